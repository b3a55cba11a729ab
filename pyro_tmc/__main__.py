"""Command line: ``python -m pyro_tmc`` runs a one-minute demo on the paper's toy model."""

import argparse

import torch

from .experiments import toy


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pyro_tmc",
        description="Tensor Monte Carlo on the paper's toy model: exact log p(x), TMC and IWAE bounds.",
    )
    parser.add_argument("--num-data", type=int, default=128, help="N, the number of data points")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 16, 64, 256], help="particle counts K")
    parser.add_argument("--repeats", type=int, default=10, help="independent draws per bound")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    print(f"Toy model (Aitchison 2019): N={args.num_data}, {args.repeats} draws per bound, device={args.device}")
    rows = toy.bounds_table(args.num_data, args.ks, args.repeats, args.device)
    print(toy.format_table(rows))
    print("TMC averages over K^(N+1) particle combinations; IWAE over K joint samples.")


if __name__ == "__main__":
    main()
