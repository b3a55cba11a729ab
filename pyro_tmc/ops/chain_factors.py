"""Chains of pairwise factors among packed log factors, each contracted as one chain product.

A ``pyro.markov`` model ``z_1 - z_2 - ... - z_N`` gives pairwise factors over
neighbouring particle dims. :func:`find_chains` finds such chains in a draw's packed
factors; :func:`reduce_chains` replaces each by one factor between its two ends: the
links stacked, each with the unary factors of the dim it leads to, multiplied in
``O(log N)`` depth by :func:`~pyro_tmc.ops.chains.chain_product`. Links that are
slices of one stacked tensor (:data:`StackedSlices`) are taken in one operation per stack.
"""

import functools
from collections import defaultdict
from typing import NamedTuple, Optional

import torch

from pyro_tmc.ops.chains import chain_product
from pyro_tmc.ops.shapes import packed_view

#: ``id(term) -> (term, stack, index)`` for the packed factors that are ``stack[index]`` of a stack
#: of log factors (:class:`pyro_tmc.estimate.batched_densities.SiteDensities`), so that the contraction
#: can take many such slices at once. Each entry holds its factor, which keeps its id unique.
StackedSlices = dict[int, tuple[torch.Tensor, torch.Tensor, int]]


def stacked_slice(term: torch.Tensor, stacks: Optional[StackedSlices]) -> Optional[tuple[torch.Tensor, int]]:
    """``(stack, index)`` if ``stacks`` says that ``term`` is ``stack[index]``, else ``None``."""
    entry = None if stacks is None else stacks.get(id(term))
    return None if entry is None or entry[0] is not term else entry[1:]


#: the shortest chain worth a tree: below this, the sequential contraction is as fast
MIN_CHAIN_LENGTH = 4


class ChainStructure(NamedTuple):
    """The factors' layout as a graph over particle dims (see :func:`chain_structure`)."""

    own: list[frozenset]  # each factor's particle dims
    plate_sets: list[frozenset]  # each factor's plate dims
    holders: dict[str, list[int]]  # dim -> the factors holding it
    pairs: dict[frozenset, list[int]]  # pair of dims -> the factors over exactly those two
    unary: dict[str, list[int]]  # dim -> the factors over it alone
    sizes: dict[str, int]  # dim -> its length


def chain_structure(factors: list[torch.Tensor], plates: frozenset) -> ChainStructure:
    """The factors' layout as a graph over particle dims, read once for finding and reducing chains."""
    own = [frozenset(t._pyro_dims) - plates for t in factors]
    holders: dict[str, list[int]] = defaultdict(list)
    pairs: dict[frozenset, list[int]] = defaultdict(list)
    unary: dict[str, list[int]] = defaultdict(list)
    for i, dims in enumerate(own):
        for d in dims:
            holders[d].append(i)
        if len(dims) == 2:
            pairs[dims].append(i)
        elif len(dims) == 1:
            unary[next(iter(dims))].append(i)
    plate_sets = [plates.intersection(t._pyro_dims) for t in factors]
    sizes = {d: n for t in factors for d, n in zip(t._pyro_dims, t.shape)}
    return ChainStructure(own, plate_sets, holders, pairs, unary, sizes)


def find_chains(
    factors: list[torch.Tensor], plates: frozenset, structure: Optional[ChainStructure] = None
) -> list[tuple]:
    """
    Chains ``z_1 - z_2 - ... - z_N`` of pairwise factors: each inner dim is held
    only by factors over it and its two neighbours, or over it alone (unary), all
    in one plate set, with one particle count along the chain.

    :param structure: :func:`chain_structure` of the factors, if already computed.
    :returns: ``(nodes, plate_set)`` per chain of at least :data:`MIN_CHAIN_LENGTH` links.
    """
    own, plate_sets, holders, pairs, _, sizes = structure or chain_structure(factors, plates)

    def neighbours(dim: str, plate_set: frozenset) -> Optional[set]:
        """The two neighbours of an inner dim, or ``None`` where the dim cannot be inner."""
        held = holders[dim]
        if any(len(own[i]) > 2 or plate_sets[i] != plate_set for i in held):
            return None
        found = {d for i in held for d in own[i]} - {dim}
        return found if len(found) == 2 else None

    used, chains = set(), []
    for pair in list(pairs):
        plate_set = plate_sets[pairs[pair][0]]
        if pair in used or any(plate_sets[i] != plate_set for i in pairs[pair]):
            continue
        nodes = sorted(pair)
        for grow_right in (True, False):  # extend from both ends through inner dims
            while True:
                end, previous = (nodes[-1], nodes[-2]) if grow_right else (nodes[0], nodes[1])
                found = neighbours(end, plate_set)
                if found is None:
                    break
                (following,) = found - {previous}
                if following in nodes or frozenset((end, following)) in used:
                    break  # a cycle, or a link another chain took
                nodes = nodes + [following] if grow_right else [following] + nodes
        links = [frozenset(p) for p in zip(nodes, nodes[1:])]
        used.update(links)
        if len(links) >= MIN_CHAIN_LENGTH and len({sizes[d] for d in nodes}) == 1:
            chains.append((nodes, plate_set))
    return chains


def reduce_chains(
    factors: list[torch.Tensor], plates: frozenset, stacks: Optional[StackedSlices] = None
) -> list[torch.Tensor]:
    """
    Contract every chain of pairwise factors (``pyro.markov`` models: z_1 - z_2 - ... - z_N)
    in O(log N) depth (:func:`find_chains`): the links are stacked, each with the
    unary factors of the dim it leads to added, and multiplied by a balanced tree of
    log-matmul-exps (:func:`~pyro_tmc.ops.chains.chain_product`). The
    chain is replaced by one factor between its two ends; the ends' unary factors
    stay. Factors that are slices of one stacked tensor (the links' densities,
    evaluated together: :mod:`pyro_tmc.estimate.batched_densities`) are taken in one
    operation per stack, not one per link (``stacks``: :data:`StackedSlices`).
    """
    plates = frozenset(plates)
    structure = chain_structure(factors, plates)
    chains = find_chains(factors, plates, structure)
    if not chains:
        return factors
    pairs, unary, sizes = structure.pairs, structure.unary, structure.sizes
    replaced, products = set(), []
    for nodes, plate_set in chains:
        batch = sorted(plate_set)
        count = len(nodes) - 1
        link_items = [(j, i) for j in range(count) for i in pairs[frozenset(nodes[j : j + 2])]]
        links = _gather_rows(
            factors, link_items, count, functools.partial(_link_dims, batch, nodes), sizes, stacks
        )
        # a link z_j -> z_{j+1} takes the unary factors of z_{j+1} when that dim is inner
        unary_items = [(j, i) for j in range(count - 1) for i in unary[nodes[j + 1]]]
        if unary_items:
            rows = _gather_rows(
                factors, unary_items, count, functools.partial(_head_dims, batch, nodes), sizes, stacks
            )
            links = links + rows.unsqueeze(-2)  # a new tensor: links may be a view of the densities
        product = chain_product(links, dim=0)  # links (links, plates..., K, K)
        product._pyro_dims = "".join(batch) + nodes[0] + nodes[-1]
        products.append(product)
        replaced.update(i for _, i in link_items + unary_items)
    return [t for i, t in enumerate(factors) if i not in replaced] + products


def _link_dims(batch: list[str], nodes: list[str], j: int) -> list[str]:
    """The dims of link ``j`` of a chain over ``nodes``: its plates, then ``z_j, z_{j+1}``."""
    return batch + nodes[j : j + 2]


def _head_dims(batch: list[str], nodes: list[str], j: int) -> list[str]:
    """The dims of the unary factors that link ``j`` takes: its plates, then ``z_{j+1}``."""
    return batch + [nodes[j + 1]]


def _gather_rows(
    factors: list[torch.Tensor],
    items: list[tuple[int, int]],
    count: int,
    dims_of,
    sizes: dict[str, int],
    stacks: Optional[StackedSlices] = None,
) -> torch.Tensor:
    """
    The sum, per row ``j`` of a new leading dim of length ``count``, of the factors
    ``i`` listed as ``(j, i)``, each arranged with the dims ``dims_of(j)``. Slices of
    one stacked tensor with the same arrangement are taken together, by one slice of
    the stack; the rest are arranged one by one and stacked.
    """
    by_stack: dict[tuple, list[tuple[int, int, torch.Tensor]]] = defaultdict(list)
    loose: list[tuple[int, torch.Tensor]] = []
    for j, i in items:
        term, order = factors[i], dims_of(j)
        where = stacked_slice(term, stacks)
        if where is not None and all(d in term._pyro_dims for d in order) and len(order) == term.dim():
            stack, index = where
            permutation = tuple(term._pyro_dims.index(d) for d in order)
            by_stack[(id(stack), permutation)].append((j, index, stack))
        else:
            shape = [sizes[d] for d in order]
            loose.append((j, packed_view(term, order).expand(shape)))
    parts: list[tuple[list[int], torch.Tensor]] = []
    for (_, permutation), members in by_stack.items():
        part = _take_rows(members[0][2], [index for _, index, _ in members])
        parts.append(([j for j, _, _ in members], part.permute((0,) + tuple(p + 1 for p in permutation))))
    if loose:
        parts.append(([j for j, _ in loose], torch.stack([t for _, t in loose])))
    return _place_rows(parts, count)


def _place_rows(parts: list[tuple[list[int], torch.Tensor]], count: int) -> torch.Tensor:
    """
    A tensor with ``count`` rows, the sum of ``part[k]`` placed at row ``rows[k]``
    for each ``(rows, part)``: one part covering every row in order is returned as
    it is; otherwise the parts are added into one new buffer in place (one buffer,
    not one per part: a chain's links are tens of megabytes at large K).
    """
    (rows, part), rest = parts[0], parts[1:]
    if not rest and rows == list(range(count)):
        return part
    total = part.new_zeros((count,) + tuple(part.shape[1:]))
    for rows, part in parts:
        where = _as_slice(rows)
        if where is not None:
            total[where] += part
        else:  # uneven rows (rare): one at a time
            for k, row in enumerate(rows):
                total[row] += part[k]
    return total


def _as_slice(indices: list[int]) -> Optional[slice]:
    """The indices as a slice, where they step evenly upwards (the links of a chain do)."""
    step = indices[1] - indices[0] if len(indices) > 1 else 1
    if step > 0 and all(b - a == step for a, b in zip(indices, indices[1:])):
        return slice(indices[0], indices[-1] + 1, step)
    return None


# Rows are taken and placed by slices, or one by one, never through an index tensor:
# made here, it would be a constant in a traced graph (pyro_tmc.compile.compiled), which
# refuses constants.


def _take_rows(stack: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """``stack[indices]``."""
    where = _as_slice(indices)
    if where is not None:
        return stack[where]
    return torch.stack([stack[i] for i in indices])


__all__ = [
    "MIN_CHAIN_LENGTH",
    "ChainStructure",
    "StackedSlices",
    "chain_structure",
    "find_chains",
    "reduce_chains",
    "stacked_slice",
]
