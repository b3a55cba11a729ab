"""From a (model trace, guide trace) pair drawn under ``tmc`` to named, packed log factors.

One factor per model sample site (Aitchison 2019, appendix "Typical choice of
factors for a directed graphical model"):

- observed site: ``log p(x | parents)``;
- sampled latent: ``log p(z^k | parents) - log q(z^k) - log K``, where ``q`` is
  the density that drew particle ``k``, indexed by ``k`` alone
  (:func:`pyro_tmc.poutine.proposals.proposal_log_prob`): the guide's for guide sites,
  the model's own conditional for model-only sites;
- exactly enumerated latent: ``log p(z | parents)`` (uniform proposal over the
  support, stratified: ``q = 1/K`` cancels ``1/K``).

Dims are packed (``._pyro_dims``) with the symbols Pyro's traces assign. This
module is the math; around it, :mod:`pyro_tmc.poutine.sites` says which site is what,
:mod:`pyro_tmc.estimate.batched_densities` evaluates the densities of many sites at once,
:mod:`pyro_tmc.ops.memory` sets the budget above which a factor is built in slices,
and :mod:`pyro_tmc.estimate.checks` holds the checks.
"""

import math
from collections.abc import Iterable
from typing import NamedTuple, Optional, Union

import torch

from pyro.distributions.util import scale_and_mask
from pyro.ops.packed import pack
from pyro.poutine import Trace

from pyro_tmc.estimate.batched_densities import SiteDensities, site_densities
from pyro_tmc.estimate.budget import can_chunk
from pyro_tmc.estimate.checks import log_prob_error, packing_error
from pyro_tmc.estimate.evaluation import EvaluationPlan
from pyro_tmc.estimate.scales import ScalePlan, keep_scaled_unit_plates
from pyro_tmc.estimate.vectorized_markov import reduce_markov_times, unscored_sites
from pyro_tmc.ops import log_density
from pyro_tmc.ops.chunked import ChunkedFactor, factor_dims
from pyro_tmc.ops.contraction import contract_log_factors
from pyro_tmc.ops.memory import (
    contraction_memory_error,
    itemsize,
    naming_the_site,
    site_memory_error,
)
from pyro_tmc.ops.shapes import broadcast_shape, log_prob_shape
from pyro_tmc.poutine.proposals import proposal_log_k, proposal_log_prob, stops_proposal_density
from pyro_tmc.poutine.sites import (
    guide_only_sites,
    is_point_mass,
    is_sample,
    is_summed_exactly,
    own_particle_dim,
    particle_draw,
    particle_symbol,
    proposal_site,
)


class LogFactor(NamedTuple):
    """
    A packed log factor and the site it came from (for error messages). The
    term is a packed tensor, or a :class:`~pyro_tmc.ops.chunked.ChunkedFactor`
    that computes it slice by slice under a memory budget; ``stacked`` is
    ``(stack, index)`` where the term is ``stack[index]`` of its group's stacked
    densities (:class:`~pyro_tmc.estimate.batched_densities.SiteDensities`).
    """

    site: str
    term: Union[torch.Tensor, ChunkedFactor]
    stacked: Optional[tuple[torch.Tensor, int]] = None


# -- log p and -log q of one site --------------------------------------------------


def _pack(site, tensor: torch.Tensor, dim_to_symbol) -> torch.Tensor:
    try:
        return pack(tensor, dim_to_symbol)
    except ValueError as error:
        raise packing_error(site, tensor, dim_to_symbol) from error


def _log_prob(site, value: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``log p`` of the site's value (or of ``value``), an error naming the site."""
    try:
        return log_density.log_prob(
            site["fn"], site["value"] if value is None else value, *site["args"], **site["kwargs"]
        )
    except ValueError as e:
        raise log_prob_error(site, e) from e


def _is_unit(scale) -> bool:
    return isinstance(scale, (int, float)) and scale == 1.0


def log_p(site, scale, mask, densities: Optional[SiteDensities]) -> torch.Tensor:
    """
    The site's packed ``log p``, scaled and masked: a slice of its group's stack
    where the group was evaluated at once (:mod:`pyro_tmc.estimate.batched_densities`)
    and nothing scales or masks it.
    """
    dim_to_symbol = site["infer"]["_dim_to_symbol"]
    where = None if densities is None else densities.log_p.get(id(site))
    if where is None:
        return _pack(site, scale_and_mask(_log_prob(site), scale, mask), dim_to_symbol)
    if mask is None and _is_unit(scale):
        packed = densities.packed(*where, dim_to_symbol)
        if packed is not None:
            return packed
    return _pack(site, scale_and_mask(densities.member(*where), scale, mask), dim_to_symbol)


def neg_log_q(
    q_site, scale, mask, detach: bool, densities: Optional[SiteDensities], dim_to_symbol, source=None
) -> torch.Tensor:
    """
    The packed ``-log q - log K`` of a latent's proposal ``q_site``
    (:func:`~pyro_tmc.poutine.proposals.proposal_log_k`; ``detach``: its gradient stopped,
    :func:`~pyro_tmc.poutine.proposals.stops_proposal_density`), plus ``source`` if given. A
    Delta proposal contributes its ``log_density`` (AutoNormal's log|Jacobian|).
    A masked element contributes ``log p - log q = 0`` for each particle, and the
    ``-log K`` keeps its sum over particles at 1.
    """
    if source is None and densities is not None and mask is None and _is_unit(scale):
        stacked = densities.proposal_factor(q_site, detach, dim_to_symbol)
        if stacked is not None:
            return stacked
    draw = particle_draw(q_site)
    where = None if densities is None else densities.log_q.get(id(q_site))
    if draw is None:
        log_q = _log_prob(q_site)
    elif where is not None:
        log_q = densities.member(*where)
    else:
        log_q = proposal_log_prob(q_site["fn"], q_site["value"], draw)
    log_k = proposal_log_k(q_site)
    term = scale_and_mask(-(log_q.detach() if detach else log_q), scale, mask)
    if log_k:
        term = term - log_k
    if source is not None:
        term = term + source
    return pack(term, dim_to_symbol)


def _chunked_log_prob(site, scale, max_factor_elements: int, mask) -> ChunkedFactor:
    """The site's ``log p`` as slices along its own particle dim, each within the budget."""
    value, fn = site["value"], site["fn"]
    particle_dim = own_particle_dim(site)
    batch_ndim = value.dim() - fn.event_dim
    num_particles = value.shape[batch_ndim + particle_dim]
    per_particle = math.prod(log_prob_shape(site)) // num_particles
    chunk = max(2, max_factor_elements // max(per_particle, 1))
    dim_to_symbol = site["infer"]["_dim_to_symbol"]
    symbol = particle_symbol(site)

    def compute(start: int, stop: int) -> torch.Tensor:
        part = value.narrow(batch_ndim + particle_dim, start, stop - start)
        with naming_the_site(site["name"], max_factor_elements * itemsize()):
            return pack(scale_and_mask(_log_prob(site, part), scale, mask), dim_to_symbol)

    batch = broadcast_shape(value.shape[:batch_ndim], fn.batch_shape)
    dims = "".join(dim_to_symbol[d - len(batch)] for d, size in enumerate(batch) if size > 1)
    return ChunkedFactor(site["name"], dims, symbol, num_particles, chunk, compute, math.prod(batch))


# -- the factors of a site, and of a draw ----------------------------------------------


def site_log_factors(
    name: str,
    model_trace: Trace,
    guide_trace: Trace,
    scale=1.0,
    source: Optional[torch.Tensor] = None,
    detach_guide_proposal: bool = False,
    max_factor_elements: Optional[int] = None,
    densities: Optional[SiteDensities] = None,
) -> list[torch.Tensor]:
    """
    The packed log factors of model site ``name`` (see the module docstring):
    ``log p`` and, for a sampled latent, ``-log q - log K`` as a second tensor.
    They are kept apart because ``log q`` has only the site's own particle dim
    while ``log p`` also has its parents': the contraction adds the small
    terms together before touching the large one (:func:`~pyro_tmc.ops.ring.fuse_factors`).

    An exactly summed latent keeps its own ``log p`` unmasked under
    ``poutine.mask`` (it sums to one over the support, as ``TraceEnum_ELBO``
    has it); the sites that depend on it carry the mask. A latent whose guide
    site is a Delta has no particles: its factor is ``log p - log q_delta``.

    :param scale: the tempering left on the site's factor
        (:meth:`~pyro_tmc.estimate.scales.ScalePlan.site_scale`): plate subsampling and
        poutine.scale common to a plate or the model act on the log of the sum over
        particles instead (:mod:`pyro_tmc.estimate.scales`).
    :param torch.Tensor source: an optional zero tensor added to the factor; the
        gradient of log P_TMC with respect to it is the posterior marginal of the
        site's particles (the autodiff identity of the alan library).
    :param bool detach_guide_proposal: stop the gradient through the guide's
        density (the path-gradient estimators take the guide's gradient elsewhere).
    :param int max_factor_elements: a latent site's ``log p`` larger than this is
        returned as a :class:`~pyro_tmc.ops.chunked.ChunkedFactor`, computed slice
        by slice along the site's own particle dim during the contraction.
    :param SiteDensities densities: log densities already computed for groups of
        sites (:func:`~pyro_tmc.estimate.batched_densities.site_densities`); the rest are computed here.
    """
    site = model_trace.nodes[name]
    dim_to_symbol = site["infer"]["_dim_to_symbol"]
    q_site = None if site["is_observed"] else proposal_site(name, model_trace, guide_trace)
    if q_site is site and is_point_mass(site):
        return []  # a model-only Delta proposes itself: p / q = 1
    sampled = q_site is not None and not is_summed_exactly(q_site)
    mask = site["mask"] if q_site is None or sampled else None
    if (
        max_factor_elements is not None
        and math.prod(log_prob_shape(site)) > max_factor_elements
        and can_chunk(site)
    ):
        factors = [_chunked_log_prob(site, scale, max_factor_elements, mask)]
    else:
        factors = [log_p(site, scale, mask, densities)]
    if sampled:
        detach = stops_proposal_density(q_site, q_site is site, detach_guide_proposal)
        factors.append(neg_log_q(q_site, scale, site["mask"], detach, densities, dim_to_symbol, source))
    elif source is not None:
        factors.append(pack(source, dim_to_symbol))
    return factors


def guide_site_log_factors(
    site,
    scale=1.0,
    source: Optional[torch.Tensor] = None,
    detach_guide_proposal: bool = False,
    densities: Optional[SiteDensities] = None,
) -> list[torch.Tensor]:
    """
    The packed log factor of a guide site the model lacks: ``-log q - log K``
    for an auxiliary latent, ``-log q`` for an auxiliary Delta, and minus the
    value of a guide ``pyro.factor`` (as ``Trace_ELBO`` counts it in ``log q``).

    :raises NotImplementedError: for an auxiliary site summed exactly, whose
        weight the model does not define.
    """
    if not site["is_observed"] and is_summed_exactly(site):
        raise NotImplementedError(
            f"Guide site '{site['name']}' is marked infer={{'enumerate': 'parallel'}} but the model "
            "has no site of that name, so TMC cannot sum it exactly. Drop the flag to sample it."
        )
    dim_to_symbol = site["infer"]["_dim_to_symbol"]
    detach = stops_proposal_density(site, False, detach_guide_proposal)
    return [neg_log_q(site, scale, site["mask"], detach, densities, dim_to_symbol, source)]


def compute_log_factors(
    model_trace: Trace,
    guide_trace: Trace,
    plan: EvaluationPlan,
    sources: Optional[dict[str, torch.Tensor]] = None,
    detach_guide_proposals: bool = False,
) -> list[LogFactor]:
    """
    Packed log factors of every model sample site and of every guide site the
    model lacks (:func:`guide_only_sites`).

    :param Trace model_trace: the model run under ``tmc`` against the guide's
        particles, with ``symbolize`` applied.
    :param Trace guide_trace: the guide run under ``tmc``.
    :param EvaluationPlan plan: the draw's scales, and whether factors are whole
        (densities stacked) or sliced under a budget (:mod:`pyro_tmc.estimate.evaluation`).
    :param dict sources: site name -> zero tensor added to that site's factor.
    :param bool detach_guide_proposals: see :func:`site_log_factors`.
    :raises FactorMemoryError: naming the site whose factor cannot be allocated.
    """
    sources = {} if sources is None else sources
    scales = plan.scales
    densities = site_densities(model_trace, guide_trace) if plan.stacks_densities else None
    factors = []
    unscored = unscored_sites(model_trace, guide_trace)  # a vectorized_markov chain's previous steps
    for name, site in model_trace.nodes.items():
        if not is_sample(site) or name in unscored:
            continue
        try:  # not a context manager per site: a try costs nothing where nothing fails
            terms = site_log_factors(
                name,
                model_trace,
                guide_trace,
                scales.site_scale(name),
                sources.get(name),
                detach_guide_proposals,
                plan.max_factor_elements,
                densities,
            )
        except RuntimeError as error:
            named = site_memory_error(error, name, plan.max_factor_bytes, can_chunk(site))
            if named is None:
                raise
            raise named from error
        factors += [_log_factor(name, t, site, scales.plate_scales, densities) for t in terms]
    for name in guide_only_sites(model_trace, guide_trace):
        if name in unscored:
            continue
        site = guide_trace.nodes[name]
        terms = guide_site_log_factors(
            site, scales.site_scale(name), sources.get(name), detach_guide_proposals, densities
        )
        factors += [_log_factor(name, t, site, scales.plate_scales, densities) for t in terms]
    joint = joint_samples_factor(model_trace)
    if joint is not None:
        factors.append(LogFactor("(joint samples)", joint))
    return factors


def _log_factor(name: str, term, site, plate_scales, densities: Optional[SiteDensities]) -> LogFactor:
    """A site's term as a :class:`LogFactor`, saying whether it is a slice of a stack."""
    kept = keep_scaled_unit_plates(term, site, plate_scales)
    stacked = densities.slice_of(kept) if densities is not None and kept is term else None
    return LogFactor(name, kept, stacked)


def joint_samples_factor(model_trace: Trace) -> Optional[torch.Tensor]:
    """
    With joint samples (IWAE: every latent on one shared particle dim), the
    single ``-log K`` of their average, over that dim and no plate, so that the
    dim is summed outside every plate: ``log 1/K sum_k prod_plates w_k``.
    """
    for site in model_trace.nodes.values():
        draw = particle_draw(site)
        if draw is not None and draw.joint:
            symbol = site["infer"]["_dim_to_symbol"][draw.target_dim]
            value = site["value"]
            term = torch.full(
                (draw.num_samples,),
                -math.log(draw.num_samples),
                dtype=value.dtype if value.is_floating_point() else torch.get_default_dtype(),
                device=value.device,
            )
            term._pyro_dims = symbol
            return term
    return None


def _whole(term: Union[torch.Tensor, ChunkedFactor]) -> torch.Tensor:
    return term.materialise() if isinstance(term, ChunkedFactor) else term


def _largest_factor_error(error: RuntimeError, factors: list[LogFactor], plates: Iterable[str]):
    """
    :func:`~pyro_tmc.ops.memory.contraction_memory_error` naming the largest of ``factors``, and
    each particle dim by the first site whose factor holds it (its own: parents come first).
    """
    sizes = [f.term.numel if isinstance(f.term, ChunkedFactor) else f.term.numel() for f in factors]
    largest = max(range(len(factors)), key=sizes.__getitem__)
    owners: dict[str, str] = {}
    for f in factors:
        for d in factor_dims(f.term):
            owners.setdefault(d, f.site)
    owners = {d: site for d, site in owners.items() if d not in set(plates)}
    return contraction_memory_error(error, factors[largest].site, sizes[largest] * itemsize(), owners)


def contract_estimate(factors: list[LogFactor], scales: ScalePlan) -> torch.Tensor:
    """log P_TMC: the factors contracted with the draw's plate scales, times its root scale."""
    if not factors:
        return contract_log_factors([], scales.plate_scales)
    stacks = {id(f.term): (f.term,) + f.stacked for f in factors if f.stacked is not None}
    terms, plate_scales = [f.term for f in factors], scales.plate_scales
    try:
        if scales.markov_times:  # vectorized_markov time dims: chains, contracted first
            terms = reduce_markov_times([_whole(t) for t in terms], scales.markov_times, plate_scales)
            plate_scales = {s: v for s, v in plate_scales.items() if s not in scales.markov_times}
        estimate = contract_log_factors(terms, plate_scales, stacks)
    except RuntimeError as error:  # an allocation failing is named after the largest factor
        named = _largest_factor_error(error, factors, scales.plate_scales)
        if named is None:
            raise
        raise named from error
    return estimate if scales.root == 1.0 else estimate * scales.root
