"""How much memory a log factor may take (max_factor_bytes="auto"), and the error when it cannot fit.

Bytes and memory only: the budget of a draw's factors, which reads its sites, is
:func:`pyro_tmc.estimate.budget.factor_budget`. A factor is built whole, or, above the
budget, slice by slice along its site's particle dim
(:class:`~pyro_tmc.ops.chunked.ChunkedFactor`). The default budget
is a share of the memory actually available when the factors are built: the
host's (``MemAvailable`` in ``/proc/meminfo``, less where a cgroup limit or
``RLIMIT_AS`` allows less) or, for factors on a CUDA device, the device's free
memory (:func:`torch.cuda.mem_get_info`, plus what torch's caching allocator
holds unused). Small factors never read it.
"""

import contextlib
import math
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Optional, Union

import torch

#: the default of ``max_factor_bytes``: a share of the available memory
AUTO = "auto"

#: the share of the available memory that one factor may take under ``"auto"``: a contraction
#: holds several factor-sized tensors at once (the log density's intermediates, the factor
#: exponentiated, in the backward pass its gradient and the recomputed slice)
AUTO_FRACTION = 1 / 8

#: under ``"auto"``, factors up to this size are built whole without reading the available
#: memory, so that a small model pays nothing for the default
AUTO_MIN_BYTES = 64 * 2**20

_CPU_ALLOCATION_FAILURE = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")


class FactorMemoryError(torch.OutOfMemoryError, MemoryError):
    """
    A log factor, or the smallest slice of it, does not fit in the memory
    available. A :class:`MemoryError` and a :class:`torch.OutOfMemoryError` (so a
    :class:`RuntimeError`), so that the usual handlers of either catch it.
    """


def check_max_factor_bytes(max_factor_bytes) -> Union[int, str, None]:
    """
    :returns: ``max_factor_bytes`` if valid: a positive int, ``"auto"`` or ``None``.
    :raises ValueError: otherwise.
    """
    if max_factor_bytes is None or max_factor_bytes == AUTO:
        return max_factor_bytes
    if isinstance(max_factor_bytes, bool) or not isinstance(max_factor_bytes, int) or max_factor_bytes <= 0:
        raise ValueError(
            f"max_factor_bytes must be a positive int, 'auto' or None, got {max_factor_bytes!r}."
        )
    return max_factor_bytes


def available_bytes(device: Union[str, torch.device] = "cpu") -> Optional[int]:
    """
    The memory a new tensor on ``device`` can take now, in bytes, or ``None``
    where it cannot be read (then no default budget applies).
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    bounds = [
        b for b in (_host_available(), _cgroup_available(), _address_space_available()) if b is not None
    ]
    return max(min(bounds), 0) if bounds else None


def _host_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:  # other Unixes: free pages only (no page cache), which underestimates
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _cgroup_available() -> Optional[int]:
    """The room left under this process's cgroup memory limit (v2, else v1), if it has one."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_file) as limit, open(usage_file) as usage:
                text = limit.read().strip()
                if text == "max":
                    return None
                return int(text) - int(usage.read().strip())
        except (OSError, ValueError):
            continue
    return None


def _address_space_available() -> Optional[int]:
    """The room left under ``RLIMIT_AS`` (``ulimit -v``), if it is set."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/statm") as statm:
            used = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        return soft - used
    except (ImportError, OSError, ValueError, AttributeError):
        return None


def auto_budget_bytes(largest_bytes: int, device: Union[str, torch.device]) -> Optional[int]:
    """
    The default budget for factors whose largest takes ``largest_bytes`` on
    ``device``: ``None`` (build every factor whole) when it is at most
    :data:`AUTO_MIN_BYTES` or within the budget, else :data:`AUTO_FRACTION` of
    the available memory (at least :data:`AUTO_MIN_BYTES`).
    """
    if largest_bytes <= AUTO_MIN_BYTES:
        return None
    available = available_bytes(device)
    if available is None:
        return None
    budget = max(int(available * AUTO_FRACTION), AUTO_MIN_BYTES)
    return None if largest_bytes <= budget else budget


def itemsize() -> int:
    """Bytes per element of a log factor (the default dtype's)."""
    return torch.finfo(torch.get_default_dtype()).bits // 8


def format_bytes(num_bytes: int) -> str:
    """``17179869184`` -> ``'17.2 GB (17179869184 bytes)'``."""
    if num_bytes < 1000:
        return f"{num_bytes} bytes"
    exponent = min(int(math.log10(num_bytes) // 3), 4)
    unit = ["bytes", "kB", "MB", "GB", "TB"][exponent]
    return f"{num_bytes / 1000**exponent:.1f} {unit} ({num_bytes} bytes)"


def factor_memory_error(
    site: str,
    needed: Optional[int],
    max_factor_bytes,
    available: Optional[int] = None,
    smallest_slice: bool = False,
    sliceable: bool = True,
) -> FactorMemoryError:
    """
    The error for the log-density factor of ``site``, which needs ``needed`` bytes
    (``None``: unknown) where ``available`` are free (``None``: not read), under
    ``max_factor_bytes``; ``smallest_slice``: ``needed`` is its smallest slice;
    ``sliceable``: a budget can slice the factor
    (:func:`~pyro_tmc.estimate.budget.can_chunk`), so that a smaller one would help.
    """
    need = f"needs {format_bytes(needed)}" if needed else "does not fit in memory"
    need += " even in its smallest slice" if smallest_slice else ""
    have = f", and {format_bytes(available)} are available" if available is not None else ""
    if not sliceable:
        return FactorMemoryError(
            f"The log-density factor of site '{site}' {need}{have} (max_factor_bytes={max_factor_bytes!r}). "
            "It cannot be sliced (an observed site's factor, a Delta's, or one of at most 2 particles is "
            "built whole), so no max_factor_bytes can make it smaller. Give the latents it depends on "
            "fewer particles (num_samples, or infer={'num_samples': ...}), share one particle dim among "
            "them (infer={'particle_group': name}), subsample its plates (pyro.plate(..., "
            "subsample_size=...)), or free memory."
        )
    if max_factor_bytes is None:
        advice = (
            "Leave max_factor_bytes at 'auto' (the default), or give a budget in bytes, to build "
            "large factors in slices; or give"
        )
    elif smallest_slice:
        advice = "Give"
    else:
        advice = "Give a smaller max_factor_bytes, or give"
    return FactorMemoryError(
        f"The log-density factor of site '{site}' {need}{have} (max_factor_bytes={max_factor_bytes!r}). "
        f"{advice} the site fewer particles (num_samples, or infer={{'num_samples': ...}}), subsample its "
        "plates (pyro.plate(..., subsample_size=...)), or free memory. A factor is sliced along its own "
        "site's particle dim: an observed site's factor, or one of at most 2 particles, is built whole."
    )


def site_memory_error(
    error: RuntimeError, site: str, max_factor_bytes, sliceable: bool = True
) -> Optional[FactorMemoryError]:
    """
    The :class:`FactorMemoryError` naming ``site``, the bytes and ``max_factor_bytes``,
    where ``error`` is torch's out-of-memory error (CPU or CUDA); ``None`` for any other
    error. Called from an ``except`` clause, so that the step pays nothing where nothing fails.

    :param bool sliceable: whether a budget can slice the site's factor
        (:func:`~pyro_tmc.estimate.budget.can_chunk`).
    """
    needed = allocation_failure_bytes(error)
    if needed is None:
        return None
    return factor_memory_error(site, needed, max_factor_bytes, sliceable=sliceable)


@contextmanager
def naming_the_site(site: str, max_factor_bytes) -> Iterator[None]:
    """A context in which torch's out-of-memory error becomes :func:`site_memory_error`."""
    try:
        yield
    except RuntimeError as error:
        named = site_memory_error(error, site, max_factor_bytes)
        if named is None:
            raise  # not an allocation failure
        raise named from error


#: the attribute of an exception raised while contracting that holds the packed dims of the
#: step that raised it (:func:`mark_contraction_step`)
STEP_DIMS = "_pyro_tmc_step_dims"

#: at most this many sites are named in :func:`contraction_memory_error`
MAX_SITES_NAMED = 8


def mark_contraction_step(error: BaseException, dims: Iterable[str]) -> None:
    """
    Record on ``error`` the packed dims of the contraction step it was raised in (the
    innermost step: a mark already there stays), for :func:`contraction_memory_error`.
    """
    if getattr(error, STEP_DIMS, None) is None:
        # an exception type without a __dict__ takes no mark: no names then
        with contextlib.suppress(AttributeError):
            setattr(error, STEP_DIMS, "".join(sorted(set(dims))))


def contraction_memory_error(
    error: RuntimeError, site: str, factor_bytes: int, owners: Optional[dict[str, str]] = None
) -> Optional[FactorMemoryError]:
    """
    The :class:`FactorMemoryError` for torch's out-of-memory ``error`` raised while
    contracting, whose intermediates no one site owns; ``None`` for any other error.
    It names the largest factor (``site``'s, of ``factor_bytes``) and, where the step
    that failed is known (:func:`mark_contraction_step`), the sites whose particles it
    sums (``owners``: particle symbol -> site). A budget slices factors, and slicing
    never makes the contraction hold more than it would whole, so no other
    ``max_factor_bytes`` can help: the advice is what would.
    """
    needed = allocation_failure_bytes(error)
    if needed is None:
        return None
    owners = {} if owners is None else owners
    step_dims = getattr(error, STEP_DIMS, None) or ""
    names = list(dict.fromkeys(owners[d] for d in step_dims if d in owners))
    if len(names) > MAX_SITES_NAMED:
        names = names[:MAX_SITES_NAMED] + [f"{len(names) - MAX_SITES_NAMED} more"]
    over = f", in a sum over the particles of {', '.join(repr(n) for n in names)}" if names else ""
    those = "those sites" if names else "the sites"
    return FactorMemoryError(
        f"Contracting the log factors failed to allocate {format_bytes(needed)}{over}; the largest "
        f"factor is site '{site}''s, {format_bytes(factor_bytes)}. The contraction needs that much at "
        "once: max_factor_bytes bounds the factors, and slicing them never makes the contraction hold "
        "more than it would unsliced, so no max_factor_bytes can make this step smaller. Give "
        f"{those} fewer particles (num_samples, or infer={{'num_samples': ...}} on their guide sites), "
        "share one particle dim among sites that meet in a factor (infer={'particle_group': name}), "
        "subsample the plates (pyro.plate(..., subsample_size=...)), or free memory: this step alone "
        f"takes {format_bytes(needed)}."
    )


def allocation_failure_bytes(error: BaseException) -> Optional[int]:
    """
    The bytes a failed allocation asked for, where ``error`` is torch's
    out-of-memory error (CPU or CUDA); ``None`` if it is another error.
    """
    if isinstance(error, FactorMemoryError):
        return None
    if isinstance(error, torch.OutOfMemoryError):
        found = re.search(r"Tried to allocate ([\d.]+) (\w+)", str(error))
        if found is None:
            return 0
        scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}.get(found.group(2), 1)
        return int(float(found.group(1)) * scale)
    if isinstance(error, RuntimeError):
        found = _CPU_ALLOCATION_FAILURE.search(str(error))
        if found is not None:
            return int(found.group(1))
    return None
