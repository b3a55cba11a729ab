"""A sparse Hessian of a model's log joint from a few Hessian-vector products.

A Laplace approximation (:mod:`pyro_tmc.infer.laplace`) needs the Hessian of the log joint density in
every covered coordinate, and row by row it costs one backward pass per coordinate: 104 passes a
Hessian for the 100-day stochastic volatility in ``pyro.markov`` (3 globals, 100 days, 22 ms a pass),
97% of its Laplace approximation's 36 s. Most entries of such a Hessian are zero by the model's
structure: two coordinates meet only where one factor reads both, and, inside a plate the factor is
in, only at the same index. So the columns that no one row meets twice can share one
Hessian-vector product (Curtis, Powell and Reid 1974; the colouring of Coleman and Moré 1984), and
the few coordinates that meet nearly every other one (the globals) are taken column by column:
3 global columns and 3 colours of days, 7 passes with the check, not 104.

:func:`hessian_pattern` reads where the entries can be non-zero from one trace of the model (which
sites each factor's log density depends on, by autograd, and the plates each sits in), and chooses
the dense columns and the colours; :func:`coloured_hessian` assembles the Hessian from the products
and checks it against one more product with a random vector, so a model that meets its coordinates
in ways the plates do not say (a factor reading another index of a site in its plate) is found, and
its Hessian taken row by row as before.

Reference: Curtis, Powell and Reid (1974) "On the estimation of sparse Jacobian matrices";
Coleman and Moré (1984) "Estimation of sparse Hessian matrices and graph coloring problems".
"""

import math
from typing import Callable, NamedTuple, Optional

import torch

from pyro import poutine

#: candidate fractions of the coordinates, by how many others each meets, taken as dense columns
#: (beside the globals, which always are): the choice is the one of fewest products
DENSE_QUANTILES = (1.0, 0.9, 0.75, 0.5, 0.25)


class HessianPattern(NamedTuple):
    """
    How :func:`coloured_hessian` assembles a Hessian.

    :ivar torch.Tensor dense: the coordinates taken column by column (one product each).
    :ivar tuple plan: per colour, its members' mask ``(N,)``, and the rows and columns of the entries
        its product holds (each row's entry at the one member it meets).
    :ivar int passes: backward passes a Hessian takes: the dense columns, the colours and the check.
    """

    dense: torch.Tensor
    plan: tuple
    passes: int


def hessian_pattern(
    model: Callable, proposal, coordinates: dict, args: tuple, kwargs: dict, scored: Callable
) -> Optional[HessianPattern]:
    """
    The :class:`HessianPattern` of ``model``'s log joint in ``proposal``'s coordinates (the globals'
    first, then each local's, as :func:`~pyro_tmc.infer.laplace.split_coordinates` lays them out:
    ``coordinates``, a point's, site by site), its factors those ``scored`` keeps (a site filter), or
    ``None`` where it would not save passes over one per coordinate, or where the structure cannot be
    read (a ``vectorized_markov`` chain, whose previous steps are its later steps shifted: its own
    :class:`~pyro_tmc.infer.laplace.ChainBand` serves it; a model that rejects the point read).
    """
    if proposal.chain_links:
        return None
    structure = nonzero_structure(model, proposal, coordinates, args, kwargs, scored)
    if structure is None:
        return None
    n = len(structure)
    best = None
    for dense in _dense_candidates(structure, proposal.num_globals):
        rest = (~dense).nonzero().squeeze(-1)
        colours = greedy_colours(_conflicts(structure, rest))
        passes = int(dense.sum()) + (int(colours.max()) + 1 if len(rest) else 0) + 1
        if best is None or passes < best[0]:
            best = (passes, dense, rest, colours)
    passes, dense, rest, colours = best
    if passes >= n:
        return None
    return HessianPattern(dense.nonzero().squeeze(-1), _plan(structure, rest, colours), passes)


def nonzero_structure(
    model: Callable, proposal, coordinates: dict, args: tuple, kwargs: dict, scored: Callable
) -> Optional[torch.Tensor]:
    """
    Where the Hessian of the log joint can be non-zero, ``(N, N)`` booleans: between two coordinates of
    sites that one factor's log density depends on (autograd's graph, at ``coordinates``), at the
    same index of every plate the factor and both sites are in; and within each element of a site
    (its event, and its transform's log-Jacobian). ``None`` where the model rejects the point.
    """
    layouts = proposal.globals + proposal.locals
    leaves = {name: part.detach().clone().requires_grad_(True) for name, part in coordinates.items()}
    offsets = dict(zip([layout.name for layout in layouts], _offsets(layouts)))
    n = sum(layout.size for layout in layouts)
    structure = torch.zeros(n, n, dtype=torch.bool)
    with torch.enable_grad():
        values = {
            layout.name: layout.transform(leaves[layout.name].to(torch.get_default_dtype()))
            for layout in layouts
        }
        try:
            trace = poutine.trace(poutine.condition(model, values)).get_trace(*args, **kwargs)
            trace.compute_log_prob(scored)
        except (ValueError, RuntimeError):  # a point outside a distribution's support
            return None
        names = list(leaves)
        indices = {layout.name: _plate_indices(layout, trace.nodes[layout.name]) for layout in layouts}
        for site in trace.nodes.values():
            if site["type"] != "sample" or "log_prob" not in site or not site["log_prob"].requires_grad:
                continue
            grads = torch.autograd.grad(
                site["log_prob"].sum(), [leaves[name] for name in names], retain_graph=True, allow_unused=True
            )
            reads = [name for name, grad in zip(names, grads) if grad is not None]
            frames = {frame.name for frame in site["cond_indep_stack"] if frame.vectorized}
            for a in reads:
                for b in reads:
                    block = _meets(indices[a], indices[b], frames)
                    rows = slice(offsets[a], offsets[a] + block.shape[0])
                    structure[rows, offsets[b] : offsets[b] + block.shape[1]] |= block
    for layout in layouts:  # each element's own coordinates: its event and its log-Jacobian
        own = indices[layout.name]["element"]
        start = offsets[layout.name]
        structure[start : start + layout.size, start : start + layout.size] |= own.unsqueeze(-1) == own
    return structure


def _offsets(layouts) -> list[int]:
    starts, start = [], 0
    for layout in layouts:
        starts.append(start)
        start += layout.size
    return starts


def _plate_indices(layout, site) -> dict:
    """
    Per coordinate of ``layout``: its element (its index in the batch, ``"element"``), and its index
    along each plate the site is in and spans (by the plate's name).
    """
    batch_shape = tuple(layout.batch_shape)
    element = torch.arange(layout.size) // max(layout.event_size, 1)
    indices = {"element": element}
    for frame in site["cond_indep_stack"]:
        position = len(batch_shape) + frame.dim
        if frame.vectorized and position >= 0 and batch_shape[position] > 1:
            stride = math.prod(batch_shape[position + 1 :])
            indices[frame.name] = (element // stride) % batch_shape[position]
    return indices


def _meets(a: dict, b: dict, frames: set) -> torch.Tensor:
    """Where two sites can meet in a factor in ``frames``: the same index in each plate of all three."""
    block = torch.ones(len(a["element"]), len(b["element"]), dtype=torch.bool)
    for name in frames:
        if name in a and name in b:
            block &= a[name].unsqueeze(-1) == b[name]
    return block


def _dense_candidates(structure: torch.Tensor, num_globals: int):
    """Masks of the coordinates to take column by column: the globals, and those meeting the most others."""
    n = len(structure)
    degree = structure.sum(-1).float()
    globals_mask = torch.arange(n) < num_globals
    for quantile in DENSE_QUANTILES:
        threshold = float(torch.quantile(degree, quantile)) if quantile < 1 else math.inf
        yield globals_mask | (degree > threshold)


def _conflicts(structure: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """Which of the ``rest`` columns one row of ``rest`` meets both of: they cannot share a product."""
    block = structure[rest][:, rest].float()
    return (block.T @ block) > 0


def greedy_colours(conflicts: torch.Tensor) -> torch.Tensor:
    """
    A colour per column, no two conflicting columns sharing one: each column, most conflicted first,
    takes the smallest colour none of its coloured neighbours holds (Welsh and Powell 1967).
    """
    m = len(conflicts)
    colours = torch.full((m,), -1, dtype=torch.long)
    for column in conflicts.sum(-1).argsort(descending=True).tolist():
        taken = colours[conflicts[column]]
        taken = taken[taken >= 0]
        if not len(taken):
            colours[column] = 0
            continue
        used = torch.zeros(int(taken.max()) + 2, dtype=torch.bool)
        used[taken] = True
        colours[column] = int((~used).nonzero()[0])
    return colours


def _plan(structure: torch.Tensor, rest: torch.Tensor, colours: torch.Tensor) -> tuple:
    """Per colour: its members' mask, and the (row, column) of each entry its product holds."""
    n = len(structure)
    rest_rows = structure[rest]
    plan = []
    for colour in range(int(colours.max()) + 1 if len(rest) else 0):
        members = rest[colours == colour]
        rows, positions = rest_rows[:, members].nonzero(as_tuple=True)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[members] = True
        plan.append((mask, rest[rows], members[positions]))
    return tuple(plan)


def coloured_hessian(
    gradient: torch.Tensor, u: torch.Tensor, pattern: HessianPattern
) -> Optional[torch.Tensor]:
    """
    The Hessian at ``u`` from ``gradient`` (differentiable, of the log density at ``u``) by
    ``pattern``'s products, checked against one more with a random vector: ``None`` where they disagree.
    """

    def product(vector: torch.Tensor) -> torch.Tensor:
        (result,) = torch.autograd.grad(
            gradient, u, grad_outputs=vector, retain_graph=True, allow_unused=True
        )
        return torch.zeros_like(u) if result is None else result.detach()

    n = len(u)
    hessian = torch.zeros(n, n, dtype=u.dtype)
    for column in pattern.dense.tolist():
        values = product(torch.nn.functional.one_hot(torch.tensor(column), n).to(u.dtype))
        hessian[:, column] = values
        hessian[column, :] = values
    for members, rows, columns in pattern.plan:
        hessian[rows, columns] = product(members.to(u.dtype))[rows]
    if not _agrees_with_probe(hessian, product, u):
        return None
    return (hessian + hessian.T) / 2


def _agrees_with_probe(hessian: torch.Tensor, product: Callable, u: torch.Tensor) -> bool:
    """Whether ``hessian`` times a fixed random vector equals ``product`` of it (one more backward pass)."""
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(len(u), dtype=u.dtype, generator=generator)
    exact = product(probe)
    # the model's float32 arithmetic differs between passes by its rounding of each row's terms
    # (the 100-day volatility's: 3e-6 of the largest row's magnitude, 4e-4 of a row's own where they
    # cancel); a missed entry, by the entry itself
    magnitude = hessian.abs() @ probe.abs()
    tolerance = 1e-3 * magnitude + 1e-5 * float(magnitude.max())
    return bool(((hessian @ probe - exact).abs() <= tolerance).all())
