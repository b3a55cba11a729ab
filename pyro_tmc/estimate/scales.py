"""Where ``poutine.scale`` acts in the TMC estimate.

A subsampled plate of full size N seen through B elements multiplies the plate's
product of ``log(sum over particles)`` by N / B (:mod:`pyro_tmc.ops.contraction`).
``poutine.scale`` used the same way, a common scale over a whole model or over
everything inside a plate (e.g. a hand-made subsampling correction), acts the
same way: on the log of the sum over particles, not inside it. This is what
``TraceEnum_ELBO`` does with a common scale on enumerated sites.

So each site's scale ``s`` (beyond its plates' subsampling) is written as
``root * prod_{p in plates} f(p)``: ``root`` multiplies the whole log estimate
and ``f(p)`` multiplies plate p's product, like subsampling. The factors are
read off the sites from the outermost plates in: the common scale of the sites
outside every plate gives ``root``; the common remaining scale of the sites in
exactly the plates P gives ``f`` of P's innermost new plate. Sites whose scales
cannot be written so (different scales among sites in the same plates, e.g. a
KL annealing factor on the latents only) keep the remainder as a *tempering*:
their log factor is multiplied by it, so the weight carries ``p^s / q^s``, which
at K = 1 is ``Trace_ELBO``'s scaled ELBO.

:func:`symbolize` plans the scales of a draw once, as it gives the dims their
packed symbols; :func:`keep_scaled_unit_plates` keeps a scaled plate of one
element visible in a factor that packing would strip of it.
"""

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Union

import torch

from pyro.poutine import Trace

from pyro_tmc.ops.chunked import ChunkedFactor, factor_dims


@dataclass
class ScalePlan:
    """
    :param float root: multiplies the whole log estimate.
    :param dict plate_scales: plate symbol -> the factor multiplying that plate's
        product: subsampling scale times its share of ``poutine.scale``.
    :param dict residual: site name -> the scale left on the site's own log
        factor (1.0 where the site's scale is fully carried by root and plates).
    :param dict markov_times: the ``vectorized_markov`` time dims among the plates
        (:func:`pyro_tmc.estimate.vectorized_markov.markov_times`), contracted as chains.
    """

    root: float = 1.0
    plate_scales: dict[str, float] = field(default_factory=dict)
    residual: dict[str, float] = field(default_factory=dict)
    #: time dims of ``vectorized_markov`` chains, contracted as chains, not products
    #: (symbol -> :class:`pyro_tmc.estimate.vectorized_markov.MarkovTime`)
    markov_times: dict[str, object] = field(default_factory=dict)

    def site_scale(self, name: str):
        """The tempering left on site ``name``'s factor (a float, or a tensor per element)."""
        return self.residual.get(name, 1.0)

    def carried_scale(self, site):
        """
        What multiplies a site's (unscaled) factor from outside it: root, plates,
        subsampling. The gradient with respect to a source added to the factor is
        the site's marginal times this.
        """
        return site["scale"] / self.site_scale(site["name"])


def symbolize(model_trace: Trace, guide_trace: Trace) -> ScalePlan:
    """
    Give every dim of both traces a packed symbol, consistently across the two,
    and attribute every site's scale to the estimate, its plates or its factor.

    :returns: the draw's :class:`ScalePlan` (:func:`plan_scales`); the draw holds it
        (:attr:`pyro_tmc.infer.draw.TMCDraw.scales`) and passes it to whatever reads it.
    """
    guide_trace.symbolize_dims()
    model_trace.symbolize_dims(guide_trace.plate_to_symbol)
    return plan_scales(model_trace, guide_trace)


def subsample_scale(site) -> float:
    """The product of the subsampling scales (full size / subsample size) of the site's plates."""
    scale = 1.0
    for frame in site["cond_indep_stack"]:
        if frame.vectorized and frame.full_size is not None:
            scale *= float(frame.full_size) / float(frame.size)
    return scale


def _subsample_scales(traces) -> dict[str, float]:
    scales = {}
    for trace in traces:
        for site in trace.nodes.values():
            if site["type"] != "sample":
                continue
            for frame in site["cond_indep_stack"]:
                if frame.vectorized:
                    full_size = frame.full_size if frame.full_size is not None else frame.size
                    scales[trace.plate_to_symbol[frame.name]] = float(full_size) / float(frame.size)
    return scales


def _scaled_sites(model_trace: Trace, guide_trace: Trace) -> list[tuple[str, tuple[str, ...], float]]:
    """(name, plate symbols outermost first, scale beyond subsampling) of every site with a factor."""
    sites = []
    for trace, own in ((model_trace, lambda n: True), (guide_trace, lambda n: n not in model_trace.nodes)):
        for name, site in trace.nodes.items():
            if site["type"] != "sample" or not own(name):
                continue
            # Pyro's stack lists the outermost plate first (dims say nothing of nesting:
            # an automatic dim goes to the plate entered first, the outer one, as -1)
            frames = [f for f in site["cond_indep_stack"] if f.vectorized]
            plates = tuple(trace.plate_to_symbol[f.name] for f in frames)
            sites.append((name, plates, site["scale"] / subsample_scale(site)))
    return sites


def _common(values: list[float]):
    """The common value of ``values`` (to rounding), or ``None``."""
    first = values[0]
    return first if all(math.isclose(v, first, rel_tol=1e-6) for v in values) else None


def plan_scales(model_trace: Trace, guide_trace: Trace) -> ScalePlan:
    """
    Attribute every site's ``poutine.scale`` to the root and its plates (see the
    module docstring). Both traces must have been symbolised.
    """
    plan = ScalePlan(plate_scales=_subsample_scales((model_trace, guide_trace)))
    sites = []
    for name, plates, scale in _scaled_sites(model_trace, guide_trace):
        if isinstance(scale, torch.Tensor) and scale.numel() > 1:
            plan.residual[name] = scale  # a scale per element: a tempering of its factor
        else:
            sites.append((name, plates, float(scale)))
    if not sites:
        return plan
    everything = _common([s for _, _, s in sites])
    if everything is not None:  # one scale for the whole model: outside the log of the sum
        plan.root = everything
        return plan
    factor = _plate_factors(plan, sites)
    for symbol, f in factor.items():
        plan.plate_scales[symbol] = plan.plate_scales.get(symbol, 1.0) * f
    return plan


ScaledSite = tuple[str, tuple[str, ...], float]


def _plate_factors(plan: ScalePlan, sites: list[ScaledSite]) -> dict[str, float]:
    """
    Each plate's share of the sites' scales, read from the outermost plates in:
    the common scale of the sites in exactly the plates P, beyond what the root
    and P's outer plates carry, goes to P's innermost plate not yet scaled.
    Sets ``plan.root`` from the sites outside every plate, and ``plan.residual``
    for the sites whose scale is not carried whole.
    """
    groups: dict[frozenset[str], list[ScaledSite]] = defaultdict(list)
    for item in sites:
        groups[frozenset(item[1])].append(item)
    factor: dict[str, float] = {}
    for plates in sorted(groups, key=len):
        group = groups[plates]
        ordered = group[0][1]
        known = plan.root * math.prod(factor.get(p, 1.0) for p in ordered) if plates else 1.0
        common = _common([s / known for _, _, s in group])
        if not plates and common is not None:
            plan.root = common
            continue
        new = [p for p in ordered if p not in factor]
        if new and common is not None:
            factor.update({p: 1.0 for p in new[:-1]})
            factor[new[-1]] = common  # the innermost plate not yet scaled
        _record_residuals(plan, factor, group)
    return factor


def _record_residuals(plan: ScalePlan, factor: dict[str, float], group: list[ScaledSite]) -> None:
    """The scale left on each site's own factor, beyond what the root and its plates carry."""
    for name, site_plates, s in group:
        carried = plan.root * math.prod(factor.get(p, 1.0) for p in site_plates)
        remainder = s / carried
        if not math.isclose(remainder, 1.0, rel_tol=1e-6):
            plan.residual[name] = remainder


def keep_scaled_unit_plates(
    term: Union[torch.Tensor, ChunkedFactor], site, plate_scales: dict[str, float]
) -> Union[torch.Tensor, ChunkedFactor]:
    """
    The packed ``term`` with a size-1 dim restored for each of the site's plates
    that has one element and a scale other than 1 (a minibatch of one, the last
    batch of a loader, ``poutine.scale`` in a plate of size 1). Packing drops
    size-1 dims, but the plate's scale multiplies the log of the sum over the
    particles inside it, so the contraction must still see where the plate is.
    """
    dim_to_symbol = site["infer"]["_dim_to_symbol"]
    missing = []
    for frame in site["cond_indep_stack"]:
        if frame.vectorized and frame.size == 1:
            symbol = dim_to_symbol[frame.dim]
            if plate_scales.get(symbol, 1.0) != 1.0 and symbol not in factor_dims(term):
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


def _with_unit_dims(term: torch.Tensor, symbols: list[str]) -> torch.Tensor:
    """A packed ``term`` with leading size-1 dims named ``symbols``."""
    widened = term.reshape((1,) * len(symbols) + term.shape)
    widened._pyro_dims = "".join(symbols) + term._pyro_dims
    return widened
