"""Log densities of many sites in one call equal each site's own log_prob."""

import dataclasses
import math

import pytest
import torch

import pyro
import pyro.distributions as dist

from pyro_tmc import TMC_ELBO, batched_densities
from pyro_tmc.estimate.batched_densities import MIN_GROUP, site_densities, stacked_log_probs


def batched_log_probs(pairs):
    """Each pair's slice of its group's stack (:func:`stacked_log_probs`), or ``None``."""
    return [None if where is None else where[0][where[1]] for where in stacked_log_probs(pairs)]


def _pairs(make, count=MIN_GROUP + 2):
    generator = torch.Generator().manual_seed(0)
    return [make(generator) for _ in range(count)]


def _randn(generator, *shape):
    return torch.randn(shape, generator=generator)


STACKABLE = {
    "normal_particles_vs_parents": lambda g: (
        dist.Normal(_randn(g, 5, 1), _randn(g).exp()),
        _randn(g, 5),
    ),
    "normal_scalar_params": lambda g: (dist.Normal(_randn(g), 1.3), _randn(g, 4, 1)),
    "bernoulli_logits": lambda g: (
        dist.Bernoulli(logits=_randn(g, 3, 1)),
        torch.bernoulli(torch.full((3, 6), 0.4), generator=g),
    ),
    "bernoulli_probs": lambda g: (
        dist.Bernoulli(probs=torch.rand(3, 1, generator=g)),
        torch.bernoulli(torch.full((6,), 0.4), generator=g),
    ),
    "gamma": lambda g: (dist.Gamma(_randn(g, 4).exp(), _randn(g).exp()), _randn(g, 2, 4).exp()),
    "categorical_logits_keep_their_event_dim": lambda g: (
        dist.Categorical(logits=_randn(g, 3, 1, 4)),  # an HMM's emission: states x plate x symbols
        torch.randint(4, (5,), generator=g),
    ),
    "categorical_probs": lambda g: (
        dist.Categorical(probs=torch.rand(2, 3, generator=g) + 0.1),
        torch.randint(3, (4, 1), generator=g),
    ),
    "independent_normal": lambda g: (
        dist.Normal(_randn(g, 3, 1, 2), 0.7).to_event(1),
        _randn(g, 4, 2),
    ),
}


@pytest.mark.parametrize("case", list(STACKABLE))
def test_batched_equals_site_by_site(case):
    pairs = _pairs(STACKABLE[case])
    batched = batched_log_probs(pairs)
    for (fn, value), log_prob in zip(pairs, batched):
        assert log_prob is not None
        expected = fn.log_prob(value)
        # at most extra leading size-1 dims, which packing ignores
        assert log_prob.squeeze().shape == expected.squeeze().shape
        assert torch.allclose(log_prob.reshape(expected.shape), expected, rtol=1e-6, atol=1e-6)


def test_gradients_flow_to_each_site():
    locs = [torch.randn(5, 1, requires_grad=True) for _ in range(MIN_GROUP)]
    values = [torch.randn(5) for _ in range(MIN_GROUP)]
    batched = batched_log_probs([(dist.Normal(loc, 0.5), v) for loc, v in zip(locs, values)])
    grads = torch.autograd.grad(sum(lp.sum() for lp in batched), locs)
    expected = torch.autograd.grad(
        sum(dist.Normal(loc, 0.5).log_prob(v).sum() for loc, v in zip(locs, values)), locs
    )
    for a, b in zip(grads, expected):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


class ShiftedNormal(dist.Normal):
    """A user's subclass: state outside its constructor, so it is never rebuilt."""

    def __init__(self, loc, scale, shift):
        super().__init__(loc, scale)
        self.shift = shift

    def log_prob(self, value):
        return super().log_prob(value) + self.shift


NOT_STACKABLE = {
    "too_few": lambda g: (dist.Normal(_randn(g), 1.0), _randn(g, 3)),
    "multivariate": lambda g: (dist.MultivariateNormal(_randn(g, 2), torch.eye(2)), _randn(g, 2)),
    "user_subclass": lambda g: (ShiftedNormal(_randn(g), 1.0, 0.5), _randn(g, 3)),
    "delta_dependent_constraint": lambda g: (dist.Delta(_randn(g, 3)), _randn(g, 3)),
    "setting_outside_the_parameters": lambda g: (  # rebuilt from probs alone, lims would be lost
        torch.distributions.ContinuousBernoulli(probs=torch.rand(3, generator=g), lims=(0.2, 0.8)),
        torch.rand(3, generator=g),
    ),
}


@pytest.mark.parametrize("case", list(NOT_STACKABLE))
def test_left_to_each_site(case):
    pairs = _pairs(NOT_STACKABLE[case], count=MIN_GROUP - 1 if case == "too_few" else MIN_GROUP + 1)
    assert all(log_prob is None for log_prob in batched_log_probs(pairs))


def test_shapes_that_differ_form_separate_groups():
    g = torch.Generator().manual_seed(1)
    pairs = [(dist.Normal(_randn(g, 3, 1), 1.0), _randn(g, 3)) for _ in range(MIN_GROUP)]
    pairs += [(dist.Normal(_randn(g, 3), 1.0), _randn(g, 3, 1)) for _ in range(MIN_GROUP)]
    pairs += [(dist.Normal(_randn(g, 2), 1.0), _randn(g, 2))]  # alone: site by site
    batched = batched_log_probs(pairs)
    assert batched[-1] is None
    for (fn, value), log_prob in zip(pairs[:-1], batched[:-1]):
        assert torch.allclose(log_prob.reshape(fn.log_prob(value).shape), fn.log_prob(value))


def test_invalid_value_falls_back_to_the_site():
    """A stacked evaluation that raises leaves the group to the sites, whose error names the site."""
    pairs = [
        (dist.Poisson(torch.tensor(2.0), validate_args=True), torch.tensor(-1.0)) for _ in range(MIN_GROUP)
    ]
    assert all(log_prob is None for log_prob in batched_log_probs(pairs))


# -- a pyro.markov chain: the estimate with and without stacking, on the same draw ------


def chain_model(x, N):
    z = x.new_zeros(())
    for i in pyro.markov(range(1, N + 1)):
        z = pyro.sample(f"z_{i}", dist.Normal(z, math.sqrt(1.0 / N)))
        pyro.sample(f"y_{i}", dist.Normal(z, 1.0), obs=x[i - 1])


def chain_guide(x, N):
    loc = pyro.param("loc", lambda: 0.1 * torch.arange(N, dtype=x.dtype))
    log_scale = pyro.param("log_scale", lambda: -torch.ones(N, dtype=x.dtype))
    for i in pyro.markov(range(1, N + 1)):
        pyro.sample(f"z_{i}", dist.Normal(loc[i - 1], log_scale[i - 1].exp()))


@pytest.mark.parametrize("variance_reduction", [None, "dregs"])
def test_chain_estimate_equals_site_by_site(monkeypatch, variance_reduction):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    N = 20
    x = torch.randn(N)
    elbo = TMC_ELBO(num_samples=6, max_plate_nesting=0, variance_reduction=variance_reduction)
    draw = elbo.draw(chain_model, chain_guide, x, N)
    params = list(pyro.get_param_store()._params.values())
    densities = site_densities(draw.model_trace, draw.guide_trace)
    # every y and every z but the first (its prior has other shapes), every q(z)
    assert len(densities.log_p) == 2 * N - 1 and len(densities.log_q) == N
    # and each of those factors says which stack it is a slice of, for the contraction
    assert sum(f.stacked is not None for f in draw.factors()) == 3 * N - 1
    stacked = draw.log_estimate()
    stacked_grads = torch.autograd.grad(stacked, params, retain_graph=True)
    monkeypatch.setattr(batched_densities, "MIN_GROUP", 10**9)  # every site on its own
    eager = dataclasses.replace(draw).log_estimate()
    eager_grads = torch.autograd.grad(eager, params)
    assert stacked.item() == pytest.approx(eager.item(), rel=1e-6, abs=1e-5)
    for a, b in zip(stacked_grads, eager_grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
