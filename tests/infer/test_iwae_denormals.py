"""IWAE's joint samples hand the backward no subnormal number (issue 42, R1).

Each joint sample's log weight is a sum over the whole batch, so the K log weights lie
tens to hundreds of nats apart. Their exact softmax weights, by which every gradient of
the step is scaled, were then subnormal in float32 (``exp(-87)`` and below) or so small
that the networks' backward products became subnormal: the paper's MNIST VAE step took
2.6-4x Pyro's ``RenyiELBO`` on a CPU. The logsumexp over the joint dim now drops the
terms below the dtype's precision, in value and gradient alike. No timing here: these
tests look for the subnormals themselves.
"""

import collections
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pyro
import pyro.distributions as dist

from pyro_tmc import IWAE_ELBO
from pyro_tmc.ops.contraction import contract_log_factors
from pyro_tmc.ops.underflow import logsumexp_to_precision


def _subnormals(tensor: torch.Tensor) -> int:
    if not tensor.is_floating_point():
        return 0
    return int(((tensor != 0) & (tensor.abs() < torch.finfo(tensor.dtype).tiny)).sum())


class _CountSubnormals(TorchDispatchMode):
    """Counts, per operation, the subnormal entries of every tensor an operation returns."""

    def __init__(self):
        super().__init__()
        self.found = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__.startswith(("empty", "new_empty")):
            return out  # uninitialised memory, overwritten before it is read
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                count = _subnormals(tensor)
                if count:
                    self.found[str(func)] += count
        return out


#: log weights whose gaps to the largest span float32's subnormal range (-87.3 to -103.3)
SPREAD_LOG_WEIGHTS = [0.0, -3.0, -25.0, -60.0, -70.0, -88.0, -90.0, -95.0, -100.0, -130.0]


def test_logsumexp_to_precision_value_and_gradient():
    x = torch.tensor(SPREAD_LOG_WEIGHTS, requires_grad=True)
    value = logsumexp_to_precision(x, [0])
    (grad,) = torch.autograd.grad(value, [x])
    exact = x.detach().double().requires_grad_()
    (exact_grad,) = torch.autograd.grad(torch.logsumexp(exact, 0), [exact])
    eps = torch.finfo(torch.float32).eps
    assert value.item() == pytest.approx(torch.logsumexp(exact, 0).item(), abs=eps)
    floor = eps / x.numel()
    kept = exact_grad > floor
    assert torch.allclose(grad[kept].double(), exact_grad[kept], rtol=1e-6)
    assert (grad[~kept] == 0).all()
    assert _subnormals(grad) == 0
    # the exact gradient is the hazard: its float32 weights are subnormal
    (plain_grad,) = torch.autograd.grad(torch.logsumexp(x, 0), [x])
    assert _subnormals(plain_grad) > 0


def test_logsumexp_to_precision_of_minus_infinity_is_minus_infinity_with_zero_gradient():
    x = torch.tensor([[-math.inf] * 3, [0.0, -math.inf, -200.0]], requires_grad=True)
    value = logsumexp_to_precision(x, [1])
    (grad,) = torch.autograd.grad(value, [x], grad_outputs=torch.ones_like(value))
    assert value.tolist() == [-math.inf, 0.0]
    assert grad.tolist() == [[0.0] * 3, [1.0, 0.0, 0.0]]


def test_logsumexp_to_precision_in_float64_is_exact_where_weights_are_close():
    x = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 5
    x.requires_grad_()
    value = logsumexp_to_precision(x, [0])
    exact = torch.logsumexp(x, 0)
    assert torch.allclose(value, exact, rtol=1e-15, atol=0)
    (grad,) = torch.autograd.grad(value.sum(), [x])
    (exact_grad,) = torch.autograd.grad(exact.sum(), [x])
    assert torch.allclose(grad, exact_grad, rtol=1e-12, atol=1e-15)


def test_joint_dim_contraction_gradient_has_no_subnormals():
    """
    The contraction IWAE's joint dim takes (one particle dim ``k`` outside the plate ``a``):
    factors whose plate sums are the spread log weights above. Its gradient is the exact
    one, in float64, to float32's precision, with no subnormal entry.
    """
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(len(SPREAD_LOG_WEIGHTS), 6, generator=generator)
    noise = noise - noise.mean(1, keepdim=True)  # leaves each row's plate sum as it is
    local = (torch.tensor(SPREAD_LOG_WEIGHTS)[:, None] / 6 + noise).requires_grad_()
    local._pyro_dims = "ka"
    log_k = torch.full((len(SPREAD_LOG_WEIGHTS),), -math.log(len(SPREAD_LOG_WEIGHTS)))
    log_k._pyro_dims = "k"
    value = contract_log_factors([local, log_k], {"a": 1.0})
    (grad,) = torch.autograd.grad(value, [local])
    exact = local.detach().double().requires_grad_()
    exact_value = torch.logsumexp(exact.sum(1) + log_k.double(), 0)
    (exact_grad,) = torch.autograd.grad(exact_value, [exact])
    assert value.item() == pytest.approx(exact_value.item(), abs=1e-5)
    assert torch.allclose(grad.double(), exact_grad, atol=torch.finfo(torch.float32).eps, rtol=1e-5)
    assert _subnormals(grad) == 0


N = 10


def _model(x):
    with pyro.plate("data", N):
        z = pyro.sample("z", dist.Normal(torch.zeros(N), 1.0))
        pyro.sample("x", dist.Normal(z, 0.3), obs=x)


def _guide(x):
    loc = pyro.param("loc", torch.zeros(N))
    scale = pyro.param("scale", torch.ones(N), constraint=dist.constraints.positive)
    with pyro.plate("data", N):
        pyro.sample("z", dist.Normal(loc, scale))


@pytest.mark.parametrize("seed", [0, 1, 10, 11])
def test_iwae_step_makes_no_subnormals(seed, fresh_pyro):
    """
    A loose guide, 10 data points, K=20: the joint samples' log weights lie ~100 nats
    apart. On ed7f8c8, with these seeds, the step's operations returned 219-815
    subnormal entries (the weights, then every gradient they scaled); now none.
    """
    pyro.set_rng_seed(seed)
    elbo = IWAE_ELBO(num_samples=20, max_plate_nesting=1)
    counter = _CountSubnormals()
    with counter:
        loss = elbo.loss_and_grads(_model, _guide, torch.zeros(N))
    assert math.isfinite(loss)
    assert not counter.found, dict(counter.found)
    for name in ("loc", "scale"):
        grad = pyro.param(name).unconstrained().grad
        assert grad is not None and torch.isfinite(grad).all() and _subnormals(grad) == 0
