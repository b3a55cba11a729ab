"""The one seam to Pyro's private internals.

Every private Pyro name that pyro_tmc uses is imported or named here, with why,
and nowhere else in the package. :func:`missing_private_names` checks that the
installed Pyro still has each one; ``tests/test_pyro_seam.py`` fails, naming the
symbol, on a Pyro version that lacks one. When Pyro changes, this file (and the
test) is where it shows.
"""

from typing import List

import pyro
from pyro.infer.elbo import ELBO
from pyro.ops.rings import LogRing
from pyro.poutine.enum_messenger import EnumMessenger

# Builds ``tmc(fn=None, ...)`` from TMCMessenger the way Pyro builds its own
# handlers (decorator and context-manager forms, the messenger's docstring).
from pyro.poutine.handlers import _make_handler  # noqa: F401

# The global enumeration-dim allocator: particle dims are allocated through it
# so that pyro.markov recycles them exactly as it recycles enumeration dims.
from pyro.poutine.runtime import _ENUM_ALLOCATOR  # noqa: F401

#: EnumMessenger's bookkeeping that TMCMessenger reads after delegating to it:
#: the dims visible to each site (upstream particles) and those its value carries.
ENUM_MESSENGER_STATE = ("_param_dims", "_value_dims", "_markov_depths")

#: Keys of ``site["infer"]`` that EnumMessenger, pyro.markov and Trace.symbolize_dims
#: read and write: a site's particle dim, the dims it carries, its markov scope.
INFER_KEYS = ("_enumerate_dim", "_dim_to_id", "_dim_to_symbol", "_markov_scope", "_markov_depth")

#: The attribute pyro.ops.packed and pyro.ops.contract use to name a packed tensor's dims.
PACKED_DIMS = "_pyro_dims"

#: Protected ELBO methods a subclass uses: guessing max_plate_nesting, and
#: vectorising num_particles, as Pyro's own ELBOs do.
ELBO_METHODS = ("_guess_max_plate_nesting", "_vectorized_num_particles")


def missing_private_names() -> List[str]:
    """The private Pyro names above that the installed Pyro lacks (empty when all are there)."""
    missing = _missing_infer_keys()  # runs an enumerated model: the allocator is then set up
    import pyro.poutine.handlers as handlers
    import pyro.poutine.runtime as runtime

    for module, name in (
        (handlers, "_make_handler"),
        (runtime, "_ENUM_ALLOCATOR"),
    ):
        if not hasattr(module, name):
            missing.append(f"{module.__name__}.{name}")
    messenger = EnumMessenger()
    with messenger:
        for name in ENUM_MESSENGER_STATE:
            if not hasattr(messenger, name):
                missing.append(f"EnumMessenger.{name}")
    allocator = getattr(runtime, "_ENUM_ALLOCATOR", None)
    for name in ("next_available_dim", "dim_to_id", "allocate"):
        if allocator is not None and not hasattr(allocator, name):
            missing.append(f"pyro.poutine.runtime._ENUM_ALLOCATOR.{name}")
    for name in ELBO_METHODS:
        if not hasattr(ELBO, name):
            missing.append(f"ELBO.{name}")
    if not hasattr(LogRing, "product"):
        missing.append("LogRing.product")
    return missing


def _missing_infer_keys() -> List[str]:
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
