"""Planning a guide's particle dims along the model's markov chain, once per argument shapes.

A guide that samples a ``pyro.markov`` chain's sites outside any markov context
(``AutoNormal``, a user's plain loop) gets its particle dims recycled along the
model's markov structure (:mod:`pyro_tmc.poutine.chain_dims`). The plan comes
from a pre-pass: the model alone under ``tmc``, two particles per site, on a
forked random number generator and without gradients (so the draws of the run
are the same with or without it), which gives each chain site the dim its
``pyro.markov`` context recycles. The guide's run never uses the plan inside its
own ``pyro.markov`` contexts.

The plan is decided after the first draw with given argument shapes, which runs
with dims allocated as usual: the pre-pass runs only where that draw's guide
sampled some of the model's chain sites outside ``pyro.markov``. Where the first
draw runs out of particle dims doing so, the pre-pass runs then, and the draw is
made again under the plan from the same random state.

A draw under the plan checks that it serves (no guide site reads a recycled dim
ambiguously, no model factor holds two latents on one dim). Where it does not,
the draw is made again from the same random state with dims allocated as usual
(one per site outside ``pyro.markov``), and the plan is dropped for those
arguments; the reason is kept, for the error raised should dims run out. A loss
keeps one plan per argument shapes (:class:`ChainPlans`), as its captured steps
are keyed.
"""

import warnings
from typing import Optional

import torch

from pyro import poutine
from pyro.poutine import Trace

from pyro_tmc.estimate.vectorized_markov import without_funsor_scoring
from pyro_tmc.poutine import TMCMessenger
from pyro_tmc.poutine.chain_dims import AUXILIARY_SUFFIX, ChainDims
from pyro_tmc.poutine.sites import has_particle_dim, is_latent, own_particle_dim


def argument_key(value) -> object:
    """
    What of an argument a model's structure may depend on: tensors' shapes and
    dtypes, and the values of ints, strings and flags. Floats count by type
    alone: an annealing factor that changes every step changes no structure.
    """
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(argument_key(item) for item in value))
    if isinstance(value, dict):
        return ("dict", tuple((repr(key), argument_key(value[key])) for key in sorted(value, key=repr)))
    return type(value).__qualname__


class ChainPlans:
    """
    A loss's :class:`~pyro_tmc.poutine.chain_dims.ChainDims`, one per argument
    shapes, decided after the first draw with those arguments: a plan where that
    draw's guide sampled some of the model's chain sites outside ``pyro.markov``
    (or ran out of particle dims doing so), ``None`` otherwise.
    """

    def __init__(self) -> None:
        self._plans: dict[tuple, Optional[ChainDims]] = {}
        #: argument key -> why the plan did not serve (for the error should particle dims run out)
        self._refusals: dict[tuple, str] = {}

    @staticmethod
    def key(args: tuple, kwargs: dict, settings) -> tuple:
        """The plans' key for a draw with these arguments."""
        return (int(settings.max_plate_nesting), argument_key(args), argument_key(kwargs))

    def decided(self, key: tuple) -> bool:
        """Whether a draw with these arguments has been made, so that their plan is known."""
        return key in self._plans

    def plan(self, key: tuple) -> Optional[ChainDims]:
        """The plan for these arguments (``None``: dims allocated as usual)."""
        return self._plans.get(key)

    def decide(self, key: tuple, model, args: tuple, kwargs: dict, needed: bool) -> Optional[ChainDims]:
        """
        Decide the plan after a first draw: the pre-pass runs where ``needed``
        (the guide sampled chain sites outside ``pyro.markov``).
        """
        plan = plan_chain_dims(model, args, kwargs, -1 - key[0]) if needed else None
        self._plans[key] = plan
        return plan

    def refuse(self, key: tuple, reason: str) -> None:
        """Drop the plan for these arguments: a draw found that it does not serve, for ``reason``."""
        self._plans[key] = None
        self._refusals[key] = reason

    def refusal(self, key: tuple) -> str:
        """Why no plan serves these arguments ("" if one does, or none was needed)."""
        return self._refusals.get(key, "")


def needs_plan(unscoped_guide_latents, model_chain_sites) -> bool:
    """
    Whether a guide that sampled ``unscoped_guide_latents`` outside ``pyro.markov``
    sampled some of the model's chain sites there (itself, or through an
    auxiliary site named after it as AutoNormal names them).
    """
    chain = set(model_chain_sites)
    return any(
        name in chain or name.endswith(AUXILIARY_SUFFIX) and name[: -len(AUXILIARY_SUFFIX)] in chain
        for name in unscoped_guide_latents
    )


def plan_chain_dims(model, args: tuple, kwargs: dict, first_available_dim: int) -> Optional[ChainDims]:
    """
    The pre-pass above.

    :returns: the model's chain sites and their dims, or ``None`` where the model
        has no latent inside ``pyro.markov`` (or cannot be run alone: the real
        run then raises what it raises, with its hint).
    """
    devices = (
        [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    )
    # two particles: a value that does not vary along its dim would not keep it in scope
    two_each = TMCMessenger(2, first_available_dim=first_available_dim, particle_counts=lambda dim: 2)
    with torch.random.fork_rng(devices=devices), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model_trace = poutine.trace(two_each(without_funsor_scoring(model))).get_trace(*args, **kwargs)
        except Exception:  # noqa: BLE001 (the real run raises whatever this is, with its hint)
            return None
    dims = chain_dims_of(model_trace)
    return ChainDims(dims) if dims else None


def chain_dims_of(model_trace: Trace) -> dict[str, int]:
    """Model latent -> the particle dim its ``pyro.markov`` context gave it (chain sites only)."""
    return {
        name: own_particle_dim(site)
        for name, site in model_trace.nodes.items()
        if is_latent(site) and has_particle_dim(site) and site["infer"].get("_markov_scope") is not None
    }
