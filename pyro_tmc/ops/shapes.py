"""Shape arithmetic on the host (cheaper than torch's for a site's few dims), and the shapes of a site."""

from collections.abc import Sequence

import torch


def broadcast_shape(*shapes: Sequence[int]) -> torch.Size:
    """
    The broadcast of ``shapes``, as :func:`torch.broadcast_shapes` gives it (which
    is far dearer per call than this arithmetic on tuples; this runs for every site,
    every step).

    :raises RuntimeError: as torch does, for shapes that do not broadcast.
    """
    if len(shapes) == 2:  # a value's batch shape and its distribution's: nearly every call
        return _broadcast_pair(*shapes)
    result = torch.Size()
    for shape in shapes:
        result = _broadcast_pair(result, shape)
    return result


def _broadcast_pair(a: Sequence[int], b: Sequence[int]) -> torch.Size:
    """The broadcast of two shapes; where the shorter is the longer's tail (the common case), no loop."""
    if len(a) < len(b):
        a, b = b, a
    pad = len(a) - len(b)
    if a[pad:] == b:  # a list and a tuple never compare equal: the loop below then runs
        return a if type(a) is torch.Size else torch.Size(a)
    result = list(a)
    for i, size in enumerate(b, pad):
        if size != 1 and result[i] != size:
            if result[i] != 1:
                return torch.broadcast_shapes(a, b)  # raises, naming the shapes
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
