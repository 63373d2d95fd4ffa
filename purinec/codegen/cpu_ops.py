"""CPU renderers (see `purinec.codegen.cpu_module.renders`): the helpers they share, and
the elementwise, data movement, reduction, softmax and loss ops.

Shapes and attributes are baked in as constants, except that flat elementwise loops and
``reduce_sum`` read their extents from their arrays, so one compile serves every size.
The heavy ops have modules of their own: `purinec.codegen.cpu_conv` (matrix products
and convolutions, through BLAS), `purinec.codegen.cpu_pool` (pooling and LRN) and
`purinec.codegen.cpu_fused` (fused nodes). Here:

* elementwise and broadcast ops: one loop nest from their element expressions
  (`purinec.codegen.elementwise`), the same emitter fused nodes use;
* data movement (``reshape``, ``concat``, ``split``): row copies; ``transpose``,
  ``strided_slice``, ``pad`` and their gradients: loop nests over the output;
* ``reduce_sum``: kept axes outside, summed axes inside, four partial sums;
* softmax, log_softmax and the losses: direct loops over rows.

Big kernels are *blocked* (`KernelModule.split`): one loop over independent items
(images, planes, rows of a product, im2col rows) runs over ``lo:hi`` only, so threads
can run blocks side by side (`purinec.codegen.cpu_runtime.run_blocked`), each with its
own scratch.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Callable, Iterator

from purinec.codegen.cpu_module import KernelModule, literal, numpy_name, renders
from purinec.codegen.elementwise import emit_loop
from purinec.ir.graph import Node
from purinec.ir.ops import REGISTRY
from purinec.ir.ops.shape import pad_sources
from purinec.ir.types import DType

# ---------------------------------------------------------------------------------------
# Shared pieces.


def dtype_name(node: Node) -> str:
    """The node's float dtype as generated source spells it."""
    return numpy_name(node.outputs[0].type.dtype)


def _accumulator(dtype: DType) -> str:
    """Sums of floats accumulate in float64, of integers and bools in int64."""
    return "np.float64" if dtype.is_float else "np.int64"


def _prod(values) -> int:
    result = 1
    for v in values:
        result *= v
    return result


def affine(var: str, scale: int, offset: int | str) -> str:
    """``var * scale + offset`` without the no-op parts."""
    text = var if scale == 1 else f"{var} * {scale}"
    if isinstance(offset, str):
        return f"{text} + {offset}"
    if offset > 0:
        return f"{text} + {offset}"
    if offset < 0:
        return f"{text} - {-offset}"
    return text


def span_of(lo: str, hi: str) -> str:
    """The arguments of ``range`` for ``lo:hi``."""
    return hi if lo == "0" else f"{lo}, {hi}"


def row_slice(array: str, start: str, count: int, total: int) -> str:
    """``array[start:start + count]``, or ``array`` itself when that is all of it."""
    if start == "0" and count == total:
        return array
    return f"{array}[{start}:{start} + {count}]" if start != "0" else f"{array}[:{count}]"


@contextmanager
def split_loop(m: KernelModule, var: str, count: int, work: int,
               products: bool = False, extent: str | None = None) -> Iterator[str]:
    """``for var in range(lo, hi)`` over ``count`` independent items, the kernel's
    blocked loop when ``work`` is big, or whatever it is when the code reads ``count``
    from its arrays into the local ``extent`` (see `KernelModule.split`)."""
    lo, hi = m.split(count, work, products, extent)
    name = m.fresh(var)
    with m.body.block(f"for {name} in range({span_of(lo, hi)}):"):
        yield name


# ---------------------------------------------------------------------------------------
# Elementwise and broadcast ops: one loop from their element expressions.


@renders(*(name for name, opdef in REGISTRY.items() if opdef.expr is not None))
def render_elementwise(node: Node, m: KernelModule) -> None:
    arrays = dict(zip(node.inputs, m.inputs)) | dict(zip(node.outputs, m.outputs))
    emit_loop(m, [node], arrays, node.outputs)


# ---------------------------------------------------------------------------------------
# Data movement.


def _around_axis(shape, axis: int) -> tuple[int, int]:
    """(product of the axes before ``axis``, product of those after)."""
    return _prod(shape[:axis]), _prod(shape[axis + 1:])


@renders("reshape")
def render_reshape(node: Node, m: KernelModule) -> None:
    """A flat copy (a planner may instead make the output a view of the input) of the
    length it reads from its output, so that its code serves every size."""
    b = m.body
    if not node.outputs[0].type.size:
        return
    size = m.extent(m.outputs[0], None, node.outputs[0].type.size, "n")
    src, dst = m.fresh("src"), m.fresh("dst")
    b.line(f"{src} = {m.view(m.inputs[0], (size,))}")
    b.line(f"{dst} = {m.view(m.outputs[0], (size,))}")
    with split_loop(m, "k", size, size, extent=str(size)) as k:
        b.line(f"{dst}[{k}] = {src}[{k}]")


def _concat_views(m: KernelModule, arrays, types, axis: int, outer: int, inner: int
                  ) -> tuple[list[str], list[int]]:
    """Each array seen as (``outer``, its length along ``axis`` times ``inner``), and
    those lengths, read from the arrays (`KernelModule.extent`)."""
    views, lengths = [], []
    for name, ty in zip(arrays, types):
        view = m.fresh(name + "_rows")
        lengths.append(m.extent(name, axis, ty.shape[axis], "length") * inner)
        m.body.line(f"{view} = {m.view(name, (outer, lengths[-1]))}")
        views.append(view)
    return views, lengths


@renders("concat", "split")
def render_concat_split(node: Node, m: KernelModule) -> None:
    """Every array viewed as (the axes before ``axis``, the rest): each part is a block
    of columns of the whole, copied row by row. The axes before ``axis`` and the
    parts' lengths along it are read from the arrays, so that a concat's code serves
    every batch and channel count (those after ``axis``, an image's size, are
    constants). Blocks split the whole's elements, rows and columns together, so that
    one row (an image at batch 1) runs on every thread too: a block's first and last
    rows may be partial, and each part copies what of it lies in the block."""
    axis = node.attrs["axis"]
    joined = node.outputs[0] if node.op == "concat" else node.inputs[0]
    joined_name = m.outputs[0] if node.op == "concat" else m.inputs[0]
    parts = node.inputs if node.op == "concat" else node.outputs
    part_names = m.inputs if node.op == "concat" else m.outputs
    outer = _prod(m.extent(joined_name, a, joined.type.shape[a], "rows")
                  for a in range(axis))
    inner = _prod(joined.type.shape[axis + 1:])
    (whole,), (width,) = _concat_views(m, [joined_name], [joined.type], axis, outer, inner)
    views, lengths = _concat_views(m, part_names, [v.type for v in parts], axis, outer,
                                   inner)
    b = m.body
    lo, hi = m.split(outer * width, joined.type.size, extent=str(outer * width))
    r, first, end = m.fresh("r"), m.fresh("first"), m.fresh("end")
    with b.block(f"for {r} in range({lo} // {width}, ({hi} + {width} - 1) // {width}):"):
        b.line(f"{first} = max({lo} - {r} * {width}, 0)")
        b.line(f"{end} = min({hi} - {r} * {width}, {width})")
        offset = 0
        for view, length in zip(views, lengths):  # the part's columns in first:end
            s0, s1 = m.fresh("part_lo"), m.fresh("part_hi")
            b.line(f"{s0} = max({first}, {offset})" if offset else f"{s0} = {first}")
            b.line(f"{s1} = min({end}, {offset + length})")
            with b.block(f"if {s0} < {s1}:"):
                _copy_part(m, node.op, whole, view, r, offset, s0, f"{s1} - {s0}")
            offset += length


def _copy_part(m: KernelModule, op: str, whole: str, part: str, row: str, offset,
               start: str, count: str) -> None:
    """Copy ``count`` columns of row ``row`` from column ``start`` of ``whole`` on
    (``start - offset`` of ``part``) from ``part`` (``op`` concat) or into it (split):
    one `copy_run`. (A loop here vectorizes only where LLVM sees its index is never
    negative, which it does not for these bounds: 10x slower.)"""
    at_part = f"{start} - {offset}" if offset else start
    if op == "concat":
        m.copy_run(whole, f"{row}, {start}", part, f"{row}, {at_part}", count)
    else:
        m.copy_run(part, f"{row}, {at_part}", whole, f"{row}, {start}", count)


# Transposes, strided slices and pads: loop nests over the output, each element read
# from where the op's index arithmetic says (per axis: strided slices and pads). The
# tables are shared with the CUDA renderers (`purinec.codegen.cuda.shape`).


def axis_sources(node: Node) -> list[list[int] | None]:
    """For ``pad`` and ``strided_slice_grad``: per output axis, the input index each
    output index copies, -1 where it takes the constant; None for an axis copied as it
    is."""
    out_shape = node.outputs[0].type.shape
    if node.op == "pad":
        pads, rank = node.attrs["pads"], len(out_shape)
        tables = [pad_sources(n, pads[a], pads[rank + a], node.attrs["mode"])
                  for a, n in enumerate(node.inputs[0].type.shape)]
    else:
        tables = []
        for n, start, step, size in zip(out_shape, node.attrs["starts"], node.attrs["steps"],
                                        node.inputs[0].type.shape):
            hits = {start + i * step: i for i in range(size)}
            tables.append([hits.get(j, -1) for j in range(n)])
    return [None if t == list(range(len(t))) else t for t in tables]


def copies_of(sources: list[int], n: int) -> tuple[list[int], list[int]]:
    """The inverse of `pad_sources` in compressed rows: the indices copying input index
    ``i`` are ``copies[first[i]:first[i + 1]]``."""
    rows: list[list[int]] = [[] for _ in range(n)]
    for j, i in enumerate(sources):
        if i >= 0:
            rows[i].append(j)
    first = [0]
    for row in rows:
        first.append(first[-1] + len(row))
    return first, [j for row in rows for j in row]


def index_of(coordinates: list[str]) -> str:
    """The index of an array at ``coordinates``; ``()`` for a 0-d array."""
    return ", ".join(coordinates) if coordinates else "()"


@contextmanager
def each_element(m: KernelModule, shape) -> Iterator[list[str]]:
    """Loops over every element of ``shape`` (the outermost the kernel's blocked loop);
    yields the coordinates' variables, the body's indentation inside the innermost."""
    with ExitStack() as stack:
        coordinates = []
        for k, extent in enumerate(shape):
            if k == 0:
                var = stack.enter_context(split_loop(m, "i0", extent, _prod(shape)))
            else:
                var = m.fresh(f"i{k}")
                stack.enter_context(m.body.block(f"for {var} in range({extent}):"))
            coordinates.append(var)
        yield coordinates


@renders("transpose")
def render_transpose(node: Node, m: KernelModule) -> None:
    """Output axis k runs along input axis perm[k]."""
    (x,), (y,), perm = m.inputs, m.outputs, node.attrs["perm"]
    with each_element(m, node.outputs[0].type.shape) as at:
        source = [at[perm.index(a)] for a in range(len(perm))]
        m.body.line(f"{y}[{index_of(at)}] = {x}[{index_of(source)}]")


@renders("strided_slice")
def render_strided_slice(node: Node, m: KernelModule) -> None:
    (x,), (y,) = m.inputs, m.outputs
    with each_element(m, node.outputs[0].type.shape) as at:
        source = [affine(v, step, start) for v, start, step
                  in zip(at, node.attrs["starts"], node.attrs["steps"])]
        m.body.line(f"{y}[{index_of(at)}] = {x}[{index_of(source)}]")


def table_sources(m, node: Node, at: list[str]) -> tuple[list[str], list[str]]:
    """For a table copy on either target (``m`` a CPU or CUDA module): the coordinates
    in the input of the output element at ``at``, and the tests (or'ed) saying it is
    the constant instead."""
    source, outside = [], []
    for a, (table, var) in enumerate(zip(axis_sources(node), at)):
        if table is None:
            source.append(var)
            continue
        source.append(f"{m.constant(f'SRC{a}', table)}[{var}]")
        if -1 in table:
            outside.append(f"{source[-1]} < 0")
    return source, outside


def copy_loops(m, body, node: Node, at: list[str], loops: ExitStack) -> list[str]:
    """For pad's gradient on either target: opens in ``body`` (each loop entered on
    ``loops``) a loop over the copies (`copies_of`) of the element of x at ``at`` along
    each padded axis; returns the coordinates in gy of one copy."""
    pads, mode = node.attrs["pads"], node.attrs["mode"]
    rank = len(at)
    source = []
    for a, (n, var) in enumerate(zip(node.outputs[0].type.shape, at)):
        if pads[a] == pads[rank + a] == 0:
            source.append(var)
            continue
        first, copies = copies_of(pad_sources(n, pads[a], pads[rank + a], mode), n)
        first, copies = m.constant(f"FIRST{a}", first), m.constant(f"COPIES{a}", copies)
        k = m.fresh(f"k{a}")
        loops.enter_context(body.block(f"for {k} in range({first}[{var}], "
                                       f"{first}[{var} + 1]):"))
        source.append(f"{copies}[{k}]")
    return source


@renders("pad", "strided_slice_grad")
def render_table_copy(node: Node, m: KernelModule) -> None:
    """Each element copies the input element the axes' tables (`axis_sources`) name, or
    is the constant where a table says -1 (pad's value, or a gradient's 0)."""
    (x,), (y,) = m.inputs, m.outputs
    value = literal(node.attrs.get("value", 0.0), node.outputs[0].type.dtype)
    with each_element(m, node.outputs[0].type.shape) as at:
        source, outside = table_sources(m, node, at)
        read = f"{x}[{index_of(source)}]"
        if outside:
            read = f"{value} if {' or '.join(outside)} else {read}"
        m.body.line(f"{y}[{index_of(at)}] = {read}")


@renders("pad_grad")
def render_pad_grad(node: Node, m: KernelModule) -> None:
    """Each element of gx adds up the elements of gy that are copies of it, in float64."""
    (gy,), (gx,), b = m.inputs, m.outputs, m.body
    dtype = node.outputs[0].type.dtype
    with each_element(m, node.outputs[0].type.shape) as at:
        acc = m.fresh("acc")
        b.line(f"{acc} = {_accumulator(dtype)}(0)")
        with ExitStack() as loops:
            source = copy_loops(m, b, node, at, loops)
            b.line(f"{acc} += {gy}[{index_of(source)}]")
        b.line(f"{gx}[{index_of(at)}] = {_cast(acc, dtype)}")


# ---------------------------------------------------------------------------------------
# Reductions.


@renders("reduce_sum")
def render_reduce_sum(node: Node, m: KernelModule) -> None:
    """Loops over the kept axes outside (each output element written once, so blocks of
    the outermost are independent) and the summed axes inside, accumulating in a
    scalar; a sum down columns (the innermost axis kept) adds whole rows instead
    (`_sum_rows`). Extents are read from the input's shape: every bias gradient of a
    network (NCHW summed to C, at any size) shares one kernel."""
    x, out, b = m.inputs[0], m.outputs[0], m.body
    x_type, out_type = node.inputs[0].type, node.outputs[0].type
    summed = set(node.attrs["axes"])
    groups: list[tuple[bool, list[int]]] = []  # (summed?, axes), like neighbours merged
    for a, size in enumerate(x_type.shape):
        if size == 1:
            continue
        if groups and groups[-1][0] == (a in summed):
            groups[-1][1].append(a)
        else:
            groups.append((a in summed, [a]))
    sizes = [_prod(x_type.shape[a] for a in axes) for _, axes in groups]
    extents = [m.fresh("e") for _ in groups]
    for extent, (_, axes) in zip(extents, groups):
        b.line(f"{extent} = {' * '.join(f'{x}.shape[{a}]' for a in axes)}")
    loop_vars = [m.fresh(f"i{k}") for k in range(len(groups))]
    view = m.fresh(x + "_v")
    b.line(f"{view} = {m.view(x, extents or [1])}")
    out_flat = m.fresh(out + "_flat")
    b.line(f"{out_flat} = {m.view(out, [f'{out}.size'])}")
    if [s for s, _ in groups] in ([True, False], [False, True, False]):
        _sum_rows(node, m, view, out_flat, extents, sizes)
        return
    kept = [k for k, (s, _) in enumerate(groups) if not s]
    sums = [k for k, (s, _) in enumerate(groups) if s]
    out_index = " + ".join(
        " * ".join([loop_vars[k]] + [extents[j] for j in kept if j > k]) for k in kept
    ) or "0"
    depth = 0
    for n, k in enumerate(kept):
        lo, hi = (m.split(sizes[k], x_type.size, extent=extents[k]) if n == 0
                  else ("0", extents[k]))
        with b.indent(depth):
            b.line(f"for {loop_vars[k]} in range({span_of(lo, hi)}):")
        depth += 1
    acc = m.fresh("acc")
    with b.indent(depth):
        b.line(f"{acc} = {_accumulator(x_type.dtype)}(0)")
    inner = sums[-1] if sums and sums[-1] == len(groups) - 1 else None
    for k in sums:
        if k == inner:
            break
        with b.indent(depth):
            b.line(f"for {loop_vars[k]} in range({extents[k]}):")
        depth += 1
    if inner is None:
        with b.indent(depth):
            b.line(f"{acc} += {view}[{', '.join(loop_vars) or '0'}]")
    else:
        with b.indent(depth):
            _sum_innermost(m, node, view, loop_vars, extents[inner], acc)
    with b.indent(len(kept)):
        b.line(f"{out_flat}[{out_index}] = {_cast(acc, out_type.dtype)}")


def _sum_rows(node: Node, m: KernelModule, view: str, out_flat: str,
              extents: list[str], sizes: list[int]) -> None:
    """A sum over the rows of ``view`` (``[rows, width]``, or ``[outer, rows, width]``
    with a sum for each outer index): the rows are added into a float64 row in order,
    a loop along the row that vectorises, where a loop down each column would read one
    element per cache line; each row a 1-D slice (indexing a 2-D slice of columns, with
    strides LLVM cannot see, kept the loop scalar: 3x slower on 64 rows of 512). The
    outer axis is the blocked one; without one, blocks of columns. ``extents``: the
    names of the view's extents; ``sizes``: their values."""
    b, dtype = m.body, node.inputs[0].type.dtype
    *outer, rows, width = extents
    r, j, total, row = m.fresh("r"), m.fresh("j"), m.fresh("total"), m.fresh("row")
    if outer:
        o = m.fresh("o")
        lo, hi = m.split(sizes[0], _prod(sizes), extent=outer[0])
        b.line(f"{total} = {m.empty([width], _accumulator(dtype))}")
        b.line(f"for {o} in range({span_of(lo, hi)}):")
        count, out_row = width, m.fresh("out_row")
        b.line(f"    {out_row} = {out_flat}[{o} * {width}:{o} * {width} + {width}]")
        row_of = f"{view}[{o}, {{}}]".format
    else:  # (the kernel's first split, of a count read at run time: always lo, hi)
        lo, hi = m.split(sizes[-1], _prod(sizes), extent=width)
        count, out_row = f"{hi} - {lo}", m.fresh("out_row")
        b.line(f"{out_row} = {out_flat}[{lo}:{hi}]")
        b.line(f"{total} = {m.empty([count], _accumulator(dtype))}")
        row_of = f"{view}[{{}}, {lo}:{hi}]".format
    with b.indent(1 if outer else 0):
        with b.block(f"for {j} in range({count}):"):
            b.line(f"{total}[{j}] = 0")
        with b.block(f"for {r} in range({rows}):"):
            b.line(f"{row} = {row_of(r)}")
            with b.block(f"for {j} in range({count}):"):
                b.line(f"{total}[{j}] += {row}[{j}]")
        with b.block(f"for {j} in range({count}):"):
            b.line(f"{out_row}[{j}] = {_cast(f'{total}[{j}]', node.outputs[0].type.dtype)}")


def _sum_innermost(m: KernelModule, node: Node, view: str, loop_vars: list[str],
                   extent: str, acc: str) -> None:
    """``acc += sum of view[..., k]`` over the innermost axis, through a partial sum per
    row. The kernel may reassociate float additions (`KernelModule.fastmath`), so LLVM
    sums each row in vector lanes: 6x faster than four scalar partial sums, and as
    accurate, in float64."""
    b, k, part = m.body, loop_vars[-1], m.fresh("part")
    prefix = ", ".join(loop_vars[:-1] + [""])
    if node.inputs[0].type.dtype.is_float:
        m.fastmath.add("reassoc")
    b.line(f"{part} = {_accumulator(node.inputs[0].type.dtype)}(0)")
    with b.block(f"for {k} in range({extent}):"):
        b.line(f"{part} += {view}[{prefix}{k}]")
    b.line(f"{acc} += {part}")


def _cast(expr: str, dtype: DType) -> str:
    if dtype is DType.bool:
        return f"{expr} != 0"
    return f"{numpy_name(dtype)}({expr})"


# ---------------------------------------------------------------------------------------
# Softmax and the losses.


def _softmax_views(node: Node, m: KernelModule, arrays: list[str]) -> tuple[int, int, int]:
    shape, axis = node.inputs[0].type.shape, node.attrs["axis"]
    outer, inner = _around_axis(shape, axis)
    for name in arrays:
        m.body.line(f"{name}_v = {m.view(name, (outer, shape[axis], inner))}")
    return outer, shape[axis], inner


def _render_softmax_rows(node: Node, m: KernelModule, log: bool) -> None:
    """softmax, or with ``log`` log_softmax, along the axis: per row its maximum; then
    ``exp(x - max)`` (log: ``x - max``) stored while the exps are summed in float64;
    then the row divided by the sum (log: less the sum's log, taken in float64)."""
    (x,), (y,), b = m.inputs, m.outputs, m.body
    outer, classes, inner = _softmax_views(node, m, [x, y])
    if not classes:
        return
    o, i, c, top, total, v = (m.fresh(s) for s in ("o", "i", "c", "top", "total", "v"))
    lo, hi = m.split(outer, outer * classes * inner * 8)
    with b.block(f"for {o} in range({span_of(lo, hi)}):"), b.block(f"for {i} in range({inner}):"):
        b.line(f"{top} = {x}_v[{o}, 0, {i}]")
        with b.block(f"for {c} in range(1, {classes}):"):
            b.line(f"{top} = max({top}, {x}_v[{o}, {c}, {i}])")
        b.line(f"{total} = 0.0")
        with b.block(f"for {c} in range({classes}):"):
            shifted = f"{x}_v[{o}, {c}, {i}] - {top}"
            b.line(f"{v} = {shifted if log else f'np.exp({shifted})'}")
            b.line(f"{y}_v[{o}, {c}, {i}] = {v}")
            b.line(f"{total} += {f'np.exp({v})' if log else v}")
        b.line(f"{total} = {dtype_name(node)}({f'np.log({total})' if log else total})")
        with b.block(f"for {c} in range({classes}):"):
            out = f"{y}_v[{o}, {c}, {i}]"
            b.line(f"{out} = {out} {'-' if log else '/'} {total}")


@renders("softmax")
def render_softmax(node: Node, m: KernelModule) -> None:
    _render_softmax_rows(node, m, log=False)


@renders("log_softmax")
def render_log_softmax(node: Node, m: KernelModule) -> None:
    _render_softmax_rows(node, m, log=True)


def _render_row_sum_then_map(node: Node, m: KernelModule, summand: Callable[[str, str], str],
                             result: Callable[[str, str, str], str]) -> None:
    """The softmax gradients: per row the sum of ``summand(y, gy)`` (in float64), then
    each ``gx = result(y, gy, sum)``."""
    (y, gy), (gx,), b = m.inputs, m.outputs, m.body
    outer, classes, inner = _softmax_views(node, m, [y, gy, gx])
    o, i, c, total = (m.fresh(s) for s in ("o", "i", "c", "total"))
    at = lambda name: f"{name}_v[{o}, {c}, {i}]"  # noqa: E731
    lo, hi = m.split(outer, outer * classes * inner * 4)
    with b.block(f"for {o} in range({span_of(lo, hi)}):"), b.block(f"for {i} in range({inner}):"):
        b.line(f"{total} = 0.0")
        with b.block(f"for {c} in range({classes}):"):
            b.line(f"{total} += {summand(at(y), at(gy))}")
        b.line(f"{total} = {dtype_name(node)}({total})")
        with b.block(f"for {c} in range({classes}):"):
            b.line(f"{at(gx)} = {result(at(y), at(gy), total)}")


@renders("softmax_grad")
def render_softmax_grad(node: Node, m: KernelModule) -> None:
    """``gx = y * (gy - sum over the axis of gy * y)``."""
    _render_row_sum_then_map(node, m, lambda y, gy: f"{gy} * {y}",
                             lambda y, gy, dot: f"{y} * ({gy} - {dot})")


@renders("log_softmax_grad")
def render_log_softmax_grad(node: Node, m: KernelModule) -> None:
    """``gx = gy - exp(y) * sum over the axis of gy``."""
    _render_row_sum_then_map(node, m, lambda y, gy: gy,
                             lambda y, gy, total: f"{gy} - np.exp({y}) * {total}")


def _row_softmax_parts(m: KernelModule, node: Node, logits: str, row: str, classes: int
                       ) -> tuple[str, str]:
    """The row's maximum and its sum of ``exp(logit - max)`` (as the node's dtype)."""
    b, c, top, total = m.body, m.fresh("c"), m.fresh("top"), m.fresh("total")
    b.line(f"{top} = {logits}[{row}, 0]")
    with b.block(f"for {c} in range(1, {classes}):"):
        b.line(f"{top} = max({top}, {logits}[{row}, {c}])")
    b.line(f"{total} = 0.0")
    with b.block(f"for {c} in range({classes}):"):
        b.line(f"{total} += np.exp({logits}[{row}, {c}] - {top})")
    b.line(f"{total} = {dtype_name(node)}({total})")
    return top, total


def _checked_label(m: KernelModule, node: Node, label: str, row: str, classes: int) -> str:
    b, name = m.body, m.fresh("cls")
    b.line(f"{name} = {label}[{row}]")
    with b.block(f"if {name} < 0 or {name} >= {classes}:"):
        # (Numba raises with the values in the arguments; the runtime joins them.)
        b.line(f'raise ValueError("label", {name}, "at row", {row}, "is outside '
               f'[0, {classes})")')
    return name


@renders("softmax_xent")
def render_softmax_xent(node: Node, m: KernelModule) -> None:
    """The batch mean of ``-(logit[label] - max - log(sum exp(logit - max)))``."""
    (logits, label), (loss,), b = m.inputs, m.outputs, m.body
    rows, classes = node.inputs[0].type.shape
    row, total_loss = m.fresh("row"), m.fresh("loss_sum")
    b.line(f"{total_loss} = 0.0")
    if classes:
        with b.block(f"for {row} in range({rows}):"):
            cls = _checked_label(m, node, label, row, classes)
            top, total = _row_softmax_parts(m, node, logits, row, classes)
            b.line(f"{total_loss} += ({logits}[{row}, {cls}] - {top}) - np.log({total})")
    b.line(f"{loss}[()] = {dtype_name(node)}(-({total_loss} / {rows}))")


@renders("softmax_xent_grad")
def render_softmax_xent_grad(node: Node, m: KernelModule) -> None:
    """``(softmax(logits) - onehot(label)) * gy / batch``."""
    (logits, label, gy), (gx,), b = m.inputs, m.outputs, m.body
    rows, classes = node.inputs[0].type.shape
    row, c, factor = m.fresh("row"), m.fresh("c"), m.fresh("factor")
    b.line(f"{factor} = {gy}[()] / {literal(rows, node.outputs[0].type.dtype)}")
    if not classes:
        return
    with b.block(f"for {row} in range({rows}):"):
        cls = _checked_label(m, node, label, row, classes)
        top, total = _row_softmax_parts(m, node, logits, row, classes)
        with b.block(f"for {c} in range({classes}):"):
            b.line(f"{gx}[{row}, {c}] = np.exp({logits}[{row}, {c}] - {top}) / {total} * "
                   f"{factor}")
        b.line(f"{gx}[{row}, {cls}] = (np.exp({logits}[{row}, {cls}] - {top}) / {total} - "
               f"{literal(1, node.outputs[0].type.dtype)}) * {factor}")


@renders("accuracy")
def render_accuracy(node: Node, m: KernelModule) -> None:
    """The fraction of rows whose first largest logit is at the label."""
    (logits, label), (out,), b = m.inputs, m.outputs, m.body
    rows, classes = node.inputs[0].type.shape
    row, c, best, hits = m.fresh("row"), m.fresh("c"), m.fresh("best"), m.fresh("hits")
    b.line(f"{hits} = 0")
    with b.block(f"for {row} in range({rows}):"):
        b.line(f"{best} = 0")
        with b.block(f"for {c} in range(1, {classes}):"):
            with b.block(f"if {logits}[{row}, {c}] > {logits}[{row}, {best}]:"):
                b.line(f"{best} = {c}")
        with b.block(f"if {classes} > 0 and {best} == {label}[{row}]:"):
            b.line(f"{hits} += 1")
    b.line(f"{out}[()] = {dtype_name(node)}({hits} / {rows})")
