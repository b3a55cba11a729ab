"""Fixtures shared by the tests. The tests' models and oracles live in tests/models.py, not in
pyro_tmc.experiments: the tests check the package against code of their own."""

import pytest
import torch

import pyro

try:
    from . import models
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    import models


@pytest.fixture
def fresh_pyro():
    """An empty param store and seed 0, and the param store emptied again afterwards."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    yield
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
