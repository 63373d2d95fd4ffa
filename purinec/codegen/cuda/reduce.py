"""CUDA reductions: sums over axes, softmax and log_softmax and their gradients, the
softmax cross-entropy and its gradient, and accuracy.

A reduction gives each result (a sum, a row of softmax) to one block, and blocks
stride over the results, so a grid never exceeds `purinec.codegen.cuda.module.MAX_BLOCKS`.
The block's threads stride over the elements reduced, each keeping a partial result,
and combine the partials in a tree in shared memory (`block_sum`, `block_max`: device
helpers whose result every thread gets), in the same order at every run. Float sums
accumulate in float64 and integer sums in int64, as on the CPU.

The loss and accuracy are scalars over the rows of a batch, and a kernel has nowhere to
keep a result per row (kernels never allocate) and no wish for atomics (their order,
hence the float sum, would change from run to run): one block computes each, looping
over the rows. A label outside ``[0, classes)``, which the CPU refuses, cannot raise on
the device: it makes the loss, or its row of the gradient, NaN.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from purinec.codegen.cpu_ops import dtype_name
from purinec.codegen.cuda.module import (HELPERS, CudaModule, blocks_for, literal,
                                         numpy_name, renders)
from purinec.codegen.cuda.shape import coordinates
from purinec.codegen.cuda.simulator import simulated
from purinec.codegen.source import SourceBuilder
from purinec.ir.graph import Node
from purinec.ir.types import DType

# Threads per block of a reduction: a power of two, as the tree halves it. 128 keeps the
# tree at 7 steps (each behind a barrier) while a row of 1,000 classes still gives each
# thread 8 elements. Numba's simulator runs one Python thread per thread and makes each
# barrier wait for all of them (seconds a launch): there the same code runs with 8.
REDUCE_THREADS = 8 if simulated() else 128
assert REDUCE_THREADS & (REDUCE_THREADS - 1) == 0


def _block_reduction(name: str, combine: str, what: str) -> str:
    return f'''\
@cuda.jit(device=True, inline=True)
def {name}(partials, value):
    # {what} of every thread's value over the block, returned to every thread.
    # partials: a shared array of one entry per thread, free again on return.
    t = cuda.threadIdx.x
    partials[t] = value
    cuda.syncthreads()
    step = cuda.blockDim.x // 2
    while step > 0:
        if t < step:
            partials[t] = {combine.format("partials[t]", "partials[t + step]")}
        cuda.syncthreads()
        step //= 2
    result = partials[0]
    cuda.syncthreads()  # every thread has read it before partials is written again
    return result'''


HELPERS["block_sum"] = _block_reduction("block_sum", "{0} + {1}", "The sum")
HELPERS["block_max"] = _block_reduction("block_max", "max({0}, {1})", "The maximum")


def _accumulator(dtype: DType) -> str:
    """Sums of floats accumulate in float64, of integers and bools in int64."""
    return "float64" if dtype.is_float else "int64"


def _cast(expr: str, dtype: DType) -> str:
    if dtype is DType.bool:
        return f"{expr} != 0"
    return f"{numpy_name(dtype)}({expr})"


def _shared(m: CudaModule, body: SourceBuilder, accumulate: str) -> str:
    """A shared array of one ``accumulate`` entry per thread, for `block_sum` and
    `block_max`."""
    name = m.fresh("partials")
    body.line(f"{name} = cuda.shared.array({REDUCE_THREADS}, {accumulate})")
    return name


def _block_loop(m: CudaModule, count: int, hint: str) -> tuple[str, str]:
    """The header of a loop giving each of ``count`` results to one block, and its
    variable: the same for every thread of the block, so all meet at each barrier."""
    item = m.fresh(hint)
    return f"for {item} in range(cuda.blockIdx.x, {count}, cuda.gridDim.x):", item


def _thread_loop(m: CudaModule, count: int, hint: str = "k") -> tuple[str, str]:
    """The header of a loop giving each thread of a block its share of ``count``
    elements, and its variable."""
    k = m.fresh(hint)
    return f"for {k} in range(cuda.threadIdx.x, {count}, cuda.blockDim.x):", k


def _launch(m: CudaModule, name: str, results: int, arrays: Sequence[str]) -> None:
    """One block per result, up to the most a grid has."""
    m.launch(name, blocks_for(results, 1), REDUCE_THREADS)


# ---------------------------------------------------------------------------------------
# Sums over axes.


def emit_sum_kernel(m: CudaModule, x: str, out: str, groups: Sequence[tuple[bool, int]],
                    dtype: DType, finish: Callable[[str], str]) -> None:
    """A kernel summing ``x`` viewed as ``groups`` (``(summed?, extent)`` per axis) over
    its summed axes into ``out`` (flat, in the order of the kept axes); ``finish``
    turns the source of a sum (float64 or int64) into what is stored."""
    kept = [extent for summed, extent in groups if not summed]
    summed = [extent for summed, extent in groups if summed]
    results, count = math.prod(kept), math.prod(summed)
    with m.kernel("sum") as (name, body):
        view, out_flat = m.view(x, [e for _, e in groups]), m.view(out, [results])
        partials = _shared(m, body, _accumulator(dtype))
        header, o = _block_loop(m, results, "o")
        with body.block(header):
            part, total = m.fresh("part"), m.fresh("total")
            body.line(f"{part} = {_accumulator(dtype)}(0)")
            loop, k = _thread_loop(m, count)
            kept_at, summed_at = iter(coordinates(o, kept)), iter(coordinates(k, summed))
            at = ", ".join(next(summed_at if s else kept_at) for s, _ in groups)
            with body.block(loop):
                body.line(f"{part} += {view}[{at}]")
            body.line(f"{total} = block_sum({partials}, {part})")
            with body.block("if cuda.threadIdx.x == 0:"):
                body.line(f"{out_flat}[{o}] = {finish(total)}")
    m.helper("block_sum")
    _launch(m, name, results, [x, out])


def _axis_groups(shape: Sequence[int], axes: Sequence[int]) -> list[tuple[bool, int]]:
    """``(summed?, extent)`` of the axes of ``shape``, neighbours alike merged and axes
    of 1 left out (at least one group)."""
    groups: list[tuple[bool, int]] = []
    for a, extent in enumerate(shape):
        if extent == 1:
            continue
        if groups and groups[-1][0] == (a in axes):
            groups[-1] = (a in axes, groups[-1][1] * extent)
        else:
            groups.append((a in axes, extent))
    return groups or [(False, 1)]


@renders("reduce_sum")
def render_reduce_sum(node: Node, m: CudaModule) -> None:
    """One block per output element (``keepdims`` changes only the output's shape)."""
    x_type, out_dtype = node.inputs[0].type, node.outputs[0].type.dtype
    groups = _axis_groups(x_type.shape, node.attrs["axes"])
    emit_sum_kernel(m, m.inputs[0], m.outputs[0], groups, x_type.dtype,
                    lambda total: _cast(total, out_dtype))


# ---------------------------------------------------------------------------------------
# Softmax and the losses: rows of classes, one block per row.


class _Rows:
    """An array viewed as (outer, classes, inner), softmax's axis in the middle: a row
    is the classes at one (outer, inner) position. (Without inner axes, as
    (rows, classes).)"""

    def __init__(self, node: Node, axis: int):
        shape = node.inputs[0].type.shape
        self.outer, self.classes = math.prod(shape[:axis]), shape[axis]
        self.inner = math.prod(shape[axis + 1:])
        self.count = self.outer * self.inner
        self.dtype = node.outputs[0].type.dtype

    def views(self, m: CudaModule, body: SourceBuilder, arrays: Sequence[str]) -> list[str]:
        shape = (self.outer, self.classes) + ((self.inner,) if self.inner > 1 else ())
        return [m.view(name, shape) for name in arrays]

    def locate(self, m: CudaModule, body: SourceBuilder, row: str
               ) -> Callable[[str, str], str]:
        """Binds the row's (outer, inner) position; returns ``at(view, c)``, the
        source of class ``c`` of the row in ``view``."""
        if self.inner == 1:
            return lambda view, c: f"{view}[{row}, {c}]"
        o, i = m.fresh("o"), m.fresh("i")
        outer_at, inner_at = coordinates(row, [self.outer, self.inner])
        body.line(f"{o}, {i} = {outer_at}, {inner_at}")
        return lambda view, c: f"{view}[{o}, {c}, {i}]"


def _row_max_and_sum(m: CudaModule, body: SourceBuilder, rows: _Rows, partials: str,
                     at: Callable[[str], str],
                     of_sum: Callable[[str], str] = lambda total: total
                     ) -> tuple[str, str]:
    """Binds the row's maximum and its sum of ``exp(x - max)`` (in the row's dtype,
    the sum added in float64, then made ``of_sum(sum)`` before it is cast), every
    thread of the block taking part; ``at(c)`` is the row's element ``c``."""
    dt = numpy_name(rows.dtype)
    high, top = m.fresh("high"), m.fresh("top")
    part, total = m.fresh("part"), m.fresh("total")
    body.line(f"{high} = {literal(-math.inf, rows.dtype)}")
    loop, c = _thread_loop(m, rows.classes, "c")
    with body.block(loop):
        body.line(f"{high} = max({high}, {at(c)})")
    body.line(f"{top} = {dt}(block_max({partials}, {high}))")
    body.line(f"{part} = 0.0")
    with body.block(loop):
        body.line(f"{part} += math.exp({at(c)} - {top})")
    body.line(f"{total} = {dt}({of_sum(f'block_sum({partials}, {part})')})")
    m.helper("block_max")
    m.helper("block_sum")
    return top, total


def _render_softmax_rows(node: Node, m: CudaModule, of_sum: Callable[[str], str],
                         store: Callable[[str, str, str], str]) -> None:
    """One block per row: its maximum and (made ``of_sum(sum)``) its sum of
    ``exp(x - max)``, then each ``y = store(x, max, that)``."""
    rows = _Rows(node, node.attrs["axis"])
    arrays = [m.inputs[0], m.outputs[0]]
    with m.kernel("rows") as (name, body):
        x, y = rows.views(m, body, arrays)
        partials = _shared(m, body, "float64")
        header, row = _block_loop(m, rows.count, "row")
        with body.block(header):
            at = rows.locate(m, body, row)
            top, total = _row_max_and_sum(m, body, rows, partials, lambda c: at(x, c), of_sum)
            loop, c = _thread_loop(m, rows.classes, "c")
            with body.block(loop):
                body.line(f"{at(y, c)} = {store(at(x, c), top, total)}")
    _launch(m, name, rows.count, arrays)


@renders("softmax")
def render_softmax(node: Node, m: CudaModule) -> None:
    """``exp(x - max) / sum exp(x - max)`` along the axis, one block per row."""
    _render_softmax_rows(node, m, lambda total: total,
                         lambda x, top, total: f"math.exp({x} - {top}) / {total}")


@renders("log_softmax")
def render_log_softmax(node: Node, m: CudaModule) -> None:
    """``x - max - log(sum exp(x - max))`` along the axis, one block per row; the log is
    taken of the float64 sum."""
    _render_softmax_rows(node, m, lambda total: f"math.log({total})",
                         lambda x, top, log_total: f"({x} - {top}) - {log_total}")


def _render_row_sum_then_map(node: Node, m: CudaModule, summand: Callable[[str, str], str],
                             result: Callable[[str, str, str], str]) -> None:
    """The softmax gradients, one block per row: the row's sum of ``summand(y, gy)``
    (in float64), then each ``gx = result(y, gy, sum)``."""
    rows = _Rows(node, node.attrs["axis"])
    arrays = m.inputs + m.outputs
    with m.kernel("rows") as (name, body):
        y, gy, gx = rows.views(m, body, arrays)
        partials = _shared(m, body, "float64")
        header, row = _block_loop(m, rows.count, "row")
        with body.block(header):
            at = rows.locate(m, body, row)
            part, total = m.fresh("part"), m.fresh("total")
            body.line(f"{part} = 0.0")
            loop, c = _thread_loop(m, rows.classes, "c")
            with body.block(loop):
                body.line(f"{part} += {summand(at(y, c), at(gy, c))}")
            body.line(f"{total} = {numpy_name(rows.dtype)}(block_sum({partials}, {part}))")
            with body.block(loop):
                body.line(f"{at(gx, c)} = {result(at(y, c), at(gy, c), total)}")
    m.helper("block_sum")
    _launch(m, name, rows.count, arrays)


@renders("softmax_grad")
def render_softmax_grad(node: Node, m: CudaModule) -> None:
    """``gx = y * (gy - sum over the axis of gy * y)``, one block per row."""
    _render_row_sum_then_map(node, m, lambda y, gy: f"{gy} * {y}",
                             lambda y, gy, dot: f"{y} * ({gy} - {dot})")


@renders("log_softmax_grad")
def render_log_softmax_grad(node: Node, m: CudaModule) -> None:
    """``gx = gy - exp(y) * sum over the axis of gy``, one block per row."""
    _render_row_sum_then_map(node, m, lambda y, gy: gy,
                             lambda y, gy, total: f"{gy} - math.exp({y}) * {total}")


def _label(m: CudaModule, body: SourceBuilder, label: str, row: str) -> str:
    name = m.fresh("cls")
    body.line(f"{name} = {label}[{row}]")
    return name


@renders("softmax_xent")
def render_softmax_xent(node: Node, m: CudaModule) -> None:
    """The batch mean of ``-(logit[label] - max - log(sum exp(logit - max)))``: one
    block, its threads sharing each row in turn; every thread keeps the same sum."""
    rows = _Rows(node, 1)
    (logits, label), (loss,) = m.inputs, m.outputs
    with m.kernel("loss") as (name, body):
        partials = _shared(m, body, "float64")
        row, loss_sum = m.fresh("row"), m.fresh("loss_sum")
        body.line(f"{loss_sum} = 0.0")
        with body.block(f"for {row} in range({rows.outer}):"):
            top, total = _row_max_and_sum(m, body, rows, partials,
                                          lambda c: f"{logits}[{row}, {c}]")
            cls = _label(m, body, label, row)
            with body.block(f"if 0 <= {cls} < {rows.classes}:"):
                log_p = f"({logits}[{row}, {cls}] - {top}) - math.log({total})"
                body.line(f"{loss_sum} += {log_p}")
            with body.block("else:"):
                body.line(f"{loss_sum} = math.nan")
        with body.block("if cuda.threadIdx.x == 0:"):
            body.line(f"{loss}[()] = {dtype_name(node)}(-({loss_sum} / {rows.outer}))")
    m.launch(name, 1, REDUCE_THREADS)


@renders("softmax_xent_grad")
def render_softmax_xent_grad(node: Node, m: CudaModule) -> None:
    """``(softmax(logits) - onehot(label)) * gy / batch``, one block per row."""
    rows = _Rows(node, 1)
    dt = node.outputs[0].type.dtype
    (logits, label, gy), (gx,) = m.inputs, m.outputs
    arrays = m.inputs + m.outputs
    with m.kernel("rows") as (name, body):
        partials = _shared(m, body, "float64")
        factor = m.fresh("factor")
        body.line(f"{factor} = {gy}[()] / {literal(rows.outer, dt)}")
        header, row = _block_loop(m, rows.count, "row")
        with body.block(header):
            top, total = _row_max_and_sum(m, body, rows, partials,
                                          lambda c: f"{logits}[{row}, {c}]")
            cls, scale = _label(m, body, label, row), m.fresh("scale")
            body.line(f"{scale} = {factor} if 0 <= {cls} < {rows.classes} else "
                      f"{literal(math.nan, dt)}")
            loop, c = _thread_loop(m, rows.classes, "c")
            p = m.fresh("p")
            with body.block(loop):
                body.line(f"{p} = math.exp({logits}[{row}, {c}] - {top}) / {total}")
                with body.block(f"if {c} == {cls}:"):
                    body.line(f"{p} -= {literal(1, dt)}")
                body.line(f"{gx}[{row}, {c}] = {p} * {scale}")
    _launch(m, name, rows.count, arrays)


@renders("accuracy")
def render_accuracy(node: Node, m: CudaModule) -> None:
    """The fraction of rows whose first largest logit is at the label: one block, a
    thread per row (a row's first maximum is a scan; a block's would need pairs of
    value and place in shared memory), the hits summed over the block."""
    rows, classes = node.inputs[0].type.shape
    (logits, label), (out,) = m.inputs, m.outputs
    with m.kernel("hits") as (name, body):
        partials = _shared(m, body, "int64")
        hits, best, c, total = (m.fresh(s) for s in ("hits", "best", "c", "total"))
        body.line(f"{hits} = int64(0)")
        loop, row = _thread_loop(m, rows, "row")
        with body.block(loop):
            body.line(f"{best} = 0")
            with body.block(f"for {c} in range(1, {classes}):"):
                with body.block(f"if {logits}[{row}, {c}] > {logits}[{row}, {best}]:"):
                    body.line(f"{best} = {c}")
            with body.block(f"if {best} == {label}[{row}]:"):
                body.line(f"{hits} += 1")
        body.line(f"{total} = block_sum({partials}, {hits})")
        with body.block("if cuda.threadIdx.x == 0:"):
            body.line(f"{out}[()] = {dtype_name(node)}({total} / {rows})")
    m.helper("block_sum")
    m.launch(name, 1, REDUCE_THREADS)
