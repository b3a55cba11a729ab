"""QEM: a gradient-free fit of a mean-field exponential-family guide by TMC moment matching.

An exponential-family distribution is fixed by the expectations of its sufficient
statistics T(z) (its mean parameters). QEM [1] sets a mean-field guide q(z_j) to the
posterior's expectations of T(z_j), read from the TMC posterior of one draw of
particles proposed by q itself (:func:`pyro_tmc.infer.posterior.compute_marginals`),
and smooths them over steps by a moving average:

    m_j <- (1 - lr) m_j + lr E_TMC[T(z_j)],    q(z_j) = the member whose E[T] is m_j.

No gradient is taken. The fixed point is the guide whose moments equal the TMC
posterior's, which for large K are the true posterior's marginal moments, whatever
the correlations the mean-field guide cannot hold (they are in the TMC weights).
Averaging the mean parameters, not the conventional ones, keeps a variance positive:
an average of second moments is at least the average variance.

Families (chosen per site from its support, or named per site):

- ``"Normal"`` (real support): T = (z, z^2).
- ``"LogNormal"`` (positive support): T = (log z, (log z)^2).
- ``"Gamma"`` (positive support, by name): T = (z, log z); the shape solves
  ``log a - digamma(a) = log E[z] - E[log z]`` by Newton's method.
- ``"UnconstrainedNormal"`` (any other continuous support, e.g. ``Interval(-1, 1)`` or the unit
  interval): a Normal on the unconstrained value ``u = biject_to(support).inv(z)``, pushed through
  the bijection; T = (u, u^2). For a Beta posterior on (0, 1) its fixed point matches
  ``E[logit z]`` and ``Var[logit z]``.

A vector site outside plates (an event of D elements) gets K whole vectors in one particle dim,
whose weights judge all D elements at once: in many dims one particle takes the weight, and its
moments are one guide draw. ``QEM(elementwise=...)`` reads such a site's moments element by element
from each element's full conditional at joint posterior draws of the rest
(:mod:`pyro_tmc.infer.qem_elementwise`), a Rao-Blackwellised estimate of the same expectations.

A model's ``pyro.markov`` loop (a site per step, with distinct names) is visited by the guide
in a ``pyro.markov`` loop of the same steps, so that TMC recycles the steps' particle dims
as it does in the model: a chain of any length, not only those under torch's 64 dims.

This follows the alan library's QEM (moving averages of mean parameters, converted
to conventional parameters), written for Pyro models and guides.

References

[1] `Massively Parallel Expectation Maximization For Approximate Posteriors`,
    Thomas Heap, Sam Bowyer and Laurence Aitchison (2025)
"""

import math
from contextlib import ExitStack
from typing import Callable, NamedTuple, Optional, Union

import torch
from torch.distributions import biject_to, constraints

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.poutine.util import prune_subsample_sites

from pyro_tmc.infer.posterior import marginals_and_log_estimate, sample_posterior
from pyro_tmc.infer.qem_elementwise import MAX_AUTO_ELEMENTS, elementwise_statistics, is_elementwise_site
from pyro_tmc.infer.tmc_elbo import TMC_ELBO
from pyro_tmc.poutine.sites import is_latent, plate_frames

#: the smallest variance (relative to 1 + mean^2) a Normal or LogNormal guide site keeps
MIN_RELATIVE_VARIANCE = 1e-12


# -- families -----------------------------------------------------------------------


class NormalFamily:
    """q(z) = Normal(loc, scale): mean parameters (E[z], E[z^2])."""

    name = "Normal"

    def statistics(self, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return value, value.square()

    def distribution(self, first: torch.Tensor, second: torch.Tensor) -> dist.TorchDistribution:
        return dist.Normal(first, _stddev(first, second))

    def initial_statistics(self, mean: torch.Tensor, variance: torch.Tensor):
        return mean, variance + mean.square()


class LogNormalFamily(NormalFamily):
    """q(z) = LogNormal(loc, scale): mean parameters (E[log z], E[(log z)^2])."""

    name = "LogNormal"

    def statistics(self, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().statistics(value.log())

    def distribution(self, first: torch.Tensor, second: torch.Tensor) -> dist.TorchDistribution:
        return dist.LogNormal(first, _stddev(first, second))

    def initial_statistics(self, mean: torch.Tensor, variance: torch.Tensor):
        log_variance = torch.log1p(variance / mean.square())  # the LogNormal with this mean and variance
        log_mean = mean.log() - log_variance / 2
        return super().initial_statistics(log_mean, log_variance)


class GammaFamily:
    """q(z) = Gamma(concentration, rate): mean parameters (E[z], E[log z])."""

    name = "Gamma"

    def statistics(self, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return value, value.log()

    def distribution(self, first: torch.Tensor, second: torch.Tensor) -> dist.TorchDistribution:
        concentration = gamma_shape(first.log() - second)
        return dist.Gamma(concentration, concentration / first)

    def initial_statistics(self, mean: torch.Tensor, variance: torch.Tensor):
        concentration, rate = mean.square() / variance, mean / variance
        return mean, torch.digamma(concentration) - rate.log()


class UnconstrainedNormalFamily(NormalFamily):
    """
    q(z) = Normal(loc, scale) on ``u = biject_to(support).inv(z)``, pushed through the bijection:
    mean parameters (E[u], E[u^2]). A fallback for any continuous support with a bijection.

    :param support: the site's support (a :class:`~torch.distributions.constraints.Constraint`).
    """

    name = "UnconstrainedNormal"

    def __init__(self, support: constraints.Constraint) -> None:
        self.transform = biject_to(support)

    def statistics(self, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().statistics(self.transform.inv(value))

    def distribution(self, first: torch.Tensor, second: torch.Tensor) -> dist.TorchDistribution:
        base = super().distribution(first, second).to_event(self.transform.domain.event_dim)
        return dist.TransformedDistribution(base, self.transform)

    def prior_statistics(self, fn, init_scale: float, num_draws: int = 1000):
        """
        (E[u], E[u^2]) of the prior ``fn`` (its variance times ``init_scale^2``), from
        ``num_draws`` draws: the unconstrained moments of most priors have no closed form.
        Draws that the bijection maps to +-inf (a float at the support's edge) are left out.
        """
        with torch.no_grad():
            values = self.transform.inv(fn.sample((num_draws,)))
        finite = torch.isfinite(values)
        count = finite.sum(0).clamp(min=1)
        mean = values.where(finite, 0.0).sum(0) / count
        variance = (values - mean).where(finite, 0.0).square().sum(0) / (count - 1).clamp(min=1)
        return self.initial_statistics(mean, variance.clamp(min=1e-6) * init_scale**2)


def gamma_shape(gap: torch.Tensor, newton_steps: int = 6) -> torch.Tensor:
    """
    The Gamma shape ``a`` with ``log a - digamma(a) = gap`` (``gap = log E[z] - E[log z] > 0``):
    Minka's closed-form start, then Newton steps on ``log a - digamma(a)``.
    """
    gap = gap.clamp(min=1e-10)
    shape = (3 - gap + ((gap - 3).square() + 24 * gap).sqrt()) / (12 * gap)
    for _ in range(newton_steps):
        residual = shape.log() - torch.digamma(shape) - gap
        slope = 1 / shape - torch.polygamma(1, shape)
        shape = (shape - residual / slope).clamp(min=shape / 10)
    return shape


def _stddev(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    floor = MIN_RELATIVE_VARIANCE * (1 + first.square())
    return (second - first.square()).clamp(min=0).add(floor).sqrt()


FAMILIES = {family.name: family for family in (NormalFamily(), LogNormalFamily(), GammaFamily())}
#: every family a site may name; the unconstrained Normal is made per site, from its support
FAMILY_NAMES = sorted(FAMILIES) + [UnconstrainedNormalFamily.name]


def default_family(site: dict):
    """
    Normal for a real site, LogNormal for a positive one, else a Normal on the unconstrained
    scale of the site's support; ``None`` for a support with no bijection (not supported).
    """
    support = site["fn"].support
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    if support is constraints.real:
        return FAMILIES["Normal"]
    if isinstance(support, constraints.greater_than) and float(support.lower_bound) == 0.0:
        return FAMILIES["LogNormal"]
    return unconstrained_family(site)


def unconstrained_family(site: dict) -> Optional[UnconstrainedNormalFamily]:
    """The unconstrained Normal of the site's support, or ``None`` where the support has no bijection."""
    try:
        return UnconstrainedNormalFamily(site["fn"].support)
    except NotImplementedError:  # biject_to's answer for a support it does not know
        return None


# -- the guide ------------------------------------------------------------------------


class MarkovLoop(NamedTuple):
    """The guide sites of a model's ``pyro.markov`` loop: its steps (site names), and its history."""

    steps: list[list[str]]
    history: int


class QEMSite(NamedTuple):
    """A guide site: its plates, family, batch and event shape (those of the model's site)."""

    frames: tuple
    family: object
    batch_shape: torch.Size
    event_dim: int


class QEMGuide:
    """
    A mean-field exponential-family guide for :class:`QEM`: one independent
    distribution per continuous latent site of the model, in the model's plates,
    held by its mean parameters in Pyro's param store (``"<prefix>.<site>"``: the
    two statistics stacked along a new leading dim).

    Discrete latents are left to the model (TMC draws them from the prior, or sums
    them where ``infer={"enumerate": "parallel"}``). Plates must not be subsampled.

    Example::

        guide = QEMGuide(model)
        qem = QEM(model, guide, num_samples=32, lr=0.2, max_plate_nesting=1)
        for step in range(200):
            loss = qem.step(data)
        guide.distribution("theta").mean, guide.distribution("theta").stddev

    :param callable model: the Pyro model.
    :param dict families: site name -> ``"Normal"``, ``"LogNormal"``, ``"Gamma"`` or
        ``"UnconstrainedNormal"``; other sites: Normal for real support, LogNormal for positive
        support, UnconstrainedNormal for any other continuous support (e.g. ``Interval(-1, 1)``).
    :param float init_scale: the first guide's standard deviations, as multiples of the
        prior's (read from the prior at one draw of the model); wider proposals are safer.
    :param str prefix: the param store names' prefix.
    """

    def __init__(
        self,
        model: Callable,
        families: Optional[dict[str, str]] = None,
        init_scale: float = 1.0,
        prefix="qem",
    ) -> None:
        self.model = model
        self.families = dict(families or {})
        unknown = set(self.families.values()) - set(FAMILY_NAMES)
        if unknown:
            raise ValueError(
                f"QEMGuide(families=...): unknown families {sorted(unknown)}; use {FAMILY_NAMES}."
            )
        self.init_scale = init_scale
        self.prefix = prefix
        self.sites: Optional[dict[str, QEMSite]] = None
        self.blocks: list[Union[str, MarkovLoop]] = []  # the visiting order: sites and markov loops

    def param_name(self, name: str) -> str:
        return f"{self.prefix}.{name}"

    # -- setting up from the model ---------------------------------------------------

    def setup(self, *args, **kwargs) -> None:
        """Read the model's continuous latents, and start each at its prior moments (once)."""
        if self.sites is not None:
            return
        with torch.no_grad():
            prototype = poutine.block(poutine.trace(self.model).get_trace)(*args, **kwargs)
        prototype = prune_subsample_sites(prototype)
        self.sites = {}
        for name, site in prototype.nodes.items():
            if not is_latent(site) or site["fn"].support.is_discrete:
                continue
            family = self._family(site)
            self.sites[name] = QEMSite(
                _whole_plate_frames(site), family, site["fn"].batch_shape, site["fn"].event_dim
            )
            first, second = _initial_statistics(site, family, self.init_scale)
            pyro.param(self.param_name(name), torch.stack([first, second]).detach())
        self.blocks = markov_blocks(prototype, list(self.sites))

    def _family(self, site: dict):
        if site["name"] in self.families:
            chosen = self.families[site["name"]]
            if chosen == UnconstrainedNormalFamily.name:
                return UnconstrainedNormalFamily(site["fn"].support)
            return FAMILIES[chosen]
        family = default_family(site)
        if family is None:
            raise NotImplementedError(
                f"QEMGuide: site '{site['name']}' has support {site['fn'].support}, which has no bijection "
                "to the real line (torch.distributions.biject_to); QEM fits Normal, LogNormal, Gamma and "
                "unconstrained-Normal sites. Reparameterise it onto a support with one."
            )
        return family

    # -- the guide --------------------------------------------------------------------

    def statistics(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The site's current mean parameters (the two expectations)."""
        first, second = pyro.param(self.param_name(name)).detach().unbind(0)
        return first, second

    def distribution(self, name: str) -> dist.TorchDistribution:
        """The guide's distribution of the site (batch shape: the site's plates; event as the model's)."""
        fitted = self.sites[name].family.distribution(*self.statistics(name))
        return fitted.to_event(self.sites[name].event_dim - fitted.event_dim)

    def __call__(self, *args, **kwargs) -> None:
        self.setup(*args, **kwargs)
        # one plate object per plate, entered by every site in it (as AutoGuides do): a plate
        # constructed twice would record its subsample site twice
        plates = {}
        for site in self.sites.values():
            for frame in site.frames:
                if frame.name not in plates:
                    plates[frame.name] = pyro.plate(frame.name, frame.size, dim=frame.dim)
        for block in self.blocks:
            if isinstance(block, str):
                self._sample(block, plates)
                continue
            for step in pyro.markov(block.steps, history=block.history):
                for name in step:
                    self._sample(name, plates)

    def _sample(self, name: str, plates: dict) -> None:
        with ExitStack() as stack:
            for frame in self.sites[name].frames:
                stack.enter_context(plates[frame.name])
            pyro.sample(name, self.distribution(name))

    # -- the QEM update ------------------------------------------------------------------

    def update(self, marginals: dict, lr: float, expectations: Optional[dict] = None) -> None:
        """
        ``m <- (1 - lr) m + lr E[T(z)]`` for every guide site, the expectations read from
        ``marginals`` (:func:`~pyro_tmc.infer.posterior.compute_marginals`), or for a site in
        ``expectations`` (name -> the pair ``(E[T_1], E[T_2])``) from there.
        """
        store = pyro.get_param_store()
        expectations = expectations or {}
        for name, site in self.sites.items():
            if name in expectations:
                statistics = torch.stack(expectations[name])
            else:
                # both expectations at once: the statistics stacked along a new last dim
                pair = marginals[name].expectation(
                    lambda z, family=site.family: torch.stack(family.statistics(z), -1)
                )
                statistics = pair.movedim(-1, 0)
            old = pyro.param(self.param_name(name)).detach()
            store[self.param_name(name)] = old + lr * (statistics.reshape(old.shape).to(old) - old)


def markov_blocks(trace, names: list[str]) -> list[Union[str, MarkovLoop]]:
    """
    The sites ``names`` (in the trace's order) as the guide visits them: a site outside
    ``pyro.markov`` on its own, the sites of a loop as a :class:`MarkovLoop` of its steps.

    ``pyro.markov`` writes each site's scope (the names of the sites it may depend on: those
    of the last ``history`` steps and the earlier ones of its own step) into its ``infer``.
    A site starts a new step where its scope drops a name the previous site's held; the
    first ``history + 1`` steps, where nothing drops out yet, are read as one. Merging steps
    only costs particle dims; it never lets two steps the model links share one.
    """
    blocks: list[Union[str, MarkovLoop]] = []
    previous: Optional[tuple[str, set]] = None  # the last site in a loop, and its scope
    for name in names:
        infer = trace.nodes[name]["infer"]
        depth = infer.get("_markov_depth", 0)
        if depth > 1:
            raise NotImplementedError(
                f"QEMGuide: site '{name}' is in nested pyro.markov loops; QEM follows one loop level."
            )
        if depth == 0:
            blocks.append(name)
            previous = None
            continue
        scope = set(infer.get("_markov_scope", ()))
        if previous is None or not scope:  # a loop's first site
            blocks.append(MarkovLoop([[name]], 1))
        elif scope >= previous[1] | {previous[0]}:
            blocks[-1].steps[-1].append(name)
        else:
            blocks[-1].steps.append([name])
        previous = (name, scope)
    return [_with_history(block, trace) if isinstance(block, MarkovLoop) else block for block in blocks]


def _with_history(loop: MarkovLoop, trace) -> MarkovLoop:
    """The loop with its history: the furthest step back that a step's first site may depend on."""
    step_of = {name: index for index, step in enumerate(loop.steps) for name in step}
    history = 1
    for index, step in enumerate(loop.steps):
        scope = trace.nodes[step[0]]["infer"].get("_markov_scope", ())
        earlier = [step_of[name] for name in scope if name in step_of and step_of[name] < index]
        if earlier:
            history = max(history, index - min(earlier))
    return MarkovLoop(loop.steps, history)


def _initial_statistics(site: dict, family, init_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The family's mean parameters at the prior's moments, the sds times ``init_scale``."""
    if isinstance(family, UnconstrainedNormalFamily):
        first, second = family.prior_statistics(site["fn"], init_scale)
        return first.to(site["value"].dtype), second.to(site["value"].dtype)
    mean, variance = _prior_moments(site, init_scale)
    return family.initial_statistics(mean, variance)


def _whole_plate_frames(site: dict) -> tuple:
    """:func:`~pyro_tmc.poutine.sites.plate_frames`, each of which must hold the whole plate."""
    frames = tuple(plate_frames(site))
    batch_shape = site["fn"].batch_shape
    for frame in frames:
        if -frame.dim <= len(batch_shape) and batch_shape[frame.dim] not in (1, frame.size):
            raise NotImplementedError(
                f"QEMGuide: site '{site['name']}' is in plate '{frame.name}' subsampled to "
                f"{batch_shape[frame.dim]} of {frame.size}; QEM needs whole plates."
            )
    return frames


def _prior_moments(site: dict, init_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The prior's mean and variance at the site (at the prototype's parents), else (0, 1)."""
    fn = site["fn"]
    shape = fn.batch_shape + fn.event_shape
    try:
        mean, variance = fn.mean.expand(shape), fn.variance.expand(shape)
    except (NotImplementedError, RuntimeError):
        mean = variance = None
    value = site["value"]
    if mean is None or not (torch.isfinite(mean).all() and torch.isfinite(variance).all()):
        mean, variance = (
            value.new_ones(shape) if _is_positive(fn) else value.new_zeros(shape),
            value.new_ones(shape),
        )
    return mean.to(value.dtype).clone(), (variance * init_scale**2).to(value.dtype).clamp(min=1e-12)


def _is_positive(fn) -> bool:
    support = fn.support
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    return isinstance(support, constraints.greater_than)


# -- the loop ---------------------------------------------------------------------------

#: the default step's first and final values: ``max(FINAL_STEP, FIRST_STEP / (t + 1))``
FIRST_STEP = 0.9
FINAL_STEP = 0.3


def default_step_size(step: int) -> float:
    """
    QEM's default moving-average step at step ``step`` (from 0): ``max(0.3, 0.9 / (t + 1))``, large
    while the guide is far from the posterior, then an average over about ``2 / 0.3`` steps.
    Measured (``benchmarks/qem_iterations.py``, K = 10, seeds 0-2): on the bus breakdowns it reaches
    TMC-VI's bound in 0.05-0.28 of TMC-VI's iterations (a constant 0.1: 0.55; 0.7: 0.05-0.42, ending
    1-3 nats lower), on radon in 0.09 (a constant 0.1: 1.55; 0.3: 0.27-0.62).
    """
    return max(FINAL_STEP, FIRST_STEP / (step + 1))


class QEM:
    """
    Gradient-free fitting of a :class:`QEMGuide` by TMC moment matching, with the
    interface of :class:`pyro.infer.SVI`: ``step(*args, **kwargs)`` runs one update
    and returns the loss ``-log P_TMC`` of its draw (a float).

    Each step draws K particles of every latent from the current guide, reads the
    posterior expectations of each site's sufficient statistics from the TMC posterior
    of that draw, and moves the guide's mean parameters a fraction ``lr`` towards them.
    The model's own parameters (``pyro.param`` in the model) are not changed: train
    those with ``SVI`` and :class:`~pyro_tmc.TMC_ELBO`, alternating if needed.

    :param callable model: the Pyro model.
    :param QEMGuide guide: the guide that QEM fits.
    :param lr: the moving average's step, in (0, 1]: 1 replaces the moments each step;
        smaller values average the Monte Carlo noise over about ``2 / lr`` steps. A callable
        ``step -> lr`` (step counts from 0) gives a schedule; the default,
        :func:`~pyro_tmc.infer.qem.default_step_size`, is ``max(0.3, 0.9 / (t + 1))``.
    :param int num_samples: K, the particles per latent in each step's TMC draw.
    :param max_plate_nesting: as in every Pyro ELBO.
    :param elementwise: the vector sites whose moments are read element by element from their
        full conditionals (:mod:`pyro_tmc.infer.qem_elementwise`) rather than from TMC's joint
        weights of whole vectors: ``"auto"`` (the default: every site outside plates with 2 to
        :data:`~pyro_tmc.infer.qem_elementwise.MAX_AUTO_ELEMENTS` elements and an element-wise
        family), ``False`` (none), or a list of site names (which may be in plates: each plate
        element then gets its own conditionals). Each step then also draws
        ``num_references`` joint samples from the TMC posterior and runs the model, vectorised, at
        ``num_references x (D num_candidates + 1)`` values of each such site of D elements.
    :param int num_references: the joint posterior draws the element-wise moments average over.
    :param int num_candidates: each element's proposals per reference draw (default: ``num_samples``).
    :param tmc_options: other :class:`~pyro_tmc.TMC_ELBO` arguments (``proposal``, ...).
    """

    def __init__(
        self,
        model: Callable,
        guide: QEMGuide,
        lr: Union[float, Callable[[int], float]] = default_step_size,
        num_samples: int = 16,
        max_plate_nesting: float = float("inf"),
        elementwise: Union[str, bool, list[str]] = "auto",
        num_references: int = 4,
        num_candidates: Optional[int] = None,
        **tmc_options,
    ) -> None:
        if not isinstance(guide, QEMGuide):
            raise TypeError(
                f"QEM needs a QEMGuide (a mean-field exponential-family guide), got {type(guide)}."
            )
        if not (elementwise in ("auto", True, False) or isinstance(elementwise, (list, tuple))):
            raise ValueError(
                f"QEM(elementwise=...): 'auto', False or a list of site names, got {elementwise!r}."
            )
        for option, count in (
            ("num_references", num_references),
            ("num_candidates", 1 if num_candidates is None else num_candidates),
        ):
            if not (isinstance(count, int) and count >= 1):
                raise ValueError(f"QEM({option}=...): a positive int, got {count!r}.")
        self.model = model
        self.guide = guide
        self.lr = lr
        self.elementwise = elementwise
        self.num_references = num_references
        self.num_candidates = num_samples if num_candidates is None else num_candidates
        self._elementwise_names: Optional[list[str]] = None
        self.num_steps = 0
        self._step_size()  # checks lr now, not at the first step
        self.elbo = TMC_ELBO(num_samples=num_samples, max_plate_nesting=max_plate_nesting, **tmc_options)

    def step(self, *args, **kwargs) -> float:
        """One QEM update; returns ``-log P_TMC`` of the draw that made it."""
        self.guide.setup(*args, **kwargs)
        with torch.no_grad():
            draw = self.elbo.draw(self.model, self.guide, *args, **kwargs)
            marginals, log_estimate = marginals_and_log_estimate(draw)
            expectations = self._elementwise_expectations(draw, args, kwargs)
            self.guide.update(marginals, self._step_size(), expectations)
        self.num_steps += 1
        loss = -float(log_estimate)
        if math.isnan(loss):
            raise ValueError(
                "QEM.step: the TMC estimate is NaN; check the model's data and the guide's start."
            )
        return loss

    def elementwise_sites(self) -> list[str]:
        """The guide sites whose moments are read element by element (after the guide's setup)."""
        if self._elementwise_names is None:
            if self.elementwise in ("auto", True):
                names = [
                    name
                    for name in self.guide.sites
                    if is_elementwise_site(self.guide, name, MAX_AUTO_ELEMENTS)
                ]
            elif self.elementwise is False:
                names = []
            else:
                names = list(self.elementwise)
                refused = [
                    name
                    for name in names
                    if name not in self.guide.sites
                    or not is_elementwise_site(self.guide, name, allow_plates=True)
                ]
                if refused:
                    raise ValueError(
                        f"QEM(elementwise=...): {refused} are not guide sites with more than one element "
                        "(each batch dim a plate) and an element-wise family."
                    )
            self._elementwise_names = names
        return self._elementwise_names

    def _elementwise_expectations(self, draw, args, kwargs) -> dict:
        """Each element-wise site's conditional expectations, from joint draws of ``draw``'s posterior."""
        names = self.elementwise_sites()
        if not names:
            return {}
        try:
            reference = sample_posterior(draw, self.num_references)
        except NotImplementedError:  # e.g. a vectorized_markov chain: TMC's moments stay
            return {}
        event_dims = {site: draw.model_trace.nodes[site]["fn"].event_dim for site in reference}
        expectations = {}
        for name in names:
            pair = elementwise_statistics(
                self.model,
                self.guide,
                name,
                reference,
                event_dims,
                args,
                kwargs,
                self.num_candidates,
                int(self.elbo.max_plate_nesting),
            )
            if pair is not None:
                expectations[name] = pair
        return expectations

    def _step_size(self) -> float:
        lr = self.lr(self.num_steps) if callable(self.lr) else self.lr
        if not 0.0 < lr <= 1.0:
            raise ValueError(f"QEM: the moving average's step lr must be in (0, 1], got {lr}.")
        return lr

    def evaluate_loss(self, *args, **kwargs) -> float:
        """``-log P_TMC`` of a fresh draw from the current guide, with no update."""
        self.guide.setup(*args, **kwargs)
        with torch.no_grad():
            return self.elbo.loss(self.model, self.guide, *args, **kwargs)
