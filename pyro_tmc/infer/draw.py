"""One TMC draw: the guide and model run under ``tmc``, and everything read from them.

Every loss and read-out of the package is a short composition over a
:class:`TMCDraw`:

- :class:`~pyro_tmc.TMC_ELBO` takes ``draw.log_estimate()`` (or a gradient
  estimator's surrogate built from it, :mod:`pyro_tmc.infer.estimators`);
- :class:`~pyro_tmc.TMC_RWS` the wake-sleep surrogate built from it;
- ``compute_marginals`` and ``sample_posterior`` read the posterior of the same
  draw (:mod:`pyro_tmc.infer.posterior`).

A draw is made by :meth:`TMCDraw.run`: the guide runs under ``tmc`` (each latent
gets K particles), optionally its particles are replaced by detached leaves and
the guide replayed on them (for the path-gradient and wake-sleep estimators,
which need d log P / d z), then the model runs against those particles. The
traces are pruned, checked and symbolised once; the factors are computed on
demand, with optional *sources* (zero tensors whose gradient is each site's
posterior marginal).
"""

import warnings
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Protocol

import torch

from pyro import poutine
from pyro.infer.util import is_validation_enabled
from pyro.poutine import Trace
from pyro.poutine.util import prune_subsample_sites
from pyro.util import check_model_guide_match, check_traceenum_requirements

from pyro_tmc.estimate.checks import check_finite, check_plate_dependencies, check_site_shapes
from pyro_tmc.estimate.evaluation import EvaluationPlan, plan_evaluation
from pyro_tmc.estimate.factors import LogFactor, compute_log_factors, contract_estimate
from pyro_tmc.estimate.scales import ScalePlan, symbolize
from pyro_tmc.estimate.vectorized_markov import markov_times, with_previous_steps, without_funsor_scoring
from pyro_tmc.infer.broadcast_check import BroadcastCheck, run_probe
from pyro_tmc.infer.chain_plan import ChainPlans, needs_plan
from pyro_tmc.infer.collapse_check import collapse_refusal
from pyro_tmc.infer.path_gradients import with_leaf_values
from pyro_tmc.ops.capture import is_tracing
from pyro_tmc.poutine import TMCMessenger
from pyro_tmc.poutine.chain_dims import ChainDims, ChainDimsConflict
from pyro_tmc.poutine.particle_groups import particle_groups_of
from pyro_tmc.poutine.sites import (
    is_latent,
    is_summed_exactly,
    latent_names,
    marginal_sources,
    model_or_guide_site,
    particle_draw,
    source_weights,
)
from pyro_tmc.poutine.tmc_messenger import ParticleDimsExhausted


class EstimateProgram(Protocol):
    """
    What computes a draw's estimate for ``TMC_ELBO(compile=...)``: the capture engine's
    :class:`pyro_tmc.compile.compiled.EstimateProgram`, a cache of traced graphs per plan.
    """

    def log_estimate(
        self, draw: "TMCDraw", sources: Optional[dict[str, torch.Tensor]], detach_guide_proposals: bool
    ) -> Optional[torch.Tensor]:
        """``log P_TMC`` of the draw, or ``None`` where the eager path must compute it."""


@dataclass
class DrawSettings:
    """
    How a draw is made.

    :param int num_samples: K for every latent site that does not set its own.
    :param proposal: the proposal strategy (name or :class:`~pyro_tmc.poutine.proposals.ProposalStrategy`).
    :param int max_plate_nesting: plate dims right of the particle dims.
    :param max_factor_bytes: a memory budget per log factor in bytes, ``"auto"`` (a share
        of the memory available: :func:`pyro_tmc.estimate.budget.factor_budget`), or ``None``.
    :param bool joint: every sampled latent shares one particle dim: K joint
        samples of the guide, as IWAE draws them, instead of K per site.
    :param EstimateProgram program: where the estimate is computed by a cached
        graph per plan (``TMC_ELBO(compile=...)``); ``None`` computes it eagerly.
    """

    num_samples: int
    proposal: object
    max_plate_nesting: int
    max_factor_bytes: Optional[int] = None
    #: every latent on one shared particle dim (IWAE's K joint samples)
    joint: bool = False
    #: the loss's cache of estimate programs (:class:`EstimateProgram`), or ``None``: eager
    program: Optional[EstimateProgram] = None
    #: the loss's record of its hand-broadcasting probe (:mod:`pyro_tmc.infer.broadcast_check`)
    broadcast_check: Optional[BroadcastCheck] = None
    #: ``dim -> K`` overriding every sampled site's count (the probe draw itself)
    particle_counts: Optional[Callable[[int], int]] = None
    #: the loss's plans of particle dims for guides that sample a chain outside
    #: pyro.markov (:mod:`pyro_tmc.infer.chain_plan`), and the plan of this draw
    chain_plans: Optional[ChainPlans] = None
    chain_dims: Optional[ChainDims] = None


@dataclass
class TMCDraw:
    """
    One draw of particles for every latent site, and the traces that hold them.

    :param Trace model_trace: the model run against the guide's particles,
        pruned and symbolised.
    :param Trace guide_trace: the guide run under ``tmc`` (replayed on the leaves,
        when there are leaves).
    :param EvaluationPlan plan: how its estimate is evaluated: the scale plan, the
        memory budget, stacked densities (:mod:`pyro_tmc.estimate.evaluation`),
        decided once and passed to everything that computes or reads the estimate.
    :param DrawSettings settings: how it was made.
    :param Trace live_trace: the guide's trace as drawn, differentiable in its
        parameters, when the particles were replaced by leaves; else ``None``.
    :param dict leaves: site name -> the detached leaf tensor that replaced its particles.
    """

    model_trace: Trace
    guide_trace: Trace
    plan: EvaluationPlan
    settings: DrawSettings
    live_trace: Optional[Trace] = None
    leaves: dict[str, torch.Tensor] = field(default_factory=dict)

    # -- making one ------------------------------------------------------------

    @classmethod
    def run(
        cls,
        model: Callable,
        guide: Callable,
        args: tuple,
        kwargs: dict,
        settings: DrawSettings,
        leaf_sites: Optional[Callable[[Trace], list[str]]] = None,
        leaves_require_grad: bool = True,
    ) -> "TMCDraw":
        """
        Run the guide under ``tmc``, then the model against its particles.

        :param leaf_sites: if given, ``live guide trace -> names`` of sites whose
            particles are replaced by detached leaves before the model runs.
        :param bool leaves_require_grad: whether those leaves require grad.
        """

        def draw_traces(settings: DrawSettings, record: Optional[list] = None):
            guide_trace = run_guide(guide, args, kwargs, settings, record)
            live_trace, leaves = None, {}
            if leaf_sites is not None:
                live_trace = guide_trace
                leaf_trace, leaves = with_leaf_values(live_trace, leaf_sites(live_trace), leaves_require_grad)
                guide_trace = replay_guide(guide, leaf_trace, args, kwargs, settings)
            model_trace = run_model(model, guide_trace, args, kwargs, settings, record)
            return settings, guide_trace, live_trace, leaves, model_trace

        settings, guide_trace, live_trace, leaves, model_trace = with_chain_plan(
            draw_traces, model, args, kwargs, settings
        )
        model_trace, guide_trace, scales = finish(model_trace, guide_trace, settings.max_plate_nesting)
        plan = plan_evaluation(model_trace, scales, settings.max_factor_bytes)
        check = settings.broadcast_check
        if check is not None and check.wanted() and not settings.joint:
            run_probe(
                lambda probe: traces_of_one_draw(model, guide, args, kwargs, probe),
                settings,
                model_trace,
                guide_trace,
            )
            check.done = True
        return cls(model_trace, guide_trace, plan, settings, live_trace, leaves)

    # -- what it holds -----------------------------------------------------------

    @property
    def scales(self) -> ScalePlan:
        """Where each site's scale acts (:func:`pyro_tmc.estimate.scales.symbolize`)."""
        return self.plan.scales

    def site(self, name: str) -> dict:
        """The model's site ``name``, or the guide's when only the guide has it (an auxiliary latent)."""
        return model_or_guide_site(name, self.model_trace, self.guide_trace)

    def sources(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Zero tensors over each named site's particles (see :meth:`marginal_weights`)."""
        return marginal_sources([self.site(name) for name in names])

    def factors(
        self, sources: Optional[dict[str, torch.Tensor]] = None, detach_guide_proposals: bool = False
    ) -> list[LogFactor]:
        """The packed log factors of every site (:func:`pyro_tmc.estimate.factors.compute_log_factors`)."""
        return compute_log_factors(
            self.model_trace, self.guide_trace, self.plan, sources, detach_guide_proposals
        )

    # -- the estimate --------------------------------------------------------------

    def log_estimate(
        self, sources: Optional[dict[str, torch.Tensor]] = None, detach_guide_proposals: bool = False
    ) -> torch.Tensor:
        """
        ``log P_TMC`` of this draw.

        :param dict sources: site name -> zero tensor added to that site's factor.
        :param bool detach_guide_proposals: stop the gradient through the guide's density.
        :raises ValueError: naming the site, if the estimate is not finite.
        """
        # a whole step being captured computes its estimate in that graph, eagerly here; sliced
        # factors checkpoint their slices, which a graph cannot: a budget runs eagerly
        program = None if is_tracing() or self.plan.sliced else self.settings.program
        if program is not None:
            estimate = program.log_estimate(self, sources, detach_guide_proposals)
            if estimate is not None and torch.isfinite(estimate).all():
                return estimate
            # not finite, or no program for this plan: the eager path (whose check names the site)
        factors = self.factors(sources, detach_guide_proposals)
        estimate = contract_estimate(factors, self.scales)
        check_finite(factors, estimate, self.model_trace)
        return estimate

    def marginal_weights(
        self, log_estimate: torch.Tensor, sources: dict[str, torch.Tensor], retain_graph: bool = True
    ) -> dict[str, torch.Tensor]:
        """
        Each source's site's posterior marginal weights (per particle and plate
        element), by the autodiff identity: d log P / d source divided by what
        scales the site's factor from outside (subsampling, poutine.scale).

        :param log_estimate: :meth:`log_estimate` computed with ``sources``.
        """
        grads = torch.autograd.grad(
            log_estimate, list(sources.values()), allow_unused=True, retain_graph=retain_graph
        )
        return source_weights(sources, grads, self.carried_scale)

    def carried_scale(self, name: str) -> float:
        """What multiplies site ``name``'s factor from outside it (:meth:`ScalePlan.carried_scale`)."""
        return self.scales.carried_scale(self.site(name))

    # -- the posterior ---------------------------------------------------------------

    def marginals(self):
        """:func:`pyro_tmc.infer.posterior.compute_marginals` of this draw."""
        from pyro_tmc.infer import posterior

        return posterior.compute_marginals(self)

    def sample(self, num_draws: int) -> dict[str, torch.Tensor]:
        """:func:`pyro_tmc.infer.posterior.sample_posterior` of this draw."""
        from pyro_tmc.infer import posterior

        return posterior.sample_posterior(self, num_draws)


# -- running guide and model ---------------------------------------------------------


def traces_of_one_draw(model, guide, args, kwargs, settings: DrawSettings) -> tuple[Trace, Trace]:
    """The finished (model, guide) traces of a plain draw (no leaves)."""
    guide_trace = run_guide(guide, args, kwargs, settings)
    model_trace = run_model(model, guide_trace, args, kwargs, settings)
    model_trace, guide_trace, _ = finish(model_trace, guide_trace, settings.max_plate_nesting)
    return model_trace, guide_trace


def with_chain_plan(draw_traces: Callable, model, args, kwargs, settings: DrawSettings):
    """
    ``draw_traces(settings, record)``, with the loss's plan of particle dims for
    a guide that samples the model's ``pyro.markov`` chain outside any markov
    context (AutoNormal, a plain loop; :mod:`pyro_tmc.infer.chain_plan`):

    - the first draw with these argument shapes runs without one, and decides it
      (from what its guide and model ``record``); should its guide run out of
      particle dims, it is drawn again under the plan, from the same random state;
    - a draw the plan cannot serve is drawn again without it, from the same
      random state, and the plan is dropped.
    """
    plans = settings.chain_plans
    if plans is None or settings.chain_dims is not None or settings.joint:
        return draw_traces(settings)
    key = plans.key(args, kwargs, settings)
    first = not plans.decided(key)
    plan = plans.plan(key)
    planned = replace(settings, chain_dims=plan) if plan is not None else settings
    rng = _rng_state() if (first or plan is not None) and not is_tracing() else None
    record: list = []
    try:
        result = draw_traces(planned, record)
    except ParticleDimsExhausted as exhausted:
        if not first or rng is None:
            raise _with_refusal(exhausted, plans.refusal(key)) from None
        plan = plans.decide(key, model, args, kwargs, needed=True)
        if plan is None:
            raise
        _restore_rng(rng)
        return with_chain_plan(draw_traces, model, args, kwargs, settings)
    except ChainDimsConflict as conflict:
        if plan is None or rng is None:
            raise
        plans.refuse(key, _without_shapes(conflict))
        _restore_rng(rng)
        try:
            return draw_traces(settings)
        except ParticleDimsExhausted as exhausted:
            raise _with_refusal(exhausted, plans.refusal(key)) from None
    if first:
        guide_run, model_run = record
        plans.decide(key, model, args, kwargs, needs_plan(guide_run.unscoped_latents, model_run.chain_sites))
    return result


def _without_shapes(error: Exception) -> str:
    """An error's message without the dump of trace shapes that Pyro appends to errors raised in a trace."""
    return str(error).split("\nTrace Shapes:")[0].strip()


def _with_refusal(error: Exception, refusal: str) -> Exception:
    """The error of a guide that ran out of particle dims, with why recycling them did not serve."""
    if not refusal:
        return error
    return type(error)(
        f"{_without_shapes(error)} TMC could not recycle the guide's particle dims along the model's "
        f"markov chain: {refusal}"
    )


def _rng_state() -> tuple:
    """The random states a draw consumes (torch's CPU generator, and CUDA's where in use)."""
    cuda = (
        torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    )
    return torch.get_rng_state(), cuda


def _restore_rng(state: tuple) -> None:
    """Back to a state of :func:`_rng_state`, so that a draw made again makes the same draws."""
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def run_guide(guide, args, kwargs, settings: DrawSettings, record: Optional[list] = None) -> Trace:
    """
    The guide under ``tmc``: K particles for every latent site, dims left of the plates.

    :param list record: if given, the handler is appended to it (what it saw).
    """
    messenger = TMCMessenger(
        settings.num_samples,
        settings.proposal,
        first_available_dim=-1 - settings.max_plate_nesting,
        joint_dim="new" if settings.joint else None,
        particle_counts=settings.particle_counts,
        chain_dims=settings.chain_dims,
    )
    if record is not None:
        record.append(messenger)
    guide_trace = run_with_shape_hint(
        messenger, "guide", poutine.trace(messenger(without_funsor_scoring(guide))).get_trace, args, kwargs
    )
    warn_about_summed_guide_sites(guide_trace)
    return guide_trace


def replay_guide(guide, leaf_trace: Trace, args, kwargs, settings: DrawSettings) -> Trace:
    """
    The guide replayed on ``leaf_trace``'s particles, continuing the dim
    allocation, so that the Delta sites it recomputes keep their particle dims.
    """
    messenger = continuing_messenger(leaf_trace, settings)
    guide = without_funsor_scoring(guide)
    return poutine.trace(poutine.replay(messenger(guide), trace=leaf_trace)).get_trace(*args, **kwargs)


def run_model(
    model, guide_trace: Trace, args, kwargs, settings: DrawSettings, record: Optional[list] = None
) -> Trace:
    """
    The model against the guide's particles (latents it alone has get their own).

    :param list record: if given, the handler is appended to it (what it saw).
    """
    # The model's handler continues the guide's dim allocation, and sits
    # inside the replay so that it sees the model's own markov scopes.
    messenger = continuing_messenger(guide_trace, settings)
    if record is not None:
        record.append(messenger)
    # a vectorized_markov chain's previous steps are the particles of the step before
    replayed = with_previous_steps(guide_trace)
    run = poutine.trace(poutine.replay(messenger(without_funsor_scoring(model)), trace=replayed)).get_trace
    return run_with_shape_hint(messenger, "model", run, args, kwargs)


def continuing_messenger(replayed: Trace, settings: DrawSettings) -> TMCMessenger:
    """
    A ``tmc`` handler that continues the dim allocation of a run whose trace it
    replays, and its particle groups (the model's own latents join the guide's).
    """
    return TMCMessenger(
        settings.num_samples,
        settings.proposal,
        replayed_sites=latent_names(replayed),
        reserved_dims=particle_dims_of(replayed),
        continue_allocation=True,
        joint_dim=joint_dim(replayed) if settings.joint else None,
        particle_counts=settings.particle_counts,
        particle_groups=particle_groups_of(replayed),
        check_replayed_dims=settings.chain_dims is not None,
    )


def particle_dims_of(trace: Trace) -> set[int]:
    """Every dim that a latent value of the trace varies along by its particles."""
    return {
        dim for site in trace.nodes.values() if is_latent(site) for dim in site["infer"].get("_dim_to_id", {})
    }


def joint_dim(trace: Trace):
    """The ``(dim, id)`` of the particle dim the trace's latents share, or ``"new"`` if none has one yet."""
    for site in trace.nodes.values():
        draw = particle_draw(site)
        if draw is not None and draw.joint:
            return draw.target_dim, site["infer"]["_dim_to_id"][draw.target_dim]
    return "new"


def finish(model_trace: Trace, guide_trace: Trace, max_plate_nesting) -> tuple[Trace, Trace, ScalePlan]:
    """
    Validate (as ``TraceEnum_ELBO`` does), prune subsample sites, symbolise, check plate dependencies.

    :returns: the pruned (model, guide) traces and the draw's scale plan.
    """
    if is_validation_enabled():
        check_model_guide_shapes_match(model_trace, guide_trace, max_plate_nesting)
    guide_trace = prune_subsample_sites(guide_trace)
    model_trace = prune_subsample_sites(model_trace)
    if is_validation_enabled():
        check_site_shapes(model_trace, guide_trace, max_plate_nesting)
        # After pruning, as TraceEnum_ELBO does: a plate's subsample site lies outside
        # every plate, and would read as depending on the enumerated sites of an earlier plate.
        check_traceenum_requirements(model_trace, guide_trace)
    scales = symbolize(model_trace, guide_trace)
    scales.markov_times = markov_times(model_trace)
    check_plate_dependencies(model_trace, guide_trace)
    return model_trace, guide_trace, scales


def run_with_shape_hint(messenger: TMCMessenger, role: str, run, args, kwargs) -> Trace:
    """
    ``run(*args, **kwargs)``; a shape error raised by user code on the particle
    dims is re-raised, same type, with a hint naming the site and the dims.
    """
    try:
        return run(*args, **kwargs)
    except (RuntimeError, IndexError, ValueError) as error:
        refusal = collapse_refusal(error, messenger.particle_dims)
        if refusal is not None:
            raise refusal from error
        if not is_shape_error(error):
            raise  # our own errors, and the user's that have nothing to do with shapes
        try:
            hinted = type(error)(str(error) + messenger.shape_error_hint(role))
        except Exception:  # an exception type that takes other arguments: the error as it came
            hinted = None
        if hinted is None:
            raise
        raise hinted from error


#: Phrases of torch's and Pyro's broadcasting errors (a ValueError is a shape error only with one).
_SHAPE_PHRASES = (
    "broadcast",
    "shape mismatch",
    "must match",
    "size of tensor",
    "shapes cannot",
    "invalid for input of size",
    "event_shape",
)
#: Phrases of a value's or a parameter's complaint: wrong values, not wrong shapes.
_VALUE_PHRASES = ("to satisfy the constraint", "within the support")


def is_shape_error(error: Exception) -> bool:
    """
    Whether user code failed on the shape of a value (where the particle dims
    TMC adds are the likely cause), not on the value itself. Pyro appends a dump
    of the trace's shapes to errors raised inside a trace, and torch names a
    parameter's shape in its constraint message, so the word "shape" alone says nothing.
    """
    message = str(error).split("Trace Shapes:")[0].lower()
    if any(phrase in message for phrase in _VALUE_PHRASES):
        return False
    return not isinstance(error, ValueError) or any(phrase in message for phrase in _SHAPE_PHRASES)


def _without_previous_steps(model_trace: Trace, guide_trace: Trace) -> tuple[Trace, Trace]:
    """
    Copies of the traces without a ``vectorized_markov`` chain's previous-steps sites (the model's
    ``_do_not_score`` ones, to which TMC gives the steps before's particles, so that a guide need not
    draw them and its draw is not scored) and without the guide's subsample site of the chain's time
    plate, which the model's funsor plate does not record: Pyro's check would warn of both.
    """
    unscored = [n for n, site in model_trace.nodes.items() if site.get("infer", {}).get("_do_not_score")]
    if not unscored:
        return model_trace, guide_trace
    time_plates = {frame.name for name in unscored for frame in model_trace.nodes[name]["cond_indep_stack"]}
    model_trace, guide_trace = model_trace.copy(), guide_trace.copy()
    for name in unscored:
        model_trace.remove_node(name)
        if name in guide_trace.nodes:
            guide_trace.remove_node(name)
    for name in time_plates - set(model_trace.nodes):
        if name in guide_trace.nodes:
            guide_trace.remove_node(name)
    return model_trace, guide_trace


def check_model_guide_shapes_match(model_trace: Trace, guide_trace: Trace, max_plate_nesting) -> None:
    """
    :func:`pyro.util.check_model_guide_match`, whose shape comparison trims a
    shape with a negative start when its event dims outnumber the rest (a
    Dirichlet transition matrix under AutoNormal carries particle dims on the
    guide side only) and then reports a false disagreement. We compare the
    plate and event dims ourselves in that case.
    """
    model_trace, guide_trace = _without_previous_steps(model_trace, guide_trace)
    try:
        check_model_guide_match(model_trace, guide_trace, max_plate_nesting)
    except ValueError as error:
        if "shapes disagree" not in str(error):
            raise
        for name, guide_site in guide_trace.nodes.items():
            model_site = model_trace.nodes.get(name)
            if guide_site["type"] != "sample" or model_site is None or model_site["type"] != "sample":
                continue
            kept = int(max_plate_nesting) + model_site["fn"].event_dim
            model_shape = tuple(model_site["fn"].shape())[-kept:] if kept else ()
            guide_shape = tuple(guide_site["fn"].shape())[-kept:] if kept else ()
            width = max(len(model_shape), len(guide_shape))
            if (1,) * (width - len(model_shape)) + model_shape != (1,) * (
                width - len(guide_shape)
            ) + guide_shape:
                raise ValueError(
                    f"Model and guide shapes disagree at site '{name}': {model_shape} vs {guide_shape}"
                ) from error


def warn_about_summed_guide_sites(guide_trace: Trace) -> None:
    """Warn, naming the site, where a guide site marked for enumeration is summed exactly."""
    for name, site in guide_trace.nodes.items():
        if is_latent(site) and is_summed_exactly(site):
            warnings.warn(
                f"Guide site '{name}' is marked infer={{'enumerate': {site['infer'].get('enumerate')!r}}}: "
                "TMC_ELBO sums it exactly over its support, where the guide's probabilities cancel "
                "(sum_z q(z) p(x, z) / q(z) = sum_z p(x, z)), so the estimate is exact in this site "
                "and the guide's parameters for it get no gradient. Drop the flag, or set "
                "infer={'num_samples': K}, to sample it from the guide instead.",
                UserWarning,
                stacklevel=4,  # here, run_guide, TMCDraw.run: the loss that drew
            )
