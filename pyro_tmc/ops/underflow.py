"""Log-space sums that never underflow: the primitives, and the repair of a product that did.

A log-space product ``log(sum_j exp(a_j + b_j + ...))`` is taken as Pyro's
``pyro.ops.einsum.torch_log`` takes it: each operand shifted by its (detached)
maximum over the dims it sums out, exponentiated, multiplied, and the log taken;
the shifts are added back. Each operand's shift is its own maximum, so when the
operands' maxima sit at different summed indices every shifted product can be far
below 1: ``exp(-88)`` is already below float32's smallest normal number, and the
entry comes out imprecise, or ``-inf`` (a stiff chain lost 123 nats in float32; a
model without a chain raised a false "-inf" error).

:func:`log_plus_shifts` finishes such a product: an entry whose shifted sum is below
:func:`underflow_floor` (``n * tiny / eps`` for ``n`` summed terms: there, the terms
lost to underflow, at most ``tiny`` each, are below the dtype's precision) is taken
again in float64, and where even that underflows, computed exactly, by max-plus
(``m = max_j (a_j + b_j)``, then ``m + log sum_j exp(a_j + b_j - m)``), over only
those entries, in chunks of bounded memory. Entries whose operands hold no finite
maximum are ``-inf`` and are left alone. While a graph is traced
(:func:`~pyro_tmc.ops.capture.deferred_underflow_checks`), where no branch on values
can run, each product records a flag instead, and the caller recomputes eagerly when
one is set (a matrix product in a graph is repaired in the graph instead:
:mod:`pyro_tmc.ops.graph_repair`).

The log of a sum that is zero (every term ``-inf``) is ``-inf`` with a zero gradient
through :func:`safe_log`, built of ``torch.where``, where Pyro's uses a custom
``autograd.Function``: a traced graph (:mod:`pyro_tmc.compile`) keeps what plain
tensor operations do, but drops a custom Function's backward, which would turn
those zero gradients into NaN.

Reference: the max-plus (tropical) product as the exact shift, e.g. Rush,
"Torch-Struct: Deep Structured Prediction Library", ACL 2020 (its log semiring).
"""

import functools
import math
from collections.abc import Sequence
from typing import Callable

import torch

from pyro_tmc.ops.capture import current

#: the most elements an exact recomputation holds at once (terms of the entries of one chunk)
EXACT_CHUNK_ELEMENTS = 2**22


def safe_log(x: torch.Tensor) -> torch.Tensor:
    """``log(x)`` for ``x >= 0``; where ``x == 0``, ``-inf`` with gradient 0 (not inf or NaN)."""
    positive = x > 0
    return torch.where(positive, torch.where(positive, x, torch.ones_like(x)).log(), -math.inf)


def safe_logsumexp(x: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """
    ``logsumexp`` over ``dims``, exact (shifted by the max), whose gradient is 0,
    not NaN, where a whole slice is ``-inf`` (:func:`torch.logsumexp` gives NaN there).
    """
    return _logsumexp(x, dims, torch.exp)


def exact_logsumexp(x: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """:func:`safe_logsumexp` by :func:`exp_or_zero`: for repairs, whose terms lie far below their maximum."""
    return _logsumexp(x, dims, exp_or_zero)


def _logsumexp(
    x: torch.Tensor, dims: Sequence[int], exp: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    dims = list(dims)
    shift = x.detach().amax(dims, keepdim=True).clamp(min=torch.finfo(x.dtype).min)
    return safe_log(exp(x - shift).sum(dims)) + shift.squeeze(dims)


def logsumexp_to_precision(x: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """
    :func:`safe_logsumexp` to ``x``'s precision: a term below ``eps / n`` times the
    largest (``n`` terms summed, ``eps`` the dtype's) is 0, in the value and in the
    gradient. Together those terms are below ``eps`` of the sum, so the value moves by
    less than ``eps`` (absolute, on the log), and each dropped term's softmax weight,
    the factor by which its term's gradient enters, is below ``eps / n``.

    Why: a weight far below 1 scales every gradient that flows back through its term.
    The log weights of IWAE's joint samples, each a sum over a whole batch, lie tens to
    hundreds of nats apart. An exact weight of ``exp(-95)`` is subnormal in float32,
    and one of ``exp(-70)`` turns the products of the networks' backward subnormal;
    a matrix product over subnormal operands runs many times slower on CPUs.
    Where every term lies within ``log(n / eps)`` of the largest (19 nats for 20
    float32 terms) this is the exact logsumexp.

    :param torch.Tensor x: log terms.
    :param dims: the dims summed out.
    """
    dims = list(dims)
    terms = math.prod(x.shape[d] for d in dims)
    floor = math.log(torch.finfo(x.dtype).eps / max(terms, 1))
    return _logsumexp(x, dims, functools.partial(_exp_above, floor=floor))


def exp_or_zero(x: torch.Tensor) -> torch.Tensor:
    """
    ``exp(x)``, with every result below twice the dtype's smallest normal number
    (``tiny``) set to 0. A sum of such terms loses at most ``2 tiny`` per term, as
    :func:`underflow_floor` allows for. Why: a CPU's exp takes a slow path for
    subnormal and zero results (float32 below -87.3, float64 below -708), and a
    shifted operand of a stiff product (Fig. 4's chain early in training) is mostly
    such values.
    """
    return _exp_above(x, math.log(2 * torch.finfo(x.dtype).tiny))


def _exp_above(x: torch.Tensor, floor: float) -> torch.Tensor:
    """``exp(x)`` where ``x >= floor``, else exactly 0 with gradient 0 (no subnormal either way)."""
    return x.clamp(min=floor).exp().masked_fill(x < floor, 0.0)


def underflow_floor(dtype: torch.dtype, num_terms: int) -> float:
    """
    The smallest sum of ``num_terms`` shifted exponentials (each at most 1) that is
    exact to ``dtype``'s precision: each term lost to underflow (or flushed to
    zero by :func:`exp_or_zero`) is below ``2 tiny``, so ``2 num_terms tiny`` lost
    is within ``eps`` of a sum of at least ``2 num_terms tiny / eps``.
    """
    info = torch.finfo(dtype)
    return 2 * num_terms * info.tiny / info.eps


def log_plus_shifts(
    shifted_sum: torch.Tensor,
    shifts: Sequence[torch.Tensor],
    live: Callable[[], torch.Tensor],
    wide_sum: Callable[[], torch.Tensor],
    exact_at: Callable[[torch.Tensor], torch.Tensor],
    num_terms: int,
    counted: Callable[[int, bool], None] = lambda count, clean: None,
) -> torch.Tensor:
    """
    ``log(shifted_sum) + sum(shifts)``, a log-space product, with its underflowed
    entries (a shifted sum of ``num_terms`` terms below :func:`underflow_floor`,
    where ``live()`` holds: finite maxima, so not ``-inf`` for want of terms)
    repaired. First, below float64, by ``wide_sum()``: the same shifted product in
    float64, whose range (down to ``exp(-700)``) holds the spreads seen in
    practice at the cost of one product, not one per entry. Then the entries
    still below float64's floor by ``exact_at(index)`` (``index``: their
    multi-indices, one row per entry), in chunks of at most
    :data:`EXACT_CHUNK_ELEMENTS` terms. Under :func:`~pyro_tmc.ops.capture.deferred_underflow_checks`,
    nothing is replaced and a flag is recorded. Eagerly, ``counted`` (if given) is
    called with how many entries were recomputed exactly, and whether the product was
    clean in its own dtype below float64 (no entry low at all).
    """
    low = shifted_sum < underflow_floor(shifted_sum.dtype, num_terms)
    flags = current().underflow_flags
    if flags is None and not low.any():  # one reduction, and the only sync
        # the common case: every sum far above 0, so a plain log (finite gradient) will do
        counted(0, shifted_sum.dtype != torch.float64)
        return plus_shifts(shifted_sum.log(), shifts)
    result = plus_shifts(safe_log(shifted_sum), shifts)
    if flags is not None:
        flags.append((low & live()).any())
        return result
    suspect = low & live()
    if shifted_sum.dtype != torch.float64 and suspect.any():
        wide = wide_sum()
        wide_result = plus_shifts(safe_log(wide), [shift.double() for shift in shifts]).to(result.dtype)
        result = torch.where(suspect, wide_result, result)
        suspect = suspect & (wide < underflow_floor(torch.float64, num_terms))
    flat = suspect.expand(result.shape).reshape(-1).nonzero().squeeze(-1)
    counted(flat.numel(), False)
    if not flat.numel():
        return result
    chunk = max(1, EXACT_CHUNK_ELEMENTS // max(num_terms, 1))
    values = [exact_at(unravel(part, result.shape)) for part in flat.split(chunk)]
    return result.reshape(-1).index_put((flat,), torch.cat(values).to(result.dtype)).reshape(result.shape)


def plus_shifts(result: torch.Tensor, shifts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``result + shifts[0] + shifts[1] + ...``, added in that order (the order fixes the rounding)."""
    for shift in shifts:
        result = result + shift
    return result


def unravel(flat: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Flat indices into ``shape`` as multi-indices, one row each (no columns for a scalar)."""
    if not shape:
        return flat.new_zeros((flat.numel(), 0))
    return torch.stack(torch.unravel_index(flat, shape), -1)


__all__ = [
    "EXACT_CHUNK_ELEMENTS",
    "exact_logsumexp",
    "exp_or_zero",
    "log_plus_shifts",
    "logsumexp_to_precision",
    "plus_shifts",
    "safe_log",
    "safe_logsumexp",
    "underflow_floor",
    "unravel",
]
