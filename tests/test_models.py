"""Self-checks of the analytic ground truths in ``tests/common/models.py`` (no pyro_tmc needed).

Each exact ``log p(x)`` is computed two independent ways (generic DAG covariance vs. a
closed form, 1-D quadrature or plain Monte Carlo), so the targets of the statistical
tests are right regardless of the code under test.
"""

import math

import numpy as np
import pytest
import torch

from tests.common import models as M

_trapezoid = getattr(np, "trapezoid", None) or np.trapz


@pytest.mark.parametrize("N", [1, 8, 128])
def test_toy_log_px_three_ways(N):
    """Dense Cholesky, Sherman-Morrison, the generic DAG builder, and quadrature over
    theta (given theta the x_i are iid N(theta, 2)) all agree."""
    x = M.toy_data(N)
    a = M.toy_log_px(x)
    assert a == pytest.approx(M.toy_log_px_closed_form(x), abs=1e-9)
    mean, cov = M.toy_moments(N)
    assert a == pytest.approx(
        M.linear_gaussian_log_marginal(x, np.arange(N + 1, 2 * N + 1), mean, cov), abs=1e-9
    )
    theta = np.linspace(-12, 12, 200001)
    log_integrand = -0.5 * (math.log(2 * math.pi) + theta**2) + (
        -0.5 * (math.log(4 * math.pi) + (x[:, None] - theta) ** 2 / 2.0)
    ).sum(0)
    c = log_integrand.max()
    quad = c + math.log(_trapezoid(np.exp(log_integrand - c), theta))
    assert a == pytest.approx(quad, abs=1e-6)


def test_loopy_log_px():
    """Var(x) = Var(2 z1 + e2 + e3 + e4 + e_x) = 4 + 4 = 8; plus a 2e6-sample MC check."""
    assert M.loopy_log_px() == pytest.approx(M.gaussian_logpdf([M.LOOPY_X], 0.0, [[8.0]]), abs=1e-12)
    rng = np.random.default_rng(0)
    n = 2_000_000
    z1 = rng.normal(size=n)
    z3 = z1 + rng.normal(size=n)
    z4 = z1 + rng.normal(size=n) + rng.normal(size=n)
    w = np.exp(-0.5 * (M.LOOPY_X - z3 - z4) ** 2) / math.sqrt(2 * math.pi)
    se = w.std() / math.sqrt(n) / w.mean()
    assert abs(math.log(w.mean()) - M.loopy_log_px()) < 5 * se


def test_chain_log_px():
    """z_N is a sum of N increments of variance 1/N, so x ~ N(0, 2) for every N."""
    for N in (1, 100):
        mean, cov = M.chain_moments(N)
        assert cov[N, N] == pytest.approx(2.0)
        assert M.linear_gaussian_log_marginal([M.CHAIN_X], [N], mean, cov) == pytest.approx(
            M.chain_log_px(), abs=1e-10
        )
    assert M.chain_log_px() == pytest.approx(-0.5 * math.log(4 * math.pi) - M.CHAIN_X**2 / 4, abs=1e-12)


def test_nonfact_log_px():
    """x ~ N(0, 3): log N(2; 0, 3) = -2.1349."""
    assert M.nonfact_log_px() == pytest.approx(-0.5 * math.log(6 * math.pi) - 4.0 / 6.0, abs=1e-12)
    assert M.nonfact_log_px() == pytest.approx(-2.1349, abs=5e-5)


def test_discrete_log_px():
    def mix(var):
        return math.log(
            sum(
                p * math.exp(-0.5 * (M.MIX_X - m) ** 2 / var) / math.sqrt(2 * math.pi * var)
                for p, m in zip(M.MIX_PROBS, M.MIX_LOCS)
            )
        )

    assert M.discrete_log_px(with_z=False) == pytest.approx(mix(1.0), abs=1e-12)
    assert M.discrete_log_px(with_z=True) == pytest.approx(mix(2.0), abs=1e-12)


def test_weight_moments_finite():
    """The guides used by the unbiasedness tests have finite 4th weight moments, so the
    sample SE of P_TMC / p(x) is a consistent estimate of its spread."""
    for N in (8, 128):
        x = M.toy_data(N)
        mean, cov = M.toy_moments(N)
        _, post_cov = M.gaussian_posterior(x, np.arange(N + 1, 2 * N + 1), mean, cov)
        q_var = np.r_[1.0, np.full(N, 2.0)]
        assert M.importance_weight_moment_finite(np.linalg.inv(post_cov), q_var, 4)
    mean, cov = M.loopy_moments()
    _, post_cov = M.gaussian_posterior([M.LOOPY_X], [4], mean, cov)
    _, scales = M.loopy_guide_params()
    assert M.importance_weight_moment_finite(np.linalg.inv(post_cov), scales**2, 4)


def test_references_are_consistent():
    """The hand-written TMC references converge to log p(x) and are unbiased."""
    g = torch.Generator().manual_seed(0)
    x = M.toy_data(8)
    v = M.toy_tmc_reference(x, 8, R=4000, generator=g)
    r = torch.exp(v - M.toy_log_px(x))
    assert abs(r.mean().item() - 1) < 4 * r.std().item() / math.sqrt(len(r))
    v = M.toy_tmc_reference(x, 64, R=200, generator=g)  # Jensen gap ~0.1 here
    se = v.std().item() / math.sqrt(len(v))
    assert -4 * se - v.var().item() < v.mean().item() - M.toy_log_px(x) < 4 * se
    xc = torch.tensor(M.CHAIN_X, dtype=torch.float64)
    for proposal in ("mixture", "permutation", "diagonal", "factorised"):
        v = M.chain_tmc_reference(xc, 3, 32, R=2000, proposal=proposal, generator=g)
        r = torch.exp(v - M.chain_log_px())
        assert abs(r.mean().item() - 1) < 4 * r.std().item() / math.sqrt(len(r)), proposal
    for proposal in ("mixture", "permutation", "diagonal"):
        r = torch.exp(M.nonfact_tmc_reference(8, 20000, proposal, g) - M.nonfact_log_px())
        assert abs(r.mean().item() - 1) < 4 * r.std().item() / math.sqrt(len(r)), proposal
    r = torch.exp(M.loopy_tmc_reference(8, 20000, g) - M.loopy_log_px())
    assert abs(r.mean().item() - 1) < 4 * r.std().item() / math.sqrt(len(r))
    r = torch.exp(M.discrete_tmc_reference(4, 20000, g) - M.discrete_log_px(with_z=True))
    assert abs(r.mean().item() - 1) < 4 * r.std().item() / math.sqrt(len(r))
