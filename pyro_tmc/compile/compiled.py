"""A draw's estimate as one cached tensor program, optionally fused by ``torch.compile``.

Building log P_TMC from two traces is Python work repeated identically at every
step of one model: reading each site, choosing its density, packing dims, fusing
small factors into large ones, planning the contraction. Only the tensors change.
So, per *plan* (everything about a draw except its tensor values):

1. the traces are flattened into the tensors they hold (distribution parameters,
   values, masks, ancestors, sources) and a hashable key for the rest
   (:func:`flatten_draw`);
2. on the first draw with that key, the eager code (:func:`pyro_tmc.estimate.factors.compute_log_factors`
   and :func:`pyro_tmc.estimate.factors.contract_estimate`, unchanged) is traced by
   ``make_fx`` into a graph of tensor operations, with fake tensors, so that any
   branch on a tensor's value fails loudly instead of being baked in;
3. that graph is replayed on each later draw's tensors, eagerly (``"graph"``: no
   Python between the operations) or compiled by ``torch.compile``
   (``"inductor"``: each large factor's log density fused with its reduction,
   as a hand-written compiled step would be).

A draw the tracer cannot handle (a branch on tensor values, a tensor that is not
among the inputs, a custom ``autograd.Function``, a memory budget) falls back to
the eager path, with one warning per plan. A shape change is a new key, hence a
new graph: the graph is traced again only when the plan changes, and at most
``max_plans`` times per loss (:class:`~pyro_tmc.compile.config.CompileConfig`). A draw in
which a log-space product underflowed (the graph flags it:
:func:`pyro_tmc.ops.capture.deferred_underflow_checks`) is computed again eagerly, where
the product is repaired.

What the key must hold, because the graph bakes it in: every Python value the
factor code reads (distribution fields, transforms' fields, ``infer`` entries,
scales, plate frames, the scale plan), each tensor's shape, strides, dtype,
device and ``requires_grad``, the names of the attributes set on it, and the
default dtype. An object the walker does not know is keyed by its identity, so a
new one is a new plan rather than a stale constant.
"""

import contextlib
import dataclasses
import functools
import itertools
import warnings
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
from torch.distributions import Distribution
from torch.distributions.transforms import Transform

from pyro.poutine import Trace

from pyro_tmc._torch import (
    DYNAMO_TENSOR_MARK,
    FakeTensorMode,
    InverseTransform,
    TracingContext,
    make_fx,
    tracing,
)
from pyro_tmc.compile.background_compile import BackgroundCompile
from pyro_tmc.compile.config import CompileConfig
from pyro_tmc.compile.fallback import warn_fallback
from pyro_tmc.compile.flatten import Flattener, fill
from pyro_tmc.compile.forward_trace import custom_backward
from pyro_tmc.estimate.checks import validate_samples
from pyro_tmc.estimate.evaluation import EvaluationPlan
from pyro_tmc.estimate.factors import compute_log_factors, contract_estimate
from pyro_tmc.estimate.scales import ScalePlan
from pyro_tmc.ops.capture import any_flag, capturing, current, deferred_underflow_checks
from pyro_tmc.poutine.proposals import ProposalStrategy

MODES = (None, "graph", "inductor")


def _fields_of(obj) -> Optional[dict]:
    """
    The fields a draw's object is copied by (:class:`~pyro_tmc.compile.flatten.Flattener`):
    of distributions, their transforms, proposal strategies and dataclasses (a site's
    ParticleDraw, the scale plan), those in the plan (:func:`_in_plan`); ``None`` for any
    other object, kept as it is (a tensor it holds is not an input: tracing with fake
    tensors then fails, and the eager path runs).
    """
    if isinstance(obj, (Distribution, Transform, ProposalStrategy)) or dataclasses.is_dataclass(obj):
        return {k: v for k, v in vars(obj).items() if _in_plan(obj, k)}
    return None


#: fields of those objects that are not part of the plan: validation (a graph never
#: validates, see checks.validate_samples), and a transform's reference to its inverse
#: (rebuilt on demand)
_NOT_PLAN = frozenset(["_validate_args", "_inv"])


def _in_plan(obj, field: str) -> bool:
    """
    Whether a copied object's field is part of the plan. An inverse transform (``t.inv``)
    is the exception to :data:`_NOT_PLAN`: its ``_inv`` is the transform it inverts, all
    it holds. A transform's ``_inv`` is otherwise a weak reference to its inverse, or (a
    composed transform's) the inverse itself, which refers back to it.
    """
    return field not in _NOT_PLAN or (field == "_inv" and isinstance(obj, InverseTransform))


def _rebuilt(kind: type, fields: dict):
    """An object copied by :func:`_fields_of`, around its filled fields."""
    copy = object.__new__(kind)
    copy.__dict__.update(fields)
    if isinstance(copy, Transform) and not _in_plan(copy, "_inv"):
        copy._inv = None
    if isinstance(copy, Distribution):
        # a support check branches on values: it runs eagerly instead (checks.validate_samples)
        copy._validate_args = False
    return copy


def _tensor_key(tensor: torch.Tensor) -> tuple:
    """What a traced estimate bakes in of an input tensor, and the attributes set on it."""
    spec = ("T", tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device, tensor.requires_grad)
    return spec, tuple(sorted(_tensor_attributes(tensor)))  # _pyro_dims and the like


def _tensor_attributes(tensor: torch.Tensor) -> dict:
    """
    What Python code has set on a tensor (``_pyro_dims``, ``_pyro_categorical_support``),
    less TorchDynamo's own marks: it tags the tensors it compiled against, which
    would change the key after the first compile.
    """
    return {k: v for k, v in getattr(tensor, "__dict__", {}).items() if not k.startswith(DYNAMO_TENSOR_MARK)}


@dataclasses.dataclass
class FlatDraw:
    """A draw's tensors and a template to rebuild its traces around other tensors."""

    tensors: list[torch.Tensor]
    template: tuple[dict, dict, Any]
    #: the sources (site name -> zero tensor) with their tensors as leaves
    source_template: dict
    key: tuple
    tensor_attributes: list[dict]
    #: ``(site name, object)`` for each object the flattening kept as it is (:class:`Flattener`)
    kept: list[tuple[Optional[str], Any]] = dataclasses.field(default_factory=list)

    def traces(self, inputs: list[torch.Tensor]) -> tuple[Trace, Trace, ScalePlan]:
        """The draw's (model, guide) traces (their sample sites) and scale plan, around ``inputs``."""
        model_nodes, guide_nodes, scales = fill(self.template, inputs)
        return _trace_of(model_nodes), _trace_of(guide_nodes), scales


def _trace_of(nodes: dict) -> Trace:
    """A trace holding ``nodes`` (no edges: the factor code reads sites only)."""
    trace = Trace()
    trace.nodes.update(nodes)
    return trace


def _sample_sites(flattener: Flattener, trace) -> dict:
    """
    Every field of each sample site: what the factor code reads of it is then in the key,
    whatever it reads, with no list of fields to keep in step with it.
    """
    sites = {}
    for name, site in trace.nodes.items():
        if site["type"] == "sample":
            flattener.site = name
            sites[name] = flattener.flatten(site)
    flattener.site = None
    return sites


def flatten_draw(draw, sources: Optional[dict[str, torch.Tensor]], detach_guide_proposals: bool) -> FlatDraw:
    """Flatten a draw's traces (their sample sites and scale plan) into tensors and a key."""
    flattener = Flattener(_tensor_key, _fields_of, _rebuilt)
    template = (
        _sample_sites(flattener, draw.model_trace),
        _sample_sites(flattener, draw.guide_trace),
        flattener.flatten(draw.plan.scales),
    )
    source_template = flattener.flatten(dict(sources or {}))
    flattener.key.append(("detach", detach_guide_proposals, torch.get_default_dtype()))
    attributes = [_tensor_attributes(t) for t in flattener.tensors]
    return FlatDraw(
        flattener.tensors, template, source_template, tuple(flattener.key), attributes, flattener.kept
    )


class GraphFallback(Exception):
    """The draw cannot be traced into a graph; the eager path is used."""


def _estimate_function(flat: FlatDraw, detach_guide_proposals: bool) -> Callable:
    def estimate(*inputs: torch.Tensor) -> torch.Tensor:
        inputs = list(inputs)
        for tensor, attributes in zip(inputs, flat.tensor_attributes):
            for name, value in attributes.items():
                setattr(tensor, name, value)
        model_trace, guide_trace, scales = flat.traces(inputs)
        sources = fill(flat.source_template, inputs)
        # no branch on values while tracing: each log-space product flags its underflow instead
        with deferred_underflow_checks() as flags:
            # whole factors: a draw with sliced factors runs eagerly (TMCDraw.log_estimate)
            plan = EvaluationPlan(scales)
            factors = compute_log_factors(model_trace, guide_trace, plan, sources, detach_guide_proposals)
            log_estimate = contract_estimate(factors, scales)
        return log_estimate, any_flag(flags, log_estimate)

    return estimate


def trace_graph(flat: FlatDraw, detach_guide_proposals: bool) -> torch.fx.GraphModule:
    """
    The eager estimate traced into a graph of tensor operations, with fake tensors.
    The graph returns ``(estimate, underflow)``: ``underflow`` (a boolean scalar)
    is set where a log-space product lost precision
    (:func:`pyro_tmc.ops.capture.deferred_underflow_checks`), and the estimate must
    then be computed eagerly.

    :raises GraphFallback: where tracing fails, or the graph holds a tensor that is
        not one of its inputs (it would be the first draw's forever).
    """
    function = _estimate_function(flat, detach_guide_proposals)
    try:
        check_no_custom_backward(function, flat.tensors)
        graph = make_fx(function, tracing_mode="fake")(*flat.tensors)
    except GraphFallback:
        raise
    except Exception as error:  # any failure, the rebuilt draw's eager run included: the eager path is right
        raise GraphFallback(_trace_failure(error, flat)) from error
    constants = [node.target for node in graph.graph.nodes if node.op == "get_attr"]
    if constants:
        raise GraphFallback(
            f"the estimate reads tensors that are not the draw's inputs ({', '.join(constants)}); "
            "a tensor captured by a distribution or closure would be frozen at its first value"
        )
    return graph


def _trace_failure(error: Exception, flat: FlatDraw) -> str:
    """Why tracing the estimate failed: in the user's terms where it read a tensor that is not an input."""
    message = f"{type(error).__name__}: {error}"
    if "convert all Tensors to FakeTensors" not in message:
        return message
    holders = [
        f"{type(obj).__name__} at site {site!r}" if site else type(obj).__name__
        for site, obj in flat.kept
        if _holds_tensors(obj)
    ]
    held_by = f" ({', '.join(dict.fromkeys(holders))})" if holders else ""
    return (
        "the estimate reads a tensor that is not one of the draw's: a tensor held by an object that a "
        f"distribution or transform refers to{held_by}, such as a normalizing flow's nn.Module, or by a "
        f"closure or global. The estimate is computed eagerly. Tracer: {message}"
    )


def _holds_tensors(obj) -> bool:
    """Whether ``obj`` is an nn.Module with parameters or buffers, or holds a tensor as an attribute."""
    if isinstance(obj, torch.nn.Module):
        return any(True for _ in itertools.chain(obj.parameters(), obj.buffers()))
    return any(isinstance(value, torch.Tensor) for value in getattr(obj, "__dict__", {}).values())


def check_no_custom_backward(function: Callable, tensors: list[torch.Tensor]) -> None:
    """
    Run the estimate once eagerly on detached copies of its inputs and look for a
    custom ``torch.autograd.Function`` in its backward graph (a user's
    distribution may use one): a graph of tensor operations keeps its forward but
    not its backward, so gradients would silently change.

    :raises GraphFallback: naming the Function.
    """
    inputs = [t.detach().requires_grad_(t.is_floating_point() or t.is_complex()) for t in tensors]
    with torch.enable_grad():
        output, _ = function(*inputs)
    name = custom_backward(output)
    if name is not None:
        raise GraphFallback(
            f"the estimate uses the custom autograd.Function {name}, "
            "whose backward a graph of tensor operations would drop"
        )


def estimates_eagerly() -> contextlib.AbstractContextManager:
    """
    Within this context (the capture context's ``eager_estimates``),
    :meth:`EstimateProgram.log_estimate` neither builds nor runs a program: the estimate is
    computed eagerly. For the few eager steps of a captured whole step
    (:mod:`pyro_tmc.compile.captured_step`), which would otherwise trace and compile an
    estimate program that the replays never use.
    """
    return capturing(eager_estimates=True)


class EstimateProgram:
    """
    The cache of traced (and optionally compiled) estimate graphs of one loss,
    keyed by plan.

    :param str mode: ``"graph"`` (replay the traced operations eagerly) or
        ``"inductor"`` (``torch.compile`` them: fused kernels).
    :param CompileConfig config: the loss's settings (``torch.compile``'s keywords, ``max_plans``).
    """

    def __init__(self, mode: str, config: CompileConfig) -> None:
        if mode not in MODES[1:]:
            raise ValueError(f"compile must be one of {MODES}, got {mode!r}")
        if config.torch_compile and mode != "inductor":
            raise ValueError("compile_options are torch.compile's: they need compile='inductor'")
        self.mode = mode
        self.config = config
        self._programs: dict[tuple, Optional[Callable]] = {}
        self.traces = 0  # how many graphs were traced (a test reads it)
        self._warned_plans = False

    def __getstate__(self) -> dict:
        # traced graphs and compiled code do not pickle (a loss sent to worker processes):
        # a copy starts with an empty cache and traces its own
        state = dict(self.__dict__)
        state["_programs"] = {}
        return state

    def log_estimate(
        self, draw, sources: Optional[dict[str, torch.Tensor]], detach_guide_proposals: bool
    ) -> Optional[torch.Tensor]:
        """``log P_TMC`` of the draw by its plan's program, or ``None`` where the eager path must run."""
        if current().eager_estimates:
            return None
        validate_samples(draw.model_trace, draw.guide_trace)
        flat = flatten_draw(draw, sources, detach_guide_proposals)
        program = self._programs.get(flat.key, _MISSING)
        if program is _MISSING:
            if len(self._programs) >= self.config.max_plans:
                self._warn_too_many_plans()
                return None
            program = self._build(flat, detach_guide_proposals)
            self._programs[flat.key] = program
        if program is None:
            return None
        try:
            estimate, underflow = program(*flat.tensors)
        except Exception as error:
            self._programs[flat.key] = None
            _warn_fallback(f"{type(error).__name__}: {error}")
            return None
        # a product underflowed in this draw (a graph cannot repair it): the eager path does
        return None if underflow else estimate

    def _warn_too_many_plans(self) -> None:
        if not self._warned_plans:
            self._warned_plans = True
            warnings.warn(
                f"pyro_tmc traced {self.config.max_plans} different plans of this model's estimate (its "
                "structure, shapes or the objects its distributions hold change from step to "
                "step); new ones now run eagerly. Keep shapes fixed (e.g. drop_last=True) to "
                "benefit from compile=.",
                RuntimeWarning,
                stacklevel=4,
            )

    def _build(self, flat: FlatDraw, detach_guide_proposals: bool) -> Optional[Callable]:
        try:
            graph = trace_graph(flat, detach_guide_proposals)
        except GraphFallback as reason:
            _warn_fallback(str(reason))
            return None
        self.traces += 1
        if self.mode == "inductor":
            return compiled_keeping_validation(_for_inductor(graph, self.config), self.config)
        return graph


_MISSING = object()


def compile_keywords(config: CompileConfig) -> dict:
    """
    The keyword arguments for ``torch.compile`` given a loss's ``config.torch_compile``:
    static shapes (a new shape is a new capture) and :func:`inductor_settings`,
    unless those keywords say otherwise. ``torch.compile`` takes a ``mode`` or
    ``options``, not both, so a mode goes in as the settings it stands for
    (``torch._inductor.list_mode_options``). Another backend gets the keywords as given.
    """
    keywords = {"dynamic": False, **config.torch_compile}
    if keywords.get("backend", "inductor") != "inductor":
        return keywords
    mode = keywords.pop("mode", None)
    from_mode = {}
    if mode is not None:
        from pyro_tmc._torch import list_mode_options  # imported only when asked: inductor is heavy

        from_mode = list_mode_options(mode)
    keywords["options"] = {**inductor_settings(config), **from_mode, **(keywords.get("options") or {})}
    return keywords


def inductor_settings(config: Optional[CompileConfig] = None) -> dict:
    """
    ``config.inductor_settings`` (the defaults' without one) that this torch's inductor has (an
    older one refuses an unknown key), and :class:`~pyro_tmc.compile.bmm_layout.BatchMajorBmmInputs`
    as its post-grad pass.
    """
    settings = _available((config or CompileConfig()).inductor_settings)
    try:
        from pyro_tmc.compile.bmm_layout import BATCH_MAJOR_BMM_INPUTS
    except ImportError:  # a torch without custom graph passes: inductor as it is
        return settings
    settings["post_grad_custom_post_pass"] = BATCH_MAJOR_BMM_INPUTS
    return settings


def _available(settings: dict) -> dict:
    """The ``settings`` that this torch's inductor has (an older one refuses an unknown key)."""
    from pyro_tmc._torch import inductor_config  # imported only when asked: inductor is heavy

    return {key: value for key, value in settings.items() if hasattr(inductor_config, key)}


def uses_cuda_graphs(config: CompileConfig) -> bool:
    """Whether ``torch.compile`` with ``config.torch_compile`` replays CUDA graphs."""
    settings = compile_keywords(config).get("options") or {}
    return bool(settings.get("triton.cudagraphs", False))


def compiled_step_graph(
    graph: torch.fx.GraphModule, config: CompileConfig, background: bool = False, wrapper_apart: bool = False
) -> Callable:
    """
    Inductor's compile of a captured step's graph, made from the graph itself
    (``torch._inductor.compile``) at its first call, with that call's inputs as
    examples; with ``background``, in a child process, the graph replayed uncompiled
    until the compile is done (:class:`~pyro_tmc.compile.background_compile.BackgroundCompile`).
    Dynamo is left out: it would trace the graph's code once more, and its
    guarded call adds to every replay (docs/performance.md, "The defaults, and
    why"). The graph holds its own
    backward, so it is compiled for inference; it must be called without grad.
    CUDA graphs (a ``mode`` such as ``"reduce-overhead"``) and another backend
    go through ``torch.compile``. With ``wrapper_apart``, the settings also have
    ``config.wrapper_apart_settings``.
    """
    graph = _for_inductor(graph, config)
    keywords = compile_keywords(config)
    settings = keywords.get("options") or {}
    if settings.get("fallback_random", background):  # a background compile keeps torch's draws by default
        with_torchs_own_bernoulli(graph)
    if keywords.get("backend", "inductor") != "inductor" or settings.get("triton.cudagraphs", False):
        return compiled_keeping_validation(graph, config)
    if wrapper_apart:
        settings = {**_available(config.wrapper_apart_settings), **settings}
    compile_graph = functools.partial(compile_captured_graph, cpu_settings=config.cpu_step_settings)
    if background:
        return BackgroundCompile(graph, settings, compile_graph)
    compiled: Optional[Callable] = None

    def run(*inputs: torch.Tensor):
        nonlocal compiled
        # contiguous: the compiled code assumes its example inputs' strides, and no guard
        # recompiles it for others (a key holds shapes, not strides); a no-op for the usual inputs
        inputs = tuple(t.contiguous() for t in inputs)
        if compiled is None:
            compiled = compile_graph(graph, [t.detach() for t in inputs], settings)
        return compiled(*inputs)

    return run


#: operations that return a copy of their first operand with some entries written: inductor
#: (torch 2.13) writes them through a broadcast operand's layout, so that every row of an
#: ``expand`` shares one set of entries (``index_put`` on ``zeros(4).expand(2, 4)`` put row 0's
#: values into row 1 too, and ``accumulate=True`` added them up)
_WRITES_INTO_A_COPY = (
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_add.default,
    torch.ops.aten.index_copy.default,
)


def _for_inductor(graph: torch.fx.GraphModule, config: CompileConfig) -> torch.fx.GraphModule:
    """The graph as inductor must see it (:func:`with_written_destinations_materialized`); else as it is."""
    if compile_keywords(config).get("backend", "inductor") != "inductor":
        return graph
    return with_written_destinations_materialized(graph)


def with_written_destinations_materialized(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """
    The graph with a contiguous ``clone`` before each of :data:`_WRITES_INTO_A_COPY` whose
    first operand is broadcast (a stride of 0 along a dim of more than one entry): what the
    eager operation does anyway (it copies that operand before writing), made explicit so
    that inductor does not write through the broadcast. Loop rolling makes such operands:
    a ``zeros`` shared by every step of a loop is expanded along the stacked dim, and the
    gradients scattered into it by ``index_put`` (Fig. 4-like chains under ``TMC_RWS``:
    a parameter's gradient came out doubled in places). Other graphs come back as they are.
    """
    changed = False
    for node in list(graph.graph.nodes):
        if node.op != "call_function" or node.target not in _WRITES_INTO_A_COPY:
            continue
        destination = node.args[0]
        value = destination.meta.get("val") if isinstance(destination, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or not _broadcast(value):
            continue
        with graph.graph.inserting_before(node):
            copy = graph.graph.call_function(
                torch.ops.aten.clone.default, (destination,), {"memory_format": torch.contiguous_format}
            )
        copy.meta["val"] = value.clone(memory_format=torch.contiguous_format)
        node.replace_input_with(destination, copy)
        changed = True
    if changed:
        graph.recompile()
    return graph


def with_torchs_own_bernoulli(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """
    The graph (changed in place) with each ``bernoulli(p)`` written as
    ``empty_like(p).bernoulli_(p)``: what the first does eagerly, the same numbers.
    Inductor decomposes the first form into ``rand(float32) < p`` even under
    ``fallback_random`` (torch 2.13, ``torch._decomp``'s ``bernoulli``), and calls torch's
    own kernel for the second (through a C++ shim, so ``cpp_wrapper`` calls it directly).
    Eager ``bernoulli`` of float64 probabilities draws other uniforms, so a captured
    step's Bernoulli draws differed from the eager step's from the same random state,
    where ``fallback_random`` promises the same numbers (found by Pyro's plate tests,
    which run in float64, under ``tools/pyro_tests_shadow.py``).
    """
    aten = torch.ops.aten
    changed = False
    for node in list(graph.graph.nodes):
        if node.op != "call_function" or node.target is not aten.bernoulli.default:
            continue
        (probs,) = node.args
        with graph.graph.inserting_before(node):
            destination = graph.graph.call_function(aten.empty_like.default, (probs,))
            draw = graph.graph.call_function(aten.bernoulli_.Tensor, (destination, probs), dict(node.kwargs))
        if "val" in probs.meta:
            destination.meta["val"] = torch.empty_like(probs.meta["val"])
        draw.meta = dict(node.meta)
        node.replace_all_uses_with(draw)
        graph.graph.erase_node(node)
        changed = True
    if changed:
        graph.recompile()
    return graph


def _broadcast(tensor: torch.Tensor) -> bool:
    return any(stride == 0 and size > 1 for size, stride in zip(tensor.shape, tensor.stride()))


def compile_captured_graph(
    graph: torch.fx.GraphModule, examples: list[torch.Tensor], settings: dict, cpu_settings: dict
) -> Callable:
    """
    ``torch._inductor.compile`` of a captured step's graph, in a :func:`_cacheable_compile`
    context. For CPU inputs, unless ``settings`` name them, ``cpu_settings``
    (``CompileConfig.cpu_step_settings``) are tried first and, should that compile fail,
    dropped: the default never compiles less than inductor's own settings do.
    """
    on_cpu = all(example.device.type == "cpu" for example in examples)
    if on_cpu and not cpu_settings.keys() & settings.keys():
        try:
            return _inductor_compile(graph, examples, {**cpu_settings, **settings})
        except Exception:  # e.g. an operation the C++ wrapper cannot call: inductor's defaults below
            pass
    return _inductor_compile(graph, examples, settings)


def _inductor_compile(graph: torch.fx.GraphModule, examples: list[torch.Tensor], settings: dict) -> Callable:
    from pyro_tmc._torch import inductor_compile  # imported only when used

    with _cacheable_compile():
        return inductor_compile(graph, examples, options=settings)


@contextlib.contextmanager
def _cacheable_compile() -> Iterator[None]:
    """
    A tracing context with a shape environment, as ``torch.compile`` gives inductor: without
    one, inductor's FX graph cache bypasses every graph (``"No shape env"``), so a later
    process compiled a captured step afresh, with only g++'s objects reused. Shapes are
    static: the environment holds no symbol.
    """
    from pyro_tmc._torch import ShapeEnv

    with tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv()))):
        yield


def compiled_keeping_validation(program: Callable, config: CompileConfig) -> Callable:
    """
    ``torch.compile`` of ``program`` (with :func:`compile_keywords` of ``config``),
    made and run so that it leaves torch.distributions' default validation as it
    found it: TorchDynamo switches it off for the whole process
    (``torch/_dynamo/eval_frame.py``) when ``torch.compile`` is first called, which
    would silently turn off the user's ``pyro.enable_validation``.
    """
    from pyro_tmc._torch import functorch_config  # loaded by torch.compile anyway

    default = Distribution._validate_args
    try:
        compiled = torch.compile(program, **compile_keywords(config))
    finally:
        Distribution.set_default_validate_args(default)

    def run(*inputs: torch.Tensor) -> torch.Tensor:
        default = Distribution._validate_args
        try:
            # compiled (lazily, at a call) with no donated buffers: a backward that reuses its
            # saved tensors' memory refuses retain_graph=True, which STL's and DReGs' inner
            # gradient of the estimate passes, so their steps raised (compile_scope="estimate")
            with functorch_config.patch(donated_buffer=False):
                return compiled(*inputs)
        finally:
            Distribution.set_default_validate_args(default)

    return run


def _warn_fallback(reason: str) -> None:
    warn_fallback("trace this model's estimate into a graph", reason, stacklevel=4)
