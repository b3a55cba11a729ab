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

Its callers: the chains of pairwise factors found among a draw's packed factors
(:func:`pyro_tmc.ops.chain_factors.reduce_chains`) and the time dims of
``vectorized_markov`` loops (:func:`pyro_tmc.estimate.vectorized_markov.reduce_markov_times`).

Reference: Särkkä, S. and García-Fernández, Á. F. (2021) "Temporal Parallelization
of Bayesian Smoothers", IEEE TAC; Obermeyer et al. (2019) "Functional Tensors for
Probabilistic Programming" (funsor's ``sum_product``).
"""

from typing import Callable

import torch

from pyro_tmc.ops.log_matmul import log_matmul_exp

#: a matrix product of two stacks of matrices ``(..., i, j)`` and ``(..., j, k)``, batched
#: over the leading dims (which broadcast): associative, as the tree regroups the factors
MatrixProduct = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
    if dim != -3:  # movedim is an operation (a view) even where it moves nothing
        links = links.movedim(dim, -3)
    while links.size(-3) > 1:
        length = links.size(-3)
        even = length - length % 2
        pairs = matmul(links[..., 0:even:2, :, :], links[..., 1:even:2, :, :])
        links = torch.cat([pairs, links[..., even:, :, :]], dim=-3) if length % 2 else pairs
    return links.squeeze(-3)


__all__ = ["MatrixProduct", "chain_product"]
