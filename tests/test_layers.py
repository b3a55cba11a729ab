"""The package's layers: every import of every module (lazy ones included) runs down, never up,
and no modules import each other in a cycle, but for the known cases listed here, which the
capture engine's rework (issue 43, item 2) is to remove. A new upward import or cycle fails; so
does a listed one that no longer exists (the lists only shrink)."""

import ast
import pathlib

import pyro_tmc

PACKAGE = pathlib.Path(pyro_tmc.__file__).parent
#: lowest first: a module may import its own layer and those before it
LAYERS = (
    "pyro_tmc._torch",
    "pyro_tmc._pyro",
    "pyro_tmc.ops",
    "pyro_tmc.poutine",
    "pyro_tmc.estimate",
    "pyro_tmc.infer",
    "pyro_tmc.compile",
)
#: above every layer: the package itself, the command line, contrib and the experiments
TOP = len(LAYERS)

#: upward imports that remain, each with why, to be removed
KNOWN_UPWARD: set = set()
#: import cycles that remain (each a set of modules), to be removed
KNOWN_CYCLES: list = []


def _modules():
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("pyro_tmc",) + path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _type_checking_nodes(tree) -> set:
    """Imports under ``if TYPE_CHECKING:``, which never run."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skipped.update(id(child) for child in ast.walk(node))
    return skipped


def _imports(path, modules) -> set:
    """The package modules that a file imports, anywhere in it (lazy imports included)."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_nodes(tree)
    imported = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (the package imports absolutely, as Pyro does)"
            base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                imported.add(submodule if submodule in modules else base)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    return {name for name in imported if name in modules}


def _graph():
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _layer(name: str) -> int:
    for index in reversed(range(len(LAYERS))):
        if name == LAYERS[index] or name.startswith(LAYERS[index] + "."):
            return index
    return TOP


def test_imports_run_down_the_layers():
    upward = {
        (a, b)
        for a, targets in _graph().items()
        for b in targets
        if _layer(b) > _layer(a) and b != "pyro_tmc"
    }
    assert upward - KNOWN_UPWARD == set(), "imports that run up the layers"
    assert KNOWN_UPWARD - upward == set(), "listed upward imports that are gone: drop them from the list"


def _reachable(graph, start) -> set:
    seen, todo = set(), [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def _cycles(graph) -> list:
    """The groups of modules that import each other (each reaches every other), of two or more."""
    reach = {name: _reachable(graph, name) for name in graph}
    groups = []
    for name in sorted(graph):
        group = {name} | {other for other in reach[name] if name in reach.get(other, ())}
        if len(group) > 1 and group not in groups:
            groups.append(group)
    return groups


def test_no_import_cycles():
    graph = _graph()
    # a package's __init__ importing its own modules is no cycle of theirs
    graph = {a: {b for b in targets if not a.startswith(b + ".")} for a, targets in graph.items()}
    cycles = _cycles(graph)
    assert [c for c in cycles if c not in KNOWN_CYCLES] == [], "import cycles"
    assert [c for c in KNOWN_CYCLES if c not in cycles] == [], "listed cycles that are gone: drop them"


def test_at_most_six_top_level_modules():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= 6, top
