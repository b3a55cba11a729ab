"""AutoGuides and plain-loop guides on pyro.markov chains: particle dims recycled along the model's chain.

A guide that samples a chain's sites outside pyro.markov (AutoNormal does) used to give each site a
particle dim of its own, and ran out of dims past ~60 steps. Now its dims follow the model's markov
structure (pyro_tmc.infer.chain_plan), and the estimate is the one a hand-written mean-field guide
with pyro.markov gives on the same draws.
"""

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro.infer.autoguide import AutoDelta, AutoNormal

from pyro_tmc import TMC_ELBO
from pyro_tmc.infer.draw import DrawSettings, TMCDraw
from pyro_tmc.poutine.chain_dims import ChainDims, ChainDimsConflict

SCALE = 0.15  # every guide's scale


def random_walk(y, markov=True):
    x = torch.zeros(())
    for t in pyro.markov(range(len(y))):
        x = pyro.sample(f"x_{t}", dist.Normal(x, 0.1))
        pyro.sample(f"y_{t}", dist.Normal(x, 0.2), obs=y[t])


def markov_guide(y):
    """The hand-written mean-field guide, with pyro.markov."""
    loc = pyro.param("loc", y.clone)
    for t in pyro.markov(range(len(y))):
        pyro.sample(f"x_{t}", dist.Normal(loc[t], SCALE))


def plain_loop_guide(y):
    """The same guide, written as a plain loop."""
    loc = pyro.param("loc", y.clone)
    for t in range(len(y)):
        pyro.sample(f"x_{t}", dist.Normal(loc[t], SCALE))


def coupled_guide(y, markov):
    """A guide in which each step's proposal depends on the one before."""
    h = 0.0
    for t in pyro.markov(range(len(y))) if markov else range(len(y)):
        h = pyro.sample(f"x_{t}", dist.Normal(0.5 * y[t] + 0.3 * h, 0.2))


def auto_normal(y):
    """AutoNormal with the hand-written guide's locations and scale: the same draws."""
    guide = AutoNormal(random_walk, init_loc_fn=lambda site: y[int(site["name"][2:])], init_scale=SCALE)
    guide(y)
    return guide


def walk(length: int) -> torch.Tensor:
    return torch.randn(length, generator=torch.Generator().manual_seed(length)).cumsum(0) * 0.1


def losses(guide, y, steps=3, **elbo_kwargs):
    """The loss and the gradient of the chain's locations, for seeds 0..steps-1, from one loss object."""
    elbo = TMC_ELBO(num_samples=4, max_plate_nesting=0, **elbo_kwargs)
    values, grads = [], []
    for seed in range(steps):
        pyro.set_rng_seed(seed)
        values.append(elbo.loss_and_grads(random_walk, guide, y))
        grads.append(_location_grad(guide, y))
    return torch.tensor(values), torch.stack(grads)


def _location_grad(guide, y) -> torch.Tensor:
    """The gradient of each step's location (cleared after reading)."""
    if isinstance(guide, AutoNormal):
        params = [getattr(guide.locs, f"x_{t}") for t in range(len(y))]
        grad = torch.stack([p.grad.clone() for p in params])
        for p in params:
            p.grad = None
        return grad
    param = pyro.param("loc").unconstrained()
    grad = param.grad.clone()
    param.grad = None
    return grad


@pytest.mark.parametrize("length", [100, 1000])
def test_auto_normal_equals_markov_guide(length):
    y = walk(length)
    pyro.clear_param_store()
    expected, expected_grads = losses(markov_guide, y)
    pyro.clear_param_store()
    got, got_grads = losses(auto_normal(y), y)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-3), (got, expected)
    assert torch.allclose(got_grads, expected_grads, rtol=1e-4, atol=1e-4)


def test_auto_normal_equals_markov_guide_captured():
    y = walk(100)
    pyro.clear_param_store()
    expected, _ = losses(markov_guide, y, steps=4)
    pyro.clear_param_store()
    got, _ = losses(auto_normal(y), y, steps=4, compile="graph")
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-3), (got, expected)


@pytest.mark.parametrize("length", [20, 100])
def test_plain_loop_guide_equals_markov_guide(length):
    """A short chain too: its first draw has a dim per site, the later ones recycle them."""
    y = walk(length)
    pyro.clear_param_store()
    expected, expected_grads = losses(markov_guide, y)
    pyro.clear_param_store()
    got, got_grads = losses(plain_loop_guide, y)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-3), (got, expected)
    assert torch.allclose(got_grads, expected_grads, rtol=1e-4, atol=1e-4)


def test_plain_loop_recycles_dims():
    y = walk(30)
    elbo = TMC_ELBO(num_samples=4, max_plate_nesting=0)
    pyro.clear_param_store()
    elbo.loss(random_walk, plain_loop_guide, y)  # the first draw decides the plan
    draw = elbo.draw(random_walk, plain_loop_guide, y)
    dims = {
        site["infer"]["_enumerate_dim"]
        for site in draw.guide_trace.nodes.values()
        if "_tmc_draw" in site.get("infer", {})
    }
    assert len(dims) == 2


def test_coupled_short_chain_falls_back():
    """A plain-loop guide that reads the step before cannot share recycled dims: allocated as before."""
    y = walk(6)
    estimates = {}
    for markov in (True, False):
        elbo = TMC_ELBO(num_samples=4, max_plate_nesting=0)
        values = []
        for seed in range(3):
            pyro.set_rng_seed(seed)
            values.append(elbo.loss(random_walk, coupled_guide, y, markov=markov))
        estimates[markov] = torch.tensor(values)
    assert torch.allclose(estimates[False], estimates[True], rtol=1e-5, atol=1e-4)


def test_coupled_long_chain_says_what_to_write():
    y = walk(100)
    elbo = TMC_ELBO(num_samples=4, max_plate_nesting=0)
    with pytest.raises(ValueError, match=r"(?s)x_64.*outside pyro.markov.*'x_3' reads a latent.*pyro.markov"):
        elbo.loss(random_walk, coupled_guide, y, markov=False)


def test_a_plan_that_pairs_two_latents_is_refused():
    """The model's check: x_1 on x_0's dim would pair their particles, silently."""
    y = walk(4)
    wrong = ChainDims({f"x_{t}": -1 for t in range(4)})
    settings = DrawSettings(4, "mixture", 0, chain_dims=wrong)
    pyro.clear_param_store()
    with pytest.raises(ChainDimsConflict, match="Model site 'x_1'"):
        TMCDraw.run(random_walk, plain_loop_guide, (y,), {}, settings)


def test_auto_delta_on_a_long_chain():
    """Point masses carry no particle dim: nothing to recycle, and nothing changes."""
    y = walk(100)
    pyro.clear_param_store()
    loss = TMC_ELBO(num_samples=4, max_plate_nesting=0).loss(random_walk, AutoDelta(random_walk), y)
    assert torch.isfinite(torch.tensor(loss))


def _global_after_chain(markov_guide: bool):
    """A chain step with one particle, then a global the chain reads: the global must not take its dim."""

    def model():
        g = pyro.sample("g", dist.Normal(-0.3, 0.3))
        for t in pyro.markov(range(1)):
            h = pyro.sample(f"h_{t}", dist.Normal(0.64 * g, 0.5))
        pyro.sample("y", dist.Normal(h, 0.5), obs=torch.tensor(1.0))

    def guide():
        for t in pyro.markov(range(1)) if markov_guide else range(1):
            pyro.sample(f"h_{t}", dist.Normal(0.0, 0.95), infer={"num_samples": 1})
        pyro.sample("g", dist.Normal(0.0, 1.0))

    return model, guide


@pytest.mark.parametrize("validate", [True, False])
def test_one_particle_chain_site_keeps_its_dim(validate):
    """Found by the budget fuzz family (seed 51205): g took h_0's dim, an error or a silently other value."""
    values = {}
    with pyro.validation_enabled(validate):
        for markov_guide in (True, False):
            model, guide = _global_after_chain(markov_guide)
            pyro.set_rng_seed(0)
            values[markov_guide] = TMC_ELBO(num_samples=2, max_plate_nesting=0).loss(model, guide)
    assert values[True] == pytest.approx(values[False], rel=1e-6)
