"""Hand broadcasting of a latent's particles is caught under validation (the probe draw)."""

import warnings

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro.infer import Trace_ELBO

from pyro_tmc import TMC_ELBO

N = 12
FEATURES = torch.linspace(-1.0, 1.0, N * 3).reshape(N, 3)
TARGETS = FEATURES @ torch.tensor([1.0, -2.0, 0.5]) + 0.3


def _regression(idiom, calls):
    def model():
        calls.append("model")
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        b = pyro.sample("b", dist.Normal(0.0, 1.0))
        with pyro.plate("data", N):
            if idiom == "unsqueeze":
                mean = (FEATURES * w.unsqueeze(-2)).sum(-1)
            elif idiom == "einsum":
                mean = torch.einsum("...d,nd->...n", w, FEATURES)
            elif idiom == "matmul":
                mean = (FEATURES @ w[..., None]).squeeze(-1)
            else:  # the idiom that broadcasts over particle dims
                mean = (FEATURES * w).sum(-1)
            pyro.sample("y", dist.Normal(mean + b, 0.5), obs=TARGETS)

    return model


def _guide():
    pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    pyro.sample("b", dist.Normal(0.0, 1.0))


@pytest.fixture
def validation():
    yield pyro.enable_validation(True)
    pyro.enable_validation(True)


@pytest.mark.parametrize("idiom", ["unsqueeze", "einsum", "matmul"])
def test_hand_broadcasting_raises_under_validation(idiom, validation):
    elbo = TMC_ELBO(num_samples=8, max_plate_nesting=1)
    with pytest.raises(ValueError, match="broadcast by hand") as raised:
        elbo.loss(_regression(idiom, []), _guide)
    message = str(raised.value)
    assert "after sample site 'b'" in message and "(X * w).sum(-1)" in message


@pytest.mark.parametrize("idiom", ["unsqueeze", "einsum", "matmul"])
def test_hand_broadcasting_is_silent_without_validation(idiom):
    """What the probe guards against: equal counts hide the mistake (and the check costs nothing)."""
    pyro.enable_validation(False)
    try:
        calls = []
        TMC_ELBO(num_samples=8, max_plate_nesting=1).loss(_regression(idiom, calls), _guide)
    finally:
        pyro.enable_validation(True)
    assert calls == ["model"]  # no probe draw


def test_probe_runs_once_per_loss_and_passes_a_correct_model(validation):
    calls = []
    elbo = TMC_ELBO(num_samples=8, max_plate_nesting=1)
    for _ in range(3):
        elbo.loss(_regression("right", calls), _guide)
    assert calls == ["model"] * 4  # three draws and one probe


def test_probe_leaves_the_random_stream_alone(validation):
    values = []
    for validate in (True, False):
        pyro.enable_validation(validate)
        pyro.set_rng_seed(3)
        loss = TMC_ELBO(num_samples=8, max_plate_nesting=1).loss(_regression("right", []), _guide)
        values.append((loss, torch.rand(()).item()))
    assert values[0] == values[1]


def test_site_varying_along_another_latents_dim_is_named(validation):
    """No broadcasting error: the moved particles land on a dim whose latent then has another size."""

    def model():
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        b = pyro.sample("b", dist.Normal(0.0, 1.0))
        # w's particles (dim -2) moved onto b's dim (-3), where b is size 1 after .mean(-3)
        moved = w.unsqueeze(-2) + b.mean(-3, keepdim=True)
        with pyro.plate("data", 2):
            pyro.sample("y", dist.Normal(moved, 1.0), obs=torch.zeros(2))

    def guide():
        pyro.sample("w", dist.Normal(0.0, 1.0))
        pyro.sample("b", dist.Normal(0.0, 1.0))

    with pytest.raises(
        ValueError, match="Site 'y' varies along the particle dim of latent 'b'.*count of \\['w'\\]"
    ):
        TMC_ELBO(num_samples=4, max_plate_nesting=1).loss(model, guide)


# -- a model that is right at the user's K is never refused ------------------------------------

LOADINGS = torch.tensor([[1.0, 3.0, 0.0], [2.0, 1.0, 4.0]])


def _reshaping_model(calls):
    """A plate of weights reshaped into a matrix across its plate: right with one particle alone."""

    def model():
        calls.append("model")
        with pyro.plate("weights", 6):
            weights = pyro.sample("weights_flat", dist.Gamma(2.0, 2.0))
        matrix = weights.reshape(weights.shape[:-1] + (2, 3))  # (K, 6) -> (K, 2, 3)
        with pyro.plate("rows", 4):
            factors = pyro.sample("factors", dist.Gamma(3.0, 3.0).expand([2]).to_event(1))
            rate = torch.matmul(factors, matrix)
            pyro.sample("counts", dist.Poisson(rate).to_event(1), obs=LOADINGS.sum(0).expand(4, 3))

    return model


def _reshaping_guide():
    concentration = pyro.param("concentration", torch.full((6,), 2.0))
    with pyro.plate("weights", 6):
        pyro.sample("weights_flat", dist.Gamma(concentration, 2.0))
    with pyro.plate("rows", 4):
        pyro.sample("factors", dist.Gamma(torch.full((4, 2), 3.0), 3.0).to_event(1))


def test_one_particle_on_every_dim_skips_the_probe(validation):
    """Nothing can move with one particle: a model that reshapes a plated latent runs, probe-free."""
    calls = []
    loss = TMC_ELBO(num_samples=1, max_plate_nesting=1).loss(_reshaping_model(calls), _reshaping_guide)
    assert torch.isfinite(torch.tensor(loss)) and calls == ["model"]


def test_one_particle_estimate_has_trace_elbos_distribution(validation):
    """At K = 1 the estimate is the single-sample ELBO: loss and gradient agree with Trace_ELBO's."""
    model = _reshaping_model([])
    draws = {}
    for name, elbo in (("tmc", TMC_ELBO(num_samples=1, max_plate_nesting=1)), ("trace", Trace_ELBO())):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        values = []
        for _ in range(300):
            loss = elbo.differentiable_loss(model, _reshaping_guide)
            (grad,) = torch.autograd.grad(loss, [pyro.param("concentration")])
            values.append(torch.cat([loss.detach().reshape(1), grad]))
        draws[name] = torch.stack(values)
    tmc, trace = draws["tmc"], draws["trace"]
    standard_error = ((tmc.var(0) + trace.var(0)) / len(tmc)).sqrt()
    assert ((tmc.mean(0) - trace.mean(0)).abs() < 4 * standard_error).all()


def test_probe_skipped_beside_an_enumerated_site(validation):
    """An enumerated site's dim holds its support, which the probe never changes: one particle still skips."""
    calls = []

    def model():
        calls.append("model")
        loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
        which = pyro.sample("which", dist.Bernoulli(0.3), infer={"enumerate": "parallel"})
        with pyro.plate("data", 3):
            pyro.sample("y", dist.Normal(loc + which, 1.0), obs=torch.tensor([0.0, 1.0, 2.0]))

    def guide():
        pyro.sample("loc", dist.Normal(0.5, 1.0))

    TMC_ELBO(num_samples=1, max_plate_nesting=1).loss(model, guide)
    assert calls == ["model"]


def test_enumerated_support_moved_onto_a_single_particle_dim_raises(validation):
    """Skipping the probe still checks the real draw: a support moved onto another latent's dim is named."""

    def model():
        loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
        which = pyro.sample("which", dist.Bernoulli(0.3), infer={"enumerate": "parallel"})
        moved = which.squeeze(-1)  # the support, dim -3 -> dim -2 (loc's)
        with pyro.plate("data", 3):
            pyro.sample("y", dist.Normal(loc + moved, 1.0), obs=torch.tensor([0.0, 1.0, 2.0]))

    def guide():
        pyro.sample("loc", dist.Normal(0.5, 1.0))

    with pytest.raises(ValueError, match="Site 'y' varies along the particle dim of latent 'loc'"):
        TMC_ELBO(num_samples=1, max_plate_nesting=1).loss(model, guide)


def _shape_asserting_model(num_samples):
    """A model that checks the particle shapes that it was promised (num_samples on each dim)."""

    def model():
        first = pyro.sample("first", dist.Normal(0.0, 1.0))
        second = pyro.sample("second", dist.Normal(first, 1.0))
        assert second.shape == (num_samples, 1, 1), second.shape
        with pyro.plate("data", 2):
            pyro.sample("y", dist.Normal(second, 1.0), obs=torch.zeros(2))

    return model


def _two_latent_guide():
    first = pyro.sample("first", dist.Normal(0.0, 1.0))
    pyro.sample("second", dist.Normal(first, 1.0))


def test_the_users_own_assert_in_the_probe_warns_and_the_run_goes_on(validation):
    elbo = TMC_ELBO(num_samples=4, max_plate_nesting=1)
    pyro.set_rng_seed(1)
    with pytest.warns(UserWarning, match="probe .* stopped after sample site 'second', with AssertionError"):
        loss = elbo.loss(_shape_asserting_model(4), _two_latent_guide)
    pyro.enable_validation(False)
    pyro.set_rng_seed(1)
    unprobed = TMC_ELBO(num_samples=4, max_plate_nesting=1).loss(_shape_asserting_model(4), _two_latent_guide)
    assert loss == unprobed  # the user's draw, whose result stands
    pyro.enable_validation(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        elbo.loss(_shape_asserting_model(4), _two_latent_guide)  # once per loss


def test_the_users_own_error_in_the_probe_warns(validation):
    """An error of the user's code with no word of shapes or sizes is no evidence either."""

    def model():
        scale = pyro.sample("scale", dist.LogNormal(0.0, 1.0))
        if scale.numel() != 4:
            raise KeyError("my lookup table has four rows")
        with pyro.plate("data", 2):
            pyro.sample("y", dist.Normal(0.0, scale), obs=torch.zeros(2))

    def guide():
        pyro.sample("scale", dist.LogNormal(0.0, 1.0))

    with pytest.warns(UserWarning, match="after sample site 'scale', with KeyError"):
        TMC_ELBO(num_samples=4, max_plate_nesting=1).loss(model, guide)


def test_particles_paired_by_an_ordinal_models_thresholds_still_raise(validation):
    """Scores' particles meet thresholds' on one dim (scores[..., None] - thresholds): evidence, kept."""

    def model():
        scores = pyro.sample("scores", dist.Normal(0.0, 1.0).expand([5]).to_event(1))
        thresholds = pyro.sample("thresholds", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        logits = (scores.unsqueeze(-1) - thresholds.sort(-1).values).sum(-1)
        with pyro.plate("items", 5):
            pyro.sample("y", dist.Bernoulli(logits=logits), obs=torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0]))

    def guide():
        pyro.sample("scores", dist.Normal(torch.zeros(5), 1.0).to_event(1))
        pyro.sample("thresholds", dist.Normal(torch.zeros(2), 1.0).to_event(1))

    with pytest.raises(ValueError, match="broadcast by hand"):
        TMC_ELBO(num_samples=4, max_plate_nesting=1).loss(model, guide)
