"""Posterior means and standard deviations, pooled over independent TMC draws, with standard errors.

One TMC draw's marginals (:func:`~pyro_tmc.infer.posterior.compute_marginals`) are
self-normalised importance estimates: their error does not vanish as K stays fixed,
however many draws are averaged plainly (an O(1/K) bias). Weighting each draw r by its
own estimate P_r of p(x) instead pools the R draws into one importance sampler over all
their particle combinations,

    E[f] ~ sum_r P_r E_r[f] / sum_r P_r,

which is consistent as R grows, for any K (Heap, Bowyer and Aitchison's estimators
combine draws the same way). Its standard error is the ratio estimator's (delta method).
When the P_r spread over many orders of magnitude, few draws carry the result; the
effective number of draws says so, and then a larger K is the cure.
"""

from collections import OrderedDict
from typing import Callable, NamedTuple

import torch

from pyro_tmc.infer.posterior import marginals_and_log_estimate

WEIGHTINGS = ("evidence", "uniform")


class PosteriorMoments(NamedTuple):
    """
    One site's pooled posterior moments (each of the site's plate + event shape).

    :ivar torch.Tensor mean: the posterior mean.
    :ivar torch.Tensor stddev: the posterior standard deviation.
    :ivar torch.Tensor mean_error: the standard error of ``mean`` over the draws.
    :ivar torch.Tensor stddev_error: the standard error of ``stddev`` over the draws.
    """

    mean: torch.Tensor
    stddev: torch.Tensor
    mean_error: torch.Tensor
    stddev_error: torch.Tensor


class PooledMoments(NamedTuple):
    """
    The result of :func:`posterior_moments`.

    :ivar dict sites: site name -> :class:`PosteriorMoments`.
    :ivar torch.Tensor log_evidences: each draw's ``log P_TMC``, shape ``(num_draws,)``.
    :ivar float effective_draws: ``(sum a)^2 / sum a^2`` of the draws' weights ``a``.
    """

    sites: "OrderedDict[str, PosteriorMoments]"
    log_evidences: torch.Tensor
    effective_draws: float


def posterior_moments(
    elbo, model: Callable, guide: Callable, *args, num_draws: int = 20, weighting: str = "evidence", **kwargs
) -> PooledMoments:
    """
    Posterior means and sds of every latent site from ``num_draws`` independent TMC
    draws of ``elbo`` (a :class:`~pyro_tmc.TMC_ELBO`; its ``num_samples`` is the read-out
    K, which may exceed the training K), with their standard errors.

    Example::

        readout = TMC_ELBO(num_samples=128, max_plate_nesting=1)
        result = posterior_moments(readout, model, guide, data, num_draws=20)
        result.sites["theta"].mean, result.sites["theta"].mean_error

    :param elbo: the TMC loss whose draws are read (one draw each: ``num_particles=1``).
    :param int num_draws: independent draws pooled.
    :param str weighting: ``"evidence"`` (default): draw r weighted by its ``P_TMC``, which
        is consistent for any K as draws are added; ``"uniform"``: the plain average of the
        draws' marginal moments (keeps the O(1/K) bias of each draw).
    :rtype: PooledMoments
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"posterior_moments(weighting={weighting!r}): use one of {WEIGHTINGS}.")
    if num_draws < 2:
        raise ValueError(f"posterior_moments(num_draws={num_draws}): standard errors need at least 2 draws.")
    if getattr(elbo, "num_particles", 1) != 1:
        raise ValueError(
            "posterior_moments reads one TMC draw at a time: construct the loss with num_particles=1."
        )
    firsts: dict[str, list[torch.Tensor]] = OrderedDict()
    seconds: dict[str, list[torch.Tensor]] = OrderedDict()
    log_evidences = []
    for _ in range(num_draws):
        with torch.no_grad():
            draw = elbo.draw(model, guide, *args, **kwargs)
        marginals, log_estimate = marginals_and_log_estimate(draw)
        log_evidences.append(log_estimate.reshape(()))
        for name, marginal in marginals.items():
            firsts.setdefault(name, []).append(marginal.mean)
            seconds.setdefault(name, []).append(marginal.expectation(torch.square))
    log_evidences = torch.stack(log_evidences)
    weights = _draw_weights(log_evidences, weighting)
    sites = OrderedDict(
        (name, pool_moments(torch.stack(firsts[name]), torch.stack(seconds[name]), weights))
        for name in firsts
    )
    effective = float(weights.sum().square() / weights.square().sum())
    return PooledMoments(sites, log_evidences, effective)


def _draw_weights(log_evidences: torch.Tensor, weighting: str) -> torch.Tensor:
    if weighting == "uniform":
        return torch.full_like(log_evidences, 1.0 / len(log_evidences))
    return torch.softmax(log_evidences, 0)


def pool_moments(firsts: torch.Tensor, seconds: torch.Tensor, weights: torch.Tensor) -> PosteriorMoments:
    """Weighted moments over the draws (dim 0), with the ratio estimator's standard errors."""
    weights = weights.to(firsts.dtype).reshape((-1,) + (1,) * (firsts.dim() - 1))
    first = (weights * firsts).sum(0)
    second = (weights * seconds).sum(0)
    variance = (second - first.square()).clamp(min=0)
    stddev = variance.sqrt()
    # each draw's influence on the pooled value, linearised (delta method)
    first_influence = firsts - first
    variance_influence = (seconds - second) - 2 * first * first_influence
    mean_error = (weights.square() * first_influence.square()).sum(0).sqrt()
    variance_error = (weights.square() * variance_influence.square()).sum(0).sqrt()
    stddev_error = variance_error / (2 * stddev.clamp(min=torch.finfo(stddev.dtype).tiny))
    return PosteriorMoments(first, stddev, mean_error, stddev_error)
