"""The precision matrix's Cholesky factor (pyro_tmc.infer.precision_factor): tridiagonal against dense."""

import pytest
import torch

from pyro_tmc.infer.precision_factor import DenseFactor, TridiagonalFactor, precision_factor


def tridiagonal(n: int, seed: int) -> torch.Tensor:
    """A random positive definite tridiagonal matrix (diagonally dominant), float64."""
    generator = torch.Generator().manual_seed(seed)
    off = 2 * torch.rand(n - 1, generator=generator, dtype=torch.float64) - 1
    diagonal = 2.5 + torch.rand(n, generator=generator, dtype=torch.float64)
    return torch.diag(diagonal) + torch.diag(off, 1) + torch.diag(off, -1)


@pytest.mark.parametrize("n", [3, 7, 200])
def test_the_tridiagonal_factor_answers_as_the_dense_one(n):
    matrix = tridiagonal(n, seed=n)
    factor = precision_factor(matrix)
    assert isinstance(factor, TridiagonalFactor)
    dense = DenseFactor(torch.linalg.cholesky(matrix))
    generator = torch.Generator().manual_seed(1)
    vector = torch.randn(n, generator=generator, dtype=torch.float64)
    columns = torch.randn(n, 3, generator=generator, dtype=torch.float64)
    inverse = torch.linalg.inv(matrix)
    assert torch.allclose(factor.solve(vector), inverse @ vector, atol=1e-12)
    assert torch.allclose(factor.solve(columns), inverse @ columns, atol=1e-12)
    assert torch.allclose(factor.inverse_diagonal(), inverse.diagonal(), atol=1e-12)
    assert torch.allclose(factor.inverse(), inverse, atol=1e-12)
    assert factor.log_det() == pytest.approx(float(torch.logdet(matrix)), abs=1e-9)
    assert factor.log_det() == pytest.approx(dense.log_det(), abs=1e-9)


def test_an_entry_off_the_band_takes_the_dense_factor():
    matrix = tridiagonal(6, seed=0)
    matrix[0, 4] = matrix[4, 0] = 0.3
    factor = precision_factor(matrix)
    assert isinstance(factor, DenseFactor)
    vector = torch.arange(6, dtype=torch.float64)
    assert torch.allclose(factor.solve(vector), torch.linalg.solve(matrix, vector), atol=1e-12)


@pytest.mark.parametrize("band", [True, False])
def test_no_factor_of_a_matrix_that_is_not_positive_definite(band):
    matrix = -tridiagonal(5, seed=2)
    if not band:
        matrix[0, 3] = matrix[3, 0] = 0.1
    assert precision_factor(matrix) is None
