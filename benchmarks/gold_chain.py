"""Stochastic volatility written for speed: TMC's chain as ``vectorized_markov``, NUTS's as one vector site.

:mod:`gold` writes the gym's stochastic volatility model with ``pyro.markov``: one sample statement
per day, which is Python work per day for every method. On the 2,516-day series that is what made
the run infeasible (3 s a step at K = 4). This module writes the same joint density twice more:

- :func:`vectorized_model` for TMC: the log volatilities in
  :func:`pyro.contrib.funsor.vectorized_markov`, so the model scores every day's transition in one
  statement and :mod:`pyro_tmc.estimate.vectorized_markov` contracts the time dim in ``log2(T)`` batched
  matrix products. The guide (:class:`ChainGuide`) puts the three globals in one particle group:
  K joint draws of (persistence, mean, shock scale) on one dim, so each link of the chain is a
  ``(K, K, K)`` factor (global, day t-1, day t), not K^5 as with a dim per global.
- :func:`nuts_model` for Pyro's NUTS: the log volatilities one vector site, the AR(1) density one
  ``pyro.factor``. A gradient is a few vector operations (about 3 ms here under ``jit_compile``),
  where the per-day model traces 5,000 sites per gradient.

Both score exactly the density of :func:`gold.stochastic_volatility_model`.

References: Kim, Shephard and Chib (1998) "Stochastic volatility: likelihood inference and
comparison with ARCH models" (the model); Inference Gym's ``stochastic_volatility.py`` (its
centered parameterisation); Aitchison (2019) "Tensor Monte Carlo" (the estimate).
"""

import json
import math
import time
from collections.abc import Sequence
from typing import NamedTuple, Optional

import numpy as np
import torch

import pyro
import pyro.distributions as dist
from pyro.contrib.funsor import vectorized_markov
from pyro.distributions import constraints
from pyro.distributions.transforms import biject_to
from pyro.infer import MCMC, NUTS, SVI

from pyro_tmc import TMC_ELBO
from pyro_tmc.infer.posterior import marginals_and_log_estimate

#: the model's global latents and their supports (their order is the model's)
GLOBALS = {
    "persistence_of_volatility": constraints.interval(-1.0, 1.0),
    "mean_log_volatility": constraints.real,
    "white_noise_shock_scale": constraints.positive,
}
CHAIN = "log_volatility"
#: the adaptive read-out (:func:`adapt_proposal`): factors on the globals' pooled posterior sd (the
#: Student-t's scale) and on each day's pooled sd in the next proposal
ROUND_WIDEN, DAY_WIDEN = 1.3, 1.5
#: each adaptive round's TMC draws, and its globals' K
ADAPT_DRAWS, ADAPT_GLOBAL_K = 10, 64
#: the degrees of freedom of the adapted globals' Student-t proposal (None: a Normal)
GLOBAL_DF: Optional[float] = 5.0


class PersistencePrior(dist.TransformedDistribution):
    """``2 Beta(20, 1.5) - 1``, with its support (-1, 1) declared: an affine map's own is the real line."""

    support = constraints.interval(-1.0, 1.0)


def persistence_prior() -> PersistencePrior:
    """The gym's prior of the AR(1) persistence (every stochastic volatility model here uses it)."""
    return PersistencePrior(dist.Beta(20.0, 1.5), [dist.transforms.AffineTransform(-1.0, 2.0)])


def global_priors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample the three globals from the gym's priors (inside a model)."""
    persistence = pyro.sample("persistence_of_volatility", persistence_prior())
    mean = pyro.sample("mean_log_volatility", dist.Cauchy(0.0, 5.0))
    shock_scale = pyro.sample("white_noise_shock_scale", dist.HalfCauchy(2.0))
    return persistence, mean, shock_scale


def vectorized_model(returns: torch.Tensor) -> None:
    """
    The gym's centered AR(1) log volatility, its days in ``vectorized_markov``: the sites are
    ``log_volatility_0`` and ``log_volatility_slice(1, T, None)`` (days 1..T-1, one statement).

    :param torch.Tensor returns: the centered daily returns, shape ``(T,)``.
    """
    persistence, mean, shock_scale = global_priors()
    previous = None
    for t in vectorized_markov(name="days", size=len(returns), dim=-1):
        if previous is None:  # day 0: the stationary distribution
            step = dist.Normal(mean, shock_scale / (1 - persistence.square()).sqrt())
        else:
            step = dist.Normal(mean + persistence * (previous - mean), shock_scale)
        previous = pyro.sample(f"{CHAIN}_{t}", step)
        pyro.sample(f"returns_{t}", dist.Normal(0.0, (previous / 2).exp()), obs=returns[t])


def nuts_model(returns: torch.Tensor) -> None:
    """
    The same density for NUTS: the log volatilities one site of shape ``(T,)`` (a flat base
    measure, ``mask(False)``, so that its density is the AR(1) factor alone).
    """
    persistence, mean, shock_scale = global_priors()
    flat = dist.Normal(0.0, 1.0).expand([len(returns)]).to_event(1).mask(False)
    log_volatility = pyro.sample(CHAIN, flat)
    first = dist.Normal(mean, shock_scale / (1 - persistence.square()).sqrt()).log_prob(
        log_volatility[..., 0]
    )
    later = dist.Normal(mean + persistence * (log_volatility[..., :-1] - mean), shock_scale)
    pyro.factor("ar1", first + later.log_prob(log_volatility[..., 1:]).sum(-1))
    pyro.sample("returns", dist.Normal(0.0, (log_volatility / 2).exp()).to_event(1), obs=returns)


class ChainGuide:
    """
    A mean-field guide for :func:`vectorized_model`: a Normal per global in its unconstrained space,
    the three in one particle group (K joint draws on one dim), and a Normal per day, drawn for all
    days at once inside the same ``vectorized_markov`` loop as the model.

    :param dict init: starting values: each global's (constrained) and ``"log_volatility"``'s.
    :param int num_days: the series' length.
    :param float init_scale: the globals' unconstrained scale at the start.
    :param float chain_scale: the days' scale at the start.
    :ivar global_samples: the globals' K (their group's ``infer["num_samples"]``); ``None``: the loss's.
    :ivar float widen: a factor on the globals' trained scales (a wider read-out proposal).
    """

    def __init__(self, init: dict[str, float], num_days: int, init_scale: float = 0.1, chain_scale=0.5):
        self.init, self.num_days = init, num_days
        self.init_scale, self.chain_scale = init_scale, chain_scale
        self.global_samples: Optional[int] = None
        self.widen = 1.0

    def __call__(self, returns: torch.Tensor) -> None:
        for name, support in GLOBALS.items():
            transform = biject_to(support)
            start = transform.inv(torch.tensor(float(self.init[name])))
            loc = pyro.param(f"chain_guide.{name}.loc", start.clone)
            scale = pyro.param(
                f"chain_guide.{name}.scale", lambda: torch.tensor(self.init_scale), constraints.positive
            )
            proposal = dist.TransformedDistribution(dist.Normal(loc, self.widen * scale), transform)
            infer = {"particle_group": "globals"}
            if self.global_samples:
                infer["num_samples"] = self.global_samples
            pyro.sample(name, proposal, infer=infer)
        loc = pyro.param(
            "chain_guide.days.loc", lambda: torch.full((self.num_days,), float(self.init[CHAIN]))
        )
        scale = pyro.param(
            "chain_guide.days.scale",
            lambda: torch.full((self.num_days,), self.chain_scale),
            constraints.positive,
        )
        for t in vectorized_markov(name="days", size=self.num_days, dim=-1):
            pyro.sample(f"{CHAIN}_{t}", dist.Normal(loc[t], scale[t]))


def from_proposal_coordinates(joint: torch.Tensor, center: float):
    """
    The globals from :class:`AdaptedChainGuide`'s coordinates ``(logit-scaled persistence, v, log
    shock scale)``, where the mean log volatility is ``center + v * shock_scale / (1 - persistence)``;
    with each global's ``log |d coordinate / d global|`` (its ``Delta`` site's ``log_density``).

    The mean's posterior is a funnel in the persistence: given persistence near 1 the days barely
    tie the mean down, its conditional sd grows as the AR(1)'s long-run sd ``shock_scale /
    (1 - persistence)`` (in NUTS draws of the 100 days, from 0.5 to 2.8 across the persistence's
    quintiles; the mean's kurtosis is 17). Scaled by the long-run sd it is near Normal (kurtosis 0.3).
    """
    persistence_transform = biject_to(GLOBALS["persistence_of_volatility"])
    persistence = persistence_transform(joint[..., 0])
    shock_scale = joint[..., 2].exp()
    long_run_scale = shock_scale / (1 - persistence)
    mean = center + joint[..., 1] * long_run_scale
    log_densities = (
        persistence_transform.inv.log_abs_det_jacobian(persistence, joint[..., 0]),
        -long_run_scale.log(),
        -joint[..., 2],
    )
    return (persistence, mean, shock_scale), log_densities


def to_proposal_coordinates(persistence, mean, shock_scale, center: float) -> torch.Tensor:
    """The inverse of :func:`from_proposal_coordinates`: shape ``batch + (3,)``."""
    unconstrained = biject_to(GLOBALS["persistence_of_volatility"]).inv(persistence)
    v = (mean - center) * (1 - persistence) / shock_scale
    return torch.stack([unconstrained, v, shock_scale.log()], -1)


class AdaptedChainGuide:
    """
    A fixed proposal for :func:`vectorized_model`'s read-out, moved onto the TMC posterior by
    :func:`adapt_proposal`: the three globals one 3-dimensional Student-t (:data:`GLOBAL_DF` degrees
    of freedom) with a full scale matrix in the coordinates of :func:`from_proposal_coordinates`
    (an auxiliary site, unpacked by ``Delta`` sites with the maps' log-Jacobians, as
    ``AutoMultivariateNormal`` unpacks its draws), and a Normal per day.

    Why this shape: the globals' posterior is correlated (persistence against shock scale and
    mean), so the proposal has a full covariance; the mean log volatility is a funnel in the
    persistence, which the coordinates undo; and the persistence's unconstrained posterior has an
    exponential right tail (the Beta prior's), under which a Normal proposal's weights would be
    unbounded, a Student-t's are not.

    :param torch.Tensor globals_loc: the globals' mean in the proposal coordinates, shape ``(3,)``.
    :param torch.Tensor globals_scale_tril: the Cholesky factor of their scale matrix, ``(3, 3)``.
    :param float center: the mean log volatility's centre in the coordinates.
    :param torch.Tensor days_loc: the days' proposal means, ``(T,)``.
    :param torch.Tensor days_scale: the days' proposal sds, ``(T,)``.
    :ivar global_samples: the globals' K (the auxiliary site's ``infer["num_samples"]``).
    :ivar float widen: a factor on the globals' scale.
    """

    def __init__(self, globals_loc, globals_scale_tril, center: float, days_loc, days_scale) -> None:
        self.globals_loc, self.globals_scale_tril, self.center = globals_loc, globals_scale_tril, center
        self.days_loc, self.days_scale = days_loc, days_scale
        self.global_samples: Optional[int] = None
        self.widen = 1.0

    @classmethod
    def from_trained(cls, guide: ChainGuide) -> "AdaptedChainGuide":
        """The trained mean-field :class:`ChainGuide`'s proposal, moved to the coordinates, detached."""
        store = pyro.get_param_store()
        locs = [store[f"chain_guide.{name}.loc"].detach() for name in GLOBALS]
        scales = [store[f"chain_guide.{name}.scale"].detach() for name in GLOBALS]
        persistence = biject_to(GLOBALS["persistence_of_volatility"])(locs[0])
        shock_scale = locs[2].exp()
        center = float(locs[1])
        # the mean's trained sd, in units of the long-run sd at the other globals' locations
        v_scale = scales[1] * (1 - persistence) / shock_scale
        scale_tril = torch.diag(torch.stack([scales[0], v_scale, scales[2]]))
        days = (store["chain_guide.days.loc"].detach(), store["chain_guide.days.scale"].detach())
        loc = torch.stack([locs[0], torch.zeros(()), locs[2]])
        return cls(loc, scale_tril, center, *days)

    def __call__(self, returns: torch.Tensor) -> None:
        infer = {"is_auxiliary": True}
        if self.global_samples:
            infer["num_samples"] = self.global_samples
        scale_tril = self.widen * self.globals_scale_tril
        if GLOBAL_DF:
            proposal = dist.MultivariateStudentT(GLOBAL_DF, self.globals_loc, scale_tril)
        else:
            proposal = dist.MultivariateNormal(self.globals_loc, scale_tril=scale_tril)
        joint = pyro.sample("chain_globals", proposal, infer=infer)
        values, log_densities = from_proposal_coordinates(joint, self.center)
        for name, value, log_density in zip(GLOBALS, values, log_densities):
            pyro.sample(name, dist.Delta(value, log_density=log_density))
        for t in vectorized_markov(name="days", size=len(self.days_loc), dim=-1):
            pyro.sample(f"{CHAIN}_{t}", dist.Normal(self.days_loc[t], self.days_scale[t]))


class DrawMoments(NamedTuple):
    """
    What one TMC draw says about the posterior, for :func:`adapt_proposal`.

    :ivar float log_evidence: the draw's ``log P_TMC``.
    :ivar torch.Tensor global_particles: the globals' particles, ``(K_globals, 3)``.
    :ivar torch.Tensor global_log_weights: their marginal log weights, normalised within the draw.
    :ivar torch.Tensor day_firsts: each day's marginal mean, ``(T,)``.
    :ivar torch.Tensor day_seconds: each day's marginal second moment, ``(T,)``.
    """

    log_evidence: float
    global_particles: torch.Tensor
    global_log_weights: torch.Tensor
    day_firsts: torch.Tensor
    day_seconds: torch.Tensor


def draw_moments(draw, num_days: int) -> DrawMoments:
    """:class:`DrawMoments` of a draw of :func:`vectorized_model` (float64)."""
    marginals, log_estimate = marginals_and_log_estimate(draw)
    particles = [marginals[name]._samples.double().reshape(-1) for name in GLOBALS]
    # the globals share one particle dim (one auxiliary site): one set of weights
    log_weights = marginals[next(iter(GLOBALS))]._log_weights.double().reshape(-1)
    days = [marginals[f"{CHAIN}_0"], marginals[f"{CHAIN}_{slice(1, num_days)}"]]
    firsts = torch.cat([day.mean.double().reshape(-1) for day in days])
    seconds = torch.cat([day.expectation(torch.square).double().reshape(-1) for day in days])
    return DrawMoments(
        float(log_estimate),
        torch.stack(particles, -1),
        log_weights - torch.logsumexp(log_weights, 0),
        firsts,
        seconds,
    )


def adapt_proposal(
    problem, guide: AdaptedChainGuide, num_samples: int, rounds: int, draws: int, global_samples: int
) -> AdaptedChainGuide:
    """
    Adaptive importance sampling of the globals with TMC's own weights: each round reads ``draws``
    TMC draws of ``global_samples`` global particles and ``num_samples`` per day, then moves the
    globals' proposal to the TMC-weighted mean and covariance of its particles (each particle
    weighted by its marginal weight times its draw's ``P_TMC``), widened by :data:`ROUND_WIDEN`,
    and each day's proposal to its pooled marginal mean and sd, widened by :data:`DAY_WIDEN`.

    The weights are consistent whatever the proposal, so the rounds undo the bound's bias on the
    globals (the trained proposal sits at the bound's optimum, not at the posterior); the widths
    keep the tails that the last round's few particles missed. Population Monte Carlo (Cappe,
    Guillin, Marin and Robert 2004), with TMC draws as the samples.

    :returns: the adapted guide (a new one; ``guide`` is left as it was).
    """
    (returns,) = problem.args
    readout = TMC_ELBO(num_samples=num_samples, max_plate_nesting=1)
    for _ in range(rounds):
        guide.global_samples = global_samples
        moments = []
        for _ in range(draws):
            with torch.no_grad():
                moments.append(draw_moments(readout.draw(vectorized_model, guide, returns), len(returns)))
        guide = pooled_proposal(moments, guide.center)
    return guide


def pooled_proposal(moments: Sequence[DrawMoments], center: float) -> AdaptedChainGuide:
    """
    The proposal at the draws' pooled posterior moments: the globals' weighted mean and covariance
    (in :func:`to_proposal_coordinates` about ``center``) widened by :data:`ROUND_WIDEN`, each day's
    mean and sd widened by :data:`DAY_WIDEN`.
    """
    log_evidences = torch.tensor([m.log_evidence for m in moments], dtype=torch.float64)
    firsts = torch.stack([m.day_firsts for m in moments])
    seconds = torch.stack([m.day_seconds for m in moments])
    day_mean, day_sd = pool(firsts, seconds, torch.softmax(log_evidences, 0))
    # a particle's weight: its marginal weight in its draw times the draw's P_TMC
    weights = torch.softmax(torch.cat([m.global_log_weights + m.log_evidence for m in moments]), 0)
    particles = to_proposal_coordinates(*torch.cat([m.global_particles for m in moments]).unbind(-1), center)
    mean = weights @ particles
    deviations = particles - mean
    covariance = (weights[:, None] * deviations).T @ deviations
    jitter = 1e-9 * torch.eye(len(GLOBALS), dtype=covariance.dtype)
    scale_tril = torch.linalg.cholesky(covariance + jitter)
    return AdaptedChainGuide(
        mean.float(), ROUND_WIDEN * scale_tril.float(), center, day_mean.float(), DAY_WIDEN * day_sd.float()
    )


def chain_moments_to_sites(moments: dict[str, tuple[torch.Tensor, torch.Tensor]], num_days: int):
    """The vectorized sites' moments under the per-day site names of :mod:`gold` (``log_volatility_t``)."""
    first = moments[f"{CHAIN}_0"]
    later = moments[f"{CHAIN}_{slice(1, num_days)}"]
    sites = {name: moments[name] for name in GLOBALS}
    for t in range(num_days):
        source, index = (first, 0) if t == 0 else (later, t - 1)
        sites[f"{CHAIN}_{t}"] = tuple(value.reshape(-1)[index] for value in source)
    return sites


def train_tmc(
    problem, steps: int, num_samples: int, lr: float, compile: Optional[str], progress
) -> ChainGuide:
    """``steps`` of SVI with ``TMC_ELBO(num_samples)`` on :func:`vectorized_model` (Adam at ``lr``)."""
    (returns,) = problem.args
    init = {name: problem.init[name] for name in GLOBALS}
    init[CHAIN] = problem.init[f"{CHAIN}_0"]
    guide = ChainGuide(init, len(returns))
    loss = TMC_ELBO(num_samples=num_samples, max_plate_nesting=1, compile=compile)
    svi = SVI(vectorized_model, guide, pyro.optim.Adam({"lr": lr}), loss)
    for _ in progress(range(steps)):
        svi.step(returns)
    return guide


def pool(
    firsts: torch.Tensor, seconds: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Means and sds from draws' (dim 0) first and second moments, pooled with ``weights`` (summing to 1)."""
    first = (weights[:, None] * firsts).sum(0)
    second = (weights[:, None] * seconds).sum(0)
    return first, (second - first.square()).clamp(min=0).sqrt()


def read_tmc(problem, guide: ChainGuide, num_samples: int, num_draws: int, log, checkpoints: Sequence[int]):
    """
    Read ``num_draws`` TMC draws at ``num_samples`` of :func:`vectorized_model`; at each checkpoint (a
    number of draws), ``log(weighting, sites' moments, effective draws)`` for both of
    :func:`pyro_tmc.infer.posterior_moments`'s weightings, pooled from the same draws:
    ``"uniform"`` (each draw's marginals averaged plainly) and ``"evidence"`` (each draw weighted
    by its ``P_TMC``, consistent in the number of draws).
    """
    (returns,) = problem.args
    readout = TMC_ELBO(num_samples=num_samples, max_plate_nesting=1)
    names, firsts, seconds, log_evidences = None, [], [], []
    for done in range(1, num_draws + 1):
        with torch.no_grad():
            draw = readout.draw(vectorized_model, guide, returns)
        marginals, log_estimate = marginals_and_log_estimate(draw)
        names = names or list(marginals)
        firsts.append(torch.cat([marginals[name].mean.double().reshape(-1) for name in names]))
        seconds.append(
            torch.cat([marginals[name].expectation(torch.square).double().reshape(-1) for name in names])
        )
        log_evidences.append(float(log_estimate))
        if done not in checkpoints and done != num_draws:
            continue
        for weighting in ("uniform", "evidence"):
            weights = torch.tensor(log_evidences, dtype=torch.float64)
            weights = torch.softmax(weights if weighting == "evidence" else 0 * weights, 0)
            means, sds = pool(torch.stack(firsts), torch.stack(seconds), weights)
            sizes = [marginals[name].mean.numel() for name in names]
            moments = dict(zip(names, zip(means.split(sizes), sds.split(sizes))))
            log(
                weighting,
                chain_moments_to_sites(moments, len(returns)),
                done,
                float(1 / weights.square().sum()),
            )


class NutsTimeline:
    """
    A ``hook_fn`` for Pyro's ``MCMC`` that keeps running moments of the draws after warm-up and, at
    each checkpoint (a number of draws), logs the wall time since the start and the errors
    against the gold: error against time from one chain.

    :param score: gym estimate -> error metrics (:func:`gold.errors` of the problem).
    :param checkpoints: numbers of post-warm-up draws at which to log.
    :param str path: a JSON-lines file each checkpoint is appended to (survives a killed run).
    """

    def __init__(self, score, checkpoints: Sequence[int], path: Optional[str], warmup: int) -> None:
        self.score, self.checkpoints, self.path, self.warmup = score, set(checkpoints), path, warmup
        self.start, self.cpu_start = time.perf_counter(), time.process_time()
        self.warmup_seconds = math.nan
        self.count, self.first, self.second = 0, None, None
        self.rows: list[dict] = []

    def __call__(self, kernel, params: dict[str, torch.Tensor], stage: str, i: int) -> None:
        if stage.startswith("Warmup"):
            self.warmup_seconds = time.perf_counter() - self.start
            return
        values = {
            name: kernel.transforms[name].inv(value) if name in kernel.transforms else value
            for name, value in params.items()
        }
        flat = torch.cat([values[name].detach().double().reshape(-1) for name in [*GLOBALS, CHAIN]])
        self.count += 1
        self.first = flat if self.first is None else self.first + flat
        self.second = flat.square() if self.second is None else self.second + flat.square()
        if self.count in self.checkpoints:
            self.log()

    def estimate(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        mean = self.first / self.count
        sd = (self.second / self.count - mean.square()).clamp(min=0.0).sqrt() * math.sqrt(
            self.count / max(self.count - 1, 1)
        )
        mean, sd = mean.numpy(), sd.numpy()
        return {
            name: (mean[i : i + 1], sd[i : i + 1]) if i < 3 else (mean[3:], sd[3:])
            for i, name in enumerate([*GLOBALS, CHAIN])
        }

    def log(self) -> None:
        row = dict(self.score(self.estimate()), method="nuts", draws=self.count, warmup=self.warmup)
        row.update(seconds=time.perf_counter() - self.start, warmup_seconds=self.warmup_seconds)
        row.update(cpu_seconds=time.process_time() - self.cpu_start)
        self.rows.append(row)
        if self.path:
            with open(self.path, "a") as handle:
                handle.write(json.dumps(row) + "\n")


def run_nuts(problem, warmup: int, draws: int, checkpoints: Sequence[int], score, path: Optional[str] = None):
    """
    Pyro NUTS (``jit_compile``) on :func:`nuts_model`, started at the problem's ``init``.

    :param score: gym estimate -> error metrics, logged at each checkpoint (a number of draws).
    :returns: the gym estimate from all ``draws``, and the checkpoints' rows.
    """
    (returns,) = problem.args

    def init_loc_fn(site: dict) -> torch.Tensor:
        if site["name"] == CHAIN:
            return torch.full((len(returns),), float(problem.init[f"{CHAIN}_0"]))
        return torch.tensor(float(problem.init[site["name"]]))

    timeline = NutsTimeline(score, [*checkpoints, draws], path, warmup)
    kernel = NUTS(nuts_model, init_strategy=init_loc_fn, jit_compile=True, ignore_jit_warnings=True)
    MCMC(kernel, num_samples=draws, warmup_steps=warmup, hook_fn=timeline, disable_progbar=True).run(returns)
    return timeline.estimate(), timeline.rows


def run_tmc(problem, settings, checkpoints: Sequence[int], score, to_gym, path=None, progress=None):
    """
    Train :class:`ChainGuide` by ``TMC_ELBO`` on :func:`vectorized_model`, then read the posterior
    from TMC draws; logs one error row per checkpoint and weighting, timed from the start of training.

    :param settings: :class:`gold.Settings`: ``steps``, ``lr``, ``train_k``; the read-out's ``read_k``,
        ``draws``, ``global_k`` (the globals' K), ``widen`` and ``weighting`` (of the returned estimate);
        ``adapt_rounds``: rounds of :func:`adapt_proposal` before the read-out (0: read the trained
        guide, its globals' scales times ``widen``; else ``widen`` is the first round's factor).
    :param score: gym estimate -> error metrics.
    :param to_gym: the sites' moments -> the gym estimate (:func:`gold.site_moments_to_gym`).
    :returns: the gym estimate from all draws at ``settings.weighting``, and the checkpoints' rows.
    """
    start, cpu_start = time.perf_counter(), time.process_time()
    guide = train_tmc(
        problem, settings.steps, settings.train_k, settings.lr, None, progress or (lambda it: it)
    )
    train_seconds = time.perf_counter() - start
    if settings.adapt_rounds:
        guide = AdaptedChainGuide.from_trained(guide)
        guide.widen = settings.widen  # the first round's proposal: the trained one, widened
        guide = adapt_proposal(
            problem, guide, settings.read_k, settings.adapt_rounds, ADAPT_DRAWS, ADAPT_GLOBAL_K
        )
    else:
        guide.widen = settings.widen
    guide.global_samples = settings.global_k
    rows, final = [], {}

    def log(weighting: str, sites, done: int, effective: float) -> None:
        estimate = to_gym(sites)
        final[weighting] = estimate
        row = dict(score(estimate), method="tmc", weighting=weighting, draws=done, effective_draws=effective)
        row.update(seconds=time.perf_counter() - start, train_seconds=train_seconds)
        row.update(cpu_seconds=time.process_time() - cpu_start)
        row.update(steps=settings.steps, train_k=settings.train_k, read_k=settings.read_k)
        row.update(global_k=settings.global_k, widen=settings.widen)
        rows.append(row)
        if path:
            with open(path, "a") as handle:
                handle.write(json.dumps(row) + "\n")

    read_tmc(problem, guide, settings.read_k, settings.draws, log, checkpoints)
    return final[settings.weighting], rows
