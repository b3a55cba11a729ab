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

import functools
import math
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Union

import torch
from opt_einsum import shared_intermediates
from torch.utils.checkpoint import checkpoint

from pyro.ops.contract import contract_to_tensor
from pyro.ops.rings import LogRing

from pyro_tmc.ops.chains import chain_product
from pyro_tmc.ops.memory import mark_contraction_step
from pyro_tmc.ops.shapes import packed_view
from pyro_tmc.ops.underflow import logsumexp_to_precision, safe_logsumexp


@dataclass
class ChunkedFactor:
    """
    A log factor too large to hold at once (a memory budget), produced slice by
    slice along ``symbol``, the particle dim of the site it belongs to, as the
    alan library's Split does.

    :param str site: the site it came from (for error messages).
    :param str dims: the packed dims of the whole factor.
    :param str symbol: the packed dim it is sliced along.
    :param int size: that dim's length.
    :param int chunk: the slice length.
    :param compute: ``(start, stop) -> packed tensor`` of the slice.
    :param int numel: the whole factor's number of elements, if known (0).
    """

    site: str
    dims: str
    symbol: str
    size: int
    chunk: int
    compute: Callable[[int, int], torch.Tensor]
    numel: int = 0

    def ranges(self, min_elements: int = 0) -> list[tuple[int, int]]:
        """
        Slices covering the dim, of ``chunk`` particles or of at least ``min_elements``
        elements where that is more; none of length 1, which packing would squeeze away.
        """
        chunk = self.chunk
        if self.numel and min_elements:
            per_particle = max(self.numel // self.size, 1)
            chunk = max(chunk, -(-min_elements // per_particle))
        bounds = [(a, min(a + chunk, self.size)) for a in range(0, self.size, chunk)]
        if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
            bounds[-2:] = [(bounds[-2][0], bounds[-1][1])]
        return bounds

    def materialise(self) -> torch.Tensor:
        """The whole factor at once."""
        chunks = [self.compute(a, b) for a, b in self.ranges()]
        whole = torch.cat(chunks, chunks[0]._pyro_dims.index(self.symbol))
        whole._pyro_dims = chunks[0]._pyro_dims
        return whole


#: ``id(term) -> (term, stack, index)`` for the packed factors that are ``stack[index]`` of a stack
#: of log factors (:class:`pyro_tmc.estimate.batched_densities.SiteDensities`), so that the contraction
#: can take many such slices at once. Each entry holds its factor, which keeps its id unique.
StackedSlices = dict[int, tuple[torch.Tensor, torch.Tensor, int]]


def stacked_slice(term: torch.Tensor, stacks: Optional[StackedSlices]) -> Optional[tuple[torch.Tensor, int]]:
    """``(stack, index)`` if ``stacks`` says that ``term`` is ``stack[index]``, else ``None``."""
    entry = None if stacks is None else stacks.get(id(term))
    return None if entry is None or entry[0] is not term else entry[1:]


def factor_dims(term: Union[torch.Tensor, ChunkedFactor]) -> str:
    """The packed dims of a factor, whole or chunked."""
    return term.dims if isinstance(term, ChunkedFactor) else term._pyro_dims


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


def _ordinals(dims_of_factors: Sequence[str], plates: frozenset) -> dict[str, frozenset]:
    """Each sum dim's plates: those of every factor (given by its packed dims) that holds it."""
    ordinal: dict[str, frozenset] = {}
    for dims in dims_of_factors:
        own = plates.intersection(dims)
        for dim in set(dims) - plates:
            ordinal[dim] = ordinal.get(dim, own) & own
    return ordinal


def _narrow(term: torch.Tensor, symbol: str, start: int, stop: int) -> torch.Tensor:
    if symbol not in term._pyro_dims:
        return term
    sliced = term.narrow(term._pyro_dims.index(symbol), start, stop - start)
    sliced._pyro_dims = term._pyro_dims
    return sliced


def _contract(factors, plate_scales, sum_dims, target_ordinal=frozenset(), target_dims=frozenset()):
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


class EliminationGroup(NamedTuple):
    """What eliminating one chunked factor's dim takes along (see :func:`elimination_group`)."""

    members: list[int]  # indices of the other factors that join the chunked one
    home: frozenset  # the plates of the eliminated dim: the message's plates
    kept: frozenset  # particle dims the message keeps (held outside the group, or global to home)
    summed: frozenset  # particle dims summed inside the message


def elimination_group(
    lazy: ChunkedFactor,
    others: Sequence[Union[torch.Tensor, ChunkedFactor]],
    plates: frozenset,
    max_message: Optional[int] = None,
) -> EliminationGroup:
    """
    The factors that must join ``lazy`` in a message summing out ``lazy.symbol``,
    and what that message keeps. A message may sum a dim only where no factor
    outside it, chunked ones still pending included, holds that dim (summing it
    there would leave those factors a dim already summed out). It lives in the
    plates of ``lazy.symbol`` (``home``): a dim in any other plate (a latent in a
    nested plate) cannot outlive the product over that plate, so it is summed
    inside and every factor holding it joins; a dim in fewer plates than ``home``
    (a global) is summed after the product over ``home``, so it is kept.

    The smallest such group keeps every dim of ``home``'s own level that a factor
    outside it holds: cheap where those are few, but a message over all of them is
    a product the unchunked contraction never forms (a chunked global that every
    step of a chain reads keeps the whole chain: K^T elements). Where that message
    is larger than ``max_message`` elements, those dims are summed inside too (every
    factor holding them joins; a dim that a pending chunked factor holds is left
    kept, so that no other chunked factor is built whole), as the unchunked
    contraction sums them at that level: the message then keeps only the globals.

    :param others: every other factor, tensors and pending chunked factors.
    :param int max_message: the message size, in elements, above which the larger
        group is taken where its message is smaller; ``None``: the smallest group.
    """
    ordinal = _ordinals([factor_dims(t) for t in others] + [lazy.dims], plates)
    home = ordinal[lazy.symbol]

    def elsewhere(d: str) -> bool:  # in plates other than home: summed inside, always
        return not ordinal[d] <= home

    smallest = _group_summing(lazy, others, plates, ordinal, elsewhere)
    if max_message is None:
        return smallest
    sizes = _dim_sizes([lazy, *others])
    elements = _message_elements(smallest, sizes)
    if elements <= max_message:
        return smallest
    pending = set().union(*(set(t.dims) for t in others if isinstance(t, ChunkedFactor)))

    def not_global(d: str) -> bool:  # and home's own level too, but for pending factors' dims
        return elsewhere(d) or (ordinal[d] == home and d not in pending)

    widest = _group_summing(lazy, others, plates, ordinal, not_global)
    return widest if _message_elements(widest, sizes) < elements else smallest


def _group_summing(
    lazy: ChunkedFactor,
    others: Sequence[Union[torch.Tensor, ChunkedFactor]],
    plates: frozenset,
    ordinal: dict[str, frozenset],
    summed_inside: Callable[[str], bool],
) -> EliminationGroup:
    """
    The group of :func:`elimination_group` that sums ``lazy.symbol`` and every dim of
    its factors for which ``summed_inside`` holds (each such dim brings in every
    factor that holds it); of the rest, it keeps those held outside it or global to
    ``home``, and sums the others.
    """
    home = ordinal[lazy.symbol]
    members: list[int] = []
    summed, frontier = {lazy.symbol}, {lazy.symbol}
    group_dims = set(lazy.dims) - plates
    while frontier:
        joining = [
            i for i, t in enumerate(others) if i not in members and frontier.intersection(factor_dims(t))
        ]
        members += joining
        group_dims.update(*(set(factor_dims(others[i])) - plates for i in joining))
        frontier = {d for d in group_dims - summed if summed_inside(d)}
        summed |= frontier
    outside = set().union(*(factor_dims(t) for i, t in enumerate(others) if i not in members))
    kept = {d for d in group_dims - summed if d in outside or ordinal[d] < home}
    return EliminationGroup(members, home, frozenset(kept), frozenset(group_dims - kept))


def _dim_sizes(factors: Sequence[Union[torch.Tensor, ChunkedFactor]]) -> dict[str, int]:
    """Each dim's length, read from the tensors' shapes and the chunked factors' own dims."""
    sizes = {t.symbol: t.size for t in factors if isinstance(t, ChunkedFactor)}
    for t in factors:
        if isinstance(t, torch.Tensor):
            sizes.update(zip(t._pyro_dims, t.shape))
    return sizes


def _message_elements(group: EliminationGroup, sizes: dict[str, int]) -> int:
    """How many elements the group's message holds: its kept dims and its plates."""
    return math.prod(sizes.get(d, 1) for d in group.kept | group.home)


def eliminate_in_chunks(
    lazy: ChunkedFactor,
    factors: Sequence[Union[torch.Tensor, ChunkedFactor]],
    plate_scales: dict[str, float],
) -> list[Union[torch.Tensor, ChunkedFactor]]:
    """
    Sum out ``lazy.symbol`` slice by slice: ``sum_k = sum_slices sum_{k in slice}``,
    so each slice's partial contraction (a *message* over the dims that factors
    outside the group still hold: :func:`elimination_group`) is computed from that
    slice alone, and the messages are log-sum-exp'd as they come
    (:func:`_log_sum_over_slices`), so memory holds one slice and two messages. A
    pending chunked factor that must join the group is materialised.

    :param factors: the other factors: tensors and pending chunked factors.
    :returns: the factors with the group replaced by its message.
    """
    plates = frozenset(plate_scales)
    members, home, kept, summed = elimination_group(lazy, factors, plates, _slice_elements(lazy))
    group = [_materialised(factors[i]) for i in members]
    rest = [t for i, t in enumerate(factors) if i not in members]
    out_dims = "".join(sorted(kept | home))
    # A kept dim held in the group only inside deeper plates (a global whose other factors are
    # outside) looks plated to Pyro's contraction, which then refuses to keep it: a zero
    # factor over it in the message's own plates (not fewer: the contraction would then
    # multiply those out too) shows where it lives.
    group_ordinal = _ordinals([lazy.dims] + [t._pyro_dims for t in group], plates)
    unplated = "".join(sorted(d for d in kept if not group_ordinal[d] <= home))
    if unplated:
        unplated += "".join(sorted(home))

    def message(start: int, stop: int, *inputs: torch.Tensor) -> torch.Tensor:
        terms = [lazy.compute(start, stop)]
        for term, tensor in zip(group, inputs):
            tensor._pyro_dims = term._pyro_dims
            terms.append(_narrow(tensor, lazy.symbol, start, stop))
        if unplated:
            terms.append(_zero_factor(terms, unplated))
        terms = fuse_factors(terms, plates)
        msg = _contract(terms, plate_scales, summed | kept, target_ordinal=home, target_dims=kept)
        return packed_view(msg, out_dims)

    # Each slice makes a whole message: a slice smaller than its message would not lower the
    # peak, only multiply the work (slices x message), so none is.
    sizes = {d: n for t in group + rest if isinstance(t, torch.Tensor) for d, n in zip(t._pyro_dims, t.shape)}
    message_elements = math.prod(sizes.get(d, 1) for d in out_dims)
    try:
        combined = _log_sum_over_slices(message, lazy.ranges(message_elements), group)
    except RuntimeError as error:  # an allocation failing: say which particles the message sums
        mark_contraction_step(error, kept | summed)
        raise
    combined._pyro_dims = out_dims
    return rest + [combined]


def _slice_elements(lazy: ChunkedFactor) -> int:
    """The elements of one slice of ``lazy``: about the budget it was sliced under."""
    per_particle = max(lazy.numel // lazy.size, 1) if lazy.numel else 1
    return lazy.chunk * per_particle


def _zero_factor(terms: list[torch.Tensor], dims: str) -> torch.Tensor:
    """A log factor of zeros over ``dims`` (sizes read from ``terms``), expanded: no memory of its own."""
    sizes = {d: n for t in terms for d, n in zip(t._pyro_dims, t.shape)}
    zero = terms[0].new_zeros(()).expand(tuple(sizes[d] for d in dims))
    zero._pyro_dims = dims
    return zero


def _materialised(term: Union[torch.Tensor, ChunkedFactor]) -> torch.Tensor:
    return term.materialise() if isinstance(term, ChunkedFactor) else term


def _log_sum_over_slices(
    message: Callable[..., torch.Tensor], ranges: list[tuple[int, int]], inputs: list[torch.Tensor]
) -> torch.Tensor:
    """
    ``log sum_i exp(message(*ranges[i], *inputs))``, elementwise, holding one
    slice's message at a time (stacking them all would hold every message at
    once: more than the unchunked contraction, F5 of issue 17).

    The value is a running log-sum-exp computed without autograd. Under autograd,
    the gradient comes from a second pass: ``total + (S - stop(S)) / stop(S)`` with
    ``S = sum_i exp(m_i - stop(total))``, whose value is ``total`` and whose
    gradient with respect to ``m_i`` is ``exp(m_i - total) / S``, the gradient of
    the log-sum-exp. Dividing by ``S`` (1 in exact arithmetic) keeps the weights
    summing to 1 where ``total`` is rounded: in float32 a log of 1e5 is rounded by
    up to 0.004, and unnormalised weights would scale every gradient by as much.
    Each ``exp(m_i - total)`` is checkpointed (recomputed in the backward pass)
    and summed as it comes, and a sum keeps nothing for its backward, so the
    backward too holds one slice.
    """
    if len(ranges) == 1:  # one slice: the plain contraction
        return message(*ranges[0], *inputs)
    with torch.no_grad():
        total = None
        for start, stop in ranges:
            piece = message(start, stop, *inputs)
            total = piece.contiguous() if total is None else torch.logaddexp(total, piece, out=total)
    if not torch.is_grad_enabled():
        return total
    weights = None
    for start, stop in ranges:
        weight = checkpoint(_relative_weight, message, total, start, stop, *inputs, use_reentrant=False)
        if not weight.requires_grad:
            return total  # nothing upstream needs a gradient
        weights = weight if weights is None else weights + weight
    norm = weights.detach()
    norm = torch.where(norm > 0, norm, torch.ones_like(norm))  # 0 only where every slice is -inf
    return total + (weights - weights.detach()) / norm


def _relative_weight(message, total: torch.Tensor, start: int, stop: int, *inputs) -> torch.Tensor:
    """
    ``exp(message - total)`` of one slice: its share of the log-sum-exp ``total``
    (0, with a zero gradient, where every slice is -inf).
    """
    return (message(start, stop, *inputs) - total.clamp(min=torch.finfo(total.dtype).min)).exp()


def _next_to_eliminate(pending: list[ChunkedFactor]) -> int:
    """
    The index of the pending chunked factor to eliminate next: the last (children
    come after their parents, and then meet only small messages) whose dim no
    other pending factor holds, so that no other needs materialising.
    """
    for i in reversed(range(len(pending))):
        if not any(j != i and pending[i].symbol in other.dims for j, other in enumerate(pending)):
            return i
    return len(pending) - 1


def contract_log_factors(
    factors: Sequence[Union[torch.Tensor, ChunkedFactor]],
    plate_scales: dict[str, float],
    stacks: Optional[StackedSlices] = None,
) -> torch.Tensor:
    """
    Sum out every particle dim and multiply out every plate dim of the packed
    log ``factors``.

    :param factors: packed log factors; a :class:`ChunkedFactor` is eliminated
        slice by slice first (:func:`eliminate_in_chunks`).
    :param dict plate_scales: every plate symbol that may occur, with its
        subsampling scale (1.0 when not subsampled).
    :param stacks: the factors that are slices of one stacked tensor
        (:data:`StackedSlices`): a chain's links are then taken in one operation
        per stack (:func:`reduce_chains`).
    :returns: a scalar tensor, the log of the contracted sum-product.
    """
    pending = [f for f in factors if isinstance(f, ChunkedFactor)]
    tensors = [f for f in factors if not isinstance(f, ChunkedFactor)]
    while pending:
        chunked = pending.pop(_next_to_eliminate(pending))
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
    return _contract(tensors, plate_scales, sum_dims)


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
