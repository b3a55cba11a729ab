"""The core package stands alone: importing it needs none of the extras (tqdm, matplotlib, lightning),
and no core module imports the experiments, the datasets or the command line.

Each check runs in a fresh interpreter, so that modules imported by other tests cannot hide an import."""

import configparser
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run before any pyro_tmc import. matplotlib and lightning cannot be imported at all. tqdm is a
# requirement of Pyro itself (pyro.infer.mcmc imports it), so it stays importable for Pyro; the
# core modules of pyro_tmc are refused it, and refused pyro_tmc's optional modules.
GUARD = textwrap.dedent(
    """
    import builtins, importlib.util, sys

    UNAVAILABLE = ("matplotlib", "lightning")
    OPTIONAL = (
        "pyro_tmc.experiments",
        "pyro_tmc.experiments.datasets",
        "pyro_tmc.contrib.lightning",
        "pyro_tmc.__main__",
        "pyro_tmc.datasets",  # the old paths of the two above (pyro_tmc.MOVED)
        "pyro_tmc.distributed",
    )

    def is_optional(name):
        return any(name == part or name.startswith(part + ".") for part in OPTIONAL)

    class Unavailable:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in UNAVAILABLE:
                raise ImportError(f"{name} is blocked: not installed, as without the extras")
            return None

    sys.meta_path.insert(0, Unavailable())
    _import = builtins.__import__

    def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
        importer = (globals or {}).get("__name__") or ""
        if importer.partition(".")[0] == "pyro_tmc" and not is_optional(importer):
            full = importlib.util.resolve_name("." * level + name, globals["__package__"]) if level else name
            for imported in [full] + [f"{full}.{attr}" for attr in fromlist or ()]:
                if imported.partition(".")[0] == "tqdm" or is_optional(imported):
                    raise ImportError(f"core module {importer} imports {imported}")
        return _import(name, globals, locals, fromlist, level)

    builtins.__import__ = guarded_import
    """
)

CORE_IMPORTS = GUARD + textwrap.dedent(
    """
    import importlib, json, pkgutil

    import pyro_tmc

    def core_modules(package):
        # pkgutil.walk_packages would import the optional packages to list their contents.
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            if is_optional(info.name):
                continue
            module = importlib.import_module(info.name)
            yield info.name
            if info.ispkg:
                yield from core_modules(module)

    modules = ["pyro_tmc"] + list(core_modules(pyro_tmc))
    leaked = sorted(m for m in sys.modules if m.partition(".")[0] in UNAVAILABLE or is_optional(m))
    print(json.dumps({"modules": modules, "leaked": leaked, "version": repr(pyro_tmc.__version__),
                      "version_is_str": isinstance(pyro_tmc.__version__, str)}))
    """
)


def _run(code):
    command = [sys.executable, "-c", code]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)


def test_core_imports_without_the_extras():
    result = _run(CORE_IMPORTS)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    modules = set(report["modules"])
    core = [
        "estimate.factors",
        "ops.contraction",
        "poutine.proposals",
        "ops.log_density",
        "estimate.scales",
        "infer",
        "poutine",
    ]
    expected = {"pyro_tmc"} | {f"pyro_tmc.{name}" for name in core}
    assert expected <= modules, f"not imported: {sorted(expected - modules)}"
    assert report["leaked"] == []
    assert report["version_is_str"], report["version"]


def test_the_guard_refuses_what_the_core_must_not_import():
    """A negative control: the guard refuses the extras, and a core module's optional imports."""
    code = GUARD + textwrap.dedent(
        """
        core = {"__name__": "pyro_tmc.some_core_module", "__package__": "pyro_tmc"}
        for statement, scope in [
            ("import matplotlib.pyplot", {}),
            ("import lightning", {}),
            ("from tqdm import tqdm", core),
            ("from .experiments import toy", core),
            ("from . import datasets", core),
            ("import pyro_tmc.__main__", core),
        ]:
            try:
                exec(statement, dict(scope))
            except ImportError:
                continue
            raise SystemExit(f"not refused: {statement}")
        """
    )
    result = _run(code)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("missing", ["matplotlib", "tqdm"])
def test_command_line_names_the_extra(missing):
    """``python -m pyro_tmc`` without the experiments extra exits with the line that installs it."""
    code = textwrap.dedent(
        f"""
        import runpy, sys
        import pyro.infer  # Pyro itself imports tqdm, one of its requirements
        sys.modules[{missing!r}] = None  # from here on, imports fail and find_spec says not installed
        sys.argv = ["pyro_tmc", "--help"]
        runpy.run_module("pyro_tmc", run_name="__main__", alter_sys=True)
        """
    )
    result = _run(code)
    assert result.returncode == 1, result.stderr
    assert f"needs {missing}" in result.stderr
    assert 'pip install "pyro-tmc[experiments]"' in result.stderr


def test_extras_hold_the_optional_requirements():
    path = os.path.join(ROOT, "setup.cfg")
    if not os.path.exists(path):
        pytest.skip("no setup.cfg (not a source checkout)")
    config = configparser.ConfigParser()
    config.read(path)

    def names(value):  # the distribution names in a list of requirements, without versions or extras
        lines = [line.strip() for line in value.splitlines() if line.strip()]
        return {re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower() for line in lines}

    core = names(config["options"]["install_requires"])
    extras = config["options.extras_require"]
    assert not core & {"tqdm", "matplotlib", "lightning"}
    assert {"tqdm", "matplotlib"} <= names(extras["experiments"])
    assert "lightning" in names(extras["distributed"])
