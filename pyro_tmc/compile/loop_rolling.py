"""Loop rolling: a captured step's repeated operations, batched into one operation each.

A ``pyro.markov`` loop of ``N`` steps is traced (:mod:`pyro_tmc.compile.captured_step`) as
``N`` copies of the same block of operations: the guide's ``loc[i]`` read, its
draw, the model's density of step ``i``, and their backward. Replaying the graph
costs a Python call and a dispatch per operation, so a 1,000-step chain of about 40
operations per step is bound by the replay, and inductor cannot compile it in
reasonable time. This module rolls the copies back up, as a compiler rolls a
loop it had unrolled:

1. In-place writes are made functional where they start a tensor, and pinned
   in order elsewhere. ``make_fx`` writes ``randn`` as ``empty(...).normal_()``
   and a copy into a new tensor as ``empty(...).copy_(x)``: each becomes the
   draw or copy that returns a new tensor (:func:`replace_fresh_fills`). Any
   other write (into a slice of a buffer) pins the buffer, its views and its
   writes (:func:`mutation_order`): they run one by one, in their order, and
   every other operation may be reordered within its dependencies. The graph
   is not functionalized (``torch.func.functionalize``): that rewrites each
   write into a slice as a ``select_scatter`` / ``slice_scatter`` copy of the
   whole buffer, each depending on the one before, so ``N`` writes into an
   ``N``-row buffer would become a chain of ``N`` whole-buffer copies, no more
   batchable than the writes and ``N`` times their memory traffic.
2. A chain of additions of same-shape tensors (autograd accumulating a
   parameter's gradient over its ``N`` uses) becomes one ``sum`` of their stack.
3. Each operation gets a level: one more than its inputs' highest. Operations on
   one level do not depend on each other; those with the same target, the same
   non-tensor arguments and the same input shapes are one group, run as one
   operation by :func:`torch.vmap` over their stacked inputs. An input that is
   the output of a whole earlier group, in order, is that group's stacked output
   as it is: no stack and unbind in between. ``select`` and ``slice`` (and their
   backwards) at different indices become one indexing operation.
4. The groups, level by level, are traced again by ``make_fx`` into one flat
   graph.

Random draws keep their order, and are batched only where one draw of the stacked
arguments gives the numbers that the draws give one by one (:func:`_draws_exactly_at_once`),
unless ``batch_draws`` asks for it: a rolled step draws the same numbers as the
eager step from the same generator state. The rolled graph computes the same
values, up to the order of floating-point additions.

Reference: the rewrite is the horizontal batching of "Auto-vectorizing TensorFlow
graphs: jacobians, auto-batching and beyond" (Agarwal and Ganichev, 2019), here by
``torch.vmap``'s batching rules, over a traced graph rather than a program.
"""

import operator
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

from pyro_tmc._torch import (
    HigherOrderOperator,
    OpOverload,
    make_fx,
    schema_of,
    tree_flatten,
    tree_unflatten,
)
from pyro_tmc.compile.forward_trace import NO_GRAD, grad_mode_of, runs_without_grad

aten = torch.ops.aten

#: (target, argument positions whose ints may differ within a group)
_VARYING_INTS = {
    aten.select.int: (2,),
    aten.slice.Tensor: (2, 3),
    aten.select_backward.default: (3,),
    aten.slice_backward.default: (3, 4),
}

#: the indexing backwards among them: each writes a gradient into a zero buffer
_SCATTERS = (aten.select_backward.default, aten.slice_backward.default)

#: operations vmap has no batching rule for: batched, it loops over the members itself and prints
#: a warning on the user's terminal (a Gamma's or Dirichlet's reparameterised gradient), so they
#: run one by one
NO_BATCHING_RULE = {aten._standard_gamma_grad.default, aten._dirichlet_grad.default}

#: random draws that are elementwise in their tensor arguments: one call on the members' stacked
#: arguments draws each member's numbers independently (each call its own, from the same distribution)
ELEMENTWISE_DRAWS = {
    aten.normal_functional.default,
    aten.normal.Tensor_Tensor,
    aten.normal.Tensor_float,
    aten.normal.float_Tensor,
    aten.uniform.default,
    aten.bernoulli.default,
    aten.bernoulli.p,
    aten.rand_like.default,
    aten.randn_like.default,
    aten.exponential.default,
    aten.poisson.default,
    aten._standard_gamma.default,
    aten.binomial.default,
}

#: normal draws whose numbers, on the CPU generator, come out the same drawn one by one or at once
#: where each draw holds a multiple of 16 numbers: torch fills a normal tensor 16 numbers at a
#: time, in memory order (``normal_fill``), so one stacked draw continues where each would
NORMAL_DRAWS = {
    aten.normal_functional.default,
    aten.normal.Tensor_Tensor,
    aten.normal.Tensor_float,
    aten.normal.float_Tensor,
    aten.randn_like.default,
}

#: a chain of additions shorter than this is left as it is
MIN_SUM_CHAIN = 3

#: a ``stack`` or ``cat`` of more tensors than this is not batched with others like it
MAX_GROUPED_JOIN = 4

#: an input gathered from group outputs with more than this many rows per row used is stacked instead
MAX_GATHER_WASTE = 4

#: a group of fewer members, each computing more than :data:`LARGE_MEMBER` elements, runs one by
#: one: batched, two or three large operations save a replay an operation or two but copy their
#: inputs into a stack (Fig. 4's log-depth tree at N=1000: the two operands of each level's
#: product, copied at every replay)
MIN_GROUP_SIZE = 4
LARGE_MEMBER = 2**16

#: at most this many of a group's members (and at most an eighth of them) are read one by one, by a
#: ``select`` each, before the group is unbound (:class:`_Batched`); an ``unbind`` of which at most
#: as many outputs are read is written as their selects (:func:`narrow_unbinds`)
MAX_SELECTED_MEMBERS = 8


# -- the graph's facts ----------------------------------------------------------------------


def _value(node: Node) -> Any:
    return node.meta.get("val")


def _is_random(node: Node) -> bool:
    target = node.target
    return isinstance(target, OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def _draws_exactly_at_once(node: Node) -> bool:
    """
    Whether stacking this draw with the draws like it that follow it gives the numbers
    they draw one by one (:data:`NORMAL_DRAWS`; ``tests/compile/test_loop_rolling.py`` checks it).
    """
    value = _value(node)
    return (
        node.target in NORMAL_DRAWS
        and isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and value.dtype in (torch.float32, torch.float64)
        and value.numel() > 0
        and value.numel() % 16 == 0
    )


def _signature(value: Any) -> Any:
    """Shapes and dtypes of a node's value (a tensor, or a pytree of them)."""
    if isinstance(value, torch.Tensor):  # most values: no pytree walk
        return ((tuple(value.shape), value.dtype, value.device),)
    leaves, spec = tree_flatten(value)
    return (
        tuple(
            (tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else repr(v) for v in leaves
        ),
        repr(spec),
    )


def _few_and_large(count: int, value: Any) -> bool:
    """
    Whether ``count`` like operations, each computing ``value``, are better run one by
    one than stacked (:data:`MIN_GROUP_SIZE`).
    """
    if count >= MIN_GROUP_SIZE:
        return False
    outputs, _ = tree_flatten(value)
    return sum(t.numel() for t in outputs if isinstance(t, torch.Tensor)) > LARGE_MEMBER


def _few_scatters(members: list[Node]) -> bool:
    """
    Whether a group of ``select_backward`` / ``slice_backward`` is better run one by one:
    batched, it is an index tensor, a zero buffer, an ``index_put`` and moves of dims, more
    operations than a few members take alone (:data:`MIN_GROUP_SIZE`).
    """
    return members[0].target in _SCATTERS and len(members) < MIN_GROUP_SIZE


def _same_shape_add(node: Node) -> bool:
    """An ``add`` of two tensors of its own shape and dtype (no broadcast, no ``alpha``)."""
    if node.op != "call_function" or node.target is not aten.add.Tensor or node.kwargs:
        return False
    if len(node.args) != 2 or not all(isinstance(a, Node) for a in node.args):
        return False
    out = _value(node)
    return isinstance(out, torch.Tensor) and all(
        isinstance(_value(a), torch.Tensor) and _value(a).shape == out.shape and _value(a).dtype == out.dtype
        for a in node.args
    )


def collapse_sum_chains(graph: Graph) -> int:
    """
    Rewrite each chain ``((a + b) + c) + ...`` of same-shape additions, each
    partial sum used only by the next, as ``stack([a, b, c, ...]).sum(0)``.
    Autograd accumulates a parameter's gradient so, one use after the other:
    a chain as long as the loop, which no level can batch.

    :returns: how many chains were rewritten.
    """
    rewritten = 0
    erased = set()
    for node in reversed(list(graph.nodes)):
        if node in erased or not _same_shape_add(node):
            continue
        if any(_same_shape_add(user) for user in node.users):  # not the end of its chain
            continue
        leaves, inner = _chain_leaves(node)
        if len(leaves) < MIN_SUM_CHAIN or _few_and_large(len(leaves), _value(node)):
            continue  # a stack of a few large terms copies more than their additions do
        with graph.inserting_before(node):
            stacked = graph.call_function(aten.stack.default, (leaves, 0))
            total = graph.call_function(aten.sum.dim_IntList, (stacked, [0]))
        total.meta["val"] = _value(node)
        # the stack's own value (a fake tensor, as the trace gives each node): grouping compares
        # it, and without it two stacks of unequal lengths read as alike
        stacked.meta["val"] = _stacked_value(_value(node), len(leaves))
        if runs_without_grad(node):
            stacked.meta[NO_GRAD] = total.meta[NO_GRAD] = True
        node.replace_all_uses_with(total)
        for dead in [node] + inner:
            graph.erase_node(dead)
            erased.add(dead)
        rewritten += 1
    return rewritten


def _stacked_value(value: Any, count: int) -> Any:
    """The value of ``stack`` of ``count`` tensors like ``value`` (``None`` where it holds no tensor)."""
    if not isinstance(value, torch.Tensor):
        return None
    return value.new_empty((count,) + tuple(value.shape))


def _chain_leaves(end: Node) -> tuple[list[Node], list[Node]]:
    """The summands of the chain of additions ending at ``end``, in order, and its inner additions."""
    leaves: list[Node] = []
    inner: list[Node] = []
    pending = [end]
    while pending:
        node = pending.pop()
        if node is not end and not (_same_shape_add(node) and len(node.users) == 1):
            leaves.append(node)
            continue
        if node is not end:
            inner.append(node)
        pending.extend(reversed(node.args))  # left operand first
    return leaves, inner


def levels(graph: Graph, after: Optional[dict[Node, list[Node]]] = None) -> dict[Node, int]:
    """
    Each node's level: 0 for inputs and constants, else one more than its inputs'
    highest (and than the nodes it must come ``after``: :func:`mutation_order`). A
    random draw is raised, where needed, to the level of the draw before it, so
    that emitting level by level keeps the draws in order.
    """
    after = after or {}
    level: dict[Node, int] = {}
    last_random = 0
    for node in graph.nodes:
        inputs = node.all_input_nodes + after.get(node, [])
        level[node] = 1 + max((level[i] for i in inputs), default=0) if node.op == "call_function" else 0
        if node.op == "call_function" and _is_random(node):
            level[node] = last_random = max(level[node], last_random)
    return level


# -- mutations ----------------------------------------------------------------------------------

#: a random fill of a fresh tensor, and the draw that returns a new one instead
_FILLS = {
    aten.normal_.default: aten.normal_functional.default,
    aten.uniform_.default: aten.uniform.default,
    aten.exponential_.default: aten.exponential.default,
    aten.bernoulli_.float: aten.bernoulli.p,
}

#: factories whose values are all overwritten by a fill or copy
_FRESH = {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}


def _mutates(node: Node) -> bool:
    return isinstance(node.target, OpOverload) and schema_of(node.target).is_mutable


def _aliases(node: Node) -> bool:
    """Whether the node's value is a view of (or is) its first argument's."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
        return False
    if node.target is operator.getitem:
        return _aliases(node.args[0])
    if not isinstance(node.target, OpOverload):
        return False
    returns = schema_of(node.target).returns
    return bool(returns) and returns[0].alias_info is not None


def replace_fresh_fills(graph: Graph) -> None:
    """
    ``empty(...).normal_()`` (how ``make_fx`` writes ``randn``) as one draw that
    returns a new tensor, and ``empty(...).copy_(x)`` as a plain ``copy``: no
    mutation left for :func:`mutation_order` to pin.
    """
    for node in list(graph.nodes):
        target = node.target
        if target not in _FILLS and target is not aten.copy_.default:
            continue
        fresh = node.args[0]
        if not (isinstance(fresh, Node) and fresh.target in _FRESH and len(fresh.users) == 1):
            continue
        functional = _FILLS.get(target, aten.copy.default)
        with graph.inserting_before(node):
            new = graph.call_function(functional, node.args, node.kwargs)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)


#: operations whose copies with the same arguments are merged (:func:`merge_repeated_zeros`)
_MERGED_WHEN_EQUAL = {aten.zeros.default, aten.expand.default, aten.scalar_tensor.default}


def merge_repeated_zeros(graph: Graph) -> int:
    """
    Merge the copies of ``zeros``, ``scalar_tensor`` and ``expand`` that have the same
    arguments into one node each. Autograd's backward of a rolled forward gives each unused
    output of an ``unbind`` its zero gradient, ``zeros([]).expand(shape)``: one pair per loop
    step (about 1,000 of the 2,150 operations of the HMM of 1,000 steps, 5,000 of the
    chain's 6,500), which a second rolling of the whole step used to batch. Merged, the
    step is as small as rolled again, without that rolling's plan and recording.
    A node that aliases one that is written (:func:`mutation_order`) or an output of the
    graph is left alone: merged, two buffers or two gradients would share memory.

    :returns: how many nodes were merged away.
    """
    _, pinned = mutation_order(graph)
    kept = set(pinned)
    output = next(node for node in reversed(graph.nodes) if node.op == "output")
    for node in output.all_input_nodes:
        while isinstance(node, Node) and node not in kept:
            kept.add(node)
            node = node.args[0] if _aliases(node) else None
    first_of: dict[tuple, Node] = {}
    merged = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _MERGED_WHEN_EQUAL or node in kept:
            continue
        key = (node.target, repr(node.args), repr(node.kwargs), runs_without_grad(node))
        first = first_of.setdefault(key, node)
        if first is not node:
            node.replace_all_uses_with(first)
            graph.erase_node(node)
            merged += 1
    return merged


def narrow_unbinds(graph: Graph) -> int:
    """
    Write an ``unbind`` of which few outputs are read as a ``select`` of each of those: the same
    views of the same tensor. Run, an ``unbind`` makes all its outputs, read or not (a graph keeps
    only the ``getitem`` of each read one), and its backward gives each unread one a zero gradient:
    the 1,000-step HMM's estimate unbinds a 500-row stack of which it reads one row, and each
    such unbind cost 500 outputs and 499 zero gradients in the rolled step's recorded backward.

    :returns: how many unbinds were narrowed.
    """
    narrowed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.unbind.int:
            continue
        value, items = _value(node), list(node.users)
        if not all(item.target is operator.getitem and isinstance(item.args[1], int) for item in items):
            continue
        readers = [item for item in items if item.users]  # a getitem nobody reads goes
        if not isinstance(value, (tuple, list)) or len(readers) > _select_at_most(len(value)):
            continue
        source, dim = node.args[0], _argument(node, 1, "dim", 0)
        for item in items:
            if not item.users:
                graph.erase_node(item)
        for reader in readers:
            with graph.inserting_before(reader):
                row = graph.call_function(aten.select.int, (source, dim, reader.args[1]), name="select")
            row.meta.update(reader.meta)
            reader.replace_all_uses_with(row)
            graph.erase_node(reader)
        graph.erase_node(node)
        narrowed += 1
    return narrowed


def mutation_order(graph: Graph) -> tuple[dict[Node, list[Node]], set]:
    """
    For the mutations left in a graph (an in-place write into a slice of a
    buffer): the tensors that alias a mutated one (its buffer, the views of it,
    the writes) are pinned, run one by one as written, and each read or write of
    such a tensor comes after the write before it, and each write after the reads
    before it.

    :returns: ``{node: nodes it must come after}`` and the pinned nodes.
    """
    parent: dict[Node, Node] = {}

    def find(node: Node) -> Node:
        while parent.get(node, node) is not node:
            node = parent[node]
        return node

    for node in graph.nodes:
        if _aliases(node) or _mutates(node):
            parent[find(node)] = find(node.args[0])
    mutated = {find(node) for node in graph.nodes if _mutates(node)}
    pinned = {node for node in graph.nodes if node.op == "call_function" and find(node) in mutated}
    after: dict[Node, list[Node]] = defaultdict(list)
    last_write: dict[Node, Node] = {}
    reads_since: dict[Node, list[Node]] = defaultdict(list)
    for node in graph.nodes:
        touched = {find(i) for i in node.all_input_nodes if i in pinned}
        if node in pinned:
            touched.add(find(node))
        for buffer in touched:
            if buffer in last_write:
                after[node].append(last_write[buffer])
            if _mutates(node) and find(node) is buffer:
                after[node].extend(reads_since.pop(buffer, []))
                last_write[buffer] = node
            else:
                reads_since[buffer].append(node)
    return after, pinned


# -- groups -----------------------------------------------------------------------------------


class Group:
    """Operations of one level, one target, and the same arguments but for their tensors (or varying ints)."""

    def __init__(self, members: list[Node]) -> None:
        self.members = members
        self.first = members[0]


def _group_key(node: Node, level: int, batch_draws: bool) -> Optional[tuple]:
    """What a node must share with the others of its group; ``None``: it runs on its own."""
    if node.op != "call_function" or _mutates(node):
        return None
    if _is_random(node) and not (batch_draws or _draws_exactly_at_once(node)):
        return None
    target = node.target
    if not (isinstance(target, OpOverload) or target is operator.getitem):
        return None
    if target in NO_BATCHING_RULE:
        return None
    if target in (aten.stack.default, aten.cat.default) and len(node.args[0]) > MAX_GROUPED_JOIN:
        return None  # a long join of a loop's values: RolledStep._joined_from_groups indexes their groups
    arguments = _arguments_key((_varying_ints_masked(node), node.kwargs))
    return (level, target, arguments, _signature(_value(node)), runs_without_grad(node))


def _arguments_key(value: Any) -> Any:
    """
    A node's arguments as a key: their nesting (each container's type and length, a dict's
    keys) with each leaf's static facts in place (:func:`_leaf_key`). Two nodes with equal
    keys flatten alike, as ``tree_flatten`` would give their leaves and spec (a walk of its
    own: a pytree spec and its ``repr`` per node were a third of planning a long loop).
    """
    if isinstance(value, (tuple, list)):
        return type(value).__name__, tuple(_arguments_key(v) for v in value)
    if isinstance(value, dict):
        return type(value).__name__, tuple((k, _arguments_key(v)) for k, v in value.items())
    return _leaf_key(value)


def _leaf_key(leaf: Any) -> Any:
    """What a group's members must share of one argument: a constant's identity, a tensor's signature."""
    if isinstance(leaf, Node):
        if leaf.op == "get_attr":  # a constant: its identity, not only its shape
            return "C", leaf.target
        return "T", _signature(_value(leaf))
    if leaf is _VARYING:
        return "int"
    return "S", repr(leaf)


#: stands for an int argument that may differ within a group (:func:`_varying_ints_masked`)
_VARYING = object()


def _varying_ints_masked(node: Node) -> tuple:
    """
    The node's arguments with each int that may differ within a group (:data:`_VARYING_INTS`)
    replaced by :data:`_VARYING`. By argument, not by position among the flattened
    arguments: ``select_backward`` and ``slice_backward`` take the input's sizes as a list,
    which flattens into one leaf per dim, so a flattened position would name a size.
    """
    varying = _VARYING_INTS.get(node.target, ())
    return tuple(
        _VARYING if position in varying and isinstance(arg, int) else arg
        for position, arg in enumerate(node.args)
    )


def _varying_ints(node: Node) -> tuple:
    """The values of the node's arguments that may differ within its group (``None`` where left out)."""
    return tuple(node.args[p] if p < len(node.args) else None for p in _VARYING_INTS.get(node.target, ()))


def plan_groups(
    graph: Graph, batch_draws: bool = False, mutations: Optional[tuple[dict[Node, list[Node]], set]] = None
) -> list[list[Group]]:
    """
    The graph's operations as groups, level by level; each level in the order of the original graph.

    :param bool batch_draws: whether random draws of one level are batched too (the same
        distribution, but not the same numbers as one by one from the same generator state).
        Without it, a run of like normal draws on the CPU is batched where that draws the
        same numbers (:func:`_draws_exactly_at_once`).
    :param mutations: :func:`mutation_order` of the graph, where the caller has it already.
    """
    after, pinned = mutations or mutation_order(graph)
    level = levels(graph, after)
    by_key: dict[tuple, list[Node]] = defaultdict(list)
    singles: list[Node] = []
    run, last_draw = 0, None  # draws batched exactly: only a run of like draws, none other between
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        key = None if node in pinned else _group_key(node, level[node], batch_draws)
        if _is_random(node) and not batch_draws:
            if key is None or key != last_draw:  # another draw came between: a new run
                run += 1
            last_draw = key
            key = None if key is None else key + (run,)
        if key is None:
            singles.append(node)
        else:
            by_key[key].append(node)
    order = {node: i for i, node in enumerate(graph.nodes)}
    split = [part for members in by_key.values() for part in _split_by_input(members)]
    one_by_one = [_few_and_large(len(part), _value(part[0])) or _few_scatters(part) for part in split]
    singles += [node for part, alone in zip(split, one_by_one) if alone for node in part]
    split = [part for part, alone in zip(split, one_by_one) if not alone]
    groups = [Group(members) for members in split] + [Group([node]) for node in singles]
    schedule: dict[int, list[Group]] = defaultdict(list)
    for group in groups:
        schedule[level[group.first]].append(group)
    return [sorted(schedule[d], key=lambda g: order[g.first]) for d in sorted(schedule)]


#: an indexing group reading from at most this many graph inputs is split into one group per input
MAX_SPLIT_INPUTS = 8


def _split_by_input(members: list[Node]) -> list[list[Node]]:
    """
    An indexing group (``select``, ``slice``) whose members read from a few graph
    inputs, as one group per input: a guide's ``loc[i]`` and ``scale[i]`` are one
    ``index_select`` each (its backward one ``index_add``), not a stack of the inputs
    repeated once per member, indexed.
    """
    if members[0].target not in _VARYING_INTS:
        return [members]
    sources = [m.args[0] for m in members]
    if not all(isinstance(s, Node) and s.op in ("placeholder", "get_attr") for s in sources):
        return [members]
    distinct = list(dict.fromkeys(sources))
    if len(distinct) == 1 or len(distinct) > MAX_SPLIT_INPUTS:
        return [members]
    return [[m for m in members if m.args[0] is source] for source in distinct]


# -- running the groups ------------------------------------------------------------------------


#: :meth:`RolledStep._run_batched`'s answer for a group whose members all compute the same value
_SHARED = object()


class _Batched:
    """
    A group's stacked output (a tensor, or a pytree of tensors, with the members along dim 0).

    A member of a stacked tensor is read as a ``select`` of its row while few of a large group's
    rows are read (a loop's first or last step, read by the code after the loop), and the group
    is unbound once for every reader after that: an ``unbind`` of 1,000 rows of which one is read
    makes 1,000 outputs, and its backward a zero gradient for each of the 999 others (of the
    9,500 operations of the 1,000-link chain's recorded backward, 3,000).
    """

    def __init__(self, value: Any, size: int) -> None:
        self.value = value
        self.size = size
        self._unbound: Optional[list[Any]] = None
        self._selected: dict[int, torch.Tensor] = {}

    def member(self, index: int) -> Any:
        if self._unbound is not None:
            return self._unbound[index]
        if isinstance(self.value, torch.Tensor):
            row = self._selected.get(index)
            if row is None and len(self._selected) < _select_at_most(self.size):
                with torch.enable_grad():  # as the unbind below
                    row = self._selected[index] = self.value.select(0, index)
            if row is not None:
                return row
        # unbound once, for every reader: in grad mode, whatever the first reader's (the
        # members of a value computed without grad do not require it either way)
        with torch.enable_grad():
            self._unbind()
        return self._unbound[index]

    def _unbind(self) -> None:
        if isinstance(self.value, torch.Tensor):
            self._unbound = list(self.value.unbind(0))
        else:  # one unbind per leaf, not one indexing per leaf and member
            leaves, spec = tree_flatten(self.value)
            rows = zip(*(leaf.unbind(0) for leaf in leaves))
            self._unbound = [tree_unflatten(list(row), spec) for row in rows]
        for index, row in self._selected.items():  # a member read already keeps its value
            self._unbound[index] = row


def _select_at_most(size: int) -> int:
    """How many of a group's ``size`` members are read by a ``select`` each before it is unbound."""
    return min(MAX_SELECTED_MEMBERS, size // 8)


class RolledStep:
    """
    Runs a traced step's graph group by group (the callable that ``make_fx`` traces
    into the rolled graph).

    :param GraphModule module: the step, its fresh fills made functional
        (:func:`replace_fresh_fills`); the writes left in it are run as pinned.
    :param schedule: :func:`plan_groups` of its graph.
    :param set pinned: :func:`mutation_order`'s pinned nodes of the graph, where the caller has them.
    """

    def __init__(
        self, module: GraphModule, schedule: list[list[Group]], pinned: Optional[set] = None
    ) -> None:
        self.module = module
        self.schedule = schedule
        #: the nodes that alias a tensor some operation writes into: a view among them stays a view
        self.pinned = mutation_order(module.graph)[1] if pinned is None else pinned

    def __call__(self, *inputs: torch.Tensor) -> Any:
        self.values: dict[Node, Any] = {}
        self.place: dict[Node, tuple[_Batched, int]] = {}
        placeholders = [n for n in self.module.graph.nodes if n.op == "placeholder"]
        for node, value in zip(placeholders, inputs):
            self.values[node] = value
        for node in self.module.graph.nodes:
            if node.op == "get_attr":
                self.values[node] = getattr(self.module, node.target)
        for groups in self.schedule:
            for group in groups:
                self._run(group)
        output = next(n for n in self.module.graph.nodes if n.op == "output")
        return map_arg(output.args[0], self._get)

    def _get(self, node: Node) -> Any:
        if node in self.values:
            return self.values[node]
        batched, index = self.place[node]
        return batched.member(index)

    def _run(self, group: Group) -> None:
        with grad_mode_of(group.first):  # a forward's node runs in the eager step's grad mode
            self._run_in_mode(group)

    def _run_in_mode(self, group: Group) -> None:
        if len(group.members) > 1:
            try:
                batched = self._run_batched(group)
            except Exception:  # no batching rule for this op: each member on its own
                batched = None
            if batched is _SHARED:
                return
            if batched is not None:
                for index, node in enumerate(group.members):
                    self.place[node] = (batched, index)
                return
        for node in group.members:
            self.values[node] = self._run_single(node)

    def _run_single(self, node: Node) -> Any:
        if node.target in (aten.stack.default, aten.cat.default):
            joined = self._joined_from_few(node)
            if joined is None:
                joined = self._joined_from_groups(node)
            if joined is not None:
                return joined
        get = self._get
        if isinstance(node.target, HigherOrderOperator):  # (cond) refuses aliased operands
            get = self._get_unaliased
        args, kwargs = map_arg((node.args, node.kwargs), get)
        if node.target is aten.view.default and node not in self.pinned:
            return _view(*args, **kwargs)
        return node.target(*args, **kwargs)

    def _get_unaliased(self, node: Node) -> Any:
        """A node's value; a copy where it is a view into its group's batched output."""
        value = self._get(node)
        if node in self.place and isinstance(value, torch.Tensor):
            return value.clone(memory_format=torch.contiguous_format)
        return value

    def _stacked_from_group(self, sources: Sequence[Node]) -> Optional[torch.Tensor]:
        """
        ``stack(sources)`` where most sources are members of batched groups:
        indexing into their stacked outputs (concatenated where there are several,
        as when a loop's even and odd steps took two paths through a log-depth
        contraction, with the few others stacked beside them), not a stack of
        one-by-one reads.
        """
        split = self._blocks_and_loose(sources)
        if split is None:
            return None
        blocks, loose = split
        offset, values = 0, []
        for key, (value, _) in blocks.items():
            blocks[key] = (value, offset)
            offset += value.size(0)
            values.append(value)
        loose_at = {source: offset + i for i, source in enumerate(dict.fromkeys(loose))}
        if loose_at:
            stacked = self._stacked_alike(list(loose_at))
            if stacked is None:
                return None
            values.append(stacked)
        if offset + len(loose_at) > MAX_GATHER_WASTE * len(sources):  # most rows unused: stack the few
            return None
        if len({(tuple(v.shape[1:]), v.dtype) for v in values}) > 1:
            return None
        whole = values[0] if len(values) == 1 else torch.cat(values, 0)
        rows = [
            loose_at[s] if s in loose_at else blocks[id(self.place[s][0])][1] + self.place[s][1]
            for s in sources
        ]
        return _take(whole, rows)

    def _blocks_and_loose(
        self, sources: Sequence[Node]
    ) -> Optional[tuple[dict[int, tuple[Any, int]], list[Node]]]:
        """
        The batched outputs that hold the sources (``id -> (stacked value, 0)``), and the
        sources no group holds; ``None`` where most are of the latter (a plain stack).
        """
        if not sources or not all(isinstance(s, Node) for s in sources):
            return None
        blocks: dict[int, tuple[Any, int]] = {}
        loose: list[Node] = []
        for source in sources:
            if source not in self.place:
                loose.append(source)
                continue
            batched = self.place[source][0]
            if not isinstance(batched.value, torch.Tensor):
                return None
            blocks.setdefault(id(batched), (batched.value, 0))
        if not blocks or len(loose) * 2 > len(sources):  # mostly one-by-one values
            return None
        return blocks, loose

    def _stacked_alike(self, sources: list[Node]) -> Optional[torch.Tensor]:
        """``stack`` of the sources' values; ``None`` where their shapes differ (a ``cat``'s)."""
        values = [self._get(source) for source in sources]
        if len({(tuple(v.shape), v.dtype) for v in values}) > 1:
            return None
        return torch.stack(values)

    def _held_values(self, sources: Sequence[Any]) -> Optional[list[torch.Tensor]]:
        """The sources' tensors where each is a node holding one of its own (not a group member's row)."""
        if not sources or not all(isinstance(s, Node) and s in self.values for s in sources):
            return None
        values = [self.values[s] for s in sources]
        if not all(isinstance(v, torch.Tensor) for v in values):
            return None
        return values

    def _joined_from_few(self, node: Node) -> Optional[torch.Tensor]:
        """A ``stack`` or ``cat`` of a few distinct tensors, many times over (:func:`_stack_few`)."""
        values = self._held_values(node.args[0])
        if values is None or len({(v.shape, v.dtype) for v in values}) > 1:
            return None
        whole = _stack_few(values)
        joined = None if whole is None else _join(node, whole)
        # contiguous, as a stack's result is (the graph's outputs may be a parameter's .grad)
        return None if joined is None else joined.contiguous()

    def _joined_from_groups(self, node: Node) -> Optional[torch.Tensor]:
        """A ``stack`` or ``cat`` of members of batched groups, as indexing into their outputs."""
        sources = node.args[0]
        whole = self._stacked_from_group(sources)
        return None if whole is None else _join(node, whole)

    def _gather(self, sources: list[Node]) -> tuple[Any, Optional[int]]:
        """One input position of a group for all members: ``(value, 0)`` stacked, ``(value, None)`` shared."""
        if all(s is sources[0] for s in sources):
            return self._get(sources[0]), None
        values = self._held_values(sources)
        if values is not None and all(v is values[0] for v in values):
            return values[0], None  # distinct nodes of one shared group (a fill, a constant)
        whole = self._stacked_from_group(sources)
        if whole is not None:
            return whole, 0
        if values is not None:
            few = _stack_few(values)
            if few is not None:
                return few, 0
        return torch.stack([self._get(s) for s in sources]), 0

    def _run_batched(self, group: Group) -> Any:
        """The group's stacked output; :data:`_SHARED` where every input is shared (one result serves all)."""
        first = group.first
        leaves, spec = tree_flatten((first.args, first.kwargs))
        positions = [p for p, leaf in enumerate(leaves) if isinstance(leaf, Node)]
        inputs = _member_inputs(group.members, [leaves[p] for p in positions], positions)
        gathered = [self._gather([nodes[k] for nodes in inputs]) for k in range(len(positions))]
        if _is_random(first):  # one draw per member, never one shared
            if first.target not in ELEMENTWISE_DRAWS or not gathered:
                return None
            filled = list(leaves)
            for p, (value, dim) in zip(positions, gathered):
                filled[p] = _expand_shared(value, dim, len(group.members))
            args, kwargs = tree_unflatten(filled, spec)
            return _Batched(first.target(*args, **kwargs), len(group.members))
        if all(dim is None for _, dim in gathered) and first.target not in _VARYING_INTS:
            value = self._run_single(first)
            for node in group.members:
                self.values[node] = value
            return _SHARED
        size = len(group.members)
        rule = _BATCH_RULES.get(first.target)
        if rule is not None:
            ints = [_varying_ints(member) for member in group.members]
            return _Batched(rule(first, gathered, ints, size), size)
        values = [value for value, _ in gathered]
        in_dims = tuple(dim for _, dim in gathered)

        def one(*tensors):
            filled = list(leaves)
            for p, tensor in zip(positions, tensors):
                filled[p] = tensor
            args, kwargs = tree_unflatten(filled, spec)
            return first.target(*args, **kwargs)

        return _Batched(torch.vmap(one, in_dims=in_dims)(*values), size)


def _member_inputs(members: list[Node], first_inputs: list[Node], positions: list[int]) -> list[list[Node]]:
    """
    Each member's tensor arguments, in the order of the first member's flattened leaves
    (``first_inputs``, at ``positions``). The members' arguments are alike but for their nodes
    (:func:`_group_key`), so each member's nodes are read by ``map_arg``, in the order in which
    it meets them, not by a ``tree_flatten`` of each: that was most of the batched groups' own
    time (cProfile of the 1,000-step HMM's capture), and each call left a reference cycle (a
    recursive closure) for the garbage collector, 15,000 at that HMM, whose collection at the end
    of the capture took 0.36 s. Where the two orders could differ (an argument in a container
    ``map_arg`` walks otherwise than ``tree_flatten``), every member is flattened.
    """
    inputs = [_nodes_in_order(member) for member in members]
    first = inputs[0]
    if len(first) == len(first_inputs) and all(a is b for a, b in zip(first, first_inputs)):
        return inputs
    flattened = [tree_flatten((member.args, member.kwargs))[0] for member in members]
    return [[leaves[p] for p in positions] for leaves in flattened]


def _nodes_in_order(node: Node) -> list[Node]:
    """The nodes among ``node``'s arguments, each time one is met (``all_input_nodes`` gives each once)."""
    found: list[Node] = []
    map_arg((node.args, node.kwargs), found.append)
    return found


def _argument(node: Node, position: int, name: str, default: Any) -> Any:
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def _stack_few(values: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """
    ``torch.stack(values)`` where they are copies of a few distinct tensors: those
    stacked once, and indexed (``None`` where most are distinct). Each member of a
    group whose inputs were all shared holds the same tensor (a ``zeros`` or a
    constant per loop step); stacked as they are, inductor makes a kernel of one
    argument per member (Fig. 4's 1,000-link chain: kernels of ~1,000 arguments, which
    inductor is slow to compile).
    """
    distinct = list({id(v): v for v in values}.values())
    if 2 * len(distinct) > len(values):
        return None
    position = {id(v): i for i, v in enumerate(distinct)}
    return _take(torch.stack(distinct), [position[id(v)] for v in values])


def _join(node: Node, whole: torch.Tensor) -> Optional[torch.Tensor]:
    """A ``stack`` or ``cat`` node's result from ``whole``, its sources stacked along dim 0."""
    dim = _argument(node, 1, "dim", 0)
    if node.target is aten.stack.default:
        return whole.movedim(0, dim % whole.dim())
    if whole.dim() < 2:
        return None
    dim = dim % (whole.dim() - 1)
    return whole.movedim(0, dim).flatten(dim, dim + 1)


def _view(tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """
    ``tensor.view(shape)``, or a reshaped copy where its strides allow no view: a member
    read from a batched output has that output's strides, not the ones the step traced
    with. Only where nothing in the step writes into the tensor (the copy would miss it).
    """
    try:
        return aten.view.default(tensor, shape)
    except (RuntimeError, ValueError):  # "Cannot view a tensor with shape ... and strides ..."
        return tensor.reshape(shape)


def _take(stacked: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """``stacked[indices]``: the tensor itself, a strided slice, or an ``index_select``."""
    size = stacked.size(0)
    if indices == list(range(size)):
        return stacked
    if len(indices) > 1:
        step = indices[1] - indices[0]
        if step > 0 and indices == list(range(indices[0], indices[0] + step * len(indices), step)):
            return stacked[indices[0] : indices[-1] + 1 : step]
    return stacked.index_select(0, torch.tensor(indices, dtype=torch.long, device=stacked.device))


# -- batching rules for indexing at ints that differ between members ---------------------------


def _expand_shared(value: torch.Tensor, dim: Optional[int], size: int) -> torch.Tensor:
    return value.unsqueeze(0).expand((size,) + tuple(value.shape)) if dim is None else value


def _select_rule(node: Node, gathered, ints, size) -> torch.Tensor:
    ((source, source_dim),) = gathered
    dim = node.args[1] % source.dim() if source_dim is None else node.args[1] % (source.dim() - 1)
    index = torch.tensor([i for (i,) in ints], dtype=torch.long, device=source.device)
    if source_dim is None:  # one tensor read at N indices: index_select
        index = index % source.size(dim)
        return source.index_select(dim, index).movedim(dim, 0)
    moved = source.movedim(dim + 1, 1)  # (members, indexed dim, rest...)
    index = index % moved.size(1)
    return moved[torch.arange(size, device=source.device), index]


def _slice_indices(node: Node, ints, length: int, device) -> torch.Tensor:
    """The (members, slice length) indices of each member's slice."""
    step = _argument(node, 4, "step", 1)
    rows = []
    for start, end in ints:
        start = 0 if start is None else start
        rows.append(list(range(length))[slice(start, end, step)])
    return torch.tensor(rows, dtype=torch.long, device=device)  # long even when the slices are empty


def _slice_rule(node: Node, gathered, ints, size) -> torch.Tensor:
    ((source, source_dim),) = gathered
    rank = source.dim() - (source_dim is not None)
    dim = _argument(node, 1, "dim", 0) % rank
    if source_dim is None:
        index = _slice_indices(node, ints, source.size(dim), source.device)  # (members, L)
        taken = source.index_select(dim, index.reshape(-1))
        taken = taken.unflatten(dim, index.shape)  # (..., members, L, ...)
        return taken.movedim(dim, 0)
    index = _slice_indices(node, ints, source.size(dim + 1), source.device)
    moved = source.movedim(dim + 1, 1)  # (members, dim, rest...)
    taken = moved[torch.arange(size, device=source.device)[:, None], index]  # (members, L, rest...)
    return taken.movedim(1, dim + 1)


def _select_backward_rule(node: Node, gathered, ints, size) -> torch.Tensor:
    ((grad, grad_dim),) = gathered
    grad = _expand_shared(grad, grad_dim, size)
    sizes = list(node.args[1])
    dim = node.args[2] % len(sizes)
    out = grad.new_zeros([size] + sizes).movedim(dim + 1, 1)  # (members, dim, rest...)
    index = torch.tensor([i for (i,) in ints], dtype=torch.long, device=grad.device) % sizes[dim]
    out = out.index_put((torch.arange(size, device=grad.device), index), grad)
    return out.movedim(1, dim + 1)


def _slice_backward_rule(node: Node, gathered, ints, size) -> torch.Tensor:
    ((grad, grad_dim),) = gathered
    grad = _expand_shared(grad, grad_dim, size)
    sizes = list(node.args[1])
    dim = node.args[2] % len(sizes)
    step = node.args[5] if len(node.args) > 5 else 1
    rows = [list(range(sizes[dim]))[slice(start, end, step)] for start, end in ints]
    index = torch.tensor(rows, dtype=torch.long, device=grad.device)  # long even when the slices are empty
    out = grad.new_zeros([size] + sizes).movedim(dim + 1, 1)
    values = grad.movedim(dim + 1, 1)  # (members, L, rest...)
    out = out.index_put((torch.arange(size, device=grad.device)[:, None], index), values)
    return out.movedim(1, dim + 1)


def _copy_rule(node: Node, gathered, ints, size) -> torch.Tensor:
    """
    ``copy(self, src)``, which :func:`replace_fresh_fills` makes of ``empty().copy_(src)``:
    vmap has no rule for it (batched, it loops and prints a warning).
    """
    (target, target_dim), (source, source_dim) = gathered
    rank = target.dim() - (target_dim is not None)
    if source_dim is not None:  # (members, *src) -> (members, 1, ..., *src): each member broadcasts alone
        source = source.reshape((size,) + (1,) * (rank - source.dim() + 1) + tuple(source.shape[1:]))
    return aten.copy(_expand_shared(target, target_dim, size), source)


def _log_sigmoid_backward_rule(node: Node, gathered, ints, size) -> torch.Tensor:
    """
    vmap's rule passes a shared ``grad_output`` unexpanded, and the kernel then resizes its
    output to the batch's shape, which torch deprecates with a warning at every replay (the
    stick-breaking transform of a Dirichlet site under an AutoGuide). Its three tensors have
    one shape: stacked, a shared one expanded, it is one call.
    """
    grad_output, value, buffer = (_expand_shared(tensor, dim, size) for tensor, dim in gathered)
    return aten.log_sigmoid_backward(grad_output, value, buffer)


_BATCH_RULES: dict[Any, Callable] = {
    aten.copy.default: _copy_rule,
    aten.log_sigmoid_backward.default: _log_sigmoid_backward_rule,
    aten.select.int: _select_rule,
    aten.slice.Tensor: _slice_rule,
    aten.select_backward.default: _select_backward_rule,
    aten.slice_backward.default: _slice_backward_rule,
}


# -- the pass -------------------------------------------------------------------------------


def count_operations(module: GraphModule) -> int:
    return sum(node.op == "call_function" for node in module.graph.nodes)


def eliminate_dead_code(graph: Graph) -> bool:
    """
    ``graph.eliminate_dead_code()``, each aten operator's purity looked up once, not per node
    (about half of its time on a long loop's 15,000-node forward).

    :returns: whether a node was removed.
    """
    purity: dict[OpOverload, bool] = {}

    def impure(node: Node) -> bool:
        if node.op != "call_function" or not isinstance(node.target, OpOverload):
            return node.is_impure()  # a higher-order operator's purity may hang on its arguments
        known = purity.get(node.target)
        if known is None:
            known = purity[node.target] = node.is_impure()
        return known

    return graph.eliminate_dead_code(is_impure_node=impure)


#: operations whose value is their operand's, for a graph replayed without grad: a copy of a
#: constant (``make_fx`` copies each tensor constant it meets) and a detach
_REPLAY_COPIES = (aten.lift_fresh_copy.default, aten.detach.default)


def drop_replay_copies(graph: Graph) -> int:
    """
    Each of :data:`_REPLAY_COPIES` whose value is only read replaced by its operand, in a graph
    replayed without grad (a captured step: its backward is operations of its own). Each was an
    operation at every replay: the enumerated HMM's rolled step held 20 copies of its constant
    indices and 20 detaches of its shifts, of 995 operations. Left as it is where the value, or
    a view of it, is written in place, or is the graph's output (a detached parameter returned
    as itself would be the parameter, with its grad).

    :returns: how many were dropped.
    """
    dropped = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _REPLAY_COPIES and _only_read(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            dropped += 1
    return dropped


def _only_read(node: Node) -> bool:
    """Whether no user of ``node``, nor of a view of it, writes into it, and none is the output."""
    for user in node.users:
        if user.op != "call_function" or _mutates(user):
            return False
        if user.target is operator.getitem or not isinstance(user.target, OpOverload):
            return False  # a pytree's part, or a higher-order operator's operand: not looked into
        if any(r.alias_info is not None for r in schema_of(user.target).returns) and not _only_read(user):
            return False
    return True


def merge_equal_constants(module: GraphModule) -> None:
    """One ``get_attr`` node per distinct constant tensor (a loop makes the same constant at every step)."""
    seen: dict[tuple, Node] = {}
    for node in list(module.graph.nodes):
        if node.op != "get_attr":
            continue
        value = getattr(module, node.target)
        if not isinstance(value, torch.Tensor) or value.numel() > 64:
            continue
        key = (tuple(value.shape), value.dtype, value.device, tuple(value.reshape(-1).tolist()))
        if key in seen:
            node.replace_all_uses_with(seen[key])
            module.graph.erase_node(node)
        else:
            seen[key] = node


def rolled_runner(module: GraphModule, batch_draws: bool = False) -> RolledStep:
    """
    A :class:`RolledStep` of a traced step (see the module docstring), its graph
    tidied and its groups planned: called on tensors, it computes the step's outputs
    group by group, each in the grad mode the eager step ran it in. Traced under
    autograd, it gives a rolled forward's backward (:mod:`pyro_tmc.compile.forward_trace`).

    :param module: a graph traced by ``make_fx`` (changed in place).
    :param bool batch_draws: see :func:`plan_groups`.
    """
    graph = module.graph
    merge_equal_constants(module)
    replace_fresh_fills(graph)
    eliminate_dead_code(graph)
    narrow_unbinds(graph)
    collapse_sum_chains(graph)
    module.recompile()
    mutations = mutation_order(graph)  # once, for the plan and the runner
    return RolledStep(module, plan_groups(graph, batch_draws, mutations), mutations[1])


def count_groups(runner: RolledStep) -> int:
    """How many operations a rolled step runs (each group is one)."""
    return sum(len(groups) for groups in runner.schedule)


def roll(
    module: GraphModule,
    example_inputs: Sequence[torch.Tensor],
    batch_draws: bool = False,
    trace: Optional[Callable[[Callable, Sequence[torch.Tensor]], GraphModule]] = None,
    at_most: Optional[int] = None,
) -> Optional[GraphModule]:
    """
    The rolled graph of a captured step, its backward included (see the module
    docstring): the same function of the same inputs, with each level's repeated
    operations batched.

    :param module: a graph traced by ``make_fx``.
    :param example_inputs: inputs of the right shapes (traced as fake tensors; not run).
    :param bool batch_draws: see :func:`plan_groups`.
    :param trace: ``(runner, example_inputs) -> graph``, how the rolled runner is traced
        (``None``: ``make_fx`` with fake tensors).
    :param int at_most: roll only where the plan has at most this many groups (``None``: always).
    :returns: the rolled graph; ``None`` where the plan has more than ``at_most`` groups
        (``module`` is tidied in place either way: :func:`rolled_runner`).
    """
    runner = rolled_runner(module, batch_draws)
    if at_most is not None and count_groups(runner) > at_most:
        return None
    # the step's backward is in its graph already, as operations: tracing them needs no autograd
    with torch.no_grad():
        rolled = (trace or _fake_trace)(runner, example_inputs)
    eliminate_dead_code(rolled.graph)
    rolled.recompile()
    return rolled


def _fake_trace(function: Callable, example_inputs: Sequence[torch.Tensor]) -> GraphModule:
    return make_fx(function, tracing_mode="fake")(*example_inputs)


def graph_constants(module: GraphModule) -> list[torch.Tensor]:
    """The tensors a graph reads by ``get_attr`` (its constants): what its runner reads besides its inputs."""
    return [
        value
        for node in module.graph.nodes
        if node.op == "get_attr" and isinstance(value := getattr(module, node.target), torch.Tensor)
    ]
