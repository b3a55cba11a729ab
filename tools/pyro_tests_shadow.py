"""
Pyro's own tests as a check of the captured step: a pytest plugin.

Every ``Trace_ELBO``, ``TraceGraph_ELBO``, ``TraceEnum_ELBO`` and
``TraceMeanField_ELBO`` that a test builds becomes a *shadow* loss. Each of its
``loss_and_grads`` calls runs ``TMC_ELBO`` eagerly and ``TMC_ELBO(compile=MODE)``
from the same random state, four times (so that the captured step replays), and
writes JSON lines: each call compared (``"compared"``), each round where loss or
gradients differ (``"mismatch"``), and each fallback warning. ``loss`` and
``differentiable_loss`` calls are compared the same way (the latter with the gradient
of the returned loss for each parameter): under ``compile=`` they run the estimate
program, not the captured step. The test itself then
goes on with the eager loss: its own assertions are about Pyro's losses, so its
pass or fail says nothing here; the log does.

Run it on a checkout of Pyro's tests (``fetch`` pyro-ppl/pyro, then ``git archive
1.9.1 tests``), from that checkout's root::

    PYTHONPATH=/path/to/pyro_tmc/tools python -m pytest -p pyro_tests_shadow \\
        tests/infer/test_valid_models.py -q -p no:cacheprovider

Settings (environment): ``SHADOW_MODE`` (``graph``, the default, or ``inductor``),
``SHADOW_LOG`` (the JSON lines file; default ``pyro_tests_shadow.jsonl``).
"""

import importlib
import json
import os
import warnings
from typing import Optional

import torch

import pyro
import pyro.infer
from pyro import poutine

from pyro_tmc import TMC_ELBO

MODE = os.environ.get("SHADOW_MODE", "graph")
LOG = os.environ.get("SHADOW_LOG", "pyro_tests_shadow.jsonl")
RTOL, ATOL = 1e-4, 1e-5  # float32 steps, values of order 1-100
ROUNDS = 4  # per call: the first captures, the later ones replay
MAX_SITE_SAMPLES = 4  # per site's infer={"num_samples": n} (see ShadowELBO._capped_samples)
COMPARED_CALLS = 6  # per loss: a test that trains on takes the captured step alone after these
#: each shadowed loss, and the module that defines it (tests import from either place)
SHADOWED = {
    "Trace_ELBO": "pyro.infer.trace_elbo",
    "TraceGraph_ELBO": "pyro.infer.tracegraph_elbo",
    "TraceEnum_ELBO": "pyro.infer.traceenum_elbo",
    "TraceMeanField_ELBO": "pyro.infer.trace_mean_field_elbo",
}
_test: dict[str, Optional[str]] = {"id": None}


def _take_grads() -> dict[str, Optional[torch.Tensor]]:
    """The param store's gradients, which are then cleared."""
    grads = {}
    for name, param in pyro.get_param_store().named_parameters():
        grads[name] = None if param.grad is None else param.grad.detach().clone()
        param.grad = None
    return grads


def _differences(eager_loss, eager_grads, captured_loss, captured_grads) -> list[str]:
    found = []
    a, b = torch.tensor(float(eager_loss)), torch.tensor(float(captured_loss))
    if not (torch.isclose(a, b, rtol=RTOL, atol=ATOL) or (a.isnan() and b.isnan())):
        found.append(f"loss {float(eager_loss)} vs {float(captured_loss)}")
    for name in set(eager_grads) | set(captured_grads):
        a, b = eager_grads.get(name), captured_grads.get(name)
        if a is None and b is None:
            continue
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        if not torch.allclose(a, b, rtol=RTOL, atol=ATOL, equal_nan=True):
            found.append(f"grad {name}: max |diff| {(a - b).abs().max().item():.3g}")
    return found


def _log(**record) -> None:
    record["test"] = _test["id"]
    with open(LOG, "a") as f:
        f.write(json.dumps(record) + "\n")


class ShadowELBO(pyro.infer.ELBO):
    """An eager ``TMC_ELBO`` and a captured one, compared on every call (see the module note)."""

    def __init__(self, *args, **kwargs) -> None:
        settings = dict(
            num_samples=3,
            max_plate_nesting=kwargs.get("max_plate_nesting", float("inf")),
            # Pyro's tests take up to 10,000 particles for their Monte Carlo checks; two
            # exercise the particle loop (or vector) as well
            num_particles=min(kwargs.get("num_particles", 1), 2),
            vectorize_particles=kwargs.get("vectorize_particles", False),
        )
        self.eager = TMC_ELBO(**settings)
        # inductor's own random draws differ from torch's: fallback_random keeps the eager step's numbers
        compile_options = {"options": {"fallback_random": True}} if MODE == "inductor" else None
        self.captured = TMC_ELBO(compile=MODE, compile_options=compile_options, **settings)
        self.calls = 0
        self._capped: dict[int, tuple] = {}  # id(model or guide) -> (it, it with num_samples capped)
        super().__init__(max_plate_nesting=settings["max_plate_nesting"])

    def _get_trace(self, *args, **kwargs):
        raise NotImplementedError

    def loss(self, model, guide, *args, **kwargs):
        return self._shadowed("loss", model, guide, args, kwargs)

    def differentiable_loss(self, model, guide, *args, **kwargs):
        return self._shadowed("differentiable_loss", model, guide, args, kwargs)

    def loss_and_grads(self, model, guide, *args, **kwargs):
        return self._shadowed("loss_and_grads", model, guide, args, kwargs)

    def _shadowed(self, method: str, model, guide, args, kwargs):
        """
        ``method`` of both losses from the same random state, ``ROUNDS`` times, compared
        (value and gradients); then the eager loss's, from that state, for the test.
        """
        self.calls += 1
        model, guide = self._capped_samples(model), self._capped_samples(guide)
        if self.calls > COMPARED_CALLS:
            return getattr(self.captured, method)(model, guide, *args, **kwargs)
        if self.calls == 1:
            # lazy set-up draws (an AutoGuide's initial values, the max_plate_nesting guess)
            # before the random state is kept: else the two losses' first draws differ
            self.eager.loss(model, guide, *args, **kwargs)
            self.captured.loss(model, guide, *args, **kwargs)
        state = pyro.util.get_rng_state()
        _take_grads()
        fallbacks = set()
        for round_ in range(ROUNDS):
            pyro.util.set_rng_state(state)
            try:
                eager = _value_and_grads(self.eager, method, model, guide, args, kwargs)
            except Exception as error:  # the model is invalid for TMC: the test sees the error
                _log(kind="eager_error", method=method, error=f"{type(error).__name__}: {str(error)[:300]}")
                raise
            pyro.util.set_rng_state(state)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    captured = _value_and_grads(self.captured, method, model, guide, args, kwargs)
                except Exception as error:  # the eager call worked: a defect of the captured one
                    _log(kind="captured_error", method=method, error=f"{type(error).__name__}: {error}"[:330])
                    raise
            fallbacks |= {str(w.message)[:300] for w in caught if "pyro_tmc could not" in str(w.message)}
            found = _differences(*eager, *captured)
            if found:
                _log(kind="mismatch", method=method, round=round_, differences=found[:5])
        _log(kind="compared", method=method, fallbacks=sorted(fallbacks))
        pyro.util.set_rng_state(state)
        return getattr(self.eager, method)(model, guide, *args, **kwargs)

    def _capped_samples(self, fn):
        """
        ``fn`` with each site's ``infer={"num_samples": n}`` capped at ``MAX_SITE_SAMPLES``
        (Pyro's tests ask up to 20,000, for Monte Carlo checks that say nothing here): the
        same wrapper each call, since a captured step is keyed by the model's and guide's
        identity.
        """
        if id(fn) not in self._capped:
            self._capped[id(fn)] = (fn, poutine.infer_config(fn, _cap_num_samples))
        return self._capped[id(fn)][1]


def _cap_num_samples(msg) -> dict:
    samples = msg["infer"].get("num_samples")
    return {} if samples is None else {"num_samples": min(samples, MAX_SITE_SAMPLES)}


def _value_and_grads(loss, method: str, model, guide, args, kwargs):
    """
    ``loss.method(...)``'s value and the gradients it gives each parameter: those
    ``loss_and_grads`` accumulates, or those of ``differentiable_loss``'s result.
    """
    value = getattr(loss, method)(model, guide, *args, **kwargs)
    if method == "loss_and_grads":
        return value, _take_grads()
    if method == "loss" or not (torch.is_tensor(value) and value.requires_grad):
        return float(value), {}
    named = [(name, p) for name, p in pyro.get_param_store().named_parameters() if p.requires_grad]
    if not named:  # the loss has a gradient, but not for the param store (a tensor of the test's own)
        return value.item(), {}
    grads = torch.autograd.grad(value, [p for _, p in named], allow_unused=True)
    return value.item(), {name: g for (name, _), g in zip(named, grads) if g is not None}


def pytest_configure(config) -> None:
    # before the test modules import them: their parametrize lists then hold the shadows
    for name, module in SHADOWED.items():
        shadow = type(name, (ShadowELBO,), {})
        setattr(pyro.infer, name, shadow)
        setattr(importlib.import_module(module), name, shadow)


def pytest_runtest_setup(item) -> None:
    _test["id"] = item.nodeid
