"""CPU renderers of matrix products and convolutions, through BLAS.

* ``matmul``: one GEMM on the operands as stored (transposes are BLAS flags), in
  blocks of rows (or columns) when big;
* ``conv2d``: per image, im2col into a scratch matrix (from a zero-bordered copy of the
  image when there is padding, so the copy loops have constant trip counts and no
  bounds tests; taps ``dilation`` apart are just larger steps; a few output rows at a
  time where the matrix would be big, `_im2col_chunk_rows`) and one GEMM per group.
  1x1 convolutions with stride 1 and no padding skip im2col: the image is the matrix.
  With stride 1 along rows and enough input channels, one GEMM per kernel row over a
  matrix ``kh`` times smaller than im2col's (see `_by_kernel_rows`). Groups of few
  channels (depthwise) are a direct loop nest instead (`_direct`), over flat phase
  planes where rows are narrow (`_direct_conv_flat`) and over column phases where a
  column stride would make the loop along a row read every other column
  (`_column_phases`). Threads split the images' output rows (`_image_rows`), so one
  image runs on all of them;
* ``conv2d_grad_input``: col2im of ``w^T @ gy`` per image (by kernel rows, likewise),
  or, for stride 1 "same" convolutions, a forward convolution of ``gy`` with flipped
  weights (as dilated as the forward's);
* ``conv2d_grad_weight``: ``gw^T`` by a GEMM per image accumulating in place (BLAS
  ``beta = 1``), then transposed; rows of the im2col matrix (columns of the gradient)
  are independent, so they are what blocks split, unless they are few: then blocks take
  fixed parts of the images, each summing its own gradient, added up at the end.

Where the BLAS multiplies small products without packing them first, much faster than
packed (OpenBLAS on AVX-512: `CpuOptions.small_gemm_macs`), forward products run in
chunks of columns that small (`_chunks`), and weight gradients multiply by ``gy``
transposed in chunks of pixels (`_unpacked`).

Both anchors take an *epilogue* (`purinec.codegen.cpu_fused`): elementwise consumers
run on each image (or row; or the block of them a thread computed) right after it is
computed, while it is in cache.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterator

from purinec.codegen.cpu_gemm import MR, VW, lanes
from purinec.codegen.kernel import CodegenError
from purinec.codegen.cpu_module import KernelModule, atom, literal, renders
from purinec.codegen.cpu_ops import affine, dtype_name, row_slice, span_of, split_loop
from purinec.codegen.cpu_window import UNITS, grid_shape, in_place
from purinec.ir.graph import Node
from purinec.ir.ops.linalg import panels_oihw
from purinec.ir.nnref import pad_edges
from purinec.ir.types import DType


def _tiled(m: KernelModule, node: Node, trans_b=False) -> bool:
    """Whether a product of ``node``'s goes to `purinec.codegen.cpu_gemm.tiled_sgemm`
    rather than the BLAS: f32, on CPUs it suits (`CpuOptions.tiled_gemm`), with the
    rows of ``op(b)`` as stored (the tile loads them as vectors). ``op(a)`` may be
    transposed: the tile reads it a scalar at a time (`_transposed_a`)."""
    return (m.options.tiled_gemm and not trans_b
            and node.outputs[0].type.dtype is DType.f32)


def _transposed_a(m: KernelModule, rows, inner: int, lda) -> tuple[str, str]:
    """`tiled_sgemm`'s offsets (``a_at``) that read ``a`` transposed: ``a[i, k]`` at
    ``i + k * lda``. A dense layer's weight gradient ``gy^T @ x`` (64 images, 256 of
    512 rows by 512 or 784 columns, one thread, Zen 4) ran at 110-114 GFLOP/s so
    against OpenBLAS's 97-101."""
    a_rows, a_taps, i = m.fresh("a_rows"), m.fresh("a_taps"), m.fresh("i")
    b = m.body
    b.line(f"{a_rows} = {m.empty([rows], 'np.int64')}")
    with b.block(f"for {i} in range({rows}):"):
        b.line(f"{a_rows}[{i}] = {i}")
    b.line(f"{a_taps} = {m.empty([inner], 'np.int64')}")
    with b.block(f"for {i} in range({inner}):"):
        b.line(f"{a_taps}[{i}] = {i} * {lda}")
    return a_rows, a_taps


def _gemm(m: KernelModule, node: Node, a: str, b: str, c: str, rows, cols, inner,
          lda, ldb, ldc, beta: int = 0, trans_a=False, trans_b=False,
          b_rows: str | None = None, a_at: tuple[str, str] | None = None) -> None:
    """Row-major ``c[rows, cols] = op(a) @ op(b) + beta * c`` in one call: of
    `tiled_sgemm` where `_tiled`, else of CBLAS. With ``b_rows`` (`_tiled` only), an
    int64 array: row ``r`` of ``b`` begins ``b_rows[r]`` elements after ``b``; with
    ``a_at`` (f32, always `tiled_sgemm`), int64 arrays ``(rows, taps)``: ``a[i, k]`` is
    ``rows[i] + taps[k]`` elements after ``a``."""
    if _tiled(m, node, trans_b) or a_at is not None:
        m.import_line("from purinec.codegen.cpu_gemm import tiled_sgemm")
        if trans_a:
            assert a_at is None, "a transposed is read at offsets of its own"
            a_at = _transposed_a(m, rows, inner, lda)
        a_rows, a_taps = a_at or ("0", "0")
        m.body.line(f"tiled_sgemm({rows}, {cols}, {inner}, {a}, {lda}, {a_rows}, {a_taps}, "
                    f"{b}, {ldb}, {b_rows or '0'}, {c}, {ldc}, {beta})")
        return
    assert b_rows is None and a_at is None, "operands at offsets are for tiled_sgemm only"
    dtype = node.outputs[0].type.dtype
    fn = "sgemm" if dtype is DType.f32 else "dgemm"
    m.import_line(f"from purinec.codegen.cpu_runtime import {fn}")
    ta, tb = (112 if t else 111 for t in (trans_a, trans_b))  # CblasTrans, CblasNoTrans
    lda, ldb, ldc = (f"max(1, {ld})" if isinstance(ld, str) else max(1, ld)
                     for ld in (lda, ldb, ldc))
    one, scale = literal(1, dtype), literal(beta, dtype)
    m.body.line(f"{fn}(101, {ta}, {tb}, {rows}, {cols}, {inner}, {one}, {a}.ctypes, {lda}, "
                f"{b}.ctypes, {ldb}, {scale}, {c}.ctypes, {ldc})")


# Chunks narrower than this run slower than a whole packed product: a 32x75 by 75x1024
# one ran at 55 GFLOP/s whole, 47 in chunks of 32 columns and 70 of 64.
MIN_CHUNK = 64
VECTOR = 16  # chunks start at multiples of this many columns (a 64-byte vector of f32)


# ---------------------------------------------------------------------------------------
# Matrix products.


@renders("matmul")
def render_matmul(node: Node, m: KernelModule) -> None:
    emit_matmul(node, m, *m.inputs, m.outputs[0])


# Products with fewer rows than this are split across threads in blocks of columns when
# they have more columns than rows (see `emit_matmul`).
FEW_ROWS = 128


def emit_matmul(node: Node, m: KernelModule, a: str, bm: str,
                out: str | None) -> tuple[str, str, bool]:
    """One GEMM into ``out``, or with ``out`` None into a scratch ``product`` holding
    the rows this call computes (whole: a block of columns lies where it is in the
    output). A big one runs in blocks of rows, or of columns when
    it has few rows (`FEW_ROWS`) and more columns: a block of a short, wide product then
    keeps every row, and OpenBLAS runs a [64, 256] block about 20% faster than a
    [32, 512] one. Returns the block's bounds and whether they count columns."""
    ta, tb = node.attrs["trans_a"], node.attrs["trans_b"]
    a_shape, b_shape = node.inputs[0].type.shape, node.inputs[1].type.shape
    rows, cols = node.outputs[0].type.shape
    inner = a_shape[0] if ta else a_shape[1]
    lda, ldb = a_shape[1], b_shape[1]
    by_columns = cols > rows and rows < FEW_ROWS
    lo, hi = (_split_product(m, cols if by_columns else rows, rows, cols, inner)
              if rows and cols else ("0", "0"))
    count = (cols if by_columns else rows) if lo == "0" else f"{hi} - {lo}"
    if out is None:
        shape = (rows if by_columns else count, cols)
        m.body.line(f"product = {m.empty(shape, dtype_name(node))}")
        out = f"product[:, {lo}:{hi}]" if by_columns and lo != "0" else "product"
    elif lo != "0":
        out = f"{out}[:, {lo}:{hi}]" if by_columns else f"{out}[{lo}:{hi}]"
    if rows == 0 or cols == 0:
        return "0", str(rows), False
    if by_columns:  # blocks of columns of op(b) and of the output
        b_block = bm if lo == "0" else (f"{bm}[{lo}:{hi}]" if tb else f"{bm}[:, {lo}:{hi}]")
        _tiled_gemm(m, node, a, b_block, out, (rows, rows), (count, cols), inner, lda, ldb,
                    cols, ta, tb)
    else:  # blocks of rows of op(a) and of the output
        a_block = a if lo == "0" else (f"{a}[:, {lo}:{hi}]" if ta else f"{a}[{lo}:{hi}]")
        _tiled_gemm(m, node, a_block, bm, out, (count, rows), (cols, cols), inner, lda, ldb,
                    cols, ta, tb)
    return lo, hi, by_columns


def _split_product(m: KernelModule, count: int, rows: int, cols: int, inner: int
                   ) -> tuple[str, str]:
    """`KernelModule.split` of a product's ``count`` rows or columns. Its work is its
    multiply-adds, or where it does few of them per element it reads, the elements: a
    dense layer at batch 1 streams its weights (resnet18's 512 x 1000, 2 MB, on one
    thread 154 us against onnxruntime's 74 on two)."""
    macs = rows * cols * inner
    if macs >= m.options.parallel_min_products:
        return m.split(count, macs, products=True)
    return m.split(count, rows * inner + inner * cols + rows * cols)


# OpenBLAS multiplies a product of rows by rows (dot products along both operands' rows,
# as ``a @ b^T`` and the weight gradient's ``col @ gy^T``) unpacked only when it has at
# most this many outputs (its SkylakeX kernels' rule, besides
# `CpuOptions.small_gemm_macs`).
SMALL_DOTS_MAX_OUTPUTS = 1200
DOT_TILE_ROWS = 32  # 32 x 32 tiles: a 64x784 by 784x512 product 76 -> 95 GFLOP/s


def _tiled_gemm(m: KernelModule, node: Node, a: str, b: str, c: str, rows, cols, inner: int,
                lda, ldb, ldc, ta: bool, tb: bool) -> None:
    """``c = op(a) @ op(b)`` for ``rows`` and ``cols`` given as (count, the most it can
    be): ``a @ b^T`` in tiles the BLAS multiplies unpacked (`SMALL_DOTS_MAX_OUTPUTS`)
    where it would pack the whole (mlp's forward products: 64x784 by 784x512, one
    thread, 76 GFLOP/s whole, 95 in 32 x 32 tiles); other products whole."""
    (count_r, most_r), (count_c, most_c) = rows, cols
    area = min(SMALL_DOTS_MAX_OUTPUTS, m.options.small_gemm_macs // max(1, inner))
    whole_small = most_r * most_c <= area
    tile_r = min(most_r, DOT_TILE_ROWS)
    tile_c = area // max(1, tile_r) // VECTOR * VECTOR
    if not tb or ta or whole_small or inner < 32 or tile_c < VECTOR:
        _gemm(m, node, a, b, c, count_r, count_c, inner, lda, ldb, ldc, 0, ta, tb)
        return
    r0, c0 = m.fresh("r0"), m.fresh("c0")
    with m.body.block(f"for {r0} in range(0, {count_r}, {tile_r}):"), \
            m.body.block(f"for {c0} in range(0, {count_c}, {tile_c}):"):
        _gemm(m, node, f"{a}[{r0}:]", f"{b}[{c0}:]", f"{c}[{r0}:, {c0}:]",
              f"min({tile_r}, {count_r} - {r0})", f"min({tile_c}, {count_c} - {c0})", inner,
              lda, ldb, ldc, 0, ta, tb)


# ---------------------------------------------------------------------------------------
# Convolutions: im2col + GEMM per image.


@dataclass(frozen=True)
class _Conv:
    """A convolution's sizes. Padding ``pt``, ``pl``, ``pb``, ``pr``: top, left, bottom,
    right; ``dh``, ``dw``: the dilation. ``K``: rows of the im2col matrix (one per
    weight of an output channel), ``P``: its columns (output pixels)."""

    n: int
    c: int
    h: int
    w: int
    cout: int
    groups: int
    kh: int
    kw: int
    sh: int
    sw: int
    pt: int
    pl: int
    pb: int
    pr: int
    dh: int
    dw: int
    oh: int
    ow: int

    @property
    def cg(self) -> int:
        return self.c // self.groups

    @property
    def og(self) -> int:
        return self.cout // self.groups

    @property
    def K(self) -> int:
        return self.cg * self.kh * self.kw

    @property
    def P(self) -> int:
        return self.oh * self.ow

    @property
    def padded(self) -> bool:
        return any((self.pt, self.pl, self.pb, self.pr))

    @property
    def pointwise(self) -> bool:
        """A 1x1 kernel, stride 1, no padding: the image itself is the im2col matrix."""
        return (self.kh, self.kw, self.sh, self.sw, self.padded) == (1, 1, 1, 1, False)

    @property
    def hp(self) -> int:
        """The padded image's height."""
        return self.h + self.pt + self.pb

    @property
    def wp(self) -> int:
        """The padded image's width."""
        return self.w + self.pl + self.pr

    @property
    def rows_read(self) -> int:
        """Rows of the padded image that stride-1 windows read (`_by_kernel_rows`)."""
        return self.oh + (self.kh - 1) * self.dh

    @property
    def macs(self) -> int:
        return self.n * self.cout * self.P * self.K


def _conv(x_shape, w_shape, y_shape, attrs) -> _Conv:
    n, c, h, w = x_shape
    cout, _, kh, kw = w_shape
    return _Conv(n, c, h, w, cout, attrs["groups"], kh, kw, *attrs["stride"],
                 *pad_edges(attrs["pad"]), *attrs["dilation"], y_shape[2], y_shape[3])


def _read_sizes(m: KernelModule, g: _Conv, images: tuple[str, int],
                channels: tuple[str, int], filters: tuple[str, int]) -> _Conv:
    """``g`` with its batch, input channels and output channels read from the kernel's
    arrays (array, axis) at run time (`KernelModule.extent`): convolutions that differ
    in those only (an inception module's branches, one layer at two batch sizes)
    share their code. The image and kernel sizes stay constants, which LLVM unrolls
    and vectorizes the copies by."""
    return replace(g, n=m.extent(*images, g.n, "images"),
                   c=m.extent(*channels, g.c, "channels"),
                   cout=m.extent(*filters, g.cout, "filters"))


def _times(var: str, factor: int) -> str:
    return var if factor == 1 else f"{var} * {factor}"


def _padded_scratch(m: KernelModule, node: Node, g: _Conv, phased: bool = False) -> None:
    """``xpad``: one group of one image with its zero border, for convolutions with
    padding; ``phased``, each row split by column phase,
    ``xpad[c, row, column % sw, column // sw]`` (`_column_phases`), padding or not.
    The border is zeroed once here and never written again (`_zero_border`)."""
    if not (phased or g.padded):
        return
    if phased:
        width = -(-g.wp // g.sw)
        _zero_border(m, node, "xpad", (g.cg, g.hp, g.sw, width), {
            "[:, {}]": [_outside(g.h, g.pt, 1, 0, g.hp)],
            "[:, :, {phase}, {}]": [_outside(g.w, g.pl, g.sw, phase, width)
                                    for phase in range(g.sw)]})
    else:
        _zero_border(m, node, "xpad", (g.cg, g.hp, g.wp), {
            "[:, {}]": [_outside(g.h, g.pt, 1, 0, g.hp)],
            "[:, :, {}]": [_outside(g.w, g.pl, 1, 0, g.wp)]})


def _zero_border(m: KernelModule, node: Node, name: str, shape: tuple[int, ...],
                 borders: dict[str, list[list[str]]]) -> None:
    """``name``: a new array of ``shape`` zero outside the image it will hold, which the
    kernel copies in, a block only the rows it reads: ``borders`` maps an index
    template (``{}`` the range, ``{phase}`` the phase) to the ranges to zero, one list
    per phase. Zeroing all of it cost a padded convolution's every block a pass over
    the whole image (resnet18's 64 channels of 58x58: 861 KB a thread and a call)."""
    m.body.line(f"{name} = {m.empty(shape, dtype_name(node))}")
    for template, phases in borders.items():
        for phase, spans in enumerate(phases):
            for span in spans:
                m.body.line(f"{name}{template.format(span, phase=phase)} = 0")


def _outside(size: int, before: int, stride: int, phase: int, extent: int) -> list[str]:
    """The ranges (slice text) of an axis ``extent`` long outside an image's ``size``
    positions that begin ``before`` positions in: index ``k`` of the axis stands for
    position ``k * stride + phase`` (a padded axis split into ``stride`` phases)."""
    first = min(max(-(-(before - phase) // stride), 0), extent)
    end = min(max(-(-(before + size - phase) // stride), first), extent)
    return [f"{lo}:{hi}" for lo, hi in ((0, first), (end, extent)) if lo < hi]


def _column_phases(m: KernelModule, g: _Conv) -> bool:
    """Whether a direct convolution reads its image split by column phase: with a
    column stride its loop along an output row would read every ``sw``-th column,
    which vectorizes badly. Only for rows of a vector or more: the split costs a
    short row more than it saves. Depthwise 3x3 of stride 2, kernel alone, same
    process, alternating, Zen 4, ms, rows against phases: batch 32, 96 channels of
    112x112 12.1 against 8.2, 144 of 56x56 4.5 against 4.0; but 192 of 28x28 (rows of
    14) 2.9 against 3.6, 576 of 14x14 1.9 against 2.6; alike at batch 1."""
    return _direct(m, g) and g.sw > 1 and g.ow >= VECTOR and not _flat_planes(g)


def copy_into_phases(m: KernelModule, dst: Callable[[int, str], str],
                     src: Callable[[str], str], width: int, stride: int, left: int) -> None:
    """One row of ``width`` elements into its ``stride`` column phases after ``left``
    columns of border: element ``column * stride + phase - left`` of the row
    (``src(index)``) into column ``column`` of phase ``phase`` (``dst(phase,
    column)``). One loop over the columns every phase has, each iteration storing one
    into each phase (an interleaved access, which LLVM vectorizes as a loop: its trip
    count is `opaque`), then the columns only some phases have."""
    b, c = m.body, m.fresh("c")
    spans = {phase: (max(0, -(-(left - phase) // stride)),
                     (width - 1 + left - phase) // stride + 1) for phase in range(stride)}
    first, last = max(s[0] for s in spans.values()), min(s[1] for s in spans.values())
    if first >= last:  # no column in every phase (a row narrower than the stride)
        first = last = 0

    def store(phase: int, column: str) -> None:
        b.line(f"{dst(phase, column)} = {src(affine(column, stride, phase - left))}")

    if first < last:
        with b.block(f"for {c} in range({m.opaque(last - first)}):"):
            for phase in range(stride):
                store(phase, f"({c} + {first})" if first else c)
    for phase, (start, stop) in spans.items():
        for column in [*range(start, min(first, stop)), *range(max(last, start), stop)]:
            store(phase, str(column))


def tap_in_phases(i: int, j: int, strides: tuple[int, int], dilations: tuple[int, int],
                  width: int) -> tuple[int, int, int]:
    """Where tap ``(i, j)`` of a window lies in an image split into phase planes by row
    and column modulo ``strides``, each plane ``width`` wide: the row phase and column
    phase of its plane, and how far along that plane (flat) it is from the window's
    first pixel."""
    (sh, sw), (dh, dw) = strides, dilations
    return i * dh % sh, j * dw % sw, i * dh // sh * width + j * dw // sw


@contextmanager
def _input_rows(m: KernelModule, g: _Conv, c0: str, rows: tuple[str, str] | None
                ) -> Iterator[tuple[str, str, str]]:
    """Loops over the channels of the group from ``c0`` on and the input rows that
    output rows ``rows`` read (`_image_rows`; all for None or ``"0"``); yields the
    channel in the group, in the image, and the row."""
    b, c, h = m.body, m.fresh("c"), m.fresh("h")
    channel = c if c0 == "0" else f"{c0} + {c}"
    span = str(g.h)
    if rows is not None and rows[0] != "0":
        first, last = m.fresh("h_lo"), m.fresh("h_hi")
        b.line(f"{first} = max({rows[0]} * {g.sh} - {g.pt}, 0)")
        b.line(f"{last} = min(({rows[1]} - 1) * {g.sh} + {(g.kh - 1) * g.dh + 1 - g.pt}, "
               f"{g.h})")
        span = f"{first}, {last}"
    with b.block(f"for {c} in range({g.cg}):"), b.block(f"for {h} in range({span}):"):
        yield c, channel, h


def _pad_image(m: KernelModule, g: _Conv, x: str, n: str, c0: str,
               rows: tuple[str, str] | None = None, phased: bool = False) -> str:
    """Copy group ``c0`` of image ``n`` into the inside of ``xpad``: the input rows
    that output rows ``rows`` read (`_image_rows`; all by default), split by column
    phase if ``phased`` (`_padded_scratch`). Returns how to index the (padded) image:
    a prefix taking ``[c, row, column]`` (``[c, row, phase, column]`` phased)."""
    if not g.padded and not phased:
        return f"{x}[{n}, {c0} + " if c0 != "0" else f"{x}[{n}, "
    with _input_rows(m, g, c0, rows) as (c, channel, h):
        row = affine(h, 1, g.pt)
        if phased:
            copy_into_phases(m, lambda phase, column: f"xpad[{c}, {row}, {phase}, {column}]",
                             lambda at: f"{x}[{n}, {channel}, {h}, {at}]", g.w, g.sw, g.pl)
        else:
            m.copy_run("xpad", f"{c}, {row}, {g.pl}", x, f"{n}, {channel}, {h}, 0", g.w)
    return "xpad["


def _im2col(m: KernelModule, g: _Conv, image: str, col: str, rows: tuple[str, str],
            back: bool, out_rows: tuple[str, str] | None = None, phased: bool = False
            ) -> None:
    """For the im2col rows ``r`` in ``rows`` (``r = (c*kh + i)*kw + j``), stored at row
    ``r - rows[0]`` of ``col``: ``col[r, p*ow + q] = image[c, p*sh + i*dh, q*sw + j*dw]``, the
    image padded (`_pad_image`), so no bounds are tested and the trip counts are
    constants; for output rows ``p`` in ``out_rows`` only (all by default), stored from
    column 0. With ``back``, the adjoint (col2im): ``image[...] += col[...]``;
    ``phased``, the image split by column phase (`_im2col_phased`)."""
    b = m.body
    r, c, i, j, row, p = (m.fresh(s) for s in ("r", "c", "i", "j", "row", "p"))
    span, first = _row_span(g, out_rows)
    with b.block(f"for {r} in range({span_of(*rows)}):"):
        b.line(f"{c} = {r} // {g.kh * g.kw}")
        b.line(f"{i} = {r} // {g.kw} % {g.kh}")
        b.line(f"{j} = {r} % {g.kw}")
        b.line(f"{row} = {r}" if rows[0] == "0" else f"{row} = {r} - {rows[0]}")
        with b.block(f"for {p} in range({span}):"):
            _pixel_row(m, g, image, f"{c}, {affine(first(p), g.sh, _times(i, g.dh))}", j,
                       col, f"{row}, {affine(p, g.ow, 0)}", back, phased)


def _im2col_phased(g: _Conv) -> bool:
    """Whether an im2col (a forward product's, a weight gradient's) reads its image
    split by column phase (`_pad_image`): with a column stride its rows would read
    every ``sw``-th column, a gather; split once, each is a `copy_run`. Kernel minima
    in the nets' traces, alternating runs: squeezenet1_1's 3x3 stride-2 first layer of
    3 channels at batch 32 11.8 -> 11.5 ms (level at batch 1); through the BLAS,
    resnet18's 7x7 stride-2 layer 1.31-1.33 -> 1.27-1.29 ms, its 3x3 stride-2 ones
    0-3%."""
    return g.sw > 1


def _pixel_row(m: KernelModule, g: _Conv, image: str, at: str, j: str, col: str,
               col_at: str, back: bool, phased: bool = False) -> None:
    """``col[col_at + q] = image[at, q*sw + j*dw]`` for the ``ow`` pixels ``q`` of an
    output row (``image`` a prefix, `_pad_image`; ``at`` its channel and row,
    ``col_at`` a row of ``col`` and its first column); with ``back``, the adjoint:
    ``image[...] += col[...]``. Contiguous pixels are one `copy_run` (with ``phased``,
    column ``q*sw + j*dw`` is ``q + j*dw // sw`` of phase ``j*dw % sw``: contiguous
    too); the rest, a loop whose trip count is hidden from LLVM where it adds (col2im),
    so that LLVM vectorizes it rather than unrolling it."""
    first_pixel = _times(j, g.dw)
    if (g.sw == 1 or phased) and not back:
        array, lead = image.split("[", 1)
        column = (f"({first_pixel}) % {g.sw}, ({first_pixel}) // {g.sw}" if phased
                  else first_pixel)
        m.copy_run(col, col_at, array, f"{lead}{at}, {column}", g.ow)
        return
    q = m.fresh("q")
    with m.body.block(f"for {q} in range({m.opaque(g.ow) if back else g.ow}):"):
        pixel = f"{image}{at}, {affine(q, g.sw, first_pixel)}]"
        entry = f"{col}[{col_at} + {q}]"
        m.body.line(f"{pixel} += {entry}" if back else f"{entry} = {pixel}")


@contextmanager
def _groups(m: KernelModule, g: _Conv) -> Iterator[tuple[str, str]]:
    """A loop over the convolution's groups (none for one group); yields the source of
    the first input channel and of the first output channel of the group."""
    if g.groups == 1:
        yield "0", "0"
        return
    gi = m.fresh("g")
    with m.body.block(f"for {gi} in range({g.groups}):"):
        yield f"{gi} * {g.cg}", f"{gi} * {g.og}"


@renders("conv2d", "conv2d_panels")
def render_conv2d(node: Node, m: KernelModule) -> None:
    emit_conv2d(node, m, *m.inputs, m.outputs[0])


def emit_conv2d(node: Node, m: KernelModule, x: str, w: str, y: str | None,
                epilogue: Callable[[str, str | None, tuple | None, tuple], None] | None = None
                ) -> None:
    """A conv2d, or a conv2d_panels (`_pixel_major_forward`), into ``y`` (None: a
    scratch), then ``epilogue`` on each block of it (see `_conv_forward`)."""
    g = node_conv(node)
    if node.op == "conv2d_panels":
        if node.outputs[0].type.dtype is not DType.f32:
            raise CodegenError(f"{node.op} {node.outputs[0].name}: the cpu target computes "
                               f"it in f32 only, not {node.outputs[0].type.dtype}")
        width = node.inputs[1].type.shape[4]
        panels = m.extent(w, 0, g.cout // width, "panels")
        g = replace(g, n=m.extent(x, 0, g.n, "images"), c=m.extent(x, 1, g.c, "channels"),
                    cout=panels * width)
        _pixel_major_forward(node, m, g, x, w, y, (panels, width), epilogue)
        return
    if not _direct(m, g):  # (a direct nest unrolls its channels' loops: they stay constants)
        g = _read_sizes(m, g, images=(x, 0), channels=(x, 1), filters=(w, 0))
    m.body.line(f"w_mat = {m.view(w, (g.cout, g.K))}")
    _conv_forward(node, m, g, x, "w_mat", y, epilogue)


def node_conv(node: Node) -> _Conv:
    """The sizes of a conv2d or conv2d_panels node."""
    w_shape = node.inputs[1].type.shape
    if node.op == "conv2d_panels":
        w_shape = panels_oihw(w_shape)
    return _conv(node.inputs[0].type.shape, w_shape, node.outputs[0].type.shape, node.attrs)


# Pixel-major convolutions (conv2d_panels): the product is pixels by filters, ``sums[p,
# o] = sum over k of image_k[p] * w[k, o]``, vectors along the filters, the rows of
# ``tiled_sgemm``'s left operand read from the (padded) image at ``pixels[p] +
# taps[k]``: no im2col matrix, no phase planes, no column computed for nothing. Where
# an image has few pixels its filter-major product fills few of a tile's lanes (49
# pixels of a 7x7 map in 64; an implicit 3x3 product of 14x14 computes 16 columns a
# row); its filters fill them. The weights come in panels of filters (64 where they
# divide: `cpu_layout.PANEL_WIDTHS`), one product each, read in order: as one
# (C*kh*kw) x O matrix, a product read each tile's rows 4 KB or more apart, and with
# the weights in memory (each read once at batch 1) it ran slower than filter-major.
# One thread, tiled_sgemm alone (us, filter-major against pixel-major), hot: 3x3 of
# 512 channels of 7x7 2922 / 2483, 256 of 14x14 2516 / 2205, 128 of 28x28 2338 / 2183;
# 1x1 320 -> 1280 at 7x7 497 / 410; caches flushed, half of the filters: 512 of 7x7
# 1521 / 1355 (one matrix 1895), 256 of 14x14 1401 / 1199 (1291). Each block's sums
# are then transposed into the output (`_transposed`).


def _pixel_major_forward(node: Node, m: KernelModule, g: _Conv, x: str, w: str,
                         y: str | None, panels: tuple, epilogue: Callable | None) -> None:
    """A conv2d_panels (one group, ``w`` of ``panels`` (count, width) by C, kh, kw) as
    `_conv_forward` computes a conv2d, in blocks of output rows (`_image_rows`) or, for
    few rows (`_by_filters`), of filters; each block's pixel-major ``sums`` transposed
    into the output (`cpu_gemm`'s ``transpose``), then the epilogue."""
    b, dtype, filters = m.body, dtype_name(node), g.cout
    b.line(f"w_panels = {m.view(w, (panels[0], g.K, panels[1]))}")
    if y is None:
        b.line(f"y_img = {m.empty((filters, g.P), dtype)}")
    else:
        b.line(f"y_mat = {m.view(y, (g.n, filters, g.P))}")
    height, width = (g.hp, g.wp) if g.padded else (g.h, g.w)
    if g.padded:
        _padded_scratch(m, node, g)
        source = m.view("xpad", (g.c * height * width,))
    else:
        b.line(f"x_flat = {m.view(x, (g.n, g.c * height * width))}")
    _pixel_major_offsets(m, g, height, width)
    by_filters = _few_rows(g, tiled=True)
    chunk_rows = None if by_filters else _chunk_rows(m, g, g.cout * g.ow * 4)
    b.line(f"sums = {m.empty((_times(chunk_rows, g.ow) if chunk_rows else g.P, filters), dtype)}")
    with _pixel_major_blocks(m, g, by_filters) as (n, block_rows, (f0, f1)), \
            _row_chunks(m, g, block_rows, chunk_rows) as rows:
        image = "y_img" if y is None else f"y_mat[{n}]"
        first = "0" if rows[0] == "0" else f"{rows[0]} * {g.ow}"
        count = g.P if rows[0] == "0" else f"({rows[1]} - {rows[0]}) * {g.ow}"
        if g.padded:
            _pad_image(m, g, x, n, "0", rows)
        else:
            source = f"x_flat[{n}]"
        pixels = "pixels" if first == "0" else f"pixels[{first}:]"
        _panel_products(m, node, g, source, pixels, count, (f0, f1), panels[1])
        filters_of = "sums" if f0 == "0" else f"sums[:, {f0}:]"
        into = image if f0 == first == "0" else f"{image}[{f0}:, {first}:]"
        span = f1 if f0 == "0" else f"{f1} - {f0}"
        _transposed(m, filters_of, count, span, filters, into, g.P)
        if epilogue is not None:
            block = ((1, f0, f1) if f0 != "0" else
                     (2, *rows) if rows[0] != "0" else None)
            epilogue(n, "y_img" if y is None else None, block, (g.n, filters, g.oh, g.ow))


def _panel_products(m: KernelModule, node: Node, g: _Conv, source: str, pixels: str,
                    count, filters: tuple[str, str], width: int) -> None:
    """``sums[:count, f0:f1]`` for the filters ``filters``: a product per panel of
    ``width`` filters, or per the part of a panel among a block's filters."""
    b, (f0, f1) = m.body, filters
    j = m.fresh("j")
    if f0 == "0":
        with b.block(f"for {j} in range({f1} // {width}):"):
            _gemm(m, node, source, f"w_panels[{j}]", f"sums[:, {j} * {width}:]", count,
                  width, g.K, 0, width, g.cout, a_at=(pixels, "taps"))
        return
    c0, c1 = m.fresh("c0"), m.fresh("c1")
    with b.block(f"for {j} in range({f0} // {width}, ({f1} + {width - 1}) // {width}):"):
        b.line(f"{c0} = max({f0}, {j} * {width})")
        b.line(f"{c1} = min({f1}, {j} * {width} + {width})")
        _gemm(m, node, source, f"w_panels[{j}, :, {c0} - {j} * {width}:]",
              f"sums[:, {c0}:]", count, f"{c1} - {c0}", g.K, 0, width, g.cout,
              a_at=(pixels, "taps"))


@contextmanager
def _pixel_major_blocks(m: KernelModule, g: _Conv, by_filters: bool
                        ) -> Iterator[tuple[str, tuple[str, str], tuple[str, str]]]:
    """The loop over images; yields the image, its output rows and its filters to
    compute: split by output rows (`_image_rows`), or with ``by_filters`` every row of
    every image, the kernel's split loop over the filters, in whole vectors."""
    if not by_filters:
        with _image_rows(m, g) as (n, rows):
            yield n, rows, ("0", str(g.cout))
        return
    lo, hi = m.split(g.cout // VECTOR, g.macs, products=True)
    n = m.fresh("n")
    with m.body.block(f"for {n} in range({g.n}):"):
        yield n, ("0", str(g.oh)), ((f"{lo} * {VECTOR}", f"{hi} * {VECTOR}") if lo != "0"
                                    else ("0", str(g.cout)))


def _pixel_major_offsets(m: KernelModule, g: _Conv, height: int, width: int) -> None:
    """``taps[(c*kh + i)*kw + j]``: where tap ``(i, j)`` of channel ``c`` lies in an
    image of ``height`` by ``width`` (flat) from its window's first pixel;
    ``pixels[p*ow + q]``: where the window of output pixel ``(p, q)`` begins."""
    b = m.body
    b.line(f"taps = {m.empty((g.K,), 'np.int64')}")
    c, i, j = m.fresh("c"), m.fresh("i"), m.fresh("j")
    with b.block(f"for {c} in range({g.c}):"), b.block(f"for {i} in range({g.kh}):"), \
            b.block(f"for {j} in range({g.kw}):"):
        b.line(f"taps[({c} * {g.kh} + {i}) * {g.kw} + {j}] = {c} * {height * width} + "
               f"{_times(i, g.dh * width)} + {_times(j, g.dw)}")
    b.line(f"pixels = {m.empty((g.P,), 'np.int64')}")
    p, q = m.fresh("p"), m.fresh("q")
    with b.block(f"for {p} in range({g.oh}):"), b.block(f"for {q} in range({g.ow}):"):
        b.line(f"pixels[{p} * {g.ow} + {q}] = {_times(p, g.sh * width)} + {_times(q, g.sw)}")


def _conv_forward(node: Node, m: KernelModule, g: _Conv, x: str, w_mat: str, y: str | None,
                  epilogue: Callable[[str, str | None, tuple | None, tuple], None] | None = None
                  ) -> None:
    """Per image and group: ``y[n, group] = w_mat[group] @ im2col(x[n, group])``, or a
    direct loop nest for few channels per group (`_direct`), in blocks of output rows
    (`_image_rows`): a block copies, multiplies and stores only its rows' columns; or,
    for few rows (`_by_filters`), in blocks of output channels. Then
    ``epilogue(n, scratch, block, sizes)``, if given, on what the block computed of
    image ``n`` while it is in cache: ``block`` is (axis, first, end) of the output,
    None for all of it; ``sizes``: the output's shape as the code reads it
    (`_read_sizes`). With ``y`` None the output lives only in the per-image ``scratch``
    it is given."""
    b, direct = m.body, _direct(m, g)
    vectors = direct and _depthwise_vectors(m, node, g)
    implicit = _implicit(m, node, g, direct)
    by_rows = _by_kernel_row_weights(g) and not implicit
    by_filters = _by_filters(m, node, g, direct, by_rows)
    flat = direct and not vectors and _flat_planes(g)
    phased = _column_phases(m, g)
    im2col = not (direct or by_rows or by_filters or g.pointwise or implicit)
    dtype = node.outputs[0].type.dtype
    chunk_rows = (_im2col_chunk_rows(m, g, dtype) if im2col else
                  _output_chunk_rows(m, node, g, implicit) if not by_filters else None)
    # (the leading dimension of col, or of x_mat)
    col_width = f"{chunk_rows} * {g.ow}" if im2col and chunk_rows is not None else g.P
    if y is None:
        b.line(f"y_img = {m.empty((g.cout, g.P), dtype_name(node))}")
    else:
        b.line(f"y_mat = {m.view(y, (g.n, g.cout, g.P))}")
    tables = None  # (where the vector code's are)
    if vectors:
        tables = window_tables(m, node, g)
    elif flat:
        _planes_scratch(m, node, g)
        b.line(f"sums = {m.empty((g.oh * _plane_shape(g)[1],), dtype_name(node))}")
    elif direct:
        _padded_scratch(m, node, g, phased=phased)
    elif g.pointwise:
        b.line(f"x_mat = {m.view(x, (g.n, g.c, g.P))}")
    elif implicit:
        _phase_planes(m, node, g, chunk_rows or g.oh)
    elif by_rows:
        _kernel_row_weights(m, node, g, w_mat)
        b.line(f"col = {m.empty((g.cg * g.kw, g.rows_read * g.ow), dtype_name(node))}")
        _padded_scratch(m, node, g)
    else:
        b.line(f"col = {m.empty((g.K, col_width), dtype_name(node))}")
        _padded_scratch(m, node, g, phased=_im2col_phased(g))
    if direct and (epilogue is not None or vectors):
        _direct_by_groups(m, node, g, x, w_mat, y is None, epilogue, flat, phased, tables)
        return
    with _image_blocks(m, g, by_filters) as (n, block_rows, filters), \
            _row_chunks(m, g, block_rows, chunk_rows) as rows:
        image = "y_img" if y is None else f"y_mat[{n}]"
        start = "0" if rows[0] == "0" else f"{rows[0]} * {g.ow}"
        count = g.P if rows[0] == "0" else f"({rows[1]} - {rows[0]}) * {g.ow}"
        with _groups(m, g) as (c0, o0):
            out = _from_column(row_slice(image, o0, g.og, g.cout), start)
            weights, og = row_slice(w_mat, o0, g.og, g.cout), g.og
            if filters[0] != "0":  # a block of the output channels (of one group)
                f0, f1 = filters
                out, weights, og = f"{image}[{f0}:{f1}]", f"{w_mat}[{f0}:{f1}]", f"{f1} - {f0}"
            if direct:
                _direct_group(m, node, g, x, w_mat, image, n, c0, o0, rows, flat, phased)
            elif implicit:
                _fill_phase_planes(m, g, x, n, c0, rows)
                _implicit_product(m, node, g, weights, og, image,
                                  filters[0] if filters[0] != "0" else o0, rows)
            elif by_rows:
                _row_im2col(m, g, _pad_image(m, g, x, n, c0, rows), "col", out_rows=rows)
                _kernel_row_gemms(m, node, g, o0, out, count)
            else:
                col = "col"
                if g.pointwise:
                    col = _from_column(row_slice(f"x_mat[{n}]", c0, g.cg, g.c), start)
                else:
                    phased = _im2col_phased(g)
                    _im2col(m, g, _pad_image(m, g, x, n, c0, rows, phased), col,
                            ("0", str(g.K)), back=False, out_rows=rows, phased=phased)
                with _chunks(m, g.og, g.K, count, g.P, _tiled(m, node)) as (s, width):
                    _gemm(m, node, weights, _from_column(col, s), _from_column(out, s), og,
                          width, g.K, g.K, col_width, g.P)
        if epilogue is not None:
            block = ((1, *filters) if filters[0] != "0" else
                     (2, *rows) if rows[0] != "0" else None)
            epilogue(n, "y_img" if y is None else None, block, (g.n, g.cout, g.oh, g.ow))


def _direct_group(m: KernelModule, node: Node, g: _Conv, x: str, w_mat: str, image: str,
                  n: str, c0: str, o0: str, rows: tuple[str, str], flat: bool,
                  phased: bool, tables: tuple[str, str] | None = None) -> None:
    """Output rows ``rows`` of the group of image ``n`` whose first input and output
    channels are ``c0`` and ``o0``, into ``image``, by a direct convolution: as vector
    code with ``tables`` (`window_plane`: every row), over flat phase planes
    (`_direct_conv_flat`) or as a loop nest (`_direct_conv`)."""
    if tables is not None:
        assert rows[0] == "0", "vector code computes whole planes"
        window_plane(m, g, f"{x}[{n}, {c0}]", f"{image}[{o0}]", tables, f"{w_mat}[{o0}]")
    elif flat:
        _fill_phase_planes(m, g, x, n, c0, rows)
        _direct_conv_flat(m, node, g, w_mat, image, o0, rows)
    else:
        _direct_conv(m, node, g, _pad_image(m, g, x, n, c0, rows, phased), w_mat, image,
                     o0, rows, phased)


def _direct_by_groups(m: KernelModule, node: Node, g: _Conv, x: str, w_mat: str,
                      scratch: bool, epilogue: Callable | None, flat: bool, phased: bool,
                      tables: tuple[str, str] | None) -> None:
    """A direct convolution with an epilogue (or as vector code with ``tables``,
    which computes whole planes), group by group: threads split the groups (a block computes every
    row of its groups, of every image), and each group's epilogue runs right after the
    group, on its channels while they are in cache. Blocks of rows of every channel
    (`_image_rows`) left the epilogue half an image to read back: a depthwise 3x3 layer
    of 144 channels of 56x56 with its batch norm and clip took 387 us with cold caches
    that way, 321 this way (hot: the same). With ``scratch`` the output lives in the
    per-image ``y_img``, else in ``y_mat``."""
    copied = window_copies(g, g.n * g.c) if tables is not None else 0
    lo, hi = m.split(g.groups, g.macs + copied, products=False)
    n, group = m.fresh("n"), m.fresh("g")
    rows = ("0", str(g.oh))
    with m.body.block(f"for {n} in range({g.n}):"), \
            m.body.block(f"for {group} in range({span_of(lo, hi)}):"):
        c0, o0 = f"{group} * {g.cg}", f"{group} * {g.og}"
        _direct_group(m, node, g, x, w_mat, "y_img" if scratch else f"y_mat[{n}]", n, c0,
                      o0, rows, flat, phased, tables)
        if epilogue is not None:
            epilogue(n, "y_img" if scratch else None, (1, o0, f"{o0} + {g.og}"),
                     (g.n, g.cout, g.oh, g.ow))


# Implicit convolutions: where products go to `tiled_sgemm` (`_tiled`), which can read
# each row of its right operand at an offset of its own, the im2col matrix is never
# made. The padded image is laid out in *phase planes*, ``planes[c, r % sh, col % sw,
# r // sh, col // sw] = xpad[c, r, col]``, each plane ``Wq`` wide (`_plane_width`: a
# row's right border is the next row's left), so that ``xpad[c, p*sh + i*dh, q*sw +
# j*dw]`` over the output pixels ``(p, q)`` is one run of ``planes`` (flat) from the
# tap's offset on, if the product computes ``Wq`` columns per output row (``Wq - ow``
# of them for nothing: those read into the next row, or the plane's spare row of
# zeros, and are dropped when the rows are copied out). Kernels alone, one image, 2
# threads, both variants in one process, caches flushed, im2col (or kernel rows)
# against implicit (us, best of 30): 3x3 layers of
# resnet18, 64 channels of 56x56 1524 / 1315, 128 of 28x28 1274 / 1206, 256 of 14x14
# 1379 / 1247, 512 of 7x7 1527 / 1502, 128 -> 256 at stride 2 824 / 790; its 7x7
# stride-2 first layer 1430 / 1360.


# Implicit convolutions need this many im2col rows or more: with fewer, a tile's pass
# over the rows reads them from as many places while im2col's copy is cheap (the 3x3
# stride-2 first layer of 3 channels: 436 against 406 us).
IMPLICIT_MIN_DEPTH = 128
# ... and must not compute many more columns than im2col's product: its rows are
# ``Wq`` wide, its tiles cover them as `cpu_gemm.lanes` says (256 filters of 13x13, 3x3:
# 195 columns in 208 lanes against 169 in 176, 364 against 334 us; 14x14: 224 in 224
# against 196 in 208, 1247 against 1379).
IMPLICIT_MIN_LANE_SHARE = 0.9


def _implicit(m: KernelModule, node: Node, g: _Conv, direct: bool) -> bool:
    """Whether a convolution's forward product reads the image in place
    (`_phase_planes`): where products are `_tiled` and it is not a direct nest, with
    enough im2col rows and few wasted columns, and not with a 1x1 kernel (pointwise,
    its image is its matrix; strided, its im2col matrix is the one phase it reads,
    which the planes would copy with all the others: resnet18's 1x1 stride-2 layers
    102-117 -> 120-144 us)."""
    return _tiled(m, node) and not direct and _implicit_fits(g)


def _implicit_fits(g: _Conv) -> bool:
    """Whether a tiled convolution's forward product would be implicit (`_implicit`)."""
    if g.kh * g.kw == 1 or g.K < IMPLICIT_MIN_DEPTH:
        return False
    return lanes(g.P) >= IMPLICIT_MIN_LANE_SHARE * lanes(g.oh * _plane_shape(g)[1])


def pixel_major_gain(node: Node) -> float:
    """How much more of its tiles' lanes a conv2d's product of one image would use
    computed pixel by filter (`_pixel_major_forward`) than filter by pixel, as
    `tiled_sgemm` computes them: pixels in tiles of `MR` rows by filters in vectors,
    against filters by the pixels (implicit: each row of the planes' width)."""
    g = node_conv(node)
    computed = lanes(g.oh * _plane_shape(g)[1]) if _implicit_fits(g) else lanes(g.P)
    pixel_rows = -(-g.P // MR) * MR
    return (g.P / pixel_rows) * (g.cout / lanes(g.cout)) / (g.P / computed)


def _plane_shape(g: _Conv) -> tuple[int, int]:
    """Rows (one spare) and width of a phase plane (`_phase_planes`)."""
    return -(-g.hp // g.sh) + 1, _plane_width(g)


def _plane_width(g: _Conv) -> int:
    """The narrowest phase plane (flat, rows of this width) that holds the image and
    from which every output pixel's taps read as one run: a tap past a row's right
    end reads on into the next row's left border, which is zero, so a row needs
    only the wider of its two borders after it, not both. Each row computes this
    many columns for ``ow`` pixels: resnet18's 3x3 layers of 56x56 57, not 58 (the
    kernel alone, 2 threads, in-process A/B: 2.5% faster; at 28x28 3.5-4%; at 14x14,
    whose 15 columns a row fill no fewer tiles than 16, level)."""
    holds = -(-(g.pl + g.w) // g.sw)  # the columns with pixels, in column phase 0
    reach = {}  # per column phase, the farthest a tap reaches past the output's row
    for j in range(g.kw):
        phase, along = j * g.dw % g.sw, j * g.dw // g.sw
        reach[phase] = max(reach.get(phase, 0), along)
    width = max(holds, g.ow, max(reach.values()) + 1)

    def reads_border(width: int) -> bool:
        return all((g.ow - 1 + along - width) * g.sw + phase < g.pl
                   for phase, along in reach.items())

    while not reads_border(width):
        width += 1
    return width


def _planes_scratch(m: KernelModule, node: Node, g: _Conv) -> None:
    """``planes``: one group of one image in phase planes, zero where
    `_fill_phase_planes` never writes (the border, the spare row; `_zero_border`)."""
    rows, width = _plane_shape(g)
    _zero_border(m, node, "planes", (g.cg, g.sh, g.sw, rows, width), {
        "[:, {phase}, :, {}]": [_outside(g.h, g.pt, g.sh, phase, rows)
                                for phase in range(g.sh)],
        "[:, :, {phase}, :, {}]": [_outside(g.w, g.pl, g.sw, phase, width)
                                   for phase in range(g.sw)]})


def _phase_planes(m: KernelModule, node: Node, g: _Conv, rows_at_once: int | str
                  ) -> None:
    """The scratch of an implicit convolution: ``planes`` (`_planes_scratch`),
    ``offsets``, where each row ``(c*kh + i)*kw + j`` of the im2col matrix begins in
    it, and ``sums``, the product of ``rows_at_once`` output rows at most
    (`_implicit_product`)."""
    b, (rows, width) = m.body, _plane_shape(g)
    _planes_scratch(m, node, g)
    b.line(f"offsets = {m.empty((g.K,), 'np.int64')}")
    c, i, j = m.fresh("c"), m.fresh("i"), m.fresh("j")
    plane = rows * width
    with b.block(f"for {c} in range({g.cg}):"), b.block(f"for {i} in range({g.kh}):"), \
            b.block(f"for {j} in range({g.kw}):"):
        tap_row, tap_column = _times(i, g.dh), _times(j, g.dw)
        terms = [f"{c} * {g.sh * g.sw * plane}"]
        if g.sh > 1:
            terms.append(f"{tap_row} % {g.sh} * {g.sw * plane}")
        if g.sw > 1:
            terms.append(f"{tap_column} % {g.sw} * {plane}")
        terms.append(f"{tap_row} // {g.sh} * {width}" if g.sh > 1 else _times(tap_row, width))
        terms.append(f"{tap_column} // {g.sw}" if g.sw > 1 else tap_column)
        b.line(f"offsets[({c} * {g.kh} + {i}) * {g.kw} + {j}] = {' + '.join(terms)}")
    b.line(f"sums = {m.empty((g.og, _times(rows_at_once, width)), dtype_name(node))}")


def _fill_phase_planes(m: KernelModule, g: _Conv, x: str, n: str, c0: str,
                       rows: tuple[str, str]) -> None:
    """Copy group ``c0`` of image ``n`` into its phase planes: the input rows that
    output rows ``rows`` read (`_image_rows`; all for ``"0"``)."""
    with _input_rows(m, g, c0, rows) as (c, channel, h):
        row = affine(h, 1, g.pt)
        phase, at = (f"({row}) % {g.sh}", f"({row}) // {g.sh}") if g.sh > 1 else ("0", row)
        if g.sw == 1:
            m.copy_run("planes", f"{c}, {phase}, 0, {at}, {g.pl}", x,
                       f"{n}, {channel}, {h}, 0", g.w)
        else:
            copy_into_phases(m, lambda p, column: f"planes[{c}, {phase}, {p}, {at}, {column}]",
                             lambda index: f"{x}[{n}, {channel}, {h}, {index}]", g.w, g.sw,
                             g.pl)


def _implicit_product(m: KernelModule, node: Node, g: _Conv, weights: str, og, image: str,
                      o_first: str, rows: tuple[str, str]) -> None:
    """``image[o_first:][:og]`` (output channels by pixels) for output rows ``rows``:
    `tiled_sgemm` of ``weights`` by the im2col matrix read from the phase planes at
    ``offsets`` into ``sums``, whose ``ow`` valid columns of each row are then copied
    out."""
    b, (plane_rows, width) = m.body, _plane_shape(g)
    o, p = m.fresh("o"), m.fresh("p")
    lo, hi = rows if rows[0] != "0" else ("0", str(g.oh))
    count = g.oh if rows[0] == "0" else f"{hi} - {lo}"
    flat = m.view("planes", (g.cg * g.sh * g.sw * plane_rows * width,))
    planes = flat if lo == "0" else f"{flat}[{_times(lo, width)}:]"
    _gemm(m, node, weights, planes, "sums", og, _times(f"({count})", width), g.K, g.K, 0,
          "sums.shape[1]", b_rows="offsets")
    channel = o if o_first == "0" else f"{o_first} + {o}"
    with b.block(f"for {o} in range({og}):"), b.block(f"for {p} in range({count}):"):
        row = p if lo == "0" else f"({lo} + {p})"
        m.copy_run(image, f"{channel}, {_times(row, g.ow)}", "sums", f"{o}, {_times(p, width)}",
                   g.ow)


# Where products go to `tiled_sgemm`, which packs nothing (a product of a few rows costs
# no more per pixel than one of all), implicit and pointwise convolutions compute a few
# output rows at a time, their product `OUT_CHUNK_BYTES` at most, so that the
# epilogue (`_conv_forward`) finds them in the core's cache: mobilenet_v2's 1x1
# layer of 96 channels of 112x112 wrote 4.8 MB, then read and wrote it again. But never
# fewer columns than `OUT_CHUNK_MIN_COLUMNS`: a chunk's product fills its last tile's
# lanes as it can (squeezenet1_1's classifier at batch 32, 1000 filters of 13x13, in
# chunks of 5 rows: 65 columns in 80 lanes).
OUT_CHUNK_BYTES = 256 * 1024
OUT_CHUNK_MIN_COLUMNS = 256


def _output_chunk_rows(m: KernelModule, node: Node, g: _Conv, implicit: bool) -> str | None:
    """The local holding how many output rows at a time an implicit or pointwise
    convolution computes (`OUT_CHUNK_BYTES`, `OUT_CHUNK_MIN_COLUMNS`), or None: all of
    a block's at once."""
    if not (implicit or (g.pointwise and _tiled(m, node))):
        return None
    width = _plane_shape(g)[1] if implicit else g.ow
    return _chunk_rows(m, g, g.og * width * 4, -(-OUT_CHUNK_MIN_COLUMNS // width), width)


def _chunk_rows(m: KernelModule, g: _Conv, row_bytes, least: int = 1,
                fit_width: int | None = None) -> str | None:
    """The local holding how many output rows of ``row_bytes`` each a convolution's
    product computes at a time: about `OUT_CHUNK_BYTES` of them, ``least`` rows or
    more; with ``fit_width``, the product's columns a row, the count that its tiles'
    lanes fit best (`cpu_gemm.fitted_rows`). None where that is every row (a
    pixel-major convolution's sums: its rows are pixels, its filters fill the tiles'
    lanes, so no least)."""
    if g.oh * row_bytes <= OUT_CHUNK_BYTES or least >= g.oh:
        return None
    local = m.fresh("rows_at_once")
    rows = f"{OUT_CHUNK_BYTES} // ({row_bytes})"
    if fit_width is None:
        m.body.line(f"{local} = max({least}, {rows})")
    else:
        m.import_line("from purinec.codegen.cpu_gemm import fitted_rows")
        m.body.line(f"{local} = fitted_rows({rows}, {least}, {fit_width})")
    return local


# im2col matrices bigger than this are made (and multiplied) a few output rows at a
# time, so that the matrix stays in the core's cache between its copy and the GEMM's
# packing of it, in the net too (where a whole 7x7 stride-2 layer's, 7.4 MB a thread,
# went to memory and back); but never fewer than `COL_CHUNK_MIN_COLUMNS` pixels at a
# time, a GEMM too thin (resnet18's 3x3 layers at 14x14 in chunks of 4 rows: 10% slower).
COL_CHUNK_BYTES = 512 * 1024
COL_CHUNK_MIN_COLUMNS = 256


def _im2col_chunk_rows(m: KernelModule, g: _Conv, dtype: DType) -> str | None:
    """The local holding how many output rows at a time im2col makes, computed in the
    kernel from the sizes it reads (`_read_sizes`); None: all of a block's at once."""
    row_bytes = g.ow * dtype.numpy.itemsize
    least = -(-COL_CHUNK_MIN_COLUMNS // g.ow)
    if max(least, COL_CHUNK_BYTES // (g.K * row_bytes)) >= g.oh:
        return None
    local = m.fresh("rows_at_once")
    m.body.line(f"{local} = max({least}, {COL_CHUNK_BYTES} // ({g.K} * {row_bytes}))")
    return local


@contextmanager
def _row_chunks(m: KernelModule, g: _Conv, rows: tuple[str, str], most: str | None
                ) -> Iterator[tuple[str, str]]:
    """The output rows ``rows`` of a block (`_image_rows`) ``most`` at a time (all at
    once for None)."""
    if most is None:
        yield rows
        return
    first, end = rows if rows[0] != "0" else ("0", str(g.oh))
    lo, hi = m.fresh("rows_lo"), m.fresh("rows_hi")
    with m.body.block(f"for {lo} in range({first}, {end}, {most}):"):
        m.body.line(f"{hi} = min({lo} + {most}, {end})")
        yield lo, hi


# Convolutions whose images have fewer output rows than this, all images together,
# split their output channels between threads rather than their rows: a block of a few
# rows of small images is a GEMM too thin for BLAS. One thread, OpenBLAS on Zen 4,
# GFLOP/s: resnet18's 512 x 4608 by 4608 x 28 (4 rows of 7x7) 69, 21 (3 rows) 59,
# against 256 x 4608 by 4608 x 49 (half the filters) 89; mobilenet_v2's 1280 x 320
# by 320 x 28 72 against 640 x 320 by 320 x 49 90. At 14x14 both ways ran alike.
FILTER_SPLIT_MAX_ROWS = 12
FILTER_SPLIT_MIN_FILTERS = 32
# With `tiled_sgemm` too, which multiplies thin products well, but each block of rows
# reads every weight: in-process A/B at batch 1, 13 and 14 rows by filters against by
# rows: squeezenet1_1's classifier (1000 filters of 13x13) 854 against 1125 us, the net
# 11% faster; googlenet 2%, resnet18 1%.
FILTER_SPLIT_MAX_ROWS_TILED = 16


def _by_filters(m: KernelModule, node: Node, g: _Conv, direct: bool, by_rows: bool) -> bool:
    """Whether threads split a plain im2col, implicit or pointwise convolution's output
    channels, each block computing its channels of every pixel (`FILTER_SPLIT_MAX_ROWS`,
    or `FILTER_SPLIT_MAX_ROWS_TILED` where products are `_tiled`): every block then
    copies the whole image into its im2col matrix (or phase planes)."""
    return (not direct and not by_rows and g.groups == 1
            and _few_rows(g, _tiled(m, node)) and g.cout >= FILTER_SPLIT_MIN_FILTERS)


def _few_rows(g: _Conv, tiled: bool) -> bool:
    """Whether a convolution's images have too few output rows, all together, for
    threads to split (`FILTER_SPLIT_MAX_ROWS`, `..._TILED` where products are tiled)."""
    return g.n * g.oh < (FILTER_SPLIT_MAX_ROWS_TILED if tiled else FILTER_SPLIT_MAX_ROWS)


@contextmanager
def _image_blocks(m: KernelModule, g: _Conv, by_filters: bool
                  ) -> Iterator[tuple[str, tuple[str, str], tuple[str, str]]]:
    """The loop over images; yields the image, its output rows and its output
    channels to compute: split by output rows (`_image_rows`), or with ``by_filters``
    every row of every image, the kernel's split loop over the output channels."""
    if not by_filters:
        with _image_rows(m, g) as (n, rows):
            yield n, rows, ("0", str(g.cout))
        return
    filters = m.split(g.cout, g.macs, products=True)
    n = m.fresh("n")
    with m.body.block(f"for {n} in range({g.n}):"):
        yield n, ("0", str(g.oh)), filters


@contextmanager
def _image_rows(m: KernelModule, g: _Conv) -> Iterator[tuple[str, tuple[str, str]]]:
    """The loop over images; yields the image and the output rows ``r0, r1`` to compute
    of it. The kernel's split loop is over every image's rows (``n * oh`` items), so a
    batch smaller than the threads still splits (a block's first and last images may
    be partial) and no block repeats another's work. Unsplit, the rows are ``"0"`` and
    ``oh``: whole images, with constant trip counts. A direct loop nest's multiply-adds
    count as elements (`CpuOptions`), not as a GEMM's: it runs at a tenth of the speed
    (mobilenet_v2's depthwise layers of 14x14 and 7x7 at batch 1, 0.4-1 M multiply-adds,
    ran on one thread: 576 channels of 14x14 0.47 -> 0.27-0.32 ms on two)."""
    lo, hi = m.split(g.n * g.oh, g.macs, products=not _direct(m, g))
    b, n = m.body, m.fresh("n")
    if lo == "0":
        with b.block(f"for {n} in range({g.n}):"):
            yield n, ("0", str(g.oh))
        return
    r0, r1 = m.fresh("r0"), m.fresh("r1")
    with b.block(f"for {n} in range({lo} // {g.oh}, ({hi} + {g.oh - 1}) // {g.oh}):"):
        b.line(f"{r0} = max({lo} - {n} * {g.oh}, 0)")
        b.line(f"{r1} = min({hi} - {n} * {g.oh}, {g.oh})")
        yield n, (r0, r1)


def _row_span(g: _Conv, rows: tuple[str, str] | None, extra: int = 0
              ) -> tuple[str, Callable[[str], str]]:
    """The trip count of a loop over the output rows ``rows`` (`_image_rows`; all if
    None) and ``extra`` rows after them, counting from 0; and how to make its variable
    a row."""
    if rows is None or rows[0] == "0":
        return str(g.oh + extra), lambda p: p
    r0, r1 = rows
    return f"{r1} - {r0} + {extra}" if extra else f"{r1} - {r0}", lambda p: f"({p} + {r0})"


def _from_column(matrix: str, start: str) -> str:
    """The columns of ``matrix`` from ``start`` on (a block of output rows' pixels)."""
    return matrix if start == "0" else f"{matrix}[:, {start}:]"


def _even_step(count: int, most: int) -> int:
    """The width of chunks of at ``most`` columns that cover ``count`` as evenly as
    whole vectors allow."""
    step = -(-count // -(-count // most))
    return -(-step // VECTOR) * VECTOR


@contextmanager
def _chunks(m: KernelModule, rows: int, inner: int, count, at_most: int, tiled: bool
            ) -> Iterator[tuple[str, str]]:
    """A loop over columns ``0:count`` (``at_most`` of them) of a product of ``rows`` by
    ``inner`` by ``count`` in chunks the BLAS multiplies without packing
    (`CpuOptions.small_gemm_macs`), when they are at least `MIN_CHUNK` wide and the
    product is not ``tiled`` (`_tiled`: that packs nothing); yields the
    first column of a chunk and its width (``"0"`` and ``count``: one product of all).
    A constant ``count`` makes the width a constant (LLVM then knows the trip count);
    a ``count`` computed at run time (a block's) computes it too, from the sizes the
    code reads (`_read_sizes`)."""
    most = m.options.small_gemm_macs // max(1, rows * inner) // VECTOR * VECTOR
    if tiled or most < MIN_CHUNK or at_most <= most:
        yield "0", count
        return
    b, s = m.body, m.fresh("s")
    if isinstance(count, int):
        step = _even_step(int(count), int(most))
    else:
        chunks, step = m.fresh("chunks"), m.fresh("step")
        b.line(f"{chunks} = max(1, ({count} + {most - 1}) // {most})")
        b.line(f"{step} = max({VECTOR}, (({count} + {chunks} - 1) // {chunks} + {VECTOR - 1})"
               f" // {VECTOR} * {VECTOR})")
    with b.block(f"for {s} in range(0, {count}, {step}):"):
        yield s, f"min({step}, {count} - {s})"


# Direct convolutions: a group of few input and output channels makes GEMMs too small
# for BLAS to run well (a depthwise convolution's are 1 x kh*kw by kh*kw x P), so
# groups of at most `CpuOptions.direct_max_channels` input times output channels are
# computed by `_direct_conv`. 3x3 convolutions, one image, 2 threads, direct vs im2col
# + GEMM (ms): 96 channels of 56x56, depthwise: 0.24 vs 1.37 (stride 2: 0.23 vs 0.45;
# 32 images: 3.8 vs 31.5); 64 channels, 2 a group: 0.26 vs 1.01; 4 x 4 a group: 0.57
# vs 1.04 (28x28: 0.27 vs 0.29); 4 in x 8 out: 0.29 vs 0.35 at 28x28 but 1.03 vs 0.73
# at 56x56; 8 x 8 at 28x28: 0.70 vs 0.33 (16 x 16: 5.2 vs 0.4, too many taps for
# LLVM to unroll). Hence 16.


def _direct(m: KernelModule, g: _Conv) -> bool:
    return g.cg * g.og <= m.options.direct_max_channels


def _direct_conv(m: KernelModule, node: Node, g: _Conv, image: str, w_mat: str, y_img: str,
                 o0: str, rows: tuple[str, str], phased: bool = False) -> None:
    """``y[o, p, q] = sum over c, i, j of w[o, c, i, j] * image[c, p*sh + i*dh,
    q*sw + j*dw]`` for the group's output channels ``o`` and output rows ``rows``
    (`_image_rows`), the image padded (`_pad_image`; split by column phase if
    ``phased``: column ``q*sw + j*dw`` is ``q + j*dw // sw`` of phase ``j*dw % sw``).
    The taps' loops have constant trip counts, so LLVM unrolls them and vectorizes
    the loop along ``q``, summing the taps in registers."""
    b = m.body
    o, p, q, c, i, j = (m.fresh(s) for s in ("o", "p", "q", "c", "i", "j"))
    y_row, total = m.fresh("y_row"), m.fresh("total")
    span, first = _row_span(g, rows)
    channel = o if o0 == "0" else f"{o0} + {o}"
    with b.block(f"for {o} in range({g.og}):"), b.block(f"for {p} in range({span}):"):
        b.line(f"{y_row} = {y_img}[{channel}, {affine(first(p), g.ow, 0)}:"
               f"{affine(first(p), g.ow, g.ow)}]")
        with b.block(f"for {q} in range({g.ow}):"):
            b.line(f"{total} = {literal(0, node.outputs[0].type.dtype)}")
            with b.block(f"for {c} in range({g.cg}):"), b.block(f"for {i} in range({g.kh}):"), \
                    b.block(f"for {j} in range({g.kw}):"):
                shift = _times(j, g.dw)
                whole = atom(shift)
                column = (f"{whole} % {g.sw}, {q} + {whole} // {g.sw}" if phased
                          else affine(q, g.sw, shift))
                b.line(f"{total} += {w_mat}[{channel}, ({c} * {g.kh} + {i}) * {g.kw} + {j}] * "
                       f"{image}{c}, {affine(first(p), g.sh, _times(i, g.dh))}, {column}]")
            b.line(f"{y_row}[{q}] = {total}")


def _depthwise_vectors(m: KernelModule, node: Node, g: _Conv) -> bool:
    """Whether a direct convolution is computed as vector code (`window_plane`):
    depthwise, where windows can be (`vector_windows`)."""
    return vector_windows(m, node) and (g.cg, g.og) == (1, 1)


def vector_windows(m: KernelModule, node: Node) -> bool:
    """Whether a convolution's or pooling's windows can be vector code
    (`purinec.codegen.cpu_window`): f32, where kernels use purinec's own vector code
    (`CpuOptions.tiled_gemm`)."""
    return m.options.tiled_gemm and node.outputs[0].type.dtype is DType.f32


def window_copies(g, planes: int) -> int:
    """The elements that vector windows (`window_plane`) over ``planes`` planes of
    ``g`` copy into phase planes (none where they read in place): work besides their
    taps', when threads split them."""
    return 0 if _window_grid(g)[2] else planes * g.h * g.w


def _window_grid(g) -> tuple[int, int, bool]:
    """The rows and columns of the grid the windows of ``g`` are computed over
    (`cpu_window.grid_shape`), and whether they read their input in place."""
    return (*grid_shape(g.h, g.w, g.ow, g.sh, g.sw), in_place(g.h, g.w, g.ow, g.sh, g.sw))


def window_tables(m: KernelModule, node: Node, g) -> tuple[str, str]:
    """The module's tap offsets and masks (`cpu_window.window_tables`) for the windows
    of ``g`` (the sizes of `_Conv` or `cpu_pool._Pool`), their names returned; the
    kernel's ``phase_planes``, the plane split by phase as wide as the grid, unless the
    windows read the input in place; and ``window_out``, the grid's output, where its
    rows are wider than the output's."""
    m.import_line("from purinec.codegen.cpu_window import window_tables")
    sizes = (g.h, g.w, g.oh, g.ow, g.kh, g.kw, g.sh, g.sw, g.dh, g.dw, g.pt, g.pl)
    offsets, masks = m.computed_constants(["tap_offsets", "tap_masks"],
                                          f"window_tables({', '.join(map(str, sizes))})")
    rows, width, reads_in_place = _window_grid(g)
    if not reads_in_place:
        m.body.line(f"phase_planes = {m.empty((g.sh, g.sw, rows, width), dtype_name(node))}")
    if width != g.ow:
        m.body.line(f"window_out = {m.empty((g.oh * width,), dtype_name(node))}")
    return offsets, masks


def window_plane(m: KernelModule, g, plane: str, y: str, tables: tuple[str, str],
                 weights: str | None = None) -> None:
    """The windows of one input ``plane`` (2-D) into ``y`` (flat) as vector code, with
    the ``tables`` `window_tables` made: with ``weights``, the channel's, a depthwise
    convolution (`cpu_window.depthwise_vectors`); else max pooling (`max_vectors`).
    The plane first split by phase into ``phase_planes`` unless read in place; then
    `UNITS` vectors of the grid at a time, and those left; then, where the grid's
    rows are wider than the output's, each row's pixels copied out."""
    b = m.body
    rows, width, reads_in_place = _window_grid(g)
    if not reads_in_place:
        m.import_line("from purinec.codegen.cpu_window import split_row")
        h, q = m.fresh("h"), m.fresh("q")
        with b.block(f"for {h} in range({g.h}):"):
            at = f"({h} % {g.sh} * {g.sw * rows} + {h} // {g.sh}) * {width}"
            with b.block(f"for {q} in range(0, {width}, {VW}):"):
                b.line(f"split_row({g.sw}, {plane}[{h}], {q}, {g.w}, phase_planes, {at}, "
                       f"{rows * width})")
        plane = "phase_planes"
    function = "depthwise_vectors" if weights is not None else "max_vectors"
    m.import_line(f"from purinec.codegen.cpu_window import {function}")
    vectors = -(-g.oh * width // VW)
    whole = vectors - vectors % UNITS
    operands = "" if weights is None else f"{weights}, "
    out = y if width == g.ow else "window_out"
    call = (f"{function}({{count}}, {g.kh * g.kw}, {plane}, {{v}}, {tables[0]}, {tables[1]}, "
            f"{operands}{out}, {g.oh * width})")
    if whole:
        v = m.fresh("v")
        with b.block(f"for {v} in range(0, {whole}, {UNITS}):"):
            b.line(call.format(count=UNITS, v=v))
    if vectors > whole:
        b.line(call.format(count=vectors - whole, v=whole))
    if width != g.ow:
        p = m.fresh("p")
        with b.block(f"for {p} in range({g.oh}):"):
            m.copy_run(y, f"{affine(p, g.ow, 0)},", "window_out", f"{affine(p, width, 0)},",
                       g.ow)


# Direct convolutions with rows narrower than this run over flat phase planes
# (`_direct_conv_flat`), but not those of stride 1 without padding (each of their rows
# is read where it lies). Depthwise 3x3 on the 2-core Zen 4, batch 1, kernel alone (us,
# the nest against flat planes): 960 channels of 7x7 144 against 54, 576 of 14x14 225
# against 95, 192 of 28x28 186 against 170, 144 of 56x56 267 against 224; 32 of
# 112x112 131 against 148, where a row is long enough to vectorize well.
FLAT_PLANES_MAX_WIDTH = 64
# Strided ones (stride 2, both ways) only with rows narrower than this: 576 channels of
# 14x14 108 against 85 us, 192 of 28x28 229 against 192; 144 of 56x56 200 against 207
# (`_column_phases`, rows of 28), 96 of 112x112 357 against 421.
FLAT_STRIDED_MAX_WIDTH = VECTOR


def _flat_planes(g: _Conv) -> bool:
    """Whether a direct convolution runs over flat phase planes (`_direct_conv_flat`):
    with stride 1, padded and with output rows narrower than `FLAT_PLANES_MAX_WIDTH`;
    strided, with rows of less than a vector (`FLAT_STRIDED_MAX_WIDTH`)."""
    if (g.sh, g.sw) == (1, 1):
        return g.padded and g.ow < FLAT_PLANES_MAX_WIDTH
    return g.ow < FLAT_STRIDED_MAX_WIDTH


def _direct_conv_flat(m: KernelModule, node: Node, g: _Conv, w_mat: str, y_img: str,
                      o0: str, rows: tuple[str, str]) -> None:
    """`_direct_conv` as one loop over the output rows ``rows`` laid out as wide as a
    phase plane (`_planes_scratch`, ``Wq`` wide): ``sums[k]`` for ``k = p*Wq + q`` sums
    over the taps ``w * planes[c, i*dh % sh, j*dw % sw].flat[k + (i*dh // sh)*Wq +
    j*dw // sw]`` (`tap_in_phases`), a contiguous run LLVM vectorizes whatever the width or stride (the
    nest vectorizes along a row of ``ow`` pixels only: scalar for a 7- or 14-pixel row,
    strided loads for a strided one), computing ``Wq - ow`` columns of nothing per row
    (reading into the next row and, for the last, the spare row of zeros); then each
    row's ``ow`` pixels into ``y``."""
    b, (plane_rows, width) = m.body, _plane_shape(g)
    o, k, p = m.fresh("o"), m.fresh("k"), m.fresh("p")
    span, first = _row_span(g, rows)
    start = "" if rows[0] == "0" else f", {rows[0]} * {width}:"
    planes = m.view("planes", (g.cg, g.sh, g.sw, plane_rows * width))
    taps = [(c, i, j) for c in range(g.cg) for i in range(g.kh) for j in range(g.kw)]
    # each tap's plane (channel, row phase, column phase) and offset along it
    places = [((c, *at[:2]), at[2]) for c, i, j in taps
              for at in [tap_in_phases(i, j, (g.sh, g.sw), (g.dh, g.dw), width)]]
    sources = {key: m.fresh("plane") for key in sorted({key for key, _ in places})}
    for key, source in sources.items():
        b.line(f"{source} = {planes}[{', '.join(map(str, key))}{start}]")
    channel = o if o0 == "0" else f"{o0} + {o}"
    weights = [m.fresh("w") for _ in taps]
    total = m.fresh("total")
    with b.block(f"for {o} in range({g.og}):"):
        for weight, (c, i, j) in zip(weights, taps):
            b.line(f"{weight} = {w_mat}[{channel}, {(c * g.kh + i) * g.kw + j}]")
        with b.block(f"for {k} in range(({span}) * {width}):"):
            terms = [f"{weight} * {sources[key]}[{affine(k, 1, offset)}]"
                     for weight, (key, offset) in zip(weights, places)]
            b.line(f"{total} = {terms[0]}")
            for term in terms[1:]:
                b.line(f"{total} += {term}")
            b.line(f"sums[{k}] = {total}")
        with b.block(f"for {p} in range({span}):"):
            m.copy_run(y_img, f"{channel}, {affine(first(p), g.ow, 0)}", "sums",
                       f"{affine(p, width, 0)},", g.ow)


# Kernel rows: for stride-1 rows, one GEMM per kernel row ``i`` over a matrix holding
# only the column shifts ``j`` of every padded image row, ``col[(c, j), (row, q)] =
# image[c, row, q*sw + j*dw]``: the rows ``p + i*dh`` that row ``i`` of the kernel needs
# are the columns from ``i*dh*ow`` on, a plain matrix with a longer leading dimension. That
# matrix is about ``kh`` times smaller than im2col's, and the copy is what im2col costs
# beside the GEMM (a quarter of a 5x5 convolution's time). Short GEMMs (few channels
# times ``kw``) run slower than one long one, hence `KERNEL_ROWS_MIN_DEPTH`.
KERNEL_ROWS_MIN_DEPTH = 64
# The forward product and the input gradient need each kernel row's weights as a matrix
# of its own (`_kernel_row_weights`): a copy of all the weights, made by every block of
# a call, which saves nothing where the images are small next to the weights. They go
# by kernel rows only with at least this many output pixels in a call (all its images)
# per output channel. resnet18 at batch 1 on the 2-core Zen 4 (ms, 3x3 convolutions,
# by kernel rows against im2col): 64 channels of 56x56 (49 pixels a channel) 1.5-1.6
# against 1.8-2.2; 128 of 28x28 (6) 1.7-1.8 against 1.5-1.6; 256 of 14x14 2.4-2.7
# against 1.6; 512 of 7x7 6.9-9.4 against 2.4.
KERNEL_ROWS_MIN_PIXELS = 16


def _by_kernel_rows(g: _Conv) -> bool:
    return g.sh == 1 and g.kh > 1 and g.cg * g.kw >= KERNEL_ROWS_MIN_DEPTH


def _by_kernel_row_weights(g: _Conv) -> bool:
    """Whether the forward product or the input gradient goes by kernel rows, each
    row's weights copied into a matrix (`KERNEL_ROWS_MIN_PIXELS`)."""
    return _by_kernel_rows(g) and g.n * g.P >= KERNEL_ROWS_MIN_PIXELS * g.cout


def _kernel_row_weights(m: KernelModule, node: Node, g: _Conv, w_mat: str) -> None:
    """``w_rows[i, o, c*kw + j] = w[o, c, i, j]``: kernel row ``i``'s weights, a matrix
    per row."""
    b, o, c, i, j = m.body, m.fresh("o"), m.fresh("c"), m.fresh("i"), m.fresh("j")
    b.line(f"w_rows = {m.empty((g.kh, g.cout, g.cg * g.kw), dtype_name(node))}")
    with b.block(f"for {i} in range({g.kh}):"), b.block(f"for {o} in range({g.cout}):"), \
            b.block(f"for {c} in range({g.cg}):"), b.block(f"for {j} in range({g.kw}):"):
        b.line(f"w_rows[{i}, {o}, {affine(c, g.kw, j)}] = "
               f"{w_mat}[{o}, ({c} * {g.kh} + {i}) * {g.kw} + {j}]")


def _row_im2col(m: KernelModule, g: _Conv, image: str, col: str, back: bool = False,
                rows: tuple[str, str] | None = None,
                out_rows: tuple[str, str] | None = None) -> None:
    """``col[c*kw + j, row*ow + q] = image[c, row, q*sw + j*dw]`` for every padded row
    that output rows ``out_rows`` read (all by default; stored from column 0), for the
    matrix rows ``r = c*kw + j`` in ``rows`` (all by default), stored at row
    ``r - rows[0]``; with ``back``, the adjoint: ``image[...] += col[...]``."""
    b = m.body
    rows = rows or ("0", str(g.cg * g.kw))
    span, first = _row_span(g, out_rows, (g.kh - 1) * g.dh)
    r, c, j, row = (m.fresh(s) for s in ("r", "c", "j", "row"))
    with b.block(f"for {r} in range({span_of(*rows)}):"):
        b.line(f"{c} = {r} // {g.kw}")
        b.line(f"{j} = {r} % {g.kw}")
        if rows[0] != "0":
            r = f"{r} - {rows[0]}"
        with b.block(f"for {row} in range({span}):"):
            _pixel_row(m, g, image, f"{c}, {first(row)}", j, col,
                       f"{r}, {affine(row, g.ow, 0)}", back)


def _kernel_row_gemms(m: KernelModule, node: Node, g: _Conv, o0: str, out: str,
                      count) -> None:
    """``out = sum over i of w_rows[i, group] @ col[:, i*dh*ow:]`` for ``count``
    columns, the first GEMM writing, the others adding (BLAS beta = 1)."""
    depth, ld, i = g.cg * g.kw, g.rows_read * g.ow, m.fresh("i")
    with _chunks(m, g.og, depth, count, g.P, _tiled(m, node)) as (s, width):
        out = _from_column(out, s)
        weights = f"w_rows[0, {o0}:]" if o0 != "0" else "w_rows[0]"
        _gemm(m, node, weights, _from_column("col", s), out, g.og, width, depth, depth, ld,
              g.P)
        with m.body.block(f"for {i} in range(1, {g.kh}):"):
            weights = f"w_rows[{i}, {o0}:]" if o0 != "0" else f"w_rows[{i}]"
            shift = f"{i} * {g.dh * g.ow}" if s == "0" else f"{i} * {g.dh * g.ow} + {s}"
            _gemm(m, node, weights, f"col[:, {shift}:]", out, g.og, width, depth, depth, ld,
                  g.P, beta=1)


@renders("conv2d_grad_input")
def render_conv2d_grad_input(node: Node, m: KernelModule) -> None:
    """Per image and group: ``gx[n, group] = col2im(w[group]^T @ gy[n, group])``. Or,
    with stride 1, as a convolution: of ``gy``, padded by ``dilation*(kernel-1) - pad``
    on each side (possible where none is negative), with the weights flipped in space
    and transposed in channels, as dilated as the forward's; its im2col copies are
    cheaper than col2im's scattered sums, but it multiplies ``H*W*Cout`` instead of
    ``OH*OW*C``, so it is used only where that is no bigger ("same" convolutions with
    as many channels out as in)."""
    g = _conv(node.attrs["input_shape"], node.inputs[1].type.shape,
              node.inputs[0].type.shape, node.attrs)
    (gy, w), (gx,) = m.inputs, m.outputs
    if not _direct(m, g):
        g = _read_sizes(m, g, images=(gy, 0), channels=(gx, 1), filters=(w, 0))
    reach_h, reach_w = g.dh * (g.kh - 1), g.dw * (g.kw - 1)
    flipped_pad = (reach_h - g.pt, reach_w - g.pl, reach_h - g.pb, reach_w - g.pr)
    if (g.sh, g.sw) == (1, 1) and min(flipped_pad) >= 0 and \
            g.h * g.w * g.cout <= g.P * g.c:
        _conv2d_grad_input_as_conv(node, m, g, flipped_pad)
    else:
        _conv2d_grad_input_col2im(node, m, g)


def _conv2d_grad_input_as_conv(node: Node, m: KernelModule, g: _Conv, pad) -> None:
    (gy, w), (gx,), b = m.inputs, m.outputs, m.body
    flipped = _Conv(g.n, g.cout, g.oh, g.ow, g.c, g.groups, g.kh, g.kw, 1, 1, *pad, g.dh,
                    g.dw, g.h, g.w)
    o, c, i, j = (m.fresh(s) for s in ("o", "c", "i", "j"))
    b.line(f"w_flip = {m.empty((g.c, flipped.K), dtype_name(node))}")
    with b.block(f"for {o} in range({g.cout}):"), b.block(f"for {c} in range({g.cg}):"), \
            b.block(f"for {i} in range({g.kh}):"), b.block(f"for {j} in range({g.kw}):"):
        row = c if g.groups == 1 else f"{o} // {g.og} * {g.cg} + {c}"
        column = o if g.groups == 1 else f"{o} % {g.og}"
        b.line(f"w_flip[{row}, (({column}) * {g.kh} + {g.kh - 1} - {i}) * {g.kw} + "
               f"{g.kw - 1} - {j}] = {w}[{o}, {c}, {i}, {j}]")
    _conv_forward(node, m, flipped, gy, "w_flip", gx)


def _conv2d_grad_input_col2im(node: Node, m: KernelModule, g: _Conv) -> None:
    """col2im adds into a zeroed padded scratch whose inside is then copied out. With
    stride-1 rows, by kernel rows (the adjoint of `_row_im2col`): each row's GEMM
    adds ``w_rows[i]^T @ gy`` into the columns from ``i*ow`` on of a smaller matrix."""
    (gy, w), (gx,), b = m.inputs, m.outputs, m.body
    padded, by_rows = g.padded, _by_kernel_row_weights(g)
    b.line(f"w_mat = {m.view(w, (g.cout, g.K))}")
    b.line(f"gy_mat = {m.view(gy, (g.n, g.cout, g.P))}")
    b.line(f"gx_mat = {m.view(gx, (g.n, g.c, g.h * g.w))}")
    if by_rows:
        _kernel_row_weights(m, node, g, "w_mat")
        b.line(f"col = {m.empty((g.cg * g.kw, g.rows_read * g.ow), dtype_name(node))}")
    else:
        b.line(f"col = {m.empty((g.K, g.P), dtype_name(node))}")
    _padded_scratch(m, node, g)
    with split_loop(m, "n", g.n, g.macs, products=True) as n:
        if not padded:  # col2im adds into gx: start from zero
            b.line(f"gx_mat[{n}] = 0")
        with _groups(m, g) as (c0, o0):
            gy_rows = row_slice(f"gy_mat[{n}]", o0, g.og, g.cout)
            if by_rows:
                _kernel_row_gemms_back(m, node, g, o0, gy_rows)
            else:
                with _chunks(m, g.K, g.og, g.P, g.P, tiled=False) as (s, width):
                    _gemm(m, node, row_slice("w_mat", o0, g.og, g.cout), _from_column(gy_rows, s),
                          _from_column("col", s), g.K, width, g.og, g.K, g.P, g.P, trans_a=True)
            if padded:
                b.line("xpad[:] = 0")
                _col2im(m, g, "xpad[", by_rows)
                c, h = m.fresh("c"), m.fresh("h")
                channel = c if c0 == "0" else f"{c0} + {c}"
                with b.block(f"for {c} in range({g.cg}):"), \
                        b.block(f"for {h} in range({g.h}):"):
                    m.copy_run(gx, f"{n}, {channel}, {h}, 0", "xpad",
                               f"{c}, {affine(h, 1, g.pt)}, {g.pl}", g.w)
            else:
                prefix = f"{gx}[{n}, {c0} + " if c0 != "0" else f"{gx}[{n}, "
                _col2im(m, g, prefix, by_rows)


def _col2im(m: KernelModule, g: _Conv, image: str, by_rows: bool) -> None:
    """Add ``col`` into ``image``, as `_row_im2col` or `_im2col` laid it out."""
    if by_rows:
        _row_im2col(m, g, image, "col", back=True)
    else:
        _im2col(m, g, image, "col", ("0", str(g.K)), back=True)


def _kernel_row_gemms_back(m: KernelModule, node: Node, g: _Conv, o0: str, gy: str) -> None:
    """``col[:, i*dh*ow:][:, :P] += w_rows[i, group]^T @ gy`` for every kernel row
    ``i``, into a zeroed ``col`` (the rows' column ranges overlap)."""
    depth, ld, i = g.cg * g.kw, g.rows_read * g.ow, m.fresh("i")
    m.body.line("col[:] = 0")
    with _chunks(m, depth, g.og, g.P, g.P, tiled=False) as (s, width), \
            m.body.block(f"for {i} in range({g.kh}):"):
        weights = f"w_rows[{i}, {o0}:]" if o0 != "0" else f"w_rows[{i}]"
        shift = f"{i} * {g.dh * g.ow}" if s == "0" else f"{i} * {g.dh * g.ow} + {s}"
        _gemm(m, node, weights, _from_column(gy, s), f"col[:, {shift}:]", depth, width, g.og,
              depth, g.P, ld, beta=1, trans_a=True)


# Weight gradients with at most this many im2col rows (a group's, or a kernel row's)
# split the images rather than the rows between threads: a thread's share of so few rows
# makes a product too thin for BLAS (conv2 of cifar_quick, 160 rows: 71 GFLOP/s for 80
# of them, 82 for all 160, AMD Zen 4 with one thread).
SLOT_MAX_ROWS = 512
# Their images are split into this many parts, whatever the threads: each part's
# gradient is summed apart, then the parts in order, so the result is the same on every
# machine.
SLOTS = 4


@renders("conv2d_grad_weight")
def render_conv2d_grad_weight(node: Node, m: KernelModule) -> None:
    """``gw[group] = sum over images of gy[n, group] @ im2col(x[n, group])^T``, computed
    transposed: ``gw^T += im2col(x[n]) @ gy[n]^T``, one GEMM per image (and kernel
    row, see `_by_kernel_rows`) adding into a scratch (BLAS beta = 1), then copied
    into gw. That way round OpenBLAS multiplies nearly twice as fast (the im2col matrix
    is the left operand, as stored) than ``gy @ col^T``. Rows of the im2col matrix
    (columns of gw) are independent: a block computes rows ``lo:hi`` of every group.
    With few rows (`SLOT_MAX_ROWS`), blocks take parts of the images instead (`SLOTS`),
    each summing its own gradient, and the parts are added at the end. With a BLAS
    that multiplies small products unpacked, ``gy[n]^T`` is copied first, so that
    the products take it as stored, in chunks that small (`_unpacked`)."""
    (x, gy), (gw,), b = m.inputs, m.outputs, m.body
    g = _read_sizes(m, _conv(node.inputs[0].type.shape, node.outputs[0].type.shape,
                             node.inputs[1].type.shape, node.attrs),
                    images=(x, 0), channels=(x, 1), filters=(gy, 1))
    by_rows = _by_kernel_rows(g)
    b.line(f"gy_mat = {m.view(gy, (g.n, g.cout, g.P))}")
    if g.pointwise:
        b.line(f"x_mat = {m.view(x, (g.n, g.c, g.P))}")
    count = g.cg * g.kw if by_rows else g.K
    shifts = g.kh if by_rows else 1  # kernel rows done by separate GEMMs
    dtype = dtype_name(node)
    n = m.fresh("n")
    if g.n >= SLOTS and count <= SLOT_MAX_ROWS:
        parts = m.share("parts", (SLOTS, shifts, count, g.cout), node.outputs[0].type.dtype)
        first, last = m.split(SLOTS, g.macs, products=True)
        _weight_gradient_scratch(m, node, g, by_rows, count, count)
        part = m.fresh("part")
        b.line(f"for {part} in range({span_of(first, last)}):")
        with b.indent():
            b.line(f"gw_t = {parts}[{part}]")
            b.line("gw_t[:] = 0")
            images = f"{part} * {g.n} // {SLOTS}, ({part} + 1) * {g.n} // {SLOTS}"
            _weight_gradient_products(m, node, g, by_rows, x, n, images, "0", str(count),
                                      count, count)
        _store_weight_gradient(m, g, by_rows, "0", count, gw, parts)
        return
    lo, hi = m.split(count, g.macs, products=True)
    width = count if lo == "0" else f"{hi} - {lo}"
    b.lines(m.filled("gw_t", (shifts, width, g.cout), dtype, "0"))
    _weight_gradient_scratch(m, node, g, by_rows, width, count)
    _weight_gradient_products(m, node, g, by_rows, x, n, str(g.n), lo, hi, width, count)
    _store_weight_gradient(m, g, by_rows, lo, width, gw)


def _weight_gradient_scratch(m: KernelModule, node: Node, g: _Conv, by_rows: bool,
                             width, most: int) -> None:
    """The im2col matrix (``width`` rows, at ``most``), the padded image it is read
    from, and ``gy_t`` for `_unpacked` products."""
    if not g.pointwise:
        columns = g.rows_read * g.ow if by_rows else g.P
        m.body.line(f"col = {m.empty((width, columns), dtype_name(node))}")
        _padded_scratch(m, node, g, phased=not by_rows and _im2col_phased(g))
    if _unpacked(m, g, most):
        m.body.line(f"gy_t = {m.empty((g.P, g.og), dtype_name(node))}")


def _unpacked(m: KernelModule, g: _Conv, most: int) -> bool:
    """Whether to copy ``gy^T`` (into ``gy_t``) and multiply ``im2col @ gy_t``, for at
    ``most`` rows: the BLAS runs that unpacked in chunks of columns (`_chunks`), where
    it would pack ``col @ gy^T``. On the Zen 4 machine (one thread) the 32 x 1024 by
    1024 x 75 product of cifar_quick's conv1 ran at 68 GFLOP/s as ``col @ gy^T``, 102
    in chunks of 384 columns of ``col @ gy_t``; the copy takes about a tenth of that.
    Not where a chunk would be narrower than `MIN_CHUNK`, or the product already
    runs unpacked."""
    limit, outputs = m.options.small_gemm_macs, most * g.og
    if not limit or (outputs <= SMALL_DOTS_MAX_OUTPUTS and outputs * g.P <= limit):
        return False
    most_columns = limit // outputs // VECTOR * VECTOR
    return most_columns >= min(g.P, MIN_CHUNK)


def _weight_gradient_products(m: KernelModule, node: Node, g: _Conv, by_rows: bool,
                              x: str, n: str, images: str, lo: str, hi: str, width,
                              most: int) -> None:
    """``gw_t += im2col(x[n]) @ gy[n]^T`` for the images ``n`` in ``range(images)``,
    for the im2col rows ``lo:hi`` (``width`` of them, at ``most``)."""
    b, unpacked = m.body, _unpacked(m, g, most)
    with b.block(f"for {n} in range({images}):"), _groups(m, g) as (c0, o0):
        gy_rows = row_slice(f"gy_mat[{n}]", o0, g.og, g.cout)
        if unpacked:
            _transpose(m, node, g, gy_rows, "gy_t")
        if g.pointwise:
            col = f"x_mat[{n}, {c0} + {lo}:{c0} + {hi}]" if lo != "0" else \
                row_slice(f"x_mat[{n}]", c0, g.cg, g.c)
            _add_weight_product(m, node, g, col, g.P, gy_rows, f"gw_t[0, :, {o0}:]", width,
                                most, unpacked)
        elif by_rows:
            _row_im2col(m, g, _pad_image(m, g, x, n, c0), "col", rows=(lo, hi))
            i = m.fresh("i")
            with b.block(f"for {i} in range({g.kh}):"):
                _add_weight_product(m, node, g, f"col[:, {i} * {g.dh * g.ow}:]",
                                    g.rows_read * g.ow, gy_rows, f"gw_t[{i}, :, {o0}:]",
                                    width, most, unpacked)
        else:
            phased = _im2col_phased(g)
            _im2col(m, g, _pad_image(m, g, x, n, c0, phased=phased), "col", (lo, hi),
                    back=False, phased=phased)
            _add_weight_product(m, node, g, "col", g.P, gy_rows, f"gw_t[0, :, {o0}:]", width,
                                most, unpacked)


def _transpose(m: KernelModule, node: Node, g: _Conv, matrix: str, into: str) -> None:
    """``into[p, o] = matrix[o, p]`` for the group's ``og`` rows: f32 by `cpu_gemm`'s
    ``transpose`` (32 x 1024, cifar_quick's conv1, 11-14 -> 8.5 us); others eight rows
    at a time, so that each column stores eight contiguous values (twice as fast as
    one row at a time)."""
    if node.outputs[0].type.dtype is DType.f32:
        _transposed(m, matrix, g.og, g.P, g.P, into, g.og)
        return
    b, o, p, k = m.body, m.fresh("o"), m.fresh("p"), m.fresh("k")
    source, whole = m.fresh("source"), g.og // 8 * 8
    b.line(f"{source} = {matrix}")
    if whole:
        with b.block(f"for {o} in range(0, {whole}, 8):"), \
                b.block(f"for {p} in range({g.P}):"), b.block(f"for {k} in range(8):"):
            b.line(f"{into}[{p}, {o} + {k}] = {source}[{o} + {k}, {p}]")
    if whole < g.og:
        with b.block(f"for {o} in range({whole}, {g.og}):"), \
                b.block(f"for {p} in range({g.P}):"):
            b.line(f"{into}[{p}, {o}] = {source}[{o}, {p}]")


def _transposed(m: KernelModule, matrix: str, rows, cols, ld, into: str, ld_into) -> None:
    """``into[j, i] = matrix[i, j]`` for ``rows`` x ``cols`` f32 (leading dimensions
    ``ld``, ``ld_into``), by `cpu_gemm`'s ``transpose``: in blocks of registers, where
    element by element the loads or the stores go a row apart."""
    m.import_line("from purinec.codegen.cpu_gemm import transpose")
    m.body.line(f"transpose({rows}, {cols}, {matrix}, {ld}, {into}, {ld_into})")


def _add_weight_product(m: KernelModule, node: Node, g: _Conv, col: str, ld: int, gy: str,
                        out: str, width, most: int, unpacked: bool) -> None:
    """``out += col[:, :P] @ gy^T`` for ``width`` rows of ``col`` (at ``most``): one
    product, or, `_unpacked`, products of chunks of columns of ``col`` and rows of
    ``gy_t``."""
    if not unpacked:
        _gemm(m, node, col, gy, out, width, g.og, g.P, ld, g.P, g.cout, beta=1, trans_b=True)
        return
    with _chunks(m, most, g.og, g.P, g.P, _tiled(m, node)) as (s, count):
        gy_t = "gy_t" if s == "0" else f"gy_t[{s}:]"
        _gemm(m, node, _from_column(col, s), gy_t, out, width, g.og, count, ld, g.og, g.cout,
              beta=1)


def _store_weight_gradient(m: KernelModule, g: _Conv, by_rows: bool, lo: str,
                           width, gw: str, parts: str | None = None) -> None:
    """``gw`` from the scratch ``gw_t[shift, r, o]``: rows ``r`` of im2col's matrix
    (from ``lo`` on), or of the kernel rows' one (then ``shift`` is the kernel row); or,
    once every block is done, from the sum of the `SLOTS` scratches in ``parts``."""
    b = m.after if parts else m.body
    gw_mat = m.fresh("gw_mat")
    b.line(f"{gw_mat} = {m.view(gw, (g.cout, g.K))}")
    s, r, o, k = m.fresh("s"), m.fresh("r"), m.fresh("o"), m.fresh("k")
    with b.block(f"for {s} in range({g.kh if by_rows else 1}):"), \
            b.block(f"for {r} in range({width}):"):
        row = r if lo == "0" else f"({r} + {lo})"
        if by_rows:  # row = c*kw + j  ->  column (c*kh + s)*kw + j of gw
            b.line(f"{k} = ({row} // {g.kw} * {g.kh} + {s}) * {g.kw} + {row} % {g.kw}")
        else:
            b.line(f"{k} = {row}")
        with b.block(f"for {o} in range({g.cout}):"):
            if parts:
                total = " + ".join(f"{parts}[{p}, {s}, {r}, {o}]" for p in range(SLOTS))
                b.line(f"{gw_mat}[{o}, {k}] = {total}")
            else:
                b.line(f"{gw_mat}[{o}, {k}] = gw_t[{s}, {r}, {o}]")
