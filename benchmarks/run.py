"""Side-by-side timings: pyro_tmc.TMC_ELBO, Pyro's TraceTMC_ELBO, pyro_tmc.IWAE_ELBO and a
hand-written torch TMC, forward + backward, in one run on one machine.

    python benchmarks/run.py                # CPU, the full grid (a few minutes on 2 cores)
    python benchmarks/run.py --quick        # a smoke run
    python benchmarks/run.py --device cuda

Each step is timed ``--repeats`` times after a warm-up; the table gives medians and the
ratios against the hand-written TMC. Methods are interleaved within a case so that a
busy machine slows them alike. Peak memory is the growth of the process's resident set
during one step, measured in a forked child on CPU, and torch's peak allocation on CUDA.
"""

import argparse
import os
import resource
import statistics
import sys
import time
from typing import Callable, Optional

import torch

import pyro
from pyro.infer import RenyiELBO, TraceTMC_ELBO, config_enumerate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

from pyro_tmc import IWAE_ELBO, TMC_ELBO  # noqa: E402

#: cases whose largest factor (K * K * N) exceeds this are skipped for the materialising methods
MAX_FACTOR_ELEMENTS = 2**25


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _pyro_step(loss, model, guide, *args) -> Callable[[], None]:
    def step():
        pyro.get_param_store().clear()
        loss.differentiable_loss(model, guide, *args).backward()

    return step


def toy_steps(num_samples: int, num_data: int, device: str) -> dict[str, Callable[[], None]]:
    x = torch.randn(num_data, device=device)
    loc = torch.zeros(2, device=device, requires_grad=True)
    log_scale = torch.tensor([0.0, 0.35], device=device, requires_grad=True)

    def handwritten():
        models.handwritten_tmc_loss(x, loc, log_scale, num_samples).backward()

    pyro_guide = config_enumerate(
        models.toy_guide, "parallel", num_samples=num_samples, expand=False, tmc="diagonal"
    )
    pyro_model = config_enumerate(
        models.toy_model, "parallel", num_samples=num_samples, expand=False, tmc="diagonal"
    )
    return {
        "hand-written TMC": handwritten,
        "pyro_tmc TMC_ELBO": _pyro_step(
            TMC_ELBO(num_samples=num_samples, max_plate_nesting=1), models.toy_model, models.toy_guide, x
        ),
        "Pyro TraceTMC_ELBO": _pyro_step(TraceTMC_ELBO(max_plate_nesting=1), pyro_model, pyro_guide, x),
        "pyro_tmc IWAE_ELBO": _pyro_step(
            IWAE_ELBO(num_samples=num_samples, max_plate_nesting=1), models.toy_model, models.toy_guide, x
        ),
    }


def chain_steps(num_samples: int, device: str) -> dict[str, Callable[[], None]]:
    x = torch.randn(16, device=device)
    steps = {}
    for strategy in ("mixture", "diagonal"):
        steps[f"pyro_tmc TMC_ELBO ({strategy})"] = _pyro_step(
            TMC_ELBO(num_samples=num_samples, max_plate_nesting=1, proposal=strategy),
            models.chain_model,
            models.chain_guide,
            x,
        )
        guide = config_enumerate(
            models.chain_guide, "parallel", num_samples=num_samples, expand=False, tmc=strategy
        )
        model = config_enumerate(
            models.chain_model, "parallel", num_samples=num_samples, expand=False, tmc=strategy
        )
        steps[f"Pyro TraceTMC_ELBO ({strategy})"] = _pyro_step(
            TraceTMC_ELBO(max_plate_nesting=1), model, guide, x
        )
    return steps


def vae_steps(
    num_samples: int, device: str, recognition: str = "factorised", compiled: bool = True
) -> dict[str, Callable[[], None]]:
    """One step of the paper's 5-layer MNIST VAE on a batch of 100 (random binary pixels: timing only)."""
    from pyro_tmc.experiments import vae

    # pyro.module keeps the store's tensors under a name it has seen: a fresh store per configuration
    pyro.clear_param_store()
    x = torch.bernoulli(torch.full((100, 784), 0.3, device=device))
    generative = vae.Generative(784).to(device)
    guide = vae.recognition_model(recognition, 784).to(device)

    def step_with(loss):
        def step():
            loss.differentiable_loss(generative.model, guide.guide, x).backward()

        return step

    renyi = RenyiELBO(alpha=0, num_particles=num_samples, vectorize_particles=True, max_plate_nesting=1)

    def pyro_iwae_step():
        renyi.loss_and_grads(generative.model, guide.guide, x)

    steps = {
        PYRO_IWAE: pyro_iwae_step,
        "TMC_ELBO": step_with(TMC_ELBO(num_samples=num_samples, max_plate_nesting=1)),
        "IWAE_ELBO": step_with(IWAE_ELBO(num_samples=num_samples, max_plate_nesting=1)),
    }
    if compiled:
        for name, make in (("TMC_ELBO", TMC_ELBO), ("IWAE_ELBO", IWAE_ELBO)):
            step = step_with(make(num_samples=num_samples, max_plate_nesting=1, compile="inductor"))
            step()  # traces and compiles (seconds): not timed
            steps[f"{name} compile='inductor'"] = step
        for name, make in (("TMC_ELBO", TMC_ELBO), ("IWAE_ELBO", IWAE_ELBO)):
            # the whole step captured (pyro_tmc.compile.captured_step): eager, then captured, then replayed
            loss = make(num_samples=num_samples, max_plate_nesting=1, compile="inductor")

            def whole_step(loss=loss):
                loss.loss_and_grads(generative.model, guide.guide, x)

            whole_step()
            whole_step()  # captures and compiles (seconds): not timed
            steps[f"{name} compile='inductor', whole step"] = whole_step
    return steps


#: Pyro's own IWAE, the reference of the VAE rows (issue 12)
PYRO_IWAE = "Pyro RenyiELBO(alpha=0, vectorize_particles=True)"


def median_seconds(steps: dict[str, Callable[[], None]], repeats: int, device: str) -> dict[str, float]:
    """Interleaved timing: each round runs every method once."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()  # warm-up: path caches, plate-nesting guesses
    for _ in range(repeats):
        for name, step in steps.items():
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def peak_memory_mb(step: Callable[[], None], device: str) -> Optional[float]:
    """Peak memory of one step, in MB (see the module docstring)."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: measure, report, exit without running parent's cleanup
        os.close(read)
        with open("/proc/self/statm") as f:
            base_kb = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024
        step()
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        os.write(write, f"{(peak_kb - base_kb) / 1024:.1f}".encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return float(text) if text else None


def run_case(title: str, steps, repeats: int, device: str, reference: str, memory: bool) -> list[str]:
    seconds = median_seconds(steps, repeats, device)
    floor = peak_memory_mb(lambda: None, device) if memory else 0.0  # the measurement's own noise
    lines = [
        f"\n### {title}\n",
        "| method | median ms | x " + reference + " | peak MB |",
        "|---|---:|---:|---:|",
    ]
    for name, value in seconds.items():
        ratio = value / seconds[reference] if reference in seconds else float("nan")
        mem = peak_memory_mb(steps[name], device) if memory else None
        mem_text = f"{max(mem - floor, 0.0):.0f}" if mem is not None else "-"
        lines.append(f"| {name} | {1e3 * value:.2f} | {ratio:.2f} | {mem_text} |")
    print("\n".join(lines), flush=True)
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a smoke run: small grid, 2 repeats")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: the issue's setting)")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-compile", action="store_true", help="leave out the compile='inductor' rows")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pyro.enable_validation(False)  # as in production training loops; validation costs time per step
    torch.manual_seed(0)
    repeats = 2 if args.quick else args.repeats
    ks = (8, 32) if args.quick else (8, 32, 128, 512)
    ns = (128,) if args.quick else (128, 1024, 8192)
    print(f"device={args.device} threads={args.threads} torch={torch.__version__} pyro={pyro.__version__}")
    for k in ks:
        for n in ns:
            if k * k * n > MAX_FACTOR_ELEMENTS:
                size = f"K*K*N = {k * k * n:,} > {MAX_FACTOR_ELEMENTS:,} elements"
                print(f"\n### toy K={k} N={n}: skipped ({size})")
                continue
            run_case(
                f"toy K={k} N={n} (forward + backward)",
                toy_steps(k, n, args.device),
                repeats,
                args.device,
                "hand-written TMC",
                memory=not args.no_memory,
            )
    k = 32 if args.quick else 128
    run_case(
        f"non-factorised 5-layer Gaussian chain, K={k} (forward + backward)",
        chain_steps(k, args.device),
        repeats,
        args.device,
        "pyro_tmc TMC_ELBO (mixture)",
        memory=not args.no_memory,
    )
    for recognition in ("factorised", "small"):
        run_case(
            f"5-layer MNIST VAE ({recognition} recognition), batch 100, K=20: one SVI step",
            vae_steps(20, args.device, recognition, compiled=not args.no_compile),
            repeats,
            args.device,
            PYRO_IWAE,
            memory=not args.no_memory,
        )


if __name__ == "__main__":
    main()
