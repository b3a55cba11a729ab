"""Catching hand broadcasting: a probe draw with a different particle count on every dim.

TMC gives every latent a particle dim left of the plates. A model that
broadcasts a latent's value by hand (``(X * w.unsqueeze(-2)).sum(-1)``,
``einsum("...d,nd->...n", w, X)``, ``X @ w[..., None]`` for a vector ``w``
outside the data plate) moves that latent's particles one dim to the left,
onto another latent's particle dim. With the same K on every dim the shapes
still fit, and the estimate is silently wrong: the two latents' particles are
paired, not combined.

So, under validation (Pyro's default), the first draw of a loss is followed by
one *probe* draw in which every particle dim has its own count (distinct
primes, by dim). A value whose particles moved then meets a dim of another
size: user code fails to broadcast, or a site's density varies along a
particle dim with another latent's count. Either is reported, naming the site
and the fix. The probe draws from a forked random number generator, so the
run's random stream (and a resumed run) is the same with or without it. With
validation off it never runs.
"""

from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Tuple

import torch

from pyro.infer.util import is_validation_enabled
from pyro.poutine import Trace

from ..shapes import log_prob_shape
from ..sites import is_latent

#: Particle counts of the probe, by particle dim from the plates leftwards:
#: distinct, and odd, so that no count is a common plate size.
PROBE_COUNTS = (3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73)

IDIOMS = (
    "(X * w.unsqueeze(-2)).sum(-1), X @ w[..., None] or einsum('...d,nd->...n', w, X) for a latent "
    "vector w sampled outside the data plate"
)
FIX = (
    "Write (X * w).sum(-1) (the value already has a size-1 slot for the plate, and its particle "
    "dims sit left of it), index with pyro.ops.indexing.Vindex, and let plates and .to_event carry "
    "the shapes. See 'Writing models for TMC: broadcasting and Vindex' in the README. "
    "(This check runs once per loss under validation: pyro.enable_validation(False) skips it.)"
)


@dataclass
class BroadcastCheck:
    """Whether a loss still has to run its probe draw (once, under validation)."""

    done: bool = False

    def wanted(self) -> bool:
        return not self.done and is_validation_enabled()


def probe_count(max_plate_nesting: int) -> Callable[[int], int]:
    """``dim -> count`` of the probe: the first particle dim left of the plates gets the first count."""

    def count(dim: int) -> int:
        return PROBE_COUNTS[(-dim - 1 - max_plate_nesting) % len(PROBE_COUNTS)]

    return count


def run_probe(draw_fn: Callable, settings) -> None:
    """
    Run a probe draw (``draw_fn(settings)`` with every dim's count its own) and
    check the particle sizes it produced.

    :param draw_fn: ``settings -> (model_trace, guide_trace)`` of one draw.
    :param settings: the :class:`~pyro_tmc.infer.draw.DrawSettings` of the real draw.
    :raises ValueError: naming the site, where a latent's particles left their dim.
    """
    count = probe_count(int(settings.max_plate_nesting))
    # "mixture": the other proposals pair particles across dims, which needs equal counts
    probe_settings = replace(settings, particle_counts=count, proposal="mixture", program=None)
    devices = (
        [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    )
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        try:
            model_trace, guide_trace = draw_fn(probe_settings)
        except (RuntimeError, ValueError, IndexError) as error:
            raise ValueError(
                f"{error}\n\nTMC's validation probe gave each particle dim its own count, and the guide "
                "and model failed with them, though they run with num_samples on every dim. A latent's "
                f"value was probably broadcast by hand ({IDIOMS}), which moves its particles onto another "
                f"latent's dim: with equal counts the estimate is silently wrong. {FIX}"
            ) from error
    check_particle_sizes(model_trace, guide_trace)


def check_particle_sizes(model_trace: Trace, guide_trace: Trace) -> None:
    """
    :raises ValueError: where a site's density varies along a latent's particle
        dim with another size than that latent's particle count.
    """
    owners = _particle_owners((guide_trace, model_trace))
    for trace in (model_trace, guide_trace):
        for name, site in trace.nodes.items():
            if site["type"] != "sample":
                continue
            shape = _density_shape(site)
            for dim, id_ in site["infer"].get("_dim_to_id", {}).items():
                owner = owners.get((dim, id_))
                if owner is None or -dim > len(shape) or shape[dim] in (1, owner[1]):
                    continue
                movers = sorted({n for (d, _), (n, size) in owners.items() if size == shape[dim]})
                raise ValueError(
                    f"Site '{name}' varies along the particle dim of latent '{owner[0]}' (dim {dim}) "
                    f"with size {shape[dim]}, where '{owner[0]}' has {owner[1]} particles under TMC's "
                    "validation probe (a different count on each particle dim)"
                    + (f"; {shape[dim]} is the count of {movers}" if movers else "")
                    + f". A latent's value was broadcast by hand ({IDIOMS}), which moves its particles "
                    f"onto another latent's dim: with equal counts the estimate is silently wrong. {FIX}"
                )


def _particle_owners(traces) -> Dict[Tuple[int, int], Tuple[str, int]]:
    """``(dim, id) -> (site, count)`` of every latent with a particle dim."""
    owners = {}
    for trace in traces:
        for name, site in trace.nodes.items():
            if not is_latent(site) or "_enumerate_dim" not in site["infer"]:
                continue
            infer = site["infer"]
            dim = infer["_enumerate_dim"]
            shape = _value_batch_shape(site)
            if -dim <= len(shape):
                owners[(dim, infer["_dim_to_id"][dim])] = (name, shape[dim])
    return owners


def _value_batch_shape(site) -> torch.Size:
    value = site["value"]
    return value.shape[: value.dim() - site["fn"].event_dim]


def _density_shape(site) -> List[int]:
    """
    The shape of the site's log density (:func:`~pyro_tmc.shapes.log_prob_shape`:
    ``torch.broadcast_shapes`` would import sympy on the first step).
    """
    return list(log_prob_shape(site))


__all__ = ["BroadcastCheck", "check_particle_sizes", "probe_count", "run_probe"]
