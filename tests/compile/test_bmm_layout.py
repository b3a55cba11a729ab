"""The inductor pass that keeps CPU batched matrix products on one BLAS call (compile/bmm_layout.py)."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.profiler import profile

from pyro_tmc.compile.bmm_layout import BatchMajorBmmInputs, layout_under_inductor, takes_one_blas_call
from pyro_tmc.compile.compiled import inductor_settings

aten = torch.ops.aten


def gradient_like_product(a, y):
    """
    A bmm whose first operand is a batch-first view of a (K, K_parent, B) tensor that
    eager computes batch-major (elementwise ops keep their input's memory order), as
    the gradient of a pairwise density reaches its backward.
    """
    factor = (a.permute(1, 2, 0) * 2.0).exp()
    return torch.bmm(factor.permute(2, 0, 1), y)


def plain_product(a, y):
    return torch.bmm(a.exp(), y)


def _inputs():
    torch.manual_seed(0)
    return torch.randn(100, 20, 20), torch.randn(100, 20, 8)


def _bmm_operand(graph: torch.fx.GraphModule) -> torch.fx.Node:
    (bmm,) = graph.graph.find_nodes(op="call_function", target=aten.bmm.default)
    return bmm.args[0]


def test_an_operand_under_a_permute_takes_the_slow_path_under_inductor_alone():
    """Eager strides say one BLAS call; inductor's contiguous buffer under the views says otherwise."""
    a, y = _inputs()
    operand = _bmm_operand(make_fx(gradient_like_product)(a, y))
    assert takes_one_blas_call(operand.meta["val"])  # what inductor's own check reads
    laid_out = layout_under_inductor(operand)
    assert laid_out.shape == (100, 20, 20) and laid_out.stride() == (1, 2000, 100)
    assert not takes_one_blas_call(laid_out)
    assert layout_under_inductor(_bmm_operand(make_fx(plain_product)(a, y))) is None  # not a view


def test_the_pass_copies_only_the_operands_that_need_it():
    a, y = _inputs()
    for function, copies in ((gradient_like_product, 1), (plain_product, 0)):
        graph = make_fx(function)(a, y)
        BatchMajorBmmInputs()(graph.graph)
        graph.recompile()
        pinned = graph.graph.find_nodes(op="call_function", target=aten.as_strided.default)
        assert len(pinned) == copies, function.__name__
        assert torch.allclose(graph(a, y), function(a, y))


def _selects_per_call(options: dict) -> int:
    a, y = _inputs()
    compiled = torch._inductor.compile(make_fx(gradient_like_product)(a, y), [a, y], options=options)
    out = compiled(a, y)
    out = out[0] if isinstance(out, (list, tuple)) else out
    assert torch.allclose(out, gradient_like_product(a, y), rtol=1e-5, atol=1e-5)
    with profile() as prof:
        compiled(a, y)
    return sum(event.count for event in prof.key_averages() if event.key == "aten::select")


def test_under_inductor_the_product_is_one_blas_call():
    """
    ATen's CPU bmm loops over the batch (a select per matrix) when an operand's matrices
    have no unit stride: inductor alone does that here, with the pass it does not.
    """
    settings = inductor_settings()
    assert isinstance(settings["post_grad_custom_post_pass"], BatchMajorBmmInputs)
    without_pass = {k: v for k, v in settings.items() if k != "post_grad_custom_post_pass"}
    assert _selects_per_call(without_pass) >= 100  # one per batch element at least
    assert _selects_per_call(settings) == 0
