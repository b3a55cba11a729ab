"""The ``tmc`` handler: a K-sized particle dimension for every latent sample site."""

import numbers
import warnings
from collections.abc import Collection
from typing import Callable, Optional

import torch

from pyro.distributions.torch_distribution import TorchDistributionMixin
from pyro.poutine.enum_messenger import EnumMessenger
from pyro.poutine.runtime import Message

from pyro_tmc._pyro import allocate_particle_dim, make_handler
from pyro_tmc.poutine.chain_dims import ChainDims, check_replayed_dims
from pyro_tmc.poutine.particle_groups import (
    ParticleGroup,
    check_model_agrees,
    check_not_summed_exactly,
    draw_member_particles,
    group_name,
    plate_names,
)
from pyro_tmc.poutine.proposals import draw_joint_particles, draw_particles, get_proposal
from pyro_tmc.poutine.sites import is_delta, is_marked_for_exact_sum, own_particle_dim

#: PyTorch tensors hold at most this many dims; particle dims beyond it cannot exist.
MAX_TENSOR_DIMS = 64
#: Where particle dims start when ``first_available_dim`` is not given and no
#: allocation is under way: left of this many plate dims.
DEFAULT_MAX_PLATE_NESTING = 4


def check_num_samples(num_samples, where: str, example: str = "") -> int:
    """
    :param str where: what was given the number, for the message (e.g. ``"TMC_ELBO(num_samples)"``).
    :param str example: a corrected call, for the message; by default ``where`` with 16.
    :returns: ``num_samples`` if it is a positive integer.
    :raises ValueError: naming ``where`` otherwise.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, numbers.Integral) or num_samples < 1:
        if not example:
            example = where.replace(")", "=16)") if where.endswith(")") else f"{where}(num_samples=16)"
        raise ValueError(
            f"{where}: must be a positive integer, got {num_samples!r}. Pass an int >= 1, e.g. {example}."
        )
    return int(num_samples)


#: Names of the sites already warned that their sequential enumeration is summed in parallel.
_WARNED_SEQUENTIAL: set[str] = set()


def check_sequential_summable(msg: Message) -> None:
    """
    :raises ValueError: if a site marked ``infer={"enumerate": "sequential"}``
        cannot be summed over its support: it sets ``num_samples`` (Pyro's
        ``config_enumerate`` refuses the pair too), or its distribution has no
        ``enumerate_support``. Sampling it instead would silently change what
        the flag asks for.
    """
    name = msg["name"]
    if "num_samples" in msg["infer"]:
        raise ValueError(
            f"Site '{name}' asks for sequential enumeration with infer['num_samples']: sequential "
            "enumeration sums over the whole support and draws no samples. Use "
            "infer={'enumerate': 'parallel', 'num_samples': K} to sample K values, or drop 'num_samples'."
        )
    if not msg["fn"].has_enumerate_support:
        raise ValueError(
            f"Site '{name}' asks for sequential enumeration, but its distribution "
            f"{type(msg['fn']).__name__} has no finite support to enumerate. Drop the flag to sample it."
        )


def warn_summed_in_parallel(name: str) -> None:
    """
    Warn, once per site name in a process, that a sequentially enumerated site
    is summed in parallel: the same value (the exact sum over its support), in
    one tensor of the support's size rather than one run per value.
    """
    if name in _WARNED_SEQUENTIAL:
        return
    _WARNED_SEQUENTIAL.add(name)
    warnings.warn(
        f"Site '{name}' asks for sequential enumeration: TMC sums it in parallel over its support "
        "instead, which gives the same value (the exact sum). Its value holds the whole support "
        "along a dim of its own, so the code that reads it must broadcast (no Python control flow "
        "or .item() on it). Mark it infer={'enumerate': 'parallel'} to silence this warning.",
        UserWarning,
        stacklevel=2,
    )


def check_no_dim_conflict(msg: Message, target_dim: int) -> None:
    """
    :raises ValueError: if the site's distribution already varies along the
        particle dim it is about to be given: an upstream latent that a too short
        ``pyro.markov(history=...)`` dropped from the scope holds that dim, and
        the two would be silently merged.
    """
    batch_shape = msg["fn"].batch_shape
    if len(batch_shape) >= -target_dim and batch_shape[target_dim] != 1:
        raise ValueError(
            f"Enumeration dim conflict at site '{msg['name']}': its distribution already varies "
            f"along dim {target_dim}, the particle dim it is given, because it depends on a latent "
            "that its pyro.markov context no longer keeps in scope. Increase the history of "
            "pyro.markov(history=...) to cover every dependency."
        )


class ParticleDimsExhausted(ValueError):
    """A site needs a particle dim beyond what a tensor holds."""


class TMCMessenger(EnumMessenger):
    """
    Gives every latent sample site a particle dimension, allocated left of the
    plate dims by Pyro's enumeration-dim allocator (so :func:`pyro.markov`
    recycles them), and records in ``site["infer"]`` what
    :class:`~pyro_tmc.TMC_ELBO` needs to contract:

    - ``"_enumerate_dim"`` and ``"_dim_to_id"``: the particle dim and the dims
      the value carries, as :class:`~pyro.poutine.enum_messenger.EnumMessenger`
      records them;
    - ``"_tmc_draw"``: a :class:`~pyro_tmc.poutine.proposals.ParticleDraw` for sampled
      sites, from which the proposal density indexed by the particle alone is
      computed.

    A site draws ``infer["num_samples"]`` particles if it sets it, else
    ``num_samples``. A site whose distribution depends on upstream particles
    draws them by ``proposal`` (see :mod:`pyro_tmc.poutine.proposals`). A site marked
    ``infer={"enumerate": "parallel"}`` without ``num_samples`` whose
    distribution has enumerable support is enumerated over its support instead
    (exact marginalisation). A :class:`~pyro.distributions.Delta` site gets no
    particle dim: its value keeps only the dims of the values it was computed from.

    :param int num_samples: K for sites that do not set their own.
    :param str proposal: ``"mixture"``, ``"permutation"`` or ``"diagonal"``.
    :param int first_available_dim: the rightmost dim available for particles,
        e.g. ``-1 - max_plate_nesting``. If ``None``, allocation continues where
        an enclosing TMC run left it when ``continue_allocation`` is set, and
        otherwise starts at ``-1 - DEFAULT_MAX_PLATE_NESTING``.
    :param replayed_sites: names of sites whose values a replay handler will
        supply (the guide's latents, when this handler wraps the model); they
        get no particles of their own.
    :param bool continue_allocation: continue the allocator's state (used for
        the model after the guide has been run).
    :param reserved_dims: dims that the replayed values occupy (the guide's
        particle dims); sites drawn here never take one, since the guide's
        ``pyro.markov`` allocations are local and do not advance the allocator.
    :param particle_counts: ``dim -> K``: if given, every sampled site draws
        this many particles on its dim, whatever it asks for (the validation
        probe of :mod:`pyro_tmc.infer.broadcast_check`).
    :param joint_dim: ``"new"`` or a ``(dim, id)`` pair: every sampled latent
        shares one particle dim (IWAE's joint samples: K particle combinations,
        not K^n); ``"new"`` allocates it at the first sampled site.
    :param particle_groups: name -> :class:`~pyro_tmc.poutine.particle_groups.ParticleGroup`
        already set up by the run this one replays (the guide's), which this
        run's members join. A site marked ``infer={"particle_group": name}``
        shares the group's particle dim (:mod:`pyro_tmc.poutine.particle_groups`); the
        first member of a new group allocates it.
    :param chain_dims: where the latents sampled outside every markov context
        put their particles: the dims the model's ``pyro.markov`` recycles
        (:mod:`pyro_tmc.poutine.chain_dims`); no other site takes those dims.
    :param bool check_replayed_dims: check that no replayed latent's factor here
        varies along its own particle dim (the model's run under ``chain_dims``).

    Reference: Aitchison, L. (2019) "Tensor Monte Carlo: Particle Methods for
    the GPU Era", NeurIPS.
    """

    def __init__(
        self,
        num_samples: int = 8,
        proposal: str = "mixture",
        first_available_dim: Optional[int] = None,
        replayed_sites: Collection[str] = (),
        continue_allocation: bool = False,
        joint_dim: Optional[tuple] = None,
        reserved_dims: Collection[int] = (),
        particle_counts: Optional[Callable[[int], int]] = None,
        particle_groups: Optional[dict[str, ParticleGroup]] = None,
        chain_dims: Optional[ChainDims] = None,
        check_replayed_dims: bool = False,
    ) -> None:
        self.num_samples = check_num_samples(num_samples, "tmc(num_samples)")
        self.proposal = get_proposal(proposal)
        if first_available_dim is None and not continue_allocation:
            first_available_dim = -1 - DEFAULT_MAX_PLATE_NESTING
        if first_available_dim is not None and first_available_dim >= 0:
            raise ValueError(
                f"first_available_dim must be negative (left of the plate dims), got {first_available_dim}."
            )
        super().__init__(first_available_dim)
        self.replayed_sites = frozenset(replayed_sites)
        self.reserved_dims = frozenset(reserved_dims)
        self.particle_counts = particle_counts
        self.joint_dim = joint_dim
        self.initial_groups = dict(particle_groups or {})
        self.chain_dims = chain_dims
        self.check_replayed_dims = check_replayed_dims
        #: dims no allocation hands out: the replayed values' and the chain plan's
        self._taken_dims = self.reserved_dims | (chain_dims.band if chain_dims is not None else frozenset())

    def __enter__(self):
        # dim -> id of the site that last placed a value there: what a site
        # outside every markov context (e.g. an observation after a markov loop)
        # can depend on.
        self._occupants: dict[int, int] = {}
        #: the last sample site run, and particle dim -> (site, K), for error messages about user code
        self.current_site: Optional[str] = None
        self.particle_dims: dict[int, tuple] = {}
        #: particle groups by name, and the groups that the model asks for at replayed sites
        self.groups: dict[str, ParticleGroup] = dict(self.initial_groups)
        self._model_groups: dict[str, str] = {}
        #: under ``chain_dims``: dim -> the sites that have held it, in order
        self._chain_holders: dict[int, list[str]] = {}
        #: latents drawn here outside every markov context on a dim of their own (a plan could recycle)
        self.unscoped_latents: list[str] = []
        #: sample sites seen inside a pyro.markov context (the model's chain, when this runs the model)
        self.chain_sites: set[str] = set()
        return super().__enter__()

    def _record_scope(self, msg: Message) -> dict[int, int]:
        """
        The dims upstream of this site, from EnumMessenger's own markov
        bookkeeping (run on a copy of the message that it only records), plus,
        outside every markov context, the dims last occupied by any value.
        """
        probe = dict(msg, done=False, is_observed=True)  # EnumMessenger records, then returns
        super()._pyro_sample(probe)
        param_dims = self._param_dims[msg["name"]]
        if msg["infer"].get("_markov_scope") is None:
            param_dims.update(self._occupants)
        else:
            self.chain_sites.add(msg["name"])
        return param_dims

    def _pyro_sample(self, msg: Message) -> None:
        if not isinstance(msg["fn"], TorchDistributionMixin):
            return
        self.current_site = msg["name"]
        param_dims = self._record_scope(msg)
        if msg["name"] in self.replayed_sites and not msg["is_observed"] and group_name(msg) is not None:
            self._model_groups[msg["name"]] = group_name(msg)  # checked against the guide's, once replayed
        if (
            msg["done"]
            or msg["is_observed"]
            or msg["name"] in self.replayed_sites
            or self._is_point_mass(msg)
        ):
            return
        if msg["infer"].get("enumerate") == "sequential":
            check_sequential_summable(msg)
            warn_summed_in_parallel(msg["name"])
        if is_marked_for_exact_sum(msg):
            check_not_summed_exactly(msg)
            target_dim, id_ = self._allocate(msg, param_dims)
            check_no_dim_conflict(msg, target_dim)
            value = _enumerate_support(msg["fn"], target_dim)
        elif self.joint_dim is not None:
            if self.joint_dim == "new":
                self.joint_dim = self._allocate(msg, param_dims)
            target_dim, id_ = self.joint_dim
            value, draw = draw_joint_particles(msg["fn"], self.num_samples, target_dim)
            msg["infer"]["_tmc_draw"] = draw
        elif group_name(msg) is not None:
            target_dim, id_, value = self._draw_in_group(msg, param_dims)
        else:
            target_dim, id_ = self._planned_dim(msg, param_dims) or self._allocate_unplanned(msg, param_dims)
            check_no_dim_conflict(msg, target_dim)
            value, draw = self._draw(msg, param_dims, target_dim)
            msg["infer"]["_tmc_draw"] = draw

        event_dim = msg["fn"].event_dim
        value_dims = {
            dim: param_dims[dim]
            for dim in range(event_dim - value.dim(), 0)
            if value.size(dim - event_dim) > 1 and dim in param_dims
        }
        value_dims[target_dim] = id_
        msg["infer"]["_enumerate_dim"] = target_dim
        msg["infer"]["_dim_to_id"] = value_dims
        msg["value"] = value
        msg["done"] = True

    def _is_point_mass(self, msg: Message) -> bool:
        """
        Whether a site to draw is a Delta, drawn as usual: its one value, with its
        parents' particle dims. Under ``chain_dims`` every site to draw, a Delta
        too, is first checked to read no recycled dim ambiguously.
        """
        if self.chain_dims is not None:
            self.chain_dims.check_reads(msg, self._chain_holders)
        return is_delta(msg["fn"])

    def _allocate(self, msg: Message, param_dims: dict[int, int], recyclable: Optional[bool] = None):
        """
        A particle dim and id for the site. A site inside a markov context may
        reuse a dim out of its scope. A site outside every markov context gets a
        dim that no value seen so far occupies: Pyro's allocator would hand it
        the dim of a latent of an exited markov loop, merging the two.

        :param recyclable: whether the dim may be reused by a later site out of
            this one's scope; by default, where the site is inside a markov context.
        """
        if recyclable is None:
            recyclable = msg["infer"].get("_markov_scope") is not None
        target_dim, id_ = allocate_particle_dim(self._taken_dims.union(param_dims), recyclable=recyclable)
        if -target_dim > MAX_TENSOR_DIMS:
            unscoped = self.unscoped_latents
            named = ", ".join(f"'{name}'" for name in unscoped[:3]) + (", ..." if len(unscoped) > 3 else "")
            raise ParticleDimsExhausted(
                f"Site '{msg['name']}' needs particle dim {target_dim}, but a tensor holds at most "
                f"{MAX_TENSOR_DIMS} dims: {len(unscoped)} latents here ({named}) are drawn outside "
                "pyro.markov, each on a particle dim of its own. Wrap sequential latents in "
                "pyro.markov (in the model and the guide) so that particle dims are recycled."
            )
        return target_dim, id_

    def _allocate_unplanned(self, msg: Message, param_dims: dict[int, int]) -> tuple[int, int]:
        """:meth:`_allocate`, recording a site outside every markov context (which a plan could serve)."""
        if msg["infer"].get("_markov_scope") is None:
            self.unscoped_latents.append(msg["name"])
        return self._allocate(msg, param_dims)

    def _planned_dim(self, msg: Message, param_dims: dict[int, int]) -> Optional[tuple[int, int]]:
        """
        The ``(dim, id)`` that ``chain_dims`` gives a site outside every markov
        context, or ``None``. The dim's last holder leaves the site's scope (the
        site does not depend on it: :meth:`ChainDims.check_reads`), so that its
        value's dim is not labelled with the holder's id.
        """
        if self.chain_dims is None or msg["infer"].get("_markov_scope") is not None:
            return None
        target_dim = self.chain_dims.dim_of(msg)
        if target_dim is None:
            return None
        param_dims.pop(target_dim, None)
        _, id_ = allocate_particle_dim((), recyclable=True)  # a fresh id; a local allocation moves no dim
        self._chain_holders.setdefault(target_dim, []).append(msg["name"])
        return target_dim, id_

    def _draw_in_group(self, msg: Message, param_dims: dict[int, int]):
        """
        The particles of a member of a particle group, on the group's dim: ``(dim,
        id, value)``. The first member sets the group up, on a dim that no later
        site reuses (the members may sit in different markov scopes); the others
        are checked against it.
        """
        name = group_name(msg)
        num_samples = self._num_samples(msg)
        group = self.groups.get(name)
        first = group is None
        if first:
            target_dim, id_ = self._allocate(msg, param_dims, recyclable=False)
            check_no_dim_conflict(msg, target_dim)
            group = ParticleGroup(name, target_dim, id_, num_samples, plate_names(msg), msg["name"])
            self.groups[name] = group
        else:
            # the validation probe gives each dim its own count: K was checked in the real draw
            group.check_member(msg, None if self.particle_counts is not None else num_samples)
        if self.particle_counts is not None:
            num_samples = self.particle_counts(group.dim)
        parent_dims = tuple(d for d in self._parent_dims(msg, param_dims) if d != group.dim)
        value, draw = draw_member_particles(
            msg["name"], msg["fn"], num_samples, self.proposal, parent_dims, group, first
        )
        msg["infer"]["_tmc_draw"] = draw
        return group.dim, group.id, value

    def _pyro_post_sample(self, msg: Message) -> None:
        # EnumMessenger labels every dim the site can see with the ids of this run's
        # scope. A replayed value's own dims keep the ids its own run gave them: this
        # run's scope may hold another latent on the same dim (a guide's pyro.markov
        # recycles dims that a plain loop here does not), which would merge the two.
        # The site's own particle dim keeps its id even with one particle (num_samples=1),
        # where the value does not vary along it: the read-outs name the particles by it.
        replayed = msg["name"] in self.replayed_sites  # (read once: this runs for every site)
        replayed_ids = self._replayed_value_ids(msg) if replayed else {}
        own_id = self._replayed_own_id(msg) if replayed else {}
        super()._pyro_post_sample(msg)
        if replayed and self.check_replayed_dims and isinstance(msg["fn"], TorchDistributionMixin):
            check_replayed_dims(msg, replayed_ids, self._param_dims.get(msg["name"], {}))
        if msg["name"] in self._model_groups:
            check_model_agrees(msg["name"], self._model_groups.pop(msg["name"]), msg, self.groups)
        if replayed_ids or own_id:
            msg["infer"]["_dim_to_id"].update({**replayed_ids, **own_id})
            self._value_dims[msg["name"]].update(replayed_ids)  # what downstream sites see
        if isinstance(msg["fn"], TorchDistributionMixin) and msg["value"] is not None:
            self._occupants.update(self._value_dims[msg["name"]])
            # A site's own dim is occupied even where it holds one particle (its value does
            # not vary along it): a later site outside pyro.markov must not be given it.
            own_dim = own_particle_dim(msg)
            if own_dim in msg["infer"].get("_dim_to_id", {}):
                self._occupants[own_dim] = msg["infer"]["_dim_to_id"][own_dim]
            # Name each dim after the site that brought it (a Delta's value carries
            # its auxiliary site's dims, which the model never sees by name).
            batch_shape = msg["value"].shape[: msg["value"].dim() - msg["fn"].event_dim]
            own_dim = own_particle_dim(msg)
            for dim in self._value_dims[msg["name"]]:
                if dim == own_dim or dim not in self.particle_dims:
                    self.particle_dims[dim] = (msg["name"], batch_shape[dim])

    def _replayed_value_ids(self, msg: Message) -> dict[int, int]:
        """``dim -> id`` of the dims a replayed site's value varies along, as its own run labelled them."""
        if not isinstance(msg["fn"], TorchDistributionMixin):
            return {}
        value = msg["value"]
        if not isinstance(value, torch.Tensor):
            return {}
        shape = value.shape[: value.dim() - msg["fn"].event_dim]
        dim_to_id = msg["infer"].get("_dim_to_id", {})
        return {dim: id_ for dim, id_ in dim_to_id.items() if len(shape) >= -dim and shape[dim] > 1}

    def _replayed_own_id(self, msg: Message) -> dict[int, int]:
        """``{particle dim: id}`` of a replayed site, as its own run labelled it (empty if it has none)."""
        own_dim = own_particle_dim(msg)
        dim_to_id = msg["infer"].get("_dim_to_id", {})
        return {own_dim: dim_to_id[own_dim]} if own_dim in dim_to_id else {}

    def shape_error_hint(self, role: str) -> str:
        """
        What to tell a user whose code broke on the particle dims: where it
        broke, which particle dims were present, and where to read how to fix it.
        """
        where = f"after sample site '{self.current_site}'" if self.current_site else "before any sample site"
        dims = ", ".join(
            f"dim {dim}: '{name}' ({size} particles)"
            for dim, (name, size) in sorted(self.particle_dims.items())
        )
        return (
            f"\n\nThis happened while running the {role} under TMC, {where}. TMC gives every latent "
            "site a particle dim left of the plate dims, so values carry extra batch dims: "
            f"particle dims present: {dims or 'none'}. Write the {role} so that it broadcasts over "
            "them: index with pyro.ops.indexing.Vindex (Vindex(locs)[..., z]), write (X * w).sum(-1) rather "
            "than X @ w for a latent vector w outside the data plate (its value already has a "
            "size-1 slot for the plate), and let plates and to_event carry "
            "the shapes. See 'Writing models for TMC: broadcasting and Vindex' in the README."
        )

    def _num_samples(self, msg: Message) -> int:
        """The K a site asks for: its ``infer["num_samples"]``, else the handler's."""
        return check_num_samples(
            msg["infer"].get("num_samples", self.num_samples),
            f"Site '{msg['name']}' infer['num_samples']",
            "infer={'num_samples': 16}",
        )

    @staticmethod
    def _parent_dims(msg: Message, param_dims: dict[int, int]) -> tuple:
        """The upstream particle dims along which the site's distribution varies."""
        batch_shape = msg["fn"].batch_shape
        return tuple(d for d in range(-len(batch_shape), 0) if batch_shape[d] > 1 and d in param_dims)

    def _draw(self, msg: Message, param_dims: dict[int, int], target_dim: int):
        num_samples = self._num_samples(msg)
        if self.particle_counts is not None:
            num_samples = self.particle_counts(target_dim)
        parent_dims = self._parent_dims(msg, param_dims)
        return draw_particles(msg["name"], msg["fn"], num_samples, self.proposal, parent_dims, target_dim)


def _enumerate_support(fn, target_dim: int) -> torch.Tensor:
    """The support of ``fn`` with its values along ``target_dim``."""
    value = fn.enumerate_support(expand=False)
    support = getattr(value, "_pyro_categorical_support", None)
    value = value.reshape(value.shape[:1] + (1,) * (-target_dim - 1) + fn.event_shape)
    if support is not None:
        value._pyro_categorical_support = support  # keeps Categorical.log_prob fast
    return value


@make_handler(TMCMessenger, module="pyro_tmc.poutine")
def tmc(  # type: ignore[empty-body]
    fn: Optional[Callable] = None,
    num_samples: int = 8,
    proposal: str = "mixture",
    first_available_dim: Optional[int] = None,
    replayed_sites: Collection[str] = (),
    continue_allocation: bool = False,
): ...
