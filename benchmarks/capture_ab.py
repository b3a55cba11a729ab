"""A case of ``first_step.py`` captured both ways in one process: traced by ``make_fx``, and recorded.

    python benchmarks/capture_ab.py --case hmm200            # compile="graph", 1 thread
    python benchmarks/capture_ab.py --case chain200 --steps 6

Each way (``CompileConfig(record_graphs=False)``, then the default, which records the capture's
graphs on real tensors: ``pyro_tmc/compile/recording.py``) starts from the same seed and the same
parameters and takes ``--steps`` steps (eager, capture, replays); the two ways' losses and
gradients are compared step by step (the largest relative difference of a gradient), and their
capture phases printed side by side. Then the two replays are timed alternately, step by step, so
that both see the same load. The cases are ``first_step.py``'s (``hmm200``, ``hmm1000``,
``chainN`` for any N).
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WAYS = ("graph-traced", "graph")


def steps_of(case: str, mode: str, count: int):
    """The loss after ``count`` steps, and each step's ``(loss, gradients)``."""
    import first_step

    import pyro

    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    loss, model, guide, args = first_step.pyro_tmc_case(case, mode)
    values = []
    for _ in range(count):
        value = loss.loss_and_grads(model, guide, *args)
        store = pyro.get_param_store()
        values.append((value, {name: p.unconstrained().grad.clone() for name, p in store.items()}))
        for param in store.values():
            param.unconstrained().grad = None
    return (loss, model, guide, args), values


def largest_difference(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-30)).item() for k in a)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--case", default="hmm200")
    parser.add_argument("--steps", type=int, default=6, help="steps compared (eager, capture, replays)")
    parser.add_argument("--timed", type=int, default=20, help="replays timed per way, alternating")
    args = parser.parse_args(argv)
    import torch

    import pyro

    sys.path.insert(0, HERE)
    torch.set_num_threads(1)
    pyro.enable_validation(False)
    runs, values = {}, {}
    for way in WAYS:
        runs[way], values[way] = steps_of(args.case, way, args.steps)
        program = runs[way][0].step_program
        phases = ", ".join(f"{name} {seconds:.2f}" for name, seconds in program.phase_seconds().items())
        print(f"{way}: {phases}", flush=True)
    for step, (traced, recorded) in enumerate(zip(*values.values())):
        difference = largest_difference(traced[1], recorded[1])
        print(f"step {step}: loss {traced[0]:.6f} / {recorded[0]:.6f}, gradients differ by {difference:.1e}")
    seconds = {way: [] for way in WAYS}
    for _ in range(args.timed):
        for way, (loss, model, guide, step_args) in runs.items():
            start = time.perf_counter()
            loss.loss_and_grads(model, guide, *step_args)
            seconds[way].append(time.perf_counter() - start)
            for param in pyro.get_param_store().values():
                param.unconstrained().grad = None
    for way, times in seconds.items():
        print(
            f"{way}: replay median {1e3 * statistics.median(times):.2f} ms, fastest {1e3 * min(times):.2f} ms"
        )
    ratio = statistics.median(r / t for t, r in zip(*seconds.values()))
    print(f"recorded / traced, step by step: median {ratio:.3f}")


if __name__ == "__main__":
    main()
