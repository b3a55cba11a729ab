"""Graphs recorded on real tensors: each replays its function, or the step is traced instead.

:mod:`pyro_tmc.compile.recording` must give a graph that computes what the function
computes on other inputs and other draws (in-place writes, views, multi-output operations,
constants, grad modes, autograd's backward kept), leave the eager state as it was, and refuse
whatever a recording could get wrong (a value read into Python, a tensor from outside), so
that ``make_fx`` decides.
"""

import logging

import pytest
import torch

import pyro

from pyro_tmc import TMC_ELBO
from pyro_tmc.compile.forward_trace import InGradModes, runs_without_grad, with_gradients
from pyro_tmc.compile.recording import record
from tests.common.compile_cases import assert_same_step, chain_guide, chain_model, replay_and_eager

RNG = (torch.get_rng_state, torch.set_rng_state)


def _step(p, x):
    """In-place writes, a view, a multi-output operation, a constant, a draw, a no-grad part."""
    y = (p * x).exp()
    buffer = torch.zeros(3, 4)
    buffer[:, 0] = y  # a write into a slice of a fresh buffer
    buffer.add_(1.0)
    largest, where = buffer.max(dim=1)  # two outputs
    noise = torch.randn(3)
    with torch.no_grad():
        stopped = p * torch.tensor(3.0)  # a constant; the eager step does not differentiate this
    loss = (largest * stopped + noise).sum() + where.sum() + y[1:].sum()
    return loss, torch.zeros((), dtype=torch.bool)


def test_recorded_graph_replays_the_step_on_other_inputs_and_draws():
    p, x = torch.randn(3, requires_grad=True), torch.randn(3)
    recording = record(_step, [p, x], num_params=1, rng=RNG)
    assert recording.refused is None
    graph = recording.graph
    assert any(runs_without_grad(n) and n.target is torch.ops.aten.mul.Tensor for n in graph.graph.nodes)
    assert all("val" in n.meta for n in graph.graph.nodes if n.op == "call_function")
    for seed in range(3):
        p2, x2 = torch.randn(3), torch.randn(3)
        torch.manual_seed(seed)
        expected, _ = _step(p2, x2)
        torch.manual_seed(seed)
        replayed, underflow = InGradModes(graph).run(p2, x2)
        assert torch.allclose(replayed, expected, rtol=1e-6)
        assert not underflow


def test_recorded_gradients_are_autograds_on_other_inputs():
    """``with_gradients`` recorded: autograd's backward as it ran, the no-grad part left out."""
    scale = torch.tensor([1.0, 2.0, 3.0])  # a constant of a graph, read by its runner

    def forward(p, x):
        loss, underflow = _step(p, x)
        return loss + (scale * p).sum(), underflow

    p, x = torch.randn(3, requires_grad=True), torch.randn(3)
    assert (
        record(with_gradients(forward, 1), [p, x], num_params=1, rng=RNG).graph is None
    )  # scale: from outside
    recording = record(with_gradients(forward, 1), [p, x], num_params=1, rng=RNG, constants=[scale])
    assert recording.refused is None
    p2, x2 = torch.randn(3), torch.randn(3)
    torch.manual_seed(1)
    with torch.no_grad():
        loss, _, grad = recording.graph(p2, x2)
    leaf = p2.clone().requires_grad_()
    torch.manual_seed(1)
    expected, _ = forward(leaf, x2)
    (expected_grad,) = torch.autograd.grad(expected, leaf)
    assert torch.allclose(loss, expected.detach(), rtol=1e-6)
    assert torch.allclose(grad, expected_grad, rtol=1e-6)


def test_recording_leaves_inputs_and_random_state_as_they_were():
    def writes_its_input(p, x):
        x.mul_(2.0)
        return (p * x + torch.randn(3)).sum(), torch.zeros((), dtype=torch.bool)

    p, x = torch.randn(3, requires_grad=True), torch.randn(3)
    x_before, state = x.clone(), torch.get_rng_state()
    recording = record(writes_its_input, [p, x], num_params=1, rng=RNG)
    assert recording.graph is not None
    assert torch.equal(x, x_before)
    assert torch.equal(torch.get_rng_state(), state)


outside = torch.randn(3)


@pytest.mark.parametrize(
    "read",
    [
        lambda p: p.sum().item() * p,  # a value read by an aten operation
        lambda p: p * 2.0 if p.sum() > 0 else p,  # a branch on a value
        lambda p: torch.tensor(p.tolist()) * p,  # a value read without one
        lambda p: p * outside,  # a tensor from outside the step
        lambda p: torch.cond(p.sum() > 0, lambda q: q * 2.0, lambda q: q * 3.0, (p,)),  # a higher-order op
    ],
    ids=["item", "branch", "tolist", "closure", "cond"],
)
def test_what_a_recording_could_get_wrong_is_refused(read):
    def step(p):
        return read(p).sum(), torch.zeros((), dtype=torch.bool)

    recording = record(step, [torch.randn(3, requires_grad=True)], num_params=1, rng=RNG)
    assert recording.graph is None and recording.refused


@pytest.mark.slow
def test_captured_chain_is_recorded_and_equals_the_eager_step(caplog):
    """A 30-link chain (rolled): its forward is recorded, and its replay is the eager step's."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    make_loss = lambda **kw: TMC_ELBO(num_samples=4, max_plate_nesting=0, **kw)  # noqa: E731
    with caplog.at_level(logging.DEBUG, logger="pyro_tmc.compile.recording"):
        replayed, eager = replay_and_eager(make_loss, chain_model, chain_guide, (torch.tensor(0.3), 30))
    assert not [r for r in caplog.records if "not recorded" in r.getMessage()]
    assert_same_step(replayed, eager)
