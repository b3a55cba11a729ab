"""Graphs recorded as the step runs on real tensors: what ``make_fx`` traces, at a fraction of its cost.

``make_fx`` traces each aten operation through a proxy and a fake tensor: about 1 ms per
operation on a loaded CPU (a profile of the 200-step HMM's forward trace: 40% in the fake
tensors' dispatch and cache, 35% in proxies, node metadata and argument wrapping; the step's own
Python and pyro_tmc's grad-mode marks, 5%). A ``pyro.markov`` loop of ``T`` steps is ``T``
copies of its body, so its forward took 5-20 s to trace at T=200-1000, where the eager step
takes 0.1-0.5 s; the backward and the rolled step, each about 1,200 operations whatever ``T``,
took 1-2 s more each. :class:`OperationRecorder` is a dispatch mode that runs each operation on
the real tensors and appends one node per operation to an FX graph: the aten operations, in
their order, that ``make_fx`` records (both see them below autograd and below ``vmap``), with
the grad mode of each node marked (:data:`~pyro_tmc.compile.forward_trace.NO_GRAD`) and a
value of its output's shape (``meta["val"]``), as loop rolling reads them.

Real tensors can do what fake ones cannot, so a recording gives way to ``make_fx`` (which then
traces the step, or says why it cannot be captured) wherever the two could differ:

- a tensor's value read into Python (``.item()``, ``bool``, ``tolist``, ``numpy``): traced, it
  would be a symbol or an error; recorded, a constant baked into the graph;
- a tensor that no recorded operation made and that is neither an input nor one of the given
  constants (a closure's data tensor, ``.data``): ``make_fx`` refuses it, or keeps it as a constant;
- a higher-order operator (``torch.cond``), a sparse or other unusual tensor, an operation
  that returns a Python number.

A recording runs on copies of the inputs and from a saved random state, restored after: the
eager state (parameters, arguments, modules' buffers, the generator) is as a trace leaves it.
Its graph is then replayed once, on fresh copies and from the same random state, and must give
the recorded outputs (:func:`record`): a recording that lost an operation or an alias is not used.
"""

import logging
import operator
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch.fx import Graph, Node, map_arg
from torch.overrides import TorchFunctionMode

from pyro_tmc._torch import (
    HigherOrderOperator,
    LazyGraphModule,
    UncompiledDispatchMode,
    original_view_tracking,
)
from pyro_tmc.compile.forward_trace import HOOK_REGISTRATIONS, NO_GRAD, HookWatch

aten = torch.ops.aten

#: operations that read a tensor's value into Python
_VALUE_READS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}

#: tensor methods that read values without an aten operation (a function mode sees them)
_VALUE_READ_METHODS = {
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__array__,
    torch.Tensor.data_ptr,
    torch.Tensor.untyped_storage,
    torch.Tensor.storage,
    torch.Tensor.__reduce_ex__,
}

#: what :class:`ValueReadWatch` looks for: a value read, or a hook's registration
_WATCHED_METHODS = _VALUE_READ_METHODS | set(HOOK_REGISTRATIONS)

#: what :meth:`OperationRecorder._nodes_in` looks into: a tensor, or a container that may hold one
_WALKED = (torch.Tensor, tuple, list, dict)

#: says, at DEBUG, why a step's forward was traced rather than recorded
_log = logging.getLogger(__name__)

#: relative tolerance of the check that the recorded graph replays the recorded outputs
REPLAY_RTOL = 1e-5


class Unrecordable(Exception):
    """The step does something whose recording could differ from its trace (see the module docstring)."""


class ValueReadWatch(TorchFunctionMode):
    """
    Refuses a tensor method that reads values into Python without an aten operation (``tolist``).

    :param HookWatch hooks: where a tensor hook's registration is noted, as a
        :class:`~pyro_tmc.compile.forward_trace.HookWatch` entered around the step would note it:
        one function mode for both, not two (each costs a Python call per torch function the step
        calls, about 65,000 in the 1,000-step HMM's forward).
    """

    def __init__(self, hooks: Optional[HookWatch] = None) -> None:
        super().__init__()
        self.hooks = hooks

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _WATCHED_METHODS:
            if func in _VALUE_READ_METHODS:
                raise Unrecordable(f"the step reads a tensor's values ({func.__name__})")
            if self.hooks is not None:
                self.hooks.hooked = True
        return func(*args, **(kwargs or {}))


class OperationRecorder(UncompiledDispatchMode):
    """
    Records each aten operation run under it, on real tensors, into :attr:`graph`.

    :param inputs: the step's inputs, in order: each is a placeholder of the graph.
    :param constants: other tensors the step may read: each is a constant of the graph.
    """

    supports_higher_order_operators = True  # cond reaches __torch_dispatch__, to be refused

    def __init__(self, inputs: Sequence[torch.Tensor], constants: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        self.graph = Graph()
        self.constants: dict[str, torch.Tensor] = {}
        #: id of a tensor -> the node that made it; every such tensor is held in :attr:`_held`, so
        #: no id is reused by another tensor while the recording lasts
        self._node_of: dict[int, Node] = {}
        self._held: list[torch.Tensor] = []
        self._values: dict[tuple, torch.Tensor] = {}
        if len({id(t) for t in inputs}) != len(inputs):
            raise Unrecordable("a tensor is passed twice among the step's inputs")
        for index, tensor in enumerate(inputs):
            node = self.graph.placeholder(f"input_{index}")
            self._track(tensor, node)
            node.meta["val"] = self._value_like(tensor)
        self._allowed = {id(t): t for t in constants}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            raise Unrecordable(f"the step runs the higher-order operator {func}")
        if func in _VALUE_READS:
            raise Unrecordable("the step reads a tensor's value")
        if func is aten.lift_fresh.default:  # torch.tensor(data): a constant, copied at each replay
            return self._record_constant(args[0])
        if func is aten.detach.default and not args[0].requires_grad and id(args[0]) in self._node_of:
            return self._same_node(args[0], func(*args, **kwargs))
        out = func(*args, **kwargs)
        node = self.graph.call_function(
            func, self._nodes_in(args), self._nodes_in(kwargs), name=func.overloadpacket.__name__
        )
        self._track_outputs(out, node, without_grad=not torch.is_grad_enabled())
        return out

    # -- nodes of tensors -------------------------------------------------------------------

    def _nodes_in(self, value: Any) -> Any:
        """``value`` with each tensor replaced by the node that made it (tuples, lists, dicts walked)."""
        if isinstance(value, torch.Tensor):
            node = self._node_of.get(id(value))
            if node is None:
                node = self._allowed_constant(value)
            return node
        # a list, not a generator, and no call per int or None (most arguments): a third of a
        # recording's own cost went to walking arguments
        if isinstance(value, (tuple, list)):
            return type(value)([self._nodes_in(v) if isinstance(v, _WALKED) else v for v in value])
        if isinstance(value, dict):
            return {k: self._nodes_in(v) if isinstance(v, _WALKED) else v for k, v in value.items()}
        return value

    def _allowed_constant(self, tensor: torch.Tensor) -> Node:
        """A get_attr node of one of the given constants (once each)."""
        if id(tensor) not in self._allowed:
            raise Unrecordable("the step reads a tensor that is neither an input nor made by the step")
        name = f"_tensor_constant{len(self.constants)}"
        self.constants[name] = tensor
        node = self.graph.get_attr(name)
        node.meta["val"] = self._value_like(tensor)
        self._track(tensor, node)
        return node

    def _track(self, tensor: torch.Tensor, node: Node) -> None:
        if tensor.layout is not torch.strided or tensor.is_quantized or tensor.is_nested:
            raise Unrecordable(f"the step makes a tensor of layout {tensor.layout}")
        self._node_of[id(tensor)] = node
        self._held.append(tensor)

    def _track_outputs(self, out: Any, node: Node, without_grad: bool) -> None:
        if without_grad:
            node.meta[NO_GRAD] = True
        if isinstance(out, torch.Tensor):
            self._track(out, node)
            node.meta["val"] = self._value_like(out)
            return
        if out is None:
            return
        if not isinstance(out, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in out):
            raise Unrecordable(f"the operation {node.target} returns {type(out).__name__}")
        node.meta["val"] = type(out)(self._value_like(t) for t in out)
        for index, tensor in enumerate(out):  # make_fx too gives every output its getitem
            item = self.graph.call_function(operator.getitem, (node, index))
            if without_grad:
                item.meta[NO_GRAD] = True
            item.meta["val"] = node.meta["val"][index]
            self._track(tensor, item)

    def _same_node(self, tensor: torch.Tensor, alias: torch.Tensor) -> torch.Tensor:
        """
        ``alias`` (a ``detach`` of a tensor that needs no gradient, a no-op) as ``tensor``'s own node.
        Real tensors get such detaches where fake ones do not (``torch.empty`` before ``normal_``
        in a ``Normal``'s draw): recorded, they would hide ``empty(...).normal_()`` from loop rolling,
        which turns that into one draw (:func:`~pyro_tmc.compile.loop_rolling.replace_fresh_fills`).
        """
        self._track(alias, self._node_of[id(tensor)])
        return alias

    def _record_constant(self, tensor: torch.Tensor) -> torch.Tensor:
        name = f"_tensor_constant{len(self.constants)}"
        self.constants[name] = tensor.detach().clone()
        attribute = self.graph.get_attr(name)
        attribute.meta["val"] = self._value_like(tensor)
        copy = self.graph.call_function(aten.lift_fresh_copy.default, (attribute,), name="lift_fresh_copy")
        self._track_outputs(tensor, copy, without_grad=not torch.is_grad_enabled())
        return tensor

    def _value_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """
        A tensor of ``tensor``'s shape, strides, dtype and device, never written: what loop
        rolling reads of a node's value (``make_fx`` gives a fake tensor). One per distinct
        signature (a loop's nodes share a few), so they hold little memory; not a fake tensor,
        whose first mode imports dynamo (seconds, and ``compile="graph"`` needs none of it).
        """
        key = (tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)
        value = self._values.get(key)
        if value is None:
            value = self._values[key] = torch.empty_strided(key[0], key[1], dtype=key[2], device=key[3])
        return value

    def module(self, outputs: Any) -> LazyGraphModule:
        """The graph, returning ``outputs`` (tensors of the recording, in tuples and lists)."""
        self.graph.output(self._nodes_in(outputs))
        root = torch.nn.Module()
        for name, tensor in self.constants.items():
            setattr(root, name, tensor)
        return LazyGraphModule(root, self.graph)


class Recording(NamedTuple):
    """What :func:`record` gives: the graph, or why it gave none (then trace with ``make_fx``)."""

    graph: Optional[LazyGraphModule]
    #: why no graph was recorded (``None`` where one was)
    refused: Optional[str] = None


def record(
    function: Callable,
    inputs: Sequence[torch.Tensor],
    num_params: int,
    rng: tuple[Callable, Callable],
    constants: Sequence[torch.Tensor] = (),
    hooks: Optional[HookWatch] = None,
) -> Recording:
    """
    The graph of ``function(*inputs)`` (a tuple of tensors) recorded on real tensors, or why
    not: it does something a recording could get wrong (see the module docstring).

    :param function: run once on copies of ``inputs``, the first ``num_params`` as leaves that
        require grad (the parameters).
    :param rng: ``(get_state, set_state)`` of the generators the function draws from: the
        recording and its check replay draw from the state before, which is restored after.
    :param constants: tensors the function may read that are neither inputs nor made by it (a
        traced graph's own constants, read by the runner of a rolled graph): each is a constant
        of the recorded graph.
    :param HookWatch hooks: notes whether the function registers a tensor hook (not entered: the
        recording's own function mode notes it; see :class:`ValueReadWatch`).
    """
    get_state, set_state = rng
    state = get_state()
    copies = _copies(inputs, num_params)
    try:
        recorder = OperationRecorder(copies, constants)
        with ValueReadWatch(hooks), recorder, original_view_tracking(True):
            outputs = tuple(function(*copies))
        graph = recorder.module(outputs)
        set_state(state)
        with torch.no_grad():  # on fresh copies: the function may have written into its inputs
            replayed = replay(graph, _copies(inputs, num_params))
        different = _first_different(replayed, outputs)
        if different is not None:
            return _refused(f"its replay gave another output {different} than the recording")
    except Exception as error:  # a recording that fails is no evidence: make_fx decides
        return _refused(f"{type(error).__name__}: {error}")
    finally:
        set_state(state)
    return Recording(graph)


def replay(module: torch.fx.GraphModule, inputs: Sequence[torch.Tensor]) -> Any:
    """
    Run a recorded graph's nodes in order on ``inputs``, as ``Interpreter(module).run`` does
    (a graph of placeholders, constants and function calls), at a third of its cost per node:
    no hooks, no current-node bookkeeping. A value is dropped after its last use, so a long
    graph holds no more than its run needs.
    """
    values: dict[Node, Any] = {}
    last_use = _last_uses(module.graph)
    inputs = iter(inputs)
    load = values.__getitem__
    for node in module.graph.nodes:
        if node.op == "placeholder":
            values[node] = next(inputs)
        elif node.op == "get_attr":
            values[node] = getattr(module, node.target)
        elif node.op == "call_function":
            args, kwargs = map_arg((node.args, node.kwargs), load)
            values[node] = node.target(*args, **kwargs)
        elif node.op == "output":
            return map_arg(node.args[0], load)
        else:
            raise ValueError(f"a recorded graph has no {node.op} nodes")
        for used in last_use.get(node, ()):
            del values[used]
    raise ValueError("the graph has no output")


def _last_uses(graph: Graph) -> dict[Node, list[Node]]:
    """Each node -> the nodes whose last reader it is (their values can go after it runs)."""
    last: dict[Node, Node] = {}
    for node in graph.nodes:
        for used in node.all_input_nodes:
            last[used] = node
    by_reader: dict[Node, list[Node]] = {}
    for used, reader in last.items():
        if reader.op != "output":
            by_reader.setdefault(reader, []).append(used)
    return by_reader


def _refused(reason: str) -> Recording:
    _log.debug("pyro_tmc: a graph is traced, not recorded: %s", reason)
    return Recording(None, reason)


def _copies(inputs: Sequence[torch.Tensor], num_params: int) -> list[torch.Tensor]:
    """Copies of the inputs, the first ``num_params`` leaves that require grad (the parameters)."""
    return [
        t.detach().clone().requires_grad_(t.requires_grad or i < num_params) for i, t in enumerate(inputs)
    ]


def _first_different(replayed: Any, recorded: tuple) -> Optional[int]:
    """The position of the first output that the replay does not reproduce (``None``: all alike)."""
    if not isinstance(replayed, (tuple, list)) or len(replayed) != len(recorded):
        return -1
    for index, (again, value) in enumerate(zip(replayed, recorded)):
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if (
                not isinstance(again, torch.Tensor)
                or again.shape != value.shape
                or again.dtype != value.dtype
            ):
                return index
            if not torch.allclose(again, value, rtol=REPLAY_RTOL, atol=0.0, equal_nan=True):
                return index
    return None
