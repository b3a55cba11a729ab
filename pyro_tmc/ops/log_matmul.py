"""``log(exp(x) @ exp(y))`` for batches of log matrices, accurate whatever the spread.

Rows of ``x`` and columns of ``y`` are shifted by their maxima, multiplied by
:func:`torch.matmul`, and the entries that underflow repaired
(:func:`~pyro_tmc.ops.underflow.log_plus_shifts`: in float64, then exactly, row by
column). Inside a traced graph whose step repairs itself
(:func:`~pyro_tmc.ops.capture.deferred_underflow_checks` with ``repair_in_graph``),
the graph's repair (:mod:`pyro_tmc.ops.graph_repair`) takes its place. An eager
product counts its repairs where a capture asks it to
(:func:`~pyro_tmc.ops.capture.counting_repairs`).
"""

import functools
from collections.abc import Sequence

import torch

from pyro_tmc.ops.capture import RepairCount, current
from pyro_tmc.ops.graph_repair import graph_hint, graph_log_matmul_exp
from pyro_tmc.ops.underflow import exact_logsumexp, exp_or_zero, log_plus_shifts


def log_matmul_exp(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """
    ``log(exp(x) @ exp(y))`` for matrix batches: rows of x, columns of y shifted
    by their maxima, and the entries that underflow computed again exactly.
    """
    floor = torch.finfo(x.dtype).min  # an all -inf row or column: shift 0, not -inf
    x_shift = x.detach().amax(-1, keepdim=True).clamp(min=floor)
    y_shift = y.detach().amax(-2, keepdim=True).clamp(min=floor)
    live = lambda: (x_shift > floor) & (y_shift > floor)  # noqa: E731 (finite maxima: not clamped)
    context = current()
    if context.underflow_flags is not None and context.repair_in_graph:
        needed, narrow_clean = graph_hint(x, y)
        if not narrow_clean:
            return graph_log_matmul_exp(x, y, x_shift, y_shift, live(), needed)
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
    counts = context.repair_counts
    if counts is None:
        return log_plus_shifts(shifted_sum, shifts, live, wide_sum, exact_at, x.size(-1))
    counted = lambda count, clean: counts.append(RepairCount(shifted_sum.shape, count, clean))  # noqa: E731
    return log_plus_shifts(shifted_sum, shifts, live, wide_sum, exact_at, x.size(-1), counted)


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


__all__ = ["log_matmul_exp"]
