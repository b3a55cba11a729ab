"""k-hat's standard error and the sites' family-wise threshold (:func:`family_khat_threshold`), by simulation.

Weights ``w = U^-k`` (U uniform) have a Pareto tail of shape exactly k, so the true k of every k-hat
below is known. Measured (seeded, 4,000 sets of 2,000 weights, M = 135): k-hat's sd over
:func:`khat_standard_error` is 1.00, 0.98 and 0.98 at k = 0.5, 0.7 and 1.2; at M = 340 (400 draws of
32 particles) 0.99-1.01. The tail of the standardised k-hat is Normal's within its Monte Carlo error
at 2.3-3.3 sds (``P(z > 2.95)``: 0.0016 measured, 0.0016 Normal), which the family-wise rate relies on.
"""

import math

import pytest
import torch

from pyro_tmc.infer import Diagnostics, TMCPosterior
from pyro_tmc.infer.diagnostics import (
    bootstrap_khat_standard_error,
    family_khat_threshold,
    khat_standard_error,
    khat_threshold,
    pareto_khat,
    tail_length,
)
from pyro_tmc.infer.tmc_posterior import KHAT_LIMIT, ReadoutDraw

#: the normal approximation's measured bias in k-hat's sd (at most 2% at M = 135: the docstring)
SD_APPROXIMATION = 0.02


def _pareto_khats(shape, rows: int, num_samples: int, seed: int) -> torch.Tensor:
    """k-hats of ``rows`` sets of ``num_samples`` Pareto weights of tail ``shape`` (a float or per row)."""
    generator = torch.Generator().manual_seed(seed)
    uniform = torch.rand(rows, num_samples, dtype=torch.float64, generator=generator)
    shape = torch.as_tensor(shape, dtype=torch.float64).expand(rows)
    return pareto_khat(-shape[:, None] * uniform.log())


@pytest.mark.parametrize("shape", [0.5, 0.7, 1.2])
def test_standard_error_matches_the_spread_of_khat(shape):
    rows, num_samples = 2000, 2000
    khats = _pareto_khats(shape, rows, num_samples, seed=int(10 * shape))
    predicted = khat_standard_error(shape, tail_length(num_samples))
    # the sample sd's relative standard error is 1 / sqrt(2 (rows - 1)), 1.6% here
    tolerance = 3 / math.sqrt(2 * (rows - 1)) + SD_APPROXIMATION
    assert float(khats.std()) / predicted == pytest.approx(1.0, abs=tolerance)


def test_the_threshold_grows_with_the_number_of_khats_and_falls_to_one_test():
    num_samples = 400 * 32
    limits = [family_khat_threshold(num_samples, n) for n in (1, 30, 500)]
    assert limits == sorted(limits) and limits[0] > KHAT_LIMIT
    # one test at 5%: the prior-shrunk mean at 0.7 plus 1.645 standard errors
    tail = tail_length(num_samples)
    mean = (tail * 0.7 + 10 * 0.5) / (tail + 10)
    assert limits[0] == pytest.approx(mean + 1.6449 * khat_standard_error(0.7, tail), abs=1e-3)
    # below 2,154 weights the base is khat_threshold's, as for one k-hat
    assert family_khat_threshold(1000, 1) > khat_threshold(1000)
    # no tail to fit: no allowance (such a k-hat is inf and is flagged whatever the threshold)
    assert family_khat_threshold(20, 30) == khat_threshold(20)
    with pytest.raises(ValueError):
        family_khat_threshold(1000, 3, false_alarm=0.0)


def _family_flags(shapes: torch.Tensor, families: int, num_samples: int, seed: int) -> torch.Tensor:
    """Whether each of ``families`` families of ``len(shapes)`` k-hats has one above the family threshold."""
    khats = _pareto_khats(shapes.repeat(families), families * len(shapes), num_samples, seed)
    limit = family_khat_threshold(num_samples, len(shapes))
    return (khats.reshape(families, len(shapes)) > limit).any(-1).double()


def test_false_alarm_rate_at_the_boundary_is_nominal():
    """30 sites whose true k is 0.7 (the boundary): flagged in about 5% of posteriors, not nearly all."""
    families, sites, num_samples = 300, 30, 2200  # 2,200 weights: khat_threshold is 0.7
    flags = _family_flags(torch.full((sites,), 0.7), families, num_samples, seed=0)
    binomial_se = math.sqrt(0.05 * 0.95 / families)
    assert float(flags.mean()) == pytest.approx(0.05, abs=3 * binomial_se)
    # the rule it replaces, the largest k-hat above 0.7: nearly always flagged
    khats = _pareto_khats(torch.full((sites,), 0.7).repeat(50), 50 * sites, num_samples, seed=1)
    assert float((khats.reshape(50, sites).max(-1).values > 0.7).double().mean()) > 0.9


def test_false_alarm_rate_below_the_boundary_is_at_most_nominal():
    families, sites, num_samples = 200, 30, 2200
    flags = _family_flags(torch.linspace(0.5, 0.7, sites), families, num_samples, seed=2)
    assert float(flags.mean()) <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / families)


def test_a_clearly_bad_proposal_is_still_flagged():
    """k = 1.2 among 30 k-hats of 400 draws of 32 particles: one element is flagged 97% of the time."""
    rows, num_samples, sites = 300, 400 * 32, 30
    limit = family_khat_threshold(num_samples, sites)
    khats = _pareto_khats(1.2, rows, num_samples, seed=3)
    power = float((khats > limit).double().mean())
    expected = 0.96  # Normal(mean 1.169, sd 0.116) above 0.958
    assert power >= expected - 3 * math.sqrt(expected * (1 - expected) / rows)
    # a bad proposal of a plate (five elements at k = 1.2): every one of 60 such sites is flagged
    assert bool((khats.reshape(60, 5).max(-1).values > limit).all())


def _mixed_draws(reps: int, seed: int) -> torch.Tensor:
    """
    ``reps`` read-outs of 200 draws of 32 particles' within-draw log weights, where 2% of the draws
    differ (their weights' log sd 3, the others' 0.3): the tail is a few draws', a mixture.
    """
    generator = torch.Generator().manual_seed(seed)
    odd = (torch.rand(reps, 200, 1, generator=generator) < 0.02).double()
    log_weights = (0.3 + 2.7 * odd) * torch.randn(reps, 200, 32, generator=generator, dtype=torch.float64)
    return log_weights - torch.logsumexp(log_weights, -1, keepdim=True)


def test_bootstrap_error_follows_the_spread_of_khat_where_draws_differ():
    """
    Draws that differ from each other spread k-hat more than Pareto weights would (measured 0.158
    against khat_standard_error's 0.099); the bootstrap over draws sees it (0.164 averaged over 20).
    """
    reps = 200
    weights = _mixed_draws(reps, seed=5)
    khats = pareto_khat(weights.reshape(reps, -1))
    spread = float(khats.std())  # its relative standard error 1 / sqrt(2 (reps - 1)): 5%
    assert spread > 1.35 * khat_standard_error(float(khats.mean()), tail_length(200 * 32))
    bootstrap = [bootstrap_khat_standard_error(weights[i]) for i in range(20)]
    # one bootstrap's sd over read-outs measured 11%, so 2.5% for the mean of 20; the spread's 5%
    assert sum(bootstrap) / len(bootstrap) == pytest.approx(spread, rel=3 * math.hypot(0.05, 0.025))
    # on independent Pareto weights it agrees with the formula
    pareto = -0.7 * torch.rand(400, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(6)).log()
    assert bootstrap_khat_standard_error(pareto) == pytest.approx(khat_standard_error(0.7, 340), rel=0.3)


def _synthetic_draw(log_weights: dict) -> ReadoutDraw:
    first = {
        name: torch.zeros(weights.shape[:-1], dtype=torch.float64) for name, weights in log_weights.items()
    }
    normalised = {name: w - torch.logsumexp(w, -1, keepdim=True) for name, w in log_weights.items()}
    return ReadoutDraw(torch.zeros((), dtype=torch.float64), first, first, normalised, {})


def test_diagnostics_use_the_family_threshold_over_every_element():
    """TMCPosterior.diagnostics: sites against family_khat_threshold over all plate elements' k-hats."""
    generator = torch.Generator().manual_seed(4)
    draws, particles = 40, 32
    sites = {"a": (3,), "b": (), "c": (2,)}  # 6 elements; "c" proposes badly
    per_draw = []
    for _ in range(draws):
        log_weights = {}
        for name, shape in sites.items():
            uniform = torch.rand(shape + (particles,), dtype=torch.float64, generator=generator)
            log_weights[name] = -(3.0 if name == "c" else 0.3) * uniform.log()
        per_draw.append(_synthetic_draw(log_weights))
    diagnostics = TMCPosterior(lambda: None, per_draw).diagnostics(warn=False)
    assert isinstance(diagnostics, Diagnostics) and diagnostics.num_tests == 6
    limit = family_khat_threshold(draws * particles, 6)
    # below the limit a site keeps it; "c" passes it, and its limit allows for its bootstrap error too
    assert diagnostics.site_threshold["a"] == diagnostics.site_threshold["b"] == pytest.approx(limit)
    assert diagnostics.site_khat["c"] > diagnostics.site_threshold["c"] >= limit
    assert diagnostics.threshold == KHAT_LIMIT and diagnostics.false_alarm == 0.05
    expected = [
        name for name, value in diagnostics.site_khat.items() if value > diagnostics.site_threshold[name]
    ]
    assert diagnostics.untrusted[: len(expected)] == expected == ["c"]
    with pytest.warns(UserWarning, match=r"'c'.*above their threshold"):
        TMCPosterior(lambda: None, per_draw).diagnostics()


def test_only_the_sites_nearest_the_limit_are_bootstrapped(monkeypatch):
    """Past MAX_BOOTSTRAP_SITES sites, the rest keep the formula's limit (and their flags): bounded time."""
    from pyro_tmc.infer import tmc_posterior

    generator = torch.Generator().manual_seed(7)
    shapes = {"near": 1.6, "far": 3.0}  # both past the limit; "near" by less
    per_draw = []
    for _ in range(40):
        # raw Pareto log weights (not normalised within the draw, a test double): k-hat near the true k
        weights = {
            name: -k * torch.rand(32, dtype=torch.float64, generator=generator).log()
            for name, k in shapes.items()
        }
        zero = {name: torch.zeros((), dtype=torch.float64) for name in shapes}
        per_draw.append(ReadoutDraw(torch.zeros((), dtype=torch.float64), zero, zero, weights, {}))
    posterior = TMCPosterior(lambda: None, per_draw)
    limit = family_khat_threshold(40 * 32, 2)
    bootstrapped = []

    def wide_error(weights):  # records which site's weights were bootstrapped; an error that lifts its limit
        bootstrapped.append(weights.shape)
        return 1.0

    monkeypatch.setattr(tmc_posterior, "MAX_BOOTSTRAP_SITES", 1)
    monkeypatch.setattr(tmc_posterior, "bootstrap_khat_standard_error", wide_error)
    capped = posterior.diagnostics(warn=False)
    assert limit < capped.site_khat["near"] < capped.site_khat["far"], capped
    assert bootstrapped == [(40, 32)] and capped.site_threshold["near"] > capped.site_khat["near"]
    assert capped.site_threshold["far"] == pytest.approx(limit) and capped.untrusted == ["far"]
