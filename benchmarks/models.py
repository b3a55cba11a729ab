"""Benchmark models: the paper's toy model with a learnable guide, a non-factorised
Gaussian chain, each in Pyro and (the toy) in hand-written torch TMC."""

import math

import torch
from torch.distributions import Normal

import pyro
import pyro.distributions as dist

from pyro_tmc.experiments.toy import model as toy_model  # noqa: F401  (written once, in the package)

# -- toy model: theta ~ N(0,1), z_n ~ N(theta,1), x_n ~ N(z_n,1) -------------------
# The model is the experiments' own; the guide differs from the experiments' (fixed) proposal:
# it has parameters, so that a step has gradients to compute.


def toy_guide(x):
    loc = pyro.param("loc", lambda: x.new_zeros(2))
    log_scale = pyro.param("log_scale", lambda: x.new_tensor([0.0, 0.5 * math.log(2.0)]))
    pyro.sample("theta", dist.Normal(loc[0], log_scale[0].exp()))
    with pyro.plate("data", x.shape[-1], dim=-1):
        pyro.sample("z", dist.Normal(loc[1], log_scale[1].exp()))


def toy_iwae_guide(x):
    """The same guide for Pyro's vectorised IWAE / RenyiELBO (no particle dims)."""
    toy_guide(x)


def handwritten_tmc_loss(x, loc, log_scale, num_samples):
    """
    -log P_TMC for the toy model, written directly in torch: the reference that
    pyro_tmc is measured against.
    """
    K = num_samples
    q_theta = Normal(loc[0], log_scale[0].exp())
    q_z = Normal(loc[1], log_scale[1].exp())
    theta = q_theta.rsample((K,))  # (K_theta,)
    z = q_z.rsample((K, x.shape[-1]))  # (K_z, N)
    f_theta = Normal(0.0, 1.0).log_prob(theta) - q_theta.log_prob(theta) - math.log(K)
    f_z = (
        Normal(theta[:, None, None], 1.0).log_prob(z)  # (K_theta, K_z, N)
        + Normal(z, 1.0).log_prob(x)
        - q_z.log_prob(z)
        - math.log(K)
    )
    per_theta = torch.logsumexp(f_z, 1).sum(-1) + f_theta  # (K_theta,)
    return -torch.logsumexp(per_theta, 0)


# -- a non-factorised 5-layer Gaussian chain -----------------------------------------


def chain_model(x, depth=5):
    z = x.new_zeros(())
    for i in range(depth):
        z = pyro.sample(f"z{i}", dist.Normal(z, 1.0))
    with pyro.plate("data", x.shape[-1], dim=-1):
        pyro.sample("x", dist.Normal(z, 1.0), obs=x)


def chain_guide(x, depth=5):
    weight = pyro.param("weight", lambda: x.new_full((depth,), 0.5))
    bias = pyro.param("bias", lambda: x.new_zeros(depth))
    z = x.new_zeros(())
    for i in range(depth):
        z = pyro.sample(f"z{i}", dist.Normal(weight[i] * z + bias[i], 1.0))
