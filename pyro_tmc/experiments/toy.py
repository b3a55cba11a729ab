"""The paper's toy model (Aitchison 2019, Fig. 3): TMC vs SMC vs IWAE.

    theta ~ N(0, 1),  z_i ~ N(theta, 1),  x_i ~ N(z_i, 1),  i = 1..N,

with proposals Q(theta) = N(0, 1) and Q(z_i) = N(0, 2), the generative marginals.
Everything is jointly Gaussian, so log p(x) is exact: x ~ N(0, 2 I + 1 1^T).
"""

import argparse
import math
from collections.abc import Sequence

import torch

import pyro
import pyro.distributions as dist

from pyro_tmc.experiments.report import timed_draws
from pyro_tmc.experiments.smc import smc_log_evidence


def model(x: torch.Tensor) -> None:
    theta = pyro.sample("theta", dist.Normal(x.new_zeros(()), 1.0))
    with pyro.plate("data", x.shape[-1], dim=-1):
        z = pyro.sample("z", dist.Normal(theta, 1.0))
        pyro.sample("x", dist.Normal(z, 1.0), obs=x)


def guide(x: torch.Tensor) -> None:
    pyro.sample("theta", dist.Normal(x.new_zeros(()), 1.0))
    with pyro.plate("data", x.shape[-1], dim=-1):
        pyro.sample("z", dist.Normal(x.new_zeros(()), math.sqrt(2.0)))


def sample_data(num_data: int, seed: int = 0, device="cpu") -> torch.Tensor:
    """Data drawn from the model itself."""
    generator = torch.Generator().manual_seed(seed)
    theta = torch.randn((), generator=generator)
    z = theta + torch.randn(num_data, generator=generator)
    return (z + torch.randn(num_data, generator=generator)).to(device)


def exact_log_evidence(x: torch.Tensor) -> float:
    """log N(x; 0, 2 I + 1 1^T), by the matrix determinant lemma and Sherman-Morrison."""
    x = x.double().cpu()
    n = x.shape[-1]
    # Sigma = 2 (I + u u^T / 2) with u = 1: log det = n log 2 + log(1 + n/2);
    # Sigma^{-1} = (I - 1 1^T / (2 + n)) / 2.
    log_det = n * math.log(2.0) + math.log1p(n / 2.0)
    quad = (x.pow(2).sum() - x.sum().pow(2) / (2.0 + n)) / 2.0
    return float(-0.5 * (n * math.log(2 * math.pi) + log_det + quad))


def time_bound(elbo, x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Mean and standard error of ``elbo.log_evidence`` over ``repeats`` draws, and seconds per draw."""
    return timed_draws(lambda: elbo.log_evidence(model, guide, x).item(), repeats, x.device)


def iwae_log_evidence(x: torch.Tensor, num_samples: int, chunk_size: int = 10000) -> float:
    """
    The IWAE bound with ``num_samples`` joint samples, drawn ``chunk_size`` at a
    time so that memory stays bounded: each chunk's log-mean-exp is combined as
    ``log sum_c (n_c / K) exp(bound_c)``.
    """
    from pyro_tmc import IWAE_ELBO

    sizes = [chunk_size] * (num_samples // chunk_size)
    sizes += [num_samples % chunk_size] if num_samples % chunk_size else []
    bounds = torch.stack(
        [IWAE_ELBO(num_samples=n, max_plate_nesting=1).log_evidence(model, guide, x) for n in sizes]
    )
    weights = torch.tensor(sizes, dtype=bounds.dtype, device=bounds.device) / num_samples
    return torch.logsumexp(bounds + weights.log(), 0).item()


def estimate(method: str, x: torch.Tensor, num_samples: int, repeats: int) -> dict[str, float]:
    """Mean, standard error and seconds per estimate of ``method`` (``"TMC"``, ``"SMC"`` or ``"IWAE"``)."""
    from pyro_tmc import TMC_ELBO

    tmc = TMC_ELBO(num_samples=num_samples, max_plate_nesting=1)
    draws = {
        "TMC": lambda: tmc.log_evidence(model, guide, x).item(),
        "SMC": lambda: smc_log_evidence(x, num_samples).item(),
        "IWAE": lambda: iwae_log_evidence(x, num_samples),
    }
    return timed_draws(draws[method], repeats, x.device)


def bounds_table(
    num_data: int = 128,
    ks: Sequence[int] = (1, 4, 16, 64, 256),
    repeats: int = 10,
    device: str = "cpu",
) -> list[dict[str, float]]:
    """TMC and IWAE bounds against the exact log p(x) for each K."""
    from pyro_tmc import IWAE_ELBO, TMC_ELBO

    x = sample_data(num_data, device=device)
    truth = exact_log_evidence(x)
    rows = []
    for k in ks:
        tmc = time_bound(TMC_ELBO(num_samples=k, max_plate_nesting=1), x, repeats)
        iwae = time_bound(IWAE_ELBO(num_samples=k, max_plate_nesting=1), x, repeats)
        rows.append({"K": k, "exact": truth, "tmc": tmc, "iwae": iwae})
    return rows


def format_table(rows: list[dict]) -> str:
    """The demo's table: each bound as mean ± standard error, and milliseconds per estimate."""
    header = (
        f"{'K':>6} {'exact log p(x)':>15} {'TMC bound ± s.e.':>18} {'IWAE bound ± s.e.':>18} "
        f"{'TMC ms':>8} {'IWAE ms':>8}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        tmc, iwae = row["tmc"], row["iwae"]
        lines.append(
            f"{row['K']:>6} {row['exact']:>15.2f} "
            f"{tmc['mean']:>10.2f} ± {tmc['se']:<5.2f} {iwae['mean']:>10.2f} ± {iwae['se']:<5.2f} "
            f"{1e3 * tmc['seconds']:>8.2f} {1e3 * iwae['seconds']:>8.2f}"
        )
    return "\n".join(lines)


def sweep(panel: str, settings: Sequence[dict], repeats: int, device: str) -> list[dict]:
    """
    One result row per (setting, method), and one ``"exact"`` row per setting.

    :param str panel: ``"K"`` (N fixed) or ``"N"`` (K fixed): the swept variable, for the figure.
    :param settings: dicts with ``"K"``, ``"N"`` and the ``methods`` to run at that setting.
    """
    from tqdm import tqdm

    rows = []
    for setting in tqdm(settings, desc=f"toy: sweep over {panel}"):
        x = sample_data(setting["N"], device=device)
        exact = exact_log_evidence(x)
        rows.append(dict(panel=panel, method="exact", K=setting["K"], N=setting["N"], mean=exact))
        for method in setting["methods"]:
            result = estimate(method, x, setting["K"], repeats)
            rows.append(dict(panel=panel, method=method, K=setting["K"], N=setting["N"], **result))
    return rows


def pivot(rows: Sequence[dict], panel: str) -> list[dict]:
    """
    One line per value of the swept variable: each method's estimate (mean ± standard error)
    and milliseconds per estimate side by side; a method not run at a setting is left out (a blank cell).
    """
    fixed = "N" if panel == "K" else "K"
    lines: dict[int, dict] = {}
    for row in rows:
        line = lines.setdefault(row[panel], {panel: row[panel], fixed: row[fixed]})
        if "se" in row:
            line[row["method"]] = f"{row['mean']:.2f} ± {row['se']:.2f}"
        else:
            line[row["method"]] = row["mean"]
        if "seconds" in row:
            line[f"{row['method']} ms"] = 1e3 * row["seconds"]
    return [lines[key] for key in sorted(lines)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pyro_tmc.experiments.report import add_common_arguments

    add_common_arguments(parser, "toy")
    parser.add_argument("--num-data", type=int, default=128, help="N for the sweep over K (panels A, B)")
    parser.add_argument(
        "--ks",
        type=int,
        nargs="+",
        default=[1, 4, 16, 64, 256, 1024],
        help="K for TMC and SMC (default: %(default)s)",
    )
    parser.add_argument(
        "--iwae-ks",
        type=int,
        nargs="+",
        default=[10**4, 10**5, 10**6],
        help="further K for IWAE alone (chunked joint samples)",
    )
    parser.add_argument("--num-samples", type=int, default=128, help="K for the sweep over N (panels C, D)")
    parser.add_argument(
        "--ns",
        type=int,
        nargs="+",
        default=[1, 4, 16, 64, 256, 1024],
        help="N for panels C, D (default: %(default)s)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="independent estimates per point")


def run(args: argparse.Namespace) -> list[dict]:
    """Paper Fig. 3: TMC, SMC, IWAE and the exact log p(x), swept over K and over N."""
    from pyro_tmc.experiments import plots, report

    files = ["toy.csv", "toy.png"]
    out = report.prepare_output(args, files)
    if args.quick:
        args.ks, args.iwae_ks, args.ns, args.num_samples, args.repeats = [1, 4, 16], [64], [4, 16], 16, 2
    smoke = report.smoke_run_note(args, f"{args.repeats} estimates per point and small K")
    if smoke:
        print(smoke)
    data = "drawn from the model itself (data seed 0), N points per setting; exact log p(x) in closed form"
    report.print_data(data)
    torch.manual_seed(args.seed)
    all_methods = ("TMC", "SMC", "IWAE")
    k_settings = [dict(K=k, N=args.num_data, methods=all_methods) for k in args.ks]
    k_settings += [dict(K=k, N=args.num_data, methods=("IWAE",)) for k in args.iwae_ks]
    n_settings = [dict(K=args.num_samples, N=n, methods=all_methods) for n in args.ns]
    k_rows = sweep("K", k_settings, args.repeats, args.device)
    n_rows = sweep("N", n_settings, args.repeats, args.device)

    report.write_csv(k_rows + n_rows, f"{out}/toy.csv")
    plots.toy_figure(k_rows, n_rows, f"{out}/toy.png")
    methods = ["exact", "TMC", "SMC", "IWAE", "TMC ms", "SMC ms", "IWAE ms"]
    print(f"A, B: log p(x) estimates and time vs K at N={args.num_data} ({args.repeats} estimates per point)")
    print(report.format_table(pivot(k_rows, "K"), ["K"] + methods, floats="{:.2f}"))
    print(
        f"C, D: log p(x) estimates and time vs N at K={args.num_samples} ({args.repeats} estimates per point)"
    )
    print(report.format_table(pivot(n_rows, "N"), ["N"] + methods, floats="{:.2f}"))
    report.print_notes(
        [
            report.SE_NOTE.format(repeats=args.repeats),
            report.BOUND_NOTE,
            "ms: milliseconds per estimate, the mean over the estimates after one warm-up "
            "estimate (excluded).",
            "Blank: not run at that setting (IWAE alone at the largest K, where TMC and SMC are not needed)."
            if args.iwae_ks
            else None,
            smoke,
        ]
    )
    report.finish(args, out, files, data)
    return k_rows + n_rows
