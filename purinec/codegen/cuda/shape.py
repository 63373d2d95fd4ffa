"""CUDA data movement: reshape, concat and split, as grid-stride copy kernels; and
`coordinates`, the index arithmetic the other CUDA renderers share.

The runtime treats ``reshape`` as a view and need not launch anything for it, but a
node may still be run as a kernel (a plan that does not alias, a test), so it has one:
a flat copy. ``concat`` and ``split`` view every array as (the axes before ``axis``,
the rest): each part is then a block of columns of the whole, and one kernel copies
every part, a grid-stride loop after another, each reading and writing consecutive
elements.
"""

from __future__ import annotations

import math
from typing import Sequence

from purinec.codegen.cpu_ops import affine
from purinec.codegen.cuda.module import THREADS, CudaModule, blocks_for, renders
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
