"""A step traced forward only, and its backward derived from the (rolled) forward.

Tracing a step's loss and its ``autograd.grad`` together records the backward as
autograd runs it: a block of backward operations for every forward block, so a
1,000-link ``pyro.markov`` chain's backward is traced link by link (most of the
trace's time) and then rolled with the forward. Tracing the forward alone,
rolling it (:mod:`pyro_tmc.compile.loop_rolling`), and running autograd on the rolled
forward under a second, short trace gives the gradients of the same operations
from about 1,000 batched operations instead of about 20,000.

A graph of aten operations forgets two things about the eager step:

- **Grad mode.** An operation run under ``no_grad`` (the draw of a
  non-reparameterised ``sample``; the backward of the inner ``autograd.grad``
  that STL and DReGs take) is not differentiated by the eager step. While the
  forward is traced, :class:`GradModeMarks` marks each node run without grad, and
  the second trace runs each node in its mode (:func:`runs_without_grad`).
  ``make_fx(pre_dispatch=True)`` records grad mode too, as
  ``torch._C._set_grad_enabled`` calls between the nodes, and is not used: loop
  rolling reorders nodes level by level, across such calls, so it needs each
  node's own mode and would have to turn the calls back into these marks; and a
  pre-dispatch trace keeps composite operations whole (``linear`` stays
  ``linear``, not ``t`` and ``mm``), another graph than the one that rolling's
  rules, the bmm pass (:mod:`pyro_tmc.compile.bmm_layout`) and the measured
  timings are made for.
- **A custom ``autograd.Function``'s backward, and tensor hooks**, which need not
  be the derivative of the forward's operations. A step that uses one is traced
  with its backward instead (:func:`custom_backward`, :class:`HookWatch`).
  ``torch.cond``'s own autograd traces its branches' backward itself, so it is
  not one of them.
"""

import contextlib
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from torch.fx import GraphModule, Interpreter, Node
from torch.overrides import TorchFunctionMode

from pyro_tmc._torch import (
    HIGHER_ORDER_OPS_MODULE,
    HigherOrderOperator,
    TorchDispatchMode,
    autograd_function_of,
    get_proxy_mode,
    make_fx,
)

#: a node's ``meta`` key: ``True`` where the eager step ran it under ``no_grad``
NO_GRAD = "pyro_tmc_no_grad"


class GradModeMarks(TorchDispatchMode):
    """
    Inside a ``make_fx`` trace: marks each node recorded while grad mode is off
    (``node.meta[NO_GRAD]``). A higher-order operator (``cond``) is never marked:
    its autograd runs its forward without grad, above this mode, and differentiates
    it itself.
    """

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.graph = None
        self.last: Optional[Node] = None  # the graph's last node after the previous operation
        #: whether the step read a tensor's value as a Python number (``.item()``, ``int(t)``, a
        #: tensor formatted into a site name): traced, that number is a symbol, and a trace that
        #: then fails most likely fails for it
        self.read_a_value = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.read_a_value = True
        if self.graph is None:
            self.graph = get_proxy_mode().tracer.graph
        without_grad = not torch.is_grad_enabled() and not isinstance(func, HigherOrderOperator)
        out = func(*args, **(kwargs or {}))
        tail = next(iter(reversed(self.graph.nodes)), None)  # the node this operation recorded last
        if without_grad:
            node = tail
            while node is not None and node is not self.last and node.op != "root":
                node.meta[NO_GRAD] = True
                node = node.prev
        self.last = tail
        return out


class HookWatch(TorchFunctionMode):
    """
    Notes whether a tensor hook is registered (``Tensor.register_hook``): a hook may
    change the gradient that reaches it, which the derivative of the forward's
    operations would not.
    """

    def __init__(self) -> None:
        super().__init__()
        self.hooked = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOOK_REGISTRATIONS:
            self.hooked = True
        return func(*args, **(kwargs or {}))


#: the tensor methods that register a hook
HOOK_REGISTRATIONS = (torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook)


def runs_without_grad(node: Node) -> bool:
    return bool(node.meta.get(NO_GRAD, False))


def grad_mode_of(node: Node) -> contextlib.AbstractContextManager:
    """``no_grad`` for a node the eager step ran without grad; else the mode as it is."""
    return torch.no_grad() if runs_without_grad(node) else contextlib.nullcontext()


def custom_backward(output: torch.Tensor) -> Optional[str]:
    """
    The name of a custom ``autograd.Function`` in ``output``'s backward graph
    (``torch``'s own higher-order operators' aside), or ``None``.
    """
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            function = autograd_function_of(node)
            if not function.__module__.startswith(HIGHER_ORDER_OPS_MODULE):
                return function.__name__
        stack.extend(next_node for next_node, _ in node.next_functions)
    return None


class InGradModes(Interpreter):
    """Runs a forward graph node by node, each in the grad mode the eager step ran it in."""

    def run_node(self, node: Node) -> Any:
        with grad_mode_of(node):
            return super().run_node(node)


def with_gradients(forward: Callable, num_params: int) -> Callable:
    """
    ``(params..., arguments...) -> (loss, underflow, grads...)``: ``forward``
    (``-> (loss, underflow)``) run under autograd, and the loss's gradient with
    respect to the first ``num_params`` inputs (zeros where it does not depend on one).
    """

    def step(*inputs: torch.Tensor):
        leaves = list(inputs[:num_params])
        loss, underflow = forward(*inputs)
        grads: Sequence[Optional[torch.Tensor]] = [None] * len(leaves)
        if leaves and loss.requires_grad:
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(leaves, grads)]
        return (loss.detach(), underflow, *grads)

    return step


def derive_backward(forward: Callable, inputs: Sequence[torch.Tensor], num_params: int) -> GraphModule:
    """
    Trace :func:`with_gradients` of ``forward`` (``-> (loss, underflow)``): ``(params...,
    arguments...) -> (loss, underflow, grads...)``.

    :param forward: the traced forward, run by :class:`InGradModes` or a
        :class:`~pyro_tmc.compile.loop_rolling.RolledStep` (which keeps the grad modes too).
    :param inputs: example inputs (traced as fake tensors).
    """
    return make_fx(with_gradients(forward, num_params), tracing_mode="fake")(*as_leaves(inputs, num_params))


def as_leaves(inputs: Sequence[torch.Tensor], num_params: int) -> list[torch.Tensor]:
    """The inputs, with the first ``num_params`` as fresh leaves that require grad (the parameters)."""
    return [t.detach().requires_grad_() if i < num_params else t for i, t in enumerate(inputs)]
