"""Depthwise convolutions of stride 1 as vector code over flat planes, without padding.

A depthwise layer of "same" width (output rows as wide as the input's, as mobilenet_v2's
3x3 layers are) reads, for output pixel ``k`` of a plane laid flat, input pixel ``k +
offset`` for each tap, one offset a tap: a run of a vector's pixels is one unaligned
load. Where a tap falls outside the image (the padding, or past a row's end into the
next row) its lanes are masked off: the load yields zeros there and reads nothing, so
the image is never copied into a padded scratch. Which lanes each tap of each vector
keeps depends on the layer's sizes only, so the masks are a table made once, when the
kernel's module loads (`depthwise_tables`).

`depthwise_vectors` computes a few vectors of a plane at a time, the sums of each in
registers across the taps (one multiply-add and one masked load per tap and vector):
with one vector at a time the multiply-adds waited on each other. The Numba loops of
`purinec.codegen.cpu_conv._direct_conv_flat` (a padded copy of each plane, rows of 7 or
14 pixels computed as wide as a padded row, partly scalar) took 2-3x as long on small
planes. One thread, kernels alone, us, those loops against this: 960 channels of 7x7
47-49 against 16-17, 576 of 14x14 54-58 against 39-41, 192 of 28x28 72 against 68-71,
144 of 56x56 222 against 190-200 (2-core Zen 4).

The kernel cache keys kernels by this file's text (`purinec.codegen.cache`): kernels
inline its code.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from purinec.codegen.cpu_gemm import VW, _splat

I1, I32, I64, F32 = ir.IntType(1), ir.IntType(32), ir.IntType(64), ir.FloatType()
MASK_BITS = ir.IntType(VW)  # a vector's lanes, one bit each, as the table holds them
MASK_DTYPE = np.dtype(f"uint{max(8, VW)}")

# Vectors of a plane computed at a time, their sums in registers: 4 chains of
# multiply-adds hide each one's latency (2 gave 960 channels of 7x7 17.7 against 20.6
# us for one, 576 of 14x14 42 against 63; 8 no faster than 4).
UNITS = 4


def depthwise_tables(h: int, w: int, oh: int, kh: int, kw: int, dh: int, dw: int,
                     pt: int, pl: int) -> tuple[np.ndarray, np.ndarray]:
    """For a stride-1 depthwise convolution whose output rows are as wide as its input
    rows (``w``), output ``oh`` rows: each tap's offset from an output pixel to the
    input pixel it reads, both planes laid flat (int64, taps in row-major order); and
    for each vector of the output plane (`VW` pixels, the last one partial) and tap,
    the lanes whose pixel the tap reads inside the image, as bits (`MASK_DTYPE`,
    vectors by taps)."""
    taps = [(i, j) for i in range(kh) for j in range(kw)]
    offsets = np.array([(i * dh - pt) * w + j * dw - pl for i, j in taps], np.int64)
    pixels = oh * w
    vectors = -(-pixels // VW)
    k = np.arange(vectors * VW)
    row, column = k // w, k % w
    lanes = np.empty((vectors, len(taps)), MASK_DTYPE)
    weights = np.left_shift(np.ones(VW, np.uint64), np.arange(VW, dtype=np.uint64))
    for t, (i, j) in enumerate(taps):
        r, c = row + i * dh - pt, column + j * dw - pl
        inside = (k < pixels) & (r >= 0) & (r < h) & (c >= 0) & (c < w)
        lanes[:, t] = (inside.reshape(vectors, VW) * weights).sum(axis=1).astype(MASK_DTYPE)
    return offsets, lanes.reshape(-1)


@intrinsic
def depthwise_vectors(typingctx, count, taps, x, vector, offsets, masks, w, y, pixels):
    """Output vectors ``vector`` to ``vector + count`` (``count`` a constant, up to
    `UNITS`) of one plane: ``y[k] = sum over taps t of w[t] * x[k + offsets[t]]`` where
    the tables (`depthwise_tables`, ``masks`` from row ``vector``) keep the lane, for
    ``k`` from ``vector * VW`` on; ``taps`` is a constant too. ``x``, ``y``: the input
    and output planes (C-contiguous), ``pixels`` in the output plane: lanes past it are
    not stored."""
    if not (isinstance(count, types.IntegerLiteral) and isinstance(taps, types.IntegerLiteral)):
        return None
    signature = types.void(count, taps, x, vector, offsets, masks, w, y, pixels)

    def codegen(context, builder, sig, args):
        from numba.np.arrayobj import make_array

        units, n_taps = count.literal_value, taps.literal_value
        _, _, x_arr, vector, offsets_arr, masks_arr, w_arr, y_arr, pixels = args
        x_ptr, offsets_ptr, masks_ptr, w_ptr, y_ptr = (
            make_array(ty)(context, builder, value).data for ty, value in
            zip((sig.args[i] for i in (2, 4, 5, 6, 7)),
                (x_arr, offsets_arr, masks_arr, w_arr, y_arr)))
        code = _VectorCode(builder)
        first = builder.mul(vector, ir.Constant(I64, VW))
        lane_masks = builder.gep(masks_ptr, [builder.mul(vector, ir.Constant(I64, n_taps))])
        sums = [code.zero] * units
        for t in range(n_taps):
            at = builder.add(first, builder.load(builder.gep(offsets_ptr, [_i64(t)])))
            weight = _splat(builder, code.vector, builder.load(builder.gep(w_ptr, [_i64(t)])))
            for u in range(units):
                lanes = builder.bitcast(
                    builder.load(builder.gep(lane_masks, [_i64(u * n_taps + t)])), code.mask)
                pixel = builder.gep(x_ptr, [builder.add(at, _i64(u * VW))])
                sums[u] = code.fma(code.masked_load(pixel, lanes), weight, sums[u])
        for u in range(units):
            start = builder.add(first, _i64(u * VW))
            code.store(sums[u], builder.gep(y_ptr, [start]), builder.sub(pixels, start))
        return context.get_dummy_value()

    return signature, codegen


def _i64(value: int) -> ir.Constant:
    return ir.Constant(I64, value)


class _VectorCode:
    """The vector type and the LLVM intrinsics `depthwise_vectors` uses."""

    def __init__(self, builder):
        self.builder = builder
        self.vector = ir.VectorType(F32, VW)
        self.mask = ir.VectorType(I1, VW)
        self.zero = ir.Constant(self.vector, [0.0] * VW)
        module, pointer = builder.module, self.vector.as_pointer()
        self._load = cgutils.get_or_insert_function(
            module, ir.FunctionType(self.vector, [pointer, I32, self.mask, self.vector]),
            f"llvm.masked.load.v{VW}f32.p0")
        self._store = cgutils.get_or_insert_function(
            module, ir.FunctionType(ir.VoidType(), [self.vector, pointer, I32, self.mask]),
            f"llvm.masked.store.v{VW}f32.p0")
        self._fma = cgutils.get_or_insert_function(
            module, ir.FunctionType(self.vector, [self.vector] * 3), f"llvm.fma.v{VW}f32")

    def masked_load(self, pointer, lanes):
        """The vector at ``pointer``, zero in the lanes ``lanes`` leaves out (which are
        not read: they may lie outside the array)."""
        at = self.builder.bitcast(pointer, self.vector.as_pointer())
        return self.builder.call(self._load, [at, ir.Constant(I32, 4), lanes, self.zero])

    def fma(self, a, b, c):
        return self.builder.call(self._fma, [a, b, c])

    def store(self, value, pointer, left) -> None:
        """``value`` at ``pointer``, its first ``left`` lanes only where fewer than a
        vector's (none for ``left`` <= 0)."""
        builder = self.builder
        at = builder.bitcast(pointer, self.vector.as_pointer())
        whole = builder.icmp_signed(">=", left, _i64(VW))
        with builder.if_else(whole, likely=True) as (then, otherwise):
            with then:
                builder.store(value, at, align=4)
            with otherwise:
                lanes = ir.Constant(ir.VectorType(I64, VW), list(range(VW)))
                inside = builder.icmp_signed("<", lanes, _splat(
                    builder, ir.VectorType(I64, VW), left))
                builder.call(self._store, [value, at, ir.Constant(I32, 4), inside])
