"""Losses and read-outs built on the TMC contraction."""

from .tmc_elbo import TMC_ELBO

__all__ = ["TMC_ELBO"]
