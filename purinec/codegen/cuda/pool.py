"""CUDA pooling and local response normalisation.

Pooling views its arrays as (batch x channel) planes. The forward kernels give each
thread one output element: its window's taps (``dilation`` apart) inside the input
(padding never wins a max nor adds to a sum), read straight from the input. The
gradients give each thread one *input* element and gather from the windows with a tap
on it, so overlapping windows need no atomics, each gradient is written once, and the
windows' shares are added in the reference's order (by window, row-major). The max's
gradient recomputes each such window's first maximum and takes the window's gradient
only if that is this element: the reference's rule for ties.

Global average pooling is a sum over each plane (`purinec.codegen.cuda.reduce`). LRN
gives each thread one element; its gradient needs the scale of every channel in the
element's window, each recomputed (a window sum of its own) rather than kept, since
kernels never allocate.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from purinec.codegen.cpu_ops import affine, dtype_name
from purinec.codegen.cpu_pool import pool_divisor
from purinec.codegen.cuda.module import THREADS, CudaModule, blocks_for, literal, renders
from purinec.codegen.cuda.reduce import emit_sum_kernel
from purinec.codegen.cuda.shape import coordinates, grid_stride
from purinec.codegen.source import SourceBuilder
from purinec.ir.graph import Node
from purinec.ir.nnref import pad_edges, pool_output_size

# ---------------------------------------------------------------------------------------
# Pooling windows.


@dataclass(frozen=True)
class _Axis:
    """The windows along one axis (rows or columns) of a plane: window ``p`` has
    ``kernel`` taps from ``p * stride - pad`` on, ``dilation`` apart, over a span of
    ``extent``; the input has ``[0, size)``."""

    size: int
    kernel: int
    stride: int
    pad: int
    dilation: int
    windows: int

    @property
    def extent(self) -> int:
        return self.dilation * (self.kernel - 1) + 1

    def first(self, p: str) -> str:
        """The first tap of window ``p`` in the input."""
        start = affine(p, self.stride, -self.pad)
        if not self.pad:
            return start
        if self.dilation == 1:
            return f"max({start}, 0)"
        # the taps before the input, rounded up: max(-start, 0) / dilation
        skipped = f"max({affine('-' + p, self.stride, self.pad + self.dilation - 1)}, 0)"
        return f"{start} + {skipped} // {self.dilation} * {self.dilation}"

    def taps(self, first: str, end: str) -> str:
        """The arguments of ``range`` over the taps from ``first`` to ``end``."""
        return f"{first}, {end}" if self.dilation == 1 else f"{first}, {end}, {self.dilation}"

    def end(self, p: str) -> str:
        """The end of window ``p`` in the input: short of ``size`` but for the last
        windows, where padding or ceil mode let them hang out."""
        end = affine(p, self.stride, self.extent - self.pad)
        overhangs = (self.windows - 1) * self.stride - self.pad + self.extent > self.size
        return f"min({end}, {self.size})" if overhangs else end

    def holds(self, h: str, p: str) -> str | None:
        """The test that window ``p``, whose span holds ``h``, has a tap on it: none
        without dilation."""
        if self.dilation == 1:
            return None
        return f"({affine(h, 1, self.pad)} - {affine(p, self.stride, 0)}) % {self.dilation} == 0"

    def containing(self, h: str) -> tuple[str, str]:
        """The windows ``p`` whose span holds input index ``h`` (``p * stride - pad <=
        h < p * stride - pad + extent``): the bounds of a range. (Divisions of
        non-negative numbers only, whatever rounding a target gives the others.)"""
        reach = self.extent - self.pad  # h below this is in window 0
        if self.stride == 1:
            low = f"max({affine(h, 1, 1 - reach)}, 0)"
            high = affine(h, 1, self.pad + 1)
        else:
            low = f"0 if {h} < {reach} else ({affine(h, 1, -reach)}) // {self.stride} + 1"
            high = f"({affine(h, 1, self.pad)}) // {self.stride} + 1"
        if (self.size - 1 + self.pad) // self.stride + 1 > self.windows:
            high = f"min({high}, {self.windows})"
        return low, high


@dataclass(frozen=True)
class _Pool:
    planes: int
    rows: _Axis
    cols: _Axis

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return self.planes, self.rows.size, self.cols.size

    @property
    def output_shape(self) -> tuple[int, int, int]:
        return self.planes, self.rows.windows, self.cols.windows


def _pool(x_shape, attrs) -> _Pool:
    n, c, h, w = x_shape
    (kh, kw), (sh, sw), (dh, dw) = attrs["kernel"], attrs["stride"], attrs["dilation"]
    pt, pl, pb, pr = pad_edges(attrs["pad"])
    ceil = attrs["ceil_mode"]
    return _Pool(n * c, _Axis(h, kh, sh, pt, dh, pool_output_size(h, kh, sh, pt, pb, dh, ceil)),
                 _Axis(w, kw, sw, pl, dw, pool_output_size(w, kw, sw, pl, pr, dw, ceil)))


def _views(m: CudaModule, arrays: list[tuple[str, tuple]]) -> list[str]:
    """The view of each ``(array, shape)``: the array reshaped as ``shape``."""
    return [m.view(name, shape) for name, shape in arrays]


@contextmanager
def _per_element(m: CudaModule, body: SourceBuilder, shape: tuple[int, ...],
                 hints: tuple[str, ...]) -> Iterator[list[str]]:
    """A grid-stride loop over the elements of ``shape``, one per thread, binding
    their coordinates (named from ``hints``); the caller writes inside."""
    header, i = grid_stride(m, math.prod(shape))
    names = [m.fresh(hint) for hint in hints]
    with body.block(header):
        for name, text in zip(names, coordinates(i, shape)):
            body.line(f"{name} = {text}")
        yield names


def _window(m: CudaModule, body: SourceBuilder, g: _Pool, p: str, q: str
            ) -> tuple[str, str, str, str]:
    """Binds the rows ``h0:h1`` and columns ``w0:w1`` of window ``(p, q)`` in the
    input."""
    h0, h1, w0, w1 = (m.fresh(s) for s in ("h0", "h1", "w0", "w1"))
    body.line(f"{h0}, {h1} = {g.rows.first(p)}, {g.rows.end(p)}")
    body.line(f"{w0}, {w1} = {g.cols.first(q)}, {g.cols.end(q)}")
    return h0, h1, w0, w1


@contextmanager
def _windows_containing(m: CudaModule, body: SourceBuilder, g: _Pool, h: str, w: str
                        ) -> Iterator[tuple[str, str]]:
    """Loops over the windows ``(p, q)`` that have a tap on input element ``(h, w)``,
    in the reference's order (row-major); the caller writes inside."""
    p0, p1, q0, q1, p, q = (m.fresh(s) for s in ("p0", "p1", "q0", "q1", "p", "q"))
    for first, end, (low, high) in ((p0, p1, g.rows.containing(h)),
                                     (q0, q1, g.cols.containing(w))):
        body.line(f"{first} = {low}")
        body.line(f"{end} = {high}")
    tests = [t for t in (g.rows.holds(h, p), g.cols.holds(w, q)) if t]
    with body.block(f"for {p} in range({p0}, {p1}):"):
        with body.block(f"for {q} in range({q0}, {q1}):"):
            if not tests:
                yield p, q
                return
            with body.block(f"if {' and '.join(tests)}:"):
                yield p, q


def _window_max(m: CudaModule, body: SourceBuilder, g: _Pool, x: str, nc: str,
                window: tuple[str, str, str, str], where: bool = False) -> list[str]:
    """Binds the window's maximum and, if ``where``, the row and column of its first
    occurrence (row-major), as `purinec.ir.nnref.max_pool2d_grad` finds it; returns
    their names."""
    h0, h1, w0, w1 = window
    h, w = m.fresh("h"), m.fresh("w")
    names = [m.fresh("best")]
    first, each = [f"{x}[{nc}, {h0}, {w0}]"], [f"{x}[{nc}, {h}, {w}]"]
    if where:
        names += [m.fresh("at_h"), m.fresh("at_w")]
        first += [h0, w0]
        each += [h, w]
    body.line(f"{', '.join(names)} = {', '.join(first)}")
    with body.block(f"for {h} in range({g.rows.taps(h0, h1)}):"):
        with body.block(f"for {w} in range({g.cols.taps(w0, w1)}):"):
            with body.block(f"if {each[0]} > {names[0]}:"):
                body.line(f"{', '.join(names)} = {', '.join(each)}")
    return names


@renders("max_pool2d")
def render_max_pool2d(node: Node, m: CudaModule) -> None:
    g = _pool(node.inputs[0].type.shape, node.attrs)
    arrays = [m.inputs[0], m.outputs[0]]
    with m.kernel("windows") as (name, body):
        x, y = _views(m, [(arrays[0], g.input_shape), (arrays[1], g.output_shape)])
        with _per_element(m, body, g.output_shape, ("nc", "p", "q")) as (nc, p, q):
            (best,) = _window_max(m, body, g, x, nc, _window(m, body, g, p, q))
            body.line(f"{y}[{nc}, {p}, {q}] = {best}")
    m.launch(name, blocks_for(math.prod(g.output_shape)), THREADS)


@renders("max_pool2d_grad")
def render_max_pool2d_grad(node: Node, m: CudaModule) -> None:
    """Each input element adds up the gradients of the windows whose first maximum
    it is."""
    g = _pool(node.inputs[0].type.shape, node.attrs)
    x_name, gy_name, gx_name = m.inputs[0], m.inputs[2], m.outputs[0]
    with m.kernel("gather") as (name, body):
        x, gy, gx = _views(m, [(x_name, g.input_shape), (gy_name, g.output_shape),
                                     (gx_name, g.input_shape)])
        with _per_element(m, body, g.input_shape, ("nc", "h", "w")) as (nc, h, w):
            total = m.fresh("total")
            body.line(f"{total} = {literal(0, node.outputs[0].type.dtype)}")
            with _windows_containing(m, body, g, h, w) as (p, q):
                window = _window(m, body, g, p, q)
                _, at_h, at_w = _window_max(m, body, g, x, nc, window, where=True)
                with body.block(f"if {at_h} == {h} and {at_w} == {w}:"):
                    body.line(f"{total} += {gy}[{nc}, {p}, {q}]")
            body.line(f"{gx}[{nc}, {h}, {w}] = {total}")
    m.launch(name, blocks_for(math.prod(g.input_shape)), THREADS)


@renders("avg_pool2d")
def render_avg_pool2d(node: Node, m: CudaModule) -> None:
    """The sum over the window's taps inside the input, divided by the divisor of
    `purinec.ir.nnref.pool_divisors` (Caffe's pool size by default)."""
    g = _pool(node.inputs[0].type.shape, node.attrs)
    arrays = [m.inputs[0], m.outputs[0]]
    with m.kernel("windows") as (name, body):
        x, y = _views(m, [(arrays[0], g.input_shape), (arrays[1], g.output_shape)])
        with _per_element(m, body, g.output_shape, ("nc", "p", "q")) as (nc, p, q):
            h0, h1, w0, w1 = _window(m, body, g, p, q)
            total, h, w = m.fresh("total"), m.fresh("h"), m.fresh("w")
            body.line(f"{total} = {literal(0, node.outputs[0].type.dtype)}")
            with body.block(f"for {h} in range({g.rows.taps(h0, h1)}):"):
                with body.block(f"for {w} in range({g.cols.taps(w0, w1)}):"):
                    body.line(f"{total} += {x}[{nc}, {h}, {w}]")
            divisor = pool_divisor(m, node, node.inputs[0].type.shape, p, q)
            body.line(f"{y}[{nc}, {p}, {q}] = {total} / {dtype_name(node)}({divisor})")
    m.launch(name, blocks_for(math.prod(g.output_shape)), THREADS)


@renders("avg_pool2d_grad")
def render_avg_pool2d_grad(node: Node, m: CudaModule) -> None:
    """Each input element adds up ``gy / divisor`` of the windows that contain it."""
    g = _pool(node.attrs["input_shape"], node.attrs)
    arrays = [m.inputs[0], m.outputs[0]]
    with m.kernel("gather") as (name, body):
        gy, gx = _views(m, [(arrays[0], g.output_shape), (arrays[1], g.input_shape)])
        with _per_element(m, body, g.input_shape, ("nc", "h", "w")) as (nc, h, w):
            total = m.fresh("total")
            body.line(f"{total} = {literal(0, node.outputs[0].type.dtype)}")
            with _windows_containing(m, body, g, h, w) as (p, q):
                divisor = pool_divisor(m, node, node.attrs["input_shape"], p, q)
                share = f"{gy}[{nc}, {p}, {q}] / {dtype_name(node)}({divisor})"
                body.line(f"{total} += {share}")
            body.line(f"{gx}[{nc}, {h}, {w}] = {total}")
    m.launch(name, blocks_for(math.prod(g.input_shape)), THREADS)


@renders("global_avg_pool")
def render_global_avg_pool(node: Node, m: CudaModule) -> None:
    """The sum of each plane (in float64) over its size."""
    n, c, h, w = node.inputs[0].type.shape
    emit_sum_kernel(m, m.inputs[0], m.outputs[0], [(False, n * c), (True, h * w)],
                    node.inputs[0].type.dtype,
                    lambda total: f"{dtype_name(node)}({total} / {h * w})")


# ---------------------------------------------------------------------------------------
# Local response normalisation across channels (Caffe's).


@dataclass(frozen=True)
class _Lrn:
    images: int
    channels: int
    pixels: int
    half: int  # the window: channels c - half to c + half, clipped

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.images, self.channels, self.pixels

    def window(self, c: str) -> str:
        """The arguments of ``range`` over the channels of ``c``'s window."""
        return f"max({c} - {self.half}, 0), min({c} + {self.half + 1}, {self.channels})"


def _lrn(node: Node) -> _Lrn:
    n, c, h, w = node.inputs[0].type.shape
    return _Lrn(n, c, h * w, (node.attrs["size"] - 1) // 2)


def _scale(m: CudaModule, body: SourceBuilder, node: Node, g: _Lrn, x: str, n: str, c: str,
           s: str) -> str:
    """Binds ``k + alpha/size * sum of x^2`` over channel ``c``'s window at image ``n``,
    pixel ``s``, added in increasing channel order as the reference adds them."""
    dt = node.outputs[0].type.dtype
    squares, c2, scale = m.fresh("squares"), m.fresh("c2"), m.fresh("scale")
    body.line(f"{squares} = {literal(0, dt)}")
    with body.block(f"for {c2} in range({g.window(c)}):"):
        body.line(f"{squares} += {x}[{n}, {c2}, {s}] * {x}[{n}, {c2}, {s}]")
    alpha = literal(node.attrs["alpha"] / node.attrs["size"], dt)
    body.line(f"{scale} = {literal(node.attrs['k'], dt)} + {alpha} * {squares}")
    return scale


@renders("lrn")
def render_lrn(node: Node, m: CudaModule) -> None:
    """``y = x * scale ** -beta``, one element per thread."""
    g, dt = _lrn(node), node.outputs[0].type.dtype
    arrays = [m.inputs[0], m.outputs[0]]
    with m.kernel("channels") as (name, body):
        x, y = _views(m, [(a, g.shape) for a in arrays])
        with _per_element(m, body, g.shape, ("n", "c", "s")) as (n, c, s):
            scale = _scale(m, body, node, g, x, n, c, s)
            power = literal(-node.attrs["beta"], dt)
            body.line(f"{y}[{n}, {c}, {s}] = {x}[{n}, {c}, {s}] * {scale} ** {power}")
    m.launch(name, blocks_for(math.prod(g.shape)), THREADS)


@renders("lrn_grad")
def render_lrn_grad(node: Node, m: CudaModule) -> None:
    """``gx_j = gy_j * scale_j^-beta - 2*alpha*beta/size * x_j * sum over j's window
    of gy_c * x_c * scale_c^(-beta-1)``, as `purinec.ir.nnref.lrn_grad`, one element
    per thread."""
    g, dt = _lrn(node), node.outputs[0].type.dtype
    beta, alpha, size = node.attrs["beta"], node.attrs["alpha"], node.attrs["size"]
    arrays = m.inputs + m.outputs
    with m.kernel("channels") as (name, body):
        x, gy, gx = _views(m, [(a, g.shape) for a in arrays])
        with _per_element(m, body, g.shape, ("n", "j", "s")) as (n, j, s):
            c, own, inner = m.fresh("c"), m.fresh("own"), m.fresh("inner")
            body.line(f"{own} = {literal(node.attrs['k'], dt)}  # j's scale, set below: "
                      f"j is in its own window")
            body.line(f"{inner} = {literal(0, dt)}")
            with body.block(f"for {c} in range({g.window(j)}):"):
                scale = _scale(m, body, node, g, x, n, c, s)
                with body.block(f"if {c} == {j}:"):
                    body.line(f"{own} = {scale}")
                body.line(f"{inner} += {gy}[{n}, {c}, {s}] * {x}[{n}, {c}, {s}] * "
                          f"{scale} ** {literal(-beta - 1, dt)}")
            at = f"[{n}, {j}, {s}]"
            body.line(f"{gx}{at} = {gy}{at} * {own} ** {literal(-beta, dt)} - "
                      f"{literal(2 * alpha * beta / size, dt)} * {x}{at} * {inner}")
    m.launch(name, blocks_for(math.prod(g.shape)), THREADS)
