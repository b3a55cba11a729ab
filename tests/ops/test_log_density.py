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


def _bernoulli_cases():
    torch.manual_seed(2)
    value = (torch.rand(40, 30) < 0.4).float()
    mask = torch.rand(40, 30) < 0.8
    logits = torch.randn(8, 9, 40, 30) * 3
    logits[0, 0, 0, 0] = 40.0  # far in the tails: no overflow either way
    logits[0, 0, 0, 1] = -40.0
    return value, mask, logits


@pytest.mark.parametrize("masked", [False, True, "expanded"])
@pytest.mark.parametrize("event", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_bernoulli_logits_equals_torch(masked, event, grad, monkeypatch):
    from pyro_tmc.ops import log_density

    monkeypatch.setattr(log_density, "MIN_BERNOULLI_TERMS", 1000)
    monkeypatch.setattr(log_density, "BERNOULLI_BLOCK_TERMS", 5000)  # several blocks, a partial last one
    value, mask, logits = _bernoulli_cases()
    logits = logits.clone().requires_grad_(grad)
    fn = dist.Bernoulli(logits=logits)
    if masked:
        fn = fn.mask(mask.expand(8, 9, 40, 30) if masked == "expanded" else mask)
    if event:
        fn = fn.to_event(1)
    fast = log_density.bernoulli_logits_log_prob(fn, value)
    slow = fn.log_prob(value)
    assert fast is not None and fast.shape == slow.shape
    assert torch.allclose(fast, slow, rtol=1e-6, atol=1e-4)
    if grad:
        (fast_grad,) = torch.autograd.grad(fast.sum(), [logits])
        (slow_grad,) = torch.autograd.grad(slow.sum(), [logits])
        assert torch.isfinite(fast_grad).all() and torch.allclose(fast_grad, slow_grad, atol=1e-6)


def test_bernoulli_logits_falls_back(monkeypatch):
    from pyro_tmc.ops import log_density

    monkeypatch.setattr(log_density, "MIN_BERNOULLI_TERMS", 1000)
    value, mask, logits = _bernoulli_cases()
    fast = log_density.bernoulli_logits_log_prob
    assert fast(dist.Bernoulli(logits=logits).to_event(1), value * 0.5) is None  # soft labels: torch's route
    assert fast(dist.Bernoulli(probs=logits.sigmoid()), value) is None  # probs, not logits
    assert fast(dist.Bernoulli(logits=logits[0, 0]), value) is None  # nothing broadcast
    assert fast(dist.Bernoulli(logits=logits).mask(False), value) is None  # Pyro's zeros
    assert fast(dist.Normal(logits, 1.0), value) is None
    small = dist.Bernoulli(logits=logits[:1, :1, :2])
    assert fast(small, value[:1]) is None  # below MIN_BERNOULLI_TERMS's 1000 terms
    with pytest.raises(ValueError):  # validation as torch's: a value outside {0, 1}
        log_density.log_prob(dist.Bernoulli(logits=logits, validate_args=True), value + 2 * (value == 0))
