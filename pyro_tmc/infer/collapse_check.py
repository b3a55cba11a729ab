"""``pyro.poutine.collapse`` under TMC: a clear refusal of the one case it cannot run.

``poutine.collapse`` (it needs ``funsor``) hides the sites inside its context
from every outer handler and, on leaving it, records their conjugate marginal as
one ``pyro.factor`` named after the first collapsed latent. TMC contracts that
factor like any other, so collapsing works when the collapsed sites depend only
on parameters, data and plates. A collapsed site whose distribution depends on
a latent that TMC gives particles cannot run: ``funsor.to_funsor`` names only
the plate dims of a batch shape and fails on the particle dim (with funsor's
bare "Invalid shape"). :func:`collapse_refusal` turns that failure into a
``NotImplementedError`` that names the site, the latent and the fix.

Reference: Pyro's ``pyro.poutine.collapse_messenger.CollapseMessenger``.
"""

import traceback
from typing import Optional

import torch

from pyro.poutine.collapse_messenger import CollapseMessenger


def collapse_refusal(error: BaseException, particle_dims: dict[int, tuple[str, int]]):
    """
    :param error: an error raised while running a model or guide under ``tmc``.
    :param dict particle_dims: ``dim -> (site, K)``: the particle dims present
        (:attr:`~pyro_tmc.poutine.TMCMessenger.particle_dims`).
    :returns: a ``NotImplementedError`` naming the collapsed site and the latent
        whose particle dim it varies along, if ``error`` was raised while
        ``poutine.collapse`` converted such a site; else ``None``.
    """
    msg = collapsed_message(error)
    if msg is None:
        return None
    varying = [dim for dim in sorted(particle_dims) if _varies_along(msg, dim)]
    if not varying:
        return None  # the collapse failed for a reason of its own (e.g. no conjugacy)
    latents = ", ".join(f"'{particle_dims[dim][0]}' (dim {dim})" for dim in varying)
    return NotImplementedError(
        f"Site '{msg['name']}' is inside pyro.poutine.collapse and varies along the particle "
        f"dim of {latents}: collapse names only plate dims, so a collapsed site cannot depend on "
        "a latent that TMC samples or enumerates. Move that latent inside the collapse context "
        "too (if the pair is conjugate), or write the collapsed marginal out with pyro.factor."
    )


def collapsed_message(error: BaseException) -> Optional[dict]:
    """The message ``CollapseMessenger._pyro_sample`` was converting when ``error`` was raised, if any."""
    for frame, _ in traceback.walk_tb(error.__traceback__):
        if isinstance(frame.f_locals.get("self"), CollapseMessenger) and isinstance(
            frame.f_locals.get("msg"), dict
        ):
            return frame.f_locals["msg"]
    return None


def _varies_along(msg: dict, dim: int) -> bool:
    """Whether the site's distribution or given value has more than one entry along batch dim ``dim``."""
    fn = msg.get("fn")
    batch_shapes = [getattr(fn, "batch_shape", ())]
    value = msg.get("value")
    if isinstance(value, torch.Tensor):
        event_dim = getattr(fn, "event_dim", 0)
        batch_shapes.append(value.shape[: value.dim() - event_dim])
    return any(len(shape) >= -dim and shape[dim] > 1 for shape in batch_shapes)
