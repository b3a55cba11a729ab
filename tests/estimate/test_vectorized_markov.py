"""Pyro's ``vectorized_markov`` chains under TMC (:mod:`pyro_tmc.estimate.vectorized_markov`).

Oracles: brute force over all K^T particle combinations on the very particles of a
draw (read from its traces), float64; the unrolled ``pyro.markov`` chain on the same
particles; the exact ``log p(x)`` of the linear-Gaussian chain (a multivariate normal)
for unbiasedness (4 measured standard errors).
"""

import itertools
import math
import re
import warnings

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro.infer.autoguide import AutoNormal
from pyro.ops.indexing import Vindex

from pyro_tmc import TMC_ELBO

funsor = pytest.importorskip("funsor")
from pyro.contrib.funsor import vectorized_markov  # noqa: E402

from tests.common.vectorized_chains import (  # noqa: E402
    CURRENT,
    GUIDE_LOC,
    GUIDE_SCALE,
    STEP_SCALE,
    K,
    T,
    X,
    brute_force,
    exact_log_evidence,
    guide,
    model,
    particles_of,
    unrolled_model,
)


def test_site_names_are_what_the_module_reads():
    """vectorized_markov's own naming, which pyro_tmc matches sites by."""
    trace = pyro.poutine.trace(model).get_trace(X)
    assert {"z_0", f"z_{slice(0, T - 1)}", CURRENT} <= set(trace.nodes)
    assert trace.nodes[f"z_{slice(0, T - 1)}"]["infer"].get("_do_not_score")


def test_estimate_equals_brute_force(float64):
    pyro.set_rng_seed(0)
    draw = TMC_ELBO(num_samples=K, max_plate_nesting=1).draw(model, guide, X)
    z = particles_of(draw)
    log_q = dist.Normal(GUIDE_LOC, GUIDE_SCALE).log_prob(z)
    expected = brute_force(z, X, log_q)
    assert torch.allclose(draw.log_estimate(), expected, rtol=0, atol=1e-10)


def test_one_particle_equals_brute_force(float64):
    """K=1: the chain's particle dims have size 1, which no factor holds (once a KeyError)."""
    pyro.set_rng_seed(0)
    draw = TMC_ELBO(num_samples=1, max_plate_nesting=1).draw(model, guide, X)
    z = particles_of(draw)
    log_q = dist.Normal(GUIDE_LOC, GUIDE_SCALE).log_prob(z)
    assert torch.allclose(draw.log_estimate(), brute_force(z, X, log_q), rtol=0, atol=1e-10)


def test_previous_steps_are_the_particles_of_the_step_before(float64):
    pyro.set_rng_seed(1)
    draw = TMC_ELBO(num_samples=K, max_plate_nesting=1).draw(model, guide, X)
    z = particles_of(draw)
    previous = draw.model_trace.nodes[f"z_{slice(0, T - 1)}"]["value"].reshape(K, T - 1)
    assert torch.equal(previous, z[:, :-1])


def test_estimate_equals_the_unrolled_chain_on_the_same_particles(float64):
    """The unrolled pyro.markov chain, its guide replaying the vectorised draw's particles."""
    pyro.set_rng_seed(2)
    draw = TMC_ELBO(num_samples=K, max_plate_nesting=1).draw(model, guide, X)
    z = particles_of(draw)

    def replaying_guide(x):
        for t in pyro.markov(range(T)):
            # K distinct points, each its own particle: a Normal whose draw we fix below
            pyro.sample(f"z_{t}", dist.Normal(GUIDE_LOC[t], GUIDE_SCALE[t]))

    unrolled = TMC_ELBO(num_samples=K, max_plate_nesting=1).draw(unrolled_model, replaying_guide, X)
    for t in range(T):  # the unrolled draw's particles: those of the vectorised draw
        site = unrolled.guide_trace.nodes[f"z_{t}"]
        assert site["value"].numel() == K
        site["value"].reshape(-1).copy_(z[:, t])
        unrolled.model_trace.nodes[f"z_{t}"]["value"].reshape(-1).copy_(z[:, t])
    log_q = dist.Normal(GUIDE_LOC, GUIDE_SCALE).log_prob(z)
    assert torch.allclose(unrolled.log_estimate(), brute_force(z, X, log_q), rtol=0, atol=1e-10)
    assert torch.allclose(draw.log_estimate(), unrolled.log_estimate(), rtol=0, atol=1e-10)


def test_autonormal_guide_equals_brute_force(float64):
    pyro.set_rng_seed(3)
    auto = AutoNormal(model)
    draw = TMC_ELBO(num_samples=K, max_plate_nesting=1).draw(model, auto, X)
    nodes = draw.guide_trace.nodes
    z = particles_of(draw)
    first_q = nodes["z_0_unconstrained"]["fn"]
    later_q = nodes[f"{CURRENT}_unconstrained"]["fn"]
    log_q = torch.cat(
        [first_q.log_prob(z[:, :1]).reshape(K, 1), later_q.log_prob(z[:, 1:]).reshape(K, T - 1)], dim=1
    )
    assert torch.allclose(draw.log_estimate(), brute_force(z, X, log_q), rtol=0, atol=1e-10)


def test_gradients_reach_the_guide(float64):
    pyro.set_rng_seed(4)
    auto = AutoNormal(model)
    loss = TMC_ELBO(num_samples=K, max_plate_nesting=1).differentiable_loss(model, auto, X)
    loss.backward()
    grads = {name: p.grad for name, p in pyro.get_param_store().named_parameters()}
    # the scored sites' parameters; those of the previous steps' own draw are unused
    used = [g for name, g in grads.items() if name.endswith(("z_0", CURRENT))]
    assert len(used) == 4
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in used)


def test_unbiased_on_the_linear_gaussian_chain(float64):
    """E[P_TMC] = p(x): the mean of P_TMC / p(x) over seeded draws is 1 within 4 standard errors."""
    pyro.set_rng_seed(5)
    elbo = TMC_ELBO(num_samples=K, max_plate_nesting=1)
    exact = exact_log_evidence(X)
    ratios = torch.stack([(elbo.draw(model, guide, X).log_estimate() - exact).exp() for _ in range(1500)])
    error = ratios.std() / math.sqrt(len(ratios))
    assert abs(ratios.mean() - 1) < 4 * error
    assert error < 0.05  # the test can fail: a 5% bias would show


def test_long_chain_runs_and_is_finite(float64):
    """T=200: the time dim is one stacked contraction, not 200 factors."""
    x = torch.linspace(-1.0, 1.0, 200)
    pyro.set_rng_seed(6)
    draw = TMC_ELBO(num_samples=8, max_plate_nesting=1).draw(model, AutoNormal(model), x)
    estimate = draw.log_estimate()
    assert torch.isfinite(estimate)
    assert len([f for f in draw.factors() if f.site.startswith("z_slice")]) <= 3


def test_guide_markov_in_time_is_refused(float64):
    def markov_guide(x):
        z_prev = torch.tensor(0.0)
        for t in vectorized_markov(name="time", size=x.shape[-1], dim=-1):
            z_prev = pyro.sample(f"z_{t}", dist.Normal(z_prev, 1.0))

    with pytest.raises(ValueError, match=re.escape(f"Guide site '{CURRENT}' depends on")):
        TMC_ELBO(num_samples=K, max_plate_nesting=1).loss(model, markov_guide, X)


def test_history_two_is_refused(float64):
    def model2(x):
        z1 = z2 = 0.0
        for t in vectorized_markov(name="time", size=x.shape[-1], dim=-1, history=2):
            z = pyro.sample(f"z_{t}", dist.Normal(z1 + z2, 1.0))
            pyro.sample(f"x_{t}", dist.Normal(z, 1.0), obs=x[t])
            z1, z2 = z, z1

    with pytest.raises(ValueError, match="history > 1"):
        TMC_ELBO(num_samples=K, max_plate_nesting=1).loss(model2, AutoNormal(model2), X)


def test_compiled_graph_equals_eager(float64):
    """TMC_ELBO(compile="graph") on the same draws: the same loss and gradients."""
    auto = AutoNormal(model)
    eager = TMC_ELBO(num_samples=K, max_plate_nesting=1)
    program = TMC_ELBO(num_samples=K, max_plate_nesting=1, compile="graph")
    for elbo in (eager, program):  # the first call validates (its probe draws too)
        elbo.loss(model, auto, X)
    params = [p for _, p in pyro.get_param_store().named_parameters()]
    for seed in range(3):
        results = []
        for elbo in (eager, program):
            pyro.set_rng_seed(seed)
            loss = elbo.differentiable_loss(model, auto, X)
            results.append((loss, torch.autograd.grad(loss, params, allow_unused=True)))
        (loss_e, grads_e), (loss_p, grads_p) = results
        assert torch.allclose(loss_e, loss_p, rtol=0, atol=1e-10)
        for g_e, g_p in zip(grads_e, grads_p):
            assert (g_e is None) == (g_p is None)
            assert g_e is None or torch.allclose(g_e, g_p, rtol=0, atol=1e-10)


# -- an HMM whose states are summed exactly ---------------------------------------------

HMM_INIT = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
HMM_TRANS = torch.tensor([[0.8, 0.1, 0.1], [0.2, 0.7, 0.1], [0.1, 0.3, 0.6]], dtype=torch.float64)
HMM_LOCS = torch.tensor([-1.0, 0.5, 2.0], dtype=torch.float64)
HMM_X = torch.tensor([0.1, -0.9, 1.8, 2.2, 0.4], dtype=torch.float64)


def hmm_model(x):
    """z_t ~ Categorical(trans[z_{t-1}]), x_t ~ N(locs[z_t], 1), z enumerated."""
    z_prev = None
    for t in vectorized_markov(name="time", size=x.shape[-1], dim=-1):
        probs = HMM_INIT if z_prev is None else Vindex(HMM_TRANS)[..., z_prev, :]
        z = pyro.sample(f"z_{t}", dist.Categorical(probs), infer={"enumerate": "parallel"})
        pyro.sample(f"x_{t}", dist.Normal(Vindex(HMM_LOCS)[..., z], 1.0), obs=x[t])
        z_prev = z


def forward_algorithm(x: torch.Tensor) -> torch.Tensor:
    """log p(x) of the HMM, exactly."""
    emission = dist.Normal(HMM_LOCS, 1.0)
    alpha = HMM_INIT.log() + emission.log_prob(x[0])
    for t in range(1, x.shape[-1]):
        alpha = torch.logsumexp(alpha[:, None] + HMM_TRANS.log(), 0) + emission.log_prob(x[t])
    return torch.logsumexp(alpha, 0)


def test_enumerated_hmm_is_exact(float64):
    """Every state summed exactly: the estimate is log p(x), the forward algorithm's."""
    draw = TMC_ELBO(num_samples=K, max_plate_nesting=1).draw(hmm_model, lambda x: None, HMM_X)
    assert torch.allclose(draw.log_estimate(), forward_algorithm(HMM_X), rtol=0, atol=1e-10)


# -- several sequences, and a latent per step that does not carry over ---------------------


def plated_model(x):
    """S sequences (a plate); per step, z carries over and w_t ~ N(z_t, 1) does not; x_t ~ N(w_t, 1)."""
    with pyro.plate("sequences", x.shape[0], dim=-2):
        z_prev = 0.0
        for t in vectorized_markov(name="time", size=x.shape[-1], dim=-1):
            z_curr = pyro.sample(f"z_{t}", dist.Normal(z_prev, STEP_SCALE))
            w = pyro.sample(f"w_{t}", dist.Normal(z_curr, 1.0))
            # t as a 1-d index: step 0 keeps its (size-1) time dim right of the plate
            pyro.sample(f"x_{t}", dist.Normal(w, 1.0), obs=x[..., torch.as_tensor(t).reshape(-1)])
            z_prev = z_curr


def test_plate_of_sequences_with_a_local_latent_equals_brute_force(float64):
    """Brute force per sequence over K^(2T) combinations (z and w per step), T=3, K=2."""
    x = torch.tensor([[0.4, -0.3, 1.1], [1.5, 0.2, -0.7]])
    num, length = 2, 3
    pyro.set_rng_seed(7)
    draw = TMC_ELBO(num_samples=num, max_plate_nesting=2).draw(plated_model, AutoNormal(plated_model), x)
    nodes = draw.guide_trace.nodes
    total = 0.0
    for s in range(x.shape[0]):
        z, w, log_q = [], [], []
        for name in ["0", str(slice(1, length))]:
            for var, out in (("z", z), ("w", w)):
                value = nodes[f"{var}_{name}"]["value"]
                q = nodes[f"{var}_{name}_unconstrained"]["fn"]
                lq = q.log_prob(value)
                value, lq = value.reshape(num, x.shape[0], -1)[:, s], lq.reshape(num, x.shape[0], -1)[:, s]
                out.append(value)
                log_q.append((var, lq))
        z, w = torch.cat(z, 1), torch.cat(w, 1)  # (K, T)
        lq_z = torch.cat([lq for var, lq in log_q if var == "z"], 1)
        lq_w = torch.cat([lq for var, lq in log_q if var == "w"], 1)
        terms = []
        for kz in itertools.product(range(num), repeat=length):
            for kw in itertools.product(range(num), repeat=length):
                zp = torch.stack([z[k, t] for t, k in enumerate(kz)])
                wp = torch.stack([w[k, t] for t, k in enumerate(kw)])
                prev = torch.cat([zp.new_zeros(1), zp[:-1]])
                lp = (
                    dist.Normal(prev, STEP_SCALE).log_prob(zp).sum()
                    + dist.Normal(zp, 1.0).log_prob(wp).sum()
                    + dist.Normal(wp, 1.0).log_prob(x[s]).sum()
                )
                lq = sum(lq_z[k, t] for t, k in enumerate(kz)) + sum(lq_w[k, t] for t, k in enumerate(kw))
                terms.append(lp - lq)
        total = total + torch.logsumexp(torch.stack(terms), 0) - 2 * length * math.log(num)
    assert torch.allclose(draw.log_estimate(), total, rtol=0, atol=1e-10)


def test_marginals_equal_brute_force(float64):
    """compute_marginals: each step's particle weights, from the brute-force posterior over K^T paths."""
    pyro.set_rng_seed(8)
    draw = TMC_ELBO(num_samples=K, max_plate_nesting=1).draw(model, guide, X)
    z = particles_of(draw)
    log_q = dist.Normal(GUIDE_LOC, GUIDE_SCALE).log_prob(z)
    paths = list(itertools.product(range(K), repeat=T))
    log_w = torch.stack(
        [brute_force(z[list(ks), range(T)][None], X, log_q[list(ks), range(T)][None]) for ks in paths]
    )
    weights = (log_w - log_w.logsumexp(0)).exp()
    expected = torch.zeros(K, T)
    for w, ks in zip(weights, paths):
        expected[list(ks), range(T)] += w
    marginals = draw.marginals()
    assert f"z_{slice(0, T - 1)}" not in marginals
    first = marginals["z_0"].log_weights.exp().reshape(K)
    later = marginals[CURRENT].log_weights.exp().reshape(T - 1, K).T
    assert torch.allclose(torch.cat([first[:, None], later], 1), expected, rtol=0, atol=1e-10)


def test_sample_posterior_refuses_by_name(float64):
    draw = TMC_ELBO(num_samples=K, max_plate_nesting=1).draw(model, guide, X)
    with pytest.raises(NotImplementedError, match=re.escape(CURRENT)):
        draw.sample(5)


def test_a_chained_latent_sampled_by_the_model_is_refused(float64):
    with pytest.raises(ValueError, match=re.escape(f"Site '{CURRENT}'") + ".*sampled by the model"):
        TMC_ELBO(num_samples=K, max_plate_nesting=1).loss(model, lambda x: None, X)


def test_predictive_log_likelihood_refuses_by_name(float64):
    from pyro_tmc.infer.predictive import predictive_log_likelihood

    site = f"z_{slice(1, HMM_X.shape[-1])}"
    with pytest.raises(NotImplementedError, match=re.escape(f"site '{site}' is a vectorized_markov chain")):
        predictive_log_likelihood(hmm_model, {"unused": torch.zeros(2)}, HMM_X, max_plate_nesting=1)


def param_guide(x):
    """The factorised guide with learnable parameters (a captured step's inputs)."""
    loc = pyro.param("loc", lambda: torch.zeros(x.shape[-1]))
    scale = pyro.param("scale", lambda: torch.ones(x.shape[-1]), constraint=dist.constraints.positive)
    for t in vectorized_markov(name="time", size=x.shape[-1], dim=-1):
        pyro.sample(f"z_{t}", dist.Normal(loc[t], scale[t]))


def test_captured_whole_step_equals_eager_step(float64):
    """compile="graph": the replayed whole step, on the eager step's draws, gives its loss and gradients."""
    pyro.set_rng_seed(9)
    loss = TMC_ELBO(num_samples=K, max_plate_nesting=1, compile="graph")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to eager
        for _ in range(2):  # eager, then captured
            loss.loss_and_grads(model, param_guide, X)
        params = {name: p for name, p in pyro.get_param_store().named_parameters()}
        for p in params.values():
            p.grad = None
        state = torch.get_rng_state()
        replayed = loss.loss_and_grads(model, param_guide, X)
        replayed_grads = {name: p.grad.clone() for name, p in params.items()}
    assert loss.step_program.replays == 1
    for p in params.values():
        p.grad = None
    torch.set_rng_state(state)
    eager = loss._eager_loss_and_grads(model, param_guide, (X,), {})
    assert replayed == pytest.approx(eager, rel=1e-10)
    for name, p in params.items():
        assert torch.allclose(replayed_grads[name], p.grad, rtol=1e-8, atol=1e-10), name
