"""pyro_tmc: Tensor Monte Carlo (Aitchison, 2019) for Pyro.

The package in layers, each importing only those below it:

- :mod:`pyro_tmc.infer`: the losses and read-outs users call (``TMC_ELBO``, ``IWAE_ELBO``,
  ``TMC_RWS``, ``QEM``, posterior moments, predictive log-likelihood), and one draw;
- :mod:`pyro_tmc.estimate`: one draw's traces -> named log factors and their estimate;
- :mod:`pyro_tmc.poutine`: the ``tmc`` handler, particle groups, proposals, and the vocabulary
  of sites (:mod:`pyro_tmc.poutine.sites`);
- :mod:`pyro_tmc.ops`: tensor maths with no model in it (einsum backend, contraction, budget);
- :mod:`pyro_tmc.compile`: the capture engine behind ``compile=``;
- :mod:`pyro_tmc.contrib` and :mod:`pyro_tmc.experiments`: Lightning, the paper's experiments;
- ``_pyro.py``: the one seam to Pyro's private names.

Modules that sat at the top level before the layers (``pyro_tmc.proposals``, ``pyro_tmc.memory``,
``pyro_tmc.distributed``, ...) still import by their old names: :data:`MOVED` maps each to its home.
"""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

#: old module path -> where the module lives now (the old path imports the same module object)
MOVED = {
    f"pyro_tmc.{old}": f"pyro_tmc.{new}"
    for old, new in {
        "sites": "poutine.sites",
        "proposals": "poutine.proposals",
        "particle_groups": "poutine.particle_groups",
        "shapes": "ops.shapes",
        "log_einsum": "ops.log_einsum",
        "contraction": "ops.contraction",
        "memory": "ops.memory",
        "log_density": "ops.log_density",
        "factors": "estimate.factors",
        "scales": "estimate.scales",
        "batched_densities": "estimate.batched_densities",
        "checks": "estimate.checks",
        "vectorized_markov": "estimate.vectorized_markov",
        "evaluation": "estimate.evaluation",
        "captured_step": "compile.captured_step",
        "compiled": "compile.compiled",
        "loop_rolling": "compile.loop_rolling",
        "forward_trace": "compile.forward_trace",
        "background_compile": "compile.background_compile",
        "bmm_layout": "compile.bmm_layout",
        "distributed": "contrib.lightning",
        "datasets": "experiments.datasets",
    }.items()
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import pyro_tmc.<old>`` gives the module at its new path, imported when first asked for."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module):
        # the import system has just given the module the old name's spec: it keeps its own
        module.__spec__ = self._own_spec


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.insert(
        0, _MovedModuleFinder()
    )  # before an editable install's finder, which knows old files

# the capture engine wraps the losses from outside: importing it registers their compile= programs
import pyro_tmc.compile  # noqa: E402, F401
from pyro_tmc.infer import IWAE_ELBO, QEM, TMC_ELBO, TMC_RWS, QEMGuide  # noqa: E402

__all__ = ["IWAE_ELBO", "QEM", "QEMGuide", "TMC_ELBO", "TMC_RWS", "__version__"]
