"""Shape arithmetic on the host (cheaper than torch's for a site's few dims), and the shapes of a site."""

from typing import Sequence

import torch


def broadcast_shape(*shapes: Sequence[int]) -> torch.Size:
    """
    The broadcast of ``shapes``, as :func:`torch.broadcast_shapes` gives it (which
    costs ~50 us a call; this runs for every site, every step).

    :raises RuntimeError: as torch does, for shapes that do not broadcast.
    """
    width = max((len(s) for s in shapes), default=0)
    result = [1] * width
    for shape in shapes:
        for i, size in enumerate(shape, width - len(shape)):
            if size != 1:
                if result[i] not in (1, size):
                    return torch.broadcast_shapes(*shapes)  # raises, naming the shapes
                result[i] = size
    return torch.Size(result)


def packed_view(term: torch.Tensor, dims: Sequence[str]) -> torch.Tensor:
    """
    A packed tensor (``._pyro_dims`` names its dims) viewed with its dims in the
    order ``dims``, which holds them all, and size 1 at each dim it lacks: it then
    broadcasts against any tensor laid out over ``dims``. An empty name in ``dims``
    is a slot no dim fills (size 1). No copy is made.
    """
    own = [d for d in dims if d and d in term._pyro_dims]  # "" is in every string
    aligned = term.permute(tuple(term._pyro_dims.index(d) for d in own))
    sizes = dict(zip(own, aligned.shape))
    return aligned.reshape([sizes.get(d, 1) for d in dims])


def log_prob_shape(site) -> torch.Size:
    """The shape of a sample site's log density: its value's batch shape broadcast with its distribution's."""
    value = site["value"]
    return broadcast_shape(value.shape[: value.dim() - site["fn"].event_dim], site["fn"].batch_shape)


def particle_shape(site) -> torch.Size:
    """
    The shape of a latent site's particle dim and plates: its value without the
    event dims, broadcast over its plates (enumerated values are not expanded).
    """
    value = site["value"]
    shape = value.shape[: value.dim() - site["fn"].event_dim]
    for frame in site["cond_indep_stack"]:
        if frame.vectorized:
            plate = [1] * -frame.dim
            plate[frame.dim] = frame.size
            shape = broadcast_shape(shape, plate)
    return shape
