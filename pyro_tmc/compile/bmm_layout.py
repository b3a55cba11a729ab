"""An inductor pass that keeps the CPU's batched matrix products on their fast path.

ATen's CPU ``bmm`` runs one batched BLAS call only when each operand's matrices
have a unit stride along a row or a column. Otherwise it loops over the batch:
three ``select`` calls, and for a matrix with neither unit stride a ``clone``
and a ``copy_``, per batch element. For a factor over (K, K_parent) particles
and a batch of B data points that is B small matrix products instead of one
call, several times slower (docs/performance.md, "The defaults, and why").

TMC's factors are laid out as Pyro lays out its dims, particles left and plates
right, so a gradient of shape (K, K_parent, B) reaches the backward of a pairwise
Gaussian density (:mod:`pyro_tmc.ops.log_density`) as a permuted view, batch first.
Eagerly that view is cheap: elementwise ops keep their inputs' memory order, so
the tensor under it is batch-major already. Inductor instead lays out each
buffer it computes contiguously in its own shape, so the permuted view has
strides (1, K_parent * B, B), neither of them 1, and inductor's own check
(``torch/_inductor/kernel/bmm.py``) reads the eager strides from the graph and
sees nothing wrong. In the MNIST VAE's small recognition model this was 12
products per step, 1,200 matrix copies.

:class:`BatchMajorBmmInputs` runs after inductor's own post-grad passes. For
each CPU ``bmm`` operand that is a chain of views of a computed tensor, it
replays the views on a contiguous stand-in for that tensor (inductor's default
layout); where the result would take the slow path, it copies the operand into
a contiguous buffer first (``clone`` pinned by ``as_strided``: a plain clone
would be laid out like its input again).
"""

from typing import Optional

import torch

# inductor's: this module is imported only where inductor compiles (compile/compiled.py)
from pyro_tmc._torch import CustomGraphPass

aten = torch.ops.aten

#: the view operations a bmm operand may be reached through
VIEWS = {
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.expand.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.select.int,
    aten.slice.Tensor,
}


def takes_one_blas_call(matrices: torch.Tensor) -> bool:
    """Whether ATen's CPU ``bmm`` runs these (batch, rows, cols) matrices in one batched call."""
    strides, sizes = matrices.stride(), matrices.shape
    return (strides[2] == 1 and strides[1] >= sizes[2]) or (strides[1] == 1 and strides[2] >= sizes[1])


def layout_under_inductor(operand: torch.fx.Node) -> Optional[torch.Tensor]:
    """
    A meta tensor with the strides ``operand`` gets if the computed tensor under its
    views is laid out contiguously, as inductor lays out the buffers it computes;
    ``None`` where ``operand`` is not a view of a computed tensor.
    """
    views = []
    node = operand
    while node.op == "call_function" and node.target in VIEWS:
        views.append(node)
        node = node.args[0]
    value = node.meta.get("val")
    if not views or node.op != "call_function" or not isinstance(value, torch.Tensor):
        return None
    tensor = torch.empty(value.shape, dtype=value.dtype, device="meta")
    try:
        for view in reversed(views):
            tensor = view.target(tensor, *view.args[1:], **view.kwargs)
    except RuntimeError:  # a reshape that copies: inductor makes that copy contiguous itself
        return None
    return tensor


class BatchMajorBmmInputs(CustomGraphPass):
    """The pass (module docstring); ``uuid`` keys inductor's cache."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.find_nodes(op="call_function", target=aten.bmm.default):
            operands = list(node.args)
            for position, operand in enumerate(operands[:2]):
                value = operand.meta.get("val")
                if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
                    continue
                laid_out = layout_under_inductor(operand)
                if laid_out is not None and not takes_one_blas_call(laid_out):
                    operands[position] = _contiguous_copy(graph, node, operand, value)
            node.args = tuple(operands)

    def uuid(self) -> str:
        return "pyro_tmc.compile.bmm_layout.BatchMajorBmmInputs.1"


#: the pass, one object: settings that hold it compare equal
BATCH_MAJOR_BMM_INPUTS = BatchMajorBmmInputs()


def _contiguous_copy(
    graph: torch.fx.Graph, before: torch.fx.Node, operand: torch.fx.Node, value: torch.Tensor
) -> torch.fx.Node:
    contiguous = value.clone(memory_format=torch.contiguous_format)
    shape, strides = list(value.shape), list(contiguous.stride())
    with graph.inserting_before(before):
        copy = graph.call_function(aten.clone.default, (operand,), {"memory_format": torch.contiguous_format})
        # as_strided fixes the copy's layout: inductor would lay a bare clone out like its input
        pinned = graph.call_function(aten.as_strided.default, (copy, shape, strides))
    for new in (copy, pinned):
        new.meta = {**operand.meta, "val": contiguous}
    return pinned
