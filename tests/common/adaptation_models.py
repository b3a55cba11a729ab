"""Models with exact posteriors for the adaptive proposal's tests (tests/infer/test_adaptive_proposal.py,
tests/infer/test_adaptation.py): a pyro.markov chain with a global, a conjugate model with positive and
interval supports, and the exact posterior regressions ("conditionals") the proposal must fit.
Linear-Gaussian answers come from :mod:`tests.common.models`' generic helpers."""

import math

import numpy as np
import torch

import pyro
import pyro.distributions as dist

from tests.common.models import gaussian_posterior, linear_gaussian_log_marginal, linear_gaussian_moments

CHAIN_STEPS = 50
CHAIN_PERSISTENCE, CHAIN_PULL, CHAIN_SD, CHAIN_NOISE = 0.8, 0.2, 0.6, 0.8


def chain_with_global_model(x: torch.Tensor) -> None:
    """g ~ N(0, 1); z_1 ~ N(g, 1); z_t ~ N(0.8 z_{t-1} + 0.2 g, 0.6^2); x_t ~ N(z_t, 0.8^2)."""
    g = pyro.sample("g", dist.Normal(x.new_zeros(()), 1.0))
    z = None
    for t in pyro.markov(range(len(x))):
        loc = g if z is None else CHAIN_PERSISTENCE * z + CHAIN_PULL * g
        z = pyro.sample(f"z_{t}", dist.Normal(loc, 1.0 if t == 0 else CHAIN_SD))
        pyro.sample(f"x_{t}", dist.Normal(z, CHAIN_NOISE), obs=x[t])


def chain_with_global_joint(steps: int):
    """Mean and covariance of (g, z_0..z_{T-1}, x_0..x_{T-1})."""
    n = 1 + 2 * steps
    weights = np.zeros((n, n))
    weights[1, 0] = 1.0
    for t in range(1, steps):
        weights[1 + t, t] = CHAIN_PERSISTENCE
        weights[1 + t, 0] = CHAIN_PULL
    weights[1 + steps + np.arange(steps), 1 + np.arange(steps)] = 1.0
    noise = np.r_[1.0, 1.0, np.full(steps - 1, CHAIN_SD**2), np.full(steps, CHAIN_NOISE**2)]
    return linear_gaussian_moments(weights, noise)


def chain_data(steps: int, seed: int = 0) -> torch.Tensor:
    mean, cov = chain_with_global_joint(steps)
    draw = np.random.default_rng(seed).multivariate_normal(mean, cov)
    return torch.tensor(draw[1 + steps :])


def chain_posterior(x: torch.Tensor):
    """The exact posterior mean and covariance of (g, z_0..z_{T-1})."""
    steps = len(x)
    mean, cov = chain_with_global_joint(steps)
    return gaussian_posterior(x.numpy(), np.arange(1 + steps, 1 + 2 * steps), mean, cov)


def chain_log_px(x: torch.Tensor) -> float:
    steps = len(x)
    mean, cov = chain_with_global_joint(steps)
    return linear_gaussian_log_marginal(x.numpy(), np.arange(1 + steps, 1 + 2 * steps), mean, cov)


def conditional(post_mean, post_cov, child: int, parents: list[int]):
    """The exact posterior regression of ``child`` on ``parents``: (intercept, coefficients, sd)."""
    c_pp = post_cov[np.ix_(parents, parents)]
    c_cp = post_cov[child, parents]
    coefficients = np.linalg.solve(c_pp, c_cp)
    intercept = post_mean[child] - coefficients @ post_mean[parents]
    variance = post_cov[child, child] - coefficients @ c_cp
    return intercept, coefficients, math.sqrt(variance)


def toy_posterior(x: torch.Tensor):
    """The toy model's (theta, z_1..z_N) exact posterior mean and covariance."""
    n = len(x)
    weights = np.zeros((1 + 2 * n, 1 + 2 * n))
    weights[1 : n + 1, 0] = 1.0
    weights[n + 1 :, 1 : n + 1] = np.eye(n)
    mean, cov = linear_gaussian_moments(weights, np.ones(1 + 2 * n))
    return gaussian_posterior(x.numpy(), np.arange(n + 1, 2 * n + 1), mean, cov)


GAMMA_PRIOR = (2.0, 1.0)
BETA_PRIOR = (2.0, 3.0)
TRIALS = 10


def conjugate_model(counts: torch.Tensor, successes: torch.Tensor) -> None:
    """
    A positive global (rate ~ Gamma, Poisson counts), an interval global (p ~ Beta, a binomial
    count) and positive locals in a plate (rate_i ~ Gamma(2, 1), a Poisson count each).
    """
    rate = pyro.sample("rate", dist.Gamma(*map(counts.new_tensor, GAMMA_PRIOR)))
    with pyro.plate("pooled", len(counts)):
        pyro.sample("pooled_counts", dist.Poisson(rate), obs=counts)
    p = pyro.sample("p", dist.Beta(*map(counts.new_tensor, BETA_PRIOR)))
    pyro.sample("successes", dist.Binomial(TRIALS, p), obs=successes)
    with pyro.plate("groups", len(counts)):
        rates = pyro.sample("rates", dist.Gamma(*map(counts.new_tensor, GAMMA_PRIOR)))
        pyro.sample("counts", dist.Poisson(rates), obs=counts)


def conjugate_posteriors(counts: torch.Tensor, successes: torch.Tensor) -> dict:
    """Each site's exact posterior (they are independent)."""
    a, b = GAMMA_PRIOR
    return {
        "rate": dist.Gamma(a + counts.sum(), b + len(counts)),
        "p": dist.Beta(BETA_PRIOR[0] + successes, BETA_PRIOR[1] + TRIALS - successes),
        "rates": dist.Gamma(a + counts, b + 1.0),
    }


def conjugate_log_px(counts: torch.Tensor, successes: torch.Tensor) -> float:
    """log p(x) by the candidate's formula p(x) = p(x | z) p(z) / p(z | x) at any z (the posterior mean)."""
    model_trace = pyro.poutine.trace(
        pyro.poutine.condition(
            conjugate_model, {name: d.mean for name, d in conjugate_posteriors(counts, successes).items()}
        )
    ).get_trace(counts, successes)
    log_joint = model_trace.log_prob_sum()
    log_post = sum(d.log_prob(d.mean).sum() for name, d in conjugate_posteriors(counts, successes).items())
    return float(log_joint - log_post)


COUNTS = torch.tensor([3.0, 0.0, 5.0, 2.0, 7.0, 1.0], dtype=torch.float64)
SUCCESSES = torch.tensor(7.0, dtype=torch.float64)


# -- a funnel: eight schools with an unknown group scale (exact by quadrature over its log) -------

FUNNEL_Y = (28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0)
FUNNEL_SIGMA = (15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0)
FUNNEL_MU_SD, FUNNEL_LOG_TAU = 5.0, (1.0, 1.0)


def funnel_model(y: torch.Tensor) -> None:
    """mu ~ N(0, 5^2), log_tau ~ N(1, 1), theta_j ~ N(mu, tau^2), y_j ~ N(theta_j, sigma_j^2)."""
    mu = pyro.sample("mu", dist.Normal(y.new_zeros(()), FUNNEL_MU_SD))
    log_tau = pyro.sample("log_tau", dist.Normal(*map(y.new_tensor, FUNNEL_LOG_TAU)))
    with pyro.plate("schools", len(y)):
        theta = pyro.sample("theta", dist.Normal(mu, log_tau.exp()))
        pyro.sample("y", dist.Normal(theta, y.new_tensor(FUNNEL_SIGMA)), obs=y)


def funnel_exact(num_points: int = 4001) -> dict:
    """
    log p(y) and the posterior means and sds of mu, log_tau and theta_1..theta_8: given log_tau the
    model is linear-Gaussian (its evidence and posterior exact), and log_tau is summed out on a grid
    of ``num_points`` over 12 prior sds (the trapezoid rule; its error is far below 1e-6 here).
    """
    y, n = np.array(FUNNEL_Y), len(FUNNEL_Y)
    loc, sd = FUNNEL_LOG_TAU
    grid = np.linspace(loc - 6 * sd, loc + 6 * sd, num_points)
    weights = np.zeros((1 + 2 * n, 1 + 2 * n))
    weights[1 : n + 1, 0] = 1.0
    weights[n + 1 :, 1 : n + 1] = np.eye(n)
    observed = np.arange(n + 1, 2 * n + 1)
    log_joint, firsts, seconds = [], [], []
    for log_tau in grid:
        noise = np.r_[FUNNEL_MU_SD**2, np.full(n, math.exp(2 * log_tau)), np.square(FUNNEL_SIGMA)]
        mean, cov = linear_gaussian_moments(weights, noise)
        log_prior = -0.5 * ((log_tau - loc) / sd) ** 2 - math.log(sd * math.sqrt(2 * math.pi))
        log_joint.append(log_prior + linear_gaussian_log_marginal(y, observed, mean, cov))
        post_mean, post_cov = gaussian_posterior(y, observed, mean, cov)
        firsts.append(np.r_[post_mean[0], log_tau, post_mean[1:]])
        seconds.append(
            np.r_[post_mean[0] ** 2 + post_cov[0, 0], log_tau**2, post_mean[1:] ** 2 + np.diag(post_cov)[1:]]
        )
    log_joint = np.array(log_joint)
    step = grid[1] - grid[0]
    trapezoid = np.full(num_points, step)
    trapezoid[[0, -1]] /= 2
    peak = log_joint.max()
    mass = np.exp(log_joint - peak) * trapezoid
    log_px = peak + math.log(mass.sum())
    posterior = mass / mass.sum()
    first, second = posterior @ np.array(firsts), posterior @ np.array(seconds)
    return {"log_px": log_px, "mean": first, "sd": np.sqrt(second - first**2)}
