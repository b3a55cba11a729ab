"""The log-space einsum backend: ``log(einsum(exp(a), exp(b), ...))`` in plain tensor operations.

The backend that :class:`~pyro_tmc.ops.contraction.PlateScaledLogRing` names for
:mod:`pyro.ops.einsum` and opt_einsum (``einsum``, ``tensordot``, ``transpose``), as
``pyro.ops.einsum.torch_log`` is Pyro's: each operand is shifted by its (detached)
maximum over the dims it sums out, exponentiated, contracted by :func:`torch.einsum`,
and the log taken; the shifts are added back. Two differences from Pyro's: the log
of a zero sum is ``-inf`` with a zero gradient through plain tensor operations
(:func:`~pyro_tmc.ops.underflow.safe_log`), which a traced graph keeps, and no entry
underflows (:func:`~pyro_tmc.ops.underflow.log_plus_shifts`: where the operands'
maxima sit at different summed indices, an entry's shifted sum can be far below 1,
and is then taken again in float64, or exactly, by max-plus over its terms).
"""

import functools
import math
import operator
from collections.abc import Sequence

import torch

from pyro.ops.einsum.util import Tensordot

from pyro_tmc.ops.underflow import exact_logsumexp, log_plus_shifts, plus_shifts, safe_log


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
        return plus_shifts(safe_log(shifted_sum), shifts)
    floor = torch.finfo(shifted_sum.dtype).min

    def live() -> torch.Tensor:  # every operand's maximum finite (its shift not clamped)
        return functools.reduce(operator.and_, [shift > floor for shift in shifts])

    def wide_sum() -> torch.Tensor:
        wide = [(operand.double() - shift.double()).exp() for operand, shift in zip(operands, own_shifts)]
        return torch.einsum(renamed, *wide)

    exact_at = functools.partial(_exact_einsum_entries, inputs, output, operands, sizes)
    return log_plus_shifts(shifted_sum, shifts, live, wide_sum, exact_at, num_terms)


tensordot = Tensordot(einsum)


__all__ = ["einsum", "tensordot", "transpose"]
