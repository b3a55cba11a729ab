"""
The paper's chain (Aitchison 2019, Fig. 4): factorised vs non-factorised proposals.

    z_0 = 0,  z_i ~ N(z_{i-1}, 1/N)  (i = 1..N),  x ~ N(z_N, 1),

so that z_N ~ N(0, 1) and log p(x) = log N(x; 0, 2) exactly, while adjacent latents
grow ever more correlated with N. The factorised proposal Q(z_i) = N(0, i/N) (the
marginals) ignores those correlations; the prior as proposal (an empty guide: every
z_i is drawn from its conditional given the particles of z_{i-1}) follows them, with
the ancestors picked by the ``proposal`` strategy of :class:`~pyro_tmc.TMC_ELBO`.
"""

import argparse
import functools
import math
from collections.abc import Sequence

import torch
from tqdm import tqdm

import pyro
import pyro.distributions as dist

from pyro_tmc import IWAE_ELBO, TMC_ELBO
from pyro_tmc.experiments import plots, report


def model(x: torch.Tensor, length: int) -> None:
    z = x.new_zeros(())
    for i in pyro.markov(range(1, length + 1)):
        z = pyro.sample(f"z_{i}", dist.Normal(z, math.sqrt(1.0 / length)))
    pyro.sample("x", dist.Normal(z, 1.0), obs=x)


def factorised_guide(x: torch.Tensor, length: int) -> None:
    """Q(z_i) = N(0, i/N): the exact marginals, without the correlations."""
    for i in pyro.markov(range(1, length + 1)):
        pyro.sample(f"z_{i}", dist.Normal(x.new_zeros(()), math.sqrt(i / length)))


def prior_guide(x: torch.Tensor, length: int) -> None:
    """Empty: every latent is drawn from the model's conditional, a non-factorised proposal."""


def exact_log_evidence(x: torch.Tensor) -> float:
    return dist.Normal(0.0, math.sqrt(2.0)).log_prob(x.double().cpu()).item()


def estimators(num_samples: int) -> dict[str, tuple]:
    """Method name -> (loss, guide). IWAE with the prior (K whole chains) is the reference."""
    return {
        "factorised (TMC)": (TMC_ELBO(num_samples=num_samples, max_plate_nesting=0), factorised_guide),
        **{
            f"prior, {proposal} (TMC)": (
                TMC_ELBO(num_samples=num_samples, max_plate_nesting=0, proposal=proposal),
                prior_guide,
            )
            for proposal in ("mixture", "permutation", "diagonal")
        },
        "prior (IWAE)": (IWAE_ELBO(num_samples=num_samples, max_plate_nesting=0), prior_guide),
    }


def _log_evidence(elbo, guide, x: torch.Tensor, length: int) -> float:
    return elbo.log_evidence(model, guide, x, length).item()


def sweep(x: torch.Tensor, length: int, ks: Sequence[int], repeats: int) -> list[dict]:
    rows = []
    for k in tqdm(ks, desc="chain: sweep over K"):
        for method, (elbo, guide) in estimators(k).items():
            draw = functools.partial(_log_evidence, elbo, guide, x, length)
            result = report.timed_draws(draw, repeats, x.device)
            rows.append(dict(method=method, K=k, **result))
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    report.add_common_arguments(parser, "chain")
    parser.add_argument("--length", type=int, default=100, help="N, the number of latents in the chain")
    parser.add_argument(
        "--ks", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128, 256], help="particle counts K"
    )
    parser.add_argument("--repeats", type=int, default=3, help="independent estimates per point")
    parser.add_argument("--x", type=float, default=1.0, help="the observation")


def run(args: argparse.Namespace) -> list[dict]:
    """Paper Fig. 4: log p(x) estimates vs K for the factorised and the non-factorised (prior) proposals."""
    files = ["chain.csv", "chain_setup.json", "chain.png"]
    out = report.prepare_output(args, files)
    if args.quick:
        args.length, args.ks, args.repeats = 10, [2, 8], 2
    smoke = report.smoke_run_note(args, f"a chain of {args.length}, {args.repeats} estimates per point")
    if smoke:
        print(smoke)
    data = (
        f"one observation x={args.x} at the end of a chain of N={args.length} latents; "
        "exact log p(x) in closed form"
    )
    report.print_data(data)
    torch.manual_seed(args.seed)
    # float64: with a factorised proposal and small K the log weights reach -1000s,
    # where float32 sums of exponentials underflow.
    x = torch.tensor(args.x, dtype=torch.float64, device=args.device)
    exact = exact_log_evidence(x)
    rows = sweep(x, args.length, args.ks, args.repeats)
    report.write_csv(rows, f"{out}/chain.csv")
    report.write_json({"length": args.length, "x": args.x, "exact": exact}, f"{out}/chain_setup.json")
    plots.chain_figure(rows, exact, f"{out}/chain.png")
    print(
        f"Chain of N={args.length} latents, x={args.x}: exact log p(x) = {exact:.3f}; "
        f"log p(x) estimates, mean ± s.e. of {args.repeats}:"
    )
    table = {}
    for row in rows:
        line = table.setdefault(row["K"], {"K": row["K"]})
        line[row["method"]] = f"{row['mean']:.3f} ± {row['se']:.3f}"
    methods = list(dict.fromkeys(row["method"] for row in rows))
    print(report.format_table(list(table.values()), ["K"] + methods))
    report.print_notes([report.SE_NOTE.format(repeats=args.repeats), report.BOUND_NOTE, smoke])
    report.finish(args, out, files, data)
    return rows
