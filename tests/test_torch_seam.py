"""torch's private and experimental internals, reached only through ``pyro_tmc._torch``, must all be there."""

import ast
import configparser
import pathlib
import re

import pytest
import torch
from packaging.version import Version

from pyro_tmc import _torch
from pyro_tmc._torch import missing_private_names

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pyro_tmc"

#: attributes of torch's objects that are torch's private business (a node's ``_schema``, a graph's
#: ``_root``, a backward node's ``_forward_cls``, the ``_dynamo`` marks on a tensor), read directly
#: or named as a string (``getattr(op, "_schema", None)``)
PRIVATE_ATTRIBUTES = {"_schema", "_root", "_forward_cls", "_dynamo"}

#: private torch names that modules still use directly, each (module, name), to be moved behind the
#: seam: the list only shrinks (a listed use that is gone fails, so that it is dropped here)
KNOWN: set = set()


def _private_module(dotted: str) -> bool:
    """Whether a dotted torch path reaches a private or experimental part of torch."""
    parts = dotted.split(".")
    if parts[0] != "torch" or parts[1:2] == ["ops"]:  # torch.ops.aten._foo: an operator, not a module
        return False
    # torch.__version__ is public
    private = [p for p in parts[1:] if p.startswith("_") and not p.endswith("__")]
    return bool(private) or "experimental" in parts[1:]


def _attribute_chain(node: ast.Attribute) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _uses_in(node: ast.AST) -> set:
    """The private torch names one syntax node uses."""
    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
        private = _private_module(node.module)
        return {f"{node.module}.{a.name}" for a in node.names if private or a.name.startswith("_")}
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if _private_module(alias.name)}
    if isinstance(node, ast.Attribute):
        chain = _attribute_chain(node)
        found = {chain} if _private_module(chain) else set()
        return found | ({f".{node.attr}"} if node.attr in PRIVATE_ATTRIBUTES else set())
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        dotted = re.fullmatch(r"torch(\.\w+)+", node.value) and _private_module(node.value)
        return {repr(node.value)} if dotted or node.value in PRIVATE_ATTRIBUTES else set()
    return set()


def private_torch_uses(source: str) -> set:
    """The private torch names a module's source uses: imports, ``torch._x`` accesses, private attributes."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        found |= _uses_in(node)
    return _outermost(found)


def _outermost(found: set) -> set:
    """``torch._ops.OpOverload`` rather than also ``torch._ops``: the longest chain of each access."""
    return {name for name in found if not any(other.startswith(name + ".") for other in found)}


def _package_uses() -> set:
    uses = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_torch.py" and path.parent == PACKAGE:
            continue
        module = path.relative_to(PACKAGE).as_posix()
        uses.update((module, name) for name in private_torch_uses(path.read_text()))
    return uses


def test_every_private_torch_name_exists():
    missing = missing_private_names()
    assert not missing, f"torch {torch.__version__} lacks private names pyro_tmc uses: {', '.join(missing)}"


def test_a_missing_name_is_named(monkeypatch):
    """The version check can fail: a name this torch lacks is reported by its path."""
    monkeypatch.setitem(_torch._LAZY, "gone", ("torch._inductor", "no_such_name"))
    monkeypatch.setattr(_torch, "_CONFIG_KEYS", (("torch._functorch.config", "no_such_key"),))
    missing = missing_private_names()
    assert missing == ["torch._inductor.no_such_name", "torch._functorch.config.no_such_key"]


def test_private_torch_names_go_through_the_seam():
    """No module but pyro_tmc/_torch.py imports or reads a private or experimental torch name."""
    uses = _package_uses()
    assert sorted(uses - KNOWN) == [], "private torch names outside pyro_tmc/_torch.py: move them to the seam"
    assert sorted(KNOWN - uses) == [], "listed uses that are gone: drop them from KNOWN"


def test_the_check_sees_each_kind_of_use():
    """The detector itself: each way a module can reach into torch's internals is caught."""
    source = (
        "import torch\n"
        "import torch._dynamo\n"
        "from torch._inductor import compile\n"
        "from torch.fx.experimental.proxy_tensor import make_fx\n"
        "from torch.distributions.transforms import _InverseTransform\n"
        "from torch.fx import Graph\n"
        "x = isinstance(op, torch._ops.OpOverload)\n"
        "y = node.target._schema\n"
        "z = getattr(node, '_forward_cls', None)\n"
        "w = name.startswith('torch._higher_order_ops')\n"
        "v = torch.ops.aten._local_scalar_dense.default\n"
    )
    assert private_torch_uses(source) == {
        "torch._dynamo",
        "torch._inductor.compile",
        "torch.fx.experimental.proxy_tensor.make_fx",
        "torch.distributions.transforms._InverseTransform",
        "torch._ops.OpOverload",
        "._schema",
        "'_forward_cls'",
        "'torch._higher_order_ops'",
    }


def _torch_floor(setup_cfg: str) -> Version:
    config = configparser.ConfigParser()
    config.read_string(setup_cfg)
    requirements = config["options"]["install_requires"].split()
    (floor,) = [r.split(">=")[1] for r in requirements if re.fullmatch(r"torch>=[\d.]+", r)]
    return Version(floor)


def _ci_torch_pins(ci_run: str) -> list:
    return [Version(pin) for pin in re.findall(r"\btorch==([\d.]+)", ci_run)]


def test_the_torch_floor_is_a_tested_torch():
    """setup.cfg admits no torch older than the oldest that CI installs and tests."""
    setup_cfg, ci_run = ROOT / "setup.cfg", ROOT / ".ci" / "run"
    if not (setup_cfg.exists() and ci_run.exists()):
        pytest.skip("run from outside the checkout (an installed wheel's tests)")
    floor, pins = _torch_floor(setup_cfg.read_text()), _ci_torch_pins(ci_run.read_text())
    assert pins, ".ci/run pins no torch"
    assert floor == min(pins), f"setup.cfg says torch>={floor}; CI tests torch {', '.join(map(str, pins))}"
    assert Version(torch.__version__.split("+")[0]) >= floor
