"""Gradient estimators: how a loss turns one TMC draw into a differentiable surrogate.

Each estimator is a small class with a name, registered in :data:`ESTIMATORS`:

- :class:`Plain` (``None``): ``log P_TMC`` itself, reparameterised where the
  guide is, score-function (DiCE) terms where it is not;
- :class:`StickingTheLanding` (``"stl"``) and :class:`DReGs` (``"dregs"``):
  path gradients for the guide, the model keeping the plain gradient
  (derivations in :mod:`pyro_tmc.infer.path_gradients`);
- :class:`WakeSleep` (``"rws"``): reweighted wake-sleep, used by
  :class:`~pyro_tmc.TMC_RWS`.

Every surrogate has the value ``log P_TMC`` of its draw; only its gradient
differs. To add one, subclass :class:`GradientEstimator` and decorate it with
``@register_estimator("name")``; ``TMC_ELBO(variance_reduction="name")`` then
uses it.
"""

from typing import Callable, Optional

import torch

from pyro.poutine import Trace

from pyro_tmc.infer.draw import DrawSettings, TMCDraw
from pyro_tmc.infer.path_gradients import check_factorised, path_surrogate, reparameterised_latents
from pyro_tmc.poutine.proposals import proposal_log_prob, sampling_log_prob
from pyro_tmc.poutine.sites import is_drawn, is_latent, particle_draw, source_weights

#: name -> estimator class; ``None`` is the plain gradient
ESTIMATORS: dict[Optional[str], type["GradientEstimator"]] = {}


def register_estimator(name: Optional[str]) -> Callable[[type], type]:
    """Class decorator: make an estimator available under ``name``."""

    def register(cls: type) -> type:
        cls.name = name
        ESTIMATORS[name] = cls
        return cls

    return register


def make_estimator(name: Optional[str], exclude=()) -> "GradientEstimator":
    """
    :param name: a registered estimator name (``None`` for the plain gradient).
    :param exclude: registered names this loss does not take.
    :raises ValueError: for an unknown or excluded name, listing the choices.
    """
    choices = [n for n in ESTIMATORS if n not in exclude]
    if name not in choices:
        raise ValueError(
            f"Unknown variance_reduction {name!r}: expected one of {', '.join(map(repr, choices))}."
        )
    return ESTIMATORS[name]()


class GradientEstimator:
    """
    Builds, from the model, guide and settings, one draw and a surrogate whose
    value is ``log P_TMC`` of that draw and whose gradient is the estimator's.
    """

    name: Optional[str] = None
    #: whether the guide's particles are replaced by detached leaves (d log P / d z)
    uses_leaves = False
    leaves_require_grad = True

    def leaf_sites(self, live_trace: Trace) -> list[str]:
        """The guide sites whose particles become leaves (when :attr:`uses_leaves`)."""
        return []

    def draw(self, model, guide, args, kwargs, settings: DrawSettings) -> TMCDraw:
        """One draw, with leaves where the estimator needs them."""
        leaf_sites = self.leaf_sites if self.uses_leaves else None
        return TMCDraw.run(model, guide, args, kwargs, settings, leaf_sites, self.leaves_require_grad)

    def surrogate(self, draw: TMCDraw) -> torch.Tensor:
        raise NotImplementedError


@register_estimator(None)
class Plain(GradientEstimator):
    """
    The gradient of the bound ``E[log P_TMC]``: of ``log P_TMC`` as it is, plus, for
    the guide's latents that are not reparameterised, a score-function (DiCE) term
    ``stop(log P_TMC) * grad sum_k log q(z^k)`` over the densities their particles
    were drawn from (:func:`~pyro_tmc.poutine.proposals.sampling_log_prob`). With ``log q``
    differentiable inside ``P_TMC`` too (:func:`~pyro_tmc.poutine.proposals.stops_proposal_density`),
    the guide's parameters get an unbiased gradient of the bound, as ``Trace_ELBO``'s
    do (the same estimator at K = 1, no baseline).
    """

    def surrogate(self, draw: TMCDraw) -> torch.Tensor:
        log_p = draw.log_estimate()
        score = score_of_unreparameterised_draws(draw.guide_trace)
        if score is None:
            return log_p
        return log_p + log_p.detach() * (score - score.detach())


def score_of_unreparameterised_draws(guide_trace: Trace) -> Optional[torch.Tensor]:
    """
    ``sum log q`` of every particle of the guide's sampled latents that are not
    reparameterised, under the densities that drew them; ``None`` where there are none
    (or their densities need no gradient).
    """
    total = None
    for site in guide_trace.nodes.values():
        draw = particle_draw(site) if is_latent(site) else None
        if draw is None or site["fn"].has_rsample:
            continue
        log_q = sampling_log_prob(site["fn"], site["value"], draw)
        if log_q.requires_grad:
            total = log_q.sum() if total is None else total + log_q.sum()
    return total


@register_estimator("stl")
class StickingTheLanding(GradientEstimator):
    """
    Sticking the landing (Roeder et al. 2017): the guide's gradient is the path
    term alone, ``sum stop(dF/dz) . dz/dphi``.
    """

    uses_leaves = True

    def leaf_sites(self, live_trace: Trace) -> list[str]:
        return reparameterised_latents(live_trace, self.name)

    def weight_sources(self, draw: TMCDraw, names: list[str]) -> dict[str, torch.Tensor]:
        """Sources whose gradients weight each particle's path gradient (none: STL)."""
        return {}

    def surrogate(self, draw: TMCDraw) -> torch.Tensor:
        names = list(draw.leaves)
        sources = self.weight_sources(draw, names)
        log_p = draw.log_estimate(sources)
        inputs = list(draw.leaves.values()) + list(sources.values())
        if not inputs:  # no reparameterised guide latent: the plain gradient is all there is
            return log_p
        # retain: the plain bound below reuses the model's and guide's networks' graph
        grads = torch.autograd.grad(log_p, inputs, allow_unused=True, retain_graph=True)
        value_grads = dict(zip(draw.leaves, grads[: len(draw.leaves)]))
        weights = event_dims = None
        if sources:
            weights = source_weights(sources, grads[len(draw.leaves) :], draw.carried_scale)
            event_dims = {name: draw.live_trace.nodes[name]["fn"].event_dim for name in names}
        live_values = {name: draw.live_trace.nodes[name]["value"] for name in names}
        # Model parameters: log P with the guide's density stopped and its particles as leaves.
        plain = draw.log_estimate(detach_guide_proposals=True)
        return plain + path_surrogate(live_values, value_grads, weights, event_dims)


@register_estimator("dregs")
class DReGs(StickingTheLanding):
    """
    Doubly reparameterised gradients (Tucker et al. 2018), unbiased for TMC:
    each particle's path gradient weighted by its own posterior marginal.
    Exact for guides whose sites do not depend on upstream particles.
    """

    def leaf_sites(self, live_trace: Trace) -> list[str]:
        names = reparameterised_latents(live_trace, self.name)
        check_factorised(live_trace, names)
        return names

    def weight_sources(self, draw: TMCDraw, names: list[str]) -> dict[str, torch.Tensor]:
        return draw.sources(names)


@register_estimator("rws")
class WakeSleep(GradientEstimator):
    """
    Reweighted wake-sleep on the TMC posterior: wake-theta for the model (log
    P_TMC with the particles held fixed and the guide's density stopped),
    wake-phi for the guide (``sum_k stop(m_j^k) log q_j(z_j^k)``).
    """

    uses_leaves = True
    leaves_require_grad = False

    def leaf_sites(self, live_trace: Trace) -> list[str]:
        return [name for name, site in live_trace.nodes.items() if is_drawn(site)]

    def surrogate(self, draw: TMCDraw) -> torch.Tensor:
        sources = draw.sources(list(draw.leaves))
        wake_theta = draw.log_estimate(sources, detach_guide_proposals=True)
        if not sources:
            return wake_theta
        # d log P / d source = the marginal weights times the scale of the site's
        # factor, which is the scale the guide's log-density terms need too.
        scaled = torch.autograd.grad(wake_theta, list(sources.values()), retain_graph=True)
        wake_phi = 0.0
        for name, weight in zip(sources, scaled):
            site = draw.guide_trace.nodes[name]
            log_q = proposal_log_prob(site["fn"], site["value"], particle_draw(site))
            wake_phi = wake_phi + (weight.detach() * log_q).sum()
        return wake_theta + wake_phi - wake_phi.detach()
