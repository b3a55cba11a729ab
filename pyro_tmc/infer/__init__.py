"""Losses and read-outs built on the TMC contraction."""

from .iwae_elbo import IWAE_ELBO
from .moments import PooledMoments, PosteriorMoments, posterior_moments
from .predictive import PosteriorDraws, PredictiveLogLikelihood, posterior_draws, predictive_log_likelihood
from .qem import QEM, QEMGuide
from .rws import TMC_RWS
from .tmc_elbo import TMC_ELBO

__all__ = [
    "IWAE_ELBO",
    "PooledMoments",
    "PosteriorDraws",
    "PosteriorMoments",
    "PredictiveLogLikelihood",
    "QEM",
    "QEMGuide",
    "TMC_ELBO",
    "TMC_RWS",
    "posterior_draws",
    "posterior_moments",
    "predictive_log_likelihood",
]
