"""
Command line. ``python -m pyro_tmc`` runs a one-minute demo on the paper's toy model;
``python -m pyro_tmc {toy,chain,vae} [--quick] [--out DIR]`` runs one of the paper's experiments.
"""

import argparse
import sys
from typing import List, Optional

import torch

from .experiments import chain, toy, vae

EXPERIMENTS = {"toy": toy, "chain": chain, "vae": vae}


def demo(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    print(f"Toy model (Aitchison 2019): N={args.num_data}, {args.repeats} draws per bound, device={args.device}")
    rows = toy.bounds_table(args.num_data, args.ks, args.repeats, args.device)
    print(toy.format_table(rows))
    print("TMC averages over K^(N+1) particle combinations; IWAE over K joint samples.")


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-data", type=int, default=128, help="N, the number of data points")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 16, 64, 256], help="particle counts K")
    parser.add_argument("--repeats", type=int, default=10, help="independent draws per bound")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--seed", type=int, default=0)


def main(argv: Optional[List[str]] = None) -> None:
    """:param argv: the arguments; with no experiment named, the demo runs."""
    parser = argparse.ArgumentParser(prog="python -m pyro_tmc", description="Tensor Monte Carlo (Aitchison 2019).")
    commands = parser.add_subparsers(dest="command")
    _demo_arguments(commands.add_parser("demo", help="TMC and IWAE bounds on the toy model (the default, ~1 min)"))
    for name, module in EXPERIMENTS.items():
        module.add_arguments(commands.add_parser(name, help=module.__doc__.strip().splitlines()[0]))
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["demo"] + argv  # the demo is the default command, its options included
    args = parser.parse_args(argv)
    if args.command == "demo":
        demo(args)
    else:
        EXPERIMENTS[args.command].run(args)


if __name__ == "__main__":
    main()
