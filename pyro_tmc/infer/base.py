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

    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        """Computes minus the bound, backpropagates it, and returns it as a float."""
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
