"""A Laplace approximation of a model's posterior, as a start for :class:`AdaptiveProposal`.

Importance sampling's weights degrade exponentially with the dimension of what is proposed jointly:
a Gaussian proposal too narrow by a few percent in each of 100 directions already leaves a handful
of effective particles. Population Monte Carlo refits the globals' covariance from the weighted
particles of a round, and with fewer effective particles than globals that estimate is
rank-deficient, so the next round is narrower still and the rounds collapse (measured: a 40-dim
linear-Gaussian global, starting from a trained ``AutoNormal``, fell to one effective draw in four
rounds; item response theory's 101 globals ended with a k-hat of 11). A start that is already
close in every direction is what those models need, and the weighted particles cannot give it.

The Laplace approximation can: a Gaussian at the posterior mode whose precision is the negative
Hessian of the log joint density, every covered site's unconstrained coordinates together (the
globals' and the locals', in the proposal's own layout), found by a few Newton steps from a start
(a trained ``AutoNormal``'s locations). For a linear-Gaussian model it is the exact posterior. From
it, :func:`gaussian_proposals` reads the proposal family's closest members exactly, with no
sampling: the globals' marginal mean and covariance, and each local's Gaussian conditional given
its regressors (the globals and its parents), whose mean is affine in them and whose variance is
the conditional one.

The Hessian costs one backward pass per coordinate (:data:`MAX_COORDINATES` bounds it), and it
exists only for a log density that is twice differentiable at the start and concave enough there:
where it is not (a funnel's neck, a flat direction), :func:`laplace_approximation` returns ``None``
and the caller keeps its start.

Reference: Tierney and Kadane (1986) "Accurate approximations for posterior moments and marginal
densities"; for adaptive importance sampling started from it, Geweke (1989) "Bayesian inference in
econometric models using Monte Carlo integration".
"""

import math
from typing import Callable, NamedTuple, Optional

import torch

from pyro import poutine

from pyro_tmc.infer.chain_proposal import chain_scan
from pyro_tmc.poutine.sites import structure_trace

#: coordinates above which the Hessian (one backward pass each) is not attempted
MAX_COORDINATES = 3000
#: Newton steps from the start to the mode (each costs a Hessian)
NEWTON_STEPS = 8
#: backtracking halvings of a Newton step that lowers the log density
HALVINGS = 6


class GaussianApproximation(NamedTuple):
    """
    A Gaussian over every covered site's unconstrained coordinates, in the proposal's layout
    (the globals' sites, then the locals', each site's ``batch_shape + unconstrained_event_shape``
    flattened).

    :ivar torch.Tensor mean: shape ``(N,)``, float64.
    :ivar torch.Tensor covariance: shape ``(N, N)``, float64.
    :ivar float log_density: the log joint density (Jacobians included) at ``mean``.
    """

    mean: torch.Tensor
    covariance: torch.Tensor
    log_density: float


def laplace_approximation(
    model: Callable,
    proposal,
    start: torch.Tensor,
    args: tuple = (),
    kwargs: Optional[dict] = None,
    newton_steps: int = NEWTON_STEPS,
) -> Optional[GaussianApproximation]:
    """
    The Laplace approximation of ``model``'s posterior over the sites ``proposal`` covers, from
    Newton steps started at ``start``.

    :param callable model: the Pyro model.
    :param AdaptiveProposal proposal: whose layout the coordinates follow.
    :param torch.Tensor start: unconstrained coordinates, shape ``(N,)`` (:func:`proposal_mean`).
    :param tuple args: the model's arguments.
    :param dict kwargs: its keyword arguments.
    :param int newton_steps: at most this many steps towards the mode.
    :returns: the approximation, or ``None`` where it does not exist or is not attempted: a latent
        site the proposal does not cover (a discrete one), more than :data:`MAX_COORDINATES`
        coordinates, a non-finite density, or a Hessian that is not negative definite.
    """
    kwargs = dict(kwargs or {})
    if len(start) > MAX_COORDINATES or not _covers_every_latent(model, proposal, args, kwargs):
        return None

    def log_density(u: torch.Tensor) -> torch.Tensor:
        return log_joint(model, proposal, u, args, kwargs)

    point = start.detach().double()
    for step in range(newton_steps + 1):
        at_point = _concave_at(log_density, point)
        if at_point is None:
            return None
        value, gradient, cholesky = at_point
        if step == newton_steps:
            break
        direction = torch.cholesky_solve(gradient.unsqueeze(-1), cholesky).squeeze(-1)
        moved = _backtracked(log_density, point, direction, value)
        if moved is None:
            break
        point = moved
        # a step below a thousandth of the posterior sd in every coordinate: at the mode
        sds = torch.cholesky_inverse(cholesky).diagonal().sqrt()
        if bool((direction.abs() < 1e-3 * sds).all()):
            at_point = _concave_at(log_density, point)
            if at_point is None:
                return None
            value, gradient, cholesky = at_point
            break
    return GaussianApproximation(point, torch.cholesky_inverse(cholesky), value)


def _concave_at(log_density, point: torch.Tensor) -> Optional[tuple[float, torch.Tensor, torch.Tensor]]:
    """
    The value, the gradient and the Cholesky factor of the negative Hessian at ``point``, or
    ``None`` where the density is rejected, not finite, or not concave there.
    """
    derivatives = _derivatives(log_density, point)
    if derivatives is None:
        return None
    value, gradient, hessian = derivatives
    if not (math.isfinite(value) and torch.isfinite(hessian).all() and torch.isfinite(gradient).all()):
        return None
    cholesky, info = torch.linalg.cholesky_ex(-hessian)
    return None if info != 0 else (value, gradient, cholesky)


def _backtracked(log_density, point, direction, value) -> Optional[torch.Tensor]:
    """``point + t * direction`` for the largest ``t`` in 1, 1/2, ... that raises the density, or ``None``."""
    fraction = 1.0
    for _ in range(HALVINGS):
        candidate = point + fraction * direction
        try:
            with torch.no_grad():
                moved = float(log_density(candidate))
        except (ValueError, RuntimeError):
            # a step far enough to leave a distribution's support (a scale of exp(-200) == 0.0 is
            # rejected by its constraint): as if the density there were -inf
            moved = -math.inf
        if math.isfinite(moved) and moved >= value:
            return candidate
        fraction /= 2
    return None


def _derivatives(log_density, point: torch.Tensor) -> Optional[tuple[float, torch.Tensor, torch.Tensor]]:
    """
    The value, gradient and Hessian of ``log_density`` at ``point`` (one backward pass per row), or
    ``None`` where the model rejects the point (a distribution's parameter outside its support).
    """
    u = point.clone().requires_grad_(True)
    with torch.enable_grad():
        try:
            value = log_density(u)
        except (ValueError, RuntimeError):
            return None
        (gradient,) = torch.autograd.grad(value, u, create_graph=True)
        rows = []
        for i in range(len(u)):
            (row,) = torch.autograd.grad(gradient[i], u, retain_graph=True, allow_unused=True)
            rows.append(torch.zeros_like(u) if row is None else row)
    hessian = torch.stack(rows).detach()
    return float(value.detach()), gradient.detach(), (hessian + hessian.T) / 2


def log_joint(model: Callable, proposal, u: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    """
    The model's log joint density at unconstrained coordinates ``u`` (shape ``(N,)``), with each
    site's log-Jacobian: the density of the coordinates themselves. A ``vectorized_markov`` chain's
    previous steps are its first step's value and its later steps' without the last, and are not
    scored (as ``vectorized_markov`` marks them).
    """
    values, log_jacobian = {}, u.new_zeros(())
    for name, coordinates in split_coordinates(proposal, u).items():
        layout = proposal.layouts[name]
        value = layout.transform(coordinates.to(torch.get_default_dtype()))
        values[name] = value
        log_jacobian = log_jacobian + layout.transform.log_abs_det_jacobian(coordinates, value).sum().double()
    for current, link in proposal.chain_links.items():
        values[link.previous] = torch.cat([values[link.first].reshape(1), values[current][:-1]])
    trace = poutine.trace(poutine.condition(model, values)).get_trace(*args, **kwargs)
    return trace.log_prob_sum(_scored).double() + log_jacobian


def _scored(name: str, site) -> bool:
    return not site["infer"].get("_do_not_score")


def split_coordinates(proposal, u: torch.Tensor) -> dict[str, torch.Tensor]:
    """Coordinates ``(..., N)`` -> covered site -> ``(...) + batch_shape + unconstrained_event_shape``."""
    sites, start = {}, 0
    for layout in proposal.globals + proposal.locals:
        part = u[..., start : start + layout.size]
        sites[layout.name] = part.reshape(
            u.shape[:-1] + layout.batch_shape + layout.unconstrained_event_shape
        )
        start += layout.size
    return sites


def _covers_every_latent(model, proposal, args, kwargs) -> bool:
    trace = structure_trace(model, args, kwargs)
    previous_steps = {link.previous for link in proposal.chain_links.values()}  # set by log_joint
    latent = [
        name
        for name, site in trace.nodes.items()
        if site["type"] == "sample" and not site["is_observed"] and hasattr(site["fn"], "batch_shape")
    ]
    return all(name in proposal.layouts or name in previous_steps for name in latent)


def proposal_mean(proposal) -> torch.Tensor:
    """
    The proposal's mean in every covered coordinate, ``(N,)``: the globals' location, then each
    local's location at its regressors' means (its parents' means, computed first: the locals are
    in the model's order).
    """
    means = {}
    globals_loc = proposal.global_proposal.loc.double() if proposal.globals else torch.zeros(0)
    start = 0
    for layout in proposal.globals:
        means[layout.name] = globals_loc[start : start + layout.size].reshape(layout.batch_shape + (-1,))
        start += layout.size
    for layout in proposal.locals:
        local = proposal.local_proposals[layout.name]
        loc = local.intercept.double()
        if local.follows_previous and local.coefficients is not None:  # the chain's means, step by step
            first = means[proposal.chain_links[layout.name].first].reshape(1)
            steps = loc.reshape(-1)
            loc = chain_scan(
                first,
                steps,
                local.coefficients.double().reshape(-1),
                torch.zeros_like(steps).unsqueeze(-1),
                torch.zeros(len(steps), 1, dtype=torch.long),
            ).reshape(loc.shape)
        elif local.coefficients is not None:
            parts = [globals_loc.expand(layout.batch_shape + globals_loc.shape)]
            parts += [
                means[p].expand(layout.batch_shape + means[p].shape[-1:])
                for p in proposal.parents[layout.name]
            ]
            regressors = torch.cat(parts, -1)
            loc = loc + (local.coefficients.double() @ regressors.unsqueeze(-1)).squeeze(-1)
        means[layout.name] = loc.expand(layout.batch_shape + loc.shape[-1:])
    return torch.cat([means[layout.name].reshape(-1) for layout in proposal.globals + proposal.locals])


def gaussian_proposals(
    proposal, approximation: GaussianApproximation, widen_globals: float, widen_locals: float
):
    """
    The members of ``proposal``'s family closest to a Gaussian over its coordinates: the globals'
    marginal (mean, Cholesky factor of the covariance times ``widen_globals``), and each local's
    conditional given its regressors, per element (intercept, coefficients, conditional sd times
    ``widen_locals``); a ``vectorized_markov`` chain's later steps
    (:attr:`~pyro_tmc.infer.adaptive_proposal.AdaptiveProposal.chain_links`) given the step before alone.

    :returns: ``(loc, scale_tril)`` of the globals (or ``None`` without globals), and local site ->
        ``(intercept, coefficients, scale)`` with the shapes of :class:`LocalProposal`'s fields.
    """
    mean, covariance = approximation.mean, approximation.covariance
    offsets, start = {}, 0
    for layout in proposal.globals + proposal.locals:
        offsets[layout.name] = start
        start += layout.size
    num_globals = sum(layout.size for layout in proposal.globals)
    globals_index = torch.arange(num_globals)
    global_part = None
    if num_globals:
        block = covariance[globals_index][:, globals_index]
        global_part = (mean[globals_index], widen_globals * torch.linalg.cholesky(block))
    locals_part = {}
    for layout in proposal.locals:
        target = _element_index(layout, offsets[layout.name], layout.batch_shape)  # S + (D,)
        link = proposal.chain_links.get(layout.name)
        if link is not None:  # a chain's later steps given the step before: the first step's, then their own
            previous = torch.cat([torch.tensor([[offsets[link.first]]]), target[:-1]])
            locals_part[layout.name] = _conditional(mean, covariance, target, previous, widen_locals)
            continue
        parents = [
            _element_index(proposal.layouts[p], offsets[p], layout.batch_shape)
            for p in proposal.parents[layout.name]
        ]
        regressors = torch.cat(
            [globals_index.expand(layout.batch_shape + (num_globals,))] + parents, -1
        )  # S + (R,)
        locals_part[layout.name] = _conditional(mean, covariance, target, regressors, widen_locals)
    return global_part, locals_part


def _element_index(layout, offset: int, batch_shape: torch.Size) -> torch.Tensor:
    """The coordinates of each element of ``layout``'s site, broadcast: ``batch_shape + (D,)``."""
    index = offset + torch.arange(layout.size).reshape(layout.batch_shape + (layout.event_size,))
    return index.expand(batch_shape + (layout.event_size,))


def _conditional(mean, covariance, target, regressors, widen: float):
    """
    Per element, the Gaussian conditional of the ``target`` coordinates (``S + (D,)``) given the
    ``regressors`` (``S + (R,)``): intercept ``S + (D,)``, coefficients ``S + (D, R)`` (``None`` for
    R = 0) and sd ``S + (D,)`` times ``widen``.
    """
    target_mean = mean[target]
    target_variance = covariance[target, target]  # S + (D,)
    if regressors.shape[-1] == 0:
        return target_mean, None, widen * target_variance.sqrt()
    cross = covariance[target.unsqueeze(-1), regressors.unsqueeze(-2)]  # S + (D, R)
    gram = covariance[regressors.unsqueeze(-1), regressors.unsqueeze(-2)]  # S + (R, R)
    cholesky = torch.linalg.cholesky(gram)
    coefficients = torch.cholesky_solve(cross.transpose(-1, -2), cholesky).transpose(-1, -2)  # S + (D, R)
    intercept = target_mean - (coefficients @ mean[regressors].unsqueeze(-1)).squeeze(-1)
    explained = (coefficients * cross).sum(-1)
    variance = (target_variance - explained).clamp(min=1e-12 * target_variance.clamp(min=1e-300))
    return intercept, coefficients, widen * variance.sqrt()
