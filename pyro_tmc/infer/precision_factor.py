"""The Cholesky factor of a precision matrix (a negative Hessian), dense or tridiagonal.

Newton's steps towards a mode solve with the negative Hessian, and a Laplace approximation reads its
inverse's diagonal (the sds), its log-determinant and, once, the inverse itself. A chain's locals
given the globals (a ``vectorized_markov`` chain's later steps: stochastic volatility's 2,515 days)
have a tridiagonal precision: each step meets only its neighbours. Its Cholesky factor is
bidiagonal, found, solved with and inverted on the diagonal in O(n) (Takahashi's recursion), where
the dense factor costs O(n^3): 0.3-0.7 s for those days on this CPU, and its inverse's diagonal as
much again, at every Newton step. :func:`precision_factor` picks the tridiagonal factor where the
matrix is tridiagonal, else the dense one; both answer the same four questions.

Reference: Takahashi, Fagan and Chen (1973) "Formation of a sparse bus impedance matrix and its
application to short circuit study" (the inverse's entries from the Cholesky factor); Rue and Held
(2005) "Gaussian Markov random fields", chapter 2 (banded precisions).
"""

import math
from typing import Optional, Union

import torch


class DenseFactor:
    """
    ``A = L L^T`` for a dense positive definite ``A``.

    :param torch.Tensor lower: ``L``, ``(n, n)``.
    """

    def __init__(self, lower: torch.Tensor) -> None:
        self.lower = lower

    def solve(self, rhs: torch.Tensor) -> torch.Tensor:
        """``A^-1 rhs``, for ``rhs`` of shape ``(n,)`` or ``(n, m)``."""
        matrix = rhs.unsqueeze(-1) if rhs.dim() == 1 else rhs
        solved = torch.cholesky_solve(matrix, self.lower)
        return solved.squeeze(-1) if rhs.dim() == 1 else solved

    def inverse_diagonal(self) -> torch.Tensor:
        return torch.cholesky_inverse(self.lower).diagonal()

    def inverse(self) -> torch.Tensor:
        return torch.cholesky_inverse(self.lower)

    def log_det(self) -> float:
        return 2 * float(self.lower.diagonal().log().sum())


class TridiagonalFactor:
    """
    ``A = L L^T`` for a tridiagonal positive definite ``A``: ``L`` lower bidiagonal, its diagonal
    ``d`` and its subdiagonal ``e`` (``L[i + 1, i] = e[i]``).

    :param torch.Tensor diagonal: ``d``, ``(n,)``, positive.
    :param torch.Tensor subdiagonal: ``e``, ``(n - 1,)``.
    """

    def __init__(self, diagonal: torch.Tensor, subdiagonal: torch.Tensor) -> None:
        self.diagonal, self.subdiagonal = diagonal, subdiagonal

    def solve(self, rhs: torch.Tensor) -> torch.Tensor:
        """``A^-1 rhs`` by one forward and one backward substitution, for ``(n,)`` or ``(n, m)``."""
        d, e = self.diagonal.tolist(), self.subdiagonal.tolist()
        columns = rhs.unsqueeze(-1) if rhs.dim() == 1 else rhs
        solved = [_bidiagonal_solve(d, e, column) for column in columns.T.tolist()]
        result = torch.tensor(solved, dtype=rhs.dtype).T
        return result.squeeze(-1) if rhs.dim() == 1 else result

    def inverse_diagonal(self) -> torch.Tensor:
        """
        ``diag(A^-1)`` from the back: with ``S = A^-1``, ``L^T S = L^-1`` is lower triangular, whose
        diagonal and first superdiagonal give ``S[i, i] = (1 + e[i]^2 S[i + 1, i + 1]) / d[i]^2``.
        """
        d, e = self.diagonal.tolist(), self.subdiagonal.tolist()
        n = len(d)
        result = [0.0] * n
        result[-1] = 1 / d[-1] ** 2
        for i in range(n - 2, -1, -1):
            result[i] = (1 + e[i] ** 2 * result[i + 1]) / d[i] ** 2
        return torch.tensor(result, dtype=self.diagonal.dtype)

    def inverse(self) -> torch.Tensor:
        lower = torch.diag(self.diagonal) + torch.diag(self.subdiagonal, -1)
        return torch.cholesky_inverse(lower)

    def log_det(self) -> float:
        return 2 * float(self.diagonal.log().sum())


Factor = Union[DenseFactor, TridiagonalFactor]


def precision_factor(matrix: torch.Tensor) -> Optional[Factor]:
    """
    The Cholesky factor of a symmetric ``matrix`` (``(n, n)``): tridiagonal where every entry two or
    more off the diagonal is zero, else dense. ``None`` where it is not positive definite.
    """
    n = matrix.shape[-1]
    diagonal, offdiagonal = matrix.diagonal(), matrix.diagonal(1)
    # a count of the non-zeros, no copy of the matrix: every one of them on the three diagonals
    banded = torch.count_nonzero(diagonal) + 2 * torch.count_nonzero(offdiagonal)
    if n > 2 and int(torch.count_nonzero(matrix)) == int(banded):
        return tridiagonal_factor(diagonal, offdiagonal)
    lower, info = torch.linalg.cholesky_ex(matrix)
    return DenseFactor(lower) if info == 0 else None


def tridiagonal_factor(diagonal: torch.Tensor, offdiagonal: torch.Tensor) -> Optional[TridiagonalFactor]:
    """``d[i] = sqrt(a[i] - e[i-1]^2)``, ``e[i] = b[i] / d[i]``; ``None`` at a pivot that is not positive."""
    a, b = diagonal.tolist(), offdiagonal.tolist()
    d, e = [0.0] * len(a), [0.0] * len(b)
    previous = 0.0
    for i, value in enumerate(a):
        pivot = value - previous**2
        if not pivot > 0 or not math.isfinite(pivot):
            return None
        d[i] = math.sqrt(pivot)
        if i < len(b):
            e[i] = previous = b[i] / d[i]
    dtype = diagonal.dtype
    return TridiagonalFactor(torch.tensor(d, dtype=dtype), torch.tensor(e, dtype=dtype))


def _bidiagonal_solve(d: list, e: list, rhs: list) -> list:
    """``(L L^T)^-1 rhs`` for the bidiagonal ``L`` of ``d``, ``e``: forward, then backward."""
    n = len(d)
    y = [0.0] * n
    for i in range(n):
        y[i] = (rhs[i] - (e[i - 1] * y[i - 1] if i else 0.0)) / d[i]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        x[i] = (y[i] - (e[i] * x[i + 1] if i < n - 1 else 0.0)) / d[i]
    return x
