"""
Command line. ``python -m pyro_tmc`` runs a demo of a few seconds on the paper's toy model;
``python -m pyro_tmc {toy,chain,vae} [--quick] [--out DIR] [--overwrite] [--threads N]`` runs one
of the paper's experiments and writes its tables, figures and ``run.json`` to ``--out``;
``vae --resume`` continues a training run from its checkpoints.
"""

import argparse
import importlib.util
import sys
from typing import Optional

import torch


def _require_experiments_extra() -> None:
    """The command line runs the experiments: without their extra, exit with the line that installs it."""
    missing = []
    for name in ("tqdm", "matplotlib"):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    if missing:
        sys.exit(
            f"python -m pyro_tmc needs {' and '.join(missing)}, of the experiments extra: "
            'pip install "pyro-tmc[experiments]"'
        )


_require_experiments_extra()

from pyro_tmc.experiments import chain, report, toy, vae  # noqa: E402
from pyro_tmc.experiments.checkpoint import CheckpointError  # noqa: E402

EXPERIMENTS = {"toy": toy, "chain": chain, "vae": vae}
HELP = {
    "toy": "the paper's toy model (Fig. 3): TMC vs SMC vs IWAE against the exact log p(x), over K and N",
    "chain": "the paper's chain (Fig. 4): factorised vs non-factorised proposals",
    "vae": "the paper's MNIST experiment (Figs. 5, 6): a VAE with five stochastic layers trained with "
    "IWAE or TMC, three recognition models, plain/STL/DReGs gradients",
}
EPILOG = (
    "Each experiment writes to results/<name>/ under the current directory unless --out says "
    "otherwise, and refuses a folder that holds a previous run unless --overwrite is given. "
    "--quick makes a smoke run of seconds: its numbers are not results. "
    "vae saves a checkpoint every epoch, and vae --resume continues from it. "
    "Details: python -m pyro_tmc <command> --help."
)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Each option's default in --help (where it tells something); the docstring as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def demo(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    print(
        f"Toy model (Aitchison 2019): N={args.num_data}, {args.repeats} draws per bound, device={args.device}"
    )
    print("data: drawn from the model itself (data seed 0); exact log p(x) in closed form")
    rows = toy.bounds_table(args.num_data, args.ks, args.repeats, args.device)
    print(toy.format_table(rows))
    report.print_notes(
        [
            report.SE_NOTE.format(repeats=args.repeats),
            report.BOUND_NOTE,
            "ms: milliseconds per estimate, the mean over the draws after one warm-up draw (excluded).",
        ]
    )
    print("TMC averages over K^(N+1) particle combinations; IWAE over K joint samples.")


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--num-data", type=int, default=128, help="N, the number of data points (default: %(default)s)"
    )
    parser.add_argument(
        "--ks",
        type=int,
        nargs="+",
        default=[1, 4, 16, 64, 256],
        help="particle counts K (default: %(default)s)",
    )
    parser.add_argument(
        "--repeats", type=int, default=10, help="independent draws per bound (default: %(default)s)"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    report.add_threads_argument(parser)


def main(argv: Optional[list[str]] = None) -> None:
    """:param argv: the arguments; with no experiment named, the demo runs."""
    parser = argparse.ArgumentParser(
        prog="python -m pyro_tmc", epilog=EPILOG, description="Tensor Monte Carlo (Aitchison 2019)."
    )
    commands = parser.add_subparsers(dest="command")
    demo_help = "TMC and IWAE bounds on the toy model (the default; seconds)"
    _demo_arguments(commands.add_parser("demo", help=demo_help))
    for name, module in EXPERIMENTS.items():
        sub = commands.add_parser(
            name, help=HELP[name], description=module.__doc__, formatter_class=_Formatter
        )
        module.add_arguments(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["demo"] + argv  # the demo is the default command, its options included
    args = parser.parse_args(argv)
    args.argv = argv
    threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        if args.command == "demo":
            demo(args)
        else:
            EXPERIMENTS[args.command].run(args)
    # A previous run's folder; no MNIST to be had; a checkpoint of another run.
    except (FileExistsError, FileNotFoundError, CheckpointError) as error:
        parser.exit(2, f"python -m pyro_tmc {args.command}: error: {error}\n")
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
