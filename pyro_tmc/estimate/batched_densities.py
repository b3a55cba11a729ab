"""Log densities of many sites at once: the links of a chain, evaluated in one call.

A model written as a Python loop (``for t in pyro.markov(range(T))``) has one site
per step, each with the same kind of distribution over tensors of the same shapes.
Evaluated one by one, each site costs Python work and a dozen autograd nodes;
stacked along a new leading dim, a whole group costs one call forward and one
backward. Each site then gets its slice: the same values as its own ``log_prob``
(with, at most, extra leading size-1 dims, which packing ignores).

Only distributions over scalars (Normal, Bernoulli, Gamma, Categorical, ...),
possibly wrapped in :class:`~torch.distributions.Independent`, from torch or Pyro
itself (a user's subclass may hold state its constructor does not rebuild), and
rebuilt from their constructor's tensor arguments, are grouped. A parameter's own
event dims (a Categorical's logits over its categories) stay rightmost when the
batch dims are lined up.
Everything else, and any group whose stacked evaluation fails, is evaluated site
by site as before.
"""

from collections import defaultdict
from collections.abc import Hashable, Sequence
from typing import NamedTuple, Optional

import torch
from torch.distributions import Distribution, Independent

from pyro.poutine import Trace

from pyro_tmc.ops import log_density
from pyro_tmc.poutine.proposals import constructor_parameters, proposal_log_k
from pyro_tmc.poutine.sites import guide_only_sites, is_sample, particle_draw, proposal_site

#: the smallest group worth stacking: below this, site by site is as fast
MIN_GROUP = 4

#: where the distributions that may be rebuilt from their parameters live
_KNOWN_MODULES = ("torch.distributions", "pyro.distributions")


def _parameters(base: Distribution) -> Optional[dict[str, tuple[torch.Tensor, int]]]:
    """
    The constructor's tensor arguments of a distribution over scalars
    (:func:`~pyro_tmc.poutine.proposals.constructor_parameters`), each with its own event
    dims (1 for a Categorical's logits, 0 for a Normal's loc), or ``None`` where
    the distribution cannot be rebuilt from them.
    """
    if not type(base).__module__.startswith(_KNOWN_MODULES) or base.event_shape != ():
        return None
    try:
        params = constructor_parameters(base, as_given=True)
        constraints = base.arg_constraints
    except NotImplementedError:
        return None
    if params is None:
        return None
    with_event_dims = {}
    for name, tensor in params.items():
        event_dim = _event_dim(constraints[name])
        if event_dim is None or event_dim > tensor.dim():
            return None
        with_event_dims[name] = (tensor, event_dim)
    return with_event_dims


def _event_dim(constraint) -> Optional[int]:
    """A constraint's event dim, or ``None`` where it depends on the instance (a Delta's value)."""
    try:
        return constraint.event_dim
    except NotImplementedError:
        return None


def _unwrap(fn: Distribution) -> tuple[tuple[tuple[type, int], ...], Distribution]:
    """The Independent wrappers (outermost first) and the base distribution."""
    wrappers = []
    while isinstance(fn, Independent):
        wrappers.append((type(fn), fn.reinterpreted_batch_ndims))
        fn = fn.base_dist
    return tuple(wrappers), fn


class _Member(NamedTuple):
    """One site's distribution taken apart: wrappers, base type, parameters, and its value."""

    wrappers: tuple[tuple[type, int], ...]
    base: Distribution
    params: dict[str, tuple[torch.Tensor, int]]  # name -> (tensor, its event dims)
    value: torch.Tensor


def _member(fn: Distribution, value: torch.Tensor) -> Optional[tuple[Hashable, _Member]]:
    """The group key (what sites must share to be stacked: types, names, shapes) and the parts."""
    if not isinstance(value, torch.Tensor):
        return None
    wrappers, base = _unwrap(fn)
    params = _parameters(base)
    if params is None:
        return None
    shapes = tuple((name, p.dtype, p.shape, event_dim) for name, (p, event_dim) in params.items())
    key = (wrappers, type(base), shapes, value.shape, value.dtype, value.device)
    return (key, base._validate_args), _Member(wrappers, base, params, value)


def _stack_padded(tensors: Sequence[torch.Tensor], batch_rank: int, event_dim: int = 0) -> torch.Tensor:
    """
    The tensors (all of one shape) stacked along a new dim 0, their batch dims
    left-padded with size-1 dims to ``batch_rank``: right-aligned, as broadcasting
    reads them, so that parameters and values of different ranks still line up.
    """
    stacked = torch.stack(list(tensors))
    pad = batch_rank - (stacked.dim() - 1 - event_dim)
    return stacked if pad == 0 else stacked.reshape(stacked.shape[:1] + (1,) * pad + stacked.shape[1:])


def _group_log_prob(members: list[_Member]) -> torch.Tensor:
    """The members' log densities, stacked along a new leading dim, in one call."""
    first = members[0]
    batch_rank = max([first.value.dim()] + [p.dim() - e for p, e in first.params.values()])
    stacked = {
        name: _stack_padded([m.params[name][0] for m in members], batch_rank, event_dim)
        for name, (_, event_dim) in first.params.items()
    }
    batched = type(first.base)(**stacked, validate_args=first.base._validate_args)
    for wrapper, ndims in reversed(first.wrappers):
        batched = wrapper(batched, ndims)
    return log_density.log_prob(batched, _stack_padded([m.value for m in members], batch_rank))


def _rebuilds_exactly(member: _Member) -> bool:
    """
    Whether the constructor, given the tensor parameters alone, makes the same
    distribution: a setting held outside them (a ContinuousBernoulli's ``lims``)
    would silently fall back to its default in the stacked copy.
    """
    params = {name: tensor for name, (tensor, _) in member.params.items()}
    try:
        rebuilt = type(member.base)(**params, validate_args=False)
    except Exception:
        return False
    original, again = vars(member.base), vars(rebuilt)
    for name in set(original) | set(again):
        if name == "_validate_args":
            continue
        a, b = original.get(name), again.get(name)
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            continue  # parameters, and lazy caches computed from them
        try:
            if (name in original) != (name in again) or a != b:
                return False
        except Exception:  # a value that does not compare
            return False
    return True


def stacked_log_probs(
    pairs: Sequence[tuple[Distribution, torch.Tensor]],
) -> list[Optional[tuple[torch.Tensor, int]]]:
    """
    ``fn.log_prob(value)`` for each pair that belongs to a group of at least
    :data:`MIN_GROUP` stackable pairs, computed in one call per group and given
    as ``(stack, index)``: ``stack[index]`` is the pair's log density. ``None``
    for the rest, and for a group whose stacked evaluation raised (site by site,
    the error names its site).
    """
    if len(pairs) < MIN_GROUP:
        return [None] * len(pairs)
    groups: dict[Hashable, list[tuple[int, _Member]]] = defaultdict(list)
    for i, (fn, value) in enumerate(pairs):
        keyed = _member(fn, value)
        if keyed is not None:
            groups[keyed[0]].append((i, keyed[1]))
    results: list[Optional[tuple[torch.Tensor, int]]] = [None] * len(pairs)
    for group in groups.values():
        if len(group) < MIN_GROUP or not _rebuilds_exactly(group[0][1]):
            continue
        try:
            log_probs = _group_log_prob([member for _, member in group])
        except (ValueError, RuntimeError, TypeError):
            continue
        for index, (i, _) in enumerate(group):
            results[i] = (log_probs, index)
    return results


class SiteDensities:
    """
    Log densities computed for groups of sites at once, kept as ``(stack, index)``
    by ``id`` of the site dict (:func:`stacked_log_probs`), and their packing, also
    done once per group: each site's packed factor is then a slice of one stacked
    tensor, recorded by :meth:`slice_of` (:data:`pyro_tmc.ops.chain_factors.StackedSlices`),
    which lets the contraction take a whole chain's links in one operation.
    """

    def __init__(self, log_p: dict[int, tuple], log_q: dict[int, tuple]) -> None:
        self.log_p = log_p
        self.log_q = log_q
        self._members: dict[int, tuple] = {}  # id(stack) -> (its members, stack)
        # id(stack) -> (stack less its size-1 dims, its members, kept dims, stack)
        self._squeezed: dict[int, tuple] = {}
        self._terms: dict[tuple, tuple] = {}  # (id(log q stack), detach, log K) -> (-log q - log K, stack)
        self._slices: dict[int, tuple] = {}  # id(packed factor) -> (it, its stack, its index)

    def member(self, stack: torch.Tensor, index: int) -> torch.Tensor:
        """
        ``stack[index]``, by one unbind for all members of the stack: its backward
        stacks their gradients once, where a select per member would write a whole
        stack-sized gradient for each. (Holding the stack keeps its id unique.)
        """
        if id(stack) not in self._members:
            self._members[id(stack)] = (stack.unbind(0), stack)
        return self._members[id(stack)][0][index]

    def packed(
        self, stack: torch.Tensor, index: int, dim_to_symbol: dict[int, str]
    ) -> Optional[torch.Tensor]:
        """
        ``pack(stack[index], dim_to_symbol)``, as a slice of the stack with its size-1
        dims squeezed once for all its members; ``None`` where a dim has no symbol
        (the site's own packing then raises the error that names it).
        """
        if id(stack) not in self._squeezed:
            kept = [d for d in range(1, stack.dim()) if stack.shape[d] > 1]
            squeezed = stack.reshape((stack.shape[0],) + tuple(stack.shape[d] for d in kept))
            self._squeezed[id(stack)] = (squeezed, kept, stack)
        squeezed, kept, _ = self._squeezed[id(stack)]
        rank = stack.dim() - 1  # a member's rank
        try:
            dims = "".join(dim_to_symbol[d - 1 - rank] for d in kept)
        except KeyError:
            return None
        packed = self.member(squeezed, index)
        packed._pyro_dims = dims
        self._slices[id(packed)] = (packed, squeezed, index)
        return packed

    def slice_of(self, term: torch.Tensor) -> Optional[tuple[torch.Tensor, int]]:
        """``(stack, index)`` where ``term`` is a packed factor that :meth:`packed` gave, else ``None``."""
        entry = self._slices.get(id(term))
        return None if entry is None or entry[0] is not term else entry[1:]

    def proposal_terms(self, where: tuple, detach: bool, log_k: float) -> tuple:
        """``(-log q - log K, index)`` for the ``log q`` at ``where = (stack, index)``, once per stack."""
        stack, index = where
        key = (id(stack), detach, log_k)
        if key not in self._terms:
            base = stack.detach() if detach else stack
            self._terms[key] = (-base - log_k if log_k else -base, stack)
        return self._terms[key][0], index

    def log_p_factor(self, site, dim_to_symbol: dict[int, str]) -> Optional[torch.Tensor]:
        """The site's packed ``log p`` as a slice of its group's stack, or ``None`` if it has none."""
        where = self.log_p.get(id(site))
        return None if where is None else self.packed(*where, dim_to_symbol)

    def proposal_factor(self, q_site, detach: bool, dim_to_symbol: dict[int, str]):
        """
        The packed ``-log q - log K`` of proposal ``q_site`` as a slice of one stacked
        tensor for its group (:func:`~pyro_tmc.poutine.proposals.proposal_log_k`), or ``None``.
        """
        where = self.log_q.get(id(q_site))
        if where is None:
            return None
        return self.packed(*self.proposal_terms(where, detach, proposal_log_k(q_site)), dim_to_symbol)


def site_densities(model_trace: Trace, guide_trace: Trace) -> SiteDensities:
    """
    The model's ``log p`` of every sample site, and the ``log q`` of every proposal
    that drew its particles on its own (no upstream particle dims), for the sites
    that :func:`stacked_log_probs` can evaluate in groups (the links of a
    ``pyro.markov`` chain); the others are left out.
    """
    p_sites = [
        site
        for site in model_trace.nodes.values()
        if is_sample(site)
        and not site["args"]
        and not site["kwargs"]
        and not site["infer"].get("_do_not_score")  # a vectorized_markov chain's previous steps
    ]
    latents = [site for site in p_sites if not site["is_observed"]]
    guide_only = guide_only_sites(model_trace, guide_trace)
    q_sites = []
    if len(latents) + len(guide_only) >= MIN_GROUP:  # else too few proposals to group: none read
        proposals = [proposal_site(site["name"], model_trace, guide_trace) for site in latents]
        proposals += [guide_trace.nodes[name] for name in guide_only]
        for site in proposals:
            draw = particle_draw(site)
            if draw is not None and not draw.parent_dims:
                q_sites.append(site)
    if len(p_sites) < MIN_GROUP and len(q_sites) < MIN_GROUP:
        return SiteDensities({}, {})  # a small model: nothing to group, and no work here
    log_p = stacked_log_probs([(site["fn"], site["value"]) for site in p_sites])
    log_q = stacked_log_probs([(site["fn"], site["value"]) for site in q_sites])
    return SiteDensities(
        {id(s): lp for s, lp in zip(p_sites, log_p) if lp is not None},
        {id(s): lp for s, lp in zip(q_sites, log_q) if lp is not None},
    )
