"""Fixtures shared by the tests. The tests' models and oracles live in tests/common/models.py, not in
pyro_tmc.experiments: the tests check the package against code of their own."""

import pytest
import torch

import pyro

from tests.common import models


@pytest.fixture
def fresh_pyro():
    """An empty param store and seed 0, and the param store emptied again afterwards."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    yield
    pyro.clear_param_store()


@pytest.fixture
def float64():
    """float64 as torch's default dtype and an empty param store, both put back afterwards."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    pyro.clear_param_store()
    yield
    torch.set_default_dtype(previous)
    pyro.clear_param_store()


@pytest.fixture
def empty_guide():
    """A guide with no sites: every latent of the model is drawn from its prior (or enumerated)."""
    return models.empty_guide


@pytest.fixture
def toy_x():
    """``toy_x(N, seed=0)``: the toy model's data, N points (:func:`models.toy_data`), as a float32 tensor."""

    def make(num_data, seed=0):
        return torch.tensor(models.toy_data(num_data, seed), dtype=torch.float32)

    return make


#: test files that capture or compile steps, run the tutorials or the benchmarks, or sweep fuzz seeds:
#: most of the suite's time. Every other test is marked ``quick`` (``python -m pytest tests -m quick``).
SLOW_FILES = {
    "test_captured_step.py",
    "test_gold_benchmark.py",
    "test_fuzz.py",
    "test_loop_rolling.py",
    "test_tutorials.py",
    "test_compiled.py",
    "test_forward_trace.py",
    "test_hierarchical_benchmark.py",
}


def pytest_collection_modifyitems(config, items):
    """Mark each test ``slow`` or ``quick`` by its file (:data:`SLOW_FILES`)."""
    for item in items:
        item.add_marker(pytest.mark.slow if item.path.name in SLOW_FILES else pytest.mark.quick)
