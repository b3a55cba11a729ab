"""Chains written with ``vectorized_markov``, shared by the tests of its estimator, proposals and fits.

- ``model`` / ``guide``: a 4-step Gaussian walk (scale ``STEP_SCALE``) observed with unit noise, and a
  guide factorised over time; ``brute_force`` and ``exact_log_evidence`` are its oracles.
- ``vectorized_walk``: a walk of any length (scale ``WALK_STEP_SCALE``, noise ``OBSERVATION_SCALE``),
  with ``exact_walk_posterior``.
- ``globals_model``: a walk whose every step reads globals (its location and scale), with
  ``chain_brute_force`` (any particle counts, the globals' included) over ``globals_head`` and
  ``globals_link``; ``drift_model``: a linear-Gaussian chain whose every step reads a global drift,
  with ``drift_exact_log_evidence``.

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


# -- chains whose steps read the globals ----------------------------------------------------------

GLOBALS_X = torch.tensor([0.5, -0.3, 1.2], dtype=torch.float64)
DRIFT, DRIFT_SCALE = 0.8, 0.7
DRIFT_X = torch.tensor([0.9, -0.4, 1.7, 0.3], dtype=torch.float64)


def globals_model(x):
    """m ~ N(0, 1), s ~ LogNormal(0, 0.5), z_0 ~ N(m, s), z_t ~ N(z_{t-1}, s), x_t ~ N(z_t, 1)."""
    m = pyro.sample("m", dist.Normal(0.0, 1.0))
    s = pyro.sample("s", dist.LogNormal(0.0, 0.5))
    previous = m
    for t in vectorized_markov(name="time", size=x.shape[-1], dim=-1):
        previous = pyro.sample(f"z_{t}", dist.Normal(previous, s))
        pyro.sample(f"x_{t}", dist.Normal(previous, 1.0), obs=x[t])


def globals_head(m, s, z0, x) -> torch.Tensor:
    """``globals_model``'s log density of the globals and the first step (with its observation)."""
    return (
        dist.Normal(0.0, 1.0).log_prob(m)
        + dist.LogNormal(0.0, 0.5).log_prob(s)
        + dist.Normal(m, s).log_prob(z0)
        + dist.Normal(z0, 1.0).log_prob(x[0])
    )


def globals_link(x):
    """``(globals, z_{t-1}, z_t, t) -> log p(z_t | z_{t-1}, s) p(x_t | z_t)`` of ``globals_model``."""

    def log_link(context, previous, value, t):
        _, s = context
        return dist.Normal(previous, s).log_prob(value) + dist.Normal(value, 1.0).log_prob(x[t])

    return log_link


def chain_brute_force(heads, later: torch.Tensor, later_log_q: torch.Tensor, log_link) -> torch.Tensor:
    """
    The TMC estimate of a chain by brute force over every combination of particles::

        log mean_c exp(head_c) K^-(T-1) sum_{k_1..k_{T-1}} prod_t p(z_t^{k_t} | z_{t-1}) / q_t(z_t^{k_t})

    :param heads: ``(log weight, z_0, context)`` per combination ``c`` of the globals' and the
        first step's particles: the log weight is ``log p - log q`` of those sites (and of the
        first step's observation); ``context`` (the globals) is passed to ``log_link``.
    :param later: ``(K, T - 1)`` the later steps' particles; ``later_log_q``: their log proposal densities.
    :param log_link: ``(context, z_{t-1}, z_t, t) -> log p(z_t | z_{t-1}) + log p(x_t | z_t)``.
    """
    num, steps = later.shape
    outer = []
    for log_weight, first, context in heads:
        paths = []
        for ks in itertools.product(range(num), repeat=steps):
            previous, total = first, log_weight
            for step, k in enumerate(ks):
                total = total + log_link(context, previous, later[k, step], step + 1) - later_log_q[k, step]
                previous = later[k, step]
            paths.append(total)
        outer.append(torch.logsumexp(torch.stack(paths), 0) - steps * math.log(num))
    return torch.logsumexp(torch.stack(outer), 0) - math.log(len(heads))


def drift_model(x):
    """m ~ N(0, 1), z_0 ~ N(m, s), z_t ~ N(rho z_{t-1} + m, s), x_t ~ N(z_t, 1): every step reads m."""
    m = pyro.sample("m", dist.Normal(0.0, 1.0))
    previous = None
    for t in vectorized_markov(name="time", size=x.shape[-1], dim=-1):
        loc = m if previous is None else DRIFT * previous + m
        previous = pyro.sample(f"z_{t}", dist.Normal(loc, DRIFT_SCALE))
        pyro.sample(f"x_{t}", dist.Normal(previous, 1.0), obs=x[t])


def _drift_prior(length: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``drift_model``'s z = B (m, e_0, .., e_{T-1}) of independent normals: B and their variances."""
    maps = torch.zeros(length, length + 1, dtype=dtype)
    maps[0, 0] = maps[0, 1] = 1.0
    for t in range(1, length):
        maps[t] = DRIFT * maps[t - 1]
        maps[t, 0] += 1.0
        maps[t, t + 1] += 1.0
    return maps, torch.tensor([1.0] + [DRIFT_SCALE**2] * length, dtype=dtype)


def drift_exact_log_evidence(x: torch.Tensor) -> torch.Tensor:
    """log p(x) of ``drift_model``."""
    maps, variances = _drift_prior(x.shape[-1], x.dtype)
    cov = maps @ torch.diag(variances) @ maps.T + torch.eye(x.shape[-1], dtype=x.dtype)
    return dist.MultivariateNormal(torch.zeros_like(x), cov).log_prob(x)


def drift_exact_posterior(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact posterior means and sds of ``drift_model``'s (m, z_0, .., z_{T-1}), given x (float64)."""
    length = x.shape[-1]
    maps, variances = _drift_prior(length, torch.float64)
    latent = torch.cat([torch.eye(1, length + 1, dtype=torch.float64), maps])  # (m, z) from (m, e)
    prior = latent @ torch.diag(variances) @ latent.T
    observe = torch.cat([torch.zeros(length, 1), torch.eye(length)], 1).double()  # z out of (m, z)
    noisy = observe @ prior @ observe.T + torch.eye(length, dtype=torch.float64)
    gain = prior @ observe.T @ torch.linalg.inv(noisy)
    return gain @ x.double(), (prior - gain @ observe @ prior).diagonal().sqrt()
