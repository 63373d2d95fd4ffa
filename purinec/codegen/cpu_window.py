"""Windows over flat planes as vector code, without padding: depthwise convolutions
and max pooling.

A depthwise layer of "same" width (output rows as wide as the input's, as mobilenet_v2's
3x3 layers of stride 1 are) reads, for output pixel ``k`` of a plane laid flat, input
pixel ``k + offset`` for each tap, one offset a tap: a run of a vector's pixels is one
unaligned load. Strided, the same holds of the input split into phase planes (pixels
by row and column modulo the stride, `grid_shape`) where the output rows are as wide
as those planes' (mobilenet_v2's of stride 2, 112 -> 56 pixels): a tap reads the plane
of its phase, and each input row is split by `split_row`. Where the output rows are
narrower (squeezenet1_1's pools, 55 -> 27 pixels), they are computed as wide as the
planes' and copied out; where wider (padding past "same"), the planes are made that
wide. Where a tap falls outside the image (the padding, or past a row's end into the
next row) its lanes are masked off: the load yields zeros there and reads nothing, so
nothing is padded. Which lanes each tap of each vector keeps depends on the layer's
sizes only, so the masks are a table made once, when the kernel's module loads
(`window_tables`). Max pooling is the same walk over the same taps, keeping the
greatest where a convolution sums (`max_vectors`).

`depthwise_vectors` computes a few vectors of a plane at a time, the sums of each in
registers across the taps (one multiply-add and one masked load per tap and vector):
with one vector at a time the multiply-adds waited on each other. Against the Numba
loops of `purinec.codegen.cpu_conv._direct_conv_flat` (a padded copy of each plane in
phase planes, rows of 7 or 14 pixels computed as wide as a padded row, partly scalar),
mobilenet_v2's layers at batch 1, one thread, kernels alone, us, loops against this
(2-core Zen 4, a noisy host): stride 1, 960 channels of 7x7 50 against 19, 576 of
14x14 60 against 46, 192 of 28x28 and 144 of 56x56 level; stride 2, 576 of 14x14 107
against 43, 192 of 28x28 117 against 38, 144 of 56x56 224 against 115, 96 of 112x112
416 against 311 (its input, 4.8 MB, read from memory: the row splits alone took 129).
googlenet's max pools against `purinec.codegen.cpu_pool`'s phase-plane loops, the
same way: 3x3 at stride 2 of 64 channels of 112x112 182 against 159, 192 of 56x56 124
against 99, 480 of 28x28 109 against 62; 2x2 of 832 of 14x14 84 against 34; 3x3 at
stride 1 of 256 of 28x28 152 against 101, 512 of 14x14 89 against 41, 832 of 7x7 55
against 15. squeezenet1_1's, whose output rows are computed as wide as the planes' and
copied out: 64 channels of 111x111 145 against 155, 128 of 55x55 80 against 70, 256 of
27x27 52 against 30.

The kernel cache keys kernels by this file's text (`purinec.codegen.cache`): kernels
inline its code.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core.extending import intrinsic

from purinec.codegen.cpu_gemm import VW, VectorCode, _splat

I32, I64, F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
MASK_DTYPE = np.dtype(f"uint{max(8, VW)}")

# Vectors of a plane computed at a time, their sums in registers: 4 chains of
# multiply-adds hide each one's latency (2 gave 960 channels of 7x7 17.7 against 20.6
# us for one, 576 of 14x14 42 against 63; 8 no faster than 4).
UNITS = 4


def window_tables(h: int, w: int, oh: int, ow: int, kh: int, kw: int, sh: int, sw: int,
                  dh: int, dw: int, pt: int, pl: int) -> tuple[np.ndarray, np.ndarray]:
    """For windows (a depthwise convolution's, a pooling's) computed over the grid of
    `grid_shape`: each tap's offset from an output pixel to the input pixel it reads,
    the output laid flat on the grid and the input as its phase planes, each as wide
    as the grid, laid flat one after another (int64, taps in row-major order); and for
    each vector of the output grid (`VW` pixels, the last one partial) and tap, the
    lanes whose pixel the tap reads inside the image, of an output pixel inside the
    output's rows, as bits (`MASK_DTYPE`, vectors by taps)."""
    rows, width = grid_shape(h, w, ow, sh, sw)
    taps = [(i * dh - pt, j * dw - pl) for i in range(kh) for j in range(kw)]
    offsets = np.array([((di % sh) * sw + dj % sw) * rows * width
                        + (di // sh) * width + dj // sw for di, dj in taps], np.int64)
    pixels = oh * width
    vectors = -(-pixels // VW)
    k = np.arange(vectors * VW)
    row, column = k // width * sh, k % width * sw
    lanes = np.empty((vectors, len(taps)), MASK_DTYPE)
    bits = np.left_shift(np.ones(VW, np.uint64), np.arange(VW, dtype=np.uint64))
    for t, (di, dj) in enumerate(taps):
        r, c = row + di, column + dj
        inside = ((k < pixels) & (k % width < ow)
                  & (r >= 0) & (r < h) & (c >= 0) & (c < w))
        lanes[:, t] = (inside.reshape(vectors, VW) * bits).sum(axis=1).astype(MASK_DTYPE)
    return offsets, lanes.reshape(-1)


def grid_shape(h: int, w: int, ow: int, sh: int, sw: int) -> tuple[int, int]:
    """The rows and columns of each phase plane of an ``h`` x ``w`` image split by row
    modulo ``sh`` and column modulo ``sw`` (plane ``(a, b)`` holds pixels ``(sh*R + a,
    sw*C + b)``), as wide as the output's rows (``ow``) where those are wider: the
    grid the windows are computed over, output row ``r`` and column ``c`` reading the
    planes at row ``r`` and column ``c`` plus the tap's offset. Some planes' last row
    or columns lie outside the image."""
    return -(-h // sh), max(ow, -(-w // sw))


def in_place(h: int, w: int, ow: int, sh: int, sw: int) -> bool:
    """Whether the windows read their input where it lies: of stride 1, with output
    rows no wider than the input's (the grid is the image itself)."""
    return (sh, sw) == (1, 1) and grid_shape(h, w, ow, sh, sw)[1] == w


@intrinsic
def depthwise_vectors(typingctx, count, taps, x, vector, offsets, masks, w, y, pixels):
    """Output vectors ``vector`` to ``vector + count`` (``count`` a constant, up to
    `UNITS`) of one plane: ``y[k] = sum over taps t of w[t] * x[k + offsets[t]]`` where
    the tables (`window_tables`, ``masks`` from row ``vector``) keep the lane, for
    ``k`` from ``vector * VW`` on; ``taps`` is a constant too. ``x``, ``y``: the input
    (its phase planes, strided) and output planes (C-contiguous), ``pixels`` in the
    output plane: lanes past it are not stored."""
    if not (isinstance(count, types.IntegerLiteral) and isinstance(taps, types.IntegerLiteral)):
        return None

    def add_tap(code, sums, t, pixels_at, weights):
        weight = _splat(code.builder, code.vector,
                        code.builder.load(code.builder.gep(weights, [_i64(t)])))
        return [code.fma(pixels, weight, total) for pixels, total in zip(pixels_at(0.0), sums)]

    return (types.void(count, taps, x, vector, offsets, masks, w, y, pixels),
            _windows_codegen(add_tap, weighted=True))


@intrinsic
def max_vectors(typingctx, count, taps, x, vector, offsets, masks, y, pixels):
    """`depthwise_vectors`' windows, their greatest tap rather than their weighted sum:
    the first maximum in the taps' order, a NaN winning only as the first (as a scalar
    loop's ``if v > best``), outside the image -inf."""
    if not (isinstance(count, types.IntegerLiteral) and isinstance(taps, types.IntegerLiteral)):
        return None

    def take_greater(code, best, t, pixels_at, weights):
        builder = code.builder
        taps = pixels_at(-np.inf)
        if t == 0:
            return taps
        return [builder.select(builder.fcmp_ordered(">", tap, so_far), tap, so_far)
                for tap, so_far in zip(taps, best)]

    return (types.void(count, taps, x, vector, offsets, masks, y, pixels),
            _windows_codegen(take_greater, weighted=False))


def _windows_codegen(combine, weighted: bool):
    """The code of `depthwise_vectors` or `max_vectors`: for each tap, ``combine(code,
    so_far, t, pixels_at, weights)`` gives the vectors' new values from what they hold
    so far (zero before the first tap) and ``pixels_at(fill)``, the tap's pixel of
    each vector (``fill`` where the masks leave it out); ``weights`` points at the
    convolution's weights, the argument after the masks where ``weighted`` (None for a
    pooling)."""
    def codegen(context, builder, sig, args):
        from numba.np.arrayobj import make_array

        units, n_taps = (ty.literal_value for ty in sig.args[:2])
        arrays = {at: make_array(sig.args[at])(context, builder, args[at]).data
                  for at, ty in enumerate(sig.args) if isinstance(ty, types.Array)}
        x_ptr, offsets_ptr, masks_ptr, y_ptr = (arrays[at] for at in (2, 4, 5, len(args) - 2))
        weights = arrays[6] if weighted else None
        vector, pixels = args[3], args[-1]
        code = VectorCode(builder)
        first = builder.mul(vector, _i64(VW))
        lane_masks = builder.gep(masks_ptr, [builder.mul(vector, _i64(n_taps))])
        values = [code.zero] * units
        for t in range(n_taps):
            at = builder.add(first, builder.load(builder.gep(offsets_ptr, [_i64(t)])))

            def pixels_at(fill, t=t, at=at):
                loads = []
                for u in range(units):
                    lanes = builder.bitcast(builder.load(
                        builder.gep(lane_masks, [_i64(u * n_taps + t)])), code.mask)
                    pixel = builder.gep(x_ptr, [builder.add(at, _i64(u * VW))])
                    loads.append(code.masked_load(pixel, lanes, fill=fill))
                return loads
            values = combine(code, values, t, pixels_at, weights)
        for u in range(units):
            start = builder.add(first, _i64(u * VW))
            code.store(values[u], builder.gep(y_ptr, [start]), builder.sub(pixels, start))
        return context.get_dummy_value()

    return codegen


@intrinsic
def split_row(typingctx, stride, src, first, width, dst, at, plane):
    """Pixels ``first * stride`` to ``(first + VW) * stride`` of a row of ``width``
    pixels (``src``, C-contiguous) into the row's phase planes by column modulo
    ``stride`` (a constant): pixel ``column * stride + phase`` to ``dst[at + phase *
    plane + column]`` for the columns from ``first`` (a multiple of `VW`) on that the
    row has. One masked load of ``stride`` vectors and a shuffle a phase: as a loop, a
    row of 7 or 14 pixels was copied a pixel at a time."""
    if not isinstance(stride, types.IntegerLiteral):
        return None
    signature = types.void(stride, src, first, width, dst, at, plane)

    def codegen(context, builder, sig, args):
        from numba.np.arrayobj import make_array

        step = stride.literal_value
        _, src_arr, first, width, dst_arr, at, plane = args
        src_ptr, dst_ptr = (make_array(ty)(context, builder, value).data for ty, value in
                            ((sig.args[1], src_arr), (sig.args[4], dst_arr)))
        code = VectorCode(builder)
        wide = ir.VectorType(F32, step * VW)
        start = builder.mul(first, _i64(step))
        inside = code.lanes_below(builder.sub(width, start), step * VW)
        pixels = code.masked_load(builder.gep(src_ptr, [start]), inside, wide)
        for phase in range(step):
            picked = builder.shuffle_vector(pixels, pixels, ir.Constant(
                ir.VectorType(I32, VW), [phase + step * lane for lane in range(VW)]))
            # column first + lane exists where (first + lane) * step + phase < width
            columns = builder.sdiv(builder.sub(builder.add(width, _i64(step - 1 - phase)),
                                               start), _i64(step))
            into = builder.add(builder.add(at, builder.mul(plane, _i64(phase))), first)
            code.masked_store(picked, builder.gep(dst_ptr, [into]),
                              code.lanes_below(columns, VW))
        return context.get_dummy_value()

    return signature, codegen


def _i64(value: int) -> ir.Constant:
    return ir.Constant(I64, value)
