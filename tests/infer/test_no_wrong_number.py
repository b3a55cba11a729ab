"""Regression tests for the silent wrong values found by fuzzing (issue "No wrong number", F1-F3, F7).

Each case is checked against an oracle that shares no code with pyro_tmc: Pyro's ``Trace_ELBO``
and ``TraceEnum_ELBO``, or an exact "scale twin" (the same model without the scale, on the same
particles, multiplied by hand).
"""

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.distributions import constraints
from pyro.infer import Trace_ELBO, TraceEnum_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.ops.indexing import Vindex

from pyro_tmc import TMC_ELBO, TMC_RWS
from pyro_tmc.poutine.sites import particle_symbol

DATA = torch.tensor([0.3, -1.2, 2.0, 0.7])


@pytest.fixture(autouse=True, params=[torch.float32, torch.float64], ids=["float32", "float64"])
def default_dtype(request):
    """Every case in both precisions, against its oracle in the same precision."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(request.param)
    yield request.param
    torch.set_default_dtype(previous)


def _empty_guide(*args, **kwargs):
    pass


# F1: a plate whose (sub)sample has one element keeps its scale.


def _observed_only(index):
    with pyro.plate("data", 4, subsample=index) as i:
        pyro.sample("x", dist.Normal(0.0, 1.0), obs=DATA[i])


def _enumerated(index):
    with pyro.plate("data", 4, subsample=index) as i:
        z = pyro.sample("z", dist.Bernoulli(0.3), infer={"enumerate": "parallel"})
        pyro.sample("x", dist.Normal(z * 2.0, 1.0), obs=DATA[i])


def _scaled_in_plate(size):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", size), poutine.scale(scale=3.0):
        z = pyro.sample("z", dist.Bernoulli(0.3), infer={"enumerate": "parallel"})
        pyro.sample("x", dist.Normal(mu + z * 2.0, 1.0), obs=DATA[:size])


def _delta_guide(size):
    pyro.sample("mu", dist.Delta(pyro.param("mu_loc", torch.tensor(0.5))))


@pytest.mark.parametrize("index", [[2], [2, 3], [0]])
def test_minibatch_of_one_keeps_its_scale_observed(index):
    index = torch.tensor(index)
    expected = Trace_ELBO().loss(_observed_only, _empty_guide, index)
    got = TMC_ELBO(num_samples=4, max_plate_nesting=1).loss(_observed_only, _empty_guide, index)
    assert got == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("index", [[2], [1, 3]])
def test_minibatch_of_one_keeps_its_scale_enumerated(index):
    index = torch.tensor(index)
    expected = TraceEnum_ELBO(max_plate_nesting=1).loss(_enumerated, _empty_guide, index)
    got = TMC_ELBO(num_samples=4, max_plate_nesting=1).loss(_enumerated, _empty_guide, index)
    assert got == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("size", [1, 2])
def test_scale_in_a_plate_of_one_value_and_gradient(size):
    pyro.clear_param_store()
    expected_loss = TraceEnum_ELBO(max_plate_nesting=1).differentiable_loss(
        _scaled_in_plate, _delta_guide, size
    )
    (expected_grad,) = torch.autograd.grad(expected_loss, [pyro.param("mu_loc").unconstrained()])
    loss = TMC_ELBO(num_samples=4, max_plate_nesting=1).differentiable_loss(
        _scaled_in_plate, _delta_guide, size
    )
    (grad,) = torch.autograd.grad(loss, [pyro.param("mu_loc").unconstrained()])
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-6)
    assert grad.item() == pytest.approx(expected_grad.item(), rel=1e-5)


def _sampled(index, full_size=4):
    with pyro.plate("data", full_size, subsample=index) as i:
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("x", dist.Normal(z, 0.5), obs=DATA[i])


def _sampled_guide(index, full_size=4):
    with pyro.plate("data", full_size, subsample=index):
        pyro.sample("z", dist.Normal(0.2, 0.8))


def test_minibatch_of_one_with_sampled_latents_is_the_scaled_twin():
    """Subsample [2] of 4 is 4x the same element as a plate of one, on the same particles."""
    elbo = TMC_ELBO(num_samples=8, max_plate_nesting=1)
    pyro.set_rng_seed(0)
    subsampled = elbo.loss(_sampled, _sampled_guide, torch.tensor([2]))
    pyro.set_rng_seed(0)
    alone = elbo.loss(_sampled, _sampled_guide, torch.tensor([2]), full_size=1)
    assert subsampled == pytest.approx(4 * alone, rel=1e-6)


def test_minibatch_of_one_marginals_sum_to_one():
    elbo = TMC_ELBO(num_samples=4, max_plate_nesting=1)
    pyro.set_rng_seed(0)
    marginals = elbo.compute_marginals(_sampled, _sampled_guide, torch.tensor([2]))
    total = marginals["z"].log_weights.exp().sum(-1)  # Empirical keeps the weights as given
    assert total.flatten().tolist() == pytest.approx([1.0] * total.numel(), abs=1e-6)


# F2: the path-gradient estimators and TMC_RWS score the minibatch the particles were drawn for.

SERIES = torch.arange(10.0)


def _minibatch_model(seen):
    shift = pyro.param("shift", torch.tensor(0.3))
    with pyro.plate("N", 10, subsample_size=3) as index:
        seen.append(("model", index.tolist()))
        z = pyro.sample("z", dist.Normal(shift, 10.0))
        pyro.sample("x", dist.Normal(z, 0.1), obs=SERIES[index])


def _minibatch_guide(seen):
    with pyro.plate("N", 10, subsample_size=3) as index:
        seen.append(("guide", index.tolist()))
        pyro.sample("z", dist.Normal(SERIES[index] + pyro.param("offset", torch.tensor(0.1)), 0.3))


def _loss_and_model_gradient(elbo):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    seen = []
    with pyro.validation_enabled(False):  # no probe draw (another minibatch) among the calls
        loss = elbo.differentiable_loss(_minibatch_model, _minibatch_guide, seen)
    (grad,) = torch.autograd.grad(loss, [pyro.param("shift").unconstrained()])
    return loss.item(), grad.item(), seen


@pytest.mark.parametrize(
    "elbo",
    [
        TMC_ELBO(num_samples=4, max_plate_nesting=1, variance_reduction="stl"),
        TMC_ELBO(num_samples=4, max_plate_nesting=1, variance_reduction="dregs"),
        TMC_RWS(num_samples=4, max_plate_nesting=1),
    ],
    ids=["stl", "dregs", "rws"],
)
def test_path_gradients_keep_the_minibatch(elbo):
    expected_loss, expected_grad, _ = _loss_and_model_gradient(TMC_ELBO(num_samples=4, max_plate_nesting=1))
    loss, grad, seen = _loss_and_model_gradient(elbo)
    assert len({tuple(index) for _, index in seen}) == 1, seen
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    assert grad == pytest.approx(expected_grad, rel=1e-5)


# F7: an error about a value gets no broadcasting hint.


def _invalid_scale_model():
    g = pyro.sample("g", dist.Normal(0.0, 1.0))
    pyro.sample("x", dist.Normal(g, torch.tensor(-1.0)), obs=torch.tensor(0.3))


def _global_guide():
    pyro.sample("g", dist.Normal(0.0, 1.0))


def test_invalid_parameter_error_has_no_broadcasting_hint():
    with pytest.raises(ValueError, match="constraint") as raised:
        TMC_ELBO(num_samples=4, max_plate_nesting=0).loss(_invalid_scale_model, _global_guide)
    assert "Vindex" not in str(raised.value) and "particle dim" not in str(raised.value)


def _hand_broadcast_model():
    g = pyro.sample("g", dist.Normal(0.0, 1.0))
    with pyro.plate("data", 3):
        pyro.sample("x", dist.Normal(g.reshape(-1)[:2], 1.0), obs=torch.zeros(3))


def test_shape_error_keeps_its_hint():
    with pytest.raises((ValueError, RuntimeError), match="Vindex"):
        TMC_ELBO(num_samples=4, max_plate_nesting=1).loss(_hand_broadcast_model, _global_guide)


# F3: the model keeps the particle dims of replayed guide latents apart from its own.

OBSERVED = torch.tensor([0.5, -0.3, 1.2, 0.4, 0.9])


def _chain_model(extra, steps=3, markov=True):
    if extra == "prior":
        pyro.sample("m", dist.Normal(0.0, 1.0))
    elif extra.startswith("enum"):
        size = int(extra[-1])
        pyro.sample("m", dist.Categorical(torch.ones(size) / size), infer={"enumerate": "parallel"})
    elif extra == "plate":
        with pyro.plate("A", 2):
            pyro.sample("z", dist.Normal(0.0, 1.0))
    h = 0.0
    for t in pyro.markov(range(steps)) if markov else range(steps):
        h = pyro.sample(f"h_{t}", dist.Normal(h, 1.0))
        pyro.sample(f"o_{t}", dist.Normal(h, 1.0), obs=OBSERVED[t])


def _chain_guide(extra, steps=3, markov=True):
    h = None
    for t in pyro.markov(range(steps)) if markov else range(steps):
        loc = OBSERVED[t] * 0.5 + (0.3 * h if h is not None else 0.0)
        h = pyro.sample(f"h_{t}", dist.Normal(loc, 1.0))


def _seeded_loss(model, guide, *args, **kwargs):
    pyro.set_rng_seed(0)  # the guide runs first: the same particles in every case
    return TMC_ELBO(num_samples=4, max_plate_nesting=1).loss(model, guide, *args, **kwargs)


@pytest.mark.parametrize("extra", ["prior", "enum4", "enum3", "plate"])
def test_irrelevant_model_latent_before_a_guide_chain(extra):
    expected = _seeded_loss(_chain_model, _chain_guide, "none")
    assert _seeded_loss(_chain_model, _chain_guide, extra) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("model_markov,guide_markov", [(True, False), (False, True), (False, False)])
def test_markov_on_one_side_only(model_markov, guide_markov):
    expected = _seeded_loss(_chain_model, _chain_guide, "none", steps=5)

    def model():
        _chain_model("none", steps=5, markov=model_markov)

    def guide():
        _chain_guide("none", steps=5, markov=guide_markov)

    assert _seeded_loss(model, guide) == pytest.approx(expected, rel=1e-6)


def _chain_with_global(first):
    """A model-only global m, drawn before or after the guide's chain, observed with its last step."""
    m = pyro.sample("m", dist.Normal(0.0, 1.0)) if first else None
    h = 0.0
    for t in pyro.markov(range(4)):
        h = pyro.sample(f"h_{t}", dist.Normal(h, 1.0))
        pyro.sample(f"o_{t}", dist.Normal(h, 1.0), obs=OBSERVED[t])
    if not first:
        m = pyro.sample("m", dist.Normal(0.0, 1.0))
    pyro.sample("end", dist.Normal(m + h, 1.0), obs=torch.tensor(1.5))


def test_model_global_before_a_guide_chain_equals_after():
    def guide(first):
        _chain_guide("none", steps=4)

    before = _seeded_loss(_chain_with_global, guide, True)
    after = _seeded_loss(_chain_with_global, guide, False)
    assert before == pytest.approx(after, rel=1e-6)


# Found by the fuzzer (seed 901340): a plate's share of poutine.scale went to the outer plate.


def _scaled_outer_plate():
    with pyro.plate("outer", 2, dim=-2), poutine.scale(scale=3.0):
        z = pyro.sample("z", dist.Gamma(2.9, 1.3))
        with pyro.plate("data", 2, dim=-1):
            pyro.sample("x", dist.Normal(z, 0.5), obs=torch.tensor([[0.16, 0.5], [0.2, -0.3]]))


def test_scale_shared_by_an_inner_plate_goes_to_the_inner_plate():
    """
    AutoNormal's auxiliary site is not scaled, so 'z' alone is tempered, and the scale common to
    the sites in both plates belongs to the inner plate: on the outer one it would also multiply
    the already tempered 'z' and the auxiliary site (marginal weights summed to 3).
    """
    pyro.clear_param_store()
    guide = AutoNormal(_scaled_outer_plate)
    elbo = TMC_ELBO(num_samples=4, max_plate_nesting=2)
    draw = elbo.draw(_scaled_outer_plate, guide)
    plan = draw.scales
    symbol = draw.model_trace.plate_to_symbol
    assert plan.plate_scales[symbol["data"]] == 3.0 and plan.plate_scales[symbol["outer"]] == 1.0
    assert plan.residual == {"z": 3.0}
    total = elbo.compute_marginals(_scaled_outer_plate, guide)["z"].log_weights.exp().sum(-1)
    assert total.flatten().tolist() == pytest.approx([1.0, 1.0], abs=1e-5)


# Found by the fuzzer (seed 1201284): a one-particle site lost its own particle dim's id.


def _one_particle_model():
    h = pyro.sample("h_0", dist.Normal(0.0, 1.0))
    for _ in pyro.markov(range(1)):
        pass
    d = pyro.sample("d", dist.Categorical(logits=torch.tensor([0.4, -0.4, 0.7]) + 0.5 * h.unsqueeze(-1)))
    pyro.sample("y", dist.Normal(Vindex(torch.tensor([0.9, 1.3, -0.1]))[..., d], 0.5), obs=torch.tensor(-0.3))


def _one_particle_guide():
    for t in pyro.markov(range(1)):
        pyro.sample(f"h_{t}", dist.Normal(0.6, 0.8), infer={"num_samples": 1})
    pyro.sample("d", dist.Categorical(torch.tensor([0.45, 0.38, 0.17])))


def test_one_particle_site_keeps_its_particle_dim_apart():
    """
    'h_0' holds one particle, on a dim local to pyro.markov; the guide's 'd' once took that dim
    (kept apart by its symbol). Since fuzz seed 51205 of the budget family (where that layout
    failed Pyro's dim check), a one-particle site's dim stays occupied: 'd' gets a dim of its own.
    """
    pyro.set_rng_seed(0)
    elbo = TMC_ELBO(num_samples=3, max_plate_nesting=0)
    draw = elbo.draw(_one_particle_model, _one_particle_guide)
    h, d = draw.model_trace.nodes["h_0"], draw.model_trace.nodes["d"]
    assert h["infer"]["_enumerate_dim"] != d["infer"]["_enumerate_dim"]
    assert particle_symbol(h) != particle_symbol(d)
    draws = elbo.sample_posterior(_one_particle_model, _one_particle_guide, num_draws=20)
    assert draws["h_0"].shape == (20,) and draws["d"].shape == (20,)


# Fuzz seed 1201790: here Pyro's TraceEnum_ELBO gradient is not the derivative of its own loss;
# TMC's is. The TMC gradient is checked against finite differences, not against TraceEnum_ELBO.

SIMPLEX_DATA = torch.tensor(
    [[-0.27, 1.6, 0.98, 1.72], [2.25, 1.19, 0.25, -1.1], [0.82, 1.3, -0.16, 0.35], [2.07, 0.75, -0.57, -0.6]]
)
WEIGHTS = torch.tensor([1.49, 0.16, 1.47])
MINIBATCH = torch.tensor([1, 2, 3])


def _dirichlet_model():
    with pyro.plate("outer", 4, dim=-2, subsample=MINIBATCH) as i:
        zo0 = pyro.sample("zo0", dist.Dirichlet(torch.tensor([1.41, 1.41, 1.41])))
        zo1 = pyro.sample("zo1", dist.OneHotCategorical(zo0), infer={"enumerate": "parallel"})
        mean = (zo1 * WEIGHTS).sum(-1)
        with pyro.plate("data", 4, dim=-1) as j:
            pyro.sample("zi0", dist.Normal(0.14 + mean, 0.3))
            bias = pyro.param("x_bias", torch.tensor(-0.91))
            pyro.sample("x", dist.Normal(bias + mean, 0.3), obs=SIMPLEX_DATA[i.unsqueeze(-1), j])


def _dirichlet_guide():
    with pyro.plate("outer", 4, dim=-2, subsample=MINIBATCH) as i:
        loc = pyro.param("q", torch.tensor([[[0.257, 0.418, 0.325]]] * 4), constraint=constraints.simplex)
        pyro.sample("zo0", dist.Delta(loc[i], event_dim=1))
        with pyro.plate("data", 4, dim=-1) as j:
            pyro.sample("zi0", dist.Delta(pyro.param("qz", torch.full((4, 4), -0.32))[i.unsqueeze(-1), j]))


def test_gradient_through_a_simplex_delta_is_the_derivative_of_the_loss(default_dtype):
    if default_dtype != torch.float64:
        pytest.skip("finite differences need float64")
    pyro.clear_param_store()
    elbo = TMC_ELBO(num_samples=4, max_plate_nesting=2)
    loss = elbo.differentiable_loss(_dirichlet_model, _dirichlet_guide)
    unconstrained = pyro.param("q").unconstrained()
    (grad,) = torch.autograd.grad(loss, [unconstrained])
    step = 1e-6
    for j in range(unconstrained.shape[-1]):
        with torch.no_grad():
            unconstrained[1, 0, j] += step
            up = elbo.loss(_dirichlet_model, _dirichlet_guide)
            unconstrained[1, 0, j] -= 2 * step
            down = elbo.loss(_dirichlet_model, _dirichlet_guide)
            unconstrained[1, 0, j] += step
        assert grad[1, 0, j].item() == pytest.approx((up - down) / (2 * step), rel=1e-5, abs=1e-6)


# IWAE's shared particle dim is allocated at the guide's first latent; a model site enumerated
# later sits to its left, and a latent drawn from the prior below it has both dims. Drawing it
# raised "Particle dim -2 collides with batch shape (2, 1, 3): increase max_plate_nesting",
# which no max_plate_nesting avoids (fuzz case 413).

X_IWAE = torch.tensor([0.3, 1.2, -0.4])
Y_IWAE = 0.5


def _enumerated_then_prior_drawn():
    c = pyro.sample("c", dist.Bernoulli(0.3), infer={"enumerate": "parallel"})
    with pyro.plate("data", 3):
        z = pyro.sample("z", dist.Normal(2.0 * c, 1.0))  # not in the guide: drawn from the prior
        pyro.sample("x", dist.Normal(z, 1.0), obs=X_IWAE)
    h = pyro.sample("h", dist.Normal(0.0, 1.0))
    pyro.sample("y", dist.Normal(h, 1.0), obs=torch.tensor(Y_IWAE))


def _guide_of_h():
    pyro.sample("h", dist.Normal(0.2, 1.0))


def test_iwae_with_an_enumerated_site_above_a_prior_drawn_latent_is_unbiased():
    """``exp(-loss)`` of IWAE is an unbiased estimate of p(x, y), known in closed form."""
    from pyro_tmc import IWAE_ELBO

    marginal = dist.Normal(0.0, 2.0**0.5)  # z (or h) integrated out: N(mean, 1 + 1)
    p_x = sum(
        prior * (marginal.log_prob(X_IWAE - 2.0 * c).sum()).exp() for c, prior in ((0.0, 0.7), (1.0, 0.3))
    )
    truth = p_x * marginal.log_prob(torch.tensor(Y_IWAE)).exp()
    elbo = IWAE_ELBO(num_samples=4, max_plate_nesting=1)
    pyro.set_rng_seed(0)
    with torch.no_grad():
        losses = [elbo.differentiable_loss(_enumerated_then_prior_drawn, _guide_of_h) for _ in range(1000)]
    estimates = (-torch.stack(losses)).exp()
    standard_error = estimates.std() / len(estimates) ** 0.5
    assert abs(estimates.mean() - truth) < 4 * standard_error, (estimates.mean(), truth, standard_error)
    assert standard_error < 0.05 * truth  # the test can tell a wrong weight from noise
