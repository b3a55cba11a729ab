"""The vocabulary of sites (pyro_tmc.poutine.sites) and the packed-layout view (ops.shapes.packed_view)."""

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro import poutine

from pyro_tmc import TMC_ELBO
from pyro_tmc.ops.shapes import packed_view
from pyro_tmc.poutine.sites import (
    is_delta,
    is_latent,
    is_marked_for_exact_sum,
    is_point_mass,
    is_summed_exactly,
    latent_names,
    particle_symbol,
    source_weights,
)


def test_packed_view_orders_dims_and_adds_unit_dims():
    term = torch.arange(6.0).reshape(2, 3)
    term._pyro_dims = "ab"
    view = packed_view(term, "bca")
    assert view.shape == (3, 1, 2)
    for i in range(2):
        for j in range(3):
            assert view[j, 0, i] == term[i, j]
    assert view.data_ptr() == term.data_ptr()  # a view, no copy


def test_packed_view_leaves_an_empty_slot_at_size_one():
    """An unplated slot is named "" (posterior read-outs); "" is in every string, yet holds no dim."""
    term = torch.arange(6.0).reshape(2, 3)
    term._pyro_dims = "ab"
    view = packed_view(term, ["b", "", "a"])
    assert view.shape == (3, 1, 2)
    assert torch.equal(view[:, 0, :], term.T)


def test_source_weights_divide_by_the_carried_scale():
    sources = {"a": torch.zeros(3), "b": torch.zeros(2)}
    grads = [torch.tensor([2.0, 4.0, 6.0]), None]
    weights = source_weights(sources, grads, {"a": 2.0, "b": 5.0}.__getitem__)
    assert torch.equal(weights["a"], torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(weights["b"], torch.zeros(2))  # a source that did not reach the estimate


def test_is_delta_sees_through_wrappers():
    delta = dist.Delta(torch.zeros(3))
    assert is_delta(delta.to_event(1))
    assert is_delta(delta.mask(torch.tensor([True, False, True])))
    assert is_delta(dist.Delta(torch.tensor(0.0)).expand([4]))
    assert not is_delta(dist.Normal(0.0, 1.0))


def test_marked_for_exact_sum_needs_flag_support_and_no_num_samples():
    def msg(fn, **infer):
        return {"fn": fn, "infer": infer}

    bernoulli = dist.Bernoulli(0.3)
    assert is_marked_for_exact_sum(msg(bernoulli, enumerate="parallel"))
    assert is_marked_for_exact_sum(msg(bernoulli, enumerate="sequential"))
    assert not is_marked_for_exact_sum(msg(bernoulli, enumerate="parallel", num_samples=4))
    assert not is_marked_for_exact_sum(msg(bernoulli))
    assert not is_marked_for_exact_sum(msg(dist.Normal(0.0, 1.0), enumerate="parallel"))


def _model():
    c = pyro.sample("c", dist.Bernoulli(0.4), infer={"enumerate": "parallel"})
    z = pyro.sample("z", dist.Normal(c.float(), 1.0))
    d = pyro.sample("d", dist.Delta(z + 1.0))
    pyro.sample("x", dist.Normal(d, 1.0), obs=torch.tensor(0.5))


def _guide():
    pyro.sample("z", dist.Normal(0.0, 1.0))


@pytest.mark.filterwarnings("ignore:Found vars in model but not guide")  # the model's own Delta
def test_predicates_on_a_drawn_model_trace():
    pyro.clear_param_store()
    draw = TMC_ELBO(num_samples=3, max_plate_nesting=0).draw(_model, _guide)
    nodes = draw.model_trace.nodes
    assert latent_names(draw.model_trace) == ["c", "z", "d"]
    assert not is_latent(nodes["x"])
    assert is_summed_exactly(nodes["c"]) and not is_summed_exactly(nodes["z"])
    assert is_point_mass(nodes["d"]) and not is_point_mass(nodes["z"])
    symbols = {particle_symbol(nodes[name]) for name in ("c", "z")}
    assert len(symbols) == 2  # each latent its own packed dim


def test_latent_names_in_a_plain_trace():
    trace = poutine.trace(_model).get_trace()
    assert latent_names(trace) == ["c", "z", "d"]
