"""Bad input raises a clear error that names the site and the fix."""

import pytest
import torch

import pyro
import pyro.distributions as dist

from pyro_tmc import TMC_ELBO
from pyro_tmc.poutine import tmc


def model():
    z0 = pyro.sample("z0", dist.Normal(0.0, 1.0))
    z1 = pyro.sample("z1", dist.Normal(z0, 1.0))
    pyro.sample("x", dist.Normal(z1, 1.0), obs=torch.tensor(0.5))


def guide():
    z0 = pyro.sample("z0", dist.Normal(0.0, 1.0))
    pyro.sample("z1", dist.Normal(z0, 1.0), infer={"num_samples": 3})


@pytest.mark.parametrize("bad", [0, -2, 2.5, "8", True])
def test_bad_num_samples(bad):
    with pytest.raises(ValueError, match="positive integer"):
        TMC_ELBO(num_samples=bad)
    with pytest.raises(ValueError, match="positive integer"):
        tmc(num_samples=bad)


def test_bad_per_site_num_samples_names_site():
    def bad_guide():
        pyro.sample("z0", dist.Normal(0.0, 1.0), infer={"num_samples": 0})
        pyro.sample("z1", dist.Normal(0.0, 1.0))

    with pytest.raises(ValueError, match="Site 'z0'.*positive integer"):
        TMC_ELBO(max_plate_nesting=0).loss(model, bad_guide)


def test_unknown_proposal_and_variance_reduction():
    with pytest.raises(ValueError, match="Unknown proposal 'nearest'"):
        TMC_ELBO(proposal="nearest")
    with pytest.raises(ValueError, match="Unknown variance_reduction 'rao'"):
        TMC_ELBO(variance_reduction="rao")


@pytest.mark.parametrize("proposal", ["diagonal", "permutation"])
def test_mismatched_particle_counts_name_site(proposal):
    elbo = TMC_ELBO(num_samples=4, max_plate_nesting=0, proposal=proposal)
    with pytest.raises(ValueError, match=r"Site 'z1' draws 3 particles.*\[4\].*mixture"):
        elbo.loss(model, guide)
    # the mixture allows it
    assert torch.isfinite(torch.tensor(TMC_ELBO(num_samples=4, max_plate_nesting=0).loss(model, guide)))


def test_too_many_particle_dims_suggests_markov():
    def long_chain():
        z = torch.tensor(0.0)
        for i in range(70):
            z = pyro.sample(f"z_{i}", dist.Normal(z, 1.0))
        pyro.sample("x", dist.Normal(z, 1.0), obs=torch.tensor(0.0))

    def no_guide():
        pass

    with pytest.raises(ValueError, match="Site 'z_6[0-9]'.*pyro.markov"):
        TMC_ELBO(num_samples=2, max_plate_nesting=0).loss(long_chain, no_guide)


def test_nan_factor_names_site():
    def nan_model():
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample(
            "x", dist.Normal(z, torch.tensor(float("nan")), validate_args=False), obs=torch.tensor(0.0)
        )

    def z_guide():
        pyro.sample("z", dist.Normal(0.0, 1.0))

    with pytest.raises(ValueError, match="site 'x' contains NaN"):
        TMC_ELBO(max_plate_nesting=0).loss(nan_model, z_guide)


def test_impossible_factor_names_site():
    def bounded_model():
        z = pyro.sample("z", dist.Uniform(0.0, 1.0))
        pyro.sample("x", dist.Normal(z, 1.0), obs=torch.tensor(0.0))

    def outside_guide():
        pyro.sample("z", dist.Uniform(2.0, 3.0))

    refused = pytest.raises(ValueError, match="site 'z' is -inf for every particle")
    with pyro.validation_enabled(False), refused:
        TMC_ELBO(max_plate_nesting=0).loss(bounded_model, outside_guide)


def test_sequential_enumeration_without_support_is_refused():
    """Sequential enumeration is summed in parallel; a site with nothing to enumerate is refused."""

    def seq_model():
        pyro.sample("c", dist.Normal(0.0, 1.0), infer={"enumerate": "sequential"})

    with pytest.raises(ValueError, match="Site 'c'.*no finite support"):
        TMC_ELBO(max_plate_nesting=0).loss(seq_model, lambda: None)
