"""One graph per step: a loss's whole step captured once per structure, then replayed.

Pyro runs the guide and the model statement by statement at every step, so a step
costs at least the Python of every sample statement, whatever the tensor work.
With ``TMC_ELBO(compile=...)``, :meth:`~pyro.infer.ELBO.loss_and_grads` is
captured instead: the guide under ``tmc``, the model against its particles, the
estimate and its gradients are traced by ``make_fx`` (with fake tensors) into one
graph of tensor operations, or recorded as they run on real tensors where that is sure to
give the same graph, at a tenth of the cost (:mod:`pyro_tmc.compile.recording`). Its inputs
are the param store's unconstrained tensors and the tensors among the step's arguments; its
random draws are
operations of the graph, so each replay draws afresh from torch's generator and
``pyro.set_rng_seed`` makes a run reproducible. The graph is replayed at later
steps (``"graph"``), or compiled by ``torch.compile`` (``"inductor"``).

The contract, as Pyro's ``JitTrace_ELBO`` states its own:

- **Structure is static** for given argument shapes and non-tensor arguments: the
  sites, their distributions and plates, the Python control flow. The key of a
  capture is each tensor argument's shape, dtype, device and ``requires_grad``,
  each other argument's value (or identity), the default dtype, and the
  parameters' names and shapes. A new key means a new capture (at most
  ``max_captures`` per loss: :class:`~pyro_tmc.compile.config.CompileConfig` holds the settings).
- **The first step of a key runs eagerly**, with every check when validation is
  on; the second is captured (and returns its values); the rest are replayed.
- **What cannot be captured runs eagerly, with one warning saying why**: a branch
  on a tensor's value, a tensor read that is neither a parameter nor an argument
  (a data tensor held by a closure: pass it as an argument). The forward is traced
  alone and its backward derived from it (:mod:`pyro_tmc.compile.forward_trace`), except
  where a custom ``autograd.Function`` or a tensor hook is used: that step's
  backward is traced as autograd runs it, so the Function's own backward is in the
  graph (unlike the estimate-only program of :mod:`pyro_tmc.compile.compiled`).
- **A structure change that keeps every shape** (a Python ``if`` on a global
  flag) cannot be seen by a replayed graph. Every ``check_every``-th step of a key
  runs eagerly and compares its structure (each site's name, distribution,
  shapes, plates and ``infer`` flags) with the captured one; on a change the loss
  warns and captures again. Between two checks, a step runs the structure that was
  captured. ``check_every=1`` checks every step (and so captures nothing useful).
- **A step whose value is not finite, or whose log-space products underflowed**
  (:func:`pyro_tmc.ops.capture.deferred_underflow_checks`), runs again eagerly
  from the same random state, where the products are repaired and a bad site is
  named.

A captured step whose forward has more than ``roll_above`` operations (a long
``pyro.markov`` loop, about ten per step) is rolled (:mod:`pyro_tmc.compile.loop_rolling`): its
repeated blocks become one batched operation each, and the backward is traced through
the rolled forward, so a 1,000-step chain is traced once, not twice, step by step, and
replays as about 2,300 operations, not 33,000. A loop whose body changes with t, so that rolling
would batch too little, is replayed unrolled, and says so once (:func:`loop_not_rolled_warning`).

Parameters are found by name in the param store. ``nn.Module`` parameters
registered by ``pyro.module`` are there too, but a plain module reads its own
tensors: during capture they are swapped for the graph's inputs in every module
that holds them, and put back after. The buffers of those modules (and of the
modules around them) are graph inputs too, read from their modules at every step
(:func:`buffers_beside`); a step that writes into one (``BatchNorm`` in training
mode) runs eagerly, with one warning.
"""

import contextlib
import dataclasses
import gc
import re
import time
import warnings
from collections.abc import Iterator
from typing import Callable, NamedTuple, Optional

import torch

import pyro
from pyro.poutine.messenger import Messenger

from pyro_tmc._pyro import param_store_holding
from pyro_tmc._torch import LazyGraphModule, make_fx, schema_of, use_lazy_graph_module
from pyro_tmc.compile.compiled import (
    MODES,
    EstimateProgram,
    GraphFallback,
    compiled_step_graph,
    estimates_eagerly,
    uses_cuda_graphs,
)
from pyro_tmc.compile.config import CompileConfig, compile_config
from pyro_tmc.compile.fallback import UNCOMPILED, UNROLLED, warn_fallback
from pyro_tmc.compile.flatten import Flattener, fill
from pyro_tmc.compile.forward_trace import (
    GradModeMarks,
    HookWatch,
    InGradModes,
    as_leaves,
    custom_backward,
    derive_backward,
    with_gradients,
)
from pyro_tmc.compile.loop_rolling import (
    count_groups,
    count_operations,
    drop_replay_copies,
    eliminate_dead_code,
    graph_constants,
    merge_repeated_zeros,
    roll,
    rolled_runner,
)
from pyro_tmc.compile.phase_times import (
    COMPILE,
    EAGER,
    PLAN_ROLLING,
    ROLL_STEP,
    TRACE_BACKWARD,
    TRACE_FORWARD,
    PhaseTimes,
    timed,
)
from pyro_tmc.compile.recording import record
from pyro_tmc.ops.capture import (
    RepairCount,
    any_flag,
    counting_repairs,
    deferred_underflow_checks,
    merge_repair_counts,
)

#: a whole step's graph is rolled only where the plan runs at most ``1 - ROLL_GAIN`` of its
#: operations: recording the rolled step costs about a replay or two of the step, and a plan
#: that batches less than this finds no loop (the HMM of 1,000 steps, whose forward was rolled:
#: 1,119 operations planned as 1,119 groups)
ROLL_GAIN = 0.1

#: a rolled graph's ``meta`` key: how many operations the graph it was rolled from had (its
#: forward's, or, for a step with a custom backward, the whole step's)
ROLLED_FROM = "pyro_tmc_rolled_from"

#: an unrolled graph's ``meta`` key, where the step was long enough to roll but rolling batched too
#: little: ``(operations, groups, roll_at_most)`` of the plan (``groups`` ``None`` where not counted)
NOT_ROLLED = "pyro_tmc_not_rolled"

#: a loop of fewer steps left unrolled is not said to be: its first and last steps, which start and
#: end the chain otherwise, are most of it, and its plan batches little however alike its steps are
#: (an HMM of 3 steps under ``roll_above=0``: 215 groups of 263 operations; of 5 steps, it rolls)
MIN_LOOP_STEPS = 8


# -- what a step is, for a key ------------------------------------------------------------


def flatten_arguments(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], tuple, Callable]:
    """
    The tensors among a step's arguments, a key for the rest, and a function that
    rebuilds ``(args, kwargs)`` around other tensors (:mod:`pyro_tmc.compile.flatten`:
    containers are walked; another object is keyed by its identity).
    """
    flattener = Flattener(_argument_key)
    template = flattener.flatten((tuple(args), dict(kwargs)))
    return flattener.tensors, tuple(flattener.key), lambda inputs: fill(template, inputs)


def _argument_key(tensor: torch.Tensor) -> tuple:
    return "T", tuple(tensor.shape), tensor.dtype, tensor.device, tensor.requires_grad


class StructureRecorder(Messenger):
    """
    Records each sample and param statement's structure: name, distribution type,
    value shape, plates and public ``infer`` flags (no values). Two runs of a model
    with the same record take the same Python path through its statements.
    """

    def __init__(self) -> None:
        super().__init__()
        self.record: list[tuple] = []
        self.param_names: list[str] = []
        #: ``(name, form)`` of each sample statement inside a ``pyro.markov`` loop (:func:`markov_loops`)
        self.markov_sites: list[tuple[str, tuple]] = []

    def _postprocess_message(self, msg) -> None:
        if msg["type"] == "param":
            if msg["name"] not in self.param_names:
                self.param_names.append(msg["name"])
            return
        if msg["type"] != "sample":
            return
        value = msg["value"]
        if msg["infer"].get("_markov_depth"):  # a statement of a pyro.markov loop's body
            self.markov_sites.append((msg["name"], _statement_form(msg)))
        self.record.append(
            (
                msg["name"],
                type(msg["fn"]).__name__,
                tuple(value.shape) if isinstance(value, torch.Tensor) else None,
                msg["is_observed"],
                tuple((f.name, f.size, f.dim) for f in msg["cond_indep_stack"]),
                tuple(sorted((k, repr(v)) for k, v in msg["infer"].items() if not k.startswith("_"))),
            )
        )


def _statement_form(msg) -> tuple:
    """
    What a loop step's sample statement is, whatever its particle dims: the distribution's type and
    event shape, its plates' sizes, whether it is observed, and its public ``infer`` flags (its value's
    shape is no help: TMC gives each step's value particle dims, which ``pyro.markov`` recycles).
    """
    return (
        type(msg["fn"]).__name__,
        tuple(getattr(msg["fn"], "event_shape", ())),
        tuple((f.name, f.size) for f in msg["cond_indep_stack"]),
        msg["is_observed"],
        tuple(sorted((k, repr(v)) for k, v in msg["infer"].items() if not k.startswith("_"))),
    )


class MarkovLoop(NamedTuple):
    """The statements of a ``pyro.markov`` loop named alike, as ``x_0, x_1, ...`` (:func:`markov_loops`)."""

    #: the sites' name with ``{t}`` for the step, as ``"x_{t}"``
    pattern: str
    #: each step's number, and its statements' ``(name, form)`` in the order they ran
    steps: dict[int, list[tuple[str, tuple]]]


def markov_loops(sites: list[tuple[str, tuple]]) -> list[MarkovLoop]:
    """
    The loops among a step's ``pyro.markov`` statements (:attr:`StructureRecorder.markov_sites`): sites
    whose names differ only in their last number are one loop's steps (the guide's and the model's
    statement of a site are one step's). Longest first; a name without a number, or alone, is none.
    """
    found: dict[tuple[str, str], dict[int, list]] = {}
    for name, form in sites:
        match = re.fullmatch(r"(.*?)(\d+)(\D*)", name)
        if match is not None:
            steps = found.setdefault((match[1], match[3]), {})
            steps.setdefault(int(match[2]), []).append((name, form))
    loops = [MarkovLoop(f"{prefix}{{t}}{suffix}", steps) for (prefix, suffix), steps in found.items()]
    return sorted((loop for loop in loops if len(loop.steps) > 1), key=lambda loop: -len(loop.steps))


def _describe_form(form: tuple) -> str:
    kind, event_shape, plates, observed, flags = form
    words = [f"a {kind} of event shape {event_shape}"]
    if plates:
        words.append("in plates " + ", ".join(f"{name} of {size}" for name, size in plates))
    if flags:
        words.append("infer " + ", ".join(f"{k}={v}" for k, v in flags))
    return ("observed " if observed else "") + ", ".join(words)


def _changing_statement(loops: list[MarkovLoop]) -> Optional[str]:
    """
    A statement of the loops that changes with t, against the same statement at the step before
    (the first step, which often starts the chain otherwise, is not compared); ``None`` where none does.
    """
    for loop in loops:
        numbers = sorted(loop.steps)
        for before, t in zip(numbers[1:], numbers[2:]):
            for (name, form), (name_before, form_before) in zip(loop.steps[t], loop.steps[before]):
                if form != form_before:
                    return (
                        f"site '{name}' is {_describe_form(form)}, where '{name_before}' is "
                        f"{_describe_form(form_before)}"
                    )
    return None


def loop_not_rolled_warning(sites: list[tuple[str, tuple]], not_rolled: tuple) -> Optional[tuple[str, str]]:
    """
    What to say of a captured step that stays unrolled although it is long enough to roll, where it
    has a ``pyro.markov`` loop: ``(what could not be done, why)`` for
    :func:`~pyro_tmc.compile.fallback.warn_fallback`; ``None`` for a step without a loop, or with
    loops of fewer than :data:`MIN_LOOP_STEPS` steps.

    :param sites: the step's ``pyro.markov`` statements (:attr:`StructureRecorder.markov_sites`).
    :param tuple not_rolled: the graph's :data:`NOT_ROLLED` entry.
    """
    loops = markov_loops(sites)
    if not loops or len(loops[0].steps) < MIN_LOOP_STEPS:
        return None
    named = ", ".join(loop.pattern for loop in loops[:3]) + (", ..." if len(loops) > 3 else "")
    numbers = sorted(loops[0].steps)
    what = f"roll the captured step's pyro.markov loop over {named} (t = {numbers[0]}..{numbers[-1]})"
    operations, groups, share = not_rolled
    changing = _changing_statement(loops)
    why = (
        f"its body changes with t: {changing}. "
        if changing is not None
        else "its steps' operations differ with t (a shape, a number or a branch that depends on t). "
    )
    if groups is None:
        why += f"Rolling would batch too few of its {operations} operations to pay"
    else:
        why += (
            f"Rolling would run its {operations} forward operations as {groups} batched ones, more than "
            f"roll_at_most={share} of them. A loop whose body is the same at every t rolls"
        )
    return what, why


# -- the parameters a step reads ------------------------------------------------------------


def unconstrained_parameters(names: list[str]) -> list[torch.Tensor]:
    """The param store's unconstrained tensors of the named parameters."""
    store = pyro.get_param_store()
    return [store.get_param(name).unconstrained() for name in names]


def live_modules() -> list[torch.nn.Module]:
    """Every live ``nn.Module``: a scan of live objects, once per capture."""
    # type(), not isinstance: a weak proxy among the objects would raise, a lazy module warn
    return [obj for obj in gc.get_objects() if issubclass(type(obj), torch.nn.Module)]


def modules_holding(
    tensors: list[torch.Tensor], modules: list[torch.nn.Module]
) -> list[tuple[torch.nn.Module, str, int]]:
    """
    ``(module, attribute, index)`` for every attribute of ``modules`` that holds one of
    ``tensors`` (by identity): where a module registered by ``pyro.module`` reads its
    parameters, which the param store cannot redirect.
    """
    index_of = {id(t): i for i, t in enumerate(tensors)}
    holders = []
    for module in modules:
        for attribute, value in module._parameters.items():
            if value is not None and id(value) in index_of:
                holders.append((module, attribute, index_of[id(value)]))
    return holders


def buffers_beside(
    holders: list[tuple[torch.nn.Module, str, int]], modules: list[torch.nn.Module]
) -> list[tuple[torch.nn.Module, str]]:
    """
    ``(module, name)`` of each buffer of the modules around the step's parameters: of
    every one of ``modules`` that holds one of them, or contains one that does, and of
    all their submodules (a normalizing flow's masks and permutation, as ``AutoIAFNormal``'s
    network holds them). A buffer is not a parameter, so the param store does not
    hold it; the graph takes each as an input, read from its module at every step.
    """
    holding = {id(module) for module, _, _ in holders}
    if not holding:
        return []
    found: dict[tuple[int, str], tuple[torch.nn.Module, str]] = {}
    for outer in modules:
        if any(id(m) in holding for m in outer.modules()):
            for module in outer.modules():
                for name, buffer in module._buffers.items():
                    if buffer is not None:
                        found[(id(module), name)] = (module, name)
    return list(found.values())


def current_buffers(sources: list[tuple[torch.nn.Module, str]]) -> list[torch.Tensor]:
    """The buffers named by :func:`buffers_beside`, as their modules hold them now."""
    return [module._buffers[name] for module, name in sources]


class _ModulesHolding:
    """
    A context in which the modules' parameters, and the buffers named by
    :func:`buffers_beside`, are the given tensors; the originals come back on exit.
    """

    def __init__(self, holders, tensors: list[torch.Tensor], buffers=(), buffer_tensors=()) -> None:
        self.holders, self.tensors = holders, tensors
        self.buffers, self.buffer_tensors = list(buffers), list(buffer_tensors)

    def __enter__(self) -> None:
        self.saved = [module._parameters[attribute] for module, attribute, _ in self.holders]
        self.saved_buffers = current_buffers(self.buffers)
        for module, attribute, index in self.holders:
            module._parameters[attribute] = self.tensors[index]
        for (module, name), tensor in zip(self.buffers, self.buffer_tensors):
            module._buffers[name] = tensor

    def __exit__(self, *exc) -> None:
        for (module, attribute, _), original in zip(self.holders, self.saved):
            module._parameters[attribute] = original
        for (module, name), original in zip(self.buffers, self.saved_buffers):
            module._buffers[name] = original


# -- one captured step ----------------------------------------------------------------


@dataclasses.dataclass
class CapturedStep:
    """A key's captured step: its graph, and what it was captured with."""

    program: Optional[Callable]  # None: this key runs eagerly
    #: the step's forward, unrolled: it draws as the eager step does (replayed at a check to compare values)
    graph: Optional[Callable]
    param_names: list[str]
    param_specs: list[tuple]
    structure: list[tuple]
    #: an uncompiled replay is timed against the eager step, alternately (:meth:`StepProgram._settle`);
    #: ``None`` once settled or compiled
    eager_seconds: Optional[list[float]] = None
    replay_seconds: list[float] = dataclasses.field(default_factory=list)
    #: replays, and those redone eagerly because a product underflowed
    attempts: int = 0
    redone: int = 0
    #: the (rolled) graph that inductor compiled: replayed instead if compiling fails
    uncompiled: Optional[Callable] = None
    #: the modules' buffers the graph takes after the arguments (:func:`buffers_beside`), and their specs
    buffers: list[tuple[torch.nn.Module, str]] = dataclasses.field(default_factory=list)
    buffer_specs: list[tuple] = dataclasses.field(default_factory=list)
    #: the seconds of its capture's phases, and of its first replay (:mod:`pyro_tmc.compile.phase_times`)
    times: PhaseTimes = dataclasses.field(default_factory=PhaseTimes)

    def inputs_after_params(self, arguments: list[torch.Tensor]) -> Optional[list[torch.Tensor]]:
        """The tensor arguments, then the buffers as they are now; ``None`` if a buffer's spec changed."""
        buffers = current_buffers(self.buffers)
        if [_spec(b) for b in buffers] != self.buffer_specs:
            return None
        return arguments + buffers


def _spec(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tensor.dtype, tensor.device


def capture_step(
    differentiable_loss: Callable,
    param_names: list[str],
    arguments: list[torch.Tensor],
    rebuild: Callable,
    repair_counts: Optional[list] = None,
    roll_above: Optional[int] = None,
    batch_draws: bool = False,
    roll_at_most: float = CompileConfig.roll_at_most,
    times: Optional[PhaseTimes] = None,
    record_graphs: bool = True,
    termwise_small_chains: bool = False,
) -> "Capture":
    """
    Trace ``differentiable_loss(*args, **kwargs)`` and its gradient with respect
    to the named parameters into one graph of ``(params..., arguments...) ->
    (loss, underflow, grads...)``.

    The forward is traced alone, then its backward from it (:mod:`pyro_tmc.compile.forward_trace`):
    from the forward rolled (:mod:`pyro_tmc.compile.loop_rolling`) where it has more than
    ``roll_above`` operations. A step with a custom ``autograd.Function`` or a tensor
    hook is traced again, with its backward as autograd runs it, and that graph is rolled.

    :param list repair_counts: how many entries each log-space matrix product of
        an eager run of the step repaired (:func:`~pyro_tmc.ops.capture.counting_repairs`):
        the graph's repairs are sized to them.
    :param int roll_above: roll a step of more forward operations than this
        (``None``: never).
    :param bool batch_draws: see :func:`~pyro_tmc.compile.loop_rolling.plan_groups`.
    :param float roll_at_most: roll a forward whose groups are at most this share of its
        operations (``CompileConfig.roll_at_most``).
    :param PhaseTimes times: where each phase's seconds are added (``None``: not timed).
    :param bool record_graphs: record the graphs on real tensors where that gives the trace's
        (:mod:`pyro_tmc.compile.recording`; ``CompileConfig.record_graphs``); else trace them.
    :param bool termwise_small_chains: take chains of small matrices term by term, for a graph
        that inductor compiles (:func:`~pyro_tmc.ops.chains.termwise_chain_product`).

    :returns: the graphs, and the structure the trace recorded.
    :raises GraphFallback: where tracing fails (a branch on values, a tensor read
        that is not an input).
    """
    params = unconstrained_parameters(param_names)
    modules = live_modules()
    holders = modules_holding(params, modules)
    buffers = buffers_beside(holders, modules)
    num_params, num_arguments = len(params), len(arguments)
    recorded: list[list] = []
    own_backward: list[bool] = []  # whether the step's backward must be traced as autograd runs it
    marks: list[GradModeMarks] = []

    def run_loss(*inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        leaves = list(inputs[:num_params])  # the parameters: the gradient is taken with respect to them
        args, kwargs = rebuild(list(inputs[num_params : num_params + num_arguments]))
        held = _ModulesHolding(holders, leaves, buffers, inputs[num_params + num_arguments :])
        recorder = StructureRecorder()
        with (
            param_store_holding(dict(zip(param_names, leaves))),
            held,
            pyro.validation_enabled(False),
            deferred_underflow_checks(
                repair_in_graph=True, repair_counts=repair_counts, termwise_small_chains=termwise_small_chains
            ) as flags,
            recorder,
        ):
            loss = differentiable_loss(*args, **kwargs)
            underflow = any_flag(flags, loss)
        recorded.append(recorder.record)
        return loss, underflow

    def watched(*inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with HookWatch() as hooks:
            return _noting_own_backward(run_loss, hooks, own_backward)(*inputs)

    def forward(*inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        marks.append(GradModeMarks())
        with marks[-1]:
            return watched(*inputs)

    def trace_forward() -> torch.fx.GraphModule:
        # recorded on real tensors where that is sure to give the trace's graph; else traced
        if record_graphs:
            hooks = HookWatch()  # noted by the recording's function mode: not entered
            noted = _noting_own_backward(run_loss, hooks, own_backward)
            recording = record(noted, inputs, num_params, _rng_of(inputs), hooks=hooks)
            if recording.graph is not None:
                return recording.graph
        recorded.clear()
        own_backward.clear()
        return make_fx(forward, tracing_mode="fake")(*as_leaves(inputs, num_params))

    inputs = params + arguments + current_buffers(buffers)
    try:
        # a lazy graph writes its Python code at its first call, not at each recompile: a long
        # step's graph is rewritten by rolling and may never run (tens of thousands of operations)
        with use_lazy_graph_module(True):
            with timed(times, TRACE_FORWARD):
                forward_graph = trace_forward()
            _check_buffers_read_only(forward_graph, buffers, num_params + num_arguments)
            if not own_backward[-1]:
                program = _backward_of(
                    forward_graph,
                    inputs,
                    num_params,
                    roll_above,
                    batch_draws,
                    roll_at_most,
                    times,
                    record_graphs,
                )
                return Capture(program, forward_graph, recorded[0], buffers)
            # its own backward, as autograd runs it: about three operations per forward one
            with timed(times, TRACE_BACKWARD):
                whole = derive_backward(run_loss, inputs, num_params)
            with timed(times, ROLL_STEP):
                longer = None if roll_above is None else 3 * roll_above
                program = _rolled(whole, inputs, longer, batch_draws, record_graphs, note_not_rolled=True)
            return Capture(program, whole, recorded[0], buffers)
    except GraphFallback:
        raise
    except Exception as error:  # any failure: the eager step is always right
        read_a_value = any(mark.read_a_value for mark in marks)
        raise GraphFallback(_fallback_reason(error, read_a_value)) from error


def _noting_own_backward(run_loss: Callable, hooks: HookWatch, own_backward: list[bool]) -> Callable:
    """
    ``run_loss``, noting in ``own_backward`` whether the step's backward must be traced as autograd
    runs it: a tensor hook registered while ``hooks`` watched, or a custom ``autograd.Function``.
    """

    def noted(*inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss, underflow = run_loss(*inputs)
        own_backward.append(hooks.hooked or (loss.requires_grad and custom_backward(loss) is not None))
        return loss, underflow

    return noted


class Capture(NamedTuple):
    """What :func:`capture_step` traced."""

    #: ``(params..., arguments...) -> (loss, underflow, grads...)``, rolled where it pays
    program: torch.fx.GraphModule
    #: the same inputs ``-> (loss, underflow, ...)``, unrolled: it draws as the eager step does
    unrolled: torch.fx.GraphModule
    #: the structure of the step's sample and param statements (:class:`StructureRecorder`)
    structure: list[tuple]
    #: the modules' buffers that the graphs take after the arguments (:func:`buffers_beside`)
    buffers: list[tuple[torch.nn.Module, str]] = []


def _check_buffers_read_only(
    forward: torch.fx.GraphModule, buffers: list[tuple[torch.nn.Module, str]], first: int
) -> None:
    """
    Refuse a step that writes into a module's buffer (``BatchNorm``'s running statistics
    in training mode): a replay redone eagerly, or replayed at a check, would write twice.

    :param int first: the position of the first buffer among the graph's inputs.
    :raises GraphFallback: naming the buffer.
    """
    placeholders = [node for node in forward.graph.nodes if node.op == "placeholder"][first:]
    names = {node: f"{type(module).__name__}.{name}" for node, (module, name) in zip(placeholders, buffers)}
    if not names:
        return
    for node in forward.graph.nodes:
        schema = schema_of(node.target)
        if node.op != "call_function" or schema is None:
            continue
        for argument, value in zip(schema.arguments, node.args):
            written = argument.alias_info is not None and argument.alias_info.is_write
            if written and isinstance(value, torch.fx.Node) and _base(value) in names:
                raise GraphFallback(
                    f"the step writes into the buffer {names[_base(value)]} (as BatchNorm's running "
                    "statistics in training mode do); a captured step only reads buffers. Put the "
                    "module in eval() mode, or train with compile=None"
                )


def _base(value):
    """The graph node a view chain starts from (``value`` itself if it is not a view)."""
    while isinstance(value, torch.fx.Node) and value.op == "call_function":
        schema = schema_of(value.target)
        if schema is None or not schema.arguments or schema.arguments[0].alias_info is None:
            return value
        if schema.arguments[0].alias_info.is_write:
            return value
        value = value.args[0]
    return value


def _backward_of(
    forward: torch.fx.GraphModule,
    inputs: list[torch.Tensor],
    num_params: int,
    roll_above: Optional[int],
    batch_draws: bool,
    roll_at_most: float,
    times: Optional[PhaseTimes] = None,
    record_graphs: bool = True,
) -> torch.fx.GraphModule:
    """
    The whole step's graph from its traced forward: the forward rolled where it has
    more than ``roll_above`` operations and rolling batches them into at most
    ``roll_at_most`` as many groups, then its backward traced through it.
    """
    eliminate_dead_code(forward.graph)
    not_rolled = None
    if roll_above is not None and count_operations(forward) > roll_above:
        try:
            with timed(times, PLAN_ROLLING):
                runner = rolled_runner(forward, batch_draws)
            operations = count_operations(forward)
            groups = count_groups(runner)
            not_rolled = (operations, groups, roll_at_most)
            if groups <= roll_at_most * operations:
                # autograd's backward of the rolled forward still has a few per-step leftovers (the
                # zero gradients of an unbind's unused outputs): rolled in turn
                with timed(times, TRACE_BACKWARD):
                    whole = _derived(
                        runner, inputs, num_params, graph_constants(runner.module), record_graphs
                    )
                with timed(times, ROLL_STEP):
                    graph = _rolled(whole, inputs, roll_above, batch_draws, record_graphs)
                graph.meta[ROLLED_FROM] = operations
                return graph
        except Exception as error:  # the unrolled graph is always right
            _warn_not_rolled(error)
            not_rolled = None  # said already
    with timed(times, TRACE_BACKWARD):
        graph = _derived(
            InGradModes(forward).run, inputs, num_params, graph_constants(forward), record_graphs
        )
    if not_rolled is not None:
        graph.meta[NOT_ROLLED] = not_rolled
    return graph


def _derived(
    forward: Callable,
    inputs: list[torch.Tensor],
    num_params: int,
    constants: list[torch.Tensor],
    record_graphs: bool = True,
) -> torch.fx.GraphModule:
    """
    :func:`~pyro_tmc.compile.forward_trace.derive_backward` of a traced forward, recorded on the
    real inputs where that gives its graph (:mod:`pyro_tmc.compile.recording`), else traced.

    :param constants: the forward graph's constants, which its runner reads.
    :param bool record_graphs: ``False``: trace it, never record.
    """
    if record_graphs:
        gradients = with_gradients(forward, num_params)
        recording = record(gradients, inputs, num_params, _rng_of(inputs), constants)
        if recording.graph is not None:
            return recording.graph
    return derive_backward(forward, inputs, num_params)


def _recorded_rolled(runner: Callable, inputs: list[torch.Tensor]) -> torch.fx.GraphModule:
    """A rolled runner as one graph (:func:`~pyro_tmc.compile.loop_rolling.roll`): recorded, else traced."""
    recording = record(runner, inputs, 0, _rng_of(inputs), graph_constants(runner.module))
    if recording.graph is not None:
        return recording.graph
    return make_fx(runner, tracing_mode="fake")(*inputs)


def _rng_of(tensors: list[torch.Tensor]) -> tuple[Callable, Callable]:
    """``(get_state, set_state)`` of the generators a step on these tensors draws from."""
    return (lambda: _rng_state(tensors), _set_rng_state)


def _rolled(
    graph: torch.fx.GraphModule,
    inputs: list[torch.Tensor],
    roll_above: Optional[int],
    batch_draws: bool,
    record_graphs: bool = True,
    note_not_rolled: bool = False,
) -> torch.fx.GraphModule:
    """
    A whole step's graph, backward included, rolled (:func:`pyro_tmc.compile.loop_rolling.roll`)
    where it has more than ``roll_above`` operations and rolling makes it smaller; else itself.
    Its repeated zero gradients are merged first
    (:func:`~pyro_tmc.compile.loop_rolling.merge_repeated_zeros`): a step whose forward was
    rolled is then about as small as rolled again, and is recorded again only where the plan
    batches at least :data:`ROLL_GAIN` of its operations.

    :param bool note_not_rolled: mark the graph (:data:`NOT_ROLLED`) where it is long enough to roll
        but rolling would not make it smaller (a step whose forward was not rolled first).
    """
    eliminate_dead_code(graph.graph)
    merge_repeated_zeros(graph.graph)
    if roll_above is None or count_operations(graph) <= roll_above:
        return graph
    try:
        at_most = int((1 - ROLL_GAIN) * count_operations(graph))
        rolled = roll(
            graph, inputs, batch_draws, trace=_recorded_rolled if record_graphs else None, at_most=at_most
        )
    except Exception as error:  # the unrolled graph is always right
        _warn_not_rolled(error)
        return graph
    if rolled is None or count_operations(rolled) >= count_operations(graph):
        if note_not_rolled:
            graph.meta[NOT_ROLLED] = (count_operations(graph), None, 1 - ROLL_GAIN)
        return graph
    rolled.meta[ROLLED_FROM] = count_operations(graph)
    return rolled


def _warn_not_rolled(error: Exception) -> None:
    warn_fallback("roll the captured step", error, UNROLLED, stacklevel=6)


def _write_code(graph: torch.fx.GraphModule) -> None:
    """
    Write the Python code of a lazy graph and of its submodules (``cond``'s branches) now.
    Dynamo will not trace a lazy graph's stand-in forward, and inlines ``cond``'s branches:
    a branch never run yet would make inductor refuse the whole step.
    """
    for module in graph.modules():
        if isinstance(module, LazyGraphModule):
            module.real_recompile()


def _fallback_reason(error: Exception, read_a_value: bool = False) -> str:
    """
    Why tracing failed, in the user's terms where the tracer's message is about its own.

    :param bool read_a_value: whether the step read a tensor's value as a Python number
        before it failed (:class:`~pyro_tmc.compile.forward_trace.GradModeMarks`): the tracer then
        fails later, on the symbol it gave for that number, with a message about something
        else (an index that is a ``SymInt``; a site named ``"x_u0"`` that the model lacks).
    """
    message = f"{type(error).__name__}: {error}"
    if "convert all Tensors to FakeTensors" in message:
        return (
            "the step reads a tensor that is neither a parameter in the param store nor an argument "
            "of the step: a data tensor held by a closure or a global (pass it as an argument), or "
            "an nn.Module whose parameters are not the param store's (pyro.module under a name "
            f"that another module registered first). Tracer: {message}"
        )
    if "data-dependent" in message or "DataDependent" in message or read_a_value:
        return (
            "the step branches on, or reads, a tensor's value (e.g. .item() or an if; a tensor "
            "formatted into a site name, as the indices of a subsampled pyro.plate iterated in Python "
            f"are). Tracer: {message}"
        )
    return message


class _ConfigField:
    """``step_program.<name>``: the loss's ``CompileConfig`` field of that name, read and set there."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, program, owner=None):
        return self if program is None else getattr(program.config, self.name)

    def __set__(self, program, value) -> None:
        setattr(program.config, self.name, value)


class StepProgram:
    """
    The captured steps of one loss, keyed by the step's arguments (see the module docstring).

    :param str mode: ``"graph"`` (replay the traced operations) or ``"inductor"``
        (``torch.compile`` them).
    :param CompileConfig config: the loss's settings.
    """

    #: the settings the docs told users to set here: each is the loss's ``compile_config``'s
    check_every = _ConfigField()
    max_inductor_nodes = _ConfigField()
    roll_above = _ConfigField()
    batch_draws = _ConfigField()
    choose_faster = _ConfigField()
    compile_in_background = _ConfigField()

    def __init__(self, mode: str, config: CompileConfig) -> None:
        if mode not in MODES[1:]:
            raise ValueError(f"compile must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.config = config
        #: CUDA graphs (torch.compile's "reduce-overhead" and "max-autotune" modes) reuse output buffers
        self._outputs_reused = mode == "inductor" and uses_cuda_graphs(config)
        self._steps: dict[tuple, CapturedStep] = {}
        self._seen: dict[tuple, int] = {}  # key -> steps taken
        self._refitted: set = set()  # keys captured again because their repairs were too small
        #: per key, what its eager steps repaired, merged
        #: (:func:`~pyro_tmc.ops.capture.merge_repair_counts`):
        #: a capture's repairs are sized by all of them, not by its own eager run alone
        self._repairs: dict[tuple, list[RepairCount]] = {}
        self._said_not_rolled: set = set()  # keys whose loop was said to stay unrolled (once each)
        self.captures = 0  # how many steps were captured (tests read it)
        self.replays = 0
        self._warned = False

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)  # graphs do not pickle: a copy captures its own
        state["_steps"], state["_seen"], state["_refitted"], state["_repairs"] = {}, {}, set(), {}
        state["_said_not_rolled"] = set()
        return state

    def loss_and_grads(
        self, eager_step: Callable, differentiable_loss: Callable, args, kwargs, functions: tuple = ()
    ) -> float:
        """
        One step: ``-bound`` as a float, its gradient accumulated into each parameter's ``.grad``.

        :param eager_step: ``(args, kwargs) -> float``, the loss's own eager ``loss_and_grads``.
        :param differentiable_loss: ``(*args, **kwargs) -> loss``, what is captured.
        :param tuple functions: the model and guide, part of the key (by identity).
        """
        arguments, key, rebuild = flatten_arguments(args, kwargs)
        key = key + (torch.get_default_dtype(),) + tuple(map(_identity, functions))
        count = self._seen.get(key, 0)
        self._seen[key] = count + 1
        captured = self._steps.get(key)
        if captured is not None and captured.program is None:
            return eager_step(args, kwargs)  # this key runs eagerly for good
        if captured is None and count > 0 and len(self._steps) >= self.config.max_captures:
            return eager_step(args, kwargs)
        # the eager steps of a key that is, or will be, captured are few: they compute the estimate
        # eagerly rather than trace (and compile, far dearer than a step) an estimate program
        eager_step = _estimating_eagerly(eager_step)
        if count == 0:
            with self._counting_repairs(key):
                return eager_step(args, kwargs)  # the first step of a key runs every check
        if captured is None:
            with _collection_paused():
                return self._capture(key, differentiable_loss, arguments, rebuild, eager_step, args, kwargs)
        if count % self.check_every == 0:
            return self._checked_eager(eager_step, args, kwargs, key, arguments)
        if self._times_eager_next(captured):
            start = time.perf_counter()
            loss = eager_step(args, kwargs)
            captured.eager_seconds.append(time.perf_counter() - start)
            return loss
        return self._replay(key, captured, arguments, eager_step, args, kwargs)

    @contextlib.contextmanager
    def _counting_repairs(self, key: tuple) -> Iterator[None]:
        """An eager step of ``key``: its repairs join the key's record, which sizes its captures."""
        with counting_repairs() as counts:
            yield
        self._repairs[key] = merge_repair_counts(self._repairs.get(key), counts)

    def phase_seconds(self) -> dict[str, float]:
        """
        The seconds of each phase of the latest capture and of its first replay
        (:mod:`pyro_tmc.compile.phase_times`); empty before any capture.
        """
        captured = [step for step in self._steps.values() if step.graph is not None]
        return dict(captured[-1].times.seconds) if captured else {}

    def wait_for_compiles(self) -> None:
        """Block until every compile started in the background (``compile_in_background``) has finished."""
        for captured in list(self._steps.values()):
            wait = getattr(captured.program, "wait", None)
            if wait is not None:
                wait()

    def _times_eager_next(self, captured: CapturedStep) -> bool:
        """While a replay is timed against the eager step, they alternate (one eager step per replay)."""
        return (
            self.choose_faster
            and captured.eager_seconds is not None
            and len(captured.eager_seconds) <= len(captured.replay_seconds)
        )

    # -- eager steps ------------------------------------------------------------------

    def _checked_eager(self, eager_step, args, kwargs, key, arguments) -> float:
        """
        An eager step that checks the capture: the model's structure must be the
        captured one, and the captured graph, replayed from the same random state,
        must give the same value (a changed constant or global shows there).
        """
        captured = self._steps[key]
        params = unconstrained_parameters(captured.param_names)
        rng_state = _rng_state(params + arguments)
        recorder = StructureRecorder()
        with recorder:
            loss = eager_step(args, kwargs)
        inputs = captured.inputs_after_params(arguments)
        changed = recorder.record != captured.structure or inputs is None
        if not changed and [_spec(p) for p in params] == captured.param_specs:
            _set_rng_state(rng_state)
            with torch.no_grad():
                replayed, underflow, *_ = captured.graph(*params, *inputs)
            after = _rng_state(params + arguments)
            changed = not bool(underflow) and not _close(replayed.item(), loss)
            _set_rng_state(after)
        if changed:
            warnings.warn(
                "pyro_tmc: this loss's step no longer matches its capture, with the same argument "
                "shapes (its structure or a value it reads changed: a Python branch or constant "
                "that is not an argument); the step is captured again. Steps between the change "
                "and this check ran the old step: pass what changes as an argument, or lower "
                "check_every.",
                RuntimeWarning,
                stacklevel=4,
            )
            del self._steps[key]
        return loss

    # -- capture and replay ---------------------------------------------------------

    def _capture(self, key, differentiable_loss, arguments, rebuild, eager_step, args, kwargs) -> float:
        recorder = StructureRecorder()
        times = PhaseTimes()
        start = time.perf_counter()
        # the parameters this step reads, and how many entries its products repair, from an
        # eager run (also this step's result), with what the key's earlier eager steps repaired
        with recorder, self._counting_repairs(key), times.phase(EAGER):
            loss = eager_step(args, kwargs)
        eager_seconds = time.perf_counter() - start
        repair_counts = self._repairs[key]
        names = recorder.param_names
        params = unconstrained_parameters(names)  # the store keeps these tensors through the capture
        devices = {t.device.type for t in [*arguments, *params]}
        try:
            program, unrolled, structure, buffers = capture_step(
                differentiable_loss,
                names,
                arguments,
                rebuild,
                repair_counts,
                roll_above=self.roll_above,
                batch_draws=batches_draws(self.batch_draws, self.mode, devices),
                roll_at_most=self.config.roll_at_most,
                times=times,
                record_graphs=self.config.record_graphs,
                # a 4-state chain's bmm, shifts and flags were half of an HMM's compiled step
                termwise_small_chains=self.mode == "inductor",
            )
        except GraphFallback as reason:
            self._steps[key] = CapturedStep(None, None, names, [], [])
            _warn_fallback(str(reason))
            return loss
        if structure != recorder.record:
            self._steps[key] = CapturedStep(None, None, names, [], [])
            _warn_fallback("the model's structure differs from one run to the next with the same arguments")
            return loss
        self.captures += 1
        self._say_if_not_rolled(key, program, recorder.markov_sites)
        eliminate_dead_code(program.graph)
        drop_replay_copies(program.graph)  # replayed without grad (:meth:`_replay`)
        program.recompile()
        specs = [_spec(p) for p in params]
        captured = CapturedStep(program, unrolled, names, specs, structure, [eager_seconds], times=times)
        captured.buffers, captured.buffer_specs = buffers, [_spec(b) for b in current_buffers(buffers)]
        if self.mode == "inductor" and not self._too_large(program):
            _write_code(program)
            captured.program = compiled_step_graph(
                program,
                self.config,
                self.compile_in_background,
                wrapper_apart=builds_wrapper_apart(program, self.config.wrapper_apart_mean_size),
            )
            captured.uncompiled = program
            captured.eager_seconds = None  # compiled: not timed against eager
        self._steps[key] = captured
        return loss

    def _say_if_not_rolled(self, key: tuple, program: torch.fx.GraphModule, markov_sites: list) -> None:
        """
        Warn, once per key, where a long step with a ``pyro.markov`` loop stays unrolled because its
        body changes with t (:func:`loop_not_rolled_warning`). A long step without a loop (a deep
        network) stays unrolled without a word, as rolling is only a loop's speed-up.
        """
        if NOT_ROLLED not in program.meta or key in self._said_not_rolled:
            return
        notice = loop_not_rolled_warning(markov_sites, program.meta[NOT_ROLLED])
        if notice is not None:
            self._said_not_rolled.add(key)
            what, why = notice
            warn_fallback(what, why, UNROLLED, stacklevel=5, limit=600)

    def _too_large(self, graph: torch.fx.GraphModule) -> bool:
        """Whether a graph has too many operations for inductor to compile in reasonable time (warns once)."""
        size = count_operations(graph)
        if self.max_inductor_nodes is None or size <= self.max_inductor_nodes:
            return False
        warnings.warn(
            f"pyro_tmc: the captured step has {size} tensor operations (after rolling its repeated "
            f"blocks), above max_inductor_nodes={self.max_inductor_nodes}: inductor would take minutes "
            "to compile it, so it is replayed uncompiled (or run eagerly, whichever is faster). "
            "pyro.contrib.funsor.vectorized_markov writes a long chain as a few stacked "
            "operations. To compile anyway, set loss.compile_config.max_inductor_nodes = None.",
            RuntimeWarning,
            stacklevel=5,
        )
        return True

    def _replay(self, key: tuple, captured: CapturedStep, arguments, eager_step, args, kwargs) -> float:
        params = [pyro.param(name).unconstrained() for name in captured.param_names]  # SVI sees them
        inputs = captured.inputs_after_params(arguments)
        if [_spec(p) for p in params] != captured.param_specs or inputs is None:
            self._steps.pop(next(k for k, v in self._steps.items() if v is captured))
            return eager_step(args, kwargs)
        rng_state = _rng_state(params + arguments)
        start = time.perf_counter()

        def run() -> tuple:
            # the graph holds the step's backward as operations: replayed, it needs no autograd (a
            # cond run under autograd would trace its branches again at every call)
            with torch.no_grad():
                return captured.program(*params, *inputs)

        try:
            if captured.attempts == 0:  # inductor compiles at the first replay: its seconds are the compile's
                with captured.times.phase(COMPILE):
                    loss, underflow, *grads = run()
            else:
                loss, underflow, *grads = run()
        except Exception as error:  # inductor compiles at the first replay: it may fail there
            if captured.uncompiled is None:
                raise
            warn_fallback("compile the captured step with inductor", error, UNCOMPILED, stacklevel=5)
            captured.program, captured.uncompiled = captured.uncompiled, None
            _set_rng_state(rng_state)
            loss, underflow, *grads = run()
        captured.attempts += 1
        if bool(underflow) or not torch.isfinite(loss):
            _set_rng_state(rng_state)  # the same draw, eagerly: products repaired, a bad site named
            with self._counting_repairs(key):  # a capture again is sized to this step too
                value = eager_step(args, kwargs)
            captured.redone += bool(underflow)
            # not timed against the eager step (:meth:`_settle`): a replay redone says how stiff the
            # draw was, not how fast a replay is, and a key mostly redone is captured again, sized
            # to its redone steps too. Judged by three redone replays, Fig. 4's 1,000-link chain
            # ran eagerly for good, at 4.5 times a replay's time
            self._give_up_if_mostly_redone(key, captured)
            return value
        self.replays += 1
        for param, grad in zip(params, grads):
            if self._outputs_reused:  # a CUDA graph's outputs are overwritten by its next replay
                grad = grad.clone()
            param.grad = grad if param.grad is None else param.grad + grad
        value = loss.item()
        if captured.eager_seconds is not None and self.choose_faster:
            self._settle(captured, time.perf_counter() - start)
        return value

    def _give_up_if_mostly_redone(self, key: tuple, captured: CapturedStep) -> None:
        """
        A key whose replays mostly underflow (a stiff chain) is captured once more, its
        repairs sized to the step then and to the key's earlier eager steps, the redone
        ones among them (the chain may have grown stiffer since the capture, or the one
        draw it was sized by was a lucky one); if that happens again, it runs eagerly:
        each step would be paid twice.
        """
        if captured.attempts < self.config.timed_replays + 1 or 2 * captured.redone <= captured.attempts:
            return
        if key not in self._refitted:
            self._refitted.add(key)
            del self._steps[key]  # the next step captures it again
        else:
            captured.program = None
            warnings.warn(
                f"pyro_tmc: {captured.redone} of {captured.attempts} replays of this loss's captured "
                "step had log-space products that underflowed (their exact repair runs eagerly), so "
                "it runs eagerly from now on. A chain whose steps are much narrower than its "
                "particles' spread does this; more particles or a better guide make it rarer.",
                RuntimeWarning,
                stacklevel=5,
            )

    def _settle(self, captured: CapturedStep, seconds: float) -> None:
        """
        Time an uncompiled replay against the eager step: replaying decomposed operations
        one by one, backward included, is slower than eager for a model whose step is
        tensor work with little Python (a long chain of stacked densities). After
        ``timed_replays`` replays, alternating with eager steps, the key keeps the
        faster of the two (by their fastest times, which noise inflates least); a replay
        that takes at most ``keep_replay_below`` of the fastest eager step is kept as soon
        as it is timed. A replay redone eagerly is not timed (:meth:`_give_up_if_mostly_redone`
        deals with those), nor is the first, unless it is fast enough to keep: it writes the
        graph's Python code (a lazy graph's, at its first call) and allocates its buffers for the
        first time, which took the 1,000-link chain's first replay from 0.09 to 0.13-0.19 s, over
        half its eager step, and cost a timed eager step of 0.4-1.1 s among its first eight.
        """
        if seconds <= self.config.keep_replay_below * min(captured.eager_seconds):
            captured.eager_seconds = None  # clearly faster: kept now (CompileConfig.keep_replay_below)
            return
        if captured.attempts == 1:
            return
        captured.replay_seconds.append(seconds)
        if len(captured.replay_seconds) < self.config.timed_replays:
            return
        if min(captured.replay_seconds) > min(captured.eager_seconds):
            captured.program = None  # eager from now on; checks and read-outs are unchanged
        captured.eager_seconds = None


def build_programs(
    mode: str, options, scope: str, check_every: Optional[int]
) -> tuple[EstimateProgram, Optional[StepProgram]]:
    """
    A loss's programs for ``compile=mode`` (what :func:`pyro_tmc.infer.base.compiled_programs`
    returns): its estimate program and, with ``scope="step"``, its step program, which read
    one :class:`~pyro_tmc.compile.config.CompileConfig`, made from ``compile_options``.
    """
    config = compile_config(options, check_every)
    return EstimateProgram(mode, config), StepProgram(mode, config) if scope == "step" else None


def builds_wrapper_apart(graph: torch.fx.GraphModule, mean_size: int) -> bool:
    """
    Whether inductor builds a step's C++ wrapper apart from its kernels, at -O1
    (``CompileConfig.wrapper_apart_settings``): for a step rolled from a long loop
    whose operations average at least ``mean_size`` elements, so that the
    wrapper's dearer calls are lost in the kernels' work. Mean output sizes: Fig. 4's
    1,000-link chain 122,530 (built apart, its replay is unchanged); its 100-link chain
    16,929; the HMM of 200 steps 5,057 and the toy, not rolled, whose replays built apart
    are slower (docs/performance.md, "The defaults, and why").
    """
    if ROLLED_FROM not in graph.meta:
        return False
    sizes = [
        node.meta["val"].numel()
        for node in graph.graph.nodes
        if node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor)
    ]
    return bool(sizes) and sum(sizes) >= mean_size * len(sizes)


def batches_draws(setting: Optional[bool], mode: str, devices: set[str]) -> bool:
    """
    Whether a rolled step batches its like random draws (``CompileConfig.batch_draws``).
    By default (``None``) only a step that inductor compiles on CUDA does: CUDA draws a
    batch in other numbers than one by one, so each of a chain's N draws would stay an
    operation of its own, N kernels a replay and N more operations for inductor (Fig. 4's
    1,000-link chain: 3,339 against 2,340, which crossed ``max_inductor_nodes`` on an
    H200). Elsewhere the rolled step keeps the eager step's numbers (on the CPU, like
    draws of a multiple of 16 numbers are batched exactly anyway).
    """
    if setting is not None:
        return setting
    return mode == "inductor" and "cuda" in devices


def _estimating_eagerly(eager_step: Callable) -> Callable:
    """``eager_step`` with the estimate computed eagerly, not by the loss's estimate program."""

    def step(args, kwargs):
        with estimates_eagerly():
            return eager_step(args, kwargs)

    return step


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """
    Python's cyclic garbage collector paused, as it was before on exit: a capture allocates
    hundreds of thousands of graph nodes, fake tensors and proxies that live until it ends,
    and each full collection walks all of them (about a tenth of a long chain's capture, its
    eager step included).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _close(a: float, b: float, rtol: float = 1e-4) -> bool:
    return abs(a - b) <= rtol * max(1.0, abs(a), abs(b))


def _identity(function: Callable) -> tuple:
    """A function's identity: a bound method's is its function's and its object's (new each access)."""
    return id(getattr(function, "__func__", function)), id(getattr(function, "__self__", None))


def _rng_state(tensors: list[torch.Tensor]) -> tuple:
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    return torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in devices}


def _set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for device, device_state in cuda.items():
        torch.cuda.set_rng_state(device_state, device)


def _warn_fallback(reason: str) -> None:
    warn_fallback("capture this loss's step into a graph", reason, stacklevel=5)
