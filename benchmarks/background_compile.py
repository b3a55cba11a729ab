"""Training progress over wall-clock time: inductor's compile blocking, or in the background.

Fig. 4's chain (``benchmarks/frontier.py``'s model and guide) trained by
``TMC_ELBO(compile="inductor")`` for a fixed wall-clock time, once with the compile
blocking the step that starts it, once with ``loss.step_program.compile_in_background =
True`` (``pyro_tmc/compile/background_compile.py``), each in a fresh process and a fresh inductor
cache directory (warmed by one small compile, so that the toolchain's one-time setup is
not counted). Prints how many steps each had taken at several times, when the first
replay was done (blocking: after the compile) and when the compiled step took over.

    python benchmarks/background_compile.py --length 1000 --seconds 100
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

CHECKPOINTS = (20, 30, 40, 50, 60, 80, 100, 120)


def run_one(length: int, seconds: float, background: bool) -> dict:
    """One training run in this process: steps done by each checkpoint, and when things happened."""
    import torch

    import pyro

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import frontier

    from pyro_tmc import TMC_ELBO

    torch.set_num_threads(1)
    pyro.set_rng_seed(0)
    x = torch.tensor(frontier.CHAIN_X)
    loss = TMC_ELBO(num_samples=32, max_plate_nesting=0, compile="inductor")
    loss.step_program.compile_in_background = background
    done, started, compiled_at, steps = {}, None, None, 0
    begin = time.perf_counter()
    while time.perf_counter() - begin < seconds:
        loss.loss_and_grads(frontier.chain_model, frontier.chain_guide, x, length)
        for param in pyro.get_param_store().values():
            param.unconstrained().grad = None
        steps += 1
        now = time.perf_counter() - begin
        if steps == 3:
            started = now  # the first replay done (blocking: after the compile)
        program = next(iter(loss.step_program._steps.values()), None)
        program = None if program is None else program.program
        if compiled_at is None and steps > 2 and getattr(program, "compiled", True) is not None:
            compiled_at = now  # blocking: the third step compiled; background: the first compiled replay
        for mark in CHECKPOINTS:
            if now >= mark and mark not in done:
                done[mark] = steps
    return {"started": started, "compiled": compiled_at, "steps": done, "total": steps}


def warmed_cache() -> str:
    """A fresh inductor cache directory in which one small compile has run (the toolchain's setup)."""
    directory = tempfile.mkdtemp(prefix="pyro_tmc-inductor-")
    code = "import torch; torch.compile(lambda x: (x * 2).exp().sum())(torch.randn(8, 8))"
    subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": directory}, check=True
    )
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=100.0)
    parser.add_argument("--one", choices=["blocking", "background"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.length, args.seconds, args.one == "background")))
        return
    rows = {}
    for mode in ("blocking", "background"):
        cache = warmed_cache()
        try:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--length",
                    str(args.length),
                    "--seconds",
                    str(args.seconds),
                    "--one",
                    mode,
                ],
                env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache},
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        rows[mode] = json.loads(out.strip().splitlines()[-1])
    marks = [m for m in CHECKPOINTS if m <= args.seconds]
    print(
        f"Fig. 4 chain, N={args.length}, K=32, compile='inductor', 1 thread; steps taken by each time (s)\n"
    )
    print(
        "| compile | first replay done (s) | compiled from (s) | "
        + " | ".join(f"{m} s" for m in marks)
        + " |"
    )
    print("|---|---:|---:|" + "---:|" * len(marks))
    for mode, row in rows.items():
        cells = " | ".join(str(row["steps"].get(str(m), row["steps"].get(m, "-"))) for m in marks)
        compiled = "-" if row["compiled"] is None else f"{row['compiled']:.1f}"
        print(f"| {mode} | {row['started']:.1f} | {compiled} | {cells} |")


if __name__ == "__main__":
    main()
