"""Pyro features that TMC once warned about or refused: plate-dependency validation, sequential
enumeration (summed in parallel), and ``pyro.poutine.collapse`` (with the ``funsor`` extra).

Oracles: Pyro's ``TraceEnum_ELBO`` (its own warnings, parallel enumeration in the model, and its
sequential enumeration in the guide at the exact posterior, where its ELBO is log p(x) and its
gradient in the model's parameters is that of log p(x)); closed-form Gaussian evidences; and the
same model with the collapsed site written out under an exact-posterior guide, whose importance
weights are all p(x), so that TMC is exact for any K.
"""

import math
import warnings

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.distributions import constraints
from pyro.infer import TraceEnum_ELBO, config_enumerate

from pyro_tmc import TMC_ELBO
from pyro_tmc.poutine import tmc_messenger

DEPENDENCY_WARNING = "possibly invalid dependency"
F64 = torch.float64


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    """Seed 0, an empty param store, validation on, and no site yet warned about sequential enumeration."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    monkeypatch.setattr(tmc_messenger, "_WARNED_SEQUENTIAL", set())
    with pyro.validation_enabled(True):
        yield
    pyro.clear_param_store()


def losses_and_warnings(elbo, model, guide, *args, steps: int = 1):
    """``elbo.loss`` ``steps`` times; the losses and the messages of every warning raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [elbo.loss(model, guide, *args) for _ in range(steps)]
    return losses, [str(w.message) for w in caught]


def loss_and_grads(elbo, model, guide, names, *args):
    """The differentiable loss and its gradients in the unconstrained params ``names`` (``None``: unused)."""
    loss = elbo.differentiable_loss(model, guide, *args)
    params = [pyro.param(name).unconstrained() for name in names]
    return loss, torch.autograd.grad(loss, params, allow_unused=True)


# --------------------------------------------------------------------------- #
# Plate-dependency validation warns where TraceEnum_ELBO does, and only there.
# --------------------------------------------------------------------------- #


def two_subsampled_plates():
    """Two plates side by side, each subsampled; no site depends on the other plate."""
    prob = torch.tensor(0.3, requires_grad=True)
    with pyro.plate("left", 10, subsample_size=5) as rows:
        pyro.sample("u", dist.Bernoulli(prob).expand([len(rows)]))
    with pyro.plate("right", 11, subsample_size=6) as cols:
        pyro.sample("v", dist.Bernoulli(prob).expand([len(cols)]))


def test_side_by_side_subsampled_plates_do_not_warn():
    """
    The second plate's subsample site lies outside every plate: read before the
    subsample sites are pruned, it looked like a site depending on 'u' (Pyro's
    test_nonnested_plate_plate_ok warned under TMC, not under TraceEnum_ELBO).
    """
    guide = config_enumerate(two_subsampled_plates)
    for elbo in (TraceEnum_ELBO(max_plate_nesting=1), TMC_ELBO(num_samples=3, max_plate_nesting=1)):
        (loss,), messages = losses_and_warnings(elbo, two_subsampled_plates, guide)
        assert loss == pytest.approx(0.0, abs=1e-6)  # no data: p sums to one, and q = p
        assert not [m for m in messages if DEPENDENCY_WARNING in m], messages


def global_after_enumerated_plate(depends: bool):
    """``z`` in a plate, then a global observation; with ``depends`` it reads the whole plate's ``z``."""
    with pyro.plate("data", 3):
        z = pyro.sample("z", dist.Bernoulli(0.3))
    loc = z.sum(-1) if depends else 0.0
    pyro.sample("y", dist.Normal(loc, 1.0), obs=torch.tensor(1.0))


def guide_enumerating_z(depends: bool):
    with pyro.plate("data", 3):
        pyro.sample("z", dist.Bernoulli(0.4), infer={"enumerate": "parallel"})


def test_site_after_enumerated_plate_still_warns():
    """A global site after an enumerated site in a plate: TraceEnum_ELBO warns, and so does TMC."""
    for elbo in (TraceEnum_ELBO(max_plate_nesting=1), TMC_ELBO(num_samples=3, max_plate_nesting=1)):
        _, messages = losses_and_warnings(elbo, global_after_enumerated_plate, guide_enumerating_z, False)
        warned = [m for m in messages if DEPENDENCY_WARNING in m]
        assert any('model site "y"' in m and '"z"' in m for m in warned), (type(elbo).__name__, messages)


@pytest.mark.parametrize("enumerated", [True, False])
def test_global_depending_on_plate_still_raises(enumerated):
    """A global site that really reads a plate's latent fails validation under both ELBOs."""
    guide = guide_enumerating_z if enumerated else poutine.block(global_after_enumerated_plate, hide=["y"])
    elbos = [TMC_ELBO(num_samples=3, max_plate_nesting=1)]
    if enumerated:
        elbos.append(TraceEnum_ELBO(max_plate_nesting=1))
    for elbo in elbos:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(ValueError, match='site "y"'):
                elbo.loss(global_after_enumerated_plate, guide, True)


# --------------------------------------------------------------------------- #
# Sequential enumeration: summed in parallel, with one warning per site.
# --------------------------------------------------------------------------- #

X_MIX = torch.tensor([0.3, 1.9, -0.4], dtype=F64)
PROBS = torch.tensor([0.2, 0.5, 0.3], dtype=F64)
LOCS = torch.tensor([-1.0, 0.5, 2.0], dtype=F64)
MODEL_PARAMS = ["probs", "locs"]


def mixture_model(mode):
    """A Gaussian mixture of three points; ``z`` is marked ``infer={"enumerate": mode}`` if ``mode``."""
    probs = pyro.param("probs", PROBS, constraint=constraints.simplex)
    locs = pyro.param("locs", LOCS)
    with pyro.plate("data", len(X_MIX)):
        infer = {"enumerate": mode} if mode else {}
        z = pyro.sample("z", dist.Categorical(probs), infer=infer)
        pyro.sample("x", dist.Normal(locs[z], 1.0), obs=X_MIX)


def no_guide(*args):
    pass


def exact_posterior():
    """p(z_i | x_i) at the initial parameters."""
    joint = PROBS * dist.Normal(LOCS, 1.0).log_prob(X_MIX[:, None]).exp()
    return joint / joint.sum(-1, keepdim=True)


def posterior_guide(mode):
    q = pyro.param("q", exact_posterior(), constraint=constraints.simplex)
    with pyro.plate("data", len(X_MIX)):
        pyro.sample("z", dist.Categorical(q), infer={"enumerate": mode})


def assert_close(actual, expected, atol=1e-5):
    for a, e in zip(actual, expected):
        assert torch.allclose(a, e, rtol=0, atol=atol), (a, e)


def test_sequential_model_site_equals_parallel_enumeration():
    """In the model: TraceEnum_ELBO with the site marked parallel (it refuses model-side sequential)."""
    expected, expected_grads = loss_and_grads(
        TraceEnum_ELBO(max_plate_nesting=1), mixture_model, no_guide, MODEL_PARAMS, "parallel"
    )
    with pytest.raises(NotImplementedError, match="sequential"):  # the oracle's own refusal
        TraceEnum_ELBO(max_plate_nesting=1).loss(mixture_model, no_guide, "sequential")
    with pytest.warns(UserWarning, match="Site 'z' asks for sequential enumeration"):
        actual, actual_grads = loss_and_grads(
            TMC_ELBO(num_samples=4, max_plate_nesting=1), mixture_model, no_guide, MODEL_PARAMS, "sequential"
        )
    assert actual.item() == pytest.approx(expected.item(), abs=1e-5)
    assert_close(actual_grads, expected_grads)


def test_sequential_guide_site_equals_pyro_sequential_enumeration():
    """
    In the guide, against Pyro's own sequential enumeration at the exact posterior:
    the ELBO is log p(x), and its gradient in the model's parameters that of log p(x).
    TMC sums the site (q cancels): the same value and model gradients, and q gets none.
    """
    names = MODEL_PARAMS + ["q"]
    expected, expected_grads = loss_and_grads(
        TraceEnum_ELBO(max_plate_nesting=1), mixture_model, posterior_guide, names, "sequential"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the summed guide site's own warning, tested elsewhere
        actual, actual_grads = loss_and_grads(
            TMC_ELBO(num_samples=4, max_plate_nesting=1), mixture_model, posterior_guide, names, "sequential"
        )
    assert actual.item() == pytest.approx(expected.item(), abs=1e-5)
    assert_close(actual_grads[:2], expected_grads[:2])
    assert actual_grads[2] is None
    assert expected_grads[2].abs().max() < 1e-5  # the oracle is at its optimum in q


def mixture_with_sampled_shift(mode):
    """The mixture with a sampled (continuous) global latent: TMC's estimate is stochastic."""
    probs = pyro.param("probs", PROBS, constraint=constraints.simplex)
    locs = pyro.param("locs", LOCS)
    shift = pyro.sample("shift", dist.Normal(torch.tensor(0.0, dtype=F64), 1.0))
    with pyro.plate("data", len(X_MIX)):
        z = pyro.sample("z", dist.Categorical(probs), infer={"enumerate": mode})
        pyro.sample("x", dist.Normal(locs[z] + shift, 1.0), obs=X_MIX)


def shift_guide(mode):
    loc = pyro.param("shift_loc", torch.tensor(0.2, dtype=F64))
    pyro.sample("shift", dist.Normal(loc, 0.5))


def test_sequential_equals_parallel_on_identical_particles():
    """With a sampled latent beside it: the same particles give the same value and gradients."""
    names = MODEL_PARAMS + ["shift_loc"]
    results = {}
    for mode in ("parallel", "sequential"):
        pyro.clear_param_store()
        pyro.set_rng_seed(3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results[mode] = loss_and_grads(
                TMC_ELBO(num_samples=5, max_plate_nesting=1),
                mixture_with_sampled_shift,
                shift_guide,
                names,
                mode,
            )
    (parallel, parallel_grads), (sequential, sequential_grads) = results["parallel"], results["sequential"]
    assert sequential.item() == pytest.approx(parallel.item(), abs=1e-10)
    assert_close(sequential_grads, parallel_grads, atol=1e-10)


HMM_X = torch.tensor([0.1, 1.4, 1.1, -0.3, 0.8], dtype=F64)


def hmm(mode):
    """A two-state HMM under ``pyro.markov``: every state marked ``infer={"enumerate": mode}``."""
    transition = pyro.param(
        "transition", torch.tensor([[0.8, 0.2], [0.3, 0.7]], dtype=F64), constraint=constraints.simplex
    )
    locs = pyro.param("emission_locs", torch.tensor([0.0, 1.2], dtype=F64))
    state = torch.tensor(0)
    for t in pyro.markov(range(len(HMM_X))):
        state = pyro.sample(f"state_{t}", dist.Categorical(transition[state]), infer={"enumerate": mode})
        pyro.sample(f"x_{t}", dist.Normal(locs[state], 0.5), obs=HMM_X[t])


def test_sequential_markov_chain_equals_parallel_enumeration():
    """Sequential states in a markov chain recycle dims as parallel ones do: TraceEnum_ELBO's value."""
    names = ["transition", "emission_locs"]
    expected, expected_grads = loss_and_grads(
        TraceEnum_ELBO(max_plate_nesting=0), hmm, no_guide, names, "parallel"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        actual, actual_grads = loss_and_grads(
            TMC_ELBO(num_samples=3, max_plate_nesting=0), hmm, no_guide, names, "sequential"
        )
    assert actual.item() == pytest.approx(expected.item(), abs=1e-5)
    assert_close(actual_grads, expected_grads)


def test_sequential_warns_once_per_site():
    """Three steps and a second loss object: one warning for the site, not one per step."""
    elbo = TMC_ELBO(num_samples=2, max_plate_nesting=1)
    _, messages = losses_and_warnings(elbo, mixture_model, no_guide, "sequential", steps=3)
    _, more = losses_and_warnings(TMC_ELBO(max_plate_nesting=1), mixture_model, no_guide, "sequential")
    summed = [m for m in messages + more if "summed in parallel" in m or "sums it in parallel" in m]
    assert len(summed) == 1, messages + more
    assert "Site 'z'" in summed[0] and "infer={'enumerate': 'parallel'}" in summed[0]


def test_sequential_without_finite_support_is_refused():
    """A Normal has nothing to enumerate: sampling it would silently ignore the flag."""

    def model():
        pyro.sample("w", dist.Normal(0.0, 1.0), infer={"enumerate": "sequential"})

    with pytest.raises(ValueError, match="Site 'w'.*no finite support.*Drop the flag"):
        TMC_ELBO(max_plate_nesting=0).loss(model, no_guide)


def test_sequential_with_num_samples_is_refused():
    """Pyro's config_enumerate refuses sequential sampling too."""

    def model():
        pyro.sample("c", dist.Bernoulli(0.5), infer={"enumerate": "sequential", "num_samples": 4})

    with pytest.raises(ValueError, match="Site 'c'.*num_samples"):
        TMC_ELBO(max_plate_nesting=0).loss(model, no_guide)


# --------------------------------------------------------------------------- #
# pyro.poutine.collapse (needs the funsor extra: pip install pyro-tmc[collapse]).
# --------------------------------------------------------------------------- #

# float32: funsor builds its Gaussians in the default dtype.
X_COLLAPSE = torch.tensor([0.5, -1.2, 2.0])
PRIOR_LOC = torch.tensor(0.3)


def collapsed_plate_model():
    """x_i ~ N(loc_i, 1), loc_i ~ N(mu, 1) collapsed: x_i ~ N(mu, sqrt 2)."""
    mu = pyro.param("mu", PRIOR_LOC)
    with pyro.plate("data", len(X_COLLAPSE)), poutine.collapse():
        loc = pyro.sample("loc", dist.Normal(mu, 1.0))
        pyro.sample("x", dist.Normal(loc, 1.0), obs=X_COLLAPSE)


def test_collapse_in_a_plate_gives_the_conjugate_evidence():
    pytest.importorskip("funsor")
    loss, (grad,) = loss_and_grads(
        TMC_ELBO(num_samples=4, max_plate_nesting=1), collapsed_plate_model, no_guide, ["mu"]
    )
    mu = PRIOR_LOC.to(F64).requires_grad_()  # the exact value in float64
    log_px = dist.Normal(mu, math.sqrt(2.0)).log_prob(X_COLLAPSE.to(F64)).sum()
    (expected_grad,) = torch.autograd.grad(-log_px, [mu])
    assert loss.item() == pytest.approx(-log_px.item(), abs=1e-5)
    assert grad.item() == pytest.approx(expected_grad.item(), abs=1e-5)


def scale_model(collapse: bool):
    """s ~ N(0, 1), y ~ N(s, 1) = 1.0 sampled by TMC; loc ~ N(0, 1), x ~ N(loc, 1) = 0.5, collapsed or not."""
    s = pyro.sample("s", dist.Normal(0.0, 1.0))
    pyro.sample("y", dist.Normal(s, 1.0), obs=torch.tensor(1.0))
    with poutine.collapse() if collapse else poutine.block(hide=[]):
        loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
        pyro.sample("x", dist.Normal(loc, 1.0), obs=torch.tensor(0.5))


def exact_posterior_guide(collapse: bool):
    """Each latent's exact posterior N(obs / 2, sqrt(1/2)): every importance weight is p(x)."""
    pyro.sample("s", dist.Normal(0.5, math.sqrt(0.5)))
    if not collapse:
        pyro.sample("loc", dist.Normal(0.25, math.sqrt(0.5)))


@pytest.mark.parametrize("num_samples", [1, 7])
def test_collapse_equals_the_site_written_out(num_samples):
    """Beside a sampled latent: the collapsed model, the written-out one, and the closed form agree."""
    pytest.importorskip("funsor")
    elbo = TMC_ELBO(num_samples=num_samples, max_plate_nesting=0)
    collapsed = elbo.loss(scale_model, exact_posterior_guide, True)
    written_out = elbo.loss(scale_model, exact_posterior_guide, False)
    marginal = dist.Normal(torch.tensor(0.0, dtype=F64), math.sqrt(2.0))  # float64: the exact value
    exact = -(marginal.log_prob(torch.tensor(1.0)) + marginal.log_prob(torch.tensor(0.5))).item()
    assert collapsed == pytest.approx(exact, abs=1e-5)
    assert written_out == pytest.approx(exact, abs=1e-5)


def test_collapsed_site_on_a_sampled_latent_is_refused():
    """collapse names only plate dims: a collapsed site cannot depend on TMC's particles."""
    pytest.importorskip("funsor")

    def model():
        g = pyro.sample("g", dist.Normal(0.0, 1.0))
        with poutine.collapse():
            loc = pyro.sample("loc", dist.Normal(g, 1.0))
            pyro.sample("x", dist.Normal(loc, 1.0), obs=torch.tensor(0.5))

    def guide():
        pyro.sample("g", dist.Normal(0.2, 0.7))

    with pytest.raises(NotImplementedError, match="Site 'loc' is inside pyro.poutine.collapse.*'g'"):
        TMC_ELBO(num_samples=3, max_plate_nesting=0).loss(model, guide)
