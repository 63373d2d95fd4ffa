"""`purinec.runtime.sums`: every copy made the sum of all, added in the copies' order
(the bytes a shared-memory allreduce gives every rank), checked against NumPy's."""

from __future__ import annotations

import numpy as np
import pytest

from purinec.runtime import sums


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.int32, np.float16])
@pytest.mark.parametrize("count", [2, 3, 4])
def test_every_copy_becomes_the_sum_in_order(dtype, count):
    rng = np.random.default_rng(count)
    size = 1000 + count  # not a multiple of a vector
    # Floats big enough that the order of the additions shows in their rounding.
    scale = {np.float16: 100, np.float32: 1e6, np.float64: 1e6}.get(dtype, 1000)
    copies = [(rng.standard_normal(size) * scale).astype(dtype) for _ in range(count)]
    want = copies[0].copy()
    for other in copies[1:]:
        want = want + other  # in order: float sums depend on it
    sums.ready(dtype, count)
    sums.sum_into_each(copies)
    for copy in copies:
        np.testing.assert_array_equal(copy, want)
        assert copy.dtype == np.dtype(dtype)


def test_views_of_one_buffer_are_summed_where_they_lie():
    """The copies are views of a shared window (pieces of each rank's segment)."""
    window = np.arange(40, dtype=np.float32)
    first, second = window[4:14], window[24:34]
    want = first + second
    sums.sum_into_each([first, second])
    np.testing.assert_array_equal(window[4:14], want)
    np.testing.assert_array_equal(window[24:34], want)
    np.testing.assert_array_equal(window[:4], np.arange(4, dtype=np.float32))
