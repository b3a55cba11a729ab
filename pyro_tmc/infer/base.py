"""Shared by every loss: ``loss``, ``loss_and_grads`` and ``log_evidence``, from ``differentiable_loss``."""

import torch

from pyro.infer.elbo import ELBO


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
