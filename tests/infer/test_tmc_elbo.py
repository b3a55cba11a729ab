"""TMC_ELBO against independent oracles: brute force over all K^n combinations,
exact enumeration (TraceEnum_ELBO), closed-form marginals, and SVI."""

import itertools
import math

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.infer import SVI, TraceEnum_ELBO
from pyro.ops.indexing import Vindex

from pyro_tmc import TMC_ELBO
from pyro_tmc.poutine import tmc

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def empty_guide(*args, **kwargs):
    pass


# ---------------------------------------------------------------------------
# Brute force: the contraction equals the explicit average over all K^n combinations.
# ---------------------------------------------------------------------------

X_OBS = torch.tensor(0.7)


def chain_model():
    z0 = pyro.sample("z0", dist.Normal(0.0, 1.0))
    z1 = pyro.sample("z1", dist.Normal(z0, 1.0))
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    pyro.sample("x", dist.Normal(z1 + w, 1.0), obs=X_OBS)


def chain_guide():
    z0 = pyro.sample("z0", dist.Normal(0.3, 1.1))
    pyro.sample("z1", dist.Normal(0.5 * z0 + 0.1, 0.8))
    pyro.sample("w", dist.Normal(-0.2, 0.9))


def _proposal_log_density(strategy, z0, z1, k1):
    """log q(z1^{k1}) indexed by k1 alone, by hand."""
    cond = dist.Normal(0.5 * z0 + 0.1, 0.8)
    if strategy == "diagonal":
        return cond.log_prob(z1[k1])[k1]
    return torch.logsumexp(cond.log_prob(z1[k1]), 0) - math.log(len(z0))


@pytest.mark.parametrize("strategy", ["mixture", "permutation", "diagonal"])
def test_contraction_equals_brute_force(strategy):
    pyro.set_rng_seed(0)
    K = 3
    elbo = TMC_ELBO(num_samples=K, max_plate_nesting=0, proposal=strategy)
    draw = elbo.draw(chain_model, chain_guide)
    guide_trace = draw.guide_trace
    estimate = draw.log_estimate()

    z0, z1, w = (guide_trace.nodes[n]["value"].reshape(-1) for n in ("z0", "z1", "w"))
    terms = []
    for k0, k1, kw in itertools.product(range(K), repeat=3):
        log_p = (
            dist.Normal(0.0, 1.0).log_prob(z0[k0])
            + dist.Normal(z0[k0], 1.0).log_prob(z1[k1])
            + dist.Normal(0.0, 1.0).log_prob(w[kw])
            + dist.Normal(z1[k1] + w[kw], 1.0).log_prob(X_OBS)
        )
        log_q = (
            dist.Normal(0.3, 1.1).log_prob(z0[k0])
            + _proposal_log_density(strategy, z0, z1, k1)
            + dist.Normal(-0.2, 0.9).log_prob(w[kw])
        )
        terms.append(log_p - log_q)
    brute = torch.logsumexp(torch.stack(terms), 0) - 3 * math.log(K)
    assert torch.allclose(estimate, brute, atol=1e-5), (estimate, brute)


def _vector_chain_model():
    z0 = pyro.sample("z0", dist.Normal(torch.zeros(1), 1.0).to_event(1))
    z1 = pyro.sample("z1", dist.Normal(z0, 1.0).to_event(1))
    pyro.sample("x", dist.Normal(z1, 1.0).to_event(1), obs=X_OBS.reshape(1))


def _vector_chain_guide():
    z0 = pyro.sample("z0", dist.Normal(torch.full((1,), 0.3), 1.1).to_event(1))
    pyro.sample("z1", dist.Normal(0.5 * z0 + 0.1, 0.8).to_event(1))


def _scalar_chain_model():
    z0 = pyro.sample("z0", dist.Normal(0.0, 1.0))
    z1 = pyro.sample("z1", dist.Normal(z0, 1.0))
    pyro.sample("x", dist.Normal(z1, 1.0), obs=X_OBS)


def _scalar_chain_guide():
    z0 = pyro.sample("z0", dist.Normal(0.3, 1.1))
    pyro.sample("z1", dist.Normal(0.5 * z0 + 0.1, 0.8))


@pytest.mark.parametrize("strategy", ["mixture", "permutation", "diagonal"])
def test_event_dims_match_scalar_sites(strategy):
    """The same non-factorised chain with `.to_event(1)` over one unit:
    identical draws, identical estimate."""
    estimates = []
    for model, guide in (
        (_vector_chain_model, _vector_chain_guide),
        (_scalar_chain_model, _scalar_chain_guide),
    ):
        pyro.set_rng_seed(9)
        estimates.append(
            TMC_ELBO(num_samples=6, max_plate_nesting=0, proposal=strategy).log_evidence(model, guide)
        )
    assert torch.allclose(estimates[0], estimates[1], atol=1e-5)


def test_thin_sampling_draws_k_particles_only():
    """A non-factorised site's particles carry no parent dims: K draws, not K x K_parent."""
    with tmc(num_samples=5, first_available_dim=-1):
        trace = poutine.trace(chain_guide).get_trace()
    z1 = trace.nodes["z1"]
    assert z1["value"].shape == (5, 1)  # its own dim (-2), none for z0 (-1)
    assert z1["infer"]["_tmc_draw"].thin_fn is not None
    assert z1["infer"]["_tmc_draw"].parent_dims == (-1,)


def test_handler_default_places_particles_left_of_plates():
    def guide():
        with pyro.plate("data", 3):
            pyro.sample("z", dist.Normal(0.0, 1.0))

    with tmc(num_samples=7):
        trace = poutine.trace(guide).get_trace()
    value = trace.nodes["z"]["value"]
    assert value.shape[0] == 7 and value.shape[-1] == 3 and value.dim() == 5


# ---------------------------------------------------------------------------
# Exact marginalisation: equal to TraceEnum_ELBO when everything is enumerated.
# ---------------------------------------------------------------------------


def hmm(data):
    probs = torch.tensor([[0.7, 0.3], [0.2, 0.8]])
    locs = torch.tensor([-1.0, 1.0])
    with pyro.plate("sequences", data.shape[1], dim=-1):
        z = 0
        for t in pyro.markov(range(data.shape[0])):
            z = pyro.sample(f"z_{t}", dist.Categorical(probs[z]), infer={"enumerate": "parallel"})
            pyro.sample(f"x_{t}", dist.Normal(locs[z], 1.0), obs=data[t])


@pytest.mark.parametrize("length", [1, 5, 100, 1000])
def test_enumerated_hmm_equals_traceenum(length):
    pyro.set_rng_seed(1)
    data = torch.randn(length, 3)
    exact = -TraceEnum_ELBO(max_plate_nesting=1).loss(hmm, empty_guide, data)
    estimate = TMC_ELBO(max_plate_nesting=1).log_evidence(hmm, empty_guide, data)
    assert estimate.item() == pytest.approx(exact, rel=1e-5)


# ---------------------------------------------------------------------------
# A mixture model: one enumerated site, several sampled ones, closed-form p(x).
# ---------------------------------------------------------------------------

MIX_X = torch.tensor([-2.0, -1.5, 2.0, 2.5, 0.1])
MIX_PRIOR_SCALE = 2.0
MIX_NOISE = 0.8


def mixture_model(x):
    locs = pyro.sample("locs", dist.Normal(0.0, MIX_PRIOR_SCALE).expand([2]).to_event(1))
    with pyro.plate("data", len(x)):
        c = pyro.sample("c", dist.Categorical(torch.ones(2) / 2), infer={"enumerate": "parallel"})
        pyro.sample("x", dist.Normal(Vindex(locs)[..., c], MIX_NOISE), obs=x)


def mixture_guide(x):
    pyro.sample("locs", dist.Normal(torch.tensor([-1.5, 1.5]), 1.5).to_event(1))


def mixture_log_evidence(x):
    """log p(x) = log mean over the 2^n assignments of N(x; 0, s^2 [c_i == c_j] + noise^2 I)."""
    n = len(x)
    terms = []
    for c in itertools.product(range(2), repeat=n):
        c = torch.tensor(c)
        same = (c[:, None] == c[None, :]).double()
        cov = MIX_PRIOR_SCALE**2 * same + MIX_NOISE**2 * torch.eye(n, dtype=torch.float64)
        mvn = torch.distributions.MultivariateNormal(torch.zeros(n, dtype=torch.float64), cov)
        terms.append(mvn.log_prob(x.double()))
    return (torch.logsumexp(torch.stack(terms), 0) - n * math.log(2)).item()


def test_mixture_unbiased_against_closed_form():
    pyro.set_rng_seed(2)
    truth = mixture_log_evidence(MIX_X)
    elbo = TMC_ELBO(num_samples=32, max_plate_nesting=1)
    log_p = torch.stack([elbo.log_evidence(mixture_model, mixture_guide, MIX_X) for _ in range(400)])
    ratio = torch.exp(log_p.double() - truth)  # P_TMC / p(x): mean 1 if unbiased
    se = ratio.std() / math.sqrt(len(ratio))
    assert abs(ratio.mean() - 1) < 4 * se, (ratio.mean(), se)


# ---------------------------------------------------------------------------
# Gradients: exp(-loss) has an unbiased gradient for p(x), reparameterised or not.
# ---------------------------------------------------------------------------


def _mean_grad_of_p_hat(model, guide, param_name, elbo, repeats):
    grads = []
    for _ in range(repeats):
        pyro.clear_param_store()
        loss = elbo.differentiable_loss(model, guide)
        param = pyro.param(param_name).unconstrained()
        (grad,) = torch.autograd.grad(torch.exp(-loss), [param])
        grads.append(grad)
    grads = torch.stack(grads)
    return grads.mean(), grads.std() / math.sqrt(repeats)


def test_gradient_unbiased_reparameterised():
    """z ~ N(mu, 1), x ~ N(z, 1): p(x) = N(x; mu, 2), d p(x)/d mu = p(x) (x - mu) / 2."""
    x, mu0 = 1.3, 0.4

    def model():
        mu = pyro.param("mu", torch.tensor(mu0))
        z = pyro.sample("z", dist.Normal(mu, 1.0))
        pyro.sample("x", dist.Normal(z, 1.0), obs=torch.tensor(x))

    def guide():
        pyro.sample("z", dist.Normal(0.0, 1.5))

    pyro.set_rng_seed(3)
    mean, se = _mean_grad_of_p_hat(model, guide, "mu", TMC_ELBO(num_samples=4, max_plate_nesting=0), 2000)
    p = math.exp(dist.Normal(mu0, math.sqrt(2)).log_prob(torch.tensor(x)).item())
    assert abs(mean.item() - p * (x - mu0) / 2) < 4 * se.item()


def test_gradient_unbiased_score_function():
    """b ~ Bernoulli(sigmoid(t)) drawn from the prior (not reparameterisable), x ~ N(2b, 1)."""
    x, t0 = 1.2, -0.3

    def model():
        t = pyro.param("t", torch.tensor(t0))
        b = pyro.sample("b", dist.Bernoulli(logits=t))
        pyro.sample("x", dist.Normal(2.0 * b, 1.0), obs=torch.tensor(x))

    pyro.set_rng_seed(4)
    mean, se = _mean_grad_of_p_hat(
        model, empty_guide, "t", TMC_ELBO(num_samples=3, max_plate_nesting=0), 3000
    )
    s = 1 / (1 + math.exp(-t0))
    n1, n0 = (math.exp(dist.Normal(m, 1.0).log_prob(torch.tensor(x)).item()) for m in (2.0, 0.0))
    exact = s * (1 - s) * (n1 - n0)  # d/dt [s n1 + (1 - s) n0]
    assert abs(mean.item() - exact) < 4 * se.item()
    assert se.item() > 0  # the score-function path is live


GUIDE_X, GUIDE_T0 = 1.5, -2.0  # x observed; the guide's logit, far from the posterior's 0.16


def _discrete_model():
    z = pyro.sample("z", dist.Bernoulli(0.3))
    pyro.sample("x", dist.Normal(2.0 * z, 1.0), obs=torch.tensor(GUIDE_X))


def _discrete_guide():
    t = pyro.param("t", torch.tensor(GUIDE_T0))
    pyro.sample("z", dist.Bernoulli(logits=t))


def _exact_bound_gradient(num_samples: int) -> float:
    """
    d/dt E[log P_TMC], the expectation taken exactly: over all 2^K particle values,
    each weighted by its probability under the guide.
    """
    t = torch.tensor(GUIDE_T0, dtype=torch.float64, requires_grad=True)
    q, prior = dist.Bernoulli(logits=t), dist.Bernoulli(torch.tensor(0.3, dtype=torch.float64))
    bound = 0.0
    for values in itertools.product([0.0, 1.0], repeat=num_samples):
        z = torch.tensor(values, dtype=torch.float64)
        log_w = prior.log_prob(z) + dist.Normal(2.0 * z, 1.0).log_prob(torch.tensor(GUIDE_X)) - q.log_prob(z)
        log_p_hat = torch.logsumexp(log_w, 0) - math.log(num_samples)
        bound = (
            bound
            + q.log_prob(z).sum().exp().detach() * log_p_hat
            + (q.log_prob(z).sum().exp() - q.log_prob(z).sum().exp().detach()) * log_p_hat.detach()
        )
    (grad,) = torch.autograd.grad(bound, [t])
    return grad.item()


@pytest.mark.parametrize(
    "num_samples, num_particles, vectorize", [(1, 1, False), (3, 1, False), (3, 4, True)]
)
def test_a_guide_that_is_not_reparameterised_gets_the_bound_gradient(num_samples, num_particles, vectorize):
    """
    A Bernoulli guide site: its parameter's gradient is unbiased for d E[log P_TMC] / dt,
    computed exactly over every particle value (at K = 1, the ELBO's, as Trace_ELBO's
    score-function gradient is). Before, the guide's density was stopped and the
    parameter got no gradient at all: a guide that is not reparameterised never trained.
    """
    repeats = {"num_particles": num_particles, "vectorize_particles": vectorize}
    elbo = TMC_ELBO(num_samples=num_samples, max_plate_nesting=0, **repeats)
    pyro.set_rng_seed(6)
    # vectorised, one estimate's score meets the other repetitions' bounds too: a noisier gradient
    mean, se = _mean_grad(elbo, 8000 if vectorize else 3000)
    exact = -_exact_bound_gradient(num_samples)  # the loss is minus the bound
    assert se > 0 and abs(mean - exact) < 4 * se, (mean, exact, se)
    assert abs(exact) > 6 * se  # the test can tell a gradient of 0 from the right one


def _mean_grad(elbo, repeats: int):
    grads = []
    for _ in range(repeats):
        pyro.clear_param_store()
        loss = elbo.differentiable_loss(_discrete_model, _discrete_guide)
        (grad,) = torch.autograd.grad(loss, [pyro.param("t").unconstrained()])
        grads.append(grad)
    grads = torch.stack(grads)
    return grads.mean().item(), (grads.std() / math.sqrt(repeats)).item()


# ---------------------------------------------------------------------------
# SVI reaches the analytic maximum-likelihood value.
# ---------------------------------------------------------------------------


def test_svi_reaches_maximum_likelihood():
    """z_i ~ N(mu, 1), x_i ~ N(z_i, 1): the ML estimate of mu is mean(x)."""
    pyro.set_rng_seed(5)
    x = torch.randn(8) * 2 + 1

    def model(x):
        mu = pyro.param("mu", torch.tensor(0.0))
        with pyro.plate("data", len(x)):
            z = pyro.sample("z", dist.Normal(mu, 1.0))
            pyro.sample("x", dist.Normal(z, 1.0), obs=x)

    def guide(x):
        loc = pyro.param("loc", torch.zeros(len(x)))
        scale = pyro.param("scale", torch.ones(len(x)), constraint=dist.constraints.positive)
        with pyro.plate("data", len(x)):
            pyro.sample("z", dist.Normal(loc, scale))

    pyro.clear_param_store()
    svi = SVI(
        model,
        guide,
        pyro.optim.ClippedAdam({"lr": 0.05, "lrd": 0.998}),
        TMC_ELBO(num_samples=16, max_plate_nesting=1),
    )
    trail = []
    for step in range(1500):
        svi.step(x)
        if step >= 1000:
            trail.append(pyro.param("mu").item())
    # Tolerance: the ML value's posterior sd is sqrt(2/8) = 0.5; the optimiser's
    # noise, averaged over 500 late iterates, was measured at ~0.01.
    assert abs(sum(trail) / len(trail) - x.mean().item()) < 0.05


# ---------------------------------------------------------------------------
# Plates: subsampling, vectorised repetitions.
# ---------------------------------------------------------------------------


def _local_model(x):
    with pyro.plate("data", len(x), subsample_size=4) as idx:
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("x", dist.Normal(z, 1.0), obs=x[idx])


def _posterior_guide(x):
    """The exact posterior of _local_model: every TMC weight equals p(x_i)."""
    with pyro.plate("data", len(x), subsample_size=4) as idx:
        pyro.sample("z", dist.Normal(x[idx] / 2, math.sqrt(0.5)))


def test_subsampled_plate_scales_local_evidence():
    pyro.set_rng_seed(6)
    x = torch.randn(12)
    # Fix the subsample by replaying the plate's indices (not z) into model and guide.
    subsample = poutine.Trace()
    subsample.add_node("data", **poutine.trace(_posterior_guide).get_trace(x).nodes["data"])
    idx = subsample.nodes["data"]["value"]
    guide = poutine.replay(_posterior_guide, trace=subsample)
    model = poutine.replay(_local_model, trace=subsample)
    estimate = TMC_ELBO(num_samples=5, max_plate_nesting=1).log_evidence(model, guide, x)
    exact = dist.Normal(0.0, math.sqrt(2)).log_prob(x[idx]).sum() * 12 / 4
    assert estimate.item() == pytest.approx(exact.item(), rel=1e-5)


def test_vectorized_particles_average_independent_estimates():
    """With the exact posterior as guide every estimate equals log p(x)."""
    pyro.set_rng_seed(7)
    x = torch.randn(4)

    def model(x):
        with pyro.plate("data", len(x)):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(z, 1.0), obs=x)

    def guide(x):
        with pyro.plate("data", len(x)):
            pyro.sample("z", dist.Normal(x / 2, math.sqrt(0.5)))

    exact = dist.Normal(0.0, math.sqrt(2)).log_prob(x).sum().item()
    for vectorize in (False, True):
        elbo = TMC_ELBO(num_samples=3, max_plate_nesting=1, num_particles=5, vectorize_particles=vectorize)
        assert elbo.loss(model, guide, x) == pytest.approx(-exact, rel=1e-5)


@requires_cuda
def test_cuda_matches_enumeration():
    data = torch.randn(20, 3, device="cuda")

    def cuda_hmm(data):
        probs = torch.tensor([[0.7, 0.3], [0.2, 0.8]], device="cuda")
        locs = torch.tensor([-1.0, 1.0], device="cuda")
        with pyro.plate("sequences", data.shape[1], dim=-1):
            z = 0
            for t in pyro.markov(range(data.shape[0])):
                z = pyro.sample(f"z_{t}", dist.Categorical(probs[z]), infer={"enumerate": "parallel"})
                pyro.sample(f"x_{t}", dist.Normal(locs[z], 1.0), obs=data[t])

    exact = -TraceEnum_ELBO(max_plate_nesting=1).loss(cuda_hmm, empty_guide, data)
    estimate = TMC_ELBO(max_plate_nesting=1).log_evidence(cuda_hmm, empty_guide, data)
    assert estimate.device.type == "cuda"
    assert estimate.item() == pytest.approx(exact, rel=1e-5)
