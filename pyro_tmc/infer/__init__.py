"""Losses and read-outs built on the TMC contraction."""

from pyro_tmc.infer.adaptation import AdaptationRound, adapt
from pyro_tmc.infer.adaptive_proposal import AdaptiveProposal
from pyro_tmc.infer.diagnostics import (
    effective_sample_size,
    family_khat_threshold,
    khat_threshold,
    pareto_khat,
    psis,
)
from pyro_tmc.infer.fit import fit_posterior
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
from pyro_tmc.infer.tmc_posterior import Diagnostics, TMCPosterior

__all__ = [
    "AdaptationRound",
    "AdaptiveProposal",
    "Diagnostics",
    "IWAE_ELBO",
    "PooledMoments",
    "PosteriorDraws",
    "PosteriorMoments",
    "PredictiveLogLikelihood",
    "QEM",
    "QEMGuide",
    "TMC_ELBO",
    "TMCPosterior",
    "TMC_RWS",
    "adapt",
    "effective_sample_size",
    "family_khat_threshold",
    "fit_posterior",
    "khat_threshold",
    "pareto_khat",
    "posterior_draws",
    "posterior_moments",
    "predictive_log_likelihood",
    "psis",
]
