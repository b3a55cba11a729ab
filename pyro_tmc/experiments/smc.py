"""Sequential Monte Carlo for the toy model: the paper's SMC baseline.

K particles of theta, drawn from Q(theta) = N(0, 1). Data points are absorbed one
at a time: each particle draws its own z_n ~ Q(z_n) = N(0, 2), is weighted by
p(z_n | theta) p(x_n | z_n) / Q(z_n), the mean weight multiplies the evidence
estimate, and the particles are resampled (multinomially) by their weights. The
estimate of p(x) is unbiased (Del Moral 2004). The loop over data points is
what TMC's tensor contraction avoids.
"""

import math

import torch
from torch.distributions import Normal


def smc_log_evidence(x: torch.Tensor, num_particles: int, num_runs: int = 1) -> torch.Tensor:
    """
    :param torch.Tensor x: the data, shape (N,).
    :param int num_particles: K.
    :param int num_runs: independent runs, vectorised.
    :returns: log of the SMC estimate of p(x), one per run (shape ``(num_runs,)``).
    """
    shape = (num_runs, num_particles)
    theta = torch.randn(shape, dtype=x.dtype, device=x.device)
    log_evidence = x.new_zeros(num_runs)
    proposal = Normal(x.new_zeros(()), math.sqrt(2.0))
    for x_n in x:
        z = proposal.sample(shape)
        log_w = Normal(theta, 1.0).log_prob(z) + Normal(z, 1.0).log_prob(x_n) - proposal.log_prob(z)
        log_evidence = log_evidence + torch.logsumexp(log_w, -1) - math.log(num_particles)
        ancestors = torch.multinomial(torch.softmax(log_w, -1), num_particles, replacement=True)
        theta = theta.gather(-1, ancestors)
    return log_evidence
