"""Particle groups: several latent sites that share one particle dim (the alan library's ``Group``).

By default every latent has its own K particles on its own dim, and a factor over n
latents has n particle dims (K^n combinations). The members of a *particle group*
share one dim instead: particle ``k`` of each member is drawn (from that member's
own proposal, independently given its parents) and indexed by the same ``k``, so a
factor over several members has one particle dim. The estimate is still unbiased:
each member enters with its own ``log p - log q``, and the group's ``-log K`` (the
average over its K joint particles) is counted once, at its first member
(:func:`pyro_tmc.poutine.proposals.proposal_log_k`), as IWAE counts it once for all
latents. The price is fewer particle combinations: K for the group instead of K^n,
hence a looser bound.

A site joins group ``"g"`` by ``infer={"particle_group": "g"}`` (:data:`PARTICLE_GROUP`),
set on the guide's site, or on the model's site for a latent the guide lacks; the
handler :func:`pyro_tmc.poutine.particle_group` sets it on every site inside it.

Members of a group must have the same K and sit in the same plates (the shared dim is
summed inside those plates), and a site summed exactly over its support cannot be a
member (its dim holds its support, not K particles). A Delta site (AutoNormal's
constrained value) has no particle dim of its own, so the key is ignored there: group
the auxiliary site that carries its particles (``<name>_unconstrained``).

Reference: Heap, T., et al. (2023) "Massively parallel reweighted wake-sleep", UAI
(the alan library's ``Group``); Burda, Y., et al. (2016) "Importance weighted autoencoders".
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributions import Distribution

from pyro.poutine import Trace

from pyro_tmc.poutine.proposals import ParticleDraw, ProposalStrategy, draw_joint_particles, draw_particles
from pyro_tmc.poutine.sites import is_latent, particle_draw

#: The ``infer`` key that puts a sample site in a particle group, by name.
PARTICLE_GROUP = "particle_group"


def group_name(msg) -> Optional[str]:
    """
    The particle group a site (a message or a trace node) asks to join, or ``None``.

    :raises ValueError: naming the site, if the group is not named by a string.
    """
    name = msg["infer"].get(PARTICLE_GROUP)
    if name is not None and not isinstance(name, str):
        raise ValueError(
            f"Site '{msg['name']}' sets infer['{PARTICLE_GROUP}'] = {name!r}: a particle group is "
            f"named by a string, e.g. infer={{'{PARTICLE_GROUP}': 'houses'}}."
        )
    return name


def plate_names(msg) -> frozenset:
    """The names of the vectorized plates a site sits in."""
    return frozenset(frame.name for frame in msg["cond_indep_stack"] if frame.vectorized)


@dataclass(frozen=True)
class ParticleGroup:
    """
    A particle group as its first member set it up.

    :param str name: the group's name.
    :param int dim: the particle dim its members share.
    :param int id: the dim's id (Pyro's enumeration-dim id).
    :param int num_samples: K, the number of particles of every member.
    :param frozenset plates: the names of the plates every member sits in.
    :param str first_member: the site that set it up (for error messages).
    """

    name: str
    dim: int
    id: int
    num_samples: int
    plates: frozenset
    first_member: str

    def check_member(self, msg, num_samples: Optional[int]) -> None:
        """
        :param num_samples: the K the site asks for, or ``None`` to skip that check
            (the validation probe, which gives each dim its own count).
        :raises ValueError: naming both sites and the fix, where the site asks for
            another K or sits in other plates than the group's first member.
        """
        name = msg["name"]
        if num_samples is not None and num_samples != self.num_samples:
            raise ValueError(
                f"Sites '{self.first_member}' and '{name}' are in particle group '{self.name}' but ask "
                f"for {self.num_samples} and {num_samples} particles. The members of a group share one "
                "particle dim, so they must have the same K: give them the same infer['num_samples'] "
                "(or none, for TMC_ELBO's num_samples), or put them in different groups."
            )
        plates = plate_names(msg)
        if plates != self.plates:
            raise ValueError(
                f"Sites '{self.first_member}' and '{name}' are in particle group '{self.name}' but sit "
                f"in different plates ({_listed(self.plates)} and {_listed(plates)}). The members of a "
                "group share one particle dim, summed inside their plates, so they must sit in the "
                "same plates: group only sites of the same plates, or put them in different groups."
            )


def _listed(plates: frozenset) -> str:
    return "plates " + ", ".join(f"'{p}'" for p in sorted(plates)) if plates else "no plate"


def check_not_summed_exactly(msg) -> None:
    """
    :raises ValueError: naming the site, if a site marked for an exact sum over its
        support asks to join a particle group.
    """
    group = group_name(msg)
    if group is not None:
        raise ValueError(
            f"Site '{msg['name']}' is marked infer={{'enumerate': {msg['infer']['enumerate']!r}}} and "
            f"is in particle group '{group}'. A site summed exactly over its support holds its support "
            "on its own dim, not K particles, so it cannot share a group's particle dim. Drop "
            f"infer['{PARTICLE_GROUP}'] to sum it exactly, or set infer['num_samples'] to sample it "
            "with the group."
        )


def check_model_agrees(name: str, model_group: str, msg, groups: dict[str, ParticleGroup]) -> None:
    """
    A latent whose particles the guide draws joins a group on the guide's side. Where
    the model's site asks for a group, the guide must have drawn it there.

    :param str model_group: the group the model's site asks for.
    :param msg: the site after the replay (its ``infer`` is the guide's).
    :raises ValueError: naming the site and the fix, where the guide did not.
    """
    draw = particle_draw(msg)
    if draw is not None:
        agrees = draw.group == model_group
    else:  # a Delta guide site: its value carries the particle dim of the site it came from
        group = groups.get(model_group)
        value = msg["value"]
        batch = value.shape[: value.dim() - msg["fn"].event_dim]
        agrees = group is not None and (
            group.num_samples == 1 or (-group.dim <= len(batch) and batch[group.dim] > 1)
        )
    if not agrees:
        raise ValueError(
            f"Site '{name}' sets infer['{PARTICLE_GROUP}'] = '{model_group}' in the model, but its "
            "particles are drawn by the guide, which does not put them in that group. Set the key on "
            f"the guide's site (infer={{'{PARTICLE_GROUP}': '{model_group}'}}, or "
            f"pyro_tmc.poutine.particle_group('{model_group}') around it; for an AutoNormal guide, "
            f"group its site '{name}_unconstrained'), and drop it from the model."
        )


def draw_member_particles(
    site_name: str,
    fn: Distribution,
    num_samples: int,
    strategy: ProposalStrategy,
    parent_dims: tuple[int, ...],
    group: ParticleGroup,
    first: bool,
) -> tuple[torch.Tensor, ParticleDraw]:
    """
    Draw a member's particles on its group's dim.

    Where the member depends on other members, its distribution already varies along
    the group's dim: particle ``k`` is drawn given their particle ``k`` (one draw per
    ``k``, as IWAE's joint samples), and its density is that conditional, indexed by
    ``k``. Other upstream latents (``parent_dims``, the group's dim left out) are
    chosen by ``strategy`` as for any site (:func:`~pyro_tmc.poutine.proposals.draw_particles`).

    :param bool first: whether the site is the group's first member, whose term
        carries the group's ``-log K``.
    """
    if parent_dims:
        value, draw = draw_particles(site_name, fn, num_samples, strategy, parent_dims, group.dim)
    else:
        value, draw = draw_joint_particles(fn, num_samples, group.dim)
    return value, dataclasses.replace(
        draw, strategy=strategy, joint=False, group=group.name, counts_log_k=first
    )


def particle_groups_of(trace: Trace) -> dict[str, ParticleGroup]:
    """
    The particle groups of a drawn trace (the guide's), by name: what a run that
    replays it (the model) continues, so that its own latents in a group (latents
    the guide lacks) join the guide's dim.
    """
    groups = {}
    for name, site in trace.nodes.items():
        draw = particle_draw(site) if is_latent(site) else None
        if draw is None or draw.group is None or draw.group in groups:
            continue
        dim_id = site["infer"]["_dim_to_id"][draw.target_dim]
        groups[draw.group] = ParticleGroup(
            draw.group, draw.target_dim, dim_id, draw.num_samples, plate_names(site), name
        )
    return groups


def is_grouped(site) -> bool:
    """Whether a drawn latent site shares its particle dim with the other members of a group."""
    draw = particle_draw(site)
    return draw is not None and draw.group is not None


__all__ = [
    "PARTICLE_GROUP",
    "ParticleGroup",
    "check_model_agrees",
    "check_not_summed_exactly",
    "draw_member_particles",
    "group_name",
    "is_grouped",
    "particle_groups_of",
    "plate_names",
]
