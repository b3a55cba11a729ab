"""pyro_tmc: Tensor Monte Carlo (Aitchison, 2019) for Pyro."""

__version__ = "0.1.0"

from .infer import IWAE_ELBO, QEM, TMC_ELBO, TMC_RWS, QEMGuide  # noqa: E402

__all__ = ["IWAE_ELBO", "QEM", "QEMGuide", "TMC_ELBO", "TMC_RWS", "__version__"]
