"""Every setting of the capture engine behind ``TMC_ELBO(compile=...)``, in one object.

``TMC_ELBO(compile="inductor", compile_options=CompileConfig(roll_above=None))`` sets
them; a ``dict`` there is still ``torch.compile``'s keyword arguments
(:attr:`CompileConfig.torch_compile`), every other setting at its default. A loss keeps
its own copy, ``loss.compile_config``, read at each step: changing a field there changes
the next steps. ``loss.step_program.<field>`` (``roll_above``, ``max_inductor_nodes``,
``batch_draws``, ``choose_faster``, ``compile_in_background``) is the same field, as the
docs once told users to set it.

Each default's comment says why it is so; the figures are the A/Bs of
``docs/performance.md`` ("The defaults, and why"): the same code with one setting flipped,
on the models of ``benchmarks/frontier.py`` and ``benchmarks/run.py``, on one machine (CPU,
1 thread, a 2-core AMD EPYC), so another machine may want others.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Optional


def _settings(**settings) -> dataclasses.Field:
    """A field whose default is a fresh copy of ``settings`` (inductor's, by name)."""
    return field(default_factory=lambda: dict(settings))


@dataclass
class CompileConfig:
    """
    The capture engine's settings (see the module docstring).

    :param dict torch_compile: keyword arguments for ``torch.compile`` (``compile="inductor"``
        only), as ``compile_options`` took them: ``{"mode": "reduce-overhead"}`` (CUDA
        graphs), ``{"options": {...}}`` (inductor settings, which win over the defaults below).
    """

    #: keyword arguments for ``torch.compile`` (see above)
    torch_compile: dict = field(default_factory=dict)

    # -- the captured whole step (compile_scope="step") ----------------------------------

    #: one step in this many, per key, runs eagerly and compares the model's structure (and the
    #: replayed value) with the capture: a check costs an eager step, so 1% of the steps (a
    #: bound on the cost, not a measured optimum)
    check_every: int = 100
    #: keys (argument shapes) captured per loss: an argument whose shape changes every step
    #: stops being captured after this many, each capture costing a trace (and a compile; not
    #: tuned: a bound on the memory its graphs hold)
    max_captures: int = 8
    #: a captured step whose forward has more operations than this is rolled (a ``pyro.markov``
    #: loop's steps batched into one operation each; ``None``: never). Below it a step is short
    #: enough to replay as it is; about 40 links of a chain (ten operations each) are above it
    roll_above: Optional[int] = 400
    #: a forward is rolled only if its groups are at most this share of its operations: above it,
    #: the stacking and unbinding that rolling adds outweigh what it batches. The shares: the HMM
    #: of 200 steps 0.26, Fig. 4's chain 0.40 (N=100) to 0.73 (N=12); the MNIST VAE 0.81-0.82,
    #: whose rolled step had 2,871 operations against 2,304 and replayed 3 ms (7%) slower
    roll_at_most: float = 0.78
    #: whether a rolled step batches its like random draws too: fewer operations, but not the
    #: eager step's numbers from the same generator state. ``None``: only a step that inductor
    #: compiles on CUDA, where each of a chain's N draws would stay an operation and a kernel of
    #: its own (Fig. 4's 1,000-link chain: 3,339 operations against 2,340 on an H200)
    batch_draws: Optional[bool] = None
    #: record a capture's graphs as the step runs on real tensors (:mod:`pyro_tmc.compile.recording`)
    #: wherever that is sure to give ``make_fx``'s graph, rather than trace them with fake
    #: tensors: the capture of the enumerated HMM of 200 steps took 3.1 s, not 16.5 s (same
    #: process, same graph but for a few operations; docs/performance.md, "Seconds to the first
    #: steps"). ``False``: always ``make_fx``, as before
    record_graphs: bool = True
    #: an uncompiled replay slower than the eager step gives way to it: replaying decomposed
    #: operations one by one, backward included, is slower than eager for a step of a few
    #: stacked densities
    choose_faster: bool = True
    #: uncompiled replays timed (alternating with eager steps) before a key keeps the faster;
    #: the fastest of three, which noise inflates least (not tuned: enough for a 2x difference to
    #: show on a loaded machine)
    timed_replays: int = 3
    #: an uncompiled replay that takes at most this share of the fastest eager step is kept at
    #: once, without the timed eager steps between replays: those cost an eager step each, the
    #: most of a rolled loop's first steps after its capture (two eager steps of 0.6-0.9 s at
    #: the HMM of 1,000 steps, whose replay takes 0.06 s). Noise rarely halves a time, and a
    #: replay kept wrongly is then about as fast as eager anyway
    keep_replay_below: float = 0.5

    # -- inductor ---------------------------------------------------------------------

    #: a captured step with more operations than this (after rolling) is not compiled by inductor
    #: but replayed uncompiled (``None``: no limit): inductor's compile time grows with the
    #: operations, and a 2,340-operation step of the 1,000-link chain compiled in about 80 s
    max_inductor_nodes: Optional[int] = 3000
    #: compile in a child process, replaying the uncompiled graph until it is done: training starts
    #: after the capture (the 1,000-link chain's first replay at 17.1 s, not 52.9 s; 717 steps by
    #: 100 s against 722), but which step is the first compiled one depends on the machine's
    #: speed, so it is off
    compile_in_background: bool = False
    #: inductor settings passed with every compile (never set process-wide): many nodes of a
    #: captured step read one buffer, and inductor's fusion search tries each node against its
    #: next 64 (250k candidate pairs for the 1,000-link chain); at 16 that chain's compile took
    #: 80 s, not 100 s, and its replay was unchanged
    inductor_settings: dict = _settings(max_fusion_buffer_group_pairwise_attempts=16)
    #: inductor settings tried first for a captured step on the CPU, unless ``torch_compile``'s
    #: settings name them (dropped if that compile fails): the code calling the kernels in C++, so
    #: a replay skips Python's 10 µs per kernel and g++ compiles one file. The toy at K=8 went
    #: from 0.47x to 0.40x the compiled hand-written step, the HMM's compile from 52 s to 42 s
    cpu_step_settings: dict = _settings(cpp_wrapper=True)
    #: inductor settings added for a rolled step of large operations (below), unless
    #: ``torch_compile``'s settings name them: its C++ wrapper built apart, at -O1, the kernels
    #: still at -O3. g++ at -O3 spent half its time on that one long function: the 1,000-link
    #: chain's g++ took 9.1-9.6 s, not 12.4-14.8 s, its replay unchanged
    wrapper_apart_settings: dict = _settings(cpp_wrapper_build_separate=True)
    #: a rolled step builds its wrapper apart where its operations' outputs average at least this
    #: many elements, so that the wrapper's dearer calls are lost in the kernels' work: the
    #: 1,000-link chain (122,530) does; the HMM of 200 steps (5,057), built apart, replayed 7%
    #: slower, and the toy 2-3%
    wrapper_apart_mean_size: int = 2**15

    # -- the estimate program (compile_scope="estimate", and loss() / the read-outs) --------

    #: plans (structures and shapes) traced per loss: a model whose plan changes every step stops
    #: being traced after this many (not tuned: a bound on the traces and the graphs kept)
    max_plans: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.torch_compile, dict):
            raise TypeError(f"CompileConfig(torch_compile=) takes a dict, got {self.torch_compile!r}")
        if not isinstance(self.check_every, int) or self.check_every < 1:
            raise ValueError(f"check_every must be a positive int, got {self.check_every!r}")


def compile_config(options, check_every: Optional[int] = None) -> CompileConfig:
    """
    A loss's own :class:`CompileConfig` from its ``compile_options``: a copy of a
    ``CompileConfig``, or a ``dict`` of ``torch.compile`` keywords, or ``None``.

    :param int check_every: the loss's ``check_every``, which wins over the config's where given.
    """
    if options is None or isinstance(options, dict):
        config = CompileConfig(torch_compile=dict(options or {}))
    elif isinstance(options, CompileConfig):  # a copy, its dicts too: two losses never share one
        config = dataclasses.replace(
            options, **{k: dict(v) for k, v in vars(options).items() if isinstance(v, dict)}
        )
    else:
        raise TypeError(
            f"compile_options takes a dict of torch.compile's keywords or a CompileConfig, got {options!r}"
        )
    if check_every is not None:
        config = dataclasses.replace(config, check_every=check_every)
    return config
