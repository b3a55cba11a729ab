"""The memory budget of a draw's log factors: which sites' factors can be sliced, and the budget.

:func:`factor_budget` reads the draw's model trace (each site's particle dim and log
density shape) and resolves ``max_factor_bytes`` to a budget in elements, from the
bytes arithmetic and memory readings of :mod:`pyro_tmc.ops.memory`; :func:`can_chunk`
says whether a site's factor can be built slice by slice along its particle dim
(:class:`~pyro_tmc.ops.chunked.ChunkedFactor`).
"""

import math
from typing import Optional

# the memory readings and floors through their module, so that each is read in one place (a
# test stands in a smaller machine by setting memory.available_bytes or memory.AUTO_MIN_BYTES)
from pyro_tmc.ops import memory
from pyro_tmc.ops.memory import AUTO, factor_memory_error, itemsize
from pyro_tmc.ops.shapes import log_prob_shape, particle_shape
from pyro_tmc.poutine.sites import has_particle_dim, own_particle_dim


def can_chunk(site) -> bool:
    """Whether a site's ``log p`` can be built in slices: a latent with more than 2 particles."""
    return (
        not site["is_observed"]
        and has_particle_dim(site)
        and particle_shape(site)[own_particle_dim(site)] > 2
    )


def factor_budget(model_trace, max_factor_elements) -> Optional[int]:
    """
    The budget, in elements, for each log factor of a draw: ``max_factor_elements``
    as given, or under ``"auto"`` (:data:`~pyro_tmc.ops.memory.AUTO`) a share of the
    memory available on the largest factor's device
    (:func:`~pyro_tmc.ops.memory.auto_budget_bytes`), read only where that factor is
    large; ``None`` builds every factor whole.

    :param model_trace: the draw's model trace (its sample sites' shapes are read).
    :raises ~pyro_tmc.ops.memory.FactorMemoryError: under ``"auto"``, where a factor's
        smallest slice (2 particles of its site, or the whole factor if it cannot be
        sliced) is larger than the memory available.
    """
    if max_factor_elements != AUTO:
        return max_factor_elements
    sites = [site for site in model_trace.nodes.values() if site["type"] == "sample"]
    size = itemsize()
    # a bound first, of C calls only (value and batch both whole): a small model stops here
    bound = max((site["value"].numel() * site["fn"].batch_shape.numel() for site in sites), default=0)
    if bound * size <= memory.AUTO_MIN_BYTES:
        return None
    sizes = [math.prod(log_prob_shape(site)) for site in sites]  # shape arithmetic only
    largest = max(range(len(sites)), key=sizes.__getitem__)
    device = sites[largest]["value"].device
    budget = memory.auto_budget_bytes(sizes[largest] * size, device)
    if budget is None:
        return None
    available = memory.available_bytes(device)
    for site, numel in zip(sites, sizes):
        if numel * size > budget:
            num_particles = particle_shape(site)[own_particle_dim(site)] if can_chunk(site) else 2
            smallest = 2 * numel // num_particles
            if smallest * size > available:
                raise factor_memory_error(site["name"], smallest * size, AUTO, available, smallest_slice=True)
    return budget // size


__all__ = ["can_chunk", "factor_budget"]
