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

The probe never turns a model that is right at the user's counts into an
error. With one particle on every sampled latent's dim it does not run: a
size-1 dim broadcasts wherever it goes, so nothing can be paired (a model that
reshapes a plated latent across its plate is right there, and only there).
Where the probe fails with an error that is no evidence of broadcasting (the
model's own ``assert`` on the particle shapes it was promised, another error of
its own code that is not about shapes), it warns once, naming the site reached
and what could not be checked, and the loss goes on with its own draw.
"""

import os
import traceback
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

import pyro
from pyro.infer.util import is_validation_enabled
from pyro.poutine import Trace
from pyro.poutine.messenger import Messenger

from pyro_tmc.ops.shapes import log_prob_shape
from pyro_tmc.poutine.sites import has_particle_dim, is_drawn, is_latent, own_particle_dim

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


def run_probe(draw_fn: Callable, settings, model_trace: Trace, guide_trace: Trace) -> None:
    """
    Run a probe draw (``draw_fn(settings)`` with every dim's count its own) and
    check the particle sizes it produced.

    With one particle on every sampled latent's dim there is nothing to probe: a
    size-1 dim broadcasts wherever it is moved, so the estimate is right, and a
    model that only runs at that count (one that reshapes a plated latent across
    its plate) must not be refused. An enumerated site's dim holds its support,
    which the probe does not change: the real draw's sizes are checked instead.

    Where the probe fails in a way that says nothing about broadcasting (the
    model's own ``assert`` on a particle shape, an error of its own that the real
    draw did not raise), it warns, naming the site reached, and the run goes on.

    :param draw_fn: ``settings -> (model_trace, guide_trace)`` of one draw.
    :param settings: the :class:`~pyro_tmc.infer.draw.DrawSettings` of the real draw.
    :param model_trace: the real draw's finished model trace.
    :param guide_trace: the real draw's finished guide trace.
    :raises ValueError: naming the site, where a latent's particles left their dim.
    """
    if not has_several_particles(model_trace, guide_trace):
        check_particle_sizes(model_trace, guide_trace, where="in this draw")
        return
    count = probe_count(int(settings.max_plate_nesting))
    # "mixture": the other proposals pair particles across dims, which needs equal counts
    probe_settings = replace(settings, particle_counts=count, proposal="mixture", program=None)
    devices = (
        [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    )
    reached = _LastSite()
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        try:
            with reached:
                model_trace, guide_trace = draw_fn(probe_settings)
        except Exception as error:
            if not is_broadcast_evidence(error):
                warn_unchecked(error, reached.name)
                return
            raise ValueError(
                f"{error}\n\nTMC's validation probe gave each particle dim its own count, and the guide "
                "and model failed with them, though they run with num_samples on every dim. A latent's "
                f"value was probably broadcast by hand ({IDIOMS}), which moves its particles onto another "
                f"latent's dim: with equal counts the estimate is silently wrong. {FIX}"
            ) from error
    check_particle_sizes(model_trace, guide_trace)


def has_several_particles(model_trace: Trace, guide_trace: Trace) -> bool:
    """
    Whether any sampled latent of the draw has more than one particle (an
    enumerated site's dim holds its support, which the probe leaves alone).
    """
    for trace in (guide_trace, model_trace):
        for site in trace.nodes.values():
            if not is_drawn(site):
                continue
            dim = own_particle_dim(site)
            shape = _value_batch_shape(site)
            if -dim <= len(shape) and shape[dim] > 1:
                return True
    return False


#: Words of torch's and Pyro's errors about sizes: the probe changes nothing but sizes, so any
#: such error is evidence ("size of tensor a (5) must match", "shapes cannot be multiplied",
#: "invalid for input of size", "do not broadcast", "Shape mismatch inside plate", ...).
_SIZE_PHRASES = ("broadcast", "shape", "size", "dimension", "mismatch", "must match", "expand")
#: Phrases of a value's or a parameter's complaint (a bad random draw): not about sizes.
_VALUE_PHRASES = ("to satisfy the constraint", "within the support")


def is_broadcast_evidence(error: Exception) -> bool:
    """
    Whether the probe's failure shows a value that does not follow its particle
    dims: a shape, size or broadcasting error, or a check of Pyro's or ours that
    the real draw passed. Not an ``AssertionError``, a ``NotImplementedError``, or
    another error of the user's code (a bad value at the probe's random draw).
    """
    if not isinstance(error, (RuntimeError, ValueError, IndexError)):
        return False
    if isinstance(error, NotImplementedError):  # a RuntimeError, but about what is missing
        return False
    message = str(error).split("Trace Shapes:")[0].lower()
    if any(phrase in message for phrase in _VALUE_PHRASES):
        return False
    return (
        isinstance(error, IndexError)
        or any(phrase in message for phrase in _SIZE_PHRASES)
        or (isinstance(error, ValueError) and _raised_by(error, _LIBRARIES))
    )


def _library_dirs() -> tuple[str, ...]:
    """Pyro's and this package's source folders: where their own checks raise."""
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return tuple(path + os.sep for path in (os.path.dirname(os.path.abspath(pyro.__file__)), ours))


_LIBRARIES = _library_dirs()


def _raised_by(error: Exception, dirs: tuple[str, ...]) -> bool:
    """Whether the innermost frame of ``error``'s traceback lies in one of ``dirs``."""
    frames = list(traceback.walk_tb(error.__traceback__))
    return bool(frames) and frames[-1][0].f_code.co_filename.startswith(dirs)


def warn_unchecked(error: Exception, site: Optional[str]) -> None:
    """Say that the probe could not run, and that the real draw's result stands."""
    where = f"after sample site '{site}'" if site else "before any sample site"
    first_line = str(error).split("Trace Shapes:")[0].strip().splitlines()
    what = f"{type(error).__name__}: {first_line[0] if first_line else ''}".rstrip(": ")
    warnings.warn(
        f"TMC's validation probe (one draw with a different particle count on each particle dim) "
        f"stopped {where}, with {what}: an error of the model's or guide's own code that is not a "
        "shape error, which the run at num_samples did not raise (a check of the particle shapes "
        "num_samples gives?). So whether a latent's value was broadcast by hand onto another latent's "
        "particle dim could not be checked; the loss goes on with its own draw, whose result stands. "
        "(pyro.enable_validation(False) skips the probe.)",
        UserWarning,
        stacklevel=2,
    )


class _LastSite(Messenger):
    """Records the name of the last sample site run beneath it (where the probe stopped)."""

    def __init__(self) -> None:
        super().__init__()
        self.name: Optional[str] = None

    def _pyro_sample(self, msg) -> None:
        self.name = msg["name"]


def check_particle_sizes(
    model_trace: Trace,
    guide_trace: Trace,
    where: str = "under TMC's validation probe (a different count on each particle dim)",
) -> None:
    """
    :param str where: which draw the traces are of, for the message.
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
                    f"with size {shape[dim]}, where '{owner[0]}' has {owner[1]} particles {where}"
                    + (f"; {shape[dim]} is the count of {movers}" if movers else "")
                    + f". A latent's value was broadcast by hand ({IDIOMS}), which moves its particles "
                    f"onto another latent's dim: with equal counts the estimate is silently wrong. {FIX}"
                )


def _particle_owners(traces) -> dict[tuple[int, int], tuple[str, int]]:
    """``(dim, id) -> (site, count)`` of every latent with a particle dim."""
    owners = {}
    for trace in traces:
        for name, site in trace.nodes.items():
            if not is_latent(site) or not has_particle_dim(site):
                continue
            infer = site["infer"]
            dim = own_particle_dim(site)
            shape = _value_batch_shape(site)
            if -dim <= len(shape):
                owners[(dim, infer["_dim_to_id"][dim])] = (name, shape[dim])
    return owners


def _value_batch_shape(site) -> torch.Size:
    value = site["value"]
    return value.shape[: value.dim() - site["fn"].event_dim]


def _density_shape(site) -> list[int]:
    """
    The shape of the site's log density (:func:`~pyro_tmc.ops.shapes.log_prob_shape`:
    ``torch.broadcast_shapes`` would import sympy on the first step).
    """
    return list(log_prob_shape(site))


__all__ = [
    "BroadcastCheck",
    "check_particle_sizes",
    "has_several_particles",
    "is_broadcast_evidence",
    "probe_count",
    "run_probe",
]
