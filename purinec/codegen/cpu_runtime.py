"""What generated CPU kernels import, and how blocked kernels run on several threads.

GEMM. Kernels call ``sgemm`` / ``dgemm``: CBLAS ``?gemm`` with 64-bit sizes,
``(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)``, order 101
(row-major), trans 111 (no) or 112 (yes). They are external functions bound *by symbol
name* (``purinec_cblas_sgemm``), which this module registers with LLVM when imported,
so kernels that call them stay cacheable on disk (Numba refuses to cache code holding
a process-specific address such as a ctypes pointer). The symbols lead to the OpenBLAS
that NumPy's wheels bundle, about a third faster on the small GEMMs of convolutions
than SciPy's copy; where there is none, to an adapter over Numba's ``numba_xxgemm``
(the helper behind ``np.dot`` in Numba, on SciPy's BLAS). OpenBLAS's AVX-512 cores
multiply small products unpacked, much faster than packed (`SMALL_GEMM_MACS`).

Arrays. Kernels make their scratch arrays with ``empty`` and see arrays with other
shapes through ``view``: intrinsics, lowered in place, where Numba's ``np.empty``,
``np.zeros``, ``np.full`` and ``reshape`` are functions it types and compiles in every
process, with run-time checks (together most of a second of lenet's compile). Numba's
cache does not see changes to them: the kernel cache keys kernels by this file's text
too (`purinec.codegen.cache.runtime_stamp`).

Threads. A big kernel is *blocked*: its function takes ``lo, hi, team, threads`` and
computes items ``lo:hi`` of one loop over independent items (see `KernelModule.split`).
It begins with `run_blocks`: given a *team* of helper threads, that cuts the items
into up to ``threads`` blocks, offers them to free helpers, claims blocks itself until
none is left, waits for the helpers that started (calling off those that had not),
and the kernel returns; without a team (or on a helper) the kernel computes ``lo:hi``
itself. Every block runs through the kernel's
own C entry, so none needs Python or the GIL; a helper spins for a fifth of a
millisecond after its block before it sleeps, so that the next kernel's blocks start
at once (Numba's ``parallel=True`` was avoided: it doubles a kernel's compile time).
`set_threads` bounds a caller's blocks, and the runtime gives each device's threads a
share of the cores (one each for two devices on two cores, which then never wake a
helper). The BLAS kernels call is made single-threaded (`limit_blas_threads`).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import cfunc, njit, types
from numba.core import cgutils
from numba.core.extending import intrinsic
from numba.core.imputils import impl_ret_borrowed, impl_ret_new_ref

from purinec import jitcache
from purinec.errors import PurinecError


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


def _is_index(index) -> bool:
    return isinstance(index, types.BaseTuple) and all(
        isinstance(ty, types.Integer) for ty in index)


@intrinsic
def copy_run(typingctx, dst, dst_at, src, src_at, count):
    """``count`` elements from ``src[src_at]`` on to ``dst[dst_at]`` on, where they are
    contiguous in both (a run along the last axis; the generated code guarantees it and
    that the arrays do not overlap: nothing is checked). A ``memcpy``, which LLVM
    expands into a few vector moves for a constant ``count``. A loop of a constant,
    short trip count is unrolled first, then vectorized badly: an im2col of 32-pixel
    rows ran 2-4x slower as a loop (AVX-512: along the rows, scattering)."""
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array)
            and dst.mutable and dst.dtype == src.dtype and _is_index(dst_at)
            and len(dst_at) == dst.ndim and _is_index(src_at) and len(src_at) == src.ndim
            and isinstance(count, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        from numba.np.arrayobj import make_array

        def pointer(array_type, array, index_type, index):
            made = make_array(array_type)(context, builder, array)
            at = [context.cast(builder, value, ty, types.intp)
                  for value, ty in zip(cgutils.unpack_tuple(builder, index), index_type)]
            return cgutils.get_item_pointer(context, builder, array_type, made, at,
                                            wraparound=False)

        itemsize = context.get_abi_sizeof(context.get_data_type(dst.dtype))
        cgutils.raw_memcpy(builder, pointer(dst, args[0], dst_at, args[1]),
                           pointer(src, args[2], src_at, args[3]),
                           context.cast(builder, args[4], count, types.intp), itemsize)
        return context.get_dummy_value()

    return types.none(dst, dst_at, src, src_at, count), codegen


@intrinsic
def opaque(typingctx, count):
    """``count``, as a value LLVM cannot see through (an empty inline assembly
    statement), for the trip count of a short loop that should stay a loop: LLVM
    unrolls a loop of a constant, short trip count before it vectorizes loops, and
    the unrolled body vectorizes worse or not at all (copying a row of 32 floats into
    two planes by column parity, an interleaved access that vectorizes as a loop:
    a third of max pooling's gradient on the Zen 4 machine)."""
    if not isinstance(count, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[0], count, types.intp)
        hide = ir.InlineAsm(ir.FunctionType(value.type, [value.type]), "", "=r,0",
                            side_effect=False)
        return builder.call(hide, [value])

    return types.intp(count), codegen


# CBLAS names with 64-bit integers (ILP64), as NumPy's wheels (scipy-openblas64) export them.
_ILP64_NAMES = {"s": ("scipy_cblas_sgemm64_", "cblas_sgemm64_"),
                "d": ("scipy_cblas_dgemm64_", "cblas_dgemm64_")}
BLAS_ENV = "PURINEC_CPU_BLAS"  # "scipy" forces the adapter over SciPy's BLAS


def _numpy_openblas() -> tuple[str | None, ctypes.CDLL | None, str | None]:
    """The OpenBLAS NumPy uses, if it exports ILP64 CBLAS: (its path, the library, the
    core whose kernels it runs, such as ``SkylakeX``)."""
    from threadpoolctl import ThreadpoolController

    for lib in ThreadpoolController().lib_controllers:
        if lib.internal_api != "openblas":
            continue
        handle = ctypes.CDLL(lib.filepath)
        if all(any(hasattr(handle, name) for name in names) for names in _ILP64_NAMES.values()):
            return lib.filepath, handle, lib.architecture
    return None, None, None


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


def _bind_gemm() -> tuple[str | None, str | None]:
    """Register the GEMM symbols; returns the path of NumPy's OpenBLAS and its core
    when they lead there, Nones when they lead to the adapter over SciPy's BLAS."""
    path, handle, core = (None, None, None)
    if os.environ.get(BLAS_ENV) != "scipy":
        path, handle, core = _numpy_openblas()
    for kind in "sd":
        symbol = f"purinec_cblas_{kind}gemm"
        if handle is not None:
            name = next(n for n in _ILP64_NAMES[kind] if hasattr(handle, n))
            llvm.add_symbol(symbol, ctypes.cast(getattr(handle, name), ctypes.c_void_p).value)
        else:
            adapter = _xxgemm_adapter(kind)
            _ADAPTERS.append(adapter)  # keep it alive: LLVM holds only its address
            llvm.add_symbol(symbol, adapter.address)
    return path, core


_ADAPTERS: list = []
NUMPY_BLAS, BLAS_CORE = _bind_gemm()

# OpenBLAS's SkylakeX kernels (which its Cooper Lake and Sapphire Rapids cores reuse,
# and which it picks on any AVX-512 CPU, AMD's too) multiply a product of at most 100^3
# multiply-adds straight from its operands; bigger ones are packed first. On the Zen 4
# machine (one thread), a 32x75 by 75x1024 product (a 5x5 convolution of 3 channels)
# ran at 55 GFLOP/s whole and 94-98 in chunks of 256-384 columns.
SMALL_GEMM_MACS = (100 ** 3 if (BLAS_CORE or "").lower() in
                   ("skylakex", "cooperlake", "sapphirerapids") else 0)

GEMM_ENV = "PURINEC_CPU_GEMM"  # "blas" or "tiled" overrides `tiled_gemm_wanted`


def cpu_features() -> list[str]:
    """The features of the CPU Numba compiles for (``+avx2``, ``-avx512f``...)."""
    from numba.core import config

    return (config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()).split(",")


def has_avx512() -> bool:
    """Whether the CPU Numba compiles for has AVX-512 (its foundation)."""
    return "+avx512f" in cpu_features()


def tiled_gemm_wanted() -> bool:
    """Whether kernels should multiply f32 operands with
    `purinec.codegen.cpu_gemm.tiled_sgemm` rather than the BLAS: where the CPU has
    AVX-512 (where it was measured faster), unless `GEMM_ENV` says otherwise."""
    choice = os.environ.get(GEMM_ENV, "").strip().lower()
    if choice not in ("", "auto", "blas", "tiled"):
        raise PurinecError(f"{GEMM_ENV}={choice!r}: give blas, tiled or auto")
    return choice == "tiled" or (choice != "blas" and has_avx512())


SLICE_ENV = "PURINEC_SLICE_BYTES"  # overrides `slice_budget`; 0: never in slices
# Where the machine does not say how big its last-level cache is, this is assumed.
ASSUMED_LAST_LEVEL_CACHE = 8 << 20
_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}  # sysfs's cache sizes: 32768K


def last_level_cache() -> int:
    """The bytes of the largest cache CPU 0 reports (Linux's sysfs; `ASSUMED_LAST_LEVEL_CACHE`
    where it reports none)."""
    sizes = []
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(index) as f:
                text = f.read().strip()
        except OSError:
            continue
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * _SIZE_UNITS.get(text[len(digits):], 1))
    return max(sizes, default=ASSUMED_LAST_LEVEL_CACHE)


def slice_budget() -> int:
    """The bytes a slice of an inference batch may make in one value (the cpu target's
    ``slices`` stage): two fifths of the last-level cache, so that a layer's input and
    output both stay there (at batch 32 on the 2-core Zen 4, 32 MB of L3, squeezenet1_1
    in slices of 3, 4 and 5 images: 136, 128 and 136 ms; mobilenet_v2 of 1, 2 and 3:
    151, 139 and 138); `SLICE_ENV` overrides it."""
    text = os.environ.get(SLICE_ENV, "").strip()
    if not text:
        return last_level_cache() * 2 // 5
    if not text.isdigit():
        raise PurinecError(f"{SLICE_ENV}={text!r}: give a number of bytes (0: never cut "
                           f"a batch into slices)")
    return int(text)


_settings = threading.local()
_lock = threading.Lock()
_holders = 0  # see hold_team
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
    CPU the process could run on when it first asked."""
    if n < 1:
        raise ValueError(f"thread count must be at least 1, got {n}")
    _settings.threads = int(n)


@functools.cache
def _default_threads() -> int:
    """The CPUs the process could run on when first asked (asking costs 1.7 us)."""
    return available_cpus()


def get_threads() -> int:
    return getattr(_settings, "threads", None) or _default_threads()


class Blocked:
    """A blocked kernel as a plain kernel: ``Blocked(fn, count)(*arrays)`` runs
    ``fn(0, count, team, threads, *arrays)``, which computes items ``0:count`` in up to
    `get_threads` blocks on the team's helper threads and this one."""

    __slots__ = ("fn", "count")

    def __init__(self, fn: Callable, count: int):
        self.fn = fn
        self.count = count

    def __call__(self, *arrays) -> None:
        threads = get_threads()
        self.fn(0, self.count, team_address() if threads > 1 else 0, threads, *arrays)

    def __repr__(self) -> str:
        return f"Blocked({self.fn!r}, {self.count})"


# -- the team: helper threads that run kernels' blocks without the GIL ---------------
#
# A blocked kernel starts with `run_blocks` (see `purinec.codegen.cpu_module`).
# Everything the helpers share with the kernels that call on them is int64 words of
# `_TEAM`: a header line, then one line per helper, read and written only with the
# atomics below. A helper waits for its STATE to say GO (spinning for about
# `SPIN_SECONDS`, then asleep on a futex), says RUNNING (unless its caller called it
# off meanwhile), claims blocks of the kernel its words describe as the caller does,
# running each by the kernel's C entry, and says DONE. Handing a block over and hearing
# back cost about a microsecond while the helper spins; through Python threads and
# locks they cost 22 (each a change of hands of the GIL).

_FUTEX_SYSCALL = ({"x86_64": 202, "aarch64": 98}.get(platform.machine())
                  if sys.platform.startswith("linux") else None)
_FUTEX_WAIT, _FUTEX_WAKE = 128, 129  # FUTEX_PRIVATE_FLAG | FUTEX_WAIT, | FUTEX_WAKE
SPIN_SECONDS = 2e-4  # how long helpers and callers spin before they sleep
_WORDS_PER_LINE = 16  # 128 bytes: no two lines share a cache line (or its prefetched pair)
_LINE = _WORDS_PER_LINE * 8
_MAX_HELPERS = 63  # `_run_blocks` notes the helpers it took as bits of an int64
# Words of the header: helpers running, spins before sleeping, where `_run_blocks` is
# (its C entry).
HELPERS, SPINS, RUN_BLOCKS = range(3)
NOT_SPLIT, DONE_BLOCKS, FAILED_BLOCK = range(3)  # what `_run_blocks` says
# A helper's words. Futexes compare 32 bits: STATE's low half, on little-endian CPUs.
STATE, CLAIM, ASLEEP, CALLER_ASLEEP, ENTRY, ARGS, LO, HI, FAILED, BLOCKS, COUNTER, NEXT = \
    range(12)
IDLE, GO, RUNNING, DONE, STOP = range(5)  # its STATE
# Never freed: a kernel may read the address just before the team stops.
_TEAM = np.zeros(_WORDS_PER_LINE * (1 + min(_MAX_HELPERS, os.cpu_count() or 1)), np.int64)
_TEAM_ADDRESS = _TEAM.ctypes.data
_team_threads: list[threading.Thread] = []
_team_started = False
I64 = ir.IntType(64)


def _word(builder, address, index):
    return builder.gep(builder.inttoptr(address, I64.as_pointer()), [index])


@intrinsic
def _load(typingctx, address, index):
    """Word ``index`` of the line at ``address``."""
    def codegen(context, builder, signature, args):
        return builder.load_atomic(_word(builder, *args), "seq_cst", 8)

    return types.int64(types.int64, types.int64), codegen


@intrinsic
def _store(typingctx, address, index, value):
    def codegen(context, builder, signature, args):
        builder.store_atomic(args[2], _word(builder, args[0], args[1]), "seq_cst", 8)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64), codegen


@intrinsic
def _swap(typingctx, address, index, expected, new):
    """Make word ``index`` ``new`` if it is ``expected``; whether it was."""
    def codegen(context, builder, signature, args):
        swapped = builder.cmpxchg(_word(builder, args[0], args[1]), args[2], args[3],
                                  "seq_cst", "seq_cst")
        return builder.extract_value(swapped, 1)

    return types.boolean(types.int64, types.int64, types.int64, types.int64), codegen


@intrinsic
def _fetch_add(typingctx, address, index, value):
    """Add ``value`` to word ``index``; what it held."""
    def codegen(context, builder, signature, args):
        return builder.atomic_rmw("add", _word(builder, args[0], args[1]), args[2], "seq_cst")

    return types.int64(types.int64, types.int64, types.int64), codegen


@intrinsic
def _pause(typingctx):
    """A spinning thread's hint to the core (x86's ``pause``; nothing elsewhere)."""
    def codegen(context, builder, signature, args):
        if platform.machine() == "x86_64":
            hint = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
            builder.call(hint, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _futex(typingctx, address, index, operation, value):
    """Sleep while word ``index`` holds ``value`` (`_FUTEX_WAIT`), or wake ``value``
    threads sleeping on it (`_FUTEX_WAKE`)."""
    def codegen(context, builder, signature, args):
        syscall = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(I64, [I64], var_arg=True), "syscall")
        word = builder.ptrtoint(_word(builder, args[0], args[1]), I64)
        null = ir.Constant(I64, 0)
        return builder.call(syscall, [ir.Constant(I64, _FUTEX_SYSCALL), word, args[2],
                                      args[3], null, null, null])

    return types.int64(types.int64, types.int64, types.int64, types.int64), codegen


@intrinsic
def _run_block(typingctx, entry, arrays, lo, hi):
    """Call a kernel's C entry (see `_block_entry`) on items ``lo:hi``; 1 if it raised."""
    def codegen(context, builder, signature, args):
        entry_type = ir.FunctionType(I64, [I64, I64, I64])
        return builder.call(builder.inttoptr(args[0], entry_type.as_pointer()), args[1:])

    return types.int64(types.int64, types.int64, types.int64, types.int64), codegen


def _block_entry(context, builder, arrays):
    """The C function ``(arrays, lo, hi) -> failed`` that runs the kernel being
    compiled, which takes ``lo, hi, team, threads`` and then ``arrays`` (their types),
    over items ``lo:hi`` alone (team 0): added to the kernel's own code, once."""
    kernel = builder.function
    try:
        return builder.module.get_global(kernel.name + "__block")
    except KeyError:
        pass
    entry = ir.Function(builder.module, ir.FunctionType(I64, [I64, I64, I64]),
                        kernel.name + "__block")
    body = ir.IRBuilder(entry.append_basic_block())
    packed = body.load(body.inttoptr(entry.args[0],
                                     context.get_value_type(arrays).as_pointer()))
    # threads 0: a block of a call on the team (see `KernelModule.share`)
    values = [entry.args[1], entry.args[2], ir.Constant(I64, 0), ir.Constant(I64, 0)]
    values += [body.extract_value(packed, i) for i in range(len(arrays))]
    # not inlined: the kernel's body would be there twice
    status, _ = context.call_conv.call_function(
        body, kernel, types.none, [types.int64] * 4 + list(arrays), values,
        attrs=("noinline",))
    body.ret(body.zext(status.is_error, I64))
    return entry


@intrinsic
def run_blocks(typingctx, team, threads, lo, hi, arrays):
    """What a blocked kernel does first, with its own ``lo, hi, team, threads`` and its
    arrays (a tuple): if ``team`` is not 0, cut ``lo:hi`` into up to ``threads`` blocks
    and run them all (`_run_blocks`: on free helpers and this thread, each through the
    kernel's C entry, `_block_entry`); true if it did, and the kernel returns. A block
    that raised makes it raise RuntimeError, once every block is done.

    The kernel reaches `_run_blocks` through an address in the team's header (linked
    into each kernel, the team's functions took 0.15 s of every kernel's compile), and
    its C entry lies in its own code: it stays cacheable."""
    if not (isinstance(arrays, types.BaseTuple)
            and all(isinstance(a, types.Array) for a in arrays)):
        return None

    def codegen(context, builder, signature, args):
        team, threads, lo, hi, packed = args
        done = cgutils.alloca_once_value(builder, ir.Constant(I64, 0))
        with builder.if_then(builder.icmp_unsigned("!=", team, ir.Constant(I64, 0))):
            slot = cgutils.alloca_once(builder, context.get_value_type(arrays))
            builder.store(packed, slot)
            entry = _block_entry(context, builder, arrays)
            function_type = ir.FunctionType(I64, [I64] * 6)
            address = builder.load(_word(builder, team, ir.Constant(I64, RUN_BLOCKS)))
            outcome = builder.call(builder.inttoptr(address, function_type.as_pointer()), [
                team, threads, lo, hi, builder.ptrtoint(entry, I64),
                builder.ptrtoint(slot, I64)])
            builder.store(outcome, done)
            failed = builder.icmp_unsigned("==", outcome, ir.Constant(I64, FAILED_BLOCK))
            with builder.if_then(failed, likely=False):
                context.call_conv.return_user_exc(builder, RuntimeError, (
                    "a block of this kernel failed on another thread (its exception is "
                    "lost there)",))
        return builder.icmp_unsigned("!=", builder.load(done), ir.Constant(I64, 0))

    return types.boolean(types.int64, types.int64, types.int64, types.int64, arrays), codegen


@njit(nogil=True, cache=True)
def _bound(lo, hi, blocks, block):
    """Where block ``block`` of ``lo:hi`` cut in ``blocks`` begins."""
    return lo + (hi - lo) * block // blocks


@njit(nogil=True, cache=True)
def _line(team, helper):
    """The address of helper ``helper``'s words."""
    return team + (helper + 1) * _LINE


@njit(nogil=True, cache=True)
def _run_blocks(team, threads, lo, hi, entry, arrays):
    """`run_blocks`: cuts ``lo:hi`` into ``threads`` blocks (no more than items), offers
    them to free helpers, and claims blocks itself as the helpers do, one at a time from
    a counter, until none is left. A helper the host has not yet given a core to when
    the blocks are gone is called off, not waited for: its block was run by whoever
    came first (on a shared machine a woken helper may wait milliseconds for a core,
    and every kernel would wait with it). Then waits for the helpers that started and
    frees them all. NOT_SPLIT (one block: the kernel runs it itself), DONE_BLOCKS, or
    FAILED_BLOCK if a block raised."""
    blocks = min(threads, hi - lo)
    if blocks < 2:
        return NOT_SPLIT
    taken = 0
    counter = 0  # the first helper's line, whose NEXT word counts the blocks claimed
    offered = 1
    for helper in range(_load(team, HELPERS)):
        if offered == blocks:
            break
        line = _line(team, helper)
        if _swap(line, CLAIM, 0, 1):
            if counter == 0:
                counter = line
                _store(line, NEXT, 0)
            taken |= 1 << helper
            _store(line, ENTRY, entry)
            _store(line, ARGS, arrays)
            _store(line, LO, lo)
            _store(line, HI, hi)
            _store(line, BLOCKS, blocks)
            _store(line, COUNTER, counter)
            _store(line, STATE, GO)
            if _load(line, ASLEEP):
                _futex(line, STATE, _FUTEX_WAKE, 1)
            offered += 1
    if counter == 0:  # no helper free: every block here, as one
        return FAILED_BLOCK if _run_block(entry, arrays, lo, hi) else DONE_BLOCKS
    failed = _claim_blocks(counter, entry, arrays, lo, hi, blocks)
    spins = _load(team, SPINS)
    for helper in range(_MAX_HELPERS):
        if (taken >> helper) & 1:
            line = _line(team, helper)
            if not _swap(line, STATE, GO, IDLE):  # it started: wait for it
                _wait(line, DONE, DONE, CALLER_ASLEEP, spins)
                failed |= _load(line, FAILED)
                _store(line, STATE, IDLE)
    for helper in range(_MAX_HELPERS):  # (the counter's line stays taken until here)
        if (taken >> helper) & 1:
            _store(_line(team, helper), CLAIM, 0)
    return FAILED_BLOCK if failed else DONE_BLOCKS


@njit(nogil=True, cache=True)
def _claim_blocks(counter, entry, arrays, lo, hi, blocks):
    """Run blocks of ``lo:hi`` (cut in ``blocks``) claimed from ``counter``'s NEXT word
    until none is left; whether one raised."""
    failed = 0
    while True:
        block = _fetch_add(counter, NEXT, 1)
        if block >= blocks:
            return failed
        failed |= _run_block(entry, arrays, _bound(lo, hi, blocks, block),
                             _bound(lo, hi, blocks, block + 1))


@njit(nogil=True, cache=True)
def _wait(line, wanted, other, asleep, spins):
    """Wait until the line's STATE is ``wanted`` or ``other``; which it is. Spins
    ``spins`` times, then sleeps, saying so in word ``asleep`` so that whoever
    changes STATE wakes it."""
    for _ in range(spins):
        state = _load(line, STATE)
        if state == wanted or state == other:
            return state
        _pause()
    while True:
        state = _load(line, STATE)
        if state == wanted or state == other:
            return state
        _store(line, asleep, 1)
        if _load(line, STATE) == state:  # else it changed before the store: look again
            _futex(line, STATE, _FUTEX_WAIT, state)
        _store(line, asleep, 0)


@njit(nogil=True, cache=True)
def _serve(team, helper):
    """A helper thread's life: claim blocks of the kernels it is offered, unless its
    caller called it off first (`_run_blocks`), until told to STOP."""
    line = _line(team, helper)
    spins = _load(team, SPINS)
    while _wait(line, GO, STOP, ASLEEP, spins) == GO:
        if not _swap(line, STATE, GO, RUNNING):
            continue  # called off: the blocks were done without it
        failed = _claim_blocks(_load(line, COUNTER), _load(line, ENTRY), _load(line, ARGS),
                               _load(line, LO), _load(line, HI), _load(line, BLOCKS))
        _store(line, FAILED, failed)
        _store(line, STATE, DONE)
        if _load(line, CALLER_ASLEEP):
            _futex(line, STATE, _FUTEX_WAKE, 1)


@njit(nogil=True, cache=True)
def _retire(team, helper):
    """Take the helper for good (once its caller frees it) and tell it to STOP."""
    line = _line(team, helper)
    while not _swap(line, CLAIM, 0, 1):
        _pause()
    _store(line, STATE, STOP)
    if _load(line, ASLEEP):
        _futex(line, STATE, _FUTEX_WAKE, 1)


@njit(nogil=True, cache=True)
def _pauses(count):
    for _ in range(count):
        _pause()


# What the team runs, loaded or compiled when it starts.
_NATIVE = {_serve: (types.int64,) * 2, _retire: (types.int64,) * 2, _pauses: (types.int64,),
           _run_blocks: (types.int64,) * 6}


def _c_entry(function) -> int:
    """The address of the C entry Numba compiles beside each function."""
    overload = function.overloads[_NATIVE[function]]
    return overload.library.get_pointer_to_function(overload.fndesc.llvm_cfunc_wrapper_name)


def _spins() -> int:
    """How many spins of `_wait` take about `SPIN_SECONDS` on this CPU (a ``pause``
    takes from a few cycles to 140, by CPU)."""
    count = 20_000
    took = []
    for _ in range(3):  # the least: a measurement the thread was preempted in is long
        began = time.perf_counter()
        _pauses(count)
        took.append(time.perf_counter() - began)
    return max(1, int(count * SPIN_SECONDS / max(min(took), 1e-9)))


def team_address() -> int:
    """The address of the team that blocked kernels share their blocks with, started
    on first use; 0 where there is none (no futexes: each kernel runs on its caller)."""
    if _team_started:
        return _TEAM_ADDRESS
    if _FUTEX_SYSCALL is None:
        return 0
    with _lock:
        if not _team_started:
            _start_team()
    return _TEAM_ADDRESS


def _start_team() -> None:
    """Start a helper for every CPU but the caller's (none on one CPU: a spinning
    helper would take the caller's core)."""
    global _team_started
    for function, signature in _NATIVE.items():
        jitcache.ready(function, signature)
    helpers = min(_MAX_HELPERS, available_cpus() - 1)
    _TEAM[_WORDS_PER_LINE:] = 0  # the helpers' lines: IDLE, free
    _TEAM[SPINS] = _spins()
    # The same address at every start: a kernel still running from before may read it.
    _TEAM[RUN_BLOCKS] = _c_entry(_run_blocks)
    for helper in range(helpers):
        thread = threading.Thread(target=_serve, args=(_TEAM_ADDRESS, helper),
                                  name=f"purinec-kernel-{helper}", daemon=True)
        thread.start()
        _team_threads.append(thread)
    _TEAM[HELPERS] = helpers  # the last store: kernels take helpers from here on
    _team_started = True


def _stop_team() -> None:
    """Stop the helpers, each once the kernel using it (if any) frees it."""
    _TEAM[HELPERS] = 0  # kernels take no helper from here on
    for helper, thread in enumerate(_team_threads):
        _retire(_TEAM_ADDRESS, helper)
        thread.join()
    _forget_team()


def _forget_team() -> None:
    """Say there is no team: its helpers stopped, or in a forked child did not come
    along (posting to those would wait forever). A later kernel starts another."""
    global _team_started
    _team_started = False
    _team_threads.clear()
    _TEAM[HELPERS] = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_team)


def hold_team() -> Callable[[], None]:
    """Count one more user of the team (a program's executable); returns how to let go
    of it. The last user to let go stops the team's threads (a later blocked kernel
    starts new ones), so a closed program leaves no thread behind."""
    global _holders
    with _lock:
        _holders += 1
    return _let_go_of_team


def _let_go_of_team() -> None:
    global _holders
    with _lock:
        _holders -= 1
        if _holders == 0 and _team_started:
            _stop_team()


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
