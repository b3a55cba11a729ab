"""Log-space contractions in plain tensor operations: an einsum backend and a chain product.

``log(einsum(exp(a), exp(b), ...))``: each operand is shifted by its (detached)
maximum over the dims it sums out, exponentiated, contracted by
:func:`torch.einsum`, and the log taken; the shifts are added back. This is
Pyro's ``pyro.ops.einsum.torch_log`` computation, with two differences.

First, the log of a sum that is zero (every term ``-inf``) is ``-inf`` with a
zero gradient through :func:`safe_log`, built of ``torch.where``, where Pyro's
uses a custom ``autograd.Function``. A traced graph (:mod:`pyro_tmc.compile.compiled`)
keeps what plain tensor operations do, but drops a custom Function's backward:
it would turn those zero gradients into NaN. The same holds for the log-depth
product of a chain of log matrices (:func:`sequential_log_matmul_exp`), which
Pyro's ``pyro.distributions.hmm._sequential_logmatmulexp`` computes with that
Function.

Second, no entry underflows. Each operand's shift is its own maximum, so when
the operands' maxima sit at different summed indices every shifted product can
be far below 1: ``exp(-88)`` is already below float32's smallest normal number,
and the entry comes out imprecise, or ``-inf`` (a stiff chain lost 123 nats in
float32; a model without a chain raised a false "-inf" error). An entry whose shifted sum is
below :func:`underflow_floor` (``n * tiny / eps`` for ``n`` summed terms: there,
the terms lost to underflow, at most ``tiny`` each, are below the dtype's
precision) is computed again exactly, by max-plus (``m = max_j (a_j + b_j)``,
then ``m + log sum_j exp(a_j + b_j - m)``), over only those entries, in chunks
of bounded memory. Entries whose operands hold no finite maximum are ``-inf``
and are left alone. While tracing a graph (:func:`deferred_underflow_checks`),
where no branch on values can run, each product records a flag instead, and the
caller recomputes eagerly when one is set. A matrix product in a graph
(:func:`log_matmul_exp`, a chain's links) is repaired in the graph instead: taken
in float64 (in float32, flagged, where the eager step before the capture found it
clean in float32), and where even that underflows, by max-plus: the underflowed entries
alone, a static number of them at most, else the whole product. So a stiff chain's
captured steps are not each redone eagerly. That number is fitted to the entries the
step's eager runs before the capture repaired, product by product (:func:`counting_repairs`,
:func:`merge_repair_counts`):
a repair's work follows its capacity, not its need, and runs at every step, with no
branch. A product with no count is repaired under ``torch.cond``, only where needed.

Reference: the max-plus (tropical) product as the exact shift, e.g. Rush,
"Torch-Struct: Deep Structured Prediction Library", ACL 2020 (its log semiring).
"""

import contextvars
import functools
import math
import operator
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Callable, NamedTuple, Optional

import torch

from pyro.ops.einsum.util import Tensordot

#: the most elements an exact recomputation holds at once (terms of the entries of one chunk)
EXACT_CHUNK_ELEMENTS = 2**22

#: the most terms a graph's exact repair of a whole matrix product holds at once (Fig. 4's
#: 1,000-link chain at K=32: 2**24 at the tree's first level)
GRAPH_REPAIR_ELEMENTS = 2**25

#: while a graph is traced: the list that collects each product's "underflow happened" flag
_DEFERRED_FLAGS: contextvars.ContextVar[Optional[list[torch.Tensor]]] = contextvars.ContextVar(
    "pyro_tmc_deferred_underflow_flags", default=None
)


#: while a whole step is traced: whether a matrix product repairs itself in the graph
_REPAIR_IN_GRAPH: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "pyro_tmc_repair_in_graph", default=False
)

#: while an eager step runs (:func:`counting_repairs`): the list that collects each matrix
#: product's shape and how many of its entries it recomputed exactly, in order
_REPAIR_COUNTS: contextvars.ContextVar[Optional[list[tuple[torch.Size, int]]]] = contextvars.ContextVar(
    "pyro_tmc_repair_counts", default=None
)

#: while a whole step is traced: the counts an eager run of it collected, to size each product's
#: repair (:func:`repair_capacity`), and how many of them the trace has used
_REPAIR_HINTS: contextvars.ContextVar[Optional["_RepairHints"]] = contextvars.ContextVar(
    "pyro_tmc_repair_hints", default=None
)


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


class RepairCount(NamedTuple):
    """What an eager matrix product recorded (:func:`counting_repairs`)."""

    shape: torch.Size
    #: how many entries were recomputed exactly (those even float64 could not hold)
    count: int
    #: whether the product, taken below float64 (float32), had no entry low at all
    narrow_clean: bool = False


@contextmanager
def counting_repairs() -> Iterator[list[RepairCount]]:
    """
    Within this context, each eager matrix product (:func:`log_matmul_exp`) appends a
    :class:`RepairCount` (its shape, how many of its entries it recomputed exactly, and
    whether it was clean in float32) to the list yielded, in the order the products run.
    A step captured after it sizes each product's in-graph repair by these counts, and
    takes a product that was clean in float32 in float32
    (``deferred_underflow_checks(repair_counts=...)``).
    """
    counts: list[RepairCount] = []
    token = _REPAIR_COUNTS.set(counts)
    try:
        yield counts
    finally:
        _REPAIR_COUNTS.reset(token)


def merge_repair_counts(seen: Optional[Sequence[tuple]], new: Sequence[tuple]) -> list[RepairCount]:
    """
    What several eager runs of one step repaired, product by product: the most entries
    any of them recomputed, and clean in float32 only where every one was. One draw can
    be clean where most are not (a deep level of Fig. 4's 1,000-link chain): a capture
    sized by that draw alone had nearly every replay redone eagerly. Where the products
    do not line up (another structure), the newest counts stand alone.
    """
    new = [RepairCount(*entry) for entry in new]
    seen = None if seen is None else [RepairCount(*entry) for entry in seen]
    if seen is None or [entry.shape for entry in seen] != [entry.shape for entry in new]:
        return new
    return [
        RepairCount(old.shape, max(old.count, now.count), old.narrow_clean and now.narrow_clean)
        for old, now in zip(seen, new)
    ]


class _RepairHints:
    """The counts of :func:`counting_repairs`, read one product at a time by a trace."""

    def __init__(self, counts: Sequence[tuple]) -> None:
        # a plain (shape, count) reads as a product not clean in float32
        self.counts = [RepairCount(*entry) for entry in counts]
        self.used = 0

    def next(self, shape: torch.Size) -> Optional[int]:
        """
        The count of the next product, of ``shape``; ``None`` from the first product
        that does not line up with the eager step's on (those get the default size).
        """
        if self.used < len(self.counts) and self.counts[self.used].shape == shape:
            self.used += 1
            return self.counts[self.used - 1].count
        self.used = len(self.counts)
        return None

    def narrow_clean(self) -> bool:
        """Whether the product :meth:`next` gave last was clean in float32 in the eager step."""
        return 1 <= self.used <= len(self.counts) and self.counts[self.used - 1].narrow_clean

    def follows_a_clean_product(self) -> bool:
        """Whether the product before the one :meth:`next` gave last repaired nothing in the eager step."""
        return 2 <= self.used <= len(self.counts) and self.counts[self.used - 2].count == 0


@contextmanager
def deferred_underflow_checks(
    repair_in_graph: bool = False, repair_counts: Optional[Sequence[tuple]] = None
) -> Iterator[list[torch.Tensor]]:
    """
    Within this context (a graph being traced, where no branch on tensor values
    can run) no product is repaired: each appends a boolean scalar tensor, set
    where one of its entries underflowed, to the list yielded, and returns its
    fast value. The caller must recompute outside the context where any flag is
    set (:func:`any_flag`).

    :param bool repair_in_graph: whether a matrix product (:func:`log_matmul_exp`)
        repairs itself in the graph instead of flagging. Only for a graph whose
        backward is traced too: a repair without a count runs under ``torch.cond``,
        whose gradient is a custom ``autograd.Function``, which an estimate-only
        graph would drop.
    :param list repair_counts: what :func:`counting_repairs` collected from an
        eager run of what is traced: each product's repair is sized by its count
        (:func:`repair_capacity`) and runs at every step, with no ``torch.cond``.
        ``None``: every product gets the default size, under ``torch.cond``.
    """
    flags: list[torch.Tensor] = []
    token = _DEFERRED_FLAGS.set(flags)
    repair_token = _REPAIR_IN_GRAPH.set(repair_in_graph)
    hints_token = _REPAIR_HINTS.set(None if repair_counts is None else _RepairHints(repair_counts))
    try:
        yield flags
    finally:
        _REPAIR_HINTS.reset(hints_token)
        _REPAIR_IN_GRAPH.reset(repair_token)
        _DEFERRED_FLAGS.reset(token)


def checks_deferred() -> bool:
    """
    Whether value checks are deferred (:func:`deferred_underflow_checks`): a graph
    is being traced, so a check that reads a tensor's value must not run; the
    caller checks the graph's outputs instead.
    """
    return _DEFERRED_FLAGS.get() is not None


def any_flag(flags: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """A boolean scalar: whether any of the flags collected by :func:`deferred_underflow_checks` is set."""
    if not flags:
        return torch.zeros((), dtype=torch.bool, device=like.device)
    return torch.stack(flags).any()


def _log_plus_shifts(
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
    :data:`EXACT_CHUNK_ELEMENTS` terms. Under :func:`deferred_underflow_checks`,
    nothing is replaced and a flag is recorded. Eagerly, ``counted`` (if given) is
    called with how many entries were recomputed exactly, and whether the product was
    clean in its own dtype below float64 (no entry low at all).
    """
    low = shifted_sum < underflow_floor(shifted_sum.dtype, num_terms)
    flags = _DEFERRED_FLAGS.get()
    if flags is None and not low.any():  # one reduction, and the only sync
        # the common case: every sum far above 0, so a plain log (finite gradient) will do
        counted(0, shifted_sum.dtype != torch.float64)
        return _plus(shifted_sum.log(), shifts)
    result = _plus(safe_log(shifted_sum), shifts)
    if flags is not None:
        flags.append((low & live()).any())
        return result
    suspect = low & live()
    if shifted_sum.dtype != torch.float64 and suspect.any():
        wide = wide_sum()
        wide_result = _plus(safe_log(wide), [shift.double() for shift in shifts]).to(result.dtype)
        result = torch.where(suspect, wide_result, result)
        suspect = suspect & (wide < underflow_floor(torch.float64, num_terms))
    flat = suspect.expand(result.shape).reshape(-1).nonzero().squeeze(-1)
    counted(flat.numel(), False)
    if not flat.numel():
        return result
    chunk = max(1, EXACT_CHUNK_ELEMENTS // max(num_terms, 1))
    values = [exact_at(_unravel(part, result.shape)) for part in flat.split(chunk)]
    return result.reshape(-1).index_put((flat,), torch.cat(values).to(result.dtype)).reshape(result.shape)


def _plus(result: torch.Tensor, shifts: Sequence[torch.Tensor]) -> torch.Tensor:
    for shift in shifts:
        result = result + shift
    return result


def _unravel(flat: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Flat indices into ``shape`` as multi-indices, one row each (no columns for a scalar)."""
    if not shape:
        return flat.new_zeros((flat.numel(), 0))
    return torch.stack(torch.unravel_index(flat, shape), -1)


def transpose(a: torch.Tensor, axes) -> torch.Tensor:
    return a.permute(axes)


def _shift_to_output(shift: torch.Tensor, dims: str, output: str) -> torch.Tensor:
    """An operand's shift (size 1 on its summed dims) as a tensor that broadcasts against the output."""
    kept = [d for d in dims if d in output]
    shift = shift.reshape([size for size, d in zip(shift.shape, dims) if d in output])
    order = [d for d in output if d in kept]
    shift = shift.permute([kept.index(d) for d in order])
    return shift.reshape([shift.shape[order.index(d)] if d in order else 1 for d in output])


def _exact_einsum_entries(
    inputs: list[str],
    output: str,
    operands: Sequence[torch.Tensor],
    sizes: dict[str, int],
    index: torch.Tensor,
) -> torch.Tensor:
    """
    ``log sum_{summed dims} exp(sum of operands)`` at the output entries ``index``
    (``(F, len(output))``), by max-plus: the terms of each entry are formed and
    log-sum-exp'd, shifted by their own maximum.
    """
    summed = sorted(set("".join(inputs)) - set(output))
    total = None
    for dims, operand in zip(inputs, operands):
        own_output = [d for d in output if d in dims]
        order = own_output + [d for d in summed if d in dims]
        arranged = operand.expand([sizes[d] for d in dims]).permute([dims.index(d) for d in order])
        if own_output:
            picked = arranged[tuple(index[:, output.index(d)] for d in own_output)]
        else:  # the same terms for every entry
            picked = arranged[None]
        picked = picked.reshape([picked.shape[0]] + [sizes[d] if d in dims else 1 for d in summed])
        total = picked if total is None else total + picked
    total = total.expand([index.shape[0]] + list(total.shape[1:]))
    return exact_logsumexp(total.reshape(index.shape[0], -1), [1])


def einsum(equation: str, *operands: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp einsum: ``log(einsum(equation, *map(exp, operands)))``, accurate whatever the spread."""
    inputs, output = equation.split("->")
    inputs = inputs.split(",")
    if len(inputs) == 1 and inputs[0] == output:
        return operands[0].clone()  # a new tensor, as the other results are
    symbols = sorted(set(equation) - set(",->"))  # torch.einsum takes letters only
    rename = dict(zip(symbols, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    sizes: dict[str, int] = {}
    for dims, operand in zip(inputs, operands):
        for d, size in zip(dims, operand.shape):
            sizes[d] = max(sizes.get(d, 1), size)
    shifts: list[torch.Tensor] = []
    own_shifts: list[torch.Tensor] = []
    exps: list[torch.Tensor] = []
    for dims, operand in zip(inputs, operands):
        summed = [i for i, d in enumerate(dims) if d not in output]
        shift = operand.detach()
        if summed:
            shift = shift.amax(summed, keepdim=True)
        # an all -inf slice: shift 0 rather than -inf, so that exp gives 0, not NaN
        shift = shift.clamp(min=torch.finfo(shift.dtype).min)
        exps.append((operand - shift).exp())
        own_shifts.append(shift)
        shifts.append(_shift_to_output(shift, dims, output))
    renamed = "".join(rename.get(c, c) for c in equation)
    shifted_sum = torch.einsum(renamed, *exps)
    num_terms = math.prod(sizes[d] for d in set("".join(inputs)) - set(output))
    if len(inputs) == 1 or num_terms == 1:  # a sum holding its maximum, exp(0) = 1: never underflows
        return _plus(safe_log(shifted_sum), shifts)
    floor = torch.finfo(shifted_sum.dtype).min

    def live() -> torch.Tensor:  # every operand's maximum finite (its shift not clamped)
        return functools.reduce(operator.and_, [shift > floor for shift in shifts])

    def wide_sum() -> torch.Tensor:
        wide = [(operand.double() - shift.double()).exp() for operand, shift in zip(operands, own_shifts)]
        return torch.einsum(renamed, *wide)

    exact_at = functools.partial(_exact_einsum_entries, inputs, output, operands, sizes)
    return _log_plus_shifts(shifted_sum, shifts, live, wide_sum, exact_at, num_terms)


tensordot = Tensordot(einsum)


def _exact_matmul_entries(x: torch.Tensor, y: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``log sum_j exp(x[..., i, j] + y[..., j, k])`` at the entries ``index`` (rows ``(batch..., i, k)``)."""
    batch = index[:, :-2].unbind(-1)
    rows = _gather_rows(x, batch, index[:, -2])
    columns = _gather_rows(y.transpose(-1, -2), batch, index[:, -1])
    return exact_logsumexp(rows + columns, [-1])


def _gather_rows(matrices: torch.Tensor, batch: Sequence[torch.Tensor], row: torch.Tensor) -> torch.Tensor:
    """
    ``matrices[batch..., row, :]`` broadcast over the batch dims, one row per index:
    by ``index_select`` on the rows of ``matrices`` itself (neither expanded nor
    advanced-indexed: eagerly on the CPU, advanced indexing of a large batch at many
    rows is far slower, and the backward of ``index_select`` is ``index_add``, not an
    accumulating ``index_put``). For eager repairs only: in a graph that inductor
    compiles, the advanced indexing makes the faster step.

    :param batch: the output's batch index of each row, one tensor per batch dim
        (``matrices`` may have fewer batch dims, or size 1 in some, as it broadcasts).
    """
    shape = matrices.shape[:-2]
    flat, stride = row, matrices.size(-2)
    for size, index in zip(reversed(shape), reversed(batch)):
        if size != 1:
            flat = flat + index * stride
        stride *= size
    return matrices.reshape(-1, matrices.size(-1)).index_select(0, flat)


def _graph_log_matmul_exp(
    x: torch.Tensor,
    y: torch.Tensor,
    x_shift: torch.Tensor,
    y_shift: torch.Tensor,
    live: torch.Tensor,
    needed: Optional[int],
) -> torch.Tensor:
    """
    :func:`log_matmul_exp` in a traced graph, which cannot repair entries on demand.
    The product is taken in float64, whose range holds most chains' spreads. Where an
    entry still underflows (a stiff chain early in training: Fig. 4 of the paper), the
    graph repairs it exactly by max-plus (:func:`_entries_branch`): the underflowed
    entries alone, up to :func:`repair_capacity` of them (a small product's all, by
    :func:`_exact_branch`). Sized by an eager step's count, the repair runs at every
    step; sized by default, under ``torch.cond``, only where an entry underflowed.
    Beyond the capacity, and above :data:`GRAPH_REPAIR_ELEMENTS` terms, the product is
    flagged, as an estimate's graph does, and the step redone eagerly. So Fig. 4's chain
    and small stiff chains replay with no eager redo. A product that the eager step found
    clean, after one that was clean too, is flagged only (no repair to compile).
    ``needed``: the eager step's count for this product (:func:`_graph_hint`), if any.
    """
    hints = _REPAIR_HINTS.get()
    wide_x, wide_y = x_shift.double(), y_shift.double()
    shifted_sum = torch.matmul(exp_or_zero(x.double() - wide_x), exp_or_zero(y.double() - wide_y))
    low = (shifted_sum < underflow_floor(torch.float64, x.size(-1))) & live
    fast = _plus(safe_log(shifted_sum), [wide_x, wide_y])
    terms = shifted_sum.numel() * x.size(-1)
    if terms > GRAPH_REPAIR_ELEMENTS:  # too large to hold every term at once: flag, as an estimate does
        _DEFERRED_FLAGS.get().append(low.any())
        return fast.to(x.dtype)
    if needed == 0 and hints.follows_a_clean_product():
        # past the first product that the eager step found clean (a log-depth contraction's
        # deeper levels, whose sums of many paths spread less): no repair, flagged (the rare step
        # that needs one is redone eagerly). Each repair is ~60 operations, forward and backward, for
        # inductor to compile: Fig. 4's 1,000-link chain keeps repairs on 4 of its 10 levels
        _DEFERRED_FLAGS.get().append(low.any())
        return fast.to(x.dtype)
    capacity = repair_capacity(fast.numel(), needed)
    # the entries alone, or a small product whole by max-plus
    small = capacity >= fast.numel()
    shapes = (x.shape, y.shape, fast.shape)
    repair = (
        functools.partial(_exact_branch, shapes)
        if small
        else functools.partial(_entries_branch, capacity, shapes)
    )
    operands = (x, y, fast.to(x.dtype), low)
    if needed is not None:
        # sized by what the eager step repaired: small, or needed at every step, so repaired at
        # every step with no branch. A cond costs time at every replay and two subgraphs for
        # inductor to compile, and keeps a step out of a CUDA graph (inductor refuses to capture
        # one holding a cond)
        (value,) = repair(*(t.reshape(-1) for t in operands))
    else:
        # no count (the product does not line up with the eager step's): sized by default, so
        # repaired only at a step where an entry underflowed.
        # torch.ops.higher_order.cond, not torch.cond: the latter traces its branches with dynamo,
        # whose dynamic shapes fail here; the operator itself traces them with make_fx. The operands
        # go in flat and contiguous: cond refuses operands that alias (slices of one stack), and
        # inductor may lay out a matrix batch unlike the branch it compiled for it (it then fails
        # an assertion), where a flat tensor has one layout. One cond per product: a nested one is
        # retraced once per enclosing trace
        flat = tuple(t.reshape(-1).clone() for t in operands)
        (value,) = torch.ops.higher_order.cond(low.any(), repair, _keep_branch, flat)
    if not small:  # more underflowed entries than the capacity: the step is redone eagerly
        _DEFERRED_FLAGS.get().append(low.sum() > capacity)
    return value.reshape(fast.shape)


def _graph_hint(x: torch.Tensor, y: torch.Tensor) -> tuple[Optional[int], bool]:
    """
    What the eager step before the capture recorded for the product ``x @ y`` being
    traced: how many entries it repaired (``None``: no record lines up), and whether it
    was clean in float32.
    """
    hints = _REPAIR_HINTS.get()
    if hints is None:
        return None, False
    needed = hints.next(torch.broadcast_shapes(x.shape[:-2], y.shape[:-2]) + (x.size(-2), y.size(-1)))
    return needed, needed == 0 and hints.narrow_clean()


def repair_capacity(num_entries: int, needed: Optional[int] = None) -> int:
    """
    How many underflowed entries of a product of ``num_entries`` entries the graph
    repairs one by one (``K`` terms each); beyond that the step is redone eagerly.
    A repair costs its capacity whatever the need, so where an eager run of the
    step ``needed`` some number (:func:`counting_repairs`), the capacity is half as
    much again plus 64, no more than the default unless the need is. The default:
    an eighth, and at least 4,096, so that a small product is repaired whole
    however stiff. Fig. 4's 1,000-link chain at K=32 and its guide's initial values
    needs 50.7-52.9k of the first tree level's 511k entries, 6.0-7.2k of the
    second's 256k, 100-210 of the third's 128k, and none after (eight draws); the
    100-link chain 0-6 of the first level's 50k, in a third of its draws.
    """
    default = max(4096, num_entries // 8)
    if needed is None:
        return default
    fitted = min(num_entries, math.ceil(1.5 * needed) + 64)
    return min(fitted, default) if needed <= default else fitted


_Shapes = tuple[torch.Size, torch.Size, torch.Size]


def _entries_branch(
    capacity: int, shapes: _Shapes, x: torch.Tensor, y: torch.Tensor, fast: torch.Tensor, low: torch.Tensor
) -> tuple[torch.Tensor]:
    """
    The max-plus value of each underflowed entry (at most ``capacity``), the fast
    value elsewhere; operands and result flat, of the ``shapes`` of x, y and the
    product. The entries' indices have a static count, as a graph needs: the unused
    ones point at one extra slot past the end, which is dropped, so neither a value
    nor a gradient lands twice on a real entry.
    """
    x, y = x.reshape(shapes[0]), y.reshape(shapes[1])
    shape, size = shapes[2], fast.numel()
    rows, columns = shape[-2], shape[-1]
    # coordinates, not flat indices: a compiled branch would divide them again for every term
    coordinates = torch.nonzero_static(low.reshape(-1, rows, columns), size=capacity, fill_value=-1)
    matrix, row, column = coordinates.clamp(min=0).unbind(-1)  # unused slots read entry 0, dropped below
    index = torch.where(coordinates[:, 0] >= 0, (matrix * rows + row) * columns + column, size)
    # advanced indexing, so that the gradients come back laid out as the operands (cond needs that);
    # y's columns as rows, so that each entry reads contiguous terms. Not _gather_rows: inductor
    # compiles this advanced indexing into a faster step than an index_select
    batch = shape[:-2]
    x_rows = x.expand(batch + x.shape[-2:]).reshape(-1, rows, x.size(-1))[matrix, row]
    y_t = y.expand(batch + y.shape[-2:]).reshape(-1, y.size(-2), columns).transpose(-1, -2).contiguous()
    y_columns = y_t[matrix, column]
    exact = exact_logsumexp(x_rows + y_columns, [-1])
    padded = torch.cat([fast, fast.new_zeros(1)])
    return (padded.index_put((index,), exact)[:size],)


def _exact_branch(
    shapes: _Shapes, x: torch.Tensor, y: torch.Tensor, fast: torch.Tensor, low: torch.Tensor
) -> tuple[torch.Tensor]:
    """The max-plus product of every entry, flat: exact, never underflows (``K^3`` terms per matrix pair)."""
    x, y = x.reshape(shapes[0]), y.reshape(shapes[1])
    return (exact_logsumexp(x.unsqueeze(-1) + y.unsqueeze(-3), [-2]).reshape(-1),)


def _keep_branch(
    x: torch.Tensor, y: torch.Tensor, fast: torch.Tensor, low: torch.Tensor
) -> tuple[torch.Tensor]:
    return (fast.clone(),)


def log_matmul_exp(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """
    ``log(exp(x) @ exp(y))`` for matrix batches: rows of x, columns of y shifted
    by their maxima, and the entries that underflow computed again exactly.
    """
    floor = torch.finfo(x.dtype).min  # an all -inf row or column: shift 0, not -inf
    x_shift = x.detach().amax(-1, keepdim=True).clamp(min=floor)
    y_shift = y.detach().amax(-2, keepdim=True).clamp(min=floor)
    live = lambda: (x_shift > floor) & (y_shift > floor)  # noqa: E731 (finite maxima: not clamped)
    if checks_deferred() and _REPAIR_IN_GRAPH.get():
        needed, narrow_clean = _graph_hint(x, y)
        if not narrow_clean:
            return _graph_log_matmul_exp(x, y, x_shift, y_shift, live(), needed)
        # clean in float32 in the eager step (the MNIST VAE's products): taken in float32 and
        # flagged below, as a product of the estimate is (a step that underflows is redone eagerly,
        # and a key mostly redone is captured again, in float64). Float64 would cost casts, a
        # float64 bmm and flags over float64 sums
    shifted_sum = torch.matmul(exp_or_zero(x - x_shift), exp_or_zero(y - y_shift))
    wide_sum = lambda: torch.matmul(  # noqa: E731 (the same product in float64)
        exp_or_zero(x.double() - x_shift.double()), exp_or_zero(y.double() - y_shift.double())
    )
    exact_at = functools.partial(_exact_matmul_entries, x, y)
    shifts = [x_shift, y_shift]
    counts = _REPAIR_COUNTS.get()
    if counts is None:
        return _log_plus_shifts(shifted_sum, shifts, live, wide_sum, exact_at, x.size(-1))
    counted = lambda count, clean: counts.append(RepairCount(shifted_sum.shape, count, clean))  # noqa: E731
    return _log_plus_shifts(shifted_sum, shifts, live, wide_sum, exact_at, x.size(-1), counted)


def sequential_log_matmul_exp(logits: torch.Tensor) -> torch.Tensor:
    """
    The log-space product ``x[..., 0, :, :] @ x[..., 1, :, :] @ ... @ x[..., T-1, :, :]``
    of a stack of log matrices along dim -3, in ~log2(T) levels: each level
    multiplies neighbouring pairs at once (a balanced tree), keeping the order.
    """
    while logits.size(-3) > 1:
        length = logits.size(-3)
        even = length - length % 2
        pairs = log_matmul_exp(logits[..., 0:even:2, :, :], logits[..., 1:even:2, :, :])
        logits = torch.cat([pairs, logits[..., even:, :, :]], dim=-3) if length % 2 else pairs
    return logits.squeeze(-3)


__all__ = [
    "any_flag",
    "checks_deferred",
    "counting_repairs",
    "deferred_underflow_checks",
    "einsum",
    "exact_logsumexp",
    "exp_or_zero",
    "log_matmul_exp",
    "merge_repair_counts",
    "safe_log",
    "safe_logsumexp",
    "sequential_log_matmul_exp",
    "tensordot",
    "transpose",
    "underflow_floor",
]
