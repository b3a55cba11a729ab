"""Where a captured step's first steps go: the seconds of each phase of its capture and compile.

A key's first steps (:mod:`pyro_tmc.compile.captured_step`) are an eager step, the capture
(the forward traced, rolled where it is long, its backward traced, the whole step rolled
again) and, under ``compile="inductor"``, the first replay, where inductor compiles the graph.
Each phase is timed into one :class:`PhaseTimes` per captured key, so that a slow first step
says which phase grew: ``benchmarks/first_step.py`` prints them.
"""

import contextlib
import time
from collections.abc import Iterator
from typing import Optional

#: the phases, in the order they run
EAGER = "eager step"
TRACE_FORWARD = "trace forward"
PLAN_ROLLING = "plan rolling"
TRACE_BACKWARD = "trace backward"
ROLL_STEP = "roll step"
COMPILE = "compile (first replay)"
PHASES = (EAGER, TRACE_FORWARD, PLAN_ROLLING, TRACE_BACKWARD, ROLL_STEP, COMPILE)


class PhaseTimes:
    """Seconds per phase (:data:`PHASES`), summed where a phase runs more than once."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block into phase ``name``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def total(self) -> float:
        return sum(self.seconds.values())


def timed(times: Optional[PhaseTimes], name: str) -> contextlib.AbstractContextManager:
    """``times.phase(name)``, or nothing where no times are kept."""
    return contextlib.nullcontext() if times is None else times.phase(name)
