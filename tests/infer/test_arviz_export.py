"""The ArviZ export: its groups, shapes and dims, and ``az.loo`` / ``az.waic`` / ``az.summary`` on the
exact posterior draws of a conjugate model, against PSIS-LOO computed here with our own :func:`psis`,
against WAIC and the moments computed directly, and against the model's exact leave-one-out elpd.

The comparisons with our own computations repeat ArviZ's deterministic float64 arithmetic in another
order of sums: measured agreement 2e-16 relative on elpd_loo, 1e-14 on p_loo, 1e-13 on the pointwise
k-hats; tolerance 1e-10."""

import math
import sys

import numpy as np
import pytest
import torch

from pyro_tmc.infer.arviz_export import to_inference_data
from pyro_tmc.infer.diagnostics import psis

az = pytest.importorskip("arviz")

PRIOR_SD, NOISE_SD, NUM_DATA, NUM_DRAWS = 2.0, 1.0, 30, 4000
RTOL = 1e-10


def _data() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return 0.7 + NOISE_SD * torch.randn(NUM_DATA, dtype=torch.float64, generator=generator)


def _posterior(data: torch.Tensor) -> tuple[float, float]:
    """The exact posterior of mu ~ N(0, PRIOR_SD), y_i ~ N(mu, NOISE_SD): mean and sd."""
    precision = PRIOR_SD**-2 + len(data) * NOISE_SD**-2
    return float(data.sum()) * NOISE_SD**-2 / precision, precision**-0.5


def _exact_loo_elpd(data: torch.Tensor) -> float:
    """sum_i log p(y_i | y_-i): each a Normal predictive from the posterior without y_i."""
    total = 0.0
    for i in range(len(data)):
        mean, sd = _posterior(torch.cat([data[:i], data[i + 1 :]]))
        predictive = torch.distributions.Normal(mean, math.sqrt(sd**2 + NOISE_SD**2))
        total += float(predictive.log_prob(data[i]))
    return total


@pytest.fixture(scope="module")
def conjugate():
    """The data, exact posterior draws of mu, a vector site, the pointwise log-likelihood, and lp."""
    data = _data()
    mean, sd = _posterior(data)
    generator = torch.Generator().manual_seed(1)
    mu = mean + sd * torch.randn(NUM_DRAWS, dtype=torch.float64, generator=generator)
    theta = torch.randn(NUM_DRAWS, 3, dtype=torch.float64, generator=generator)
    log_lik = torch.distributions.Normal(mu[:, None], NOISE_SD).log_prob(data)
    lp = log_lik.sum(-1) + torch.distributions.Normal(0.0, PRIOR_SD).log_prob(mu)
    return {"data": data, "mu": mu, "theta": theta, "log_lik": log_lik, "lp": lp}


def _export(case, **kwargs):
    return to_inference_data(
        {"mu": case["mu"], "theta": case["theta"]},
        log_likelihood={"y": case["log_lik"]},
        sample_stats={"lp": case["lp"]},
        observed_data={"y": case["data"]},
        **kwargs,
    )


def test_groups_shapes_and_dims(conjugate):
    idata = _export(conjugate, num_chains=4)
    assert set(idata.groups()) == {"posterior", "log_likelihood", "sample_stats", "observed_data"}
    draws = NUM_DRAWS // 4
    assert idata.posterior["mu"].dims == ("chain", "draw")
    assert idata.posterior["mu"].shape == (4, draws)
    assert idata.posterior["theta"].dims == ("chain", "draw", "theta_dim_0")
    assert idata.posterior["theta"].shape == (4, draws, 3)
    assert idata.log_likelihood["y"].dims == ("chain", "draw", "y_dim_0")
    assert idata.log_likelihood["y"].shape == (4, draws, NUM_DATA)
    assert idata.sample_stats["lp"].shape == (4, draws)
    assert idata.observed_data["y"].dims == ("y_dim_0",)
    # The draws fill the chains in order.
    np.testing.assert_array_equal(idata.posterior["mu"].values.reshape(-1), conjugate["mu"].numpy())
    np.testing.assert_array_equal(
        idata.log_likelihood["y"].values.reshape(NUM_DRAWS, NUM_DATA), conjugate["log_lik"].numpy()
    )


def test_coords_and_dims_pass_through(conjugate):
    idata = _export(
        conjugate, dims={"y": ["obs"], "theta": ["component"]}, coords={"obs": np.arange(NUM_DATA) + 10}
    )
    assert idata.log_likelihood["y"].dims == ("chain", "draw", "obs")
    assert idata.observed_data["y"].dims == ("obs",)
    assert idata.posterior["theta"].dims == ("chain", "draw", "component")
    assert idata.observed_data["obs"].values[0] == 10


def test_only_the_groups_given():
    idata = to_inference_data({"mu": torch.zeros(10)})
    assert set(idata.groups()) == {"posterior"}


def test_loo_matches_our_psis_loo_and_the_exact_elpd(conjugate):
    log_lik = conjugate["log_lik"]
    result = az.loo(_export(conjugate), pointwise=True)
    # Our PSIS-LOO: weights 1 / p(y_i | mu) over the posterior draws, smoothed (Vehtari et al. 2017).
    smoothed, khat = psis(-log_lik, dim=0)
    loo_i = torch.logsumexp(smoothed + log_lik, 0)
    lppd = float((torch.logsumexp(log_lik, 0) - math.log(NUM_DRAWS)).sum())
    assert result.elpd_loo == pytest.approx(float(loo_i.sum()), rel=RTOL)
    assert result.p_loo == pytest.approx(lppd - float(loo_i.sum()), rel=RTOL)
    np.testing.assert_allclose(result.loo_i.values, loo_i.numpy(), rtol=RTOL)
    np.testing.assert_allclose(result.pareto_k.values, khat.numpy(), rtol=RTOL)
    assert (khat < 0.5).all()
    # Against the exact elpd: 5 Monte Carlo standard errors, each point's by the delta method on
    # log mean_s exp(-log_lik), summed (a bound: the points share the draws).
    ratios = torch.exp(-(log_lik - log_lik.max(0).values))
    standard_error = float((ratios.std(0) / (ratios.mean(0) * math.sqrt(NUM_DRAWS))).sum())
    assert abs(result.elpd_loo - _exact_loo_elpd(conjugate["data"])) <= 5 * standard_error
    assert math.isfinite(result.se) and result.se > 0


def test_waic_matches_a_direct_computation(conjugate):
    log_lik = conjugate["log_lik"]
    result = az.waic(_export(conjugate))
    lppd = float((torch.logsumexp(log_lik, 0) - math.log(NUM_DRAWS)).sum())
    p_waic = float(log_lik.var(0, correction=0).sum())
    assert result.p_waic == pytest.approx(p_waic, rel=RTOL)
    assert result.elpd_waic == pytest.approx(lppd - p_waic, rel=RTOL)


def test_summary_reads_the_posterior(conjugate):
    summary = az.summary(_export(conjugate, num_chains=4), var_names=["mu"], round_to="none")
    mu = conjugate["mu"]
    assert summary.loc["mu", "mean"] == pytest.approx(float(mu.mean()), rel=RTOL)
    assert summary.loc["mu", "sd"] == pytest.approx(float(mu.std()), rel=RTOL)
    mean, sd = _posterior(conjugate["data"])
    assert abs(summary.loc["mu", "mean"] - mean) <= 5 * sd / math.sqrt(NUM_DRAWS)
    # Independent draws: r-hat about 1 and an effective sample size of the order of the draws.
    assert abs(summary.loc["mu", "r_hat"] - 1) < 0.01 and summary.loc["mu", "ess_bulk"] > NUM_DRAWS / 2


def test_without_arviz_the_error_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "arviz", None)
    with pytest.raises(ImportError, match=r"pip install pyro_tmc\[posterior\]"):
        to_inference_data({"mu": torch.zeros(4)})


@pytest.mark.parametrize(
    "samples, extra, match",
    [
        ({"mu": torch.zeros(10)}, {"num_chains": 3}, "num_chains=3 does not divide the 10 draws"),
        ({"mu": torch.zeros(10)}, {"log_likelihood": {"y": torch.zeros(9, 2)}}, "'y' has 9 draws"),
        ({"mu": torch.zeros(())}, {}, "'mu' has no draws"),
        ({}, {}, "samples is empty"),
    ],
)
def test_bad_inputs_say_what_to_change(samples, extra, match):
    with pytest.raises(ValueError, match=match):
        to_inference_data(samples, **extra)
