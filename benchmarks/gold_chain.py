"""Stochastic volatility written for speed: TMC's chain as ``vectorized_markov``, NUTS's as one vector site.

:mod:`gold` writes the gym's stochastic volatility model with ``pyro.markov``: one sample statement
per day, which is Python work per day for every method. On the 2,516-day series that is what made
the run infeasible (3 s a step at K = 4). This module writes the same joint density twice more:

- :func:`vectorized_model` for TMC: the log volatilities in
  :func:`pyro.contrib.funsor.vectorized_markov`, so the model scores every day's transition in one
  statement and :mod:`pyro_tmc.estimate.vectorized_markov` contracts the time dim in ``log2(T)`` batched
  matrix products. (The TMC read-out itself is the library's: :func:`pyro_tmc.infer.fit_posterior`.)
- :func:`nuts_model` for Pyro's NUTS: the log volatilities one vector site, the AR(1) density one
  ``pyro.factor``. A gradient is a few vector operations (about 3 ms here under ``jit_compile``),
  where the per-day model traces 5,000 sites per gradient.

Both score exactly the density of :func:`gold.stochastic_volatility_model`.

References: Kim, Shephard and Chib (1998) "Stochastic volatility: likelihood inference and
comparison with ARCH models" (the model); Inference Gym's ``stochastic_volatility.py`` (its
centered parameterisation); Aitchison (2019) "Tensor Monte Carlo" (the estimate).
"""

import torch

import pyro
import pyro.distributions as dist
from pyro.contrib.funsor import vectorized_markov
from pyro.distributions import constraints

#: the model's global latents and their supports (their order is the model's)
GLOBALS = {
    "persistence_of_volatility": constraints.interval(-1.0, 1.0),
    "mean_log_volatility": constraints.real,
    "white_noise_shock_scale": constraints.positive,
}
CHAIN = "log_volatility"


class PersistencePrior(dist.TransformedDistribution):
    """``2 Beta(20, 1.5) - 1``, with its support (-1, 1) declared: an affine map's own is the real line."""

    support = constraints.interval(-1.0, 1.0)


def persistence_prior() -> PersistencePrior:
    """The gym's prior of the AR(1) persistence (every stochastic volatility model here uses it)."""
    return PersistencePrior(dist.Beta(20.0, 1.5), [dist.transforms.AffineTransform(-1.0, 2.0)])


def global_priors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample the three globals from the gym's priors (inside a model)."""
    persistence = pyro.sample("persistence_of_volatility", persistence_prior())
    mean = pyro.sample("mean_log_volatility", dist.Cauchy(0.0, 5.0))
    shock_scale = pyro.sample("white_noise_shock_scale", dist.HalfCauchy(2.0))
    return persistence, mean, shock_scale


def vectorized_model(returns: torch.Tensor) -> None:
    """
    The gym's centered AR(1) log volatility, its days in ``vectorized_markov``: the sites are
    ``log_volatility_0`` and ``log_volatility_slice(1, T, None)`` (days 1..T-1, one statement).

    :param torch.Tensor returns: the centered daily returns, shape ``(T,)``.
    """
    persistence, mean, shock_scale = global_priors()
    previous = None
    for t in vectorized_markov(name="days", size=len(returns), dim=-1):
        if previous is None:  # day 0: the stationary distribution
            step = dist.Normal(mean, shock_scale / (1 - persistence.square()).sqrt())
        else:
            step = dist.Normal(mean + persistence * (previous - mean), shock_scale)
        previous = pyro.sample(f"{CHAIN}_{t}", step)
        pyro.sample(f"returns_{t}", dist.Normal(0.0, (previous / 2).exp()), obs=returns[t])


def nuts_model(returns: torch.Tensor) -> None:
    """
    The same density for NUTS: the log volatilities one site of shape ``(T,)`` (a flat base
    measure, ``mask(False)``, so that its density is the AR(1) factor alone).
    """
    persistence, mean, shock_scale = global_priors()
    flat = dist.Normal(0.0, 1.0).expand([len(returns)]).to_event(1).mask(False)
    log_volatility = pyro.sample(CHAIN, flat)
    first = dist.Normal(mean, shock_scale / (1 - persistence.square()).sqrt()).log_prob(
        log_volatility[..., 0]
    )
    later = dist.Normal(mean + persistence * (log_volatility[..., :-1] - mean), shock_scale)
    pyro.factor("ar1", first + later.log_prob(log_volatility[..., 1:]).sum(-1))
    pyro.sample("returns", dist.Normal(0.0, (log_volatility / 2).exp()).to_event(1), obs=returns)
