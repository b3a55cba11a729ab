"""Reweighted wake-sleep on the TMC posterior (Bornschein & Bengio 2015; Le et al. 2019)."""

from typing import Optional

from pyro_tmc.infer.estimators import make_estimator
from pyro_tmc.infer.tmc_elbo import TMC_ELBO


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
    the sum of the two updates (model and guide parameters are disjoint). It is
    :class:`TMC_ELBO` with the ``"rws"`` estimator
    (:class:`~pyro_tmc.infer.estimators.WakeSleep`); arguments are
    :class:`TMC_ELBO`'s, except ``variance_reduction``.

    References

    [1] Bornschein, Bengio (2015) "Reweighted Wake-Sleep".
    [2] Le, Kosiorek, Siddharth, Teh, Wood (2019) "Revisiting Reweighted Wake-Sleep
        for Models with Stochastic Control Flow".
    [3] Aitchison (2019) "Tensor Monte Carlo: Particle Methods for the GPU Era".
    """

    def __init__(
        self,
        num_samples: int = 8,
        max_plate_nesting: float = float("inf"),
        proposal: str = "mixture",
        num_particles: int = 1,
        vectorize_particles: bool = False,
        **kwargs,
    ) -> None:
        if "variance_reduction" in kwargs:
            raise ValueError(
                "TMC_RWS takes no variance_reduction: its guide gradient is the wake-phi update. "
                "Use TMC_ELBO(variance_reduction=...) for STL or DReGs."
            )
        super().__init__(
            num_samples=num_samples,
            max_plate_nesting=max_plate_nesting,
            proposal=proposal,
            num_particles=num_particles,
            vectorize_particles=vectorize_particles,
            **kwargs,
        )

    def _make_estimator(self, variance_reduction: Optional[str]):
        return make_estimator("rws")
