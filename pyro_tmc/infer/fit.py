"""One call from a Pyro model to a posterior: train a proposal, adapt it, read it out.

:func:`fit_posterior` runs the three stages that a posterior as good as a long NUTS run needs, with
no model-specific code:

1. **Train** a guide with :class:`~pyro_tmc.TMC_ELBO` (Pyro's ``AutoNormal`` when none is given).
   The trained guide sits at the bound's optimum, which is close to the posterior but not on it
   (and a mean-field guide cannot hold its correlations), so it is only the start. Training is
   skipped where the model's Laplace approximation, from the guide's initial locations, already
   gives TMC draws that agree (a near-Gaussian posterior), or where the joint density has no mode
   and the globals' Laplace marginal converges (:func:`laplace_before_training`).
2. **Adapt** (:func:`~pyro_tmc.infer.adaptation.adapt`): rounds of population Monte Carlo with TMC
   draws as the samples move an :class:`~pyro_tmc.infer.adaptive_proposal.AdaptiveProposal` onto the
   TMC-weighted posterior: the globals one heavy-tailed joint proposal (one particle group), every
   other site a Normal that follows its parents (a chain's previous step, the globals).
3. **Read out** R independent TMC draws under the adapted proposal at a larger K, pooled by their
   ``P_TMC`` into a :class:`~pyro_tmc.infer.tmc_posterior.TMCPosterior`, with diagnostics.

References: Aitchison (2019) "Tensor Monte Carlo: particle methods for the GPU era" (the estimator
and its posterior); Cappe, Guillin, Marin and Robert (2004) "Population Monte Carlo" (the rounds);
Vehtari, Simpson, Gelman, Yao and Gabry (2024) "Pareto smoothed importance sampling" (k-hat).
"""

import math
from collections.abc import Iterable
from typing import Callable, Optional

import torch

import pyro
from pyro.infer import SVI
from pyro.infer.autoguide import AutoNormal
from pyro.infer.util import is_validation_enabled

from pyro_tmc.estimate.vectorized_markov import find_time_links
from pyro_tmc.infer.adaptation import WIDEN_GLOBALS, WIDEN_LOCALS, adapt
from pyro_tmc.infer.adaptive_proposal import AdaptiveProposal
from pyro_tmc.infer.chain_conditional import chain_conditional
from pyro_tmc.infer.laplace import laplace_approximation, proposal_mean
from pyro_tmc.infer.tmc_elbo import TMC_ELBO
from pyro_tmc.infer.tmc_posterior import TMCPosterior, read_draw
from pyro_tmc.poutine.particle_group import particle_group
from pyro_tmc.poutine.sites import structure_trace

#: the particle group of the globals in training
GLOBALS_GROUP = "fit_posterior_globals"
#: read-out draws between checks of their standard errors, at least
CHECK_EVERY = 20
#: and at least this fraction of the draws so far: a check of a long chain's bounds draws 500 joint
#: errors over every dim (2,516 days: about a second), so checks thin out as the draws grow
CHECK_GROWTH = 0.1
#: the largest sd (nats) of the draws' ``log P_TMC`` under the Laplace start at which training is
#: skipped: draws that agree within a nat or so come from a proposal close to the posterior in
#: every direction the estimate is sensitive to (for importance sampling, a log-weight sd of 1 keeps
#: about exp(-1) of the draws effective)
LAPLACE_TRUSTED_SPREAD = 1.0
#: the probability with which the read-out's error stays within ``target_error`` (``small_enough``).
#: A per-dim standard error averaged over dims says nothing of how the dims' errors move together: on
#: a 30-step chain (Brownian motion), an average standard error of 0.015 sds gave an average error
#: above 0.02 about one time in five, its steps' errors being nearly one
ERROR_PROBABILITY = 0.95
#: the worst dim's error allowed, as a multiple of the average's (the gold targets: 0.02 / 0.1 sds)
WORST_TO_AVERAGE = 5.0
#: the globals' K where the model has a ``vectorized_markov`` chain (:func:`chain_global_samples`)
CHAIN_GLOBAL_SAMPLES = 1


def fit_posterior(
    model: Callable,
    *args,
    guide: Optional[Callable] = None,
    num_steps: int = 1000,
    num_samples: int = 16,
    learning_rate: float = 0.01,
    adapt_rounds: int = 4,
    adapt_draws: int = 10,
    adapt_samples: int = 32,
    readout_samples: int = 32,
    num_draws: int = 100,
    max_draws: int = 2500,
    target_error: float = 0.01,
    target_sd_error: float = 0.02,
    samples_per_draw: int = 10,
    max_plate_nesting: Optional[int] = None,
    progress: bool = True,
    model_kwargs: Optional[dict] = None,
) -> TMCPosterior:
    """
    Fit the posterior of ``model`` given its data ``*args``: train a proposal with TMC, adapt it
    onto the TMC-weighted posterior, and read out pooled TMC draws.

    Example::

        posterior = pyro_tmc.infer.fit_posterior(model, data)
        posterior.moments["theta"].mean, posterior.moments["theta"].mean_error
        posterior.diagnostics().untrusted     # sites whose weights' k-hat is above its threshold
        samples = posterior.sample(1000)      # for pyro.infer.Predictive
        az.summary(posterior.to_arviz())

    Discrete sites marked ``infer={"enumerate": "parallel"}`` are summed exactly, as in
    :class:`~pyro_tmc.TMC_ELBO`; other discrete sites are drawn from the model's conditional.
    The guide's parameters live in Pyro's param store, as in any SVI run: a second call with the
    same model starts from the first call's guide.

    :param callable model: a Pyro model; its observed sites hold the data.
    :param args: the model's arguments.
    :param callable guide: a guide to train and start from; ``None``: ``AutoNormal(model)``.
    :param int num_steps: SVI steps of training (0: use ``guide`` as it is). None are taken where the
        default guide's Laplace start already measures well (``history["laplace_spread"]``).
    :param int num_samples: K in training.
    :param float learning_rate: Adam's step size in training (decayed 10x over the run).
    :param int adapt_rounds: rounds of adaptation (0: read out under the trained guide).
    :param int adapt_draws: TMC draws per adaptation round.
    :param int adapt_samples: K in adaptation.
    :param int readout_samples: K in the read-out.
    :param int num_draws: TMC draws read out and pooled, at least (at least 2; more than 20 for the draws'
        own k-hat).
    :param int max_draws: TMC draws read out at most: past ``num_draws``, draws are added (20 at a time,
        or a tenth of those so far) until the moments' Monte Carlo error is small enough
        (``target_error``, ``target_sd_error``; each check in ``history["error_checks"]``). At 1,000 the
        100-day volatility stopped with its ``mean_log_volatility`` sd 10-25% off (its own bound 0.13-0.2);
        at 400 the 2,516-day volatility, the unknown-scales walk and item response theory stopped with
        their means' bound above the target.
    :param float target_error: the read-out's Monte Carlo error allowed on the means, in posterior sds:
        with probability 0.95 the means' error averaged over every dim at most this, and the worst dim's
        at most 5 times this, the dims' errors drawn jointly (correlated, as a chain's steps are). At
        0.015 the 30-step Brownian motion's seed 1 stopped at 460 draws 0.022 sd off its exact posterior
        (the gold targets: 0.02); at 0.01, 0.007 in 1,000 draws:
        :meth:`~pyro_tmc.infer.tmc_posterior.TMCPosterior.mean_error_quantiles`.
    :param float target_sd_error: the same for the sds, relative (0.02: the average sd within 2% and the
        worst within 10% with probability 0.95; the gold targets: 3% and 10%):
        :meth:`~pyro_tmc.infer.tmc_posterior.TMCPosterior.stddev_error_quantiles`.
    :param int samples_per_draw: exact joint draws kept from each read-out draw (for
        :meth:`~TMCPosterior.sample`, :meth:`~TMCPosterior.to_arviz` and the predictive).
    :param int max_plate_nesting: as in every Pyro ELBO (``None``: guessed from a first run).
    :param bool progress: show progress bars (tqdm, when installed).
    :param dict model_kwargs: the model's keyword arguments.
    :rtype: ~pyro_tmc.infer.tmc_posterior.TMCPosterior
    """
    kwargs = dict(model_kwargs or {})
    nesting = _nesting(max_plate_nesting)
    history: dict = {"global_samples": chain_global_samples(model, args, kwargs)}
    global_samples = history["global_samples"]
    if guide is None:
        guide = AutoNormal(model)
    start = None
    if num_steps and adapt_rounds:
        start = laplace_before_training(
            model, guide, args, kwargs, adapt_draws, adapt_samples, max_plate_nesting, history, global_samples
        )
    if num_steps and start is None:
        history["losses"] = train(
            model,
            guide,
            args,
            kwargs,
            num_steps,
            num_samples,
            learning_rate,
            nesting,
            progress,
            global_samples,
        )
    proposal = guide
    # Pyro's checks of every distribution's arguments and values (when on) cost a pass over each: half
    # of an item response theory draw, over its 41 million logits. The fit's hundreds of draws run the
    # same model, so once it has run checked (training, or the Laplace start's draws), they run
    # unchecked; a factor that is not finite is still reported with its site.
    checked = bool(num_steps)
    if adapt_rounds:
        with pyro.validation_enabled(is_validation_enabled() and not checked):
            proposal = adapted_proposal(
                model,
                guide,
                args,
                kwargs,
                adapt_rounds,
                adapt_draws,
                adapt_samples,
                max_plate_nesting,
                progress,
                start=start,
                global_samples=global_samples,
            )
        history["adaptation"] = proposal.history
        checked = True
    readout = TMC_ELBO(num_samples=readout_samples, max_plate_nesting=nesting)
    draws, checks, next_check = [], [], num_draws
    for _ in _bar(range(max(num_draws, max_draws)), "read-out", progress):
        if len(draws) >= next_check and len(draws) % CHECK_EVERY == 0:
            checks.append(error_bounds(model, draws))
            if small_enough(checks[-1], target_error, target_sd_error):
                break
            next_check = max(len(draws) + CHECK_EVERY, int(len(draws) * (1 + CHECK_GROWTH)))
        with torch.no_grad(), pyro.validation_enabled(is_validation_enabled() and not (checked or draws)):
            draw = readout.draw(model, proposal, *args, **kwargs)
        draws.append(read_draw(draw, samples_per_draw))
    history["readout_draws"] = len(draws)
    history["error_checks"] = checks
    posterior = TMCPosterior(model, draws, args, kwargs, guide=proposal, history=history)
    # what the stopping rule read, at the end: above its targets where max_draws stopped it first
    posterior.history["mean_error_quantiles"] = posterior.mean_error_quantiles(ERROR_PROBABILITY)
    posterior.history["stddev_error_quantiles"] = posterior.stddev_error_quantiles(ERROR_PROBABILITY)
    return posterior


def error_bounds(model, draws) -> dict:
    """
    The pooled draws' Monte Carlo error bounds, at probability :data:`ERROR_PROBABILITY`: ``draws``
    (how many), ``mean`` and ``stddev`` (each the average and the worst dim's, in posterior sds and
    relative, :meth:`~pyro_tmc.infer.tmc_posterior.TMCPosterior.mean_error_quantiles` and
    :meth:`~pyro_tmc.infer.tmc_posterior.TMCPosterior.stddev_error_quantiles`).
    """
    pooled = TMCPosterior(model, draws)
    return {
        "draws": len(draws),
        "mean": pooled.mean_error_quantiles(ERROR_PROBABILITY),
        "stddev": pooled.stddev_error_quantiles(ERROR_PROBABILITY),
    }


def small_enough(bounds: dict, target_error: float, target_sd_error: float) -> bool:
    """
    Whether the pooled moments' Monte Carlo error, which no diagnostic of the weights' tails shows,
    is small enough to return (``bounds``: :func:`error_bounds`): with probability
    :data:`ERROR_PROBABILITY`, the means' average error over every dim of every site at most
    ``target_error`` posterior sds and the worst at most :data:`WORST_TO_AVERAGE` times that, and the
    sds' relative error the same against ``target_sd_error``, the dims' errors drawn jointly.
    """
    return all(
        average <= target and worst <= WORST_TO_AVERAGE * target
        for (average, worst), target in ((bounds["mean"], target_error), (bounds["stddev"], target_sd_error))
    )


def train(
    model, guide, args, kwargs, num_steps, num_samples, learning_rate, nesting, progress, global_samples=None
) -> list[float]:
    """
    SVI with :class:`~pyro_tmc.TMC_ELBO` and Adam, its step decayed 10x over the run; the losses.
    An ``AutoNormal``'s globals train as one particle group (:func:`grouped_globals`), of
    ``global_samples`` particles where given (:func:`chain_global_samples`).
    """
    optim = pyro.optim.ClippedAdam({"lr": learning_rate, "lrd": 0.1 ** (1 / max(num_steps, 1))})
    if isinstance(guide, AutoNormal):
        guide = grouped_globals(model, guide, args, kwargs, global_samples)
    svi = SVI(model, guide, optim, TMC_ELBO(num_samples=num_samples, max_plate_nesting=nesting))
    losses = []
    for _ in _bar(range(num_steps), "training", progress):
        losses.append(svi.step(*args, **kwargs))
    return losses


def grouped_globals(model, guide: AutoNormal, args, kwargs, global_samples: Optional[int] = None) -> Callable:
    """
    ``guide`` with the model's globals (continuous latents in no plate and no ``pyro.markov`` chain)
    in one particle group: a factor over several globals (item response theory's mean ability and
    100 difficulties, against 30,000 answers) then has one particle dim, not one per global, which
    is K^(n-1) times smaller; the read-out's proposal groups them the same way. ``global_samples``:
    the group's K (``None``: the loss's).
    """
    names = [f"{name}_unconstrained" for name in global_sites(structure_trace(model, args, kwargs))]
    if global_samples is not None:
        chosen = set(names)
        guide = pyro.poutine.infer_config(
            guide, lambda msg: {"num_samples": global_samples} if msg["name"] in chosen else {}
        )
    return particle_group(GLOBALS_GROUP, sites=names)(guide) if len(names) > 1 else guide


def global_sites(trace) -> list[str]:
    """The model's globals: its continuous latents in no plate and no ``pyro.markov`` chain."""
    return [
        name
        for name, site in trace.nodes.items()
        if site["type"] == "sample"
        and not site["is_observed"]
        and not any(frame.vectorized for frame in site["cond_indep_stack"])
        and site["infer"].get("_markov_scope") is None
        and not site["fn"].has_enumerate_support
    ]


def chain_global_samples(model, args, kwargs) -> Optional[int]:
    """
    The globals' K: :data:`CHAIN_GLOBAL_SAMPLES` where a ``vectorized_markov`` chain has globals
    besides its first steps, else ``None`` (the loss's K). Every link of such a chain holds the
    globals' particles as a batch dim, so K globals particles cost K chain products (each globals
    particle meets every path of the chain's particles); with one per TMC draw the chain is contracted
    once, and the pooling of the read-out's draws by their ``P_TMC`` importance-samples the globals.
    On stochastic volatility's 2,516 days at K = 32, under its Laplace proposal: 0.1-0.8 s a draw with
    one globals particle, 16 s with 32. A chain's first step (a global too: in no plate) alone keeps
    the loss's K: one particle of it per draw left the 8-step walk's first sd 14% short.
    """
    with torch.random.fork_rng():  # a look at the model's structure leaves the caller's draws as they were
        trace = structure_trace(model, args, kwargs)
    links = find_time_links(trace)
    firsts = {link.first for link in links}
    others = [name for name in global_sites(trace) if name not in firsts]
    return CHAIN_GLOBAL_SAMPLES if links and others else None


def laplace_before_training(
    model, guide, args, kwargs, draws, num_samples, max_plate_nesting, history: dict, global_samples=None
) -> Optional[AdaptiveProposal]:
    """
    The proposal read from the model's Laplace approximation, Newton steps from a fresh
    ``AutoNormal``'s initial locations, when it can be trusted: at the joint mode, where its TMC draws
    already agree (the sd of ``draws`` draws' ``log P_TMC`` at most :data:`LAPLACE_TRUSTED_SPREAD`),
    or, where the joint density has no mode (a funnel), the locals' conditional approximation beside
    the globals' Laplace marginal at its mode. Then training is skipped, and the rounds of adaptation
    start from it. ``None`` (train first) for any other guide, a model with no Laplace approximation,
    a wider spread at the joint mode, or a marginal that did not converge. ``history`` records the
    spread (``"laplace_spread"``) and whether the start is the joint mode's (``"laplace_at_mode"``).
    ``global_samples``: the globals' K (:func:`chain_global_samples`).
    """
    if not isinstance(guide, AutoNormal) or hasattr(guide, "locs"):  # a guide given, or trained already
        return None
    with torch.no_grad(), pyro.poutine.block():
        guide(*args, **kwargs)  # its prototype trace and initial locations, as SVI's first step makes them
    proposal = AdaptiveProposal(
        model,
        *args,
        init=guide,
        max_plate_nesting=max_plate_nesting,
        global_samples=global_samples,
        **kwargs,
    )
    # the joint mode's, or a funnel's conditional approximation beside the globals' Laplace marginal
    # at its mode; not one beside the untrained guide's globals, which misses their tails where a
    # handful of draws need not show it (eight schools seed 2: sds 19% short)
    candidate = laplace_proposal(model, proposal, args, kwargs, trusted_only=True)
    if candidate is None:
        return None
    values = torch.tensor(log_evidences(candidate, model, args, kwargs, draws, num_samples))
    history["laplace_spread"] = spread = float(values.std()) if len(values) > 1 else math.inf
    history["laplace_at_mode"] = at_mode = candidate.laplace_at_mode
    # a conditional start with the marginal at its mode skips training whatever its spread: the
    # marginal's Newton steps find the globals that training moves towards, and stochastic volatility's
    # 2,516 days spread by 1.9 nats at K = 32 under it (the chain's own noise), where training for
    # 131-164 s and its Laplace start gave 12 effective draws of 400, and this start 110
    return candidate if spread <= LAPLACE_TRUSTED_SPREAD or not at_mode else None


def adapted_proposal(
    model,
    guide,
    args,
    kwargs,
    rounds,
    draws,
    num_samples,
    max_plate_nesting,
    progress,
    start=None,
    global_samples: Optional[int] = None,
):
    """
    An :class:`AdaptiveProposal` moved onto the posterior, starting from the trained ``guide``: from
    its locations and scales when it is an ``AutoNormal``, else from the TMC-weighted joint draws of
    ``draws`` TMC draws under it (any guide can start the rounds); from the prior's moments when the
    guide is an ``AutoNormal`` that never ran (``num_steps=0``). Where the model's Laplace
    approximation exists (:mod:`pyro_tmc.infer.laplace`) and measures better, the rounds start from
    it instead; the proposal returned is the best the rounds measured (:func:`best_of_rounds`).
    A ``start`` (:func:`laplace_before_training`) is where the rounds start instead.
    ``global_samples``: the globals' K (:func:`chain_global_samples`).
    """

    def measure(candidate: AdaptiveProposal) -> float:
        return mean_log_evidence(candidate, model, args, kwargs, draws, num_samples)

    if start is not None:
        return best_of_rounds(model, start, args, kwargs, rounds, draws, num_samples, measure, progress)
    trained = not isinstance(guide, AutoNormal) or hasattr(guide, "locs")  # an AutoNormal never run has none
    start = guide if isinstance(guide, AutoNormal) and trained else None
    proposal = AdaptiveProposal(
        model, *args, init=start, max_plate_nesting=max_plate_nesting, global_samples=global_samples, **kwargs
    )
    if start is None and trained:
        proposal = fitted_to_guide(
            model, guide, proposal, args, kwargs, draws, num_samples, max_plate_nesting
        )
    proposal = laplace_started(model, proposal, args, kwargs, measure)
    return best_of_rounds(model, proposal, args, kwargs, rounds, draws, num_samples, measure, progress)


def laplace_started(model, proposal: AdaptiveProposal, args, kwargs, measure: Callable) -> AdaptiveProposal:
    """
    ``proposal``, or the proposal read from the model's Laplace approximation (Newton steps from
    ``proposal``'s mean), whichever ``measure`` scores higher. The globals' widening shrinks with
    their number (:func:`globals_widening`) and, past :data:`~pyro_tmc.infer.adaptive_proposal.DEFAULT_DF`
    globals, their Student-t's degrees of freedom grow with it: a Student-t with few degrees of
    freedom in many dims spreads its particles' radii far wider than the posterior's, and the
    weights with them.
    """
    candidate = laplace_proposal(model, proposal, args, kwargs)
    if candidate is None:
        return proposal
    return candidate if measure(candidate) > measure(proposal) else proposal


def laplace_proposal(
    model, proposal: AdaptiveProposal, args, kwargs, trusted_only: bool = False
) -> Optional[AdaptiveProposal]:
    """
    The proposal read from the model's Laplace approximation, Newton steps from ``proposal``'s mean
    (the globals widened by :func:`globals_widening`, their Student-t's degrees of freedom at least
    their number), or ``None`` where it does not exist (or, with ``trusted_only``, where it is the
    locals' conditional one beside globals that are not their Laplace marginal at its mode). Its
    ``laplace_at_mode`` says whether it is the joint mode's.
    """
    approximation = laplace_approximation(model, proposal, proposal_mean(proposal), args, kwargs)
    if approximation is None:
        return None
    if trusted_only and not (approximation.at_mode or approximation.marginal_converged):
        return None
    num_globals = proposal.num_globals
    df = proposal.global_proposal.df if proposal.globals else None
    if df is not None:
        df = max(df, float(num_globals))
    candidate = proposal.fitted_to_gaussian(approximation, globals_widening(num_globals), WIDEN_LOCALS, df)
    # one globals particle a draw: the chain's proposal follows it (not widened: its mixture over the
    # step before's particles has the tails, and widening the 2,515 days of stochastic volatility by
    # 1.2 spread the draws' log P_TMC by 2.5 nats, not 1.9)
    candidate.chain_conditional = chain_conditional(model, candidate, approximation.mean, args, kwargs)
    candidate.laplace_at_mode = approximation.at_mode
    return candidate


def globals_widening(num_globals: int) -> float:
    """
    The widening of ``num_globals`` globals' sds: :data:`WIDEN_GLOBALS` up to 3 globals, then
    shrinking as ``1 / sqrt(num_globals)``. A proposal wider by a factor ``w`` in each of G directions
    is ``G (w - 1)^2`` nats from the posterior (to second order), so this keeps that cost at its
    value for 3 globals: 1.2 in one to three dims, 1.03 in a hundred.
    """
    return 1 + (WIDEN_GLOBALS - 1) * min(1.0, math.sqrt(3 / max(num_globals, 1)))


def best_of_rounds(model, proposal, args, kwargs, rounds, draws, num_samples, measure, progress):
    """
    ``rounds`` rounds of :func:`~pyro_tmc.infer.adaptation.adapt`, each measured (the mean
    ``log P_TMC`` of its draws, which rises as the proposal nears the posterior), and the best
    proposal of all returned, the last refit measured too. A refit from fewer effective particles
    than the globals' dims can be narrower than the posterior in some direction, and the next
    round's draws then fewer still: rounds can make a proposal worse, and keeping the best stops
    that collapse. The returned proposal's ``history`` holds every round.
    """
    candidates, history = [], []
    for _ in _bar(range(rounds), "adapting the proposal", progress):
        refitted = adapt(
            model,
            proposal,
            *args,
            num_samples=num_samples,
            rounds=1,
            draws=draws,
            widen_globals=globals_widening(proposal.num_globals),
            **kwargs,
        )
        measured = refitted.history[-1]
        history.append(measured)
        candidates.append((float(measured.log_evidences.mean()), proposal))
        proposal = refitted
    if rounds:
        candidates.append((measure(proposal), proposal))
    best = max(candidates, key=lambda candidate: candidate[0])[1] if candidates else proposal
    best.history = history
    return best


def mean_log_evidence(proposal, model, args, kwargs, draws: int, num_samples: int) -> float:
    """The mean ``log P_TMC`` of ``draws`` TMC draws of K = ``num_samples`` under ``proposal``."""
    values = log_evidences(proposal, model, args, kwargs, draws, num_samples)
    return sum(values) / len(values)


def log_evidences(proposal, model, args, kwargs, draws: int, num_samples: int) -> list[float]:
    """The ``log P_TMC`` of each of ``draws`` TMC draws of K = ``num_samples`` under ``proposal``."""
    elbo = TMC_ELBO(num_samples=num_samples, max_plate_nesting=proposal.max_plate_nesting)
    values = []
    for _ in range(draws):
        with torch.no_grad():
            values.append(float(elbo.draw(model, proposal, *args, **kwargs).log_estimate()))
    return values


def fitted_to_guide(model, guide, proposal, args, kwargs, draws, num_samples, max_plate_nesting):
    """``proposal`` fitted to the pooled joint draws of ``draws`` TMC draws under ``guide``."""
    elbo = TMC_ELBO(num_samples=num_samples, max_plate_nesting=_nesting(max_plate_nesting))
    pools = []
    for _ in range(draws):
        with torch.no_grad():
            draw = elbo.draw(model, guide, *args, **kwargs)
            pools.append(read_draw(draw, samples_per_draw=num_samples))
    posterior = TMCPosterior(model, pools, args, kwargs)
    samples, log_weights = posterior.pooled_samples()
    covered = {name: samples[name] for name in proposal.covered if name in samples}
    return proposal.fitted(covered, log_weights, widen_globals=WIDEN_GLOBALS, widen_locals=WIDEN_LOCALS)


def _nesting(max_plate_nesting: Optional[int]) -> float:
    return float("inf") if max_plate_nesting is None else max_plate_nesting


def _bar(iterable: Iterable, description: str, progress: bool) -> Iterable:
    if not progress:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is an optional extra: run silently without it
        return iterable
    return tqdm(iterable, desc=f"fit_posterior: {description}", leave=False)
