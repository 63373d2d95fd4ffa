"""What generated CPU kernels import, and how blocked kernels run on several threads.

GEMM. Kernels call ``sgemm`` / ``dgemm``: CBLAS ``?gemm`` with 64-bit sizes,
``(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)``, order 101
(row-major), trans 111 (no) or 112 (yes). They are external functions bound *by symbol
name* (``purinec_cblas_sgemm``), which this module registers with LLVM when imported,
so kernels that call them stay cacheable on disk (Numba refuses to cache code holding
a process-specific address such as a ctypes pointer). The symbols lead to the OpenBLAS
that NumPy's wheels bundle, about a third faster on the small GEMMs of convolutions
than SciPy's copy; where there is none, to an adapter over Numba's ``numba_xxgemm``
(the helper behind ``np.dot`` in Numba, on SciPy's BLAS).

Arrays. Kernels make their scratch arrays with ``empty`` and see arrays with other
shapes through ``view``: intrinsics, lowered in place, where Numba's ``np.empty``,
``np.zeros``, ``np.full`` and ``reshape`` are functions it types and compiles in every
process, with run-time checks (together most of a second of lenet's compile). Numba's
cache does not see changes to them: the kernel cache keys kernels by this file's text
too (`purinec.codegen.cache.runtime_stamp`).

Threads. A big kernel is *blocked*: its function takes ``lo, hi`` and computes items
``lo:hi`` of one loop over independent items (see `KernelModule.split`), and
`run_blocked` cuts the items into one block per thread, running one block on the
calling thread and the others on a small pool. Kernels release the GIL, so blocks run
side by side. The BLAS kernels call is made single-threaded (`limit_blas_threads`), so
`set_threads` alone bounds the threads a kernel uses. Thread pools that spin (OpenMP,
Numba's ``prange``) were avoided on purpose: on a machine with 2 cores they fight the
runtime's own threads, and ``parallel=True`` doubles a kernel's compile time.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Callable, Sequence

import llvmlite.binding as llvm
import numpy as np
from numba import cfunc, types
from numba.core import cgutils
from numba.core.extending import intrinsic
from numba.core.imputils import impl_ret_borrowed, impl_ret_new_ref


def _gemm_type(scalar):
    i32, i64 = types.int32, types.int64
    return types.void(i32, i32, i32, i64, i64, i64, scalar, types.voidptr, i64,
                      types.voidptr, i64, scalar, types.voidptr, i64)


sgemm = types.ExternalFunction("purinec_cblas_sgemm", _gemm_type(types.float32))
dgemm = types.ExternalFunction("purinec_cblas_dgemm", _gemm_type(types.float64))


def _c_strides(builder, itemsize, dims: list) -> list:
    strides = [itemsize]
    for dim in reversed(dims[1:]):
        strides.append(builder.mul(strides[-1], dim))
    return strides[::-1]


def _dims(context, builder, shape_type, shape) -> list:
    return [context.cast(builder, dim, ty, types.intp)
            for dim, ty in zip(cgutils.unpack_tuple(builder, shape), shape_type)]


def _is_shape(shape) -> bool:
    return (isinstance(shape, types.BaseTuple) and len(shape) > 0
            and all(isinstance(ty, types.Integer) for ty in shape))


@intrinsic
def view(typingctx, array, shape):
    """``array`` seen with ``shape``, as ``array.reshape(shape)``, for a C-contiguous
    ``array`` whose size is the product of ``shape`` (the generated code guarantees
    it; nothing is checked). Numba's ``reshape`` checks at run time and cost about 25
    ms of compiling per call in the code, 0.15 s more for a process's first."""
    if not (isinstance(array, types.Array) and array.layout == "C" and _is_shape(shape)):
        return None
    result = array.copy(ndim=len(shape), layout="C", readonly=not array.mutable)

    def codegen(context, builder, signature, args):
        from numba.np.arrayobj import make_array, populate_array

        source = make_array(array)(context, builder, args[0])
        dims = _dims(context, builder, shape, args[1])
        seen = make_array(result)(context, builder)
        populate_array(seen, data=source.data, shape=dims,
                       strides=_c_strides(builder, source.itemsize, dims),
                       itemsize=source.itemsize, meminfo=source.meminfo, parent=source.parent)
        return impl_ret_borrowed(context, builder, result, seen._getvalue())

    return result(array, shape), codegen


@intrinsic
def empty(typingctx, shape, dtype):
    """A new C-contiguous array of ``shape`` and ``dtype`` (``np.float32`` and
    friends), as ``np.empty``. Numba's ``np.empty`` cost about 0.1 s of compiling the
    first time a process meets it and 0.03 s for each new rank or dtype."""
    if not (_is_shape(shape) and isinstance(dtype, types.NumberClass)):
        return None
    result = types.Array(dtype.instance_type, len(shape), "C")

    def codegen(context, builder, signature, args):
        from numba.np.arrayobj import make_array, populate_array

        dims = _dims(context, builder, shape, args[0])
        itemsize = context.get_constant(types.intp, context.get_abi_sizeof(
            context.get_data_type(result.dtype)))
        size = itemsize
        for dim in dims:
            size = builder.mul(size, dim)
        align = context.get_constant(types.uint32,
                                     context.get_preferred_array_alignment(result.dtype))
        meminfo = context.nrt.meminfo_alloc_aligned(builder, size, align)
        data = context.nrt.meminfo_data(builder, meminfo)
        made = make_array(result)(context, builder)
        populate_array(made, data=builder.bitcast(data, made.data.type), shape=dims,
                       strides=_c_strides(builder, itemsize, dims), itemsize=itemsize,
                       meminfo=meminfo)
        return impl_ret_new_ref(context, builder, result, made._getvalue())

    return result(shape, dtype), codegen


# CBLAS names with 64-bit integers (ILP64), as NumPy's wheels (scipy-openblas64) export them.
_ILP64_NAMES = {"s": ("scipy_cblas_sgemm64_", "cblas_sgemm64_"),
                "d": ("scipy_cblas_dgemm64_", "cblas_dgemm64_")}
BLAS_ENV = "PURINEC_CPU_BLAS"  # "scipy" forces the adapter over SciPy's BLAS


def _numpy_openblas() -> tuple[str | None, ctypes.CDLL | None]:
    """The OpenBLAS NumPy uses, if it exports ILP64 CBLAS: (its path, the library)."""
    from threadpoolctl import ThreadpoolController

    for lib in ThreadpoolController().lib_controllers:
        if lib.internal_api != "openblas":
            continue
        handle = ctypes.CDLL(lib.filepath)
        if all(any(hasattr(handle, name) for name in names) for names in _ILP64_NAMES.values()):
            return lib.filepath, handle
    return None, None


def _xxgemm_adapter(kind: str):
    """A C function with the CBLAS ILP64 signature that calls ``numba_xxgemm``: BLAS
    is column-major, where a row-major matrix reads as its transpose, so it computes
    ``c^T = op(b)^T @ op(a)^T`` with the operands swapped."""
    scalar = types.float32 if kind == "s" else types.float64
    dtype = np.float32 if kind == "s" else np.float64
    xxgemm = types.ExternalFunction("numba_xxgemm", types.intc(
        types.char, types.char, types.char, types.intp, types.intp, types.intp,
        types.voidptr, types.voidptr, types.intp, types.voidptr, types.intp,
        types.voidptr, types.voidptr, types.intp))
    code = ord(kind)

    @cfunc(_gemm_type(scalar), nopython=True)
    def adapter(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        scalars = np.empty(2, dtype)
        scalars[0] = alpha
        scalars[1] = beta
        xxgemm(code, 116 if tb == 112 else 110, 116 if ta == 112 else 110, n, m, k,
               scalars[0:1].ctypes, b, ldb, a, lda, scalars[1:2].ctypes, c, ldc)

    return adapter


def _bind_gemm() -> str | None:
    """Register the GEMM symbols; returns the path of NumPy's OpenBLAS when they lead
    there, None when they lead to the adapter over SciPy's BLAS."""
    path, handle = (None, None)
    if os.environ.get(BLAS_ENV) != "scipy":
        path, handle = _numpy_openblas()
    for kind in "sd":
        symbol = f"purinec_cblas_{kind}gemm"
        if handle is not None:
            name = next(n for n in _ILP64_NAMES[kind] if hasattr(handle, n))
            llvm.add_symbol(symbol, ctypes.cast(getattr(handle, name), ctypes.c_void_p).value)
        else:
            adapter = _xxgemm_adapter(kind)
            _ADAPTERS.append(adapter)  # keep it alive: LLVM holds only its address
            llvm.add_symbol(symbol, adapter.address)
    return path


_ADAPTERS: list = []
NUMPY_BLAS = _bind_gemm()

_settings = threading.local()
_lock = threading.Lock()
_pool: _BlockPool | None = None  # see _get_pool
_holders = 0  # see hold_block_pool
_blas_limited = False


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def local_ranks() -> int:
    """How many ranks of an MPI job share this machine (MPICH's Hydra says so), so that
    they can share its cores."""
    try:
        return max(1, int(os.environ.get("MPI_LOCALNRANKS", "1")))
    except ValueError:
        return 1


def process_cpus() -> int:
    """The cores this process may use: those it may run on, shared with the other ranks
    of its job on this machine unless the launcher bound each rank to cores of its own."""
    cpus = available_cpus()
    if cpus == os.cpu_count():
        cpus = max(1, cpus // local_ranks())
    return cpus


def set_threads(n: int) -> None:
    """Run the kernels this thread calls on at most ``n`` threads (this one included).
    The setting belongs to the calling thread; threads that never set it use every
    available CPU."""
    if n < 1:
        raise ValueError(f"thread count must be at least 1, got {n}")
    _settings.threads = int(n)


def get_threads() -> int:
    return getattr(_settings, "threads", None) or available_cpus()


def run_blocked(fn: Callable, count: int, arrays: Sequence) -> None:
    """Run ``fn(lo, hi, *arrays)`` over ``0:count`` in one block per thread: the first
    on the calling thread, the others on the pool's free helpers (and on the calling
    thread too, after its own, where several callers share the pool at once)."""
    blocks = min(get_threads(), count)
    if blocks <= 1:
        fn(0, count, *arrays)
        return
    bounds = [count * i // blocks for i in range(blocks + 1)]
    pool = _get_pool()
    helpers = pool.claim(blocks - 1)
    own = [0, *range(len(helpers) + 1, blocks)]
    error = None
    # Nothing but the calls between waking the helpers and running a block: a helper
    # woken while this thread holds the GIL waits for it.
    for i, helper in enumerate(helpers, start=1):
        helper.start(fn, bounds[i], bounds[i + 1], arrays)
    try:
        for i in own:
            fn(bounds[i], bounds[i + 1], *arrays)
    except BaseException as err:  # still wait: the other blocks write the same arrays
        error = err
    for helper in helpers:
        error = helper.finish() or error
    pool.release(helpers)
    if error is not None:
        raise error


class Blocked:
    """A blocked kernel as a plain kernel: ``Blocked(fn, count)(*arrays)`` runs
    ``fn(lo, hi, *arrays)`` over ``0:count`` with `run_blocked`."""

    __slots__ = ("fn", "count")

    def __init__(self, fn: Callable, count: int):
        self.fn = fn
        self.count = count

    def __call__(self, *arrays) -> None:
        run_blocked(self.fn, self.count, arrays)

    def __repr__(self) -> str:
        return f"Blocked({self.fn!r}, {self.count})"


class _Helper:
    """A thread of the block pool. Handing it a block and hearing back are one lock
    each: a call of two blocks costs about 22 us on two cores, where a
    ThreadPoolExecutor's submit and result took 42, which a small blocked kernel
    (mlp's products take 0.3 ms) paid on every call."""

    def __init__(self, name: str):
        self._go, self._done = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._block: tuple | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def start(self, fn: Callable, lo: int, hi: int, arrays: Sequence) -> None:
        self._block = (fn, lo, hi, arrays)
        self._go.release()

    def finish(self) -> BaseException | None:
        """Wait for the block started last; what it raised, if anything."""
        self._done.acquire()
        error, self._error = self._error, None
        return error

    def stop(self) -> None:
        self._block = None
        self._go.release()
        self._thread.join()

    def _serve(self) -> None:
        while True:
            self._go.acquire()
            if self._block is None:
                return
            fn, lo, hi, arrays = self._block
            self._block = None
            try:
                fn(lo, hi, *arrays)
            except BaseException as err:  # the caller re-raises it
                self._error = err
            self._done.release()


class _BlockPool:
    """Helper threads that callers of `run_blocked` claim for one call each. Once
    stopped, it hands out none, and each helper stops as soon as it is free."""

    def __init__(self, size: int):
        self._free = [_Helper(f"purinec-kernel-{i}") for i in range(size)]
        self._busy = 0
        self._stopped = False
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)

    def claim(self, most: int) -> list[_Helper]:
        with self._lock:
            if self._stopped:
                return []
            taken, self._free = self._free[:most], self._free[most:]
            self._busy += len(taken)
            return taken

    def release(self, helpers: list[_Helper]) -> None:
        with self._lock:
            self._free.extend(helpers)
            self._busy -= len(helpers)
            self._idle.notify_all()

    def stop(self) -> None:
        """Stop every helper, once those in use are back."""
        with self._lock:
            self._stopped = True
            self._idle.wait_for(lambda: self._busy == 0)
            helpers, self._free = self._free, []
        for helper in helpers:
            helper.stop()


def _get_pool() -> _BlockPool:
    global _pool
    with _lock:
        if _pool is None:
            _pool = _BlockPool(max(1, available_cpus() - 1))
        return _pool


def hold_block_pool() -> Callable[[], None]:
    """Count one more user of the block pool (a program's executable); returns how to
    let go of it. The last user to let go stops the pool's threads (a later blocked
    kernel starts new ones), so a closed program leaves no thread behind."""
    global _holders
    with _lock:
        _holders += 1
    return _let_go_of_block_pool


def _let_go_of_block_pool() -> None:
    global _holders, _pool
    with _lock:
        _holders -= 1
        if _holders > 0:
            return
        pool, _pool = _pool, None
    if pool is not None:
        pool.stop()


def limit_blas_threads() -> None:
    """Make the BLAS that kernels call single-threaded, once, for the whole process
    (so NumPy's own matrix products then run on one thread too, when kernels use
    NumPy's BLAS). Kernels parallelise around BLAS calls instead."""
    global _blas_limited
    with _lock:
        if _blas_limited:
            return
        from threadpoolctl import ThreadpoolController

        if NUMPY_BLAS is None:
            import scipy.linalg.cython_blas  # noqa: F401  (loads SciPy's BLAS)
        blas = [lib for lib in ThreadpoolController().lib_controllers
                if lib.user_api == "blas"]
        if NUMPY_BLAS is not None:
            chosen = [lib for lib in blas if lib.filepath == NUMPY_BLAS]
        else:  # SciPy's wheels keep their BLAS in scipy.libs
            chosen = [lib for lib in blas
                      if Path(lib.filepath).parent.name.startswith("scipy")] or blas
        for lib in chosen:
            lib.set_num_threads(1)
        _blas_limited = True
