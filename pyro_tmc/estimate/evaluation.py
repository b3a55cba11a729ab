"""How a draw's estimate is evaluated: one plan, decided once per draw.

The estimate is one sum-product, ``log P_TMC`` (:mod:`pyro_tmc.estimate.factors` is its
math, :mod:`pyro_tmc.ops.contraction` its contraction). *How* it is computed takes
a few choices, and each is made here, once, when a draw is made
(:meth:`pyro_tmc.infer.draw.TMCDraw.run`). Every path that computes the
estimate reads the same :class:`EvaluationPlan`, a plain value: the eager factors and
contraction, the compiled estimate (:mod:`pyro_tmc.compile.compiled`, which traces
them), and the posterior read-outs.

- **Scales** (:class:`~pyro_tmc.estimate.scales.ScalePlan`): where each site's scale
  acts, on its factor or on the log of a plate's sum.
- **Whole or sliced factors**: a memory budget (``max_factor_bytes``, resolved
  once by :func:`~pyro_tmc.estimate.budget.factor_budget`) above which a latent's
  ``log p`` is built slice by slice during the contraction.
- **Stacked or per-site densities**: like sites' densities are evaluated in one
  call (:mod:`pyro_tmc.estimate.batched_densities`), and a chain's links are then taken
  in one operation per stack (:func:`~pyro_tmc.ops.chain_factors.reduce_chains`).
  A stack holds whole factors, so a budget turns stacking off.
- **Eager or a cached program** is the draw's to choose, not the plan's: ``compile=``
  traces the eager code into a graph per plan
  (:class:`~pyro_tmc.compile.compiled.EstimateProgram`), except for sliced factors,
  which checkpoint their slices, which a graph cannot: a budget runs eagerly.

Which contraction order, and whether a chain is taken by a log-depth tree, is the
contraction's own choice from the factors' dims (as ``opt_einsum`` chooses a
path), not the plan's.
"""

from dataclasses import dataclass
from typing import Optional, Union

from pyro_tmc.estimate.budget import factor_budget
from pyro_tmc.estimate.scales import ScalePlan
from pyro_tmc.ops.memory import AUTO, itemsize


@dataclass(frozen=True)
class EvaluationPlan:
    """
    How one draw's estimate is evaluated (see the module docstring).

    :param ScalePlan scales: where each site's scale acts.
    :param int max_factor_elements: the resolved budget, in elements, above which
        a latent's ``log p`` is built in slices; ``None`` builds every factor whole.
    :param max_factor_bytes: the budget as the user set it (bytes, ``"auto"`` or
        ``None``), named in memory errors.
    """

    scales: ScalePlan
    max_factor_elements: Optional[int] = None
    max_factor_bytes: Union[int, str, None] = None

    @property
    def sliced(self) -> bool:
        """Whether factors above the budget are built slice by slice."""
        return self.max_factor_elements is not None

    @property
    def stacks_densities(self) -> bool:
        """Whether like sites' densities are evaluated in one stacked call (whole factors only)."""
        return not self.sliced


def plan_evaluation(model_trace, scales: ScalePlan, max_factor_bytes=None) -> EvaluationPlan:
    """
    The evaluation plan of a draw, its memory budget resolved once.

    :param model_trace: the draw's finished model trace (its sites' shapes set the budget).
    :param ScalePlan scales: the draw's scale plan.
    :param max_factor_bytes: bytes per factor, ``"auto"`` or ``None`` (see ``TMC_ELBO``).
    :raises FactorMemoryError: under ``"auto"``, where a factor's smallest slice cannot fit.
    """
    elements = max_factor_bytes
    if max_factor_bytes is not None and max_factor_bytes != AUTO:
        elements = max_factor_bytes // itemsize()
    return EvaluationPlan(scales, factor_budget(model_trace, elements), max_factor_bytes)
