"""The capture engine behind ``TMC_ELBO(compile="graph" | "inductor")``: whole steps captured once
per argument shapes and replayed (:mod:`~pyro_tmc.compile.captured_step`), estimate programs
(:mod:`~pyro_tmc.compile.compiled`), loop rolling, forward tracing, inductor's layout pass and
compiling in a child process; :class:`CompileConfig` holds every setting of it.
"""

from pyro_tmc.compile.config import CompileConfig

__all__ = ["CompileConfig"]
