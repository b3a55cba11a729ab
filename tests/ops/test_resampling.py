"""Resampling schemes: exact count bounds (systematic), unbiased counts and their variance against the
exact values (stratified, multinomial), zero weights never picked. The Monte Carlo checks run many
seeded repetitions as one batch; their tolerances are 5 standard errors of the estimate compared."""

import math

import pytest
import torch

from pyro_tmc.ops.resampling import multinomial_resample, stratified_resample, systematic_resample

SCHEMES = {
    "multinomial": multinomial_resample,
    "stratified": stratified_resample,
    "systematic": systematic_resample,
}
REPEATS = 20000
STANDARD_ERRORS = 5.0


def _counts(indices: torch.Tensor, num_particles: int) -> torch.Tensor:
    """How often each particle was picked, along the last dim."""
    return torch.nn.functional.one_hot(indices, num_particles).sum(-2).to(torch.float64)


def _weights(num_particles: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return 1.5 * torch.randn(num_particles, dtype=torch.float64, generator=generator)


def _stratified_variance(weights: torch.Tensor, num_samples: int) -> torch.Tensor:
    """The exact variance of stratified counts: a sum over strata of independent Bernoulli variances,
    p_ij = n |[CDF_{i-1}, CDF_i) intersected with [j/n, (j+1)/n)|."""
    upper = weights.cumsum(-1)
    lower = upper - weights
    strata = torch.arange(num_samples, dtype=torch.float64)
    overlap = torch.minimum(upper[:, None], (strata + 1) / num_samples) - torch.maximum(
        lower[:, None], strata / num_samples
    )
    probs = (num_samples * overlap).clamp(min=0)
    return (probs * (1 - probs)).sum(-1)


@pytest.mark.parametrize("num_samples", [7, 50, 333])
def test_systematic_counts_lie_within_floor_and_ceil(num_samples):
    log_weights = torch.stack([_weights(40, seed) for seed in range(30)])
    log_weights[:5, ::4] = -math.inf
    generator = torch.Generator().manual_seed(num_samples)
    counts = _counts(systematic_resample(log_weights, num_samples, generator=generator), 40)
    expected = num_samples * torch.softmax(log_weights, -1)
    assert (counts >= torch.floor(expected - 1e-9)).all() and (counts <= torch.ceil(expected + 1e-9)).all()
    assert (counts.sum(-1) == num_samples).all()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_counts_are_unbiased(scheme):
    num_particles, num_samples = 10, 23
    log_weights = _weights(num_particles, seed=1)
    weights = torch.softmax(log_weights, -1)
    generator = torch.Generator().manual_seed(2)
    indices = SCHEMES[scheme](log_weights.expand(REPEATS, num_particles), num_samples, generator=generator)
    counts = _counts(indices, num_particles)
    expected = num_samples * weights
    fraction = expected - expected.floor()
    variance = {
        "multinomial": num_samples * weights * (1 - weights),
        "stratified": _stratified_variance(weights, num_samples),
        "systematic": fraction * (1 - fraction),
    }[scheme]
    standard_error = (variance / REPEATS).sqrt()
    assert ((counts.mean(0) - expected).abs() <= STANDARD_ERRORS * standard_error + 1e-12).all()


@pytest.mark.parametrize("scheme", ["multinomial", "stratified"])
def test_count_variances_match_the_exact_ones(scheme):
    """Stratified counts' variance is the exact one, which is at most multinomial's (Douc et al. 2005)."""
    num_particles, num_samples = 10, 23
    log_weights = _weights(num_particles, seed=3)
    weights = torch.softmax(log_weights, -1)
    generator = torch.Generator().manual_seed(4)
    indices = SCHEMES[scheme](log_weights.expand(REPEATS, num_particles), num_samples, generator=generator)
    counts = _counts(indices, num_particles)
    multinomial_variance = num_samples * weights * (1 - weights)
    exact = multinomial_variance if scheme == "multinomial" else _stratified_variance(weights, num_samples)
    centred = counts - counts.mean(0)
    variance = centred.pow(2).mean(0)
    # the standard error of a sample variance: sqrt((m4 - var^2) / R), from the measured fourth moment
    standard_error = ((centred.pow(4).mean(0) - variance**2) / REPEATS).sqrt()
    assert ((variance - exact).abs() <= STANDARD_ERRORS * standard_error + 1e-12).all()
    assert (exact <= multinomial_variance + 1e-12).all()
    if scheme == "stratified":
        assert exact.sum() < 0.5 * multinomial_variance.sum()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_zero_weights_are_never_picked(scheme):
    log_weights = _weights(12, seed=5).expand(2000, 12).clone()
    log_weights[:, [0, 3, 4, 11]] = -math.inf
    generator = torch.Generator().manual_seed(6)
    picked = SCHEMES[scheme](log_weights, 30, generator=generator)
    assert not torch.isin(picked, torch.tensor([0, 3, 4, 11])).any()
    only = torch.full((5, 9), -math.inf)
    only[:, 8] = 0.0
    assert (SCHEMES[scheme](only, 4, generator=generator) == 8).all()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_batch_dims_and_scale(scheme):
    """Weights along dim 0 of a (S, 2, 3) tensor, and the same indices for weights shifted by 1000."""
    log_weights = torch.stack([_weights(15, seed) for seed in range(6)], -1).reshape(15, 2, 3)
    picked = SCHEMES[scheme](log_weights, 8, dim=0, generator=torch.Generator().manual_seed(7))
    assert picked.shape == (8, 2, 3) and picked.dtype == torch.long
    moved = SCHEMES[scheme](
        log_weights.movedim(0, -1) + 1000.0, 8, generator=torch.Generator().manual_seed(7)
    )
    assert torch.equal(picked, moved.movedim(-1, 0))
