"""The register-tiled f32 GEMM (`purinec.codegen.cpu_gemm.tiled_sgemm`) against NumPy
in float64, alone and inside the convolution and product kernels that call it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit
from numba.core.errors import TypingError

from purinec.codegen import cpu, cpu_conv, cpu_runtime
from purinec.codegen.cpu_gemm import (KC, MR, NW, VW, fitted_rows, lanes, tiled_sgemm,
                                      transpose)
from purinec.codegen.cpu_module import CpuOptions
from purinec.errors import PurinecError
from purinec.ir.types import DType
from tests.codegen.test_codegen_cpu import (FEW, check, check_conv_gradients,
                                            check_conv_in_chunks, conv_problems, one_node,
                                            random_array, seeds)


@njit
def _product(a, b, c, beta):
    """``tiled_sgemm`` on 2-D f32 arrays whose rows may be longer than they are used."""
    tiled_sgemm(a.shape[0], b.shape[1], a.shape[1], a, a.strides[0] // 4, 0, 0,
                b, b.strides[0] // 4, 0, c, c.strides[0] // 4, beta)


@njit
def _product_of_gathered(source, a_rows, a_taps, b, c):
    """``tiled_sgemm`` of ``a[i, k] = source[a_rows[i] + a_taps[k]]`` by ``b``."""
    tiled_sgemm(a_rows.size, b.shape[1], a_taps.size, source, 0, a_rows, a_taps, b,
                b.shape[1], 0, c, c.shape[1], 0)


def check_product(rng, m: int, n: int, k: int, beta: int, spare: int = 3) -> None:
    """``c = a @ b + beta * c`` on views of bigger arrays (leading dimensions longer
    than the rows), and not an element written outside ``c``."""
    a = rng.standard_normal((m, k + spare), dtype=np.float32)[:, :k]
    b = rng.standard_normal((k, n + spare), dtype=np.float32)[:, :n]
    whole = rng.standard_normal((m + 1, n + spare), dtype=np.float32)
    before = whole.copy()
    _product(a, b, whole[:m, :n], beta)
    want = a.astype(np.float64) @ b.astype(np.float64) + (before[:m, :n] if beta else 0)
    np.testing.assert_allclose(whole[:m, :n], want, rtol=1e-5,
                               atol=2e-6 * max(1.0, np.sqrt(k)) * np.abs(want).max(initial=1))
    outside = np.ones(whole.shape, bool)
    outside[:m, :n] = False
    np.testing.assert_array_equal(whole[outside], before[outside])


@pytest.mark.parametrize("beta", [0, 1])
@pytest.mark.parametrize("m, n, k", [
    (1, 1, 1),
    (MR, NW, KC),               # one whole tile, one pass
    (MR + 1, NW + 1, KC + 1),   # a row, a column and a k step past them
    (3 * MR - 1, 2 * NW - VW + 3, 2 * KC + 7),  # partial vectors, rows and passes
    (5, VW - 1, 9),             # narrower than one vector
    (MR, NW + VW - 2, 300),     # a last tile one vector wider than the others
    (2, 2 * NW + VW + 5, 40),   # ... and one not (it would be two wider)
    (2 * MR, 3 * VW, 0),        # an empty sum: zeros (or c itself)
    (256, 49, 4608),            # resnet18's last layers, half the filters
])
def test_tiled_sgemm_agrees_on_tiles_edges_and_passes(m, n, k, beta):
    check_product(np.random.default_rng(m * n + k), m, n, k, beta)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(m=st.integers(1, 3 * MR + 1), n=st.integers(1, 2 * NW + VW + 1),
       k=st.integers(0, KC + 20), beta=st.sampled_from([0, 1]), spare=st.integers(0, 17))
def test_tiled_sgemm_agrees_on_random_sizes(m, n, k, beta, spare):
    check_product(np.random.default_rng(m + 31 * n + 977 * k), m, n, k, beta, spare)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(m=st.integers(1, 3 * MR + 1), n=st.integers(1, 2 * NW + VW + 1),
       k=st.integers(0, KC + 20), seed=st.integers(0, 2**16))
def test_tiled_sgemm_reads_a_at_offsets(m, n, k, seed):
    """Rows and columns of ``a`` at offsets of their own (a pixel-major convolution's
    transposed im2col matrix, read from the padded image): the product of the matrix
    those offsets gather, rows past the last one never read past it."""
    rng = np.random.default_rng(seed)
    source = rng.standard_normal(4 * (m + k) + 8, dtype=np.float32)
    a_rows = rng.integers(0, 2 * m + 4, m).astype(np.int64)
    a_taps = rng.integers(0, 2 * k + 4, k).astype(np.int64)
    b = rng.standard_normal((k, n), dtype=np.float32)
    c = np.full((m, n), np.nan, np.float32)
    _product_of_gathered(source, a_rows, a_taps, b, c)
    a = source[a_rows[:, None] + a_taps[None, :]].astype(np.float64)
    want = a @ b.astype(np.float64)
    np.testing.assert_allclose(c, want, rtol=1e-5,
                               atol=2e-6 * max(1.0, np.sqrt(k)) * np.abs(want).max(initial=1))


def test_kernels_pass_the_gemms_arrays_never_their_addresses():
    """An address taken in jitted code lets Numba free its array before the call reads
    it (a scratch array of offsets whose last use that was: a dense layer's weight
    gradient on two devices at once crashed), so the calls take the arrays themselves."""
    a = np.ones((4, 4), np.float32)

    @njit
    def by_address(a):
        transpose(4, 4, a.ctypes.data, 4, a, 4)

    @njit
    def offsets_by_address(a):
        offsets = np.zeros(4, np.int64)
        tiled_sgemm(4, 4, 4, a, 4, offsets.ctypes.data, offsets, a, 4, 0, a, 4, 0)

    for kernel in (by_address, offsets_by_address):
        with pytest.raises(TypingError, match="_call"):
            kernel(a)


@njit
def _transposed(src, dst):
    """``transpose`` of a 2-D f32 view into another whose rows may be longer."""
    transpose(src.shape[0], src.shape[1], src, src.strides[0] // 4, dst, dst.strides[0] // 4)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(rows=st.integers(0, 3 * VW + 3), cols=st.integers(0, 3 * VW + 3),
       spare=st.integers(0, VW + 1), seed=st.integers(0, 2**16))
def test_transpose_agrees_on_blocks_and_edges(rows, cols, spare, seed):
    """Whole blocks in registers and the rows and columns past them one by one, from
    and into views of bigger matrices: every element where it belongs, nothing
    written outside."""
    rng = np.random.default_rng(seed)
    src = rng.standard_normal((rows, cols + spare), dtype=np.float32)[:, :cols]
    whole = np.full((cols + 1, rows + spare), np.nan, np.float32)
    _transposed(src, whole[:cols, :rows])
    np.testing.assert_array_equal(whole[:cols, :rows], src.T)
    outside = np.ones(whole.shape, bool)
    outside[:cols, :rows] = False
    assert np.isnan(whole[outside]).all()

AVX2_CHECK = """
import json, numpy as np
from purinec.codegen import cpu_gemm, cpu_runtime
from tests.codegen.test_cpu_gemm import check_product, _transposed
rng = np.random.default_rng(0)
for m, n, k, beta in [(7, 37, 300, 0), (13, 17, 5, 1), (6, 16, 256, 0), (1, 3, 0, 0)]:
    check_product(rng, m, n, k, beta)
for rows, cols in [(8, 8), (19, 13), (3, 40)]:
    src = rng.standard_normal((rows, cols)).astype(np.float32)
    dst = np.full((cols, rows), np.nan, np.float32)
    _transposed(src, dst)
    assert np.array_equal(dst, src.T), (rows, cols)
print(json.dumps([cpu_gemm.VW, cpu_gemm.MR, cpu_runtime.tiled_gemm_wanted()]))
"""


@pytest.mark.slow  # a fresh process compiles the kernel again
def test_tiled_sgemm_of_avx2_tiles_agrees():
    """Where the CPU has no AVX-512 the tile is 6 rows by up to 2 vectors of 8 lanes,
    and kernels call the BLAS instead (unless told otherwise), and ``transpose`` moves
    blocks of 8 x 8: their code is checked with AVX-512 taken away from Numba, as on an
    AVX2 machine."""
    features = ",".join(feature if "avx512" not in feature else f"-{feature[1:]}"
                        for feature in cpu_runtime.cpu_features())
    env = {**os.environ, "NUMBA_CPU_FEATURES": features, "PURINEC_CPU_GEMM": "auto"}
    done = subprocess.run([sys.executable, "-c", AVX2_CHECK], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [8, 6, False]


LOAD_CHECK = """
import sys, numpy as np
from purinec.codegen import cpu_gemm
functions = {name: cpu_gemm._compiled(name) for name in ("tiled_sgemm", "transpose")}
rng = np.random.default_rng(0)
a = rng.standard_normal((5, 70)).astype(np.float32)
b = rng.standard_normal((70, 33)).astype(np.float32)
c, t = np.full((5, 33), np.nan, np.float32), np.full((33, 5), np.nan, np.float32)
functions["tiled_sgemm"].ctypes(5, 33, 70, a.ctypes.data, 70, 0, 0, b.ctypes.data, 33, 0,
                                c.ctypes.data, 33, 0)
functions["transpose"].ctypes(5, 33, c.ctypes.data, 33, t.ctypes.data, 5)
error = np.abs(c - a.astype(np.float64) @ b).max()
print(bool(error < 1e-4 and np.array_equal(t, c.T)), "numba.np.arraymath" in sys.modules)
"""


@pytest.mark.slow  # the first process compiles the kernel again
def test_a_later_process_loads_the_gemms_functions_without_readying_numba(tmp_path):
    """The first process compiles ``tiled_sgemm`` and ``transpose`` into Numba's cache
    (a fresh one); a later one loads them (`purinec.jitcache.ready_cfunc`) without
    Numba's typing and lowering registries, which a warm ``purinec run`` paid for at its
    first product."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    runs = [subprocess.run([sys.executable, "-c", LOAD_CHECK], env=env, text=True,
                           capture_output=True, timeout=300) for _ in range(2)]
    assert [run.returncode for run in runs] == [0, 0], runs[-1].stderr[-3000:]
    assert [run.stdout.split() for run in runs] == [["True", "True"], ["True", "False"]]


def test_choice_of_gemm_follows_the_environment(monkeypatch):
    avx512 = "+avx512f" in cpu_runtime.cpu_features()
    for value, expected in [("blas", False), ("tiled", True), ("auto", avx512), ("", avx512)]:
        monkeypatch.setenv(cpu_runtime.GEMM_ENV, value)
        assert cpu_runtime.tiled_gemm_wanted() == expected
    monkeypatch.setenv(cpu_runtime.GEMM_ENV, "fast")
    with pytest.raises(PurinecError, match="PURINEC_CPU_GEMM='fast'"):
        cpu_runtime.tiled_gemm_wanted()


TILED = CpuOptions(tiled_gemm=True, direct_max_channels=0)
TILED_BLOCKED = CpuOptions(tiled_gemm=True, direct_max_channels=0, parallel_min=0,
                           parallel_min_products=0)


@pytest.mark.slow  # a Numba compile per case
@pytest.mark.parametrize("options", [TILED, TILED_BLOCKED], ids=["whole", "blocked"])
@pytest.mark.parametrize("x_shape, w_shape, attrs, implicit", [
    ((2, 15, 9, 11), (5, 15, 3, 3), {"stride": [1, 2], "pad": [1, 1], "groups": 1}, True),
    ((1, 3, 64, 64), (8, 3, 7, 7), {"stride": [2, 2], "pad": [3, 3], "groups": 1}, True),
    ((2, 8, 9, 9), (6, 8, 1, 1), {"stride": [2, 2], "pad": [0, 0], "groups": 1}, False),
    ((1, 48, 11, 10), (4, 24, 3, 2), {"stride": [2, 1], "pad": [0, 2, 1, 0], "groups": 2,
                                      "dilation": [2, 3]}, True),
    ((3, 8, 5, 6), (6, 4, 1, 1), {"stride": [1, 1], "pad": [0, 0], "groups": 2}, False),
    ((1, 32, 40, 40), (12, 16, 5, 5), {"stride": [1, 1], "pad": [2, 2], "groups": 2}, True),
    ((1, 24, 7, 7), (40, 24, 3, 3), {"stride": [1, 1], "pad": [1, 1], "groups": 1}, True),
    ((2, 3, 9, 9), (4, 3, 3, 3), {"stride": [2, 2], "pad": [1, 1], "groups": 1}, False),
    ((1, 16, 13, 13), (8, 16, 5, 5), {"stride": [1, 1], "pad": [2, 2], "groups": 1}, False),
], ids=["3x3-column-stride", "7x7-stride-2", "1x1-stride-2", "dilated-groups",
        "pointwise", "5x5", "by-filters", "few-rows", "wasteful-rows"])
def test_convolutions_through_the_tiled_gemm_agree(x_shape, w_shape, attrs, implicit,
                                                   options):
    """Forward products of every kind of convolution go to `tiled_sgemm`, reading the
    image in place from its phase planes (`implicit`) where their im2col matrix has 128
    rows or more and the planes' rows add few columns to the product (13x13 maps
    under 5x5 windows, 15-column planes: 169 columns in 176 lanes against 195 in 208),
    and so do the input gradients computed as convolutions; transposed products stay
    with the BLAS."""
    rng = np.random.default_rng(17)
    attrs = {"dilation": [1, 1], **attrs}
    x, w = random_array(rng, x_shape, DType.f32), random_array(rng, w_shape, DType.f32)
    source = cpu.render(one_node("conv2d", [x, w], attrs), options)
    assert "tiled_sgemm(" in source and "sgemm(101" not in source
    assert ("offsets, sums," in source) == implicit
    check("conv2d", [x, w], attrs, options)
    check_conv_gradients(rng, x_shape, w_shape, attrs, DType.f32, options)


@pytest.mark.slow  # a Numba compile per case
@pytest.mark.parametrize("rows, by_filters", [(13, True), (15, True), (16, False)])
def test_tiled_convolutions_of_few_rows_split_their_filters(rows, by_filters):
    """Under `cpu_conv.FILTER_SPLIT_MAX_ROWS_TILED` output rows, blocks take output
    channels of every pixel, not rows of every channel (where OpenBLAS multiplies,
    under `cpu_conv.FILTER_SPLIT_MAX_ROWS`)."""
    rng = np.random.default_rng(2)
    x = random_array(rng, (1, 16, rows, 9), DType.f32)
    w = random_array(rng, (40, 16, 3, 3), DType.f32)
    attrs = {"stride": [1, 1], "pad": [1, 1], "groups": 1}
    assert ("w_mat[lo:hi]" in cpu.render(one_node("conv2d", [x, w], attrs), TILED_BLOCKED)
            ) == by_filters
    blas = CpuOptions(direct_max_channels=0, parallel_min=0, parallel_min_products=0)
    assert "w_mat[lo:hi]" not in cpu.render(one_node("conv2d", [x, w], attrs), blas)
    check("conv2d", [x, w], attrs, TILED_BLOCKED)


@pytest.mark.slow  # a Numba compile per example
@settings(FEW, max_examples=12)
@given(problem=conv_problems(), seed=seeds, options=st.sampled_from([TILED, TILED_BLOCKED]),
       everywhere=st.booleans())
def test_random_convolutions_through_the_tiled_gemm_agree(problem, seed, options,
                                                          everywhere, monkeypatch):
    """Small random convolutions, ``everywhere`` implicit (but for 1x1 kernels) however
    few their im2col rows and however wide their phase planes."""
    x_shape, w_shape, attrs = problem
    rng = np.random.default_rng(seed)
    x, w = random_array(rng, x_shape, DType.f32), random_array(rng, w_shape, DType.f32)
    with monkeypatch.context() as patch:  # (the fixture outlives the example)
        if everywhere:
            patch.setattr(cpu_conv, "IMPLICIT_MIN_DEPTH", 0)
            patch.setattr(cpu_conv, "IMPLICIT_MIN_LANE_SHARE", 0)
        source = cpu.render(one_node("conv2d", [x, w], attrs), options)
        assert ("offsets, sums," in source) == (everywhere and w_shape[2:] != (1, 1))
        check("conv2d", [x, w], attrs, options)
        check_conv_gradients(rng, x_shape, w_shape, attrs, DType.f32, options)


@pytest.mark.slow  # a Numba compile per case
@pytest.mark.parametrize("options", [TILED, TILED_BLOCKED], ids=["whole", "blocked"])
@pytest.mark.parametrize("kernel", [3, 1])
@pytest.mark.parametrize("epilogue", [None, "bias", "exported"])
def test_convolutions_in_chunks_of_output_rows(options, kernel, epilogue, monkeypatch):
    """Implicit (3x3) and pointwise (1x1) convolutions whose product is over
    `cpu_conv.OUT_CHUNK_BYTES` compute a few output rows at a time (here 2 of 9, in
    blocks that may begin mid-image), each chunk's epilogue run before the next."""
    monkeypatch.setattr(cpu_conv, "IMPLICIT_MIN_DEPTH", 0)
    monkeypatch.setattr(cpu_conv, "IMPLICIT_MIN_LANE_SHARE", 0)
    width = 11 + 1 if kernel == 3 else 11  # (a phase plane's: a row, its right border)
    monkeypatch.setattr(cpu_conv, "OUT_CHUNK_BYTES", 8 * width * 4 * 2)  # 2 rows
    monkeypatch.setattr(cpu_conv, "OUT_CHUNK_MIN_COLUMNS", width)
    source = check_conv_in_chunks((2, 4, 9, 11), (8, 4, kernel, kernel),
                                  {"stride": [1, 1], "pad": [kernel // 2] * 2}, epilogue,
                                  options)
    assert ("offsets, sums," in source) == (kernel == 3)


@pytest.mark.parametrize("size, chunk", [(28, r"rows_at_once = fitted_rows\(.*, 10, 28\)"),
                                         (13, None)])
def test_chunks_of_output_rows_fill_their_tiles(size, chunk):
    """A chunk of output rows has `cpu_conv.OUT_CHUNK_MIN_COLUMNS` columns or more,
    however many filters its bytes allow (512 filters of 28x28: 4 rows by bytes, 10
    by columns), as many as fill its tiles best (`fitted_rows`); where that is every
    row, the product is one."""
    x = np.zeros((1, 16, size, size), np.float32)
    w = np.zeros((512, 16, 1, 1), np.float32)
    source = cpu.render(one_node("conv2d", [x, w], {}), TILED)
    assert re.search(chunk, source) if chunk else "rows_at_once" not in source


def _masked_share(rows: int, width: int) -> float:
    return (lanes(rows * width) - rows * width) / (rows * width)


@given(st.integers(1, 64), st.integers(1, 20), st.integers(1, 300))
def test_fitted_rows_waste_no_more_lanes_than_the_rows_bytes_allow(rows, least, width):
    """`fitted_rows` stays near the rows the bytes allow (``least`` or more), and its
    chunks' tiles mask no larger share of their lanes than those rows' would."""
    fitted = fitted_rows(rows, least, width)
    plain = max(least, rows)
    assert max(least, rows * 3 // 4) <= fitted <= plain * 3 // 2
    assert _masked_share(fitted, width) <= _masked_share(plain, width) + 1e-12


def test_fitted_rows_of_googlenets_56x56_layer():
    """192 filters over phase planes 57 columns wide: 5 rows by bytes, 285 columns in
    288 lanes; 7 rows fill 400 with 399, with AVX2's tiles too (in planes 58 wide, 6
    rows with AVX-512's, 7 with AVX2's)."""
    fitted = fitted_rows(5, 5, 57)
    assert fitted == 7
    assert _masked_share(fitted, 57) < _masked_share(5, 57) / 3
    assert fitted_rows(5, 5, 58) == (6 if VW == 16 else 7)


@pytest.mark.slow  # a Numba compile per case
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, False), (False, True)])
def test_products_go_to_the_tiled_gemm_with_b_as_stored(trans_a, trans_b):
    """The tile loads rows of ``op(b)`` as vectors, so only ``b`` as stored; ``a`` is
    read a scalar at a time, transposed too (a dense layer's weight gradient)."""
    rng = np.random.default_rng(4)
    m, n, k = 37, 70, 300
    a = random_array(rng, (k, m) if trans_a else (m, k), DType.f32)
    b = random_array(rng, (n, k) if trans_b else (k, n), DType.f32)
    attrs = {"trans_a": trans_a, "trans_b": trans_b}
    for options in (TILED, TILED_BLOCKED):
        source = cpu.render(one_node("matmul", [a, b], attrs), options)
        assert ("tiled_sgemm(" in source) == (not trans_b)
        check("matmul", [a, b], attrs, options)
    f64 = [array.astype(np.float64) for array in (a, b)]
    assert "tiled_sgemm(" not in cpu.render(one_node("matmul", f64, attrs), TILED)
