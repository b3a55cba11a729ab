"""Summing out a log factor too large to hold at once, slice by slice (a memory budget).

A :class:`ChunkedFactor` is produced slice by slice along its site's particle dim, as
the alan library's Split does. :func:`eliminate_in_chunks` sums that dim out: each
slice's partial contraction, a *message* over the dims that factors outside the group
still hold (:func:`elimination_group`), is computed from that slice alone, and the
messages are log-sum-exp'd as they come, so that memory holds one slice and two
messages, in the backward pass too (:func:`_log_sum_over_slices`).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Union

import torch
from torch.utils.checkpoint import checkpoint

from pyro_tmc.ops.memory import mark_contraction_step
from pyro_tmc.ops.ring import contract_packed, fuse_factors
from pyro_tmc.ops.shapes import packed_view


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


def factor_dims(term: Union[torch.Tensor, ChunkedFactor]) -> str:
    """The packed dims of a factor, whole or chunked."""
    return term.dims if isinstance(term, ChunkedFactor) else term._pyro_dims


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
        msg = contract_packed(terms, plate_scales, summed | kept, target_ordinal=home, target_dims=kept)
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


def next_to_eliminate(pending: list[ChunkedFactor]) -> int:
    """
    The index of the pending chunked factor to eliminate next: the last (children
    come after their parents, and then meet only small messages) whose dim no
    other pending factor holds, so that no other needs materialising.
    """
    for i in reversed(range(len(pending))):
        if not any(j != i and pending[i].symbol in other.dims for j, other in enumerate(pending)):
            return i
    return len(pending) - 1


__all__ = [
    "ChunkedFactor",
    "EliminationGroup",
    "eliminate_in_chunks",
    "elimination_group",
    "factor_dims",
    "next_to_eliminate",
]
