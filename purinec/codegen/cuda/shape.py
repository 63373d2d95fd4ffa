"""CUDA data movement: reshape, concat, split, transpose, strided slices and pads, as
grid-stride copy kernels; and `coordinates`, the index arithmetic the other CUDA
renderers share.

The runtime treats ``reshape`` as a view and need not launch anything for it, but a
node may still be run as a kernel (a plan that does not alias, a test), so it has one:
a flat copy. ``concat`` and ``split`` view every array as (the axes before ``axis``,
the rest): each part is then a block of columns of the whole, and one kernel copies
every part, a grid-stride loop after another, each reading and writing consecutive
elements. ``transpose``, ``strided_slice`` and ``pad`` (and their gradients) give each
thread output elements, read from where the CPU's index arithmetic and tables say.
"""

from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager
from typing import Iterator, Sequence

from purinec.codegen.cpu_ops import affine, copy_loops, table_sources
from purinec.codegen.cuda.module import THREADS, CudaModule, blocks_for, literal, renders
from purinec.codegen.source import SourceBuilder
from purinec.ir.graph import Node


def coordinates(flat: str, extents: Sequence[int]) -> list[str]:
    """The source of each coordinate of the flat index ``flat`` into a C-ordered array
    of ``extents``, without the divisions and remainders that cannot matter."""
    result = []
    for k, extent in enumerate(extents):
        stride, before = math.prod(extents[k + 1:]), math.prod(extents[:k])
        if extent == 1:
            result.append("0")
            continue
        text = flat if stride == 1 else f"{flat} // {stride}"
        if before > 1:  # flat may run past this axis only when an outer one varies
            text = f"({text}) % {extent}" if stride != 1 else f"{text} % {extent}"
        result.append(text)
    return result


def grid_stride(m: CudaModule, count: int) -> tuple[str, str]:
    """The header of a loop giving each thread of the grid its share of ``count``
    items, and the loop's variable."""
    i = m.fresh("i")
    return f"for {i} in range(cuda.grid(1), {count}, cuda.gridsize(1)):", i


@renders("reshape")
def render_reshape(node: Node, m: CudaModule) -> None:
    """A flat copy: the element order does not change."""
    size = node.outputs[0].type.size
    (x,), (y,) = m.inputs, m.outputs
    with m.kernel("copy") as (name, body):
        src, dst = m.view(x, [size]), m.view(y, [size])
        header, i = grid_stride(m, size)
        with body.block(header):
            body.line(f"{dst}[{i}] = {src}[{i}]")
    m.launch(name, blocks_for(size), THREADS)


@renders("concat", "split")
def render_concat_split(node: Node, m: CudaModule) -> None:
    """Every part copied to (concat) or from (split) its columns of the whole."""
    axis, concat = node.attrs["axis"], node.op == "concat"
    if concat:
        whole, whole_value, parts = m.outputs[0], node.outputs[0], zip(m.inputs, node.inputs)
    else:
        whole, whole_value, parts = m.inputs[0], node.inputs[0], zip(m.outputs, node.outputs)
    shape = whole_value.type.shape
    outer, inner = math.prod(shape[:axis]), math.prod(shape[axis + 1:])
    with m.kernel("copy") as (name, body):
        whole_rows = m.view(whole, [outer, shape[axis] * inner])
        offset = 0
        for part, value in parts:
            width = value.type.shape[axis] * inner
            rows = m.view(part, [outer, width])
            header, i = grid_stride(m, outer * width)
            row, column = m.fresh("row"), m.fresh("column")
            in_part = f"{rows}[{row}, {column}]"
            in_whole = f"{whole_rows}[{row}, {affine(column, 1, offset)}]"
            with body.block(header):
                body.line(f"{row}, {column} = {', '.join(coordinates(i, [outer, width]))}")
                body.line(f"{in_whole} = {in_part}" if concat else f"{in_part} = {in_whole}")
            offset += width
    m.launch(name, blocks_for(whole_value.type.size), THREADS)


def flat_index(coordinates: Sequence[str], shape: Sequence[int]) -> str:
    """The source of the C-order flat index at ``coordinates`` into ``shape``."""
    terms = []
    for k, (text, extent) in enumerate(zip(coordinates, shape)):
        if extent != 1:
            terms.append(affine(f"({text})" if " " in text else text,
                                math.prod(shape[k + 1:]), 0))
    return " + ".join(terms) or "0"


@contextmanager
def each_element(m: CudaModule, node: Node) -> Iterator[tuple[list[str], str, str,
                                                                SourceBuilder]]:
    """A grid-stride kernel over the elements of the node's output: yields the locals of
    an element's coordinates, the input's flat view, the output element's place (to
    store into) and the loop's body."""
    out = node.outputs[0].type
    with m.kernel("copy") as (name, body):
        src = m.view(m.inputs[0], [node.inputs[0].type.size])
        dst = m.view(m.outputs[0], [out.size])
        header, i = grid_stride(m, out.size)
        with body.block(header):
            at = []
            for k, text in enumerate(coordinates(i, out.shape)):
                at.append(m.fresh(f"a{k}"))
                body.line(f"{at[-1]} = {text}")
            yield at, src, f"{dst}[{i}]", body
    m.launch(name, blocks_for(out.size), THREADS)


@renders("transpose")
def render_transpose(node: Node, m: CudaModule) -> None:
    """Output axis k runs along input axis perm[k]."""
    perm, shape = node.attrs["perm"], node.inputs[0].type.shape
    with each_element(m, node) as (at, src, dst, body):
        source = [at[perm.index(a)] for a in range(len(perm))]
        body.line(f"{dst} = {src}[{flat_index(source, shape)}]")


@renders("strided_slice")
def render_strided_slice(node: Node, m: CudaModule) -> None:
    with each_element(m, node) as (at, src, dst, body):
        source = [affine(v, step, start) for v, start, step
                  in zip(at, node.attrs["starts"], node.attrs["steps"])]
        body.line(f"{dst} = {src}[{flat_index(source, node.inputs[0].type.shape)}]")


@renders("pad", "strided_slice_grad")
def render_table_copy(node: Node, m: CudaModule) -> None:
    """As on the CPU (`purinec.codegen.cpu_ops.render_table_copy`): each element copies
    the input element its axes' tables name, or is the constant where one says -1."""
    value = literal(node.attrs.get("value", 0.0), node.outputs[0].type.dtype)
    with each_element(m, node) as (at, src, dst, body):
        source, outside = table_sources(m, node, at)
        read = f"{src}[{flat_index(source, node.inputs[0].type.shape)}]"
        if outside:
            read = f"{value} if {' or '.join(outside)} else {read}"
        body.line(f"{dst} = {read}")


@renders("pad_grad")
def render_pad_grad(node: Node, m: CudaModule) -> None:
    """As on the CPU (`purinec.codegen.cpu_ops.render_pad_grad`): each element adds up
    its copies, here in the gradient's own dtype (a few terms)."""
    with each_element(m, node) as (at, src, dst, body):
        acc = m.fresh("acc")
        body.line(f"{acc} = {literal(0, node.outputs[0].type.dtype)}")
        with ExitStack() as loops:
            source = copy_loops(m, body, node, at, loops)
            body.line(f"{acc} += {src}[{flat_index(source, node.inputs[0].type.shape)}]")
        body.line(f"{dst} = {acc}")
