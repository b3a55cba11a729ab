"""The installed distribution (``pip install .``, a wheel, or ``pip install -e .``) is this package."""

import importlib.metadata

import pytest

import pyro_tmc


def test_version_matches_the_installed_metadata():
    try:
        installed = importlib.metadata.version("pyro-tmc")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pyro-tmc is not installed: imported from a checkout on the path")
    assert isinstance(pyro_tmc.__version__, str)
    assert installed == pyro_tmc.__version__
