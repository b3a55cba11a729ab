"""TMC_ELBO: the Tensor Monte Carlo bound as a drop-in Pyro SVI loss. Orchestration only."""

import warnings
from typing import Iterator, Optional, Tuple

import torch
import pyro.poutine as poutine
from pyro.infer.util import is_validation_enabled
from pyro.poutine import Trace
from pyro.poutine.util import prune_subsample_sites
from pyro.util import check_model_guide_match, check_traceenum_requirements, warn_if_nan

from .base import DifferentiableLossELBO
from ..factors import (
    check_finite,
    check_plate_dependencies,
    check_site_shapes,
    check_variance_reduction,
    compute_log_factors,
    contract_estimate,
    is_summed_exactly,
    latent_site,
    particle_shape,
    plate_scale_of,
    symbolize,
)
from ..poutine import TMCMessenger
from ..poutine.tmc_messenger import check_num_samples
from ..proposals import check_proposal
from . import posterior
from .path_gradients import (
    check_factorised,
    marginal_sources,
    path_surrogate,
    reparameterised_latents,
    with_leaf_values,
)


def run_with_shape_hint(messenger: TMCMessenger, role: str, run, args, kwargs) -> Trace:
    """
    ``run(*args, **kwargs)``; a shape error raised by user code on the particle
    dims is re-raised, same type, with a hint naming the site and the dims.
    """
    try:
        return run(*args, **kwargs)
    except (RuntimeError, IndexError, ValueError) as error:
        if isinstance(error, ValueError) and "shape" not in str(error).lower():
            raise  # our own errors, and the user's that have nothing to do with shapes
        try:
            hinted = type(error)(str(error) + messenger.shape_error_hint(role))
        except Exception:  # an exception type that takes other arguments
            raise error
        raise hinted from error


def check_model_guide_shapes_match(model_trace: Trace, guide_trace: Trace, max_plate_nesting) -> None:
    """
    :func:`pyro.util.check_model_guide_match`, whose shape comparison trims a
    shape with a negative start when its event dims outnumber the rest (a
    Dirichlet transition matrix under AutoNormal carries particle dims on the
    guide side only) and then reports a false disagreement. We compare the
    plate and event dims ourselves in that case.
    """
    try:
        check_model_guide_match(model_trace, guide_trace, max_plate_nesting)
    except ValueError as error:
        if "shapes disagree" not in str(error):
            raise
        for name, guide_site in guide_trace.nodes.items():
            model_site = model_trace.nodes.get(name)
            if guide_site["type"] != "sample" or model_site is None or model_site["type"] != "sample":
                continue
            kept = int(max_plate_nesting) + model_site["fn"].event_dim
            model_shape = tuple(model_site["fn"].shape())[-kept:] if kept else ()
            guide_shape = tuple(guide_site["fn"].shape())[-kept:] if kept else ()
            width = max(len(model_shape), len(guide_shape))
            if (1,) * (width - len(model_shape)) + model_shape != (1,) * (width - len(guide_shape)) + guide_shape:
                raise ValueError(
                    f"Model and guide shapes disagree at site '{name}': {model_shape} vs {guide_shape}"
                ) from error


def warn_about_summed_guide_sites(guide_trace: Trace) -> None:
    """Warn, naming the site, where a guide site marked for enumeration is summed exactly."""
    for name, site in guide_trace.nodes.items():
        if site["type"] == "sample" and not site["is_observed"] and is_summed_exactly(site):
            warnings.warn(
                f"Guide site '{name}' is marked infer={{'enumerate': 'parallel'}}: TMC_ELBO sums it "
                "exactly over its support, where the guide's probabilities cancel "
                "(sum_z q(z) p(x, z) / q(z) = sum_z p(x, z)), so the estimate is exact in this site "
                "and the guide's parameters for it get no gradient. Drop the flag, or set "
                "infer={'num_samples': K}, to sample it from the guide instead.",
                UserWarning,
            )


def latent_site_names(trace: Trace):
    """Names of the unobserved sample sites of a trace."""
    return [
        name
        for name, site in trace.nodes.items()
        if site["type"] == "sample" and not site["is_observed"]
    ]


class TMC_ELBO(DifferentiableLossELBO):
    """
    The Tensor Monte Carlo estimate of log p(x) [1] as a Pyro loss.

    Every latent site of the guide, and every latent site of the model that the
    guide lacks, is drawn K times (``infer={"num_samples": K_i}`` per site, else
    ``num_samples``). The estimate averages p(x, z)/q(z) over all prod_i K_i
    combinations of particles,

        P_TMC = 1/prod_i K_i sum_{k_1..k_n} p(x, z_1^{k_1}, ..., z_n^{k_n}) / prod_i q(z_i^{k_i}),

    by tensor contraction in log space, with plates nested and subsampled and
    :func:`pyro.markov` honoured. ``E[P_TMC] = p(x)``, so ``-log P_TMC`` is a
    stochastic upper bound on ``-log p(x)`` in expectation, for factorised and
    non-factorised guides alike: a site whose proposal depends on upstream
    particles gets a proposal density indexed by its own particle alone (see
    :mod:`pyro_tmc.proposals`). Unlike :class:`pyro.infer.TraceTMC_ELBO`, no
    ``config_enumerate`` is needed.

    Model sites absent from the guide are drawn from the model's conditional;
    model sites marked ``infer={"enumerate": "parallel"}`` without
    ``num_samples`` are summed exactly over their support.

    Example::

        elbo = TMC_ELBO(num_samples=16, max_plate_nesting=1)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), loss=elbo)
        svi.step(data)

    :param int num_samples: K, the particles of every latent site that does not set its own.
    :param int max_plate_nesting: as in every Pyro ELBO; guessed from a first run if omitted.
    :param str proposal: ``"mixture"``, ``"permutation"`` or ``"diagonal"``: how a
        site whose proposal depends on upstream particles draws its own.
    :param str variance_reduction: ``None``, ``"stl"`` or ``"dregs"``.
    :param int num_particles: independent TMC estimates averaged in the loss.
    :param bool vectorize_particles: compute those estimates in one vectorised pass.
    :param int max_factor_bytes: a memory budget: a site's log-density factor
        larger than this is computed and summed out in slices along the site's
        particle dim (with activation checkpointing), same result; ``None``
        (default) materialises every factor, which is fastest.

    References

    [1] `Tensor Monte Carlo: Particle Methods for the GPU Era`,
        Laurence Aitchison (NeurIPS 2019)
    """

    def __init__(
        self,
        num_samples: int = 8,
        max_plate_nesting: float = float("inf"),
        proposal: str = "mixture",
        variance_reduction=None,
        num_particles: int = 1,
        vectorize_particles: bool = False,
        max_factor_bytes: Optional[int] = None,
        **kwargs,
    ) -> None:
        self.num_samples = check_num_samples(num_samples, "TMC_ELBO")
        if max_factor_bytes is not None and max_factor_bytes <= 0:
            raise ValueError(f"max_factor_bytes must be positive or None, got {max_factor_bytes}.")
        self.max_factor_bytes = max_factor_bytes
        self.proposal = check_proposal(proposal)
        self.variance_reduction = check_variance_reduction(variance_reduction)
        check_num_samples(num_particles, "TMC_ELBO(num_particles)")
        super().__init__(
            num_particles=num_particles,
            max_plate_nesting=max_plate_nesting,
            vectorize_particles=vectorize_particles,
            **kwargs,
        )

    # -- traces --------------------------------------------------------------

    def _run_guide(self, guide, args, kwargs) -> Trace:
        guide_tmc = TMCMessenger(
            self.num_samples, self.proposal, first_available_dim=-1 - self.max_plate_nesting
        )
        guide_trace = run_with_shape_hint(
            guide_tmc, "guide", poutine.trace(guide_tmc(guide)).get_trace, args, kwargs
        )
        warn_about_summed_guide_sites(guide_trace)
        return guide_trace

    def _run_model(self, model, guide_trace, args, kwargs) -> Trace:
        """The model against the guide's particles (latents it alone has get their own)."""
        # The model's handler continues the guide's dim allocation, and sits
        # inside the replay so that it sees the model's own markov scopes.
        model_tmc = TMCMessenger(
            self.num_samples,
            self.proposal,
            replayed_sites=latent_site_names(guide_trace),
            continue_allocation=True,
        )
        run = poutine.trace(poutine.replay(model_tmc(model), trace=guide_trace)).get_trace
        return run_with_shape_hint(model_tmc, "model", run, args, kwargs)

    def _replay_guide(self, guide, leaf_trace: Trace, args, kwargs) -> Trace:
        """
        The guide replayed on ``leaf_trace``'s particles (:func:`with_leaf_values`),
        continuing the dim allocation, so that the Delta sites it recomputes keep
        their particle dims.
        """
        replay_tmc = TMCMessenger(
            self.num_samples,
            self.proposal,
            replayed_sites=latent_site_names(leaf_trace),
            continue_allocation=True,
        )
        return poutine.trace(poutine.replay(replay_tmc(guide), trace=leaf_trace)).get_trace(
            *args, **kwargs
        )

    def _finish(self, model_trace: Trace, guide_trace: Trace) -> Tuple[Trace, Trace]:
        if is_validation_enabled():
            check_model_guide_shapes_match(model_trace, guide_trace, self.max_plate_nesting)
            check_traceenum_requirements(model_trace, guide_trace)
        guide_trace = prune_subsample_sites(guide_trace)
        model_trace = prune_subsample_sites(model_trace)
        if is_validation_enabled():
            check_site_shapes(model_trace, guide_trace, self.max_plate_nesting)
        symbolize(model_trace, guide_trace)
        check_plate_dependencies(model_trace, guide_trace)
        return model_trace, guide_trace

    def _get_trace(self, model, guide, args, kwargs) -> Tuple[Trace, Trace]:
        """One guide trace under ``tmc`` and the model run against its particles."""
        guide_trace = self._run_guide(guide, args, kwargs)
        model_trace = self._run_model(model, guide_trace, args, kwargs)
        return self._finish(model_trace, guide_trace)

    def _vectorized(self, model, guide, args, kwargs):
        if self.max_plate_nesting == float("inf"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._guess_max_plate_nesting(model, guide, args, kwargs)
        if self.vectorize_particles:
            return self._vectorized_num_particles(model), self._vectorized_num_particles(guide), 1
        return model, guide, self.num_particles

    def _get_traces(self, model, guide, args, kwargs) -> Iterator[Tuple[Trace, Trace]]:
        model, guide, repeats = self._vectorized(model, guide, args, kwargs)
        for _ in range(repeats):
            yield self._get_trace(model, guide, args, kwargs)

    # -- the estimate --------------------------------------------------------

    def _log_estimate(
        self, model_trace: Trace, guide_trace: Trace, sources=None, detach_guide_proposals=False
    ) -> torch.Tensor:
        """log P_TMC of one draw (summed over vectorised repetitions)."""
        max_elements = None
        if self.max_factor_bytes is not None:
            max_elements = self.max_factor_bytes // (torch.finfo(torch.get_default_dtype()).bits // 8)
        factors = compute_log_factors(
            model_trace, guide_trace, sources, detach_guide_proposals, max_elements
        )
        estimate = contract_estimate(factors, model_trace)
        check_finite(factors, estimate)
        return estimate

    def _path_gradient_surrogate(self, model, guide, args, kwargs) -> torch.Tensor:
        """
        log P_TMC of one draw, whose gradient is the plain one for the model's
        parameters and the STL / DReGs one for the guide's (see
        :mod:`pyro_tmc.infer.path_gradients`).
        """
        live_trace = self._run_guide(guide, args, kwargs)
        names = reparameterised_latents(live_trace, self.variance_reduction)
        if self.variance_reduction == "dregs":
            check_factorised(live_trace, names)
        leaf_trace, leaves = with_leaf_values(live_trace, names)
        guide_trace = self._replay_guide(guide, leaf_trace, args, kwargs)
        model_trace = self._run_model(model, guide_trace, args, kwargs)
        model_trace, guide_trace = self._finish(model_trace, guide_trace)

        sources = {}
        if self.variance_reduction == "dregs":
            sites = [latent_site(name, model_trace, guide_trace) for name in names]
            sources = marginal_sources(sites, particle_shape)
        log_p = self._log_estimate(model_trace, guide_trace, sources)
        inputs = list(leaves.values()) + list(sources.values())
        if not inputs:  # no reparameterised guide latent: the plain gradient is all there is
            return log_p
        # retain: the plain bound below reuses the model's and guide's networks' graph
        grads = torch.autograd.grad(log_p, inputs, allow_unused=True, retain_graph=True)
        value_grads = dict(zip(leaves, grads[: len(leaves)]))
        weights = event_dims = None
        if sources:
            weights = {
                name: _zero_if_none(grad, sources[name])
                / plate_scale_of(latent_site(name, model_trace, guide_trace), model_trace)
                for name, grad in zip(sources, grads[len(leaves):])
            }
            event_dims = {name: live_trace.nodes[name]["fn"].event_dim for name in names}
        live_values = {name: live_trace.nodes[name]["value"] for name in names}
        # Model parameters: log P with the guide's density stopped and its particles as leaves.
        plain = self._log_estimate(model_trace, guide_trace, detach_guide_proposals=True)
        return plain + path_surrogate(live_values, value_grads, weights, event_dims)

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        """
        :returns: ``-log P_TMC``, averaged over ``num_particles`` independent
            draws; differentiable.
        :rtype: torch.Tensor
        """
        total = 0.0
        if self.variance_reduction is None or not torch.is_grad_enabled():
            for model_trace, guide_trace in self._get_traces(model, guide, args, kwargs):
                total = total + self._log_estimate(model_trace, guide_trace)
        else:
            model, guide, repeats = self._vectorized(model, guide, args, kwargs)
            for _ in range(repeats):
                total = total + self._path_gradient_surrogate(model, guide, args, kwargs)
        loss = -total / self.num_particles
        warn_if_nan(loss, "loss")
        return loss

    # -- the posterior of one draw -------------------------------------------

    def _one_draw(self, model, guide, args, kwargs) -> Tuple[Trace, Trace]:
        if self.num_particles != 1:
            raise NotImplementedError(
                "Posterior read-outs use one TMC draw: construct the ELBO with num_particles=1."
            )
        return next(self._get_traces(model, guide, args, kwargs))

    def compute_marginals(self, model, guide, *args, **kwargs):
        """
        The posterior over particle combinations of one TMC draw, read per site.

        :returns: site name -> :class:`~pyro.distributions.Empirical` over the
            site's particles, weighted by their posterior marginal weight (the sum
            of the weights of all combinations that contain the particle), batched
            over the site's plates; ``.mean`` and ``.variance`` are posterior
            moment estimates. Enumerated sites give their support, exactly weighted.
        :rtype: OrderedDict
        """
        with torch.no_grad():
            model_trace, guide_trace = self._one_draw(model, guide, args, kwargs)
        return posterior.compute_marginals(model_trace, guide_trace)

    def sample_posterior(self, model, guide, *args, num_draws: int = 1, **kwargs):
        """
        Exact draws of joint particle combinations from the posterior of one TMC
        draw, by backward sampling through the same contraction.

        :param int num_draws: how many combinations to draw (vectorised).
        :returns: site name -> values, with a new leftmost dim of size
            ``num_draws``; plugs into ``pyro.infer.Predictive(model, posterior_samples=...)``.
        :rtype: dict
        """
        num_draws = check_num_samples(num_draws, "sample_posterior(num_draws)")
        with torch.no_grad():
            model_trace, guide_trace = self._one_draw(model, guide, args, kwargs)
        return posterior.sample_posterior(model_trace, guide_trace, num_draws)



def _zero_if_none(grad, like):
    return torch.zeros_like(like) if grad is None else grad
