"""Rounds that move an :class:`~pyro_tmc.infer.adaptive_proposal.AdaptiveProposal` onto TMC's posterior.

Population Monte Carlo (Cappe, Guillin, Marin and Robert 2004) with TMC draws as the samples.
Each round makes ``draws`` independent TMC draws under the current proposal. Draw r's estimate
P_r of p(x) weighs it against the others: pooled over draws, the draws' posteriors (each the
distribution over its particle combinations, weights p(x, z)/q(z)) weighted by P_r form one
importance sampler of the posterior, consistent as draws are added whatever the proposal (as
:func:`~pyro_tmc.infer.moments.posterior_moments` pools moments). The proposal is then refitted
to the pooled weighted posterior (:meth:`AdaptiveProposal.fitted_to_weighted`) and widened a
little, so that the next round's proposal covers the tails the last round's particles missed.

What each round reads from a draw (``readout``):

- ``"factors"``: for every local site at once, one backward pass gives the draw's posterior over
  each combination of the site's particles with its parents' and the globals' (a zero *source*
  factor over exactly those particle dims: :func:`read_factor_posteriors`). Each local's
  regression on its parents and the globals is fitted to all K^(1 + parents) x K_globals
  combinations with their exact weights (Rao-Blackwellised: no sampling noise within a draw),
  the globals to every particle of their one particle dim with its marginal weight. It costs
  what ``compute_marginals`` costs (measured on a pyro.markov chain with a global, K = 16: 0.06 s
  a draw at 50 steps, 0.27 s at 200);
- ``"samples"``: ``samples_per_draw`` exact joint draws of particle combinations
  (:meth:`~pyro_tmc.infer.draw.TMCDraw.sample`), each weighted by softmax(log P_r) /
  samples_per_draw. They cost one contraction per latent site (measured, 64 draws: 6.4 s a draw
  at 50 steps, 82 s at 200) and fit noisier regressions than the factors (on the toy model at
  K = 32, 10 draws, 4 rounds: coefficients within 0.21 of the exact 0.5, against 0.04);
- ``"marginals"``: each site's marginal alone (:func:`~pyro_tmc.infer.posterior.marginals_and_log_estimate`):
  the globals exactly as above, each local its pooled mean and sd (no regression);
- ``"auto"`` (default): ``"factors"``, unless one local's combinations would hold more than
  :data:`MAX_FACTOR_ELEMENTS` numbers (many parents, or large K), then ``"marginals"``.
"""

import math
from typing import Callable, NamedTuple

import torch

from pyro.ops.packed import pack

from pyro_tmc.estimate.factors import LogFactor, contract_estimate
from pyro_tmc.estimate.vectorized_markov import own_previous_dim, step_particle_dim
from pyro_tmc.infer.adaptive_proposal import GLOBALS_SITE, AdaptiveProposal, LocalDraws
from pyro_tmc.infer.posterior import marginals_and_log_estimate
from pyro_tmc.infer.tmc_elbo import TMC_ELBO

READOUTS = ("auto", "factors", "samples", "marginals")
#: above this many elements in one local's factor read-out (its particle combinations x its
#: elements x its coordinates), ``readout="auto"`` reads the marginals instead
MAX_FACTOR_ELEMENTS = 2**25
#: the posterior mass of a factor read-out's lightest combinations, dropped from the fit
DROPPED_MASS = 1e-6
#: the default widening factors on the globals' and the locals' fitted sds. Measured after 4
#: rounds (K = 16, 10 draws), read out by posterior_moments (K = 16, 20 draws): on the conjugate
#: model of the tests (seeds 0-2, Student-t globals) the sds' worst relative error 10.5% / 5.6% /
#: 5.9% at widening 1.0 / 1.2 / 1.5; on a 50-step chain (Normal globals) the sds within 0.88-1.25 /
#: 0.94-1.11 / 0.93-1.09 of the exact ones; log P_TMC's sd grows with the widening (0.26 / 0.31 /
#: 0.71 on the chain). 1.2 keeps the sds right at little cost in the evidence's spread.
WIDEN_GLOBALS, WIDEN_LOCALS = 1.2, 1.2


class AdaptationRound(NamedTuple):
    """
    What one round of :func:`adapt` measured, under the proposal it started from.

    :ivar torch.Tensor log_evidences: each draw's ``log P_TMC``, shape ``(draws,)``.
    :ivar float effective_draws: ``1 / sum a_r^2`` of the draws' normalised weights ``a``.
    :ivar str readout: ``"factors"``, ``"samples"`` or ``"marginals"``: what the refit read.
    """

    log_evidences: torch.Tensor
    effective_draws: float
    readout: str


def adapt(
    model: Callable,
    proposal: AdaptiveProposal,
    *args,
    num_samples: int = 16,
    rounds: int = 3,
    draws: int = 10,
    samples_per_draw: int = 64,
    readout: str = "auto",
    widen_globals: float = WIDEN_GLOBALS,
    widen_locals: float = WIDEN_LOCALS,
    progress: bool = False,
    **kwargs,
) -> AdaptiveProposal:
    """
    Rounds of population Monte Carlo with TMC draws as the samples (see the module docstring).

    Example::

        proposal = AdaptiveProposal(model, data)
        proposal = adapt(model, proposal, data, num_samples=32, rounds=4)
        [round.effective_draws for round in proposal.history]  # convergence: rising towards draws

    :param callable model: the Pyro model.
    :param AdaptiveProposal proposal: where to start (left as it is).
    :param args: the model's arguments.
    :param int num_samples: K of each TMC draw.
    :param int rounds: refits.
    :param int draws: TMC draws per round.
    :param int samples_per_draw: joint draws of particle combinations read from each TMC draw
        (with ``readout="samples"``).
    :param str readout: ``"auto"``, ``"factors"``, ``"samples"`` or ``"marginals"`` (module docstring).
    :param float widen_globals: the factor on the globals' fitted sd at each refit.
    :param float widen_locals: the factor on each local's fitted sd at each refit.
    :param bool progress: show a progress bar over the rounds.
    :param kwargs: the model's keyword arguments.
    :returns: the adapted proposal; its ``history`` holds one :class:`AdaptationRound` per round.
    :rtype: AdaptiveProposal
    """
    if readout not in READOUTS:
        raise ValueError(f"adapt(readout={readout!r}): use one of {READOUTS}.")
    elbo = TMC_ELBO(num_samples=num_samples, max_plate_nesting=proposal.max_plate_nesting)
    if readout == "auto":
        readout = "factors" if factor_elements(proposal, num_samples) <= MAX_FACTOR_ELEMENTS else "marginals"
    history = list(proposal.history)
    for _ in _rounds(rounds, progress):
        read = {"factors": _read_factors, "samples": _read_samples, "marginals": _read_marginals}[readout]
        refit, log_evidences = read(elbo, model, proposal, args, kwargs, draws, samples_per_draw)
        weights = torch.softmax(log_evidences.double(), 0)
        history.append(AdaptationRound(log_evidences, float(1 / weights.square().sum()), readout))
        proposal = refit(widen_globals, widen_locals)
        proposal.history = list(history)
    return proposal


def factor_elements(proposal: AdaptiveProposal, num_samples: int) -> int:
    """
    The largest ``"factors"`` read-out of one local site in one draw, before its lightest
    combinations are dropped: its particle combinations (its own, its parents', the globals')
    times its elements and coordinates (value, regressors, weight).
    """
    global_k = proposal.global_samples or num_samples
    total = 0
    for layout in proposal.locals:
        if layout.name in proposal.chain_links:  # a chain's step and the step before, value and regressor
            total = max(total, num_samples**2 * math.prod(layout.batch_shape) * 3)
            continue
        parents = proposal.parents[layout.name]
        combinations = num_samples ** (1 + len(parents)) * (global_k if proposal.globals else 1)
        coordinates = layout.event_size + proposal.num_regressors(layout.name) + 1
        total = max(total, combinations * math.prod(layout.batch_shape) * coordinates)
    return total


def _rounds(rounds: int, progress: bool):
    if not progress:
        return range(rounds)
    try:
        from tqdm.auto import tqdm
    except ImportError:  # no progress bar without tqdm: the rounds run all the same
        return range(rounds)
    return tqdm(range(rounds), desc="adapting the proposal")


def _draws(elbo, model, proposal, args, kwargs, draws: int):
    for _ in range(draws):
        with torch.no_grad():
            draw = elbo.draw(model, proposal, *args, **kwargs)
        yield draw  # outside no_grad: a suspended generator would keep it for the caller


def _read_factors(elbo, model, proposal, args, kwargs, draws: int, samples_per_draw: int):
    """
    Each draw's posterior over every local site's particles jointly with its parents' and the
    globals' (one backward pass for all sites), weighted by the draw's ``P_TMC``.
    """
    global_values, global_weights, local_parts, log_evidences = [], [], [], []
    for draw in _draws(elbo, model, proposal, args, kwargs, draws):
        log_estimate, globals_read, locals_read = read_factor_posteriors(draw, proposal)
        log_evidences.append(log_estimate)
        if globals_read is not None:
            global_values.append(globals_read[0])
            global_weights.append(globals_read[1])
        local_parts.append(locals_read)
    log_evidences = torch.stack(log_evidences)
    draw_weights = torch.softmax(log_evidences.double(), 0)
    flat = weights = None
    if proposal.globals:
        flat = torch.cat(global_values)
        weights = torch.cat([a * w for a, w in zip(draw_weights, global_weights)])
    local_draws = {}
    for layout in proposal.locals:
        parts = [part[layout.name] for part in local_parts]
        local_draws[layout.name] = LocalDraws(
            torch.cat([p.values for p in parts]),
            None if parts[0].regressors is None else torch.cat([p.regressors for p in parts]),
            torch.cat([a * p.weights for a, p in zip(draw_weights, parts)]),
        )

    def refit(widen_globals, widen_locals):
        return proposal.fitted_to_weighted(flat, weights, local_draws, widen_globals, widen_locals)

    return refit, log_evidences


def read_factor_posteriors(draw, proposal: AdaptiveProposal):
    """
    One TMC draw's joint posterior over each local site's particles, its parents' and the
    globals' (the auxiliary site's), by the autodiff identity with one zero *source* factor per
    site over exactly those particle dims (and the site's plates): d log P_TMC / d source is the
    posterior weight of each combination of their particles. The sources join the draw's factors
    as factors of their own, so no site's factor changes; a local whose proposal depends on its
    parents shares its factor's dims with the model's conditional already. A ``vectorized_markov``
    chain's later steps (:attr:`AdaptiveProposal.chain_links`) span their own particles and the step
    before's (the first step's dim, which the previous steps take) at each step: the pairwise
    posterior that a proposal following the chain is fitted to, regressed on the step before alone.

    :returns: ``log P_TMC``; the globals' ``(values (K, G), weights (K,))`` or ``None``; and local
        site -> :class:`~pyro_tmc.infer.adaptive_proposal.LocalDraws` over that draw's combinations
        (each element's weights summing to 1).
    """
    model_trace, guide_trace = draw.model_trace, draw.guide_trace
    aux = guide_trace.nodes.get(GLOBALS_SITE) if proposal.globals else None
    layouts = {}  # name -> (the particle sites its source spans, first the site's own)
    regressors = {}  # local name -> the sites whose values are its regressors, in order
    if aux is not None:
        layouts[GLOBALS_SITE] = [aux]
    for layout in proposal.locals:
        site = model_trace.nodes[layout.name]
        link = proposal.chain_links.get(layout.name)
        if link is not None:
            previous = model_trace.nodes[link.previous]
            # the step before's particles: on the first step's dim, or, after the first step, on the
            # previous steps' own (the first step's dims then batch dims: pyro_tmc.estimate.vectorized_markov)
            own = [previous] if own_previous_dim(previous) is not None else []
            layouts[layout.name] = [site, model_trace.nodes[link.first]] + own
            regressors[layout.name] = [previous]
            continue
        parents = [model_trace.nodes[p] for p in proposal.parents[layout.name]]
        layouts[layout.name] = [site] + parents + ([aux] if aux is not None else [])
        regressors[layout.name] = ([aux] if aux is not None else []) + parents
    sources = {name: _source(sites, model_trace) for name, sites in layouts.items()}
    with torch.enable_grad():
        factors = draw.factors()
        factors += [LogFactor(f"(source {name})", pack(*source)) for name, source in sources.items()]
        log_estimate = contract_estimate(factors, draw.scales)
        # by the unpacked sources: their dims are the values' (a size-1 dim between two others kept)
        leaves = [source for source, _ in sources.values()]
        grads = torch.autograd.grad(log_estimate, leaves, allow_unused=True)
    sources = {name: source for name, (source, _) in sources.items()}
    # a marginal weight is a sum of non-negative terms: what rounding leaves below zero is none
    weights = {
        name: torch.zeros_like(s) if g is None else g.clamp(min=0)
        for (name, s), g in zip(sources.items(), grads)
    }
    globals_read = None
    if aux is not None:
        values = aux["value"].detach()
        globals_read = (
            values.reshape(-1, values.shape[-1]).double(),
            weights[GLOBALS_SITE].reshape(-1).double(),
        )
        globals_read = (globals_read[0], globals_read[1] / globals_read[1].sum())
    locals_read = {
        layout.name: _local_draws(
            layout, proposal, layouts[layout.name][0], regressors[layout.name], weights[layout.name]
        )
        for layout in proposal.locals
    }
    return log_estimate.detach().reshape(()), globals_read, locals_read


def _source(sites: list, model_trace) -> tuple[torch.Tensor, dict[int, str]]:
    """A zero tensor over each site's own particle dim and the first site's plates, and its dims' symbols."""
    dim_to_symbol, sizes = {}, {}
    for site in sites:
        dim = own_previous_dim(site)
        if dim is None:
            dim = step_particle_dim(site)  # a chain's first step may be a point mass (a global's Delta)
        if dim is None:
            continue  # one particle (a chain's first step, with the globals at K=1): no dim to span
        value = site["value"]
        batch_ndim = value.dim() - site["fn"].event_dim
        dim_to_symbol[dim] = site["infer"]["_dim_to_symbol"][dim]
        sizes[dim] = value.shape[batch_ndim + dim] if -dim <= batch_ndim else 1
    for frame in sites[0]["cond_indep_stack"]:
        if frame.vectorized:
            dim_to_symbol[frame.dim] = model_trace.plate_to_symbol[frame.name]
            sizes[frame.dim] = frame.size
    shape = [sizes.get(d, 1) for d in range(min(sizes), 0)]
    value = sites[0]["value"]
    source = torch.zeros(shape, dtype=value.dtype, device=value.device, requires_grad=True)
    return source, dim_to_symbol


def _local_draws(layout, proposal, site, regressor_sites: list, weights: torch.Tensor) -> LocalDraws:
    """A site's values and regressors at every combination of its source's particles, with their weights."""
    length = weights.dim()
    plates = proposal.max_plate_nesting
    value = layout.unconstrained(site["value"].detach().double())
    parts = []
    for regressor in regressor_sites:
        if regressor["name"] == GLOBALS_SITE:  # the globals' unconstrained coordinates
            parts.append(regressor["value"].detach().double())
            continue
        # a chain's previous steps are not covered: they take the later steps' support
        regressor_layout = proposal.layouts.get(regressor["name"], layout)
        parts.append(regressor_layout.unconstrained(regressor["value"].detach().double()))
    shape = weights.shape
    weights = weights.double()

    def flattened(tensor):  # batch + (r,) -> (N,) + S + (r,)
        tensor = _right_aligned(tensor, length)
        tensor = tensor.expand(shape + tensor.shape[-1:])
        return tensor.reshape((-1,) + layout.batch_shape + tensor.shape[-1:])

    flat_weights = weights.reshape((-1,) + shape[length - plates :]).reshape((-1,) + layout.batch_shape)
    flat_weights = flat_weights / flat_weights.sum(0).clamp(min=1e-300)
    kept = _heaviest(flat_weights)
    regressors = torch.cat([flattened(p)[kept] for p in parts], -1) if parts else None
    return LocalDraws(flattened(value)[kept], regressors, flat_weights[kept])


def _heaviest(weights: torch.Tensor) -> torch.Tensor:
    """
    The indices of the fewest combinations (dim 0) that hold all but :data:`DROPPED_MASS` of
    the weight, averaged over the elements: a draw's posterior over K^3 combinations of a
    chain step, its parent and the globals sits on a few hundred of them.
    """
    mass = weights.reshape(len(weights), -1).mean(-1)
    order = mass.argsort(descending=True)
    cumulative = mass[order].cumsum(0)
    count = int((cumulative < (1 - DROPPED_MASS) * cumulative[-1]).sum()) + 1
    return order[: min(count, len(order))]


def _right_aligned(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """``tensor`` (batch + (r,)) with its batch made ``length`` dims long: leading 1s added or dropped."""
    batch = list(tensor.shape[:-1])
    while len(batch) > length and batch[0] == 1:
        batch.pop(0)
    return tensor.reshape([1] * (length - len(batch)) + batch + [tensor.shape[-1]])


def _read_samples(elbo, model, proposal, args, kwargs, draws: int, samples_per_draw: int):
    """
    Joint draws from each TMC draw, weighted by the draw's ``P_TMC`` shared among its samples;
    the globals from every particle with its marginal weight (as ``"marginals"`` reads them).
    """
    pieces, log_evidences, global_particles, global_log_weights = [], [], [], []
    for draw in _draws(elbo, model, proposal, args, kwargs, draws):
        marginals, log_estimate = marginals_and_log_estimate(draw)
        log_evidences.append(log_estimate.reshape(()))
        _add_globals(marginals, log_estimate, proposal, global_particles, global_log_weights)
        with torch.no_grad():
            pieces.append(draw.sample(samples_per_draw))
    log_evidences = torch.stack(log_evidences)
    samples = {name: torch.cat([piece[name] for piece in pieces]) for name in proposal.covered}
    log_weights = log_evidences.repeat_interleave(samples_per_draw) - math.log(samples_per_draw)
    global_samples, global_log_weights = _pooled_globals(proposal, global_particles, global_log_weights)

    def refit(widen_globals, widen_locals):
        return proposal.fitted(
            samples,
            log_weights,
            widen_globals,
            widen_locals,
            global_samples=global_samples,
            global_log_weights=global_log_weights,
        )

    return refit, log_evidences


def _add_globals(marginals, log_estimate, proposal, particles: list, log_weights: list) -> None:
    """Append a draw's global particles and their log weights (marginal weight times ``P_TMC``)."""
    if not proposal.globals:
        return
    log_w = marginals[proposal.globals[0].name].log_weights.reshape(-1).double()  # shared: one particle dim
    log_weights.append(log_w - torch.logsumexp(log_w, 0) + log_estimate.double().reshape(()))
    particles.append({g.name: _particles(marginals[g.name], g) for g in proposal.globals})


def _pooled_globals(proposal, particles: list, log_weights: list):
    if not proposal.globals:
        return None, None
    samples = {g.name: torch.cat([p[g.name] for p in particles]) for g in proposal.globals}
    return samples, torch.cat(log_weights)


def _read_marginals(elbo, model, proposal, args, kwargs, draws: int, samples_per_draw: int):
    """Each draw's marginals: the globals' weighted particles jointly, the locals' moments."""
    global_particles, global_log_weights, firsts, seconds, log_evidences = [], [], [], [], []
    for draw in _draws(elbo, model, proposal, args, kwargs, draws):
        marginals, log_estimate = marginals_and_log_estimate(draw)
        log_evidences.append(log_estimate.reshape(()))
        _add_globals(marginals, log_estimate, proposal, global_particles, global_log_weights)
        moments = {
            layout.name: _unconstrained_moments(marginals[layout.name], layout) for layout in proposal.locals
        }
        firsts.append({name: first for name, (first, _) in moments.items()})
        seconds.append({name: second for name, (_, second) in moments.items()})
    log_evidences = torch.stack(log_evidences)
    draw_weights = torch.softmax(log_evidences.double(), 0)
    local_moments = {}
    for layout in proposal.locals:
        first = sum(w * f[layout.name] for w, f in zip(draw_weights, firsts))
        second = sum(w * s[layout.name] for w, s in zip(draw_weights, seconds))
        local_moments[layout.name] = (first, (second - first.square()).clamp(min=0).sqrt())
    samples, log_weights = _pooled_globals(proposal, global_particles, global_log_weights)

    def refit(widen_globals, widen_locals):
        return proposal.fitted_to_moments(samples, log_weights, local_moments, widen_globals, widen_locals)

    return refit, log_evidences


def _particles(marginal, layout) -> torch.Tensor:
    """A global's particles from its marginal: ``(K,) +`` its shape."""
    samples = marginal.enumerate_support()  # (K,) + event: a global is in no plate
    return samples.reshape((-1,) + layout.batch_shape + layout.event_shape)


def _unconstrained_moments(marginal, layout) -> tuple[torch.Tensor, torch.Tensor]:
    """
    A local site's marginal first and second moments of its unconstrained values, per element:
    each ``S + (D,)`` (the marginal holds plates + (K,) + event).
    """
    values = layout.unconstrained(marginal.enumerate_support().double())  # plates + (K, D)
    weights = torch.softmax(marginal.log_weights.double(), -1).unsqueeze(-1)  # plates + (K, 1)
    first, second = (weights * values).sum(-2), (weights * values.square()).sum(-2)
    shape = layout.batch_shape + (layout.event_size,)
    return first.reshape(shape), second.reshape(shape)
