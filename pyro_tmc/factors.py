"""From a (model trace, guide trace) pair drawn under ``tmc`` to named, packed log factors.

One factor per model sample site (Aitchison 2019, appendix "Typical choice of
factors for a directed graphical model"):

- observed site: ``log p(x | parents)``;
- sampled latent: ``log p(z^k | parents) - log q(z^k) - log K``, where ``q`` is
  the density that drew particle ``k``, indexed by ``k`` alone
  (:func:`pyro_tmc.proposals.proposal_log_prob`): the guide's for guide sites,
  the model's own conditional for model-only sites;
- exactly enumerated latent: ``log p(z | parents)`` (uniform proposal over the
  support, stratified: ``q = 1/K`` cancels ``1/K``).

Dims are packed (``._pyro_dims``) with the symbols Pyro's traces assign.
"""

import dataclasses
import math
from types import SimpleNamespace
from typing import Dict, List, NamedTuple, Optional, Union

import torch

from pyro.distributions.util import scale_and_mask
from pyro.ops.packed import pack
from pyro.poutine import Trace
from pyro.util import check_site_shape

from . import log_density, memory
from .batched_densities import stacked_log_probs
from .contraction import ChunkedFactor, contract_log_factors
from .memory import (
    AUTO,
    auto_budget_bytes,
    available_bytes,
    factor_memory_error,
    naming_the_largest_factor,
    naming_the_site,
)
from .proposals import proposal_log_prob
from .scales import ScalePlan, plan_scales
from .shapes import broadcast_shape


class LogFactor(NamedTuple):
    """
    A packed log factor and the site it came from (for error messages). The
    term is a packed tensor, or a :class:`~pyro_tmc.contraction.ChunkedFactor`
    that computes it slice by slice under a memory budget.
    """

    site: str
    term: Union[torch.Tensor, ChunkedFactor]

    @property
    def tensor(self) -> Union[torch.Tensor, ChunkedFactor]:
        """The same as :attr:`term` (the name older code used)."""
        return self.term


def symbolize(model_trace: Trace, guide_trace: Trace) -> None:
    """
    Give every dim of both traces a packed symbol, consistently across the two,
    and attribute every site's scale to the estimate, its plates or its factor
    (:func:`pyro_tmc.scales.plan_scales`, kept as ``model_trace.tmc_scales``).
    """
    guide_trace.symbolize_dims()
    model_trace.symbolize_dims(guide_trace.plate_to_symbol)
    model_trace.tmc_scales = plan_scales(model_trace, guide_trace)


def scale_plan(model_trace: Trace) -> ScalePlan:
    """The trace's :class:`~pyro_tmc.scales.ScalePlan` (see :func:`symbolize`)."""
    return model_trace.tmc_scales


def plate_scales(model_trace: Trace) -> Dict[str, float]:
    """Plate symbol -> the factor multiplying that plate's product (subsampling and poutine.scale)."""
    return scale_plan(model_trace).plate_scales


def _pack(site, tensor: torch.Tensor, dim_to_symbol) -> torch.Tensor:
    """Pack a site's log factor; a shape that fits neither its plates nor its particle dims names the site."""
    try:
        return pack(tensor, dim_to_symbol)
    except ValueError as error:
        raise ValueError(
            f"The log density of site '{site['name']}' has shape {tuple(tensor.shape)}, which does not fit "
            f"its plates and particle dims (dims {sorted(dim_to_symbol)}): a value was probably "
            "broadcast so that particles landed on a plate dim or the reverse. See 'Writing models "
            "for TMC: broadcasting and Vindex' in the README."
        ) from error


def log_prob_error(site, error: ValueError) -> ValueError:
    """A distribution's complaint about a value, naming the site it came from."""
    return ValueError(f"Error while computing log_prob at site '{site['name']}': {error}")


def _log_prob(site, value=None, densities: Optional["SiteDensities"] = None) -> torch.Tensor:
    if value is None and densities is not None and id(site) in densities.log_p:
        return densities.member(*densities.log_p[id(site)])
    fn = site["fn"]
    try:
        return log_density.log_prob(
            fn, site["value"] if value is None else value, *site["args"], **site["kwargs"]
        )
    except ValueError as e:
        raise log_prob_error(site, e) from e


def _log_prob_numel(site) -> int:
    """How many elements the site's log density will have (its broadcast batch shape)."""
    return math.prod(_batch_shape(site))


def _can_chunk(site) -> bool:
    """Whether a site's ``log p`` can be built in slices: a latent with more than 2 particles."""
    return (
        not site["is_observed"]
        and "_enumerate_dim" in site["infer"]
        and particle_shape(site)[site["infer"]["_enumerate_dim"]] > 2
    )


def _itemsize() -> int:
    """Bytes per element of a log factor (the default dtype's)."""
    return torch.finfo(torch.get_default_dtype()).bits // 8


def factor_budget(model_trace: Trace, max_factor_elements) -> Optional[int]:
    """
    The budget, in elements, for each log factor of this draw: ``max_factor_elements``
    as given, or under ``"auto"`` (:data:`pyro_tmc.memory.AUTO`) a share of the memory
    available on the largest factor's device (:func:`pyro_tmc.memory.auto_budget_bytes`),
    read only where that factor is large; ``None`` builds every factor whole.

    :raises FactorMemoryError: under ``"auto"``, where a factor's smallest slice (2
        particles of its site, or the whole factor if it cannot be sliced) is larger
        than the memory available.
    """
    if max_factor_elements != AUTO:
        return max_factor_elements
    sites = [site for site in model_trace.nodes.values() if site["type"] == "sample"]
    itemsize = _itemsize()
    # a bound first, of C calls only (value and batch both whole): a small model stops here
    bound = max((site["value"].numel() * site["fn"].batch_shape.numel() for site in sites), default=0)
    if bound * itemsize <= memory.AUTO_MIN_BYTES:
        return None
    sizes = [_log_prob_numel(site) for site in sites]  # shape arithmetic only
    largest = max(range(len(sites)), key=sizes.__getitem__)
    device = sites[largest]["value"].device
    budget = auto_budget_bytes(sizes[largest] * itemsize, device)
    if budget is None:
        return None
    available = available_bytes(device)
    for site, numel in zip(sites, sizes):
        if numel * itemsize > budget:
            smallest = (
                2 * numel // particle_shape(site)[site["infer"]["_enumerate_dim"]]
                if _can_chunk(site)
                else numel
            )
            if smallest * itemsize > available:
                raise factor_memory_error(
                    site["name"], smallest * itemsize, AUTO, available, smallest_slice=True
                )
    return budget // itemsize


def _chunked_log_prob(site, extra_scale, max_factor_elements: int, mask) -> ChunkedFactor:
    """The site's ``log p`` as slices along its own particle dim, each within the budget."""
    value, fn = site["value"], site["fn"]
    particle_dim = site["infer"]["_enumerate_dim"]
    batch_ndim = value.dim() - fn.event_dim
    num_particles = value.shape[batch_ndim + particle_dim]
    per_particle = _log_prob_numel(site) // num_particles
    chunk = max(2, max_factor_elements // max(per_particle, 1))
    dim_to_symbol = site["infer"]["_dim_to_symbol"]
    symbol = dim_to_symbol[particle_dim]

    def compute(start: int, stop: int) -> torch.Tensor:
        part = value.narrow(batch_ndim + particle_dim, start, stop - start)
        with naming_the_site(site["name"], max_factor_elements * _itemsize()):
            return pack(scale_and_mask(_log_prob(site, part), extra_scale, mask), dim_to_symbol)

    batch = broadcast_shape(value.shape[:batch_ndim], fn.batch_shape)
    dims = "".join(dim_to_symbol[d - len(batch)] for d, size in enumerate(batch) if size > 1)
    return ChunkedFactor(site["name"], dims, symbol, num_particles, chunk, compute, math.prod(batch))


def proposal_site(name: str, model_trace: Trace, guide_trace: Trace):
    """The site whose distribution drew the particles of latent ``name``."""
    if name in guide_trace.nodes and guide_trace.nodes[name]["type"] == "sample":
        return guide_trace.nodes[name]
    return model_trace.nodes[name]


def is_summed_exactly(site) -> bool:
    """Whether a latent site was enumerated over its support (no proposal density)."""
    return "_enumerate_dim" in site["infer"] and "_tmc_draw" not in site["infer"]


def is_point_mass_site(site) -> bool:
    """Whether a latent site has no particle dim of its own (a Delta, or no torch distribution)."""
    return "_enumerate_dim" not in site["infer"]


def guide_only_sites(model_trace: Trace, guide_trace: Trace) -> List[str]:
    """
    Guide sample sites the model lacks: auxiliary latents (AutoNormal's
    ``<name>_unconstrained``, AutoContinuous's ``_Auto..._latent``) and the
    guide's ``pyro.factor`` statements. Both belong to ``q`` and so to the weight.
    """
    return [
        name
        for name, site in guide_trace.nodes.items()
        if site["type"] == "sample" and name not in model_trace.nodes
    ]


def latent_site(name: str, model_trace: Trace, guide_trace: Trace):
    """The model's site ``name``, or the guide's if only the guide has it (an auxiliary latent)."""
    if name in model_trace.nodes:
        return model_trace.nodes[name]
    return guide_trace.nodes[name]


def _proposal_term(q_site, extra_scale, mask, detach: bool, densities: Optional["SiteDensities"] = None):
    """
    ``-log q`` of a latent's proposal, and ``-log K`` for a sampled one. A
    Delta proposal contributes its ``log_density`` (AutoNormal's log|Jacobian|).
    """
    draw = q_site["infer"].get("_tmc_draw")
    if draw is None:
        log_q = _log_prob(q_site)
    elif densities is not None and id(q_site) in densities.log_q:
        log_q = densities.member(*densities.log_q[id(q_site)])
    else:
        log_q = proposal_log_prob(q_site["fn"], q_site["value"], draw)
    if not q_site["is_observed"] and (not q_site["fn"].has_rsample or detach):
        # DiCE: p/q with q stopped has the score-function gradient of an
        # importance weight (the score of q cancels against -log q).
        log_q = log_q.detach()
    # A masked element contributes log p - log q = 0 for each particle, and the
    # -log K keeps its sum over particles at 1.
    term = scale_and_mask(-log_q, extra_scale, mask)
    if draw is not None and not draw.joint:
        term = term - math.log(draw.num_samples)
    return term


def site_log_factors(
    name: str,
    model_trace: Trace,
    guide_trace: Trace,
    source: Optional[torch.Tensor] = None,
    detach_guide_proposal: bool = False,
    max_factor_elements: Optional[int] = None,
    densities: Optional["SiteDensities"] = None,
) -> List[torch.Tensor]:
    """
    The packed log factors of model site ``name`` (see the module docstring):
    ``log p`` and, for a sampled latent, ``-log q - log K`` as a second tensor.
    They are kept apart because ``log q`` has only the site's own particle dim
    while ``log p`` also has its parents': the contraction adds the small
    terms together before touching the large one (:func:`~pyro_tmc.contraction.fuse_factors`).

    An exactly summed latent keeps its own ``log p`` unmasked under
    ``poutine.mask`` (it sums to one over the support, as ``TraceEnum_ELBO``
    has it); the sites that depend on it carry the mask. A latent whose guide
    site is a Delta has no particles: its factor is ``log p - log q_delta``.

    :param torch.Tensor source: an optional zero tensor added to the factor; the
        gradient of log P_TMC with respect to it is the posterior marginal of the
        site's particles (the autodiff identity of the alan library).
    :param bool detach_guide_proposal: stop the gradient through the guide's
        density (the path-gradient estimators take the guide's gradient elsewhere).
    :param int max_factor_elements: a latent site's ``log p`` larger than this is
        returned as a :class:`~pyro_tmc.contraction.ChunkedFactor`, computed slice
        by slice along the site's own particle dim during the contraction.
    :param SiteDensities densities: log densities already computed for groups of
        sites (:func:`site_densities`); the rest are computed here.
    """
    site = model_trace.nodes[name]
    dim_to_symbol = site["infer"]["_dim_to_symbol"]
    # Plate subsampling and poutine.scale common to a plate or the model act on the
    # log of the sum over particles (scales.py); what is left weights this factor.
    extra_scale = scale_plan(model_trace).site_scale(name)
    q_site = None if site["is_observed"] else proposal_site(name, model_trace, guide_trace)
    if q_site is site and is_point_mass_site(site):
        return []  # a model-only Delta proposes itself: p / q = 1
    mask = None if q_site is not None and is_summed_exactly(q_site) else site["mask"]
    if max_factor_elements is not None and _log_prob_numel(site) > max_factor_elements and _can_chunk(site):
        factors = [_chunked_log_prob(site, extra_scale, max_factor_elements, mask)]
    else:
        packed = _stacked_log_p_factor(site, extra_scale, mask, densities, dim_to_symbol)
        if packed is None:
            log_p = _log_prob(site, densities=densities)
            packed = _pack(site, scale_and_mask(log_p, extra_scale, mask), dim_to_symbol)
        factors = [packed]
    proposal_term = 0.0
    if q_site is not None and not is_summed_exactly(q_site):
        detach = detach_guide_proposal and q_site is not site
        stacked = None
        if source is None:
            stacked = _stacked_proposal_factor(
                q_site, extra_scale, site["mask"], detach, densities, dim_to_symbol
            )
        if stacked is not None:
            return factors + [stacked]
        proposal_term = _proposal_term(q_site, extra_scale, site["mask"], detach, densities)
    if source is not None:
        proposal_term = proposal_term + source
    if isinstance(proposal_term, torch.Tensor):
        factors.append(pack(proposal_term, dim_to_symbol))
    return factors


def guide_site_log_factors(
    site,
    extra_scale=1.0,
    source: Optional[torch.Tensor] = None,
    detach_guide_proposal: bool = False,
    densities: Optional["SiteDensities"] = None,
) -> List[torch.Tensor]:
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
    if source is None:
        stacked = _stacked_proposal_factor(
            site, extra_scale, site["mask"], detach_guide_proposal, densities, site["infer"]["_dim_to_symbol"]
        )
        if stacked is not None:
            return [stacked]
    term = _proposal_term(site, extra_scale, site["mask"], detach_guide_proposal, densities)
    if source is not None:
        term = term + source
    return [pack(term, site["infer"]["_dim_to_symbol"])]


def compute_log_factors(
    model_trace: Trace,
    guide_trace: Trace,
    sources: Optional[Dict[str, torch.Tensor]] = None,
    detach_guide_proposals: bool = False,
    max_factor_elements: Optional[int] = None,
) -> List[LogFactor]:
    """
    Packed log factors of every model sample site and of every guide site the
    model lacks (:func:`guide_only_sites`).

    :param Trace model_trace: the model run under ``tmc`` against the guide's
        particles, with ``symbolize`` applied.
    :param Trace guide_trace: the guide run under ``tmc``.
    :param dict sources: site name -> zero tensor added to that site's factor.
    :param bool detach_guide_proposals: see :func:`site_log_factors`.
    :param max_factor_elements: see :func:`site_log_factors`, or ``"auto"``
        (:func:`factor_budget`).
    :raises FactorMemoryError: naming the site whose factor cannot be allocated.
    """
    sources = {} if sources is None else sources
    setting = (
        max_factor_elements if max_factor_elements in (None, AUTO) else max_factor_elements * _itemsize()
    )
    max_factor_elements = factor_budget(model_trace, max_factor_elements)
    # a memory budget bounds each factor: stacking a group would exceed it
    densities = site_densities(model_trace, guide_trace) if max_factor_elements is None else None
    factors = []
    for name, site in model_trace.nodes.items():
        if site["type"] != "sample":
            continue
        with naming_the_site(name, setting):
            terms = site_log_factors(
                name,
                model_trace,
                guide_trace,
                sources.get(name),
                detach_guide_proposals,
                max_factor_elements,
                densities,
            )
        for tensor in terms:
            factors.append(LogFactor(name, _keep_scaled_unit_plates(tensor, site, model_trace)))
    for name in guide_only_sites(model_trace, guide_trace):
        site = guide_trace.nodes[name]
        extra_scale = scale_plan(model_trace).site_scale(name)
        for tensor in guide_site_log_factors(
            site, extra_scale, sources.get(name), detach_guide_proposals, densities
        ):
            factors.append(LogFactor(name, _keep_scaled_unit_plates(tensor, site, model_trace)))
    joint = joint_samples_factor(model_trace)
    if joint is not None:
        factors.append(LogFactor("(joint samples)", joint))
    return factors


def _keep_scaled_unit_plates(
    term: Union[torch.Tensor, ChunkedFactor], site, model_trace: Trace
) -> Union[torch.Tensor, ChunkedFactor]:
    """
    The packed ``term`` with a size-1 dim restored for each of the site's plates
    that has one element and a scale other than 1 (a minibatch of one, the last
    batch of a loader, ``poutine.scale`` in a plate of size 1). Packing drops
    size-1 dims, but the plate's scale multiplies the log of the sum over the
    particles inside it, so the contraction must still see where the plate is.
    """
    plate_scales = scale_plan(model_trace).plate_scales
    dim_to_symbol = site["infer"]["_dim_to_symbol"]
    missing = []
    for frame in site["cond_indep_stack"]:
        if frame.vectorized and frame.size == 1:
            symbol = dim_to_symbol[frame.dim]
            if plate_scales.get(symbol, 1.0) != 1.0 and symbol not in _dims_of(term):
                missing.append(symbol)
    if not missing:
        return term
    if isinstance(term, ChunkedFactor):
        compute = term.compute
        return dataclasses.replace(
            term,
            dims="".join(missing) + term.dims,
            compute=lambda a, b: _with_unit_dims(compute(a, b), missing),
        )
    return _with_unit_dims(term, missing)


def _dims_of(term: Union[torch.Tensor, ChunkedFactor]) -> str:
    return term.dims if isinstance(term, ChunkedFactor) else term._pyro_dims


def _with_unit_dims(term: torch.Tensor, symbols: List[str]) -> torch.Tensor:
    """A packed ``term`` with leading size-1 dims named ``symbols``."""
    widened = term.reshape((1,) * len(symbols) + term.shape)
    widened._pyro_dims = "".join(symbols) + term._pyro_dims
    return widened


class SiteDensities:
    """
    Log densities computed for groups of sites at once, kept as ``(stack, index)``
    by ``id`` of the site dict (:func:`~pyro_tmc.batched_densities.stacked_log_probs`),
    and their packing, also done once per group: each site's packed factor is then
    a slice of one stacked tensor and says so
    (:func:`pyro_tmc.batched_densities.stacked_slice`), which lets the
    contraction take a whole chain's links in one operation.
    """

    def __init__(self, log_p: Dict[int, tuple], log_q: Dict[int, tuple]) -> None:
        self.log_p = log_p
        self.log_q = log_q
        self._members: Dict[int, tuple] = {}  # id(stack) -> (its members, stack)
        # id(stack) -> (stack less its size-1 dims, its members, kept dims, stack)
        self._squeezed: Dict[int, tuple] = {}
        self._terms: Dict[tuple, tuple] = {}  # (id(log q stack), detach, log K) -> (-log q - log K, stack)

    def member(self, stack: torch.Tensor, index: int) -> torch.Tensor:
        """
        ``stack[index]``, by one unbind for all members of the stack: its backward
        stacks their gradients once, where a select per member would write a whole
        stack-sized gradient for each. (Holding the stack keeps its id unique.)
        """
        if id(stack) not in self._members:
            self._members[id(stack)] = (stack.unbind(0), stack)
        return self._members[id(stack)][0][index]

    def packed(
        self, stack: torch.Tensor, index: int, dim_to_symbol: Dict[int, str]
    ) -> Optional[torch.Tensor]:
        """
        ``pack(stack[index], dim_to_symbol)``, as a slice of the stack with its size-1
        dims squeezed once for all its members; ``None`` where a dim has no symbol
        (the site's own packing then raises the error that names it).
        """
        if id(stack) not in self._squeezed:
            kept = [d for d in range(1, stack.dim()) if stack.shape[d] > 1]
            squeezed = stack.reshape((stack.shape[0],) + tuple(stack.shape[d] for d in kept))
            self._squeezed[id(stack)] = (squeezed, kept, stack)
        squeezed, kept, _ = self._squeezed[id(stack)]
        rank = stack.dim() - 1  # a member's rank
        try:
            dims = "".join(dim_to_symbol[d - 1 - rank] for d in kept)
        except KeyError:
            return None
        packed = self.member(squeezed, index)
        packed._pyro_dims = dims
        packed._tmc_stack = (squeezed, index)
        return packed

    def proposal_terms(self, where: tuple, detach: bool, log_k: float) -> tuple:
        """``(-log q - log K, index)`` for the ``log q`` at ``where = (stack, index)``, once per stack."""
        stack, index = where
        key = (id(stack), detach, log_k)
        if key not in self._terms:
            base = stack.detach() if detach else stack
            self._terms[key] = (-base - log_k if log_k else -base, stack)
        return self._terms[key][0], index


def _is_unit(scale) -> bool:
    return isinstance(scale, (int, float)) and scale == 1.0


def _stacked_log_p_factor(site, extra_scale, mask, densities, dim_to_symbol) -> Optional[torch.Tensor]:
    """The site's packed ``log p`` as a slice of its group's stack, where nothing scales or masks it."""
    where = None if densities is None else densities.log_p.get(id(site))
    if where is None or mask is not None or not _is_unit(extra_scale):
        return None
    return densities.packed(*where, dim_to_symbol)


def _stacked_proposal_factor(q_site, extra_scale, mask, detach, densities, dim_to_symbol):
    """The packed ``-log q - log K`` as a slice of one stacked tensor for the group, where that is exact."""
    draw = q_site["infer"].get("_tmc_draw")
    if densities is None or draw is None or id(q_site) not in densities.log_q:
        return None
    if mask is not None or not _is_unit(extra_scale):
        return None
    detach = not q_site["is_observed"] and (not q_site["fn"].has_rsample or detach)  # as _proposal_term
    log_k = 0.0 if draw.joint else math.log(draw.num_samples)
    terms = densities.proposal_terms(densities.log_q[id(q_site)], detach, log_k)
    return densities.packed(*terms, dim_to_symbol)


def site_densities(model_trace: Trace, guide_trace: Trace) -> SiteDensities:
    """
    The model's ``log p`` of every sample site, and the ``log q`` of every proposal
    that drew its particles on its own (no upstream particle dims), for the sites
    that :func:`pyro_tmc.batched_densities.stacked_log_probs` can evaluate in groups
    (the links of a ``pyro.markov`` chain); the others are left out.
    """
    p_sites = [
        site
        for site in model_trace.nodes.values()
        if site["type"] == "sample" and not site["args"] and not site["kwargs"]
    ]
    proposals = [
        proposal_site(site["name"], model_trace, guide_trace) for site in p_sites if not site["is_observed"]
    ]
    proposals += [guide_trace.nodes[name] for name in guide_only_sites(model_trace, guide_trace)]
    q_sites = []
    for site in proposals:
        draw = site["infer"].get("_tmc_draw")
        if draw is not None and not draw.parent_dims:
            q_sites.append(site)
    # apart: a small model has too few of either to group, and then costs nothing here
    log_p = stacked_log_probs([(site["fn"], site["value"]) for site in p_sites])
    log_q = stacked_log_probs([(site["fn"], site["value"]) for site in q_sites])
    return SiteDensities(
        {id(s): lp for s, lp in zip(p_sites, log_p) if lp is not None},
        {id(s): lp for s, lp in zip(q_sites, log_q) if lp is not None},
    )


def joint_samples_factor(model_trace: Trace) -> Optional[torch.Tensor]:
    """
    With joint samples (IWAE: every latent on one shared particle dim), the
    single ``-log K`` of their average, over that dim and no plate, so that the
    dim is summed outside every plate: ``log 1/K sum_k prod_plates w_k``.
    """
    for site in model_trace.nodes.values():
        draw = site["infer"].get("_tmc_draw") if site["type"] == "sample" else None
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


def particle_shape(site) -> torch.Size:
    """
    The shape of a latent site's particle dim and plates: its value without the
    event dims, broadcast over its plates (enumerated values are not expanded).
    """
    value = site["value"]
    shape = value.shape[: value.dim() - site["fn"].event_dim]
    for frame in site["cond_indep_stack"]:
        if frame.vectorized:
            plate = [1] * -frame.dim
            plate[frame.dim] = frame.size
            shape = broadcast_shape(shape, plate)
    return shape


def contract_estimate(factors: List["LogFactor"], model_trace: Trace) -> torch.Tensor:
    """log P_TMC: the factors contracted with the trace's plate scales, times its root scale."""
    plan = scale_plan(model_trace)
    if not factors:
        return contract_log_factors([], plan.plate_scales)
    # an allocation failing in the contraction is named after the largest factor
    sizes = [f.term.numel if isinstance(f.term, ChunkedFactor) else f.term.numel() for f in factors]
    largest = max(range(len(factors)), key=sizes.__getitem__)
    with naming_the_largest_factor(factors[largest].site, sizes[largest] * _itemsize()):
        estimate = contract_log_factors([f.term for f in factors], plan.plate_scales)
    return estimate if plan.root == 1.0 else estimate * plan.root


def carried_scale(site, model_trace: Trace) -> float:
    """
    What multiplies the site's factor from outside it (subsampling, and the
    poutine.scale carried by the estimate and its plates): the gradient with
    respect to a source added to the factor is the marginal times this.
    """
    return scale_plan(model_trace).carried_scale(site)


def check_site_shapes(model_trace: Trace, guide_trace: Trace, max_plate_nesting) -> None:
    """
    Pyro's plate-shape and enumeration-dim checks (:func:`pyro.util.check_site_shape`)
    on every sample site, as ``TraceEnum_ELBO`` runs them under validation.
    """
    for trace in (model_trace, guide_trace):
        for site in trace.nodes.values():
            if site["type"] != "sample":
                continue
            log_prob = SimpleNamespace(shape=_batch_shape(site))  # all the check reads of it
            infer = site["infer"]
            draw = infer.get("_tmc_draw")
            if draw is not None and draw.joint:  # shares its parents' dim by design
                infer = {k: v for k, v in infer.items() if k != "_enumerate_dim"}
            check_site_shape({**site, "infer": infer, "log_prob": log_prob}, max_plate_nesting)


def check_plate_dependencies(model_trace: Trace, guide_trace: Trace) -> None:
    """
    :raises ValueError: naming both sites, where a site depends on the
        particles of a latent inside a plate that the site is not in. Its factor
        would couple particle k of every plate element, which the contraction
        (sums inside plates, products across them) cannot express; as in
        ``TraceEnum_ELBO``, a variable outside a plate must never depend on one inside it.
    """
    owners = {}  # particle symbol -> (site name, its plate symbols)
    traces = (guide_trace, model_trace)
    for trace in traces:
        for name, site in trace.nodes.items():
            draw = site["infer"].get("_tmc_draw") if site["type"] == "sample" else None
            if draw is not None and draw.joint:
                continue  # the shared dim of joint samples is summed outside every plate
            if site["type"] == "sample" and "_enumerate_dim" in site["infer"]:
                plates = _plate_symbols(site, trace)
                if plates:  # a latent outside every plate can be depended on by anything
                    symbol = site["infer"]["_dim_to_symbol"][site["infer"]["_enumerate_dim"]]
                    owners[symbol] = (name, plates)
    if not owners:
        return
    for trace in traces:
        for name, site in trace.nodes.items():
            if site["type"] != "sample":
                continue
            plates = batch = None
            for dim, symbol in site["infer"].get("_dim_to_symbol", {}).items():
                owner = owners.get(symbol)
                if owner is None:
                    continue
                if batch is None:
                    plates, batch = _plate_symbols(site, trace), _batch_shape(site)
                if -dim > len(batch) or batch[dim] == 1:
                    continue  # visible to the site, but its factor does not vary along it
                if not owner[1] <= plates:
                    raise ValueError(
                        f"Site '{name}' depends on latent '{owner[0]}', which is inside a plate that "
                        f"'{name}' is not in. A variable outside a plate must never depend on one "
                        "inside it (as in TraceEnum_ELBO): move the site into the plate, or the latent "
                        "out of it "
                        "(e.g. sample a plate of globals as one vector with .to_event(1))."
                    )


def _batch_shape(site) -> torch.Size:
    """The shape of the site's log density: its value's batch shape broadcast with its distribution's."""
    value = site["value"]
    return broadcast_shape(value.shape[: value.dim() - site["fn"].event_dim], site["fn"].batch_shape)


def _plate_symbols(site, trace: Trace) -> frozenset:
    return frozenset(trace.plate_to_symbol[f.name] for f in site["cond_indep_stack"] if f.vectorized)


def _non_finite(term: Union[torch.Tensor, ChunkedFactor]) -> tuple:
    """
    Whether a factor holds a NaN, holds +inf, and is -inf everywhere; a chunked
    factor is read slice by slice (whole, it may not fit in memory).
    """
    pieces = [term] if isinstance(term, torch.Tensor) else (term.compute(a, b) for a, b in term.ranges())
    has_nan = has_posinf = False
    all_neginf, numel = True, 0
    with torch.no_grad():
        for piece in pieces:
            has_nan = has_nan or bool(torch.isnan(piece).any())
            has_posinf = has_posinf or bool(torch.isposinf(piece).any())
            all_neginf = all_neginf and bool((piece == -math.inf).all())
            numel += piece.numel()
    return has_nan, has_posinf, all_neginf and numel > 0


def check_finite(
    factors: List[LogFactor], estimate: torch.Tensor, model_trace: Optional[Trace] = None
) -> None:
    """
    If the estimate is not finite, find the site responsible.

    :raises ValueError: naming the first site whose factor holds a NaN or
        +inf, or is -inf everywhere.
    """
    if torch.isfinite(estimate).all():
        return
    for site, tensor in factors:
        has_nan, has_posinf, all_neginf = _non_finite(tensor)
        if has_nan:
            node = model_trace.nodes.get(site) if model_trace is not None else None
            if node is not None and node["is_observed"] and torch.isnan(node["value"]).any():
                raise ValueError(
                    f"The observed value of site '{site}' contains NaN. Remove the missing entries, or "
                    "mask them out with poutine.mask (or obs_mask) and give them any finite placeholder."
                )
            raise ValueError(
                f"TMC factor of site '{site}' contains NaN: check its distribution's parameters."
            )
        if has_posinf:
            raise ValueError(f"TMC factor of site '{site}' contains +inf: check its log density.")
        if all_neginf:
            raise ValueError(
                f"TMC factor of site '{site}' is -inf for every particle: its value has zero "
                "density under the model or the proposal (e.g. a value outside the support)."
            )
    raise ValueError(
        f"The TMC estimate is {estimate.item()}, though every factor is finite somewhere: "
        "no particle combination has positive weight. Try more particles or a better guide."
    )
