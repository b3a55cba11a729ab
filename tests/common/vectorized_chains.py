"""Chains written with ``vectorized_markov``, shared by the tests of its estimator, proposals and fits.

- ``model`` / ``guide``: a 4-step Gaussian walk (scale ``STEP_SCALE``) observed with unit noise, and a
  guide factorised over time; ``brute_force`` and ``exact_log_evidence`` are its oracles.
- ``vectorized_walk``: a walk of any length (scale ``WALK_STEP_SCALE``, noise ``OBSERVATION_SCALE``),
  with ``exact_walk_posterior``.

Import this module only after ``pytest.importorskip("funsor")``: ``vectorized_markov`` needs it.
"""

import itertools
import math

import torch

import pyro
import pyro.distributions as dist
from pyro.contrib.funsor import vectorized_markov

T = 4
K = 3
STEP_SCALE = 0.7
X = torch.tensor([0.9, -0.4, 1.7, 0.3], dtype=torch.float64)
GUIDE_LOC = torch.tensor([0.3, 0.0, 0.8, 0.5], dtype=torch.float64)
GUIDE_SCALE = torch.tensor([0.8, 0.9, 1.0, 0.7], dtype=torch.float64)
CURRENT = f"z_{slice(1, T)}"


def model(x):
    """z_0 ~ N(0, s), z_t ~ N(z_{t-1}, s), x_t ~ N(z_t, 1): one statement for all t >= 1."""
    z_prev = 0.0
    for t in vectorized_markov(name="time", size=x.shape[-1], dim=-1):
        z_curr = pyro.sample(f"z_{t}", dist.Normal(z_prev, STEP_SCALE))
        pyro.sample(f"x_{t}", dist.Normal(z_curr, 1.0), obs=x[t])
        z_prev = z_curr


def guide(x):
    """Factorised over time: z_t ~ N(loc_t, scale_t), drawn for all t >= 1 at once."""
    for t in vectorized_markov(name="time", size=x.shape[-1], dim=-1):
        pyro.sample(f"z_{t}", dist.Normal(GUIDE_LOC[t], GUIDE_SCALE[t]))


def unrolled_model(x):
    """The same chain with pyro.markov: one statement per step."""
    z = 0.0
    for t in pyro.markov(range(x.shape[-1])):
        z = pyro.sample(f"z_{t}", dist.Normal(z, STEP_SCALE))
        pyro.sample(f"x_{t}", dist.Normal(z, 1.0), obs=x[t])


def particles_of(draw) -> torch.Tensor:
    """The draw's particles, (K, T): z_0's, then the later steps'."""
    nodes = draw.guide_trace.nodes
    first = nodes["z_0"]["value"].reshape(-1)
    later = nodes[CURRENT]["value"].reshape(-1, T - 1)
    return torch.cat([first[:, None], later], dim=1)


def brute_force(z: torch.Tensor, x: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """
    ``log 1/K^T sum_{k_0..k_{T-1}} prod_t p(z_t | z_{t-1}) p(x_t | z_t) / q_t(z_t)``, z_t at particle k_t.

    :param z: (K, T) particles; :param log_q: (K, T) their proposal log densities.
    """
    num, length = z.shape
    terms = []
    for ks in itertools.product(range(num), repeat=length):
        path = torch.stack([z[k, t] for t, k in enumerate(ks)])
        lq = sum(log_q[k, t] for t, k in enumerate(ks))
        prev = torch.cat([path.new_zeros(1), path[:-1]])
        lp = dist.Normal(prev, STEP_SCALE).log_prob(path).sum() + dist.Normal(path, 1.0).log_prob(x).sum()
        terms.append(lp - lq)
    return torch.logsumexp(torch.stack(terms), 0) - length * math.log(num)


def exact_log_evidence(x: torch.Tensor) -> torch.Tensor:
    """log p(x): z is Gaussian with Cov(z_i, z_j) = s^2 (min(i, j) + 1), and x = z + N(0, I)."""
    steps = torch.arange(x.shape[-1], dtype=x.dtype)
    cov = STEP_SCALE**2 * (torch.minimum(steps[:, None], steps[None, :]) + 1) + torch.eye(x.shape[-1])
    return dist.MultivariateNormal(torch.zeros_like(x), cov).log_prob(x)


WALK_STEP_SCALE, OBSERVATION_SCALE = 0.5, 1.0
WALK = torch.tensor([0.3, 0.8, 0.1, -0.5, -0.2, 0.6, 1.1, 0.9])


def vectorized_walk(y):
    """A Gaussian random walk observed with noise, its steps in ``vectorized_markov``."""
    previous = None
    for t in vectorized_markov(name="steps", size=len(y), dim=-1):
        loc = 0.0 if previous is None else previous
        previous = pyro.sample(f"z_{t}", dist.Normal(loc, 1.0 if previous is None else WALK_STEP_SCALE))
        pyro.sample(f"y_{t}", dist.Normal(previous, OBSERVATION_SCALE), obs=y[t])


def exact_walk_posterior(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The walk's posterior mean and sds, every step: z = L e with L lower-triangular."""
    n = len(y)
    scales = torch.tensor([1.0] + [WALK_STEP_SCALE] * (n - 1), dtype=torch.float64)
    cholesky = torch.tril(torch.ones(n, n, dtype=torch.float64)) * scales
    precision = (
        torch.linalg.inv(cholesky @ cholesky.T) + torch.eye(n, dtype=torch.float64) / OBSERVATION_SCALE**2
    )
    cov = torch.linalg.inv(precision)
    return cov @ y.double() / OBSERVATION_SCALE**2, cov.diagonal().sqrt()
