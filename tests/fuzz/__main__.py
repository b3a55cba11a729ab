"""``python -m tests.fuzz --cases 5000 --seed 0``: run many fuzz cases and print a summary.

Prints the cases by feature, the checks by oracle, and each failure with the seed that
reproduces it (``python -m tests.fuzz --show SEED`` prints that case's model and guide).
"""

import argparse
import collections
import sys
import time
import warnings

import torch

from .generator import make_case
from .minimize import minimize
from .oracles import check_case


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200, help="how many cases (seeds seed..seed+cases-1)")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument(
        "--family",
        default=None,
        help="only this family (enum, brute, twin, general, gauss; budget and chain only when named)",
    )
    parser.add_argument("--oracle", action="append", default=None, help="only these oracles (repeatable)")
    parser.add_argument("--show", type=int, default=None, help="print the case of this seed and its checks")
    parser.add_argument(
        "--minimize", action="store_true", help="with --show: shrink each failure to a minimal case"
    )
    parser.add_argument("--max-failures-shown", type=int, default=60)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    if args.show is not None:
        case = make_case(args.show, args.family)
        print(case.describe())
        checks = check_case(case, args.oracle)
        for check in checks:
            print(("ok   " if check.ok else "FAIL ") + check.line()[:400])
        if args.minimize:
            explained = set()  # failures that an earlier minimal case already shows
            for check in [c for c in checks if not c.ok and not c.refused]:
                if (check.oracle, check.what) in explained:
                    continue
                small = minimize(case, check)
                print(f"\n# minimal case failing {check.oracle}/{check.what}:\n{small.describe()}")
                for again in check_case(small, [check.oracle]):
                    if not again.ok:
                        explained.add((again.oracle, again.what))
                        print("FAIL " + again.line()[:400])
        return 0
    features = collections.Counter()
    checks_by_oracle = collections.Counter()
    failures_by_oracle = collections.Counter()
    refused = collections.Counter()
    failures = []
    start = time.time()
    for seed in range(args.seed, args.seed + args.cases):
        case = make_case(seed, args.family)
        features.update(case.spec.features)
        for check in check_case(case, args.oracle):
            if check.refused:
                refused[check.oracle] += 1
                continue
            checks_by_oracle[check.oracle] += 1
            if not check.ok:
                failures_by_oracle[check.oracle] += 1
                failures.append((seed, case.spec.family, check))
    elapsed = time.time() - start
    print(f"{args.cases} cases (seeds {args.seed}..{args.seed + args.cases - 1}) in {elapsed:.0f} s\n")
    print(f"{'feature':40s} cases")
    for name, count in sorted(features.items()):
        print(f"{name:40s} {count}")
    print(f"\n{'oracle':14s} {'checks':>7s} {'failed':>7s} {'refused':>8s}")
    for name in sorted(checks_by_oracle):
        print(f"{name:14s} {checks_by_oracle[name]:7d} {failures_by_oracle[name]:7d} {refused[name]:8d}")
    failed_seeds = sorted({seed for seed, _, _ in failures})
    print(f"\n{len(failures)} failed checks in {len(failed_seeds)} cases")
    for seed, family, check in failures[: args.max_failures_shown]:
        print(f"  seed {seed:6d} {family:8s} {check.line()[:300]}")
    if failures:
        print("\nreproduce: python -m tests.fuzz --show SEED --family FAMILY")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
