"""A step traced forward only, its backward derived: grad modes kept, custom backwards kept.

The captured step (:mod:`pyro_tmc.compile.captured_step`) traces the forward alone, rolls it,
and takes autograd's backward of the rolled forward. The eager step's gradient must
come out: operations the eager step ran without grad stay undifferentiated, and a
custom ``autograd.Function``'s own backward is used, not the derivative of its forward.
"""

import warnings

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import pyro
import pyro.distributions as dist

from pyro_tmc import TMC_ELBO
from pyro_tmc.compile.forward_trace import (
    GradModeMarks,
    InGradModes,
    custom_backward,
    derive_backward,
    runs_without_grad,
)
from tests.common.compile_cases import (
    DoubleGrad,
    assert_same_step,
    chain_guide,
    chain_model,
    replay_and_eager,
    toy_guide,
    toy_model,
)


def _captured_equals_eager(model, guide):
    """A replayed toy step equals the eager step on the same draw (values and gradients, 1e-5)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x = torch.randn(6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # captured, no fallback
        replayed, eager = replay_and_eager(
            lambda **kw: TMC_ELBO(num_samples=4, max_plate_nesting=1, **kw), model, guide, (x,)
        )
    assert_same_step(replayed, eager)


def _step(p, x):
    y = (p * x).exp()
    with torch.no_grad():
        stopped = p * 3.0  # the eager step does not differentiate this
    (g,) = torch.autograd.grad(y.sum(), p, retain_graph=True)  # nor an inner gradient
    return (y * stopped).sum() + (g * p).sum(), torch.tensor(False)


def _marked_step(p, x):
    with GradModeMarks():
        return _step(p, x)


def test_operations_run_without_grad_are_marked_and_stay_undifferentiated():
    p, x = torch.randn(3, requires_grad=True), torch.randn(3)
    graph = make_fx(_marked_step, tracing_mode="fake")(p, x)
    marked = [n for n in graph.graph.nodes if runs_without_grad(n)]
    assert any(n.target is torch.ops.aten.mul.Tensor for n in marked)  # the stopped product
    assert all(n.op == "call_function" for n in marked)

    joint = derive_backward(InGradModes(graph).run, [p, x], num_params=1)
    loss, _, grad = joint(p.detach(), x)
    leaf = p.detach().requires_grad_()
    expected_loss, _ = _step(leaf, x)
    (expected,) = torch.autograd.grad(expected_loss, leaf)
    assert torch.allclose(loss, expected_loss.detach())
    assert torch.allclose(grad, expected)
    # the derivative of every operation, stopped ones included, differs
    leaf = p.detach().requires_grad_()
    y = (leaf * x).exp()
    (g,) = torch.autograd.grad(y.sum(), leaf, create_graph=True)
    (unstopped,) = torch.autograd.grad((y * leaf * 3.0).sum() + (g * leaf).sum(), leaf)
    assert not torch.allclose(grad, unstopped, rtol=1e-3)


def test_custom_backward_is_found_and_cond_is_not():
    x = torch.randn(3, requires_grad=True)
    assert custom_backward(DoubleGrad.apply(x).sum()) == "DoubleGrad"
    assert custom_backward((x * 2).sum()) is None


def doubled_model(x):
    """A model whose likelihood passes through an identity whose backward doubles the gradient."""
    theta = pyro.sample("theta", dist.Normal(x.new_zeros(()), 1.0))
    with pyro.plate("data", x.shape[-1], dim=-1):
        z = pyro.sample("z", dist.Normal(theta, 1.0))
        pyro.sample("x", dist.Normal(DoubleGrad.apply(z), 1.0), obs=x)


def test_a_custom_backward_is_captured_with_its_own_backward():
    _captured_equals_eager(doubled_model, toy_guide)


@pytest.mark.parametrize("variance_reduction", ["stl", "dregs"])
def test_a_rolled_chain_with_inner_gradients_equals_the_eager_step(variance_reduction):
    """STL and DReGs take an inner gradient in the forward: rolled, it must stay a constant."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)

    def make_loss(**kwargs):
        loss = TMC_ELBO(num_samples=4, max_plate_nesting=0, variance_reduction=variance_reduction, **kwargs)
        loss.step_program.roll_above = 0
        loss.step_program.choose_faster = False
        return loss

    assert_same_step(*replay_and_eager(make_loss, chain_model, chain_guide, (torch.tensor(0.7), 24)))


def stopping_guide(x):
    """A guide whose scale follows its location with the gradient stopped, by ``no_grad``."""
    loc = pyro.param("theta_loc", torch.tensor(0.3))
    with torch.no_grad():
        scale = 0.5 + loc.abs()
    pyro.sample("theta", dist.Normal(loc, scale))
    with pyro.plate("data", x.shape[-1], dim=-1):
        z_loc = pyro.param("z_loc", torch.zeros(x.shape[-1]))
        pyro.sample("z", dist.Normal(z_loc, 1.0))


def test_a_gradient_stopped_by_no_grad_stays_stopped_under_capture():
    _captured_equals_eager(toy_model, stopping_guide)


def hooked_model(x):
    """A model whose latent's gradient is tripled by a tensor hook."""
    theta = pyro.sample("theta", dist.Normal(x.new_zeros(()), 1.0))
    with pyro.plate("data", x.shape[-1], dim=-1):
        z = pyro.sample("z", dist.Normal(theta, 1.0))
        if z.requires_grad:
            z.register_hook(lambda grad: 3 * grad)
        pyro.sample("x", dist.Normal(z, 1.0), obs=x)


def test_a_tensor_hook_is_captured_with_its_own_backward():
    _captured_equals_eager(hooked_model, toy_guide)
