"""A chain's proposal that follows the globals: the days' Laplace approximation given each globals draw.

Where a ``vectorized_markov`` chain has globals besides its first step (stochastic volatility's
persistence, mean and shock scale), :func:`~pyro_tmc.infer.fit.chain_global_samples` gives each TMC
draw one particle of the globals, and the draws' pooling by ``P_TMC`` importance-samples them. The
chain's K particles per step then all sit under one value of the globals, and a proposal for the
steps that ignores it is wrong in a different way at every draw: the posterior path of 2,515 days
moves with the mean and the persistence, and its spread with the shock scale. Measured on stochastic
volatility's 2,516 days at K = 32, under the globals' Laplace marginal (16 draws): the draws'
``log P_TMC`` spread by 2.87 nats with the days' proposal read at the globals' centre, and by 1.89 with
this one.

:class:`ChainConditional` gives, for each globals draw ``g``, the Gaussian chain closest to the steps'
conditional posterior: the steps' conditional mode ``x*(g)`` (started along how the mode follows the
globals, ``dx*/dg`` by the implicit function theorem, then one Newton step) and their tridiagonal
precision ``Q(g)`` (the negative Hessian there). A Gaussian with a tridiagonal precision is a Markov
chain, and its forward conditionals come from the Schur complements ``D_t`` of its later steps, from
the back:

    D_{T-1} = Q_{T-1,T-1},   D_t = Q_{t,t} - Q_{t,t+1}^2 / D_{t+1},
    x_t | x_{t-1} ~ N(x*_t - (Q_{t,t-1} / D_t) (x_{t-1} - x*_{t-1}), 1 / D_t),

the first step's coupling ``Q_{1,0}`` being the one between the chain's first later step and its first
step (a global). These are :class:`~pyro_tmc.infer.chain_proposal.ChainProposal`'s intercepts,
coefficients and scales. Each draw costs one gradient and Hessian of the log joint (four backward passes
on a chain, :func:`~pyro_tmc.infer.laplace.chain_hessian`), O(T) to factor and recurse.

References: Rue and Held (2005) "Gaussian Markov random fields" (chapter 2: a banded precision's
conditionals); Rue, Martino and Chopin (2009), INLA (the latents' Laplace approximation given the
hyperparameters, at each of their values).
"""

import math
from typing import Callable, NamedTuple, Optional

import torch

from pyro import poutine

from pyro_tmc.infer import laplace
from pyro_tmc.infer.precision_factor import tridiagonal_factor


class ChainParameters(NamedTuple):
    """A :class:`~pyro_tmc.infer.chain_proposal.ChainProposal`'s fields, each ``(T - 1,)``."""

    intercept: torch.Tensor
    coefficient: torch.Tensor
    scale: torch.Tensor


class ChainConditional:
    """
    The Gaussian chain of a ``vectorized_markov`` chain's later steps given each draw of the globals
    (see the module docstring).

    :param callable log_density: unconstrained coordinates ``(N,)`` -> the log joint density, with a
        ``band`` attribute (:class:`~pyro_tmc.infer.laplace.ChainBand`).
    :param torch.Tensor centre: the steps' conditional mode at the globals' centre, ``(N,)``.
    :param torch.Tensor free: the locals' coordinates (a mask, ``(N,)``): the chain's later steps.
    :param torch.Tensor response: ``dx*/dg`` at the centre, ``(locals, globals)``.
    :param int first_index: where the chain's first step sits among the globals' coordinates.
    :param str site: the later-steps site.
    :param float widen: the factor on the conditional sds.
    """

    def __init__(
        self,
        log_density: Callable,
        centre: torch.Tensor,
        free: torch.Tensor,
        response: torch.Tensor,
        first_index: int,
        site: str,
        widen: float = 1.0,
    ) -> None:
        self.log_density, self.centre, self.free = log_density, centre, free
        self.response, self.first_index, self.site, self.widen = response, first_index, site, widen

    def parameters(self, globals_flat: torch.Tensor) -> Optional[ChainParameters]:
        """
        The chain's proposal at one draw of the globals (unconstrained, ``(G,)``), or ``None`` where
        the density has no concave conditional there (the caller keeps its constant proposal).
        """
        with torch.no_grad(), poutine.block():
            return self._parameters(globals_flat.detach().double().reshape(-1))

    def _parameters(self, globals_flat: torch.Tensor) -> Optional[ChainParameters]:
        free = self.free
        point = self.centre.clone()
        point[free] += self.response @ (globals_flat - point[~free])
        point[~free] = globals_flat
        derivatives = laplace.chain_derivatives(self.log_density, point)
        if derivatives is None:
            return None
        _, gradient, diagonal, above, couplings = derivatives
        factor = tridiagonal_factor(-diagonal, -above)
        if factor is None:
            return None
        mode = point[free] + factor.solve(gradient)  # one Newton step to the conditional mode
        first = globals_flat[self.first_index : self.first_index + 1]
        intercept, coefficient, variance = forward_conditionals(
            mode, -diagonal, -above, first, -float(couplings[self.first_index])
        )
        return ChainParameters(intercept, coefficient, self.widen * variance.sqrt())


def forward_conditionals(
    mean: torch.Tensor,
    diagonal: torch.Tensor,
    above: torch.Tensor,
    first: torch.Tensor,
    first_coupling: float,
):
    """
    The forward conditionals ``x_t | x_{t-1} ~ N(intercept_t + coefficient_t x_{t-1}, variance_t)`` of
    a Gaussian chain ``N(mean, Q^-1)`` given the step before it, ``first``, at its value: ``Q``
    tridiagonal, its ``diagonal`` ``(n,)`` and superdiagonal ``above`` ``(n - 1,)``, and
    ``first_coupling`` its entry with the step before (module docstring).

    :returns: ``intercept``, ``coefficient``, ``variance``, each ``(n,)``.
    """
    diagonal, above = diagonal.tolist(), above.tolist()
    schur = [0.0] * len(diagonal)
    schur[-1] = diagonal[-1]
    for t in range(len(diagonal) - 2, -1, -1):
        schur[t] = diagonal[t] - above[t] ** 2 / schur[t + 1]
    schur = torch.tensor(schur, dtype=mean.dtype)
    couplings = torch.tensor([first_coupling] + above, dtype=mean.dtype)
    coefficient = -couplings / schur
    previous = torch.cat([first.to(mean.dtype), mean[:-1]])
    return mean - coefficient * previous, coefficient, 1 / schur


def chain_conditional(
    model: Callable, proposal, centre: torch.Tensor, args: tuple, kwargs: dict, widen: float = 1.0
) -> Optional[ChainConditional]:
    """
    The :class:`ChainConditional` of ``proposal``'s chain, from the steps' conditional mode near
    ``centre`` (unconstrained coordinates ``(N,)``, e.g. a Laplace approximation's mean), or ``None``
    where it does not apply: more than one globals particle per draw (``proposal.global_samples``),
    locals other than one chain's later steps, or no concave conditional at the centre.
    """
    if proposal.global_samples != 1 or len(proposal.chain_links) != 1 or not proposal.globals:
        return None
    band = laplace._chain_band(proposal)
    free = laplace._locals_mask(proposal)
    if band is None or free is None:
        return None
    log_density = laplace.LogJoint(model, proposal, args, kwargs, band)
    site, link = next(iter(proposal.chain_links.items()))
    if link.first not in {layout.name for layout in proposal.globals}:
        return None
    first_index = _global_offset(proposal, link.first)
    with torch.no_grad(), poutine.block():
        point, value, factor, _ = laplace._mode(log_density, centre.detach().double(), 2, free)
        if point is None or factor is None:
            return None
        response = laplace._locals_response(log_density, laplace.ConditionalMode(point, value, factor), free)
    if (
        response is None
        or not math.isfinite(float(response.sum()))
        or not laplace.chain_derivatives_agree(log_density, point, free, first_index)
    ):
        return None
    return ChainConditional(log_density, point, free, response, first_index, site, widen)


def _global_offset(proposal, name: str) -> int:
    """Where global site ``name``'s coordinate sits among the globals'."""
    start = 0
    for layout in proposal.globals:
        if layout.name == name:
            return start
        start += layout.size
    raise KeyError(name)
