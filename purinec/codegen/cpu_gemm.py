"""A register-tiled f32 GEMM that generated CPU kernels call instead of the BLAS where
that measures faster, ``tiled_sgemm``; and ``transpose``, by blocks in registers.

Why not always the BLAS: OpenBLAS packs both operands into its own layouts at every
call, copying the whole weight matrix of a convolution (9.4 MB for resnet18's last 3x3
layers) once per image; and its AVX-512 kernels run thin products (a few dozen output
pixels: small maps at batch 1) at a fraction of their peak. This kernel reads the
operands where they lie: each k step loads a row of ``b`` (contiguous: an im2col
matrix's row of pixels) as vectors and multiplies it by one scalar of each of a few
rows of ``a`` (the weights, row-major), accumulating a tile of ``c`` in vector
registers. On the Zen 4 machine, one thread, caches flushed before each call
(GFLOP/s, this / OpenBLAS): 256x4608 by 4608x49 81 / 72, 128x1152 by 1152x392 94 / 88,
64x576 by 576x784 84 / 79, 32x75 by 75x1024 61 / 46; with warm caches 110-114 against
99-101 on the latter shapes, level on the thinnest.

The rows of ``b`` may also lie anywhere, at offsets given by an array: implicit
convolutions (`purinec.codegen.cpu_conv._implicit`) read their im2col matrix that way
from the padded image itself. So may the elements of ``a``: a pixel-major
convolution's transposed im2col matrix, a dense layer's ``gy`` transposed for its
weight gradient (`purinec.codegen.cpu_conv._transposed_a`).

The tile's inner loop is written in LLVM IR (`_TileCode`) rather than left to LLVM's loop
vectorizer, which keeps accumulators in registers only when it sees the whole tile:
``MR`` rows of ``c`` times ``nv`` vectors of its columns, all in registers across
the k loop, with the last vector masked where the tile is narrower than its vectors.
With AVX-512 a tile is 4 rows by 4 vectors of 16 (16 of the 32 registers accumulate;
the last of a row of tiles up to 5); the kernels only call it there
(`cpu_runtime.tiled_gemm_wanted`), since on AVX2 (16 registers, an emulation on the
same cores) it ran at 0.7-0.9 of OpenBLAS (weight gradients of dense layers 0.75-0.95):
there the tile is 6 rows by up to 2 vectors of 8, correct wherever a kernel compiled
on one machine runs on another.

The kernel cache keys kernels by this file's text too (`purinec.codegen.cache`).
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Callable

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils, sigutils
from numba.core.ccallback import CFunc
from numba.core.extending import intrinsic, register_jitable

from purinec import jitcache
from purinec.codegen import cache
from purinec.codegen.compile_helpers import start_numba_without_scipy
from purinec.codegen.cpu_runtime import has_avx512

I1, I8, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(32), ir.IntType(64)
F32 = ir.FloatType()

# k steps per pass over a tile: a pass reads a block of ``b`` of KC rows by a tile's
# columns (64 KB of f32 with AVX-512), which the tiles of every row block then share.
KC = 256

VW = 16 if has_avx512() else 8  # f32 lanes of a vector register
MR, NV = (4, 4) if VW == 16 else (6, 2)  # a tile: MR rows of c by NV vectors
# The last tile of a row of tiles takes up to NV + 1 vectors where that leaves no tile
# of a few columns (a 196-pixel product 64 + 64 + 68 rather than 64 + 64 + 64 + 4: a
# tile of one vector costs a pass of its own at a quarter of the work); with 16
# registers (AVX2) there is no room for it.
NV_LAST = NV + 1 if VW == 16 else NV
NW = NV * VW  # the columns of every other tile


def _splat(builder, vector_type, scalar):
    """``scalar`` in every lane of a vector."""
    lanes = vector_type.count
    one = builder.insert_element(ir.Constant(vector_type, None), scalar, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(I32, lanes), [0] * lanes))


class VectorCode:
    """The f32 vector type and the LLVM intrinsics of vector code written in LLVM IR
    (`_TileCode`'s, `purinec.codegen.cpu_window`'s)."""

    def __init__(self, builder):
        self.builder = builder
        self.vector = ir.VectorType(F32, VW)
        self.mask = ir.VectorType(I1, VW)
        self.zero = ir.Constant(self.vector, [0.0] * VW)
        self._fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(self.vector, [self.vector] * 3),
            f"llvm.fma.v{VW}f32")

    def _masked(self, operation: str, vector):
        """LLVM's masked load or store of ``vector``'s type."""
        lanes, pointer = vector.count, vector.as_pointer()
        mask = ir.VectorType(I1, lanes)
        kind = (ir.FunctionType(vector, [pointer, I32, mask, vector]) if operation == "load"
                else ir.FunctionType(ir.VoidType(), [vector, pointer, I32, mask]))
        return cgutils.get_or_insert_function(self.builder.module, kind,
                                              f"llvm.masked.{operation}.v{lanes}f32.p0")

    def masked_load(self, pointer, lanes, vector=None, fill: float = 0.0):
        """The vector (of `VW` lanes, or of ``vector``'s type) at ``pointer``, ``fill``
        in the lanes ``lanes`` leaves out (which are not read: they may lie outside the
        array)."""
        vector = vector or self.vector
        at = self.builder.bitcast(pointer, vector.as_pointer())
        filled = ir.Constant(vector, [fill] * vector.count)
        return self.builder.call(self._masked("load", vector),
                                 [at, ir.Constant(I32, 4), lanes, filled])

    def masked_store(self, value, pointer, lanes) -> None:
        at = self.builder.bitcast(pointer, value.type.as_pointer())
        self.builder.call(self._masked("store", value.type),
                          [value, at, ir.Constant(I32, 4), lanes])

    def lanes_below(self, count, lanes: int = VW):
        """The mask of the first ``count`` of ``lanes`` lanes (none for ``count`` <= 0)."""
        ids = ir.Constant(ir.VectorType(I64, lanes), list(range(lanes)))
        return self.builder.icmp_signed("<", ids, _splat(
            self.builder, ir.VectorType(I64, lanes), count))

    def fma(self, a, b, c):
        return self.builder.call(self._fma, [a, b, c])

    def store(self, value, pointer, left) -> None:
        """``value`` at ``pointer``, its first ``left`` lanes only where fewer than a
        vector's (none for ``left`` <= 0)."""
        builder = self.builder
        whole = builder.icmp_signed(">=", left, ir.Constant(I64, VW))
        with builder.if_else(whole, likely=True) as (then, otherwise):
            with then:
                builder.store(value, builder.bitcast(pointer, self.vector.as_pointer()),
                              align=4)
            with otherwise:
                self.masked_store(value, pointer, self.lanes_below(left))


class _TileCode:
    """LLVM IR of one tile: ``c[:rows, :cols] (+)= a[:rows, :depth] @ b[:depth, :cols]``
    for ``rows <= MR`` and ``cols <= nv * VW``; rows past ``rows`` repeat the last one
    (read, never stored), the last vector's lanes past ``cols`` are masked."""

    def __init__(self, builder, nv: int, args):
        self.builder, self.nv = builder, nv
        a, self.lda, a_rows, a_taps, b, self.ldb, b_rows, c, self.ldc, self.rows, self.cols, \
            self.depth, self.ahead, self.accumulate = args
        pointer = F32.as_pointer()
        self.a, self.b, self.c = (builder.inttoptr(p, pointer) for p in (a, b, c))
        self.a_offsets = builder.icmp_signed("!=", a_taps, ir.Constant(I64, 0))
        self.a_taps = builder.inttoptr(a_taps, I64.as_pointer())
        self.offsets = builder.icmp_signed("!=", b_rows, ir.Constant(I64, 0))
        self.b_rows = builder.inttoptr(b_rows, I64.as_pointer())
        self.code = VectorCode(builder)
        self.vector, self.zero = self.code.vector, self.code.zero
        self.prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32]),
            "llvm.prefetch.p0")
        self.last_mask = self.code.lanes_below(builder.sub(self.cols,
                                                           ir.Constant(I64, (nv - 1) * VW)))
        self.row_offsets = builder.inttoptr(a_rows, I64.as_pointer())

    def a_row_pointers(self, a_offsets: bool) -> list:
        """Where each of the tile's `MR` rows of ``a`` begins (rows past ``rows`` repeat
        the last one): ``lda`` apart, or with ``a_offsets`` where ``a_rows`` says."""
        builder, final_row = self.builder, self.builder.sub(self.rows, ir.Constant(I64, 1))
        pointers = []
        for i in range(MR):
            row = builder.select(builder.icmp_signed("<", ir.Constant(I64, i), self.rows),
                                 ir.Constant(I64, i), final_row)
            offset = (builder.load(builder.gep(self.row_offsets, [row])) if a_offsets
                      else builder.mul(row, self.lda))
            pointers.append(builder.gep(self.a, [offset]))
        return pointers

    def vector_at(self, row_pointer, v: int):
        return self.builder.bitcast(
            self.builder.gep(row_pointer, [ir.Constant(I64, v * VW)]), self.vector.as_pointer())

    def emit(self) -> None:
        """The k loops (rows of ``b`` ``ldb`` apart or at offsets; every vector full or
        the last one masked), then the stores."""
        full = self.builder.icmp_signed("==", self.cols, ir.Constant(I64, self.nv * VW))
        sums = self.choose(self.a_offsets, lambda a_offsets: self.choose(
            self.offsets, lambda offsets: self.choose(
                full, lambda whole: self.k_loop(not whole, offsets, a_offsets))))
        with self.builder.if_else(full) as (whole, part):
            for masked, arm in ((False, whole), (True, part)):
                with arm:
                    self.store(sums, masked)

    def choose(self, condition, sums_of: Callable[[bool], list]) -> list:
        """``sums_of(True)`` where ``condition`` holds, else ``sums_of(False)``, each
        its own code (a branch outside the k loops, none inside)."""
        builder, arms = self.builder, []
        with builder.if_else(condition) as (then, otherwise):
            for value, arm in ((True, then), (False, otherwise)):
                with arm:
                    sums = sums_of(value)
                    arms.append((builder.basic_block, sums))
        merged = []
        for i in range(MR):
            row = []
            for v in range(self.nv):
                phi = builder.phi(self.vector)
                for block, arm_sums in arms:
                    phi.add_incoming(arm_sums[i][v], block)
                row.append(phi)
            merged.append(row)
        return merged

    def load_b(self, row_pointer, v: int, masked: bool):
        pointer = self.vector_at(row_pointer, v)
        if masked and v == self.nv - 1:
            return self.code.masked_load(pointer, self.last_mask)
        return self.builder.load(pointer, align=4)

    def k_loop(self, masked: bool, offsets: bool, a_offsets: bool) -> list:
        """The sums of a tile over ``depth`` k steps (zero for none), as phis of the
        block after the loop; rows of ``b`` at ``offsets``, columns of ``a`` at
        ``a_offsets``."""
        builder, nv = self.builder, self.nv
        a_rows = self.a_row_pointers(a_offsets)
        entry = builder.basic_block
        loop, done = builder.append_basic_block("k"), builder.append_basic_block("k_done")
        builder.cbranch(builder.icmp_signed(">", self.depth, ir.Constant(I64, 0)), loop, done)
        builder.position_at_end(loop)
        k = builder.phi(I64)
        k.add_incoming(ir.Constant(I64, 0), entry)
        sums = [[builder.phi(self.vector) for _ in range(nv)] for _ in range(MR)]
        for row in sums:
            for phi in row:
                phi.add_incoming(self.zero, entry)
        b_row = builder.gep(self.b, [builder.load(builder.gep(self.b_rows, [k])) if offsets
                                     else builder.mul(k, self.ldb)])
        b_vectors = [self.load_b(b_row, v, masked) for v in range(nv)]
        self.prefetch_next_columns(b_row)
        updated = []
        a_k = builder.load(builder.gep(self.a_taps, [k])) if a_offsets else k
        for i in range(MR):
            a_ik = _splat(builder, self.vector, builder.load(builder.gep(a_rows[i], [a_k])))
            updated.append([self.code.fma(a_ik, b_vectors[v], sums[i][v])
                            for v in range(nv)])
        next_k, body_end = builder.add(k, ir.Constant(I64, 1)), builder.basic_block
        k.add_incoming(next_k, body_end)
        for i in range(MR):
            for v in range(nv):
                sums[i][v].add_incoming(updated[i][v], body_end)
        builder.cbranch(builder.icmp_signed("<", next_k, self.depth), loop, done)
        builder.position_at_end(done)
        results = []
        for i in range(MR):
            row = []
            for v in range(nv):
                result = builder.phi(self.vector)
                result.add_incoming(self.zero, entry)
                result.add_incoming(updated[i][v], body_end)
                row.append(result)
            results.append(row)
        return results

    def prefetch_next_columns(self, b_row) -> None:
        """Ask for this row of ``b`` ``ahead`` elements on (as wide as the tile), where
        the next columns' tiles will read it: where ``b``'s rows lie far apart (a
        pointwise convolution's image, a row per channel) the hardware follows too few
        of them. 128 -> 16 channels of 55x55 at batch 32, products alone, 2 threads: 24%
        faster; 576 -> 96 of 14x14 6%; implicit 3x3 products level. ``ahead`` 0 (a row
        of tiles after the first, which finds the columns in cache) asks for the row
        just read, at the cost of the instructions only."""
        i8, builder = I8.as_pointer(), self.builder
        for line in range(0, self.nv * VW, 64 // 4):
            at = builder.add(self.ahead, ir.Constant(I64, line))
            builder.call(self.prefetch, [builder.bitcast(builder.gep(b_row, [at]), i8),
                                         ir.Constant(I32, 0), ir.Constant(I32, 3),
                                         ir.Constant(I32, 1)])

    def store(self, sums: list, masked: bool) -> None:
        """The sums into ``c`` (added to it where ``accumulate``); with ``masked``, the
        last vector of a row only in the lanes inside the tile. A full tile's stores
        are plain: AVX2's masked store (``vmaskmovps``) is slow on AMD's cores, and a
        tile of 64 k steps ran at 0.7 of OpenBLAS's speed with them."""
        builder = self.builder
        for i in range(MR):
            c_row = builder.gep(self.c, [builder.mul(ir.Constant(I64, i), self.ldc)])
            inside = builder.icmp_signed("<", ir.Constant(I64, i), self.rows)
            with builder.if_then(inside, likely=True):
                for v in range(self.nv):
                    pointer = self.vector_at(c_row, v)
                    lanes = self.last_mask if masked and v == self.nv - 1 else None
                    with builder.if_then(self.accumulate):
                        self.store_vector(builder.fadd(self.load_c(pointer, lanes),
                                                       sums[i][v]), pointer, lanes)
                    with builder.if_then(builder.not_(self.accumulate)):
                        self.store_vector(sums[i][v], pointer, lanes)

    def load_c(self, pointer, lanes):
        if lanes is None:
            return self.builder.load(pointer, align=4)
        return self.code.masked_load(pointer, lanes)

    def store_vector(self, vector, pointer, lanes) -> None:
        if lanes is None:
            self.builder.store(vector, pointer, align=4)
        else:
            self.code.masked_store(vector, pointer, lanes)


@intrinsic
def _tile(typingctx, vectors, a, lda, a_rows, a_taps, b, ldb, b_rows, c, ldc, rows, cols,
          depth, ahead, accumulate):
    """One tile (`_TileCode`) of ``vectors`` vectors of columns, 1 to `NV_LAST`."""
    signature = types.void(*[types.int64] * 14, types.boolean)

    def codegen(context, builder, sig, args):
        done = builder.append_basic_block("tile_done")
        switch = builder.switch(args[0], done)
        for nv in range(1, NV_LAST + 1):
            case = builder.append_basic_block(f"tile_{nv}")
            switch.add_case(ir.Constant(I64, nv), case)
            builder.position_at_end(case)
            _TileCode(builder, nv, args[1:]).emit()
            builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return signature, codegen


@register_jitable
def _tile_columns(left: int) -> int:
    """The columns of the next tile of a row of tiles with ``left`` columns to go:
    `NW`, or all of them where one tile of `NV_LAST` vectors takes them."""
    return left if left <= NV_LAST * VW else NW


# (m, n, k, a, lda, a_rows, a_taps, b, ldb, b_rows, c, ldc, beta): sizes and leading
# dimensions in elements, operands by address (as signed integers: their offsets are,
# and mixing the two would make Numba compute in floating point).
SIGNATURE = types.void(*[types.int64] * 13)


def _tiled_sgemm(m, n, k, a, lda, a_rows, a_taps, b, ldb, b_rows, c, ldc, beta):
    """`tiled_sgemm`'s code, compiled by `_compiled`."""
    for k0 in range(0, max(k, 1), KC):  # (k == 0: one pass of empty sums, zeros)
        depth = min(KC, k - k0)
        accumulate = beta != 0 or k0 > 0
        pass_rows = b_rows + 8 * k0 if b_rows else 0
        n0 = 0
        while n0 < n:
            cols = _tile_columns(n - n0)
            vectors = (cols + VW - 1) // VW
            pb = b + 4 * (n0 if b_rows else k0 * ldb + n0)
            for m0 in range(0, m, MR):
                rows = min(MR, m - m0)
                pc = c + 4 * (m0 * ldc + n0)
                ahead = cols if m0 == 0 else 0  # the first row of tiles asks for the next
                # One call site: the tile's code is large, and each call is a copy of it.
                pa = a if a_taps else a + 4 * (m0 * lda + k0)
                tile_rows = a_rows + 8 * m0 if a_taps else 0
                tile_taps = a_taps + 8 * k0 if a_taps else 0
                _tile(vectors, pa, lda, tile_rows, tile_taps, pb, ldb, pass_rows, pc, ldc,
                      rows, cols, depth, ahead, accumulate)
            n0 += cols


@register_jitable
def lanes(n: int) -> int:
    """How many columns the tiles of a product of ``n`` columns compute, the masked
    ones included (as `_tiled_sgemm` cuts them)."""
    total = 0
    while n > 0:
        cols = _tile_columns(n)
        total += -(-cols // VW) * VW
        n -= cols
    return total


@register_jitable
def fitted_rows(rows: int, least: int, width: int) -> int:
    """How many rows of ``width`` columns a product computes at a time, about ``rows``
    (from three quarters of it to half again, ``least`` or more): the count whose
    columns the tiles cover with the fewest masked lanes per column (`lanes`), the one
    nearest ``rows`` among equals. googlenet's 3x3 layer of 192 filters over rows of
    57 columns took 5 rows (285 columns in 288 lanes); 7 fill 400 with 399."""
    best, best_waste = max(least, rows), 1.0
    for count in range(max(least, rows * 3 // 4), max(least, rows) * 3 // 2 + 1):
        columns = count * width
        waste = (lanes(columns) - columns) / columns
        if waste < best_waste - 1e-9 or (waste < best_waste + 1e-9
                                         and abs(count - rows) < abs(best - rows)):
            best, best_waste = count, waste
    return best


# ---------------------------------------------------------------------------------------
# Transposing: a pixel-major convolution's sums (pixels by filters) into its output
# (filters by pixels), a weight gradient's ``gy``. Element by element, along either
# axis, the loads or the stores go a row apart: 0.7 ns an element on the Zen 4 machine
# (196 pixels by 576 filters, 77 us hot, one thread: a third of mobilenet_v2's 1x1
# layers of 14x14); by blocks in registers 16 us.


def _swap_mask(b: int, second: bool) -> ir.Constant:
    """The lanes of a shuffle of rows ``i`` and ``i + b`` of a block (the second's
    lanes numbered from `VW`) that swaps their off-diagonal halves of every 2b lanes:
    row ``i`` keeps its lanes without bit ``b`` and takes the other row's lanes ``b``
    lower for the rest; row ``i + b`` (``second``) the reverse."""
    lanes = [(lane + b if second else lane) if not lane & b
             else (VW + lane if second else VW + lane - b) for lane in range(VW)]
    return ir.Constant(ir.VectorType(I32, VW), lanes)


@intrinsic
def _transpose_block(typingctx, src, lds, dst, ldd):
    """The `VW` x `VW` block of f32 at address ``src`` (its rows ``lds`` elements
    apart) transposed into ``dst`` (rows ``ldd`` apart) in registers: the off-diagonal
    b x b blocks of every 2b x 2b block swapped, for b from VW/2 down to 1 (VW log VW
    shuffles of two rows)."""
    signature = types.void(types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, sig, args):
        src, lds, dst, ldd = args
        vector = ir.VectorType(F32, VW)

        def row(base, ld, i: int):
            start = builder.inttoptr(base, F32.as_pointer())
            at = builder.gep(start, [builder.mul(ir.Constant(I64, i), ld)])
            return builder.bitcast(at, vector.as_pointer())

        rows = [builder.load(row(src, lds, i), align=4) for i in range(VW)]
        b = VW // 2
        while b:
            swapped = list(rows)
            for i in (i for i in range(VW) if not i & b):
                for k, second in ((i, False), (i + b, True)):
                    swapped[k] = builder.shuffle_vector(rows[i], rows[i + b],
                                                        _swap_mask(b, second))
            rows, b = swapped, b // 2
        for i, value in enumerate(rows):
            builder.store(value, row(dst, ldd, i), align=4)
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def _copy_element(typingctx, dst, src):
    """The f32 at address ``src`` stored at address ``dst``."""
    signature = types.void(types.int64, types.int64)

    def codegen(context, builder, sig, args):
        dst, src = (builder.inttoptr(address, F32.as_pointer()) for address in args)
        builder.store(builder.load(src, align=4), dst, align=4)
        return context.get_dummy_value()

    return signature, codegen


# (rows, cols, src, lds, dst, ldd): sizes and leading dimensions in elements, operands
# by address.
TRANSPOSE_SIGNATURE = types.void(*[types.int64] * 6)


def _transpose(rows, cols, src, lds, dst, ldd):
    """`transpose`'s code, compiled by `_compiled`."""
    whole_rows, whole_cols = rows - rows % VW, cols - cols % VW
    for i0 in range(0, whole_rows, VW):
        for j0 in range(0, whole_cols, VW):
            _transpose_block(src + 4 * (i0 * lds + j0), lds, dst + 4 * (j0 * ldd + i0), ldd)
    for i in range(rows):  # what no whole block covers: the last columns of every row,
        for j in range(whole_cols if i < whole_rows else 0, cols):  # every last row's
            _copy_element(dst + 4 * (j * ldd + i), src + 4 * (i * lds + j))


# ---------------------------------------------------------------------------------------
# Kernels call these by symbol name, as they call the BLAS (`purinec.codegen.cpu_runtime`):
# their machine code, compiled once (and cached by Numba), is not linked into every
# kernel (which cost lenet's cold compile 2 s). Compiled when a kernel first imports
# one, not when code generation reads the tile sizes above.
_FUNCTIONS = {"tiled_sgemm": ("purinec_tiled_sgemm", _tiled_sgemm, SIGNATURE),
              "transpose": ("purinec_transpose", _transpose, TRANSPOSE_SIGNATURE)}


def _call_by_arrays(symbol: str, args: tuple, arrays: dict[int, bool]):
    """An intrinsic's typing of a call of the C function ``symbol`` whose arguments at
    the positions of ``arrays`` are addresses, given as arrays (or, where ``arrays``
    says True, as the literal 0 for none): the call takes each array's data address
    itself. Kernels never take an address (``x.ctypes.data``) and pass the integer:
    Numba frees an array right after its last use, so a scratch array whose last use
    that was would be freed before the function read it (another thread's
    allocations then reused the memory: a crash, or wrong offsets)."""
    for at, ty in enumerate(args):
        if at in arrays:
            none = (arrays[at] and isinstance(ty, types.IntegerLiteral)
                    and ty.literal_value == 0)
            if not (isinstance(ty, types.Array) or none):
                return None
        elif not isinstance(ty, types.Integer):
            return None

    def codegen(context, builder, signature, values):
        from numba.np.arrayobj import make_array

        words = [builder.ptrtoint(make_array(ty)(context, builder, value).data, I64)
                 if isinstance(ty, types.Array)
                 else context.cast(builder, value, ty, types.int64)
                 for ty, value in zip(signature.args, values)]
        function = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [I64] * len(words)), symbol)
        builder.call(function, words)
        return context.get_dummy_value()

    return types.void(*args), codegen


@intrinsic
def _tiled_sgemm_call(typingctx, m, n, k, a, lda, a_rows, a_taps, b, ldb, b_rows, c, ldc,
                      beta):
    return _call_by_arrays("purinec_tiled_sgemm",
                           (m, n, k, a, lda, a_rows, a_taps, b, ldb, b_rows, c, ldc, beta),
                           {3: False, 5: True, 6: True, 7: False, 9: True, 10: False})


@intrinsic
def _transpose_call(typingctx, rows, cols, src, lds, dst, ldd):
    return _call_by_arrays("purinec_transpose", (rows, cols, src, lds, dst, ldd),
                           {2: False, 4: False})


_CALLS = {"tiled_sgemm": _tiled_sgemm_call, "transpose": _transpose_call}


_compiling = threading.Lock()
_compiled_code: dict[str, CFunc] = {}


def _compiled(name: str) -> CFunc:
    """The C function ``name`` compiled, made once per process, however many threads
    ask at once: its symbol must lead to code that stays alive."""
    with _compiling:
        if name not in _compiled_code:
            symbol, code, signature = _FUNCTIONS[name]
            function = CFunc(code, sigutils.normalize_signature(signature), locals={},
                             options={})
            function.enable_caching()
            jitcache.ready_cfunc(function, functools.partial(_compile, function, symbol))
            llvm.add_symbol(symbol, function.address)
            _compiled_code[name] = function
        return _compiled_code[name]


def _compile(function: CFunc, symbol: str) -> None:
    """Compile ``function`` into Numba's disk cache, or load it from there once another
    process (a compile helper, another rank) that holds its lock has compiled it: a cold
    compile's helper and its main process each compiled the GEMM, 2.6 s where one
    took 1.8."""
    start_numba_without_scipy()
    with cache.one_compiler(symbol):
        function.compile()


# How a kernel's module imports one of these C functions (`cpu_conv`'s import lines).
_IMPORTED = re.compile(r"^from purinec\.codegen\.cpu_gemm import (\w+)$", re.MULTILINE)


def linked(source: str) -> tuple[str, ...]:
    """The symbols of the C functions here that the kernel module ``source`` imports:
    the names of their locks (`_compile`), which compiling processes test before taking
    the kernel (`purinec.codegen.compile_helpers.compiling_elsewhere`)."""
    return tuple(_FUNCTIONS[name][0] for name in _IMPORTED.findall(source)
                 if name in _FUNCTIONS)


def __getattr__(name: str):
    """``tiled_sgemm(m, n, k, a, lda, a_rows, a_taps, b, ldb, b_rows, c, ldc, beta)``:
    row-major ``c[:m, :n] = a[:m, :k] @ b[:k, :n] + beta * c`` for f32 arrays ``a``,
    ``b``, ``c`` (views of any shape: the product starts at each one's first element)
    with leading dimensions ``lda``, ``ldb``, ``ldc`` (elements), ``beta`` 0 or 1. Row
    ``r`` of ``b`` starts ``r * ldb`` elements after ``b``'s start, or, with ``b_rows``
    an int64 array (not 0), ``b_rows[r]`` elements after it: the rows of an im2col
    matrix read in place, from the padded image (`purinec.codegen.cpu_conv`'s implicit
    convolutions). Likewise ``a[i, k]`` is ``a_rows[i] + a_taps[k]`` elements after
    ``a``'s start where ``a_taps``, an int64 array, is not 0 (``lda`` unused), else
    ``i * lda + k``: the transposed im2col matrix of a pixel-major convolution, read in
    place.

    ``transpose(rows, cols, src, lds, dst, ldd)``: ``dst[j, i] = src[i, j]`` for
    ``i < rows``, ``j < cols``, f32 arrays ``src``, ``dst`` with leading dimensions
    ``lds``, ``ldd`` (elements); by blocks of `VW` x `VW` in registers.

    Both are for jitted code (`_call_by_arrays`); their C functions take addresses."""
    if name in _CALLS:
        _compiled(name)
        return _CALLS[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
