"""The paper's toy model (Aitchison 2019, "Comparing TMC, SMC and IWAE").

    theta ~ N(0, 1),  z_i ~ N(theta, 1),  x_i ~ N(z_i, 1),  i = 1..N,

with proposals Q(theta) = N(0, 1) and Q(z_i) = N(0, 2), the generative marginals.
Everything is jointly Gaussian, so log p(x) is exact: x ~ N(0, 2 I + 1 1^T).
"""

import math
import time
from typing import Dict, List, Sequence

import torch
import pyro
import pyro.distributions as dist


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


def time_bound(elbo, x: torch.Tensor, repeats: int) -> Dict[str, float]:
    """Mean and standard error of ``elbo.log_evidence`` over ``repeats`` draws, and seconds per draw."""
    values: List[float] = []
    elbo.log_evidence(model, guide, x)  # warm-up: plate nesting guess, path caches
    start = time.perf_counter()
    for _ in range(repeats):
        values.append(elbo.log_evidence(model, guide, x).item())
    if x.is_cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / repeats
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
    return {"mean": mean, "se": math.sqrt(var / len(values)), "seconds": seconds}


def bounds_table(
    num_data: int = 128,
    ks: Sequence[int] = (1, 4, 16, 64, 256),
    repeats: int = 10,
    device: str = "cpu",
) -> List[Dict[str, float]]:
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


def format_table(rows: List[Dict]) -> str:
    header = f"{'K':>6} {'exact log p(x)':>15} {'TMC bound':>18} {'IWAE bound':>18} {'TMC ms':>8} {'IWAE ms':>8}"
    lines = [header, "-" * len(header)]
    for row in rows:
        tmc, iwae = row["tmc"], row["iwae"]
        lines.append(
            f"{row['K']:>6} {row['exact']:>15.2f} "
            f"{tmc['mean']:>10.2f} ± {tmc['se']:<5.2f} {iwae['mean']:>10.2f} ± {iwae['se']:<5.2f} "
            f"{1e3 * tmc['seconds']:>8.2f} {1e3 * iwae['seconds']:>8.2f}"
        )
    return "\n".join(lines)
