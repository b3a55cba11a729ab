"""The experiments in quick mode, end to end through the command line, and MNIST loading."""

import csv
import gzip
import importlib.util
import math
import os
import pickle

import numpy as np
import pytest
import torch

from pyro_tmc import datasets
from pyro_tmc.__main__ import main

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MNIST_PATH = os.path.join(REPO_ROOT, "..", "shared", "data", "mnist.pkl.gz")


@pytest.fixture(autouse=True)
def one_thread():
    # Small tensors on shared cores: thread hand-offs cost more than they save.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_demo_is_the_default(capsys):
    main(["--ks", "1", "4", "--repeats", "2"])
    out = capsys.readouterr().out
    assert "exact log p(x)" in out and "TMC bound" in out


def test_toy(tmp_path, capsys):
    main(["toy", "--quick", "--out", str(tmp_path)])
    assert "exact" in capsys.readouterr().out
    assert (tmp_path / "toy.png").stat().st_size > 0
    rows = read_csv(tmp_path / "toy.csv")
    exact = {(r["panel"], r["K"], r["N"]): float(r["mean"]) for r in rows if r["method"] == "exact"}
    bound = {(r["panel"], r["K"], r["N"], r["method"]): float(r["mean"]) for r in rows if r["method"] != "exact"}
    assert {key[3] for key in bound} == {"TMC", "SMC", "IWAE"}
    for (panel, k, n, method), value in bound.items():
        assert value < exact[panel, k, n] + 2.0, (panel, k, n, method)
    for k in ("4", "16"):  # N=128: TMC's K^(N+1) combinations beat IWAE's K samples by far
        assert bound["K", k, "128", "TMC"] > bound["K", k, "128", "IWAE"] + 50


def test_chain(tmp_path, capsys):
    main(["chain", "--quick", "--out", str(tmp_path)])
    assert "exact log p(x)" in capsys.readouterr().out
    assert (tmp_path / "chain.png").stat().st_size > 0
    exact = math.log(math.exp(-0.25) / math.sqrt(4 * math.pi))  # log N(1; 0, 2)
    rows = read_csv(tmp_path / "chain.csv")
    assert {r["method"] for r in rows} >= {"factorised (TMC)", "prior, mixture (TMC)",
                                           "prior, permutation (TMC)", "prior, diagonal (TMC)"}
    for row in rows:
        assert -30 < float(row["mean"]) < exact + 1.0, row


def test_vae(tmp_path, capsys):
    main(["vae", "--quick", "--out", str(tmp_path)])
    assert "skipped" in capsys.readouterr().out
    for name in ("vae.csv", "vae_bounds.png", "vae_time.png"):
        assert (tmp_path / name).stat().st_size > 0
    rows = read_csv(tmp_path / "vae.csv")
    skipped = {(r["recognition"], r["trained with"], r["variance reduction"]) for r in rows if r["note"]}
    assert skipped == {("small", "tmc", "dregs")}
    data_dim = 784
    for row in rows:
        if not row["note"]:
            for column in ("train bound", "test IWAE", "test TMC"):
                assert -data_dim * math.log(2) * 2 < float(row[column]) < 0, row


def write_pickled(path, sizes=(5, 3, 2), pixels=784):
    rng = np.random.default_rng(0)
    parts = tuple((rng.random((n, pixels), dtype=np.float32) * 0.99, rng.integers(10, size=n)) for n in sizes)
    with gzip.open(path, "wb") as f:
        pickle.dump(parts, f)
    return parts


def test_read_pickled_file(tmp_path):
    parts = write_pickled(tmp_path / "tiny.pkl.gz")
    data = datasets.load_mnist(str(tmp_path / "tiny.pkl.gz"))
    assert list(data) == ["train", "valid", "test"]
    for split, (images, labels) in zip(data.values(), parts):
        assert split.images.dtype == torch.float32 and split.labels.dtype == torch.int64
        assert torch.equal(split.images, torch.as_tensor(images))
        assert torch.equal(split.labels, torch.as_tensor(labels))


def test_environment_variable(tmp_path, monkeypatch):
    write_pickled(tmp_path / "tiny.pkl.gz", sizes=(4, 2, 2))
    monkeypatch.setenv(datasets.MNIST_ENV, str(tmp_path / "tiny.pkl.gz"))
    assert len(datasets.load_mnist()["train"].images) == 4
    assert len(datasets.load_dataset(embedded=True)["train"].images) == 4  # a given file wins over embedded


def test_embedded_fallback(monkeypatch):
    monkeypatch.delenv(datasets.MNIST_ENV, raising=False)
    first, second = datasets.load_dataset(embedded=True), datasets.load_embedded()
    for name in datasets.SPLITS:
        assert torch.equal(first[name].images, second[name].images)  # deterministic
        images = first[name].images
        assert len(images) > 0 and images.min() >= 0 and images.max() < 1


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision would download MNIST")
def test_no_source_is_a_clear_error(monkeypatch):
    monkeypatch.delenv(datasets.MNIST_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match=datasets.MNIST_ENV):
        datasets.load_mnist()


@pytest.mark.skipif(not os.path.exists(MNIST_PATH), reason="the MNIST file is not present")
def test_real_mnist():
    data = datasets.load_mnist(MNIST_PATH)
    assert [len(split.images) for split in data.values()] == [50000, 10000, 10000]
    assert data["train"].images.shape[1] == 784
    assert 0 <= data["test"].images.min() and data["test"].images.max() < 1


def test_vae_data_parallel_two_processes(tmp_path):
    """`python -m pyro_tmc vae --devices 2`: two gloo processes train the VAE with TMC."""
    pytest.importorskip("lightning")
    from pyro_tmc.__main__ import main

    main(["vae", "--quick", "--devices", "2", "--out", str(tmp_path)])
    with open(tmp_path / "vae_data_parallel.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row["trained with"] == "tmc" and row["devices"] == "2"
    assert math.isfinite(float(row["train bound"]))
