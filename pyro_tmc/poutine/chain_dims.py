"""Particle dims for a guide that samples a chain without ``pyro.markov``, recycled as the model's are.

An AutoGuide such as ``AutoNormal``, or a user's plain loop, samples the sites of
a ``pyro.markov`` chain one by one, outside any markov context. Allocated as
usual, each would get a particle dim of its own, never reused: a chain of T
steps needs T dims, and a tensor holds at most 64. Yet the model's
``pyro.markov`` says which latents meet in a factor: ``x_{t+1}`` meets ``x_t``,
and no factor holds ``x_t`` beside ``x_{t+2}``. So the guide's particles of
``x_t`` can sit on the dim that the model's own run gives ``x_t``, which
``pyro.markov`` recycles.

A :class:`ChainDims` is that assignment, as the ``tmc`` handler reads it
(:mod:`pyro_tmc.infer.chain_plan` makes it). It is safe where no guide site
reads a recycled dim ambiguously: a site whose distribution (or a Delta's value)
varies along a dim that two guide latents have held so far cannot say whose
particles it holds. The handler checks every site against that
(:meth:`ChainDims.check_reads`), and the model's run checks that no model
factor holds two latents on one dim (:func:`check_replayed_dim`).
"""

from dataclasses import dataclass
from typing import Optional

from pyro.poutine.runtime import Message

#: how AutoNormal names the auxiliary site that feeds a site's Delta
AUXILIARY_SUFFIX = "_unconstrained"


class ChainDimsConflict(ValueError):
    """A site that recycled particle dims cannot serve, with the sites involved and what to write instead."""


def _fix(role: str) -> str:
    return (
        f"Wrap the {role}'s loop over the chain in pyro.markov, as the model's is, so that the "
        "particle dims follow its own markov structure (or sample the chain as one site, e.g. "
        "with AutoDiagonalNormal or a vectorized_markov guide)."
    )


@dataclass(frozen=True)
class ChainDims:
    """
    Where the guide's latents outside every markov context put their particles.

    :param dict dims: model chain site -> the particle dim the model's own run
        gives it under ``pyro.markov``. The guide's site of that name takes it, and
        so does an auxiliary site named after it as AutoNormal names them
        (``x_unconstrained`` for ``x``, whose Delta value carries its particles).
    """

    dims: dict[str, int]

    @property
    def band(self) -> frozenset[int]:
        """Every dim the plan hands out: the allocator gives them to no other site."""
        return frozenset(self.dims.values())

    def dim_of(self, msg: Message) -> Optional[int]:
        """The dim of a guide site outside every markov context, or ``None`` if the plan has none for it."""
        name = msg["name"]
        if name in self.dims:
            return self.dims[name]
        if msg["infer"].get("is_auxiliary") and name.endswith(AUXILIARY_SUFFIX):
            return self.dims.get(name[: -len(AUXILIARY_SUFFIX)])
        return None

    def check_reads(self, msg: Message, holders: dict[int, list[str]]) -> None:
        """
        :param holders: dim -> the guide sites that have held it so far, in order.
        :raises ChainDimsConflict: where the site's distribution varies along a
            recycled dim whose particles it cannot name: one that several sites
            have held, or the dim the site itself is about to take. A Delta that
            carries the particles of its own feeder, on the feeder's dim, is fine.
        """
        name = msg["name"]
        batch_shape = msg["fn"].batch_shape
        own_dim = self.dims.get(name)
        feeder = name + AUXILIARY_SUFFIX
        for dim in self.band:
            if len(batch_shape) < -dim or batch_shape[dim] == 1:
                continue
            held = holders.get(dim, [])
            if held and held[-1] == feeder and own_dim == dim:
                continue
            if dim == own_dim or len(held) > 1:
                raise ChainDimsConflict(
                    f"Guide site '{name}' depends on the particles on dim {dim}, which the guide's "
                    f"latents {held} share: the guide samples the chain's sites outside pyro.markov, "
                    "so TMC recycles their particle dims along the model's markov structure, and "
                    f"'{name}' reads a latent whose dim has been recycled. " + _fix("guide")
                )


def check_replayed_dims(msg: Message, value_ids: dict[int, int], param_dims: dict[int, int]) -> None:
    """
    :param value_ids: dim -> id of the dims the replayed value varies along, as
        the guide's run labelled them.
    :param param_dims: dim -> id of the latents upstream of the site in the model's run.
    :raises ChainDimsConflict: where a model site replayed from the guide varies,
        in the model, along a dim that its value holds for one latent and the
        model's scope for another: the two would be paired, not combined. The
        dims were recycled along the model's markov structure, which this
        model's dependencies exceed.
    """
    batch_shape = msg["fn"].batch_shape
    for dim, id_ in value_ids.items():
        if len(batch_shape) < -dim or batch_shape[dim] == 1 or param_dims.get(dim, id_) == id_:
            continue
        raise ChainDimsConflict(
            f"Model site '{msg['name']}' depends on another latent on the particle dim {dim} of its "
            "own value: the guide samples the chain's sites outside pyro.markov, so TMC recycled "
            "their particle dims along the model's markov structure, and this site depends on a "
            "latent that structure had left out of scope. Increase the model's "
            "pyro.markov(history=...) to cover every dependency. " + _fix("guide")
        )
