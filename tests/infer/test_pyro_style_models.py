"""TMC_ELBO as a drop-in SVI loss for models and guides written the way Pyro users
write them (see ``pyro_style_models.py``): AutoGuides, enumerated HMMs with MAP
globals, LDA, a VAE, Gaussian mixtures.

Oracles, all independent of pyro_tmc:
* closed-form evidence of conjugate models: ``E[P_TMC] = p(x)``, checked as the mean of
  ``P_TMC / p(x)`` over seeded draws within 5 measured standard errors (each check
  also asserts that the SE is small enough for the test to have power);
* ``TraceEnum_ELBO``: with every local latent enumerated and every global a Delta
  site, ``P_TMC`` is deterministic and equals the exact enumerated joint, for any K;
* ``Trace_ELBO``: for a model whose only latents have Delta guides, both losses are
  ``-log p(x, z_MAP)``; and with K = 1 the TMC estimate is the single-sample ELBO;
* hand-written forward algorithm / brute-force sums over assignments.
"""

import math

import pytest
import torch

import pyro
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO, TraceEnum_ELBO
from pyro.infer.autoguide import (
    AutoDelta,
    AutoDiagonalNormal,
    AutoGuideList,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
    init_to_sample,
    init_to_value,
)

from pyro_tmc import TMC_ELBO
from tests.common import pyro_style_models as M


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Every tensor here is tiny: intra-op threads only add overhead (a 2x2 Cholesky took
    10 ms instead of 3 us with two threads on a loaded 2-core machine)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(autouse=True)
def fresh_param_store():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    yield
    pyro.clear_param_store()


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #
def log_evidence_draws(elbo, model, guide, args, num_draws):
    return torch.stack([elbo.log_evidence(model, guide, *args) for _ in range(num_draws)]).double()


def assert_unbiased(log_p_hat, log_px, max_se):
    """mean(P_hat / p(x)) == 1 within 5 SE measured from the draws; the SE must be
    below ``max_se`` (otherwise the check could not detect a bias)."""
    ratio = torch.exp(log_p_hat - log_px)
    mean = ratio.mean().item()
    se = (ratio.std() / math.sqrt(len(ratio))).item()
    assert math.isfinite(mean), log_p_hat
    assert abs(mean - 1.0) < 5 * se, f"biased: E[P_TMC]/p(x) = {mean:.4f} +- {se:.4f}"
    assert se < max_se, f"too noisy to test: E[P_TMC]/p(x) = {mean:.4f} +- {se:.4f}"


def run_svi(model, guide, elbo, args, num_steps, lr=0.05):
    svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), loss=elbo)
    losses = [svi.step(*args) for _ in range(num_steps)]
    assert all(math.isfinite(loss) for loss in losses), losses
    return losses


def loss_gradients(elbo, model, guide, args):
    """Gradients of ``elbo.differentiable_loss`` w.r.t. every (unconstrained) parameter."""
    loss = elbo.differentiable_loss(model, guide, *args)
    named = list(pyro.get_param_store().named_parameters())
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {name: torch.zeros_like(p) if g is None else g for (name, p), g in zip(named, grads)}


def assert_matches_traceenum(model, guide, args, max_plate_nesting, num_samples):
    """TMC loss and gradients == TraceEnum_ELBO's with the same (Delta) guide."""
    exact_elbo = TraceEnum_ELBO(max_plate_nesting=max_plate_nesting)
    tmc_elbo = TMC_ELBO(num_samples=num_samples, max_plate_nesting=max_plate_nesting)
    exact = exact_elbo.loss(model, guide, *args)  # also initialises the guide's parameters
    assert math.isfinite(exact)
    assert tmc_elbo.loss(model, guide, *args) == pytest.approx(exact, rel=1e-5)
    exact_grads = loss_gradients(exact_elbo, model, guide, args)
    tmc_grads = loss_gradients(tmc_elbo, model, guide, args)
    assert exact_grads.keys() == tmc_grads.keys() and exact_grads
    for name, g in exact_grads.items():
        tol = 1e-4 * (1.0 + g.abs().max().item())
        assert torch.allclose(tmc_grads[name], g, rtol=1e-4, atol=tol), (name, tmc_grads[name], g)


# --------------------------------------------------------------------------- #
# A. AutoGuides on conjugate models
# --------------------------------------------------------------------------- #
NORMAL_X = torch.tensor([0.4, -1.1, 1.6])
LOGNORMAL_X = torch.tensor([1.8, 2.6, 1.2])
MVN_X = torch.tensor([[1.3, -0.2], [0.6, -0.9], [1.1, -0.4]])


def _conjugate_case(name):
    """(model, data, log p(x), a guide init value for z near the posterior, init_scale).

    The guides start slightly off the posterior mean and wider than the posterior
    (in unconstrained space), so the importance weights are bounded (finite variance)."""
    if name == "normal_plate":
        z0 = M.normal_plate_posterior_mean(NORMAL_X) + 0.3
        return M.normal_plate_model, NORMAL_X, M.normal_plate_log_evidence(NORMAL_X), z0, 1.0
    if name == "lognormal":  # posterior sd of log z: 0.28
        z0 = torch.tensor(math.exp(M.lognormal_posterior_log_mean(LOGNORMAL_X) + 0.1))
        return M.lognormal_model, LOGNORMAL_X, M.lognormal_log_evidence(LOGNORMAL_X), z0, 0.5
    if name == "mvn":  # posterior covariance eigenvalues < 0.25
        z0 = M.mvn_posterior_mean(MVN_X) + torch.tensor([0.2, -0.2])
        return M.mvn_model, MVN_X, M.mvn_log_evidence(MVN_X), z0, 0.7
    raise ValueError(name)


GAUSSIAN_AUTOGUIDES = [AutoNormal, AutoDiagonalNormal, AutoMultivariateNormal, AutoLowRankMultivariateNormal]


def _make_gaussian_guide(guide_cls, model, z0, init_scale):
    if guide_cls is AutoLowRankMultivariateNormal:
        init_scale *= 1.5  # its covariance is >= init_scale^2 / 2 (plus a random low-rank part)
    return guide_cls(model, init_loc_fn=init_to_value(values={"z": z0}), init_scale=init_scale)


@pytest.mark.parametrize("case", ["normal_plate", "lognormal", "mvn"])
@pytest.mark.parametrize("guide_cls", GAUSSIAN_AUTOGUIDES, ids=lambda c: c.__name__)
def test_autoguide_unbiased(guide_cls, case):
    """E[P_TMC] = p(x): the auxiliary site (``z_unconstrained`` / ``_Auto..._latent``) is
    drawn K times and enters with -log q, the Delta site ``z`` it unpacks enters with
    -log_density (its log|Jacobian|, nonzero for the positive latent of ``lognormal``)."""
    model, x, log_px, z0, init_scale = _conjugate_case(case)
    guide = _make_gaussian_guide(guide_cls, model, z0, init_scale)
    elbo = TMC_ELBO(num_samples=8, max_plate_nesting=1)
    assert_unbiased(log_evidence_draws(elbo, model, guide, (x,), 400), log_px, max_se=0.06)


GL_X = torch.tensor([2.0, 2.6, 3.1, 1.7, 2.9, 3.4])


def _guide_list(mu0=None, local_mu=None):
    """AutoDelta on the global mu (at mu0 if given) + the hand-written local guide."""
    model = M.global_local_model
    init = {} if mu0 is None else {"init_loc_fn": init_to_value(values={"mu": torch.tensor(mu0)})}
    guide = AutoGuideList(model)
    guide.append(AutoDelta(poutine.block(model, expose=["mu"]), **init))
    guide.append(M.GlobalLocalLocalGuide(model, mu=local_mu))
    return guide


def _training_guide(kind):
    model = M.global_local_model
    if kind == "AutoGuideList":
        return _guide_list()
    return {
        "AutoNormal": AutoNormal,
        "AutoDiagonalNormal": AutoDiagonalNormal,
        "AutoMultivariateNormal": AutoMultivariateNormal,
        "AutoLowRankMultivariateNormal": AutoLowRankMultivariateNormal,
        "AutoDelta": AutoDelta,
    }[kind](model)


@pytest.mark.parametrize(
    "kind",
    [
        "AutoNormal",
        "AutoDiagonalNormal",
        "AutoMultivariateNormal",
        "AutoLowRankMultivariateNormal",
        "AutoDelta",
        "AutoGuideList",
    ],
)
def test_autoguide_svi_trains(kind):
    """SVI with TMC_ELBO runs and its loss goes down: the guides start at the prior
    median (mu = z = 0) while the posterior sits near mu = 2.5."""
    guide = _training_guide(kind)
    losses = run_svi(
        M.global_local_model, guide, TMC_ELBO(num_samples=8, max_plate_nesting=1), (GL_X,), 80, lr=0.1
    )
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < first - 1.0, (first, last)


def test_autonormal_svi_trains_constrained_latent():
    """A positive latent (exp transform, log-Jacobian in every weight) trains too."""
    guide = AutoNormal(M.lognormal_model, init_loc_fn=init_to_value(values={"z": torch.tensor(0.2)}))
    losses = run_svi(
        M.lognormal_model, guide, TMC_ELBO(num_samples=8, max_plate_nesting=1), (LOGNORMAL_X,), 80, lr=0.1
    )
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 1.0


@pytest.mark.parametrize("num_samples", [1, 5])
@pytest.mark.parametrize(
    "model, x",
    [(M.global_local_model, GL_X), (M.lognormal_model, LOGNORMAL_X)],
    ids=["global_local", "lognormal"],
)
def test_autodelta_equals_trace_elbo(model, x, num_samples):
    """Delta sites get no particles, so with every latent Delta-guided P_TMC is the single
    joint p(x, z_MAP) / delta(z_MAP): TMC loss == Trace_ELBO loss (and the gradients),
    == -log p(x, z_MAP) by hand."""
    guide = AutoDelta(model, init_loc_fn=init_to_sample)
    trace_elbo = Trace_ELBO()
    tmc_elbo = TMC_ELBO(num_samples=num_samples, max_plate_nesting=1)
    expected = trace_elbo.loss(model, guide, x)
    assert tmc_elbo.loss(model, guide, x) == pytest.approx(expected, rel=1e-6)

    values = guide.median(x)
    conditioned = poutine.trace(poutine.condition(model, data=values)).get_trace(x)
    assert expected == pytest.approx(-conditioned.log_prob_sum().item(), rel=1e-6)

    expected_grads = loss_gradients(trace_elbo, model, guide, (x,))
    tmc_grads = loss_gradients(tmc_elbo, model, guide, (x,))
    for name, g in expected_grads.items():
        assert torch.allclose(tmc_grads[name], g, rtol=1e-5, atol=1e-5), name

    losses = run_svi(model, guide, tmc_elbo, (x,), 20)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("num_samples", [1, 6])
def test_guide_list_exact_local_guide(num_samples):
    """AutoDelta on the global mu + the exact posterior of the locals given mu as a
    hand-written local guide: every weight p(x_i, z_i | mu) / q(z_i) equals p(x_i | mu), so
    log P_TMC = log N(mu; 0, 4) + sum_i log N(x_i; mu, 1.25) exactly, for any K."""
    mu0 = 1.7
    model = M.global_local_model
    guide = _guide_list(mu0, local_mu=mu0)
    estimate = TMC_ELBO(num_samples=num_samples, max_plate_nesting=1).log_evidence(model, guide, GL_X)
    assert estimate.item() == pytest.approx(M.global_local_log_joint(GL_X, mu0), rel=1e-5)


def test_guide_list_unbiased():
    """AutoDelta on mu (no particles) + a mean-field hand-written local guide (K particles
    per data point): E[P_TMC] = p(x, mu) = N(mu; 0, 4) prod_i N(x_i; mu, 1.25)."""
    mu0 = 2.3
    model = M.global_local_model
    guide = _guide_list(mu0)
    elbo = TMC_ELBO(num_samples=8, max_plate_nesting=1)
    draws = log_evidence_draws(elbo, model, guide, (GL_X,), 400)
    assert_unbiased(draws, M.global_local_log_joint(GL_X, mu0), max_se=0.06)


# --------------------------------------------------------------------------- #
# B. HMMs: hidden states enumerated, globals AutoDelta -> TMC == TraceEnum
# --------------------------------------------------------------------------- #
def _padded_data():
    torch.manual_seed(3)
    sequences = torch.randn(4, 6, 2) + torch.tensor([1.0, -1.0])
    lengths = torch.tensor([6, 3, 1, 5])
    for t in range(sequences.shape[1]):
        sequences[:, t][t >= lengths] = 0.0  # padding, as real data would have
    return sequences, lengths


def _hmm_case(name):
    """(model, args, names of the globals, max_plate_nesting)."""
    torch.manual_seed(1)
    if name == "categorical":
        return M.categorical_hmm, (torch.randint(4, (4, 7)),), {"init", "trans", "emit"}, 1
    if name == "categorical_long":
        return M.categorical_hmm, (torch.randint(4, (3, 40)),), {"init", "trans", "emit"}, 1
    if name == "factorial":
        return M.factorial_hmm, (2.0 * torch.randn(3, 6),), {"trans_w", "trans_x", "locs", "scale"}, 1
    if name == "second_order":
        return M.second_order_hmm, (torch.bernoulli(torch.full((3, 6, 2), 0.4)),), {"trans", "probs_y"}, 2
    if name == "padded":
        return M.padded_hmm, _padded_data(), {"trans", "locs", "noise"}, 2
    if name == "padded_subsampled":
        return M.padded_hmm, _padded_data() + (torch.tensor([0, 2, 3]),), {"trans", "locs", "noise"}, 2
    raise ValueError(name)


HMM_CASES = ["categorical", "categorical_long", "factorial", "second_order", "padded", "padded_subsampled"]


@pytest.mark.parametrize("num_samples", [1, 5])
@pytest.mark.parametrize("case", HMM_CASES)
def test_hmm_matches_traceenum(case, num_samples):
    """Every local latent enumerated, every global a Delta: P_TMC is the exact marginal
    likelihood times the globals' prior, as TraceEnum_ELBO computes it."""
    model, args, names, max_plate_nesting = _hmm_case(case)
    guide = M.globals_guide(model, names)
    assert_matches_traceenum(model, guide, args, max_plate_nesting, num_samples)


@pytest.mark.parametrize("batch", [None, torch.tensor([0, 2, 3])], ids=["full", "subsampled"])
def test_padded_hmm_matches_forward_algorithm(batch):
    """The masked padded HMM against a hand-written forward algorithm run on each
    sequence truncated to its length (subsampled plate scaled by N / B)."""
    sequences, lengths = _padded_data()
    guide = M.globals_guide(M.padded_hmm, {"trans", "locs", "noise"})
    loss = TMC_ELBO(num_samples=3, max_plate_nesting=2).loss(M.padded_hmm, guide, sequences, lengths, batch)
    g = guide.median(sequences, lengths, batch)
    expected = -M.padded_hmm_log_joint(sequences, lengths, g["trans"], g["locs"], g["noise"], batch)
    assert loss == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("case", HMM_CASES)
def test_hmm_svi(case):
    """A few SVI steps with TMC_ELBO: finite losses, and (the loss being deterministic here)
    lower at the end than at the start."""
    model, args, names, max_plate_nesting = _hmm_case(case)
    guide = M.globals_guide(model, names)
    losses = run_svi(model, guide, TMC_ELBO(num_samples=4, max_plate_nesting=max_plate_nesting), args, 10)
    assert losses[-1] < losses[0], losses


# --------------------------------------------------------------------------- #
# B. LDA: nested plates, word topics enumerated
# --------------------------------------------------------------------------- #
def _lda_words():
    torch.manual_seed(2)
    return torch.randint(5, (4, 3))  # 4 words in each of 3 documents, vocabulary 5


def _lda_guide(kind):
    if kind == "AutoDelta":
        return AutoDelta(poutine.block(M.lda_model, hide=["word_topics"]), init_loc_fn=init_to_sample)
    return M.lda_map_guide


@pytest.mark.parametrize("num_samples", [1, 4])
@pytest.mark.parametrize("kind", ["AutoDelta", "hand_map"])
def test_lda_matches_traceenum(kind, num_samples):
    """Topic-word and doc-topic globals Delta-guided, word topics enumerated: == TraceEnum."""
    assert_matches_traceenum(M.lda_model, _lda_guide(kind), (_lda_words(),), 2, num_samples)


@pytest.mark.parametrize("kind", ["AutoDelta", "hand_map", "dirichlet_docs"])
def test_lda_svi(kind):
    guide = M.lda_dirichlet_guide if kind == "dirichlet_docs" else _lda_guide(kind)
    losses = run_svi(M.lda_model, guide, TMC_ELBO(num_samples=4, max_plate_nesting=2), (_lda_words(),), 10)
    if kind != "dirichlet_docs":  # deterministic loss
        assert losses[-1] < losses[0], losses


def test_lda_dirichlet_doc_guide_unbiased():
    """Topic-words Delta, each document's topic mix drawn K times from a Dirichlet guide,
    word topics enumerated: E[P_TMC] = p(words, topic_words), the document mixes and the
    word topics integrated out by brute force over assignments (Dirichlet-multinomial)."""
    words = _lda_words()
    elbo = TMC_ELBO(num_samples=16, max_plate_nesting=2)
    draws = log_evidence_draws(elbo, M.lda_model, M.lda_dirichlet_guide, (words,), 300)
    topic_words = pyro.param("topic_words_map").detach()
    assert_unbiased(draws, M.lda_log_joint(words, topic_words), max_se=0.06)


# --------------------------------------------------------------------------- #
# B. A tiny VAE
# --------------------------------------------------------------------------- #
def _vae_and_data():
    pyro.set_rng_seed(4)
    images = torch.bernoulli(torch.full((16, 8), 0.3))
    return M.TinyVAE(), images


def test_vae_svi_runs():
    """SVI with TMC_ELBO updates the decoder (model) and the encoder (guide)."""
    vae, images = _vae_and_data()
    before = {n: p.detach().clone() for n, p in vae.named_parameters()}
    run_svi(vae.model, vae.guide, TMC_ELBO(num_samples=8, max_plate_nesting=1), (images,), 15, lr=1e-2)
    for name, p in vae.named_parameters():
        assert not torch.equal(p.detach(), before[name]), name


def _mean_and_se(values):
    values = torch.tensor(values, dtype=torch.float64)
    return values.mean().item(), (values.std() / math.sqrt(len(values))).item()


def test_vae_one_particle_is_the_elbo_in_expectation():
    """With K = 1, log P_TMC = log p(x, z) - log q(z) for one draw: the ELBO estimator."""
    vae, images = _vae_and_data()
    tmc = TMC_ELBO(num_samples=1, max_plate_nesting=1)
    trace = Trace_ELBO()
    tmc_mean, tmc_se = _mean_and_se([tmc.loss(vae.model, vae.guide, images) for _ in range(300)])
    elbo_mean, elbo_se = _mean_and_se([trace.loss(vae.model, vae.guide, images) for _ in range(300)])
    assert abs(tmc_mean - elbo_mean) < 5 * math.hypot(tmc_se, elbo_se), (tmc_mean, elbo_mean)


def test_vae_tmc_bound_above_elbo():
    """E[log P_TMC] with K = 16 >= the ELBO (each data point's factor is a K-sample
    importance average); the untrained encoder is far from the posterior, so strictly."""
    vae, images = _vae_and_data()
    tmc = TMC_ELBO(num_samples=16, max_plate_nesting=1)
    tmc_mean, tmc_se = _mean_and_se(
        [tmc.log_evidence(vae.model, vae.guide, images).item() for _ in range(100)]
    )
    elbo_mean, elbo_se = _mean_and_se([-Trace_ELBO().loss(vae.model, vae.guide, images) for _ in range(100)])
    assert tmc_mean - elbo_mean > 3 * math.hypot(tmc_se, elbo_se), (tmc_mean, elbo_mean)


# --------------------------------------------------------------------------- #
# B. Gaussian mixtures
# --------------------------------------------------------------------------- #
GMM_DATA = torch.tensor([-3.1, -2.4, -2.9, 0.2, 0.5, 3.3, 2.8, 3.9])


def _gmm_guide():
    return AutoDelta(
        poutine.block(M.gmm_model, expose=["weights", "scale", "locs"]), init_loc_fn=init_to_sample
    )


@pytest.mark.parametrize("num_samples", [1, 7])
def test_gmm_map_matches_traceenum(num_samples):
    """Weights, locations (in a components plate, indexed ``locs[assignment]``) and scale
    MAP, assignments enumerated: == TraceEnum."""
    assert_matches_traceenum(M.gmm_model, _gmm_guide(), (GMM_DATA,), 1, num_samples)


def test_gmm_map_svi():
    losses = run_svi(M.gmm_model, _gmm_guide(), TMC_ELBO(num_samples=4, max_plate_nesting=1), (GMM_DATA,), 20)
    assert losses[-1] < losses[0], losses


MIX_DATA = torch.tensor([-2.0, -1.5, 2.0, 2.5, 0.1])


def _gmm_sampled_locs_guide(init_scale):
    model = M.gmm_sampled_locs_model
    guide = AutoGuideList(model)
    guide.append(
        AutoDelta(
            poutine.block(model, expose=["weights"]),
            init_loc_fn=init_to_value(values={"weights": torch.tensor([0.35, 0.65])}),
        )
    )
    guide.append(
        AutoNormal(
            poutine.block(model, expose=["locs"]),
            init_loc_fn=init_to_value(values={"locs": torch.zeros(2)}),
            init_scale=init_scale,
        )
    )
    return guide


def test_gmm_sampled_locs_unbiased():
    """Weights MAP (Delta), locs drawn K times from AutoNormal, assignments summed:
    E[P_TMC] = p(x, weights), by brute force over the 2^n assignments. The guide
    N(0, 2.5^2) is wider than the prior N(0, 2^2), so the weights are bounded."""
    guide = _gmm_sampled_locs_guide(init_scale=2.5)
    elbo = TMC_ELBO(num_samples=32, max_plate_nesting=1)
    draws = log_evidence_draws(elbo, M.gmm_sampled_locs_model, guide, (MIX_DATA,), 400)
    weights = guide.median(MIX_DATA)["weights"].detach()
    assert torch.allclose(weights, torch.tensor([0.35, 0.65]))
    assert_unbiased(draws, M.gmm_sampled_locs_log_joint(MIX_DATA, weights), max_se=0.06)


def test_gmm_sampled_locs_svi():
    guide = _gmm_sampled_locs_guide(init_scale=1.0)
    losses = run_svi(
        M.gmm_sampled_locs_model, guide, TMC_ELBO(num_samples=8, max_plate_nesting=1), (MIX_DATA,), 40
    )
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, losses
