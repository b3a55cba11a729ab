"""A proposal for any Pyro model that can be moved onto TMC's weighted posterior draws.

:class:`AdaptiveProposal` is built from one prior trace of the model. It covers the model's
continuous latent sites (not observed; discrete sites and sites marked for enumeration are left
to TMC, which enumerates them or draws them from the prior), everything in each site's
unconstrained space (``biject_to(support)``), event dims flattened:

- the *globals* (sites in no plate and in no ``pyro.markov`` context) are one auxiliary site,
  their unconstrained values concatenated, drawn from a multivariate Student-t (heavy tails, so
  that the importance weights stay bounded where the posterior's tails are heavier than a
  Normal's) or a multivariate Normal, and unpacked into the model's sites by ``Delta`` sites that
  carry each map's log-Jacobian (as :class:`pyro.infer.autoguide.AutoMultivariateNormal` unpacks
  its draws). A ``Delta`` has no particle dim of its own under TMC, so all globals share the
  auxiliary site's one particle dim: correlated globals are proposed jointly, K combinations, not
  K^n;
- every other site (in a plate, or a step of a ``pyro.markov`` chain) is a Normal per element
  whose location is affine in the unconstrained values of the globals and of the site's latent
  prior parents, and whose log-scale is affine in the globals',

      q(z | parents, globals) = N(a + B [globals, parents], exp(c + d globals)^2),

  so that a chain's proposal follows the chain, q(z_t | z_{t-1}, globals), and a funnel's locals
  (eight schools' effects given their group's log sd) widen and narrow with the global scale
  (:class:`LogScaleRegression`; the scale is constant where the draws cannot support the fit).
  TMC draws such a site through its non-factorised proposals (:mod:`pyro_tmc.poutine.proposals`),
  its density correct for the bound;
- the later steps of a ``vectorized_markov`` chain (one site for all of them: univariate, in no
  plate but the time dim), once fitted to draws that hold the step before, follow the chain:
  q(z_t | z_{t-1}) drawn from one particle of the step before
  (:class:`~pyro_tmc.infer.chain_proposal.ChainProposal`), rather than each step on its own,
  which a long chain's TMC estimate cannot afford.

The guide runs the model itself, with each covered site's distribution replaced by its proposal
and every other site hidden, so plates (same name, size and dim), ``pyro.markov`` contexts and the
model's control flow are the model's own, whatever the model. For a linear-Gaussian model this
family holds the exact posterior (a Gaussian over the globals; each local's posterior conditional
given its parents and the globals is Gaussian and affine in them, its scale constant), so
:meth:`AdaptiveProposal.fitted` on exact posterior draws converges to it.

References: Cappe, Guillin, Marin and Robert (2004) "Population Monte Carlo" (moving a proposal
onto weighted draws); Aitchison (2019) "Tensor Monte Carlo", appendix on non-factorised proposals.
"""

import functools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
from torch.distributions import biject_to
from torch.distributions.transforms import ComposeTransform, IndependentTransform, Transform

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.distributions.util import sum_rightmost
from pyro.infer.inspect import TrackProvenance
from pyro.ops.provenance import get_provenance
from pyro.poutine.block_messenger import BlockMessenger
from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import Message

from pyro_tmc._pyro import messengers_inside
from pyro_tmc.estimate.vectorized_markov import find_time_links
from pyro_tmc.infer.chain_proposal import ChainProposal
from pyro_tmc.poutine.sites import plate_nesting

#: the auxiliary site that holds the globals' unconstrained values
GLOBALS_SITE = "_adaptive_globals"
#: the default degrees of freedom of the globals' Student-t (measured: see ``fitted``)
DEFAULT_DF = 5.0
#: ridge on the regressors' weighted covariance, relative to its diagonal
RIDGE = 1e-6
#: the effective number of weighted draws needed per regression coefficient; below it a site's
#: proposal is fitted to its plain weighted moments (no regression on its parents)
MIN_ESS_PER_COEFFICIENT = 10.0
#: a local's log-scale is held within this many of its sds (over the fitted draws) of its value at
#: the globals' mean: beyond, the fit saw few draws (see :class:`LogScaleRegression`)
LOG_SCALE_BOUND_SDS = 3.0
#: the heteroscedastic fit's rounds, at most, and its Fisher-scoring steps of the log-scale in each;
#: it stops when no log-scale coefficient moved more than the tolerance in a round (measured on a
#: funnel, eight schools' y with tau unknown, 20,000 weighted draws: 3-10 rounds)
MAX_HETEROSCEDASTIC_ROUNDS, SCORING_STEPS, HETEROSCEDASTIC_TOLERANCE = 10, 2, 1e-3
#: a Fisher-scoring step that lowers the likelihood is halved up to this many times, then not taken
STEP_HALVINGS = 4
#: the smallest eigenvalue of the globals' weighted correlation matrix for a scale to follow them
MIN_GLOBALS_EIGENVALUE = 1e-6
#: the most globals a local's scale follows: a funnel's scales are a few globals, and the fit costs
#: G^2 per element and needs 10 G effective draws more (item response theory's 101 globals: its
#: 400 students' scales stay constant)
MAX_SCALE_GLOBALS = 8


@dataclass(frozen=True)
class SiteLayout:
    """
    Where a covered site's unconstrained values sit.

    :param str name: the site.
    :param Transform transform: ``biject_to(support)``: unconstrained -> constrained.
    :param torch.Size batch_shape: the site's batch shape in the prior trace (its plates).
    :param torch.Size event_shape: its constrained event shape.
    :param torch.Size unconstrained_event_shape: its unconstrained event shape.
    """

    name: str
    transform: Transform
    batch_shape: torch.Size
    event_shape: torch.Size
    unconstrained_event_shape: torch.Size

    @property
    def event_size(self) -> int:
        """The number of unconstrained coordinates per element (D)."""
        return math.prod(self.unconstrained_event_shape)

    @property
    def size(self) -> int:
        """The number of unconstrained coordinates of the whole site (its batch included)."""
        return math.prod(self.batch_shape) * self.event_size

    def unconstrained(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (constrained, any leading dims) -> unconstrained, event dims flattened to one (D)."""
        u = self.transform.inv(value)
        event_ndim = len(self.unconstrained_event_shape)
        return u.reshape(u.shape[: u.dim() - event_ndim] + (self.event_size,))


@dataclass(frozen=True)
class GlobalProposal:
    """
    The globals' joint proposal in their unconstrained coordinates.

    :param torch.Tensor loc: shape ``(G,)``.
    :param torch.Tensor scale_tril: shape ``(G, G)``: the Cholesky factor of the Student-t's scale
        matrix (the Normal's covariance, when ``df`` is ``None``).
    :param df: the Student-t's degrees of freedom, or ``None`` for a Normal.
    """

    loc: torch.Tensor
    scale_tril: torch.Tensor
    df: Optional[float]

    def distribution(self) -> dist.TorchDistribution:
        if self.df is None:
            return dist.MultivariateNormal(self.loc, scale_tril=self.scale_tril)
        return dist.MultivariateStudentT(self.df, self.loc, self.scale_tril)


@dataclass(frozen=True)
class LogScaleRegression:
    """
    How a local site's proposal scale follows the globals' unconstrained values ``g`` (G of them),
    per element of its batch shape S and coordinate (D):

        log scale(g) = log scale + clamp(slopes @ (g - centre), -bound, bound).

    In a funnel (eight schools' effects given their group's log sd; a chain's steps given its
    innovations' scale) a local's conditional posterior sd grows with a global scale, about as a
    power of it: the log-scale is about affine in that global's log. The clamp holds the scale
    where the fit saw few draws (a Student-t global's tail particles), at its value ``bound`` away.

    :param torch.Tensor slopes: shape ``S + (D, G)``.
    :param torch.Tensor centre: shape ``S + (G,)``: the globals' weighted mean in the fit, where the
        scale is the proposal's ``scale``.
    :param torch.Tensor bound: shape ``S + (D,)``: the largest change of the log-scale,
        :data:`LOG_SCALE_BOUND_SDS` of its sds over the fitted draws.
    """

    slopes: torch.Tensor
    centre: torch.Tensor
    bound: torch.Tensor

    def log_factor(self, globals_values: torch.Tensor) -> torch.Tensor:
        """
        The log of the scale's factor at ``globals_values`` (``... + S + (G,)``): ``... + S + (D,)``.
        """
        dtype = globals_values.dtype
        deviations = (globals_values - self.centre.to(dtype)).unsqueeze(-1)
        offset = (self.slopes.to(dtype) @ deviations).squeeze(-1)
        bound = self.bound.to(dtype)
        return torch.minimum(torch.maximum(offset, -bound), bound)


@dataclass(frozen=True)
class LocalProposal:
    """
    One local site's conditional proposal, per element of its batch shape S (D coordinates, R
    regressors: the globals' G, then each parent's):

        u ~ N(intercept + coefficients @ regressors, scale(globals)^2),

    the scale constant, or following the globals (``log_scale``).

    :param torch.Tensor intercept: shape ``S + (D,)``.
    :param torch.Tensor coefficients: shape ``S + (D, R)``, or ``None``: no regression.
    :param torch.Tensor scale: shape ``S + (D,)``: the scale (at the globals' fitted centre, when
        ``log_scale`` is given).
    :param LogScaleRegression log_scale: how the scale follows the globals; ``None``: constant.
    :param bool follows_previous: the site is a ``vectorized_markov`` chain's later steps and its one
        regressor is the step before (:attr:`AdaptiveProposal.chain_links`): it is drawn as a
        :class:`~pyro_tmc.infer.chain_proposal.ChainProposal`.
    """

    intercept: torch.Tensor
    coefficients: Optional[torch.Tensor]
    scale: torch.Tensor
    log_scale: Optional[LogScaleRegression] = None
    follows_previous: bool = False


class LocalDraws(NamedTuple):
    """
    Weighted draws of one local site with its regressors, what its fit reads.

    :ivar torch.Tensor values: unconstrained values, ``(N,) + S + (D,)``.
    :ivar torch.Tensor regressors: ``(N,) + S + (R,)`` (the globals' coordinates, then each
        parent's), or ``None``.
    :ivar torch.Tensor weights: normalised over the N draws, ``(N,)`` or ``(N,) + S`` (per element).
    """

    values: torch.Tensor
    regressors: Optional[torch.Tensor]
    weights: torch.Tensor


class AdaptiveProposal:
    """
    A guide for any Pyro model (see the module docstring): the globals one Student-t (or Normal),
    every other continuous latent a Normal whose location is affine in its parents' and the
    globals' unconstrained values, and whose log-scale is affine in the globals'. Use it as the
    guide of a :class:`~pyro_tmc.TMC_ELBO` read-out; move it onto the posterior with :meth:`fitted`
    (one step) or :func:`pyro_tmc.infer.adaptation.adapt` (rounds of population Monte Carlo).

    Example::

        proposal = AdaptiveProposal(model, data, init=trained_auto_normal)
        proposal = adapt(model, proposal, data, num_samples=64)
        moments = posterior_moments(TMC_ELBO(num_samples=64), model, proposal, data)

    :param callable model: the Pyro model.
    :param args: its arguments (one prior trace is taken with them).
    :param float df: the globals' Student-t degrees of freedom; ``None``: a multivariate Normal.
    :param init: a trained :class:`pyro.infer.autoguide.AutoNormal` to start from (its per-site
        locations and scales); ``None``: the moments of ``num_prior_draws`` prior draws (each local
        regressed on its parents, so a chain starts at its prior conditional).
    :param int num_prior_draws: prior draws for the start when ``init`` is ``None``.
    :param int global_samples: the globals' K (the auxiliary site's ``infer["num_samples"]``);
        ``None``: the loss's K.
    :param int max_plate_nesting: the model's plate dims; ``None``: read from the prior trace.
    :param bool scales_follow_globals: fit each local's log-scale affine in the globals where its
        draws support it (:class:`LogScaleRegression`); ``False``: constant scales.
    :param kwargs: the model's keyword arguments.
    """

    def __init__(
        self,
        model: Callable,
        *args,
        df: Optional[float] = DEFAULT_DF,
        init=None,
        num_prior_draws: int = 1000,
        global_samples: Optional[int] = None,
        max_plate_nesting: Optional[int] = None,
        scales_follow_globals: bool = True,
        **kwargs,
    ) -> None:
        self.model = model
        self.scales_follow_globals = scales_follow_globals
        self.global_samples = global_samples
        #: what :func:`~pyro_tmc.infer.adaptation.adapt` measured in each round (empty if not adapted)
        self.history: list = []
        trace, parents = _prior_trace_with_parents(model, args, kwargs)
        self.max_plate_nesting = plate_nesting(trace) if max_plate_nesting is None else max_plate_nesting
        self.globals: list[SiteLayout] = []
        self.locals: list[SiteLayout] = []
        for site in trace.nodes.values():
            if _is_covered(site):
                _check_not_subsampled(site)
                layout = _layout(site)
                (self.locals if _is_local(site) else self.globals).append(layout)
        #: covered site -> where its unconstrained values sit
        self.layouts: dict[str, SiteLayout] = {layout.name: layout for layout in self.globals + self.locals}
        local_names = {layout.name for layout in self.locals}
        #: local site -> the local latents among its prior parents whose batch shapes broadcast to its own
        self.parents: dict[str, tuple[str, ...]] = {
            layout.name: tuple(
                p for p in parents[layout.name] if p in local_names and self._broadcasts(p, layout)
            )
            for layout in self.locals
        }
        #: a ``vectorized_markov`` chain's later-steps site -> its first step's site and its previous
        #: steps' (the regressor of a proposal that follows the chain)
        self.chain_links: dict[str, ChainLink] = _chain_links(trace, self.layouts, local_names)
        self.global_proposal: Optional[GlobalProposal] = None
        self.local_proposals: dict[str, LocalProposal] = {}
        #: where set, a chain's proposal at each globals draw, read from its Laplace approximation given
        #: them (:mod:`pyro_tmc.infer.chain_conditional`), in place of its constant one
        self.chain_conditional = None
        if init is not None:
            self._start_from_auto_normal(init, df)
        else:
            start = self._fitted_to_prior(model, args, kwargs, num_prior_draws, df)
            self.global_proposal, self.local_proposals = start.global_proposal, start.local_proposals

    # -- structure ---------------------------------------------------------------------------

    @property
    def covered(self) -> list[str]:
        """The model's sites this proposal draws (the rest are TMC's to enumerate or draw)."""
        return [layout.name for layout in self.globals + self.locals]

    @property
    def num_globals(self) -> int:
        """G: the globals' unconstrained coordinates."""
        return sum(layout.size for layout in self.globals)

    def _layout_of(self, name: str) -> SiteLayout:
        return self.layouts[name]

    def _broadcasts(self, parent: str, layout: SiteLayout) -> bool:
        try:
            shape = torch.broadcast_shapes(self._layout_of(parent).batch_shape, layout.batch_shape)
        except RuntimeError:
            return False
        return shape == layout.batch_shape

    def num_regressors(self, name: str) -> int:
        """R of a local site: the globals' coordinates, then each parent's per element."""
        return self.num_globals + sum(self._layout_of(p).event_size for p in self.parents[name])

    def _copy(self, global_proposal: GlobalProposal, local_proposals: dict) -> "AdaptiveProposal":
        """A proposal with this one's structure and the given parameters (``history`` not copied)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.global_proposal, new.local_proposals, new.history = global_proposal, dict(local_proposals), []
        return new

    # -- starting points ---------------------------------------------------------------------

    def _start_from_auto_normal(self, guide, df: Optional[float]) -> None:
        """Each site's unconstrained location and scale from a trained ``AutoNormal``, no regression."""
        locs, scales = [], []
        for layout in self.globals:
            locs.append(_deep_getattr(guide.locs, layout.name).detach().reshape(-1))
            scales.append(_deep_getattr(guide.scales, layout.name).detach().reshape(-1))
        loc = torch.cat(locs) if locs else torch.zeros(0)
        self.global_proposal = GlobalProposal(loc, torch.diag_embed(torch.cat(scales) if scales else loc), df)
        for layout in self.locals:
            shape = layout.batch_shape + (layout.event_size,)
            loc = _deep_getattr(guide.locs, layout.name).detach()
            scale = _deep_getattr(guide.scales, layout.name).detach()
            self.local_proposals[layout.name] = LocalProposal(
                loc.reshape(shape), None, scale.expand(loc.shape).reshape(shape)
            )

    def _fitted_to_prior(
        self, model, args, kwargs, num_draws: int, df: Optional[float]
    ) -> "AdaptiveProposal":
        """The proposal fitted to ``num_draws`` prior draws of the model (equal weights, not widened)."""
        self.global_proposal = GlobalProposal(torch.zeros(self.num_globals), torch.eye(self.num_globals), df)
        if not self.covered:
            return self
        samples = _prior_samples(model, args, kwargs, num_draws, self.max_plate_nesting, self.covered)
        log_weights = torch.zeros(len(next(iter(samples.values()))), dtype=torch.float64)
        return self.fitted(samples, log_weights, widen_globals=1.0, widen_locals=1.0)

    # -- moving it -----------------------------------------------------------------------------

    def fitted(
        self,
        samples: dict[str, torch.Tensor],
        log_weights: torch.Tensor,
        widen_globals: float = 1.0,
        widen_locals: float = 1.0,
        regress: bool = True,
        global_samples: Optional[dict[str, torch.Tensor]] = None,
        global_log_weights: Optional[torch.Tensor] = None,
    ) -> "AdaptiveProposal":
        """
        A new proposal moved to weighted draws (this one is left as it is):

        - the globals: their weighted mean and full covariance (Cholesky-factored with a small
          jitter), the Student-t's scale matrix that covariance times ``widen_globals ** 2``;
        - each local site, per element: weighted least squares of its unconstrained value on
          ``[1, globals, parents]`` (batched over its elements, with a small ridge), the scale the
          residual sd (corrected for the fitted coefficients) times ``widen_locals``. Where the
          weights' effective sample size is under :data:`MIN_ESS_PER_COEFFICIENT` per coefficient,
          or ``regress`` is false, the site's plain weighted mean and sd instead;
        - where the draws support it (``scales_follow_globals``, at most :data:`MAX_SCALE_GLOBALS`
          globals, and that many effective draws per coefficient of the log-scale too), the
          location and a log-scale affine in the globals fitted jointly by weighted maximum
          likelihood (:func:`_heteroscedastic_fit`), the scale then constant beyond
          :data:`LOG_SCALE_BOUND_SDS` of the log-scale's sds.

        :param dict samples: site name -> constrained values, shape ``(N,) +`` the site's shape,
            every covered site drawn jointly (e.g. :meth:`pyro_tmc.infer.draw.TMCDraw.sample`).
        :param torch.Tensor log_weights: shape ``(N,)``, unnormalised.
        :param float widen_globals: the factor on the globals' sd.
        :param float widen_locals: the factor on each local's residual sd.
        :param bool regress: fit the locals' regressions (else their moments alone).
        :param dict global_samples: if given, the globals are fitted to these weighted draws
            instead (site -> constrained values ``(M,) +`` shape): e.g. every particle of the
            globals' one particle dim with its marginal weight, which holds more distinct values
            than joint draws do.
        :param torch.Tensor global_log_weights: their log weights, shape ``(M,)``.
        :rtype: AdaptiveProposal
        """
        weights = torch.softmax(log_weights.double(), 0)
        columns = {name: self._unconstrained_samples(name, samples[name]) for name in self.covered}
        if global_samples is None:
            global_flat, global_weights = self._global_columns(columns), weights
        else:
            global_weights = torch.softmax(global_log_weights.double(), 0)
            global_flat = self._global_columns(
                {g.name: self._unconstrained_samples(g.name, global_samples[g.name]) for g in self.globals}
            )
        local_draws = {
            layout.name: LocalDraws(
                columns[layout.name], self._fit_regressors(layout, columns, regress), weights
            )
            for layout in self.locals
        }
        return self.fitted_to_weighted(global_flat, global_weights, local_draws, widen_globals, widen_locals)

    def _fit_regressors(self, layout: SiteLayout, columns: dict, regress: bool) -> Optional[torch.Tensor]:
        """A local's regressors in :meth:`fitted`: a chain's step before, else the globals and its parents."""
        if not regress:
            return None
        link = self.chain_links.get(layout.name)
        if link is not None:  # the first step's value, then the later steps' without the last
            first = columns[link.first].reshape(-1, 1, 1)
            return torch.cat([first, columns[layout.name][:, :-1]], 1)
        return self._regressors(layout, columns) if self.num_regressors(layout.name) else None

    def fitted_to_weighted(
        self,
        global_values: Optional[torch.Tensor],
        global_weights: Optional[torch.Tensor],
        local_draws: dict[str, LocalDraws],
        widen_globals: float = 1.0,
        widen_locals: float = 1.0,
    ) -> "AdaptiveProposal":
        """
        :meth:`fitted`, from weighted draws already in the proposal's coordinates, each site with
        draws of its own: e.g. every particle combination of a TMC draw's factor over a local site,
        its parents and the globals, with its joint posterior weight
        (:func:`pyro_tmc.infer.adaptation.adapt`'s ``"factors"`` read-out).

        :param torch.Tensor global_values: the globals' unconstrained coordinates, ``(M, G)``.
        :param torch.Tensor global_weights: their weights, ``(M,)``, summing to 1.
        :param dict local_draws: local site -> its :class:`LocalDraws`.
        :rtype: AdaptiveProposal
        """
        global_proposal = self.global_proposal
        if self.globals:
            global_proposal = _fitted_globals(
                global_values, global_weights, widen_globals, global_proposal.df
            )
        local_proposals = {
            name: self._fitted_local(name, draws, widen_locals) for name, draws in local_draws.items()
        }
        return self._copy(global_proposal, local_proposals)

    def _fitted_local(self, name: str, draws: LocalDraws, widen: float) -> LocalProposal:
        """One local's fit; a chain's later steps regressed on the step before alone (``chain_links``)."""
        if name not in self.chain_links:
            num_globals = self.num_globals if self.scales_follow_globals else 0
            return _fitted_local(draws.values, draws.regressors, draws.weights, widen, num_globals)
        if draws.regressors is None:
            return _fitted_local(draws.values, None, draws.weights, widen)
        return _fitted_chain(draws.values, draws.regressors, draws.weights, widen)

    def _global_columns(self, columns: dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """The globals' unconstrained draws concatenated: ``(N, G)``."""
        if not self.globals:
            return None
        return torch.cat([columns[g.name].reshape(columns[g.name].shape[0], -1) for g in self.globals], -1)

    def fitted_to_gaussian(
        self,
        approximation,
        widen_globals: float = 1.0,
        widen_locals: float = 1.0,
        df: Optional[float] = DEFAULT_DF,
    ) -> "AdaptiveProposal":
        """
        A new proposal read exactly from a Gaussian over every covered coordinate (a
        :class:`~pyro_tmc.infer.laplace.GaussianApproximation`, e.g. the Laplace approximation):
        the globals its marginal, each local its Gaussian conditional given the globals and its
        parents (:func:`~pyro_tmc.infer.laplace.gaussian_proposals`), no sampling.

        :param float widen_globals: the factor on the globals' sds.
        :param float widen_locals: the factor on each local's conditional sd.
        :param df: the globals' Student-t degrees of freedom, or ``None`` for a Normal.
        """
        from pyro_tmc.infer.laplace import gaussian_proposals

        global_part, locals_part = gaussian_proposals(self, approximation, widen_globals, widen_locals)
        global_proposal = self.global_proposal
        if global_part is not None:
            global_proposal = GlobalProposal(global_part[0].to(_dtype()), global_part[1].to(_dtype()), df)
        local_proposals = {
            name: LocalProposal(
                intercept.to(_dtype()),
                None if coefficients is None else coefficients.to(_dtype()),
                scale.to(_dtype()),
                follows_previous=name in self.chain_links and coefficients is not None,
            )
            for name, (intercept, coefficients, scale) in locals_part.items()
        }
        return self._copy(global_proposal, local_proposals)

    def fitted_to_moments(
        self,
        global_samples: Optional[dict[str, torch.Tensor]],
        global_log_weights: Optional[torch.Tensor],
        local_moments: dict[str, tuple[torch.Tensor, torch.Tensor]],
        widen_globals: float = 1.0,
        widen_locals: float = 1.0,
    ) -> "AdaptiveProposal":
        """
        A new proposal from what TMC's marginals give, where joint draws cost too much: the
        globals from their weighted joint particles (all globals share one particle dim, so their
        marginal weights are their joint's), each local from its unconstrained mean and sd alone
        (no regression on its parents).

        :param dict global_samples: global site -> constrained particles, shape ``(N,) +`` its shape.
        :param global_log_weights: shape ``(N,)``.
        :param dict local_moments: local site -> (mean, sd) of its unconstrained values, each
            shape ``S + (D,)``.
        """
        global_proposal = self.global_proposal
        if self.globals:
            flat = self._global_columns(
                {g.name: self._unconstrained_samples(g.name, global_samples[g.name]) for g in self.globals}
            )
            weights = torch.softmax(global_log_weights.double(), 0)
            global_proposal = _fitted_globals(flat, weights, widen_globals, global_proposal.df)
        local_proposals = {
            name: LocalProposal(mean.to(_dtype()), None, widen_locals * sd.to(_dtype()).clamp(min=1e-6))
            for name, (mean, sd) in local_moments.items()
        }
        return self._copy(global_proposal, local_proposals)

    def _unconstrained_samples(self, name: str, values: torch.Tensor) -> torch.Tensor:
        """Constrained draws ``(N,) + shape`` -> unconstrained ``(N,) + S + (D,)`` in float64."""
        layout = self._layout_of(name)
        values = values.reshape((values.shape[0],) + layout.batch_shape + layout.event_shape)
        return layout.unconstrained(values.double())

    def _regressors(self, layout: SiteLayout, columns: dict[str, torch.Tensor]) -> torch.Tensor:
        """Shape ``(N,) + S + (R,)``: the globals' coordinates, then each parent's, at each element."""
        num = next(iter(columns.values())).shape[0]
        parts = [columns[g.name].reshape(num, -1) for g in self.globals]
        flat = (
            [torch.cat(parts, -1).reshape((num,) + (1,) * len(layout.batch_shape) + (-1,))] if parts else []
        )
        flat += [columns[p] for p in self.parents[layout.name]]
        return _concatenated(flat, (num,) + layout.batch_shape)

    # -- the guide -------------------------------------------------------------------------------

    def __call__(self, *args, **kwargs) -> None:
        globals_flat = None
        if self.globals:
            infer = {"is_auxiliary": True}
            if self.global_samples:
                infer["num_samples"] = self.global_samples
            globals_flat = pyro.sample(GLOBALS_SITE, self.global_proposal.distribution(), infer=infer)
        chain_parameters = {}
        conditional = getattr(self, "chain_conditional", None)  # None on a proposal pickled before it
        if conditional is not None and globals_flat.numel() == self.num_globals:
            # one globals particle: the chain's proposal given it (None where it has no concave conditional)
            parameters = conditional.parameters(globals_flat)
            if parameters is not None:
                chain_parameters[conditional.site] = parameters
        covered = set(self.covered)
        # Validation off: the model runs here only to place the covered sites' draws; what it computes
        # from sites nobody proposes (a vectorized_markov chain's previous steps, drawn from their
        # prior) is never scored, and a prior draw can reach a scale of 0.0 that a constraint rejects.
        # The model's own run under TMC validates every value it scores.
        # The model stops after the last covered site: what follows (the likelihood's 41 million
        # logits of item response theory, a third of a draw) is not the guide's to compute.
        try:
            with ProposalMessenger(self, globals_flat, chain_parameters), pyro.validation_enabled(False):
                poutine.block(self.model, hide_fn=lambda msg: msg["name"] not in covered)(*args, **kwargs)
        except AllProposed:
            pass

    def global_value(self, layout: SiteLayout, globals_flat: torch.Tensor) -> dist.Delta:
        """The ``Delta`` of global site ``layout`` at the auxiliary site's value, with its log-Jacobian."""
        start = 0
        for g in self.globals:
            if g.name == layout.name:
                break
            start += g.size
        u = globals_flat[..., start : start + layout.size]
        unconstrained_shape = layout.batch_shape + layout.unconstrained_event_shape
        u = u.reshape(_trimmed(u.shape[:-1], len(layout.batch_shape)) + unconstrained_shape)
        value = layout.transform(u)
        log_density = layout.transform.inv.log_abs_det_jacobian(value, u)
        event_dim = len(layout.event_shape)
        log_density = sum_rightmost(log_density, event_dim - layout.transform.codomain.event_dim)
        return dist.Delta(value, log_density=log_density, event_dim=event_dim)

    def chain_distribution(
        self, layout: SiteLayout, first_value: torch.Tensor, parameters=None
    ) -> ChainProposal:
        """
        A chain's later steps that follow the step before, from the first step's particles' values;
        ``parameters`` (a :class:`~pyro_tmc.infer.chain_conditional.ChainParameters`): in place of
        the site's constant intercepts, coefficients and scales.
        """
        proposal = self.local_proposals[layout.name]
        if parameters is not None:
            dtype = proposal.intercept.dtype
            proposal = LocalProposal(
                parameters.intercept.to(dtype), parameters.coefficient.to(dtype), parameters.scale.to(dtype)
            )
        first_layout = self.layouts[self.chain_links[layout.name].first]
        first = first_layout.unconstrained(first_value).reshape(-1)
        if first.numel() != max(first_value.shape, default=1):
            raise ValueError(
                f"Site '{layout.name}': the first step's value has shape {tuple(first_value.shape)}; a "
                "proposal that follows the chain reads its particles along one dim."
            )
        intercept, coefficient = proposal.intercept.reshape(-1), proposal.coefficients.reshape(-1)
        first = first.to(intercept.dtype)
        return ChainProposal(first, intercept, coefficient, proposal.scale.reshape(-1), layout.transform)

    def local_distribution(self, layout: SiteLayout, regressors: Optional[torch.Tensor]):
        """The proposal of a local site given its regressors' values (``... + S + (R,)``)."""
        proposal = self.local_proposals[layout.name]
        loc = proposal.intercept
        if proposal.coefficients is not None and regressors is not None:
            coefficients = proposal.coefficients.to(regressors.dtype)
            loc = loc.to(regressors.dtype) + (coefficients @ regressors.unsqueeze(-1)).squeeze(-1)
        event = layout.unconstrained_event_shape
        loc = loc.reshape(loc.shape[:-1] + event)
        scale = proposal.scale.to(loc.dtype)
        if proposal.log_scale is not None and regressors is not None:
            scale = scale * proposal.log_scale.log_factor(regressors[..., : self.num_globals]).exp()
        scale = scale.reshape(scale.shape[:-1] + event)
        base = dist.Normal(loc, scale).to_event(len(event))
        if _is_identity(layout.transform):
            return base  # a Normal TMC can index by ancestors ("thin" sampling)
        return dist.TransformedDistribution(base, [layout.transform])


class ProposalMessenger(Messenger):
    """
    Replaces each covered site's distribution by its proposal while the guide runs the model
    (every other site is hidden by ``poutine.block``), and keeps the values drawn so far, which
    the later sites' proposals are conditioned on.
    """

    def __init__(
        self, proposal: AdaptiveProposal, globals_flat: Optional[torch.Tensor], chain_parameters=None
    ) -> None:
        super().__init__()
        self.proposal = proposal
        self.globals_flat = globals_flat
        self.chain_parameters = chain_parameters or {}
        self.layouts = proposal.layouts
        self.is_global = {layout.name for layout in proposal.globals}
        self.values: dict[str, torch.Tensor] = {}

    def _pyro_sample(self, msg: Message) -> None:
        layout = self.layouts.get(msg["name"])
        if layout is None:
            return
        if len(self.values) == len(self.layouts) - 1 and layout.name not in self.values and self._can_stop():
            _stop_after(msg)
        scope = msg["infer"].get("_markov_scope")
        if scope is not None:
            # the model's markov contexts saw the sites this guide hides (observations): TMC never
            # does, and must find in a site's scope only the sites it has seen
            msg["infer"] = dict(msg["infer"])
            msg["infer"]["_markov_scope"] = Counter({n: c for n, c in scope.items() if n in self.layouts})
        if layout.name in self.is_global:
            msg["fn"] = self.proposal.global_value(layout, self.globals_flat)
            return
        local = self.proposal.local_proposals[layout.name]
        if local.follows_previous and local.coefficients is not None:
            first = self.values[self.proposal.chain_links[layout.name].first]
            msg["fn"] = self.proposal.chain_distribution(
                layout, first, self.chain_parameters.get(layout.name)
            )
            return
        msg["fn"] = self.proposal.local_distribution(layout, self._regressors(layout))

    def _can_stop(self) -> bool:
        """
        Whether the model can stop here (:func:`_stop_after`): only within plates and the guide's
        block, whose ``with`` blocks unwind at once. A loop of ``pyro.markov`` or ``vectorized_markov``
        is a generator whose messenger would leave the stack only when it is collected, and funsor's
        dims with it, in the middle of whatever runs then.
        """
        return all(type(inner) in (BlockMessenger, pyro.plate) for inner in messengers_inside(self))

    def _pyro_post_sample(self, msg: Message) -> None:
        if msg["name"] in self.layouts:
            self.values[msg["name"]] = msg["value"]

    def _regressors(self, layout: SiteLayout) -> Optional[torch.Tensor]:
        if self.proposal.local_proposals[layout.name].coefficients is None:
            return None
        parts = []
        if self.globals_flat is not None:
            # its leading dims hold a 1 at every plate slot already (or none, outside TMC)
            parts.append(self.globals_flat)
        parts += [self.layouts[p].unconstrained(self.values[p]) for p in self.proposal.parents[layout.name]]
        return _concatenated(parts, layout.batch_shape)


class AllProposed(Exception):
    """Every covered site is drawn: the guide's run of the model stops (:func:`_stop_after`)."""


def _stop_after(msg: Message) -> None:
    """
    Stop the model once every messenger has processed ``msg``'s site: its continuation, which Pyro
    calls after the last postprocess, raises :class:`AllProposed` (each messenger's ``__exit__``
    takes it off the stack on the way out).
    """
    previous = msg.get("continuation")

    def stop(msg: Message) -> None:
        if previous is not None:
            previous(msg)
        raise AllProposed

    msg["continuation"] = stop


# -- fitting -------------------------------------------------------------------------------------


def _fitted_globals(flat: torch.Tensor, weights: torch.Tensor, widen: float, df) -> GlobalProposal:
    """The weighted mean and covariance of ``flat`` (``(N, G)``), its Cholesky factor widened."""
    mean = weights @ flat
    deviations = flat - mean
    covariance = (weights[:, None] * deviations).T @ deviations
    covariance = covariance / (1 - weights.square().sum()).clamp(min=1e-3)  # the weighted unbiased form
    jitter = 1e-8 * covariance.diagonal().mean().clamp(min=1e-12) + 1e-12
    scale_tril = torch.linalg.cholesky(covariance + jitter * torch.eye(len(mean), dtype=covariance.dtype))
    return GlobalProposal(mean.to(_dtype()), (widen * scale_tril).to(_dtype()), df)


def _fitted_local(
    values: torch.Tensor,
    regressors: Optional[torch.Tensor],
    weights: torch.Tensor,
    widen: float,
    num_globals: int = 0,
) -> LocalProposal:
    """
    Weighted least squares of ``values`` (``(N,) + S + (D,)``) on ``[1, regressors]``
    (``(N,) + S + (R,)``), per element, or the weighted moments where there are too few draws.
    ``weights``: ``(N,)`` or ``(N,) + S``, summing to 1 over N. With ``num_globals`` (G, the first
    regressors), the scale follows the globals where the draws support it and there are at most
    :data:`MAX_SCALE_GLOBALS` of them (:func:`_heteroscedastic_fit`).
    """
    w = weights.to(values.dtype)
    w = w.reshape(w.shape + (1,) * (values.dim() - w.dim()))  # (N,) + S-or-ones + (1,)
    mean = (w * values).sum(0)
    centred = values - mean
    effective = 1 / w.square().sum(0)  # S-or-ones + (1,)
    fewest = float(effective.min())
    num_coefficients = 1 + (0 if regressors is None else regressors.shape[-1])
    too_few = fewest < MIN_ESS_PER_COEFFICIENT * num_coefficients
    if regressors is None or regressors.shape[-1] == 0 or too_few:
        variance = (w * centred.square()).sum(0) / max(1 - 1 / fewest, 1e-3)
        return LocalProposal(mean.to(_dtype()), None, (widen * variance.sqrt()).clamp(min=1e-6).to(_dtype()))
    regressors = regressors.to(values.dtype)
    intercept, coefficients, residuals = _weighted_least_squares(values, regressors, w)
    correction = max(1 - num_coefficients / fewest, 1e-3)  # residual variance's degrees of freedom
    log_scale = 0.5 * ((w * residuals.square()).sum(0) / correction).log()
    scale_regression = None
    follows = 0 < num_globals <= MAX_SCALE_GLOBALS
    if follows and fewest >= MIN_ESS_PER_COEFFICIENT * (num_coefficients + num_globals):
        fit = _heteroscedastic_fit(values, regressors, w, num_globals, effective, residuals)
        if fit is not None:
            kept, het_intercept, het_coefficients, het_log_scale, scale_regression = fit
            intercept = torch.where(kept, het_intercept, intercept)
            coefficients = torch.where(kept.unsqueeze(-1), het_coefficients, coefficients)
            log_scale = torch.where(kept, het_log_scale - 0.5 * math.log(correction), log_scale)
    scale = (widen * log_scale.exp()).clamp(min=1e-6)
    if scale_regression is not None:
        scale_regression = LogScaleRegression(*(t.to(_dtype()) for t in scale_regression))
    return LocalProposal(
        intercept.to(_dtype()), coefficients.to(_dtype()), scale.to(_dtype()), scale_regression
    )


def _fitted_chain(values: torch.Tensor, regressors: torch.Tensor, weights: torch.Tensor, widen: float):
    """
    A chain's later steps regressed on the step before, per step (``values`` and ``regressors``
    ``(N, S, 1)``, ``weights`` ``(N,)`` or ``(N, S)``): a step whose weights hold too few effective
    draws for the regression (:data:`MIN_ESS_PER_COEFFICIENT` per coefficient) gets its weighted
    moments and no coefficient, which :class:`ChainProposal` draws as a step on its own. One such
    step does not cost the others theirs: a 2,516-day chain always has a few.
    """
    w = weights.to(values.dtype)
    w = w.reshape(w.shape + (1,) * (values.dim() - w.dim()))  # (N, S, 1)
    effective = 1 / w.square().sum(0)  # (S, 1)
    mean = (w * values).sum(0)
    variance = (w * (values - mean).square()).sum(0) / (1 - 1 / effective).clamp(min=1e-3)
    intercept, coefficients, residuals = _weighted_least_squares(values, regressors.to(values.dtype), w)
    correction = (1 - 2 / effective).clamp(min=1e-3)
    residual_variance = (w * residuals.square()).sum(0) / correction
    regress = (
        (effective >= 2 * MIN_ESS_PER_COEFFICIENT) & intercept.isfinite() & coefficients.isfinite().all(-1)
    )
    intercept = torch.where(regress, intercept, mean)
    coefficients = torch.where(regress.unsqueeze(-1), coefficients, torch.zeros_like(coefficients))
    scale = (widen * torch.where(regress, residual_variance, variance).sqrt()).clamp(min=1e-6)
    return LocalProposal(
        intercept.to(_dtype()), coefficients.to(_dtype()), scale.to(_dtype()), follows_previous=True
    )


def _weighted_least_squares(values: torch.Tensor, regressors: torch.Tensor, weights: torch.Tensor):
    """
    Weighted least squares of ``values`` (``(N,) + S + (D,)``) on ``[1, regressors]``
    (``(N,) + S + (R,)``) per element, with a small ridge; ``weights`` broadcast to ``(N,) + S + (D,)``
    (one set per coordinate, or shared).

    :returns: the intercept ``S + (D,)``, the coefficients ``S + (D, R)``, the residuals ``(N,) + S + (D,)``.
    """
    w = weights.unsqueeze(-1) / weights.sum(0, keepdim=True).unsqueeze(-1)  # (N,) + S' + (D', 1)
    x, y = regressors.unsqueeze(-2), values.unsqueeze(-1)  # (N,) + S + (1, R), (N,) + S + (D, 1)
    x_mean, y_mean = (w * x).sum(0), (w * y).sum(0)
    x_centred = x - x_mean
    gram = torch.einsum("n...r,n...q->...rq", w * x_centred, x_centred)
    ridge = RIDGE * gram.diagonal(dim1=-2, dim2=-1) + 1e-12
    cross = torch.einsum("n...r,n...k->...rk", w * x_centred, y - y_mean)
    coefficients = torch.linalg.solve(gram + torch.diag_embed(ridge), cross).squeeze(-1)  # S + (D, R)
    intercept = y_mean.squeeze(-1) - (coefficients * x_mean).sum(-1)
    coefficients = coefficients.expand(values.shape[1:] + regressors.shape[-1:])
    residuals = values - intercept - (coefficients * x).sum(-1)
    return intercept, coefficients, residuals


def _heteroscedastic_fit(values, regressors, w, num_globals: int, effective, residuals):
    """
    The weighted maximum-likelihood fit of a Normal whose location is affine in the regressors and
    whose log-scale is affine in the globals (the first ``num_globals`` regressors), per element:
    the proposal in this family closest to the weighted draws in KL(posterior || proposal), as the
    constant-scale fit is in its own. Rounds (until the log-scale settles, at most
    :data:`MAX_HETEROSCEDASTIC_ROUNDS`) alternate :data:`SCORING_STEPS` Fisher-scoring steps on
    the log-scale (its information matrix ``2 sum w z z'`` is the same at every step; a step that
    would lower the likelihood is halved, so it never falls) with the location refitted by least
    squares weighted by ``w / scale^2``.

    An element keeps it only where it pays: its weighted log-likelihood gain times its effective
    draws exceeds the G extra parameters (Akaike's criterion), the globals' weighted correlation
    matrix is well-conditioned, and every number is finite; elsewhere the constant-scale fit stands.

    :returns: ``None`` if no element keeps it, else (which elements keep it ``S + (D,)``, their
        intercept, coefficients, log-scale at the centre, and the ``(slopes, centre, bound)`` of a
        :class:`LogScaleRegression`, the slopes zero where not kept).
    """
    globals_values = regressors[..., :num_globals]
    centre = (w * globals_values).sum(0)  # S-or-ones + (G,)
    features = torch.cat([torch.ones_like(globals_values[..., :1]), globals_values - centre], -1)
    information = 2 * torch.einsum("n...a,n...b->...ab", w * features, features)  # S-or-S' + (G+1, G+1)
    information = information + torch.diag_embed(RIDGE * information.diagonal(dim1=-2, dim2=-1) + 1e-12)
    cholesky = torch.linalg.cholesky(information).unsqueeze(-3)  # one per element, shared by its D
    covariance = information[..., 1:, 1:] / 2
    sd = covariance.diagonal(dim1=-2, dim2=-1).sqrt()
    correlation = covariance / (sd.unsqueeze(-1) * sd.unsqueeze(-2)).clamp(min=1e-300)
    conditioned = torch.linalg.eigvalsh(correlation)[..., 0] > MIN_GLOBALS_EIGENVALUE  # S-or-S'

    def log_likelihood(theta, squared):  # per unit weight, from the squared residuals: S + (D,)
        log_scale = torch.einsum("n...a,...da->n...d", features, theta)
        return -(w * (log_scale + 0.5 * squared * torch.exp(-2 * log_scale))).sum(0)

    squared = residuals.square()
    start = 0.5 * (w * squared).sum(0).log()  # the constant-scale fit's log-scale
    theta = torch.cat([start.unsqueeze(-1), torch.zeros(start.shape + (num_globals,), dtype=start.dtype)], -1)
    constant = value = log_likelihood(theta, squared)
    for _ in range(MAX_HETEROSCEDASTIC_ROUNDS):
        previous = theta
        for _ in range(SCORING_STEPS):
            theta, value = _scoring_step(theta, value, squared, w, features, cholesky, log_likelihood)
        precision = torch.exp(-2 * torch.einsum("n...a,...da->n...d", features, theta))
        intercept, coefficients, residuals = _weighted_least_squares(values, regressors, w * precision)
        squared = residuals.square()
        value = log_likelihood(theta, squared)  # the location's refit never lowers it
        if not bool(((theta - previous).abs() > HETEROSCEDASTIC_TOLERANCE).any()):
            break
    gain = value - constant
    kept = (gain * effective > num_globals) & conditioned.unsqueeze(-1) & theta.isfinite().all(-1)
    kept = kept & intercept.isfinite() & coefficients.isfinite().all(-1)
    if not bool(kept.any()):
        return None
    slopes = torch.where(kept.unsqueeze(-1), theta[..., 1:], torch.zeros_like(theta[..., 1:]))
    spread = torch.einsum("...dg,...gh,...dh->...d", slopes, covariance, slopes).clamp(min=0).sqrt()
    shape = values.shape[1:-1]
    scale_regression = (slopes, centre.expand(shape + (num_globals,)), LOG_SCALE_BOUND_SDS * spread)
    return kept, intercept, coefficients, theta[..., 0], scale_regression


def _scoring_step(theta, current, squared, w, features, cholesky, log_likelihood):
    """
    One Fisher-scoring step of the log-scale's coefficients ``theta`` (``S + (D, G + 1)``) given the
    squared residuals, halved where it lowers the likelihood (``current``, ``S + (D,)``), up to
    :data:`STEP_HALVINGS` times, then not taken there.

    :returns: the new coefficients and their likelihood.
    """
    log_scale = torch.einsum("n...a,...da->n...d", features, theta)
    excess = squared * torch.exp(-2 * log_scale) - 1  # the score's per-draw term
    score = torch.einsum("n...a,n...d->...da", w * features, excess)
    step = torch.cholesky_solve(score.unsqueeze(-1), cholesky).squeeze(-1)
    for _ in range(STEP_HALVINGS):
        candidate = theta + step
        value = log_likelihood(candidate, squared)
        better = value >= current  # NaN compares false: not taken
        if bool(better.all()):
            break
        step = torch.where(better.unsqueeze(-1), step, step / 2)
    theta = torch.where(better.unsqueeze(-1), candidate, theta)
    return theta, torch.where(better, value, current)


# -- reading the model ---------------------------------------------------------------------------


class ChainLink(NamedTuple):
    """A ``vectorized_markov`` chain's first-step site and previous-steps site, for its later steps."""

    first: str
    previous: str


def _chain_links(trace, layouts: dict[str, SiteLayout], local_names: set) -> dict[str, ChainLink]:
    """
    The later-steps sites of ``vectorized_markov`` chains that a :class:`ChainProposal` can follow:
    univariate, in no plate but the time dim, their first step covered too.
    """
    links = {}
    for link in find_time_links(trace):
        layout = layouts.get(link.current)
        if layout is None or link.current not in local_names or link.first not in layouts:
            continue
        if len(layout.batch_shape) == 1 and layout.event_size == 1 and layouts[link.first].size == 1:
            links[link.current] = ChainLink(link.first, link.previous)
    return links


def _is_covered(site) -> bool:
    """A continuous latent sample site that TMC does not enumerate."""
    if not _is_distribution_site(site) or site["is_observed"] or site["infer"].get("is_auxiliary"):
        return False
    if site["infer"].get("_do_not_score"):
        # a vectorized_markov chain's previous steps: TMC gives them the particles of the steps
        # before (pyro_tmc.estimate.vectorized_markov), so nothing proposes them
        return False
    if site["infer"].get("enumerate") is not None:
        return False
    fn = site["fn"]
    support = getattr(fn, "support", None)
    return support is not None and not support.is_discrete and not isinstance(fn, dist.Delta)


def _is_distribution_site(site) -> bool:
    """A sample site with a distribution (not a plate's subsample site)."""
    return site["type"] == "sample" and hasattr(site["fn"], "batch_shape")


def _is_local(site) -> bool:
    """In a plate, or a step of a ``pyro.markov`` chain."""
    in_plate = any(frame.vectorized for frame in site["cond_indep_stack"])
    return in_plate or site["infer"].get("_markov_scope") is not None


def _check_not_subsampled(site) -> None:
    """The proposal's parameters are per element of the plates as the prior trace has them: whole plates."""
    for frame in site["cond_indep_stack"]:
        if frame.vectorized and frame.size is not None and frame.full_size not in (None, frame.size):
            raise NotImplementedError(
                f"AdaptiveProposal: site '{site['name']}' is in plate '{frame.name}', subsampled "
                f"({frame.size} of {frame.full_size}); its proposal holds parameters per plate element, "
                "so the plate must be whole. Build the proposal and read the posterior without subsampling."
            )


def _layout(site) -> SiteLayout:
    fn = site["fn"]
    transform = biject_to(fn.support)
    event_shape = fn.event_shape
    unconstrained = transform.inv.forward_shape(event_shape) if event_shape else event_shape
    return SiteLayout(site["name"], transform, fn.batch_shape, event_shape, torch.Size(unconstrained))


def _prior_trace_with_parents(model, args, kwargs):
    """
    One prior trace of the model, and each latent site's direct prior parents (the latent sites
    whose values its log density depends on), by tracking each value's provenance in one pass.
    :func:`pyro.infer.inspect.get_dependencies` gives the same parents but compares every pair of
    sites (measured on a 1,000-step chain: 50 s, against 2.6 s here).
    """
    with torch.random.fork_rng(), torch.no_grad(), pyro.validation_enabled(False), TrackProvenance():
        trace = poutine.trace(model).get_trace(*args, **kwargs)
    parents = {}
    for name, site in trace.nodes.items():
        if _is_distribution_site(site) and not site["is_observed"]:
            provenance = get_provenance(site["fn"].log_prob(site["value"]))
            parents[name] = tuple(p for p in trace.nodes if p in provenance and p != name)
    # Validation off in both: a prior draw from heavy-tailed priors can reach a scale that underflows
    # to 0.0 (exp of a Cauchy draw), which a distribution's constraint rejects; these traces give
    # the sites' shapes and parents, not values anyone reads.
    with torch.random.fork_rng(), torch.no_grad(), pyro.validation_enabled(False):
        clean = poutine.trace(model).get_trace(*args, **kwargs)  # values without provenance wrappers
    return clean, parents


def _prior_samples(model, args, kwargs, num_draws: int, max_plate_nesting: int, names: list[str]):
    """
    ``num_draws`` prior draws of the named sites: ``(num_draws,) +`` each site's shape. One run
    vectorised over a plate left of the model's own, else (a model that does not broadcast)
    one run per draw.
    """
    if not names:
        return {}
    with pyro.validation_enabled(False):  # heavy-tailed priors reach scales of 0.0: see _finite_draws
        return _finite_draws(_every_prior_sample(model, args, kwargs, num_draws, max_plate_nesting, names))


def _finite_draws(samples: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The draws whose every site's value is finite (a prior's extreme draw can give inf or NaN)."""
    finite = torch.ones(len(next(iter(samples.values()))), dtype=torch.bool)
    for value in samples.values():
        finite &= torch.isfinite(value.reshape(len(value), -1)).all(-1)
    return {name: value[finite] for name, value in samples.items()}


def _every_prior_sample(model, args, kwargs, num_draws: int, max_plate_nesting: int, names: list[str]):
    try:
        with torch.no_grad(), pyro.plate("_adaptive_prior_draws", num_draws, dim=-1 - max_plate_nesting):
            trace = poutine.trace(model).get_trace(*args, **kwargs)
        samples = {name: trace.nodes[name]["value"] for name in names}
        for name, value in samples.items():
            site = trace.nodes[name]
            if value.dim() - site["fn"].event_dim < 1 + max_plate_nesting or value.shape[0] != num_draws:
                raise ValueError(f"site {name} did not broadcast over the prior draws")
        return {name: value.reshape(num_draws, -1) for name, value in samples.items()}
    except (RuntimeError, ValueError, IndexError):
        traces = []
        with torch.no_grad():
            for _ in range(num_draws):
                traces.append(poutine.trace(model).get_trace(*args, **kwargs))
        return {name: torch.stack([t.nodes[name]["value"] for t in traces]) for name in names}


# -- small helpers ---------------------------------------------------------------------------------


def _trimmed(shape: torch.Size, batch_ndim: int) -> torch.Size:
    """
    ``shape`` (a draw's leading dims: particle dims, then a 1 per plate slot) with up to
    ``batch_ndim`` of its trailing 1s dropped, so that a site's own batch dims take those slots.
    """
    shape = list(shape)
    for _ in range(batch_ndim):
        if not shape or shape[-1] != 1:
            break
        shape.pop()
    return torch.Size(shape)


def _concatenated(parts: list[torch.Tensor], batch_shape: tuple) -> torch.Tensor:
    """``parts`` (each ``... + (r_i,)``) broadcast over their batch dims and ``batch_shape``, concatenated."""
    batch = torch.broadcast_shapes(batch_shape, *(p.shape[:-1] for p in parts))
    return torch.cat([p.expand(batch + p.shape[-1:]) for p in parts], -1)


def _is_identity(transform: Transform) -> bool:
    """Whether ``transform`` is the identity (``biject_to`` of a real support, maybe ``to_event``'d)."""
    while isinstance(transform, IndependentTransform):
        transform = transform.base_transform
    return isinstance(transform, ComposeTransform) and not transform.parts


def _dtype() -> torch.dtype:
    """The dtype proposals' parameters are kept in: torch's default (the models' own)."""
    return torch.get_default_dtype()


def _deep_getattr(module, name: str):
    """``module.a.b`` for ``name = "a.b"`` (AutoNormal nests the parameters of dotted site names)."""
    return functools.reduce(getattr, name.split("."), module)


__all__ = [
    "AdaptiveProposal",
    "GlobalProposal",
    "LocalDraws",
    "LocalProposal",
    "LogScaleRegression",
    "SiteLayout",
]
