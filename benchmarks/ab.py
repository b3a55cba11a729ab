"""Two versions of pyro_tmc side by side: the checkout and an earlier commit, in one run.

    python benchmarks/ab.py --base fa2bc8e          # toy and VAE rows, CPU, 1 thread

The earlier commit is checked out into a temporary git worktree. Each round runs
every case once per version, each in a fresh process that imports that version
(the step functions are this checkout's ``benchmarks/run.py``), so both see the
same machine load; the table gives the median over rounds of each process's
median step time, and the ratio checkout / base.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CASES = {
    "toy K=8 N=128": ("toy", 8, 128),
    "toy K=32 N=1024": ("toy", 32, 1024),
    "toy K=128 N=128": ("toy", 128, 128),
    "VAE K=20 factorised": ("vae", 20, "factorised"),
    "VAE K=20 small": ("vae", 20, "small"),
}


def worker(case: str, repeats: int) -> None:
    """Time one case with the pyro_tmc first on sys.path; print the medians as JSON."""
    import torch

    sys.path.insert(0, HERE)
    import run

    torch.set_num_threads(1)
    kind, num_samples, extra = CASES[case]
    if kind == "toy":
        steps = run.toy_steps(num_samples, extra, "cpu")
        steps = {name: steps[name] for name in ("pyro_tmc TMC_ELBO", "pyro_tmc IWAE_ELBO")}
    else:
        steps = run.vae_steps(num_samples, "cpu", extra, compiled=False)
    print(json.dumps(run.median_seconds(steps, repeats, "cpu")))


def run_version(root: str, case: str, repeats: int) -> dict:
    env = dict(os.environ, PYTHONPATH=root)
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", case, "--repeats", str(repeats)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", required=False, help="the earlier commit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cases", nargs="*", default=list(CASES), help="a subset of: " + ", ".join(CASES))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.repeats)
    base_dir = tempfile.mkdtemp(prefix="pyro_tmc_base_")
    subprocess.run(
        ["git", "-C", ROOT, "worktree", "add", "--detach", base_dir, args.base],
        check=True,
        capture_output=True,
    )
    try:
        cases = [case for case in CASES if case in args.cases]
        times = {(case, version): [] for case in cases for version in ("base", "head")}
        for _ in range(args.rounds):
            for case in cases:
                for version, root in (("base", base_dir), ("head", ROOT)):
                    times[case, version].append(run_version(root, case, args.repeats))
        print(
            f"base {args.base} vs the checkout; CPU, 1 thread; median over {args.rounds} rounds of "
            f"medians of {args.repeats} steps (ms)\n"
        )
        print("| case | method | base | checkout | checkout / base |")
        print("|---|---|---:|---:|---:|")
        for case in cases:
            for method in times[case, "base"][0]:
                base = statistics.median(t[method] for t in times[case, "base"]) * 1e3
                head = statistics.median(t[method] for t in times[case, "head"]) * 1e3
                print(f"| {case} | {method} | {base:.2f} | {head:.2f} | {head / base:.3f} |")
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base_dir], check=False)


if __name__ == "__main__":
    main()
