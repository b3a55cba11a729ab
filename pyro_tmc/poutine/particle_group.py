"""The ``particle_group`` handler: put every sample site inside it in one particle group."""

import functools
from collections.abc import Collection
from typing import Callable, Optional, Union

from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import Message

from pyro_tmc.poutine.particle_groups import PARTICLE_GROUP


class ParticleGroupMessenger(Messenger):
    """
    Sets ``infer={"particle_group": group}`` on every latent sample site inside it
    (or on the named ones), so that under TMC they share one particle dim: particle
    ``k`` of each is drawn from its own proposal and indexed by the same ``k``, and a
    factor over several of them has one particle dim instead of one each (see
    :mod:`pyro_tmc.poutine.particle_groups`). A site that sets the key itself, or an inner
    ``particle_group``, keeps its own group. Use it in the guide (it draws the
    particles), or in the model around latents that the guide lacks.

    Example, with alan's radon model's per-state latents::

        def guide(...):
            with pyro.plate("states", 4, dim=-2), pyro_tmc.poutine.particle_group("state"):
                pyro.sample("state_mean", dist.Normal(m, s))
                pyro.sample("beta_u", dist.Normal(m_u, s_u))

    For an ``AutoNormal`` guide, name the auxiliary sites that carry the particles::

        names = ["state_mean_unconstrained", "beta_u_unconstrained"]
        guide = particle_group("state", sites=names)(AutoNormal(model))

    :param str group: the group's name.
    :param sites: if given, only the sites of these names join it.

    Reference: the alan library's ``Group`` (Heap et al. 2023, "Massively parallel
    reweighted wake-sleep").
    """

    def __init__(self, group: str, sites: Optional[Collection[str]] = None) -> None:
        if not isinstance(group, str):
            raise ValueError(f"particle_group(group): a group is named by a string, got {group!r}.")
        if isinstance(sites, str):
            raise ValueError(
                f"particle_group(sites): a collection of site names, got the string {sites!r}; "
                f"write sites=[{sites!r}]."
            )
        super().__init__()
        self.group = group
        self.sites = None if sites is None else frozenset(sites)

    def _pyro_sample(self, msg: Message) -> None:
        if msg["is_observed"] or (self.sites is not None and msg["name"] not in self.sites):
            return
        msg["infer"] = dict(msg["infer"] or {})  # never write into a dict the caller passed
        msg["infer"].setdefault(PARTICLE_GROUP, self.group)


def particle_group(
    group: str, sites: Optional[Collection[str]] = None, fn: Optional[Callable] = None
) -> Union[ParticleGroupMessenger, Callable]:
    """
    :class:`ParticleGroupMessenger` as a context manager (``with particle_group("g"):``)
    or a decorator (``particle_group("g")(guide)``, or ``fn=guide``). The group comes
    first, unlike Pyro's handlers whose first argument is ``fn``, so that it reads as
    alan's ``Group``.

    :param str group: the group's name.
    :param sites: if given, only the sites of these names join it.
    :param fn: a model or guide to wrap.
    """
    messenger = ParticleGroupMessenger(group, sites)
    return messenger if fn is None else functools.update_wrapper(messenger(fn), fn, updated=())
