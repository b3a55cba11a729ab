"""Resampling: n indices drawn in proportion to importance weights, as a particle filter's step.

All three schemes are unbiased: particle i is picked ``n w_i`` times in expectation (``w`` the
normalised weights). They differ in the spread of the counts:

- multinomial: n independent draws; each count is Binomial(n, w_i);
- stratified: one uniform draw in each of the n strata ``[j/n, (j+1)/n)`` of the weights' CDF; the
  counts' variance is never above multinomial's;
- systematic: one uniform draw, shifted by ``j/n``; each count is ``floor(n w_i)`` or ``ceil(n w_i)``,
  the least spread possible, though counts of neighbours are correlated.

Each takes any batch shape, weights along ``dim``, and returns ``LongTensor`` indices into ``dim``
with ``dim`` of size ``num_samples``. A weight of zero (log weight ``-inf``) is never picked. The
weights need not be normalised. Deterministic given ``generator``; free of side effects but for the
generator's state.

References:

- R. Douc, O. Cappe, E. Moulines (2005), "Comparison of resampling schemes for particle filtering",
  ISPA 2005, 64-69.
- G. Kitagawa (1996), "Monte Carlo filter and smoother for non-Gaussian nonlinear state space
  models", JCGS 5(1), 1-25 (stratified and systematic resampling).
"""

from typing import Optional

import torch

#: the largest float64 below 1: a position rounded up to 1 would fall past the CDF's end
_BELOW_ONE = 1.0 - torch.finfo(torch.float64).eps / 2


def multinomial_resample(
    log_weights: torch.Tensor, num_samples: int, dim: int = -1, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """
    ``num_samples`` independent draws of indices, each with probability proportional to ``exp(log_weights)``.

    :param torch.Tensor log_weights: unnormalised log weights, any batch shape; each batch element needs
        one finite weight.
    :param int num_samples: the number of indices drawn n.
    :param int dim: the dim along which the weights lie.
    :param torch.Generator generator: the source of randomness (torch's default one if None).
    :returns: indices into ``dim``, of the input's shape with ``dim`` of size ``num_samples``.
    :rtype: torch.LongTensor
    """
    rows = log_weights.to(torch.float64).movedim(dim, -1)
    probs = torch.softmax(rows.reshape(-1, rows.shape[-1]), -1)
    picked = torch.multinomial(probs, num_samples, replacement=True, generator=generator)
    return picked.reshape(rows.shape[:-1] + (num_samples,)).movedim(-1, dim)


def stratified_resample(
    log_weights: torch.Tensor, num_samples: int, dim: int = -1, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """
    Stratified resampling: the j-th index is where the weights' CDF passes ``(j + u_j) / n``, the
    ``u_j`` independent uniforms (Kitagawa 1996). Counts of particle i have mean ``n w_i`` and a
    variance at most multinomial's ``n w_i (1 - w_i)`` (Douc et al. 2005).

    :param torch.Tensor log_weights: unnormalised log weights, any batch shape; each batch element needs
        one finite weight.
    :param int num_samples: the number of indices drawn n.
    :param int dim: the dim along which the weights lie.
    :param torch.Generator generator: the source of randomness (torch's default one if None).
    :returns: indices into ``dim``, sorted, of the input's shape with ``dim`` of size ``num_samples``.
    :rtype: torch.LongTensor
    """
    rows = log_weights.movedim(dim, -1)
    offsets = torch.rand(rows.shape[:-1] + (num_samples,), dtype=torch.float64, generator=generator)
    return _invert_cdf(rows, offsets).movedim(-1, dim)


def systematic_resample(
    log_weights: torch.Tensor, num_samples: int, dim: int = -1, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """
    Systematic resampling: the j-th index is where the weights' CDF passes ``(j + u) / n``, one uniform
    ``u`` for all j (Kitagawa 1996). Particle i is picked ``floor(n w_i)`` or ``ceil(n w_i)`` times,
    ``n w_i`` in expectation.

    :param torch.Tensor log_weights: unnormalised log weights, any batch shape; each batch element needs
        one finite weight.
    :param int num_samples: the number of indices drawn n.
    :param int dim: the dim along which the weights lie.
    :param torch.Generator generator: the source of randomness (torch's default one if None).
    :returns: indices into ``dim``, sorted, of the input's shape with ``dim`` of size ``num_samples``.
    :rtype: torch.LongTensor
    """
    rows = log_weights.movedim(dim, -1)
    offset = torch.rand(rows.shape[:-1] + (1,), dtype=torch.float64, generator=generator)
    return _invert_cdf(rows, offset.expand(rows.shape[:-1] + (num_samples,))).movedim(-1, dim)


def _invert_cdf(log_weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """
    The index i with ``CDF[i-1] <= (j + offsets[j]) / n < CDF[i]`` for each j, weights along the last dim.

    The CDF is divided by its last entry, so it ends at exactly 1; a zero weight repeats its
    predecessor's CDF value, so no position can land on it.
    """
    num_samples = offsets.shape[-1]
    weights = torch.softmax(log_weights.to(torch.float64), -1)
    cdf = weights.cumsum(-1)
    cdf = cdf / cdf[..., -1:]
    strata = torch.arange(num_samples, dtype=torch.float64)
    positions = ((strata + offsets) / num_samples).clamp(max=_BELOW_ONE)
    return torch.searchsorted(cdf.contiguous(), positions.contiguous(), right=True)
