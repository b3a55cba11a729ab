"""Ground-truth models for the TMC tests.

Every model here is linear-Gaussian, so ``log p(x)`` is available in closed form
from the joint covariance.  The helpers compute it in float64 numpy, independently
of ``pyro_tmc`` (and of torch's own distributions), so they can serve as ground truth.

Contents
--------
* generic: :func:`gaussian_logpdf`, :func:`linear_gaussian_moments`,
  :func:`linear_gaussian_log_marginal`, :func:`gaussian_posterior`.
* (a) the paper's toy model (theta -> z_i -> x_i), Sec. "Comparing TMC, SMC and IWAE".
* (b) the loopy 4-latent graph of the paper's Fig. 1.
* (c) the chain of the paper's Fig. 4 ("Comparing factorised and non-factorised
  proposals"), with a factorised guide and the prior as proposal.
* (d) a two-latent chain with a non-factorised guide (Pyro's own TMC test case).
* hand-written reference estimators (TMC and IWAE, vectorised over repetitions),
  used to calibrate the thresholds of the statistical tests.
"""

import math

import numpy as np
import torch

import pyro
import pyro.distributions as dist

LOG_2PI = math.log(2 * math.pi)


# --------------------------------------------------------------------------- #
# generic linear-Gaussian helpers
# --------------------------------------------------------------------------- #
def gaussian_logpdf(x, mean, cov):
    """Exact ``log N(x; mean, cov)`` (float64, via Cholesky) for a vector ``x``."""
    x = np.atleast_1d(np.asarray(x, dtype=np.float64))
    mean = np.broadcast_to(np.asarray(mean, dtype=np.float64), x.shape)
    cov = np.atleast_2d(np.asarray(cov, dtype=np.float64))
    chol = np.linalg.cholesky(cov)
    r = np.linalg.solve(chol, x - mean)
    logdet = 2.0 * np.log(np.diag(chol)).sum()
    return float(-0.5 * (x.size * LOG_2PI + logdet + r @ r))


def linear_gaussian_moments(weights, noise_var, bias=None):
    """Mean and covariance of a linear-Gaussian DAG ``v = W v + b + eps``.

    ``weights[i, j]`` is the coefficient of parent ``v_j`` in the mean of ``v_i``
    (so ``W`` is strictly lower triangular for a topological order), and
    ``eps_i ~ N(0, noise_var[i])`` independently.  Then
    ``v = (I - W)^{-1} (b + eps)``, whence ``mean = (I - W)^{-1} b`` and
    ``cov = L diag(noise_var) L^T`` with ``L = (I - W)^{-1}``.
    """
    weights = np.asarray(weights, dtype=np.float64)
    n = weights.shape[0]
    bias = np.zeros(n) if bias is None else np.asarray(bias, dtype=np.float64)
    L = np.linalg.inv(np.eye(n) - weights)
    mean = L @ bias
    cov = L @ np.diag(np.asarray(noise_var, dtype=np.float64)) @ L.T
    return mean, cov


def linear_gaussian_log_marginal(x, obs_idx, mean, cov):
    """Exact ``log p(x)`` of the observed coordinates ``obs_idx`` of a joint Gaussian."""
    obs_idx = np.asarray(obs_idx)
    return gaussian_logpdf(x, mean[obs_idx], cov[np.ix_(obs_idx, obs_idx)])


def gaussian_posterior(x, obs_idx, mean, cov):
    """Posterior mean and covariance of the unobserved coordinates given ``x``."""
    n = len(mean)
    obs_idx = np.asarray(obs_idx)
    lat_idx = np.setdiff1d(np.arange(n), obs_idx)
    S_oo = cov[np.ix_(obs_idx, obs_idx)]
    S_lo = cov[np.ix_(lat_idx, obs_idx)]
    S_ll = cov[np.ix_(lat_idx, lat_idx)]
    gain = S_lo @ np.linalg.inv(S_oo)
    post_mean = mean[lat_idx] + gain @ (np.atleast_1d(x) - mean[obs_idx])
    post_cov = S_ll - gain @ S_lo.T
    return post_mean, post_cov


def importance_weight_moment_finite(post_prec, proposal_var, power):
    """Whether ``E_q[w^power]`` is finite for ``w = p(x, z) / q(z)``.

    With ``p(x, z) ∝ exp(-z^T A z / 2 + ...)`` (``A`` the posterior precision) and a
    factorised Gaussian ``q`` of variances ``proposal_var``, ``E_q[w^m]`` is a Gaussian
    integral that is finite iff ``m A - (m - 1) diag(1/proposal_var)`` is positive
    definite.  Every TMC estimator is an average of such weights, so it inherits the
    finiteness of these moments.  ``power=4`` guarantees the sample standard error
    used by the tests is itself a consistent estimate.
    """
    M = power * post_prec - (power - 1) * np.diag(1.0 / np.asarray(proposal_var))
    return bool(np.all(np.linalg.eigvalsh(M) > 0))


# --------------------------------------------------------------------------- #
# (a) the paper's toy model: theta ~ N(0,1), z_i ~ N(theta,1), x_i ~ N(z_i,1)
#
# pyro_tmc.experiments.toy (and benchmarks/models.py, which imports it) has its own
# copy of this model.  This one is deliberately independent: the tests check the
# package against code of their own, never against the package's model code.
# --------------------------------------------------------------------------- #
def toy_cov(N):
    """Covariance of x in the toy model: ``2 I + 1 1^T`` (x has mean 0)."""
    return 2.0 * np.eye(N) + np.ones((N, N))


def toy_log_px(x):
    """Exact ``log p(x)`` of the toy model."""
    x = np.asarray(x, dtype=np.float64)
    return gaussian_logpdf(x, 0.0, toy_cov(len(x)))


def toy_log_px_closed_form(x):
    """Same as :func:`toy_log_px`, via Sherman-Morrison / the matrix determinant lemma:
    ``det(2I + 11^T) = 2^N (1 + N/2)``, ``(2I + 11^T)^{-1} = I/2 - 11^T / (2 (2 + N))``."""
    x = np.asarray(x, dtype=np.float64)
    N = len(x)
    logdet = N * math.log(2.0) + math.log(1.0 + N / 2.0)
    quad = (x @ x) / 2.0 - x.sum() ** 2 / (2.0 * (2.0 + N))
    return -0.5 * (N * LOG_2PI + logdet + quad)


def toy_moments(N):
    """Joint moments of (theta, z_1..z_N, x_1..x_N) via :func:`linear_gaussian_moments`."""
    n = 1 + 2 * N
    W = np.zeros((n, n))
    W[1 : N + 1, 0] = 1.0  # z_i <- theta
    W[N + 1 :, 1 : N + 1] = np.eye(N)  # x_i <- z_i
    return linear_gaussian_moments(W, np.ones(n))


def toy_posterior_moments(x):
    """Exact posterior means and variances of (theta, z_1..z_N) given the toy model's data x."""
    x = np.asarray(x, dtype=np.float64)
    N = len(x)
    mean, cov = toy_moments(N)
    post_mean, post_cov = gaussian_posterior(x, np.arange(N + 1, 2 * N + 1), mean, cov)
    return post_mean, np.diag(post_cov)


def toy_data(N, seed=0):
    """A data set of size N drawn from the toy model (fixed numpy seed), float64 numpy."""
    rng = np.random.default_rng(seed)
    theta = rng.normal()
    z = theta + rng.normal(size=N)
    return z + rng.normal(size=N)


def toy_model(x):
    """Constants are built from ``x`` so the model runs on x's device and dtype."""
    theta = pyro.sample("theta", dist.Normal(x.new_zeros(()), 1.0))
    with pyro.plate("data", x.shape[-1], dim=-1):
        z = pyro.sample("z", dist.Normal(theta, 1.0))
        pyro.sample("x", dist.Normal(z, 1.0), obs=x)


def make_toy_guide(theta_num_samples=None):
    """The paper's proposal: the generative marginals Q(theta)=N(0,1), Q(z_i)=N(0,2).

    ``theta_num_samples`` sets ``infer={"num_samples": K_theta}`` on theta (per-site K).
    """
    infer = {} if theta_num_samples is None else {"num_samples": theta_num_samples}

    def toy_guide(x):
        zero = x.new_zeros(())
        pyro.sample("theta", dist.Normal(zero, 1.0), infer=dict(infer))
        with pyro.plate("data", x.shape[-1], dim=-1):
            pyro.sample("z", dist.Normal(zero, math.sqrt(2.0)))

    return toy_guide


toy_guide = make_toy_guide()


def _normal_logpdf(x, mean, var):
    return -0.5 * (LOG_2PI + math.log(var) + (x - mean) ** 2 / var)


def _logmeanexp(t, dim):
    return torch.logsumexp(t, dim) - math.log(t.shape[dim])


def toy_tmc_reference(x, K, R, generator=None, K_theta=None):
    """Hand-written TMC ``log P_TMC`` for the toy model, R independent draws.

    ``log P = logmeanexp_{k_theta} sum_i logmeanexp_{k_i} log[p(z_i|theta)p(x_i|z_i)/q(z_i)]``
    (q(theta) = p(theta) cancels).  ``K_theta`` (default K) particles for theta.
    Returns a float64 tensor of shape (R,).
    """
    x = torch.as_tensor(x, dtype=torch.float64)
    K_theta = K if K_theta is None else K_theta
    theta = torch.randn(R, K_theta, 1, 1, dtype=torch.float64, generator=generator)
    z = math.sqrt(2.0) * torch.randn(R, 1, K, x.shape[-1], dtype=torch.float64, generator=generator)
    f = _normal_logpdf(z, theta, 1.0) + _normal_logpdf(x, z, 1.0) - _normal_logpdf(z, 0.0, 2.0)
    return _logmeanexp(_logmeanexp(f, -2).sum(-1), -1)


def toy_iwae_reference(x, K, R, generator=None):
    """Hand-written IWAE ``log (1/K sum_k p(x, z^k) / q(z^k))`` with K *joint* samples
    of (theta, z_1..z_N) from the same guide.  Returns shape (R,)."""
    x = torch.as_tensor(x, dtype=torch.float64)
    theta = torch.randn(R, K, 1, dtype=torch.float64, generator=generator)
    z = math.sqrt(2.0) * torch.randn(R, K, x.shape[-1], dtype=torch.float64, generator=generator)
    logw = (_normal_logpdf(z, theta, 1.0) + _normal_logpdf(x, z, 1.0) - _normal_logpdf(z, 0.0, 2.0)).sum(-1)
    return _logmeanexp(logw, -1)


# --------------------------------------------------------------------------- #
# (b) the loopy graph of the paper's Fig. 1:
#     z1 -> z2, z1 -> z3, z2 -> z4, z3 -> x, z4 -> x
# --------------------------------------------------------------------------- #
LOOPY_NAMES = ("z1", "z2", "z3", "z4", "x")
LOOPY_X = 3.0


def loopy_moments():
    """z1~N(0,1), z2~N(z1,1), z3~N(z1,1), z4~N(z2,1), x~N(z3+z4,1); Var(x) = 8."""
    W = np.zeros((5, 5))
    W[1, 0] = W[2, 0] = W[3, 1] = W[4, 2] = W[4, 3] = 1.0
    return linear_gaussian_moments(W, np.ones(5))


def loopy_log_px(x=LOOPY_X):
    mean, cov = loopy_moments()
    return linear_gaussian_log_marginal([x], [4], mean, cov)


def loopy_model(x):
    z1 = pyro.sample("z1", dist.Normal(x.new_zeros(()), 1.0))
    z2 = pyro.sample("z2", dist.Normal(z1, 1.0))
    z3 = pyro.sample("z3", dist.Normal(z1, 1.0))
    z4 = pyro.sample("z4", dist.Normal(z2, 1.0))
    pyro.sample("x", dist.Normal(z3 + z4, 1.0), obs=x)


def loopy_guide_params(x=LOOPY_X, widen=1.5):
    """Factorised guide: the exact posterior marginals, standard deviation ``widen``
    times larger (a slightly over-dispersed proposal keeps the weights' moments finite,
    see :func:`importance_weight_moment_finite`)."""
    mean, cov = loopy_moments()
    post_mean, post_cov = gaussian_posterior([x], [4], mean, cov)
    return post_mean, widen * np.sqrt(np.diag(post_cov))


def make_loopy_guide(x=LOOPY_X, widen=1.5):
    locs, scales = loopy_guide_params(x, widen)

    def loopy_guide(x):
        for name, loc, scale in zip(LOOPY_NAMES[:4], locs, scales):
            pyro.sample(name, dist.Normal(x.new_tensor(float(loc)), float(scale)))

    return loopy_guide


def loopy_tmc_reference(K, R, generator=None, x=LOOPY_X, widen=1.5):
    """Hand-written TMC for the loopy graph with the factorised guide: the average over
    all K^4 particle combinations by one einsum over the five factors.  Shape (R,)."""
    locs, scales = loopy_guide_params(x, widen)
    z = [
        float(m) + float(s) * torch.randn(R, K, dtype=torch.float64, generator=generator)
        for m, s in zip(locs, scales)
    ]
    logq = [_normal_logpdf(zz, float(m), float(s) ** 2) for zz, m, s in zip(z, locs, scales)]
    factors = [
        _normal_logpdf(z[0], 0.0, 1.0) - logq[0],  # [r, a]
        _normal_logpdf(z[1][:, None, :], z[0][:, :, None], 1.0) - logq[1][:, None, :],  # [r, a, b]
        _normal_logpdf(z[2][:, None, :], z[0][:, :, None], 1.0) - logq[2][:, None, :],  # [r, a, c]
        _normal_logpdf(z[3][:, None, :], z[1][:, :, None], 1.0) - logq[3][:, None, :],  # [r, b, d]
        _normal_logpdf(x, z[2][:, :, None] + z[3][:, None, :], 1.0),  # [r, c, d]
    ]
    shifts = [f.flatten(1).max(-1).values for f in factors]
    exps = [torch.exp(f - c.view((-1,) + (1,) * (f.dim() - 1))) for f, c in zip(factors, shifts)]
    P = torch.einsum("ra,rab,rac,rbd,rcd->r", *exps)
    return torch.log(P) + sum(shifts) - 4 * math.log(K)


# --------------------------------------------------------------------------- #
# (c) the chain of the paper's Fig. 4: z_0 = 0, z_i ~ N(z_{i-1}, 1/N), x ~ N(z_N, 1)
# --------------------------------------------------------------------------- #
CHAIN_X = 1.0


def chain_log_px(x=CHAIN_X):
    """z_N ~ N(0, N * 1/N) = N(0, 1), so x ~ N(0, 2) whatever N."""
    return gaussian_logpdf([x], 0.0, [[2.0]])


def chain_moments(N):
    """Joint moments of (z_1..z_N, x) via :func:`linear_gaussian_moments`."""
    W = np.zeros((N + 1, N + 1))
    W[np.arange(1, N + 1), np.arange(N)] = 1.0
    return linear_gaussian_moments(W, np.r_[np.full(N, 1.0 / N), 1.0])


def chain_model(x, N):
    z = torch.zeros((), dtype=x.dtype, device=x.device)
    scale = math.sqrt(1.0 / N)
    for i in pyro.markov(range(1, N + 1)):
        z = pyro.sample(f"z_{i}", dist.Normal(z, scale))
    pyro.sample("x", dist.Normal(z, 1.0), obs=x)


def chain_guide_factorised(x, N):
    """Q(z_i) = N(0, i/N): the prior marginal of z_i."""
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    for i in pyro.markov(range(1, N + 1)):
        pyro.sample(f"z_{i}", dist.Normal(zero, math.sqrt(i / N)))


def chain_guide_prior(x, N):
    """Empty guide: every z_i is drawn from the model's conditional p(z_i | z_{i-1})
    (the paper's non-factorised proposal)."""


def _ancestors(proposal, R, K, generator=None):
    """Each particle's upstream particle under ``proposal``: shape (R, K)."""
    if proposal == "diagonal":
        return torch.arange(K).expand(R, K)
    if proposal == "permutation":
        return torch.argsort(torch.rand(R, K, generator=generator), -1)
    if proposal == "mixture":
        return torch.randint(K, (R, K), generator=generator)
    raise ValueError(proposal)


def chain_tmc_reference(x, N, K, R, proposal="factorised", generator=None):
    """Hand-written TMC ``log P_TMC`` for the chain by a forward recursion in log space.

    ``proposal``: "factorised" (Q(z_i)=N(0,i/N)), or the prior with ancestor picks
    "mixture" / "permutation" (proposal density = mixture over upstream particles) or
    "diagonal" (particle k descends from particle k).  Returns shape (R,).
    """
    var = 1.0 / N
    dt = torch.float64
    zprev = torch.zeros(R, K, dtype=dt)
    alpha = torch.zeros(R, K, dtype=dt)  # log of (1/K^{i-1}) sum over upstream indices
    for i in range(1, N + 1):
        if proposal == "factorised":
            z = math.sqrt(i / N) * torch.randn(R, K, dtype=dt, generator=generator)
            logq = _normal_logpdf(z, 0.0, i / N)
        else:
            anc = _ancestors(proposal, R, K, generator)
            z = zprev.gather(-1, anc) + math.sqrt(var) * torch.randn(R, K, dtype=dt, generator=generator)
            pair = _normal_logpdf(z[:, :, None], zprev[:, None, :], var)  # [r, k_i, k_{i-1}]
            logq = pair.diagonal(dim1=-2, dim2=-1) if proposal == "diagonal" else _logmeanexp(pair, -1)
        if i == 1:
            trans = _normal_logpdf(z, 0.0, var)
        else:
            trans = torch.logsumexp(
                alpha[:, None, :] + _normal_logpdf(z[:, :, None], zprev[:, None, :], var), -1
            )
        alpha = trans - logq - math.log(K)
        zprev = z
    return torch.logsumexp(alpha + _normal_logpdf(x, zprev, 1.0), -1)


# --------------------------------------------------------------------------- #
# (d) non-factorised guide on a two-latent chain (as in Pyro's tests/infer/test_tmc.py)
# --------------------------------------------------------------------------- #
NONFACT_X = 2.0


def nonfact_log_px(x=NONFACT_X):
    """z0~N(0,1), z1~N(z0,1), x~N(z1,1): x ~ N(0, 3); log N(2; 0, 3) = -2.1349..."""
    mean, cov = linear_gaussian_moments([[0, 0, 0], [1, 0, 0], [0, 1, 0]], [1.0, 1.0, 1.0])
    return linear_gaussian_log_marginal([x], [2], mean, cov)


def nonfact_model(x):
    z0 = pyro.sample("z0", dist.Normal(x.new_zeros(()), 1.0))
    z1 = pyro.sample("z1", dist.Normal(z0, 1.0))
    pyro.sample("x", dist.Normal(z1, 1.0), obs=x)


def nonfact_guide(x):
    z0 = pyro.sample("z0", dist.Normal(x.new_tensor(0.5), 1.0))
    pyro.sample("z1", dist.Normal(0.8 * z0 + 0.6, 0.9))


def nonfact_tmc_reference(K, R, proposal="mixture", generator=None, x=NONFACT_X):
    """Hand-written TMC for (d): z0^a ~ q(z0); z1^b ~ q(z1 | z0^{anc(b)}) with the
    ancestor scheme of ``proposal``; z1^b is scored by the mixture over all z0
    particles ("mixture"/"permutation") or by q(z1 | z0^b) ("diagonal").  Shape (R,)."""
    z0 = 0.5 + torch.randn(R, K, dtype=torch.float64, generator=generator)
    anc = _ancestors(proposal, R, K, generator)
    z1 = 0.8 * z0.gather(-1, anc) + 0.6 + 0.9 * torch.randn(R, K, dtype=torch.float64, generator=generator)
    pair = _normal_logpdf(z1[:, :, None], 0.8 * z0[:, None, :] + 0.6, 0.81)  # [r, b, a]
    logq1 = pair.diagonal(dim1=-2, dim2=-1) if proposal == "diagonal" else _logmeanexp(pair, -1)
    f = (
        (_normal_logpdf(z0, 0.0, 1.0) - _normal_logpdf(z0, 0.5, 1.0))[:, None, :]
        + _normal_logpdf(z1[:, :, None], z0[:, None, :], 1.0)
        + (_normal_logpdf(x, z1, 1.0) - logq1)[:, :, None]
    )
    return torch.logsumexp(f.flatten(1), -1) - 2 * math.log(K)


# --------------------------------------------------------------------------- #
# (e) exact marginalisation of a discrete site: c ~ Cat(pi), [z ~ N(mu_c, 1)], x ~ N(., 1)
# --------------------------------------------------------------------------- #
MIX_PROBS = (0.2, 0.5, 0.3)
MIX_LOCS = (-2.0, 0.5, 3.0)
MIX_X = 1.5


def discrete_log_px(x=MIX_X, with_z=False):
    """``log sum_c pi_c N(x; mu_c, 1 + [with_z])``: z ~ N(mu_c, 1) adds unit variance."""
    var = 2.0 if with_z else 1.0
    return float(
        np.logaddexp.reduce(
            [math.log(p) + gaussian_logpdf([x], m, [[var]]) for p, m in zip(MIX_PROBS, MIX_LOCS)]
        )
    )


def make_discrete_model(with_z):
    def discrete_model(x):
        probs = x.new_tensor(MIX_PROBS)
        locs = x.new_tensor(MIX_LOCS)
        c = pyro.sample("c", dist.Categorical(probs), infer={"enumerate": "parallel"})
        loc = locs[c]
        if with_z:
            loc = pyro.sample("z", dist.Normal(loc, 1.0))
        pyro.sample("x", dist.Normal(loc, 1.0), obs=x)

    return discrete_model


def discrete_guide(x):
    """Proposal for z only (c is absent from the guide, so it is summed exactly)."""
    pyro.sample("z", dist.Normal(x.new_tensor(0.5), 2.5))


def empty_guide(*args, **kwargs):
    pass


def discrete_tmc_reference(K, R, generator=None, x=MIX_X):
    """Hand-written TMC for the discrete model with z: c summed exactly, z^k from the
    guide N(0.5, 2.5^2).  Shape (R,)."""
    z = 0.5 + 2.5 * torch.randn(R, K, 1, dtype=torch.float64, generator=generator)
    log_pi = torch.tensor(MIX_PROBS, dtype=torch.float64).log()
    mu = torch.tensor(MIX_LOCS, dtype=torch.float64)
    f = torch.logsumexp(log_pi + _normal_logpdf(z, mu, 1.0), -1)
    f = f + _normal_logpdf(x, z[..., 0], 1.0) - _normal_logpdf(z[..., 0], 0.5, 6.25)
    return _logmeanexp(f, -1)
