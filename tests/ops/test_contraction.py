"""The contraction layer: fused factors and chunked elimination give the same numbers."""

import math

import opt_einsum
import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro.ops.contract import naive_ubersum

from pyro_tmc import TMC_ELBO
from pyro_tmc.ops.contraction import contract_log_factors
from pyro_tmc.ops.ring import fuse_factors


def _packed(tensor, dims):
    tensor._pyro_dims = dims
    return tensor


@pytest.mark.parametrize("seed", range(5))
def test_fused_contraction_equals_naive_ubersum(seed):
    """Random factors over sum dims a, b, c and plates i, j (c local to i),
    against Pyro's brute-force oracle."""
    torch.manual_seed(seed)
    specs = ["a", "ab", "b", "bci", "ci", "ci", "cij", "ai"]
    sizes = {"a": 3, "b": 2, "c": 4, "i": 5, "j": 2}
    factors = [_packed(torch.randn([sizes[d] for d in s]), s) for s in specs]
    ours = contract_log_factors(factors, {"i": 1.0, "j": 1.0})
    (naive,) = naive_ubersum(
        ",".join(specs) + "->",
        *[f.clone() for f in factors],
        plates="ij",
        backend="pyro.ops.einsum.torch_log",
        modulo_total=False,
    )
    assert torch.allclose(ours, naive, atol=1e-4)
    assert len(fuse_factors(factors, "ij")) < len(factors)


def _grads_and_value(model, guide, args, budget, seed, params):
    pyro.set_rng_seed(seed)
    pyro.clear_param_store()
    elbo = TMC_ELBO(num_samples=16, max_plate_nesting=2, max_factor_bytes=budget)
    loss = elbo.differentiable_loss(model, guide, *args)
    grads = torch.autograd.grad(loss, [pyro.param(p).unconstrained() for p in params])
    return loss.detach(), grads


def toy_model(x):
    theta = pyro.sample("theta", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x), dim=-1):
        z = pyro.sample("z", dist.Normal(theta, 1.0))
        pyro.sample("x", dist.Normal(z, 1.0), obs=x)


def toy_guide(x):
    loc = pyro.param("loc", torch.tensor([0.2, -0.1]))
    pyro.sample("theta", dist.Normal(loc[0], 1.0))
    with pyro.plate("data", len(x), dim=-1):
        pyro.sample("z", dist.Normal(loc[1], 1.4))


def chain_model(x):
    z = torch.tensor(0.0)
    for i in range(4):
        z = pyro.sample(f"z{i}", dist.Normal(z, 1.0))
    with pyro.plate("data", len(x), dim=-1):
        pyro.sample("x", dist.Normal(z, 1.0), obs=x)


def chain_guide(x):
    weight = pyro.param("weight", torch.full((4,), 0.7))
    z = torch.tensor(0.0)
    for i in range(4):
        z = pyro.sample(f"z{i}", dist.Normal(weight[i] * z, 1.0))


def nested_model(y):
    with pyro.plate("groups", y.shape[-2], dim=-2):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        with pyro.plate("members", y.shape[-1], dim=-1):
            w = pyro.sample("w", dist.Normal(z, 1.0))
            pyro.sample("y", dist.Normal(w, 1.0), obs=y)


def nested_guide(y):
    loc = pyro.param("loc", torch.tensor([0.1, 0.3]))
    with pyro.plate("groups", y.shape[-2], dim=-2):
        pyro.sample("z", dist.Normal(loc[0], 1.2))
        with pyro.plate("members", y.shape[-1], dim=-1):
            pyro.sample("w", dist.Normal(loc[1], 1.5))


CASES = {
    "toy": (toy_model, toy_guide, (torch.randn(32),), ["loc"]),
    "non-factorised chain": (chain_model, chain_guide, (torch.randn(8),), ["weight"]),
    "nested plates": (nested_model, nested_guide, (torch.randn(3, 4),), ["loc"]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("budget", [4000, 1200])
def test_chunked_elimination_equals_whole(case, budget):
    """A memory budget far below the largest factor (16 x 16 x N floats) changes nothing but memory."""
    model, guide, args, params = CASES[case]
    whole_loss, whole_grads = _grads_and_value(model, guide, args, None, 0, params)
    chunked_loss, chunked_grads = _grads_and_value(model, guide, args, budget, 0, params)
    assert torch.allclose(whole_loss, chunked_loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(whole_grads, chunked_grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_chunked_factor_is_never_materialised_whole():
    """With a budget, the toy model's K x K x N log density is only ever built in slices."""
    shapes = []
    original = dist.Normal.log_prob

    def recording_log_prob(self, value):
        result = original(self, value)
        shapes.append(math.prod(result.shape))
        return result

    pyro.set_rng_seed(1)
    x = torch.randn(64)
    dist.Normal.log_prob = recording_log_prob
    try:
        TMC_ELBO(num_samples=32, max_plate_nesting=1, max_factor_bytes=4 * 8192).loss(toy_model, toy_guide, x)
    finally:
        del dist.Normal.log_prob  # back to the inherited method
    assert max(shapes) <= 8192 < 32 * 32 * 64


def test_bad_budget():
    with pytest.raises(ValueError, match="max_factor_bytes"):
        TMC_ELBO(max_factor_bytes=0)


def test_one_global_sum_fast_path_equals_general_contraction():
    """
    One particle dim summed outside the plates (IWAE's joint samples, one global
    latent): the direct sum-of-logs then logsumexp equals the ring contraction,
    value and gradient, with subsampling scales on nested plates.
    """
    from pyro_tmc.ops.contraction import _contract_one_global_sum, _is_one_global_sum
    from pyro_tmc.ops.ring import contract_packed

    torch.manual_seed(0)
    shapes = {"k": 5, "a": 3, "b": 4}

    def packed(dims):
        t = torch.randn([shapes[d] for d in dims], requires_grad=True)
        t._pyro_dims = dims
        return t

    factors = [packed("k"), packed("ka"), packed("kab"), packed("ab"), packed("a")]
    scales = {"a": 2.0, "b": 1.5}
    assert _is_one_global_sum(factors, {"k"}, frozenset(scales))
    fast = _contract_one_global_sum(factors, {"k"}, scales)
    general = contract_packed(fuse_factors(factors, scales), scales, {"k"})
    assert torch.allclose(fast, general, atol=1e-5)
    grads_fast = torch.autograd.grad(fast, factors)
    grads_general = torch.autograd.grad(general, factors)
    for g1, g2 in zip(grads_fast, grads_general):
        assert torch.allclose(g1, g2, atol=1e-5)
    # a particle dim held only inside a plate is summed per element: not this path
    assert not _is_one_global_sum([packed("ka")], {"k"}, frozenset(scales))


def _chain_factors(length, size, plate_size=None, seed=0):
    """Pairwise log factors z_0 - z_1 - ... - z_length (optionally in a plate), unary terms, a side branch."""
    torch.manual_seed(seed)
    symbols = "".join(opt_einsum.get_symbol(i) for i in range(200, 201 + length))
    plate = "P" if plate_size else ""
    shape = [plate_size] if plate_size else []

    def packed(dims, extra=()):
        t = (3 * torch.randn(shape + [size] * len(dims) + list(extra))).requires_grad_()
        t._pyro_dims = plate + dims
        return t

    factors = [packed(symbols[i] + symbols[i + 1]) for i in range(length)]
    factors += [packed(symbols[i]) for i in range(0, length + 1, 3)]  # unary terms
    factors.append(packed(symbols[0] + "Z"))  # a side branch at the chain's start
    return factors, ({"P": 2.0} if plate_size else {})


@pytest.mark.parametrize("length", [4, 5, 9, 30])
@pytest.mark.parametrize("plate_size", [None, 3])
def test_log_depth_chain_equals_sequential_contraction(length, plate_size, monkeypatch):
    """
    Chains of pairwise factors contracted by a balanced tree (chain_factors.reduce_chains) give
    the sequential contraction's value and gradients, inside a plate (scaled) and outside.
    """
    from pyro_tmc import contraction

    factors, scales = _chain_factors(length, 4, plate_size)
    tree = contraction.contract_log_factors(factors, scales)
    monkeypatch.setattr(contraction, "MIN_CHAIN_LENGTH", 10**9)  # the sequential path
    sequential = contraction.contract_log_factors(factors, scales)
    assert torch.allclose(tree, sequential, rtol=1e-5, atol=1e-4)
    for g1, g2 in zip(torch.autograd.grad(tree, factors), torch.autograd.grad(sequential, factors)):
        assert torch.allclose(g1, g2, rtol=1e-4, atol=1e-5)


def test_log_depth_chain_all_underflow_rows_stay_finite():
    """Rows that are -inf everywhere (impossible particles) give -inf messages, not NaN."""
    from pyro_tmc import contraction

    factors, scales = _chain_factors(8, 3)
    with torch.no_grad():
        factors[2][0].fill_(-math.inf)  # particle 0 of z_2 is impossible given any z_3
    value = contraction.contract_log_factors(factors, scales)
    assert torch.isfinite(value)
    (grad,) = torch.autograd.grad(value, [factors[2]])
    assert not torch.isnan(grad).any()


def _stacked_chain_factors(length, size, plate_size=None, shuffle=False, seed=1):
    """
    A chain whose links and unary terms are slices of stacked tensors, as the batched
    densities produce them: links alternate between two stacks of opposite orientation
    (as pyro.markov's alternating dims give), some unary terms come from a stack and
    some are loose, one pair has a second factor, and one link is loose.
    """
    torch.manual_seed(seed)
    symbols = "".join(opt_einsum.get_symbol(i) for i in range(300, 301 + length))
    plate, shape = ("P", [plate_size]) if plate_size else ("", [])
    leaves, factors, stacks = [], [], {}

    def stacked(count, member_shape):
        stack = (2 * torch.randn([count] + shape + member_shape)).requires_grad_()
        leaves.append(stack)
        return stack.unbind(0), stack

    even = list(range(0, length, 2))
    odd = list(range(1, length, 2))
    if shuffle:
        even = even[::-1]
    for links, transposed in ((even, False), (odd, True)):
        members, stack = stacked(len(links), [size, size])
        for k, j in enumerate(links):
            if j == length // 2:
                continue  # this link is loose, below
            term = members[k]
            pair = symbols[j + 1] + symbols[j] if transposed else symbols[j] + symbols[j + 1]
            term._pyro_dims = plate + pair
            stacks[id(term)] = (term, stack, k)
            factors.append(term)
    loose_link = (2 * torch.randn(shape + [size, size])).requires_grad_()
    loose_link._pyro_dims = plate + symbols[length // 2] + symbols[length // 2 + 1]
    extra_pair = (2 * torch.randn(shape + [size, size])).requires_grad_()
    extra_pair._pyro_dims = plate + symbols[1] + symbols[2]  # a second factor on one pair
    leaves += [loose_link, extra_pair]
    factors += [loose_link, extra_pair]
    members, stack = stacked(length + 1, [size])
    for j in range(length + 1):
        term = members[j]
        term._pyro_dims = plate + symbols[j]
        stacks[id(term)] = (term, stack, j)
        factors.append(term)
    for j in range(0, length + 1, 4):  # and a few loose unary terms
        term = torch.randn(shape + [size]).requires_grad_()
        term._pyro_dims = plate + symbols[j]
        leaves.append(term)
        factors.append(term)
    return factors, leaves, ({"P": 3.0} if plate_size else {}), stacks


@pytest.mark.parametrize("plate_size", [None, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_stacked_chain_equals_sequential_contraction(plate_size, shuffle, monkeypatch):
    """Links and unary terms taken from their stacks in one operation give the sequential result."""
    from pyro_tmc.ops import chain_factors, contraction

    factors, leaves, scales, stacks = _stacked_chain_factors(11, 3, plate_size, shuffle)
    assert len(chain_factors.find_chains(factors, frozenset(scales))) == 1
    taken = []
    take_rows = chain_factors._take_rows
    monkeypatch.setattr(chain_factors, "_take_rows", lambda *a: taken.append(1) or take_rows(*a))
    tree = contraction.contract_log_factors(factors, scales, stacks)
    assert len(taken) == 3  # one slice per stack: the two stacks of links, the stack of unary terms
    tree_grads = torch.autograd.grad(tree, leaves, retain_graph=True)
    monkeypatch.setattr(contraction, "MIN_CHAIN_LENGTH", 10**9)  # no tree: opt_einsum's sequential plan
    sequential = contraction.contract_log_factors(factors, scales)
    assert torch.allclose(tree, sequential, rtol=1e-5, atol=1e-4)
    for g1, g2 in zip(tree_grads, torch.autograd.grad(sequential, leaves)):
        assert torch.allclose(g1, g2, rtol=1e-4, atol=1e-5)


def test_ring_of_pairwise_factors_equals_sequential_contraction(monkeypatch):
    """A cycle z_0 - z_1 - ... - z_7 - z_0: the chain stops before closing it, and the sum is unchanged."""
    from pyro_tmc.ops import chain_factors, contraction

    torch.manual_seed(3)
    symbols = "".join(opt_einsum.get_symbol(i) for i in range(400, 408))
    factors = []
    for j in range(8):
        term = torch.randn(3, 3).requires_grad_()
        term._pyro_dims = symbols[j] + symbols[(j + 1) % 8]
        factors.append(term)
    for j in range(0, 8, 2):
        term = torch.randn(3).requires_grad_()
        term._pyro_dims = symbols[j]
        factors.append(term)
    (chain,) = chain_factors.find_chains(factors, frozenset())
    assert len(chain[0]) == 8  # every node, one link left out
    tree = contraction.contract_log_factors(factors, {})
    monkeypatch.setattr(contraction, "MIN_CHAIN_LENGTH", 10**9)
    sequential = contraction.contract_log_factors(factors, {})
    assert torch.allclose(tree, sequential, rtol=1e-5, atol=1e-5)
    for g1, g2 in zip(torch.autograd.grad(tree, factors), torch.autograd.grad(sequential, factors)):
        assert torch.allclose(g1, g2, rtol=1e-4, atol=1e-5)
