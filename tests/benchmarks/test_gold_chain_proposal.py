"""
benchmarks/gold_chain.py's adapted proposal for the stochastic volatility globals has the density it
claims: the auxiliary Student-t's log density plus its Delta sites' log-Jacobians is the density of the
globals under the change of variables, checked against the Jacobian determinant by autograd.
"""

import importlib.util
import os

import pytest
import torch

import pyro

from tests.common import REPO_ROOT


def _load_chain():
    path = os.path.join(REPO_ROOT, "benchmarks", "gold_chain.py")
    spec = importlib.util.spec_from_file_location("gold_chain_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_adapted_proposal_density_is_the_change_of_variables():
    pytest.importorskip("pyro.contrib.funsor")
    chain = _load_chain()
    torch.manual_seed(0)
    center = 7.5
    loc = torch.tensor([3.0, 0.1, -0.7], dtype=torch.float64)
    scale_tril = torch.tensor([[0.8, 0.0, 0.0], [-0.1, 0.3, 0.0], [-0.1, 0.02, 0.25]], dtype=torch.float64)
    days = (torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
    guide = chain.AdaptedChainGuide(loc, scale_tril, center, *days)
    trace = pyro.poutine.trace(guide).get_trace(torch.zeros(3, dtype=torch.float64))
    trace.compute_log_prob()
    values = torch.stack([trace.nodes[name]["value"] for name in chain.GLOBALS])
    claimed = trace.nodes["chain_globals"]["log_prob"] + sum(
        trace.nodes[name]["log_prob"] for name in chain.GLOBALS
    )
    jacobian = torch.autograd.functional.jacobian(lambda x: chain.to_proposal_coordinates(*x, center), values)
    joint = chain.to_proposal_coordinates(*values, center)
    expected = trace.nodes["chain_globals"]["fn"].log_prob(joint) + torch.linalg.det(jacobian).abs().log()
    assert torch.allclose(joint, trace.nodes["chain_globals"]["value"], atol=1e-10)
    assert torch.allclose(claimed, expected, atol=1e-10)
