"""The capture context: what a step being captured into a graph asks of the tensor maths below it.

A step captured into a graph of tensor operations (:mod:`pyro_tmc.compile`) runs the same
code as an eager step, so the code below it must know a few things that are no argument of
its own: whether a graph is being traced (then nothing may branch on a tensor's value),
where a log-space product records that it underflowed instead of repairing itself, whether
a matrix product repairs itself in the graph, and the repairs an eager run of the step made,
which size those of the graph. They are the fields of one :class:`CaptureContext`, entered
in one place, :func:`capturing`, which replaces only the fields it is given, so that an
inner context keeps what an outer one set. :func:`deferred_underflow_checks` and
:func:`counting_repairs` are the two ways the capture engine enters it.

The context lives in one :class:`contextvars.ContextVar`, so that threads (a data loader's,
a background compile's) and asyncio tasks each see their own.
"""

import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple, Optional

import torch


class RepairCount(NamedTuple):
    """What an eager matrix product recorded (:func:`counting_repairs`)."""

    shape: torch.Size
    #: how many entries were recomputed exactly (those even float64 could not hold)
    count: int
    #: whether the product, taken below float64 (float32), had no entry low at all
    narrow_clean: bool = False


class RepairHints:
    """The counts of :func:`counting_repairs`, read one product at a time by a trace."""

    def __init__(self, counts: Sequence[tuple]) -> None:
        # a plain (shape, count) reads as a product not clean in float32
        self.counts = [RepairCount(*entry) for entry in counts]
        self.used = 0

    def next(self, shape: torch.Size) -> Optional[int]:
        """
        The count of the next product, of ``shape``; ``None`` from the first product
        that does not line up with the eager step's on (those get the default size).
        """
        if self.used < len(self.counts) and self.counts[self.used].shape == shape:
            self.used += 1
            return self.counts[self.used - 1].count
        self.used = len(self.counts)
        return None

    def narrow_clean(self) -> bool:
        """Whether the product :meth:`next` gave last was clean in float32 in the eager step."""
        return 1 <= self.used <= len(self.counts) and self.counts[self.used - 1].narrow_clean

    def follows_a_clean_product(self) -> bool:
        """Whether the product before the one :meth:`next` gave last repaired nothing in the eager step."""
        return 2 <= self.used <= len(self.counts) and self.counts[self.used - 2].count == 0


@dataclasses.dataclass(frozen=True)
class CaptureContext:
    """
    What the code under a step knows of its capture (see the module docstring).
    The default, outside any capture, is an eager step with nothing to record.
    """

    #: a graph is being traced: no code may branch on a tensor's value (a check of values is
    #: left to the graph's outputs, a random state is not read)
    tracing: bool = False
    #: where each log-space product appends a boolean scalar, set where it underflowed, instead
    #: of repairing itself (``None``: products repair themselves eagerly)
    underflow_flags: Optional[list[torch.Tensor]] = None
    #: whether a matrix product repairs itself in the graph instead of flagging
    repair_in_graph: bool = False
    #: an eager step's record of each matrix product's repair, in order (``None``: no record)
    repair_counts: Optional[list[RepairCount]] = None
    #: a trace's reading of such a record, to size each product's repair (``None``: none)
    repair_hints: Optional[RepairHints] = None
    #: every estimate program gives way to the eager path (the eager steps of a captured
    #: whole step, which would otherwise build estimate programs that its replays never use)
    eager_estimates: bool = False
    #: the graph is for inductor to compile: a log-space chain of small matrices is taken term by
    #: term, its matrices' dims first (:func:`~pyro_tmc.ops.chains.chain_product`)
    termwise_small_chains: bool = False


#: outside any capture: an eager step with nothing to record
_EAGER = CaptureContext()

_CONTEXT: contextvars.ContextVar[CaptureContext] = contextvars.ContextVar("pyro_tmc_capture", default=_EAGER)


def current() -> CaptureContext:
    """The capture context in force (the default :class:`CaptureContext` outside any)."""
    return _CONTEXT.get()


@contextmanager
def capturing(**fields) -> Iterator[CaptureContext]:
    """
    Within this context, the capture context is the current one with ``fields``
    replaced (the fields of :class:`CaptureContext`); the current one is restored after.

    :raises TypeError: for a name that is no field.
    """
    context = dataclasses.replace(_CONTEXT.get(), **fields)
    token = _CONTEXT.set(context)
    try:
        yield context
    finally:
        _CONTEXT.reset(token)


def is_tracing() -> bool:
    """
    Whether a graph is being traced (:attr:`CaptureContext.tracing`): a check that
    reads a tensor's value must not run; the caller checks the graph's outputs instead.
    """
    return _CONTEXT.get().tracing


@contextmanager
def deferred_underflow_checks(
    repair_in_graph: bool = False,
    repair_counts: Optional[Sequence[tuple]] = None,
    termwise_small_chains: bool = False,
) -> Iterator[list[torch.Tensor]]:
    """
    A graph being traced, where no branch on tensor values can run: within this
    context no product is repaired: each appends a boolean scalar tensor, set
    where one of its entries underflowed, to the list yielded, and returns its
    fast value. The caller must recompute outside the context where any flag is
    set (:func:`any_flag`).

    :param bool repair_in_graph: whether a matrix product
        (:func:`~pyro_tmc.ops.log_matmul.log_matmul_exp`) repairs itself in the graph
        instead of flagging. Only for a graph whose backward is traced too: a repair
        without a count runs under ``torch.cond``, whose gradient is a custom
        ``autograd.Function``, which an estimate-only graph would drop.
    :param list repair_counts: what :func:`counting_repairs` collected from an
        eager run of what is traced: each product's repair is sized by its count
        (:func:`~pyro_tmc.ops.graph_repair.repair_capacity`) and runs at every step,
        with no ``torch.cond``. ``None``: every product gets the default size, under
        ``torch.cond``.
    :param bool termwise_small_chains: see :attr:`CaptureContext.termwise_small_chains`.
    """
    hints = None if repair_counts is None else RepairHints(repair_counts)
    with capturing(
        tracing=True,
        underflow_flags=[],
        repair_in_graph=repair_in_graph,
        repair_hints=hints,
        termwise_small_chains=termwise_small_chains,
    ) as context:
        yield context.underflow_flags


@contextmanager
def counting_repairs() -> Iterator[list[RepairCount]]:
    """
    Within this context, each eager matrix product
    (:func:`~pyro_tmc.ops.log_matmul.log_matmul_exp`) appends a :class:`RepairCount`
    (its shape, how many of its entries it recomputed exactly, and whether it was
    clean in float32) to the list yielded, in the order the products run. A step
    captured after it sizes each product's in-graph repair by these counts, and
    takes a product that was clean in float32 in float32
    (``deferred_underflow_checks(repair_counts=...)``).
    """
    with capturing(repair_counts=[]) as context:
        yield context.repair_counts


def merge_repair_counts(seen: Optional[Sequence[tuple]], new: Sequence[tuple]) -> list[RepairCount]:
    """
    What several eager runs of one step repaired, product by product: the most entries
    any of them recomputed, and clean in float32 only where every one was. One draw can
    be clean where most are not (a deep level of Fig. 4's 1,000-link chain): a capture
    sized by that draw alone had nearly every replay redone eagerly. Where the products
    do not line up (another structure), the newest counts stand alone.
    """
    new = [RepairCount(*entry) for entry in new]
    seen = None if seen is None else [RepairCount(*entry) for entry in seen]
    if seen is None or [entry.shape for entry in seen] != [entry.shape for entry in new]:
        return new
    return [
        RepairCount(old.shape, max(old.count, now.count), old.narrow_clean and now.narrow_clean)
        for old, now in zip(seen, new)
    ]


def any_flag(flags: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """A boolean scalar: whether any of the flags collected by :func:`deferred_underflow_checks` is set."""
    if not flags:
        return torch.zeros((), dtype=torch.bool, device=like.device)
    return torch.stack(flags).any()


__all__ = [
    "CaptureContext",
    "RepairCount",
    "RepairHints",
    "any_flag",
    "capturing",
    "counting_repairs",
    "current",
    "deferred_underflow_checks",
    "is_tracing",
    "merge_repair_counts",
]
