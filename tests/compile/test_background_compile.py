"""A captured step compiled in a child process: the switch to its compiled code, and its cache hit."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from pyro_tmc.compile import CompileConfig
from pyro_tmc.compile.background_compile import BackgroundCompile
from pyro_tmc.compile.compiled import compile_captured_graph


def _compile(graph, examples, settings):
    """The compile the child runs, and this process after it (module level: pickled by reference)."""
    return compile_captured_graph(graph, examples, settings, CompileConfig().cpu_step_settings)


def _switch(monkeypatch, tmp_path):
    """The step's first call (starts the child), then its call once the child is done (switches)."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x = torch.randn(8, 3)
    graph = make_fx(lambda t: ((t.sin() * 2.0).sum(0),))(x)
    step = BackgroundCompile(graph, {}, _compile)
    with torch.no_grad():  # as a replay calls it
        (first,) = step(x)  # starts the child, replays uncompiled
        step.wait()
        counters["aot_autograd"].clear()
        (second,) = step(x)  # compiles here, from the child's caches, and runs compiled
    return x, step, (first, second), dict(counters["aot_autograd"])


def test_the_switch_runs_the_compiled_graph(monkeypatch, tmp_path):
    x, step, values, _ = _switch(monkeypatch, tmp_path)
    assert step.uncompiled_calls == 1 and step.compiled is not None
    for value in values:
        assert torch.allclose(value, (x.sin() * 2.0).sum(0))


def test_the_switch_to_the_childs_compile_hits_aot_autograds_cache(monkeypatch, tmp_path):
    """
    The child compiles the graph as a replay runs it, without grad and for this process's thread
    count: both are part of the key of AOTAutograd's cache (and the threads of inductor's). A
    child that compiled with grad on left the step that switched a miss there (only inductor's
    cache, keyed after AOTAutograd's trace of the whole graph, hit); one that compiled for 1
    thread, under a parent of 2, left it two misses, and the switch compiled afresh.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # not the child's own default of 1, whatever this machine's cores
    try:
        _, _, _, aot = _switch(monkeypatch, tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert aot.get("autograd_cache_hit") == 1 and not aot.get("autograd_cache_miss"), aot
