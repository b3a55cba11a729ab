"""Adding an estimator or a proposal strategy is one class plus a registry line (docs/extending.md)."""

import math

import pytest
import torch

import pyro
import pyro.distributions as dist

from pyro_tmc import TMC_ELBO
from pyro_tmc.infer.estimators import ESTIMATORS, GradientEstimator, register_estimator
from pyro_tmc.poutine.proposals import PROPOSALS, Diagonal, register_proposal

X = torch.tensor(0.7)


def model():
    z = pyro.sample("z", dist.Normal(0.0, 1.0))
    w = pyro.sample("w", dist.Normal(z, 1.0))
    pyro.sample("x", dist.Normal(w, 1.0), obs=X)


def guide():
    loc = pyro.param("loc", torch.tensor(0.3))
    z = pyro.sample("z", dist.Normal(loc, 1.0))
    pyro.sample("w", dist.Normal(0.5 * z, 1.0))


@pytest.fixture
def registries():
    """Registries as they were before the test."""
    estimators, proposals = dict(ESTIMATORS), dict(PROPOSALS)
    yield
    ESTIMATORS.clear(), ESTIMATORS.update(estimators)
    PROPOSALS.clear(), PROPOSALS.update(proposals)


def test_new_estimator(registries):
    """A registered estimator is taken by name; this one gives the guide no gradient."""

    @register_estimator("model-only")
    class ModelOnly(GradientEstimator):
        def surrogate(self, draw):
            return draw.log_estimate(detach_guide_proposals=True)

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    loss = TMC_ELBO(num_samples=8, max_plate_nesting=0, variance_reduction="model-only").differentiable_loss(
        model, guide
    )
    assert math.isfinite(loss.item())
    loc = pyro.param("loc").unconstrained()
    # the guide's particles still move with loc (reparameterised), its density does not
    (grad,) = torch.autograd.grad(loss, [loc], allow_unused=True)
    assert grad is not None


def test_new_proposal_strategy_is_unbiased(registries):
    """Every particle from upstream particle 0: still E[P_TMC] = p(x) = N(0.7; 0, 3)."""

    @register_proposal("first-parent")
    class FirstParent(Diagonal):
        needs_equal_num_samples = False

        def choose(self, num_parent, shape, device):
            return torch.zeros(shape, dtype=torch.long, device=device)

    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    elbo = TMC_ELBO(num_samples=4, max_plate_nesting=0, proposal="first-parent")
    log_p = torch.stack([elbo.log_evidence(model, guide) for _ in range(1500)]).double()
    truth = dist.Normal(0.0, math.sqrt(3.0)).log_prob(X).double()
    ratio = (log_p - truth).exp()
    mean, se = ratio.mean().item(), (ratio.std() / math.sqrt(len(ratio))).item()
    assert se < 0.05
    assert abs(mean - 1.0) < 5 * se, (mean, se)
