"""Log-space products that cannot underflow (issue 17, F6).

Each operand of a log-space product is shifted by its own maximum; where the
operands' maxima sit at different summed indices, every shifted product can be
below float32's smallest normal number. The oracles: a float64 brute-force
logsumexp over all terms (and its float64 autograd), and the same factors
contracted in float64; at model level, float32 against float64 on identical
particles.
"""

import math

import pytest
import torch
import torch.distributions.normal as torch_normal

import pyro
import pyro.distributions as dist

from pyro_tmc import TMC_ELBO
from pyro_tmc.estimate.factors import contract_estimate
from pyro_tmc.ops import graph_repair, underflow
from pyro_tmc.ops.capture import any_flag, counting_repairs, deferred_underflow_checks
from pyro_tmc.ops.chains import chain_product
from pyro_tmc.ops.log_einsum import einsum
from pyro_tmc.ops.log_matmul import log_matmul_exp

EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture
def default_dtype():
    """``set(dtype)``: the default dtype for the test, restored afterwards."""
    old = torch.get_default_dtype()
    yield torch.set_default_dtype
    torch.set_default_dtype(old)


# -- oracles -----------------------------------------------------------------------


def brute_einsum(equation: str, *operands: torch.Tensor) -> torch.Tensor:
    """``log sum exp`` over every summed index of the sum of the operands, all terms formed at once."""
    inputs, output = equation.split("->")
    inputs = inputs.split(",")
    symbols = sorted(set("".join(inputs)))
    sizes = {d: n for dims, x in zip(inputs, operands) for d, n in zip(dims, x.shape)}
    total = 0.0
    for dims, x in zip(inputs, operands):
        own = [d for d in symbols if d in dims]
        x = x.permute([dims.index(d) for d in own])
        total = total + x.reshape([sizes[d] if d in dims else 1 for d in symbols])
    total = total.expand([sizes[d] for d in symbols])
    summed = [i for i, d in enumerate(symbols) if d not in output]
    kept = [d for d in symbols if d in output]
    result = torch.logsumexp(total, summed) if summed else total
    return result.permute([kept.index(d) for d in output])


def spread(shape, generator: torch.Generator, dead: float = 0.0) -> torch.Tensor:
    """
    Float32 log values uniform in [-1000, 0], each row's maximum (0) at a random
    column, a ``dead`` fraction of entries ``-inf``: two such operands have maxima
    that rarely meet, so their shifted products underflow.
    """
    x = -1000.0 * torch.rand(shape, generator=generator)
    peak = torch.randint(shape[-1], shape[:-1] + (1,), generator=generator)
    x = x.scatter(-1, peak, 0.0)
    if dead:
        x = x.masked_fill(torch.rand(shape, generator=generator) < dead, -math.inf)
    return x


def assert_close_log(actual: torch.Tensor, expected: torch.Tensor, magnitude: float) -> None:
    """Equal ``-inf`` entries, and the rest within float32's precision of inputs of that magnitude."""
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected.to(actual.dtype)))
    finite = torch.isfinite(expected)
    assert torch.isfinite(actual[finite]).all()
    error = (actual[finite].double() - expected[finite]).abs().max().item() if finite.any() else 0.0
    assert error <= 8 * EPS32 * magnitude, error


def check_gradients(function, oracle, operands, generator) -> None:
    """Gradients of a weighted sum of the finite outputs, float32 against float64 autograd of the oracle."""
    leaves32 = [x.clone().requires_grad_() for x in operands]
    leaves64 = [x.double().requires_grad_() for x in operands]
    expected = oracle(*[x.detach() for x in leaves64])
    finite = torch.isfinite(expected)
    weights = torch.rand(expected.shape, generator=generator, dtype=torch.float64)
    (function(*leaves32)[finite] * weights[finite].float()).sum().backward()
    # the oracle's logsumexp gives NaN gradients through its -inf entries: leave those out of it
    masked = [x.masked_fill(~torch.isfinite(x), -1e30) for x in leaves64]
    (oracle(*masked)[finite] * weights[finite]).sum().backward()
    for ours, theirs in zip(leaves32, leaves64):
        assert torch.isfinite(ours.grad).all()
        assert torch.allclose(ours.grad.double(), theirs.grad, atol=1e-4, rtol=1e-3)
        assert (ours.grad[torch.isneginf(ours)] == 0).all()


# -- log_matmul_exp, chain_product, einsum ----------------------------------


@pytest.mark.parametrize("dead", [0.0, 0.3])
def test_log_matmul_exp_wide_spread(dead):
    generator = torch.Generator().manual_seed(0)
    x = spread((3, 6, 7), generator, dead)
    y = spread((3, 5, 7), generator, dead).transpose(-1, -2)  # maxima along the summed dim, elsewhere
    x[0, 1] = -math.inf  # a dead row: -inf, left alone
    x[1, 2, 1:] = -math.inf  # rows and columns finite, no finite pair: exactly -inf
    y[1, :, 3] = -math.inf
    y[1, 1, 3] = 0.0
    expected = brute_einsum("nij,njk->nik", x.double(), y.double())
    result = log_matmul_exp(x, y)
    assert_close_log(result, expected, 2000.0)
    assert torch.isneginf(result[1, 2, 3])
    check_gradients(log_matmul_exp, lambda a, b: brute_einsum("nij,njk->nik", a, b), [x, y], generator)


def test_log_matmul_exp_broadcast_batch():
    generator = torch.Generator().manual_seed(1)
    x = spread((2, 1, 4, 9), generator)
    y = spread((3, 4, 9), generator).transpose(-1, -2)
    expected = brute_einsum("abij,bjk->abik", x.double().expand(2, 3, 4, 9), y.double())
    assert_close_log(log_matmul_exp(x, y), expected, 2000.0)


def test_repairs_read_the_rows_of_broadcast_batches():
    """
    Both repairs (an eager product's, and a graph's up to its capacity) gather each
    underflowed entry's row of ``x`` and column of ``y`` from operands whose batch dims
    broadcast (``(2, 1)`` against ``(20,)``): exact in value and gradient.
    """
    generator = torch.Generator().manual_seed(2)
    x, y = chain_links(20, 16, 0.02, generator)
    # batches (2, 1) and (20,), not square: 6,720 entries, above the default capacity (4,096), so
    # that the graph repairs entries alone
    x, y = x.reshape(2, 10, 16, 16)[:, :1, :12], y[:, :, :14]

    def oracle(a, b):
        return torch.logsumexp(a[..., :, :, None] + b[..., None, :, :], -2)

    def in_graph(a, b):
        with deferred_underflow_checks(repair_in_graph=True) as flags:
            value = log_matmul_exp(a, b)
        assert len(flags) == 1 and not flags[0]  # entries alone, within the capacity: not flagged
        return value

    wide = (x.double() - x.double().amax(-1, keepdim=True)).exp() @ (
        y.double() - y.double().amax(-2, keepdim=True)
    ).exp()
    # float64 alone loses some entries, in nearly every matrix of the output's batch
    underflowed = (wide < underflow.underflow_floor(torch.float64, 16)).sum((-2, -1))
    assert (underflowed > 0).sum() >= 30
    for product in (log_matmul_exp, in_graph):
        assert_close_log(product(x, y), oracle(x.double(), y.double()), 2000.0)
        check_gradients(product, oracle, [x, y], generator)


@pytest.mark.parametrize("length", [2, 7, 12])
def test_chain_product_wide_spread(length):
    generator = torch.Generator().manual_seed(length)
    links = spread((2, length, 5, 5), generator, dead=0.1)

    def oracle(stack):
        product = stack[..., 0, :, :]
        for t in range(1, stack.size(-3)):
            product = brute_einsum("nij,njk->nik", product, stack[..., t, :, :])
        return product

    expected = oracle(links.double())
    assert_close_log(chain_product(links), expected, 1000.0 * length)
    if length <= 7:
        check_gradients(chain_product, oracle, [links], generator)


@pytest.mark.parametrize(
    "equation, shapes",
    [
        ("ab,bc->ac", [(5, 6), (6, 4)]),
        ("nab,nbc->nac", [(2, 5, 6), (2, 6, 4)]),
        ("ab,bc,cd->ad", [(3, 4), (4, 5), (5, 3)]),
        ("ab,ab->", [(4, 6), (4, 6)]),
        ("ab,b->a", [(5, 7), (7,)]),
        ("abc,ca->b", [(4, 3, 5), (5, 4)]),
    ],
)
@pytest.mark.parametrize("dead", [0.0, 0.25])
def test_einsum_wide_spread(equation, shapes, dead):
    generator = torch.Generator().manual_seed(len(equation))
    operands = [spread(shape, generator, dead) for shape in shapes]
    expected = brute_einsum(equation, *[x.double() for x in operands])
    assert_close_log(einsum(equation, *operands), expected, 1000.0 * len(shapes))
    check_gradients(
        lambda *xs: einsum(equation, *xs), lambda *xs: brute_einsum(equation, *xs), operands, generator
    )


def test_einsum_repairs_only_what_underflows():
    """Well-aligned maxima: nothing to repair, the fast value as it was."""
    generator = torch.Generator().manual_seed(3)
    a, b = torch.randn(5, 6, generator=generator), torch.randn(6, 4, generator=generator)
    fast = (a.exp() @ b.exp()).log()
    assert torch.allclose(einsum("ab,bc->ac", a, b), fast, rtol=1e-6)


def test_exact_recomputation_in_chunks(monkeypatch):
    """The repaired entries are recomputed a few at a time (memory-bounded): the same values."""
    monkeypatch.setattr(underflow, "EXACT_CHUNK_ELEMENTS", 10)  # one or two entries a chunk
    generator = torch.Generator().manual_seed(5)
    x, y = spread((2, 6, 7), generator, 0.2), spread((2, 5, 7), generator, 0.2).transpose(-1, -2)
    expected = brute_einsum("nij,njk->nik", x.double(), y.double())
    assert_close_log(log_matmul_exp(x, y), expected, 2000.0)
    assert_close_log(einsum("nij,njk->nik", x, y), expected, 2000.0)


def test_deferred_checks_flag_instead_of_repairing():
    """While a graph is traced: the fast value, and a flag set exactly where something underflowed."""
    generator = torch.Generator().manual_seed(6)
    x, y = spread((6, 7), generator), spread((5, 7), generator).T
    calm = torch.randn(6, 7, generator=generator), torch.randn(7, 5, generator=generator)
    dead = torch.full((6, 7), -math.inf), torch.randn(7, 5, generator=generator)  # -inf, not underflow
    for operands, underflows in [((x, y), True), (calm, False), (dead, False)]:
        with deferred_underflow_checks() as flags:
            einsum("ij,jk->ik", *operands)
        assert bool(any_flag(flags, x)) == underflows


def test_deferred_matrix_product_is_repaired_in_the_graph():
    """
    In a graph, a chain's matrix product is exact with no flag: float64 where float32
    underflowed (spreads of 1,000 nats), max-plus where float64 does too (10,000), in
    value and gradient, traced and replayed.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    generator = torch.Generator().manual_seed(6)
    x, y = spread((6, 7), generator), spread((5, 7), generator).T

    def product_and_grad(a, b):
        a = torch.nn.Parameter(a)
        with deferred_underflow_checks(repair_in_graph=True) as flags:
            value = log_matmul_exp(a, b)
        assert not flags
        return value.detach(), torch.autograd.grad(value.logsumexp((0, 1)), [a])[0]

    for scale in (1.0, 10.0):
        a, b = scale * x, scale * y
        expected = brute_einsum("ij,jk->ik", a.double(), b.double())
        reference = a.double().requires_grad_()
        (expected_grad,) = torch.autograd.grad(
            brute_einsum("ij,jk->ik", reference, b.double()).logsumexp((0, 1)), [reference]
        )
        graph = make_fx(product_and_grad, tracing_mode="fake")(a, b)
        for value, grad in (product_and_grad(a, b), graph(a, b)):
            assert value.dtype == torch.float32
            assert torch.allclose(value.double(), expected, rtol=1e-6)
            assert torch.allclose(grad.double(), expected_grad, atol=1e-5)


def chain_links(batch: int, K: int, scale: float, generator: torch.Generator):
    """
    Two batches of Gaussian random-walk links, ``x[b, i, j] = log N(v_j | u_i, scale)``
    up to a constant and ``y[b, j, k]`` likewise from ``v`` to ``w``, with particles
    ``u, v, w ~ N(0, 1)``: Fig. 4's links. An entry's value is about
    ``-(u_i - w_k)^2 / (4 scale^2)`` below its row and column shifts, so the smaller
    ``scale``, the more entries underflow even in float64.
    """
    u, v, w = (torch.randn(batch, K, generator=generator) for _ in range(3))
    x = -((u[:, :, None] - v[:, None, :]) ** 2) / (2 * scale**2)
    y = -((v[:, :, None] - w[:, None, :]) ** 2) / (2 * scale**2)
    return x, y


def test_graph_repairs_underflowed_entries_alone_and_flags_too_many(monkeypatch):
    """
    A graph repairs a large product's underflowed entries one by one, up to
    :func:`repair_capacity` of them (scale 0.05: 6% of them), exact in value and
    gradient, traced and not, with no padding landing on a real entry's value or
    gradient. Beyond (scale 0.02: 43%), it flags the product, so that the caller
    redoes the step eagerly.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    def product_and_grad(a, b):
        a = torch.nn.Parameter(a)
        with deferred_underflow_checks(repair_in_graph=True) as flags:
            value = log_matmul_exp(a, b)
        flagged = torch.stack(flags).any()
        return value.detach(), torch.autograd.grad(value.logsumexp((-2, -1)).sum(), [a])[0], flagged

    for scale, repaired in ((0.05, True), (0.02, False)):
        x, y = chain_links(40, 16, scale, torch.Generator().manual_seed(0))
        wide = (x.double() - x.double().amax(-1, keepdim=True)).exp() @ (
            y.double() - y.double().amax(-2, keepdim=True)
        ).exp()
        underflowed = int((wide < underflow.underflow_floor(torch.float64, 16)).sum())
        capacity = graph_repair.repair_capacity(wide.numel())
        assert underflowed > 0 and capacity < wide.numel() and (underflowed <= capacity) == repaired
        reference = x.double().requires_grad_()
        expected = torch.logsumexp(reference[..., :, :, None] + y.double()[..., None, :, :], -2)
        (expected_grad,) = torch.autograd.grad(expected.logsumexp((-2, -1)).sum(), [reference])
        graph = make_fx(product_and_grad, tracing_mode="fake")(x, y)
        for value, grad, flagged in (product_and_grad(x, y), graph(x, y)):
            assert bool(flagged) != repaired
            if repaired:
                assert torch.allclose(value.double(), expected, rtol=1e-6, atol=1e-6)
                assert torch.allclose(grad.double(), expected_grad, atol=1e-6)

        taken = []  # without autograd, a cond runs only the branch it takes
        with monkeypatch.context() as patch:
            original = graph_repair._entries_branch
            patch.setattr(
                graph_repair, "_entries_branch", lambda *a, t=taken, f=original: (t.append(1), f(*a))[1]
            )
            with torch.no_grad(), deferred_underflow_checks(repair_in_graph=True):
                log_matmul_exp(x, y)
        assert taken == [1]


def _repair_sizes(graph) -> list:
    """The static capacities of a traced graph's entry repairs (its ``nonzero_static`` sizes)."""
    return [
        node.kwargs["size"]
        for module in graph.modules()
        for node in module.graph.nodes
        if node.target is torch.ops.aten.nonzero_static.default
    ]


def test_repair_capacity_fits_the_need_an_eager_run_saw():
    """Without a count, the default; with one, half as much again plus 64, capped by the default."""
    assert graph_repair.repair_capacity(50_176) == 6_272
    assert graph_repair.repair_capacity(3_072) == 4_096  # small: repaired whole
    assert graph_repair.repair_capacity(50_176, 0) == 64  # Fig. 4 at N=100: 0-6 entries of 50k
    assert graph_repair.repair_capacity(256_000, 6_500) == 9_814
    assert graph_repair.repair_capacity(511_000, 52_000) == 63_875  # the default, above the need
    assert graph_repair.repair_capacity(4_864, 4_500) == 4_864  # more than the default needed: all


def test_graph_repairs_are_sized_by_the_eager_counts():
    """
    An eager product reports how many entries it repaired (:func:`counting_repairs`);
    a trace given those counts sizes its repair to them (not an eighth of the product)
    and is exact; given a count far below the need, the product is flagged (the step is
    redone eagerly), never wrong.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    x, y = chain_links(40, 16, 0.05, torch.Generator().manual_seed(0))
    with counting_repairs() as counts:
        expected = log_matmul_exp(x, y)
    ((shape, needed, narrow_clean),) = counts
    assert shape == (40, 16, 16) and 0 < needed < graph_repair.repair_capacity(shape.numel()) // 2
    assert not narrow_clean

    def traced(repair_counts):
        def product(a, b):
            with deferred_underflow_checks(repair_in_graph=True, repair_counts=repair_counts) as flags:
                value = log_matmul_exp(a, b)
            return value, torch.stack(flags).any()

        return make_fx(product, tracing_mode="fake")(x, y)

    graph = traced(counts)
    assert _repair_sizes(graph) == [graph_repair.repair_capacity(shape.numel(), needed)]
    with torch.no_grad():
        value, flagged = graph(x, y)
    assert not flagged and torch.allclose(value, expected, rtol=1e-6, atol=1e-6)

    too_few = traced([(shape, 0)])  # capacity 64, against 615 underflowed entries
    assert _repair_sizes(too_few) == [64]
    with torch.no_grad():
        assert bool(too_few(x, y)[1])
    assert _repair_sizes(traced([(torch.Size([7, 16, 16]), needed)])) == [
        graph_repair.repair_capacity(shape.numel())
    ]  # a count for another shape: the products do not line up, the default


def test_a_product_clean_in_float32_is_traced_in_float32_and_flagged():
    """
    A product that the eager step found clean in float32 (no entry low: the MNIST VAE's)
    is traced in float32, with no float64 product and no repair, and flagged: on links
    where it does underflow (a stiffer draw), the flag is set, so the step is redone
    eagerly, never wrong.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    generator = torch.Generator().manual_seed(0)
    mild = chain_links(40, 16, 1.0, generator)
    with counting_repairs() as counts:
        expected = log_matmul_exp(*mild)
    ((shape, needed, narrow_clean),) = counts
    assert needed == 0 and narrow_clean

    def product(a, b):
        with deferred_underflow_checks(repair_in_graph=True, repair_counts=counts) as flags:
            value = log_matmul_exp(a, b)
        return value, torch.stack(flags).any()

    graph = make_fx(product, tracing_mode="fake")(*mild)
    dtypes = {
        node.meta["val"].dtype for node in graph.graph.nodes if isinstance(node.meta.get("val"), torch.Tensor)
    }
    assert torch.float64 not in dtypes and _repair_sizes(graph) == []
    with torch.no_grad():
        value, flagged = graph(*mild)
        assert not flagged and torch.allclose(value, expected, rtol=1e-6, atol=1e-6)
        stiff = chain_links(40, 16, 0.05, generator)
        assert bool(graph(*stiff)[1])


def test_a_product_clean_after_a_clean_one_is_flagged_not_repaired():
    """
    Of products that the eager step found clean (count 0), the first after a repaired
    one keeps a small repair (64 entries), and the ones after it have none: each is
    flagged where an entry underflows (the step is redone eagerly), never wrong, and
    leaves inductor fewer operations to compile (Fig. 4's chain: 4 of 10 tree levels).
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    x, y = chain_links(40, 16, 0.05, torch.Generator().manual_seed(0))
    shape = torch.Size([40, 16, 16])

    def traced(counts):
        def products(a, b):
            with deferred_underflow_checks(repair_in_graph=True, repair_counts=counts) as flags:
                values = [log_matmul_exp(a, b) for _ in counts]
            return values, [flag.reshape(()) for flag in flags]

        return make_fx(products, tracing_mode="fake")(x, y)

    graph = traced([(shape, 700), (shape, 0), (shape, 0), (shape, 0)])
    needed_capacity = graph_repair.repair_capacity(shape.numel(), 700)
    assert _repair_sizes(graph) == [needed_capacity, 64]  # the third and fourth: no repair
    with torch.no_grad():
        values, flags = graph(x, y)
    expected = log_matmul_exp(x, y)
    assert torch.allclose(values[0], expected, rtol=1e-6, atol=1e-6)
    # 615 entries underflow: the second overflows its 64, the third and fourth flag them
    assert [bool(f) for f in flags] == [False, True, True, True]
    assert _repair_sizes(traced([(shape, 0), (shape, 0)])) == [64]  # the first product: repaired


def test_float64_wide_spread():
    """Float64 underflows too, past ~700 nats: it is repaired the same way."""
    generator = torch.Generator().manual_seed(4)
    x, y = spread((6, 7), generator).double(), spread((5, 7), generator).double().T
    expected = brute_einsum("ij,jk->ik", x, y)
    assert torch.allclose(log_matmul_exp(x, y), expected, atol=1e-9, rtol=0)


# -- models: the repros (F6) ------------------------------------------------------

CHAIN_LENGTH, STIFF_SD = 12, 0.005


def stiff_chain_model():
    z = torch.tensor(0.0)
    for i in pyro.markov(range(CHAIN_LENGTH)):
        z = pyro.sample(f"z{i}", dist.Normal(z, STIFF_SD))
    pyro.sample("x", dist.Normal(z, 1.0), obs=torch.tensor(0.5))


def stiff_chain_guide():
    for i in pyro.markov(range(CHAIN_LENGTH)):
        pyro.sample(f"z{i}", dist.Normal(0.0, 0.3))


def in_float64(factors):
    """The same packed factors, cast to float64."""
    cast = []
    for factor in factors:
        term = factor.term.double()
        term._pyro_dims = factor.term._pyro_dims
        cast.append(factor._replace(term=term))
    return cast


def largest_factor(draw) -> float:
    return max(f.term.detach().abs().max().item() for f in draw.factors())


@pytest.mark.parametrize("seed", [1, 2])
def test_stiff_chain_factors_float32_equal_float64(seed, default_dtype):
    """The contraction alone: the very same float32 factors, contracted in float32 and in float64."""
    default_dtype(torch.float32)
    pyro.set_rng_seed(seed)
    draw = TMC_ELBO(num_samples=8, max_plate_nesting=0).draw(stiff_chain_model, stiff_chain_guide)
    factors = draw.factors()
    ours = contract_estimate(factors, draw.scales).item()
    exact = contract_estimate(in_float64(factors), draw.scales).item()
    assert abs(ours - exact) <= 8 * EPS32 * largest_factor(draw)  # was off by 123 and 41 nats


@pytest.mark.parametrize("max_factor_bytes", [None, 64])
@pytest.mark.parametrize("seed", [1, 2])
def test_stiff_chain_float32_equals_float64(seed, max_factor_bytes, default_dtype):
    """
    The repro: the estimate in float32 and float64 from one seed (identical
    particles, up to rounding); float32 was -741.29 and -648.26 where float64 gives
    -617.96 and -606.99. Under a memory budget every link is contracted in chunks.
    """
    estimates, magnitude = {}, 0.0
    for dtype in (torch.float32, torch.float64):
        default_dtype(dtype)
        pyro.set_rng_seed(seed)
        elbo = TMC_ELBO(num_samples=8, max_plate_nesting=0, max_factor_bytes=max_factor_bytes)
        draw = elbo.draw(stiff_chain_model, stiff_chain_guide)
        estimates[dtype] = draw.log_estimate().item()
        magnitude = max(magnitude, *(_factor_magnitude(f.term) for f in draw.factors()))
    assert estimates[torch.float64] == pytest.approx({1: -617.963, 2: -606.988}[seed], abs=1e-3)
    assert abs(estimates[torch.float32] - estimates[torch.float64]) <= 8 * EPS32 * magnitude


@pytest.mark.parametrize("max_factor_bytes", [None, 64])
def test_stiff_chain_marginals_float32_equal_float64(max_factor_bytes, default_dtype):
    """Gradients through the chain product (unchunked and chunked): each link's marginal weights."""
    names = [f"z{i}" for i in range(CHAIN_LENGTH)]
    weights = {}
    for dtype in (torch.float32, torch.float64):
        default_dtype(dtype)
        pyro.set_rng_seed(1)
        elbo = TMC_ELBO(num_samples=8, max_plate_nesting=0, max_factor_bytes=max_factor_bytes)
        draw = elbo.draw(stiff_chain_model, stiff_chain_guide)
        sources = draw.sources(names)
        marginals = draw.marginal_weights(draw.log_estimate(sources), sources, retain_graph=False)
        weights[dtype] = torch.stack([marginals[name].reshape(-1) for name in names]).double()
    assert torch.isfinite(weights[torch.float32]).all()
    assert torch.allclose(weights[torch.float32], weights[torch.float64], atol=1e-3)


GLOBAL_DATA = 1.5 + 0.1 * torch.randn(100, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def tight_globals_model():
    g = pyro.sample("g", dist.Normal(0.0, 2.0))
    z = pyro.sample("z", dist.Normal(g, 0.003))
    with pyro.plate("n", len(GLOBAL_DATA)):
        pyro.sample("x", dist.Normal(z, 0.1), obs=GLOBAL_DATA.to(torch.get_default_dtype()))


def tight_globals_guide():
    centre = GLOBAL_DATA.mean().item()
    pyro.sample("g", dist.Normal(centre, 0.3))
    pyro.sample("z", dist.Normal(centre, 0.3))


@pytest.fixture
def float64_normals(monkeypatch):
    """Normal draws made in float64 and cast: identical particles whatever the default dtype."""
    original = torch_normal._standard_normal
    monkeypatch.setattr(
        torch_normal,
        "_standard_normal",
        lambda shape, dtype, device: original(shape, torch.float64, device).to(dtype),
    )


@pytest.mark.parametrize("max_factor_bytes", [None, 64])
def test_no_chain_float32_equals_float64(max_factor_bytes, default_dtype, float64_normals):
    """The non-chain repro: float32 raised a false '-inf' error; float64 gives -53.04. Chunked too."""
    estimates, magnitude = {}, 0.0
    for dtype in (torch.float64, torch.float32):
        default_dtype(dtype)
        pyro.set_rng_seed(0)
        elbo = TMC_ELBO(num_samples=8, max_plate_nesting=1, max_factor_bytes=max_factor_bytes)
        draw = elbo.draw(tight_globals_model, tight_globals_guide)
        estimates[dtype] = draw.log_estimate().item()
        magnitude = max(magnitude, sum(_factor_magnitude(f.term) for f in draw.factors()))
    assert estimates[torch.float64] == pytest.approx(-53.037188, abs=1e-5)
    assert abs(estimates[torch.float32] - estimates[torch.float64]) <= 8 * EPS32 * magnitude


def _factor_magnitude(term) -> float:
    """The largest |entry| of a factor, a chunked one materialised."""
    term = term.materialise() if hasattr(term, "materialise") else term
    return term.detach().abs().max().item()


def test_chunked_gradients_float32_equal_float64(default_dtype, float64_normals):
    """Through the chunked contraction (max_factor_bytes), gradients of the estimate in both dtypes."""
    grads = {}
    for dtype in (torch.float64, torch.float32):
        default_dtype(dtype)
        pyro.set_rng_seed(0)
        elbo = TMC_ELBO(num_samples=8, max_plate_nesting=1, max_factor_bytes=64)
        draw = elbo.draw(tight_globals_model, tight_globals_guide)
        sources = draw.sources(["g", "z"])
        weights = draw.marginal_weights(draw.log_estimate(sources), sources, retain_graph=False)
        grads[dtype] = torch.cat([weights["g"].reshape(-1), weights["z"].reshape(-1)]).double()
    assert torch.isfinite(grads[torch.float32]).all()
    assert torch.allclose(grads[torch.float32], grads[torch.float64], atol=1e-4)


def test_true_minus_infinity_still_raises():
    """An estimate that is -inf in exact arithmetic (every combination has a -inf factor) still says so."""

    def model():
        a = pyro.sample("a", dist.Categorical(torch.ones(2)), infer={"enumerate": "parallel"})
        b = pyro.sample("b", dist.Categorical(torch.ones(2)), infer={"enumerate": "parallel"})
        pyro.factor("differ", torch.where(a == b, -math.inf, 0.0))
        pyro.factor("a_is_0", torch.where(a == 0, 0.0, -math.inf))
        pyro.factor("b_is_0", torch.where(b == 0, 0.0, -math.inf))

    with pytest.raises(ValueError, match="no particle combination has positive weight"):
        TMC_ELBO(max_plate_nesting=0).loss(model, lambda: None)


# -- compile="graph": the graph flags an underflow and the eager path repairs it -----------


@pytest.mark.parametrize("seed", [1, 2])
def test_graph_on_stiff_chain_equals_eager(seed, default_dtype):
    default_dtype(torch.float32)
    losses = {}
    for mode in (None, "graph"):
        pyro.set_rng_seed(seed)
        elbo = TMC_ELBO(num_samples=8, max_plate_nesting=0, compile=mode)
        losses[mode] = elbo.loss(stiff_chain_model, stiff_chain_guide)
        if mode:
            assert elbo.program.traces == 1  # traced (no fallback to eager for the whole plan)
    assert losses["graph"] == losses[None]
    pyro.set_rng_seed(seed)
    default_dtype(torch.float64)
    exact = TMC_ELBO(num_samples=8, max_plate_nesting=0).loss(stiff_chain_model, stiff_chain_guide)
    assert losses["graph"] == pytest.approx(exact, abs=0.05)
