"""The one seam to torch's private and experimental internals.

Every private or experimental torch name that pyro_tmc uses is imported or named
here, with why, and nowhere else in the package (``tests/test_torch_seam.py``
parses every module to keep it so). :func:`missing_private_names` checks that the
installed torch still has each one; the same test fails, naming the symbol, on a
torch version that lacks one. When torch changes, this file (and the test) is
where it shows.

The names that the graph capture needs on every import of a compile module are
imported here at once: ``import torch`` has loaded their modules already. Those
of inductor and dynamo, which take seconds to import, are looked up on first use
(:data:`_LAZY`, through the module's ``__getattr__``, typed ``Any``): ``from pyro_tmc._torch
import inductor_compile`` inside a function imports inductor then, not with
``import pyro_tmc``.
"""

import importlib
from typing import Any, Optional

import torch

# TracingContext and tracing (over a FakeTensorMode with a ShapeEnv): the context torch.compile
# gives inductor, which its FX graph cache needs (compile/compiled.py, ``_cacheable_compile``)
from torch._guards import TracingContext, tracing

# isinstance checks on a graph node's target: an aten operator overload (it has a schema and
# tags), or a higher-order operator (``torch.cond``), which the capture treats apart
from torch._ops import HigherOrderOperator, OpOverload

# fake tensors with a shape environment, for that tracing context
from torch._subclasses.fake_tensor import FakeTensorMode

# autograd replays a view's own operations (not as_strided) in the backward of a write into it, as
# it does for fake tensors: a recorded step's backward is then the graph make_fx traces
# (compile/recording.py)
from torch.autograd.grad_mode import _force_original_view_tracking as original_view_tracking

# a transform's inverse (``t.inv``) holds ``t`` and nothing else: the plan cache's key walks into
# it, not into another transform's weak reference to its inverse (compile/compiled.py)
from torch.distributions.transforms import _InverseTransform as InverseTransform

# a graph that writes its Python code at its first call, not at each recompile: rolling rewrites
# a long step's graph, which may never run (compile/captured_step.py)
from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule
from torch.fx._lazy_graph_module import _use_lazy_graph_module as use_lazy_graph_module

# make_fx traces a step into a graph of aten operations; get_proxy_mode gives the graph it is
# recording, which GradModeMarks marks node by node (compile/forward_trace.py)
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

# GradModeMarks is a dispatch mode: it sees each aten operation as make_fx records it
from torch.utils._python_dispatch import TorchDispatchMode

# a node's arguments and outputs are nested tuples, lists and dicts of nodes and tensors
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = [
    "DYNAMO_TENSOR_MARK",
    "HIGHER_ORDER_OPS_MODULE",
    "FakeTensorMode",
    "HigherOrderOperator",
    "InverseTransform",
    "LazyGraphModule",
    "OpOverload",
    "TorchDispatchMode",
    "UncompiledDispatchMode",
    "TracingContext",
    "autograd_function_of",
    "get_proxy_mode",
    "load_inductor_tracing",
    "make_fx",
    "missing_private_names",
    "original_view_tracking",
    "schema_of",
    "tracing",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
    "use_lazy_graph_module",
]


class UncompiledDispatchMode(TorchDispatchMode):
    """
    A dispatch mode that never runs under ``torch.compile`` (the recorder of
    compile/recording.py, which runs before any compile). torch wraps each subclass's
    ``__torch_dispatch__`` in dynamo's ``disable`` (so that dynamo does not trace into a mode
    it compiles through), unless the class's ``_should_skip_dynamo`` says not to; that wrapper
    imports dynamo at its first call (1-2 s, the first capture's, where ``compile="graph"``
    needs no dynamo at all) and costs a frame-evaluation switch per operation.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


#: the heavy names, imported on first use: name here -> (module, attribute; ``None``: the module)
_LAZY: dict[str, tuple[str, Optional[str]]] = {
    # compiles a captured step's graph as it is, with no second trace by dynamo
    "inductor_compile": ("torch._inductor", "compile"),
    # torch.compile's ``mode`` as the settings it stands for (it takes a mode or settings)
    "list_mode_options": ("torch._inductor", "list_mode_options"),
    # which of the package's inductor settings this torch's inductor has
    "inductor_config": ("torch._inductor.config", None),
    # the base class of compile/bmm_layout.py's post-grad pass; its uuid() keys inductor's cache
    "CustomGraphPass": ("torch._inductor.custom_graph_pass", "CustomGraphPass"),
    # a shape environment for the tracing context inductor's FX graph cache needs
    "ShapeEnv": ("torch.fx.experimental.symbolic_shapes", "ShapeEnv"),
    # AOTAutograd's settings, read around torch.compile (compile/compiled.py)
    "functorch_config": ("torch._functorch.config", None),
}

#: the attributes TorchDynamo sets on the tensors it compiled against start with this; the plan
#: cache's key leaves them out, or it would change after the first compile
DYNAMO_TENSOR_MARK = "_dynamo"

#: the module of torch's own higher-order operators (``cond``): the autograd Functions defined
#: there differentiate their branches themselves, so they are no custom backward
HIGHER_ORDER_OPS_MODULE = "torch._higher_order_ops"


def __getattr__(name: str) -> Any:
    """A name of :data:`_LAZY`, imported now (and kept)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = _resolve(*_LAZY[name])
    globals()[name] = value
    return value


def _resolve(module: str, attribute: Optional[str]) -> Any:
    loaded = importlib.import_module(module)
    return loaded if attribute is None else getattr(loaded, attribute)


def schema_of(target: Any) -> Optional[torch.FunctionSchema]:
    """
    The schema of a graph node's target (an aten operator overload): its arguments'
    and returns' alias and write annotations say which operations mutate or return
    views. ``None`` for a target without one (``operator.getitem``, ``cond``).
    """
    return getattr(target, "_schema", None)


def autograd_function_of(backward: torch.autograd.function.BackwardCFunction) -> type:
    """The custom ``autograd.Function`` whose backward this ``grad_fn`` node runs."""
    return getattr(backward, "_forward_cls", type(backward))


def load_inductor_tracing() -> None:
    """
    Import dynamo and the triton-kernel wrapper: inductor's tracing expects their modules
    loaded, which ``torch.compile`` does but a fresh process that calls inductor directly
    (compile/background_compile.py's child) does not.
    """
    importlib.import_module("torch._dynamo")
    importlib.import_module("torch._higher_order_ops.triton_kernel_wrap")


#: protocol attributes that torch reads from the package's objects: (module whose source reads
#: it, the attribute). A dispatch mode that sets ``supports_higher_order_operators`` sees ``cond``
#: in ``__torch_dispatch__`` (GradModeMarks leaves it unmarked) instead of torch refusing it; one
#: whose ``_should_skip_dynamo`` is false is not wrapped in dynamo's ``disable``
#: (:class:`UncompiledDispatchMode`).
_PROTOCOL = (
    ("torch._ops", "supports_higher_order_operators"),
    ("torch.utils._python_dispatch", "_should_skip_dynamo"),
)

#: settings the package patches: (config module, key). Inductor's settings need no entry: the
#: package passes only those this inductor has (compile/compiled.py, ``_available``).
_CONFIG_KEYS = (("torch._functorch.config", "donated_buffer"),)


def missing_private_names() -> list[str]:
    """
    The private torch names above that the installed torch lacks (empty when all are
    there). The ones imported at the top fail ``import pyro_tmc._torch`` itself, naming
    the symbol; this checks the lazy ones, and those read as attributes.
    """
    import inspect

    missing = []
    for module, attribute in _LAZY.values():
        try:
            _resolve(module, attribute)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{attribute}" if attribute else module)
    for module, attribute in _PROTOCOL:
        if attribute not in inspect.getsource(importlib.import_module(module)):
            missing.append(f"{module}: {attribute}")
    try:
        load_inductor_tracing()
    except ImportError as error:
        missing.append(str(error))
    for module, key in _CONFIG_KEYS:
        if not hasattr(_resolve(module, None), key):
            missing.append(f"{module}.{key}")
    missing += _missing_schema_fields()
    missing += _missing_autograd_function_field()
    return missing


def _missing_schema_fields() -> list[str]:
    """The schema fields the capture reads: whether an operation mutates, what it aliases."""
    schema = schema_of(torch.ops.aten.add_.Tensor)
    if schema is None:
        return ["OpOverload._schema"]
    argument = schema.arguments[0] if schema.arguments else None
    fields = [
        ("FunctionSchema.is_mutable", hasattr(schema, "is_mutable")),
        ("FunctionSchema.returns", hasattr(schema, "returns")),
        ("Argument.alias_info", argument is not None and argument.alias_info is not None),
        ("AliasInfo.is_write", argument is not None and getattr(argument.alias_info, "is_write", False)),
    ]
    return [name for name, there in fields if not there]


def _missing_autograd_function_field() -> list[str]:
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return 2 * x

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return 2 * grad

    out = Twice.apply(torch.ones(1, requires_grad=True))
    return [] if autograd_function_of(out.grad_fn) is Twice else ["BackwardCFunction._forward_cls"]
