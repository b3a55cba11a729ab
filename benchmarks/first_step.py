"""Seconds to the first steps of a captured loop, phase by phase, beside NumPyro's ``scan``.

    python benchmarks/first_step.py                               # every case, CPU, 1 thread
    python benchmarks/first_step.py --cases hmm200 --modes inductor
    python benchmarks/first_step.py --warm                        # inductor's caches filled first
    python benchmarks/first_step.py --modes graph-traced,graph    # make_fx's traces against recordings
    python benchmarks/first_step.py --modes inductor,inductor-background
    python benchmarks/first_step.py --modes graph,inductor --interleaved 10   # per step, beside the reference

Cases (one ``loss_and_grads`` of ``TMC_ELBO`` per step):

- ``hmm200``, ``hmm1000``: an HMM with enumerated states (4 states, 16 sequences in a plate,
  3-dim Gaussian emissions of unit scale, learnable transition matrix and emission means, an
  empty guide), ``T`` steps written as a ``pyro.markov`` loop. With the empty guide the loss
  is exactly ``-log p(y)``: 16673.627 (T=200) and 83009.370 (T=1000) at the initial values,
  by a float64 forward algorithm. The data, ``benchmarks/data/numpyro_hmm/``, are those of the
  NumPyro peer the issue that asked for this benchmark compared against (copied from the
  project's shared ``peers/numpyro_hmm/``: ``obs_T200.npy``, ``obs_T1000.npy``, float32
  ``T x 16 x 3``; ``locs.npy``, the initial means; the transitions start uniform).
- ``chain1000``: the paper's Fig. 4 chain, N=1000, K=32, as ``frontier.py`` writes it.

A mode ending in ``-traced`` is that mode with ``CompileConfig(record_graphs=False)``: every graph
of the capture traced by ``make_fx`` with fake tensors, as before the capture recorded them on
real tensors (:mod:`pyro_tmc.compile.recording`); the table ends with each case's ratios,
traced over recorded, of the first steps and of each phase. ``inductor-background`` is
``inductor`` with ``CompileConfig(compile_in_background=True)``: its first steps replay the
uncompiled graph while a child process compiles; its row adds when the compile was done (from
the first step) and the seconds of the step that switched to the compiled code, and its per-step
column is the compiled step's. ``inductor-novec`` compiles with ``cpp.simdlen=1`` (no vector ISA of that
width, so no CPU vectorization, for that compile only; docs/performance.md). ``inductor-noisa`` runs its
child with ``TORCHINDUCTOR_VEC_ISA_OK=0`` in its environment: vectorization off for the whole process,
the setting a user makes before torch compiles anything (inductor caches the CPU's vector ISAs once a
process, so no single compile can set it).

Each case and mode runs in a child process of its own, with cold inductor caches (a fresh
``TORCHINDUCTOR_CACHE_DIR``; ``--warm`` runs it once before, into the same directory): the
first-steps column is the wall time of its first 8 steps (an eager step, the capture, the
first replay, where inductor compiles, and five replays), and the phases are
:meth:`pyro_tmc.compile.captured_step.StepProgram.phase_seconds`. The per-step column is
the median of 20 later steps.

The NumPyro rows (when ``numpyro``, ``jax`` and ``funsor`` are importable: the ``peers``
extra; skipped with a note otherwise) time the same HMM written with
``numpyro.contrib.control_flow.scan`` over the steps after the first, its loss
``-log p(y)`` from ``numpyro.contrib.funsor.log_density`` with the states enumerated,
and one Adam update, jit-compiled by XLA on one thread. NumPyro's ``TraceEnum_ELBO`` is
not used: with ``scan`` and enumerated states it gives a wrong loss (29836.1 at T=200).
Each NumPyro row's loss is checked against the exact value.

``--interleaved ROUNDS`` times the steps alone, robust to a loaded machine: each mode and the
case's reference (NumPyro's ``scan`` for the HMM, where installed; for the chain, ``frontier.py``'s
hand-written log-depth tree in float32, eager, the issue's reference) in a persistent child
process, past its first 16 steps, the children taking turns at ``--steps`` steps each, ROUNDS
times; a row gives the mode's median step and the median (and range) over rounds of its time
over the reference's in the same round. With ``--base REV`` the reference of each mode is the same
mode at the git revision ``REV`` (its ``pyro_tmc`` extracted by ``git archive`` and put first on the
child's path): before and after a change, in one run, with no NumPyro needed.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "numpyro_hmm")
NUM_STATES = 4
#: -log p(y) at the initial values, by a float64 forward algorithm
EXACT = {200: 16673.627, 1000: 83009.370}
CASES = ("hmm200", "hmm1000", "chain1000")
MODES = ("graph", "inductor", "numpyro")
#: a pyro_tmc mode with this suffix traces every graph with make_fx (``record_graphs=False``)
TRACED = "-traced"
#: ``inductor`` with this suffix compiles in a child process (``compile_in_background=True``)
BACKGROUND = "-background"
#: ``inductor`` with this suffix compiles without CPU vectorization (``cpp.simdlen=1``: no vector ISA)
NOVEC = "-novec"
#: ``inductor`` with this suffix runs its child with vectorization off for the process (its environment)
NOISA = "-noisa"


def mode_environment(env: dict, mode: str) -> dict:
    """A mode's child environment: ``env``, with inductor's vector ISAs off for :data:`NOISA` modes."""
    return dict(env, TORCHINDUCTOR_VEC_ISA_OK="0") if mode.partition(AT)[0].endswith(NOISA) else env


FIRST_CALLS = 8
TIMED_STEPS = 20


# -- pyro_tmc ---------------------------------------------------------------------------


def hmm_data(length: int):
    import numpy as np
    import torch

    observations = torch.from_numpy(np.load(os.path.join(DATA, f"obs_T{length}.npy")))
    locs = torch.from_numpy(np.load(os.path.join(DATA, "locs.npy")))
    return observations, locs


def make_hmm(initial_locs):
    """The HMM's model and (empty) guide; ``observations`` is ``(T, sequences, 3)``."""
    import torch

    import pyro
    import pyro.distributions as dist
    from pyro.infer import config_enumerate

    @config_enumerate
    def model(observations):
        transition = pyro.param(
            "transition",
            lambda: torch.full((NUM_STATES, NUM_STATES), 1.0 / NUM_STATES),
            constraint=dist.constraints.simplex,
        )
        locs = pyro.param("locs", initial_locs.clone)
        uniform = torch.full((NUM_STATES,), 1.0 / NUM_STATES)
        with pyro.plate("sequences", observations.shape[1], dim=-1):
            state = None
            for t in pyro.markov(range(observations.shape[0])):
                probs = uniform if state is None else transition[state]
                state = pyro.sample(f"state_{t}", dist.Categorical(probs))
                pyro.sample(f"y_{t}", dist.Normal(locs[state], 1.0).to_event(1), obs=observations[t])

    def guide(observations):
        pass

    return model, guide


def pyro_tmc_case(case: str, mode: str):
    """``(loss, model, guide, args)`` of a case under ``TMC_ELBO(compile=mode)`` (``-traced``: see above)."""
    from pyro_tmc import TMC_ELBO
    from pyro_tmc.compile import CompileConfig

    # only where asked: benchmarks/ab.py runs this with earlier versions, whose config has no such field
    options = CompileConfig(record_graphs=False) if mode.endswith(TRACED) else None
    if mode.endswith(BACKGROUND):
        options = CompileConfig(compile_in_background=True)
    if mode.endswith(NOVEC):
        options = CompileConfig(torch_compile={"options": {"cpp.simdlen": 1}})
    mode = mode.removesuffix(NOISA).removesuffix(TRACED).removesuffix(BACKGROUND).removesuffix(NOVEC)
    if case.startswith("hmm"):
        observations, locs = hmm_data(int(case[3:]))
        model, guide = make_hmm(locs)
        loss = TMC_ELBO(num_samples=4, max_plate_nesting=1, compile=mode, compile_options=options)
        return loss, model, guide, (observations,)
    import torch

    sys.path.insert(0, HERE)
    import frontier

    N = int(case[len("chain") :])
    loss = TMC_ELBO(num_samples=32, max_plate_nesting=0, compile=mode, compile_options=options)
    return loss, frontier.chain_model, frontier.chain_guide, (torch.tensor(frontier.CHAIN_X), N)


def pyro_tmc_step(case: str, mode: str):
    """``(step, loss)``: one ``loss_and_grads`` of the case (its gradients dropped), 1 thread, seeded."""
    import torch

    import pyro

    torch.set_num_threads(1)
    pyro.enable_validation(False)
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    loss, model, guide, args = pyro_tmc_case(case, mode)

    def step() -> float:
        value = loss.loss_and_grads(model, guide, *args)
        for param in pyro.get_param_store().values():
            param.unconstrained().grad = None
        return value

    return step, loss


def run_pyro_tmc(case: str, mode: str) -> dict:
    step, loss = pyro_tmc_step(case, mode)
    calls, values = [], []
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        for _ in range(FIRST_CALLS):
            start = time.perf_counter()
            values.append(step())
            calls.append(time.perf_counter() - start)
    messages = [str(w.message)[:200] for w in caught if str(w.message).startswith("pyro_tmc")]
    program = loss.step_program
    background = {}
    if mode.endswith(BACKGROUND):  # when the child's compile was done, and the step that switched to it
        program.wait_for_compiles()
        background["compiled_after_s"] = time.perf_counter() - started
        start = time.perf_counter()
        step()
        background["switch_s"] = time.perf_counter() - start
    seconds = []
    for _ in range(TIMED_STEPS):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return {
        **background,
        "first_steps_s": sum(calls),
        "calls_s": calls,
        "phases_s": program.phase_seconds(),
        "ms_per_step": 1e3 * statistics.median(seconds),
        "loss": values[0],
        "captures": program.captures,
        "replays": program.replays,
        "warnings": messages,
    }


# -- NumPyro --------------------------------------------------------------------------------


def numpyro_available() -> bool:
    try:
        import funsor  # noqa: F401
        import jax  # noqa: F401
        import numpyro  # noqa: F401
    except ImportError:
        return False
    return True


def numpyro_step(case: str):
    """
    The HMM in NumPyro: ``scan`` over steps 1..T-1, ``-log p(y)`` by funsor, one Adam update,
    as a step (jit-compiled at its first call) that returns the loss.
    """
    os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    import jax
    import jax.numpy as jnp
    import numpy as np
    import numpyro
    import numpyro.distributions as ndist
    from numpyro.contrib.control_flow import scan
    from numpyro.contrib.funsor import config_enumerate, enum, log_density
    from numpyro.distributions.transforms import biject_to

    length = int(case[3:])
    observations = jnp.asarray(np.load(os.path.join(DATA, f"obs_T{length}.npy")))
    initial_locs = jnp.asarray(np.load(os.path.join(DATA, "locs.npy")))
    to_simplex = biject_to(ndist.constraints.simplex)
    num_sequences = observations.shape[1]

    def emit(locs, state, y):
        numpyro.sample("y", ndist.Normal(locs[state], 1.0).to_event(1), obs=y)

    def model(transition, locs, observations):
        with numpyro.plate("sequences", num_sequences, dim=-1):
            first = numpyro.sample(
                "state_0",
                ndist.Categorical(jnp.full(NUM_STATES, 1.0 / NUM_STATES)),
                infer={"enumerate": "parallel"},
            )
            numpyro.sample("y_0", ndist.Normal(locs[first], 1.0).to_event(1), obs=observations[0])

        def transition_step(state, y):
            with numpyro.plate("sequences", num_sequences, dim=-1):
                state = numpyro.sample(
                    "state", ndist.Categorical(transition[state]), infer={"enumerate": "parallel"}
                )
                emit(locs, state, y)
            return state, None

        scan(transition_step, first, observations[1:])

    enumerated = enum(config_enumerate(model), first_available_dim=-2)

    def negative_log_likelihood(unconstrained):
        transition = to_simplex(unconstrained["transition"])
        log_joint, _ = log_density(enumerated, (transition, unconstrained["locs"], observations), {}, {})
        return -log_joint

    optimizer = numpyro.optim.Adam(1e-3)

    def update(state):
        value, grads = jax.value_and_grad(negative_log_likelihood)(optimizer.get_params(state))
        return optimizer.update(grads, state), value

    update = jax.jit(update)
    state = None

    def step() -> float:
        nonlocal state
        if state is None:  # the first call: the initial values, then the jit's trace and XLA's compile
            unconstrained = {
                "transition": to_simplex.inv(jnp.full((NUM_STATES, NUM_STATES), 1.0 / NUM_STATES)),
                "locs": initial_locs,
            }
            state = optimizer.init(unconstrained)
        state, value = update(state)
        return float(value.block_until_ready())

    return step


def run_numpyro(case: str) -> dict:
    step = numpyro_step(case)
    start = time.perf_counter()
    value = step()
    first = time.perf_counter() - start
    for _ in range(3):
        step()
    seconds = []
    for _ in range(TIMED_STEPS):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return {
        "first_steps_s": first,
        "ms_per_step": 1e3 * statistics.median(seconds),
        "loss": value,
        "phases_s": {},
    }


# -- the chain's float32 log-depth tree, hand-written ------------------------------------------


def tree_step(case: str):
    """
    The chain case as ``frontier.py``'s hand-written log-depth tree in float32 (eager, forward and
    backward; it loses the entries that underflow, which pyro_tmc repairs): the issue's reference.
    """
    import torch

    sys.path.insert(0, HERE)
    import frontier

    torch.set_num_threads(1)
    torch.manual_seed(0)
    N, K = int(case[len("chain") :]), 32
    x = torch.tensor(frontier.CHAIN_X)
    loc, log_scale = (t.clone().requires_grad_() for t in frontier.chain_init(N, x))

    def step() -> float:
        value = frontier.tree_contract(*frontier.chain_log_factors(x, loc, log_scale, K))
        value.backward()
        loc.grad = log_scale.grad = None
        return value.item()

    return step


def reference_mode(case: str) -> str:
    """The reference a case's interleaved times are divided by: NumPyro's scan, or the chain's tree."""
    return "numpyro" if case.startswith("hmm") else "tree"


# -- the table ------------------------------------------------------------------------------


def child(case: str, mode: str) -> dict:
    return run_numpyro(case) if mode == "numpyro" else run_pyro_tmc(case, mode)


def serve(case: str, mode: str) -> None:
    """
    A child of :func:`interleaved`: its first steps (capture and compile), a few more (a graph's
    timed eager steps), ``ready``; then, for each line ``n`` on stdin, ``n`` steps timed, as JSON.
    """
    if mode == "numpyro":
        step = numpyro_step(case)
    elif mode == "tree":
        step = tree_step(case)
    else:
        step = pyro_tmc_step(case, mode)[0]
    for _ in range(2 * FIRST_CALLS):
        step()
    print("ready", flush=True)
    for line in sys.stdin:
        seconds = []
        for _ in range(int(line)):
            start = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - start)
        print(json.dumps(seconds), flush=True)


def interleaved(case: str, modes: list[str], rounds: int, steps: int) -> dict[str, list[list[float]]]:
    """
    Per-step seconds of each mode, ``rounds`` rounds of ``steps`` steps, the modes in turn within
    each round: one persistent child per mode (:func:`serve`, cold inductor caches), started
    together and timed one at a time, so that every mode sees the same machine load.
    """
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="first_step_inductor_"))
    command = [sys.executable, os.path.abspath(__file__), "--serve", case]
    children = {}
    for mode in modes:
        name, _, revision = mode.partition(AT)
        child_env = dict(env, PYTHONPATH=revision_tree(revision)) if revision else env
        child_env = mode_environment(child_env, mode)
        children[mode] = subprocess.Popen(
            command + [name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env
        )
    try:
        for mode, process in children.items():
            if process.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{case}, {mode}: the child failed before its first steps were done")
        times: dict[str, list[list[float]]] = {mode: [] for mode in modes}
        for _ in range(rounds):
            for mode, process in children.items():
                process.stdin.write(f"{steps}\n")
                process.stdin.flush()
                times[mode].append(json.loads(process.stdout.readline()))
        return times
    finally:
        for process in children.values():
            process.kill()
            process.wait()


#: a mode at a git revision (``--base``): ``inductor@66616f1``
AT = "@"


def revision_tree(revision: str) -> str:
    """A folder holding ``pyro_tmc`` as it was at ``revision`` (``git archive``), for a child's path."""
    folder = tempfile.mkdtemp(prefix="first_step_base_")
    archive = subprocess.run(
        ["git", "-C", os.path.dirname(HERE), "archive", revision, "pyro_tmc"], check=True, capture_output=True
    )
    subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)
    return folder


def interleaved_rows(
    case: str, modes: list[str], rounds: int, steps: int, base: Optional[str] = None
) -> list[str]:
    """
    The rows of :func:`interleaved`: each mode's median step, and the median over rounds of its ratio
    to the case's reference, or with ``base`` to the same mode at that revision.
    """
    modes = [mode for mode in modes if mode not in ("numpyro", "tree")]
    if base:
        references = {mode: f"{mode}{AT}{base}" for mode in modes}
        modes = [run for mode in modes for run in (mode, references[mode])]
        references.update({reference: reference for reference in references.values()})
    else:
        modes.append(reference_mode(case))
        references = dict.fromkeys(modes, reference_mode(case))
    times = interleaved(case, modes, rounds, steps)
    medians = {mode: [statistics.median(burst) for burst in bursts] for mode, bursts in times.items()}
    rows = []
    for mode in modes:
        ratios = [a / b for a, b in zip(medians[mode], medians[references[mode]])]
        ms = 1e3 * statistics.median(medians[mode])
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        name = "hand-written float32 log-depth tree (eager)" if mode == "tree" else label(mode)
        rows.append(f"| {case} | {name} | {ms:.2f} | {statistics.median(ratios):.2f} ({spread}) |")
    return rows


def ratios(case: str, results: dict) -> list[str]:
    """Per pyro_tmc mode run both ways: traced over recorded, the first steps and each phase."""
    lines = []
    for mode, traced in results.items():
        recorded = results.get(mode.removesuffix(TRACED)) if mode.endswith(TRACED) else None
        if recorded is None or "error" in traced or "error" in recorded:
            continue
        phases = ", ".join(
            f"{name} {seconds / recorded['phases_s'][name]:.1f}x"
            for name, seconds in traced["phases_s"].items()
            if recorded["phases_s"].get(name)
        )
        first = traced["first_steps_s"] / recorded["first_steps_s"]
        lines.append(
            f"{case}, {mode.removesuffix(TRACED)}: traced / recorded, first steps {first:.1f}x; {phases}"
        )
    return lines


def run_child(case: str, mode: str, warm: bool, timeout: float) -> dict:
    """One case and mode in a fresh process, with its own (cold, or with ``warm`` filled) caches."""
    cache = tempfile.mkdtemp(prefix="first_step_inductor_")
    env = mode_environment(dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache), mode)
    command = [sys.executable, os.path.abspath(__file__), "--child", case, mode]
    try:
        for _ in range(2 if warm and mode.startswith("inductor") else 1):
            done = subprocess.run(
                command, check=False, env=env, capture_output=True, text=True, timeout=timeout
            )
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    return json.loads(lines[-1])


def label(mode: str) -> str:
    """A row's method."""
    return (
        "NumPyro scan + funsor log_density (jit, Adam)" if mode == "numpyro" else f"pyro_tmc compile={mode!r}"
    )


def row(case: str, mode: str, result: dict) -> str:
    method = label(mode)
    if "error" in result:
        return f"| {case} | {method} | failed: {result['error']} | | | |"
    phases = ", ".join(f"{name} {seconds:.2f}" for name, seconds in result["phases_s"].items())
    exact = EXACT.get(int(case[3:])) if case.startswith("hmm") else None
    loss = f"{result['loss']:.3f}" + (
        "" if exact is None else (" (exact)" if abs(result["loss"] - exact) <= 1e-4 * exact else " (WRONG)")
    )
    if "compiled_after_s" in result:  # compiled in the background
        phases += f"; compiled after {result['compiled_after_s']:.1f}, switched in {result['switch_s']:.2f}"
    first = result["first_steps_s"]
    return f"| {case} | {method} | {result['ms_per_step']:.2f} | {first:.1f} | {phases} | {loss} |"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {CASES}")
    suffixes = f"{TRACED!r}, or inductor{BACKGROUND}, {NOVEC}, {NOISA}"
    modes_help = f"comma-separated, of {MODES} (or a pyro_tmc one + {suffixes})"
    parser.add_argument("--modes", default=",".join(MODES), help=modes_help)
    parser.add_argument("--warm", action="store_true", help="fill inductor's caches with one run first")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per case and mode")
    parser.add_argument(
        "--interleaved",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="instead of the first steps: per-step times of the modes and the case's reference "
        "(NumPyro's scan, the chain's float32 tree), timed in turn in persistent children, ROUNDS rounds",
    )
    parser.add_argument("--steps", type=int, default=10, help="steps per mode and round (--interleaved)")
    parser.add_argument(
        "--base", metavar="REV", help="--interleaved: each mode beside itself at this git revision"
    )
    parser.add_argument("--child", nargs=2, metavar=("CASE", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--serve", nargs=2, metavar=("CASE", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)), flush=True)
        return
    if args.serve:
        serve(*args.serve)
        return
    if args.interleaved:
        print("| case | method | ms per step | x reference (range over rounds) |\n|---|---|---:|---:|")
        for case in args.cases.split(","):
            rows = interleaved_rows(case, args.modes.split(","), args.interleaved, args.steps, args.base)
            print("\n".join(rows), flush=True)
        return
    notes = []
    modes = args.modes.split(",")
    if "numpyro" in modes and not numpyro_available():
        modes.remove("numpyro")
        notes.append(
            "NumPyro rows skipped: numpyro, jax or funsor is not importable (pip install -e .[peers])"
        )
    print(
        "| case | method | ms per step | first steps, s | phases of the first steps, s | "
        "loss at the first step |\n"
        "|---|---|---:|---:|---|---:|",
        flush=True,
    )
    for case in args.cases.split(","):
        results = {}
        for mode in modes:
            if mode == "numpyro" and not case.startswith("hmm"):
                continue
            result = results[mode] = run_child(case, mode, args.warm, args.timeout)
            print(row(case, mode, result), flush=True)
            notes += [f"{case}, {mode}: {message}" for message in result.get("warnings", [])]
        notes += ratios(case, results)
    print(
        "\n".join(f"- {note}" for note in ["inductor caches: " + ("warm" if args.warm else "cold")] + notes)
    )


if __name__ == "__main__":
    main()
