"""One flattener: an object -> the tensors it holds, a hashable key for the rest, and a template.

The capture engine keys a graph by what it bakes in, and replays it on other tensors: a
draw's traces (:mod:`pyro_tmc.compile.compiled`) and a step's arguments
(:mod:`pyro_tmc.compile.captured_step`) are flattened here, alike:

- a tensor: an input of the graph (a :class:`Leaf`), its ``tensor_key`` in the key; a
  tensor met twice is one input, as the graph traced it;
- an atom (``None``, a number, a string, a dtype, a device, a size): itself, in the key;
- tuples, lists, namedtuples and dicts: walked, their type and length (a dict's keys) in
  the key;
- an object that ``fields_of`` copies (distributions, transforms and dataclasses, for a
  draw): its type in the key, and its fields flattened in turn;
- anything else: kept as it is, keyed by its identity, so that a new one (a callable made
  afresh each step) is a new key rather than a stale constant.

Not ``torch.utils._pytree``: a draw is flattened at every step of an estimate program, and
pytree's specs made that step's Python dearer: a 100-link chain's draw (404 tensors) took
61 ms to flatten with ``tree_flatten`` (its specs in the key) against 11 ms by this walk, and
its key 2.5 ms to hash against 0.08 ms (best of 20, this project's loaded 2-core CPU).
Registering distributions with pytree, for it to walk them, would also change how
``torch.compile`` flattens them in the user's own code: its registry is the whole process's.
"""

from typing import Any, Callable, Optional

import torch

#: immutable values that go into the key as they are (and their subclasses, such as numpy's floats)
ATOMS = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.Size)
#: the same types, looked up first by exact type: most of a draw's values are of these
_ATOM_TYPES = frozenset(ATOMS)


class Leaf:
    """A placeholder for the i-th input tensor."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class Copied:
    """A copied object in a template: its type, its fields' template, and how to rebuild it."""

    __slots__ = ("fields", "kind", "rebuild")

    def __init__(self, kind: type, fields: dict, rebuild: Callable[[type, dict], Any]) -> None:
        self.kind, self.fields, self.rebuild = kind, fields, rebuild


def _copies_nothing(obj) -> Optional[dict]:
    return None


class Flattener:
    """
    Flattens objects into :attr:`tensors`, :attr:`key` and templates (see the module docstring).

    :param tensor_key: ``tensor -> hashable``: what of an input tensor the key holds.
    :param fields_of: ``object -> dict or None``: the fields to copy an object by, or ``None``
        to keep it as it is.
    :param rebuild: ``(type, fields) -> object``: an object copied by ``fields_of``, again.
    """

    def __init__(
        self,
        tensor_key: Callable[[torch.Tensor], Any],
        fields_of: Callable[[Any], Optional[dict]] = _copies_nothing,
        rebuild: Optional[Callable[[type, dict], Any]] = None,
    ) -> None:
        self.tensor_key, self.fields_of, self.rebuild = tensor_key, fields_of, rebuild
        self.tensors: list[torch.Tensor] = []
        self.key: list[Any] = []
        #: ``(site, object)`` for each object kept as it is (a failed trace names them)
        self.kept: list[tuple[Optional[str], Any]] = []
        #: the site being flattened, named in :attr:`kept`
        self.site: Optional[str] = None
        self._index: dict[int, int] = {}

    def flatten(self, obj):
        """``obj``'s template: ``obj`` with each tensor replaced by its :class:`Leaf`."""
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        kind = type(obj)
        if kind in _ATOM_TYPES:
            self.key.append(obj)
            return obj
        if kind is tuple or kind is list:
            self.key.append((kind, len(obj)))
            return kind(self.flatten(item) for item in obj)
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple (a plate frame)
            if all(type(item) in _ATOM_TYPES for item in obj):
                self.key.append(obj)
                return obj
            self.key.append(kind)
            return kind(*(self.flatten(item) for item in obj))
        if isinstance(obj, dict):
            self.key.append((dict, tuple(obj)))
            return {k: self.flatten(v) for k, v in obj.items()}
        fields = self.fields_of(obj)
        if fields is not None:
            self.key.append(kind)
            return Copied(kind, {k: self.flatten(v) for k, v in fields.items()}, self.rebuild)
        if isinstance(obj, ATOMS):
            self.key.append(obj)
            return obj
        self.key.append(("opaque", kind, id(obj)))
        self.kept.append((self.site, obj))
        return obj

    def _tensor(self, tensor: torch.Tensor) -> Leaf:
        index = self._index.get(id(tensor))
        if index is not None:
            self.key.append(("alias", index))
            return Leaf(index)
        index = self._index[id(tensor)] = len(self.tensors)
        self.tensors.append(tensor)
        self.key.append(self.tensor_key(tensor))
        return Leaf(index)


def fill(template, inputs: list[torch.Tensor]):
    """The template with each :class:`Leaf` replaced by its input tensor, each copied object rebuilt."""
    if isinstance(template, Leaf):
        return inputs[template.index]
    kind = type(template)
    if kind is tuple or kind is list:
        return kind(fill(item, inputs) for item in template)
    if isinstance(template, tuple) and hasattr(template, "_fields"):
        return kind(*(fill(item, inputs) for item in template))
    if kind is dict:
        return {k: fill(v, inputs) for k, v in template.items()}
    if kind is Copied:
        return template.rebuild(template.kind, {k: fill(v, inputs) for k, v in template.fields.items()})
    return template
