"""The expanded-square Gaussian log density equals Normal.log_prob, values and gradients."""

import pytest
import torch

import pyro.distributions as dist

from pyro_tmc.ops.log_density import gaussian_pairwise_log_prob, log_prob


@pytest.mark.parametrize("units", [8, 64])
@pytest.mark.parametrize("offset", [0.0, 30.0])
def test_pairwise_gaussian_equals_elementwise(units, offset):
    torch.manual_seed(0)
    value = (torch.randn(20, 1, 5, units) + offset).requires_grad_()
    loc = (torch.randn(1, 12, 5, units) + offset).requires_grad_()
    scale = (torch.rand(1, 12, 5, units) + 0.05).requires_grad_()
    fn = dist.Normal(loc, scale).to_event(1)
    fast = gaussian_pairwise_log_prob(fn, value)
    slow = fn.log_prob(value)
    assert fast is not None and fast.shape == slow.shape == (20, 12, 5)
    # float32 tolerance relative to the terms' size (values reach about -1e4 here)
    assert torch.allclose(fast, slow, rtol=1e-5, atol=1e-3 * (1 + slow.abs().max().item() / 1e4))
    grads_fast = torch.autograd.grad(fast.sum(), [value, loc, scale])
    grads_slow = torch.autograd.grad(slow.sum(), [value, loc, scale])
    for a, b in zip(grads_fast, grads_slow):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-3)


def test_falls_back_where_not_faster():
    value = torch.randn(20, 1, 4)
    assert (
        gaussian_pairwise_log_prob(dist.Normal(torch.randn(12, 4), 1.0).to_event(1), value) is None
    )  # 4 units
    assert gaussian_pairwise_log_prob(dist.Normal(torch.randn(12, 1), 1.0), value) is None  # no event
    same = dist.Normal(torch.randn(20, 1, 16), 1.0).to_event(1)  # no parent dims to broadcast
    assert gaussian_pairwise_log_prob(same, torch.randn(20, 1, 16)) is None
    assert torch.allclose(log_prob(same, torch.zeros(20, 1, 16)), same.log_prob(torch.zeros(20, 1, 16)))


def test_scalar_gaussian_equals_elementwise():
    from pyro_tmc.ops.log_density import scalar_gaussian_log_prob

    torch.manual_seed(1)
    value = torch.randn(7, 1, 5).requires_grad_()
    loc = torch.randn(1, 6, 5).requires_grad_()
    scale = (torch.rand(1, 6, 5) + 0.1).requires_grad_()
    fn = dist.Normal(loc, scale)
    fast = scalar_gaussian_log_prob(fn, value)
    slow = fn.log_prob(value)
    assert fast is not None and torch.allclose(fast, slow, rtol=1e-5, atol=1e-5)
    for a, b in zip(
        torch.autograd.grad(fast.sum(), [value, loc, scale]),
        torch.autograd.grad(slow.sum(), [value, loc, scale]),
    ):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-4)
    assert (
        scalar_gaussian_log_prob(dist.Normal(loc, scale), torch.randn(3, 6, 5)) is None
    )  # nothing to broadcast
