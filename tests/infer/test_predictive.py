"""predictive_log_likelihood against exact Gaussian posterior predictive densities (issue 20, item 4).

Every model here is linear-Gaussian, so log p(y_test | y_train) = log N(y_all) - log N(y_train) with
the marginal covariances written out. The estimate must land within 3 of its own standard errors.
Measured z-scores (estimate - exact) / standard error over seeds 0-5, 2000 draws from one TMC draw:
global mean at K = 4096: 0.47, 0.1, -0.59, -1.13, 0.02, 1.6; with local latents marginalised
(K = 64 inside): -0.53, -0.62, 1.06, -1.21, 0.28, 2.8; group means shared with the test rows, 8 TMC
draws of K = 1024 pooled: 0.57, -0.27, -0.16, -1.40, 0.27, -0.60 (one TMC draw of K = 256 and a guide
off the posterior: up to 3.5, as the standard error covers the draws, not the draw's particle set).
"""

import math

import pytest
import torch

import pyro
import pyro.distributions as dist

from pyro_tmc import TMC_ELBO
from pyro_tmc.infer import PredictiveLogLikelihood, posterior_draws, predictive_log_likelihood

NUM_TRAIN, NUM_TEST = 20, 7


@pytest.fixture
def data():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(NUM_TRAIN, generator=generator) + 0.7, torch.randn(NUM_TEST, generator=generator) + 0.7


def global_mean_model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", y.shape[0]):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def local_latent_model(y):
    """z_i ~ N(mu, 1), y_i ~ N(z_i, 1): each test row brings a new z_i, marginalised under the prior."""
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", y.shape[0]):
        z = pyro.sample("z", dist.Normal(mu, 1.0))
        pyro.sample("y", dist.Normal(z, 1.0), obs=y)


def _log_normal(y: torch.Tensor, cov: torch.Tensor) -> float:
    y = y.double()
    return float(dist.MultivariateNormal(torch.zeros(len(y), dtype=torch.float64), cov).log_prob(y))


def exact_predictive(y_train, y_test, design_train, design_test, prior_cov, noise_var):
    """log p(y_test | y_train) for y = design @ u + N(0, noise_var), u ~ N(0, prior_cov)."""
    design = torch.cat([design_train, design_test]).double()
    marginal = design @ prior_cov @ design.T + noise_var * torch.eye(len(design), dtype=torch.float64)
    n = len(y_train)
    return _log_normal(torch.cat([y_train, y_test]), marginal) - _log_normal(y_train, marginal[:n, :n])


def _mean_only(y_train, y_test, noise_var):
    ones = torch.ones
    return exact_predictive(
        y_train,
        y_test,
        ones(len(y_train), 1),
        ones(len(y_test), 1),
        torch.eye(1, dtype=torch.float64),
        noise_var,
    )


def _posterior_of_mean(y_train, noise_var):
    variance = 1.0 / (1.0 + len(y_train) / noise_var)
    return variance * float(y_train.sum()) / noise_var, variance


def _assert_within_three_standard_errors(result: PredictiveLogLikelihood, exact: float):
    z = (float(result.log_likelihood) - exact) / float(result.standard_error)
    assert abs(z) < 3.0, (float(result.log_likelihood), exact, float(result.standard_error))


def test_exact_posterior_draws_give_the_exact_predictive(data):
    """The predictive step alone: draws from the exact posterior of the mean."""
    y_train, y_test = data
    mean, variance = _posterior_of_mean(y_train, 1.0)
    draws = {"mu": mean + math.sqrt(variance) * torch.randn(4000, generator=torch.Generator().manual_seed(1))}
    result = predictive_log_likelihood(global_mean_model, draws, y_test)
    assert result.log_likelihoods.shape == (4000,)
    _assert_within_three_standard_errors(result, _mean_only(y_train, y_test, 1.0))
    assert result.effective_sample_size > 1000


def test_one_draw_is_the_plug_in_log_likelihood(data):
    """One draw and no local latents: exactly sum_i log N(y_i; mu, 1), with no standard error."""
    _, y_test = data
    result = predictive_log_likelihood(global_mean_model, {"mu": torch.tensor([0.3])}, y_test)
    exact = dist.Normal(0.3, 1.0).log_prob(y_test).sum()
    assert torch.allclose(result.log_likelihood, exact, atol=1e-5)
    assert math.isnan(float(result.standard_error))


def test_tmc_posterior_draws_give_the_exact_predictive(data, fresh_pyro):
    y_train, y_test = data
    mean, variance = _posterior_of_mean(y_train, 1.0)

    def guide(y):
        pyro.sample("mu", dist.Normal(mean, 2 * math.sqrt(variance)))

    elbo = TMC_ELBO(num_samples=4096, max_plate_nesting=1)
    draws = elbo.sample_posterior(global_mean_model, guide, y_train, num_draws=2000)
    result = predictive_log_likelihood(global_mean_model, draws, y_test)
    _assert_within_three_standard_errors(result, _mean_only(y_train, y_test, 1.0))


def test_pooled_tmc_draws_weighted_by_evidence(data, fresh_pyro):
    """
    Small K and the prior as guide: one TMC draw's particles are a crude posterior. Pooling 40 TMC
    draws, each weighted by its P_TMC, is consistent, and its standard error (over the pools) covers
    the particles' error. Measured (seeds 0-4, K = 8): z = -0.2, -0.9, -1.3, 0.3, 1.0; pooled with
    equal weights -2.5, -2.9, -3.0, -1.8, -1.4 (the small-K bias); one TMC draw's 50 draws alone,
    with the within-draw error, 2.1, -3.7, 7.1, 78, 2.9.
    """
    y_train, y_test = data

    def guide(y):
        pyro.sample("mu", dist.Normal(0.0, 1.0))

    elbo = TMC_ELBO(num_samples=8, max_plate_nesting=1)
    pooled = posterior_draws(elbo, global_mean_model, guide, y_train, num_tmc_draws=40, num_draws=50)
    assert len(pooled.samples) == 40 and pooled.log_evidences.shape == (40,)
    result = predictive_log_likelihood(global_mean_model, pooled, y_test)
    assert result.log_likelihoods.shape == result.log_weights.shape == (2000,)
    assert torch.logsumexp(result.log_weights, 0).abs() < 1e-5  # the draws' weights sum to one
    _assert_within_three_standard_errors(result, _mean_only(y_train, y_test, 1.0))
    equal = predictive_log_likelihood(global_mean_model, pooled.samples, y_test)
    assert torch.allclose(equal.log_weights, torch.full((2000,), -math.log(2000.0)))


def test_local_latents_of_test_rows_are_marginalised(data, fresh_pyro):
    """y_i | mu ~ N(mu, 2) once z_i is integrated out: the inner TMC average must find that."""
    y_train, y_test = data

    def guide(y):
        pyro.sample("mu", dist.Normal(0.6, 0.6))
        with pyro.plate("data", y.shape[0]):
            pyro.sample("z", dist.Normal(y / 2 + 0.3, 1.0), infer={"num_samples": 32})

    elbo = TMC_ELBO(num_samples=1024, max_plate_nesting=1)
    draws = elbo.sample_posterior(local_latent_model, guide, y_train, num_draws=2000)
    assert draws["z"].shape == (2000, NUM_TRAIN)  # the training rows' z: not fixed in the test run
    result = predictive_log_likelihood(local_latent_model, draws, y_test, num_samples=64)
    _assert_within_three_standard_errors(result, _mean_only(y_train, y_test, 2.0))


def grouped_model(y):
    """y[g, i] ~ N(a_g, 1), a_g ~ N(mu, 1): the group means are shared by training and test rows,
    so they are fixed to the draws; the rows (inner plate) are new."""
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("groups", y.shape[0], dim=-2):
        a = pyro.sample("a", dist.Normal(mu, 1.0))
        with pyro.plate("rows", y.shape[1], dim=-1):
            pyro.sample("y", dist.Normal(a, 1.0), obs=y)


def _group_design(y: torch.Tensor) -> torch.Tensor:
    """u = (mu, a_g - mu for each group), independent standard normals; y[g, i] = mu + (a_g - mu) + noise."""
    groups = torch.arange(y.shape[0]).repeat_interleave(y.shape[1])
    return torch.cat([torch.ones(y.numel(), 1), torch.nn.functional.one_hot(groups, y.shape[0])], 1)


def test_group_latents_are_shared_with_the_test_rows(data, fresh_pyro):
    y_train, y_test = data
    y_train, y_test = y_train[:18].reshape(3, 6), y_test[:6].reshape(3, 2)
    exact = exact_predictive(
        y_train.reshape(-1),
        y_test.reshape(-1),
        _group_design(y_train),
        _group_design(y_test),
        torch.eye(4, dtype=torch.float64),
        1.0,
    )

    def guide(y):  # about where training would put it: near the posterior, 1.5x wider
        pyro.sample("mu", dist.Normal(0.7, 0.8))
        with pyro.plate("groups", 3, dim=-2):
            pyro.sample("a", dist.Normal(torch.tensor([[0.14], [1.2], [1.45]]), 0.6))

    # draws pooled over 8 TMC draws: the standard error covers the draws, not the error of one
    # draw's particle set, which pooling shrinks
    elbo = TMC_ELBO(num_samples=1024, max_plate_nesting=2)
    pools = [elbo.sample_posterior(grouped_model, guide, y_train, num_draws=250) for _ in range(8)]
    draws = {name: torch.cat([pool[name] for pool in pools]) for name in pools[0]}
    assert draws["a"].shape == (2000, 3, 1)
    with pytest.raises(ValueError, match="local_plates"):  # groups keep their size: which plate is new?
        predictive_log_likelihood(grouped_model, draws, y_test)
    result = predictive_log_likelihood(grouped_model, draws, y_test, local_plates=("rows",))
    assert math.isfinite(float(result.standard_error))
    _assert_within_three_standard_errors(result, exact)


def test_test_rows_as_many_as_training_rows_must_be_named(data):
    """With equal sizes the z of the training rows would silently be reused: refuse, then accept the name."""
    y_train, _ = data
    draws = {"mu": torch.zeros(5), "z": torch.zeros(5, NUM_TRAIN)}
    with pytest.raises(ValueError, match="local_plates"):
        predictive_log_likelihood(local_latent_model, draws, y_train)
    result = predictive_log_likelihood(local_latent_model, draws, y_train, local_plates=("data",))
    assert result.log_likelihoods.shape == (5,)


def test_mismatched_draw_counts_are_refused(data):
    _, y_test = data
    with pytest.raises(ValueError, match="same number of draws"):
        predictive_log_likelihood(local_latent_model, {"mu": torch.zeros(5), "z": torch.zeros(4, 3)}, y_test)
