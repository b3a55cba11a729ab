"""
The tutorials in ``tutorials/`` run from top to bottom in quick mode (``PYRO_TMC_QUICK=1``:
smaller K, fewer steps, smaller subsets), and are saved with the outputs of a full run.

Executing needs ``nbclient``, ``nbformat`` and ``ipykernel`` (a ``python3`` kernel) and the
notebooks themselves import ``matplotlib``; without them these tests skip.
"""

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")

REPO = pathlib.Path(__file__).resolve().parents[1]
TUTORIALS = REPO / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("[0-9][0-9]_*.ipynb"))
KERNEL = "python3"


def _kernel_available() -> bool:
    try:
        from jupyter_client.kernelspec import KernelSpecManager

        return KERNEL in KernelSpecManager().find_kernel_specs()
    except ImportError:
        return False


def test_tutorials_exist_and_are_numbered():
    assert [p.name[:2] for p in NOTEBOOKS] == [f"{i:02d}" for i in range(1, len(NOTEBOOKS) + 1)]
    assert len(NOTEBOOKS) >= 5


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_saved_with_outputs_of_a_full_run(path):
    """Readers on GitHub see results: every code cell ran, in order, and none failed."""
    nb = nbformat.read(path, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    counts = [cell.execution_count for cell in code]
    assert None not in counts, f"{path.name}: cells without outputs of a run"
    assert counts == sorted(counts), f"{path.name}: cells ran out of order"
    errors = [o for cell in code for o in cell.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: saved with an error output"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_in_quick_mode(path, monkeypatch):
    if not _kernel_available():
        pytest.skip(f"no Jupyter kernel named {KERNEL!r} (pip install ipykernel)")
    # The kernel inherits this environment: quick mode, and this checkout's
    # pyro_tmc ahead of any installed copy.
    monkeypatch.setenv("PYRO_TMC_QUICK", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name=KERNEL, resources={"metadata": {"path": str(TUTORIALS)}}
    )
    try:
        client.execute()  # raises CellExecutionError, naming the cell, on any error
    except nbclient.exceptions.CellExecutionError as error:
        # A notebook on an optional extra (e.g. lightning) skips without it; pyro_tmc itself must import.
        if error.ename == "ModuleNotFoundError" and "pyro_tmc" not in error.evalue:
            pytest.skip(f"{path.name} needs an optional package: {error.evalue}")
        raise
