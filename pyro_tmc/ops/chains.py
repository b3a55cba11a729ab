"""The product of a chain of matrices in a log-depth tree, over any associative matrix product.

A Markov chain ``z_0 - z_1 - ... - z_T`` sums out its inner states as the ordered
product of its links, ``L_1 L_2 ... L_T``, each ``L_t[i, j]`` the factor between
``z_{t-1} = i`` and ``z_t = j``. :func:`chain_product` takes the product in
``ceil(log2 T)`` levels, each multiplying all neighbouring pairs at once (a batched
matrix product), keeping the order: the parallel scan of Särkkä and García-Fernández
(2021), and funsor's ``sequential_sum_product(sum_op, prod_op, trans, time, step)``,
here on positional dims. The semiring is the matrix product given: by default
:func:`~pyro_tmc.ops.log_matmul.log_matmul_exp`, the log-space product
``log(exp(x) @ exp(y))``, which no spread between the operands' maxima makes
underflow. Pyro's ``pyro.distributions.hmm._sequential_logmatmulexp`` shifts each
row of ``x`` and column of ``y`` by its own maximum too, but keeps what the shifted
product gives: an entry whose paths all lie more than ~88 nats (float32) below the
sum of those maxima, as where the two maxima sit at different states, comes out
``-inf``. Other semirings: :func:`torch.matmul` for probabilities, a max-plus
product for the most probable path.

In a graph that inductor compiles (:attr:`~pyro_tmc.ops.capture.CaptureContext.termwise_small_chains`),
a chain of small matrices (at most :data:`TERMWISE_AT_MOST` states: an HMM's) is taken term by
term instead (:func:`termwise_chain_product`): each entry a log-sum-exp of its own terms, exact
with no repair, laid out with the matrices' dims first, so that every fused operation runs along
the links and batch dims, whole vectors at a time. There a 4 x 4 ``bmm`` costs ~140 ns a matrix,
and the shifts, flags and repairs around it are most of the graph.

Its callers: the chains of pairwise factors found among a draw's packed factors
(:func:`pyro_tmc.ops.chain_factors.reduce_chains`) and the time dims of
``vectorized_markov`` loops (:func:`pyro_tmc.estimate.vectorized_markov.reduce_markov_times`).

Reference: Särkkä, S. and García-Fernández, Á. F. (2021) "Temporal Parallelization
of Bayesian Smoothers", IEEE TAC; Obermeyer et al. (2019) "Functional Tensors for
Probabilistic Programming" (funsor's ``sum_product``).
"""

from typing import Callable

import torch

from pyro_tmc.ops.capture import current
from pyro_tmc.ops.log_matmul import log_matmul_exp
from pyro_tmc.ops.underflow import exact_logsumexp

#: a matrix product of two stacks of matrices ``(..., i, j)`` and ``(..., j, k)``, batched
#: over the leading dims (which broadcast): associative, as the tree regroups the factors
MatrixProduct = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: the most states (rows, columns) of a chain's matrices that a graph for inductor takes term by
#: term (:func:`termwise_chain_product`): ``S^3`` exponentials a product, against ``2 S^2`` and a
#: ``bmm`` by shifts
TERMWISE_AT_MOST = 4


def chain_product(links: torch.Tensor, matmul: MatrixProduct = log_matmul_exp, dim: int = -3) -> torch.Tensor:
    """
    The ordered product ``links[0] @ links[1] @ ... @ links[T-1]`` of a stack of
    matrices along ``dim``, under the matrix product ``matmul``, in
    ``ceil(log2 T)`` levels: each level multiplies neighbouring pairs at once (a
    balanced tree), an odd last one carried to the next level.

    :param torch.Tensor links: ``T >= 1`` matrices ``(S, S')`` along ``dim``, with
        any batch dims before them: the last two dims are each link's rows and columns.
    :param matmul: the semiring's matrix product; by default the log-space
        :func:`~pyro_tmc.ops.log_matmul.log_matmul_exp`, exact whatever the spread.
    :param int dim: the dim along which the links are ordered, left of the last two.
    :returns: the product, ``links`` without ``dim``.
    """
    if matmul is log_matmul_exp and max(links.shape[-2:]) <= TERMWISE_AT_MOST:
        context = current()
        if context.termwise_small_chains and context.tracing:
            return termwise_chain_product(links, dim)
    if dim != -3:  # movedim is an operation (a view) even where it moves nothing
        links = links.movedim(dim, -3)
    while links.size(-3) > 1:
        length = links.size(-3)
        even = length - length % 2
        pairs = matmul(links[..., 0:even:2, :, :], links[..., 1:even:2, :, :])
        links = torch.cat([pairs, links[..., even:, :, :]], dim=-3) if length % 2 else pairs
    return links.squeeze(-3)


def termwise_chain_product(links: torch.Tensor, dim: int = -3) -> torch.Tensor:
    """
    :func:`chain_product` under the log-space product, each entry of each level
    ``log sum_j exp(x[i, j] + y[j, k])`` from its own terms, shifted by their maximum: exact,
    never underflows, so nothing is flagged or repaired. For small matrices in a graph that
    inductor fuses: the links are laid out as ``(S, S', T, batch...)``, so that each level is
    one fused reduction over ``j`` along whole vectors of the links and batch dims. The
    products' repair counts of the eager step (:class:`~pyro_tmc.ops.capture.RepairHints`)
    are read as the eager tree's products would, so that later products line up with theirs.

    :param torch.Tensor links: as :func:`chain_product`'s.
    :param int dim: as :func:`chain_product`'s.
    """
    hints = current().repair_hints
    links = links.movedim(dim, -3)
    batch = links.dim() - 3
    rows, columns = links.shape[-2:]
    terms = links.permute(batch + 1, batch + 2, batch, *range(batch))  # (S, S', T, batch...)
    while terms.size(2) > 1:
        length = terms.size(2)
        even = length - length % 2
        if hints is not None:  # the eager tree's product at this level: (batch..., pairs, S, S')
            hints.next(links.shape[:-3] + (even // 2, rows, columns))
        x, y = terms[:, :, 0:even:2], terms[:, :, 1:even:2]
        # (i, j, 1, ...) + (1, j, k, ...): the terms of entry (i, k), summed over j
        pairs = exact_logsumexp(x.unsqueeze(2) + y.unsqueeze(0), [1])
        terms = torch.cat([pairs, terms[:, :, even:]], dim=2) if length % 2 else pairs
    return terms.squeeze(2).permute(*range(2, 2 + batch), 0, 1)


__all__ = ["MatrixProduct", "TERMWISE_AT_MOST", "chain_product", "termwise_chain_product"]
