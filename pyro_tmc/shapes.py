"""Shape arithmetic on the host, cheaper than torch's for the few dims a site has."""

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
