"""STL and DReGs for TMC and IWAE, against brute force over all K^n combinations,
against the plain gradient in expectation, and against the paper's DReGs surrogate."""

import math

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro.infer import RenyiELBO

from pyro_tmc import IWAE_ELBO, TMC_ELBO
from pyro_tmc.experiments.smc import smc_log_evidence
from tests.common.models import toy_guide, toy_log_px, toy_model

# ---------------------------------------------------------------------------
# Small models with factorised Gaussian guides, written twice: as Pyro programs,
# and as explicit log densities over broadcast particle tensors (brute force).
# Every guide site j is z_j = loc_j + exp(log_scale_j) * eps.
# ---------------------------------------------------------------------------

X_SINGLE = torch.tensor(1.3)
X_PLATE = torch.tensor([0.5, -1.0, 2.0])
X_CHAIN = torch.tensor(1.5)


class Problem:
    """A model and factorised guide; ``latents`` lists the brute-force latents (one per plate element)."""

    def __init__(self, name, model, guide, latents, log_joint, loc0, max_plate_nesting):
        self.name, self.model, self.guide = name, model, guide
        self.latents, self.log_joint, self.loc0 = latents, log_joint, loc0
        self.max_plate_nesting = max_plate_nesting

    def init_params(self):
        pyro.clear_param_store()
        pyro.param("loc", self.loc0.clone())
        pyro.param("log_scale", torch.full_like(self.loc0, -0.2))


def _single_model():
    z = pyro.sample("z", dist.Normal(0.0, 1.0))
    pyro.sample("x", dist.Normal(z, 1.0), obs=X_SINGLE)


def _single_guide():
    loc, log_scale = pyro.param("loc"), pyro.param("log_scale")
    pyro.sample("z", dist.Normal(loc[0], log_scale[0].exp()))


def _single_log_joint(z):
    (z,) = z
    return dist.Normal(0.0, 1.0).log_prob(z) + dist.Normal(z, 1.0).log_prob(X_SINGLE)


def _plate_model():
    theta = pyro.sample("theta", dist.Normal(0.0, 1.0))
    with pyro.plate("data", 3):
        z = pyro.sample("z", dist.Normal(theta, 1.0))
        pyro.sample("x", dist.Normal(z, 1.0), obs=X_PLATE)


def _plate_guide():
    loc, log_scale = pyro.param("loc"), pyro.param("log_scale")
    pyro.sample("theta", dist.Normal(loc[0], log_scale[0].exp()))
    with pyro.plate("data", 3):
        pyro.sample("z", dist.Normal(loc[1:], log_scale[1:].exp()))


def _plate_log_joint(z):
    theta, *zs = z
    total = dist.Normal(0.0, 1.0).log_prob(theta)
    for z_n, x_n in zip(zs, X_PLATE):
        total = total + dist.Normal(theta, 1.0).log_prob(z_n) + dist.Normal(z_n, 1.0).log_prob(x_n)
    return total


def _chain_model():
    z1 = pyro.sample("z1", dist.Normal(0.0, 1.0))
    z2 = pyro.sample("z2", dist.Normal(z1, 1.0))
    z3 = pyro.sample("z3", dist.Normal(z2, 1.0))
    pyro.sample("x", dist.Normal(z3, 1.0), obs=X_CHAIN)


def _chain_guide():
    loc, log_scale = pyro.param("loc"), pyro.param("log_scale")
    for i in range(3):
        pyro.sample(f"z{i + 1}", dist.Normal(loc[i], log_scale[i].exp()))


def _chain_log_joint(z):
    z1, z2, z3 = z
    return (
        dist.Normal(0.0, 1.0).log_prob(z1)
        + dist.Normal(z1, 1.0).log_prob(z2)
        + dist.Normal(z2, 1.0).log_prob(z3)
        + dist.Normal(z3, 1.0).log_prob(X_CHAIN)
    )


PROBLEMS = {
    "single": Problem(
        "single", _single_model, _single_guide, ["z"], _single_log_joint, torch.tensor([0.2]), 0
    ),
    "plate": Problem(
        "plate",
        _plate_model,
        _plate_guide,
        ["theta", "z0", "z1", "z2"],
        _plate_log_joint,
        torch.tensor([0.3, 0.0, -0.5, 0.8]),
        1,
    ),
    "chain": Problem(
        "chain",
        _chain_model,
        _chain_guide,
        ["z1", "z2", "z3"],
        _chain_log_joint,
        torch.tensor([0.2, 0.4, 0.9]),
        0,
    ),
}


def _particle_values(problem, elbo):
    """The particles of the guide's first run, per brute-force latent: shape (K,) each."""
    trace = elbo.draw(problem.model, problem.guide).guide_trace
    values = []
    for site in trace.nodes.values():
        if site["type"] == "sample" and not site["is_observed"] and "_tmc_draw" in site["infer"]:
            value = site["value"].detach()
            values.extend(value.reshape(value.shape[0], -1).T)  # one latent per plate element
    return values


def _broadcast(values):
    """Latent j's particles along dim j of an n-dim combination tensor (batched on the left)."""
    n = len(values)
    return [
        v.reshape(v.shape[:-1] + (1,) * j + (v.shape[-1],) + (1,) * (n - 1 - j)) for j, v in enumerate(values)
    ]


def _combination_log_weights(problem, z, log_q):
    """log w over all combinations, shape (R, K, ..., K), from particles and their log q, shape (R, n, K)."""
    n = z.shape[1]
    log_w = problem.log_joint(_broadcast([z[:, j] for j in range(n)]))
    return log_w - sum(_broadcast([log_q[:, j] for j in range(n)]))


def brute_force_gradients(problem, eps, loc, log_scale):
    """
    Guide-parameter gradients of log P_TMC by explicit sums over all K^n combinations:
    plain (total derivative), STL (path only), DReGs per particle
    (sum_{j,k} (m_j^k)^2 d log A_j^k/dz_j^k dz_j^k/dphi) and the paper's surrogate.

    :param eps: standard-normal noise, shape (R, n, K) for R independent draws.
    :param loc, log_scale: guide parameters, shape (n,).
    :returns: dict of estimator -> gradients of shape (R, 2n) (loc then log_scale).
    """
    R, n, K = eps.shape
    results = {}
    for estimator in ("plain", "stl", "dregs", "paper"):
        loc_r = loc.detach().expand(R, n).clone().requires_grad_()
        log_scale_r = log_scale.detach().expand(R, n).clone().requires_grad_()
        z = loc_r[..., None] + log_scale_r.exp()[..., None] * eps  # (R, n, K)
        q_loc, q_log_scale = (
            (loc_r, log_scale_r) if estimator == "plain" else (loc_r.detach(), log_scale_r.detach())
        )
        log_q = dist.Normal(q_loc[..., None], q_log_scale.exp()[..., None]).log_prob(z)
        log_w = _combination_log_weights(problem, z, log_q)
        flat = log_w.reshape(R, -1)
        if estimator in ("plain", "stl"):
            surrogate = torch.logsumexp(flat, -1).sum()
        elif estimator == "paper":
            ratio = torch.exp(torch.logsumexp(2 * flat, -1) - 2 * torch.logsumexp(flat, -1)).detach()
            surrogate = (0.5 * ratio * torch.logsumexp(2 * flat, -1)).sum()
        else:
            surrogate = 0.0
            log_total = torch.logsumexp(flat, -1).detach()
            for j in range(n):
                # d log A_j^k / d z_j^k: every other latent's particles held fixed.
                held = torch.stack([z[:, i] if i == j else z[:, i].detach() for i in range(n)], 1)
                held_log_q = dist.Normal(q_loc[..., None], q_log_scale.exp()[..., None]).log_prob(held)
                log_w_j = _combination_log_weights(problem, held, held_log_q)
                other = [d for d in range(1, n + 1) if d != j + 1]
                log_a = torch.logsumexp(log_w_j, dim=other) if other else log_w_j  # (R, K): A_j^k
                m = torch.exp(log_a.detach() - log_total[:, None])
                surrogate = surrogate + (m**2 * log_a).sum()
        grads = torch.autograd.grad(surrogate, [loc_r, log_scale_r])
        results[estimator] = torch.cat(grads, -1)
    return results


def our_gradients(problem, variance_reduction, num_samples, seed):
    """Guide-parameter gradients of log P_TMC from TMC_ELBO, and the noise its guide drew."""
    problem.init_params()
    elbo = TMC_ELBO(
        num_samples=num_samples,
        max_plate_nesting=problem.max_plate_nesting,
        variance_reduction=variance_reduction,
    )
    pyro.set_rng_seed(seed)
    loss = elbo.differentiable_loss(problem.model, problem.guide)
    params = [pyro.param("loc").unconstrained(), pyro.param("log_scale").unconstrained()]
    grads = torch.cat(torch.autograd.grad(-loss, params))
    pyro.set_rng_seed(seed)
    values = torch.stack(_particle_values(problem, elbo))  # (n, K)
    eps = (values - problem.loc0[:, None]) / torch.exp(torch.tensor(-0.2))
    return grads, eps


@pytest.mark.parametrize("problem", ["single", "plate", "chain"])
@pytest.mark.parametrize("variance_reduction", [None, "stl", "dregs"])
def test_gradients_equal_brute_force_formulas(problem, variance_reduction):
    problem = PROBLEMS[problem]
    grads, eps = our_gradients(problem, variance_reduction, num_samples=3, seed=11)
    brute = brute_force_gradients(problem, eps[None], problem.loc0, torch.full_like(problem.loc0, -0.2))
    expected = brute["plain" if variance_reduction is None else variance_reduction][0]
    assert torch.allclose(grads, expected, atol=1e-5), (grads, expected)


def test_dregs_equals_paper_surrogate_for_a_single_latent():
    problem = PROBLEMS["single"]
    grads, eps = our_gradients(problem, "dregs", num_samples=6, seed=12)
    brute = brute_force_gradients(problem, eps[None], problem.loc0, torch.full_like(problem.loc0, -0.2))
    assert torch.allclose(grads, brute["paper"][0], atol=1e-5)


@pytest.mark.parametrize("problem", ["plate", "chain"])
def test_dregs_unbiased_where_paper_surrogate_is_not(problem):
    """
    Over R = 20,000 draws (vectorised brute force, K = 3): the mean DReGs guide gradient
    agrees with the mean plain gradient (both unbiased for d E[log P_TMC]/d phi), within
    4 standard errors of the difference; the paper's surrogate misses it by more than 6.
    """
    problem = PROBLEMS[problem]
    torch.manual_seed(13)
    R, n, K = 20000, len(problem.latents), 3
    brute = brute_force_gradients(
        problem, torch.randn(R, n, K), problem.loc0, torch.full_like(problem.loc0, -0.2)
    )

    def z_scores(estimator):
        diff = brute[estimator] - brute["plain"]
        return diff.mean(0) / (diff.std(0) / math.sqrt(R))

    assert z_scores("dregs").abs().max() < 4
    assert z_scores("paper").abs().max() > 6


def test_dregs_agrees_with_plain_through_the_elbo():
    """The same check, fewer draws, through TMC_ELBO itself: tolerance 4 SE of the difference."""
    problem = PROBLEMS["plate"]
    diffs = []
    for seed in range(300):
        plain, _ = our_gradients(problem, None, 3, seed)
        dregs, _ = our_gradients(problem, "dregs", 3, seed + 10_000)
        diffs.append(dregs - plain)
    diffs = torch.stack(diffs)
    z = diffs.mean(0) / (diffs.std(0) / math.sqrt(len(diffs)))
    assert z.abs().max() < 4


@pytest.mark.parametrize("Elbo", [TMC_ELBO, IWAE_ELBO])
@pytest.mark.parametrize("variance_reduction", ["stl", "dregs"])
def test_path_gradients_vanish_at_the_exact_posterior(Elbo, variance_reduction):
    """One latent, q = p(z | x) = N(x/2, 1/2): every weight is p(x), so STL/DReGs gradients are 0."""
    problem = PROBLEMS["single"]
    pyro.clear_param_store()
    pyro.param("loc", X_SINGLE.reshape(1) / 2)
    pyro.param("log_scale", torch.tensor([0.5 * math.log(0.5)]))
    grads = {}
    for vr in (None, variance_reduction):
        elbo = Elbo(num_samples=8, max_plate_nesting=0, variance_reduction=vr)
        draws = []
        for _ in range(50):
            loss = elbo.differentiable_loss(problem.model, problem.guide)
            params = [pyro.param("loc").unconstrained(), pyro.param("log_scale").unconstrained()]
            draws.append(torch.cat(torch.autograd.grad(loss, params)))
        grads[vr] = torch.stack(draws)
    assert grads[variance_reduction].abs().max() < 1e-5
    assert grads[None].std(0).min() > 0.05  # the plain estimator is noisy there


@pytest.mark.parametrize("Elbo", [TMC_ELBO, IWAE_ELBO])
@pytest.mark.parametrize("variance_reduction", ["stl", "dregs"])
def test_path_gradients_refuse_discrete_guide_sites(Elbo, variance_reduction):
    def model():
        pyro.sample("b", dist.Bernoulli(0.3))

    def guide():
        pyro.sample("b", dist.Bernoulli(0.5))

    with pytest.raises(NotImplementedError, match="site 'b'"):
        Elbo(num_samples=4, max_plate_nesting=0, variance_reduction=variance_reduction).loss_and_grads(
            model, guide
        )


def test_dregs_refuses_non_factorised_guides():
    def model():
        z0 = pyro.sample("z0", dist.Normal(0.0, 1.0))
        pyro.sample("z1", dist.Normal(z0, 1.0))

    def guide():
        z0 = pyro.sample("z0", dist.Normal(0.0, 1.0))
        pyro.sample("z1", dist.Normal(z0, 1.0))

    with pytest.raises(NotImplementedError, match="site 'z1'.*stl"):
        TMC_ELBO(num_samples=4, max_plate_nesting=0, variance_reduction="dregs").loss_and_grads(model, guide)


def test_path_gradients_stable_for_large_k_and_extreme_weights():
    """
    K = 1000, five stacked latents, x far in the tail: the likelihood factor alone spans
    hundreds of nats across particles (weights near 1e-200 to 1e-500, whose squares no
    float holds), yet loss and gradients stay finite for every estimator.
    """

    def model():
        z = torch.tensor(0.0)
        for i in range(5):
            z = pyro.sample(f"z{i}", dist.Normal(z, 1.0))
        pyro.sample("x", dist.Normal(z, 1.0), obs=torch.tensor(40.0))

    def guide():
        loc = pyro.param("loc", torch.zeros(5))
        for i in range(5):
            pyro.sample(f"z{i}", dist.Normal(loc[i], 3.0))

    pyro.set_rng_seed(16)
    pyro.clear_param_store()
    for vr in (None, "stl", "dregs"):
        elbo = TMC_ELBO(num_samples=1000, max_plate_nesting=0, variance_reduction=vr)
        likelihood = elbo.draw(model, guide).factors()[-1].term
        assert likelihood.max() - likelihood.min() > 300 and likelihood.max() < -300
        loss = elbo.differentiable_loss(model, guide)
        (grad,) = torch.autograd.grad(loss, [pyro.param("loc").unconstrained()])
        assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_iwae_matches_renyi_alpha_zero(toy_x):
    """Means over 300 draws agree within 4 standard errors of their difference."""
    pyro.set_rng_seed(14)
    x = toy_x(16)
    model, guide = toy_model, toy_guide

    ours = torch.stack(
        [IWAE_ELBO(num_samples=8, max_plate_nesting=1).log_evidence(model, guide, x) for _ in range(300)]
    )
    renyi = torch.tensor(
        [
            -RenyiELBO(alpha=0, num_particles=8, vectorize_particles=True, max_plate_nesting=1).loss(
                model, guide, x
            )
            for _ in range(300)
        ]
    )
    se = math.sqrt(ours.var() / 300 + renyi.var() / 300)
    assert abs(ours.mean().item() - renyi.mean().item()) < 4 * se


def test_smc_estimate_is_unbiased(toy_x):
    """log-mean-exp of 4,000 SMC estimates against the exact log p(x), tolerance from its SE."""
    torch.manual_seed(15)
    x = toy_x(8)
    truth = toy_log_px(x)
    ratio = torch.exp(smc_log_evidence(x, num_particles=16, num_runs=4000).double() - truth)
    se = ratio.std() / math.sqrt(len(ratio))
    assert abs(ratio.mean() - 1) < 4 * se


@pytest.mark.parametrize("Elbo", [TMC_ELBO, IWAE_ELBO])
@pytest.mark.parametrize("variance_reduction", ["stl", "dregs"])
def test_model_parameters_take_the_plain_gradient(Elbo, variance_reduction):
    """With the same particles, STL/DReGs leave the model's parameter gradient as it was."""

    def model():
        mu = pyro.param("mu", torch.tensor(0.4))
        with pyro.plate("data", 3):
            z = pyro.sample("z", dist.Normal(mu * torch.ones(3), 1.0))
            pyro.sample("x", dist.Normal(z, 1.0), obs=X_PLATE)

    def guide():
        loc = pyro.param("loc", torch.zeros(3))
        with pyro.plate("data", 3):
            pyro.sample("z", dist.Normal(loc, 1.2))

    grads = []
    for vr in (None, variance_reduction):
        pyro.clear_param_store()
        pyro.set_rng_seed(17)
        loss = Elbo(num_samples=5, max_plate_nesting=1, variance_reduction=vr).differentiable_loss(
            model, guide
        )
        grads.append(torch.autograd.grad(loss, [pyro.param("mu").unconstrained()])[0])
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


def test_single_particle_is_plain_importance_sampling():
    """K = 1: log P_TMC is the log importance weight of one joint draw
    (a regression test for 0-dim factors)."""
    problem = PROBLEMS["plate"]
    problem.init_params()
    pyro.set_rng_seed(18)
    elbo = TMC_ELBO(num_samples=1, max_plate_nesting=1)
    estimate = elbo.log_evidence(problem.model, problem.guide)
    pyro.set_rng_seed(18)
    values = _particle_values(problem, elbo)
    z = torch.stack(values)[:, 0]
    log_q = dist.Normal(problem.loc0, torch.exp(torch.tensor(-0.2))).log_prob(z).sum()
    assert torch.allclose(estimate, problem.log_joint(list(z)) - log_q, atol=1e-5)
