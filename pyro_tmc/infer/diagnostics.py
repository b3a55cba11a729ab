"""When to trust importance weights: Pareto-smoothed importance sampling, k-hat, the effective sample size.

Every posterior read-out of TMC is an importance sampler: draws (or whole TMC estimates) carry weights
``w_s``, and a weighted average is only as good as the weights' right tail. Vehtari et al. fit a
generalized Pareto distribution to the largest weights; its shape ``k`` says how many finite moments the
weights have (``1/k``), and so how fast the estimate converges:

- ``k < 0.5``: finite variance, the central limit theorem applies;
- ``0.5 <= k < 0.7``: infinite variance, but the smoothed estimate still converges at a usable rate;
- ``k >= 0.7`` (or above :func:`khat_threshold` for small samples): do not trust the estimate.

k-hat is itself an estimate, with a sampling error of about ``(1 + k) / sqrt(M)`` from the ``M`` tail
draws it fits (:func:`khat_standard_error`). One k-hat is compared with the threshold as it is; many of
them (a k-hat per site and plate element) are compared with :func:`family_khat_threshold`, which allows
for the largest of ``n`` noisy estimates, so that weights whose true ``k`` is at most the threshold
everywhere are flagged with a chosen probability (5%) whatever ``n``. Where the weights come in groups
that differ (TMC draws), k-hat varies more than that formula says, and
:func:`bootstrap_khat_standard_error` measures it.

Replacing the largest weights by the fitted distribution's quantiles (the "smoothing") lowers the
estimate's variance at a small bias. The functions take any batch shape, the weights lying along
``dim``, and compute in float64 whatever the input's dtype.

Edge cases (ArviZ's :func:`arviz.psislw` is the reference, and agrees wherever it defines an answer):

- fewer than 5 draws in the tail (``num_samples <= 20``, or ties among the largest weights): k-hat is
  ``inf``: there are too few draws to fit a tail, so the weights are never reported trustworthy;
- the largest ``M + 1`` weights all equal (constant weights, or a rejection sampler's 0/1 weights):
  k-hat is ``-inf``: the weights are bounded, with no tail at all. (ArviZ returns ``inf`` here, which
  would flag the perfect importance sampler as the worst.);
- every weight ``-inf`` (or a weight ``nan`` / ``+inf``): k-hat is ``nan`` and the weights are
  returned as they came.

References:

- A. Vehtari, D. Simpson, A. Gelman, Y. Yao, J. Gabry (2024), "Pareto smoothed importance
  sampling", JMLR 25(72), 1-58.
- J. Zhang, M. A. Stephens (2009), "A new and efficient estimation method for the generalized
  Pareto distribution", Technometrics 51(3), 316-325.
- R. L. Smith (1985), "Maximum likelihood estimation in a class of nonregular cases", Biometrika
  72(1), 67-90 (the generalized Pareto shape's asymptotic variance ``(1 + k)^2 / M``).
- Z. Sidak (1967), "Rectangular confidence regions for the means of multivariate normal
  distributions", JASA 62(318), 626-633.
- B. Efron, R. J. Tibshirani (1993), "An Introduction to the Bootstrap", Chapman & Hall (Chapter 6:
  the bootstrap estimate of a standard error).
"""

import math
from statistics import NormalDist
from typing import Optional

import torch

#: the fit needs at least this many draws in the tail (ArviZ and the R package ``loo`` agree)
MIN_TAIL_DRAWS = 5
#: the weakly informative prior on k of Vehtari et al. (Appendix C): ``PRIOR_DRAWS`` pseudo-draws at
#: ``PRIOR_KHAT``, which shrinks the noisy estimates of short tails towards 0.5
PRIOR_DRAWS = 10
PRIOR_KHAT = 0.5
#: Zhang and Stephens' grid over the GPD's theta has ``GRID_BASE + floor(sqrt(tail draws))`` points
GRID_BASE = 30
#: grid points whose posterior weight is below this are dropped (as ArviZ and ``loo`` do)
NEGLIGIBLE_GRID_WEIGHT = 10 * torch.finfo(torch.float64).eps
#: below this log weight (relative to the largest) a draw never enters the tail: exp() underflows
LOG_TINY = math.log(torch.finfo(torch.float64).tiny)


def tail_length(num_samples: int, relative_efficiency: float = 1.0) -> int:
    """
    The number of largest weights that PSIS fits: ``M = ceil(min(S / 5, 3 sqrt(S / r_eff)))``.

    Vehtari et al. (2024, Section 3.2) take ``M = min(0.2 S, 3 sqrt(S / r_eff))``; ArviZ (and the R
    package ``loo``) round it up, and so does this function, so that both fit the same draws.

    :param int num_samples: the number of weights S.
    :param float relative_efficiency: the draws' effective sample size over S (1 for independent draws;
        smaller for MCMC), which lengthens the tail to hold ``3 sqrt(ESS)`` effective draws.
    :returns: the tail length M.
    :rtype: int
    """
    return int(math.ceil(min(num_samples / 5.0, 3.0 * math.sqrt(num_samples / relative_efficiency))))


def khat_threshold(num_samples: int) -> float:
    """
    The largest k-hat at which S Pareto-smoothed weights can be trusted: ``min(1 - 1/log10(S), 0.7)``.

    Why (Vehtari et al. 2024, Sections 3.3-3.4): for weights whose tail has shape k, the smoothed
    estimate's error falls with S only once S passes a pre-asymptotic regime, whose length grows
    like ``10^(1 / (1 - k))`` draws (measured there on a range of distributions and proven for the
    generalized Pareto). Inverting ``S > 10^(1/(1-k))`` gives ``k < 1 - 1/log10(S)``. Above 0.7 the
    required sample size grows impractically fast, and k-hat itself is too noisy to rely on, so the
    threshold never exceeds 0.7 (it reaches it at S = 2154). With S <= 10 no k-hat passes: the
    threshold is 0 or below (``-inf`` at S = 1).

    :param int num_samples: the number of weights S.
    :returns: the threshold; k-hat above it says "do not trust this estimate".
    :rtype: float
    """
    if num_samples <= 1:
        return -math.inf
    return min(1.0 - 1.0 / math.log10(num_samples), 0.7)


def khat_standard_error(shape: float, tail_draws: int) -> float:
    """
    The sampling standard deviation of the k-hat that :func:`psis` fits to ``tail_draws`` draws from a
    tail of shape ``shape``: ``(1 + k) / sqrt(M)``, shrunk by the prior, ``M / (M + PRIOR_DRAWS)``.

    Why: the maximum likelihood estimate of a generalized Pareto shape ``k > -1/2`` is asymptotically
    Normal with variance ``(1 + k)^2 / M`` (Smith 1985), and Zhang and Stephens' (2009) estimate is
    as efficient to within a few percent for ``k > 0`` (their Section 4). PSIS then shrinks it by
    ``M / (M + PRIOR_DRAWS)`` towards :data:`PRIOR_KHAT`. Measured on Pareto weights (2,000 sets each,
    ``tests/infer/test_khat_family.py``): at k = 0.7 the empirical sd is 0.151 against 0.158 at
    M = 95 and 0.090 against 0.090 at M = 340; at k = 0.3-1.2 within 5% at M >= 95 and 7% at M = 20.

    :param float shape: the true shape k.
    :param int tail_draws: the tail length M (:func:`tail_length`).
    :returns: the standard deviation of k-hat.
    :rtype: float
    """
    return (1.0 + shape) / math.sqrt(tail_draws) * tail_draws / (tail_draws + PRIOR_DRAWS)


def family_khat_threshold(
    num_samples: int,
    num_tests: int,
    false_alarm: float = 0.05,
    relative_efficiency: float = 1.0,
    standard_error: Optional[float] = None,
) -> float:
    """
    The k-hat above which one of ``num_tests`` k-hats (each fitted to ``num_samples`` weights) says
    "do not trust", such that when every true k is at most :func:`khat_threshold` the largest of them
    passes it with probability at most ``false_alarm``.

    Each k-hat is about Normal (:func:`khat_standard_error`; the tail quantiles are checked by
    simulation), with mean ``(M k + PRIOR_DRAWS PRIOR_KHAT) / (M + PRIOR_DRAWS)`` (the prior's
    shrinkage). At the boundary ``k0 = khat_threshold(S)`` the threshold is that mean plus ``z``
    standard errors, ``z`` the Sidak (1967) quantile ``Phi^-1((1 - false_alarm)^(1 / n))``: exact for
    independent k-hats, conservative for positively dependent ones (k-hats of one set of draws).
    ``num_tests = 1`` gives a one-sided test of one k-hat at level ``false_alarm``; the allowance
    grows like ``sqrt(2 log n)`` standard errors. With K = 32 particles and 400 draws (M = 340,
    se 0.090), the threshold is 0.84 for 1 k-hat, 0.96 for 32 and 1.03 for 500.

    The cost is power: a single element whose true k is just above 0.7 is found less often than by
    ``k-hat > 0.7`` (which, over 30 elements at k = 0.7, flags nearly always: the largest of 30
    noisy estimates is above their mean). A proposal that is clearly bad (k about 1.2 and above, at
    M = 340) is still flagged.

    :param int num_samples: the weights S that each k-hat was fitted to.
    :param int num_tests: how many k-hats are compared (sites times their plate elements).
    :param float false_alarm: the probability of flagging any, when every true k is at the threshold.
    :param float relative_efficiency: see :func:`tail_length`.
    :param float standard_error: a measured standard error of the k-hat at the threshold (e.g.
        :func:`bootstrap_khat_standard_error`, rescaled), used where it is larger than
        :func:`khat_standard_error`'s: weights whose draws differ more than independent ones would.
    :returns: the threshold; where no tail can be fitted (``M < 5``), :func:`khat_threshold` itself (such a
        k-hat is ``inf``, flagged anyway).
    :rtype: float
    """
    if not 0.0 < false_alarm < 1.0:
        raise ValueError(f"false_alarm must lie in (0, 1); got {false_alarm}")
    base = khat_threshold(num_samples)
    tail_draws = tail_length(num_samples, relative_efficiency)
    if tail_draws < MIN_TAIL_DRAWS or not math.isfinite(base):
        return base
    # Sidak: each test at 1 - (1 - alpha)^(1/n), computed without the cancellation of 1 - (1 - tiny)
    per_test = -math.expm1(math.log1p(-false_alarm) / max(num_tests, 1))
    z = -NormalDist().inv_cdf(per_test)
    mean = (tail_draws * base + PRIOR_DRAWS * PRIOR_KHAT) / (tail_draws + PRIOR_DRAWS)
    error = max(khat_standard_error(base, tail_draws), standard_error or 0.0)
    return mean + z * error


def bootstrap_khat_standard_error(
    log_weights: torch.Tensor, num_resamples: int = 100, seed: int = 0
) -> float:
    """
    The standard error of the k-hat of weights that come in independent groups (a TMC draw's particles,
    normalised within their draw), fitted over all of them: the sd of k-hat over ``num_resamples``
    resamples of the groups with replacement (the nonparametric bootstrap, resampling the independent
    units). Seeded by ``seed`` on a generator of its own: the same weights give the same answer.

    Why: the groups' weights are not independent draws of one Pareto tail when the groups differ (a
    draw's globals put its particles' weights in another regime), and then k-hat varies more than
    :func:`khat_standard_error` says. Measured on the unknown-scales Brownian motion's 400 draws of 32
    particles: 0.16-0.19 over the locs' k-hats, against 0.09-0.10 (that formula); on independent groups
    (Pareto or lognormal weights) the bootstrap and the simulated sd agree (0.07-0.09 against 0.07-0.09).

    :param torch.Tensor log_weights: ``(R, K)``: R independent groups of K log weights.
    :param int num_resamples: bootstrap resamples.
    :param int seed: the resampling's seed.
    :returns: the standard error.
    :rtype: float
    """
    groups = log_weights.to(torch.float64).reshape(log_weights.shape[0], -1)
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randint(groups.shape[0], (num_resamples, groups.shape[0]), generator=generator)
    khats = pareto_khat(groups[chosen].reshape(num_resamples, -1), dim=-1)
    return float(khats[torch.isfinite(khats)].std()) if torch.isfinite(khats).sum() > 1 else math.inf


def effective_sample_size(log_weights: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """
    Kish's effective sample size of importance weights, ``(sum w)^2 / sum w^2``, computed in log space
    (so weights of any scale, ``exp(1000)`` or ``exp(-1000)``, neither overflow nor underflow).

    It lies between 1 (one weight carries everything) and S (equal weights); all weights zero
    (every log weight ``-inf``) gives 0: no draw counts.

    Reference: L. Kish (1965), "Survey Sampling"; Vehtari et al. (2024), Section 3.

    :param torch.Tensor log_weights: log weights, any batch shape.
    :param int dim: the dim along which the weights lie.
    :returns: the effective sample size, the batch shape (``dim`` removed), in float64.
    :rtype: torch.Tensor
    """
    log_weights = log_weights.to(torch.float64)
    log_ratio = 2 * torch.logsumexp(log_weights, dim) - torch.logsumexp(2 * log_weights, dim)
    all_zero = torch.isneginf(log_weights).all(dim)
    return torch.where(all_zero, torch.zeros_like(log_ratio), log_ratio.exp())


def pareto_khat(log_weights: torch.Tensor, dim: int = -1, relative_efficiency: float = 1.0) -> torch.Tensor:
    """
    The Pareto shape k-hat of the weights' right tail (see :func:`psis`), without the smoothed weights.

    :param torch.Tensor log_weights: log weights, any batch shape.
    :param int dim: the dim along which the weights lie.
    :param float relative_efficiency: see :func:`tail_length`.
    :returns: k-hat, the batch shape (``dim`` removed).
    :rtype: torch.Tensor
    """
    return psis(log_weights, dim, relative_efficiency)[1]


def psis(
    log_weights: torch.Tensor, dim: int = -1, relative_efficiency: float = 1.0, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Pareto-smoothed importance sampling (Vehtari et al. 2024, Algorithm 1).

    The M largest weights (:func:`tail_length`), less the (M+1)-th largest, are fitted by a generalized
    Pareto distribution (Zhang and Stephens' empirical Bayes estimate, with the paper's weakly
    informative prior on k); each is replaced by the fitted quantile of its rank, ``(i - 1/2) / M``,
    plus that cutoff, and truncated at the largest raw weight. Deterministic and free of side effects.

    Example::

        smoothed, khat = psis(log_p - log_q)   # draws along the last dim
        mean = (smoothed.exp() * f).sum(-1)    # smoothed weights sum to 1
        trusted = khat <= khat_threshold(log_p.shape[-1])

    :param torch.Tensor log_weights: log weights (finite or ``-inf``), any batch shape.
    :param int dim: the dim along which the weights lie.
    :param float relative_efficiency: see :func:`tail_length`.
    :param bool normalize: return log weights that sum (in exp) to 1 along ``dim``, as ArviZ's
        ``psislw`` does; otherwise on the input's scale.
    :returns: ``(smoothed_log_weights, khat)``: the smoothed log weights, of the input's shape, and
        k-hat, of the batch shape (``dim`` removed), both of the input's floating dtype (float64
        otherwise). The edge cases (too few draws, bounded weights, no weight) are in the module's
        docstring.
    :rtype: tuple
    """
    dtype = log_weights.dtype if log_weights.is_floating_point() else torch.float64
    moved = log_weights.to(torch.float64).movedim(dim, -1)
    num_samples = moved.shape[-1]
    rows = moved.reshape(-1, num_samples)
    smoothed, khat = _psis_rows(rows, tail_length(num_samples, relative_efficiency), normalize)
    smoothed = smoothed.reshape(moved.shape).movedim(-1, dim)
    return smoothed.to(dtype), khat.reshape(moved.shape[:-1]).to(dtype)


def _psis_rows(rows: torch.Tensor, tail_draws: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """PSIS of each row of a (rows, S) float64 matrix with tail length ``tail_draws``."""
    largest = rows.max(-1, keepdim=True).values
    usable = torch.isfinite(largest).squeeze(-1)
    # Relative to the largest weight, as ArviZ: the exceedances then lie in (0, 1].
    shifted = torch.where(usable[:, None], rows - largest, torch.zeros_like(rows))
    khat = torch.full(usable.shape, math.inf, dtype=torch.float64)
    if tail_draws >= MIN_TAIL_DRAWS:
        _smooth_tails(shifted, khat, tail_draws)
    if normalize:
        out = shifted - torch.logsumexp(shifted, -1, keepdim=True)
    else:
        out = shifted + torch.where(usable[:, None], largest, torch.zeros_like(largest))
    khat = torch.where(usable, khat, torch.full_like(khat, math.nan))
    return torch.where(usable[:, None], out, rows), khat


def _smooth_tails(shifted: torch.Tensor, khat: torch.Tensor, tail_draws: int) -> None:
    """Fit and smooth every row's tail. Has side effects: writes ``shifted``'s tails and ``khat``."""
    top, top_index = shifted.topk(tail_draws + 1, dim=-1)  # descending
    cutoff = top[:, tail_draws].clamp(min=LOG_TINY)
    # Ties at the cutoff shorten a tail: the tail is the draws strictly above it (a prefix of `top`).
    tail_sizes = (top[:, :tail_draws] > cutoff[:, None]).sum(-1)
    khat[tail_sizes == 0] = -math.inf
    # Rows with the same tail size share one grid and are fitted together.
    for size in tail_sizes.unique().tolist():
        if size < MIN_TAIL_DRAWS:
            continue
        chosen = (tail_sizes == size).nonzero().squeeze(-1)
        tail = top[chosen, :size].flip(-1)  # ascending
        base = cutoff[chosen].exp()[:, None]
        shape, scale = _gpd_fit(tail.exp() - base)
        khat[chosen] = shape
        ranks = (torch.arange(size, dtype=torch.float64) + 0.5) / size
        fitted = (_gpd_quantile(ranks, shape[:, None], scale[:, None]) + base).log().clamp(max=0.0)
        # A failed fit (a non-finite shape or scale) keeps the raw tail, as ArviZ does.
        fit_ok = (torch.isfinite(shape) & (scale > 0))[:, None]
        fitted = torch.where(fit_ok, fitted, tail)
        shifted[chosen[:, None], top_index[chosen, :size].flip(-1)] = fitted


def _gpd_fit(exceedances: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """
    The generalized Pareto's shape k and scale sigma for each row of sorted (ascending) positive
    exceedances, by Zhang and Stephens' (2009) empirical Bayes estimate: a posterior mean of
    ``theta = -k / sigma`` over a grid, weighted by the profile likelihood, then k given that theta,
    shrunk by the prior of Vehtari et al. (:data:`PRIOR_DRAWS` draws at :data:`PRIOR_KHAT`).
    """
    size = exceedances.shape[-1]
    grid_size = GRID_BASE + int(math.sqrt(size))
    steps = torch.arange(1, grid_size + 1, dtype=torch.float64)
    first_quartile = exceedances[:, int(size / 4 + 0.5) - 1, None]
    # Every grid theta is below 1 / max, so 1 - theta x > 0 for all the data.
    theta = 1 / exceedances[:, -1:] + (1 - (grid_size / (steps - 0.5)).sqrt()) / (3 * first_quartile)
    # ArviZ's sign: shape_given_theta = -k(theta) of Zhang and Stephens, which is the GPD's usual k.
    shape_given_theta = torch.log1p(-theta[:, :, None] * exceedances[:, None, :]).mean(-1)
    profile_log_lik = size * ((-theta / shape_given_theta).log() - shape_given_theta - 1)
    grid_weight = torch.softmax(profile_log_lik, -1)
    grid_weight = torch.where(
        grid_weight >= NEGLIGIBLE_GRID_WEIGHT, grid_weight, torch.zeros_like(grid_weight)
    )
    theta_mean = (theta * grid_weight).sum(-1) / grid_weight.sum(-1)
    shape = torch.log1p(-theta_mean[:, None] * exceedances).mean(-1)
    scale = -shape / theta_mean
    shape = (size * shape + PRIOR_DRAWS * PRIOR_KHAT) / (size + PRIOR_DRAWS)
    return shape, scale


def _gpd_quantile(probs: torch.Tensor, shape: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The generalized Pareto's quantiles: ``sigma ((1 - p)^-k - 1) / k``; ``-sigma log(1 - p)`` at k = 0."""
    log_survival = torch.log1p(-probs)
    near_zero = shape.abs() < torch.finfo(torch.float64).eps
    safe_shape = torch.where(near_zero, torch.ones_like(shape), shape)
    general = torch.expm1(-safe_shape * log_survival) / safe_shape
    return scale * torch.where(near_zero, -log_survival, general)
