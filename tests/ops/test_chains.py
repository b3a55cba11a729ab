"""The generic chain product (:func:`pyro_tmc.ops.chains.chain_product`).

Oracles: the product of the matrices one after the other, in float64, by plain
matrix products of probabilities where float64 holds them, and by exact max-plus
log-sum-exps where it does not.
"""

import functools

import pytest
import torch

from pyro.distributions.hmm import _sequential_logmatmulexp

from pyro_tmc.ops.capture import deferred_underflow_checks
from pyro_tmc.ops.chains import TERMWISE_AT_MOST, chain_product, termwise_chain_product
from pyro_tmc.ops.underflow import safe_logsumexp


def left_to_right(links: torch.Tensor, matmul) -> torch.Tensor:
    """``links[..., 0, :, :] @ links[..., 1, :, :] @ ...``, one product after another."""
    return functools.reduce(matmul, links.unbind(-3))


def exact_log_matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``log(exp(x) @ exp(y))`` by forming every term: exact whatever the spread."""
    return torch.logsumexp(x[..., :, :, None] + y[..., None, :, :], -2)


@pytest.mark.parametrize("length", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log_chain_equals_the_product_of_the_matrices(length, dtype):
    """Value and gradient, against float64 ``log(exp(L_1) @ ... @ exp(L_T))``, batched."""
    generator = torch.Generator().manual_seed(length)
    links64 = torch.randn(2, 3, length, 4, 4, generator=generator, dtype=torch.float64)
    leaf64 = links64.clone().requires_grad_()
    expected = left_to_right(leaf64.exp(), torch.matmul).log()
    weights = torch.rand(expected.shape, generator=generator, dtype=torch.float64)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), leaf64)
    leaf = links64.to(dtype).requires_grad_()
    result = chain_product(leaf)
    (grad,) = torch.autograd.grad((result * weights.to(dtype)).sum(), leaf)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    assert result.shape == (2, 3, 4, 4) and result.dtype == dtype
    assert torch.allclose(result.double(), expected.detach(), atol=tolerance * length, rtol=tolerance)
    assert torch.allclose(grad.double(), expected_grad, atol=tolerance * length, rtol=tolerance)


@pytest.mark.parametrize("length", [1, 4, 7])
def test_any_matrix_product_in_order_along_any_dim(length):
    """Another semiring (plain matmul), links along dim 0: the tree keeps the order of the factors."""
    generator = torch.Generator().manual_seed(10 + length)
    links = torch.randn(length, 2, 3, 3, generator=generator, dtype=torch.float64)
    expected = left_to_right(links.movedim(0, -3), torch.matmul)
    assert torch.allclose(chain_product(links, torch.matmul, dim=0), expected, rtol=1e-12, atol=1e-12)
    if length > 1:  # the order matters: the test can tell
        reversed_order = left_to_right(links.flip(0).movedim(0, -3), torch.matmul)
        assert not torch.allclose(expected, reversed_order)


def stiff_links(length: int, nats: float, dtype: torch.dtype) -> torch.Tensor:
    """
    Links whose rows peak at state 0 on odd steps and at state 1 on even steps, every
    other entry ``nats`` lower: the row maxima of one link meet the column maxima of
    the next at different states, so each shifted product is ``exp(-nats)`` (a little
    noise keeps the entries apart).
    """
    generator = torch.Generator().manual_seed(int(nats))
    links = torch.full((length, 3, 3), -nats, dtype=torch.float64)
    links[0::2, :, 0] = 0.0  # x[i, j]: largest at j = 0
    links[1::2, 1, :] = 0.0  # y[j, k]: largest at j = 1
    links = links + 0.1 * torch.rand(links.shape, generator=generator, dtype=torch.float64)
    return links.to(dtype)


@pytest.mark.parametrize(("nats", "dtype"), [(150.0, torch.float32), (1000.0, torch.float64)])
def test_operands_maxima_far_apart_do_not_underflow(nats, dtype):
    """
    The operands' maxima ``nats`` apart (beyond float32's 88 or float64's 708): a product
    shifted by each operand's own maxima alone (Pyro's) loses every entry to ``-inf``;
    this one is exact, in value and gradient.
    """
    links = stiff_links(6, nats, dtype)
    naive = _sequential_logmatmulexp(links)
    assert torch.isneginf(naive).any()  # the case is one a per-operand shift gets wrong

    leaf64 = links.double().requires_grad_()
    expected = left_to_right(leaf64, exact_log_matmul)
    (expected_grad,) = torch.autograd.grad(expected.sum(), leaf64)
    leaf = links.clone().requires_grad_()
    result = chain_product(leaf)
    (grad,) = torch.autograd.grad(result.sum(), leaf)
    assert torch.isfinite(result).all() and torch.isfinite(grad).all()
    eps = torch.finfo(dtype).eps
    assert torch.allclose(result.double(), expected.detach(), rtol=8 * eps, atol=0.0)
    assert torch.allclose(grad.double(), expected_grad, atol=1e-5)


@pytest.mark.parametrize(
    ("shape", "dim"), [((2, 3, 7, 4, 4), -3), ((9, 16, 4, 4), 0), ((5, 3, 3), 0), ((1, 2, 4, 4), 0)]
)
def test_termwise_product_equals_the_tree(shape, dim):
    """The term-by-term tree of a graph for inductor: the shifted tree's value and gradient, batched."""
    generator = torch.Generator().manual_seed(len(shape) + shape[0])
    links = (30 * torch.randn(shape, generator=generator, dtype=torch.float64)).requires_grad_()
    expected = chain_product(links, dim=dim)
    weights = torch.rand(expected.shape, generator=generator, dtype=torch.float64)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), links)
    result = termwise_chain_product(links, dim)
    (grad,) = torch.autograd.grad((result * weights).sum(), links)
    assert result.shape == expected.shape
    assert torch.allclose(result, expected, rtol=1e-12, atol=0.0)
    assert torch.allclose(grad, expected_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("nats", "dtype"), [(150.0, torch.float32), (1000.0, torch.float64)])
def test_termwise_product_is_exact_where_shifts_underflow(nats, dtype):
    """Operands' maxima far apart, and a state no path reaches: exact, its gradient 0, nothing flagged."""
    links = stiff_links(6, nats, dtype)
    links[:, :, 2] = -float("inf")  # state 2 unreachable: -inf entries, no NaN in the gradient
    leaf64 = links.double().requires_grad_()
    # one product after another, each entry from its terms (safe_logsumexp: a 0 gradient through -inf)
    expected = left_to_right(
        leaf64, lambda x, y: safe_logsumexp(x[..., :, :, None] + y[..., None, :, :], [-2])
    )
    (expected_grad,) = torch.autograd.grad(expected[..., :2].sum(), leaf64)
    leaf = links.clone().requires_grad_()
    with deferred_underflow_checks(repair_in_graph=True, termwise_small_chains=True) as flags:
        result = chain_product(leaf, dim=0)  # a graph for inductor: term by term
    (grad,) = torch.autograd.grad(result[..., :2].sum(), leaf)
    assert not flags and torch.isneginf(result[..., 2]).all()
    eps = torch.finfo(dtype).eps
    assert torch.allclose(result[..., :2].double(), expected[..., :2].detach(), rtol=8 * eps, atol=0.0)
    assert torch.isfinite(grad).all() and (grad[:, :, 2] == 0).all()
    assert torch.allclose(grad.double(), expected_grad, atol=1e-5)


def test_large_matrices_are_not_taken_termwise():
    """Above TERMWISE_AT_MOST states the graph keeps the shifted products, which flag their underflow."""
    links = torch.randn(6, TERMWISE_AT_MOST + 1, TERMWISE_AT_MOST + 1)
    with deferred_underflow_checks(termwise_small_chains=True) as flags:
        chain_product(links, dim=0)
    assert len(flags) == 3  # one per level: 6 -> 3 -> 2 -> 1
