"""Reweighted wake-sleep on the TMC posterior (Bornschein & Bengio 2015; Le et al. 2019)."""

import torch

from ..factors import latent_site, particle_shape
from ..proposals import proposal_log_prob
from .path_gradients import marginal_sources, with_leaf_values
from .tmc_elbo import TMC_ELBO


def sampled_guide_sites(guide_trace):
    """Names of the guide's latent sites that drew particles."""
    return [
        name
        for name, site in guide_trace.nodes.items()
        if site["type"] == "sample" and not site["is_observed"] and "_tmc_draw" in site["infer"]
    ]


class TMC_RWS(TMC_ELBO):
    """
    Reweighted wake-sleep with TMC: the guide is fitted to the posterior that
    a TMC draw implies, so it trains discrete, non-reparameterisable latents
    without score-function gradients.

    - wake-theta: the model's parameters follow the gradient of log P_TMC with
      the particles held fixed (detached) and the guide's density stopped;
    - wake-phi: each guide site j follows the gradient of
      ``sum_k stop(m_j^k) log q_j(z_j^k)``, where ``m_j^k`` is particle k's TMC
      posterior marginal weight (per plate element) and ``q_j`` its proposal
      density indexed by k alone, a self-normalised estimate of
      ``E_{p(z|x)}[log q(z)]``: minimising ``KL(p(z|x) || q(z))``.

    The loss's value is ``-log P_TMC``, as for :class:`TMC_ELBO`; its gradient is
    the sum of the two updates (model and guide parameters are disjoint).
    Arguments are those of :class:`TMC_ELBO`, without ``variance_reduction``.

    References

    [1] Bornschein, Bengio (2015) "Reweighted Wake-Sleep".
    [2] Le, Kosiorek, Siddharth, Teh, Wood (2019) "Revisiting Reweighted Wake-Sleep
        for Models with Stochastic Control Flow".
    [3] Aitchison (2019) "Tensor Monte Carlo: Particle Methods for the GPU Era".
    """

    def __init__(self, num_samples: int = 8, max_plate_nesting: float = float("inf"),
                 proposal: str = "mixture", num_particles: int = 1,
                 vectorize_particles: bool = False, **kwargs) -> None:
        super().__init__(num_samples=num_samples, max_plate_nesting=max_plate_nesting,
                         proposal=proposal, num_particles=num_particles,
                         vectorize_particles=vectorize_particles, **kwargs)

    def _wake_surrogate(self, model, guide, args, kwargs) -> torch.Tensor:
        drawn = self._run_guide(guide, args, kwargs)
        names = sampled_guide_sites(drawn)
        fixed, _ = with_leaf_values(drawn, names, requires_grad=False)
        guide_trace = self._replay_guide(guide, fixed, args, kwargs)
        model_trace = self._run_model(model, guide_trace, args, kwargs)
        model_trace, guide_trace = self._finish(model_trace, guide_trace)

        sites = [latent_site(name, model_trace, guide_trace) for name in names]
        sources = marginal_sources(sites, particle_shape)
        wake_theta = self._log_estimate(model_trace, guide_trace, sources, detach_guide_proposals=True)
        # d log P / d source = the marginal weights, times the plate's subsampling scale,
        # which is the scale the guide's log-density terms need too.
        scaled_marginals = torch.autograd.grad(wake_theta, list(sources.values()), retain_graph=True)
        wake_phi = 0.0
        for name, weight in zip(names, scaled_marginals):
            site = guide_trace.nodes[name]
            log_q = proposal_log_prob(site["fn"], site["value"], site["infer"]["_tmc_draw"])
            wake_phi = wake_phi + (weight.detach() * log_q).sum()
        return wake_theta + wake_phi - wake_phi.detach()

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        """
        :returns: ``-log P_TMC`` (averaged over ``num_particles``) whose gradient is
            the wake-theta update for the model and the wake-phi update for the guide.
        """
        if not torch.is_grad_enabled():
            return super().differentiable_loss(model, guide, *args, **kwargs)
        model, guide, repeats = self._vectorized(model, guide, args, kwargs)
        total = 0.0
        for _ in range(repeats):
            total = total + self._wake_surrogate(model, guide, args, kwargs)
        return -total / self.num_particles
