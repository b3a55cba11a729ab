"""The capture engine's one fallback warning: what could not be captured, rolled or compiled,
what runs instead, and why.

A fallback never changes a number: the eager step, the unrolled graph and the uncompiled
graph compute what the captured, rolled or compiled one would, only slower. Every fallback
says so in one sentence shape, ``pyro_tmc could not <what>; <instead>. Reason: <why>``, so
that one filter on ``"pyro_tmc could not"`` finds them all.
"""

import warnings

#: what runs instead, for each kind of fallback
EAGER = "it runs eagerly instead (same values, no speed-up)"
UNROLLED = "it is replayed unrolled instead (same values)"
UNCOMPILED = "it is replayed uncompiled instead (same values)"
IN_THIS_PROCESS = "it is compiled in this process instead"


def warn_fallback(what: str, reason, instead: str = EAGER, stacklevel: int = 1, limit: int = 300) -> None:
    """
    The one warning that ``what`` (e.g. "capture this loss's step into a graph") failed.

    :param reason: why (an exception or a sentence), shortened to ``limit`` characters.
    :param str instead: what runs instead (:data:`EAGER`, :data:`UNROLLED`, ...).
    :param int stacklevel: as ``warnings.warn``'s, counted from the caller of this function.
    """
    reason = " ".join(str(reason).split())
    if len(reason) > limit:
        reason = reason[:limit] + "..."
    warnings.warn(
        f"pyro_tmc could not {what}; {instead}. Reason: {reason}", RuntimeWarning, stacklevel=stacklevel + 1
    )
