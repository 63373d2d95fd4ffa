"""Data sets for `purinec train`: images as float32 NCHW, labels as int32."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from purinec.errors import DataError


@dataclass
class Dataset:
    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])

    def __str__(self) -> str:
        return (f"{self.name}: {len(self.train_x)} training and {len(self.test_x)} test "
                f"images of shape {list(self.input_shape)}, {self.num_classes} classes")


def _split(name, x, y, num_classes, test_fraction, seed) -> Dataset:
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return Dataset(name, x[train], y[train], x[test], y[test], num_classes)


def digits(seed: int = 0) -> Dataset:
    """scikit-learn's 8x8 handwritten digits (1797 images, shipped with the package),
    scaled to [0, 1], 20% held out for testing."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images / 16.0).astype(np.float32)[:, None, :, :]
    y = bunch.target.astype(np.int32)
    return _split("digits", x, y, 10, 0.2, seed)


def synthetic(seed: int = 0, n: int = 1024, shape=(1, 8, 8), num_classes: int = 10) -> Dataset:
    """Linearly separable random images: a quick check that training works end to end."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 1, (num_classes, *shape)).astype(np.float32)
    y = rng.integers(0, num_classes, n).astype(np.int32)
    x = centers[y] + rng.normal(0, 0.5, (n, *shape)).astype(np.float32)
    return _split("synthetic", x, y, num_classes, 0.2, seed)


DATASETS = {"digits": digits, "synthetic": synthetic}


def load_dataset(name: str, seed: int = 0) -> Dataset:
    try:
        return DATASETS[name](seed)
    except KeyError:
        raise DataError(f"unknown data set {name!r}; available: {', '.join(DATASETS)}") from None


def batches(x: np.ndarray, y: np.ndarray, batch: int, rng: np.random.Generator | None
            ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Full batches in shuffled order (training) or in order (rng None) with the last one
    padded by repeating rows; callers of the padded form count only the real rows."""
    n = len(x)
    order = rng.permutation(n) if rng is not None else np.arange(n)
    if rng is not None:
        for start in range(0, n - batch + 1, batch):
            idx = order[start:start + batch]
            yield x[idx], y[idx]
        return
    for start in range(0, n, batch):
        idx = order[start:start + batch]
        if len(idx) < batch:
            idx = np.concatenate([idx, np.resize(idx, batch - len(idx))])
        yield x[idx], y[idx]
