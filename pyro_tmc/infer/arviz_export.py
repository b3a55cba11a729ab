"""Posterior draws as an ArviZ ``InferenceData``, so that ``az.summary``, ``az.loo``, ``az.waic`` and
ArviZ's plots read a TMC posterior as they read an MCMC run.

ArviZ wants every variable shaped ``(chain, draw, *shape)``. TMC's equal-weight draws (resampled
from the weighted particles) are exchangeable, so splitting them into chains is only bookkeeping;
with one chain ArviZ takes the draws as independent (``r_eff = 1`` in ``az.loo``), which they are.

ArviZ is an optional dependency (``pip install pyro_tmc[posterior]``), imported only when called.

Reference: R. Kumar, C. Carroll, A. Hartikainen, O. Martin (2019), "ArviZ a unified library for
exploratory analysis of Bayesian models in Python", JOSS 4(33), 1143.
"""

from typing import Optional

import numpy as np
import torch

INSTALL_HINT = "pip install pyro_tmc[posterior]"


def to_inference_data(
    samples: dict[str, torch.Tensor],
    log_likelihood: Optional[dict[str, torch.Tensor]] = None,
    sample_stats: Optional[dict[str, torch.Tensor]] = None,
    observed_data: Optional[dict[str, torch.Tensor]] = None,
    num_chains: int = 1,
    coords: Optional[dict] = None,
    dims: Optional[dict[str, list[str]]] = None,
):
    """
    An :class:`arviz.InferenceData` of equal-weight posterior draws.

    Example::

        idata = to_inference_data({"mu": mu_draws}, log_likelihood={"y": log_lik}, observed_data={"y": y})
        az.summary(idata), az.loo(idata)

    :param dict samples: site name -> ``(num_draws, *site_shape)`` tensor of equal-weight posterior
        draws (the ``posterior`` group).
    :param dict log_likelihood: observed site name -> ``(num_draws, *obs_shape)`` pointwise
        log-likelihood of each draw (the ``log_likelihood`` group, which ``az.loo`` and ``az.waic``
        read; name it as the observed site, so that its dims match ``observed_data``'s).
    :param dict sample_stats: statistic name -> ``(num_draws,)`` tensor (``sample_stats``; ArviZ knows
        ``lp`` and ``log_likelihood`` among others).
    :param dict observed_data: observed site name -> tensor of the data, no draw dim.
    :param int num_chains: the draws are split, in order, into this many chains of
        ``num_draws / num_chains`` draws (it must divide ``num_draws``).
    :param dict coords: coordinate values of named dims, passed to :func:`arviz.from_dict`.
    :param dict dims: variable name -> names of its dims after ``(chain, draw)``, passed to
        :func:`arviz.from_dict` (ArviZ's default: ``<name>_dim_<i>``).
    :returns: the ``InferenceData``, with the groups given (``posterior`` always).
    :rtype: arviz.InferenceData
    :raises ImportError: without ArviZ.
    :raises ValueError: on draw counts that differ between variables or that ``num_chains`` does not divide.
    """
    az = _import_arviz()
    if not samples:
        raise ValueError("to_inference_data: samples is empty; pass at least one site's draws.")
    num_draws = _count_draws(samples, log_likelihood or {}, sample_stats or {})
    if num_chains < 1 or num_draws % num_chains:
        raise ValueError(
            f"to_inference_data: num_chains={num_chains} does not divide the {num_draws} draws; "
            "pass a number of draws that is a multiple of num_chains."
        )
    return az.from_dict(
        posterior=_by_chain(samples, num_chains),
        log_likelihood=_by_chain(log_likelihood, num_chains),
        sample_stats=_by_chain(sample_stats, num_chains),
        observed_data=None
        if observed_data is None
        else {name: _numpy(v) for name, v in observed_data.items()},
        coords=coords,
        dims=dims,
    )


def _import_arviz():
    try:
        import arviz
    except ImportError as error:
        raise ImportError(f"to_inference_data needs ArviZ: {INSTALL_HINT}") from error
    return arviz


def _count_draws(*groups: dict[str, torch.Tensor]) -> int:
    """The common leading size of every variable of every group; a ValueError naming any that differs."""
    sizes = {name: tuple(np.shape(value))[:1] for group in groups for name, value in group.items()}
    first_name, num_draws = next(iter(sizes.items()))
    for name, size in sizes.items():
        if not size or size != num_draws:
            raise ValueError(
                f"to_inference_data: {name!r} has {size[0] if size else 'no'} draws (its leading dim), "
                f"{first_name!r} has {num_draws[0] if num_draws else 'none'}; every variable needs the "
                "draws as its first dim, the same number for all."
            )
    return num_draws[0]


def _by_chain(group: Optional[dict[str, torch.Tensor]], num_chains: int) -> Optional[dict[str, np.ndarray]]:
    """Each ``(num_draws, *shape)`` variable as a ``(num_chains, num_draws / num_chains, *shape)`` array."""
    if not group:
        return None
    return {
        name: _numpy(value).reshape((num_chains, -1) + tuple(np.shape(value)[1:]))
        for name, value in group.items()
    }


def _numpy(value) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)
