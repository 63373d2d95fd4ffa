"""Matrix products through cuBLAS, and the scratch memory of the kernels around them.

The cuda target renders each matrix product and convolution in one of two forms
(`products`): ``cublas``, where the module's host function calls `gemm` (cuBLAS's
strided batched GEMM, through NVIDIA's ``nvmath-python`` bindings, on the node's
stream) between generated kernels that lay operands out for it (im2col, col2im) and
apply fused epilogues; or ``tiled``, one generated shared-memory GEMM kernel
(`purinec.codegen.cuda.gemm`), which needs no library. ``cublas`` is the default where
cuBLAS loads; ``PURINEC_CUDA_PRODUCTS=tiled`` (or ``cublas``) chooses.

`gemm` takes row-major operands, as the IR lays them out, and hands cuBLAS, which is
column-major, the transposed problem: a row-major matrix is its own transpose read
column by column, so ``C = op(A) @ op(B)`` is computed as ``C^T = op(B)^T @ op(A)^T``
with A and B swapped and nothing copied.

Numba's CUDA simulator has no cuBLAS (its arrays have no device pointers): there the
same calls run through `_simulated_gemm`, a NumPy implementation of cuBLAS's column-major
contract (leading dimensions, batch strides, beta 0 not reading C) that refuses what
cuBLAS refuses, so the ``cublas`` form of every product is tested without a GPU.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref

import numpy as np

from purinec.codegen.cuda.simulator import simulated
from purinec.errors import ExecutionError, PurinecError

PRODUCTS_VAR = "PURINEC_CUDA_PRODUCTS"
FORMS = ("cublas", "tiled")


def products() -> str:
    """The form products are rendered in here: ``PURINEC_CUDA_PRODUCTS`` if set, else
    ``cublas`` where cuBLAS loads (never in the simulator), else ``tiled``."""
    chosen = os.environ.get(PRODUCTS_VAR, "").strip()
    if chosen:
        if chosen not in FORMS:
            raise PurinecError(f"{PRODUCTS_VAR}={chosen!r}: choose one of "
                               f"{', '.join(FORMS)}")
        return chosen
    return "cublas" if cublas_missing() is None else "tiled"


@functools.cache
def cublas_missing() -> str | None:
    """Why cuBLAS cannot be called in this process, or None."""
    if simulated():
        return "Numba's CUDA simulator has no cuBLAS"
    try:
        from nvmath.bindings import cublas
        cublas.get_property(0)  # loads the library (and the driver)
    except Exception as err:
        return f"cuBLAS did not load ({type(err).__name__}: {' '.join(str(err).split())})"
    return None


def gemm(stream, a, b, c, rows: int, cols: int, depth: int, *, trans_a: bool = False,
         trans_b: bool = False, lda: int, ldb: int, ldc: int, a_at: int = 0,
         b_at: int = 0, c_at: int = 0, stride_a: int = 0, stride_b: int = 0,
         stride_c: int = 0, batch: int = 1, accumulate: bool = False) -> None:
    """For ``i < batch``: ``C_i (+)= op(A_i) @ op(B_i)``, queued on ``stream``.

    Row-major, as the arrays are: ``C_i`` is ``rows x cols`` starting ``c_at +
    i * stride_c`` elements into ``c`` with ``ldc`` elements from one row to the next;
    ``op(A_i)`` is ``rows x depth``, stored so (or transposed, ``trans_a``) with rows
    ``lda`` apart; ``op(B_i)`` is ``depth x cols`` likewise. ``accumulate`` adds to C
    instead of overwriting it (C is not read otherwise)."""
    op_a, op_b = int(trans_a), int(trans_b)  # cuBLAS's N = 0, T = 1
    call = _simulated_gemm if simulated() else _cublas_gemm
    # column-major: C^T (cols x rows) = op(B)^T (cols x depth) @ op(A)^T (depth x rows)
    call(stream, op_b, op_a, cols, rows, depth, b, b_at, ldb, stride_b, a, a_at, lda,
         stride_a, float(accumulate), c, c_at, ldc, stride_c, batch)


def scratch(stream, nbytes: int):
    """``nbytes`` of device memory for the kernels queued on ``stream``: one buffer per
    stream, grown when a kernel needs more. The work on one stream runs in order, so
    each node may use all of it."""
    return _stream_buffer(_SCRATCH, stream, nbytes, "scratch memory for matrix products")


# Buffers live as long as their stream: a program's streams, and so its buffers, go
# when the program does.
_SCRATCH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _stream_buffer(buffers: weakref.WeakKeyDictionary, stream, nbytes: int, what: str):
    """The device buffer of ``buffers`` kept for ``stream``, at least ``nbytes`` long:
    made, or grown once the stream's queued work (which may use the old one) is done."""
    held = buffers.get(stream)
    if held is None or held.size < nbytes:
        from numba import cuda

        if held is not None:
            stream.synchronize()
        try:
            held = cuda.device_array(max(nbytes, 1), np.uint8)
        except Exception as err:
            raise ExecutionError(f"allocating {nbytes:,} bytes of {what} failed: "
                                 f"{type(err).__name__}: {err}") from err
        buffers[stream] = held
    return held


# -- cuBLAS -------------------------------------------------------------------------

_local = threading.local()  # each host thread's cuBLAS handles (`_Handles`)
_SCALARS = {np.dtype(t): (np.zeros(1, t), np.ones(1, t)) for t in (np.float32, np.float64)}


# cuBLAS's workspace per stream (its advice for Hopper: 32 MiB). Set explicitly, so
# that cuBLAS allocates nothing of its own while a CUDA graph is captured.
WORKSPACE_BYTES = 32 << 20
_WORKSPACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Handles(dict):
    """One host thread's cuBLAS handles, by GPU, destroyed when the thread ends (its
    locals go then: a program's worker threads end when it closes)."""

    def __del__(self):
        from numba import cuda
        from nvmath.bindings import cublas

        for gpu, handle in self.items():
            try:
                with cuda.gpus[gpu]:
                    cublas.destroy(handle)
            except Exception:  # (at interpreter exit the driver may be gone)
                pass


def _handle(stream) -> int:
    """This thread's cuBLAS handle for the current GPU, bound to ``stream`` and its
    workspace (a handle is not for two threads at once; binding costs next to
    nothing, and binding a stream resets the workspace, so both are bound each call)."""
    from numba import cuda
    from nvmath.bindings import cublas

    handles = getattr(_local, "handles", None)
    if handles is None:
        handles = _local.handles = _Handles()
    gpu = cuda.get_current_device().id
    if gpu not in handles:
        handles[gpu] = cublas.create()
    workspace = _stream_buffer(_WORKSPACES, stream, WORKSPACE_BYTES, "cuBLAS's workspace")
    cublas.set_stream(handles[gpu], _address(stream))
    cublas.set_workspace(handles[gpu], _pointer(workspace, 0), WORKSPACE_BYTES)
    return handles[gpu]


def _address(stream) -> int:
    """The CUstream of a Numba stream, as an integer (0: the default stream)."""
    return int(int(stream))


def _pointer(array, offset: int) -> int:
    return array.__cuda_array_interface__["data"][0] + offset * array.dtype.itemsize


def _cublas_gemm(stream, op_a, op_b, m, n, k, a, a_at, lda, stride_a, b, b_at, ldb,
                 stride_b, beta, c, c_at, ldc, stride_c, batch) -> None:
    """``cublas<S|D>gemmStridedBatched``, column-major, in cuBLAS's order of arguments
    (offsets in elements next to their arrays; ``beta`` 0 or 1; alpha 1)."""
    from nvmath.bindings import cublas

    dtype = np.dtype(c.dtype)
    if dtype not in _SCALARS or a.dtype != dtype or b.dtype != dtype:
        raise PurinecError(f"cuBLAS products of {a.dtype} by {b.dtype} into {c.dtype} "
                           f"are not supported")
    zero, one = _SCALARS[dtype]
    function = (cublas.sgemm_strided_batched if dtype == np.float32
                else cublas.dgemm_strided_batched)
    try:
        function(_handle(stream), op_a, op_b, m, n, k, one.ctypes.data,
                 _pointer(a, a_at), lda, stride_a, _pointer(b, b_at), ldb, stride_b,
                 (one if beta else zero).ctypes.data, _pointer(c, c_at), ldc, stride_c,
                 batch)
    except Exception as err:
        raise ExecutionError(f"cuBLAS gemm ({m}x{n}x{k}, batch {batch}) failed: "
                             f"{type(err).__name__}: {err}") from err


# -- the simulator's stand-in ---------------------------------------------------------


def _simulated_gemm(stream, op_a, op_b, m, n, k, a, a_at, lda, stride_a, b, b_at, ldb,
                    stride_b, beta, c, c_at, ldc, stride_c, batch) -> None:
    """What ``cublas<S|D>gemmStridedBatched`` computes, column-major, on the simulator's
    arrays (NumPy arrays underneath); cuBLAS's argument checks raise."""
    a_rows, b_rows = (k if op_a else m), (n if op_b else k)
    for name, ld, rows in (("lda", lda, a_rows), ("ldb", ldb, b_rows), ("ldc", ldc, m)):
        if ld < max(1, rows):
            raise PurinecError(f"cuBLAS gemm: {name} {ld} < {rows} rows "
                               f"(CUBLAS_STATUS_INVALID_VALUE)")
    if min(m, n, k, batch) < 0 or (op_a not in (0, 1)) or (op_b not in (0, 1)):
        raise PurinecError("cuBLAS gemm: invalid sizes or operations")
    flat_a, flat_b, flat_c = (np.asarray(x._ary).reshape(-1) for x in (a, b, c))
    for i in range(batch):
        left = _column_major(flat_a, a_at + i * stride_a, a_rows, m if op_a else k, lda)
        right = _column_major(flat_b, b_at + i * stride_b, b_rows, k if op_b else n, ldb)
        out = _column_major(flat_c, c_at + i * stride_c, m, n, ldc)
        product = (left.T if op_a else left) @ (right.T if op_b else right)
        out[...] = product + out if beta else product


def _column_major(flat: np.ndarray, at: int, rows: int, cols: int, ld: int) -> np.ndarray:
    """The ``rows x cols`` column-major matrix at element ``at`` of ``flat``, columns
    ``ld`` apart; an error if it runs past the array (an illegal address on a GPU)."""
    end = at + (cols - 1) * ld + rows if rows and cols else at
    if at < 0 or end > flat.size:
        raise PurinecError(f"cuBLAS gemm: a {rows}x{cols} matrix at element {at} with "
                           f"leading dimension {ld} runs past an array of {flat.size} "
                           f"elements (an illegal address on a GPU)")
    item = flat.itemsize
    return np.lib.stride_tricks.as_strided(flat[at:], (rows, cols), (item, ld * item))
