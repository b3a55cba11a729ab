"""Pyro's ``vectorized_markov`` chains under TMC: a long chain as a few stacked tensor operations.

:func:`pyro.contrib.funsor.vectorized_markov` (``history=1``) runs its loop body
three times: for ``t = 0`` (sites ``z_0``), for the previous steps
``t = arange(0, T-1)`` (sites ``z_slice(0, T-1, None)``, marked
``infer["_do_not_score"]``) and for the current steps ``t = arange(1, T)``
(sites ``z_slice(1, T, None)``), the last two inside an ``IndepMessenger``
over a time dim of size ``T - 1``. So the model computes
``p(z_t | z_{t-1})`` for every ``t >= 1`` in one statement.

Under TMC every latent of a time step has K particles, drawn independently
per time step by the guide, which runs the same loop (or an autoguide that
draws the same sites). Then:

- the *first* site ``z_0`` holds K particles on its dim ``a``;
- the *current* site ``z_slice(1, T)`` holds K particles per time step on its
  dim ``b``: particle ``k`` at step ``t`` is ``z_t^k``;
- the *previous* site ``z_slice(0, T-1)`` is not drawn: the model sees the
  particles of the step before, ``z_{t-1}^k``, on the first site's dim ``a``
  (:func:`with_previous_steps`: ``z_0`` at ``t = 1``, the current site shifted
  by one step after it). Its own draw, if the guide made one, is not scored.

The model's ``log p(z_t | z_{t-1})`` is then a stack over time of ``(K_a, K_b)``
matrices, the link from step ``t-1`` to step ``t``. Contracting the time dim is
the chain product of these matrices (:func:`reduce_markov_times`), with the
factors over ``b`` alone (observations, ``-log q - log K``) added to each link,
in ``log2(T)`` levels (:func:`~pyro_tmc.ops.chains.chain_product`).
It leaves one factor over ``a`` and the last step's ``b``, which the rest of the
contraction sums with ``z_0``'s own factors. This is the unrolled ``pyro.markov``
chain's estimate, term for term: the same factors, contracted in another order.

Dim ``a`` can stand for the steps before only where it is ``z_0``'s alone and holds
as many particles as ``b``. Where ``z_0`` shares its dim with other latents that the
links read (a global's ``Delta`` on an auxiliary site's dim, as
:class:`~pyro_tmc.infer.adaptive_proposal.AdaptiveProposal` draws ``z_0`` with the
globals), has one particle (``num_samples=1`` on the globals), or another count than
the later steps, the previous steps get a dim ``p`` of their own instead
(:func:`needs_own_previous_dim`): ``z_0`` on ``a`` at ``t = 1``, ``z_{t-1}^k`` on ``p``
after it. The first link is then constant along ``p``, ``a`` is a batch dim of every
link (it carries the globals' particles), and the product's ``p`` side is read at
any one index (the first): the factor left is over ``a`` and the last step's ``b``,
as before. Sharing ``a`` in that case would pair the globals' particle ``i`` with
particle ``i`` of each step before: a wrong estimate, not an error.

Several latents per step form one chain whose state is their joint particle
index; a step's latents that do not carry over to the next step are summed per
step. A latent summed exactly (``infer={"enumerate": "parallel"}``, drawn by the
model) enumerates the same support at every step: its links run from the
previous-steps site's own dim, which stands for the first step's after the
product. Sites are matched by name, as ``vectorized_markov`` itself matches them
(``"<var>0"``, ``"<var>slice(0, T-1, None)"``, ``"<var>slice(1, T, None)"``).

Not supported (a :class:`ValueError` names the site): ``history > 1``, a guide
whose draws at a step depend on the step before through its distribution's
parameters (a guide that follows the chain draws its later steps as one
:class:`~pyro_tmc.infer.chain_proposal.ChainProposal`, whose particles hold
their ancestors and whose density is over the site's own particles), a chained latent
that the model samples itself, and a time dim that is subsampled or scaled. ``sample_posterior`` and
``predictive_log_likelihood`` raise :class:`NotImplementedError` on such a chain.

Reference: Aitchison, L. (2019) "Tensor Monte Carlo: Particle Methods for the
GPU Era", NeurIPS; Särkkä, S. and García-Fernández, Á. F. (2021) "Temporal
Parallelization of Bayesian Smoothers", IEEE TAC (the parallel scan over time).
"""

import functools
import math
import re
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pyro.poutine import Trace
from pyro.poutine.messenger import Messenger

from pyro_tmc._pyro import allocate_particle_dim
from pyro_tmc.ops.chains import chain_product
from pyro_tmc.ops.ring import contract_packed
from pyro_tmc.ops.shapes import packed_view
from pyro_tmc.poutine.sites import has_particle_dim, own_particle_dim, particle_draw

#: ``<var>slice(start, stop, None)``: the name ``vectorized_markov`` gives a site of its time dim
_SLICE_NAME = re.compile(r"^(?P<var>.*)slice\((?P<start>\d+), (?P<stop>\d+), None\)$")
#: the ``infer`` key of a previous-steps site whose steps have a particle dim of their own (its dim)
PREVIOUS_STEPS_DIM = "_tmc_previous_steps_dim"


@dataclass(frozen=True)
class TimeLink:
    """
    One latent variable of a ``vectorized_markov`` chain: its three sites.

    :param str first: the site of step 0 (``"<var>0"``).
    :param str previous: the site of steps ``0 .. T-2`` (not scored).
    :param str current: the site of steps ``1 .. T-1``.
    :param str time: the name of the time dim (the loop's ``name``).
    """

    first: str
    previous: str
    current: str
    time: str


@dataclass(frozen=True)
class MarkovTime:
    """
    A time dim to contract as a chain: its packed symbol, and per chained latent,
    the symbol of the links' *from* side (the previous steps' particles: the first
    step's dim for a sampled latent, the previous-steps site's own dim for one
    summed exactly or for one whose previous steps have a dim of their own), of
    their *to* side (the current steps' particles), and of the first step's
    particles, which the from side stands for after the product; ``None`` where
    the from side is a dim of the previous steps' own, along which the first link
    is constant: the product is read at its first index, the first step's dims
    being batch dims of the links.
    """

    symbol: str
    from_symbols: tuple[str, ...]
    current_symbols: tuple[str, ...]
    first_symbols: tuple[Optional[str], ...]
    sites: tuple[str, ...]


@functools.cache
def _no_named_inputs():
    """One funsor without inputs, the same object at every site (a compiled draw's key holds it)."""
    import funsor

    return funsor.Number(0.0)


class NoFunsorScoring(Messenger):
    """
    Gives each sample site a ``msg["funsor"]["log_prob"]`` with no named inputs, so
    that ``vectorized_markov`` does not convert the site's log density to a funsor
    after the last step: it would name every batch dim of it, particle dims
    included, in funsor's own dim stack, which runs out of dims (``"Ran out of free
    dims"``). That conversion only finds the chain's variables for funsor's
    inference; TMC finds them by name (:func:`find_time_links`).
    """

    def _pyro_sample(self, msg) -> None:
        msg.setdefault("funsor", {}).setdefault("log_prob", _no_named_inputs())


def without_funsor_scoring(fn: Callable) -> Callable:
    """``fn`` under :class:`NoFunsorScoring` where Pyro's funsor backend is loaded; else ``fn``."""
    if "pyro.contrib.funsor" not in sys.modules:
        return fn
    return NoFunsorScoring()(fn)


def find_time_links(trace: Trace) -> list[TimeLink]:
    """
    The chained latents of a trace's ``vectorized_markov`` loops, by their site names.

    :raises ValueError: naming the site, for ``history > 1``, or a current site
        without its first-step site.
    """
    links = []
    for name, site in trace.nodes.items():
        if "slice(" not in name:  # every step runs this: most names are no chain's, and say so cheaply
            continue
        match = _SLICE_NAME.match(name) if site["type"] == "sample" else None
        if match is None or site["is_observed"]:
            continue
        var, start, stop = match["var"], int(match["start"]), int(match["stop"])
        if start >= 2:
            raise ValueError(
                f"Site '{name}': vectorized_markov with history > 1 is not supported by TMC. "
                "Use history=1 (carry several latents per step for a longer memory), or pyro.markov."
            )
        if start != 1:
            continue
        first = f"{var}0"
        if first not in trace.nodes:
            raise ValueError(
                f"Site '{name}' is a vectorized_markov step, but its first step '{first}' is missing. "
                "Sample the same name at every step of the loop (f'{var}{t}')."
            )
        frame = _time_frame(site, stop - start)
        links.append(TimeLink(first, f"{var}{slice(0, stop - 1)}", name, frame))
    return links


def _time_frame(site, size: int) -> str:
    """The name of the innermost vectorised frame of ``size`` elements of a site: its time dim."""
    for frame in reversed(site["cond_indep_stack"]):
        if frame.vectorized and frame.size == size:
            return frame.name
    raise ValueError(f"Site '{site['name']}' looks like a vectorized_markov step, but has no time dim.")


def step_particle_dim(site) -> Optional[int]:
    """
    The dim of a latent's own particles: its particle dim, or, for a point mass
    (an autoguide's Delta over an auxiliary latent), the one particle dim its value
    varies along. ``None`` where the value varies along none (one particle).

    :raises ValueError: naming the site, where a point mass varies along several.
    """
    dim = own_particle_dim(site)
    if dim is not None:
        return dim
    value = site["value"]
    batch = value.shape[: value.dim() - site["fn"].event_dim]
    dims = [d for d in site["infer"].get("_dim_to_id", {}) if len(batch) >= -d and batch[d] > 1]
    if len(dims) > 1:
        raise ValueError(
            f"Site '{site['name']}' of a vectorized_markov chain varies along several particle dims "
            f"{sorted(dims)}: TMC cannot tell which one holds its own particles. Give it a guide "
            "site of its own (AutoNormal, or a sample statement in the guide)."
        )
    return dims[0] if dims else None


def own_previous_dim(site) -> Optional[int]:
    """
    The particle dim of a previous-steps site's own, where its steps have one
    (:func:`needs_own_previous_dim`): where the particles of each step but the last
    lie, the first step's staying on the first step's dims. ``None`` otherwise.
    """
    return (site.get("infer") or {}).get(PREVIOUS_STEPS_DIM)


def _step_dims(site, dim: Optional[int]) -> dict[int, int]:
    """``dim -> id`` of the particle dims a latent's value varies along, without ``dim``."""
    value = site["value"]
    batch = value.shape[: value.dim() - site["fn"].event_dim]
    return {
        d: i
        for d, i in site["infer"].get("_dim_to_id", {}).items()
        if d != dim and len(batch) >= -d and batch[d] > 1
    }


def previous_steps_value(
    first, current, time_dim: int, own_dim: Optional[tuple[int, int]] = None
) -> tuple[torch.Tensor, dict[int, int]]:
    """
    The value the previous-steps site takes: at step ``t`` (``t = 1 .. T-1``), the
    particles of step ``t - 1``: the first site's value, then the current site's
    without its last step, its particles on the first site's particle dim, or on
    ``own_dim`` where given (:func:`needs_own_previous_dim`).

    :param first: the first step's site, ``current``: the current steps' site (guide trace nodes).
    :param int time_dim: the time dim (negative, left of the event dims).
    :param own_dim: ``(dim, id)`` of a particle dim of the previous steps' own, or ``None``.
    :returns: the value and its ``dim -> id`` map.
    """
    event_dim = current["fn"].event_dim
    first_dim, current_dim = step_particle_dim(first), step_particle_dim(current)
    target = own_dim[0] if own_dim is not None else first_dim
    before, now = first["value"], current["value"]
    rank = max(before.dim(), now.dim(), event_dim - min(time_dim, target or -1, current_dim or -1))
    before = before.reshape((1,) * (rank - before.dim()) + before.shape)
    now = now.reshape((1,) * (rank - now.dim()) + now.shape)
    if target is not None and current_dim is not None and current_dim != target:
        now = now.transpose(current_dim - event_dim, target - event_dim)
    time = time_dim - event_dim
    now = now.narrow(time, 0, now.size(time) - 1)
    shape = list(torch.broadcast_shapes(before.shape, now.shape))
    shape[time] = 1
    before = before.expand(shape)
    shape[time] = now.size(time)
    value = torch.cat([before, now.expand(shape)], dim=time)
    dim_to_id = {**_step_dims(current, current_dim), **_step_dims(first, None)}
    if own_dim is not None:
        dim_to_id[own_dim[0]] = own_dim[1]
    elif first_dim is not None:
        dim_to_id[first_dim] = first["infer"]["_dim_to_id"][first_dim]
    return value, dim_to_id


def needs_own_previous_dim(guide_trace: Trace, link: TimeLink) -> bool:
    """
    Whether a chained latent's previous steps need a particle dim of their own,
    rather than the first step's (see the module docstring): the first step has no
    particle dim (one particle), another count than the later steps, or a dim that
    another latent of the guide varies along (a global's, whose particle ``i`` the
    links would pair with particle ``i`` of each step before). An auxiliary site
    (an autoguide's ``"<name>_unconstrained"``) that only draws the first step does
    not count: the model never reads it.
    """
    first, current = guide_trace.nodes[link.first], guide_trace.nodes[link.current]
    current_dim = step_particle_dim(current)
    if current_dim is None:
        return False  # no particles of its own: markov_times names the site
    first_dim = step_particle_dim(first)
    if first_dim is None or _size_along(first, first_dim) != _size_along(current, current_dim):
        return True
    chain = (link.first, link.previous, link.current)
    return any(
        name not in chain
        and site["type"] == "sample"
        and not site["is_observed"]
        and not site["infer"].get("is_auxiliary")
        and _size_along(site, first_dim) > 1
        for name, site in guide_trace.nodes.items()
    )


def _size_along(site, dim: int) -> int:
    """The size of a sample site's value along batch dim ``dim`` (1 where it has no such dim)."""
    value = site["value"]
    if not isinstance(value, torch.Tensor) or not hasattr(site["fn"], "event_dim"):
        return 1
    batch = value.shape[: value.dim() - site["fn"].event_dim]
    return batch[dim] if len(batch) >= -dim else 1


def _unused_particle_dim(trace: Trace) -> tuple[int, int]:
    """
    A ``(dim, id)`` that no site of ``trace`` holds, from Pyro's allocator (which
    continues the guide's run, as the model's does next): a global allocation, so
    that no site of the model is given it afterwards.
    """
    taken = set()
    for site in trace.nodes.values():
        infer = site.get("infer") or {}
        taken.update(infer.get("_dim_to_id", {}))
        if infer.get("_enumerate_dim") is not None:
            taken.add(infer["_enumerate_dim"])
    return allocate_particle_dim(taken, recyclable=False)


def with_previous_steps(guide_trace: Trace) -> Trace:
    """
    The trace the model replays: the guide's, with each previous-steps site's value
    replaced by the particles of the step before (:func:`previous_steps_value`).
    The guide's trace itself is left as it is.

    :raises ValueError: naming the site, where the guide's current steps depend on
        its previous steps (a guide that is Markov in time cannot be drawn at once).
    """
    links = find_time_links(guide_trace)
    if not links:
        return guide_trace
    replay = guide_trace.copy()
    for link in links:
        first, current = guide_trace.nodes[link.first], guide_trace.nodes[link.current]
        _check_factorised_in_time(current, guide_trace.nodes.get(link.previous))
        time_dim = next(f.dim for f in current["cond_indep_stack"] if f.name == link.time)
        own_dim = _unused_particle_dim(replay) if needs_own_previous_dim(guide_trace, link) else None
        value, dim_to_id = previous_steps_value(first, current, time_dim, own_dim)
        infer = {"_do_not_score": True, "_dim_to_id": dim_to_id}
        if own_dim is not None:
            infer[PREVIOUS_STEPS_DIM] = own_dim[0]
        replay.nodes[link.previous] = dict(current, name=link.previous, value=value, infer=infer)
    return replay


def _check_factorised_in_time(current, previous) -> None:
    """:raises ValueError: if the guide's current-steps site varies along its previous-steps site's dim."""
    if previous is None:
        return
    dim = step_particle_dim(previous)
    batch = current["fn"].batch_shape
    if dim is not None and len(batch) >= -dim and batch[dim] > 1:
        raise ValueError(
            f"Guide site '{current['name']}' depends on '{previous['name']}', the step before: TMC "
            "draws every step of a vectorized_markov chain at once, so the guide must be factorised "
            "over time (each step's distribution free of the previous step's value). Use a "
            "mean-field guide over time, or pyro.markov for a guide that is Markov in time."
        )


def unscored_sites(model_trace: Trace, guide_trace: Trace) -> set[str]:
    """
    The sites that get no factor: the model's previous-steps sites (and their
    observations), marked ``_do_not_score`` by ``vectorized_markov``, and a guide's
    auxiliary sites of those (an autoguide's ``"<name>_unconstrained"``), which
    only drew the value that :func:`with_previous_steps` replaces.
    """
    skipped = {name for name, site in model_trace.nodes.items() if site.get("infer", {}).get("_do_not_score")}
    if not skipped:
        return skipped
    auxiliary = {
        name
        for name in guide_trace.nodes
        if name not in model_trace.nodes and any(name.startswith(f"{s}_") for s in skipped)
    }
    return skipped | auxiliary


def markov_times(model_trace: Trace) -> dict[str, MarkovTime]:
    """
    The time dims of a symbolised model trace that are contracted as chains, by packed symbol.

    A chained latent is drawn by the guide (its previous steps replayed by
    :func:`with_previous_steps`, on the first step's dim) or summed exactly in the
    model (every step enumerates the same support, so the previous steps' own dim
    stands for the first step's).

    :raises ValueError: naming the site, where a chained latent has no particle dim
        of its own, or is sampled by the model itself.
    """
    times: dict[str, MarkovTime] = {}
    for link in find_time_links(model_trace):
        symbol = model_trace.plate_to_symbol[link.time]
        nodes = model_trace.nodes
        first, previous, current = nodes[link.first], nodes[link.previous], nodes[link.current]
        if particle_draw(previous) is not None:
            raise ValueError(
                f"Site '{link.current}' of a vectorized_markov chain is sampled by the model itself "
                "(the guide has no such site): its previous steps would be drawn afresh, not be the "
                "particles of the step before. Sample it in the guide, or mark it "
                "infer={'enumerate': 'parallel'} to sum it exactly."
            )
        current_symbol = _own_symbol(current)
        own_dim = own_previous_dim(previous)
        if own_dim is not None:  # the first step's dims are the links' batch dims
            first_symbol, from_symbol = None, previous["infer"]["_dim_to_symbol"][own_dim]
        else:
            first_symbol = _own_symbol(first)
            from_symbol = _own_symbol(previous) if has_particle_dim(previous) else first_symbol
        known = times.get(symbol, MarkovTime(symbol, (), (), (), ()))
        times[symbol] = MarkovTime(
            symbol,
            known.from_symbols + (from_symbol,),
            known.current_symbols + (current_symbol,),
            known.first_symbols + (first_symbol,),
            known.sites + (link.current,),
        )
    return times


def _own_symbol(site) -> str:
    """The packed symbol of a chained latent's own particle dim (:func:`step_particle_dim`)."""
    dim = step_particle_dim(site)
    if dim is None:
        raise ValueError(
            f"Site '{site['name']}' of a vectorized_markov chain has no particles of its own "
            "(one particle, or a point mass): TMC cannot chain it. Use num_samples >= 2."
        )
    return site["infer"]["_dim_to_symbol"][dim]


def reduce_markov_times(
    factors: list[torch.Tensor], times: dict[str, MarkovTime], plate_scales: dict[str, float]
) -> list[torch.Tensor]:
    """
    Contract each markov time dim as a chain (see the module docstring): the
    factors that hold it are replaced by one factor over the first step's
    particles and the last step's, times any particle dim they share with
    factors outside the time dim (a global latent), per plate they hold.

    :param factors: packed log factors (tensors).
    :param times: the draw's :func:`markov_times`.
    :param plate_scales: every plate symbol with its scale, the time dims' included.
    """
    plates = frozenset(plate_scales)
    for time in times.values():
        if plate_scales.get(time.symbol, 1.0) != 1.0:
            raise ValueError(
                f"Site '{time.sites[0]}': the time dim of a vectorized_markov chain is scaled or "
                "subsampled, which a chain product cannot carry. Scale or subsample an outer plate instead."
            )
        inside = [f for f in factors if time.symbol in f._pyro_dims]
        outside = [f for f in factors if time.symbol not in f._pyro_dims]
        factors = outside + [_contract_time(inside, outside, time, plates, plate_scales)]
    return factors


def _contract_time(inside, outside, time: MarkovTime, plates: frozenset, plate_scales) -> torch.Tensor:
    """The factors over one time dim, contracted over it as a chain of ``(state, state)`` links."""
    held = set("".join(f._pyro_dims for f in inside))
    held_outside = set("".join(f._pyro_dims for f in outside))
    state_from, state_to = list(time.from_symbols), list(time.current_symbols)
    chained = set(state_from) | set(state_to)
    batch_plates = sorted(held & plates - {time.symbol})
    batch = sorted((held - plates - chained) & held_outside)  # e.g. a global latent in every link
    local = (held - plates - chained) - held_outside  # a step's latents that do not carry over
    order = batch_plates + batch + [time.symbol] + state_from + state_to
    sizes = {d: n for f in inside + outside for d, n in zip(f._pyro_dims, f.shape)}
    shape = [sizes.get(d, 1) for d in order]
    if local:
        keep = frozenset(batch_plates) | {time.symbol}
        kept = held & (chained | set(batch))
        per_step = contract_packed(inside, plate_scales, local | kept, keep, kept)
        links = packed_view(per_step, order).expand(shape)
    else:
        links = sum(packed_view(f, order) for f in inside)
        links = links.expand(shape)
    lead = shape[: len(batch_plates) + len(batch) + 1]
    num_from = math.prod(sizes.get(d, 1) for d in state_from)  # K=1: a dim no factor holds
    num_to = math.prod(sizes.get(d, 1) for d in state_to)
    if num_from != num_to:
        raise ValueError(
            f"Site '{time.sites[0]}': the first step has {num_from} particle combinations and each "
            f"later step {num_to}; a vectorized_markov chain needs one count at every step "
            "(set the same num_samples on the first step's sites and the later steps')."
        )
    product = chain_product(links.reshape(lead + [num_from, num_to]))
    product = product.reshape(shape[: len(lead) - 1] + shape[len(lead) :])
    # the product's from side holds the first step's particles (or its support); a from side of
    # the previous steps' own is constant (the first link does not vary along it): read at index 0
    for position in reversed(range(len(state_from))):
        if time.first_symbols[position] is None:
            product = product.select(len(lead) - 1 + position, 0)
    first = [symbol for symbol in time.first_symbols if symbol is not None]
    product._pyro_dims = "".join(batch_plates + batch + first + state_to)
    return product
