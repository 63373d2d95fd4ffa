"""CUDA renderers of matrix products and convolutions: every one is one tiled GEMM.

Each op here is a product ``C[m, n] = sum over k of A[m, k] * B[k, n]`` (per group, for
a grouped convolution) whose operands are read in place from the IR's arrays:

* ``matmul``: A and B are the operands, transposed or not;
* ``conv2d``, an implicit GEMM: A is the weight as a ``[Cout, Cin/groups*kh*kw]``
  matrix and B the im2col matrix of the input, each element gathered from the input as
  it is loaded (zero in the padding), so no im2col matrix is ever built:
  ``C[co, (img, oh, ow)]`` is ``y[img, co, oh, ow]``;
* ``conv2d_grad_input``: ``C[ci, (img, ih, iw)] = sum over (co, kh, kw) of
  w[co, ci, kh, kw] * gy[img, co, oh, ow]``, where ``(oh, ow)`` is the output pixel
  whose window puts tap ``(kh, kw)`` on input pixel ``(ih, iw)``, if any: col2im
  without a scratch, gathering what the CPU scatters;
* ``conv2d_grad_weight``: ``C[co, (ci, kh, kw)] = sum over (img, oh, ow) of
  gy[img, co, oh, ow] * im2col(x)[(ci, kh, kw), (img, oh, ow)]``.

`emit_gemm` writes the kernel they share from generated source for an element of A, an
element of B and the output coordinates of an element of C. C's element is stored, or
handed to an epilogue (`EPILOGUES`): the fused elementwise members compute on it while
it is in a register and store their outputs, the product's own only if the fused node
exports it.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

from purinec.codegen.cpu_conv import _Conv, _conv
from purinec.codegen.cuda.elementwise import emit_element, emit_loop_kernel
from purinec.codegen.cuda.fused import EPILOGUES
from purinec.codegen.cuda.module import (THREADS, CudaModule, blocks_for, literal,
                                         renders)
from purinec.codegen.cuda.shape import grid_stride
from purinec.codegen.cuda.simulator import simulated
from purinec.codegen.elementwise import input_axes
from purinec.codegen.kernel import CodegenError
from purinec.codegen.source import SourceBuilder
from purinec.ir.graph import Node, Value
from purinec.ir.ops import Trait, op_has
from purinec.ir.types import DType

# The side of the square tiles of C a block computes, and of its blocks of threads.
# Numba's simulator runs one Python thread per CUDA thread, every one of them behind
# each barrier: there the same code runs with tiles of 8 (a program's products take
# a third less time, and the small shapes it is tested on span more tiles).
TILE = 8 if simulated() else 16
# CUDA's bound on a grid's y and z dimensions (tiles of rows of C, groups).
MAX_GRID_YZ = 65535


@dataclass(frozen=True)
class Load:
    """Source for one element of an operand, read where every ``valid`` condition
    holds (a convolution's padding; the matrix's bounds are the emitter's) and zero
    elsewhere."""

    value: str
    valid: tuple[str, ...] = ()


# (body, group, row, column) -> the element of an operand at that row and column of
# its matrix (the group is None for one group). It may bind locals in ``body`` first.
Reader = Callable[[SourceBuilder, str | None, str, str], Load]


@dataclass(frozen=True)
class Operand:
    """How to read an operand of the product. ``transposed``: its matrix is contiguous
    in memory down its columns, so the threads next to one another load down a column
    of its tile (coalesced reads) rather than along a row."""

    read: Reader
    transposed: bool = False


@dataclass(frozen=True)
class Gemm:
    """``C[m, n] = sum over k < depth of A[m, k] * B[k, n]`` for ``m < rows``, ``n <
    cols`` and each of ``groups``. ``at(body, group, m, n)`` gives the coordinates of
    ``C[m, n]`` in the op's output. For the kernel's comment: ``formula`` says in the
    IR's terms what is computed (lines), ``axes`` what C's rows and columns and the
    depth are."""

    formula: str
    axes: tuple[str, str, str]
    rows: int
    cols: int
    depth: int
    groups: int
    dtype: DType
    a: Operand
    b: Operand
    at: Callable[[SourceBuilder, str | None, str, str], list[str]]


# (body, coordinates of C's element in the output, local holding it) -> None
Store = Callable[[SourceBuilder, list[str], str], None]


def emit_gemm(m: CudaModule, gemm: Gemm, arrays: Sequence[str], store: Store) -> None:
    """One kernel computing ``gemm``, giving each element of C to ``store``.

    A block of TILE x TILE threads computes a TILE x TILE tile of C, one element per
    thread, for one group: the grid is (tiles of columns, tiles of rows, groups). It
    walks the depth a tile at a time: each thread loads one element of A's tile and one
    of B's into shared memory (zero beyond the matrices, so no size need be a multiple
    of TILE), the block waits, each thread adds its row of A's tile times its column of
    B's, and the block waits again before the tiles are overwritten. Every thread takes
    part in every load and barrier; only the store is guarded by C's bounds. The sum is
    in the operands' precision, as the CPU's BLAS does (float32 for float32)."""
    row_tiles, col_tiles = _tiles(gemm.rows), _tiles(gemm.cols)
    if row_tiles > MAX_GRID_YZ or gemm.groups > MAX_GRID_YZ:
        raise CodegenError(f"kernel {m.name}: a product of {gemm.rows} rows in "
                           f"{gemm.groups} group(s) needs a grid of {row_tiles} x "
                           f"{gemm.groups} blocks along y and z, over CUDA's {MAX_GRID_YZ}")
    kind, zero = gemm.dtype.numpy.name, literal(0, gemm.dtype)
    with m.kernel("gemm") as (name, body), body.origin(*_anchor(m)):
        for line in gemm.formula.split("\n"):
            body.line(f"# {line}")
        rows, cols, depth = gemm.axes
        per_group = " per group" if gemm.groups > 1 else ""
        body.line(f"# as C = A @ B{per_group}: rows {rows}, columns {cols}, depth {depth}; a "
                  f"{TILE}x{TILE}")
        body.line("# tile of C per block of threads, one element per thread.")
        # One column of padding: threads filling a tile down a column (a transposed
        # operand) then write to different shared-memory banks.
        a_tile, b_tile = m.fresh("tile_a"), m.fresh("tile_b")
        body.line(f"{a_tile} = cuda.shared.array(({TILE}, {TILE + 1}), {kind})")
        body.line(f"{b_tile} = cuda.shared.array(({TILE}, {TILE + 1}), {kind})")
        ty, tx = m.fresh("ty"), m.fresh("tx")
        body.line(f"{ty} = cuda.threadIdx.y")
        body.line(f"{tx} = cuda.threadIdx.x")
        group = None
        if gemm.groups > 1:
            group = m.fresh("group")
            body.line(f"{group} = cuda.blockIdx.z")
        row0, col0 = m.fresh("row0"), m.fresh("col0")
        body.line(f"{row0} = cuda.blockIdx.y * {TILE}")
        body.line(f"{col0} = cuda.blockIdx.x * {TILE}")
        acc, k0, kk = m.fresh("acc"), m.fresh("k0"), m.fresh("kk")
        body.line(f"{acc} = {zero}")
        with body.block(f"for {k0} in range(0, {gemm.depth}, {TILE}):"):
            body.line(f"# A[{row0}:, {k0}:] and B[{k0}:, {col0}:], a tile each, into "
                      f"shared memory")
            _load_tile(m, body, gemm.a, "a", a_tile, group, (ty, tx), (row0, k0),
                       (gemm.rows, gemm.depth), "mk", zero)
            _load_tile(m, body, gemm.b, "b", b_tile, group, (ty, tx), (k0, col0),
                       (gemm.depth, gemm.cols), "kn", zero)
            body.line("cuda.syncthreads()")
            with body.block(f"for {kk} in range({TILE}):"):
                body.line(f"{acc} += {a_tile}[{ty}, {kk}] * {b_tile}[{kk}, {tx}]")
            body.line("cuda.syncthreads()")
        row, col = m.fresh("row"), m.fresh("col")
        body.line(f"{row} = {row0} + {ty}")
        body.line(f"{col} = {col0} + {tx}")
        inside = _below(row, gemm.rows) + _below(col, gemm.cols)
        if inside:
            with body.block(f"if {' and '.join(inside)}:"):
                store(body, gemm.at(body, group, row, col), acc)
        else:
            store(body, gemm.at(body, group, row, col), acc)
    blocks = (col_tiles, row_tiles) + ((gemm.groups,) if gemm.groups > 1 else ())
    m.launch(name, blocks, (TILE, TILE))


def _load_tile(m: CudaModule, body: SourceBuilder, operand: Operand, letter: str,
               tile: str, group: str | None, threads: tuple[str, str],
               starts: tuple[str, str], sizes: tuple[int, int], axes: str, zero: str
               ) -> None:
    """This thread's element of the tile of operand ``letter`` whose corner is at
    ``starts`` in a matrix of ``sizes`` (its ``axes`` of the product): at (thread y,
    thread x) of the tile, or at (x, y) for a transposed operand."""
    at = threads[::-1] if operand.transposed else threads
    index = [m.fresh(letter + axis) for axis in axes]
    for name, start, thread in zip(index, starts, at):
        body.line(f"{name} = {start} + {thread}")
    load = operand.read(body, group, *index)
    valid = _below(index[0], sizes[0]) + _below(index[1], sizes[1]) + list(load.valid)
    if load.valid:  # a window's bounds too: name the test, or the line gets long
        inside = m.fresh(f"inside_{letter}")
        body.line(f"{inside} = {' and '.join(valid)}")
        valid = [inside]
    value = f"{load.value} if {' and '.join(valid)} else {zero}" if valid else load.value
    body.line(f"{tile}[{at[0]}, {at[1]}] = {value}")


def _below(index: str, size: int) -> list[str]:
    """The test that ``index``, which the grid's tiles take up to a multiple of TILE
    (at least one tile), is below ``size``: none when it cannot fail."""
    return [f"{index} < {size}"] if size % TILE or not size else []


def _anchor(m: CudaModule) -> tuple[Node, ...]:
    """The node the product's lines come from: a fused node's anchor."""
    (node,) = m.nodes
    return (node.body[0],) if node.body is not None else (node,)


def _tiles(size: int) -> int:
    return max(1, -(-size // TILE))


# ---------------------------------------------------------------------------------------
# The ops as products.


def _matmul(node: Node, m: CudaModule, arrays: dict[Value, str]) -> Gemm:
    """``op(a) @ op(b)``: transposes are the order of the indices."""
    a, b = (arrays[v] for v in node.inputs)
    ta, tb = node.attrs["trans_a"], node.attrs["trans_b"]
    rows, cols = node.outputs[0].type.shape
    depth = node.inputs[0].type.shape[0 if ta else 1]
    a_at, b_at = ("k, m" if ta else "m, k"), ("n, k" if tb else "k, n")
    return Gemm(f"y[m, n] = sum over k of a[{a_at}] * b[{b_at}]", ("m", "n", "k"),
                rows, cols, depth, 1,
                node.outputs[0].type.dtype,
                Operand(lambda body, g, i, k: Load(f"{a}[{k}, {i}]" if ta else f"{a}[{i}, {k}]"),
                        transposed=ta),
                Operand(lambda body, g, k, j: Load(f"{b}[{j}, {k}]" if tb else f"{b}[{k}, {j}]"),
                        transposed=tb),
                lambda body, g, i, j: [i, j])


def _conv2d(node: Node, m: CudaModule, arrays: dict[Value, str]) -> Gemm:
    """Per group, C's rows are the group's output channels, its columns the output
    pixels of every image, and B the im2col matrix of the input, gathered."""
    (x, w), y = (arrays[v] for v in node.inputs), node.outputs[0]
    g = _conv(node.inputs[0].type.shape, node.inputs[1].type.shape, y.type.shape,
              node.attrs)
    taps = (g.cg, g.kh, g.kw), ("ci", "kh", "kw")

    def weight(body, group, co, tap):
        ci, kh, kw = _unflatten(m, body, tap, *taps)
        return Load(f"{w}[{_linear((group, g.og), (co, 1))}, {ci}, {kh}, {kw}]")

    def at(body, group, co, pixel):
        img, oh, ow = _unflatten(m, body, pixel, (g.n, g.oh, g.ow), ("img", "oh", "ow"))
        return [img, _linear((group, g.og), (co, 1)), oh, ow]
    return Gemm(f"y[img, co, oh, ow] = sum over ci, kh, kw of w[co, ci, kh, kw] * "
                f"x[img, ci, ih, iw]\n  with {_window(g)} (zero outside x)",
                ("co", "(img, oh, ow)", "(ci, kh, kw)"),
                g.og, g.n * g.P, g.K, g.groups, y.type.dtype, Operand(weight),
                Operand(lambda body, group, tap, pixel:
                        _input_pixel(m, body, g, x, group, tap, pixel)),
                at)


def _conv2d_grad_input(node: Node, m: CudaModule, arrays: dict[Value, str]) -> Gemm:
    """Per group, C's rows are the group's input channels and its columns the input
    pixels of every image; the depth runs over the output channels and taps, B's
    element being the output gradient at the position whose window puts that tap on
    that pixel (zero where no window does)."""
    (gy, w), gx = (arrays[v] for v in node.inputs), node.outputs[0]
    g = _conv(gx.type.shape, node.inputs[1].type.shape, node.inputs[0].type.shape,
              node.attrs)
    taps = (g.og, g.kh, g.kw), ("co", "kh", "kw")
    pixels = (g.n, g.h, g.w), ("img", "ih", "iw")

    def weight(body, group, ci, tap):
        co, kh, kw = _unflatten(m, body, tap, *taps)
        return Load(f"{w}[{_linear((group, g.og), (co, 1))}, {ci}, {kh}, {kw}]")

    def gradient(body, group, tap, pixel):
        co, kh, kw = _unflatten(m, body, tap, *taps)
        img, ih, iw = _unflatten(m, body, pixel, *pixels)
        oh, valid_h = _window_start(m, body, ih, kh, g.sh, g.pt, g.dh, g.kh, g.h, g.oh, "oh")
        ow, valid_w = _window_start(m, body, iw, kw, g.sw, g.pl, g.dw, g.kw, g.w, g.ow, "ow")
        return Load(f"{gy}[{img}, {_linear((group, g.og), (co, 1))}, {oh}, {ow}]",
                    valid_h + valid_w)

    def at(body, group, ci, pixel):
        img, ih, iw = _unflatten(m, body, pixel, *pixels)
        return [img, _linear((group, g.cg), (ci, 1)), ih, iw]
    return Gemm(f"gx[img, ci, ih, iw] = sum over co, kh, kw of w[co, ci, kh, kw] * "
                f"gy[img, co, oh, ow]\n  for the whole oh, ow in range with {_window(g)}",
                ("ci", "(img, ih, iw)", "(co, kh, kw)"),
                g.cg, g.n * g.h * g.w, g.og * g.kh * g.kw, g.groups, gx.type.dtype,
                Operand(weight), Operand(gradient), at)


def _conv2d_grad_weight(node: Node, m: CudaModule, arrays: dict[Value, str]) -> Gemm:
    """Per group, C's rows are the group's output channels and its columns the taps of
    each input channel; the depth runs over images and output pixels, along which both
    operands are contiguous (B, the im2col matrix, is read transposed)."""
    (x, gy), gw = (arrays[v] for v in node.inputs), node.outputs[0]
    g = _conv(node.inputs[0].type.shape, gw.type.shape, node.inputs[1].type.shape,
              node.attrs)
    pixels = (g.n, g.oh, g.ow), ("img", "oh", "ow")

    def gradient(body, group, co, pixel):
        img, oh, ow = _unflatten(m, body, pixel, *pixels)
        return Load(f"{gy}[{img}, {_linear((group, g.og), (co, 1))}, {oh}, {ow}]")

    def at(body, group, co, tap):
        ci, kh, kw = _unflatten(m, body, tap, (g.cg, g.kh, g.kw), ("ci", "kh", "kw"))
        return [_linear((group, g.og), (co, 1)), ci, kh, kw]
    return Gemm(f"gw[co, ci, kh, kw] = sum over img, oh, ow of gy[img, co, oh, ow] * "
                f"x[img, ci, ih, iw]\n  with {_window(g)} (zero outside x)",
                ("co", "(ci, kh, kw)", "(img, oh, ow)"),
                g.og, g.K, g.n * g.P, g.groups, gw.type.dtype, Operand(gradient),
                Operand(lambda body, group, pixel, tap:
                        _input_pixel(m, body, g, x, group, tap, pixel), transposed=True),
                at)


def _input_pixel(m: CudaModule, body: SourceBuilder, g: _Conv, x: str, group: str | None,
                 tap: str, pixel: str) -> Load:
    """The element of the im2col matrix of ``x`` at row ``tap`` (flat ``(ci, kh, kw)``)
    and column ``pixel`` (flat ``(img, oh, ow)``): the input under tap ``(kh, kw)`` of
    output pixel ``(oh, ow)``'s window, zero in the padding."""
    ci, kh, kw = _unflatten(m, body, tap, (g.cg, g.kh, g.kw), ("ci", "kh", "kw"))
    img, oh, ow = _unflatten(m, body, pixel, (g.n, g.oh, g.ow), ("img", "oh", "ow"))
    ih, iw = m.fresh("ih"), m.fresh("iw")
    body.line(f"{ih} = {_linear((oh, g.sh), (kh, g.dh), constant=-g.pt)}")
    body.line(f"{iw} = {_linear((ow, g.sw), (kw, g.dw), constant=-g.pl)}")
    valid = (_in_range(ih, -g.pt, (g.oh - 1) * g.sh + (g.kh - 1) * g.dh - g.pt, g.h)
             + _in_range(iw, -g.pl, (g.ow - 1) * g.sw + (g.kw - 1) * g.dw - g.pl, g.w))
    return Load(f"{x}[{img}, {_linear((group, g.cg), (ci, 1))}, {ih}, {iw}]", valid)


def _window_start(m: CudaModule, body: SourceBuilder, pixel: str, tap: str, stride: int,
                  pad: int, dilation: int, kernel: int, size: int, out: int, hint: str
                  ) -> tuple[str, tuple[str, ...]]:
    """The output position (along one axis) whose window puts ``tap`` on input
    ``pixel``: ``(pixel + pad - tap * dilation) / stride``, and the conditions that it
    is whole and in range (those that can fail for these sizes)."""
    shifted = _linear((pixel, 1), (tap, -dilation), constant=pad)
    start = m.fresh(hint)
    if stride == 1:
        body.line(f"{start} = {shifted}")
        valid: tuple[str, ...] = ()
    else:
        scaled = m.fresh(f"{hint}s")  # start times the stride, if whole
        body.line(f"{scaled} = {shifted}")
        body.line(f"{start} = {scaled} // {stride}")
        valid = (f"{scaled} % {stride} == 0",)
    lowest, highest = (pad - (kernel - 1) * dilation) // stride, (size - 1 + pad) // stride
    return start, valid + _in_range(start, lowest, highest, out)


def _window(g: _Conv) -> str:
    """Where tap ``(kh, kw)`` of output pixel ``(oh, ow)``'s window falls in the
    input, with this convolution's numbers."""
    return (f"ih, iw = {_linear(('oh', g.sh), ('kh', g.dh), constant=-g.pt)}, "
            f"{_linear(('ow', g.sw), ('kw', g.dw), constant=-g.pl)}")


# ---------------------------------------------------------------------------------------
# Index arithmetic printed with the constants baked in.


def _linear(*terms: tuple[str | None, int], constant: int = 0) -> str:
    """Source of ``sum of var * scale + constant``, leaving out absent (None) and
    zero terms."""
    text = ""
    for var, scale in terms:
        if var is None or var == "0" or scale == 0:
            continue
        product = var if abs(scale) == 1 else f"{var} * {abs(scale)}"
        text = (f"-{product}" if scale < 0 else product) if not text else \
            f"{text} {'-' if scale < 0 else '+'} {product}"
    if not text:
        return str(constant)
    return text if constant == 0 else f"{text} {'-' if constant < 0 else '+'} {abs(constant)}"


def _unflatten(m: CudaModule, body: SourceBuilder, flat: str, extents: Sequence[int],
               hints: Sequence[str]) -> list[str]:
    """The coordinates of C-order index ``flat`` over ``extents``, each bound to a
    local in ``body``; ``"0"`` along axes of extent 1."""
    names, outermost = [], True
    for k, (extent, hint) in enumerate(zip(extents, hints)):
        if extent == 1:
            names.append("0")
            continue
        stride = 1
        for inner in extents[k + 1:]:
            stride *= inner
        text = flat if stride == 1 else f"{flat} // {stride}"
        if not outermost:
            text = f"{text} % {extent}"
        outermost = False
        if text == flat:
            names.append(flat)
            continue
        names.append(m.fresh(hint))
        body.line(f"{names[-1]} = {text}")
    return names


def _in_range(var: str, lowest: int, highest: int, size: int) -> tuple[str, ...]:
    """The test that ``var``, known to lie in ``[lowest, highest]``, is in
    ``[0, size)``: only the bounds it can cross."""
    below, above = lowest < 0, highest >= size
    if below and above:
        return (f"0 <= {var} < {size}",)
    return ((f"{var} >= 0",) if below else ()) + ((f"{var} < {size}",) if above else ())


def _flat(coords: Sequence[str], shape: Sequence[int]) -> str:
    """The C-order flat index of ``coords`` in an array of ``shape``."""
    terms, stride = [], 1
    for coord, extent in reversed(list(zip(coords, shape))):
        terms.append((coord, stride))
        stride *= extent
    return f"({_linear(*reversed(terms))})"


def _index(coords: Sequence[str]) -> str:
    return ", ".join(coords) if coords else "()"


# ---------------------------------------------------------------------------------------
# The ops through cuBLAS (`blas.gemm`): the product itself in the library, generated
# kernels around it lay a convolution's operands out as matrices (im2col, a transposed
# output gradient) and gather col2im's sums. Each writes the product into ``out``, an
# array of the op's output shape.

# Bytes of scratch one chunk of images may take (im2col's matrix and the like): its
# products are big enough for cuBLAS, and it is small next to a GPU's memory.
CHUNK_BYTES = 1 << 27


def _blas_matmul(node: Node, m: CudaModule, arrays: dict[Value, str], out: str) -> None:
    a, b = (arrays[v] for v in node.inputs)
    (rows, cols), depth = node.outputs[0].type.shape, node.inputs[0].type.shape[
        0 if node.attrs["trans_a"] else 1]
    _gemm(m, a, b, out, rows, cols, depth, trans_a=node.attrs["trans_a"],
          trans_b=node.attrs["trans_b"], lda=node.inputs[0].type.shape[1],
          ldb=node.inputs[1].type.shape[1], ldc=cols)


def _gemm(m: CudaModule, a: str, b: str, c: str, rows: int, cols: int, depth: int,
          **options) -> None:
    """A host step calling `blas.gemm` with these operands, sizes and keywords (numbers,
    or source text evaluated on the host: a chunk's offset)."""
    keywords = "".join(f", {name}={value}" for name, value in options.items())
    m.host(f"blas.gemm(stream, {a}, {b}, {c}, {rows}, {cols}, {depth}{keywords})")


def _pointwise(g: _Conv) -> bool:
    """A 1x1 convolution with stride 1 and no padding: an image is its own im2col."""
    return (g.kh, g.kw, g.sh, g.sw, g.pt, g.pl, g.pb, g.pr) == (1, 1, 1, 1, 0, 0, 0, 0)


def _chunk(images: int, bytes_per_image: int) -> int:
    """Images per chunk: the most that divides ``images`` and fits `CHUNK_BYTES`
    (every chunk the same, so one kernel serves them all)."""
    fits = max(1, CHUNK_BYTES // max(1, bytes_per_image))
    return max(d for d in range(1, min(images, fits) + 1) if images % d == 0)


@contextmanager
def _chunks(m: CudaModule, g: _Conv, count: int, sliced: Sequence[str]
            ) -> Iterator[tuple[str, list[str]]]:
    """The host's loop over chunks of ``count`` images (none for one chunk): yields
    the first image's expression and, for each array of ``sliced`` (indexed by image
    first), the chunk's slice of it; the steps added meanwhile are the loop's body."""
    if count == g.n:
        yield "0", list(sliced)
        return
    start = m.fresh("i0")
    parts = [m.local(f"{array}_chunk", array) for array in sliced]
    with m.host_block(f"for {start} in range(0, {g.n}, {count}):"):
        for part, array in zip(parts, sliced):
            m.host(f"{part} = {array}[{start}:{start} + {count}]")
        yield start, parts


def _im2col(m: CudaModule, g: _Conv, count: int, x: str, col: str, dtype: DType) -> None:
    """``col[(ci, kh, kw), (img, oh, ow)]``: every input channel's taps under every
    output pixel of ``count`` images of ``x``, zero in the padding."""
    whole = replace(g, n=count, groups=1)
    total = g.c * g.kh * g.kw * count * g.oh * g.ow
    columns = count * g.oh * g.ow
    with m.kernel("im2col") as (name, body):
        header, element = grid_stride(m, total)
        with body.block(header):
            tap, pixel = m.fresh("tap"), m.fresh("pixel")
            body.line(f"{tap} = {element} // {columns}")
            body.line(f"{pixel} = {element} % {columns}")
            load = _input_pixel(m, body, whole, x, None, tap, pixel)
            value = (f"{load.value} if {' and '.join(load.valid)} else "
                     f"{literal(0, dtype)}" if load.valid else load.value)
            body.line(f"{col}[{tap}, {pixel}] = {value}")
    m.launch(name, blocks_for(total), THREADS)


def _blas_conv2d(node: Node, m: CudaModule, arrays: dict[Value, str], out: str) -> None:
    """Per group and image, ``y[img, group] = w[group] @ im2col(x[img])[group]``: one
    strided batched product per group and chunk of images."""
    (x, w), y = (arrays[v] for v in node.inputs), node.outputs[0]
    g = _conv(node.inputs[0].type.shape, node.inputs[1].type.shape, y.type.shape,
              node.attrs)
    pixels, depth = g.oh * g.ow, g.cg * g.kh * g.kw
    if _pointwise(g):
        for group in range(g.groups):
            _gemm(m, w, x, out, g.og, pixels, depth, lda=depth, ldb=pixels, ldc=pixels,
                  a_at=group * g.og * depth, b_at=group * g.cg * pixels,
                  c_at=group * g.og * pixels, stride_b=g.c * pixels,
                  stride_c=g.cout * pixels, batch=g.n)
        return
    dtype = y.type.dtype
    count = _chunk(g.n, g.c * g.kh * g.kw * pixels * dtype.numpy.itemsize)
    columns = count * pixels
    col = m.scratch("col", dtype.numpy.name, (g.c * g.kh * g.kw, columns))
    with _chunks(m, g, count, [x]) as (start, (x_chunk,)):
        _im2col(m, g, count, x_chunk, col, dtype)
        for group in range(g.groups):
            _gemm(m, w, col, out, g.og, pixels, depth, lda=depth, ldb=columns, ldc=pixels,
                  a_at=group * g.og * depth, b_at=group * depth * columns,
                  c_at=_linear((start, g.cout * pixels), constant=group * g.og * pixels),
                  stride_b=pixels, stride_c=g.cout * pixels, batch=count)


def _blas_conv2d_grad_input(node: Node, m: CudaModule, arrays: dict[Value, str],
                            out: str) -> None:
    """Per group and image, ``cols = w[group]^T @ gy[img, group]``, then each input
    pixel gathers its taps' sums from ``cols`` (col2im); a pointwise convolution's
    product is the gradient itself."""
    (gy, w), gx = (arrays[v] for v in node.inputs), node.outputs[0]
    g = _conv(gx.type.shape, node.inputs[1].type.shape, node.inputs[0].type.shape,
              node.attrs)
    pixels, depth = g.oh * g.ow, g.cg * g.kh * g.kw
    if _pointwise(g):
        for group in range(g.groups):
            _gemm(m, w, gy, out, g.cg, pixels, g.og, trans_a=True, lda=depth, ldb=pixels,
                  ldc=pixels, a_at=group * g.og * depth, b_at=group * g.og * pixels,
                  c_at=group * g.cg * pixels, stride_b=g.cout * pixels,
                  stride_c=g.c * pixels, batch=g.n)
        return
    dtype = gx.type.dtype
    count = _chunk(g.n, g.c * g.kh * g.kw * pixels * dtype.numpy.itemsize)
    columns = count * pixels
    cols = m.scratch("cols", dtype.numpy.name, (g.c * g.kh * g.kw, columns))
    with _chunks(m, g, count, [out]) as (start, (gx_chunk,)):
        for group in range(g.groups):
            _gemm(m, w, gy, cols, depth, pixels, g.og, trans_a=True, lda=depth, ldb=pixels,
                  ldc=columns, a_at=group * g.og * depth,
                  b_at=_linear((start, g.cout * pixels), constant=group * g.og * pixels),
                  c_at=group * depth * columns, stride_b=g.cout * pixels, stride_c=pixels,
                  batch=count)
        _col2im(m, g, count, cols, gx_chunk, dtype)


def _col2im(m: CudaModule, g: _Conv, count: int, cols: str, gx: str, dtype: DType
            ) -> None:
    """``gx[img, ci, ih, iw]``: the sum of ``cols[(ci, kh, kw), (img, oh, ow)]`` over
    the taps whose window puts them on that pixel; each thread gathers one pixel's."""
    total = count * g.c * g.h * g.w
    pixels = g.oh * g.ow
    with m.kernel("col2im") as (name, body):
        (header, element), acc = grid_stride(m, total), m.fresh("acc")
        with body.block(header):
            img, ci, ih, iw = _unflatten(m, body, element, (count, g.c, g.h, g.w),
                                         ("img", "ci", "ih", "iw"))
            body.line(f"{acc} = {literal(0, dtype)}")
            kh, kw = m.fresh("kh"), m.fresh("kw")
            with body.block(f"for {kh} in range({g.kh}):"), \
                    body.block(f"for {kw} in range({g.kw}):"):
                oh, valid_h = _window_start(m, body, ih, kh, g.sh, g.pt, g.dh, g.kh, g.h,
                                            g.oh, "oh")
                ow, valid_w = _window_start(m, body, iw, kw, g.sw, g.pl, g.dw, g.kw, g.w,
                                            g.ow, "ow")
                row = _linear((ci, g.kh * g.kw), (kh, g.kw), (kw, 1))
                column = _linear((img, pixels), (oh, g.ow), (ow, 1))
                add = f"{acc} += {cols}[{row}, {column}]"
                valid = valid_h + valid_w
                if valid:
                    with body.block(f"if {' and '.join(valid)}:"):
                        body.line(add)
                else:
                    body.line(add)
            body.line(f"{gx}[{img}, {ci}, {ih}, {iw}] = {acc}")
    m.launch(name, blocks_for(total), THREADS)


def _blas_conv2d_grad_weight(node: Node, m: CudaModule, arrays: dict[Value, str],
                             out: str) -> None:
    """Per group, ``gw[group] = gy^T[group] @ im2col(x)[group]^T`` summed over chunks of
    images: each chunk's output gradient laid out as ``[co, (img, oh, ow)]`` beside its
    im2col matrix, one product per group, added to the chunks' before."""
    (x, gy), gw = (arrays[v] for v in node.inputs), node.outputs[0]
    g = _conv(node.inputs[0].type.shape, gw.type.shape, node.inputs[1].type.shape,
              node.attrs)
    pixels, depth = g.oh * g.ow, g.cg * g.kh * g.kw
    dtype = gw.type.dtype
    count = _chunk(g.n, (g.c * g.kh * g.kw + g.cout) * pixels * dtype.numpy.itemsize)
    columns = count * pixels
    col = m.scratch("col", dtype.numpy.name, (g.c * g.kh * g.kw, columns))
    gy_t = m.scratch("gy_t", dtype.numpy.name, (g.cout, columns))
    with _chunks(m, g, count, [x, gy]) as (start, (x_chunk, gy_chunk)):
        _im2col(m, g, count, x_chunk, col, dtype)
        _transpose_images(m, g, count, gy_chunk, gy_t)
        for group in range(g.groups):
            _gemm(m, gy_t, col, out, g.og, depth, columns, trans_b=True, lda=columns,
                  ldb=columns, ldc=depth, a_at=group * g.og * columns,
                  b_at=group * depth * columns, c_at=group * g.og * depth,
                  accumulate=f"{start} > 0" if start != "0" else False)


def _transpose_images(m: CudaModule, g: _Conv, count: int, gy: str, gy_t: str) -> None:
    """``gy_t[co, (img, oh, ow)] = gy[img, co, oh, ow]`` for ``count`` images."""
    columns = count * g.oh * g.ow
    total = g.cout * columns
    with m.kernel("gy_t") as (name, body):
        header, element = grid_stride(m, total)
        with body.block(header):
            co, column = m.fresh("co"), m.fresh("column")
            body.line(f"{co} = {element} // {columns}")
            body.line(f"{column} = {element} % {columns}")
            img, oh, ow = _unflatten(m, body, column, (count, g.oh, g.ow), ("img", "oh", "ow"))
            body.line(f"{gy_t}[{co}, {column}] = {gy}[{img}, {co}, {oh}, {ow}]")
    m.launch(name, blocks_for(total), THREADS)


# op -> fn(node, module, arrays, out): the op through cuBLAS, its product into ``out``
BLAS_PRODUCTS: dict[str, Callable[[Node, CudaModule, dict[Value, str], str], None]] = {
    "matmul": _blas_matmul,
    "conv2d": _blas_conv2d,
    "conv2d_grad_input": _blas_conv2d_grad_input,
    "conv2d_grad_weight": _blas_conv2d_grad_weight,
}


# ---------------------------------------------------------------------------------------
# Renderers.

# op -> fn(node, module, arrays): the op as a product over the module's arrays
PRODUCTS: dict[str, Callable[[Node, CudaModule, dict[Value, str]], Gemm]] = {
    "matmul": _matmul,
    "conv2d": _conv2d,
    "conv2d_grad_input": _conv2d_grad_input,
    "conv2d_grad_weight": _conv2d_grad_weight,
}


@renders(*PRODUCTS)
def render_product(node: Node, m: CudaModule) -> None:
    arrays = dict(zip(node.inputs, m.inputs)) | dict(zip(node.outputs, m.outputs))
    out = m.outputs[0]
    if m.products == "cublas":
        BLAS_PRODUCTS[node.op](node, m, arrays, out)
        return

    def store(body: SourceBuilder, coords: list[str], acc: str) -> None:
        body.line(f"{out}[{_index(coords)}] = {acc}")
    emit_gemm(m, PRODUCTS[node.op](node, m, arrays), m.inputs + m.outputs, store)


def render_epilogue(node: Node, m: CudaModule, arrays: dict[Value, str],
                    outputs: list[Value]) -> None:
    """The fused node's anchor as a product whose every element goes through the
    elementwise members after it (``node.body[1:]``) and is stored as ``outputs``, and
    as the anchor's output too when the fused node exports that."""
    anchor, members = node.body[0], node.body[1:]
    (product,) = anchor.outputs
    if m.products == "cublas":
        _blas_epilogue(node, m, arrays, outputs)
        return
    stored = ([product] if product in node.outputs else []) + list(outputs)
    shape = product.type.shape

    def store(body: SourceBuilder, coords: list[str], acc: str) -> None:
        loaded: dict[tuple[Value, tuple[str, ...]], str] = {}

        def load(member: Node, i: int) -> str:
            value = member.inputs[i]
            where = tuple(coords[a] if a is not None else "0"
                          for a in input_axes(member, i))
            if (value, where) not in loaded:
                loaded[value, where] = m.fresh(value.name)
                with body.origin(member):
                    body.line(f"{loaded[value, where]} = {arrays[value]}[{_index(where)}]")
            return loaded[value, where]

        emit_element(m, body, members, stored, load,
                     lambda value, text: f"{arrays[value]}[{_index(coords)}] = {text}",
                     _flat(coords, shape), given={product: acc})
    emit_gemm(m, PRODUCTS[anchor.op](anchor, m, arrays), m.inputs + m.outputs, store)


def _blas_epilogue(node: Node, m: CudaModule, arrays: dict[Value, str],
                   outputs: list[Value]) -> None:
    """The product through cuBLAS, then the members as one loop over its elements. The
    product goes to its own output if the fused node exports it, else to scratch
    memory: not to an output of the loop, which the memory planner may have put where
    an input of the loop is (a solver's update in place)."""
    anchor, members = node.body[0], node.body[1:]
    (product,) = anchor.outputs
    held = (arrays[product] if product in node.outputs else
            m.scratch("product", product.type.dtype.numpy.name, product.type.shape))
    BLAS_PRODUCTS[anchor.op](anchor, m, arrays, held)
    if outputs:
        emit_loop_kernel(m, members, {**arrays, product: held}, outputs, "epilogue")


EPILOGUES.update({op: render_epilogue for op in PRODUCTS
                  if op_has(op, Trait.epilogue_anchor)})
