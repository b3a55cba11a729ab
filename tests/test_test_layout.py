"""The tests mirror the package: one folder per layer of ``pyro_tmc`` (plus contrib, experiments and
the benchmarks), shared helpers only in ``tests/common``, and no test file importing another."""

import ast
import pathlib

import pyro_tmc

TESTS = pathlib.Path(__file__).resolve().parent
PACKAGE = pathlib.Path(pyro_tmc.__file__).resolve().parent
#: test folders that are not a subpackage of pyro_tmc, and why they exist
OTHER_FOLDERS = {
    "common": "what the tests share: models with oracles, capture cases",
    "fuzz": "the random model generator and its oracles",
    "benchmarks": "the scripts in benchmarks/ run and read what they should",
}


def _test_folders():
    return {p.name for p in TESTS.iterdir() if p.is_dir() and (p / "__init__.py").exists()}


def test_every_test_folder_is_a_layer_of_the_package_or_says_why():
    layers = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert _test_folders() - set(OTHER_FOLDERS) <= layers


def test_every_test_folder_is_a_package():
    """Without ``__init__.py`` pytest imports a test file by its base name, and two folders could clash."""
    for folder in TESTS.rglob("*"):
        if folder.is_dir() and any(folder.glob("*.py")):
            assert (folder / "__init__.py").exists(), f"{folder.relative_to(TESTS)} has no __init__.py"


def _imported_modules(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            yield from (f"{base}.{alias.name}" for alias in node.names)
            yield base
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def test_no_test_file_imports_another():
    for path in TESTS.rglob("*.py"):
        for module in _imported_modules(path):
            last = module.rsplit(".", 1)[-1]
            assert not last.startswith("test_"), f"{path.relative_to(TESTS)} imports the test file {module}"
