"""The capture engine behind ``TMC_ELBO(compile="graph" | "inductor")``: whole steps captured once
per argument shapes and replayed (:mod:`~pyro_tmc.compile.captured_step`), estimate programs
(:mod:`~pyro_tmc.compile.compiled`), loop rolling, forward tracing, inductor's layout pass and
compiling in a child process; :class:`CompileConfig` holds every setting of it.

The engine wraps the losses of :mod:`pyro_tmc.infer` from outside: importing it registers what
builds a loss's programs (:func:`pyro_tmc.infer.base.register_compiler`), and ``import pyro_tmc``
imports it.
"""

from pyro_tmc.compile.captured_step import build_programs
from pyro_tmc.compile.config import CompileConfig
from pyro_tmc.infer.base import register_compiler

register_compiler(build_programs)

__all__ = ["CompileConfig"]
