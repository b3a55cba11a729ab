"""The one seam to Pyro's private internals.

Every private Pyro name that pyro_tmc uses is imported or named here, with why,
and nowhere else in the package. :func:`missing_private_names` checks that the
installed Pyro still has each one; ``tests/test_pyro_seam.py`` fails, naming the
symbol, on a Pyro version that lacks one. When Pyro changes, this file (and the
test) is where it shows.
"""

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Callable

import torch

import pyro
from pyro.distributions import MaskedDistribution
from pyro.infer.elbo import ELBO
from pyro.ops.rings import LogRing
from pyro.poutine.enum_messenger import EnumMessenger
from pyro.poutine.handlers import _make_handler
from pyro.poutine.runtime import _ENUM_ALLOCATOR, _PYRO_STACK


def make_handler(messenger_class: type, module: str) -> Callable:
    """
    A decorator that builds a handler (``tmc(fn=None, ...)``, decorator and
    context-manager forms, the messenger's docstring) from a messenger class,
    the way Pyro builds its own.
    """
    return _make_handler(messenger_class, module=module)


def messengers_inside(messenger) -> list:
    """
    The messengers entered after ``messenger`` and still on Pyro's stack (those inside it: a model's
    plates, a ``poutine.block``); empty where it is not on the stack. Pyro keeps
    the stack private (``_PYRO_STACK``); an exception raised inside ``messenger`` unwinds these.
    """
    if messenger not in _PYRO_STACK:
        return []
    return _PYRO_STACK[_PYRO_STACK.index(messenger) + 1 :]


def distribution_mask(fn: MaskedDistribution):
    """A ``MaskedDistribution``'s mask: ``True``, ``False`` or a bool tensor (Pyro keeps it as ``_mask``)."""
    return fn._mask


def allocate_particle_dim(avoid: Collection[int], recyclable: bool) -> tuple[int, int]:
    """
    A ``(dim, id)`` for a site's particles from Pyro's global enumeration-dim
    allocator, so that :func:`pyro.markov` recycles particle dims exactly as it
    recycles enumeration dims.

    :param avoid: dims the new dim must not be (those in the site's scope, and
        any the caller reserves).
    :param bool recyclable: a local dim that a later site out of this one's
        scope may reuse (inside ``pyro.markov``), or else a global dim that is
        never reused; a global dim also skips every dim in ``avoid``.
    """
    if recyclable:
        return _ENUM_ALLOCATOR.allocate(set(avoid))
    while _ENUM_ALLOCATOR.next_available_dim in avoid:
        _ENUM_ALLOCATOR.next_available_dim -= 1
    return _ENUM_ALLOCATOR.allocate(None)


@contextmanager
def param_store_holding(unconstrained: dict[str, torch.Tensor]) -> Iterator[None]:
    """
    A context in which the param store's named parameters are the given
    unconstrained tensors (``pyro.param(name)`` constrains them as usual), so
    that a captured step reads its parameters as graph inputs
    (:mod:`pyro_tmc.compile.captured_step`); the store's own tensors come back on exit.
    ``ParamStoreDict`` has no public setter that keeps a parameter's identity.
    """
    store = pyro.get_param_store()
    saved = {name: store._params[name] for name in unconstrained}
    store._params.update(unconstrained)
    try:
        yield
    finally:
        store._params.update(saved)


#: EnumMessenger's bookkeeping that TMCMessenger reads after delegating to it:
#: the dims visible to each site (upstream particles) and those its value carries.
ENUM_MESSENGER_STATE = ("_param_dims", "_value_dims", "_markov_depths")

#: Keys of ``site["infer"]`` that EnumMessenger, pyro.markov and Trace.symbolize_dims
#: read and write: a site's particle dim, the dims it carries, its markov scope.
INFER_KEYS = ("_enumerate_dim", "_dim_to_id", "_dim_to_symbol", "_markov_scope", "_markov_depth")

#: Protected ELBO methods a subclass uses: guessing max_plate_nesting, and
#: vectorising num_particles, as Pyro's own ELBOs do.
ELBO_METHODS = ("_guess_max_plate_nesting", "_vectorized_num_particles")


def missing_private_names() -> list[str]:
    """The private Pyro names above that the installed Pyro lacks (empty when all are there)."""
    missing = _missing_infer_keys()  # runs an enumerated model: the allocator is then set up
    from pyro.poutine import handlers, runtime

    messenger = EnumMessenger()
    with messenger:  # its state exists while it is active
        owners = [
            (handlers, "pyro.poutine.handlers", ["_make_handler"]),
            (runtime, "pyro.poutine.runtime", ["_ENUM_ALLOCATOR"]),
            (messenger, "EnumMessenger", list(ENUM_MESSENGER_STATE)),
            (
                getattr(runtime, "_ENUM_ALLOCATOR", None),
                "pyro.poutine.runtime._ENUM_ALLOCATOR",
                ["next_available_dim", "dim_to_id", "allocate"],
            ),
            (ELBO, "ELBO", list(ELBO_METHODS)),
            (MaskedDistribution(pyro.distributions.Normal(0.0, 1.0), True), "MaskedDistribution", ["_mask"]),
            (LogRing, "LogRing", ["product"]),
            (pyro.get_param_store(), "ParamStoreDict", ["_params"]),
        ]
        for owner, label, names in owners:
            missing += [f"{label}.{name}" for name in names if owner is not None and not hasattr(owner, name)]
    return missing


def _missing_infer_keys() -> list[str]:
    """Run a tiny enumerated markov model and check that Pyro still writes the infer keys."""
    import pyro.distributions as dist
    from pyro import poutine

    def model():
        for i in pyro.markov(range(2)):
            pyro.sample(f"x_{i}", dist.Bernoulli(0.5), infer={"enumerate": "parallel"})

    trace = poutine.trace(poutine.enum(model, first_available_dim=-1)).get_trace()
    trace.symbolize_dims()
    site = trace.nodes["x_1"]
    return [f'site["infer"]["{key}"]' for key in INFER_KEYS if key not in site["infer"]]
