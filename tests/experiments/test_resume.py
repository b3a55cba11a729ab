"""
Runs that resume: a training run stopped after an epoch and resumed from its checkpoint gives what
an uninterrupted run gives (the same parameters, optimiser state, loss history and result rows).

The experiments with a training loop are the VAE grid (``python -m pyro_tmc vae``) and the longer
VAE run (``benchmarks/vae_long_run.py``); ``toy`` and ``chain`` only estimate, with nothing to train.
"""

import csv
import gzip
import importlib.util
import os
import pickle
import random

import numpy as np
import pytest
import torch

from pyro.optim import Adam

from pyro_tmc import datasets
from pyro_tmc.__main__ import main
from pyro_tmc.experiments.checkpoint import Checkpoint
from pyro_tmc.experiments.vae import CHECKPOINTS
from tests.common import REPO_ROOT

# Two objectives, two gradient estimators: four configurations of two steps per epoch (--quick).
GRID = ["vae", "--quick", "--recognition", "factorised", "--objectives", "tmc", "iwae"]
GRID += ["--variance-reductions", "none", "stl"]
RESULTS = ("train bound", "test IWAE", "test TMC", "steps")  # the vae.csv columns that are not timings
LONG_RUN = REPO_ROOT / "benchmarks" / "vae_long_run.py"


class Killed(Exception):
    """Stands for the process being killed."""


@pytest.fixture(autouse=True)
def one_thread_no_mnist(monkeypatch):
    monkeypatch.delenv(datasets.MNIST_ENV, raising=False)  # the embedded digits
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The VAE grid trained for two epochs in one go: the reference."""
    out = tmp_path_factory.mktemp("uninterrupted")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.delenv(datasets.MNIST_ENV, raising=False)  # the embedded digits
        try:
            main(GRID + ["--epochs", "2", "--out", str(out)])
        finally:
            torch.set_num_threads(threads)
    return out


def read_rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def assert_same_training(resumed, reference):
    """Two checkpoints of the same epoch hold the same parameters, Adam state and losses, exactly."""
    assert resumed["epoch"] == reference["epoch"] and resumed["global_step"] == reference["global_step"]
    assert resumed["loss_history"] == reference["loss_history"]
    params, expected = resumed["param_store"]["params"], reference["param_store"]["params"]
    assert params.keys() == expected.keys()
    for name in expected:
        assert torch.equal(params[name], expected[name]), name
    moments, expected = resumed["optimizer"], reference["optimizer"]
    assert moments.keys() == expected.keys()
    for name in expected:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(moments[name]["state"][0][key], expected[name]["state"][0][key]), (name, key)


def assert_same_grid(out, reference):
    checkpoints = sorted(os.listdir(reference / CHECKPOINTS))
    assert len(checkpoints) == 4 and sorted(os.listdir(out / CHECKPOINTS)) == checkpoints  # no temp file
    for name in checkpoints:
        assert_same_training(
            torch.load(out / CHECKPOINTS / name, weights_only=False),
            torch.load(reference / CHECKPOINTS / name, weights_only=False),
        )
    rows, expected = read_rows(out / "vae.csv"), read_rows(reference / "vae.csv")
    assert [{c: r[c] for c in RESULTS} for r in rows] == [{c: r[c] for c in RESULTS} for r in expected]


def test_vae_grid_killed_inside_a_configuration_resumes(tmp_path, monkeypatch, uninterrupted):
    """
    Killed in the second configuration's second epoch, after its first epoch's checkpoint: on
    --resume the first configuration is only evaluated, the second goes on, the others start.
    """
    save = Checkpoint.save
    saves = []

    def save_then_die(self, epoch, *args, **kwargs):
        save(self, epoch, *args, **kwargs)
        saves.append(epoch)
        if saves == [1, 2, 1]:
            raise Killed

    monkeypatch.setattr(Checkpoint, "save", save_then_die)
    with pytest.raises(Killed):
        main(GRID + ["--epochs", "2", "--out", str(tmp_path)])
    monkeypatch.setattr(Checkpoint, "save", save)
    assert len(os.listdir(tmp_path / CHECKPOINTS)) == 2
    main(GRID + ["--epochs", "2", "--resume", "--out", str(tmp_path)])
    assert_same_grid(tmp_path, uninterrupted)


def test_vae_grid_resumed_for_more_epochs(tmp_path, capsys, uninterrupted):
    """One epoch, then --resume --epochs 2: the same as two epochs in one go."""
    main(GRID + ["--epochs", "1", "--out", str(tmp_path)])
    main(GRID + ["--epochs", "2", "--resume", "--out", str(tmp_path)])
    assert "resume: 4 of 4 configurations have a checkpoint" in capsys.readouterr().out
    assert_same_grid(tmp_path, uninterrupted)


def test_vae_refuses_a_checkpoint_it_cannot_continue(tmp_path, capsys):
    grid = ["vae", "--quick", "--recognition", "factorised", "--objectives", "tmc"]
    grid += ["--variance-reductions", "none", "--out", str(tmp_path)]
    main(grid + ["--epochs", "2"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:  # a previous run: not resumed unless asked
        main(grid + ["--epochs", "2"])
    assert exit_info.value.code == 2 and "--resume to continue it" in capsys.readouterr().err
    for other, complaint in (
        (["--epochs", "2", "--num-samples", "3"], "num_samples: 4 then, 3 now"),
        (["--epochs", "1"], "2 epochs, more than the 1 asked for"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(grid + other + ["--resume"])
        assert exit_info.value.code == 2 and complaint in capsys.readouterr().err


def load_long_run():
    spec = importlib.util.spec_from_file_location("vae_long_run", LONG_RUN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_tiny_mnist(path, pixels=64):
    """A pickled (train, valid, test) split in MNIST's format: 24 training and 8 test images."""
    rng = np.random.default_rng(0)
    parts = tuple(
        (rng.random((n, pixels), dtype=np.float32) * 0.99, rng.integers(10, size=n)) for n in (24, 4, 8)
    )
    with gzip.open(path, "wb") as f:
        pickle.dump(parts, f)


def test_long_run_resumed_equals_uninterrupted(tmp_path):
    long_run = load_long_run()
    write_tiny_mnist(tmp_path / "mnist.pkl.gz")
    common = ["--mnist", str(tmp_path / "mnist.pkl.gz"), "--objective", "tmc", "--num-samples", "3"]
    common += ["--batch-size", "8", "--threads", "1"]
    long_run.main(common + ["--epochs", "2", "--out", str(tmp_path / "uninterrupted")])
    long_run.main(common + ["--epochs", "1", "--out", str(tmp_path / "resumed")])
    long_run.main(common + ["--epochs", "2", "--resume", "--out", str(tmp_path / "resumed")])

    def load(folder, name):
        return torch.load(tmp_path / folder / name, weights_only=False)

    assert_same_training(load("resumed", "vae_long_tmc.ckpt"), load("uninterrupted", "vae_long_tmc.ckpt"))
    untimed = [c for c in long_run.FIELDS if not c.endswith(" s")]
    rows, expected = (read_rows(tmp_path / f / "vae_long_tmc.csv") for f in ("resumed", "uninterrupted"))
    assert len(rows) == 2 and [{c: r[c] for c in untimed} for r in rows] == [
        {c: r[c] for c in untimed} for r in expected
    ]
    weights, expected = load("resumed", "vae_long_tmc.pt"), load("uninterrupted", "vae_long_tmc.pt")
    for part in ("generative", "recognition"):
        for name, value in expected[part].items():
            assert torch.equal(weights[part][name], value), (part, name)
    with pytest.raises(SystemExit, match="2 epochs, more than the 1 asked for"):
        long_run.main(common + ["--epochs", "1", "--resume", "--out", str(tmp_path / "resumed")])


def test_checkpoint_restores_every_generator(tmp_path):
    """Python's, NumPy's and torch's global generators and a named one (a loader's) are restored."""
    loader = torch.Generator().manual_seed(3)
    checkpoint = Checkpoint(str(tmp_path / "run.ckpt"), Adam({}), generators={"loader": loader})
    checkpoint.save(1, 0)
    draws = (random.random(), np.random.rand(), torch.rand(()).item(), torch.rand((), generator=loader))
    assert sorted(os.listdir(tmp_path)) == ["run.ckpt"]  # written atomically: no temporary left
    assert checkpoint.load()["epoch"] == 1
    assert (
        random.random(),
        np.random.rand(),
        torch.rand(()).item(),
        torch.rand((), generator=loader),
    ) == draws
