"""PSIS, k-hat and the effective sample size against ArviZ's ``psislw`` (the reference implementation).

Both implementations are deterministic float64 computations of the same algorithm; they differ only in
the order of floating-point sums (numpy's pairwise sum against torch's), measured at 3e-15 relative on
k-hat and 7e-15 absolute on the smoothed log weights. The tolerances (1e-12) leave a margin of 300x for
platform differences and still catch a change to the algorithm: one draw more or less in the tail, or
no prior, moves k-hat by 7e-4 to 4e-2 (measured).
"""

import math

import numpy as np
import pytest
import torch

from pyro_tmc.infer.diagnostics import effective_sample_size, khat_threshold, pareto_khat, psis, tail_length

az = pytest.importorskip("arviz")
stats = pytest.importorskip("scipy.stats")

RTOL = 1e-12
ATOL = 1e-12


def _log_weights(kind: str, shape: tuple, seed: int) -> np.ndarray:
    """Seeded log importance weights whose right tail is light, moderate or heavy."""
    rng = np.random.default_rng(seed)
    if kind == "lognormal":  # k about 0.2-0.4
        return rng.normal(size=shape)
    if kind == "wide_lognormal":  # k about 0.5-0.65
        return 2.0 * rng.normal(size=shape)
    if kind == "student_t":  # target Student-t(3), proposal N(0, 1): unbounded weights
        draws = rng.normal(size=shape)
        return stats.t.logpdf(draws, 3) - stats.norm.logpdf(draws)
    if kind == "light":  # target N(0, 1), proposal N(0, 1.5): bounded weights, k < 0
        draws = 1.5 * rng.normal(size=shape)
        return stats.norm.logpdf(draws) - stats.norm.logpdf(draws, scale=1.5)
    if kind == "pareto":  # Pareto(1.2) weights: k = 1 / 1.2
        return -np.log(rng.uniform(size=shape)) / 1.2
    raise ValueError(kind)


def _reference(log_weights: np.ndarray, **kwargs):
    smoothed, khat = az.psislw(log_weights.copy(), **kwargs)
    return np.asarray(smoothed), np.asarray(khat)


@pytest.mark.parametrize("kind", ["lognormal", "wide_lognormal", "student_t", "light", "pareto"])
@pytest.mark.parametrize("shape", [(1000,), (3, 2000), (2, 2, 300), (4, 21)])
def test_psis_matches_arviz(kind, shape):
    log_weights = _log_weights(kind, shape, seed=sum(shape))
    expected_weights, expected_khat = _reference(log_weights)
    smoothed, khat = psis(torch.tensor(log_weights))
    assert khat.shape == shape[:-1] and smoothed.shape == shape
    np.testing.assert_allclose(khat.numpy(), expected_khat, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(smoothed.numpy(), expected_weights, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(pareto_khat(torch.tensor(log_weights)).numpy(), expected_khat, rtol=RTOL)


@pytest.mark.parametrize(
    "kind, low, high", [("light", -math.inf, 0.0), ("lognormal", 0.0, 0.5), ("pareto", 0.7, math.inf)]
)
def test_the_cases_cover_light_and_heavy_tails(kind, low, high):
    """The weights above do reach both sides of the thresholds (else the comparison would test less)."""
    khat = pareto_khat(torch.tensor(_log_weights(kind, (4, 4000), seed=1)))
    assert ((khat > low) & (khat < high)).all(), khat


def test_weights_along_another_dim():
    log_weights = _log_weights("student_t", (500, 3, 2), seed=3)
    expected_weights, expected_khat = _reference(np.moveaxis(log_weights, 0, -1))
    smoothed, khat = psis(torch.tensor(log_weights), dim=0)
    np.testing.assert_allclose(khat.numpy(), expected_khat, rtol=RTOL)
    np.testing.assert_allclose(smoothed.numpy(), np.moveaxis(expected_weights, -1, 0), rtol=RTOL, atol=ATOL)


def test_unnormalized_and_relative_efficiency_match_arviz():
    log_weights = 100.0 + _log_weights("wide_lognormal", (3, 1000), seed=4)
    expected_weights, expected_khat = _reference(log_weights, reff=0.3, normalize=False)
    assert tail_length(1000, 0.3) == math.ceil(3 * math.sqrt(1000 / 0.3))
    smoothed, khat = psis(torch.tensor(log_weights), relative_efficiency=0.3, normalize=False)
    np.testing.assert_allclose(khat.numpy(), expected_khat, rtol=RTOL)
    np.testing.assert_allclose(smoothed.numpy(), expected_weights, rtol=RTOL)


def test_smoothing_truncates_at_the_largest_raw_weight_and_normalises():
    log_weights = torch.tensor(_log_weights("pareto", (2, 3000), seed=5))
    smoothed, _ = psis(log_weights, normalize=False)
    assert (smoothed.max(-1).values <= log_weights.max(-1).values).all()
    normalised, _ = psis(log_weights)
    torch.testing.assert_close(normalised.exp().sum(-1), torch.ones(2, dtype=torch.float64))


def test_float32_in_float32_out():
    log_weights = _log_weights("student_t", (2, 1000), seed=6)
    smoothed, khat = psis(torch.tensor(log_weights, dtype=torch.float32))
    assert smoothed.dtype == khat.dtype == torch.float32
    expected_khat = _reference(log_weights.astype(np.float32).astype(np.float64))[1]
    np.testing.assert_allclose(khat.numpy(), expected_khat, rtol=1e-6)


@pytest.mark.parametrize("num_samples", [1, 2, 5, 20])
def test_too_few_draws_give_infinite_khat(num_samples):
    """S <= 20 leaves fewer than 5 draws in the tail: k-hat is inf (as ArviZ, which fails at S = 1)."""
    log_weights = torch.tensor(_log_weights("lognormal", (3, num_samples), seed=7))
    smoothed, khat = psis(log_weights)
    assert torch.isposinf(khat).all()
    torch.testing.assert_close(smoothed, log_weights - log_weights.logsumexp(-1, keepdim=True))
    if num_samples > 1:
        np.testing.assert_array_equal(_reference(log_weights.numpy())[1], np.inf)


def test_ties_that_leave_a_short_tail_give_infinite_khat():
    """One dominant weight above a tied body: 1 draw above the cutoff, k-hat inf (as ArviZ)."""
    log_weights = np.full(1000, -10.0)
    log_weights[17] = 0.0
    assert math.isinf(_reference(log_weights)[1])
    assert torch.isposinf(pareto_khat(torch.tensor(log_weights)))


@pytest.mark.parametrize("fraction_zero", [0.0, 0.5])
def test_bounded_weights_give_minus_infinite_khat(fraction_zero):
    """Constant weights, and a rejection sampler's 0/1 weights: no tail, k-hat -inf (ArviZ: inf)."""
    num_samples = 1000
    log_weights = torch.zeros(2, num_samples, dtype=torch.float64)
    log_weights[:, : int(fraction_zero * num_samples)] = -math.inf
    smoothed, khat = psis(log_weights)
    assert torch.isneginf(khat).all()
    kept = num_samples - int(fraction_zero * num_samples)
    torch.testing.assert_close(
        smoothed[:, -kept:], torch.full((2, kept), -math.log(kept), dtype=torch.float64)
    )
    assert torch.isneginf(smoothed[:, :-kept]).all()


def test_minus_infinite_weights_are_never_in_the_tail():
    log_weights = _log_weights("student_t", (2, 2000), seed=8)
    log_weights[:, ::3] = -np.inf
    expected_weights, expected_khat = _reference(log_weights)
    smoothed, khat = psis(torch.tensor(log_weights))
    np.testing.assert_allclose(khat.numpy(), expected_khat, rtol=RTOL)
    np.testing.assert_allclose(smoothed.numpy(), expected_weights, rtol=RTOL, atol=ATOL)
    assert torch.isneginf(smoothed[:, ::3]).all()


def test_no_weight_at_all_gives_nan_khat():
    log_weights = torch.tensor(_log_weights("lognormal", (3, 100), seed=9))
    log_weights[1] = -math.inf
    smoothed, khat = psis(log_weights)
    assert torch.isnan(khat[1]) and torch.isfinite(khat[[0, 2]]).all()
    assert torch.isneginf(smoothed[1]).all() and torch.isfinite(smoothed[[0, 2]]).all()


def test_effective_sample_size():
    log_weights = torch.tensor(_log_weights("wide_lognormal", (3, 500), seed=10))
    weights = log_weights.exp()
    expected = weights.sum(-1) ** 2 / (weights**2).sum(-1)
    torch.testing.assert_close(effective_sample_size(log_weights), expected, rtol=1e-12, atol=0)
    # Far out of exp's range the log-space form still gives the same answer.
    torch.testing.assert_close(effective_sample_size(log_weights + 2000), expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(effective_sample_size(log_weights.T, dim=0), expected, rtol=1e-12, atol=0)


def test_effective_sample_size_limits():
    flat = torch.zeros(7, 40)
    assert torch.allclose(effective_sample_size(flat), torch.full((7,), 40.0, dtype=torch.float64))
    one = torch.full((40,), -math.inf)
    one[3] = 5.0
    assert effective_sample_size(one) == 1.0
    assert effective_sample_size(torch.full((40,), -math.inf)) == 0.0


def test_khat_threshold():
    assert khat_threshold(100) == pytest.approx(0.5)
    assert khat_threshold(1000) == pytest.approx(2 / 3)
    assert khat_threshold(2154) == pytest.approx(0.7, abs=1e-4)
    assert khat_threshold(10**6) == 0.7
    assert khat_threshold(10) == 0.0
    assert khat_threshold(1) == -math.inf


def test_khat_threshold_is_arvizs_good_k():
    rng = np.random.default_rng(11)
    data = az.from_dict(
        posterior={"mu": rng.normal(size=(1, 400))}, log_likelihood={"y": rng.normal(size=(1, 400, 3))}
    )
    assert az.loo(data).good_k == pytest.approx(khat_threshold(400), rel=1e-14)
