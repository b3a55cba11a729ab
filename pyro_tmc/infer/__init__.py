"""Losses and read-outs built on the TMC contraction."""

from .iwae_elbo import IWAE_ELBO
from .rws import TMC_RWS
from .tmc_elbo import TMC_ELBO

__all__ = ["IWAE_ELBO", "TMC_ELBO", "TMC_RWS"]
