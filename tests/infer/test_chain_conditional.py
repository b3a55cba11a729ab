"""The chain's proposal that follows the globals (``pyro_tmc.infer.chain_conditional``).

Oracles: the dense Gaussian (a tridiagonal precision inverted, conditioned step by step), the exact
conditional of a linear-Gaussian chain given its globals (its Hessian by autograd, dense), and the
exact ``log p(x)`` of that chain for unbiasedness (4 measured standard errors).
"""

import math

import pytest
import torch

import pyro

from pyro_tmc import TMC_ELBO
from pyro_tmc.infer import laplace
from pyro_tmc.infer.adaptive_proposal import AdaptiveProposal
from pyro_tmc.infer.chain_conditional import chain_conditional, forward_conditionals
from pyro_tmc.infer.chain_proposal import ChainProposal
from pyro_tmc.infer.fit import laplace_proposal

funsor = pytest.importorskip("funsor")

from tests.common.vectorized_chains import DRIFT, DRIFT_SCALE, drift_exact_log_evidence, drift_model  # noqa: E402

X = torch.tensor([0.9, -0.4, 1.7, 0.3, -1.1, 0.2, 0.8, 1.4, -0.2, 0.5], dtype=torch.float64)
CURRENT = f"z_{slice(1, len(X))}"


def dense_conditionals(mean: torch.Tensor, covariance: torch.Tensor, first_coefficient: float):
    """``x_t | x_{t-1}`` of ``N(mean, covariance)`` (a chain given the step before it): step by step."""
    variance = covariance.diagonal().clone()
    coefficient = torch.zeros_like(mean)
    coefficient[0] = first_coefficient
    for t in range(1, len(mean)):
        coefficient[t] = covariance[t, t - 1] / covariance[t - 1, t - 1]
        variance[t] = covariance[t, t] - covariance[t, t - 1] ** 2 / covariance[t - 1, t - 1]
    return coefficient, variance


def test_forward_conditionals_match_the_dense_gaussian(float64):
    generator = torch.Generator().manual_seed(0)
    n = 7
    diagonal = 2.0 + torch.rand(n + 1, generator=generator, dtype=torch.float64)
    above = torch.rand(n, generator=generator, dtype=torch.float64) - 0.5
    precision = torch.diag(diagonal) + torch.diag(above, 1) + torch.diag(above, -1)  # x_0 .. x_n
    later = precision[1:, 1:]
    covariance = torch.linalg.inv(later)
    first = torch.tensor([0.7], dtype=torch.float64)
    mean = torch.randn(n, generator=generator, dtype=torch.float64)  # the later steps' mean given x_0 = first
    intercept, coefficient, variance = forward_conditionals(
        mean, later.diagonal(), later.diagonal(1), first, float(precision[1, 0])
    )
    # E[x_1 | x_0] moves with x_0 by -(Q_ll^-1 Q_l0)_1
    first_coefficient = float(-(covariance @ precision[1:, 0])[0])
    expected_coefficient, expected_variance = dense_conditionals(mean, covariance, first_coefficient)
    assert torch.allclose(coefficient, expected_coefficient, atol=1e-12)
    assert torch.allclose(variance, expected_variance, atol=1e-12)
    previous = torch.cat([first, mean[:-1]])
    assert torch.allclose(intercept + coefficient * previous, mean, atol=1e-12)


def exact_conditional(x: torch.Tensor, m: float, z0: float):
    """The drift chain's later steps given m and z_0: their mean and covariance, by a dense Hessian."""

    def log_density(later):
        path = torch.cat([torch.tensor([z0], dtype=later.dtype), later])
        steps = torch.distributions.Normal(DRIFT * path[:-1] + m, DRIFT_SCALE).log_prob(path[1:]).sum()
        return steps + torch.distributions.Normal(path[1:], 1.0).log_prob(x[1:]).sum()

    zero = torch.zeros(len(x) - 1, dtype=torch.float64)
    hessian = torch.autograd.functional.hessian(log_density, zero)
    gradient = torch.autograd.functional.jacobian(log_density, zero)
    covariance = torch.linalg.inv(-hessian)
    return covariance @ gradient, covariance  # one Newton step from 0: the mode of a Gaussian


def fitted(global_samples=1):
    proposal = AdaptiveProposal(drift_model, X, global_samples=global_samples, max_plate_nesting=1)
    approximation = laplace.laplace_approximation(
        drift_model, proposal, laplace.proposal_mean(proposal), (X,)
    )
    return proposal, approximation


@pytest.mark.parametrize("globals_value", [(0.3, 0.5), (-1.2, 2.0)])
def test_parameters_are_the_exact_conditional_of_a_linear_gaussian_chain(float64, globals_value):
    proposal, approximation = fitted()
    conditional = chain_conditional(drift_model, proposal, approximation.mean, (X,), {})
    assert conditional is not None and conditional.site == CURRENT
    m, z0 = globals_value
    parameters = conditional.parameters(torch.tensor([m, z0], dtype=torch.float64))
    mean, covariance = exact_conditional(X, m, z0)
    # the first coefficient: how the later steps' conditional mean moves with z_0 (it is linear in z_0)
    shifted, _ = exact_conditional(X, m, z0 + 1.0)
    first_coefficient = float(shifted[0] - mean[0])
    coefficient, variance = dense_conditionals(mean, covariance, first_coefficient)
    assert torch.allclose(parameters.coefficient, coefficient, atol=1e-8)
    assert torch.allclose(parameters.scale, variance.sqrt(), atol=1e-8)
    previous = torch.cat([torch.tensor([z0], dtype=torch.float64), mean[:-1]])
    assert torch.allclose(parameters.intercept + parameters.coefficient * previous, mean, atol=1e-8)


def test_not_built_with_several_globals_particles(float64):
    proposal, approximation = fitted(global_samples=None)
    assert chain_conditional(drift_model, proposal, approximation.mean, (X,), {}) is None


def log_ratios(proposal, draws: int, num_samples: int = 3) -> torch.Tensor:
    elbo = TMC_ELBO(num_samples=num_samples, max_plate_nesting=1)
    exact = drift_exact_log_evidence(X)
    return torch.stack([elbo.draw(drift_model, proposal, X).log_estimate() - exact for _ in range(draws)])


@pytest.mark.parametrize("num_samples", [1, 3])
def test_exact_conditionals_make_every_draw_exact(float64, num_samples):
    """
    The globals' exact marginal (a linear-Gaussian chain's Laplace approximation, not widened, a
    Normal) and the chain's exact conditional given each globals draw: every draw's P_TMC is p(x)
    (the mixture over the step before's particles telescopes). The chain's constant proposal is not.
    """
    pyro.set_rng_seed(0)
    proposal, approximation = fitted()
    exact = proposal.fitted_to_gaussian(approximation, 1.0, 1.0, df=None)
    exact.chain_conditional = chain_conditional(drift_model, exact, approximation.mean, (X,), {})
    assert torch.allclose(
        log_ratios(exact, 20, num_samples), torch.zeros(20, dtype=torch.float64), atol=1e-10
    )
    constant = exact._copy(exact.global_proposal, exact.local_proposals)
    constant.chain_conditional = None
    assert float(log_ratios(constant, 20, num_samples).std()) > 0.1


def test_draws_that_follow_the_globals_are_unbiased(float64):
    """E[P_TMC] = p(x) under fit_posterior's Laplace proposal (globals widened, a Student-t)."""
    pyro.set_rng_seed(0)
    proposal, _ = fitted()
    candidate = laplace_proposal(drift_model, proposal, (X,), {})
    assert candidate.chain_conditional is not None
    draw = TMC_ELBO(num_samples=3, max_plate_nesting=1).draw(drift_model, candidate, X)
    fn = draw.guide_trace.nodes[CURRENT]["fn"]
    assert isinstance(fn, ChainProposal)
    assert not torch.allclose(fn.intercept, candidate.local_proposals[CURRENT].intercept.reshape(-1))
    ratios = log_ratios(candidate, 300).exp()
    error = ratios.std() / math.sqrt(len(ratios))
    assert abs(ratios.mean() - 1) < 4 * error, (float(ratios.mean()), float(error))
    assert error < 0.1  # the test can fail
