"""The vocabulary of sites: which sample sites of a TMC draw are what.

A draw is a model trace and a guide trace, both run under ``tmc``. Each
predicate or filter here has one name, used everywhere:

- a *latent* is an unobserved sample site (:func:`is_latent`);
- it is *summed exactly* when it was enumerated over its support rather than
  sampled (:func:`is_summed_exactly`), and a *point mass* when it has no
  particle dim of its own (:func:`is_point_mass`: a Delta, AutoDelta's sites);
- its *proposal site* is the site whose distribution drew its particles: the
  guide's, or the model's own for a model-only latent (:func:`proposal_site`);
- a *guide-only* site is one the model lacks: an auxiliary latent (AutoNormal's
  ``<name>_unconstrained``) or a guide ``pyro.factor`` (:func:`guide_only_sites`).
"""

from typing import List

from pyro.poutine import Trace


def is_sample(site) -> bool:
    """Whether a trace node is a sample site."""
    return site["type"] == "sample"


def is_latent(site) -> bool:
    """Whether a trace node is an unobserved sample site."""
    return site["type"] == "sample" and not site["is_observed"]


def is_summed_exactly(site) -> bool:
    """Whether a latent site was enumerated over its support (no proposal density)."""
    return "_enumerate_dim" in site["infer"] and "_tmc_draw" not in site["infer"]


def is_point_mass(site) -> bool:
    """Whether a latent site has no particle dim of its own (a Delta, or no torch distribution)."""
    return "_enumerate_dim" not in site["infer"]


def proposal_site(name: str, model_trace: Trace, guide_trace: Trace):
    """The site whose distribution drew the particles of latent ``name``."""
    if name in guide_trace.nodes and guide_trace.nodes[name]["type"] == "sample":
        return guide_trace.nodes[name]
    return model_trace.nodes[name]


def latent_site(name: str, model_trace: Trace, guide_trace: Trace):
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
