"""CPU renderers of matrix products and convolutions, through BLAS.

* ``matmul``: one GEMM on the operands as stored (transposes are BLAS flags), in
  blocks of rows (or columns) when big;
* ``conv2d``: per image, im2col into a scratch matrix (from a zero-bordered copy of the
  image when there is padding, so the copy loops have constant trip counts and no
  bounds tests) and one GEMM per group. 1x1 convolutions with stride 1 and no padding
  skip im2col: the image is the matrix;
* ``conv2d_grad_input``: col2im of ``w^T @ gy`` per image, or, for stride 1 "same"
  convolutions, a forward convolution of ``gy`` with flipped weights;
* ``conv2d_grad_weight``: a GEMM per image accumulating in place (BLAS ``beta = 1``);
  rows of the im2col matrix (columns of the gradient) are independent, so they are
  what blocks split.

Both anchors take an *epilogue* (`purinec.codegen.cpu_fused`): elementwise consumers
run on each image (or row) right after it is computed, while it is in cache.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from purinec.codegen.cpu_module import KernelModule, literal, renders
from purinec.codegen.cpu_ops import affine, dtype_name, row_slice, span_of, split_loop
from purinec.ir.graph import Node
from purinec.ir.types import DType


def _gemm(m: KernelModule, node: Node, a: str, b: str, c: str, rows, cols, inner,
          lda, ldb, ldc, beta: int = 0, trans_a=False, trans_b=False) -> None:
    """Row-major ``c[rows, cols] = op(a) @ op(b) + beta * c`` in one CBLAS call."""
    dtype = node.outputs[0].type.dtype
    fn = "sgemm" if dtype is DType.f32 else "dgemm"
    m.import_line(f"from purinec.codegen.cpu_runtime import {fn}")
    ta, tb = (112 if t else 111 for t in (trans_a, trans_b))  # CblasTrans, CblasNoTrans
    lda, ldb, ldc = (f"max(1, {ld})" if isinstance(ld, str) else max(1, ld)
                     for ld in (lda, ldb, ldc))
    one, scale = literal(1, dtype), literal(beta, dtype)
    m.body.line(f"{fn}(101, {ta}, {tb}, {rows}, {cols}, {inner}, {one}, {a}.ctypes, {lda}, "
                f"{b}.ctypes, {ldb}, {scale}, {c}.ctypes, {ldc})")


# ---------------------------------------------------------------------------------------
# Matrix products.


@renders("matmul")
def render_matmul(node: Node, m: KernelModule) -> None:
    emit_matmul(node, m, *m.inputs, m.outputs[0], by_rows=False)


def emit_matmul(node: Node, m: KernelModule, a: str, bm: str, out: str, by_rows: bool,
            out_rows_from: str = "0") -> tuple[str, str]:
    """One GEMM into ``out``; a big one in blocks of rows (or of columns, when there
    are more of them and ``by_rows`` is not asked). ``out`` holds the output's rows
    from ``out_rows_from`` on (a block's scratch), else all of them. Returns the bounds
    of the rows computed."""
    ta, tb = node.attrs["trans_a"], node.attrs["trans_b"]
    a_shape, b_shape = node.inputs[0].type.shape, node.inputs[1].type.shape
    rows, cols = node.outputs[0].type.shape
    inner = a_shape[0] if ta else a_shape[1]
    if rows == 0 or cols == 0:
        return "0", str(rows)
    lda, ldb, work = a_shape[1], b_shape[1], rows * cols * inner
    if by_rows or rows >= cols:  # blocks of rows of op(a) and of the output
        lo, hi = m.split(rows, work)
        a_block = a if lo == "0" else (f"{a}[:, {lo}:{hi}]" if ta else f"{a}[{lo}:{hi}]")
        out_block = out if lo == out_rows_from else f"{out}[{lo}:{hi}]"
        count = rows if lo == "0" else f"{hi} - {lo}"
        _gemm(m, node, a_block, bm, out_block, count, cols, inner, lda, ldb, cols, 0, ta, tb)
        return lo, hi
    lo, hi = m.split(cols, work)  # blocks of columns of op(b) and of the output
    b_block = bm if lo == "0" else (f"{bm}[{lo}:{hi}]" if tb else f"{bm}[:, {lo}:{hi}]")
    out_block = out if lo == "0" else f"{out}[:, {lo}:{hi}]"
    count = cols if lo == "0" else f"{hi} - {lo}"
    _gemm(m, node, a, b_block, out_block, rows, count, inner, lda, ldb, cols, 0, ta, tb)
    return "0", str(rows)


# ---------------------------------------------------------------------------------------
# Convolutions: im2col + GEMM per image.


@dataclass(frozen=True)
class _Conv:
    """A convolution's sizes. ``K``: rows of the im2col matrix (one per weight of an
    output channel), ``P``: its columns (output pixels)."""

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
    ph: int
    pw: int
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
    def pointwise(self) -> bool:
        """A 1x1 kernel, stride 1, no padding: the image itself is the im2col matrix."""
        return (self.kh, self.kw, self.sh, self.sw, self.ph, self.pw) == (1, 1, 1, 1, 0, 0)

    @property
    def macs(self) -> int:
        return self.n * self.cout * self.P * self.K


def _conv(x_shape, w_shape, y_shape, attrs) -> _Conv:
    n, c, h, w = x_shape
    cout, _, kh, kw = w_shape
    return _Conv(n, c, h, w, cout, attrs["groups"], kh, kw, *attrs["stride"],
                 *attrs["pad"], y_shape[2], y_shape[3])


def _padded_scratch(m: KernelModule, node: Node, g: _Conv) -> None:
    """``xpad``: one group of one image with its zero border, for convolutions with
    padding. The border is zeroed once here and never written again."""
    if g.ph or g.pw:
        m.body.line(f"xpad = np.zeros(({g.cg}, {g.h + 2 * g.ph}, {g.w + 2 * g.pw}), "
                    f"{dtype_name(node)})")


def _pad_image(m: KernelModule, g: _Conv, x: str, n: str, c0: str) -> str:
    """Copy group ``c0`` of image ``n`` into the inside of ``xpad``; returns how to
    index the (padded) image: a prefix taking ``[c, row, column]``."""
    if not (g.ph or g.pw):
        return f"{x}[{n}, {c0} + " if c0 != "0" else f"{x}[{n}, "
    b, c, h, w = m.body, m.fresh("c"), m.fresh("h"), m.fresh("w")
    channel = c if c0 == "0" else f"{c0} + {c}"
    with b.block(f"for {c} in range({g.cg}):"), b.block(f"for {h} in range({g.h}):"), \
            b.block(f"for {w} in range({g.w}):"):
        b.line(f"xpad[{c}, {affine(h, 1, g.ph)}, {affine(w, 1, g.pw)}] = "
               f"{x}[{n}, {channel}, {h}, {w}]")
    return "xpad["


def _im2col(m: KernelModule, g: _Conv, image: str, col: str, rows: tuple[str, str],
            back: bool) -> None:
    """For the im2col rows ``r`` in ``rows`` (``r = (c*kh + i)*kw + j``), stored at row
    ``r - rows[0]`` of ``col``: ``col[r, p*ow + q] = image[c, p*sh + i, q*sw + j]``, the
    image padded (`_pad_image`), so no bounds are tested and the trip counts are
    constants. With ``back``, the adjoint (col2im): ``image[...] += col[...]``."""
    b = m.body
    r, c, i, j, row, p, q = (m.fresh(s) for s in ("r", "c", "i", "j", "row", "p", "q"))
    with b.block(f"for {r} in range({span_of(*rows)}):"):
        b.line(f"{c} = {r} // {g.kh * g.kw}")
        b.line(f"{i} = {r} // {g.kw} % {g.kh}")
        b.line(f"{j} = {r} % {g.kw}")
        b.line(f"{row} = {r}" if rows[0] == "0" else f"{row} = {r} - {rows[0]}")
        with b.block(f"for {p} in range({g.oh}):"), b.block(f"for {q} in range({g.ow}):"):
            pixel = f"{image}{c}, {affine(p, g.sh, i)}, {affine(q, g.sw, j)}]"
            entry = f"{col}[{row}, {affine(p, g.ow, q)}]"
            b.line(f"{pixel} += {entry}" if back else f"{entry} = {pixel}")


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


@renders("conv2d")
def render_conv2d(node: Node, m: KernelModule) -> None:
    emit_conv2d(node, m, *m.inputs, m.outputs[0])


def emit_conv2d(node: Node, m: KernelModule, x: str, w: str, y: str | None,
            epilogue: Callable[[str, str | None], None] | None = None) -> None:
    g = _conv(node.inputs[0].type.shape, node.inputs[1].type.shape,
              node.outputs[0].type.shape, node.attrs)
    m.body.line(f"w_mat = {w}.reshape(({g.cout}, {g.K}))")
    _conv_forward(node, m, g, x, "w_mat", y, epilogue)


def _conv_forward(node: Node, m: KernelModule, g: _Conv, x: str, w_mat: str, y: str | None,
                  epilogue: Callable[[str, str | None], None] | None = None) -> None:
    """Per image and group: ``y[n, group] = w_mat[group] @ im2col(x[n, group])``. Then
    ``epilogue(n, scratch)``, if given, while image ``n`` is still in cache; with
    ``y`` None the output lives only in the per-image ``scratch`` it is given."""
    b = m.body
    if y is None:
        b.line(f"y_img = np.empty(({g.cout}, {g.P}), {dtype_name(node)})")
    else:
        b.line(f"y_mat = {y}.reshape(({g.n}, {g.cout}, {g.P}))")
    if g.pointwise:
        b.line(f"x_mat = {x}.reshape(({g.n}, {g.c}, {g.P}))")
    else:
        b.line(f"col = np.empty(({g.K}, {g.P}), {dtype_name(node)})")
        _padded_scratch(m, node, g)
    with split_loop(m, "n", g.n, g.macs) as n:
        image = "y_img" if y is None else f"y_mat[{n}]"
        with _groups(m, g) as (c0, o0):
            if g.pointwise:
                col = row_slice(f"x_mat[{n}]", c0, g.cg, g.c)
            else:
                col = "col"
                _im2col(m, g, _pad_image(m, g, x, n, c0), col, ("0", str(g.K)), back=False)
            _gemm(m, node, row_slice(w_mat, o0, g.og, g.cout), col,
                  row_slice(image, o0, g.og, g.cout), g.og, g.P, g.K, g.K, g.P, g.P)
        if epilogue is not None:
            epilogue(n, "y_img" if y is None else None)


@renders("conv2d_grad_input")
def render_conv2d_grad_input(node: Node, m: KernelModule) -> None:
    """Per image and group: ``gx[n, group] = col2im(w[group]^T @ gy[n, group])``. Or,
    with stride 1, as a convolution: of ``gy``, padded by ``kernel - 1 - pad``, with
    the weights flipped in space and transposed in channels; its im2col copies are
    cheaper than col2im's scattered sums, but it multiplies ``H*W*Cout`` instead of
    ``OH*OW*C``, so it is used only where that is no bigger ("same" convolutions with
    as many channels out as in)."""
    g = _conv(node.attrs["input_shape"], node.inputs[1].type.shape,
              node.inputs[0].type.shape, node.attrs)
    if (g.sh, g.sw) == (1, 1) and g.ph < g.kh and g.pw < g.kw and \
            g.h * g.w * g.cout <= g.P * g.c:
        _conv2d_grad_input_as_conv(node, m, g)
    else:
        _conv2d_grad_input_col2im(node, m, g)


def _conv2d_grad_input_as_conv(node: Node, m: KernelModule, g: _Conv) -> None:
    (gy, w), (gx,), b = m.inputs, m.outputs, m.body
    flipped = _Conv(g.n, g.cout, g.oh, g.ow, g.c, g.groups, g.kh, g.kw, 1, 1,
                    g.kh - 1 - g.ph, g.kw - 1 - g.pw, g.h, g.w)
    o, c, i, j = (m.fresh(s) for s in ("o", "c", "i", "j"))
    b.line(f"w_flip = np.empty(({g.c}, {flipped.K}), {dtype_name(node)})")
    with b.block(f"for {o} in range({g.cout}):"), b.block(f"for {c} in range({g.cg}):"), \
            b.block(f"for {i} in range({g.kh}):"), b.block(f"for {j} in range({g.kw}):"):
        row = c if g.groups == 1 else f"{o} // {g.og} * {g.cg} + {c}"
        column = o if g.groups == 1 else f"{o} % {g.og}"
        b.line(f"w_flip[{row}, (({column}) * {g.kh} + {g.kh - 1} - {i}) * {g.kw} + "
               f"{g.kw - 1} - {j}] = {w}[{o}, {c}, {i}, {j}]")
    _conv_forward(node, m, flipped, gy, "w_flip", gx)


def _conv2d_grad_input_col2im(node: Node, m: KernelModule, g: _Conv) -> None:
    """col2im adds into a zeroed padded scratch whose inside is then copied out."""
    (gy, w), (gx,), b = m.inputs, m.outputs, m.body
    padded = bool(g.ph or g.pw)
    b.line(f"w_mat = {w}.reshape(({g.cout}, {g.K}))")
    b.line(f"gy_mat = {gy}.reshape(({g.n}, {g.cout}, {g.P}))")
    b.line(f"gx_mat = {gx}.reshape(({g.n}, {g.c}, {g.h * g.w}))")
    b.line(f"col = np.empty(({g.K}, {g.P}), {dtype_name(node)})")
    _padded_scratch(m, node, g)
    with split_loop(m, "n", g.n, g.macs) as n:
        if not padded:  # col2im adds into gx: start from zero
            b.line(f"gx_mat[{n}] = 0")
        with _groups(m, g) as (c0, o0):
            _gemm(m, node, row_slice("w_mat", o0, g.og, g.cout),
                  row_slice(f"gy_mat[{n}]", o0, g.og, g.cout), "col", g.K, g.P, g.og, g.K,
                  g.P, g.P, trans_a=True)
            if padded:
                b.line("xpad[:] = 0")
                _im2col(m, g, "xpad[", "col", ("0", str(g.K)), back=True)
                c, h, wi = m.fresh("c"), m.fresh("h"), m.fresh("w")
                channel = c if c0 == "0" else f"{c0} + {c}"
                with b.block(f"for {c} in range({g.cg}):"), \
                        b.block(f"for {h} in range({g.h}):"), b.block(f"for {wi} in range({g.w}):"):
                    b.line(f"{gx}[{n}, {channel}, {h}, {wi}] = "
                           f"xpad[{c}, {affine(h, 1, g.ph)}, {affine(wi, 1, g.pw)}]")
            else:
                prefix = f"{gx}[{n}, {c0} + " if c0 != "0" else f"{gx}[{n}, "
                _im2col(m, g, prefix, "col", ("0", str(g.K)), back=True)


@renders("conv2d_grad_weight")
def render_conv2d_grad_weight(node: Node, m: KernelModule) -> None:
    """``gw[group] = sum over images of gy[n, group] @ im2col(x[n, group])^T``, one GEMM
    per image adding into gw (BLAS beta = 1). Columns of gw, i.e. rows of the im2col
    matrix, are independent: a block computes columns ``lo:hi`` of every group."""
    (x, gy), (gw,), b = m.inputs, m.outputs, m.body
    g = _conv(node.inputs[0].type.shape, node.outputs[0].type.shape,
              node.inputs[1].type.shape, node.attrs)
    b.line(f"gy_mat = {gy}.reshape(({g.n}, {g.cout}, {g.P}))")
    b.line(f"gw_mat = {gw}.reshape(({g.cout}, {g.K}))")
    if g.pointwise:
        b.line(f"x_mat = {x}.reshape(({g.n}, {g.c}, {g.P}))")
    lo, hi = m.split(g.K, g.macs)
    width = g.K if lo == "0" else f"{hi} - {lo}"
    b.line(f"gw_mat[:{'' if lo == '0' else f', {lo}:{hi}'}] = 0")
    if not g.pointwise:
        b.line(f"col = np.empty(({width}, {g.P}), {dtype_name(node)})")
        _padded_scratch(m, node, g)
    n = m.fresh("n")
    with b.block(f"for {n} in range({g.n}):"), _groups(m, g) as (c0, o0):
        if g.pointwise:
            col = f"x_mat[{n}, {c0} + {lo}:{c0} + {hi}]" if lo != "0" else \
                row_slice(f"x_mat[{n}]", c0, g.cg, g.c)
        else:
            col = "col"
            _im2col(m, g, _pad_image(m, g, x, n, c0), col, (lo, hi), back=False)
        target = row_slice("gw_mat", o0, g.og, g.cout)
        if lo != "0":
            target = f"{target}[:, {lo}:{hi}]"
        _gemm(m, node, row_slice(f"gy_mat[{n}]", o0, g.og, g.cout), col, target, g.og, width,
              g.P, g.P, g.P, g.K, beta=1, trans_b=True)
