"""A captured step compiled by inductor in another process, replayed uncompiled meanwhile.

Inductor's compile of a large captured step takes a while: Fig. 4's 1,000-link chain,
rolled, compiles for about twice as long as it takes to capture, and a blocking compile
makes training wait for both. Compiled in the background instead, the step is replayed as
its uncompiled graph (the same operations, one by one: slower than compiled, far faster
than eager for that chain) until the compiled code is ready, then switches to it. Training
starts after the capture (the figures: docs/performance.md).

The compile runs in a child process (``python -m pyro_tmc.compile.background_compile``), not a
thread: inductor's compile is mostly Python, and in a thread it held the interpreter lock
that the replay's operations need between them, so replays stalled while it ran. The child
compiles the graph into inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``, which it
inherits); when it is done, this process compiles the same graph again, a cache hit, and
switches. The child compiles it without grad, as the replay does, so that the hit is one of
AOTAutograd's cache, not only of inductor's (whose key comes after AOTAutograd's trace of the
whole graph). Where that fails (the graph does not pickle, the child cannot import pyro_tmc,
inductor's cache is off), the compile happens in this process as it would without the
background, or the graph is replayed uncompiled, with one warning.

The price is reproducibility to the last bit: which step is the first to run compiled
depends on how fast the machine compiles, and the compiled step rounds differently (it
fuses operations). To keep the random numbers themselves the same on both sides of the
switch, the compile keeps torch's own random operations (inductor's ``fallback_random``),
unless the settings say otherwise.
"""

import atexit
import os
import pickle
import subprocess
import sys
import tempfile
from typing import Callable, Optional

import torch

from pyro_tmc.compile.fallback import IN_THIS_PROCESS, UNCOMPILED, warn_fallback

#: the children compiling now, with their files: ended with this process (an unfinished
#: compile is of no use)
_CHILDREN: dict[subprocess.Popen, list[str]] = {}

_Spec = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, str]


@atexit.register
def _stop_children() -> None:
    for child, files in list(_CHILDREN.items()):
        child.kill()
        child.wait()
        _remove(files)


def _remove(files: list[str]) -> None:
    for path in files:
        if os.path.exists(path):
            os.remove(path)


class BackgroundCompile:
    """
    A callable replaying ``graph`` (a captured step, called without grad) that, at its
    first call, starts compiling it with inductor in a child process, and runs the
    compiled code from the first call after the child finished.

    :param graph: the captured step's graph.
    :param dict settings: inductor's settings (``torch._inductor.compile``'s ``options``).
    :param compile_in_process: ``(graph, examples, settings) -> compiled``, the compile that
        the child runs to fill inductor's cache (pickled by reference: a module-level function,
        or a ``functools.partial`` of one), and this process again once the child is done.
    """

    def __init__(self, graph: torch.fx.GraphModule, settings: dict, compile_in_process: Callable) -> None:
        self.graph = graph
        self.settings = {"fallback_random": True, **settings}
        self.compile_in_process = compile_in_process
        self.compiled: Optional[Callable] = None
        self.uncompiled_calls = 0
        self._child: Optional[subprocess.Popen] = None
        self._blob: Optional[bytes] = None  # the pickled graph: compiled here as the child compiled it
        self._started = False
        self._files: list[str] = []

    def __call__(self, *inputs: torch.Tensor):
        # contiguous: the compiled code assumes its example inputs' strides (as compiled_step_graph)
        inputs = tuple(t.contiguous() for t in inputs)
        if not self._started:
            self._started = True
            self._start(inputs)
        if self.compiled is None and self._child is not None and self._child.poll() is not None:
            self._finish(inputs)
        if self.compiled is not None:
            return self.compiled(*inputs)
        self.uncompiled_calls += 1
        return self.graph(*inputs)

    def wait(self) -> None:
        """Block until the child has finished compiling (the next call switches to the compiled code)."""
        if self._child is not None:
            self._child.wait()

    def _start(self, inputs) -> None:
        specs: list[_Spec] = [(tuple(t.shape), t.stride(), t.dtype, str(t.device)) for t in inputs]
        try:
            self._blob = pickle.dumps(self.graph)
            # this process's threads: inductor's cache key holds the thread count the compiled code is for
            threads = torch.get_num_threads()
            job = pickle.dumps((self._blob, specs, self.settings, self.compile_in_process, threads))
        except Exception as error:  # e.g. a graph holding a subgraph that does not pickle
            self._compile_here(inputs, f"the graph does not pickle ({error})")
            return
        handle, path = tempfile.mkstemp(prefix="pyro_tmc-compile-", suffix=".pkl")
        with os.fdopen(handle, "wb") as file:
            file.write(job)
        self._files = [path, path + ".log"]
        with open(path + ".log", "wb") as log:
            self._child = subprocess.Popen(
                [sys.executable, "-m", "pyro_tmc.compile.background_compile", path], stdout=log, stderr=log
            )
        _CHILDREN[self._child] = self._files

    def _finish(self, inputs) -> None:
        """The child is done: compile here from inductor's cache, or say why not."""
        child, self._child = self._child, None
        _CHILDREN.pop(child, None)
        log = _read_tail(self._files[1])
        _remove(self._files)
        if child.returncode != 0:
            self._compile_here(inputs, f"its compile in a child process failed: {log}")
            return
        self._compile(pickle.loads(self._blob), inputs)

    def _compile_here(self, inputs, reason: str) -> None:
        # the whole reason: the tail of the child's log, where its error is (600 characters at most)
        what = "compile the captured step in the background"
        warn_fallback(what, reason, IN_THIS_PROCESS, stacklevel=6, limit=700)
        self._compile(self.graph, inputs)

    def _compile(self, graph: torch.fx.GraphModule, inputs) -> None:
        try:
            self.compiled = self.compile_in_process(graph, [t.detach() for t in inputs], self.settings)
        except Exception as error:  # the uncompiled graph is always right: it goes on replaying
            warn_fallback("compile the captured step with inductor", error, UNCOMPILED, stacklevel=8)


def _read_tail(path: str, size: int = 600) -> str:
    try:
        with open(path, "rb") as file:
            text = file.read().decode(errors="replace")
    except OSError:
        return ""
    return " ".join(text.split())[-size:]


def _compile_job(path: str) -> None:
    """
    The child: compile the pickled graph on empty inputs of its examples' specs, into inductor's
    cache, for as many threads as the parent runs.
    """
    from pyro_tmc._torch import load_inductor_tracing

    load_inductor_tracing()  # inductor's tracing expects dynamo's modules loaded
    with open(path, "rb") as file:
        blob, specs, settings, compile_graph, threads = pickle.load(file)
    # the parent's thread count, not one of the child's own: the keys of AOTAutograd's and of
    # inductor's caches hold it (``cpp_runtime_thread_count``: the compiled code's OpenMP threads),
    # and a child compiling for 1 thread, under a parent of 2, left the switch two misses
    torch.set_num_threads(threads)
    graph = pickle.loads(blob)
    examples = [
        torch.empty_strided(shape, stride, dtype=dtype, device=device)
        for shape, stride, dtype, device in specs
    ]
    # without grad, as this process compiles it at a replay: grad mode is part of the key of
    # AOTAutograd's cache, and compiled with grad on, the step that switched missed that cache and
    # traced the whole graph through AOTAutograd again (6 of its 12 s at the 1,000-step HMM)
    with torch.no_grad():
        compile_graph(graph, examples, settings)


if __name__ == "__main__":
    _compile_job(sys.argv[1])
