"""Losses and read-outs built on the TMC contraction."""

from .iwae_elbo import IWAE_ELBO
from .tmc_elbo import TMC_ELBO

__all__ = ["IWAE_ELBO", "TMC_ELBO"]
