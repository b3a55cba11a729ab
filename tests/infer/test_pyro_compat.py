"""TMC_ELBO on the Pyro features that its core tests do not reach, against independent oracles.

Oracles: Pyro's own ``Trace_ELBO`` / ``TraceEnum_ELBO`` (on models where they are exact
or estimate the same quantity), closed-form evidences, exact enumeration written out by
hand, and quadrature. Statistical checks compare a sample mean with the truth in units of
the standard error measured from the draws themselves (5 SE), on fixed seeds.
"""

import itertools
import math
import warnings

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.infer import Trace_ELBO, TraceEnum_ELBO, config_enumerate
from pyro.infer.autoguide import (
    AutoDelta,
    AutoDiagonalNormal,
    AutoIAFNormal,
    AutoMultivariateNormal,
    AutoNormal,
    init_to_value,
)
from pyro.ops.indexing import Vindex

from pyro_tmc import TMC_ELBO
from pyro_tmc.poutine import tmc

ENUM = {"enumerate": "parallel"}
NUM_SE = 5.0


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fresh_state():
    """Seed, empty param store, one torch thread (tiny tensors; avoids thread-pool stalls)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    yield
    pyro.clear_param_store()
    torch.set_num_threads(threads)


@pytest.fixture
def validation():
    with pyro.validation_enabled(True):
        yield


def empty_guide(*args, **kwargs):
    pass


def log_evidence_draws(elbo, model, guide, num_draws, *args):
    """``num_draws`` independent values of log P_TMC, in float64."""
    return torch.stack([elbo.log_evidence(model, guide, *args) for _ in range(num_draws)]).double()


def mean_and_se(values):
    values = torch.as_tensor(values, dtype=torch.float64)
    return values.mean().item(), (values.std() / math.sqrt(len(values))).item()


def assert_unbiased(log_p, log_truth, max_se=0.1):
    """
    E[P_TMC] = p(x): the mean of P_TMC / p(x) is 1 within NUM_SE standard errors.
    ``max_se`` (several times the SE measured for a correct estimator) keeps the
    check from passing on a noisy estimate.
    """
    mean, se = mean_and_se(torch.exp(log_p - log_truth))
    assert 0 < se < max_se, f"SE {se:.4f}"
    assert abs(mean - 1.0) < NUM_SE * se, f"mean ratio {mean:.4f}, SE {se:.4f}"


def close(actual, expected, tol=1e-5):
    return actual == pytest.approx(expected, rel=tol, abs=tol)


def normal_pdf(x, loc, scale):
    return math.exp(-0.5 * ((x - loc) / scale) ** 2) / (scale * math.sqrt(2 * math.pi))


def exception_chain(error):
    """The exception and everything it was raised from."""
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


# ---------------------------------------------------------------------------
# 1. A latent sampled after a pyro.markov loop gets a fresh particle dim.
# ---------------------------------------------------------------------------


def _site(name, kind, enum_probs):
    if kind == "enumerated":
        return pyro.sample(name, dist.Categorical(enum_probs), infer=ENUM)
    return pyro.sample(name, dist.Normal(0.0, 1.0))


@pytest.mark.parametrize("length", [1, 2])
@pytest.mark.parametrize("after", ["sampled", "enumerated"])
@pytest.mark.parametrize("loop", ["sampled", "enumerated"])
def test_latent_after_markov_loop_prior_only_loss_is_zero(loop, after, length):
    """
    No observations and the prior as proposal: a sampled site's factor is
    log p - log p - log K, summing to 1 over its K particles, and an enumerated
    site's prior sums to 1 over its support, so P_TMC = 1 and the loss is 0
    exactly, unless the site after the loop shares a particle dim with a loop site.
    """

    def model():
        for i in pyro.markov(range(length)):
            _site(f"w_{i}", loop, torch.tensor([0.3, 0.7]))
        _site("d", after, torch.tensor([0.2, 0.3, 0.5]))

    loss = TMC_ELBO(num_samples=4, max_plate_nesting=0).loss(model, lambda: None)
    assert abs(loss) < 1e-6


CHAIN_Y = torch.tensor(0.5)


def _markov_chain_then_latent():
    w = torch.tensor(0.0)
    for i in pyro.markov(range(2)):
        w = pyro.sample(f"w_{i}", dist.Normal(w, 1.0))
    d = pyro.sample("d", dist.Normal(w, 1.0))
    pyro.sample("y", dist.Normal(d, 1.0), obs=CHAIN_Y)


def test_latent_after_markov_loop_unbiased():
    """
    w_0 ~ N(0,1), w_1 ~ N(w_0,1) in a markov loop, then d ~ N(w_1,1), y ~ N(d,1):
    y ~ N(0, 4) in closed form, and E[P_TMC] = p(y).
    """
    elbo = TMC_ELBO(num_samples=4, max_plate_nesting=0)
    log_p = log_evidence_draws(elbo, _markov_chain_then_latent, lambda: None, 400)
    assert_unbiased(log_p, dist.Normal(0.0, 2.0).log_prob(CHAIN_Y).item())


HMM_INIT = torch.tensor([0.6, 0.4])
HMM_TRANS = torch.tensor([[0.7, 0.3], [0.2, 0.8]])
EMIT_PROBS = torch.tensor([[0.9, 0.1], [0.25, 0.75]])
EMIT_LOCS = torch.tensor([-1.0, 1.5])
LOOP_Y = 0.4


def _chain_prior_products(length):
    """(z_0..z_{T-1}, p(z_0..z_{T-1})) for every path of the 2-state chain."""
    for path in itertools.product(range(2), repeat=length):
        prob = HMM_INIT[path[0]].item()
        for prev, cur in zip(path, path[1:]):
            prob *= HMM_TRANS[prev, cur].item()
        yield path, prob


def _enumerated_loop(length):
    z = None
    for t in pyro.markov(range(length)):
        z = pyro.sample(f"z_{t}", dist.Categorical(HMM_INIT if z is None else HMM_TRANS[z]), infer=ENUM)
    return z


@pytest.mark.parametrize("depends_on_loop", [True, False])
@pytest.mark.parametrize("length", [1, 2, 3])
def test_enumerated_loop_then_enumerated_latent_exact(length, depends_on_loop):
    """
    Everything enumerated, so -log p(y) exactly; the oracle sums over all paths by
    hand (TraceEnum_ELBO itself gives the post-loop site the loop's dim and fails here).
    """

    def model():
        z = _enumerated_loop(length)
        probs = EMIT_PROBS[z] if depends_on_loop else EMIT_PROBS[0]
        d = pyro.sample("d", dist.Categorical(probs), infer=ENUM)
        pyro.sample("y", dist.Normal(EMIT_LOCS[d] + 0.5 * z, 1.0), obs=torch.tensor(LOOP_Y))

    evidence = 0.0
    for path, prob in _chain_prior_products(length):
        z = path[-1]
        row = EMIT_PROBS[z] if depends_on_loop else EMIT_PROBS[0]
        for d in range(2):
            evidence += prob * row[d].item() * normal_pdf(LOOP_Y, EMIT_LOCS[d].item() + 0.5 * z, 1.0)
    loss = TMC_ELBO(num_samples=4, max_plate_nesting=0).loss(model, empty_guide)
    assert close(loss, -math.log(evidence))


def test_enumerated_loop_then_sampled_latent_unbiased():
    """
    z_0, z_1 enumerated in a markov loop, then d ~ N(loc[z_1], 1) drawn from the
    prior, y ~ N(d, 1): p(y) = sum_z p(z_1) N(y; loc[z_1], sqrt 2), and E[P_TMC] = p(y).
    """

    def model():
        z = _enumerated_loop(2)
        d = pyro.sample("d", dist.Normal(EMIT_LOCS[z], 1.0))
        pyro.sample("y", dist.Normal(d, 1.0), obs=torch.tensor(LOOP_Y))

    evidence = sum(
        prob * normal_pdf(LOOP_Y, EMIT_LOCS[path[-1]].item(), math.sqrt(2.0))
        for path, prob in _chain_prior_products(2)
    )
    elbo = TMC_ELBO(num_samples=4, max_plate_nesting=0)
    assert_unbiased(log_evidence_draws(elbo, model, empty_guide, 400), math.log(evidence))


# ---------------------------------------------------------------------------
# 2. poutine.mask on an exactly summed site masks only what depends on it.
# ---------------------------------------------------------------------------

MASK_INIT = torch.tensor([0.5, 0.3, 0.2])
MASK_TRANS = torch.tensor([[0.7, 0.2, 0.1], [0.2, 0.6, 0.2], [0.1, 0.3, 0.6]])
MASK_LOCS = torch.tensor([-2.0, 0.0, 2.0])


def padded_hmm(data, lengths):
    with pyro.plate("sequences", data.shape[1], dim=-1):
        z = None
        for t in pyro.markov(range(data.shape[0])):
            with poutine.mask(mask=t < lengths):
                z = pyro.sample(
                    f"z_{t}", dist.Categorical(MASK_INIT if z is None else MASK_TRANS[z]), infer=ENUM
                )
                pyro.sample(f"x_{t}", dist.Normal(MASK_LOCS[z], 1.0), obs=data[t])


def _forward_log_evidence(data, lengths):
    """sum_n log p(x_n[:length_n]) by the forward algorithm, in float64."""
    total = 0.0
    log_trans = MASK_TRANS.double().log()
    for n in range(data.shape[1]):
        alpha = MASK_INIT.double().log()
        for t in range(int(lengths[n])):
            if t > 0:
                alpha = torch.logsumexp(alpha[:, None] + log_trans, 0)
            alpha = alpha + dist.Normal(MASK_LOCS.double(), 1.0).log_prob(data[t, n].double())
        total += torch.logsumexp(alpha, 0).item()
    return total


def test_mask_on_enumerated_site_padded_hmm():
    """
    Padded sequences with the padding masked: the masked states' priors still sum
    to 1, so the loss is -sum_n log p(x_n[:length_n]) (forward algorithm), which is
    also TraceEnum_ELBO's value (it masks only the costs downstream of enumeration).
    """
    data = torch.randn(6, 4) * 2
    lengths = torch.tensor([6, 3, 1, 4])
    exact = -_forward_log_evidence(data, lengths)
    oracle = TraceEnum_ELBO(max_plate_nesting=1).loss(padded_hmm, empty_guide, data, lengths)
    assert close(oracle, exact)
    loss = TMC_ELBO(num_samples=4, max_plate_nesting=1).loss(padded_hmm, empty_guide, data, lengths)
    assert close(loss, oracle)


def masked_mixture(x, mask):
    with pyro.plate("data", len(x)), poutine.mask(mask=mask):
        c = pyro.sample("c", dist.Categorical(MASK_INIT), infer=ENUM)
        pyro.sample("x", dist.Normal(MASK_LOCS[c], 1.0), obs=x)


def test_mask_on_enumerated_site_mixture():
    """A plate of mixtures, boolean mask: -sum over unmasked i of log sum_c w_c N(x_i; mu_c, 1)."""
    x = torch.randn(7) * 2
    mask = torch.tensor([True, False, True, True, False, False, True])
    per_point = torch.logsumexp(MASK_INIT.log() + dist.Normal(MASK_LOCS, 1.0).log_prob(x[:, None]), -1)
    exact = -per_point[mask].sum().item()
    oracle = TraceEnum_ELBO(max_plate_nesting=1).loss(masked_mixture, empty_guide, x, mask)
    assert close(oracle, exact)
    loss = TMC_ELBO(num_samples=4, max_plate_nesting=1).loss(masked_mixture, empty_guide, x, mask)
    assert close(loss, oracle)


# ---------------------------------------------------------------------------
# 3. Models without latent sites.
# ---------------------------------------------------------------------------

FREE_X = torch.tensor([0.3, -1.2, 2.0])


def observations_only():
    loc = pyro.param("loc", torch.tensor(0.5))
    with pyro.plate("data", 3):
        pyro.sample("x", dist.Normal(loc, 1.5), obs=FREE_X)
    pyro.sample("count", dist.Poisson(2.0), obs=torch.tensor(3.0))


def factors_only():
    pyro.factor("f", torch.tensor(-1.3))
    with pyro.plate("data", 3):
        pyro.factor("g", -(FREE_X**2))


def observations_and_factors():
    with pyro.plate("data", 3):
        pyro.sample("x", dist.Normal(0.0, 1.0), obs=FREE_X)
        pyro.factor("g", -FREE_X.abs())
    pyro.factor("f", torch.tensor(0.7))


LATENT_FREE = [observations_only, factors_only, observations_and_factors]


@pytest.mark.parametrize("max_plate_nesting", [1, float("inf")])
@pytest.mark.parametrize("model", LATENT_FREE, ids=lambda m: m.__name__)
def test_latent_free_model_equals_trace_elbo(model, max_plate_nesting):
    """Nothing to sample: P_TMC = p(x) exp(sum of factors), exactly Trace_ELBO's value."""
    expected = Trace_ELBO().loss(model, empty_guide)
    loss = TMC_ELBO(num_samples=4, max_plate_nesting=max_plate_nesting).loss(model, empty_guide)
    assert abs(loss - expected) < 1e-6


@pytest.mark.parametrize("variance_reduction", [None, "stl", "dregs"])
def test_latent_free_model_gradients_match_trace_elbo(variance_reduction):
    """loss_and_grads on a model without latents: Trace_ELBO's loss and parameter gradient."""
    expected = Trace_ELBO().loss_and_grads(observations_only, empty_guide)
    loc = pyro.param("loc").unconstrained()
    expected_grad = loc.grad.clone()
    loc.grad = None
    elbo = TMC_ELBO(num_samples=4, max_plate_nesting=1, variance_reduction=variance_reduction)
    loss = elbo.loss_and_grads(observations_only, empty_guide)
    assert abs(loss - expected) < 1e-6
    assert loc.grad is not None and close(loc.grad.item(), expected_grad.item(), 1e-6)


@pytest.mark.parametrize("model", LATENT_FREE, ids=lambda m: m.__name__)
def test_latent_free_model_posterior_readouts_are_empty(model):
    """No latent sites: the posterior read-outs have no sites, and do not crash."""
    elbo = TMC_ELBO(num_samples=4, max_plate_nesting=1)
    assert len(elbo.compute_marginals(model, empty_guide)) == 0
    assert len(elbo.sample_posterior(model, empty_guide, num_draws=3)) == 0


# ---------------------------------------------------------------------------
# 4. Guide sites marked for parallel enumeration are summed exactly, with a warning.
# ---------------------------------------------------------------------------

GE_WEIGHTS = torch.tensor([0.5, 0.3, 0.2])
GE_LOCS = torch.tensor([-2.0, 0.0, 2.0])
GE_X = torch.tensor([-1.7, 0.4, 2.2, 1.1])


def ge_model(x):
    with pyro.plate("data", len(x)):
        c = pyro.sample("assignment", dist.Categorical(GE_WEIGHTS))
        pyro.sample("x", dist.Normal(GE_LOCS[c], 1.0), obs=x)


def ge_guide(x):
    probs = torch.tensor([[0.8, 0.1, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8], [0.2, 0.3, 0.5]])
    with pyro.plate("data", len(x)):
        pyro.sample("assignment", dist.Categorical(probs))


def test_guide_enumerated_site_is_summed_exactly():
    """
    sum_z q(z) p(x, z) / q(z) = p(x): the loss is -log p(x), i.e. TraceEnum_ELBO with
    the site enumerated model-side and an empty guide (and the hand-written sum).
    """
    exact = -torch.logsumexp(GE_WEIGHTS.log() + dist.Normal(GE_LOCS, 1.0).log_prob(GE_X[:, None]), -1).sum()
    oracle = TraceEnum_ELBO(max_plate_nesting=1).loss(config_enumerate(ge_model), empty_guide, GE_X)
    assert close(oracle, exact.item())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        loss = TMC_ELBO(num_samples=4, max_plate_nesting=1).loss(ge_model, config_enumerate(ge_guide), GE_X)
    assert close(loss, oracle)


def test_guide_enumerated_site_warns_naming_site():
    """Exact summation of a guide site ignores the guide's probabilities: say so, naming the site."""
    with pytest.warns(UserWarning, match="assignment"):
        TMC_ELBO(num_samples=4, max_plate_nesting=1).loss(ge_model, config_enumerate(ge_guide), GE_X)


# ---------------------------------------------------------------------------
# 5. pyro.markov history shorter than the model's dependencies.
# ---------------------------------------------------------------------------

SHORT_P = torch.tensor([[0.7, 0.3], [0.2, 0.8]])


def _second_order_chain(history, enumerated=False):
    """x_t depends on x_{t-2}."""
    xs = [0, 0] if enumerated else [torch.tensor(0.0)] * 2
    for t in pyro.markov(range(4), history=history):
        if enumerated:
            xs.append(pyro.sample(f"x_{t}", dist.Categorical(SHORT_P[xs[-2]]), infer=ENUM))
        else:
            xs.append(pyro.sample(f"x_{t}", dist.Normal(xs[-2], 1.0)))
    return xs[-1]


def short_sampled_model():
    last = _second_order_chain(history=1)
    pyro.sample("y", dist.Normal(last, 1.0), obs=torch.tensor(0.3))


def short_enumerated_model():
    last = _second_order_chain(history=1, enumerated=True)
    pyro.sample("y", dist.Normal(last.float(), 1.0), obs=torch.tensor(0.3))


def short_plate_model():
    with pyro.plate("chains", 3):
        last = _second_order_chain(history=1)
        pyro.sample("y", dist.Normal(last, 1.0), obs=torch.zeros(3))


def long_enough_model():
    last = _second_order_chain(history=2)
    pyro.sample("y", dist.Normal(last, 1.0), obs=torch.tensor(0.3))


def short_guide():
    _second_order_chain(history=1)


SHORT_HISTORY_CASES = {
    "sampled": (short_sampled_model, empty_guide, 0),
    "enumerated": (short_enumerated_model, empty_guide, 0),
    "in_plate": (short_plate_model, empty_guide, 1),
    "guide": (long_enough_model, short_guide, 0),
}


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("case", sorted(SHORT_HISTORY_CASES))
def test_markov_history_too_short_raises(case, validate):
    """x_2 depends on x_0, which history=1 no longer keeps in scope: a clear error, validated or not."""
    model, guide, max_plate_nesting = SHORT_HISTORY_CASES[case]
    refused = pytest.raises(ValueError, match="Enumeration dim conflict")
    with pyro.validation_enabled(validate), refused as info:
        TMC_ELBO(num_samples=3, max_plate_nesting=max_plate_nesting).loss(model, guide)
    assert "x_2" in str(info.value)


# ---------------------------------------------------------------------------
# 6. compute_marginals of exactly summed sites.
# ---------------------------------------------------------------------------

CM_WEIGHTS = torch.tensor([0.5, 0.3, 0.2])
CM_LOCS = torch.tensor([-2.0, 0.0, 2.0])
CM_FLIP = torch.tensor([0.3, 0.6, 0.8])
CM_X = torch.tensor([-1.7, 0.4, 2.2, 1.1])


def cm_model(x):
    with pyro.plate("data", len(x)):
        c = pyro.sample("c", dist.Categorical(CM_WEIGHTS), infer=ENUM)
        b = pyro.sample("b", dist.Bernoulli(CM_FLIP[c]), infer=ENUM)
        pyro.sample("x", dist.Normal(CM_LOCS[c] + b, 1.0), obs=x)


def _moments(d):
    """Mean and variance of a discrete distribution, from its support and probabilities."""
    support = d.enumerate_support(expand=False).double()
    probs = d.log_prob(support).exp().double()
    mean = (probs * support).sum(0)
    return mean, (probs * support**2).sum(0) - mean**2


def _cm_posterior_by_hand():
    """Posterior (mean, variance) of c and of b per point, from the joint over (c, b) written out."""
    b = torch.arange(2.0, dtype=torch.float64)
    joint = (
        CM_WEIGHTS.double()[:, None]
        * torch.where(b == 1, CM_FLIP.double()[:, None], 1 - CM_FLIP.double()[:, None])
        * dist.Normal(CM_LOCS.double()[:, None] + b, 1.0).log_prob(CM_X.double()[:, None, None]).exp()
    )  # (N, c, b)
    joint = joint / joint.sum((-1, -2), keepdim=True)
    values = {"c": torch.arange(3.0, dtype=torch.float64), "b": b}
    probs = {"c": joint.sum(-1), "b": joint.sum(-2)}
    moments = {}
    for name, p in probs.items():
        mean = p @ values[name]
        moments[name] = (mean, p @ values[name] ** 2 - mean**2)
    return moments


def test_compute_marginals_of_enumerated_sites():
    """
    Enumerated sites have exact posterior marginals: mean and variance equal
    TraceEnum_ELBO.compute_marginals' (checked against the joint written out by hand).
    """
    by_hand = _cm_posterior_by_hand()
    oracle = TraceEnum_ELBO(max_plate_nesting=1).compute_marginals(cm_model, empty_guide, CM_X)
    marginals = TMC_ELBO(num_samples=4, max_plate_nesting=1).compute_marginals(cm_model, empty_guide, CM_X)
    for name in ("c", "b"):
        mean, variance = _moments(oracle[name])
        assert torch.allclose(mean, by_hand[name][0], atol=1e-5)
        assert torch.allclose(variance, by_hand[name][1], atol=1e-5)
        assert torch.allclose(marginals[name].mean.double(), mean, atol=1e-5), name
        assert torch.allclose(marginals[name].variance.double(), variance, atol=1e-5), name


# ---------------------------------------------------------------------------
# 7. pyro.factor in the guide enters log q.
# ---------------------------------------------------------------------------


def factor_model():
    z = pyro.sample("z", dist.Normal(0.0, 1.0))
    pyro.sample("x", dist.Normal(z, 1.0), obs=torch.tensor(0.9))


def factor_delta_guide():
    pyro.factor("guide_factor", torch.tensor(0.8), has_rsample=True)
    pyro.sample("z", dist.Delta(torch.tensor(0.3)))


def factor_free_model():
    with pyro.plate("p", 2):
        pyro.sample("x", dist.Normal(0.0, 1.0), obs=torch.tensor([0.9, -0.4]))


def factor_only_guide():
    with pyro.plate("p", 2):
        pyro.factor("guide_factor", torch.tensor([0.8, -0.2]), has_rsample=False)


@pytest.mark.parametrize("num_samples", [1, 3])
@pytest.mark.parametrize(
    "model, guide",
    [(factor_model, factor_delta_guide), (factor_free_model, factor_only_guide)],
    ids=["delta_guide", "latent_free"],
)
def test_guide_factor_enters_log_q(model, guide, num_samples):
    """A deterministic guide: log P_TMC = log p(x, z) - (guide factors), Trace_ELBO's value exactly."""
    expected = Trace_ELBO().loss(model, guide)
    loss = TMC_ELBO(num_samples=num_samples, max_plate_nesting=1).loss(model, guide)
    assert abs(loss - expected) < 1e-6


# ---------------------------------------------------------------------------
# 8. Delta guide sites get no particle dim of their own.
# ---------------------------------------------------------------------------

AD_X = torch.tensor([-1.7, 0.4, 2.2, 1.1, -0.3])


def ad_mixture(x):
    weights = pyro.sample("weights", dist.Dirichlet(torch.ones(3)))
    locs = pyro.sample("locs", dist.Normal(0.0, 3.0).expand([3]).to_event(1))
    with pyro.plate("data", len(x)):
        c = pyro.sample("c", dist.Categorical(weights), infer=ENUM)
        pyro.sample("x", dist.Normal(locs[c], 1.0), obs=x)


def ad_hmm(x):
    trans = pyro.sample("trans", dist.Dirichlet(torch.ones(2, 2)).to_event(1))
    locs = pyro.sample("locs", dist.Normal(0.0, 3.0).expand([2]).to_event(1))
    z = 0
    for t in pyro.markov(range(len(x))):
        z = pyro.sample(f"z_{t}", dist.Categorical(trans[z]), infer=ENUM)
        pyro.sample(f"x_{t}", dist.Normal(locs[z], 1.0), obs=x[t])


@pytest.mark.parametrize("num_samples", [1, 4])
@pytest.mark.parametrize(
    "model, globals_, max_plate_nesting",
    [(ad_mixture, ["weights", "locs"], 1), (ad_hmm, ["trans", "locs"], 0)],
    ids=["mixture", "hmm"],
)
def test_autodelta_with_enumerated_locals_matches_traceenum(model, globals_, max_plate_nesting, num_samples):
    """
    AutoDelta globals indexed by enumerated locals (probs[z], locs[c]): the guide is
    deterministic and the locals are summed, so the loss is TraceEnum_ELBO's, for any K.
    """
    guide = AutoDelta(poutine.block(model, expose=globals_))
    guide(AD_X)  # initialise
    expected = TraceEnum_ELBO(max_plate_nesting=max_plate_nesting).loss(model, guide, AD_X)
    loss = TMC_ELBO(num_samples=num_samples, max_plate_nesting=max_plate_nesting).loss(model, guide, AD_X)
    assert close(loss, expected)


def test_delta_site_has_no_particle_dim():
    """A Delta's value keeps only upstream particle dims; the next sampled site takes the next dim."""

    def guide():
        pyro.sample("g", dist.Delta(torch.tensor(1.5)))
        n = pyro.sample("n", dist.Normal(0.0, 1.0))
        pyro.sample("h", dist.Delta(2 * n))
        pyro.sample("m", dist.Normal(0.0, 1.0))

    with tmc(num_samples=5, first_available_dim=-2):
        trace = poutine.trace(guide).get_trace()
    shapes = {name: trace.nodes[name]["value"].shape for name in ("g", "n", "h", "m")}
    assert shapes == {"g": (), "n": (5, 1), "h": (5, 1), "m": (5, 1, 1)}


# ---------------------------------------------------------------------------
# 9. Auxiliary guide sites and Delta log densities (autoguides).
# ---------------------------------------------------------------------------

AUX_Y = torch.tensor(0.7)


def beta_model():
    phi = pyro.sample("phi", dist.Uniform(0.0, 1.0))
    pyro.sample("y", dist.Bernoulli(phi), obs=torch.tensor(1.0))


def loc_scale_model():
    loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
    scale = pyro.sample("scale", dist.LogNormal(0.0, 0.5))
    pyro.sample("y", dist.Normal(loc, scale), obs=AUX_Y)


def _loc_scale_evidence():
    """p(y) = int N(y; 0, sqrt(1 + s^2)) LogNormal(s; 0, 0.5) ds, over u = log s by quadrature."""
    integrate = pytest.importorskip("scipy.integrate")

    def integrand(u):
        return normal_pdf(u, 0.0, 0.5) * normal_pdf(AUX_Y.item(), 0.0, math.sqrt(1 + math.exp(2 * u)))

    return integrate.quad(integrand, -6.0, 6.0, epsabs=1e-13)[0]


def _aux_case(name):
    """(model, initialised autoguide, p(y)). Guide scales are wide enough for finite-variance weights."""
    if name == "AutoNormal":
        model = beta_model
        guide = AutoNormal(
            model, init_loc_fn=init_to_value(values={"phi": torch.tensor(0.5)}), init_scale=1.8
        )
        evidence = 0.5  # int_0^1 phi dphi
    else:
        model = loc_scale_model
        cls = {"AutoDiagonalNormal": AutoDiagonalNormal, "AutoMultivariateNormal": AutoMultivariateNormal}[
            name
        ]
        init = init_to_value(values={"loc": torch.tensor(0.0), "scale": torch.tensor(1.0)})
        guide = cls(model, init_loc_fn=init, init_scale=0.5)
        evidence = _loc_scale_evidence()
    guide()  # initialise
    return model, guide, evidence


AUX_GUIDES = ["AutoNormal", "AutoDiagonalNormal", "AutoMultivariateNormal"]


@pytest.mark.parametrize("name", AUX_GUIDES)
def test_autoguide_one_particle_matches_trace_elbo(name):
    """
    With K = 1, log P_TMC = log p(x, z) - log q(aux) - log_density(Delta), the same
    random variable as -Trace_ELBO().loss: their means agree within 5 combined SE.
    """
    model, guide, _ = _aux_case(name)
    num_draws = 300
    trace_elbo = [-Trace_ELBO().loss(model, guide) for _ in range(num_draws)]
    log_p = log_evidence_draws(TMC_ELBO(num_samples=1, max_plate_nesting=0), model, guide, num_draws)
    (m1, se1), (m2, se2) = mean_and_se(trace_elbo), mean_and_se(log_p)
    assert abs(m1 - m2) < NUM_SE * math.sqrt(se1**2 + se2**2), (m1, m2, se1, se2)


@pytest.mark.parametrize("name", AUX_GUIDES)
def test_autoguide_unbiased(name):
    """With K = 8, E[P_TMC] = p(y): 0.5 for the Beta-Bernoulli model, quadrature for the other."""
    model, guide, evidence = _aux_case(name)
    log_p = log_evidence_draws(TMC_ELBO(num_samples=8, max_plate_nesting=0), model, guide, 300)
    assert_unbiased(log_p, math.log(evidence), max_se=0.25)  # measured SE up to 0.06 over seeds


def test_a_flow_guide_is_not_inverted_at_each_step(monkeypatch):
    """
    An autoregressive flow's log density at its own sample comes from its transforms'
    caches, as under Trace_ELBO: inverting it costs one network pass per dimension.
    The particles reach log_prob as the very tensor the flow returned.
    """
    import importlib

    flow = importlib.import_module("pyro.distributions.transforms.affine_autoregressive")
    inversions = []
    invert = flow.AffineAutoregressive._inverse
    monkeypatch.setattr(
        flow.AffineAutoregressive, "_inverse", lambda self, y: (inversions.append(1), invert(self, y))[1]
    )

    def model(x):
        z = pyro.sample("z", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        pyro.sample("x", dist.Normal(z, 1.0).to_event(1), obs=x)

    pyro.clear_param_store()
    x, guide = torch.randn(3), AutoIAFNormal(model)
    elbo = TMC_ELBO(num_samples=4, max_plate_nesting=0)
    elbo.loss_and_grads(model, guide, x)  # the first step also runs the guide to set itself up
    inversions.clear()
    for _ in range(3):
        elbo.loss_and_grads(model, guide, x)
    assert not inversions


# ---------------------------------------------------------------------------
# 10. Validation warnings, as Pyro's ELBOs give them.
# ---------------------------------------------------------------------------


def test_model_guide_mismatch_warns(validation):
    """A non-auxiliary guide latent that the model lacks: Trace_ELBO warns, and so does TMC_ELBO."""

    def model():
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("x", dist.Normal(z, 1.0), obs=torch.tensor(0.2))

    def guide():
        pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("extra_latent", dist.Normal(0.0, 1.0))

    with pytest.warns(UserWarning, match="extra_latent"):
        Trace_ELBO().loss(model, guide)
    with pytest.warns(UserWarning, match="extra_latent"):
        TMC_ELBO(num_samples=3, max_plate_nesting=0).loss(model, guide)


def test_invalid_plate_dependency_warns(validation):
    """
    A site outside plate 'items' after an enumerated site inside it: TraceEnum_ELBO
    warns (a RuntimeWarning naming the site), and TMC_ELBO must too.
    """

    def model():
        with pyro.plate("items", 3):
            pyro.sample("c", dist.Bernoulli(0.4))
        pyro.sample("global_obs", dist.Normal(0.0, 1.0), obs=torch.tensor(1.0))  # checked by order alone

    def guide():
        with pyro.plate("items", 3):
            pyro.sample("c", dist.Bernoulli(0.5), infer=ENUM)

    with pytest.warns(RuntimeWarning, match="global_obs"):
        TraceEnum_ELBO(max_plate_nesting=1).loss(model, guide)
    with pytest.warns((UserWarning, RuntimeWarning), match="global_obs"):
        TMC_ELBO(num_samples=3, max_plate_nesting=1).loss(model, guide)


# ---------------------------------------------------------------------------
# 11. Shape errors in user code re-raise with a hint.
# ---------------------------------------------------------------------------

REG_X = torch.linspace(-1.0, 1.0, 15).reshape(5, 3)
REG_Y = torch.linspace(-1.0, 1.0, 5)


def regression_model():
    weights = pyro.sample("weights", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    with pyro.plate("rows", 5):
        pyro.sample(
            "response", dist.Normal(REG_X @ weights, 1.0), obs=REG_Y
        )  # TMC needs (REG_X * weights).sum(-1)


def cluster_model():
    locs = pyro.sample("cluster_locs", dist.Normal(torch.zeros(5), 1.0).to_event(1))
    with pyro.plate("rows", 5):
        a = pyro.sample("assignment", dist.Categorical(torch.ones(5) / 5))
        z = pyro.sample("local_z", dist.Normal(Vindex(locs)[..., a], 1.0))
        pyro.sample("response", dist.Normal(z, 1.0), obs=REG_Y)


def cluster_guide_without_vindex():
    locs = pyro.sample("cluster_locs", dist.Normal(torch.zeros(5), 1.0).to_event(1))
    with pyro.plate("rows", 5):
        a = pyro.sample("assignment", dist.Categorical(torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0])))
        pyro.sample("local_z", dist.Normal(locs[a], 1.0))  # indexes the particle dim, not the event


@pytest.mark.parametrize(
    "model, guide, error_type, names",
    [
        (regression_model, empty_guide, RuntimeError, ("weights", "rows", "response")),
        (cluster_model, cluster_guide_without_vindex, IndexError, ("cluster_locs", "assignment", "local_z")),
    ],
    ids=["matmul_in_model", "index_in_guide"],
)
def test_shape_error_hint(model, guide, error_type, names):
    """A particle-batched latent used as if unbatched: the error keeps its type and points to the guide."""
    with pytest.raises(Exception) as info:
        TMC_ELBO(num_samples=2, max_plate_nesting=1).loss(model, guide)
    error = info.value
    message = str(error)
    assert any(isinstance(e, error_type) for e in exception_chain(error)), repr(error)
    assert any(name in message for name in names), message
    assert "particle dim" in message, message
    assert "Writing models for TMC" in message, message


# ---------------------------------------------------------------------------
# 12. Sequential enumeration (summed in parallel) and pyro.poutine.collapse:
#     tests/infer/test_pyro_features.py.
# ---------------------------------------------------------------------------


# --------------------------------------------------------------------------- #
# Found by the outside corpus: per-element ancestors, poutine.scale, empty model,
# read-outs for Delta (AutoGuide) sites.
# --------------------------------------------------------------------------- #
PLATE_X = torch.tensor([1.9, -0.3, 2.4, 0.2, 1.1, 2.8, -0.8, 1.6])


def global_switch_model():
    g = pyro.sample("g", dist.Bernoulli(0.5))
    with pyro.plate("data", len(PLATE_X)):
        z = pyro.sample("z", dist.Bernoulli(0.2 + 0.6 * g))
        pyro.sample("x", dist.Normal(2.0 * z, 1.0), obs=PLATE_X)


def global_switch_guide():
    g = pyro.sample("g", dist.Bernoulli(0.5))
    with pyro.plate("data", len(PLATE_X)):
        pyro.sample("z", dist.Bernoulli(logits=2 * PLATE_X - 2 + 2.0 * (2 * g - 1)))


def _global_switch_log_px():
    """Exact: sum over g of p(g) prod_i sum_z p(z | g) N(x_i; 2z, 1)."""
    total = 0.0
    for g in (0, 1):
        p_z = 0.2 + 0.6 * g
        per_point = [
            p_z * normal_pdf(x, 2.0, 1.0) + (1 - p_z) * normal_pdf(x, 0.0, 1.0) for x in PLATE_X.tolist()
        ]
        total += 0.5 * math.prod(per_point)
    return math.log(total)


@pytest.mark.parametrize("proposal", ["mixture", "permutation"])
def test_plate_site_drawn_from_global_latent_unbiased(proposal):
    """
    Local guide sites drawing from a global latent's particles pick their
    ancestors per plate element: one pick shared by the whole plate couples the
    elements, and E[P_TMC] was 1.32 p(x) here.
    """
    elbo = TMC_ELBO(num_samples=4, max_plate_nesting=1, proposal=proposal)
    log_p = log_evidence_draws(elbo, global_switch_model, global_switch_guide, 1500)
    assert_unbiased(log_p, _global_switch_log_px(), max_se=0.05)


SCALE_X = torch.tensor([0.4, -1.3, 2.2])


@config_enumerate
def scaled_mixture_model(x, scale_where):
    """A two-component mixture per point; ``poutine.scale`` over the whole model or inside the plate."""
    whole = poutine.scale(scale=3.0) if scale_where == "model" else poutine.scale(scale=1.0)
    with whole:
        loc = pyro.sample("loc", dist.Normal(0.0, 2.0))
        with pyro.plate("data", len(x)):
            inner = poutine.scale(scale=2.5) if scale_where == "plate" else poutine.scale(scale=1.0)
            with inner:
                c = pyro.sample("c", dist.Bernoulli(0.3))
                pyro.sample("x", dist.Normal(loc * c, 1.0), obs=x)


def scaled_mixture_guide(x, scale_where):
    whole = poutine.scale(scale=3.0) if scale_where == "model" else poutine.scale(scale=1.0)
    with whole:
        pyro.sample("loc", dist.Delta(torch.tensor(1.2)))


@pytest.mark.parametrize("scale_where", ["model", "plate"])
def test_common_poutine_scale_acts_outside_the_sum_as_traceenum(scale_where):
    """
    A scale common to the whole model, or to everything inside a plate, multiplies
    the log of the sum over the enumerated values, as TraceEnum_ELBO (and a
    subsampled plate) has it, not the terms inside the sum.
    """
    args = (SCALE_X, scale_where)
    expected = TraceEnum_ELBO(max_plate_nesting=1).loss(scaled_mixture_model, scaled_mixture_guide, *args)
    actual = TMC_ELBO(num_samples=4, max_plate_nesting=1).loss(
        scaled_mixture_model, scaled_mixture_guide, *args
    )
    assert close(actual, expected)


def test_empty_model_and_guide():
    """Nothing to weigh: log P_TMC = 0, as Trace_ELBO's loss."""
    assert TMC_ELBO(num_samples=4, max_plate_nesting=0).loss(empty_guide, empty_guide) == 0.0


def conjugate_model(y):
    z = pyro.sample("z", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(z, 1.0), obs=y)


@pytest.mark.parametrize("guide_kind", ["AutoNormal", "AutoDiagonalNormal"])
def test_posterior_readouts_of_autoguide_sites(guide_kind):
    """
    The model's latent under an AutoGuide is a Delta site carried by an
    auxiliary site's particles: compute_marginals reports it (exact posterior mean
    sum(y) / (n + 1) within the spread over draws) and sample_posterior draws it,
    ready for Predictive.
    """
    y = torch.tensor([1.2, 0.4, 2.0, 1.5])
    exact_mean = y.sum().item() / (len(y) + 1)
    guide_class = getattr(pyro.infer.autoguide, guide_kind)
    guide = guide_class(conjugate_model, init_scale=1.0)
    elbo = TMC_ELBO(num_samples=256, max_plate_nesting=1)
    means = [elbo.compute_marginals(conjugate_model, guide, y)["z"].mean.item() for _ in range(20)]
    mean, se = mean_and_se(means)
    assert abs(mean - exact_mean) < NUM_SE * se + 0.02, (mean, se, exact_mean)
    draws = elbo.sample_posterior(conjugate_model, guide, y, num_draws=500)
    assert draws["z"].shape == (500,)
    assert abs(draws["z"].mean().item() - exact_mean) < 0.25
    predictive = pyro.infer.Predictive(conjugate_model, posterior_samples=draws)(y)
    assert predictive["y"].shape == (500, len(y))


def test_autodelta_marginal_is_its_point():
    """An AutoDelta site has one value: its marginal is that point, with weight one."""
    guide = pyro.infer.autoguide.AutoDelta(conjugate_model)
    y = torch.tensor([1.2, 0.4])
    marginal = TMC_ELBO(num_samples=8, max_plate_nesting=1).compute_marginals(conjugate_model, guide, y)["z"]
    assert marginal.mean.item() == pytest.approx(guide.median()["z"].item())
    assert marginal.variance.item() == pytest.approx(0.0)


def test_autonormal_matrix_latent_passes_validation(validation):
    """
    A Dirichlet transition matrix (event_dim 2) under AutoNormal: the guide's Delta
    carries particle dims, which Pyro's model/guide shape check mis-trims into a
    false "shapes disagree"; TMC_ELBO compares plate and event dims itself, and the
    loss is finite.
    """

    def model(y):
        trans = pyro.sample("trans", dist.Dirichlet(torch.ones(2, 2)).to_event(1))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Normal(trans[..., 0, 0], 1.0), obs=y)

    guide = pyro.infer.autoguide.AutoNormal(model)
    loss = TMC_ELBO(num_samples=4, max_plate_nesting=1).loss(model, guide, torch.zeros(3))
    assert math.isfinite(loss)
