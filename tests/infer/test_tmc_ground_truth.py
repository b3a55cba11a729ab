"""Statistical ground-truth tests of ``pyro_tmc.TMC_ELBO`` on linear-Gaussian models.

Every target below is exact (``tests/common/models.py`` computes ``log p(x)`` from the joint
covariance).  Each test draws R independent estimates ``log P_TMC`` and measures its
own standard error (SE); tolerances are ``4 * SE`` (a 4-sigma band: a correct
implementation fails with probability < 1e-4 per assertion, and the seeds are fixed)
plus, where the claim is about ``E[log P_TMC]`` rather than ``E[P_TMC]``, an allowance
for the Jensen gap ``log p(x) - E[log P_TMC] >= 0``.  That allowance is taken as the
measured variance of ``log P_TMC``: for a near-lognormal estimator the gap is about
``Var[log P] / 2``, so ``Var[log P]`` leaves a factor two of headroom.

Unbiasedness (``E[P_TMC] = p(x)``) is tested on the ratio ``r = P_TMC / p(x)``:
``|mean(r) - 1| < 4 SE(r)``, with SE floored by the spread of a large vectorised sample
of a hand-written reference estimator (r is right-skewed, so a few hundred draws tend to
underestimate its SE); simulated with the references, this check had no false alarm
in 3000 runs per configuration (and 3-SE excursions at the normal rate, ~0.3%).

Calibration (hand-written references in ``tests/common/models.py``, float64) of what a correct
TMC gives, ``log p - E[log P]`` (sd of log P):
  toy N=128:  K=4: 22.7 (9.3), K=16: 3.5 (2.9), K=64: 1.0 (1.3); IWAE: 158, 133, 115.
  chain N=100, K=4: factorised 213 (60), prior+mixture 0.23 (0.93),
               prior+permutation 0.10 (0.31), prior+diagonal 84 (16).
  chain N=100, K=256: factorised 0.04 (0.38), prior+mixture 0.09 (0.29).
  non-factorised (d), K=512: mixture 0.001 (0.026), permutation 0.001 (0.025),
               diagonal 0.002 (0.075); Pyro TraceTMC_ELBO mixture: mean -2.158 (0.025).
"""

import math

import pytest
import torch

import pyro
import pyro.infer

from pyro_tmc import TMC_ELBO
from tests.common import models as M

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #
def draw_log_evidence(model, guide, *args, R, seed, **elbo_kwargs):
    """R independent draws of ``log P_TMC`` (float64 CPU tensor of shape (R,))."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    elbo = TMC_ELBO(**elbo_kwargs)
    vals = [float(elbo.log_evidence(model, guide, *args)) for _ in range(R)]
    return torch.tensor(vals, dtype=torch.float64)


def mean_se(v):
    v = torch.as_tensor(v, dtype=torch.float64)
    return v.mean().item(), (v.std() / math.sqrt(len(v))).item()


def assert_finite(v):
    assert torch.isfinite(torch.as_tensor(v)).all(), v


def assert_unbiased(log_p_hat, log_p, reference=None):
    """``E[P_TMC] = p(x)``: the ratio ``r = P_TMC / p(x)`` has mean 1 within 4 SE.

    ``r`` is right-skewed: a few hundred draws can miss its rare large values, which
    makes the sample SE too small exactly when the sample mean is too small.  So when
    a hand-written ``reference`` sample of the same estimator (thousands of vectorised
    draws) is given, SE is the larger of the measured one and ``sd_ref(r) / sqrt(R)``.
    Simulating this check with the references puts its false-alarm rate near 1e-4.
    """
    assert_finite(log_p_hat)
    r = torch.exp(log_p_hat - log_p)
    m, se = mean_se(r)
    if reference is not None:
        se = max(se, torch.exp(reference - log_p).std().item() / math.sqrt(len(r)))
    assert abs(m - 1.0) < 4 * se, f"mean P/p = {m:.4f} +- {se:.4f}"


def assert_log_close_below(log_p_hat, log_p, bias=0.0):
    """``E[log P_TMC]`` is at most ``log p`` (Jensen) and within the Jensen gap of it:
    ``-4 SE - Var[log P] - bias < mean - log p < 4 SE``."""
    assert_finite(log_p_hat)
    m, se = mean_se(log_p_hat)
    allowance = log_p_hat.var().item() + bias
    assert m - log_p < 4 * se, f"mean {m:.4f} +- {se:.4f} above truth {log_p:.4f}"
    assert m - log_p > -4 * se - allowance, (
        f"mean {m:.4f} +- {se:.4f}, truth {log_p:.4f}, allowance {allowance:.4f}"
    )


def assert_same_mean(a, b):
    """Two samples of the same estimator agree in mean within 4 combined SEs."""
    (ma, sa), (mb, sb) = mean_se(a), mean_se(b)
    assert abs(ma - mb) < 4 * math.hypot(sa, sb), f"{ma:.4f} +- {sa:.4f} vs {mb:.4f} +- {sb:.4f}"


# --------------------------------------------------------------------------- #
# (a) the paper's toy model (Fig. 2A): TMC vs ground truth vs IWAE
# --------------------------------------------------------------------------- #
TOY_N = 128
TOY_KS = (4, 16, 64)
TOY_R = 20  # SE of the mean log P: 2.1, 0.65, 0.29 nats at K = 4, 16, 64
_toy_cache = {}


def toy_tmc_draws(K):
    """Cached so the three toy tests share one set of draws per K."""
    if K not in _toy_cache:
        x = torch.tensor(M.toy_data(TOY_N))
        _toy_cache[K] = draw_log_evidence(
            M.toy_model, M.toy_guide, x, R=TOY_R, seed=K, num_samples=K, max_plate_nesting=1
        )
    return _toy_cache[K]


def toy_truth():
    return M.toy_log_px(M.toy_data(TOY_N))


@pytest.mark.parametrize("K", TOY_KS)
def test_toy_tmc_below_truth_and_matches_reference(K):
    """Jensen: E[log P_TMC] <= log p(x); and the draws have the mean of a hand-written
    TMC estimator with the same K (so the gap itself is the right size)."""
    v = toy_tmc_draws(K)
    assert_finite(v)
    m, se = mean_se(v)
    assert m < toy_truth() + 4 * se
    ref = M.toy_tmc_reference(M.toy_data(TOY_N), K, R=50, generator=torch.Generator().manual_seed(K))
    assert_same_mean(v, ref)


def test_toy_gap_shrinks_with_K():
    """The gap to log p(x) shrinks as K grows (22.7 -> 3.5 -> 1.0 nats, see calibration):
    strictly (beyond 4 combined SEs) from K=4 to 16 and 64; not significantly worse
    from 16 to 64 (that difference, 2.5 nats, is about 3.5 SE with R=20)."""
    stats = {K: mean_se(toy_tmc_draws(K)) for K in TOY_KS}
    (m4, s4), (m16, s16), (m64, s64) = (stats[K] for K in TOY_KS)
    assert m16 - m4 > 4 * math.hypot(s4, s16)
    assert m64 - m4 > 4 * math.hypot(s4, s64)
    assert m64 > m16 - 4 * math.hypot(s16, s64)
    truth = toy_truth()
    assert abs(m64 - truth) < abs(m4 - truth)


@pytest.mark.parametrize("K", TOY_KS)
def test_toy_iwae_far_below_tmc(K):
    """IWAE with K joint samples of (theta, z_1..z_N) from the same guide is >100 nats
    below TMC at every K here (paper Fig. 2A); assert a 50-nat margin beyond 4 SE."""
    iwae = M.toy_iwae_reference(M.toy_data(TOY_N), K, R=200, generator=torch.Generator().manual_seed(100 + K))
    (mt, st), (mi, si) = mean_se(toy_tmc_draws(K)), mean_se(iwae)
    assert mi < M.toy_log_px(M.toy_data(TOY_N)) + 4 * si  # IWAE is a bound too
    assert mt - mi > 50 + 4 * math.hypot(st, si)


@pytest.mark.parametrize(
    "K, theta_K, R",
    [
        (8, None, 400),  # sd(P/p) ~ 1.1, SE ~ 0.055
        (16, None, 300),  # sd ~ 0.7, SE ~ 0.04
        (8, 2, 400),  # per-site K: theta drawn twice, every z_i eight times; sd ~ 1.4
    ],
)
def test_toy_unbiased(K, theta_K, R):
    """E[P_TMC] = p(x) on a small toy model (N=8, where Var[P/p] is modest)."""
    x = torch.tensor(M.toy_data(8))
    guide = M.make_toy_guide(theta_num_samples=theta_K)
    v = draw_log_evidence(M.toy_model, guide, x, R=R, seed=K, num_samples=K, max_plate_nesting=1)
    ref = M.toy_tmc_reference(
        M.toy_data(8), K, R=4000, generator=torch.Generator().manual_seed(K), K_theta=theta_K
    )
    assert_unbiased(v, M.toy_log_px(M.toy_data(8)), ref)


def test_iwae_elbo_matches_hand_iwae():
    """The IWAE baseline of the API has the distribution of the hand-written IWAE."""
    from pyro_tmc import IWAE_ELBO

    x = torch.tensor(M.toy_data(TOY_N))
    pyro.set_rng_seed(0)
    elbo = IWAE_ELBO(num_samples=16, max_plate_nesting=1)
    v = torch.tensor([-float(elbo.loss(M.toy_model, M.toy_guide, x)) for _ in range(30)], dtype=torch.float64)
    ref = M.toy_iwae_reference(M.toy_data(TOY_N), 16, R=300, generator=torch.Generator().manual_seed(1))
    assert_same_mean(v, ref)


# --------------------------------------------------------------------------- #
# (b) the loopy graph of the paper's Fig. 1
# --------------------------------------------------------------------------- #
def test_loopy_unbiased():
    """Reference: at K=8 sd(P/p) ~ 0.35, so R=600 gives SE ~ 0.014."""
    x = torch.tensor(M.LOOPY_X)
    v = draw_log_evidence(
        M.loopy_model, M.make_loopy_guide(), x, R=600, seed=0, num_samples=8, max_plate_nesting=0
    )
    ref = M.loopy_tmc_reference(8, R=20000, generator=torch.Generator().manual_seed(0))
    assert_unbiased(v, M.loopy_log_px(), ref)


def test_loopy_converges_at_large_K():
    """At K=128 the reference gap is ~0.005 with sd(log P) ~ 0.08."""
    x = torch.tensor(M.LOOPY_X)
    v = draw_log_evidence(
        M.loopy_model, M.make_loopy_guide(), x, R=40, seed=1, num_samples=128, max_plate_nesting=0
    )
    assert_log_close_below(v, M.loopy_log_px())
    assert abs(v.mean().item() - M.loopy_log_px()) < 0.05


# --------------------------------------------------------------------------- #
# (c) the chain of the paper's Fig. 4: factorised vs non-factorised (prior) proposal
# --------------------------------------------------------------------------- #
CHAIN_N = 100
CHAIN_GUIDES = {"factorised": M.chain_guide_factorised, "prior": M.chain_guide_prior}


def chain_draws(guide_name, K, R, seed, proposal="mixture", N=CHAIN_N):
    x = torch.tensor(M.CHAIN_X)
    return draw_log_evidence(
        M.chain_model,
        CHAIN_GUIDES[guide_name],
        x,
        N,
        R=R,
        seed=seed,
        num_samples=K,
        max_plate_nesting=0,
        proposal=proposal,
    )


@pytest.mark.parametrize("guide_name", ["factorised", "prior"])
def test_chain_large_K_close_below_truth(guide_name):
    """At K=256 both proposals are within ~0.1 nat of log p(x) = log N(1; 0, 2)
    (reference gaps 0.04 and 0.09, sd(log P) 0.38 and 0.29)."""
    v = chain_draws(guide_name, K=256, R=16, seed=2)
    assert_log_close_below(v, M.chain_log_px(), bias=0.05)


def test_chain_prior_beats_factorised_at_small_K():
    """Paper Fig. 4: at K=4 the non-factorised (prior) proposal is close to the truth
    (gap 0.23) while the factorised one is hundreds of nats off (gap 213)."""
    fact = chain_draws("factorised", K=4, R=30, seed=3)
    prior = chain_draws("prior", K=4, R=30, seed=4)
    (mf, sf), (mp, sp) = mean_se(fact), mean_se(prior)
    assert mp - mf > 4 * math.hypot(sf, sp)
    assert mp - mf > 50
    assert_log_close_below(prior, M.chain_log_px())


@pytest.mark.parametrize(
    "guide_name, proposal",
    [("factorised", "mixture"), ("prior", "mixture"), ("prior", "permutation"), ("prior", "diagonal")],
)
def test_chain_matches_reference_at_K4(guide_name, proposal):
    """The whole distribution of log P_TMC, not just its limit: the mean agrees with a
    hand-written forward recursion using the same proposal scheme.  This separates
    the schemes sharply (gaps 0.10 permutation, 0.23 mixture, 84 diagonal)."""
    v = chain_draws(guide_name, K=4, R=30, seed=5, proposal=proposal)
    assert_finite(v)
    ref_proposal = "factorised" if guide_name == "factorised" else proposal
    ref = M.chain_tmc_reference(
        torch.tensor(M.CHAIN_X, dtype=torch.float64),
        CHAIN_N,
        4,
        R=1000,
        proposal=ref_proposal,
        generator=torch.Generator().manual_seed(6),
    )
    assert_same_mean(v, ref)


def test_chain_of_1000_latents_runs():
    """pyro.markov keeps a 1000-step chain tractable.  With the prior as proposal and
    K=4 the reference has gap 0.36, sd 1.1, so a correct draw lies far inside
    (log p - 30, log p + 10) (the upper side: P(P/p > e^10) < e^-10 by Markov)."""
    v = chain_draws("prior", K=4, R=2, seed=7, N=1000)
    assert_finite(v)
    assert (v > M.chain_log_px() - 30).all()
    assert (v < M.chain_log_px() + 10).all()


# --------------------------------------------------------------------------- #
# (d) non-factorised guide: pyro_tmc is unbiased, Pyro's TraceTMC_ELBO is not
# --------------------------------------------------------------------------- #
NONFACT_TRUTH = -2.1349


def test_nonfact_truth():
    assert abs(M.nonfact_log_px() - NONFACT_TRUTH) < 1e-4


@pytest.mark.parametrize("proposal", ["mixture", "permutation", "diagonal"])
def test_nonfact_guide_K512(proposal):
    """Mean log estimate within 4 SE + 0.003 (the reference Jensen gap is <= 0.002)."""
    x = torch.tensor(M.NONFACT_X)
    v = draw_log_evidence(
        M.nonfact_model,
        M.nonfact_guide,
        x,
        R=80,
        seed=8,
        num_samples=512,
        max_plate_nesting=0,
        proposal=proposal,
    )
    assert_finite(v)
    m, se = mean_se(v)
    assert abs(m - M.nonfact_log_px()) < 4 * se + 0.003, f"{m:.4f} +- {se:.4f}"


@pytest.mark.parametrize("proposal", ["mixture", "permutation", "diagonal"])
def test_nonfact_guide_unbiased_small_K(proposal):
    """E[P_TMC] = p(x) with a non-factorised guide (reference sd(P/p) at K=8: 0.2 for
    mixture/permutation, 0.78 for diagonal)."""
    x = torch.tensor(M.NONFACT_X)
    v = draw_log_evidence(
        M.nonfact_model,
        M.nonfact_guide,
        x,
        R=300,
        seed=9,
        num_samples=8,
        max_plate_nesting=0,
        proposal=proposal,
    )
    ref = M.nonfact_tmc_reference(8, R=20000, proposal=proposal, generator=torch.Generator().manual_seed(9))
    assert_unbiased(v, M.nonfact_log_px(), ref)


def test_pyro_trace_tmc_elbo_is_biased_for_nonfactorised_guide():
    """Documents the bug pyro_tmc fixes: Pyro's TraceTMC_ELBO (pyro-ppl 1.9.2) draws z1
    from the mixture over z0 particles but scores it with q(z1 | z0^a) for every pair
    (a, b) instead of the mixture density, so its estimate is biased: mean log P at
    K=512 is about -2.158 (sd 0.025) vs the truth -2.1349."""
    from pyro.infer import TraceTMC_ELBO, config_enumerate

    pyro.set_rng_seed(10)
    model = config_enumerate(M.nonfact_model, "parallel", num_samples=512, tmc="mixture")
    guide = config_enumerate(M.nonfact_guide, "parallel", num_samples=512, tmc="mixture")
    elbo = TraceTMC_ELBO(max_plate_nesting=0)
    x = torch.tensor(M.NONFACT_X)
    v = torch.tensor([-float(elbo.loss(model, guide, x)) for _ in range(120)], dtype=torch.float64)
    m, se = mean_se(v)
    assert m < -2.145
    assert M.nonfact_log_px() - m > 4 * se


# --------------------------------------------------------------------------- #
# (e) exact marginalisation of a discrete site
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("K", [1, 8])
def test_discrete_site_summed_exactly(K):
    """With c the only latent, summing it exactly makes P_TMC = p(x) with zero variance."""
    x = torch.tensor(M.MIX_X)
    v = draw_log_evidence(
        M.make_discrete_model(False), M.empty_guide, x, R=3, seed=11, num_samples=K, max_plate_nesting=0
    )
    assert torch.allclose(v, torch.full_like(v, M.discrete_log_px(with_z=False)), atol=1e-4)


def test_discrete_site_with_continuous_child_unbiased():
    """c summed exactly, z sampled (K=4) from the guide: E[P_TMC] = p(x)."""
    x = torch.tensor(M.MIX_X)
    v = draw_log_evidence(
        M.make_discrete_model(True), M.discrete_guide, x, R=300, seed=12, num_samples=4, max_plate_nesting=0
    )
    ref = M.discrete_tmc_reference(4, R=20000, generator=torch.Generator().manual_seed(12))
    assert_unbiased(v, M.discrete_log_px(with_z=True), ref)


# --------------------------------------------------------------------------- #
# CUDA variants
# --------------------------------------------------------------------------- #
@requires_cuda
def test_toy_cuda_matches_reference():
    x = torch.tensor(M.toy_data(TOY_N), device="cuda")
    v = draw_log_evidence(M.toy_model, M.toy_guide, x, R=TOY_R, seed=13, num_samples=64, max_plate_nesting=1)
    ref = M.toy_tmc_reference(M.toy_data(TOY_N), 64, R=50, generator=torch.Generator().manual_seed(14))
    assert_same_mean(v, ref)
    assert v.mean().item() < M.toy_log_px(M.toy_data(TOY_N)) + 4 * mean_se(v)[1]


@requires_cuda
@pytest.mark.parametrize("proposal", ["mixture", "permutation"])
def test_nonfact_guide_K512_cuda(proposal):
    x = torch.tensor(M.NONFACT_X, device="cuda")
    v = draw_log_evidence(
        M.nonfact_model,
        M.nonfact_guide,
        x,
        R=80,
        seed=15,
        num_samples=512,
        max_plate_nesting=0,
        proposal=proposal,
    )
    m, se = mean_se(v)
    assert abs(m - M.nonfact_log_px()) < 4 * se + 0.003
