"""TMC_ELBO: the Tensor Monte Carlo bound as a drop-in Pyro SVI loss: settings, and a draw per step."""

import warnings
from typing import TYPE_CHECKING, Optional, Union

import torch

from pyro.util import warn_if_nan

from pyro_tmc.infer.base import DifferentiableLossELBO, compiled_programs
from pyro_tmc.infer.broadcast_check import BroadcastCheck
from pyro_tmc.infer.chain_plan import ChainPlans
from pyro_tmc.infer.draw import DrawSettings, TMCDraw
from pyro_tmc.infer.estimators import make_estimator
from pyro_tmc.ops.capture import is_tracing
from pyro_tmc.ops.memory import check_max_factor_bytes
from pyro_tmc.poutine.proposals import check_proposal
from pyro_tmc.poutine.tmc_messenger import check_num_samples

if TYPE_CHECKING:
    from pyro_tmc.compile.config import CompileConfig

#: registered estimators that belong to another loss (TMC_RWS's wake-sleep)
NOT_VARIANCE_REDUCTIONS = ("rws",)


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
    :mod:`pyro_tmc.poutine.proposals`). Unlike :class:`pyro.infer.TraceTMC_ELBO`, no
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
    :param max_factor_bytes: a memory budget in bytes: a site's log-density
        factor larger than this is computed and summed out in slices along the
        site's particle dim (with activation checkpointing), same result.
        ``"auto"`` (default): 1/8 of the memory available when the factors are
        built (host RAM, or the CUDA device's free memory), read only when a
        factor exceeds 64 MiB, so small models build every factor whole.
        ``None``: every factor whole, whatever its size. A factor that cannot
        fit even in its smallest slice raises
        :class:`~pyro_tmc.ops.memory.FactorMemoryError` (a ``MemoryError``).
    :param str compile: ``None`` (default): every step runs eagerly.
        ``"graph"``: each step of ``loss_and_grads`` (what ``SVI.step`` calls)
        is captured once per argument shapes into one graph of tensor
        operations (guide, model, estimate and gradients, random draws
        included) and replayed at later steps with no Python per sample
        statement (:mod:`pyro_tmc.compile.captured_step`, whose docstring states the
        contract: structure static for given argument shapes). ``"inductor"``:
        that graph is also compiled by ``torch.compile``. Values and gradients
        equal the eager step's on the same draws; what cannot be captured runs
        eagerly, with one warning saying why.
    :param compile_options: a :class:`~pyro_tmc.compile.CompileConfig`, every setting
        of the capture engine with the reason for its default (the loss keeps a copy,
        ``loss.compile_config``); or a dict, its ``torch_compile``: keyword arguments for
        ``torch.compile`` with ``compile="inductor"``, e.g. ``{"mode": "reduce-overhead"}``
        (CUDA graphs), or ``{"options": {...}}`` (inductor settings). A captured whole step
        is compiled by inductor from its graph directly (``torch._inductor.compile``,
        with those settings), except with CUDA graphs or another ``backend``
        (:func:`pyro_tmc.compile.compiled.compiled_step_graph`). On the CPU it gets
        inductor's C++ wrapper unless the settings name ``cpp_wrapper``
        (``CompileConfig.cpu_step_settings``).
    :param str compile_scope: ``"step"`` (default): capture whole steps, as
        above; ``"estimate"``: run guide and model eagerly and capture only the
        estimate from their traces (:mod:`pyro_tmc.compile.compiled`), for a model whose
        structure changes from step to step. Whatever is not captured whole
        (``loss``, ``differentiable_loss``, the read-outs) uses the estimate
        program either way.
    :param int check_every: with ``compile_scope="step"``, one step in this many
        runs eagerly and checks that the model's structure is the captured one
        (``None``: ``CompileConfig.check_every``, 100 by default).

    References

    [1] `Tensor Monte Carlo: Particle Methods for the GPU Era`,
        Laurence Aitchison (NeurIPS 2019)
    """

    def __init__(
        self,
        num_samples: int = 8,
        max_plate_nesting: float = float("inf"),
        proposal: str = "mixture",
        variance_reduction: Optional[str] = None,
        num_particles: int = 1,
        vectorize_particles: bool = False,
        max_factor_bytes: Union[int, str, None] = "auto",
        compile: Optional[str] = None,
        compile_options: Union[dict, "CompileConfig", None] = None,
        compile_scope: str = "step",
        check_every: Optional[int] = None,
        **kwargs,
    ) -> None:
        self.num_samples = check_num_samples(num_samples, "TMC_ELBO(num_samples)")
        self.max_factor_bytes = check_max_factor_bytes(max_factor_bytes)
        self.compile = compile
        if compile_scope not in ("step", "estimate"):
            raise ValueError(f"compile_scope must be 'step' or 'estimate', got {compile_scope!r}")
        self.compile_scope = compile_scope
        programs = compiled_programs(compile, compile_options, compile_scope, check_every)
        self.program, self.step_program = programs
        #: the capture engine's settings (a copy of ``compile_options``), read at each step
        self.compile_config = None if compile is None else self.program.config
        self.broadcast_check = BroadcastCheck()
        self.chain_plans = ChainPlans()
        self.proposal = check_proposal(proposal)
        self.estimator = self._make_estimator(variance_reduction)
        self.variance_reduction = variance_reduction
        check_num_samples(num_particles, "TMC_ELBO(num_particles)")
        super().__init__(
            num_particles=num_particles,
            max_plate_nesting=max_plate_nesting,
            vectorize_particles=vectorize_particles,
            **kwargs,
        )

    def _make_estimator(self, variance_reduction):
        return make_estimator(variance_reduction, exclude=NOT_VARIANCE_REDUCTIONS)

    # -- draws ---------------------------------------------------------------

    def _settings(self) -> DrawSettings:
        return DrawSettings(
            self.num_samples,
            self.proposal,
            self.max_plate_nesting,
            self.max_factor_bytes,
            program=self.program,
            broadcast_check=self.broadcast_check,
            chain_plans=self.chain_plans,
        )

    def _checked(self, draw: TMCDraw) -> TMCDraw:
        """A hook for subclasses that restrict the models they take."""
        return draw

    def _prepared(self, model, guide, args, kwargs):
        """Model and guide as one draw runs them (vectorised repetitions), and how many draws to average."""
        if self.max_plate_nesting == float("inf"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._guess_max_plate_nesting(model, guide, args, kwargs)
        if self.vectorize_particles:
            return self._vectorized_num_particles(model), self._vectorized_num_particles(guide), 1
        return model, guide, self.num_particles

    def draw(self, model, guide, *args, **kwargs) -> TMCDraw:
        """
        One TMC draw of particles for every latent site, with the traces that
        hold them (no gradient-estimator leaves): what ``log_evidence`` and the
        posterior read-outs use.

        :rtype: ~pyro_tmc.infer.draw.TMCDraw
        """
        model, guide, _ = self._prepared(model, guide, args, kwargs)
        return self._checked(TMCDraw.run(model, guide, args, kwargs, self._settings()))

    def _get_trace(self, model, guide, args, kwargs):
        """Pyro's ELBO protocol: the (model, guide) traces of one draw."""
        draw = TMCDraw.run(model, guide, args, kwargs, self._settings())
        return draw.model_trace, draw.guide_trace

    # -- the loss ------------------------------------------------------------

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        """
        :returns: ``-log P_TMC``, averaged over ``num_particles`` independent
            draws; differentiable, with the gradient of the chosen estimator.
        :rtype: torch.Tensor
        """
        model, guide, repeats = self._prepared(model, guide, args, kwargs)
        settings = self._settings()
        total = 0.0
        for _ in range(repeats):
            if torch.is_grad_enabled():
                draw = self._checked(self.estimator.draw(model, guide, args, kwargs, settings))
                total = total + self.estimator.surrogate(draw)
            else:  # the value alone: no leaves, no surrogate
                total = (
                    total + self._checked(TMCDraw.run(model, guide, args, kwargs, settings)).log_estimate()
                )
        loss = -total / self.num_particles
        if not is_tracing():  # a step being captured checks its output instead
            warn_if_nan(loss, "loss")
        return loss

    # -- the posterior of one draw -------------------------------------------

    def _one_draw(self, model, guide, args, kwargs) -> TMCDraw:
        if self.num_particles != 1:
            raise NotImplementedError(
                "Posterior read-outs use one TMC draw: construct the ELBO with num_particles=1."
            )
        with torch.no_grad():
            return self.draw(model, guide, *args, **kwargs)

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
        return self._one_draw(model, guide, args, kwargs).marginals()

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
        draw = self._one_draw(model, guide, args, kwargs)
        with torch.no_grad():
            return draw.sample(num_draws)
