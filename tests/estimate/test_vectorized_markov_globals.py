"""``vectorized_markov`` chains whose steps read globals drawn at a count of their own.

The globals' particles reach every link of the chain. Where the first step shares their particle
dim (its value a ``Delta`` of an auxiliary site that also draws the globals, as
``AdaptiveProposal`` draws them), has one particle, or has another count than the later steps,
the previous steps get a particle dim of their own (:func:`needs_own_previous_dim`); sharing the
first step's would pair globals particle ``i`` with particle ``i`` of each step before. Oracle:
brute force over every particle combination of the draw (read from its traces), float64.
"""

import pytest
import torch

import pyro
import pyro.distributions as dist

from pyro_tmc import TMC_ELBO

funsor = pytest.importorskip("funsor")
from pyro.contrib.funsor import vectorized_markov  # noqa: E402

from tests.common.vectorized_chains import (  # noqa: E402
    CURRENT,
    GLOBALS_X,
    GUIDE_LOC,
    GUIDE_SCALE,
    STEP_SCALE,
    K,
    T,
    X,
    chain_brute_force,
    globals_head,
    globals_link,
    globals_model,
    guide,
    model,
)

GLOBALS_T = GLOBALS_X.shape[-1]
GLOBALS_CURRENT = f"z_{slice(1, GLOBALS_T)}"


def _log_q(site) -> torch.Tensor:
    return site["fn"].log_prob(site["value"]).reshape(-1)


def _later(draw, name: str, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    site = draw.guide_trace.nodes[name]
    return site["value"].reshape(-1, steps), site["fn"].log_prob(site["value"]).reshape(-1, steps)


def mean_field_guide(num_globals):
    """The globals at ``num_globals`` particles each (``None``: the loss's K), every step on its own."""
    infer = {} if num_globals is None else {"num_samples": num_globals}

    def guide(x):
        pyro.sample("m", dist.Normal(0.1, 0.9), infer=infer)
        pyro.sample("s", dist.LogNormal(0.0, 0.4), infer=infer)
        for t in vectorized_markov(name="time", size=x.shape[-1], dim=-1):
            pyro.sample(f"z_{t}", dist.Normal(GUIDE_LOC[t], GUIDE_SCALE[t]))

    return guide


@pytest.mark.parametrize("num_globals", [1, 2, None])
def test_globals_at_their_own_count_equal_brute_force(float64, num_globals):
    pyro.set_rng_seed(0)
    draw = TMC_ELBO(num_samples=K, max_plate_nesting=1).draw(
        globals_model, mean_field_guide(num_globals), GLOBALS_X
    )
    nodes = draw.guide_trace.nodes
    m, s, z0 = (nodes[n]["value"].reshape(-1) for n in ("m", "s", "z_0"))
    log_qm, log_qs, log_q0 = (_log_q(nodes[n]) for n in ("m", "s", "z_0"))
    heads = [
        (globals_head(m[a], s[b], z0[c], GLOBALS_X) - log_qm[a] - log_qs[b] - log_q0[c], z0[c], (m[a], s[b]))
        for a in range(len(m))
        for b in range(len(s))
        for c in range(len(z0))
    ]
    later, later_log_q = _later(draw, GLOBALS_CURRENT, GLOBALS_T - 1)
    expected = chain_brute_force(heads, later, later_log_q, globals_link(GLOBALS_X))
    assert torch.allclose(draw.log_estimate(), expected, rtol=0, atol=1e-10)


#: the auxiliary site that draws the globals and the first step jointly (an AdaptiveProposal's layout)
JOINT = "joint_globals"


def joint_guide(num_globals):
    """m, log s and z_0 one multivariate normal, unpacked by Deltas: the first step on the globals' dim."""
    infer = {"is_auxiliary": True}
    if num_globals is not None:
        infer["num_samples"] = num_globals
    loc = torch.tensor([0.2, -0.1, 0.3])
    scale_tril = torch.tensor([[0.9, 0.0, 0.0], [0.1, 0.4, 0.0], [0.5, 0.0, 0.7]])

    def guide(x):
        u = pyro.sample(JOINT, dist.MultivariateNormal(loc, scale_tril=scale_tril), infer=infer)
        pyro.sample("m", dist.Delta(u[..., 0]))
        pyro.sample("s", dist.Delta(u[..., 1].exp(), log_density=-u[..., 1]))  # the map's log-Jacobian
        for t in vectorized_markov(name="time", size=x.shape[-1], dim=-1):
            if isinstance(t, int):
                pyro.sample(f"z_{t}", dist.Delta(u[..., 2]))
            else:
                pyro.sample(f"z_{t}", dist.Normal(GUIDE_LOC[t], GUIDE_SCALE[t]))

    return guide


@pytest.mark.parametrize("num_globals", [1, 2, None])
def test_first_step_on_the_globals_dim_equals_brute_force(float64, num_globals):
    """``None``: as many globals particles as each step's, on one dim (once a wrong estimate, no error)."""
    pyro.set_rng_seed(1)
    draw = TMC_ELBO(num_samples=K, max_plate_nesting=1).draw(
        globals_model, joint_guide(num_globals), GLOBALS_X
    )
    nodes = draw.guide_trace.nodes
    m, s, z0 = (nodes[n]["value"].reshape(-1) for n in ("m", "s", "z_0"))
    log_q = sum(_log_q(nodes[n]) for n in (JOINT, "m", "s", "z_0"))
    heads = [
        (globals_head(m[i], s[i], z0[i], GLOBALS_X) - log_q[i], z0[i], (m[i], s[i])) for i in range(len(m))
    ]
    later, later_log_q = _later(draw, GLOBALS_CURRENT, GLOBALS_T - 1)
    expected = chain_brute_force(heads, later, later_log_q, globals_link(GLOBALS_X))
    assert len(heads) == (K if num_globals is None else num_globals)
    assert torch.allclose(draw.log_estimate(), expected, rtol=0, atol=1e-10)


def walk_link(context, previous, value, t):
    return dist.Normal(previous, STEP_SCALE).log_prob(value) + dist.Normal(value, 1.0).log_prob(X[t])


@pytest.mark.parametrize("first_count", [1, K + 1])
def test_different_counts_along_the_chain_equal_brute_force(float64, first_count):
    """The first step at its own count (once refused): its particles are then a batch dim of the links."""

    def uneven_guide(x):
        for t in vectorized_markov(name="time", size=x.shape[-1], dim=-1):
            infer = {"num_samples": first_count} if isinstance(t, int) else {}
            pyro.sample(f"z_{t}", dist.Normal(GUIDE_LOC[t], GUIDE_SCALE[t]), infer=infer)

    pyro.set_rng_seed(2)
    draw = TMC_ELBO(num_samples=K, max_plate_nesting=1).draw(model, uneven_guide, X)
    first = draw.guide_trace.nodes["z_0"]
    z0, log_q0 = first["value"].reshape(-1), _log_q(first)
    head = dist.Normal(0.0, STEP_SCALE).log_prob(z0) + dist.Normal(z0, 1.0).log_prob(X[0]) - log_q0
    heads = [(head[c], z0[c], None) for c in range(len(z0))]
    later, later_log_q = _later(draw, CURRENT, T - 1)
    assert len(heads) == first_count and later.shape == (K, T - 1)
    expected = chain_brute_force(heads, later, later_log_q, walk_link)
    assert torch.allclose(draw.log_estimate(), expected, rtol=0, atol=1e-10)


def test_the_first_steps_own_dim_is_shared_where_it_can_be(float64):
    """A first step on a dim of its own, at the later steps' count: the previous steps take its dim."""
    from pyro_tmc.estimate.vectorized_markov import own_previous_dim

    draw = TMC_ELBO(num_samples=K, max_plate_nesting=1).draw(model, guide, X)
    assert own_previous_dim(draw.model_trace.nodes[f"z_{slice(0, T - 1)}"]) is None
    draw = TMC_ELBO(num_samples=K, max_plate_nesting=1).draw(globals_model, joint_guide(None), GLOBALS_X)
    assert own_previous_dim(draw.model_trace.nodes[f"z_{slice(0, GLOBALS_T - 1)}"]) is not None
