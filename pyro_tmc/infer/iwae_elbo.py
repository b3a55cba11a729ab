"""IWAE_ELBO: the importance-weighted bound with K joint samples, the baseline beside TMC_ELBO."""

import math
import warnings

import torch
import pyro
import pyro.poutine as poutine
from pyro.poutine.util import prune_subsample_sites, site_is_subsample
from pyro.util import warn_if_nan

from .base import DifferentiableLossELBO
from ..poutine.tmc_messenger import check_num_samples
from .path_gradients import path_surrogate, with_leaf_values

_SAMPLE_PLATE = "_iwae_samples"
_REPEAT_PLATE = "_iwae_repetitions"


class IWAE_ELBO(DifferentiableLossELBO):
    """
    The importance-weighted bound [1] with ``num_samples`` joint samples:
    ``log 1/K sum_k p(x, z^k) / q(z^k)``, with ``z^k`` a whole draw of the guide.
    Latent sites of the model absent from the guide are drawn from the prior,
    which cancels from the weight.

    :param int num_samples: K, the joint samples.
    :param int max_plate_nesting: as in every Pyro ELBO; guessed if omitted.
    :param str variance_reduction: ``None``, ``"stl"`` (sticking the landing [2])
        or ``"dregs"`` (doubly reparameterised gradients [3]); both change the
        guide parameters' gradient only.
    :param int num_particles: independent bounds averaged in the loss.
    :param bool vectorize_particles: compute them in one vectorised pass.

    References

    [1] Burda, Grosse, Salakhutdinov (2016) "Importance Weighted Autoencoders".
    [2] Roeder, Wu, Duvenaud (2017) "Sticking the Landing".
    [3] Tucker, Lawson, Gu, Maddison (2018) "Doubly Reparameterized Gradient
        Estimators for Monte Carlo Objectives".
    """

    def __init__(
        self,
        num_samples: int = 8,
        max_plate_nesting: float = float("inf"),
        variance_reduction=None,
        num_particles: int = 1,
        vectorize_particles: bool = False,
        **kwargs,
    ) -> None:
        self.num_samples = check_num_samples(num_samples, "IWAE_ELBO")
        if variance_reduction not in (None, "stl", "dregs"):
            raise ValueError(
                f"Unknown variance_reduction {variance_reduction!r}: expected None, 'stl' or 'dregs'."
            )
        self.variance_reduction = variance_reduction
        super().__init__(num_particles=num_particles, max_plate_nesting=max_plate_nesting, **kwargs)
        self.vectorize_particles = vectorize_particles

    def _wrap(self, fn, repetitions: int):
        sample_dim = -1 - self.max_plate_nesting

        def wrapped(*args, **kwargs):
            with pyro.plate(_REPEAT_PLATE, repetitions, dim=sample_dim - 1):
                with pyro.plate(_SAMPLE_PLATE, self.num_samples, dim=sample_dim):
                    return fn(*args, **kwargs)

        return wrapped

    def _get_trace(self, model, guide, args, kwargs):
        return self._traces(model, guide, args, kwargs, 1)

    def _traces(self, model, guide, args, kwargs, repetitions):
        guide_trace = poutine.trace(self._wrap(guide, repetitions)).get_trace(*args, **kwargs)
        model_trace = poutine.trace(
            poutine.replay(self._wrap(model, repetitions), trace=guide_trace)
        ).get_trace(*args, **kwargs)
        return prune_subsample_sites(model_trace), prune_subsample_sites(guide_trace)

    def _per_sample(self, log_prob: torch.Tensor) -> torch.Tensor:
        """Sum a site's log density over its plates: shape (repetitions, K)."""
        ndim = 2 + self.max_plate_nesting
        log_prob = log_prob.reshape((1,) * (ndim - log_prob.dim()) + log_prob.shape)
        return log_prob.reshape(log_prob.shape[:2] + (-1,)).sum(-1)

    def _log_weights(self, model_trace, guide_trace, log_q_by_site):
        log_w = 0.0
        for name, site in model_trace.nodes.items():
            if site["type"] != "sample":
                continue
            if not site["is_observed"] and name not in guide_trace.nodes:
                _check_reparameterised(site, "drawn from the prior")
                continue  # proposal = prior: p / q cancels
            log_w = log_w + self._per_sample(site["log_prob"])
        for name, log_q in log_q_by_site.items():
            log_w = log_w - self._per_sample(log_q)
        return log_w

    def _guess_plates(self, model, guide, args, kwargs) -> None:
        if self.max_plate_nesting == float("inf"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._guess_max_plate_nesting(model, guide, args, kwargs)

    def _log_q(self, guide_trace, detach: bool = False):
        log_q = {}
        for name, site in guide_trace.nodes.items():
            if site["type"] == "sample" and not site["is_observed"]:
                _check_reparameterised(site, "in the guide")
                log_q[name] = site["log_prob"].detach() if detach else site["log_prob"]
        return log_q

    def _plain_bound(self, model_trace, guide_trace) -> torch.Tensor:
        model_trace.compute_log_prob()
        guide_trace.compute_log_prob()
        log_w = self._log_weights(model_trace, guide_trace, self._log_q(guide_trace))
        return _log_mean_exp(log_w).sum()

    def _path_gradient_bound(self, model, guide, args, kwargs, repetitions) -> torch.Tensor:
        """The bound, with the STL / DReGs gradient for the guide's parameters."""
        wrapped_guide = self._wrap(guide, repetitions)
        live_trace = poutine.trace(wrapped_guide).get_trace(*args, **kwargs)
        names = []
        for name, site in live_trace.nodes.items():
            if site["type"] == "sample" and not site["is_observed"] and not _is_subsample(site):
                _check_reparameterised(site, "in the guide")
                names.append(name)
        leaf_trace, leaves = with_leaf_values(live_trace, names)
        guide_trace = poutine.trace(poutine.replay(wrapped_guide, trace=leaf_trace)).get_trace(*args, **kwargs)
        model_trace = poutine.trace(
            poutine.replay(self._wrap(model, repetitions), trace=guide_trace)
        ).get_trace(*args, **kwargs)
        model_trace, guide_trace = prune_subsample_sites(model_trace), prune_subsample_sites(guide_trace)
        model_trace.compute_log_prob()
        guide_trace.compute_log_prob()

        log_w = self._log_weights(model_trace, guide_trace, self._log_q(guide_trace))
        # retain: the plain bound below reuses the model's networks' graph
        grads = torch.autograd.grad(
            _log_mean_exp(log_w).sum(), list(leaves.values()), allow_unused=True, retain_graph=True
        )
        weights = event_dims = None
        if self.variance_reduction == "dregs":
            # One latent (the joint sample): its marginal weight is the normalised weight.
            normalised = torch.softmax(log_w.detach(), -1)
            normalised = normalised.reshape(normalised.shape + (1,) * self.max_plate_nesting)
            weights = {name: normalised for name in names}
            event_dims = {name: live_trace.nodes[name]["fn"].event_dim for name in names}
        live_values = {name: live_trace.nodes[name]["value"] for name in names}
        plain_log_w = self._log_weights(model_trace, guide_trace, self._log_q(guide_trace, detach=True))
        plain = _log_mean_exp(plain_log_w).sum()
        return plain + path_surrogate(live_values, dict(zip(leaves, grads)), weights, event_dims)

    def _log_bound(self, model, guide, args, kwargs) -> torch.Tensor:
        """The bound, averaged over ``num_particles`` repetitions."""
        self._guess_plates(model, guide, args, kwargs)
        repetitions = self.num_particles if self.vectorize_particles else 1
        total = 0.0
        for _ in range(1 if self.vectorize_particles else self.num_particles):
            if self.variance_reduction is not None and torch.is_grad_enabled():
                total = total + self._path_gradient_bound(model, guide, args, kwargs, repetitions)
            else:
                total = total + self._plain_bound(*self._traces(model, guide, args, kwargs, repetitions))
        return total / self.num_particles

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        """:returns: minus the importance-weighted bound (averaged over ``num_particles``)."""
        loss = -self._log_bound(model, guide, args, kwargs)
        warn_if_nan(loss, "loss")
        return loss



def _log_mean_exp(log_w: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(log_w, -1) - math.log(log_w.shape[-1])


def _is_subsample(site) -> bool:
    return site_is_subsample(site)


def _check_reparameterised(site, where: str) -> None:
    if not site["fn"].has_rsample:
        raise NotImplementedError(
            f"IWAE_ELBO needs reparameterised latents, but site '{site['name']}' ({where}) "
            "is not. Use TMC_ELBO, which gives such sites unbiased score-function terms."
        )

