"""The Laplace start of AdaptiveProposal (pyro_tmc.infer.laplace), against exact Gaussian posteriors."""

import math

import pytest
import torch

import pyro
import pyro.distributions as dist

from pyro_tmc.infer.adaptive_proposal import AdaptiveProposal
from pyro_tmc.infer.fit import fit_posterior, globals_widening
from pyro_tmc.infer.laplace import (
    _damped_step,
    _derivatives,
    _marginal_iterations,
    gaussian_proposals,
    laplace_approximation,
    log_joint,
    proposal_mean,
)

Y_SCHOOLS = torch.tensor([1.0, -0.5, 2.0])
Y_CHAIN = torch.tensor([0.3, 0.8, 1.5, 1.1])


def linear_gaussian(y_schools, y_chain):
    """A global, a plate of locals on it, and a pyro.markov chain started at it: jointly Gaussian."""
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("schools", len(y_schools)):
        theta = pyro.sample("theta", dist.Normal(mu, 1.0))
        pyro.sample("y", dist.Normal(theta, 0.5), obs=y_schools)
    x = mu
    for t in pyro.markov(range(len(y_chain))):
        x = pyro.sample(f"x_{t}", dist.Normal(0.7 * x, 1.0))
        pyro.sample(f"obs_{t}", dist.Normal(x, 0.5), obs=y_chain[t])


def exact_log_density(z: torch.Tensor) -> torch.Tensor:
    """The same density written by hand over (mu, theta_0..2, x_0..3): an oracle outside Pyro."""
    normal = torch.distributions.Normal
    mu, theta, x = z[0], z[1:4], z[4:]
    total = normal(0.0, 1.0).log_prob(mu)
    total = (
        total + normal(mu, 1.0).log_prob(theta).sum() + normal(theta, 0.5).log_prob(Y_SCHOOLS.double()).sum()
    )
    previous = torch.cat([mu.reshape(1), x[:-1]])
    return (
        total
        + normal(0.7 * previous, 1.0).log_prob(x).sum()
        + normal(x, 0.5).log_prob(Y_CHAIN.double()).sum()
    )


def exact_posterior() -> tuple[torch.Tensor, torch.Tensor]:
    z = torch.zeros(8, dtype=torch.float64)
    hessian = torch.autograd.functional.hessian(exact_log_density, z)
    gradient = torch.autograd.functional.jacobian(exact_log_density, z)
    covariance = torch.linalg.inv(-hessian)
    return covariance @ gradient, covariance  # one Newton step from 0 is the mode of a Gaussian


@pytest.fixture
def proposal():
    pyro.set_rng_seed(0)
    return AdaptiveProposal(linear_gaussian, Y_SCHOOLS, Y_CHAIN, max_plate_nesting=1)


def test_log_joint_is_the_model_density(proposal):
    z = torch.randn(8, dtype=torch.float64)
    expected = exact_log_density(z)
    assert torch.allclose(
        log_joint(linear_gaussian, proposal, z, (Y_SCHOOLS, Y_CHAIN), {}), expected, atol=1e-5
    )


def test_laplace_is_the_exact_posterior_of_a_gaussian_model(proposal):
    mean, covariance = exact_posterior()
    start = proposal_mean(proposal)
    approximation = laplace_approximation(linear_gaussian, proposal, start, (Y_SCHOOLS, Y_CHAIN))
    assert approximation is not None
    assert torch.allclose(approximation.mean, mean, atol=1e-5)
    assert torch.allclose(approximation.covariance, covariance, atol=1e-6)


def test_gaussian_proposals_are_the_exact_conditionals(proposal):
    """Each local's proposal is its Gaussian conditional given the globals and its parents."""
    mean, covariance = exact_posterior()
    approximation = laplace_approximation(
        linear_gaussian, proposal, proposal_mean(proposal), (Y_SCHOOLS, Y_CHAIN)
    )
    (loc, scale_tril), locals_part = gaussian_proposals(proposal, approximation, 1.0, 1.0)
    assert torch.allclose(loc, mean[:1], atol=1e-5)
    assert torch.allclose(scale_tril.square(), covariance[:1, :1], atol=1e-6)

    def conditional(target: int, given: list[int]):
        cross, gram = covariance[target, given], covariance[given][:, given]
        coefficients = torch.linalg.solve(gram, cross)
        intercept = mean[target] - coefficients @ mean[given]
        return intercept, coefficients, (covariance[target, target] - coefficients @ cross).sqrt()

    intercept, coefficients, scale = locals_part["theta"]  # (3, 1), (3, 1, 1), (3, 1)
    for j in range(3):
        expected = conditional(1 + j, [0])
        assert torch.allclose(intercept[j, 0], expected[0], atol=1e-5)
        assert torch.allclose(coefficients[j, 0], expected[1], atol=1e-5)
        assert torch.allclose(scale[j, 0], expected[2], atol=1e-5)
    for t in range(1, 4):  # x_t given mu and x_{t-1}: the rest of the chain marginalised
        intercept, coefficients, scale = locals_part[f"x_{t}"]
        expected = conditional(4 + t, [0, 3 + t])
        assert torch.allclose(intercept.reshape(()), expected[0], atol=1e-5)
        assert torch.allclose(coefficients.reshape(-1), expected[1], atol=1e-5)
        assert torch.allclose(scale.reshape(()), expected[2], atol=1e-5)


def test_no_laplace_where_a_latent_is_not_covered():
    def mixture(y):
        z = pyro.sample("z", dist.Bernoulli(0.5))
        loc = pyro.sample("loc", dist.Normal(0.0, 3.0))
        pyro.sample("y", dist.Normal(loc + z, 1.0), obs=y)

    proposal = AdaptiveProposal(mixture, torch.tensor(0.5), max_plate_nesting=0)
    assert laplace_approximation(mixture, proposal, proposal_mean(proposal), (torch.tensor(0.5),)) is None


def test_no_laplace_where_the_density_is_not_concave():
    """Between two Cauchy observations far apart the log density curves up: no Gaussian there."""

    def two_cauchy(y):
        loc = pyro.sample("loc", dist.Normal(0.0, 100.0))
        with pyro.plate("data", 2):
            pyro.sample("y", dist.Cauchy(loc, 0.1), obs=y)

    y = torch.tensor([-5.0, 5.0])
    proposal = AdaptiveProposal(two_cauchy, y, max_plate_nesting=1)
    start = torch.zeros(1, dtype=torch.float64)
    assert laplace_approximation(two_cauchy, proposal, start, (y,), newton_steps=0) is None


def _rejected_past_five(u: torch.Tensor) -> torch.Tensor:
    """A density the model refuses to evaluate past 5, as a distribution refuses a scale of 0.0."""
    if bool((u > 5).any()):
        raise ValueError("Expected parameter scale ... to satisfy the constraint GreaterThan")
    return -((u - 4) ** 2).sum()


def test_a_newton_step_out_of_the_support_is_damped():
    """
    Regression: tutorial 09's eight schools, whose Newton step left exp(log_stddev)'s support, raised;
    stochastic volatility's shock scale, which a Hessian that calls it flat sent 5,000 sds away.
    """
    point, gradient = torch.zeros(1, dtype=torch.float64), torch.full((1,), 8.0, dtype=torch.float64)
    too_flat = torch.full((1, 1), 0.1, dtype=torch.float64)  # Newton's step: 80, refused past 5
    value = float(_rejected_past_five(point))
    moved, damping = _damped_step(_rejected_past_five, point, value, gradient, too_flat, 0.0)
    assert moved is not None and 0 < moved.item() <= 5 and float(_rejected_past_five(moved)) > value
    assert damping > 1  # raised until the step stayed inside: lowered tenfold for the next
    exact = torch.full((1, 1), 2.0, dtype=torch.float64)  # the true Hessian: Newton's step to the mode
    moved, damping = _damped_step(_rejected_past_five, point, value, gradient, exact, 0.0)
    assert moved.item() == pytest.approx(4.0) and damping == 0.0
    assert _derivatives(_rejected_past_five, torch.full((1,), 6.0, dtype=torch.float64)) is None


def test_globals_widening_shrinks_with_their_number():
    assert globals_widening(1) == globals_widening(3) == pytest.approx(1.2)
    assert globals_widening(100) == pytest.approx(1 + 0.2 * math.sqrt(0.03))


@pytest.mark.slow
def test_fit_posterior_of_forty_correlated_globals():
    """
    40 correlated Gaussian globals: the rounds alone collapsed onto one effective draw (sds 0-3% of
    the exact ones); from the Laplace start, kept by the best-of-rounds rule, the means sit within
    their standard errors and the sds within 5%.
    """
    size = 40
    generator = torch.Generator().manual_seed(0)
    design = torch.randn(size, size, generator=generator) / size**0.5 + torch.eye(size)
    y = design @ torch.randn(size, generator=generator) + 0.3 * torch.randn(size, generator=generator)

    def regression(y):
        z = pyro.sample("z", dist.Normal(torch.zeros(size), 1.0).to_event(1))
        pyro.sample("y", dist.Normal((design * z.unsqueeze(-2)).sum(-1), 0.3).to_event(1), obs=y)

    precision = torch.eye(size) + design.T @ design / 0.09
    covariance = torch.linalg.inv(precision)
    mean = covariance @ (design.T @ y / 0.09)
    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    posterior = fit_posterior(
        regression,
        y,
        num_steps=200,
        learning_rate=0.05,
        num_draws=40,
        max_draws=40,
        max_plate_nesting=0,
        progress=False,
    )
    moments = posterior.moments["z"]
    sd = covariance.diagonal().sqrt()
    assert ((moments.mean.float() - mean).abs() < 4 * moments.mean_error.float() + 0.01 * sd).all()
    assert ((moments.stddev.float() / sd - 1).abs() < 0.05).all()


def test_log_joint_carries_the_jacobian_of_a_constrained_site():
    """A Gamma scale, in log coordinates: the density of u = log(scale) is p(e^u) e^u."""

    def scale_model(y):
        scale = pyro.sample("scale", dist.Gamma(2.0, 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Normal(0.0, scale), obs=y)

    y = torch.tensor([0.5, -1.0, 2.0])
    proposal = AdaptiveProposal(scale_model, y, max_plate_nesting=1)
    u = torch.tensor([0.3], dtype=torch.float64)
    scale = u.exp()
    expected = (
        torch.distributions.Gamma(2.0, 1.0).log_prob(scale)
        + torch.distributions.Normal(0.0, scale).log_prob(y.double()).sum()
        + u
    )
    assert torch.allclose(log_joint(scale_model, proposal, u, (y,), {}), expected.reshape(()), atol=1e-5)


def test_a_chain_s_hessian_is_read_from_its_band(float64):
    """
    A 2-global, 40-step chain's Hessian from 2 + 6 backward passes equals the one read row by row;
    a density that couples steps 3 apart is caught by the check and read row by row.
    """
    from pyro_tmc.infer.laplace import ChainBand, _banded_hessian

    torch.manual_seed(0)
    steps = 40
    band = ChainBand(
        torch.cat([torch.full((2,), -1), torch.arange(1, steps + 1) % 3]),
        torch.cat([torch.full((2,), -1), torch.arange(1, steps + 1)]),
    )
    weights = torch.randn(steps)

    def chain_density(u):  # the globals scale every step's link to the step before
        g, z = u[:2], u[2:]
        links = (z[1:] - g[0].tanh() * z[:-1]).square().sum() * g[1].exp()
        return -links - (weights * z).cos().sum() - g.square().sum() * z.square().mean()

    def coupled_density(u):
        return chain_density(u) - (u[2 + 3 :] * u[2:-3]).sum()

    point = 0.5 * torch.randn(2 + steps)
    for density, banded in ((chain_density, True), (coupled_density, False)):
        density.band = None
        full = _derivatives(density, point)[2]
        u = point.clone().requires_grad_(True)
        (gradient,) = torch.autograd.grad(density(u), u, create_graph=True)
        got = _banded_hessian(gradient, u, band)
        if banded:
            assert torch.allclose(got, full, rtol=1e-10, atol=1e-10)
        else:
            assert got is None


Y_REGRESSION = torch.tensor([0.4, -1.2, 2.1, 0.9, 1.6])
X_REGRESSION = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0])  # not centred: the globals correlate


def gaussian_locals(y):
    """Two globals (intercept, slope) and a Gaussian local per point, linear in them: jointly Gaussian."""
    intercept = pyro.sample("intercept", dist.Normal(0.0, 2.0))
    slope = pyro.sample("slope", dist.Normal(0.0, 1.0))
    with pyro.plate("points", len(y)):
        z = pyro.sample("z", dist.Normal(intercept + slope * X_REGRESSION, 0.8))
        pyro.sample("y", dist.Normal(z, 0.5), obs=y)


def scale_funnel(y):
    """A log scale and a Gaussian local per group on it: the joint density has no mode (tau -> 0)."""
    tau = pyro.sample("tau", dist.LogNormal(0.0, 1.0))
    with pyro.plate("groups", len(y)):
        z = pyro.sample("z", dist.Normal(0.0, tau))
        pyro.sample("y", dist.Normal(z, 1.0), obs=y)


def exact_funnel_marginal(u: torch.Tensor) -> torch.Tensor:
    """log p(y, log tau) of the funnel, the locals integrated out exactly: y_i ~ N(0, tau^2 + 1)."""
    tau = u.exp()
    log_prior = torch.distributions.LogNormal(0.0, 1.0).log_prob(tau) + u  # the density of log tau
    variance = tau**2 + 1
    return log_prior + torch.distributions.Normal(0.0, variance.sqrt()).log_prob(Y_REGRESSION.double()).sum()


def conditional_start(model, y, globals_at: torch.Tensor):
    """_globals_marginal's arguments: the log density, the locals' mask, their mode given the globals."""
    from pyro_tmc.infer.laplace import ConditionalMode, _locals_mask, _mode

    proposal = AdaptiveProposal(model, y)

    def log_density(u):
        return log_joint(model, proposal, u, (y,), {})

    free = _locals_mask(proposal)
    start = proposal_mean(proposal).double()
    start[~free] = globals_at.double()
    point, value, factor, converged = _mode(log_density, start, 20, free)
    assert converged
    return log_density, ConditionalMode(point, value, factor), free


def test_the_globals_marginal_is_exact_where_the_locals_are_gaussian():
    """For a jointly Gaussian model L(g) is the log marginal itself: its Newton step lands on the mode."""
    from pyro_tmc.infer.laplace import _globals_marginal

    start = torch.tensor([1.0, -0.5])
    log_density, conditional, free = conditional_start(gaussian_locals, Y_REGRESSION, start)
    marginal = _globals_marginal(log_density, conditional, free, torch.ones(2, dtype=torch.float64))
    z = torch.zeros(7, dtype=torch.float64)
    hessian = torch.autograd.functional.hessian(log_density, z)
    gradient = torch.autograd.functional.jacobian(log_density, z)
    covariance = torch.linalg.inv(-hessian)
    mean = covariance @ gradient  # the joint posterior, one Newton step from 0
    assert torch.allclose(marginal.mean, mean[:2], atol=1e-5)
    assert torch.allclose(marginal.covariance, covariance[:2, :2], rtol=1e-4, atol=1e-6)
    # the locals' mode at the globals' mean: the joint mode
    assert torch.allclose(marginal.mode.point, mean, atol=1e-5)


@pytest.mark.parametrize("start", [-0.5, 0.4, 1.5])
def test_the_globals_marginal_of_a_funnel_integrates_its_locals(start):
    """
    The funnel's locals are Gaussian given its scale, so L is the exact log marginal of log tau (up to
    a constant): the Newton steps on its finite differences end at the exact marginal's mode, and its
    covariance is their curvature there.
    """
    from pyro_tmc.infer.laplace import _globals_marginal

    log_density, conditional, free = conditional_start(scale_funnel, Y_REGRESSION, torch.tensor([start]))
    marginal = _globals_marginal(log_density, conditional, free, torch.ones(1, dtype=torch.float64))
    exact = exact_funnel_marginal
    mode = torch.tensor(0.0, dtype=torch.float64)
    for _ in range(50):  # the exact marginal's mode, by Newton's steps on its analytic derivatives
        mode = mode - torch.autograd.functional.jacobian(exact, mode) / torch.autograd.functional.hessian(
            exact, mode
        )
    analytic_variance = float(-1 / torch.autograd.functional.hessian(exact, mode))
    sd = math.sqrt(analytic_variance)
    # within a tenth of an sd of the mode (the last step was at most MARGINAL_TOLERANCE sds, and
    # Newton's steps converge quadratically), from a start on either side of it
    assert abs(float(marginal.mean) - float(mode)) < 0.1 * sd, (float(marginal.mean), float(mode))
    # the covariance is the differences' curvature, steps of MARGINAL_STEP sds: within 12% of the
    # analytic one (their error, h^2 / 12 of the fourth derivative over the second)
    assert float(marginal.covariance) == pytest.approx(analytic_variance, rel=0.12)
    u = marginal.mean.reshape(()).double()
    assert exact(u) >= exact(torch.tensor(start, dtype=torch.float64))


def test_the_globals_marginal_takes_no_step_it_cannot_afford():
    """
    One step on 3 globals over 103 unbanded coordinates read row by row costs 5,150 backward passes,
    over the budget: none is taken (at least one had doubled the 100-day volatility's fit); by its
    sparse Hessian's 8 passes, 12; a chain's 2,516 days get 12.
    """
    assert _marginal_iterations(3, 103, chain=False) == 0
    assert _marginal_iterations(3, 8, chain=False) == 12
    assert _marginal_iterations(4, 2520, chain=True) == 12
    assert _marginal_iterations(2, 10, chain=False) == 12
