"""Shared by every loss: ``loss``, ``loss_and_grads`` and ``log_evidence``, from ``differentiable_loss``.

The capture engine behind ``compile=`` (:mod:`pyro_tmc.compile`) wraps a loss's step from
outside, a layer above the losses: it registers what builds a loss's programs
(:func:`register_compiler`), and a loss asks for them (:func:`compiled_programs`) without
importing it. ``import pyro_tmc`` imports the engine, so the programs are always there.
"""

from typing import Any, Callable, Optional

import torch

from pyro.infer.elbo import ELBO

#: ``"build"``: ``(compile, compile_options, compile_scope, check_every) -> (estimate program,
#: step program or None)``, registered by :mod:`pyro_tmc.compile`
_COMPILER: dict[str, Callable] = {}


def register_compiler(build: Callable) -> None:
    """Make ``build`` what a loss with ``compile=`` calls for its programs (see :func:`compiled_programs`)."""
    _COMPILER["build"] = build


def compiled_programs(
    compile: Optional[str], options, scope: str, check_every: Optional[int]
) -> tuple[Optional[Any], Optional[Any]]:
    """
    A loss's programs for ``compile=``: the estimate program that a draw asks for its
    estimate (:class:`pyro_tmc.compile.compiled.EstimateProgram`), and, with
    ``scope="step"``, the step program that ``loss_and_grads`` runs
    (:class:`pyro_tmc.compile.captured_step.StepProgram`); ``(None, None)`` without ``compile``.
    """
    if compile is None:
        return None, None
    if "build" not in _COMPILER:
        raise RuntimeError("compile= needs the capture engine: import pyro_tmc.compile")
    return _COMPILER["build"](compile, options, scope, check_every)


class DifferentiableLossELBO(ELBO):
    """
    A :class:`pyro.infer.ELBO` defined by its ``differentiable_loss``, minus a
    log-evidence bound whose gradient may be a surrogate's (STL, DReGs, RWS).
    """

    def loss(self, model, guide, *args, **kwargs) -> float:
        """:returns: minus the bound, as a float (no gradients)."""
        with torch.no_grad():
            return self.differentiable_loss(model, guide, *args, **kwargs).item()

    #: the loss's captured steps (:class:`~pyro_tmc.compile.captured_step.StepProgram`), or ``None``: eager
    step_program = None

    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        """
        Computes minus the bound, backpropagates it, and returns it as a float:
        by a captured graph of the whole step where the loss has one
        (:mod:`pyro_tmc.compile.captured_step`), else eagerly.
        """
        if self.step_program is None or not torch.is_grad_enabled():
            return self._eager_loss_and_grads(model, guide, args, kwargs)
        return self.step_program.loss_and_grads(
            lambda a, k: self._eager_loss_and_grads(model, guide, a, k),
            lambda *a, **k: self.differentiable_loss(model, guide, *a, **k),
            args,
            kwargs,
            functions=(model, guide),
        )

    def _eager_loss_and_grads(self, model, guide, args, kwargs) -> float:
        loss = self.differentiable_loss(model, guide, *args, **kwargs)
        if loss.requires_grad:
            loss.backward(retain_graph=self.retain_graph)
        return loss.item()

    def log_evidence(self, model, guide, *args, **kwargs) -> torch.Tensor:
        """
        :returns: the bound's value for one draw (averaged over ``num_particles``
            draws when that is above 1), detached: for TMC_ELBO, ``log P_TMC``.
        :rtype: torch.Tensor
        """
        with torch.no_grad():
            return -self.differentiable_loss(model, guide, *args, **kwargs)
