"""Losses and read-outs built on the TMC contraction."""

from pyro_tmc.infer.iwae_elbo import IWAE_ELBO
from pyro_tmc.infer.moments import PooledMoments, PosteriorMoments, posterior_moments
from pyro_tmc.infer.predictive import (
    PosteriorDraws,
    PredictiveLogLikelihood,
    posterior_draws,
    predictive_log_likelihood,
)
from pyro_tmc.infer.qem import QEM, QEMGuide
from pyro_tmc.infer.rws import TMC_RWS
from pyro_tmc.infer.tmc_elbo import TMC_ELBO

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
