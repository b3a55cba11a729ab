"""Drawing K particles for one sample site, and their proposal density.

A site whose distribution depends on upstream particles has a batch dim for each
upstream latent (its *parent dims*). Drawing one particle per combination of
parents would cost ``K * prod(K_parent)`` samples; TMC needs only ``K``. Each
particle ``k`` therefore picks one particle of every parent (the *ancestor*
choice below) and is drawn from the conditional given those ancestors. We index
the distribution's parameters by the ancestors *before* sampling ("thin"
sampling), falling back to drawing all combinations and keeping K of them only
for distributions whose parameters we cannot index.

The proposal density of particle ``k`` must be indexed by ``k`` alone, or the
TMC estimate is biased (Aitchison 2019, appendix "TMC for non-factorised
proposals"). Given all upstream particles, particle ``k`` is distributed as

- ``"mixture"`` and ``"permutation"``: the uniform mixture over all upstream
  particles, ``mean_{k'} q(z^k | z_pa^{k'})`` (a permutation only couples the
  particles; each one's marginal is still the mixture);
- ``"diagonal"``: ``q(z^k | z_pa^k)``.

Each strategy's density is exactly that conditional, so every term of the TMC
average is an unbiased importance weight.
"""

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from torch.distributions import Distribution, Independent

from . import log_density

PROPOSALS = ("mixture", "permutation", "diagonal")


def check_proposal(proposal: str) -> str:
    """
    :param str proposal: a proposal strategy name.
    :returns: ``proposal``, if it is one of :data:`PROPOSALS`.
    :raises ValueError: otherwise.
    """
    if proposal not in PROPOSALS:
        raise ValueError(
            f"Unknown proposal {proposal!r}: expected one of {', '.join(map(repr, PROPOSALS))}."
        )
    return proposal


@dataclass
class ParticleDraw:
    """
    What a site's particles were drawn from, kept in ``site["infer"]["_tmc_draw"]``
    so that the factors can evaluate the proposal density indexed by ``k`` alone.

    :param int num_particles: K, the number of particles of this site.
    :param str strategy: the proposal strategy used for the parent dims.
    :param tuple parent_dims: the upstream particle dims (negative, relative to the
        right of the site's batch shape) on which the site's distribution depends.
    :param bool thin: whether the particles were drawn from the distribution
        indexed by their ancestors (K draws), rather than by the fallback that
        draws one particle per parent combination and keeps K.
    :param dict ancestors: parent dim -> LongTensor of shape ``(K,) + plate
        shape`` (right-aligned at the particle dim), the ancestor of each particle
        in each plate element.
    :param int target_dim: the particle dim of this site.
    """

    num_particles: int
    strategy: str
    parent_dims: Tuple[int, ...]
    thin: bool
    ancestors: Dict[int, torch.Tensor]
    target_dim: int
    #: the distribution drawn from and its ancestor-indexed copy, reused while scoring that same distribution
    source_fn: Optional[Distribution] = None
    thin_fn: Optional[Distribution] = None


def choose_ancestors(
    site_name: str,
    strategy: str,
    parent_sizes: Dict[int, int],
    num_particles: int,
    device: torch.device,
    element_shape: Tuple[int, ...] = (),
) -> Dict[int, torch.Tensor]:
    """
    For each parent dim, the ancestor (an index into that parent's particles) of
    each of this site's ``num_particles`` particles, chosen anew for every plate
    element: a particle shared by all elements of a plate that its parent is
    outside would couple them, and the product over the plate would be biased.

    :param tuple element_shape: the site's plate shape, right-aligned at the
        particle dim: each returned tensor has shape ``(K,) + element_shape``.
    :raises ValueError: if ``"permutation"`` or ``"diagonal"`` meets a parent with
        another number of particles.
    """
    if strategy != "mixture":
        mismatched = {d: s for d, s in parent_sizes.items() if s != num_particles}
        if mismatched:
            raise ValueError(
                f"Site '{site_name}' draws {num_particles} particles with "
                f"proposal={strategy!r}, which needs every upstream latent to have the "
                f"same number, but its parents have {sorted(mismatched.values())}. "
                "Use proposal='mixture', or give the site and its parents equal num_samples."
            )
    shape = (num_particles,) + tuple(element_shape)
    ancestors = {}
    for dim, size in parent_sizes.items():
        if strategy == "mixture":
            ancestors[dim] = torch.randint(size, shape, device=device)
        elif strategy == "permutation":  # an independent permutation per plate element
            ancestors[dim] = torch.rand(shape, device=device).argsort(0)
        else:
            ancestors[dim] = torch.arange(size, device=device).reshape((size,) + (1,) * len(element_shape))
    return ancestors


def _particle_index(num: int, target_dim: int, device) -> torch.Tensor:
    """``arange(num)`` laid out along ``target_dim``."""
    return torch.arange(num, device=device).reshape((num,) + (1,) * (-target_dim - 1))


def _select_particles(
    x: torch.Tensor,
    batch_ndim: int,
    picks: Dict[int, torch.Tensor],
    target_dim: int,
) -> torch.Tensor:
    """
    Vectorised gather over the batch dims of ``x`` (its leftmost ``batch_ndim``
    dims; the rest are event dims): each dim in ``picks`` is replaced by the
    entries ``picks[dim]``, laid out with ``k`` along ``target_dim`` (and plate
    elements at their dims); other batch dims are kept in place.
    """
    index = []
    for i in range(batch_ndim):
        dim = i - batch_ndim
        size = x.shape[i]
        if dim in picks and size > 1:
            pick = picks[dim]
            index.append(pick.reshape(pick.shape + (1,) * (-target_dim - pick.dim())))
        elif size > 1:
            index.append(torch.arange(size, device=x.device).reshape((size,) + (1,) * (-dim - 1)))
        else:
            index.append(torch.zeros((), dtype=torch.long, device=x.device))
    if all(i.dim() == 0 for i in index):  # constant over the batch: broadcasts as is
        return x.reshape(x.shape[batch_ndim:])
    return x[tuple(index)]


def _index_params(
    fn: Distribution, picks: Dict[int, torch.Tensor], target_dim: int
) -> Optional[Distribution]:
    """
    A distribution whose parameters are ``fn``'s, indexed by :func:`_select_particles`,
    or ``None`` if ``fn``'s parameters cannot be read generically.
    """
    if isinstance(fn, Independent):
        shift = fn.reinterpreted_batch_ndims
        base = _index_params(
            fn.base_dist, {d - shift: p.reshape(p.shape + (1,) * shift) for d, p in picks.items()}, target_dim - shift
        )
        return None if base is None else type(fn)(base, shift)  # keeps Pyro's Independent (callable)
    if type(fn).__name__ in ("MaskedDistribution", "ExpandedDistribution", "TransformedDistribution"):
        return None
    batch_ndim = len(fn.batch_shape)
    params = {}
    for name in fn.arg_constraints:
        value = fn.__dict__.get(name)
        if not isinstance(value, torch.Tensor):
            continue
        if name == "probs" and "logits" in fn.__dict__:
            continue  # one parametrisation suffices; logits are the stabler one
        if value.dim() < batch_ndim or any(
            s not in (1, b) for s, b in zip(value.shape, fn.batch_shape)
        ):
            return None
        params[name] = _select_particles(value, batch_ndim, picks, target_dim)
    if not params:
        return None
    try:
        return type(fn)(**params, validate_args=False)
    except (TypeError, ValueError):
        return None


def draw_particles(
    site_name: str,
    fn: Distribution,
    num_particles: int,
    strategy: str,
    parent_dims: Tuple[int, ...],
    target_dim: int,
) -> Tuple[torch.Tensor, ParticleDraw]:
    """
    Draw ``num_particles`` particles of a site, placed at ``target_dim``.

    :param str site_name: for error messages.
    :param Distribution fn: the site's distribution; its batch shape may carry
        the upstream particle dims ``parent_dims``.
    :param int num_particles: K.
    :param str strategy: one of :data:`PROPOSALS`.
    :param tuple parent_dims: the upstream particle dims of ``fn``'s batch shape.
    :param int target_dim: the (negative) dim that will index the particles.
    :returns: the particles (shape: K at ``target_dim``, plate dims, event shape)
        and the record of how they were drawn.
    """
    batch_shape = fn.batch_shape
    event_shape = fn.event_shape
    if not parent_dims:
        value = fn(sample_shape=torch.Size([num_particles]))
        value = _place_particle_dim(value, batch_shape, event_shape, target_dim)
        return value, ParticleDraw(num_particles, strategy, (), True, {}, target_dim)

    parent_sizes = {d: batch_shape[d] for d in parent_dims}
    device = _device_of(fn)
    element_shape = tuple(
        batch_shape[d] if -d <= len(batch_shape) and d not in parent_dims else 1
        for d in range(target_dim + 1, 0)
    )
    ancestors = choose_ancestors(site_name, strategy, parent_sizes, num_particles, device, element_shape)
    thin_fn = _index_params(fn, ancestors, target_dim)
    if thin_fn is not None:
        value = thin_fn()
    else:
        # Fallback: draw one particle per parent combination and keep K of them.
        fat = fn(sample_shape=torch.Size([num_particles]))
        picks = dict(ancestors)
        picks[-1 - len(batch_shape)] = _particle_index(num_particles, target_dim, device)
        value = _select_particles(fat, 1 + len(batch_shape), picks, target_dim)
    draw = ParticleDraw(
        num_particles, strategy, tuple(parent_dims), thin_fn is not None, ancestors, target_dim, fn, thin_fn
    )
    return value, draw


def _place_particle_dim(value, batch_shape, event_shape, target_dim):
    """Reshape a ``(K,) + batch_shape + event_shape`` sample so that K sits at ``target_dim``."""
    batch = list(batch_shape)
    while batch and batch[0] == 1:
        batch.pop(0)
    pad = -target_dim - 1 - len(batch)
    if pad < 0:
        raise ValueError(
            f"Particle dim {target_dim} collides with batch shape {tuple(batch_shape)}: "
            "increase max_plate_nesting."
        )
    return value.reshape((value.shape[0],) + (1,) * pad + tuple(batch) + tuple(event_shape))


def _device_of(fn: Distribution) -> torch.device:
    for value in vars(fn).values():
        if isinstance(value, torch.Tensor):
            return value.device
        if isinstance(value, Distribution):
            return _device_of(value)
    return torch.device("cpu")


def proposal_log_prob(
    fn: Distribution, value: torch.Tensor, draw: ParticleDraw
) -> torch.Tensor:
    """
    The log proposal density of each particle, indexed by the particle's own
    index alone (plus plate dims): see the module docstring.

    :param Distribution fn: the distribution the particles were drawn from
        (with parent dims in its batch shape).
    :param torch.Tensor value: the particles.
    :param ParticleDraw draw: how they were drawn.
    """
    if not draw.parent_dims:
        return fn.log_prob(value)
    if draw.strategy == "diagonal":
        # Reuse the indexed copy made for drawing, unless ``fn`` was recomputed
        # (from other parent values, as the path-gradient estimators do).
        thin_fn = draw.thin_fn if fn is draw.source_fn else _index_params(fn, draw.ancestors, draw.target_dim)
        if thin_fn is not None:
            return thin_fn.log_prob(value)
        log_q = fn.log_prob(value)
        picks = {d: draw.ancestors[d] for d in draw.parent_dims}
        picks[draw.target_dim] = _particle_index(draw.num_particles, draw.target_dim, value.device)
        return _select_particles(log_q, log_q.dim(), _aligned(picks, log_q.dim()), draw.target_dim)
    # mixture / permutation: average the density over every upstream particle.
    log_q = log_density.log_prob(fn, value)
    dims = [d for d in draw.parent_dims if -d <= log_q.dim() and log_q.shape[d] > 1]
    if not dims:
        return log_q
    num_components = math.prod(log_q.shape[d] for d in dims)
    return torch.logsumexp(log_q, dim=dims, keepdim=True) - math.log(num_components)


def _aligned(picks: Dict[int, torch.Tensor], ndim: int) -> Dict[int, torch.Tensor]:
    return {d: p for d, p in picks.items() if -d <= ndim}
