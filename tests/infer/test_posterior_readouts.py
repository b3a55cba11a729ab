"""sample_posterior on nested plates (issue 20, item 6): a latent in the outer of two nested plates
has a singleton slot for the inner plate, whose packed symbol is "". The draws must keep the site's
shape, pick particles of the site, and average to compute_marginals' mean of the same TMC draw."""

import math

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro.infer.autoguide import AutoNormal

from pyro_tmc import IWAE_ELBO, TMC_ELBO
from pyro_tmc.infer import posterior

NUM_OUTER, NUM_INNER = 4, 5


def nested_model(y):
    """A global mean, one latent per outer element (shape (4, 1)), one per (outer, inner) element."""
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("outer", NUM_OUTER, dim=-2):
        a = pyro.sample("a", dist.Normal(mu, 1.0))
        with pyro.plate("inner", NUM_INNER, dim=-1):
            b = pyro.sample("b", dist.Normal(a, 1.0))
            pyro.sample("y", dist.Normal(b, 1.0), obs=y)


def nested_guide(y):
    """The prior's marginal scales, wide enough to cover the posterior."""
    pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("outer", NUM_OUTER, dim=-2):
        pyro.sample("a", dist.Normal(torch.zeros(NUM_OUTER, 1), 1.5))
        with pyro.plate("inner", NUM_INNER, dim=-1):
            pyro.sample("b", dist.Normal(torch.zeros(NUM_OUTER, NUM_INNER), 2.0))


SHAPES = {"mu": (), "a": (NUM_OUTER, 1), "b": (NUM_OUTER, NUM_INNER)}


@pytest.fixture
def data():
    return torch.randn(NUM_OUTER, NUM_INNER, generator=torch.Generator().manual_seed(0))


def _draw(y, num_samples=3):
    return TMC_ELBO(num_samples=num_samples, max_plate_nesting=2).draw(nested_model, nested_guide, y)


def test_draws_keep_the_site_shapes(data, fresh_pyro):
    samples = _draw(data).sample(10)
    assert {name: tuple(value.shape) for name, value in samples.items()} == {
        name: (10,) + shape for name, shape in SHAPES.items()
    }


def test_outer_plate_latent_alone_reproduces_the_issue(fresh_pyro):
    """The issue's own model: one latent in the outer plate, the observations in the inner."""

    def model(y):
        with pyro.plate("outer", NUM_OUTER, dim=-2):
            a = pyro.sample("a", dist.Normal(0.0, 1.0))
            with pyro.plate("inner", NUM_INNER, dim=-1):
                pyro.sample("y", dist.Normal(a, 1.0), obs=y)

    def guide(y):
        with pyro.plate("outer", NUM_OUTER, dim=-2):
            pyro.sample("a", dist.Normal(torch.zeros(NUM_OUTER, 1), 1.0))

    y = torch.randn(NUM_OUTER, NUM_INNER)
    samples = TMC_ELBO(num_samples=3, max_plate_nesting=2).sample_posterior(model, guide, y, num_draws=10)
    assert samples["a"].shape == (10, NUM_OUTER, 1)


def test_drawn_values_are_particles_of_the_site(data, fresh_pyro):
    draw = _draw(data, num_samples=4)
    samples = draw.sample(50)
    for name, shape in SHAPES.items():
        site = draw.model_trace.nodes[name]
        particles = posterior._particles_last(site, site["value"], 0)  # plate shape + (K,)
        assert particles.shape == shape + (4,)
        drawn = samples[name]  # (draws,) + plate shape
        # each draw's value, at each plate element, equals one of that element's K particles
        hits = (drawn.unsqueeze(-1) == particles).sum(-1)
        assert torch.equal(hits, torch.ones_like(hits)), name


def test_draws_average_to_the_marginal_mean(data, fresh_pyro):
    """
    Joint draws from one TMC draw are exact draws from its weighted particles, so their mean
    matches that draw's compute_marginals mean within its Monte Carlo error sqrt(var / n).
    Measured (seed 0, n = 4000): largest |difference| / standard error 1.96 over the 25 values.
    """
    num_draws = 4000
    draw = _draw(data, num_samples=8)
    samples = draw.sample(num_draws)
    marginals = draw.marginals()
    for name in SHAPES:
        mean, variance = marginals[name].mean, marginals[name].variance
        standard_error = (variance / num_draws).sqrt()
        z = (samples[name].mean(0) - mean).abs() / standard_error.clamp(min=1e-6)
        assert z.max() < 4.5, (name, z)


def test_autonormal_point_mass_sites_on_nested_plates(data, fresh_pyro):
    """AutoNormal's Delta sites take their values from the auxiliary site's drawn particles."""
    guide = AutoNormal(nested_model)
    elbo = TMC_ELBO(num_samples=3, max_plate_nesting=2)
    samples = elbo.sample_posterior(nested_model, guide, data, num_draws=6)
    for name, shape in SHAPES.items():
        assert samples[name].shape == (6,) + shape, name
        assert torch.isfinite(samples[name]).all()
    assert not math.isnan(float(samples["a"].std()))


def test_iwae_marginal_of_an_unplated_delta_beside_a_plated_latent():
    """
    IWAE's joint index is shared by every site; an unplated AutoNormal Delta (``mu``) takes the
    weights of that index, which a plated site (``theta``) carries equally in every plate element.
    Before the fix, ``mu`` was given ``theta``'s plated weights and the read-out raised.
    """

    def model(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        with pyro.plate("groups", 3, dim=-1):
            theta = pyro.sample("theta", dist.Normal(mu, 1.0))
            pyro.sample("y", dist.Normal(theta, 1.0), obs=y)

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    y = torch.tensor([1.0, 2.0, 3.0])
    guide = AutoNormal(model)
    guide(y)
    marginals = IWAE_ELBO(num_samples=8, max_plate_nesting=1).compute_marginals(model, guide, y)
    theta_weights = marginals["theta"].log_weights  # (3, 8): one row per plate element
    assert torch.allclose(theta_weights, theta_weights[:1].expand_as(theta_weights), atol=1e-5)
    mu_weights = marginals["mu"].log_weights
    assert mu_weights.shape == (8,)
    assert torch.allclose(mu_weights.softmax(-1), theta_weights[0].softmax(-1), atol=1e-6)
