"""CPU renderers of pooling and local response normalisation.

Pooling runs over (batch x channel) planes, as many as its arrays hold (`_planes`), so
a layer's code serves every batch size. A plane's sizes are constants: read from the
arrays, they cost lenet's small planes 40-50 ns each (loops LLVM no longer unrolls),
0.4 ms of a 9 ms training step. Where windows reach outside the input
(padding, or ceil mode letting the last window hang out) the plane is first copied
into a scratch with a border that never wins a max (-inf) or adds nothing to a sum
(0), so every window has the same constant taps (``dilation`` apart) and needs no
clipping; an average's divisors come from a table per axis. f32 max pooling, where
kernels use purinec's own vector code, is vector code (`purinec.codegen.cpu_window`,
which masks the taps outside the image instead); other max pooling copies, into one
scratch per column phase (column modulo the stride), so
that neighbouring windows read neighbouring entries and a row of windows vectorises;
where rows of windows are too short for that (7 or 14 windows), rows are split by
phase too and every window of a plane is one loop over the phases laid flat
(`_max_over_flat_planes`). The gradient of max pooling recomputes each window's first
maximum with selects, not branches, keeping where that element lies as an offset in
the plane. LRN works one
image at a time with its window sums in channel order, as the reference adds them, and
its quarter powers (beta 0.75) from square roots (`_power`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator

import numpy as np

from purinec.codegen.cpu_conv import (VECTOR, copy_into_phases, tap_in_phases, vector_windows,
                                      window_copies, window_plane, window_tables)
from purinec.codegen.cpu_module import KernelModule, literal, numpy_name, renders
from purinec.codegen.cpu_ops import affine, dtype_name, span_of, split_loop
from purinec.ir.graph import Node
from purinec.ir.nnref import pad_edges, pool_divisors, pool_output_size

# ---------------------------------------------------------------------------------------
# Pooling: direct loops over (batch x channel) planes.


@dataclass(frozen=True)
class _Pool:
    """Pooling's sizes. Padding ``pt``, ``pl``: top and left (what lies past the input
    at the bottom and right is `span`'s); ``dh``, ``dw``: the dilation."""

    planes: int
    h: int
    w: int
    kh: int
    kw: int
    sh: int
    sw: int
    pt: int
    pl: int
    dh: int
    dw: int
    oh: int
    ow: int
    counted: str = ""  # the kernel's local holding ``planes`` (`_plane_views`)

    @property
    def span(self) -> tuple[int, int]:
        """Rows and columns the windows cover, from the padded top left corner: more
        than the padded input where ceil mode lets the last window hang out."""
        return ((max((self.oh - 1) * self.sh + self.dh * (self.kh - 1) + 1, self.h + self.pt)),
                (max((self.ow - 1) * self.sw + self.dw * (self.kw - 1) + 1, self.w + self.pl)))

    @property
    def needs_scratch(self) -> bool:
        """Whether windows reach outside the input (padding or an overhanging window)."""
        return self.span != (self.h, self.w) or bool(self.pt or self.pl)

    def row(self, p: str, i: int | str) -> str:
        """The row of tap ``i`` of window row ``p``, from the padded top."""
        return affine(p, self.sh, i * self.dh if isinstance(i, int) else _times(i, self.dh))

    def col(self, q: str, j: int | str) -> str:
        return affine(q, self.sw, j * self.dw if isinstance(j, int) else _times(j, self.dw))


def _times(var: str, factor: int) -> str:
    return var if factor == 1 else f"{var} * {factor}"


def _pool(x_shape, attrs) -> _Pool:
    n, c, h, w = x_shape
    (kh, kw), (sh, sw), (dh, dw) = attrs["kernel"], attrs["stride"], attrs["dilation"]
    pt, pl, pb, pr = pad_edges(attrs["pad"])
    ceil = attrs["ceil_mode"]
    return _Pool(n * c, h, w, kh, kw, sh, sw, pt, pl, dh, dw,
                 pool_output_size(h, kh, sh, pt, pb, dh, ceil),
                 pool_output_size(w, kw, sw, pl, pr, dw, ceil))


def _plane_views(m: KernelModule, g: _Pool, inputs: list[tuple[str, bool]]
                 ) -> tuple[_Pool, list[str]]:
    """Each array viewed as (planes, rows, cols): input-sized or, when the flag is set,
    output-sized; and ``g`` with the local its planes are counted in (``counted``,
    read from the first array)."""
    counted = m.fresh("planes")
    first = inputs[0][0]
    m.body.line(f"{counted} = {first}.shape[0] * {first}.shape[1]")
    views = []
    for name, pooled in inputs:
        view = m.fresh(name + "_p")
        rows, cols = (g.oh, g.ow) if pooled else (g.h, g.w)
        m.body.line(f"{view} = {m.view(name, (counted, rows, cols))}")
        views.append(view)
    return replace(g, counted=counted), views


def _planes(m: KernelModule, g: _Pool, copied: int = 0) -> str:
    """The loop over planes, split into blocks (the work: every window's taps, and
    ``copied`` elements); returns its variable."""
    lo, hi = m.split(g.planes, g.planes * g.oh * g.ow * g.kh * g.kw + copied,
                     extent=g.counted)
    nc = m.fresh("nc")
    m.body.line(f"for {nc} in range({span_of(lo, hi)}):")
    return nc


def _padded_plane(m: KernelModule, g: _Pool, x: str, nc: str) -> str:
    """Plane ``nc`` of ``x`` where every window fits: ``x`` itself, or a copy inside
    the border of ``plane`` (see `_plane_scratch`). Window
    ``(p, q)`` then starts at row ``p*sh`` and column ``q*sw`` of what this returns
    (a prefix taking ``row, column]``), and never needs clipping."""
    if not g.needs_scratch:
        return f"{x}[{nc}, "
    b, h, w = m.body, m.fresh("h"), m.fresh("w")
    with b.block(f"for {h} in range({g.h}):"), b.block(f"for {w} in range({g.w}):"):
        b.line(f"plane[{affine(h, 1, g.pt)}, {affine(w, 1, g.pl)}] = {x}[{nc}, {h}, {w}]")
    return "plane["


def _plane_scratch(m: KernelModule, node: Node, g: _Pool, name: str, fill) -> None:
    """A plane the windows fit in, its border set to ``fill``: a value that never wins
    a max, or adds nothing to a sum."""
    if g.needs_scratch:
        fill = literal(fill, node.outputs[0].type.dtype)
        m.body.lines(m.filled(name, g.span, dtype_name(node), fill))


def pool_divisor(m, node: Node, shape, p: str, q: str) -> str:
    """The average's divisor of window ``(p, q)`` over input ``shape``: a product of a
    factor per axis (`purinec.ir.nnref.pool_divisors`), each a constant or, where the
    windows' differ, looked up in a table."""
    attrs = node.attrs
    edges = pad_edges(attrs["pad"])
    factors = []
    for axis, var in ((0, p), (1, q)):
        counts = pool_divisors(shape[2 + axis], attrs["kernel"][axis], attrs["stride"][axis],
                               edges[axis], edges[2 + axis], attrs["dilation"][axis],
                               attrs["ceil_mode"], attrs["count_include_pad"])
        factors.append(str(counts[0]) if len(set(counts)) == 1 else
                       f"{m.constant('DIVISOR', counts)}[{var}]")
    return " * ".join(factors)


def _phase_scratch(m: KernelModule, node: Node, g: _Pool, flat: bool = False) -> None:
    """``plane[phase, row, column]``: the padded plane (`_Pool.span`, border -inf)
    split by column modulo the column stride (``column = phase + sw * c``), so that
    neighbouring windows read neighbouring entries and the loop over them
    vectorises. For `_max_over_flat_planes` the rows are split likewise (phase
    ``row % sh * sw + column % sw``; `_phase_rows` rows each), with a spare row of -inf under
    each phase: it reads past the last row. The border is filled once here and never
    written again."""
    phases, rows = (g.sh * g.sw, _phase_rows(g) + 1) if flat else (g.sw, g.span[0])
    border = literal(-np.inf, node.outputs[0].type.dtype)
    m.body.lines(m.filled("plane", (phases, rows, _phase_width(g)), dtype_name(node),
                          border))
    if flat:  # each phase laid flat (`_flat_tap`)
        m.body.line(f"phases = {m.view('plane', (phases, rows * _phase_width(g)))}")


def _phase_width(g: _Pool) -> int:
    return -(-g.span[1] // g.sw)


def _phase_rows(g: _Pool) -> int:
    return -(-g.span[0] // g.sh)


def _fill_phases(m: KernelModule, g: _Pool, x: str, nc: str, flat: bool = False) -> None:
    """Copy plane ``nc`` of ``x`` inside the border of the phase planes (`_phase_scratch`,
    ``flat`` as there), row by row (`purinec.codegen.cpu_conv.copy_into_phases`)."""
    b, h = m.body, m.fresh("h")
    row, row_phase = affine(h, 1, g.pt), None
    with b.block(f"for {h} in range({g.h}):"):
        if flat and g.sh > 1:
            padded = h if not g.pt else f"({affine(h, 1, g.pt)})"
            row_phase, row = m.fresh("row_phase"), m.fresh("row")
            b.line(f"{row_phase} = {padded} % {g.sh} * {g.sw}")
            b.line(f"{row} = {padded} // {g.sh}")

        def dst(phase: int, column: str) -> str:
            at = phase if row_phase is None else affine(row_phase, 1, phase)
            return f"plane[{at}, {row}, {column}]"

        copy_into_phases(m, dst, lambda at: f"{x}[{nc}, {h}, {at}]", g.w, g.sw, g.pl)


def _window(g: _Pool, p: str, q: str, i: int | str, j: int | str) -> str:
    """Tap ``(i, j)`` of window ``(p, q)`` in the phase planes: column ``j*dw`` of the
    window is phase ``j*dw % sw``, ``j*dw // sw`` further along."""
    if isinstance(j, str):
        shift = _times(j, g.dw)
        return f"plane[{shift} % {g.sw}, {g.row(p, i)}, {q} + {shift} // {g.sw}]"
    shift = j * g.dw
    return f"plane[{shift % g.sw}, {g.row(p, i)}, {affine(q, 1, shift // g.sw)}]"


UNROLL_MAX = 25  # windows up to this size are unrolled (constant phases and offsets)
# Rows of windows this long loop a trip count LLVM cannot see (from half a vector of
# f32 up to one).
SHORT_ROWS = (VECTOR // 2, VECTOR)


def _window_elements(m: KernelModule, g: _Pool) -> Iterator[tuple[int | str, int | str]]:
    """For each element of a window in row-major order, ``(i, j)``: constants for
    small windows (the caller writes its body once per element), loop variables for
    big ones (the body is written once, inside the two loops opened here)."""
    if g.kh * g.kw <= UNROLL_MAX:
        yield from ((i, j) for i in range(g.kh) for j in range(g.kw))
        return
    i, j = m.fresh("i"), m.fresh("j")
    with m.body.block(f"for {i} in range({g.kh}):"), m.body.block(f"for {j} in range({g.kw}):"):
        yield i, j


@renders("max_pool2d")
def render_max_pool2d(node: Node, m: KernelModule) -> None:
    g = _pool(node.inputs[0].type.shape, node.attrs)
    g, (x, y) = _plane_views(m, g, [(m.inputs[0], False), (m.outputs[0], True)])
    if vector_windows(m, node):
        tables = window_tables(m, node, g)
        nc = _planes(m, g, window_copies(g, g.planes))
        with m.body.indent():
            window_plane(m, g, f"{x}[{nc}]", f"{m.view(y, (g.counted, g.oh * g.ow))}[{nc}]",
                         tables)
        return
    b, flat = m.body, _flat_windows(g)
    p, q = m.fresh("p"), m.fresh("q")
    _phase_scratch(m, node, g, flat)
    if flat:
        b.line(f"maxima = {m.empty([g.oh * _phase_width(g)], dtype_name(node))}")
    nc = _planes(m, g)
    with b.indent():
        _fill_phases(m, g, x, nc, flat)
        if flat:
            _max_over_flat_planes(m, g, y, nc)
            return
        with b.block(f"for {p} in range({g.oh}):"), b.block(f"for {q} in range({g.ow}):"):
            _window_max(m, _window(g, p, q, 0, 0),
                        (_window(g, p, q, i, j) for i, j in _window_elements(m, g)),
                        f"{y}[{nc}, {p}, {q}]")


def _window_max(m: KernelModule, first: str, taps: Iterator[str], into: str) -> None:
    """``into`` = the first maximum of ``taps``, from ``first``, in their order (a NaN
    wins only first). ``taps`` is taken lazily: a big window's loops
    (`_window_elements`) open around the lines for its taps."""
    b, best, v = m.body, m.fresh("best"), m.fresh("v")
    b.line(f"{best} = {first}")
    for tap in taps:
        b.line(f"{v} = {tap}")
        with b.block(f"if {v} > {best}:"):
            b.line(f"{best} = {v}")
    b.line(f"{into} = {best}")


# Max pooling with rows of windows narrower than this, and not a whole number of
# vectors long, runs over flat phase planes (`_max_over_flat_planes`); with a row
# stride, only rows of half a vector or more (the planes' fill then splits rows by
# phase too, which costs tiny planes more than it saves). 3x3 windows unless said, on
# the 2-core Zen 4, kernel alone, same process, alternating, us, forward and gradient,
# rows of windows against flat planes: stride 1, 512 planes of 14x14 77 against 24
# (forward), 64 of 8x8 97/158 against 48/107, 256 of 28x28 55/164 against 50/121;
# stride 2, 480 planes of 28x28 93/122 against 48/92, 1280 of 24x24 (2x2 windows)
# 109/200 against 79/149, 192 of 56x56 60/157 against 58/132; but 64 of 112x112 (rows
# of 56 windows) 74/172 against 85/177, and 3200 of 8x8 (2x2, rows of 4) 104 against
# 120 (forward).
FLAT_WINDOWS_MAX_WIDTH = 32


def _flat_windows(g: _Pool) -> bool:
    return (g.ow < FLAT_WINDOWS_MAX_WIDTH and g.ow % VECTOR != 0
            and (g.sh == 1 or g.ow >= VECTOR // 2) and g.kh * g.kw <= UNROLL_MAX)


def _max_over_flat_planes(m: KernelModule, g: _Pool, y: str, nc: str) -> None:
    """The windows' maxima as one loop over the rows of windows laid out as wide as a
    phase plane: ``maxima[k]`` for ``k = p*width + q`` takes tap ``(i, j)`` of window
    ``(p, q)``, row ``p*sh + i*dh`` and column ``q*sw + j*dw`` of the padded plane,
    from ``k + (i*dh // sh)*width + j*dw // sw`` of its phase: a contiguous run LLVM
    vectorizes (a loop along one row of 7 or 14 windows does not), computing
    ``width - ow`` windows of nothing per row (reading into the next row and, for the
    last, the spare row); then each row's ``ow`` maxima into ``y``."""
    b, width, k, p = m.body, _phase_width(g), m.fresh("k"), m.fresh("p")
    with b.block(f"for {k} in range({g.oh * width}):"):
        _window_max(m, _flat_tap(g, k, 0, 0),
                    (_flat_tap(g, k, i, j) for i, j in _window_elements(m, g)),
                    f"maxima[{k}]")
    with b.block(f"for {p} in range({g.oh}):"):
        m.copy_run(y, f"{nc}, {p}, 0", "maxima", f"{affine(p, width, 0)},", g.ow)


def _flat_tap(g: _Pool, k: str, i: int, j: int) -> str:
    """Tap ``(i, j)`` of window ``k`` of the flat phase planes (`_max_over_flat_planes`)."""
    row_phase, column_phase, offset = tap_in_phases(i, j, (g.sh, g.sw), (g.dh, g.dw),
                                                    _phase_width(g))
    return f"phases[{row_phase * g.sw + column_phase}, {affine(k, 1, offset)}]"


@renders("max_pool2d_grad")
def render_max_pool2d_grad(node: Node, m: KernelModule) -> None:
    """Each gradient goes to the first maximum (row-major) of its window, recomputed
    from x; overlapping windows add up. Per row of windows, first where each maximum
    is (a loop that vectorises: windows are independent), then the sums (which are
    not: overlapping windows add to the same entries)."""
    g = _pool(node.inputs[0].type.shape, node.attrs)
    g, (x, gy, gx) = _plane_views(m, g, [(m.inputs[0], False), (m.inputs[2], True),
                                    (m.outputs[0], False)])
    b, flat = m.body, _flat_windows(g)
    p, q, gx_flat = m.fresh("p"), m.fresh("q"), m.fresh("gx_flat")
    b.line(f"{gx_flat} = {m.view(gx, (g.counted, g.h * g.w))}")
    _phase_scratch(m, node, g, flat)
    width = _phase_width(g) if flat else g.ow  # of a row of `where`
    b.line(f"where = {m.empty([g.oh * width if flat else g.ow], 'np.int32')}")
    nc = _planes(m, g)
    with b.indent():
        b.line(f"{gx}[{nc}] = 0")
        _fill_phases(m, g, x, nc, flat)
        if flat:  # every window's maximum at once (`_max_over_flat_planes`), then the sums
            k = m.fresh("k")
            with b.block(f"for {k} in range({g.oh * width}):"):
                _first_maximum(m, g, lambda i, j: _flat_tap(g, k, i, j), f"where[{k}]")
        with b.block(f"for {p} in range({g.oh}):"):
            if not flat:  # row by row of windows
                # (LLVM unrolls a constant-trip loop of under a vector whole and
                # vectorizes the unrolled code with gathers: 4x slower on 8x8 planes,
                # stride 1; rows of under half a vector are better unrolled)
                windows = m.opaque(g.ow) if SHORT_ROWS[0] <= g.ow < SHORT_ROWS[1] else g.ow
                with b.block(f"for {q} in range({windows}):"):
                    _first_maximum(m, g, lambda i, j: _window(g, p, q, i, j), f"where[{q}]")
            with b.block(f"for {q} in range({g.ow}):"):
                at = affine(p, width, q) if flat else q
                corner = affine(p, g.sh * g.w, affine(q, g.sw, f"where[{at}]"))
                b.line(f"{gx_flat}[{nc}, {corner}] += {gy}[{nc}, {p}, {q}]")


def _first_maximum(m: KernelModule, g: _Pool, tap: Callable[[int | str, int | str], str],
                   into: str) -> None:
    """``into`` = where the first maximum of a window lies (`_offset`), by selects, not
    branches: which element wins is data, and unpredictable. ``tap(i, j)``: the
    window's element ``(i, j)``."""
    b, v, best, at, better = m.body, *(m.fresh(s) for s in ("v", "best", "at", "better"))
    b.line(f"{best} = {tap(0, 0)}")
    b.line(f"{at} = np.int32({-g.pt * g.w - g.pl})")
    for i, j in _window_elements(m, g):
        b.line(f"{v} = {tap(i, j)}")
        b.line(f"{better} = {v} > {best}")
        b.line(f"{best} = {v} if {better} else {best}")
        b.line(f"{at} = np.int32({_offset(g, i, j)}) if {better} else {at}")
    b.line(f"{into} = {at}")


def _offset(g: _Pool, i: int | str, j: int | str) -> int | str:
    """Where tap ``(i, j)`` of a window lies in the input plane, counted in elements
    from the window's corner (padding taken off): the maximum's place is kept as this
    offset, so the gradient's sum needs no lookups (tables of rows and columns made
    the kernel 15% slower on cifar_quick's pool1)."""
    if isinstance(i, int):
        return (i * g.dh - g.pt) * g.w + j * g.dw - g.pl
    return f"({_times(i, g.dh)} - {g.pt}) * {g.w} + {_times(j, g.dw)} - {g.pl}"


@renders("avg_pool2d")
def render_avg_pool2d(node: Node, m: KernelModule) -> None:
    g = _pool(node.inputs[0].type.shape, node.attrs)
    g, (x, y) = _plane_views(m, g, [(m.inputs[0], False), (m.outputs[0], True)])
    b, dtype = m.body, node.outputs[0].type.dtype
    p, q, i, j, acc = (m.fresh(s) for s in ("p", "q", "i", "j", "acc"))
    _plane_scratch(m, node, g, "plane", 0)
    nc = _planes(m, g)
    with b.indent():
        src = _padded_plane(m, g, x, nc)
        with b.block(f"for {p} in range({g.oh}):"), b.block(f"for {q} in range({g.ow}):"):
            b.line(f"{acc} = {literal(0, dtype)}")
            with b.block(f"for {i} in range({g.kh}):"), b.block(f"for {j} in range({g.kw}):"):
                b.line(f"{acc} += {src}{g.row(p, i)}, {g.col(q, j)}]")
            divisor = pool_divisor(m, node, node.inputs[0].type.shape, p, q)
            b.line(f"{y}[{nc}, {p}, {q}] = {acc} / {numpy_name(dtype)}({divisor})")


@renders("avg_pool2d_grad")
def render_avg_pool2d_grad(node: Node, m: KernelModule) -> None:
    """Each ``gy / divisor`` added over its window, in two passes, since a window is a
    row of taps times a column of them: first along the rows, each share into the
    ``kw`` columns of its window in ``wide[p]`` (a row per row of windows, as wide as
    the padded input); then each row of the input is the sum of the rows of ``wide``
    whose windows cover it: loops along whole rows (of flat views: through 2-D ones
    LLVM kept them scalar) that vectorise, and no padded scratch to copy out. Adding
    every share into its ``kh * kw`` taps, element by element, took 40% longer
    (cifar_quick's 3x3 stride-2 pool2, 3200 planes of 16x16: 388 against 273 us on
    two threads; its pool3, 8x8 planes, 200 against 136 on one)."""
    g = _pool(node.attrs["input_shape"], node.attrs)
    g, (gy,) = _plane_views(m, g, [(m.inputs[0], True)])
    b, gx = m.body, m.outputs[0]
    p, q, i, j, h, w, t = (m.fresh(s) for s in ("p", "q", "i", "j", "h", "w", "t"))
    share, row, wide_row = m.fresh("share"), m.fresh("row"), m.fresh("wide_row")
    b.line(f"wide = {m.empty((g.oh, g.span[1]), dtype_name(node))}")
    b.line(f"wide_flat = {m.view('wide', (g.oh * g.span[1],))}")
    flat = m.fresh(gx + "_flat")
    b.line(f"{flat} = {m.view(gx, (f'{gx}.size',))}")
    nc = _planes(m, g)
    with b.indent():
        b.line("wide[:] = 0")
        with b.block(f"for {p} in range({g.oh}):"), b.block(f"for {q} in range({g.ow}):"):
            divisor = pool_divisor(m, node, node.attrs["input_shape"], p, q)
            b.line(f"{share} = {gy}[{nc}, {p}, {q}] / {dtype_name(node)}({divisor})")
            with b.block(f"for {j} in range({g.kw}):"):
                b.line(f"wide[{p}, {g.col(q, j)}] += {share}")
        with b.block(f"for {h} in range({g.h}):"):
            b.line(f"{row} = ({nc} * {g.h} + {h}) * {g.w}")
            with b.block(f"for {w} in range({g.w}):"):
                b.line(f"{flat}[{row} + {w}] = 0")
            with b.block(f"for {i} in range({g.kh}):"):  # the windows' rows p*sh + i*dh = h
                b.line(f"{t} = {affine(h, 1, g.pt)} - {_times(i, g.dh)}")
                with b.block(f"if {t} >= 0 and {t} % {g.sh} == 0 and {t} // {g.sh} < {g.oh}:"):
                    b.line(f"{wide_row} = {t} // {g.sh} * {g.span[1]} + {g.pl}")
                    with b.block(f"for {w} in range({g.w}):"):
                        b.line(f"{flat}[{row} + {w}] += wide_flat[{wide_row} + {w}]")


@renders("global_avg_pool")
def render_global_avg_pool(node: Node, m: KernelModule) -> None:
    n, c, h, w = node.inputs[0].type.shape
    b, x, y = m.body, m.inputs[0], m.outputs[0]
    nc, k, acc = m.fresh("nc"), m.fresh("k"), m.fresh("acc")
    b.line(f"x_v = {m.view(x, (n * c, h * w))}")
    b.line(f"y_v = {m.view(y, (n * c,))}")
    lo, hi = m.split(n * c, n * c * h * w)
    m.fastmath.add("reassoc")  # each plane summed in vector lanes (see `_sum_innermost`)
    with b.block(f"for {nc} in range({span_of(lo, hi)}):"):
        b.line(f"{acc} = 0.0")
        with b.block(f"for {k} in range({h * w}):"):
            b.line(f"{acc} += x_v[{nc}, {k}]")
        b.line(f"y_v[{nc}] = {dtype_name(node)}({acc} / {h * w})")


# ---------------------------------------------------------------------------------------
# Local response normalisation across channels (Caffe's), one image at a time.


def _window_sum(m: KernelModule, src: str, dst: str, channels: int, pixels: int,
                half: int, c: str) -> None:
    """``dst[s] = sum of src[c2, s] for |c2 - c| <= half`` (clipped to the channels),
    added in increasing c2 as the reference does, so float32 sums agree exactly."""
    b, s, c2 = m.body, m.fresh("s"), m.fresh("c2")
    with b.block(f"for {s} in range({pixels}):"):
        b.line(f"{dst}[{s}] = 0")
    with b.block(f"for {c2} in range(max(0, {c} - {half}), min({channels}, {c} + {half + 1})):"):
        with b.block(f"for {s} in range({pixels}):"):
            b.line(f"{dst}[{s}] += {src}[{c2}, {s}]")


def _power(base: str, exponent: float, dtype) -> str:
    """``base ** exponent`` for a positive ``base``: a multiple of a quarter (LRN's beta
    0.75, and 1.75 in its gradient) from square roots, which vectorize, within 2 ulp;
    ``**`` calls ``pow`` for each element, ten times slower (inception's LRN layers
    took a third of its training step)."""
    quarters = exponent * 4
    if quarters != int(quarters) or not 0 < abs(quarters) <= 8:
        return f"{base} ** {literal(exponent, dtype)}"
    whole, rest = divmod(abs(int(quarters)), 4)
    root = f"np.sqrt({base})"
    factors = [base] * whole + {0: [], 1: [f"np.sqrt({root})"], 2: [root],
                                3: [root, f"np.sqrt({root})"]}[rest]
    product = " * ".join(factors)
    return f"({product})" if quarters > 0 else f"({literal(1, dtype)} / ({product}))"


def _lrn_setup(node: Node, m: KernelModule, arrays: list[str]) -> tuple[int, int, int, int]:
    n, c, h, w = node.inputs[0].type.shape
    for name in arrays:
        m.body.line(f"{name}_v = {m.view(name, (n, c, h * w))}")
    return n, c, h * w, (node.attrs["size"] - 1) // 2


def _lrn_scale(m: KernelModule, node: Node, x: str, n: str, channels: int, pixels: int,
               half: int) -> None:
    """``scale[c, s] = k + alpha/size * (window sum of x^2)`` for image ``n``."""
    b, dt = m.body, node.outputs[0].type.dtype
    c, s = m.fresh("c"), m.fresh("s")
    with b.block(f"for {c} in range({channels}):"), b.block(f"for {s} in range({pixels}):"):
        b.line(f"sq[{c}, {s}] = {x}_v[{n}, {c}, {s}] * {x}_v[{n}, {c}, {s}]")
    k, alpha = literal(node.attrs["k"], dt), literal(node.attrs["alpha"] / node.attrs["size"], dt)
    with b.block(f"for {c} in range({channels}):"):
        _window_sum(m, "sq", "acc", channels, pixels, half, c)
        with b.block(f"for {s} in range({pixels}):"):
            b.line(f"scale[{c}, {s}] = {k} + {alpha} * acc[{s}]")


def _lrn_scratch(node: Node, m: KernelModule, channels: int, pixels: int) -> list[str]:
    dt = dtype_name(node)
    return [f"sq = {m.empty((channels, pixels), dt)}",
            f"scale = {m.empty((channels, pixels), dt)}",
            f"acc = {m.empty([pixels], dt)}"]


@renders("lrn")
def render_lrn(node: Node, m: KernelModule) -> None:
    """``y = x * scale ** -beta`` per image; images split over threads when big."""
    (x,), (y,) = m.inputs, m.outputs
    n, channels, pixels, half = _lrn_setup(node, m, [x, y])
    work = n * channels * pixels * node.attrs["size"]
    dt = node.outputs[0].type.dtype
    m.body.lines(_lrn_scratch(node, m, channels, pixels))
    with split_loop(m, "n", n, work) as i:
        _lrn_scale(m, node, x, i, channels, pixels, half)
        c, s, b = m.fresh("c"), m.fresh("s"), m.body
        with b.block(f"for {c} in range({channels}):"), b.block(f"for {s} in range({pixels}):"):
            b.line(f"{y}_v[{i}, {c}, {s}] = {x}_v[{i}, {c}, {s}] * "
                   f"{_power(f'scale[{c}, {s}]', -node.attrs['beta'], dt)}")


@renders("lrn_grad")
def render_lrn_grad(node: Node, m: KernelModule) -> None:
    """``gx = gy * scale^-beta - 2*alpha*beta/size * x * window_sum(gy * x *
    scale^(-beta-1))``, as `purinec.ir.nnref.lrn_grad` computes it."""
    (x, gy), (gx,) = m.inputs, m.outputs
    n, channels, pixels, half = _lrn_setup(node, m, [x, gy, gx])
    dt = node.outputs[0].type.dtype
    beta, alpha, size = node.attrs["beta"], node.attrs["alpha"], node.attrs["size"]
    factor = literal(2 * alpha * beta / size, dt)
    scratch = _lrn_scratch(node, m, channels, pixels) + [
        f"{name} = {m.empty((channels, pixels), dtype_name(node))}"
        for name in ("inner", "powered")]
    work = n * channels * pixels * size
    m.body.lines(scratch)
    with split_loop(m, "n", n, work) as i:
        _lrn_scale(m, node, x, i, channels, pixels, half)
        c, s, b = m.fresh("c"), m.fresh("s"), m.body
        # scale^-beta once (its square roots are most of the kernel's time), and
        # scale^(-beta-1) from it
        with b.block(f"for {c} in range({channels}):"), b.block(f"for {s} in range({pixels}):"):
            b.line(f"powered[{c}, {s}] = {_power(f'scale[{c}, {s}]', -beta, dt)}")
            b.line(f"inner[{c}, {s}] = {gy}_v[{i}, {c}, {s}] * {x}_v[{i}, {c}, {s}] * "
                   f"(powered[{c}, {s}] / scale[{c}, {s}])")
        with b.block(f"for {c} in range({channels}):"):
            _window_sum(m, "inner", "acc", channels, pixels, half, c)
            with b.block(f"for {s} in range({pixels}):"):
                b.line(f"{gx}_v[{i}, {c}, {s}] = {gy}_v[{i}, {c}, {s}] * powered[{c}, {s}] - "
                       f"{factor} * {x}_v[{i}, {c}, {s}] * acc[{s}]")
