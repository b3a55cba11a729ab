"""The vocabulary of sites: which sample sites of a TMC draw are what, each under one name.

A draw is a model trace and a guide trace, both run under ``tmc``.

- a *latent* is an unobserved sample site (:func:`is_latent`, :func:`latent_names`);
- before the draw, a latent is *marked for an exact sum* by its ``infer`` flags
  (:func:`is_marked_for_exact_sum`); once drawn it is *summed exactly*: enumerated
  over its support rather than sampled (:func:`is_summed_exactly`);
- a *point mass* has no particle dim of its own (:func:`is_point_mass`): its
  distribution is a Delta (:func:`is_delta`), so its K particles would all be
  equal; :func:`is_point_mass_latent` leaves out a plate's subsample site;
- a latent *has a particle dim* of its own (:func:`has_particle_dim`,
  :func:`own_particle_dim`) where it is not a point mass: its drawn particles, or
  its enumerated support; a *drawn* latent (:func:`is_drawn`) has its
  :func:`particle_draw`, how its particles were drawn (none where it is summed
  exactly). These read the ``infer`` keys the ``tmc`` handler writes, here alone;
- a site with a particle dim has its *particle symbol*, the packed name of that
  dim (:func:`particle_symbol`); :func:`plate_frames` are its plates, and
  :func:`plate_symbols` names them;
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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch.distributions import Independent

import pyro
from pyro import poutine
from pyro.distributions import Delta
from pyro.distributions.torch_distribution import ExpandedDistribution, MaskedDistribution
from pyro.poutine import Trace
from pyro.poutine.util import site_is_subsample

from pyro_tmc.ops.shapes import particle_shape

if TYPE_CHECKING:
    from pyro_tmc.poutine.proposals import ParticleDraw


def is_sample(site) -> bool:
    """Whether a trace node is a sample site."""
    return site["type"] == "sample"


def is_latent(site) -> bool:
    """Whether a trace node is an unobserved sample site."""
    return site["type"] == "sample" and not site["is_observed"]


def latent_names(trace: Trace) -> list[str]:
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
    return has_particle_dim(site) and particle_draw(site) is None


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


def particle_draw(site) -> Optional["ParticleDraw"]:
    """
    How a sample site's particles were drawn (a :class:`~pyro_tmc.poutine.proposals.ParticleDraw`,
    kept in ``site["infer"]["_tmc_draw"]`` by the ``tmc`` handler), or ``None``: a site
    summed exactly, a point mass, an observed site, or no sample site at all.
    """
    if site.get("type", "sample") != "sample":
        return None
    return (site.get("infer") or {}).get("_tmc_draw")


def is_drawn(site) -> bool:
    """Whether a trace node is a latent whose particles were drawn from a proposal (:func:`particle_draw`)."""
    return is_latent(site) and particle_draw(site) is not None


def has_particle_dim(site) -> bool:
    """
    Whether a site has a particle dim of its own (its drawn particles, or the support it is
    summed over), recorded by the ``tmc`` handler as Pyro's enumeration records its dims.
    """
    return "_enumerate_dim" in (site.get("infer") or {})


def own_particle_dim(site) -> Optional[int]:
    """The dim of a site's own particles (or of its enumerated support), or ``None`` if it has none."""
    return (site.get("infer") or {}).get("_enumerate_dim")


def is_point_mass(site) -> bool:
    """Whether a drawn latent site has no particle dim of its own (a Delta, or no torch distribution)."""
    return not has_particle_dim(site)


def is_point_mass_latent(site) -> bool:
    """
    Whether a trace node is a point-mass latent: its value is a function of other
    particles. A plate's subsample site has no particle dim either, but it is no
    latent of the model.
    """
    return is_latent(site) and not site_is_subsample(site) and is_point_mass(site)


def particle_symbol(site) -> str:
    """The packed symbol of a drawn latent's own particle dim (or enumeration dim)."""
    return site["infer"]["_dim_to_symbol"][own_particle_dim(site)]


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


def guide_only_sites(model_trace: Trace, guide_trace: Trace) -> list[str]:
    """
    Guide sample sites the model lacks: auxiliary latents (AutoNormal's
    ``<name>_unconstrained``, AutoContinuous's ``_Auto..._latent``) and the
    guide's ``pyro.factor`` statements. Both belong to ``q`` and so to the weight.
    """
    return [
        name for name, site in guide_trace.nodes.items() if is_sample(site) and name not in model_trace.nodes
    ]


def plate_frames(site) -> list:
    """The vectorised plates (``pyro.plate`` frames) a sample site is in, outermost first."""
    return [frame for frame in site["cond_indep_stack"] if frame.vectorized]


def structure_trace(model: Callable, args: tuple = (), kwargs: Optional[dict] = None) -> Trace:
    """
    One run of ``model`` from its prior, for its structure (its sites, their shapes, plates and
    observed values), not its values: without gradients, hidden from outer handlers, and with
    Pyro's validation off, because a draw from heavy-tailed priors can reach a parameter its
    distribution rejects (``exp`` of a Cauchy draw underflows to a scale of 0.0) though the model
    is valid.

    :param callable model: the Pyro model.
    :param tuple args: its arguments.
    :param dict kwargs: its keyword arguments.
    :rtype: pyro.poutine.Trace
    """
    with torch.no_grad(), poutine.block(), pyro.validation_enabled(False):
        return poutine.trace(model).get_trace(*args, **(kwargs or {}))


def plate_nesting(trace: Trace) -> int:
    """
    The deepest batch dim of any sample site of ``trace``: its plates' dims, and batch dims outside
    any plate (a ``Normal(torch.zeros(3), 1)`` without ``to_event``), which a new plate must also
    sit left of. What ``max_plate_nesting`` must be at least, read from one run.
    """
    deepest = 0
    for site in trace.nodes.values():
        if site["type"] != "sample" or not hasattr(site["fn"], "batch_shape"):
            continue
        deepest = max([deepest, len(site["fn"].batch_shape)] + [-frame.dim for frame in plate_frames(site)])
    return deepest


def plate_symbols(site, trace: Trace) -> frozenset:
    """The packed symbols of the site's vectorized plates."""
    return frozenset(trace.plate_to_symbol[f.name] for f in site["cond_indep_stack"] if f.vectorized)


def marginal_sources(sites: Sequence[dict]) -> dict[str, torch.Tensor]:
    """
    Zero tensors, one per site over its particle dim and plates
    (:func:`~pyro_tmc.ops.shapes.particle_shape`), to be added to the sites' factors:
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
    sources: dict[str, torch.Tensor],
    grads: Sequence[Optional[torch.Tensor]],
    carried_scale: Callable[[str], float],
) -> dict[str, torch.Tensor]:
    """
    Each source's site's posterior marginal weights (per particle and plate
    element): ``d log P / d source``, divided by what scales the site's factor
    from outside it (subsampling, ``poutine.scale``).

    :param grads: the gradients of ``log P`` with respect to ``sources.values()``,
        in order; ``None`` where the source did not reach it (the weights are then 0).
    :param carried_scale: site name -> that scale
        (:meth:`pyro_tmc.estimate.scales.ScalePlan.carried_scale` of the site).
    """
    weights = {}
    for (name, source), grad in zip(sources.items(), grads):
        grad = torch.zeros_like(source) if grad is None else grad
        weights[name] = grad / carried_scale(name)
    return weights
