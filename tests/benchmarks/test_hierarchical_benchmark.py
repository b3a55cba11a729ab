"""benchmarks/hierarchical.py runs: both real data sets ship with it, and both methods give finite
bounds and held-out log-likelihoods (a smoke run; the figures themselves are the benchmark's)."""

import importlib.util
import math

import torch

from tests.common import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "hierarchical.py"


def _load():
    spec = importlib.util.spec_from_file_location("hierarchical_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_on_both_data_sets(fresh_pyro, capsys):
    benchmark = _load()
    argv = ["--quick", "--iterations", "3", "--threads", str(torch.get_num_threads())]  # leave it as it is
    rows = benchmark.main(argv + ["--datasets", "bus_breakdown"])
    rows += benchmark.main(argv + ["--datasets", "radon", "--methods", "qem"])  # radon's SVI is the slow one
    assert [(row["data"], row["method"]) for row in rows] == [
        ("bus_breakdown", "svi"),
        ("bus_breakdown", "qem"),
        ("radon", "qem"),
    ]
    for row in rows:
        assert math.isfinite(row["bound"]) and math.isfinite(row["predictive"])
        assert row["predictive"] < 0 and row["effective_draws"] >= 1
    assert "| radon | qem |" in capsys.readouterr().out
