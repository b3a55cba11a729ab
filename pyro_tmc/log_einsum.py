"""Log-space contractions in plain tensor operations: an einsum backend and a chain product.

``log(einsum(exp(a), exp(b), ...))``: each operand is shifted by its (detached)
maximum over the dims it sums out, exponentiated, contracted by
:func:`torch.einsum`, and the log taken; the shifts are added back. This is
Pyro's ``pyro.ops.einsum.torch_log`` computation, with one difference: the log
of a sum that is zero (every term ``-inf``) is ``-inf`` with a zero gradient
through :func:`safe_log`, built of ``torch.where``, where Pyro's uses a custom
``autograd.Function``. A traced graph (:mod:`pyro_tmc.compiled`) keeps what
plain tensor operations do, but drops a custom Function's backward: it would
turn those zero gradients into NaN. The same holds for the log-depth product of
a chain of log matrices (:func:`sequential_log_matmul_exp`), which Pyro's
``pyro.distributions.hmm._sequential_logmatmulexp`` computes with that Function.
"""

import math
from typing import List

import torch

from pyro.ops.einsum.util import Tensordot


def safe_log(x: torch.Tensor) -> torch.Tensor:
    """``log(x)`` for ``x >= 0``; where ``x == 0``, ``-inf`` with gradient 0 (not inf or NaN)."""
    positive = x > 0
    return torch.where(positive, torch.where(positive, x, torch.ones_like(x)).log(), -math.inf)


def transpose(a: torch.Tensor, axes) -> torch.Tensor:
    return a.permute(axes)


def _shift_to_output(shift: torch.Tensor, dims: str, output: str) -> torch.Tensor:
    """An operand's shift (size 1 on its summed dims) as a tensor that broadcasts against the output."""
    kept = [d for d in dims if d in output]
    shift = shift.reshape([size for size, d in zip(shift.shape, dims) if d in output])
    order = [d for d in output if d in kept]
    shift = shift.permute([kept.index(d) for d in order])
    return shift.reshape([shift.shape[order.index(d)] if d in order else 1 for d in output])


def einsum(equation: str, *operands: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp einsum: ``log(einsum(equation, *map(exp, operands)))``."""
    inputs, output = equation.split("->")
    inputs = inputs.split(",")
    if len(inputs) == 1 and inputs[0] == output:
        return operands[0].clone()  # a new tensor, as the other results are
    symbols = sorted(set(equation) - set(",->"))  # torch.einsum takes letters only
    rename = dict(zip(symbols, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    shifts: List[torch.Tensor] = []
    exps: List[torch.Tensor] = []
    for dims, operand in zip(inputs, operands):
        summed = [i for i, d in enumerate(dims) if d not in output]
        shift = operand.detach()
        if summed:
            shift = shift.amax(summed, keepdim=True)
        # an all -inf slice: shift 0 rather than -inf, so that exp gives 0, not NaN
        shift = shift.clamp(min=torch.finfo(shift.dtype).min)
        exps.append((operand - shift).exp())
        shifts.append(_shift_to_output(shift, dims, output))
    renamed = "".join(rename.get(c, c) for c in equation)
    result = safe_log(torch.einsum(renamed, *exps))
    for shift in shifts:
        result = result + shift
    return result


tensordot = Tensordot(einsum)


def log_matmul_exp(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``log(exp(x) @ exp(y))`` for matrix batches; rows of x, columns of y shifted by their maxima."""
    floor = torch.finfo(x.dtype).min  # an all -inf row or column: shift 0, not -inf
    x_shift = x.detach().amax(-1, keepdim=True).clamp(min=floor)
    y_shift = y.detach().amax(-2, keepdim=True).clamp(min=floor)
    return safe_log(torch.matmul((x - x_shift).exp(), (y - y_shift).exp())) + x_shift + y_shift


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


__all__ = ["einsum", "log_matmul_exp", "safe_log", "sequential_log_matmul_exp", "tensordot", "transpose"]
