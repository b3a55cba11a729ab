"""Contracting packed log factors to the TMC estimate, over Pyro's contraction machinery.

Every factor is a packed tensor (``._pyro_dims`` names its dims: particle dims,
which are summed, and plate dims, which are multiplied). The estimate is

    log P_TMC = log sum_{all particle dims} prod_{plates} prod_{factors} exp(factor)

computed by :func:`pyro.ops.contract.contract_to_tensor` in log space
(``LogRing``: ``logsumexp`` for sums, by the einsum backend
:mod:`pyro_tmc.ops.log_einsum`, the paper's logmmexp, and ``sum`` for plate
products), with opt_einsum contraction paths cached by :mod:`pyro.ops.einsum`.

The steps, each in its own module: a factor too large to hold is summed out slice by
slice first (:mod:`pyro_tmc.ops.chunked`); chains of pairwise factors are contracted
as chain products (:mod:`pyro_tmc.ops.chain_factors`); the rest by Pyro's ring, with
subsampled plates scaled at the plate product (:mod:`pyro_tmc.ops.ring`). One global
sum (IWAE's joint samples) skips the planning.
"""

import math
from collections.abc import Sequence
from typing import Optional, Union

import torch

from pyro_tmc.ops.chain_factors import MIN_CHAIN_LENGTH, StackedSlices, reduce_chains
from pyro_tmc.ops.chunked import ChunkedFactor, eliminate_in_chunks, next_to_eliminate
from pyro_tmc.ops.memory import mark_contraction_step
from pyro_tmc.ops.ring import contract_packed, fuse_factors
from pyro_tmc.ops.underflow import logsumexp_to_precision


def contract_log_factors(
    factors: Sequence[Union[torch.Tensor, ChunkedFactor]],
    plate_scales: dict[str, float],
    stacks: Optional[StackedSlices] = None,
) -> torch.Tensor:
    """
    Sum out every particle dim and multiply out every plate dim of the packed
    log ``factors``.

    :param factors: packed log factors; a :class:`~pyro_tmc.ops.chunked.ChunkedFactor` is eliminated
        slice by slice first (:func:`~pyro_tmc.ops.chunked.eliminate_in_chunks`).
    :param dict plate_scales: every plate symbol that may occur, with its
        subsampling scale (1.0 when not subsampled).
    :param stacks: the factors that are slices of one stacked tensor
        (:data:`~pyro_tmc.ops.chain_factors.StackedSlices`): a chain's links are then taken in one operation
        per stack (:func:`~pyro_tmc.ops.chain_factors.reduce_chains`).
    :returns: a scalar tensor, the log of the contracted sum-product.
    """
    pending = [f for f in factors if isinstance(f, ChunkedFactor)]
    tensors = [f for f in factors if not isinstance(f, ChunkedFactor)]
    while pending:
        chunked = pending.pop(next_to_eliminate(pending))
        try:
            remaining = eliminate_in_chunks(chunked, tensors + pending, plate_scales)
        except RuntimeError as error:  # an allocation failing: say which particles the message sums
            mark_contraction_step(error, chunked.dims)
            raise
        pending = [f for f in remaining if isinstance(f, ChunkedFactor)]
        tensors = [f for f in remaining if not isinstance(f, ChunkedFactor)]
    if not tensors:  # no factors at all (an empty model and guide): log 1
        return torch.zeros(())
    try:
        return _contract_whole(tensors, plate_scales, stacks)
    except RuntimeError as error:  # an allocation failing outside a marked step: every dim left
        mark_contraction_step(error, "".join(t._pyro_dims for t in tensors))
        raise


def _contract_whole(
    tensors: list[torch.Tensor], plate_scales: dict[str, float], stacks: Optional[StackedSlices]
) -> torch.Tensor:
    """:func:`contract_log_factors` of whole factors (no chunked factor left)."""
    plates = frozenset(plate_scales)
    sum_dims = set("".join(t._pyro_dims for t in tensors)) - plates
    if _is_one_global_sum(tensors, sum_dims, plates):
        return _contract_one_global_sum(tensors, sum_dims, plate_scales)
    # chains first: their links and the unary factors of their inner dims go into one tree
    if len(sum_dims) > MIN_CHAIN_LENGTH:  # else too few dims for a chain's links: skip the search
        tensors = reduce_chains(tensors, plates, stacks)
    tensors = fuse_factors(tensors, plates)
    sum_dims = set("".join(t._pyro_dims for t in tensors)) - plates
    return contract_packed(tensors, plate_scales, sum_dims)


def _is_one_global_sum(tensors, sum_dims, plates) -> bool:
    """
    At most one particle dim, summed outside every plate (a factor holds it and
    no plate): IWAE's joint samples, or a model with one global latent.
    """
    if not sum_dims:
        return True
    if len(sum_dims) > 1:
        return False
    (dim,) = sum_dims
    return any(dim in t._pyro_dims and not plates.intersection(t._pyro_dims) for t in tensors)


def _contract_one_global_sum(tensors, sum_dims, plate_scales) -> torch.Tensor:
    """
    ``log sum_k prod_f prod_plates exp(f)``: each factor's plate products are
    sums of logs (scaled by the plates' scales), then one logsumexp over k, to the
    dtype's precision (:func:`~pyro_tmc.ops.underflow.logsumexp_to_precision`). The
    same value as the general contraction, without its planning.
    """
    total = 0.0
    for term in tensors:
        dims = term._pyro_dims
        positions = [i for i, d in enumerate(dims) if d in plate_scales]
        if positions:
            scale = math.prod(plate_scales[dims[i]] for i in positions)
            term = term.sum(positions)
            term = term * scale if scale != 1.0 else term
        total = total + term.reshape(-1) if sum_dims else total + term
    if not sum_dims:
        return total if isinstance(total, torch.Tensor) else torch.zeros(())
    # the joint samples' log weights lie far apart: exact weights would be subnormal
    return logsumexp_to_precision(total, [0])


__all__ = ["contract_log_factors"]
