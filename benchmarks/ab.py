"""Two versions of pyro_tmc side by side: the checkout and an earlier commit, in one run.

    python benchmarks/ab.py --base fa2bc8e          # toy and VAE rows, CPU, 1 thread
    python benchmarks/ab.py                         # the checkout alone: the regression check
    python benchmarks/ab.py --cases "VAE K=20 factorised inductor" "VAE K=20 small inductor"

The earlier commit is checked out into a temporary git worktree. Each round runs
every case once per version, each in a fresh process that imports that version
(the step functions are this checkout's ``benchmarks/run.py``), so both see the
same machine load; the table gives the median over rounds of each process's
median step time, and the ratio checkout / base.

The regression check: in the VAE cases, each ``IWAE_ELBO`` row against Pyro's
``RenyiELBO(alpha=0)`` row, timed interleaved in the same process (so the ratio
holds under load, where the times do not), at most :data:`RATIO_LIMITS`; the run
exits with status 1 where the checkout's median ratio is above it. (Issue 42: on an
Intel CPU, subnormal weights of IWAE's joint samples made that ratio 4-6x; an AMD
CPU, where subnormal arithmetic is cheap, had shown ~1.0x.) The two inductor cases
compile for a few minutes per process, so they run only when named.
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
    "VAE K=20 factorised inductor": ("vae inductor", 20, "factorised"),
    "VAE K=20 small inductor": ("vae inductor", 20, "small"),
    # the enumerated-state HMM of first_step.py, its whole step captured and replayed (no compile)
    "HMM T=200 graph": ("hmm", 4, 200),
}

#: the cases a plain run takes
DEFAULT_CASES = [case for case, (kind, _, _) in CASES.items() if kind != "vae inductor"]

#: (row, reference row) -> the most the row may take, as a multiple of the reference's
#: time in the same process; a row is each VAE row whose name starts with the first
RATIO_LIMITS = {("IWAE_ELBO", "Pyro RenyiELBO(alpha=0, vectorize_particles=True)"): 1.05}


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
    elif kind == "vae":
        steps = run.vae_steps(num_samples, "cpu", extra, compiled=False)
    elif kind == "hmm":
        steps = {"TMC_ELBO(compile='graph'), whole step": captured_hmm_step(extra)}
    else:  # the compiled IWAE rows beside Pyro's: TMC's compiled rows are timed by run.py
        steps = run.vae_steps(num_samples, "cpu", extra, compiled=True)
        steps = {name: step for name, step in steps.items() if not name.startswith("TMC_ELBO")}
    print(json.dumps(run.median_seconds(steps, repeats, "cpu")))


def captured_hmm_step(length: int):
    """``first_step.py``'s HMM, ``compile="graph"``, after its eager step, capture and first replay."""
    import first_step

    import pyro

    loss, model, guide, args = first_step.pyro_tmc_case(f"hmm{length}", "graph")

    def step() -> None:
        loss.loss_and_grads(model, guide, *args)
        for param in pyro.get_param_store().values():
            param.unconstrained().grad = None

    for _ in range(3):
        step()
    return step


def ratio_rows(times: dict, case: str, version: str) -> dict:
    """
    ``(row, reference) -> (median ratio over rounds, limit)`` for the rows of
    :data:`RATIO_LIMITS` in ``case``; each round's ratio is taken within its process.
    """
    rounds = times[case, version]
    ratios = {}
    for (prefix, reference), limit in RATIO_LIMITS.items():
        if reference not in rounds[0]:
            continue
        for method in rounds[0]:
            if method.startswith(prefix):
                ratio = statistics.median(t[method] / t[reference] for t in rounds)
                ratios[method, reference] = (ratio, limit)
    return ratios


def print_ratio_check(times: dict, cases: list, versions: list) -> bool:
    """The regression check's table; whether the checkout keeps every limit."""
    print("\n| case | method / reference | " + " | ".join(versions) + " | limit | |")
    print("|---|---|" + "---:|" * len(versions) + "---:|---|")
    kept = True
    for case in cases:
        checks = {version: ratio_rows(times, case, version) for version in versions}
        for (method, reference), (ratio, limit) in checks["checkout"].items():
            cells = " | ".join(f"{checks[v][method, reference][0]:.3f}" for v in versions)
            over = ratio > limit
            kept = kept and not over
            print(f"| {case} | {method} / {reference} | {cells} | {limit:.2f} | {'OVER' if over else 'ok'} |")
    return kept


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
    parser.add_argument("--base", required=False, help="the earlier commit; without it, the checkout alone")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cases", nargs="*", default=DEFAULT_CASES, help="a subset of: " + ", ".join(CASES))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.repeats)
    unknown = [case for case in args.cases if case not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; the cases are: {', '.join(CASES)}")
    base_dir = tempfile.mkdtemp(prefix="pyro_tmc_base_") if args.base else None
    if base_dir:
        subprocess.run(
            ["git", "-C", ROOT, "worktree", "add", "--detach", base_dir, args.base],
            check=True,
            capture_output=True,
        )
    try:
        kept = compare(args, base_dir)
    finally:
        if base_dir:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base_dir], check=False)
    sys.exit(0 if kept else 1)


def compare(args: argparse.Namespace, base_dir) -> bool:
    """Time the cases, print both tables; whether the checkout keeps every ratio limit."""
    roots = ([("base", base_dir)] if base_dir else []) + [("checkout", ROOT)]
    versions = [version for version, _ in roots]
    cases = [case for case in CASES if case in args.cases]
    times = {(case, version): [] for case in cases for version in versions}
    for _ in range(args.rounds):
        for case in cases:
            for version, root in roots:
                times[case, version].append(run_version(root, case, args.repeats))
    against = f"base {args.base} vs the checkout" if base_dir else "the checkout"
    print(
        f"{against}; CPU, 1 thread; median over {args.rounds} rounds of "
        f"medians of {args.repeats} steps (ms)\n"
    )
    if base_dir:
        print("| case | method | base | checkout | checkout / base |")
        print("|---|---|---:|---:|---:|")
    else:
        print("| case | method | checkout |")
        print("|---|---|---:|")
    for case in cases:
        for method in times[case, "checkout"][0]:
            head = statistics.median(t[method] for t in times[case, "checkout"]) * 1e3
            if not base_dir:
                print(f"| {case} | {method} | {head:.2f} |")
                continue
            base = statistics.median(t[method] for t in times[case, "base"]) * 1e3
            print(f"| {case} | {method} | {base:.2f} | {head:.2f} | {head / base:.3f} |")
    return print_ratio_check(times, cases, versions)


if __name__ == "__main__":
    main()
