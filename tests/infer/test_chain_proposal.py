"""The proposal that follows a ``vectorized_markov`` chain (:mod:`pyro_tmc.infer.chain_proposal`).

Oracles: a loop over the steps for the prefix scan and the mixture density; brute force over all
K^T particle combinations on a draw's particles (float64); the exact ``log p(x)`` of the
linear-Gaussian chain for unbiasedness (4 measured standard errors).
"""

import math

import pytest
import torch

import pyro
import pyro.distributions as dist

from pyro_tmc import TMC_ELBO
from pyro_tmc.infer.chain_proposal import ChainProposal, balanced_ancestors, chain_scan, mixture_log_density

pytest.importorskip("funsor")
from tests.common.vectorized_chains import (  # noqa: E402
    CURRENT,
    GUIDE_LOC,
    GUIDE_SCALE,
    K,
    T,
    X,
    brute_force,
    exact_log_evidence,
    model,
    particles_of,
)

COEFFICIENT = torch.tensor([0.8, 0.6, 0.9], dtype=torch.float64)


def chain_guide(x):
    """z_0 ~ N(loc_0, scale_0); each later step drawn from one particle of the step before."""
    first = pyro.sample("z_0", dist.Normal(GUIDE_LOC[0], GUIDE_SCALE[0]))
    with pyro.plate("time", T - 1, dim=-1):
        proposal = ChainProposal(first.reshape(-1), GUIDE_LOC[1:], COEFFICIENT, GUIDE_SCALE[1:])
        pyro.sample(CURRENT, proposal)


def chain_log_q(z: torch.Tensor) -> torch.Tensor:
    """(K, T): the first step's Normal density, then each later particle's mixture density (a loop)."""
    num = z.shape[0]
    log_q = torch.empty_like(z)
    log_q[:, 0] = dist.Normal(GUIDE_LOC[0], GUIDE_SCALE[0]).log_prob(z[:, 0])
    for t in range(1, T):
        for k in range(num):
            terms = dist.Normal(GUIDE_LOC[t] + COEFFICIENT[t - 1] * z[:, t - 1], GUIDE_SCALE[t]).log_prob(
                z[k, t]
            )
            log_q[k, t] = torch.logsumexp(terms, 0) - math.log(num)
    return log_q


def test_scan_equals_a_loop_over_the_steps(float64):
    torch.manual_seed(0)
    steps, num = 37, 5
    first = torch.randn(3)
    intercept, coefficient = torch.randn(steps), torch.rand(steps) * 1.5
    innovations = torch.randn(steps, num)
    ancestors = balanced_ancestors(3, num, steps)
    expected, previous = [], first
    for t in range(steps):
        previous = intercept[t] + coefficient[t] * previous[ancestors[t]] + innovations[t]
        expected.append(previous)
    got = chain_scan(first, intercept, coefficient, innovations, ancestors)
    assert torch.allclose(got, torch.stack(expected), rtol=1e-12, atol=1e-12)


def test_ancestors_are_uniform_and_balanced():
    torch.manual_seed(1)
    ancestors = balanced_ancestors(4, 6, 20000)
    first = torch.bincount(ancestors[0], minlength=4)
    assert first.tolist() in ([2, 2, 1, 1], [1, 2, 2, 1], [1, 1, 2, 2], [2, 1, 1, 2])  # 6 onto 4: balanced
    counts = torch.bincount(ancestors[1:, 0], minlength=6).double()  # particle 0's ancestor over the steps
    expected = (len(ancestors) - 1) / 6
    assert ((counts - expected).abs() < 4 * math.sqrt(expected)).all(), counts
    assert all(sorted(row.tolist()) == list(range(6)) for row in ancestors[1:50])  # each parent once


def test_mixture_density_equals_a_loop(float64):
    torch.manual_seed(2)
    z = torch.randn(K, T)
    got = mixture_log_density(z[:, 1:], z[:, 0], GUIDE_LOC[1:], COEFFICIENT, GUIDE_SCALE[1:])
    assert torch.allclose(got, chain_log_q(z)[:, 1:], rtol=0, atol=1e-12)


def test_tmc_estimate_equals_brute_force_with_the_mixture_density(float64):
    pyro.set_rng_seed(3)
    draw = TMC_ELBO(num_samples=K, max_plate_nesting=1).draw(model, chain_guide, X)
    z = particles_of(draw)
    assert torch.allclose(draw.log_estimate(), brute_force(z, X, chain_log_q(z)), rtol=0, atol=1e-10)


def test_particles_follow_their_ancestors(float64):
    """Each step's particles are the step before's, moved a little: each parent used once (K equal)."""
    pyro.set_rng_seed(4)
    proposal = ChainProposal(
        torch.tensor([-5.0, 0.0, 5.0]), torch.zeros(50), torch.ones(50), 0.01 * torch.ones(50)
    )
    z = proposal.sample(torch.Size([3]))  # (3, 50): three walks that stay near -5, 0 and 5
    assert all(sorted(z[:, t].round().tolist()) == [-5.0, 0.0, 5.0] for t in range(50))
    assert (z.sort(0).values.diff(dim=-1).abs() < 0.1).all()


def test_unbiased_on_the_linear_gaussian_chain(float64):
    """E[P_TMC] = p(x) with the chain proposal: the mean of P_TMC / p(x) is 1 within 4 standard errors."""
    pyro.set_rng_seed(5)
    elbo = TMC_ELBO(num_samples=K, max_plate_nesting=1)
    exact = exact_log_evidence(X)
    ratios = torch.stack(
        [(elbo.draw(model, chain_guide, X).log_estimate() - exact).exp() for _ in range(1500)]
    )
    error = ratios.std() / math.sqrt(len(ratios))
    assert abs(ratios.mean() - 1) < 4 * error
    assert error < 0.05  # the test can fail: a 5% bias would show


def test_gradients_reach_every_parameter(float64):
    pyro.set_rng_seed(6)
    params = [GUIDE_LOC.clone().requires_grad_(), COEFFICIENT.clone().requires_grad_()]

    def guide(x):
        first = pyro.sample("z_0", dist.Normal(params[0][0], GUIDE_SCALE[0]))
        with pyro.plate("time", T - 1, dim=-1):
            pyro.sample(CURRENT, ChainProposal(first.reshape(-1), params[0][1:], params[1], GUIDE_SCALE[1:]))

    TMC_ELBO(num_samples=K, max_plate_nesting=1).differentiable_loss(model, guide, X).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() and (p.grad != 0).all() for p in params)
