"""Data sets for `purinec train`: images in NCHW, labels as int32.

Built in: scikit-learn's digits and synthetic data. From files (nothing is downloaded):
MNIST's IDX files and CIFAR-10's binary batches. Images read from files stay uint8 in
memory (CIFAR-10 would take 600 MB as float32); `batches` hands out float32 in [0, 1].
"""

from __future__ import annotations

import gzip
import os
import zlib
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


def resized(data: Dataset, shape: tuple[int, int, int]) -> Dataset:
    """``data`` with its (float) images scaled bilinearly to ``shape`` (C, H, W), gray
    images repeated over the C channels: the built-in sets for a model made for larger
    images than theirs."""
    channels, height, width = shape
    have = data.input_shape[0]
    if have not in (1, channels):
        raise DataError(f"{data.name} has {have} channels; it cannot be made into images "
                        f"of shape {list(shape)}")

    def scale(images: np.ndarray) -> np.ndarray:
        x = _interpolated(_interpolated(images, height, axis=2), width, axis=3)
        return np.repeat(x, channels // have, axis=1).astype(np.float32)

    return Dataset(data.name, scale(data.train_x), data.train_y,
                   scale(data.test_x), data.test_y, data.num_classes)


def _interpolated(x: np.ndarray, size: int, axis: int) -> np.ndarray:
    """Linear interpolation of ``x`` to ``size`` samples along ``axis`` (pixel centres
    kept aligned, as image resizing does)."""
    n = x.shape[axis]
    position = np.clip((np.arange(size) + 0.5) * n / size - 0.5, 0, n - 1)
    low = np.floor(position).astype(np.intp)
    high = np.minimum(low + 1, n - 1)
    weight = (position - low).reshape([size if d == axis else 1 for d in range(x.ndim)])
    return np.take(x, low, axis) * (1 - weight) + np.take(x, high, axis) * weight


# -- MNIST: IDX files ---------------------------------------------------------------------

MNIST_FILES = {  # split -> (images, labels), as distributed (each may also end in .gz)
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
IDX_UBYTE = 0x08  # the IDX element-type code of unsigned bytes, the only one MNIST uses


def read_idx(path: str, ndim: int) -> np.ndarray:
    """An IDX file of unsigned bytes with ``ndim`` dimensions (optionally gzipped).

    Layout: two zero bytes, the element-type code, the number of dimensions, each
    dimension as a big-endian uint32, then the elements in C order."""
    data = _read_bytes(path)
    if len(data) < 4:
        raise DataError(f"{path}: truncated IDX file: {len(data)} bytes, no header")
    zero, dtype_code, file_ndim = data[:2], data[2], data[3]
    if zero != b"\0\0":
        raise DataError(f"{path}: not an IDX file (bad magic number "
                        f"0x{int.from_bytes(data[:4], 'big'):08x})")
    if dtype_code != IDX_UBYTE or file_ndim != ndim:
        raise DataError(f"{path}: bad magic number 0x{int.from_bytes(data[:4], 'big'):08x}, "
                        f"expected 0x{(IDX_UBYTE << 8) | ndim:08x} (unsigned bytes, {ndim} "
                        f"dimension(s))")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"{path}: truncated IDX header: {len(data)} bytes, need {header}")
    shape = tuple(int(d) for d in np.frombuffer(data, ">u4", ndim, offset=4))
    want = int(np.prod(shape, dtype=np.int64))
    have = len(data) - header
    if have != want:
        problem = "truncated" if have < want else "longer than its header says"
        raise DataError(f"{path}: {problem}: the header declares shape {list(shape)} "
                        f"({want} bytes of data), the file has {have}")
    return np.frombuffer(data, np.uint8, want, offset=header).reshape(shape)


def _read_bytes(path: str) -> bytes:
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return f.read()
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
        raise DataError(f"{path}: cannot read: {err}") from None


def _find_file(directory: str, names: tuple[str, ...], what: str) -> str:
    for name in names:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    others = f" (also looked for {', '.join(names[1:])})" if names[1:] else ""
    raise DataError(f"{what}: file {os.path.join(directory, names[0])} not found{others}")


def _mnist_split(directory: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    images_name, labels_name = MNIST_FILES[split]
    images_path = _find_file(directory, (images_name, images_name + ".gz"), "mnist")
    labels_path = _find_file(directory, (labels_name, labels_name + ".gz"), "mnist")
    images = read_idx(images_path, 3)
    labels = read_idx(labels_path, 1)
    if len(images) != len(labels):
        raise DataError(f"{images_path} has {len(images)} images but {labels_path} has "
                        f"{len(labels)} labels")
    _check_labels(labels_path, labels, 10)
    return images[:, None, :, :], labels.astype(np.int32)


def mnist(directory: str) -> Dataset:
    """MNIST from its four IDX files in ``directory`` (as distributed, optionally .gz);
    pixels kept as bytes and scaled to [0, 1] batch by batch (see `batches`)."""
    train_x, train_y = _mnist_split(directory, "train")
    test_x, test_y = _mnist_split(directory, "test")
    return Dataset("mnist", train_x, train_y, test_x, test_y, 10)


# -- CIFAR-10: binary batches -------------------------------------------------------------

CIFAR10_TRAIN = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
CIFAR10_TEST = "test_batch.bin"
CIFAR10_SHAPE = (3, 32, 32)
CIFAR10_RECORD = 1 + 3 * 32 * 32  # one label byte, then the red, green and blue planes


def read_cifar10_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 binary batch: images (N, 3, 32, 32) as bytes and labels (N,)."""
    data = _read_bytes(path)
    if not data or len(data) % CIFAR10_RECORD:
        raise DataError(f"{path}: truncated or not a CIFAR-10 binary batch: {len(data)} bytes "
                        f"is not a whole number of {CIFAR10_RECORD}-byte records")
    records = np.frombuffer(data, np.uint8).reshape(-1, CIFAR10_RECORD)
    labels = records[:, 0].astype(np.int32)
    _check_labels(path, labels, 10)
    return records[:, 1:].reshape(-1, *CIFAR10_SHAPE), labels


def cifar10(directory: str) -> Dataset:
    """CIFAR-10 from its binary batches in ``directory`` (data_batch_1.bin ...
    data_batch_5.bin, test_batch.bin); pixels kept as bytes, scaled per batch."""
    paths = [_find_file(directory, (name,), "cifar10") for name in CIFAR10_TRAIN]
    train = [read_cifar10_batch(p) for p in paths]
    test_x, test_y = read_cifar10_batch(_find_file(directory, (CIFAR10_TEST,), "cifar10"))
    return Dataset("cifar10", np.concatenate([x for x, _ in train]),
                   np.concatenate([y for _, y in train]), test_x, test_y, 10)


def _check_labels(path: str, labels: np.ndarray, num_classes: int) -> None:
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if len(bad):
        raise DataError(f"{path}: label {int(labels[bad[0]])} of record {int(bad[0])} is not "
                        f"a class in 0..{num_classes - 1}")


# -- choosing a data set ----------------------------------------------------------------

DATASETS = {"digits": digits, "synthetic": synthetic}  # built in, no files needed
FILE_DATASETS = {"mnist": mnist, "cifar10": cifar10}  # read from a directory

DATA_HELP = ("digits (scikit-learn's 8x8 digits, the default), synthetic, mnist:DIR (the "
             "four MNIST IDX files, optionally .gz), cifar10:DIR (CIFAR-10's binary "
             "batches), or a DIR holding either")


def load_dataset(spec: str, seed: int = 0) -> Dataset:
    """A data set by name (``digits``, ``synthetic``), as ``mnist:DIR`` or ``cifar10:DIR``,
    or a directory whose files say which it is. ``seed`` splits the built-in sets."""
    if spec in DATASETS:
        return DATASETS[spec](seed)
    kind, sep, directory = spec.partition(":")
    if sep and kind in FILE_DATASETS:
        return FILE_DATASETS[kind](_directory(directory, spec))
    if spec in FILE_DATASETS:
        raise DataError(f"data set {spec} is read from its files: give --data {spec}:DIR "
                        "(purinec downloads nothing)")
    if os.path.isdir(spec):
        return FILE_DATASETS[_detect(spec)](spec)
    raise DataError(f"unknown data set {spec!r}; use {DATA_HELP}")


def _directory(directory: str, spec: str) -> str:
    if not directory:
        raise DataError(f"--data {spec}: give the directory after the colon")
    if not os.path.isdir(directory):
        raise DataError(f"--data {spec}: directory {directory} not found")
    return directory


def _detect(directory: str) -> str:
    names = set(os.listdir(directory))
    if any(n.startswith(MNIST_FILES["train"][0]) for n in names):
        return "mnist"
    if CIFAR10_TRAIN[0] in names or CIFAR10_TEST in names:
        return "cifar10"
    raise DataError(f"{directory} holds neither MNIST ({MNIST_FILES['train'][0]}, ...) nor "
                    f"CIFAR-10 ({CIFAR10_TRAIN[0]}, ...) files")


def batches(x: np.ndarray, y: np.ndarray, batch: int, rng: np.random.Generator | None
            ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Full batches in shuffled order (training) or in order (rng None) with the last one
    padded by repeating rows; callers of the padded form count only the real rows.
    Images come out as float32 (bytes scaled to [0, 1])."""
    n = len(x)
    order = rng.permutation(n) if rng is not None else np.arange(n)
    if rng is not None:
        for start in range(0, n - batch + 1, batch):
            idx = order[start:start + batch]
            yield as_float(x[idx]), y[idx]
        return
    for start in range(0, n, batch):
        idx = order[start:start + batch]
        if len(idx) < batch:
            idx = np.concatenate([idx, np.resize(idx, batch - len(idx))])
        yield as_float(x[idx]), y[idx]


def as_float(images: np.ndarray) -> np.ndarray:
    """float32 images: bytes (from files) scaled to [0, 1], floats as they are."""
    if images.dtype == np.uint8:
        return images.astype(np.float32) / np.float32(255)
    return images.astype(np.float32, copy=False)
