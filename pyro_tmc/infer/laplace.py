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

The Hessian costs one backward pass per coordinate (:data:`MAX_COORDINATES` bounds it), or, where
the model's structure leaves most of its entries zero (a chain, a plate of locals), a few passes in
all (:mod:`pyro_tmc.infer.sparse_hessian`; a ``vectorized_markov`` chain's band: :class:`ChainBand`); it
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
from pyro_tmc.infer.precision_factor import Factor, precision_factor, tridiagonal_factor
from pyro_tmc.infer.sparse_hessian import HessianPattern, coloured_hessian, hessian_pattern
from pyro_tmc.poutine.sites import structure_trace

#: coordinates above which the Hessian (one backward pass each) is not attempted
MAX_COORDINATES = 3000
#: Newton steps from the start to the mode, at most (each costs a Hessian)
NEWTON_STEPS = 20
#: the first damping of a Newton step that lowers the log density, and how many tenfold raises of it
#: are tried before giving up (:func:`_damped_step`)
FIRST_DAMPING, DAMPINGS = 1e-3, 12
#: joint Newton steps after the locals' conditional mode (:func:`_needs_locals_first`): a funnel's
#: joint density climbs towards its neck at every step, and the conditional approximation stands
FUNNEL_JOINT_STEPS = 8
#: globals at most whose Laplace marginal is computed where the joint density has no mode
#: (:func:`_globals_marginal`: 1 + 2G + G(G-1)/2 conditional modes)
MARGINAL_GLOBALS = 6
#: the finite differences' step, in the globals' current sds: within the posterior, where L is close
#: to quadratic, and far enough for float32 densities of thousands of terms to resolve its curvature
MARGINAL_STEP = 0.5
#: Newton steps of each conditional mode in the finite differences (from a start moved along the
#: mode's response to the globals, which is right to second order)
MARGINAL_NEWTON_STEPS = 4
#: halvings of the Newton step on the globals' marginal before keeping the start
MARGINAL_HALVINGS = 3
#: Newton steps on the globals' marginal at most, each its finite differences anew
#: (:func:`_globals_marginal`); it stops once a step is below :data:`MARGINAL_TOLERANCE` of its sds
MARGINAL_ITERATIONS = 12
MARGINAL_TOLERANCE = 0.2
#: the backward passes the marginal's Newton steps may take together (:func:`_marginal_iterations`)
MARGINAL_BACKWARD_PASSES = 5000


class GaussianApproximation(NamedTuple):
    """
    A Gaussian over every covered site's unconstrained coordinates, in the proposal's layout
    (the globals' sites, then the locals', each site's ``batch_shape + unconstrained_event_shape``
    flattened).

    :ivar torch.Tensor mean: shape ``(N,)``, float64.
    :ivar torch.Tensor covariance: shape ``(N, N)``, float64.
    :ivar float log_density: the log joint density (Jacobians included) at ``mean``.
    :ivar bool at_mode: ``mean`` is the joint density's mode; ``False``: the locals' conditional mode
        given the globals, where the joint has none (a funnel: see :func:`laplace_approximation`).
    :ivar bool marginal_converged: where not ``at_mode``, the globals' Gaussian is their Laplace
        marginal at its mode (:func:`_globals_marginal`'s Newton steps converged).
    """

    mean: torch.Tensor
    covariance: torch.Tensor
    log_density: float
    at_mode: bool = True
    marginal_converged: bool = False


def laplace_approximation(
    model: Callable,
    proposal,
    start: torch.Tensor,
    args: tuple = (),
    kwargs: Optional[dict] = None,
    newton_steps: int = NEWTON_STEPS,
    conditional: bool = True,
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
    :param bool conditional: where the joint density has no mode, return the locals' conditional
        approximation beside the globals' Laplace marginal (``False``: ``None``).
    :returns: the approximation, or ``None`` where it does not exist or is not attempted: a latent
        site the proposal does not cover (a discrete one), more than :data:`MAX_COORDINATES`
        coordinates, a non-finite density, or a Hessian that is not negative definite.
    """
    kwargs = dict(kwargs or {})
    if len(start) > MAX_COORDINATES or not _covers_every_latent(model, proposal, args, kwargs):
        return None

    band = _chain_band(proposal)  # the Hessian's sparsity, where the model is a vectorized chain
    pattern = None
    if band is None:  # else, where the model's structure leaves most entries zero
        pattern = hessian_pattern(model, proposal, split_coordinates(proposal, start), args, kwargs, _scored)
    log_density = LogJoint(model, proposal, args, kwargs, band, pattern)  # a band's pattern: its own

    point, found, joint_steps = start.detach().double(), None, newton_steps
    derivatives = _derivatives(log_density, point)  # at the start: read by the first phase's first step
    if derivatives is None or not _finite(derivatives):
        return None
    locals_first = _locals_mask(proposal)
    if locals_first is not None and _needs_locals_first(log_density, point, derivatives):
        point, value, factor, _ = _mode(log_density, point, newton_steps, locals_first, derivatives)
        derivatives = None  # those of the start, which the locals left
        if point is None:
            return None
        if factor is not None:
            found = ConditionalMode(point, value, factor)
        joint_steps = min(newton_steps, FUNNEL_JOINT_STEPS)
    moved, value, factor, converged = _mode(log_density, point, joint_steps, derivatives=derivatives)
    if factor is not None and (converged or found is None):
        return GaussianApproximation(moved, factor.inverse(), value)
    if found is None or not conditional:
        return None
    scale = proposal.global_proposal.scale_tril.double().diagonal()
    marginal = _globals_marginal(log_density, found, locals_first, scale)
    return _conditional_approximation(proposal, found, locals_first, marginal)


class ConditionalMode(NamedTuple):
    """
    The locals' conditional mode given the globals: the point (the globals where they stand), its log
    density, and the Cholesky factor of the negative Hessian in the locals' coordinates.
    """

    point: torch.Tensor
    value: float
    factor: Factor


class GlobalsMarginal(NamedTuple):
    """
    The globals' Laplace marginal (:func:`_globals_marginal`): their mean and covariance, and the
    locals' conditional mode at that mean.
    """

    mean: torch.Tensor
    covariance: torch.Tensor
    mode: ConditionalMode
    converged: bool = False


def _conditional_approximation(
    proposal, conditional: ConditionalMode, free: torch.Tensor, marginal: Optional[GlobalsMarginal]
) -> GaussianApproximation:
    """
    The locals' Laplace approximation given the globals, beside the globals' own Gaussian, independent
    of each other: where the joint density has no mode (a funnel's neck, where it grows without
    bound), the locals' conditional one still gives them a Gaussian that follows their structure (a
    chain's steps their AR path). The globals' Gaussian is their Laplace marginal where it exists
    (:func:`_globals_marginal`), the locals' mode then taken at its mean; else the globals' own
    proposal (its scale matrix as their covariance).
    """
    if marginal is not None:
        conditional = marginal.mode
    point = conditional.point
    covariance = torch.zeros(len(point), len(point), dtype=point.dtype)
    index = free.nonzero().squeeze(-1)
    covariance[index.unsqueeze(-1), index] = conditional.factor.inverse()
    globals_index = (~free).nonzero().squeeze(-1)
    if marginal is not None:
        globals_covariance = marginal.covariance
    else:
        scale_tril = proposal.global_proposal.scale_tril.double()
        globals_covariance = scale_tril @ scale_tril.T
    covariance[globals_index.unsqueeze(-1), globals_index] = globals_covariance
    converged = marginal is not None and marginal.converged
    return GaussianApproximation(
        point, covariance, conditional.value, at_mode=False, marginal_converged=converged
    )


def _globals_marginal(
    log_density, conditional: ConditionalMode, free: torch.Tensor, scale: torch.Tensor
) -> Optional[GlobalsMarginal]:
    """
    The globals' Laplace marginal, where the joint density has no mode: the log density of the globals
    alone, the locals integrated out by their conditional Laplace approximation,

        L(g) = log p(data, x*(g), g) - 1/2 log det(-H_xx(x*(g), g))        (x*(g): the locals' mode),

    its gradient and Hessian by finite differences at the conditional mode's globals (steps of
    :data:`MARGINAL_STEP` times the globals' sds: ``scale`` at first, then the marginal's own), and
    Newton steps on it (Levenberg-Marquardt's where it is not yet concave, :func:`_marginal_step`;
    halved until L rises), each from differences taken anew, at most :data:`MARGINAL_ITERATIONS` of
    them (fewer where each is costly: :func:`_marginal_iterations`), until a step is below
    :data:`MARGINAL_TOLERANCE` of the sds; the covariance is
    ``-Hessian^-1`` at the last concave one. It is the approximation of Tierney and Kadane (1986) that
    INLA (Rue, Martino and Chopin 2009) uses for its hyperparameters. The log-determinant is what a
    funnel needs: without it (the Schur complement of the joint Hessian alone) a volatility model's
    shock scale curves the wrong way, as the joint density does; with it, on stochastic volatility's
    2,516 days, the three globals' sds came within 5% of the gold's, and from the data's variance and
    a persistence of 0.9 (where L is not concave) four steps reach persistence, mean and shock scale
    within 0.3, 0.08 and 0.06 gold sds of the gold means (the marginal's mode, not its mean). Each
    evaluation finds the locals' mode anew, from the conditional mode moved along how it follows the
    globals (the implicit function theorem, :func:`_locals_response`), in a few Newton steps
    (:func:`chain_mode` on a chain). ``None`` with more than :data:`MARGINAL_GLOBALS` globals, or
    where L is never concave.
    """
    outer = ~free
    num_globals = int(outer.sum())
    if not 0 < num_globals <= MARGINAL_GLOBALS:
        return None
    # on a chain, the same Newton steps on its tridiagonal Hessian: 15 evaluations of stochastic
    # volatility's marginal in 0.5 s, not 35
    chain = chain_derivatives_agree(log_density, conditional.point, free)
    conditional_mode = chain_mode if chain else _mode
    steps, found = MARGINAL_STEP * scale.double(), None
    for _ in range(_marginal_iterations(num_globals, _hessian_passes(log_density, len(free)), chain)):
        response = _locals_response(log_density, conditional, free)
        if response is None:
            return found
        marginal = _marginal_around(log_density, conditional, response, free, conditional_mode)
        gradient, hessian, centre = _finite_differences(marginal, steps)
        if gradient is None:
            return found
        covariance, delta = _marginal_step(gradient, hessian)
        delta, moved = _rising(marginal, delta, centre[0])
        if covariance is not None:
            sds = covariance.diagonal().sqrt()
            steps = MARGINAL_STEP * sds
            mode = centre[1] if moved is None else moved
            found = GlobalsMarginal(mode.point[outer], covariance, mode)
            if bool((delta.abs() <= MARGINAL_TOLERANCE * sds).all()):
                return found._replace(converged=True)  # at L's mode, to a fraction of its sd
        if moved is None:
            return found  # no step raises L: where it stands
        conditional = moved
    return found


def _marginal_around(
    log_density, conditional: ConditionalMode, response, free: torch.Tensor, conditional_mode
):
    """
    ``delta -> (L(g + delta), the locals' conditional mode there)`` around ``conditional``'s globals
    ``g``, each mode found by ``conditional_mode`` from the start moved along ``response`` (``dx*/dg``).
    """
    outer = ~free

    def marginal(delta: torch.Tensor) -> tuple[float, Optional[ConditionalMode]]:
        start = conditional.point.clone()
        start[outer] += delta
        start[free] += response @ delta
        point, value, factor, _ = conditional_mode(log_density, start, MARGINAL_NEWTON_STEPS, free)
        if point is None or factor is None:
            return -math.inf, None
        return value - factor.log_det() / 2, ConditionalMode(point, value, factor)

    return marginal


def _marginal_iterations(num_globals: int, hessian_passes: int, chain: bool) -> int:
    """
    The Newton steps on the globals' marginal affordable in :data:`MARGINAL_BACKWARD_PASSES`: each
    takes ``1 + 2G + G(G-1)/2`` conditional modes of up to ``MARGINAL_NEWTON_STEPS + 1`` Hessians,
    each ``hessian_passes`` backward passes (four on a chain: a gradient and three products). At
    most :data:`MARGINAL_ITERATIONS`: stochastic volatility's 2,516 days and eight schools get 12,
    the unknown-scales walk 5. The 100-day volatility in ``pyro.markov`` (103 coordinates) got none
    row by row: one step cost 5,150 passes (232 s of CPU), and 12 had taken over 40 minutes; its
    sparse Hessian (:mod:`~pyro_tmc.infer.sparse_hessian`) takes 7 passes, and it gets 12.
    """
    evaluations = 1 + 2 * num_globals + num_globals * (num_globals - 1) // 2
    passes = evaluations * (MARGINAL_NEWTON_STEPS + 1) * (4 if chain else hessian_passes)
    return min(MARGINAL_ITERATIONS, MARGINAL_BACKWARD_PASSES // passes)


def _hessian_passes(log_density, num_coordinates: int) -> int:
    """Backward passes :func:`_derivatives` takes for a Hessian (past the gradient's) of ``log_density``."""
    pattern = getattr(log_density, "pattern", None)
    return num_coordinates if pattern is None else pattern.passes


def _rising(marginal, delta: torch.Tensor, value: float):
    """
    The step ``delta`` on the marginal, halved until it rises from ``value`` (at most
    :data:`MARGINAL_HALVINGS` times), and the conditional mode it reaches; ``None`` where none rises.
    """
    for _ in range(MARGINAL_HALVINGS):
        moved, moved_mode = marginal(delta)
        if moved_mode is not None and moved >= value:
            return delta, moved_mode
        delta = delta / 2
    return delta, None


def _marginal_step(gradient: torch.Tensor, hessian: torch.Tensor):
    """
    The covariance ``-H^-1`` of the marginal where its finite-difference Hessian ``H`` is negative
    definite (else ``None``), and a step up it: Newton's there, else Levenberg-Marquardt's (``-H`` plus
    a multiple of its diagonal's magnitude, raised tenfold from a thousandth until positive
    definite), shorter and turned towards the gradient, from a start where L is not yet concave
    (stochastic volatility's globals from the data's variance and a persistence of 0.9).
    """
    cholesky, info = torch.linalg.cholesky_ex(-hessian)
    if info == 0:
        return torch.cholesky_inverse(cholesky), torch.cholesky_solve(
            gradient.unsqueeze(-1), cholesky
        ).squeeze(-1)
    diagonal = torch.diag(hessian.diagonal().abs().clamp(min=1e-12))
    damping = FIRST_DAMPING
    for _ in range(DAMPINGS):
        cholesky, info = torch.linalg.cholesky_ex(-hessian + damping * diagonal)
        if info == 0:
            return None, torch.cholesky_solve(gradient.unsqueeze(-1), cholesky).squeeze(-1)
        damping *= 10
    return None, torch.zeros_like(gradient)


def _locals_response(log_density, conditional: ConditionalMode, free: torch.Tensor) -> Optional[torch.Tensor]:
    """
    How the locals' conditional mode moves with the globals, ``d x* / d g = -H_xx^-1 H_xg`` (the
    implicit function theorem), at the conditional mode: ``(locals, globals)``.
    """
    derivatives = _derivatives(log_density, conditional.point)
    if derivatives is None or not _finite(derivatives):
        return None
    hessian = derivatives[2]
    cross = hessian[free][:, ~free]
    return conditional.factor.solve(cross)  # (-H_xx)^-1 H_xg


def _finite_differences(function, steps: torch.Tensor):
    """
    The gradient and Hessian of ``function`` (returning ``(value, payload)``) at 0 by finite
    differences with ``steps`` per coordinate: central ones for the gradient and the diagonal,
    forward ones for the cross terms (1 + 2G + G(G-1)/2 evaluations). ``(None, None, None)`` where an
    evaluation fails; else also the value and payload at 0.
    """
    num = len(steps)
    centre = function(torch.zeros(num, dtype=steps.dtype))
    if not math.isfinite(centre[0]):
        return None, None, None
    unit = torch.eye(num, dtype=steps.dtype) * steps
    plus = [function(unit[i])[0] for i in range(num)]
    minus = [function(-unit[i])[0] for i in range(num)]
    values = torch.tensor(plus + minus, dtype=steps.dtype)
    if not torch.isfinite(values).all():
        return None, None, None
    plus, minus = values[:num], values[num:]
    gradient = (plus - minus) / (2 * steps)
    hessian = torch.diag((plus - 2 * centre[0] + minus) / steps**2)
    for i in range(num):
        for j in range(i + 1, num):
            both = function(unit[i] + unit[j])[0]
            if not math.isfinite(both):
                return None, None, None
            hessian[i, j] = hessian[j, i] = (both - plus[i] - plus[j] + centre[0]) / (steps[i] * steps[j])
    return gradient, hessian, centre


def _mode(
    log_density,
    point: torch.Tensor,
    steps: int,
    free: Optional[torch.Tensor] = None,
    derivatives: Optional[tuple] = None,
):
    """
    Damped Newton steps (:func:`_damped_step`) in the ``free`` coordinates (a mask; ``None``: all)
    until a Newton step is below a thousandth of the posterior sd in every free coordinate, at most
    ``steps`` of them. ``derivatives``: those at ``point``, if already computed (a Hessian each).

    :returns: the point, its log density, and the Cholesky factor of the negative Hessian in the
        free coordinates (``None`` where the density is not concave there), and whether it
        converged; ``(None, None, None, False)`` where the model rejects a point or its derivatives
        are not finite.
    """
    damping = 0.0
    for step in range(steps + 1):
        if step or derivatives is None:
            derivatives = _derivatives(log_density, point)
        if derivatives is None or not _finite(derivatives):
            return None, None, None, False
        value, gradient, hessian = derivatives
        converged = False
        if free is not None:
            gradient, hessian = _restricted(gradient, hessian, free)
        factor = precision_factor(-hessian)
        if factor is not None:
            direction = factor.solve(gradient)
            converged = bool((direction.abs() < 1e-3 * factor.inverse_diagonal().sqrt()).all())
            if converged:
                break
        if step == steps:
            break
        undamped = factor if damping == 0 else None  # the first try's factor, already found
        moved, damping = _damped_step(
            log_density, point, value, gradient, -hessian, damping, free, factor=undamped
        )
        if moved is None:  # no step raises the density: the approximation where it stands
            break
        point = moved
    return point, value, factor, converged


def _restricted(gradient: torch.Tensor, hessian: torch.Tensor, free: torch.Tensor):
    """The gradient and Hessian in the ``free`` coordinates: a view where they are one block (the locals')."""
    index = free.nonzero().squeeze(-1)
    if len(index) and int(index[-1] - index[0]) + 1 == len(index):
        block = slice(int(index[0]), int(index[-1]) + 1)
        return gradient[block], hessian[block, block]
    return gradient[index], hessian[index][:, index]


def _locals_mask(proposal) -> Optional[torch.Tensor]:
    """The locals' coordinates (the globals' come first), or ``None`` without both kinds."""
    num_globals = proposal.num_globals
    total = num_globals + sum(layout.size for layout in proposal.locals)
    if not num_globals or total == num_globals:
        return None
    return torch.arange(total) >= num_globals


def _needs_locals_first(log_density, point: torch.Tensor, derivatives: tuple) -> bool:
    """
    Whether Newton's step from ``point`` fails to raise the density. A funnel's joint density grows
    without bound towards its neck (stochastic volatility's shock scale to 0 with every day on the
    AR(1) mean path, as a start with every day at one value is), so from such a start the locals
    move to their conditional mode first, the globals fixed, which is away from the neck.
    ``derivatives``: the value, gradient and Hessian at ``point``.
    """
    value, gradient, hessian = derivatives
    moved, damping = _damped_step(log_density, point, value, gradient, -hessian, 0.0, tries=1)
    return moved is None


def _finite(derivatives) -> bool:
    value, gradient, hessian = derivatives
    # one sum, not a mask of the whole Hessian: a NaN or an infinity anywhere makes it non-finite
    sums = float(hessian.sum()) + float(gradient.sum())
    return math.isfinite(value) and math.isfinite(sums)


def _damped_step(
    log_density,
    point: torch.Tensor,
    value: float,
    gradient: torch.Tensor,
    negative_hessian: torch.Tensor,
    damping: float,
    free: Optional[torch.Tensor] = None,
    tries: int = 0,
    factor: Optional[Factor] = None,
):
    """
    One Levenberg-Marquardt step up the log density: the Newton step on the negative Hessian plus
    ``damping`` times its diagonal, the damping raised tenfold (from :data:`FIRST_DAMPING`) until
    the step raises the density, at most :data:`DAMPINGS` times, and lowered tenfold once it does.
    Undamped where the density is concave, it is Newton's step; damped, it is shorter and turns
    towards the gradient, so that a direction the Hessian calls flat (a scale the data pull hard
    on: stochastic volatility's shock scale, 5,000 sds away in one Newton step) is not crossed to
    a funnel's neck, and a point where the density is not concave still moves. A step that leaves
    a distribution's support counts as a fall. Only the ``free`` coordinates (a mask) move, the
    gradient and Hessian given in them; ``tries`` (0: :data:`DAMPINGS`) bounds the dampings tried;
    ``factor``: the undamped negative Hessian's factor, where already found.

    :returns: the new point and damping, or ``(None, damping)`` where no step raises the density.
    """
    diagonal = negative_hessian.diagonal().abs()
    diagonal = torch.diag(diagonal.clamp(min=1e-12 * float(diagonal.max().clamp(min=1e-300))))
    for _ in range(tries or DAMPINGS):
        if damping or factor is None:
            factor = precision_factor(negative_hessian + damping * diagonal)
        if factor is not None:
            step = factor.solve(gradient)
            candidate = point + step if free is None else point.masked_scatter(free, point[free] + step)
            try:
                with torch.no_grad():
                    moved = float(log_density(candidate))
            except (ValueError, RuntimeError):  # out of a distribution's support (a scale of 0.0)
                moved = -math.inf
            if math.isfinite(moved) and moved >= value:
                return candidate, damping / 10 if damping > FIRST_DAMPING else 0.0
        damping = max(10 * damping, FIRST_DAMPING)
    return None, damping


def _value_and_gradient(log_density, u: torch.Tensor):
    """
    ``log_density(u)`` and its gradient, kept differentiable for Hessian-vector products (call under
    grad mode, ``u`` requiring grad), or ``None`` where the model rejects the point.
    """
    try:
        value = log_density(u)
    except (ValueError, RuntimeError):  # a distribution's parameter outside its support
        return None
    (gradient,) = torch.autograd.grad(value, u, create_graph=True)
    return value, gradient


def _derivatives(log_density, point: torch.Tensor) -> Optional[tuple[float, torch.Tensor, torch.Tensor]]:
    """
    The value, gradient and Hessian of ``log_density`` at ``point`` (one backward pass per row), or
    ``None`` where the model rejects the point (a distribution's parameter outside its support).
    """
    u = point.clone().requires_grad_(True)
    with torch.enable_grad():
        first_order = _value_and_gradient(log_density, u)
        if first_order is None:
            return None
        value, gradient = first_order
        pattern = getattr(log_density, "pattern", None)
        sparse = None if pattern is None else coloured_hessian(gradient, u, pattern)
        if sparse is not None:
            return float(value.detach()), gradient.detach(), sparse
        if pattern is not None:  # its structure missed an entry: row by row from now on
            log_density.pattern = None
        rows = []
        for i in range(len(u)):
            (row,) = torch.autograd.grad(gradient[i], u, retain_graph=True, allow_unused=True)
            rows.append(torch.zeros_like(u) if row is None else row)
    hessian = torch.stack(rows).detach()
    return float(value.detach()), gradient.detach(), (hessian + hessian.T) / 2


class ChainBand(NamedTuple):
    """
    Where a chain's Hessian can be non-zero: every global's row and column, and between two chain
    coordinates at most one step apart. ``colours``: per coordinate, -1 for a global, else a colour
    shared by no two chain coordinates that one row can meet (site, step mod 3); ``steps``: per
    coordinate, its step (-1 for a global); ``plan``: per colour, the entries its Hessian-vector
    product fills (:func:`_band_plan`), computed once where given.
    """

    colours: torch.Tensor
    steps: torch.Tensor
    plan: Optional[tuple] = None


def _chain_band(proposal) -> Optional[ChainBand]:
    """The :class:`ChainBand` of a proposal whose every local is a chain's later steps, else ``None``."""
    if not proposal.locals or any(layout.name not in proposal.chain_links for layout in proposal.locals):
        return None
    colours = [torch.full((proposal.num_globals,), -1, dtype=torch.long)]
    steps = [torch.full((proposal.num_globals,), -1, dtype=torch.long)]
    for index, layout in enumerate(proposal.locals):
        step = torch.arange(1, layout.size + 1)  # the later steps: 1 .. T-1, one coordinate each
        steps.append(step)
        colours.append(3 * index + step % 3)
    band = ChainBand(torch.cat(colours), torch.cat(steps))
    return band._replace(plan=_band_plan(band))


def _band_plan(band: ChainBand) -> tuple:
    """
    Per colour of the chain coordinates: the colour, and the rows and columns of the Hessian's
    entries that its Hessian-vector product holds (row r's entry at the one member of the colour
    next to it, on each chain site, at most one step away).
    """
    chain = (band.colours >= 0).nonzero().squeeze(-1)
    plan = []
    for colour in band.colours[chain].unique().tolist():
        members = (band.colours == colour).nonzero().squeeze(-1)
        rows = chain[(band.steps[chain].unsqueeze(-1) - band.steps[members]).abs().min(-1).values <= 1]
        hit_rows, hit_columns = [], []
        for offset in (-1, 0, 1):  # the one member of this colour next to each row, on each site
            target = band.steps[rows] + offset
            for member_steps, member in _by_site(band, members):
                position = torch.searchsorted(member_steps, target).clamp(max=len(member) - 1)
                hit = member_steps[position] == target
                hit_rows.append(rows[hit])
                hit_columns.append(member[position[hit]])
        plan.append((colour, torch.cat(hit_rows), torch.cat(hit_columns)))
    return tuple(plan)


def _banded_hessian(gradient: torch.Tensor, u: torch.Tensor, band: ChainBand) -> Optional[torch.Tensor]:
    """
    The Hessian from a column per global and one Hessian-vector product per colour (7 backward passes
    for a chain with 4 globals, not one per coordinate: 2,519 for stochastic volatility's), each
    chain row's entries read at the steps next to it, which carry distinct colours: the band's
    :func:`band_pattern` through :func:`~pyro_tmc.infer.sparse_hessian.coloured_hessian`, ``None`` (do
    it row by row) where its check disagrees: a model whose chain coordinates meet more than their
    neighbours.
    """
    return coloured_hessian(gradient, u, band_pattern(band))


def band_pattern(band: ChainBand) -> HessianPattern:
    """A chain's band as a :class:`~pyro_tmc.infer.sparse_hessian.HessianPattern`: globals, colours."""
    dense = (band.colours < 0).nonzero().squeeze(-1)
    plan = tuple(
        (band.colours == colour, rows, columns) for colour, rows, columns in band.plan or _band_plan(band)
    )
    return HessianPattern(dense, plan, len(dense) + len(plan) + 1)


def _by_site(band: ChainBand, members: torch.Tensor):
    """The colour's members grouped by chain site (colour // 3), each with its sorted steps."""
    for site in (band.colours[members] // 3).unique().tolist():
        mine = members[band.colours[members] // 3 == site]
        order = band.steps[mine].argsort()
        yield band.steps[mine][order], mine[order]


class LogJoint:
    """
    :func:`log_joint` of ``model`` in ``proposal``'s coordinates, as a function of them alone, with the
    Hessian's sparsity: ``band`` (a :class:`ChainBand`, or ``None``), which :func:`chain_derivatives`
    reads, and ``pattern`` (a :class:`~pyro_tmc.infer.sparse_hessian.HessianPattern`; ``None``: the
    band's, :func:`band_pattern`, else row by row), which :func:`_derivatives` reads.
    """

    def __init__(
        self,
        model: Callable,
        proposal,
        args: tuple,
        kwargs: dict,
        band: Optional[ChainBand],
        pattern: Optional[HessianPattern] = None,
    ) -> None:
        self.model, self.proposal, self.args, self.kwargs, self.band = model, proposal, args, kwargs, band
        self.pattern = band_pattern(band) if pattern is None and band is not None else pattern

    def __call__(self, u: torch.Tensor) -> torch.Tensor:
        return log_joint(self.model, self.proposal, u, self.args, self.kwargs)


class ChainDerivatives(NamedTuple):
    """:func:`chain_derivatives`' answer (see there)."""

    value: float
    gradient: torch.Tensor
    diagonal: torch.Tensor
    above: torch.Tensor
    couplings: torch.Tensor


def chain_derivatives(log_density: LogJoint, point: torch.Tensor) -> Optional[ChainDerivatives]:
    """
    The gradient and the tridiagonal Hessian in the locals' coordinates of a proposal whose locals
    are one chain's later steps (its :class:`ChainBand`, ``log_density.band``), and the Hessian's
    entry between the first later step and the chain's first step (the step before it, a global):
    one backward pass for the gradient and one Hessian-vector product per colour (3), no column per
    global. Every row of the chain meets the one member of a colour next to it, so the colour's
    product holds, at a member's row, its diagonal entry, and at the row before a member, the entry
    between the two. ``None`` where the model rejects the point or a derivative is not finite.

    :returns: a :class:`ChainDerivatives`: the log density, the locals' gradient and the diagonal of
        their Hessian, ``(n,)`` each, its first superdiagonal ``(n - 1,)``, and, per global, the sum of
        its entries with the members of the first later step's colour, ``(G,)``: the entry with the
        first later step alone for the chain's first step (which meets no other later step), not for
        a global that meets every step (a chain's persistence).
    """
    band = log_density.band
    chain = band.colours >= 0
    first = int(chain.nonzero()[0])  # the first later step's coordinate (the globals' come first)
    u = point.clone().requires_grad_(True)
    with torch.enable_grad():
        first_order = _value_and_gradient(log_density, u)
        if first_order is None:
            return None
        value, gradient = first_order
        n = len(u)
        diagonal, above = torch.zeros(n, dtype=u.dtype), torch.zeros(n, dtype=u.dtype)
        coupling = torch.zeros(n, dtype=u.dtype)
        for colour in band.colours[chain].unique().tolist():
            members = band.colours == colour
            (product,) = torch.autograd.grad(gradient, u, grad_outputs=members.to(u.dtype), retain_graph=True)
            product = product.detach()
            diagonal[members] = product[members]
            before = torch.zeros_like(members)
            before[:-1] = members[1:] & chain[:-1]  # rows whose next coordinate is a member
            above[before] = product[before]
            if members[first]:
                coupling = product  # the globals' rows: their entries with the first later step
    gradient, diagonal, above = gradient.detach()[chain], diagonal[chain], above[chain][:-1]
    sums = float(gradient.sum()) + float(diagonal.sum()) + float(above.sum())
    value = float(value.detach())
    if not (math.isfinite(value) and math.isfinite(sums)):
        return None
    return ChainDerivatives(value, gradient, diagonal, above, coupling[~chain])


def chain_derivatives_agree(
    log_density, point: torch.Tensor, free: torch.Tensor, first_index: Optional[int] = None
):
    """
    Whether :func:`chain_derivatives` at ``point`` agrees with the full Hessian there
    (:func:`_derivatives`, itself checked against one more product): the locals' block and, with
    ``first_index`` (the chain's first step among the globals), its entry with the first later step.
    A chain whose steps meet more than their neighbours has entries off the three diagonals.
    """
    if getattr(log_density, "band", None) is None or int((log_density.band.colours >= 0).sum()) != int(
        free.sum()
    ):
        return False
    full = _derivatives(log_density, point)
    chain = chain_derivatives(log_density, point)
    if full is None or chain is None:
        return False
    hessian = full[2]
    locals_block = hessian[free][:, free]
    banded = torch.diag(chain.diagonal) + torch.diag(chain.above, 1) + torch.diag(chain.above, -1)
    scale = float(locals_block.abs().max())
    if not torch.allclose(banded, locals_block, rtol=1e-4, atol=1e-6 * scale):
        return False
    if first_index is None:
        return True
    exact = float(hessian[free][0, ~free][first_index])
    return abs(float(chain.couplings[first_index]) - exact) <= 1e-4 * abs(exact) + 1e-6 * scale


def chain_mode(log_density, point: torch.Tensor, steps: int, free: torch.Tensor):
    """
    :func:`_mode` in the locals' coordinates of a chain (``free``: one chain's later steps, whose
    :func:`chain_derivatives` agree with the full Hessian: :func:`chain_derivatives_agree`): Newton
    steps on the tridiagonal Hessian, each halved until the density rises (at most
    :data:`MARGINAL_HALVINGS` times), until a step is below a thousandth of the conditional sd.
    A gradient and three Hessian-vector products a step, where :func:`_mode` takes one product per
    global more, and a dense Hessian.

    :returns: as :func:`_mode`'s.
    """
    factor, value = None, -math.inf
    for step in range(steps + 1):
        derivatives = chain_derivatives(log_density, point)
        if derivatives is None:
            return None, None, None, False
        value = derivatives.value
        factor = tridiagonal_factor(-derivatives.diagonal, -derivatives.above)
        if factor is None:
            return point, value, None, False
        direction = factor.solve(derivatives.gradient)
        if bool((direction.abs() < 1e-3 * factor.inverse_diagonal().sqrt()).all()):
            return point, value, factor, True
        if step == steps:
            break
        for _ in range(MARGINAL_HALVINGS + 1):
            candidate = point.masked_scatter(free, point[free] + direction)
            try:
                with torch.no_grad():
                    moved = float(log_density(candidate))
            except (ValueError, RuntimeError):
                moved = -math.inf
            if math.isfinite(moved) and moved >= value:
                break
            direction = direction / 2
        else:
            return point, value, factor, False  # no step raises the density: where it stands
        point = candidate
    return point, value, factor, False


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
