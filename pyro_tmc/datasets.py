"""
MNIST loading for the experiments.

:func:`load_mnist` reads the classic pickled split: a gzip'd pickle of
``(train, valid, test)``, each ``(images, labels)`` with images float32 of shape
``(n, 784)`` in [0, 1). The path comes from the ``path`` argument, else from the
environment variable ``PYRO_TMC_MNIST``; without either, torchvision's copy is
downloaded when torchvision is installed and online.

:func:`load_embedded` needs no file and no network (scikit-learn's 8x8 digits when
installed, else a synthetic binary dataset generated deterministically), so that
quick runs and tests are self-contained. :func:`load_dataset` picks between them.
"""

import gzip
import os
import pickle
from typing import Dict, NamedTuple, Optional, Tuple

import torch

MNIST_ENV = "PYRO_TMC_MNIST"
SPLITS = ("train", "valid", "test")


class Split(NamedTuple):
    images: torch.Tensor  # float32 (n, pixels), grey levels in [0, 1)
    labels: torch.Tensor  # int64 (n,)


def read_pickled_mnist(path: str) -> Dict[str, Split]:
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


def _torchvision_mnist(root: str) -> Dict[str, Split]:
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


def load_mnist(path: Optional[str] = None, download_root: str = "data") -> Dict[str, Split]:
    """
    MNIST as three splits of flattened images in [0, 1).

    :param str path: the pickled split; defaults to ``$PYRO_TMC_MNIST``.
    :param str download_root: where torchvision keeps its copy when neither is given.
    :raises FileNotFoundError: when no path is given and torchvision is not installed.
    """
    path = path or os.environ.get(MNIST_ENV)
    if path:
        return read_pickled_mnist(path)
    try:
        return _torchvision_mnist(download_root)
    except ImportError:
        raise FileNotFoundError(
            f"No MNIST file: pass its path or set {MNIST_ENV} to a gzip'd pickle of "
            "(train, valid, test), or install torchvision to download it."
        ) from None


def _sklearn_digits() -> Tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    # Grey levels 0..16; / 17 keeps them in [0, 1).
    return torch.as_tensor(digits.data, dtype=torch.float32) / 17.0, torch.as_tensor(digits.target)


def _synthetic_digits(num_images: int = 3000, side: int = 28, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
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


def load_embedded(num_valid: int = 300, num_test: int = 300) -> Dict[str, Split]:
    """
    A small digit dataset that needs no file: scikit-learn's 8x8 digits when
    scikit-learn is installed, else synthetic 28x28 images (deterministic).
    The last ``num_valid + num_test`` images are the validation and test splits.
    """
    try:
        images, labels = _sklearn_digits()
    except ImportError:
        images, labels = _synthetic_digits()
    ends = (len(images) - num_valid - num_test, len(images) - num_test, len(images))
    starts = (0,) + ends[:2]
    return {
        name: Split(images[start:end], labels[start:end])
        for name, start, end in zip(SPLITS, starts, ends)
    }


def load_dataset(path: Optional[str] = None, embedded: bool = False) -> Dict[str, Split]:
    """
    MNIST from ``path`` or ``$PYRO_TMC_MNIST`` when either is given; otherwise the
    embedded digits if ``embedded`` (quick runs), else MNIST from torchvision.
    """
    if embedded and not (path or os.environ.get(MNIST_ENV)):
        return load_embedded()
    return load_mnist(path)
