"""QEM's element-wise moments of vector sites (pyro_tmc.infer.qem_elementwise) against exact Gaussian answers.

The model is a Bayesian linear regression: an intercept ``b`` (a scalar site) and coefficients ``beta``
(one vector site of D elements), both N(0, 1) a priori, observations N(b + X beta, 1) in a plate. The
posterior of ``(b, beta)`` is Gaussian with precision ``I + A^T A`` (``A = [1, X]``), so every
conditional and marginal moment is known in closed form.
"""

import math

import numpy as np
import pytest
import torch

import pyro
import pyro.distributions as dist

from pyro_tmc import QEM, QEMGuide
from pyro_tmc.infer.qem_elementwise import elementwise_statistics, is_elementwise_site

NUM_DATA, NUM_COEFFICIENTS = 12, 4


def regression_model(features, y):
    b = pyro.sample("b", dist.Normal(0.0, 1.0))
    beta = pyro.sample("beta", dist.Normal(0.0, 1.0).expand([features.shape[-1]]).to_event(1))
    with pyro.plate("data", y.shape[-1]):
        pyro.sample("y", dist.Normal(b + (features * beta).sum(-1), 1.0), obs=y)


def regression_data(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(NUM_DATA, NUM_COEFFICIENTS, generator=generator)
    y = 0.5 + features @ torch.tensor([1.0, -0.5, 0.3, 0.0]) + torch.randn(NUM_DATA, generator=generator)
    return features, y


def exact_posterior(features, y):
    """The posterior mean and precision of ``(b, beta_1..beta_D)`` (float64)."""
    design = np.concatenate([np.ones((NUM_DATA, 1)), features.double().numpy()], 1)
    precision = np.eye(NUM_COEFFICIENTS + 1) + design.T @ design
    mean = np.linalg.solve(precision, design.T @ y.double().numpy())
    return mean, precision


def test_elementwise_statistics_are_each_elements_exact_conditional_moments(fresh_pyro):
    """
    At one fixed reference ``(b*, beta*)``, element j's statistics are ``E[beta_j | beta*_{-j}, b*, y]``
    and ``E[beta_j^2 | ...]``: the Gaussian conditional ``N(m_j - sum_{i != j} P_ji (z*_i - m_i) / P_jj,
    1 / P_jj)``. 2,000 candidates per element from the prior, 16 repeats (seeds 0-15); the tolerance is
    5 standard errors of the repeats' mean. Measured (seeds 0-15, ..., 64-79): largest |error| / standard
    error 1.35, 3.12, 2.05, 2.09, 1.20; largest |error| 0.002-0.008.
    """
    features, y = regression_data()
    mean, precision = exact_posterior(features, y)
    guide = QEMGuide(regression_model)
    guide.setup(features, y)
    reference_value = torch.tensor([0.3, 0.8, -0.2, 0.5, -0.4])  # (b*, beta*), near the posterior
    reference = {"b": reference_value[:1], "beta": reference_value[1:].unsqueeze(0)}
    event_dims = {"b": 0, "beta": 1}
    estimates = []
    for seed in range(16):
        pyro.set_rng_seed(seed)
        first, second = elementwise_statistics(
            regression_model, guide, "beta", reference, event_dims, (features, y), {}, 2000, 1
        )
        estimates.append(torch.cat([first, second]).double().numpy())
    estimates = np.stack(estimates)
    average, error = estimates.mean(0), estimates.std(0, ddof=1) / math.sqrt(len(estimates))
    z = reference_value.double().numpy()
    exact_first, exact_second = [], []
    for j in range(1, NUM_COEFFICIENTS + 1):
        others = [i for i in range(NUM_COEFFICIENTS + 1) if i != j]
        conditional_mean = mean[j] - precision[j, others] @ (z[others] - mean[others]) / precision[j, j]
        exact_first.append(conditional_mean)
        exact_second.append(1 / precision[j, j] + conditional_mean**2)
    exact = np.array(exact_first + exact_second)
    assert np.all(np.abs(average - exact) < 5 * error + 1e-3), (average, exact, error)


NUM_GROUPS, GROUP_SIZE, GROUP_COEFFICIENTS = 3, 6, 3


def plated_model(features, y):
    """A coefficient vector per group (in a plate), a shared intercept: the groups' vectors are
    independent given ``b``."""
    b = pyro.sample("b", dist.Normal(0.0, 1.0))
    with pyro.plate("groups", y.shape[-2], dim=-2):
        beta = pyro.sample("beta", dist.Normal(0.0, 1.0).expand([features.shape[-1]]).to_event(1))
        with pyro.plate("data", y.shape[-1], dim=-1):
            pyro.sample("y", dist.Normal(b + (features * beta).sum(-1), 1.0), obs=y)


def test_a_plated_vector_sites_elements_take_their_groups_conditionals(fresh_pyro):
    """
    ``beta`` in plate ``groups``, one 3-vector per group: element j of group g's statistics are its
    Gaussian conditional given group g's other elements and ``b`` (precision ``I + X_g^T X_g``, mean
    from the residuals ``y_g - b``), from group g's factors only. 2,000 candidates, 16 repeats, the
    tolerance 5 standard errors of their mean. Measured: largest |error| / standard error over the 18
    statistics 2.35 (seeds 0-15), 4.04, 3.52 and 2.93 (seeds 16-31, 32-47, 48-63).
    """
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(NUM_GROUPS, GROUP_SIZE, GROUP_COEFFICIENTS, generator=generator)
    y = torch.randn(NUM_GROUPS, GROUP_SIZE, generator=generator) + features[..., 0]
    guide = QEMGuide(plated_model)
    guide.setup(features, y)
    assert is_elementwise_site(guide, "beta", allow_plates=True) and not is_elementwise_site(guide, "beta")
    b = 0.4
    drawn = torch.tensor([[0.5, -0.3, 0.2], [1.0, 0.1, -0.6], [0.0, 0.4, 0.3]])  # (G, D)
    reference = {"b": torch.tensor([b]), "beta": drawn.reshape(1, NUM_GROUPS, 1, GROUP_COEFFICIENTS)}
    estimates = []
    for seed in range(16):
        pyro.set_rng_seed(seed)
        first, second = elementwise_statistics(
            plated_model, guide, "beta", reference, {"b": 0, "beta": 1}, (features, y), {}, 2000, 2
        )
        assert first.shape == (NUM_GROUPS, 1, GROUP_COEFFICIENTS)
        estimates.append(torch.cat([first.reshape(-1), second.reshape(-1)]).double().numpy())
    estimates = np.stack(estimates)
    average, error = estimates.mean(0), estimates.std(0, ddof=1) / math.sqrt(len(estimates))
    exact_first, exact_second = [], []
    for g in range(NUM_GROUPS):
        design = features[g].double().numpy()
        precision = np.eye(GROUP_COEFFICIENTS) + design.T @ design
        mean = np.linalg.solve(precision, design.T @ (y[g].double().numpy() - b))
        z = drawn[g].double().numpy()
        for j in range(GROUP_COEFFICIENTS):
            others = [i for i in range(GROUP_COEFFICIENTS) if i != j]
            conditional_mean = mean[j] - precision[j, others] @ (z[others] - mean[others]) / precision[j, j]
            exact_first.append(conditional_mean)
            exact_second.append(1 / precision[j, j] + conditional_mean**2)
    exact = np.array(exact_first + exact_second)
    assert np.all(np.abs(average - exact) < 5 * error + 1e-3), (average, exact, error)


def test_auto_picks_the_vector_sites_outside_plates(fresh_pyro):
    """``elementwise="auto"`` takes ``beta`` (4 elements, no plate), not the scalar ``b``; bad names fail."""
    features, y = regression_data()
    guide = QEMGuide(regression_model)
    qem = QEM(regression_model, guide, num_samples=4, max_plate_nesting=1, elementwise="auto")
    qem.step(features, y)
    assert qem.elementwise_sites() == ["beta"]
    assert is_elementwise_site(guide, "beta") and not is_elementwise_site(guide, "b")
    with pytest.raises(ValueError, match="elementwise"):
        QEM(regression_model, QEMGuide(regression_model), elementwise="beta")
    with pytest.raises(ValueError, match="num_references"):
        QEM(regression_model, QEMGuide(regression_model), num_references=0)
    pyro.clear_param_store()
    bad = QEM(regression_model, QEMGuide(regression_model), max_plate_nesting=1, elementwise=["b"])
    with pytest.raises(ValueError, match="not guide sites"):
        bad.step(features, y)


def _converged_moments(model, args, names, elementwise, max_plate_nesting):
    """
    QEM at K = 64, lr = 0.2 for 300 steps: the guide's means and sds of sites ``names`` (flattened,
    concatenated) averaged over the last 250 steps, and their batch-means standard errors.
    """
    guide = QEMGuide(model)
    qem = QEM(
        model, guide, lr=0.2, num_samples=64, max_plate_nesting=max_plate_nesting, elementwise=elementwise
    )
    history = []
    for step in range(300):
        qem.step(*args)
        if step >= 50:
            fitted = [guide.distribution(name) for name in names]
            means = torch.cat([site.mean.reshape(-1) for site in fitted])
            stddevs = torch.cat([site.stddev.reshape(-1) for site in fitted])
            history.append(torch.cat([means, stddevs]).double().numpy())
    history = np.stack(history)
    batches = np.stack([batch.mean(0) for batch in np.array_split(history, 10)])
    average, error = history.mean(0), batches.std(0, ddof=1) / math.sqrt(10)
    half = len(average) // 2
    return average[:half], average[half:], error[:half], error[half:]


@pytest.mark.slow
def test_qem_with_elementwise_moments_converges_to_the_exact_marginals(fresh_pyro):
    """
    QEM with ``elementwise="auto"`` (beta's moments element-wise, b's from TMC), K = 64, lr = 0.2, 300
    steps averaged over the last 250: every marginal mean and sd matches the exact posterior's within
    4 batch-means standard errors plus 0.05 posterior sd (the O(1/K) bias of self-normalised moments;
    the reference draws come from TMC's weights). Measured (seeds 0-2): largest mean error 0.013-0.017
    sd, sd ratios 0.964-1.007 (TMC's joint moments alone, ``elementwise=False``: 0.946-0.999; at K = 16
    0.90-1.00 element-wise and 0.85-1.01 without).
    """
    features, y = regression_data()
    mean, precision = exact_posterior(features, y)
    sd = np.sqrt(np.diag(np.linalg.inv(precision)))
    means, stddevs, mean_error, sd_error = _converged_moments(
        regression_model, (features, y), ["b", "beta"], "auto", 1
    )
    assert np.all(np.abs(means - mean) < 4 * mean_error + 0.05 * sd), (means, mean)
    assert np.all(np.abs(stddevs - sd) < 4 * sd_error + 0.05 * sd), (stddevs, sd)


@pytest.mark.slow
def test_qem_with_plated_elementwise_moments_converges_to_the_exact_marginals(fresh_pyro):
    """
    The plated model with ``elementwise=["beta"]`` (each group's vector element-wise), as above: the
    exact posterior of ``(b, beta_1, .., beta_G)`` is Gaussian with precision ``I + A^T A``. Measured
    (seeds 0-2): largest mean error 0.016-0.035 sd (|error| / standard error at most 3.11), sd ratios
    0.972-1.019 (TMC's joint moments alone: 0.013-0.028 sd, 0.975-1.010: three elements a group are
    few enough for TMC's K = 64 particles of each).
    """
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(NUM_GROUPS, GROUP_SIZE, GROUP_COEFFICIENTS, generator=generator)
    y = torch.randn(NUM_GROUPS, GROUP_SIZE, generator=generator) + features[..., 0]
    design = np.zeros((NUM_GROUPS * GROUP_SIZE, 1 + NUM_GROUPS * GROUP_COEFFICIENTS))
    for g in range(NUM_GROUPS):
        rows = slice(g * GROUP_SIZE, (g + 1) * GROUP_SIZE)
        design[rows, 0] = 1.0
        design[rows, 1 + g * GROUP_COEFFICIENTS : 1 + (g + 1) * GROUP_COEFFICIENTS] = (
            features[g].double().numpy()
        )
    precision = np.eye(design.shape[1]) + design.T @ design
    mean = np.linalg.solve(precision, design.T @ y.reshape(-1).double().numpy())
    sd = np.sqrt(np.diag(np.linalg.inv(precision)))
    means, stddevs, mean_error, sd_error = _converged_moments(
        plated_model, (features, y), ["b", "beta"], ["beta"], 2
    )
    assert np.all(np.abs(means - mean) < 4 * mean_error + 0.05 * sd), (means, mean)
    assert np.all(np.abs(stddevs - sd) < 4 * sd_error + 0.05 * sd), (stddevs, sd)
