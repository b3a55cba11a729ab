"""Pyro's log-space ring with subsampled plates, and one contraction of packed log factors over it.

:func:`contract_packed` contracts packed log factors (``._pyro_dims`` names each
factor's dims: particle dims, summed, and plate dims, multiplied) by
:func:`pyro.ops.contract.contract_to_tensor` in log space: ``logsumexp`` for sums,
by this package's einsum backend (:mod:`pyro_tmc.ops.log_einsum`, the paper's
logmmexp, which never underflows), and ``sum`` for plate products, with
opt_einsum contraction paths cached by :mod:`pyro.ops.einsum`.

One change to Pyro's ring (:class:`PlateScaledLogRing`): subsampled plates. A site
in a plate of full size N subsampled to B contributes ``(N / B) * log(sum over its
particles)`` per element; Pyro scales the log-factors instead, which is wrong once
particle dims are summed inside the plate. We scale at the plate product, where the
scaling belongs.
"""

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch
from opt_einsum import shared_intermediates

from pyro.ops.contract import contract_to_tensor
from pyro.ops.rings import LogRing

from pyro_tmc.ops.memory import mark_contraction_step
from pyro_tmc.ops.shapes import packed_view
from pyro_tmc.ops.underflow import safe_logsumexp


class PlateScaledLogRing(LogRing):
    """
    :class:`~pyro.ops.rings.LogRing` whose product over a plate is multiplied
    by that plate's subsampling scale (full size / subsample size).

    :param dict plate_scales: plate symbol -> scale.
    """

    #: Pyro's log-space einsum in plain tensor operations, so that a traced graph keeps its gradient
    _backend = "pyro_tmc.ops.log_einsum"

    def __init__(self, cache=None, dim_to_size=None, plate_scales=None):
        super().__init__(cache=cache, dim_to_size=dim_to_size)
        self._plate_scales = {} if plate_scales is None else plate_scales

    def sumproduct(self, terms, dims):
        try:
            return self._sumproduct(terms, dims)
        except RuntimeError as error:  # an allocation failing: say which particles this step sums
            mark_contraction_step(error, "".join(t._pyro_dims for t in terms))
            raise

    def _sumproduct(self, terms, dims):
        if len(terms) == 1:  # a plain reduction: cheaper than a log-space einsum
            (term,) = terms
            positions = [i for i, d in enumerate(term._pyro_dims) if d in dims]
            if not positions:
                return term
            result = safe_logsumexp(term, positions)
            result._pyro_dims = "".join(d for d in term._pyro_dims if d not in dims)
            return result
        return super().sumproduct(terms, dims)

    def product(self, term, ordinal):
        # Pyro's product, one plate at a time, each scaled by its subsampling scale.
        for dim in sorted(ordinal, reverse=True):
            if dim not in term._pyro_dims:
                continue
            term = super().product(term, frozenset(dim))
            scale = self._plate_scales.get(dim, 1.0)
            if scale != 1.0:
                dims = term._pyro_dims
                term = term * scale
                term._pyro_dims = dims
        return term


def _add(big: torch.Tensor, small: torch.Tensor) -> torch.Tensor:
    total = big + packed_view(small, big._pyro_dims)
    total._pyro_dims = big._pyro_dims
    return total


def fuse_factors(factors: Sequence[torch.Tensor], plates: Iterable[str]) -> list[torch.Tensor]:
    """
    Add factors together where that costs nothing extra (a product of exps is
    the exp of a sum), so that the contraction sees fewer terms: first factors
    over the same dims (cheap, small adds), then each group into the smallest
    group that holds all of its dims and the same plates. The result contracts
    to the same value.
    """
    plates = frozenset(plates)
    groups: dict[frozenset, torch.Tensor] = {}
    for term in factors:
        key = frozenset(term._pyro_dims)
        groups[key] = _add(groups[key], term) if key in groups else term
    fused: list[torch.Tensor] = []
    fused_dims: list[frozenset] = []
    holding: dict[str, list[int]] = {}  # dim -> the fused terms that hold it (a host holds every dim)
    for key in sorted(groups, key=lambda k: -groups[k].numel()):
        term = groups[key]
        # Only the terms holding the key's rarest dim can host it: a lookup, not a scan of all.
        candidates = min((holding.get(d, []) for d in key), key=len) if key else range(len(fused))
        hosts = [i for i in candidates if key <= fused_dims[i] and plates & key == plates & fused_dims[i]]
        if hosts:
            i = min(hosts, key=lambda i: fused[i].numel())
            fused[i] = _add(fused[i], term)
        else:
            for d in key:
                holding.setdefault(d, []).append(len(fused))
            fused.append(term)
            fused_dims.append(key)
    return fused


def contract_packed(factors, plate_scales, sum_dims, target_ordinal=frozenset(), target_dims=frozenset()):
    """
    Pyro's ``contract_to_tensor`` of packed log ``factors`` under :class:`PlateScaledLogRing`:
    ``sum_dims`` summed out, plates multiplied out but those of ``target_ordinal``, the
    particle dims ``target_dims`` kept.
    """
    plates = frozenset(plate_scales)
    dim_to_size: dict[str, int] = {}
    tensor_tree: OrderedDict[frozenset, list[torch.Tensor]] = OrderedDict()
    for term in factors:
        dim_to_size.update(zip(term._pyro_dims, term.shape))
        tensor_tree.setdefault(plates.intersection(term._pyro_dims), []).append(term)
    with shared_intermediates() as cache:
        ring = PlateScaledLogRing(cache, dim_to_size=dim_to_size, plate_scales=plate_scales)
        return contract_to_tensor(
            tensor_tree, set(sum_dims), target_ordinal=target_ordinal, target_dims=set(target_dims), ring=ring
        )


__all__ = ["PlateScaledLogRing", "contract_packed", "fuse_factors"]
