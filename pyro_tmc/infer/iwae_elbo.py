"""IWAE_ELBO: the importance-weighted bound with K joint samples, the baseline beside TMC_ELBO."""

import dataclasses
from typing import Optional

from pyro_tmc.infer.draw import DrawSettings, TMCDraw
from pyro_tmc.infer.tmc_elbo import TMC_ELBO
from pyro_tmc.poutine.sites import particle_draw


class IWAE_ELBO(TMC_ELBO):
    """
    The importance-weighted bound [1] with ``num_samples`` joint samples:
    ``log 1/K sum_k p(x, z^k) / q(z^k)``, with ``z^k`` a whole draw of the guide.
    Latent sites of the model absent from the guide are drawn from the prior,
    which cancels from the weight.

    It is a TMC draw in which every latent shares one particle dim (K joint
    samples rather than K per site, :class:`~pyro_tmc.infer.draw.DrawSettings`
    ``joint``), so it has the same estimators and read-outs as
    :class:`~pyro_tmc.TMC_ELBO`; model sites marked for parallel enumeration
    are still summed exactly.

    :param int num_samples: K, the joint samples.
    :param int max_plate_nesting: as in every Pyro ELBO; guessed if omitted.
    :param str variance_reduction: ``None``, ``"stl"`` (sticking the landing [2])
        or ``"dregs"`` (doubly reparameterised gradients [3]); both change the
        guide parameters' gradient only.
    :param int num_particles: independent bounds averaged in the loss.
    :param bool vectorize_particles: compute them in one vectorised pass.
    :raises NotImplementedError: for a latent that is not reparameterisable
        (:class:`~pyro_tmc.TMC_ELBO` gives those score-function terms).

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
        variance_reduction: Optional[str] = None,
        num_particles: int = 1,
        vectorize_particles: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(
            num_samples=num_samples,
            max_plate_nesting=max_plate_nesting,
            variance_reduction=variance_reduction,
            num_particles=num_particles,
            vectorize_particles=vectorize_particles,
            **kwargs,
        )

    def _settings(self) -> DrawSettings:
        return dataclasses.replace(super()._settings(), joint=True)

    def _checked(self, draw: TMCDraw) -> TMCDraw:
        for trace, where in ((draw.guide_trace, "in the guide"), (draw.model_trace, "drawn from the prior")):
            for name, site in trace.nodes.items():
                if particle_draw(site) is not None and not site["fn"].has_rsample:
                    raise NotImplementedError(
                        f"IWAE_ELBO needs reparameterised latents, but site '{name}' ({where}) "
                        "is not. Use TMC_ELBO, which gives such sites unbiased score-function terms."
                    )
        return draw
