"""
Pyro's own tests with ``TMC_ELBO`` in place of Pyro's ELBOs: a pytest plugin.

Every ``Trace_ELBO``, ``TraceGraph_ELBO``, ``TraceEnum_ELBO`` and
``TraceMeanField_ELBO`` that a test builds becomes a ``TMC_ELBO`` (its
``max_plate_nesting``, ``num_particles`` capped at 2, ``vectorize_particles``;
``num_samples`` from ``TMC_TESTS_NUM_SAMPLES``, default 3). Unlike
``pyro_tests_shadow`` (captured against eager, on the same draws), here the test's
own pass or fail is the result: a model that passes under Pyro's ELBOs and fails
under ``TMC_ELBO`` is one that TMC refuses or breaks. Compare two runs, one with
this plugin and one without (``pytest -rA`` lists every outcome)::

    PYTHONPATH=/path/to/pyro_tmc/tools python -m pytest -p pyro_tests_tmc \\
        tests/infer/test_valid_models.py -q -rA -p no:cacheprovider

from a checkout of Pyro's tests (``fetch`` pyro-ppl/pyro, then ``git archive 1.9.1
tests``). Each site's ``infer={"num_samples": n}`` is capped at 4 (Pyro's tests
ask up to 20,000 for Monte Carlo checks), except where ``TMC_TESTS_CAP_SITE_SAMPLES=0``.
"""

import importlib
import os

import pyro
import pyro.infer
from pyro import poutine

from pyro_tmc import TMC_ELBO

NUM_SAMPLES = int(os.environ.get("TMC_TESTS_NUM_SAMPLES", "3"))
CAP_SITE_SAMPLES = os.environ.get("TMC_TESTS_CAP_SITE_SAMPLES", "1") != "0"
MAX_SITE_SAMPLES = 4
#: each replaced loss, and the module that defines it (tests import from either place)
REPLACED = {
    "Trace_ELBO": "pyro.infer.trace_elbo",
    "TraceGraph_ELBO": "pyro.infer.tracegraph_elbo",
    "TraceEnum_ELBO": "pyro.infer.traceenum_elbo",
    "TraceMeanField_ELBO": "pyro.infer.trace_mean_field_elbo",
}


class SwappedELBO(TMC_ELBO):
    """``TMC_ELBO`` built from a Pyro ELBO's arguments (those it has no use for are dropped)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(
            num_samples=NUM_SAMPLES,
            max_plate_nesting=kwargs.get("max_plate_nesting", float("inf")),
            num_particles=min(kwargs.get("num_particles", 1), 2),
            vectorize_particles=kwargs.get("vectorize_particles", False),
        )
        self._capped = {}  # id(model or guide) -> (it, it with num_samples capped)

    def _capped_samples(self, fn):
        """The same wrapper each call (a loss may cache per model and guide)."""
        if not CAP_SITE_SAMPLES:
            return fn
        if id(fn) not in self._capped:
            self._capped[id(fn)] = (fn, poutine.infer_config(fn, _cap_num_samples))
        return self._capped[id(fn)][1]

    def loss(self, model, guide, *args, **kwargs):
        return super().loss(self._capped_samples(model), self._capped_samples(guide), *args, **kwargs)

    def differentiable_loss(self, model, guide, *args, **kwargs):
        model, guide = self._capped_samples(model), self._capped_samples(guide)
        return super().differentiable_loss(model, guide, *args, **kwargs)

    def loss_and_grads(self, model, guide, *args, **kwargs):
        model, guide = self._capped_samples(model), self._capped_samples(guide)
        return super().loss_and_grads(model, guide, *args, **kwargs)


def _cap_num_samples(msg) -> dict:
    samples = msg["infer"].get("num_samples")
    return {} if samples is None else {"num_samples": min(samples, MAX_SITE_SAMPLES)}


def pytest_configure(config) -> None:
    # before the test modules import them: their parametrize lists then hold the swapped losses
    for name, module in REPLACED.items():
        swapped = type(name, (SwappedELBO,), {})
        setattr(pyro.infer, name, swapped)
        setattr(importlib.import_module(module), name, swapped)
