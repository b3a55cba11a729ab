"""fit_posterior and the TMCPosterior it returns, against a hierarchical Gaussian model's exact posterior."""

import math
import warnings

import numpy as np
import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro.infer import Predictive

from pyro_tmc.infer import TMCPosterior, fit_posterior

GROUP_SCALE, NOISE_SCALE = 1.0, 0.5
DATA = torch.tensor([1.2, 0.3, -0.4, 2.0, 0.9])


def hierarchical_model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("groups", len(y)):
        theta = pyro.sample("theta", dist.Normal(mu, GROUP_SCALE))
        pyro.sample("y", dist.Normal(theta, NOISE_SCALE), obs=y)


def exact_posterior(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and covariance of (mu, theta_1..n) given y: a linear-Gaussian model, in float64."""
    n = len(y)
    # z = (mu, theta): mu ~ N(0, 1), theta = mu + GROUP_SCALE e; y = theta + NOISE_SCALE e'
    prior_cov = torch.zeros(n + 1, n + 1, dtype=torch.float64)
    prior_cov[0, 0] = 1.0
    prior_cov[0, 1:] = prior_cov[1:, 0] = 1.0
    prior_cov[1:, 1:] = 1.0 + GROUP_SCALE**2 * torch.eye(n, dtype=torch.float64)
    observe = torch.cat([torch.zeros(n, 1), torch.eye(n)], 1).double()  # y = observe @ z + noise
    precision = torch.linalg.inv(prior_cov) + observe.T @ observe / NOISE_SCALE**2
    cov = torch.linalg.inv(precision)
    mean = cov @ (observe.T @ y.double() / NOISE_SCALE**2)
    return mean, cov


@pytest.fixture(scope="module")
def fitted() -> TMCPosterior:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    return fit_posterior(
        hierarchical_model,
        DATA,
        num_steps=300,
        num_samples=16,
        learning_rate=0.05,
        adapt_rounds=2,
        adapt_draws=6,
        readout_samples=64,
        num_draws=20,
        max_draws=20,
        samples_per_draw=50,
        max_plate_nesting=1,
        progress=False,
    )


def test_moments_match_the_exact_posterior(fitted):
    mean, cov = exact_posterior(DATA)
    sd = cov.diagonal().sqrt()
    got_mean = torch.cat([fitted.mean("mu").reshape(1), fitted.mean("theta")])
    got_sd = torch.cat([fitted.stddev("mu").reshape(1), fitted.stddev("theta")])
    mean_error = torch.cat([fitted.moments["mu"].mean_error.reshape(1), fitted.moments["theta"].mean_error])
    sd_error = torch.cat([fitted.moments["mu"].stddev_error.reshape(1), fitted.moments["theta"].stddev_error])
    # within 4 standard errors plus a floor for the pooled ratio estimator's own small bias
    assert ((got_mean - mean).abs() <= 4 * mean_error + 0.02 * sd).all(), (got_mean, mean, mean_error)
    assert ((got_sd - sd).abs() <= 4 * sd_error + 0.03 * sd).all(), (got_sd, sd, sd_error)


def test_log_evidence_matches_the_exact_marginal(fitted):
    _, cov = exact_posterior(DATA)
    n = len(DATA)
    marginal_cov = torch.ones(n, n, dtype=torch.float64) + (GROUP_SCALE**2 + NOISE_SCALE**2) * torch.eye(
        n, dtype=torch.float64
    )
    exact = dist.MultivariateNormal(torch.zeros(n, dtype=torch.float64), marginal_cov).log_prob(DATA.double())
    spread = fitted.log_evidences.std() / math.sqrt(len(fitted.draws))
    assert abs(float(fitted.log_evidence) - float(exact)) < 4 * float(spread) + 0.02


def test_sample_gives_equal_weight_draws_for_predictive(fitted):
    mean, cov = exact_posterior(DATA)
    samples = fitted.sample(4000, generator=torch.Generator().manual_seed(0))
    assert samples["mu"].shape == (4000,)
    assert samples["theta"].shape == (4000, len(DATA))
    # the resampled draws' mean: within 4 of their own standard errors (draws are correlated by
    # resampling, so the error uses the pooled draws' effective count, at least the TMC draws')
    sd = cov.diagonal().sqrt()[0]
    assert abs(float(samples["mu"].double().mean()) - float(mean[0])) < 4 * float(sd) / math.sqrt(20) + 0.05
    predictive = Predictive(hierarchical_model, posterior_samples=samples, return_sites=["y"])
    assert predictive(DATA)["y"].shape == (4000, len(DATA))


def test_diagnostics_trust_a_well_fitted_posterior(fitted):
    """Its weights are trusted; its 20 draws leave the means' Monte Carlo error above 0.02 sds: it says so."""
    with pytest.warns(UserWarning, match="Monte Carlo error"):
        diagnostics = fitted.diagnostics()
    assert set(diagnostics.site_khat) >= {"theta"} or diagnostics.site_khat
    assert diagnostics.untrusted == ["<monte carlo error>"], diagnostics
    assert diagnostics.error_bounds["mean"][0] > 0.02
    assert all(value < 0.7 for value in diagnostics.site_khat.values())
    assert 1 <= diagnostics.effective_draws <= len(fitted.draws)


def test_diagnostics_name_the_sites_of_a_poor_proposal():
    """The prior as the proposal of a sharp posterior, read at a small K: k-hat flags it, with a warning."""
    y = torch.tensor([3.0, 3.2, 2.9, 3.1, 3.3]) * 3
    pyro.clear_param_store()
    pyro.set_rng_seed(1)

    def empty_guide(y):
        pass

    posterior = fit_posterior(
        hierarchical_model,
        y,
        guide=empty_guide,
        num_steps=0,
        adapt_rounds=0,
        readout_samples=8,
        num_draws=20,
        max_draws=20,
        samples_per_draw=0,
        max_plate_nesting=1,
        progress=False,
    )
    with pytest.warns(UserWarning, match="k-hat"):
        diagnostics = posterior.diagnostics()
    assert diagnostics.untrusted, diagnostics


def test_diagnostics_warn_of_too_few_draws_for_their_khat(fitted):
    """With 20 draws or fewer the draws' k-hat is NaN, and the warning says so rather than staying silent."""
    few = TMCPosterior(fitted.model, fitted.draws[:12], fitted.args, fitted.kwargs)
    with pytest.warns(UserWarning, match="too few for the draws' k-hat"):
        diagnostics = few.diagnostics()
    assert math.isnan(diagnostics.khat_draws)
    # 320 draws: enough for the draws' k-hat, and for the Monte Carlo error bound (its warning)
    enough = TMCPosterior(fitted.model, fitted.draws * 16, fitted.args, fitted.kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not math.isnan(enough.diagnostics().khat_draws)


def test_to_arviz_has_the_groups_loo_needs(fitted):
    az = pytest.importorskip("arviz")
    data = fitted.to_arviz(num_samples=400, num_chains=2, generator=torch.Generator().manual_seed(0))
    assert {"posterior", "log_likelihood", "sample_stats", "observed_data"} <= set(data.groups())
    assert data.posterior["theta"].shape[:2] == (2, 200)
    assert data.log_likelihood["y"].shape[:2] == (2, 200)
    total = data.log_likelihood["y"].sum(
        [d for d in data.log_likelihood["y"].dims if d not in ("chain", "draw")]
    )
    assert np.allclose(data.sample_stats["total_log_likelihood"], total)
    loo = az.loo(data)
    assert math.isfinite(float(loo.elpd_loo))
    summary = az.summary(data, var_names=["mu"])
    assert "mean" in summary.columns


def test_log_predictive_of_new_groups_is_finite(fitted):
    result = fitted.log_predictive(torch.tensor([0.5, 1.0, 1.5]), num_samples=32)
    assert math.isfinite(float(result.log_likelihood))


def test_read_out_continues_until_the_standard_errors_are_small():
    """Past num_draws, draws are added 20 at a time until the means' errors average target_error sds."""
    pyro.clear_param_store()
    pyro.set_rng_seed(2)
    options = dict(num_steps=100, adapt_rounds=1, adapt_draws=4, readout_samples=8, samples_per_draw=0)
    posterior = fit_posterior(
        hierarchical_model, DATA, num_draws=20, max_draws=200, target_error=0.02, progress=False, **options
    )
    count = posterior.history["readout_draws"]
    assert count % 20 == 0 and 20 <= count <= 200
    relative = torch.cat([(m.mean_error / m.stddev).reshape(-1) for m in posterior.moments.values()])
    assert float(relative.mean()) <= 0.02 or count == 200, (count, relative)
    if count > 20:  # it stopped at the first check that met the target: 20 fewer draws did not
        fewer = TMCPosterior(hierarchical_model, posterior.draws[:-20])
        relative = torch.cat([(m.mean_error / m.stddev).reshape(-1) for m in fewer.moments.values()])
        assert float(relative.mean()) > 0.02


@pytest.mark.slow
def test_a_vectorized_markov_chain_is_fitted_from_its_marginals():
    """Regression: fit_posterior raised KeyError on the previous-steps site, then NotImplementedError."""
    pytest.importorskip("funsor")
    from tests.common.vectorized_chains import WALK, exact_walk_posterior, vectorized_walk

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # Pyro's model-guide checks: nothing to warn of
        fitted = fit_posterior(
            vectorized_walk,
            WALK,
            num_steps=200,
            learning_rate=0.05,
            adapt_rounds=2,
            adapt_draws=6,
            readout_samples=64,
            num_draws=20,
            max_draws=20,
            max_plate_nesting=1,
            progress=False,
        )
    mean, sd = exact_walk_posterior(WALK)
    got_mean, got_sd, mean_error = _stacked([fitted.moments["z_0"]], fitted.moments["z_slice(1, 8, None)"])
    # measured: mean errors 0.013-0.054 sd against standard errors 0.025-0.036; sd ratios 0.98-1.02
    assert ((got_mean - mean).abs() <= 4 * mean_error + 0.02 * sd).all(), (got_mean, mean, mean_error)
    assert ((got_sd / sd - 1).abs() <= 0.1).all(), (got_sd, sd)
    with pytest.raises(ValueError, match="vectorized_markov"):
        fitted.sample(10)


def test_a_chain_that_reads_a_global_is_fitted_with_one_globals_particle_per_draw():
    """
    Every link of the drift chain reads the global m: fit_posterior gives the globals one particle per
    draw (its chain contracted once, the draws' pooling importance-sampling m), and its moments are the
    exact posterior's, a dense Gaussian.
    """
    pytest.importorskip("funsor")
    from tests.common.vectorized_chains import DRIFT_X, drift_exact_posterior, drift_model

    x = DRIFT_X.float()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    fitted = fit_posterior(
        drift_model,
        x,
        num_steps=200,
        learning_rate=0.05,
        adapt_rounds=2,
        adapt_draws=6,
        readout_samples=32,
        num_draws=100,
        max_draws=100,
        max_plate_nesting=1,
        progress=False,
    )
    assert fitted.history["global_samples"] == 1
    mean, sd = drift_exact_posterior(DRIFT_X)
    got_mean, got_sd, mean_error = _stacked(
        [fitted.moments["m"], fitted.moments["z_0"]], fitted.moments[f"z_{slice(1, len(x))}"]
    )
    # measured (seed 0): mean errors 0.06-0.15 sd against standard errors 0.05-0.11; sd ratios 0.95-1.09
    assert ((got_mean - mean).abs() <= 4 * mean_error + 0.02 * sd).all(), (got_mean, mean, mean_error)
    assert ((got_sd / sd - 1).abs() <= 0.15).all(), (got_sd, sd)


def _stacked(heads: list, rest) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chain's means, sds and mean errors: the scalar sites ``heads``, then the later steps' ``rest``."""
    sites = heads + [rest]
    return tuple(
        torch.cat([getattr(s, field).reshape(-1) for s in sites])
        for field in ("mean", "stddev", "mean_error")
    )


def _draws_with_log_evidences(log_evidences: torch.Tensor) -> list:
    from pyro_tmc.infer.tmc_posterior import ReadoutDraw

    return [ReadoutDraw(value, {"x": value.exp()}, {"x": value.exp()}, {}, {}) for value in log_evidences]


def test_draw_weights_are_pareto_smoothed():
    """A heavy-tailed pool (log P_r ~ Normal(0, 2)) is smoothed by PSIS; a short pool is left raw."""
    from pyro_tmc.infer.diagnostics import psis

    torch.manual_seed(0)
    log_evidences = 2.0 * torch.randn(200, dtype=torch.float64)
    pooled = TMCPosterior(hierarchical_model, _draws_with_log_evidences(log_evidences))
    raw = torch.softmax(log_evidences, 0)
    assert torch.allclose(pooled.draw_weights, psis(log_evidences)[0].exp())
    assert pooled.draw_weights.sum().item() == pytest.approx(1.0)
    assert not torch.allclose(pooled.draw_weights, raw, atol=1e-3)  # (the second largest: 0.172 -> 0.091)
    short = TMCPosterior(hierarchical_model, _draws_with_log_evidences(log_evidences[:20]))
    assert torch.allclose(short.draw_weights, torch.softmax(log_evidences[:20], 0))


def test_training_is_skipped_where_the_laplace_start_measures_well(fitted):
    """A linear-Gaussian model: its Laplace approximation is the posterior, so no SVI step is taken."""
    assert "losses" not in fitted.history
    assert fitted.history["laplace_spread"] <= 1.0


@pytest.mark.parametrize("iterations", [1, None])
def test_a_funnel_skips_training_where_its_globals_marginal_converges(iterations, monkeypatch):
    """
    Eight schools' centered funnel: its joint density has no mode, so the Laplace start is the locals'
    conditional one beside the globals' Laplace marginal. Where the marginal's Newton steps reach its
    mode, training is skipped whatever the draws' spread; where they stop short (one step allowed), the
    guide is trained.
    """
    from pyro_tmc.infer import laplace

    if iterations is not None:
        monkeypatch.setattr(laplace, "MARGINAL_ITERATIONS", iterations)
    effects = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
    stddevs = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])

    def eight_schools(effects, stddevs):
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        log_tau = pyro.sample("log_tau", dist.Normal(5.0, 1.0))
        with pyro.plate("schools", len(stddevs)):
            theta = pyro.sample("theta", dist.Normal(mu, log_tau.exp()))
            pyro.sample("y", dist.Normal(theta, stddevs), obs=effects)

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    fitted = fit_posterior(
        eight_schools,
        effects,
        stddevs,
        num_steps=20,
        adapt_rounds=1,
        adapt_draws=6,
        num_draws=2,
        max_draws=2,
        max_plate_nesting=1,
        progress=False,
    )
    if iterations is None:
        assert "losses" not in fitted.history and fitted.history["laplace_at_mode"] is False
    else:
        assert len(fitted.history["losses"]) == 20 and "laplace_at_mode" not in fitted.history


def _pool_of_means(offsets: torch.Tensor) -> TMCPosterior:
    """Equal draws whose site ``x`` has marginal means ``offsets[r]`` (R, D) and marginal sds 1."""
    from pyro_tmc.infer.tmc_posterior import ReadoutDraw

    draws = [
        ReadoutDraw(torch.tensor(0.0, dtype=torch.float64), {"x": row}, {"x": row.square() + 1}, {}, {})
        for row in offsets
    ]
    return TMCPosterior(hierarchical_model, draws)


def test_the_monte_carlo_flag_follows_the_error_bounds(fitted):
    """Each draw counted 16 times: the bounds shrink 4x, below the tolerances, and the flag goes."""
    single = fitted.diagnostics(warn=False).error_bounds
    repeated = TMCPosterior(fitted.model, fitted.draws * 16, fitted.args, fitted.kwargs)
    diagnostics = repeated.diagnostics(warn=False)
    assert "<monte carlo error>" not in diagnostics.untrusted, diagnostics.error_bounds
    for kind in ("mean", "stddev"):
        for one, many in zip(single[kind], diagnostics.error_bounds[kind]):
            assert many == pytest.approx(one / 4, rel=0.15)


def test_the_stddev_error_quantiles_are_the_delta_method_s():
    """
    400 equal draws of one dim, means 0 and second moments 1 + 0.2 z_r: the pooled variance is 1 with
    standard error 0.2 / 20 = 0.01, so the sd's relative error is 0.005 and its 95% bound 1.96 x 0.005.
    """
    from pyro_tmc.infer.tmc_posterior import ReadoutDraw

    torch.manual_seed(0)
    spread = torch.randn(400, 1, dtype=torch.float64)
    spread = (spread - spread.mean()) / spread.std()
    draws = [
        ReadoutDraw(torch.tensor(0.0, dtype=torch.float64), {"x": torch.zeros(1)}, {"x": 1 + 0.2 * z}, {}, {})
        for z in spread
    ]
    average, worst = TMCPosterior(hierarchical_model, draws).stddev_error_quantiles()
    assert average == pytest.approx(1.96 * 0.005, rel=0.1) and worst == pytest.approx(average)


def test_the_mean_error_quantiles_see_correlated_dims():
    """
    400 equal draws, 30 dims, each dim's standard error 0.01 sd. When the dims move as one, the
    average error has one dim's spread (95%: 1.96 x 0.01); when they are independent, it
    concentrates near its mean (0.8 x 0.01, sd 0.6 x 0.01 / sqrt(30)): 95% about 0.0098.
    """
    torch.manual_seed(0)
    shared = 0.2 * torch.randn(400, 1, dtype=torch.float64)
    shared = shared - shared.mean()
    correlated = _pool_of_means(shared.expand(400, 30))
    independent = _pool_of_means(0.2 * torch.randn(400, 30, dtype=torch.float64))
    (se,) = correlated.moments["x"].mean_error[:1].tolist()
    assert se == pytest.approx(0.01, rel=0.1)
    average, worst = correlated.mean_error_quantiles()
    assert 1.7 * se < average < 2.3 * se and worst == pytest.approx(average)
    average, worst = independent.mean_error_quantiles()
    assert 0.85 * se < average < 1.15 * se
    assert 2.5 * se < worst < 4.0 * se  # the largest of 30 independent errors


@pytest.mark.parametrize("validation", [True, False])
def test_only_the_first_draw_is_validated(validation):
    """Pyro's checks (when on) cost a pass over every argument: the read-out checks its first draw only."""
    checks = []

    class CheckedPoisson(dist.Poisson):
        def _validate_sample(self, value):
            checks.append(value.shape)
            return super()._validate_sample(value)

    def model(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("groups", len(y)):
            pyro.sample("y", CheckedPoisson(mu.exp()), obs=y)

    def prior(y):
        pyro.sample("mu", dist.Normal(0.0, 1.0))

    counts = []
    counts_data = torch.tensor([1.0, 0.0, 3.0, 2.0, 1.0])
    with pyro.validation_enabled(validation):
        for draws in (2, 6):
            checks.clear()
            pyro.set_rng_seed(0)
            fit_posterior(
                model, counts_data, guide=prior, num_steps=0, adapt_rounds=0, readout_samples=4,
                num_draws=draws, max_draws=draws, samples_per_draw=0, max_plate_nesting=1, progress=False,
            )  # fmt: skip
            counts.append(len(checks))
        assert pyro.infer.util.is_validation_enabled() == validation  # the user's setting, restored
    assert counts[0] == counts[1] and (counts[0] > 0) == validation
