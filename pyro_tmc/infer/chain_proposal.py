"""A proposal that follows a ``vectorized_markov`` chain: every step drawn from the step before, all at once.

A ``vectorized_markov`` chain holds all its later steps in one site (``z_slice(1, T, None)``), and TMC
draws K particles of it in one statement. A proposal that is independent over time cannot follow
the chain: its K particles at step t know nothing of the step before's, so each link of the chain
product (a ``(K, K)`` matrix of ``p(z_t | z_{t-1})``) finds few pairs that fit, and the estimate's
variance grows with T. :class:`ChainProposal` draws each particle from a conditional on one
particle of the step before,

    u_t^k ~ N(intercept_t + coefficient_t * u_{t-1}^{a_t(k)}, scale_t^2)    (unconstrained values u),

its ancestor ``a_t(k)`` uniform over the step before's particles (a random permutation, shifted:
each particle of the step before is used about equally), the draws of all T - 1 steps computed
together as a prefix scan of affine maps (``log2(T)`` batched gathers, no loop over time).

Its density is that of a particle given *all* the step before's particles, the uniform mixture

    q(u_t^k) = mean_{k'} N(u_t^k; intercept_t + coefficient_t * u_{t-1}^{k'}, scale_t^2),

which is what makes TMC's estimate unbiased with a proposal that is not factorised (Aitchison
2019, appendix "TMC for non-factorised proposals"; the marginal particle filter of Klaas, de Freitas
and Doucet 2005 weighs its particles by the same mixture). It depends on the particles only, not on
the ancestors drawn, so the density is a plain function of the site's value and the first step's.

Reference: Aitchison, L. (2019) "Tensor Monte Carlo: Particle Methods for the GPU Era", NeurIPS.
"""

import math
from typing import Optional

import torch
from torch.distributions import constraints
from torch.distributions.transforms import Transform, identity_transform

from pyro.distributions import TorchDistribution


class ChainProposal(TorchDistribution):
    """
    The later steps of a univariate chain, each particle drawn from one particle of the step
    before (see the module docstring). Its batch shape is the chain's time dim, ``(T - 1,)``; a
    sample of shape ``(K,)`` is K particles of every step, drawn jointly.

    :param torch.Tensor first: the first step's particles, unconstrained, shape ``(K0,)`` (flat).
    :param torch.Tensor intercept: shape ``(T - 1,)``.
    :param torch.Tensor coefficient: shape ``(T - 1,)``: on the step before's unconstrained value.
    :param torch.Tensor scale: shape ``(T - 1,)``, positive.
    :param Transform transform: unconstrained -> the site's support (``biject_to(support)``).
    """

    arg_constraints: dict = {}
    has_rsample = True

    def __init__(
        self,
        first: torch.Tensor,
        intercept: torch.Tensor,
        coefficient: torch.Tensor,
        scale: torch.Tensor,
        transform: Transform = identity_transform,
        validate_args: Optional[bool] = None,
    ) -> None:
        if first.dim() != 1 or intercept.dim() != 1:
            raise ValueError(
                f"ChainProposal: first must be (K0,) and intercept (T - 1,), got {tuple(first.shape)} "
                f"and {tuple(intercept.shape)}."
            )
        self.first, self.intercept = first, intercept
        self.coefficient, self.scale = coefficient.expand_as(intercept), scale.expand_as(intercept)
        self.transform = transform
        super().__init__(intercept.shape, torch.Size(), validate_args=False)

    @constraints.dependent_property(is_discrete=False, event_dim=0)
    def support(self):
        return self.transform.codomain

    def expand(self, batch_shape, _instance=None):
        if torch.Size(batch_shape) != self.batch_shape:
            raise NotImplementedError(
                f"ChainProposal draws one chain of {self.batch_shape[0]} steps; it cannot be expanded to "
                f"{tuple(batch_shape)}."
            )
        return self

    def rsample(self, sample_shape=()) -> torch.Tensor:
        num = math.prod(sample_shape)
        intercept = self.intercept
        noise = torch.randn((num,) + self.batch_shape, dtype=intercept.dtype, device=intercept.device)
        u = chain_scan(
            self.first,
            self.intercept,
            self.coefficient,
            self.scale.unsqueeze(-1) * noise.T,
            balanced_ancestors(self.first.numel(), num, len(self.intercept), self.intercept.device),
        )
        return self.transform(u.T).reshape(torch.Size(sample_shape) + self.batch_shape)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """
        The mixture density of each particle given all the step before's (module docstring).
        ``value`` holds the K particles along one dim left of the time dim (any other dims of size 1).
        """
        dim = _particle_dim(value)
        u = self.transform.inv(value)
        log_jacobian = self.transform.log_abs_det_jacobian(u, value)
        if dim is None:  # one particle
            flat = u.reshape(1, u.shape[-1])
        else:
            u = u.movedim(dim, 0)
            flat = u.reshape(u.shape[0], u.shape[-1])
        log_q = mixture_log_density(flat, self.first, self.intercept, self.coefficient, self.scale).reshape(
            u.shape
        )
        if dim is not None:
            log_q = log_q.movedim(0, dim)
        return log_q - log_jacobian


def balanced_ancestors(previous: int, num: int, steps: int, device=None) -> torch.Tensor:
    """
    ``(steps, num)`` ancestors: at each step, particle k's ancestor among ``previous`` particles
    of the step before (the first step's count at step 0, ``num`` after it), each uniform (a random
    permutation of ``num``, shifted by a uniform offset, modulo the count) and the step before's
    particles used about equally.
    """
    counts = torch.full((steps, 1), num, device=device)
    counts[0] = previous
    permutations = torch.rand(steps, num, device=device).argsort(-1)
    offsets = (torch.rand(steps, 1, device=device) * counts).long()
    return (permutations + offsets) % counts


def chain_scan(
    first: torch.Tensor,
    intercept: torch.Tensor,
    coefficient: torch.Tensor,
    innovations: torch.Tensor,
    ancestors: torch.Tensor,
) -> torch.Tensor:
    """
    ``u_t^k = intercept_t + coefficient_t * u_{t-1}^{ancestors[t, k]} + innovations[t, k]`` for
    every step t at once, ``u_{-1}`` being ``first``: an inclusive prefix scan (Hillis and Steele
    1986) of the steps' maps ``u -> a * u[index] + b``, which compose as
    ``(index2, a2, b2) o (index1, a1, b1) = (index1[index2], a2 a1[index2], a2 b1[index2] + b2)``.

    :param first: ``(K0,)``. :param intercept, coefficient: ``(T,)``. :param innovations: ``(T, K)``.
    :param ancestors: ``(T, K)`` indices into the step before's particles.
    :returns: ``(T, K)``.
    """
    index = ancestors
    slope = coefficient.unsqueeze(-1).expand(innovations.shape)
    offset = intercept.unsqueeze(-1) + innovations
    span = 1
    while span < len(index):
        # element t now covers the steps (t - span, t]: compose it with the one that ends at t - span
        before_index, before_slope, before_offset = index[:-span], slope[:-span], offset[:-span]
        after_index, after_slope = index[span:], slope[span:]
        offset = torch.cat(
            [offset[:span], after_slope * before_offset.gather(1, after_index) + offset[span:]]
        )
        slope = torch.cat([slope[:span], after_slope * before_slope.gather(1, after_index)])
        index = torch.cat([index[:span], before_index.gather(1, after_index)])
        span *= 2
    return slope * first[index] + offset


def mixture_log_density(
    u: torch.Tensor,
    first: torch.Tensor,
    intercept: torch.Tensor,
    coefficient: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    """
    ``log mean_{k'} N(u[k, t]; intercept_t + coefficient_t * u_{t-1}^{k'}, scale_t^2)`` for every
    particle k and step t, ``u_{t-1}`` being ``first`` at t = 0 and ``u[:, t - 1]`` after it.

    :param u: ``(K, T)``. :param first: ``(K0,)``. :returns: ``(K, T)``.
    """

    def log_mean_normal(values, previous, step):  # values (K, S), previous (K', S): (K, S)
        loc = intercept[step] + coefficient[step] * previous
        z = (values.unsqueeze(1) - loc.unsqueeze(0)) / scale[step]
        log_normal = -0.5 * z.square() - scale[step].log() - 0.5 * math.log(2 * math.pi)
        return torch.logsumexp(log_normal, 1) - math.log(previous.shape[0])

    head = log_mean_normal(u[:, :1], first.unsqueeze(-1).to(u.dtype), slice(0, 1))
    tail = log_mean_normal(u[:, 1:], u[:, :-1], slice(1, None))
    return torch.cat([head, tail], -1)


def _particle_dim(value: torch.Tensor) -> Optional[int]:
    """The one dim left of the time dim along which ``value`` varies (its particles), or ``None``."""
    dims = [d for d in range(-value.dim(), -1) if value.shape[d] > 1]
    if len(dims) > 1:
        raise ValueError(
            f"ChainProposal.log_prob: a value of shape {tuple(value.shape)} varies along several dims "
            f"{dims} left of the time dim; it holds one chain's particles along one dim."
        )
    return dims[0] if dims else None
