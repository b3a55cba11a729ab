"""Pyro's private internals, reached only through ``pyro_tmc._pyro``, must all be there."""

import pathlib
import re

import pyro

from pyro_tmc._pyro import missing_private_names

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "pyro_tmc"


def test_every_private_pyro_name_exists():
    missing = missing_private_names()
    assert not missing, f"pyro {pyro.__version__} lacks private names pyro_tmc uses: {', '.join(missing)}"


def test_private_pyro_imports_go_through_the_seam():
    """No module but pyro_tmc/_pyro.py imports a private name from pyro."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "_pyro.py":
            continue
        for line in path.read_text().splitlines():
            # pyro itself, not this package (pyro_tmc imports absolutely, as Pyro does)
            if re.match(r"\s*from pyro(\.[\w.]*)? import .*\b_[A-Za-z]", line) or re.match(
                r"\s*import pyro(\.[\w.]*)?\._", line
            ):
                offenders.append(f"{path.relative_to(PACKAGE)}: {line.strip()}")
    assert not offenders, offenders
