"""The vocabulary of sites: which sample sites of a TMC draw are what, each under one name.

A draw is a model trace and a guide trace, both run under ``tmc``.

- a *latent* is an unobserved sample site (:func:`is_latent`, :func:`latent_names`);
- before the draw, a latent is *marked for an exact sum* by its ``infer`` flags
  (:func:`is_marked_for_exact_sum`); once drawn it is *summed exactly*: enumerated
  over its support rather than sampled (:func:`is_summed_exactly`);
- a *point mass* has no particle dim of its own (:func:`is_point_mass`): its
  distribution is a Delta (:func:`is_delta`), so its K particles would all be
  equal; :func:`is_point_mass_latent` leaves out a plate's subsample site;
- a site with a particle dim has its *particle symbol*, the packed name of that
  dim (:func:`particle_symbol`); :func:`plate_symbols` names its plates;
- the *proposal site* of a latent is the site whose distribution drew its
  particles: the guide's, or the model's own for a model-only latent
  (:func:`proposal_site`);
- a *guide-only* site is one the model lacks: an auxiliary latent (AutoNormal's
  ``<name>_unconstrained``) or a guide ``pyro.factor`` (:func:`guide_only_sites`);
  :func:`model_or_guide_site` finds a site in either trace.

The posterior of a site is read through a *source* (:func:`marginal_sources`): a
zero tensor over its particles added to its factor, whose gradient is the site's
posterior marginal times what scales its factor from outside (:func:`source_weights`;
the autodiff identity of the alan library).
"""

from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch.distributions import Independent

from pyro.distributions import Delta
from pyro.distributions.torch_distribution import ExpandedDistribution, MaskedDistribution
from pyro.poutine import Trace
from pyro.poutine.util import site_is_subsample

from .shapes import particle_shape


def is_sample(site) -> bool:
    """Whether a trace node is a sample site."""
    return site["type"] == "sample"


def is_latent(site) -> bool:
    """Whether a trace node is an unobserved sample site."""
    return site["type"] == "sample" and not site["is_observed"]


def latent_names(trace: Trace) -> List[str]:
    """Names of the latents (unobserved sample sites) of a trace, in the order they were drawn."""
    return [name for name, site in trace.nodes.items() if is_latent(site)]


def is_marked_for_exact_sum(msg) -> bool:
    """
    Whether a latent site (a message, before the draw) is to be summed exactly over
    its support rather than sampled: marked ``infer={"enumerate": "parallel"}`` (or
    ``"sequential"``, summed in parallel: the same value) without ``num_samples``,
    with a distribution that has enumerable support.
    """
    infer = msg["infer"]
    return (
        infer.get("enumerate") in ("parallel", "sequential")  # sequential: summed in parallel
        and "num_samples" not in infer
        and msg["fn"].has_enumerate_support
    )


def is_summed_exactly(site) -> bool:
    """Whether a drawn latent site was enumerated over its support (no proposal density)."""
    return "_enumerate_dim" in site["infer"] and "_tmc_draw" not in site["infer"]


def is_delta(fn) -> bool:
    """
    Whether ``fn`` is a :class:`~pyro.distributions.Delta` (possibly made
    independent, masked or expanded): its K particles would all be equal, so it
    gets no particle dim. Its value carries only the particle dims of the
    values it was computed from (e.g. AutoNormal's auxiliary site).
    """
    while isinstance(fn, (Independent, MaskedDistribution, ExpandedDistribution)):
        fn = fn.base_dist
    return isinstance(fn, Delta)


def is_point_mass(site) -> bool:
    """Whether a drawn latent site has no particle dim of its own (a Delta, or no torch distribution)."""
    return "_enumerate_dim" not in site["infer"]


def is_point_mass_latent(site) -> bool:
    """
    Whether a trace node is a point-mass latent: its value is a function of other
    particles. A plate's subsample site has no particle dim either, but it is no
    latent of the model.
    """
    return is_latent(site) and not site_is_subsample(site) and is_point_mass(site)


def particle_symbol(site) -> str:
    """The packed symbol of a drawn latent's own particle dim (or enumeration dim)."""
    infer = site["infer"]
    return infer["_dim_to_symbol"][infer["_enumerate_dim"]]


def proposal_site(name: str, model_trace: Trace, guide_trace: Trace):
    """The site whose distribution drew the particles of latent ``name``."""
    if name in guide_trace.nodes and guide_trace.nodes[name]["type"] == "sample":
        return guide_trace.nodes[name]
    return model_trace.nodes[name]


def model_or_guide_site(name: str, model_trace: Trace, guide_trace: Trace):
    """The model's site ``name``, or the guide's if only the guide has it (an auxiliary latent)."""
    if name in model_trace.nodes:
        return model_trace.nodes[name]
    return guide_trace.nodes[name]


def guide_only_sites(model_trace: Trace, guide_trace: Trace) -> List[str]:
    """
    Guide sample sites the model lacks: auxiliary latents (AutoNormal's
    ``<name>_unconstrained``, AutoContinuous's ``_Auto..._latent``) and the
    guide's ``pyro.factor`` statements. Both belong to ``q`` and so to the weight.
    """
    return [
        name for name, site in guide_trace.nodes.items() if is_sample(site) and name not in model_trace.nodes
    ]


def plate_symbols(site, trace: Trace) -> frozenset:
    """The packed symbols of the site's vectorized plates."""
    return frozenset(trace.plate_to_symbol[f.name] for f in site["cond_indep_stack"] if f.vectorized)


def marginal_sources(sites: Sequence[dict]) -> Dict[str, torch.Tensor]:
    """
    Zero tensors, one per site over its particle dim and plates
    (:func:`~pyro_tmc.shapes.particle_shape`), to be added to the sites' factors:
    their gradients give the sites' posterior marginals (:func:`source_weights`).

    :param sites: the sites (trace nodes) to read, each with a particle dim.
    """
    sources = {}
    for site in sites:
        dtype = site["value"].dtype if site["value"].is_floating_point() else torch.get_default_dtype()
        sources[site["name"]] = torch.zeros(
            particle_shape(site), dtype=dtype, device=site["value"].device, requires_grad=True
        )
    return sources


def source_weights(
    sources: Dict[str, torch.Tensor],
    grads: Sequence[Optional[torch.Tensor]],
    carried_scale: Callable[[str], float],
) -> Dict[str, torch.Tensor]:
    """
    Each source's site's posterior marginal weights (per particle and plate
    element): ``d log P / d source``, divided by what scales the site's factor
    from outside it (subsampling, ``poutine.scale``).

    :param grads: the gradients of ``log P`` with respect to ``sources.values()``,
        in order; ``None`` where the source did not reach it (the weights are then 0).
    :param carried_scale: site name -> that scale
        (:meth:`pyro_tmc.scales.ScalePlan.carried_scale` of the site).
    """
    weights = {}
    for (name, source), grad in zip(sources.items(), grads):
        grad = torch.zeros_like(source) if grad is None else grad
        weights[name] = grad / carried_scale(name)
    return weights
