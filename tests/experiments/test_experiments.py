"""The experiments in quick mode, end to end through the command line, and MNIST loading."""

import csv
import gzip
import importlib.util
import json
import math
import os
import pickle

import numpy as np
import pytest
import torch

from pyro_tmc import datasets
from pyro_tmc.__main__ import main

# The real MNIST file, when the environment names one (CI does where it has a copy).
MNIST_PATH = os.environ.get(datasets.MNIST_ENV)


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
    assert "exact log p(x)" in out and "TMC bound ± s.e." in out
    assert "±: the standard error" in out


def test_threads_option_is_applied_and_restored(monkeypatch):
    seen = []
    monkeypatch.setattr("pyro_tmc.__main__.demo", lambda args: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    main(["--threads", "2"])
    main([])
    assert seen == [2, 1]  # 1 by default
    assert torch.get_num_threads() == before


def test_help_shows_defaults_and_whole_sentences(capsys):
    with pytest.raises(SystemExit):
        main(["toy", "--help"])
    out = capsys.readouterr().out
    assert "(default: results/toy)" in out and "--overwrite" in out and "--threads" in out
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "three recognition models, plain/STL/DReGs gradients" in out  # the vae line, not cut


def check_report(out, folder):
    """What every experiment prints: a smoke-run mark, the data used, the folder written."""
    assert out.startswith("SMOKE RUN (--quick)") and "numbers are not results" in out
    assert "\ndata: " in out
    assert f"wrote {folder}" in out
    info = json.loads((folder / "run.json").read_text())
    assert info["smoke run"] is True and info["data"] and info["command"].startswith("python -m pyro_tmc")


def test_toy(tmp_path, capsys):
    main(["toy", "--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "exact" in out and "±: the standard error" in out and "Blank: not run" in out
    check_report(out, tmp_path)
    assert (tmp_path / "toy.png").stat().st_size > 0
    rows = read_csv(tmp_path / "toy.csv")
    exact = {(r["panel"], r["K"], r["N"]): float(r["mean"]) for r in rows if r["method"] == "exact"}
    bound = {
        (r["panel"], r["K"], r["N"], r["method"]): float(r["mean"]) for r in rows if r["method"] != "exact"
    }
    assert {key[3] for key in bound} == {"TMC", "SMC", "IWAE"}
    for (panel, k, n, method), value in bound.items():
        assert value < exact[panel, k, n] + 2.0, (panel, k, n, method)
    for k in ("4", "16"):  # N=128: TMC's K^(N+1) combinations beat IWAE's K samples by far
        assert bound["K", k, "128", "TMC"] > bound["K", k, "128", "IWAE"] + 50


def test_chain(tmp_path, capsys):
    main(["chain", "--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "exact log p(x)" in out and "±: the standard error" in out
    check_report(out, tmp_path)
    assert (tmp_path / "chain.png").stat().st_size > 0
    exact = math.log(math.exp(-0.25) / math.sqrt(4 * math.pi))  # log N(1; 0, 2)
    rows = read_csv(tmp_path / "chain.csv")
    assert {r["method"] for r in rows} >= {
        "factorised (TMC)",
        "prior, mixture (TMC)",
        "prior, permutation (TMC)",
        "prior, diagonal (TMC)",
    }
    for row in rows:
        assert -30 < float(row["mean"]) < exact + 1.0, row


def test_vae(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(datasets.MNIST_ENV, raising=False)
    main(["vae", "--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    check_report(out, tmp_path)
    assert "untrained" in out and "data: embedded digits" in out
    skip_line = next(line for line in out.splitlines() if "skipped" in line)
    assert "dregs" in skip_line.split("skipped")[1]  # the reason, in the table itself
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
            # the warm-up step is timed apart: two steps of one epoch, the second one timed
            assert float(row["first step s"]) > 0 and float(row["s/epoch"]) > 0


def test_previous_run_is_not_overwritten(tmp_path, capsys):
    main(["chain", "--quick", "--out", str(tmp_path)])
    before = (tmp_path / "chain.csv").read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["chain", "--quick", "--out", str(tmp_path), "--seed", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "previous run" in err and "--overwrite" in err
    assert (tmp_path / "chain.csv").read_text() == before
    main(["chain", "--quick", "--out", str(tmp_path), "--seed", "1", "--overwrite"])
    assert (tmp_path / "chain.csv").read_text() != before


def test_vae_without_mnist_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(datasets.MNIST_ENV, raising=False)

    def no_torchvision(root):
        raise ImportError("torchvision")

    monkeypatch.setattr(datasets, "_torchvision_mnist", no_torchvision)
    with pytest.raises(SystemExit) as exit_info:
        main(["vae", "--out", str(tmp_path / "vae")])
    assert exit_info.value.code == 2
    assert "--mnist" in capsys.readouterr().err


def test_default_output_folder_is_under_the_current_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    main(["chain", "--quick"])
    assert (tmp_path / "results" / "chain" / "chain.csv").exists()
    assert f"wrote {tmp_path / 'results' / 'chain'}" in capsys.readouterr().out


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
    data = datasets.load_dataset(embedded=True)  # a given file wins over embedded
    assert len(data["train"].images) == 4 and datasets.MNIST_ENV in data.source
    assert len(datasets.load_dataset(fallback=True)["train"].images) == 4


def test_fallback_to_embedded(monkeypatch):
    """What the tutorials do: no file and no torchvision download -> the embedded digits, said so."""
    monkeypatch.delenv(datasets.MNIST_ENV, raising=False)

    def no_download(root):
        raise RuntimeError("offline")

    monkeypatch.setattr(datasets, "_torchvision_mnist", no_download)
    data = datasets.load_dataset(fallback=True)
    assert data.source.startswith("embedded digits") and "download failed" in data.source
    with pytest.raises(RuntimeError):
        datasets.load_dataset()
    with pytest.raises(FileNotFoundError):  # a named file that is missing is an error, fallback or not
        datasets.load_dataset("no/such/mnist.pkl.gz", fallback=True)


def test_embedded_fallback(monkeypatch):
    monkeypatch.delenv(datasets.MNIST_ENV, raising=False)
    first, second = datasets.load_dataset(embedded=True), datasets.load_embedded()
    for name in datasets.SPLITS:
        assert torch.equal(first[name].images, second[name].images)  # deterministic
        images = first[name].images
        assert len(images) > 0 and images.min() >= 0 and images.max() < 1


@pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is not None, reason="torchvision would download MNIST"
)
def test_no_source_is_a_clear_error(monkeypatch):
    monkeypatch.delenv(datasets.MNIST_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match=datasets.MNIST_ENV):
        datasets.load_mnist()


@pytest.mark.skipif(not MNIST_PATH, reason=f"${datasets.MNIST_ENV} does not name the MNIST file")
def test_real_mnist():
    data = datasets.load_mnist(MNIST_PATH)
    assert [len(split.images) for split in data.values()] == [50000, 10000, 10000]
    assert data["train"].images.shape[1] == 784
    assert data["test"].images.min() >= 0 and data["test"].images.max() < 1


def test_vae_data_parallel_two_processes(tmp_path):
    """`python -m pyro_tmc vae --devices 2`: two gloo processes train the VAE with TMC."""
    pytest.importorskip("lightning")
    from pyro_tmc.__main__ import main

    main(["vae", "--quick", "--devices", "2", "--out", str(tmp_path)])
    with open(tmp_path / "vae_data_parallel.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row["trained with"] == "tmc" and row["devices"] == "2"
    assert math.isfinite(float(row["train bound"]))
