"""Data sets: MNIST's IDX files and CIFAR-10's binary batches, parsed from small files the
tests write (valid and broken), the built-in sets, and how --data is resolved."""

import gzip

import numpy as np
import pytest

from purinec.data import (CIFAR10_RECORD, batches, cifar10, load_dataset, mnist, read_idx,
                          synthetic)
from purinec.errors import DataError
from purinec.train import epoch_rng


def idx_bytes(array: np.ndarray) -> bytes:
    """The IDX encoding of a uint8 array: 0, 0, type 0x08, ndim, big-endian dims, data."""
    header = bytes([0, 0, 0x08, array.ndim]) + np.array(array.shape, ">u4").tobytes()
    return header + array.astype(np.uint8).tobytes()


def write_mnist(directory, n_train=6, n_test=4, gz=False, size=28):
    rng = np.random.default_rng(0)
    arrays = {}
    for stem, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, (n, size, size), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        for kind, array in (("images-idx3-ubyte", images), ("labels-idx1-ubyte", labels)):
            data = idx_bytes(array)
            name = f"{stem}-{kind}"
            if gz:
                (directory / f"{name}.gz").write_bytes(gzip.compress(data))
            else:
                (directory / name).write_bytes(data)
        arrays[stem] = images, labels
    return arrays


def cifar_records(labels, rng) -> tuple[bytes, np.ndarray]:
    images = rng.integers(0, 256, (len(labels), 3, 32, 32), dtype=np.uint8)
    rows = [np.concatenate([[label], image.ravel()]) for label, image in zip(labels, images)]
    return np.array(rows, np.uint8).tobytes(), images


def write_cifar10(directory, per_batch=2, n_test=3):
    rng = np.random.default_rng(1)
    train_images, train_labels = [], []
    for i in range(1, 6):
        labels = rng.integers(0, 10, per_batch)
        data, images = cifar_records(labels, rng)
        (directory / f"data_batch_{i}.bin").write_bytes(data)
        train_images.append(images)
        train_labels.append(labels)
    test_labels = rng.integers(0, 10, n_test)
    data, test_images = cifar_records(test_labels, rng)
    (directory / "test_batch.bin").write_bytes(data)
    return (np.concatenate(train_images), np.concatenate(train_labels), test_images,
            test_labels)


# -- MNIST ---------------------------------------------------------------------------------

@pytest.mark.parametrize("gz", [False, True])
def test_mnist_reads_idx_files(tmp_path, gz):
    arrays = write_mnist(tmp_path, gz=gz)
    data = mnist(str(tmp_path))
    assert data.name == "mnist" and data.num_classes == 10
    assert data.input_shape == (1, 28, 28)
    np.testing.assert_array_equal(data.train_x[:, 0], arrays["train"][0])
    np.testing.assert_array_equal(data.train_y, arrays["train"][1])
    np.testing.assert_array_equal(data.test_x[:, 0], arrays["t10k"][0])
    np.testing.assert_array_equal(data.test_y, arrays["t10k"][1])
    assert data.train_y.dtype == np.int32


def test_images_become_float32_in_0_1_batch_by_batch(tmp_path):
    arrays = write_mnist(tmp_path)
    data = mnist(str(tmp_path))
    assert data.train_x.dtype == np.uint8  # kept small in memory
    x, y = next(batches(data.train_x, data.train_y, 6, None))
    assert x.dtype == np.float32 and 0 <= x.min() and x.max() <= 1
    np.testing.assert_array_equal(x[:, 0], arrays["train"][0] / np.float32(255))


def test_idx_bad_magic_number(tmp_path):
    path = tmp_path / "x"
    path.write_bytes(bytes([0, 0, 0x0D, 3]) + np.array([1, 1, 1], ">u4").tobytes() + b"\0")
    with pytest.raises(DataError, match=r"x: bad magic number 0x00000d03, expected 0x00000803"):
        read_idx(str(path), 3)
    path.write_bytes(b"\x1f\x8b\x08\x00" + b"\0" * 20)  # a gzip file without the .gz name
    with pytest.raises(DataError, match="not an IDX file"):
        read_idx(str(path), 3)


@pytest.mark.parametrize("cut, message", [
    (2, "no header"),
    (10, "truncated IDX header"),
    (-1, r"truncated: the header declares shape \[2, 3, 4\] \(24 bytes of data\), the file "
         r"has 23"),
])
def test_idx_truncated(tmp_path, cut, message):
    path = tmp_path / "x"
    path.write_bytes(idx_bytes(np.zeros((2, 3, 4), np.uint8))[:cut])
    with pytest.raises(DataError, match=message):
        read_idx(str(path), 3)


def test_idx_too_long(tmp_path):
    path = tmp_path / "x"
    path.write_bytes(idx_bytes(np.zeros(5, np.uint8)) + b"\0")
    with pytest.raises(DataError, match="longer than its header says"):
        read_idx(str(path), 1)


def test_idx_broken_gzip(tmp_path):
    path = tmp_path / "x.gz"
    path.write_bytes(gzip.compress(idx_bytes(np.zeros(5, np.uint8)))[:-6])
    with pytest.raises(DataError, match="x.gz: cannot read"):
        read_idx(str(path), 1)


def test_mnist_missing_file_is_named(tmp_path):
    write_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte not found"):
        mnist(str(tmp_path))


def test_mnist_counts_and_labels_are_checked(tmp_path):
    write_mnist(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros(5, np.uint8)))
    with pytest.raises(DataError, match="has 6 images but .* has 5 labels"):
        mnist(str(tmp_path))
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(
        idx_bytes(np.array([0, 1, 2, 3, 12, 5], np.uint8)))
    with pytest.raises(DataError, match=r"train-labels-idx1-ubyte: label 12 of record 4 is "
                                        r"not a class in 0..9"):
        mnist(str(tmp_path))


def test_mnist_images_must_be_three_dimensional(tmp_path):
    write_mnist(tmp_path)
    (tmp_path / "train-images-idx3-ubyte").write_bytes(idx_bytes(np.zeros(6, np.uint8)))
    with pytest.raises(DataError, match="expected 0x00000803"):
        mnist(str(tmp_path))


# -- CIFAR-10 ------------------------------------------------------------------------------

def test_cifar10_reads_binary_batches(tmp_path):
    train_x, train_y, test_x, test_y = write_cifar10(tmp_path)
    data = cifar10(str(tmp_path))
    assert data.name == "cifar10" and data.input_shape == (3, 32, 32)
    assert len(data.train_x) == 10 and len(data.test_x) == 3
    np.testing.assert_array_equal(data.train_x, train_x)  # planes in R, G, B order
    np.testing.assert_array_equal(data.train_y, train_y)
    np.testing.assert_array_equal(data.test_x, test_x)
    np.testing.assert_array_equal(data.test_y, test_y)


def test_cifar10_record_layout(tmp_path):
    """One label byte, then 1024 red, 1024 green, 1024 blue bytes, rows top to bottom."""
    write_cifar10(tmp_path)
    record = np.zeros(CIFAR10_RECORD, np.uint8)
    record[0] = 7
    record[1 + 0 * 1024 + 0] = 11  # red, row 0, column 0
    record[1 + 1 * 1024 + 32 + 2] = 22  # green, row 1, column 2
    record[1 + 2 * 1024 + 1023] = 33  # blue, row 31, column 31
    (tmp_path / "test_batch.bin").write_bytes(record.tobytes())
    data = cifar10(str(tmp_path))
    assert data.test_y.tolist() == [7]
    image = data.test_x[0]
    assert (image[0, 0, 0], image[1, 1, 2], image[2, 31, 31]) == (11, 22, 33)
    assert int(image.sum()) == 66


def test_cifar10_truncated_batch_is_named(tmp_path):
    write_cifar10(tmp_path)
    path = tmp_path / "data_batch_4.bin"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DataError, match=r"data_batch_4.bin: truncated .* 6046 bytes is not a "
                                        r"whole number of 3073-byte records"):
        cifar10(str(tmp_path))
    path.write_bytes(b"")
    with pytest.raises(DataError, match="data_batch_4.bin: truncated"):
        cifar10(str(tmp_path))


def test_cifar10_missing_batch_is_named(tmp_path):
    write_cifar10(tmp_path)
    (tmp_path / "data_batch_3.bin").unlink()
    with pytest.raises(DataError, match=r"data_batch_3.bin not found$"):
        cifar10(str(tmp_path))


def test_cifar10_bad_label(tmp_path):
    write_cifar10(tmp_path)
    record = np.zeros(CIFAR10_RECORD, np.uint8)
    record[0] = 10
    (tmp_path / "test_batch.bin").write_bytes(record.tobytes())
    with pytest.raises(DataError, match="test_batch.bin: label 10 of record 0"):
        cifar10(str(tmp_path))


# -- resolving --data ------------------------------------------------------------------

def test_data_specs(tmp_path):
    mnist_dir, cifar_dir = tmp_path / "m", tmp_path / "c"
    mnist_dir.mkdir()
    cifar_dir.mkdir()
    write_mnist(mnist_dir, gz=True)
    write_cifar10(cifar_dir)
    assert load_dataset(f"mnist:{mnist_dir}").name == "mnist"
    assert load_dataset(f"cifar10:{cifar_dir}").name == "cifar10"
    assert load_dataset(str(mnist_dir)).name == "mnist"  # recognized by its files
    assert load_dataset(str(cifar_dir)).name == "cifar10"
    assert load_dataset("synthetic").name == "synthetic"


@pytest.mark.parametrize("spec, message", [
    ("mnist", "give --data mnist:DIR"),
    ("mnist:", "give the directory after the colon"),
    ("cifar10:/no/such/dir", "directory /no/such/dir not found"),
    ("imagenet", "unknown data set 'imagenet'"),
])
def test_bad_data_specs(spec, message):
    with pytest.raises(DataError, match=message):
        load_dataset(spec)


def test_a_directory_of_other_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(DataError, match="holds neither MNIST .* nor CIFAR-10"):
        load_dataset(str(tmp_path))


def test_synthetic_and_shuffles_are_reproducible():
    a, b = synthetic(seed=4, n=40), synthetic(seed=4, n=40)
    np.testing.assert_array_equal(a.train_x, b.train_x)
    order = [y for _, y in batches(a.train_x, a.train_y, 8, epoch_rng(4, 2))]
    again = [y for _, y in batches(a.train_x, a.train_y, 8, epoch_rng(4, 2))]
    other = [y for _, y in batches(a.train_x, a.train_y, 8, epoch_rng(4, 3))]
    np.testing.assert_array_equal(order, again)
    assert not np.array_equal(order, other)  # each epoch its own shuffle


def test_resized_images_interpolate_between_pixel_centres():
    from purinec.data import Dataset, resized

    ramp = np.array([[0.0, 1.0], [2.0, 3.0]], np.float32)[None, None]  # 1 image, gray
    data = Dataset("ramp", ramp, np.zeros(1, np.int32), ramp + 1, np.ones(1, np.int32), 2)
    big = resized(data, (3, 4, 4))
    # Output pixel i of 4 sits at input position (i + 0.5) / 2 - 0.5, clipped to [0, 1].
    along = np.array([0.0, 0.25, 0.75, 1.0], np.float32)
    expected = 2 * along[:, None] + along[None, :]
    assert big.train_x.shape == (1, 3, 4, 4) and big.train_x.dtype == np.float32
    for channel in range(3):  # gray repeated over the channels
        np.testing.assert_allclose(big.train_x[0, channel], expected, atol=1e-6)
        np.testing.assert_allclose(big.test_x[0, channel], expected + 1, atol=1e-6)
    np.testing.assert_array_equal(big.train_y, data.train_y)
    same = resized(data, (1, 2, 2))
    np.testing.assert_allclose(same.train_x, ramp)
    with pytest.raises(DataError, match="has 3 channels"):
        resized(big, (2, 4, 4))
