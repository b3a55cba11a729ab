"""
MNIST loading for the experiments and tutorials.

:func:`load_mnist` reads the classic pickled split: a gzip'd pickle of
``(train, valid, test)``, each ``(images, labels)`` with images float32 of shape
``(n, 784)`` in [0, 1). The path comes from the ``path`` argument (the command
line's ``--mnist``), else from the environment variable ``PYRO_TMC_MNIST``; without
either, torchvision's copy is downloaded when torchvision is installed and online.

:func:`load_embedded` needs no file and no network (scikit-learn's 8x8 digits when
installed, else a synthetic dataset of 28x28 images generated deterministically), so
that quick runs, tutorials and tests are self-contained. :func:`load_dataset` picks
between them, in that order, and says which one it used (:attr:`Splits.source`).
"""

import gzip
import os
import pickle
from typing import NamedTuple, Optional

import torch

MNIST_ENV = "PYRO_TMC_MNIST"
SPLITS = ("train", "valid", "test")


class Split(NamedTuple):
    """One split of a dataset."""

    images: torch.Tensor  #: float32 ``(n, pixels)``, grey levels in [0, 1)
    labels: torch.Tensor  #: int64 ``(n,)``


class Splits(dict):
    """
    ``{"train": Split, "valid": Split, "test": Split}``, and where they came from.

    :ivar str source: one line naming the data, e.g. ``"MNIST (mnist.pkl.gz, from $PYRO_TMC_MNIST)"``
        or ``"embedded digits (synthetic 28x28 images; no MNIST file given)"``.
    """

    def __init__(self, splits: dict[str, Split], source: str) -> None:
        super().__init__(splits)
        self.source = source


def read_pickled_mnist(path: str) -> dict[str, Split]:
    """
    :param str path: a gzip'd pickle of ``(train, valid, test)``, each ``(images, labels)``.
    :returns: the three splits by name.
    """
    with gzip.open(path, "rb") as f:
        parts = pickle.load(f, encoding="latin1")
    return {
        name: Split(torch.as_tensor(images, dtype=torch.float32), torch.as_tensor(labels, dtype=torch.int64))
        for name, (images, labels) in zip(SPLITS, parts)
    }


def default_download_root() -> str:
    """Where torchvision's MNIST is kept: ``$XDG_CACHE_HOME/pyro_tmc``, by default ``~/.cache/pyro_tmc``."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "pyro_tmc")


def _torchvision_mnist(root: str) -> dict[str, Split]:
    """torchvision's MNIST; its 60,000 training images split 50,000 / 10,000 as in the pickled file."""
    from torchvision.datasets import MNIST

    def split(train: bool):
        data = MNIST(root, train=train, download=True)
        # uint8 / 256 keeps the grey levels in [0, 1), as in the pickled file.
        return data.data.reshape(len(data.data), -1).float() / 256.0, data.targets.long()

    (train_x, train_y), (test_x, test_y) = split(True), split(False)
    return {
        "train": Split(train_x[:50000], train_y[:50000]),
        "valid": Split(train_x[50000:], train_y[50000:]),
        "test": Split(test_x, test_y),
    }


def load_mnist(path: Optional[str] = None, download_root: Optional[str] = None) -> Splits:
    """
    MNIST as three splits of flattened images in [0, 1).

    :param str path: the pickled split; defaults to ``$PYRO_TMC_MNIST``.
    :param str download_root: where torchvision keeps its copy when neither is given
        (default: :func:`default_download_root`).
    :raises FileNotFoundError: when no path is given and torchvision is not installed.
    """
    if path:
        return Splits(read_pickled_mnist(path), f"MNIST ({path})")
    if os.environ.get(MNIST_ENV):
        path = os.environ[MNIST_ENV]
        return Splits(read_pickled_mnist(path), f"MNIST ({path}, from ${MNIST_ENV})")
    root = download_root or default_download_root()
    try:
        return Splits(_torchvision_mnist(root), f"MNIST (torchvision's copy in {root})")
    except ImportError:
        raise FileNotFoundError(
            f"No MNIST file: pass its path (--mnist) or set {MNIST_ENV} to a gzip'd pickle of "
            "(train, valid, test), or install torchvision to download it."
        ) from None


def _sklearn_digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    # Grey levels 0..16; / 17 keeps them in [0, 1).
    return torch.as_tensor(digits.data, dtype=torch.float32) / 17.0, torch.as_tensor(digits.target)


def _synthetic_digits(
    num_images: int = 3000, side: int = 28, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ten random prototypes of blurred strokes; each image is a prototype with its pixels jittered."""
    generator = torch.Generator().manual_seed(seed)
    ramp = torch.linspace(-1.0, 1.0, side)
    rows, cols = ramp[:, None], ramp[None, :]
    prototypes = []
    for _ in range(10):
        centres = torch.rand(4, 2, generator=generator) * 1.2 - 0.6
        blobs = [torch.exp(-((rows - r) ** 2 + (cols - c) ** 2) / 0.04) for r, c in centres]
        prototypes.append(torch.stack(blobs).sum(0).clamp(max=1.0))
    prototypes = torch.stack(prototypes).reshape(10, -1)
    labels = torch.randint(10, (num_images,), generator=generator)
    noise = 0.1 * torch.randn(num_images, side * side, generator=generator)
    images = (prototypes[labels] + noise).clamp(0.0, 0.999)
    return images, labels


def load_embedded(num_valid: int = 300, num_test: int = 300) -> Splits:
    """
    A small digit dataset that needs no file: scikit-learn's 8x8 digits when
    scikit-learn is installed, else synthetic 28x28 images (deterministic).
    The last ``num_valid + num_test`` images are the validation and test splits.
    """
    try:
        images, labels = _sklearn_digits()
        source = "embedded digits (scikit-learn's 8x8 digits, not MNIST)"
    except ImportError:
        images, labels = _synthetic_digits()
        source = "embedded digits (synthetic 28x28 images, not MNIST)"
    ends = (len(images) - num_valid - num_test, len(images) - num_test, len(images))
    starts = (0,) + ends[:2]
    return Splits(
        {name: Split(images[start:end], labels[start:end]) for name, start, end in zip(SPLITS, starts, ends)},
        source,
    )


def load_dataset(
    path: Optional[str] = None,
    embedded: bool = False,
    fallback: bool = False,
    download_root: Optional[str] = None,
) -> Splits:
    """
    MNIST from ``path`` or ``$PYRO_TMC_MNIST`` when either is given; otherwise the
    embedded digits if ``embedded`` (quick runs), else MNIST from torchvision.

    :param bool fallback: when MNIST can't be had from torchvision (not installed, or
        offline), use the embedded digits instead of raising (what the tutorials do).
    :returns: the splits; their ``source`` names the data used.
    """
    if embedded and not (path or os.environ.get(MNIST_ENV)):
        return load_embedded()
    if not fallback:
        return load_mnist(path, download_root)
    try:
        return load_mnist(path, download_root)
    except (FileNotFoundError, RuntimeError, OSError) as error:
        if path or os.environ.get(MNIST_ENV):
            raise  # a file was named: don't hide that it could not be read
        data = load_embedded()
        reason = "torchvision not installed" if isinstance(error, FileNotFoundError) else "download failed"
        return Splits(data, f"{data.source}; no MNIST file given and {reason}")
