"""Loop rolling: a captured step's repeated blocks batched, with the same values and gradients.

Rolled without batching the random draws, a graph draws the same numbers from the
same generator state as the graph it came from, so the two must agree to float
precision (the only change is the order of additions). With the draws batched (the
default), the rolled step draws from the same distribution: its estimate must stay
unbiased.
"""

import math
import warnings

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.distributions import constraints

from pyro_tmc import TMC_ELBO, TMC_RWS
from pyro_tmc.compile.captured_step import (
    ROLLED_FROM,
    batches_draws,
    capture_step,
    flatten_arguments,
    unconstrained_parameters,
)
from pyro_tmc.compile.loop_rolling import (
    LARGE_MEMBER,
    MAX_SELECTED_MEMBERS,
    _Batched,
    collapse_sum_chains,
    count_operations,
    drop_replay_copies,
    merge_repeated_zeros,
    narrow_unbinds,
    roll,
)
from tests.common.compile_cases import cases, chain_guide, chain_model


def _captured(loss, model, guide, args):
    """The whole-step graph of ``loss`` on ``model`` / ``guide``, and its inputs."""
    loss.loss_and_grads(model, guide, *args)  # creates the parameters
    names = list(pyro.get_param_store().keys())
    arguments, _, rebuild = flatten_arguments(args, {})
    graph = capture_step(
        lambda *a, **k: loss.differentiable_loss(model, guide, *a, **k), names, arguments, rebuild
    ).program
    graph.graph.eliminate_dead_code()
    graph.recompile()
    return graph, unconstrained_parameters(names) + arguments


def _same_outputs(graph, rolled, inputs, rtol=1e-5):
    state = torch.get_rng_state()
    expected = graph(*inputs)
    torch.set_rng_state(state)
    actual = rolled(*inputs)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        if e.dtype == torch.bool:
            assert torch.equal(a, e)
        else:
            assert torch.allclose(a, e, rtol=rtol, atol=rtol * max(1.0, e.abs().max().item()))


@pytest.mark.parametrize("case", list(cases()))
@pytest.mark.parametrize("variance_reduction", [None, "stl", "dregs"])
def test_rolled_graph_equals_captured_graph(case, variance_reduction):
    if variance_reduction == "dregs" and case == "non_factorised":
        pytest.skip("DReGs refuses a non-factorised guide (tests/test_estimators.py)")
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model, guide, args, nesting = cases()[case]
    loss = TMC_ELBO(num_samples=4, max_plate_nesting=nesting, variance_reduction=variance_reduction)
    graph, inputs = _captured(loss, model, guide, args)
    _same_outputs(graph, roll(graph, inputs, batch_draws=False), inputs)


def test_long_chain_rolls_to_a_size_that_does_not_grow_with_its_length():
    sizes = {}
    for length in (24, 96):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        loss = TMC_ELBO(num_samples=8, max_plate_nesting=0)
        graph, inputs = _captured(loss, chain_model, chain_guide, (torch.tensor(0.3), length))
        unrolled = count_operations(graph)
        _same_outputs(graph, roll(graph, inputs, batch_draws=False), inputs)
        sizes[length] = (unrolled, count_operations(roll(graph, inputs, batch_draws=True)))
    (short_unrolled, short_rolled), (long_unrolled, long_rolled) = sizes[24], sizes[96]
    assert long_unrolled > 2.5 * short_unrolled, sizes  # the unrolled graph grows with the chain
    # the rolled one (draws batched) by the contraction tree's two more levels only (~100 operations
    # each: a product, its repair, and their backward)
    assert long_rolled < short_rolled + 250 and long_rolled < long_unrolled / 3, sizes


def _draws(graph) -> int:
    return sum(
        isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags
        for n in graph.graph.nodes
    )


@pytest.mark.parametrize("num_samples", [16, 12])
def test_like_normal_draws_batch_where_the_numbers_stay_the_same(num_samples):
    """
    Rolled without ``batch_draws``, a run of like normal draws on the CPU becomes one
    draw where each holds a multiple of 16 numbers (torch fills normal tensors 16 at
    a time, so the stacked draw continues where each would); the others stay one by one.
    Either way the rolled graph draws the unrolled graph's numbers.
    """
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    loss = TMC_ELBO(num_samples=num_samples, max_plate_nesting=0)
    graph, inputs = _captured(loss, chain_model, chain_guide, (torch.tensor(0.3), 24))
    rolled = roll(graph, inputs, batch_draws=False)
    _same_outputs(graph, rolled, inputs)
    if num_samples % 16 == 0:
        assert _draws(rolled) <= 2 and _draws(graph) >= 24
    else:
        assert _draws(rolled) == _draws(graph) >= 24


def test_mutations_keep_their_order():
    """Writes into slices of a buffer, between reads of it, at one level of the graph."""

    def step(x, y):
        buffer = x.new_zeros(4, 3)
        parts = [x[i] * 2.0 for i in range(4)]  # four like operations: one group
        buffer[0].copy_(parts[0])
        first = buffer.sum()  # reads the buffer between two writes
        buffer[1:3] += torch.stack(parts[1:3])
        second = (buffer * y).sum()
        buffer[3].copy_(parts[3] + first)
        return first, second, buffer.clone(), torch.randn(3) + torch.randn(3)

    x, y = torch.randn(4, 3), torch.randn(4, 3)
    graph = make_fx(step, tracing_mode="fake")(x, y)
    _same_outputs(graph, roll(graph, [x, y], batch_draws=False), [x, y])
    torch.manual_seed(0)
    expected = step(x, y)
    torch.manual_seed(0)
    for a, e in zip(roll(make_fx(step, tracing_mode="fake")(x, y), [x, y])(x, y)[:3], expected[:3]):
        assert torch.allclose(a, e)


def test_indexing_backwards_of_several_dims_roll_at_their_own_index():
    """
    ``select_backward`` / ``slice_backward`` take the input's sizes as a list: rolling reads
    the index (and slice bounds) of each member by argument, not at a flattened position,
    which would name one of the sizes (a gradient scattered into the wrong row, silently).
    """
    aten = torch.ops.aten

    def step(x, y):
        # like operations at one level, at one index: rolling batches each kind into one group
        rows = [aten.select_backward(x[i] * 2.0, [4, 3, 2], 0, 1) for i in range(5)]
        slices = [aten.slice_backward(y[i] * 2.0, [4, 2], 0, 1, 3, 1) for i in range(5)]
        return torch.stack(rows), torch.stack(slices)

    x, y = torch.randn(5, 3, 2), torch.randn(5, 2, 2)
    graph = make_fx(step, tracing_mode="fake")(x, y)
    rolled = roll(graph, [x, y], batch_draws=False)
    assert count_operations(rolled) < count_operations(graph)
    _same_outputs(graph, rolled, [x, y])


def test_a_join_of_group_members_and_tensors_of_other_lengths_rolls():
    """A ``cat`` of a group's members with two loose tensors of unequal lengths (fuzz case 487)."""

    def step(x, y, z):
        parts = [x[i] * 2.0 for i in range(6)]  # like operations: one group
        return torch.cat(parts + [y * 3.0, z * 4.0])

    inputs = [torch.randn(6, 3), torch.randn(2), torch.randn(1)]
    graph = make_fx(step, tracing_mode="fake")(*inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _same_outputs(graph, roll(graph, inputs, batch_draws=False), inputs)


def test_a_collapsed_sum_chain_knows_its_stacks_length():
    """
    Two chains of additions, of 3 and 5 terms, become ``stack(...).sum(0)``; each new stack
    carries its own value, so grouping does not take the two (of unequal lengths) as alike.
    """

    def step(x):
        short = x[0] + x[1] + x[2]
        long = x[3] + x[4] + x[5] + x[6] + x[7]
        return short, long

    graph = make_fx(step, tracing_mode="fake")(torch.randn(8, 3))
    assert collapse_sum_chains(graph.graph) == 2
    stacks = [n for n in graph.graph.nodes if n.target is torch.ops.aten.stack.default]
    assert sorted(tuple(n.meta["val"].shape) for n in stacks) == [(3, 3), (5, 3)]


def test_repeated_zeros_merge_unless_written_or_returned():
    """
    Like ``zeros([]).expand(shape)`` (autograd's zero gradients) become one node and give the
    same values; a zeros written into, or one an output views, keeps its own memory.
    """
    aten = torch.ops.aten

    def step(x):
        sums = [aten.zeros.default([]).expand([3]) + x[i] for i in range(4)]  # four like pairs: one
        written = aten.zeros.default([])
        written.add_(x[0, 0])  # a write: not merged with the others
        returned = aten.zeros.default([]).expand([3])  # an output views it: not merged
        return torch.stack(sums), written + 1.0, returned

    x = torch.randn(4, 3)
    graph = make_fx(step, tracing_mode="fake")(x)
    expected = graph(x)

    def count(target):
        return sum(node.target is target for node in graph.graph.nodes)

    assert count(aten.zeros.default) == 6
    assert merge_repeated_zeros(graph.graph) == 6  # three zeros and three expands
    graph.recompile()
    assert count(aten.zeros.default) == 3 and count(aten.expand.default) == 2
    for got, want in zip(graph(x), expected):
        assert torch.equal(got, want)


def test_copies_only_read_are_dropped_unless_written_or_returned():
    """
    A copy of a constant, or a detach, whose value is only read becomes its operand (the values
    are the same); one written into (through a view too), or returned, stays.
    """
    aten = torch.ops.aten

    def step(x):
        index = torch.tensor([2, 0])  # a constant's copy, only read
        read = x.index_select(0, index).detach().exp()  # a detach, only read
        written = torch.tensor([1.0, 2.0])  # a constant's copy written into: stays
        written.add_(x[0])
        viewed = x.detach()  # written through a view: stays
        viewed.view(-1).mul_(1.0)
        return read + written, x[0].detach()  # a detach returned: stays

    x = torch.randn(3, 2)
    graph = make_fx(step)(x)

    def count(target):
        return sum(node.target is target for node in graph.graph.nodes)

    copies, detaches = count(aten.lift_fresh_copy.default), count(aten.detach.default)
    assert copies == 2 and detaches == 3, graph.code
    expected = graph(x.clone())
    assert drop_replay_copies(graph.graph) == 2  # the index's copy, the detach before exp
    graph.recompile()
    assert count(aten.lift_fresh_copy.default) == 1 and count(aten.detach.default) == 2
    for got, want in zip(graph(x.clone()), expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("read", [[0, 37], list(range(40))])
def test_an_unbind_read_at_a_few_rows_becomes_their_selects(read):
    """
    An ``unbind`` of 64 rows of which two are read is their two ``select``: the same values and
    gradients, without 62 unread outputs (and their zero gradients in the backward). One of
    which most rows are read stays an ``unbind``.
    """
    aten = torch.ops.aten

    def step(x):
        rows = (x * 2.0).unbind(0)
        return torch.stack([rows[i] * (i + 1) for i in read]).sum()

    x = torch.randn(64, 3)
    graph = make_fx(step, tracing_mode="fake")(x)
    narrowed = make_fx(step, tracing_mode="fake")(x)
    few = len(read) <= MAX_SELECTED_MEMBERS
    assert narrow_unbinds(narrowed.graph) == (1 if few else 0)
    narrowed.recompile()
    targets = [node.target for node in narrowed.graph.nodes]
    assert (aten.unbind.int in targets) is not few
    assert targets.count(aten.select.int) == (len(read) if few else 0)
    grads = []
    for module in (graph, narrowed):
        leaf = x.clone().requires_grad_()
        value = module(leaf)
        grads.append((value, *torch.autograd.grad(value, leaf)))
    for got, want in zip(grads[1], grads[0]):
        assert torch.equal(got, want)


def test_a_few_members_of_a_large_group_are_selected_then_it_is_unbound():
    """
    A batched group's members read one by one: by a ``select`` each while at most
    ``MAX_SELECTED_MEMBERS`` (and an eighth of the group) are read, then by one ``unbind`` for
    the rest; a member read before keeps its value.
    """
    stacked = torch.randn(80, 3, requires_grad=True) * 1.0
    batched = _Batched(stacked, 80)
    first = [batched.member(i) for i in range(MAX_SELECTED_MEMBERS)]
    assert all(type(row.grad_fn).__name__ == "SelectBackward0" for row in first)
    assert batched.member(0) is first[0]
    later = batched.member(MAX_SELECTED_MEMBERS)
    assert type(later.grad_fn).__name__ == "UnbindBackward0"
    assert batched.member(3) is first[3]
    for index in range(80):
        assert torch.equal(batched.member(index), stacked[index])
    small = _Batched(torch.randn(4, 2, requires_grad=True) * 1.0, 4)  # a small group: unbound at once
    assert type(small.member(1).grad_fn).__name__ == "UnbindBackward0"


def test_gradients_vmap_cannot_batch_run_one_by_one(capfd):
    """
    vmap has no batching rule for a Gamma's or a Dirichlet's reparameterised gradient: batched,
    it loops itself and prints a warning to the terminal at every capture. They run one by one.
    """
    aten = torch.ops.aten

    def step(x, alpha):
        return torch.stack([aten._standard_gamma_grad(x[i] * 2.0, alpha[i] + 1.0) for i in range(5)])

    inputs = [torch.rand(5, 3) + 0.1, torch.rand(5, 3)]
    graph = make_fx(step, tracing_mode="fake")(*inputs)
    _same_outputs(graph, roll(graph, inputs, batch_draws=False), inputs)
    assert "batching rule" not in capfd.readouterr().err


@pytest.mark.parametrize("per_member_source", [True, False], ids=["own_source", "shared_source"])
def test_copies_into_fresh_tensors_roll_without_vmap_fallback(capfd, per_member_source):
    """
    ``empty().copy_(x)`` becomes ``copy(empty, x)`` (:func:`replace_fresh_fills`), which vmap has
    no rule for: batched, it printed "There is a performance drop..." (fuzz case 4697, a stiff
    chain under DReGs). Rolled by its own rule: broadcast, cast to the fresh tensor's dtype.
    """

    def step(x):
        copies = []
        for i in range(5):
            source = x[i] * 2.0 if per_member_source else x[0]
            copies.append(x.new_empty((2, 3), dtype=torch.float64).copy_(source) + i)
        return torch.stack(copies).sum(0), torch.stack(copies)

    inputs = [torch.randn(5, 3)]
    graph = make_fx(step, tracing_mode="fake")(*inputs)
    rolled = roll(graph, inputs, batch_draws=False)
    _same_outputs(graph, rolled, inputs)
    assert "performance drop" not in capfd.readouterr().err


def test_log_sigmoid_backward_with_a_shared_gradient_rolls_without_resizing(capfd):
    """
    vmap's rule for ``log_sigmoid_backward`` with a shared ``grad_output`` called the kernel on
    unexpanded operands: every replay printed "An output with one or more elements was resized"
    (fuzz case 5508: Dirichlet sites under an AutoMultivariateNormal).
    """
    aten = torch.ops.aten

    def step(grad, x):
        results = []
        for i in range(5):
            _, buffer = aten.log_sigmoid_forward(x[i] * 2.0)
            results.append(aten.log_sigmoid_backward(grad, x[i] * 2.0, buffer))
        return (torch.stack(results),)

    inputs = [torch.randn(4, 2), torch.randn(5, 4, 2)]
    graph = make_fx(step, tracing_mode="fake")(*inputs)
    rolled = roll(graph, inputs, batch_draws=False)
    assert count_operations(rolled) < count_operations(graph)
    _same_outputs(graph, rolled, inputs)
    assert "resized" not in capfd.readouterr().err


def test_a_view_of_a_rolled_value_with_other_strides_rolls():
    """
    A ``view`` whose input, read from a batched group, has other strides than the trace's
    (fuzz case 1559: a history-2 chain under TMC_RWS) is a reshape there: the step rolls.
    """
    y = torch.linspace(-0.5, 0.5, 12)

    def model(y):
        with poutine.scale(scale=0.5):
            g = pyro.sample("g", dist.Bernoulli(0.58))
            prev1 = prev2 = None
            for t in pyro.markov(range(12), history=2):
                loc = -0.71 + 0.76 * g
                loc = loc if prev1 is None else loc + prev1
                loc = loc if prev2 is None else loc + 0.49 * prev2
                h = pyro.sample(f"h_{t}", dist.Normal(loc, 0.01))
                pyro.sample(f"y_{t}", dist.Normal(-0.22 - 0.27 * h, 0.005), obs=y[t])
                prev1, prev2 = h, prev1

    def guide(y):
        pyro.sample(
            "g", dist.Bernoulli(pyro.param("p", torch.tensor(0.58), constraint=constraints.unit_interval))
        )
        loc = pyro.param("loc", torch.linspace(-0.8, 0.3, 12))
        for t in range(12):
            pyro.sample(f"h_{t}", dist.Normal(loc[t], 0.3))

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    loss = TMC_RWS(num_samples=8, proposal="diagonal", max_plate_nesting=0, compile="graph")
    loss.step_program.roll_above = 0  # roll this small step
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*could not roll")
        for _ in range(2):
            loss.loss_and_grads(model, guide, y)
    assert loss.step_program.captures == 1


def _largest_join(graph) -> int:
    joins = (torch.ops.aten.stack.default, torch.ops.aten.cat.default)
    return max((len(n.args[0]) for n in graph.graph.nodes if n.target in joins), default=0)


def test_copies_of_one_value_are_not_stacked_one_by_one():
    """
    A fill made at each step of a loop (a group whose inputs are all shared) gives each
    member the same tensor. Read by a later group, or stacked with a few others, it is
    expanded or indexed, not stacked member by member: inductor made a kernel of one
    argument per member of such a stack (Fig. 4's 1,000-link chain: ~1,000).
    """

    def step(x):
        zeros = [x.new_zeros(3) for _ in range(40)]  # one group: the same tensor for all 40
        shifted = [z + x[i] for i, z in enumerate(zeros)]  # reads it
        first = x.new_ones(3)
        stacked = torch.stack([first] + [x.new_zeros(3) for _ in range(40)], dim=1)
        joined = torch.cat([x.new_full((2, 3), 2.0) for _ in range(40)] + [first.expand(2, 3)], dim=1)
        return torch.stack(shifted), stacked, joined

    x = torch.randn(40, 3)
    graph = make_fx(step, tracing_mode="fake")(x)
    rolled = roll(graph, [x])
    assert _largest_join(graph) == 41 and _largest_join(rolled) <= 2
    _same_outputs(graph, rolled, [x])
    assert all(t.is_contiguous() for t in rolled(x))  # fresh tensors, as a stack's


def _joined_elements(graph) -> int:
    """How many elements the graph's ``stack`` and ``cat`` operations copy."""
    joins = [
        n for n in graph.graph.nodes if n.target in (torch.ops.aten.stack.default, torch.ops.aten.cat.default)
    ]
    return sum(n.meta["val"].numel() for n in joins)


def test_a_few_large_operations_run_one_by_one():
    """
    Two or three like operations on large tensors (a log-depth tree's two operands of
    a product, the terms of a short gradient sum) are not stacked to run as one: the
    stack would copy them. Many small ones still are.
    """
    large = LARGE_MEMBER + 1

    def step(x, y, small):
        pair = [x[0].exp(), x[1].exp()]  # like operations, large and few
        total = pair[0] * y + pair[1] * y + y.sin()  # a short sum of large terms
        loop = [small[i].exp() for i in range(40)]  # many small: batched
        return total, torch.stack(loop).sum()

    x, y, small = torch.randn(2, large), torch.randn(large), torch.randn(40, 3)
    graph = make_fx(step, tracing_mode="fake")(x, y, small)
    rolled = roll(graph, [x, y, small])
    _same_outputs(graph, rolled, [x, y, small])
    assert count_operations(rolled) < count_operations(graph)  # the loop was rolled
    assert _joined_elements(rolled) < large  # but nothing large was stacked


def test_batched_draws_keep_the_estimate_unbiased():
    """The rolled step, with its draws batched, on a chain whose p(x) is known: z_N ~ N(0, 1)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    x, length = torch.tensor(0.8, dtype=torch.float64), 12

    def guide(x, N):
        for i in pyro.markov(range(1, N + 1)):
            pyro.sample(f"z_{i}", dist.Normal(x.new_zeros(()), math.sqrt(i / N)))

    loss = TMC_ELBO(num_samples=6, max_plate_nesting=0, compile="graph")
    program = loss.step_program
    program.roll_above, program.choose_faster, program.batch_draws = 0, False, True
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # rolled and replayed, no fallback
        weights = torch.tensor(
            [math.exp(-loss.loss_and_grads(chain_model, guide, x, length)) for _ in range(2000)]
        )
    captured = next(iter(program._steps.values()))
    assert count_operations(captured.program) < captured.program.meta[ROLLED_FROM]  # its forward's
    assert program.replays >= 1950
    exact = math.exp(dist.Normal(0.0, math.sqrt(2.0)).log_prob(x).item())
    mean, stderr = weights.mean().item(), weights.std().item() / math.sqrt(len(weights))
    assert abs(mean - exact) < 4 * stderr, (mean, exact, stderr)


def test_svi_on_a_rolled_chain_matches_the_eager_losses_on_average():
    """Training through the rolled step: the losses of the first steps match eager training's in mean."""

    def run(mode):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        loss = TMC_ELBO(num_samples=8, max_plate_nesting=0, compile=mode)
        if mode:
            loss.step_program.roll_above, loss.step_program.choose_faster = 0, False
        optim = pyro.optim.Adam({"lr": 0.02})
        svi = pyro.infer.SVI(chain_model, chain_guide, optim, loss)
        return torch.tensor([svi.step(torch.tensor(0.5), 16) for _ in range(150)])

    eager, rolled = run(None), run("graph")
    assert torch.isfinite(rolled).all()
    tail_e, tail_r = eager[-50:], rolled[-50:]
    stderr = math.sqrt(tail_e.var() / 50 + tail_r.var() / 50)
    assert abs(tail_e.mean() - tail_r.mean()) < 4 * stderr + 0.05


def test_draws_are_batched_by_default_only_under_inductor_on_cuda():
    """
    By default a rolled step keeps the eager step's numbers, except a step that inductor
    compiles on CUDA: there each draw would stay an operation (and a kernel) of its own.
    A setting of True or False wins everywhere.
    """
    assert batches_draws(None, "inductor", {"cuda"})
    assert batches_draws(None, "inductor", {"cpu", "cuda"})
    assert not batches_draws(None, "inductor", {"cpu"})
    assert not batches_draws(None, "graph", {"cuda"})
    assert not batches_draws(False, "inductor", {"cuda"})
    assert batches_draws(True, "graph", {"cpu"})


def _random_operations(graph) -> int:
    return sum(
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in node.target.tags
        for node in graph.graph.nodes
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_rolled_chain_under_inductor_on_cuda_batches_its_draws_cuda():
    """
    Under inductor on CUDA a rolled chain draws its particles in a few batched draws, not
    one per link, and stays unbiased (the exact marginal likelihood of a Gaussian chain).
    """
    x, length = torch.tensor(0.8, dtype=torch.float64, device="cuda"), 12

    def guide(x, N):
        for i in pyro.markov(range(1, N + 1)):
            pyro.sample(f"z_{i}", dist.Normal(x.new_zeros(()), math.sqrt(i / N)))

    pyro.set_rng_seed(0)
    loss = TMC_ELBO(num_samples=6, max_plate_nesting=0, compile="inductor")
    loss.step_program.roll_above, loss.step_program.choose_faster = 0, False
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # rolled, compiled and replayed, no fallback
        weights = torch.tensor(
            [math.exp(-loss.loss_and_grads(chain_model, guide, x, length)) for _ in range(2000)]
        )
    captured = next(iter(loss.step_program._steps.values()))
    assert _random_operations(captured.uncompiled) < 4, _random_operations(captured.uncompiled)
    assert loss.step_program.replays >= 1950  # all but the first two and the structure checks
    exact = math.exp(dist.Normal(0.0, math.sqrt(2.0)).log_prob(torch.tensor(0.8)).item())
    mean, stderr = weights.mean().item(), weights.std().item() / math.sqrt(len(weights))
    assert abs(mean - exact) < 4 * stderr, (mean, exact, stderr)


def test_a_step_that_rolling_barely_batches_stays_unrolled():
    """
    The MNIST VAE's five layers differ in width, so rolling its forward would batch
    little (about 0.8 as many groups as operations) and add stacking: its step is
    captured unrolled, and replays the eager step's value.
    """
    from pyro_tmc.compile import CompileConfig
    from pyro_tmc.compile.captured_step import count_groups
    from pyro_tmc.compile.loop_rolling import rolled_runner
    from pyro_tmc.experiments import vae

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x = torch.bernoulli(torch.full((10, 784), 0.3))
    generative, recognition = vae.Generative(784), vae.recognition_model("small", 784)
    loss = TMC_ELBO(num_samples=4, max_plate_nesting=1, compile="graph")
    loss.step_program.choose_faster = False
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # captured and replayed, no fallback
        for _ in range(3):
            loss.loss_and_grads(generative.model, recognition.guide, x)
    assert loss.step_program.replays == 1
    captured = next(iter(loss.step_program._steps.values()))
    assert ROLLED_FROM not in captured.program.meta
    forward = captured.graph  # the traced forward
    forward.graph.eliminate_dead_code()
    operations = count_operations(forward)
    assert operations > loss.step_program.roll_above  # long enough to be considered
    assert count_groups(rolled_runner(forward)) > CompileConfig.roll_at_most * operations
