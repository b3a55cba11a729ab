"""Contracting packed log factors to the TMC estimate, over Pyro's contraction machinery.

Every factor is a packed tensor (``._pyro_dims`` names its dims: particle dims,
which are summed, and plate dims, which are multiplied). The estimate is

    log P_TMC = log sum_{all particle dims} prod_{plates} prod_{factors} exp(factor)

computed by :func:`pyro.ops.contract.contract_to_tensor` in log space
(``LogRing``: ``logsumexp`` for sums via the ``pyro.ops.einsum.torch_log``
backend, which is the paper's logmmexp, and ``sum`` for plate products), with
opt_einsum contraction paths cached by :mod:`pyro.ops.einsum`.

One change to Pyro's ring: subsampled plates. A site in a plate of full size N
subsampled to B contributes ``(N / B) * log(sum over its particles)`` per
element; Pyro scales the log-factors instead, which is wrong once particle dims
are summed inside the plate. We scale at the plate product, where the
scaling belongs.
"""

from collections import OrderedDict
from typing import Dict, Iterable, List, Sequence

import torch
from opt_einsum import shared_intermediates
from pyro.ops.contract import contract_to_tensor
from pyro.ops.rings import LogRing


class PlateScaledLogRing(LogRing):
    """
    :class:`~pyro.ops.rings.LogRing` whose product over a plate is multiplied
    by that plate's subsampling scale (full size / subsample size).

    :param dict plate_scales: plate symbol -> scale.
    """

    def __init__(self, cache=None, dim_to_size=None, plate_scales=None):
        super().__init__(cache=cache, dim_to_size=dim_to_size)
        self._plate_scales = {} if plate_scales is None else plate_scales

    def product(self, term, ordinal):
        dims = term._pyro_dims
        for dim in sorted(ordinal, reverse=True):
            pos = dims.find(dim)
            if pos == -1:
                continue
            key = "product", self._hash_by_id(term), dim
            if key in self._cache:
                term = self._cache[key]
            else:
                scale = self._plate_scales.get(dim, 1.0)
                term = term.sum(pos)
                if scale != 1.0:
                    term = term * scale
                dims = dims.replace(dim, "")
                self._cache[key] = term
                term._pyro_dims = dims
        return term


def _align(term: torch.Tensor, dims: str) -> torch.Tensor:
    """View a packed ``term`` (whose dims are a subset of ``dims``) so it broadcasts against ``dims``."""
    own = [d for d in dims if d in term._pyro_dims]
    aligned = term.permute(*(term._pyro_dims.index(d) for d in own))
    shape = [aligned.shape[own.index(d)] if d in own else 1 for d in dims]
    return aligned.reshape(shape)


def _add(big: torch.Tensor, small: torch.Tensor) -> torch.Tensor:
    total = big + _align(small, big._pyro_dims)
    total._pyro_dims = big._pyro_dims
    return total


def fuse_factors(factors: Sequence[torch.Tensor], plates: Iterable[str]) -> List[torch.Tensor]:
    """
    Add factors together where that costs nothing extra (a product of exps is
    the exp of a sum), so that the contraction sees fewer terms: first factors
    over the same dims (cheap, small adds), then each group into the smallest
    group that holds all of its dims and the same plates. The result contracts
    to the same value.
    """
    plates = frozenset(plates)
    groups: Dict[frozenset, torch.Tensor] = {}
    for term in factors:
        key = frozenset(term._pyro_dims)
        groups[key] = _add(groups[key], term) if key in groups else term
    fused: List[torch.Tensor] = []
    for key in sorted(groups, key=lambda k: -groups[k].numel()):
        term = groups[key]
        hosts = [
            i for i, big in enumerate(fused)
            if key <= set(big._pyro_dims) and plates & key == plates & set(big._pyro_dims)
        ]
        if hosts:
            i = min(hosts, key=lambda i: fused[i].numel())
            fused[i] = _add(fused[i], term)
        else:
            fused.append(term)
    return fused


def contract_log_factors(
    factors: Sequence[torch.Tensor], plate_scales: Dict[str, float]
) -> torch.Tensor:
    """
    Sum out every particle dim and multiply out every plate dim of the packed
    log ``factors``.

    :param factors: packed log factors.
    :param dict plate_scales: every plate symbol that may occur, with its
        subsampling scale (1.0 when not subsampled).
    :returns: a scalar tensor, the log of the contracted sum-product.
    """
    plates = frozenset(plate_scales)
    factors = fuse_factors(factors, plates)
    dim_to_size: Dict[str, int] = {}
    tensor_tree: "OrderedDict[frozenset, List[torch.Tensor]]" = OrderedDict()
    for term in factors:
        dim_to_size.update(zip(term._pyro_dims, term.shape))
        tensor_tree.setdefault(plates.intersection(term._pyro_dims), []).append(term)
    sum_dims = set(dim_to_size) - plates
    with shared_intermediates() as cache:
        ring = PlateScaledLogRing(cache, dim_to_size=dim_to_size, plate_scales=plate_scales)
        result = contract_to_tensor(tensor_tree, sum_dims, ring=ring)
    return result
