"""The posterior that :func:`~pyro_tmc.infer.fit_posterior` returns: pooled TMC draws, read every way.

Each of R independent TMC draws is a self-normalised importance sampler over all its particle
combinations; weighting draw r by its own ``P_r`` pools them into one sampler that is consistent as
R grows, for any K (:mod:`pyro_tmc.infer.moments`). :class:`TMCPosterior` holds, for every draw, what
its one contraction gives (``log P_r``, each site's marginal moments and particle weights) and a set
of exact joint draws of particle combinations, and reads from them:

- moments with standard errors (:attr:`TMCPosterior.moments`);
- equal-weight draws for :class:`pyro.infer.Predictive` (:meth:`TMCPosterior.sample`);
- the held-out predictive log-likelihood (:meth:`TMCPosterior.log_predictive`);
- diagnostics (:meth:`TMCPosterior.diagnostics`): how many draws carry each site, and the Pareto
  k-hat of the pooled weights (Vehtari et al. 2024), with a warning naming the sites that fail (the
  sites' k-hats against a threshold that allows for how many there are);
- an ArviZ ``InferenceData`` (:meth:`TMCPosterior.to_arviz`).

The pooled weight of particle k of a site in draw r is ``P_r m_rk`` (``m_rk`` its marginal weight
within the draw), exactly the weight with which the pooled moments use it. Two tails decide whether
to trust it, each with its Pareto k-hat: the ``m_rk`` of a site's particles, over all draws (a few
particles carrying their draws: the site's proposal misses its posterior), and the draws' ``P_r`` (a
few draws carrying the pool: the proposal misses the joint posterior, or K is too small). Above
the threshold, a few weights carry the estimate and its standard errors cannot be trusted either.
There is one k-hat of the draws, compared with 0.7, but one per site and plate element (a 30-step
chain has 30), each an estimate with its own noise: they are compared with
:func:`~pyro_tmc.infer.diagnostics.family_khat_threshold`, above which the largest of that many passes
with probability 5% when every true k is at most 0.7 (with a site's bootstrap standard error over the
draws where its k-hat passes it and that error is the larger).
"""

import math
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Callable, NamedTuple, Optional

import torch

import pyro

from pyro_tmc.infer.diagnostics import (
    bootstrap_khat_standard_error,
    effective_sample_size,
    family_khat_threshold,
    khat_threshold,
    pareto_khat,
    psis,
)
from pyro_tmc.infer.moments import PosteriorMoments, pool_moments
from pyro_tmc.infer.posterior import marginals_and_log_estimate
from pyro_tmc.infer.predictive import (
    DRAWS_PLATE,
    FixedSites,
    PosteriorDraws,
    PredictiveLogLikelihood,
    batched_over_draws,
    predictive_log_likelihood,
)
from pyro_tmc.ops.resampling import systematic_resample
from pyro_tmc.poutine.sites import is_summed_exactly, plate_nesting, structure_trace

#: k-hat above this says "do not trust" (the PSIS paper's bound for any sample size: beyond it the
#: importance ratios' variance is infinite in all but name, and more draws barely help); the draws'
#: k-hat is compared with it, the sites' with :func:`family_khat_threshold` from it
KHAT_LIMIT = 0.7
#: the probability that the sites' k-hats flag a posterior whose true k is at most 0.7 everywhere
SITE_FALSE_ALARM = 0.05
#: at most this many sites past the formula's limit get a bootstrap of their k-hat (0.1 s each at 400
#: draws of 32 particles): a chain of 2,500 sites all past it would take minutes, and is not to be trusted
MAX_BOOTSTRAP_SITES = 20
#: the draws' own k-hat needs more than this many draws (below it the tail holds 4 or fewer: no fit)
MIN_DRAWS_FOR_KHAT = 20
#: the Monte Carlo error bounds (95%) above which the diagnostics do not trust the moments
#: (``"<monte carlo error>"``): the means' average and worst error over the dims, in posterior sds, and
#: the sds' relative error, as the gold benchmark asks of a posterior (its targets). No k-hat sees
#: this error: weights with a light tail (k-hat 0.3-0.5) still leave a heavy-tailed marginal's sd 10-25%
#: off in 1,000 draws (the 100-day volatility's ``mean_log_volatility``, kurtosis 9.6)
MEAN_ERROR_TOLERANCE = (0.02, 0.1)
STDDEV_ERROR_TOLERANCE = (0.03, 0.1)
#: the probability of the error bounds
ERROR_BOUND_PROBABILITY = 0.95


class ReadoutDraw(NamedTuple):
    """
    What one TMC draw contributes to a :class:`TMCPosterior`.

    :ivar torch.Tensor log_evidence: the draw's ``log P_TMC`` (a scalar).
    :ivar dict firsts: site -> its marginal mean (plate + event shape).
    :ivar dict seconds: site -> its marginal second moment.
    :ivar dict log_weights: particle site -> its particles' marginal log weights, normalised within
        the draw, particles last: ``plate shape + (K,)``. Sites summed exactly are left out.
    :ivar dict samples: model site -> exact joint draws of particle combinations, ``(S,) + shape``.
    """

    log_evidence: torch.Tensor
    firsts: "OrderedDict[str, torch.Tensor]"
    seconds: "OrderedDict[str, torch.Tensor]"
    log_weights: "OrderedDict[str, torch.Tensor]"
    samples: dict[str, torch.Tensor]


def read_draw(draw, samples_per_draw: int) -> ReadoutDraw:
    """
    A :class:`ReadoutDraw` of one :class:`~pyro_tmc.infer.draw.TMCDraw`: one contraction for its
    marginals and ``log P_TMC``, and (if ``samples_per_draw``) one per latent site for its joint draws.
    """
    marginals, log_estimate = marginals_and_log_estimate(draw)
    firsts, seconds, log_weights = OrderedDict(), OrderedDict(), OrderedDict()
    model_nodes = draw.model_trace.nodes
    for name, marginal in marginals.items():
        if name in model_nodes:
            firsts[name] = marginal.mean.double()
            seconds[name] = marginal.expectation(torch.square).double()
        site = model_nodes.get(name) or draw.guide_trace.nodes[name]
        if not is_summed_exactly(site):
            weights = marginal.log_weights.double()
            log_weights[name] = weights - torch.logsumexp(weights, -1, keepdim=True)
    # a vectorized_markov chain's joint draws are not implemented (sample_posterior): its moments
    # are read from the marginals alone
    joint = samples_per_draw and not draw.scales.markov_times
    samples = draw.sample(samples_per_draw) if joint else {}
    return ReadoutDraw(log_estimate.detach().double().reshape(()), firsts, seconds, log_weights, samples)


def _error_quantiles(influence: torch.Tensor, probability: float, num_samples: int) -> tuple[float, float]:
    """
    The ``probability`` quantiles of the average and the largest ``|error|`` over the dims of a pooled
    estimate whose error is ``sum_r z_r influence_r`` (``influence``: ``(R, D)``), the ``z_r``
    independent standard Normals, drawn ``num_samples`` times from a generator seeded 0.
    """
    generator = torch.Generator().manual_seed(0)
    normals = torch.randn(num_samples, influence.shape[0], dtype=torch.float64, generator=generator)
    errors = (normals @ influence).abs()
    average = torch.quantile(errors.mean(-1), probability)
    worst = torch.quantile(errors.max(-1).values, probability)
    return float(average), float(worst)


class Diagnostics(NamedTuple):
    """
    How far a :class:`TMCPosterior` can be trusted (:meth:`TMCPosterior.diagnostics`).

    :ivar dict site_khat: particle site -> the Pareto k-hat of its particles' marginal weights within
        their draws, over all draws (the worst plate element's). Not adjusted: the raw estimate.
    :ivar dict effective_samples: particle site -> the effective number of its pooled particles
        ``(sum w)^2 / sum w^2`` (the worst plate element's).
    :ivar float khat_draws: the k-hat of the R draws' ``P_TMC`` (NaN for 20 draws or fewer: too few for a
        tail fit).
    :ivar float effective_draws: ``(sum P)^2 / sum P^2`` over the draws: how many carry the result.
    :ivar float khat: the overall k-hat, the largest of the above.
    :ivar float threshold: the k-hat above which the draws' k-hat is not trusted (0.7).
    :ivar list untrusted: the sites whose k-hat exceeds their ``site_threshold`` (``"<draws>"`` where the
        draws' exceeds ``threshold``).
    :ivar dict site_threshold: particle site -> the k-hat above which it is not trusted:
        :func:`~pyro_tmc.infer.diagnostics.family_khat_threshold` of its weights' count, over
        ``num_tests`` k-hats at ``false_alarm``; where its k-hat passes that, with its worst element's
        bootstrap standard error over the draws where that is larger.
    :ivar int num_tests: how many k-hats the sites' thresholds allow for (every plate element of every
        particle site).
    :ivar float false_alarm: the probability that any site is flagged when every true k is at most 0.7.
    :ivar dict error_bounds: ``"mean"`` and ``"stddev"``: the average and the worst dim's Monte Carlo
        error that the pooled means (in posterior sds) and sds (relative) stay below with probability
        0.95 (:meth:`TMCPosterior.mean_error_quantiles`, :meth:`TMCPosterior.stddev_error_quantiles`);
        ``"<monte carlo error>"`` is untrusted where one passes :data:`MEAN_ERROR_TOLERANCE` or
        :data:`STDDEV_ERROR_TOLERANCE`.
    """

    site_khat: dict[str, float]
    effective_samples: dict[str, float]
    khat_draws: float
    effective_draws: float
    khat: float
    threshold: float
    untrusted: list[str]
    site_threshold: dict[str, float] = {}
    num_tests: int = 0
    false_alarm: float = SITE_FALSE_ALARM
    error_bounds: dict = {}


class TMCPosterior:
    """
    A posterior read from R independent TMC draws, pooled by their ``P_TMC``
    (:func:`~pyro_tmc.infer.fit_posterior` builds it).

    Example::

        posterior = fit_posterior(model, data)
        posterior.moments["theta"].mean, posterior.moments["theta"].mean_error
        Predictive(model, posterior_samples=posterior.sample(1000))(data)
        posterior.diagnostics().untrusted          # [] when no k-hat is above its threshold
        az.summary(posterior.to_arviz())

    :param callable model: the Pyro model.
    :param draws: one :class:`ReadoutDraw` per TMC draw.
    :param tuple args: the model's arguments (the data it was fitted to).
    :param dict kwargs: its keyword arguments.
    :param guide: the proposal the draws were made with (kept for further draws).
    :param dict history: what fitting recorded (losses, each adaptation round's effective draws).
    """

    def __init__(
        self,
        model: Callable,
        draws: Sequence[ReadoutDraw],
        args: tuple = (),
        kwargs: Optional[dict] = None,
        guide: Optional[Callable] = None,
        history: Optional[dict] = None,
    ) -> None:
        if len(draws) < 2:
            raise ValueError(
                f"TMCPosterior needs at least 2 TMC draws for standard errors; got {len(draws)}."
            )
        self.model, self.guide = model, guide
        self.draws = list(draws)
        self.args, self.kwargs = tuple(args), dict(kwargs or {})
        self.history = dict(history or {})
        self.log_evidences = torch.stack([draw.log_evidence for draw in self.draws])
        self._draw_weights: Optional[torch.Tensor] = None
        self._moments: Optional[OrderedDict] = None

    # -- moments ------------------------------------------------------------------------------

    @property
    def draw_weights(self) -> torch.Tensor:
        """
        Each TMC draw's weight in the pool, ``P_r / sum P``, Pareto-smoothed (:func:`psis`), shape
        ``(R,)``. The draws' ``P_r`` are importance weights of the draws, as heavy-tailed as the
        proposal's tails are light: the smoothing replaces the largest by the quantiles of a Pareto
        fit to them, which lowers the pooled moments' error where one draw would otherwise dominate
        (measured: eight schools' worst draw at 3.5% of the pool, mean error 0.022 -> 0.015 gold
        sds). Under 25 draws the tail is too short to fit, and the weights are the raw ones.
        """
        if self._draw_weights is None:  # read by the moments, the pooled samples and the predictive
            self._draw_weights = psis(self.log_evidences.double(), 0)[0].exp()
        return self._draw_weights

    @property
    def log_evidence(self) -> torch.Tensor:
        """``log mean_r P_r``: the pooled estimate of ``log p(x)`` (unbiased in ``p(x)``)."""
        return torch.logsumexp(self.log_evidences, 0) - math.log(len(self.draws))

    @property
    def moments(self) -> "OrderedDict[str, PosteriorMoments]":
        """Model site -> its pooled :class:`~pyro_tmc.infer.PosteriorMoments` (means, sds, their errors)."""
        if self._moments is None:
            weights = self.draw_weights
            self._moments = OrderedDict(
                (name, pool_moments(self._stacked("firsts", name), self._stacked("seconds", name), weights))
                for name in self.draws[0].firsts
            )
        return self._moments

    def mean(self, name: str) -> torch.Tensor:
        """The posterior mean of site ``name``."""
        return self.moments[name].mean

    def stddev(self, name: str) -> torch.Tensor:
        """The posterior standard deviation of site ``name``."""
        return self.moments[name].stddev

    def mean_error_quantiles(self, probability: float = 0.95, num_samples: int = 500) -> tuple[float, float]:
        """
        The average and the worst error of the pooled means over every dim of every site, in posterior
        sds, that the read-out's Monte Carlo error stays below with ``probability``. The means' errors
        are correlated across dims (a chain's steps move together from draw to draw), which the
        per-dim standard errors do not show: ten dims that move as one have the spread of one dim's
        error in their average, ten independent ones a third of it. So the errors are drawn jointly,
        each draw's linearised influence on every mean (as :func:`pool_moments` takes its standard
        errors) times one Normal per draw, ``num_samples`` times (a fixed seed: the same pool gives the
        same answer).

        :returns: the ``probability`` quantiles of ``mean |error| / sd`` and of ``max |error| / sd``.
        """
        return _error_quantiles(self._influences(stddevs=False), probability, num_samples)

    def stddev_error_quantiles(
        self, probability: float = 0.95, num_samples: int = 500
    ) -> tuple[float, float]:
        """
        As :meth:`mean_error_quantiles`, for the pooled sds: the average and the worst relative error
        ``|sd error| / sd`` over every dim of every site, drawn jointly, that the read-out's Monte Carlo
        error stays below with ``probability``. A sd's error is set by the posterior's fourth moment:
        a heavy-tailed marginal needs many more effective draws for its sd than for its mean (at a
        kurtosis of 9.6, the 100-day volatility's ``mean_log_volatility``, about 860 for 5%).

        :returns: the ``probability`` quantiles of ``mean |error| / sd`` and of ``max |error| / sd``.
        """
        return _error_quantiles(self._influences(stddevs=True), probability, num_samples)

    def _influences(self, stddevs: bool) -> torch.Tensor:
        """
        ``(R, D)``: each draw's linearised influence on every dim's pooled mean (``stddevs=False``) or
        sd (``stddevs=True``), over the posterior sd; the pooled error is ``sum_r z_r influence_r``.
        The sd's is the variance's (:func:`pool_moments`) over ``2 sd^2``.
        """
        weights = self.draw_weights.double()[:, None]
        influences = []
        for name, moments in self.moments.items():
            firsts = self._stacked("firsts", name).double().reshape(len(self.draws), -1)
            mean = moments.mean.double().reshape(-1)
            sd = moments.stddev.double().reshape(-1).clamp(min=torch.finfo(torch.float64).tiny)
            if not stddevs:
                influences.append(weights * (firsts - mean) / sd)
                continue
            seconds = self._stacked("seconds", name).double().reshape(len(self.draws), -1)
            second = (weights * seconds).sum(0)
            variance_influence = (seconds - second) - 2 * mean * (firsts - mean)
            influences.append(weights * variance_influence / (2 * sd.square()))
        return torch.cat(influences, -1)

    def _stacked(self, field: str, name: str) -> torch.Tensor:
        return torch.stack([getattr(draw, field)[name] for draw in self.draws])

    # -- draws --------------------------------------------------------------------------------

    def sample(
        self, num_samples: int, generator: Optional[torch.Generator] = None
    ) -> dict[str, torch.Tensor]:
        """
        ``num_samples`` equal-weight posterior draws: the draws' joint particle combinations,
        resampled (systematically) with their draw's pooled weight.

        :param int num_samples: how many draws.
        :param torch.Generator generator: the random numbers' source (default: torch's global one).
        :returns: model site -> values, leading dim ``num_samples``: ready for
            ``pyro.infer.Predictive(model, posterior_samples=...)``.
        """
        pooled, log_weights = self.pooled_samples()
        indices = systematic_resample(log_weights, num_samples, generator=generator)
        return {name: values[indices] for name, values in pooled.items()}

    def pooled_samples(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Every draw's joint samples, concatenated, and their log weights ``log P_r / (S_r sum P)``."""
        counts = [self._count(draw) for draw in self.draws]
        if not all(counts):
            raise ValueError(
                "TMCPosterior.sample: these draws hold no joint samples; fit with samples_per_draw > 0 "
                "(a model with a vectorized_markov chain keeps none: write the chain with pyro.markov)."
            )
        pooled = {
            name: torch.cat([draw.samples[name] for draw in self.draws]) for name in self.draws[0].samples
        }
        per_draw = [torch.full((n,), -math.log(n), dtype=torch.float64) for n in counts]
        log_weights = torch.cat([part + weight for part, weight in zip(per_draw, self.draw_weights.log())])
        return pooled, log_weights

    @staticmethod
    def _count(draw: ReadoutDraw) -> int:
        return next((values.shape[0] for values in draw.samples.values()), 0)

    def posterior_draws(self) -> PosteriorDraws:
        """The joint draws as :func:`~pyro_tmc.infer.posterior_draws` returns them (one set per TMC draw)."""
        return PosteriorDraws([draw.samples for draw in self.draws], self.log_evidences)

    def log_predictive(
        self, *args, local_plates=None, num_samples: int = 16, **kwargs
    ) -> PredictiveLogLikelihood:
        """
        The held-out predictive log-likelihood ``log p(y_test | y_train)``: the model called with
        ``*args, **kwargs`` (the test data, observed), the fitted latents fixed to the pooled draws
        (:func:`~pyro_tmc.infer.predictive_log_likelihood`, whose parameters these are).

        :rtype: ~pyro_tmc.infer.PredictiveLogLikelihood
        """
        return predictive_log_likelihood(
            self.model,
            self.posterior_draws(),
            *args,
            local_plates=local_plates,
            num_samples=num_samples,
            **kwargs,
        )

    def pointwise_log_likelihood(self, samples: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """
        ``log p(y_i | z_s)`` of every observed element at every draw ``z_s`` of ``samples``,
        on the fitted data: observed site -> ``(S,) +`` its batch shape. What ``az.loo`` reads.
        """
        num_samples = next(iter(samples.values())).shape[0]
        with torch.no_grad():
            trial = structure_trace(self.model, self.args, self.kwargs)
            nesting = plate_nesting(trial)
            fixed = {
                name: batched_over_draws(samples[name], site, nesting)
                for name, site in trial.nodes.items()
                if name in samples and site["type"] == "sample" and not site["is_observed"]
            }
            with pyro.plate(DRAWS_PLATE, num_samples, dim=-nesting - 1), FixedSites(fixed):
                trace = pyro.poutine.trace(self.model).get_trace(*self.args, **self.kwargs)
        pointwise = {}
        for name, site in trace.nodes.items():
            if site["type"] == "sample" and site["is_observed"] and name not in fixed:
                log_prob = site["fn"].log_prob(site["value"])
                pointwise[name] = log_prob.expand(site["fn"].batch_shape).reshape(num_samples, -1).double()
        return pointwise

    # -- diagnostics ----------------------------------------------------------------------------

    def diagnostics(self, warn: bool = True, false_alarm: float = SITE_FALSE_ALARM) -> Diagnostics:
        """
        Effective sample sizes and Pareto k-hats of the pooled weights, per particle site and over
        the draws; with ``warn``, a warning naming every site above its threshold, and one when there
        are too few draws (:data:`MIN_DRAWS_FOR_KHAT` or fewer) for the draws' own k-hat, the one check
        that sees a proposal whose particles all miss the posterior together.

        The draws' k-hat is one estimate, compared with :data:`KHAT_LIMIT`. The sites' are many (one
        per plate element of every particle site), and the largest of many noisy estimates of a true
        k = 0.7 lies above 0.7 nearly always: a site is flagged when its k-hat exceeds
        :func:`~pyro_tmc.infer.diagnostics.family_khat_threshold` (0.7 plus the allowance for the
        largest of that many, about 0.26 for 30 k-hats of 400 draws of 32 particles), so that a
        posterior whose true k is at most 0.7 everywhere is flagged with probability ``false_alarm``.
        Where a site's worst k-hat passes it, its standard error is measured too, by the bootstrap over
        the draws (for the :data:`MAX_BOOTSTRAP_SITES` sites nearest the limit), and the threshold uses it
        where it is larger (:meth:`_site_limit`): the draws'
        particle weights differ from draw to draw, and k-hat then varies up to twice as much as
        independent Pareto weights' (measured on the unknown-scales Brownian motion's locs).

        :param bool warn: warn of untrusted sites and of too few draws.
        :param float false_alarm: the sites' family-wise false-alarm probability.
        :rtype: Diagnostics
        """
        khat, worst, effective, counts, elements = {}, {}, {}, {}, 0
        for name in self.draws[0].log_weights:
            # each draw's particles weighted within their draw (not times P_r: the draws' spread is the
            # draws' own k-hat below, and mixing it in makes the tail a few draws' clusters)
            within = torch.cat([draw.log_weights[name] for draw in self.draws], -1)
            site_khat = pareto_khat(within, dim=-1).nan_to_num(nan=0.0)
            khat[name], worst[name] = float(site_khat.max()), int(site_khat.reshape(-1).argmax())
            counts[name] = within.shape[-1]
            if self.draws[0].log_weights[name].shape[-1] > 1:  # one particle a draw: no tail to test
                elements += site_khat.numel()
            pooled = torch.cat(
                [
                    draw.log_weights[name] + weight
                    for draw, weight in zip(self.draws, self.draw_weights.log())
                ],
                -1,
            )
            effective[name] = float(effective_sample_size(pooled, dim=-1).min())
        limits = {name: family_khat_threshold(count, elements, false_alarm) for name, count in counts.items()}
        # the sites just past the formula's limit first: the bootstrap can lift their flags
        passed = sorted(
            (name for name in limits if khat[name] > limits[name]), key=lambda n: khat[n] - limits[n]
        )
        for name in passed[:MAX_BOOTSTRAP_SITES]:
            limits[name] = self._site_limit(
                name, khat[name], worst[name], counts[name], elements, false_alarm
            )
        khat_draws = (
            float(pareto_khat(self.log_evidences, dim=-1))
            if len(self.draws) > MIN_DRAWS_FOR_KHAT
            else math.nan
        )
        effective_draws = float(effective_sample_size(self.log_evidences, dim=-1))
        overall = max(
            [value for value in [*khat.values(), khat_draws] if not math.isnan(value)], default=math.nan
        )
        untrusted = [name for name, value in khat.items() if value > limits[name]]
        if khat_draws > KHAT_LIMIT:
            untrusted.append("<draws>")
        if warn and untrusted:
            self._warn_untrusted(untrusted, khat, khat_draws, limits, elements, false_alarm)
        bounds = {
            "mean": self.mean_error_quantiles(ERROR_BOUND_PROBABILITY),
            "stddev": self.stddev_error_quantiles(ERROR_BOUND_PROBABILITY),
        }
        if self._too_uncertain(bounds, warn):
            untrusted.append("<monte carlo error>")
        if warn and math.isnan(khat_draws):
            warnings.warn(
                f"TMCPosterior: {len(self.draws)} draws are too few for the draws' k-hat (it needs more than "
                f"{MIN_DRAWS_FOR_KHAT}), and the sites' k-hats alone cannot see a proposal that misses the "
                "posterior as a whole (every particle of every draw in the wrong place, agreeing with each "
                "other). Read out more draws (num_draws=; fit_posterior's default is 100) before trusting "
                "it.",
                stacklevel=2,
            )
        return Diagnostics(
            khat,
            effective,
            khat_draws,
            effective_draws,
            overall,
            KHAT_LIMIT,
            untrusted,
            limits,
            elements,
            false_alarm,
            bounds,
        )

    def _too_uncertain(self, bounds: dict, warn: bool) -> bool:
        """Whether an error bound passes its tolerance; with ``warn``, a warning naming the dims."""
        passed = {
            kind: bound
            for kind, bound, tolerance in (
                ("means", bounds["mean"], MEAN_ERROR_TOLERANCE),
                ("sds", bounds["stddev"], STDDEV_ERROR_TOLERANCE),
            )
            if bound[0] > tolerance[0] or bound[1] > tolerance[1]
        }
        if warn and passed:
            values = "; ".join(f"{kind} {bound[0]:.3g} / {bound[1]:.3g}" for kind, bound in passed.items())
            warnings.warn(
                f"TMCPosterior: the pooled moments' Monte Carlo error (95%, average / worst dim: {values}) "
                f"is above {MEAN_ERROR_TOLERANCE} posterior sds for the means and {STDDEV_ERROR_TOLERANCE} "
                "relative for the sds: read out more draws (fit_posterior's max_draws=), or a larger K "
                "(readout_samples=).",
                stacklevel=3,
            )
        return bool(passed)

    def _site_limit(
        self, name: str, khat: float, element: int, count: int, elements: int, false_alarm: float
    ) -> float:
        """
        The k-hat above which site ``name`` is not trusted: :func:`family_khat_threshold` over ``elements``
        k-hats; where its worst k-hat ``khat`` (of plate element ``element``, flattened) passes that, the
        threshold again with that element's bootstrap standard error over the draws
        (:func:`bootstrap_khat_standard_error`, rescaled from ``khat`` to the threshold's k by
        ``(1 + k) / (1 + khat)``) where it is larger. A site is then flagged only when its worst k-hat
        passes a threshold that allows for how much it varies between read-outs of the same proposal.
        """
        limit = family_khat_threshold(count, elements, false_alarm)
        if not khat > limit or not math.isfinite(khat):
            return limit
        # of the worst element only: the site is flagged when its largest k-hat passes its limit
        weights = torch.stack([draw.log_weights[name] for draw in self.draws])  # (R,) + plate + (K,)
        weights = weights.reshape(len(self.draws), -1, weights.shape[-1])[:, element]
        error = bootstrap_khat_standard_error(weights) * (1 + khat_threshold(count)) / (1 + khat)
        return family_khat_threshold(count, elements, false_alarm, standard_error=error)

    @staticmethod
    def _warn_untrusted(untrusted, khat, khat_draws, limits, elements, false_alarm) -> None:
        """The warning naming the untrusted sites, each k-hat beside the threshold it passed."""
        values = {
            name: f"{khat[name]:.2f} > {limits[name]:.2f}" if name in khat else f"{khat_draws:.2f} > 0.7"
            for name in untrusted
        }
        warnings.warn(
            f"TMCPosterior: the importance weights of {untrusted} have Pareto k-hat above their threshold "
            f"({values}; a site's is {KHAT_LIMIT} plus the allowance for the largest of {elements} noisy "
            f"k-hats, passed with probability {false_alarm:g} if every true k were {KHAT_LIMIT}): a few "
            "particles carry these estimates, and their standard errors are unreliable. Fit with more "
            "adaptation rounds (adapt_rounds=), a larger read-out K (readout_samples=) or more draws "
            "(num_draws=).",
            stacklevel=3,
        )

    # -- export -------------------------------------------------------------------------------

    def to_arviz(
        self, num_samples: int = 1000, num_chains: int = 1, generator: Optional[torch.Generator] = None
    ):
        """
        An ArviZ ``InferenceData``: a ``posterior`` group of ``num_samples`` equal-weight draws
        (:meth:`sample`), a pointwise ``log_likelihood`` group on the fitted data (so that
        ``az.loo`` and ``az.waic`` work), ``sample_stats`` (``total_log_likelihood``: each draw's
        log-likelihood summed over every observation) and ``observed_data``. Needs ArviZ
        (``pip install pyro_tmc[posterior]``).

        :param int num_samples: posterior draws exported (a multiple of ``num_chains``).
        :param int num_chains: ArviZ's chain dim (the draws are exchangeable, so any split is valid).
        """
        from pyro_tmc.infer.arviz_export import to_inference_data

        samples = self.sample(num_samples, generator=generator)
        log_likelihood = self.pointwise_log_likelihood(samples)
        # ArviZ reserves the name log_likelihood for the pointwise group (and warns of it in sample_stats)
        total = sum(values.reshape(values.shape[0], -1).sum(-1) for values in log_likelihood.values())
        stats = {"total_log_likelihood": total} if log_likelihood else {}
        observed = self._observed_data()
        return to_inference_data(
            samples,
            log_likelihood=log_likelihood,
            sample_stats=stats,
            observed_data=observed,
            num_chains=num_chains,
        )

    def _observed_data(self) -> dict[str, torch.Tensor]:
        trace = structure_trace(self.model, self.args, self.kwargs)
        return {
            name: site["value"].detach()
            for name, site in trace.nodes.items()
            if site["type"] == "sample" and site["is_observed"]
        }

    def __repr__(self) -> str:
        return (
            f"TMCPosterior({len(self.draws)} TMC draws, {len(self.draws[0].firsts)} sites, "
            f"log p(x) ~ {float(self.log_evidence):.3f})"
        )
