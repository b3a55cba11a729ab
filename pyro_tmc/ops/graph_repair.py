"""The repair of a log-space matrix product inside a traced graph, which cannot branch on values.

An eager product repairs the entries that underflow on demand
(:func:`~pyro_tmc.ops.underflow.log_plus_shifts`); a graph cannot, so a matrix product
in a graph (:func:`~pyro_tmc.ops.log_matmul.log_matmul_exp`, a chain's links) is repaired
in the graph instead: taken in float64 (in float32, flagged, where the eager step before
the capture found it clean in float32), and where even that underflows, by max-plus: the
underflowed entries alone, a static number of them at most, else the whole product. So a
stiff chain's captured steps are not each redone eagerly. That number is fitted to the
entries the step's eager runs before the capture repaired, product by product
(:func:`~pyro_tmc.ops.capture.counting_repairs`,
:func:`~pyro_tmc.ops.capture.merge_repair_counts`): a repair's work follows its capacity,
not its need, and runs at every step, with no branch. A product with no count is repaired
under ``torch.cond``, only where needed.
"""

import functools
import math
from typing import Optional

import torch

from pyro_tmc.ops.capture import current
from pyro_tmc.ops.shapes import broadcast_shape
from pyro_tmc.ops.underflow import exact_logsumexp, exp_or_zero, plus_shifts, safe_log, underflow_floor

#: the most terms a graph's exact repair of a whole matrix product holds at once (Fig. 4's
#: 1,000-link chain at K=32: 2**24 at the tree's first level)
GRAPH_REPAIR_ELEMENTS = 2**25


def graph_log_matmul_exp(
    x: torch.Tensor,
    y: torch.Tensor,
    x_shift: torch.Tensor,
    y_shift: torch.Tensor,
    live: torch.Tensor,
    needed: Optional[int],
) -> torch.Tensor:
    """
    :func:`~pyro_tmc.ops.log_matmul.log_matmul_exp` in a traced graph, which cannot repair entries on demand.
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
    ``needed``: the eager step's count for this product (:func:`graph_hint`), if any.
    """
    context = current()
    hints, flags = context.repair_hints, context.underflow_flags
    wide_x, wide_y = x_shift.double(), y_shift.double()
    shifted_sum = torch.matmul(exp_or_zero(x.double() - wide_x), exp_or_zero(y.double() - wide_y))
    low = (shifted_sum < underflow_floor(torch.float64, x.size(-1))) & live
    fast = plus_shifts(safe_log(shifted_sum), [wide_x, wide_y])
    terms = shifted_sum.numel() * x.size(-1)
    if terms > GRAPH_REPAIR_ELEMENTS:  # too large to hold every term at once: flag, as an estimate does
        flags.append(low.any())
        return fast.to(x.dtype)
    if needed == 0 and hints.follows_a_clean_product():
        # past the first product that the eager step found clean (a log-depth contraction's
        # deeper levels, whose sums of many paths spread less): no repair, flagged (the rare step
        # that needs one is redone eagerly). Each repair is ~60 operations, forward and backward, for
        # inductor to compile: Fig. 4's 1,000-link chain keeps repairs on 4 of its 10 levels
        flags.append(low.any())
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
        flags.append(low.sum() > capacity)
    return value.reshape(fast.shape)


def graph_hint(x: torch.Tensor, y: torch.Tensor) -> tuple[Optional[int], bool]:
    """
    What the eager step before the capture recorded for the product ``x @ y`` being
    traced: how many entries it repaired (``None``: no record lines up), and whether it
    was clean in float32.
    """
    hints = current().repair_hints
    if hints is None:
        return None, False
    # not torch.broadcast_shapes: under a capture's dispatch mode its first call imports sympy (0.7 s)
    needed = hints.next(broadcast_shape(x.shape[:-2], y.shape[:-2]) + (x.size(-2), y.size(-1)))
    return needed, needed == 0 and hints.narrow_clean()


def repair_capacity(num_entries: int, needed: Optional[int] = None) -> int:
    """
    How many underflowed entries of a product of ``num_entries`` entries the graph
    repairs one by one (``K`` terms each); beyond that the step is redone eagerly.
    A repair costs its capacity whatever the need, so where an eager run of the
    step ``needed`` some number (:func:`~pyro_tmc.ops.capture.counting_repairs`), the capacity is half as
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


__all__ = ["GRAPH_REPAIR_ELEMENTS", "graph_hint", "graph_log_matmul_exp", "repair_capacity"]
