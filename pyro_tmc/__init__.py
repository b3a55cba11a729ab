"""pyro_tmc: Tensor Monte Carlo (Aitchison, 2019) for Pyro."""

__version__ = "0.1.0"

from .infer import TMC_ELBO  # noqa: E402

__all__ = ["TMC_ELBO", "__version__"]
