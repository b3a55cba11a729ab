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

Strategies are classes registered by name (:data:`PROPOSALS`). To add one,
subclass :class:`ProposalStrategy` (how ancestors are chosen, and the density
of a particle given all upstream particles) and decorate it with
``@register_proposal("name")``; ``TMC_ELBO(proposal="name")`` then uses it.
"""

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.distributions import (
    Distribution,
    Independent,
    LowRankMultivariateNormal,
    MultivariateNormal,
    TransformedDistribution,
)

from pyro.distributions.torch_distribution import ExpandedDistribution, MaskedDistribution

from pyro_tmc.ops import log_density
from pyro_tmc.poutine.sites import particle_draw

#: name -> proposal strategy class
PROPOSALS: dict[str, type["ProposalStrategy"]] = {}


def register_proposal(name: str) -> Callable[[type], type]:
    """Class decorator: make a proposal strategy available under ``name``."""

    def register(cls: type) -> type:
        cls.name = name
        PROPOSALS[name] = cls
        return cls

    return register


def check_proposal(proposal: str) -> str:
    """
    :param str proposal: a proposal strategy name.
    :returns: ``proposal``, if it is registered in :data:`PROPOSALS`.
    :raises ValueError: otherwise, listing the names.
    """
    if proposal not in PROPOSALS:
        raise ValueError(f"Unknown proposal {proposal!r}: expected one of {', '.join(map(repr, PROPOSALS))}.")
    return proposal


def get_proposal(proposal) -> "ProposalStrategy":
    """The strategy object for a name (or the object itself)."""
    if isinstance(proposal, ProposalStrategy):
        return proposal
    return PROPOSALS[check_proposal(proposal)]()


class ProposalStrategy:
    """
    How a site whose distribution depends on upstream particles draws its own
    K particles, and the density of each, indexed by the particle alone.
    """

    name: str = ""
    #: whether every upstream latent must have as many particles as this site
    needs_equal_num_samples = False

    def choose(self, num_parent: int, shape: tuple[int, ...], device) -> torch.Tensor:
        """Ancestor indices (into a parent's ``num_parent`` particles) of the given shape, K leftmost."""
        raise NotImplementedError

    def log_prob(self, fn: Distribution, value: torch.Tensor, draw: "ParticleDraw") -> torch.Tensor:
        """The log density of each particle given every upstream particle, indexed by the particle."""
        raise NotImplementedError


@register_proposal("mixture")
class Mixture(ProposalStrategy):
    """Each particle picks every ancestor uniformly at random; its density is the mixture over them."""

    def choose(self, num_parent, shape, device):
        return torch.randint(num_parent, shape, device=device)

    def log_prob(self, fn, value, draw):
        log_q = log_density.log_prob(fn, value)
        dims = [d for d in draw.parent_dims if -d <= log_q.dim() and log_q.shape[d] > 1]
        if not dims:
            return log_q
        num_components = math.prod(log_q.shape[d] for d in dims)
        return torch.logsumexp(log_q, dim=dims, keepdim=True) - math.log(num_components)


@register_proposal("permutation")
class Permutation(Mixture):
    """
    The ancestors are a random permutation (per plate element), so every
    upstream particle is used once; each particle's marginal is still the mixture.
    """

    needs_equal_num_samples = True

    def choose(self, num_parent, shape, device):
        return torch.rand(shape, device=device).argsort(0)


@register_proposal("diagonal")
class Diagonal(ProposalStrategy):
    """Particle k uses upstream particle k; its density is the conditional given it."""

    needs_equal_num_samples = True

    def choose(self, num_parent, shape, device):
        return torch.arange(num_parent, device=device).reshape((num_parent,) + (1,) * (len(shape) - 1))

    def log_prob(self, fn, value, draw):
        # Reuse the indexed copy made for drawing, unless ``fn`` was recomputed
        # (from other parent values, as the path-gradient estimators do).
        thin_fn = (
            draw.thin_fn if fn is draw.source_fn else index_parameters(fn, draw.ancestors, draw.target_dim)
        )
        if thin_fn is not None:
            return thin_fn.log_prob(value)
        log_q = fn.log_prob(value)
        picks = {d: draw.ancestors[d] for d in draw.parent_dims}
        picks[draw.target_dim] = _particle_index(draw.num_samples, draw.target_dim, value.device)
        picks = {d: p for d, p in picks.items() if -d <= log_q.dim()}
        return _select_particles(log_q, log_q.dim(), picks, draw.target_dim)


@dataclass
class ParticleDraw:
    """
    What a site's particles were drawn from, kept in ``site["infer"]["_tmc_draw"]``
    so that the factors can evaluate the proposal density indexed by ``k`` alone.

    :param int num_samples: K, the number of particles of this site.
    :param ProposalStrategy strategy: the proposal strategy used for the parent dims.
    :param tuple parent_dims: the upstream particle dims (negative, relative to the
        right of the site's batch shape) on which the site's distribution depends.
    :param dict ancestors: parent dim -> LongTensor of shape ``(K,) + plate
        shape`` (right-aligned at the particle dim), the ancestor of each particle
        in each plate element.
    :param int target_dim: the particle dim of this site.
    """

    num_samples: int
    strategy: ProposalStrategy
    parent_dims: tuple[int, ...]
    ancestors: dict[int, torch.Tensor]
    target_dim: int
    #: the distribution drawn from and its ancestor-indexed copy ("thin" sampling: ``None`` where the
    #: fallback drew one particle per parent combination), reused while scoring that same distribution
    source_fn: Optional[Distribution] = None
    thin_fn: Optional[Distribution] = None
    #: drawn on the one particle dim that every latent shares (IWAE's joint
    #: samples): the -log K is counted once for the whole draw, not per site
    joint: bool = False
    #: the particle group it was drawn in (several sites on one particle dim:
    #: :mod:`pyro_tmc.poutine.particle_groups`), or ``None``
    group: Optional[str] = None
    #: whether the site's term carries its ``-log K``: a group's is counted at one member only
    counts_log_k: bool = True


def choose_ancestors(
    site_name: str,
    strategy: ProposalStrategy,
    parent_sizes: dict[int, int],
    num_samples: int,
    device: torch.device,
    element_shape: tuple[int, ...] = (),
) -> dict[int, torch.Tensor]:
    """
    For each parent dim, the ancestor (an index into that parent's particles) of
    each of this site's ``num_samples`` particles, chosen anew for every plate
    element: a particle shared by all elements of a plate that its parent is
    outside would couple them, and the product over the plate would be biased.

    :param tuple element_shape: the site's plate shape, right-aligned at the
        particle dim: each returned tensor has shape ``(K,) + element_shape``.
    :raises ValueError: if the strategy needs equal numbers of particles and a
        parent has another.
    """
    if strategy.needs_equal_num_samples:
        mismatched = {d: s for d, s in parent_sizes.items() if s != num_samples}
        if mismatched:
            raise ValueError(
                f"Site '{site_name}' draws {num_samples} particles with "
                f"proposal={strategy.name!r}, which needs every upstream latent to have the "
                f"same number, but its parents have {sorted(mismatched.values())}. "
                "Use proposal='mixture', or give the site and its parents equal num_samples."
            )
    shape = (num_samples,) + tuple(element_shape)
    return {dim: strategy.choose(size, shape, device) for dim, size in parent_sizes.items()}


def _particle_index(num: int, target_dim: int, device) -> torch.Tensor:
    """``arange(num)`` laid out along ``target_dim``."""
    return torch.arange(num, device=device).reshape((num,) + (1,) * (-target_dim - 1))


def _select_particles(
    x: torch.Tensor,
    batch_ndim: int,
    picks: dict[int, torch.Tensor],
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
            # a one-element tensor, not a 0-dim one: torch reads a 0-dim integer index with
            # .item(), a read of a value that a captured step cannot make
            index.append(torch.zeros((1,), dtype=torch.long, device=x.device))
    if all(x.shape[i] <= 1 for i in range(batch_ndim)):  # constant over the batch: broadcasts as is
        return x.reshape(x.shape[batch_ndim:])
    return x[tuple(index)]


def constructor_parameters(fn: Distribution, as_given: bool = False) -> Optional[dict[str, torch.Tensor]]:
    """
    The tensors that rebuild ``fn`` through its constructor, read from its own
    parameters, or ``None`` where no rule is known (the caller then falls back
    to drawing without indexing). Rules: a multivariate normal by its Cholesky
    factor; a distribution with ``probs`` and ``logits`` by its logits (the
    stabler of the two); any other by its ``arg_constraints``, which for
    torch's distributions are exactly its constructor's tensor arguments.
    Wrappers whose construction is not their parameters (masked, expanded,
    transformed) have no rule.

    :param bool as_given: of ``probs`` and ``logits``, take the one the
        distribution was built with, rather than computing the other (one
        tensor operation per call, on a hot path for stacked densities).
    """
    if isinstance(fn, (MaskedDistribution, ExpandedDistribution, TransformedDistribution)):
        return None
    if isinstance(fn, LowRankMultivariateNormal):
        names = ["loc", "cov_factor", "cov_diag"]
    elif isinstance(fn, MultivariateNormal):
        names = ["loc", "scale_tril"]
    else:
        names = list(fn.arg_constraints)
        if "probs" in names and "logits" in names:
            names.remove("logits" if as_given and "logits" not in fn.__dict__ else "probs")
    params = {}
    for name in names:
        value = getattr(fn, name, None)
        if isinstance(value, torch.Tensor):
            params[name] = value
    return params or None


def index_parameters(
    fn: Distribution, picks: dict[int, torch.Tensor], target_dim: int
) -> Optional[Distribution]:
    """
    A distribution whose parameters are ``fn``'s, indexed by :func:`_select_particles`,
    or ``None`` if ``fn`` has no rule in :func:`constructor_parameters`.
    """
    if isinstance(fn, Independent):
        shift = fn.reinterpreted_batch_ndims
        base = index_parameters(
            fn.base_dist,
            {d - shift: p.reshape(p.shape + (1,) * shift) for d, p in picks.items()},
            target_dim - shift,
        )
        return None if base is None else type(fn)(base, shift)  # keeps Pyro's Independent (callable)
    params = constructor_parameters(fn)
    if params is None:
        return None
    batch_ndim = len(fn.batch_shape)
    indexed = {}
    for name, value in params.items():
        event_ndim = value.dim() - batch_ndim
        if event_ndim < 0 or any(s not in (1, b) for s, b in zip(value.shape, fn.batch_shape)):
            return None  # a parameter that does not carry the batch shape: no rule
        indexed[name] = _select_particles(value, batch_ndim, picks, target_dim)
    try:
        return type(fn)(**indexed, validate_args=False)
    except (TypeError, ValueError):
        return None


def draw_particles(
    site_name: str,
    fn: Distribution,
    num_samples: int,
    strategy: ProposalStrategy,
    parent_dims: tuple[int, ...],
    target_dim: int,
) -> tuple[torch.Tensor, ParticleDraw]:
    """
    Draw ``num_samples`` particles of a site, placed at ``target_dim``.

    :param str site_name: for error messages.
    :param Distribution fn: the site's distribution; its batch shape may carry
        the upstream particle dims ``parent_dims``.
    :param int num_samples: K.
    :param ProposalStrategy strategy: how ancestors are chosen (:data:`PROPOSALS`).
    :param tuple parent_dims: the upstream particle dims of ``fn``'s batch shape.
    :param int target_dim: the (negative) dim that will index the particles.
    :returns: the particles (shape: K at ``target_dim``, plate dims, event shape)
        and the record of how they were drawn.
    """
    batch_shape = fn.batch_shape
    event_shape = fn.event_shape
    if not parent_dims:
        value = fn(sample_shape=torch.Size([num_samples]))
        value = _place_particle_dim(value, batch_shape, event_shape, target_dim)
        return value, ParticleDraw(num_samples, strategy, (), {}, target_dim)

    parent_sizes = {d: batch_shape[d] for d in parent_dims}
    device = _device_of(fn)
    element_shape = tuple(
        batch_shape[d] if -d <= len(batch_shape) and d not in parent_dims else 1
        for d in range(target_dim + 1, 0)
    )
    ancestors = choose_ancestors(site_name, strategy, parent_sizes, num_samples, device, element_shape)
    thin_fn = index_parameters(fn, ancestors, target_dim)
    if thin_fn is not None:
        value = thin_fn()
    else:
        # Fallback: draw one particle per parent combination and keep K of them.
        fat = fn(sample_shape=torch.Size([num_samples]))
        picks = dict(ancestors)
        picks[-1 - len(batch_shape)] = _particle_index(num_samples, target_dim, device)
        value = _select_particles(fat, 1 + len(batch_shape), picks, target_dim)
    draw = ParticleDraw(num_samples, strategy, tuple(parent_dims), ancestors, target_dim, fn, thin_fn)
    return value, draw


def draw_joint_particles(
    fn: Distribution, num_samples: int, target_dim: int
) -> tuple[torch.Tensor, ParticleDraw]:
    """
    Particles on the dim that every latent shares (IWAE): where the site's
    distribution already varies along it (its parents' particle k), one draw per
    k; else ``num_samples`` draws placed there.
    """
    batch_shape = fn.batch_shape
    if len(batch_shape) >= -target_dim and batch_shape[target_dim] > 1:
        value = fn()
    else:
        value = _place_particle_dim(
            fn(sample_shape=torch.Size([num_samples])), batch_shape, fn.event_shape, target_dim
        )
    return value, ParticleDraw(num_samples, None, (), {}, target_dim, joint=True)


def _place_particle_dim(value, batch_shape, event_shape, target_dim):
    """
    Reshape a ``(K,) + batch_shape + event_shape`` sample so that K sits at ``target_dim``.

    The batch shape may reach past ``target_dim`` with size 1 there: IWAE's shared particle
    dim is allocated at the guide's first latent, so a model site enumerated later sits to
    its left, and a latent drawn from the prior below it carries both.
    """
    batch = list(batch_shape)
    while batch and batch[0] == 1:
        batch.pop(0)
    pad = -target_dim - 1 - len(batch)
    if pad >= 0:
        shape = (value.shape[0],) + (1,) * pad + tuple(batch) + tuple(event_shape)
        # the sample itself where it already has the shape: a transformed distribution's
        # log_prob then finds it in its transforms' caches, not inverting them (an
        # autoregressive flow's inverse is one network pass per dimension)
        return value if value.shape == shape else value.reshape(shape)
    if batch[target_dim] != 1:
        raise ValueError(
            f"Particle dim {target_dim} collides with batch shape {tuple(batch_shape)}: "
            "increase max_plate_nesting."
        )
    position = len(batch_shape) + target_dim  # the batch dim that the particles take
    return value.squeeze(1 + position).movedim(0, position)


def _device_of(fn: Distribution) -> torch.device:
    """Where a distribution's parameters live."""
    while isinstance(fn, Independent):
        fn = fn.base_dist
    for value in (constructor_parameters(fn) or {}).values():
        return value.device
    return fn.sample().device  # no parameter rule: ask the distribution


def proposal_log_prob(fn: Distribution, value: torch.Tensor, draw: ParticleDraw) -> torch.Tensor:
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
    return draw.strategy.log_prob(fn, value, draw)


def stops_proposal_density(q_site, own_prior: bool, detach_guide: bool) -> bool:
    """
    Whether a latent's ``log q`` enters its factor with its gradient stopped:

    - a model latent drawn from its own conditional (``own_prior``) that is not
      reparameterised. DiCE: ``p / stop(p)`` has the score-function gradient of
      the importance weight, so the model's parameters get an unbiased gradient of
      ``p(x)`` through the draw (``tests/infer/test_tmc_elbo.py``);
    - a guide latent where the caller stops the guide's density (``detach_guide``:
      the path-gradient and wake-sleep estimators take the guide's gradient elsewhere).

    A guide latent that is not reparameterised keeps its gradient: with the score
    term that :class:`~pyro_tmc.infer.estimators.Plain` adds, the guide's parameters
    get the gradient of the bound ``E[log P_TMC]``, as ``Trace_ELBO``'s do at K = 1.
    An observed site's density is never stopped.
    """
    if q_site["is_observed"]:
        return False
    if own_prior:
        return not q_site["fn"].has_rsample
    return detach_guide


def sampling_log_prob(fn: Distribution, value: torch.Tensor, draw: "ParticleDraw") -> torch.Tensor:
    """
    The log density of each particle under what drew it: the site's distribution
    given the ancestors each particle picked (those picks do not depend on the
    guide's parameters), unmasked. Its gradient is the particles' score function.
    """
    if isinstance(fn, MaskedDistribution):  # the mask stops a factor, not the drawing
        fn = fn.base_dist
    if not draw.parent_dims:
        return log_density.log_prob(fn, value)
    return Diagonal().log_prob(fn, value, draw)


def proposal_log_k(q_site) -> float:
    """
    The ``log K`` in the ``-log q - log K`` by which the proposal ``q_site`` of a latent
    enters the latent's factor: of a sampled site, the average over its particles; 0
    for an enumerated or Delta proposal, for joint samples, whose ``-log K`` is
    counted once for the whole draw (:func:`pyro_tmc.estimate.factors.joint_samples_factor`),
    and for every member of a particle group but the first, since the members share
    one average over their K particles (:mod:`pyro_tmc.poutine.particle_groups`).
    """
    draw = particle_draw(q_site)
    counted = draw is not None and not draw.joint and draw.counts_log_k
    return math.log(draw.num_samples) if counted else 0.0
