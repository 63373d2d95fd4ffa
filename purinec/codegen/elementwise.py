"""Elementwise ops as scalar expressions, and the loop emitter that composes them.

Each elementwise or broadcast op has a *scalar rule*: given the names of scalar locals
holding one element of each input, it returns one expression per output. `emit_loop`
renders any group of such nodes whose outputs share one shape, a single node or a fused
chain alike, as one loop nest: it loads each element of each outside input once,
evaluates the members' rules in order (each result bound to a local), and stores the
group's outputs. Broadcast inputs (a bias along one axis, a 0-d scalar, a size-1 axis)
are indexed by the loop variables of the axes they vary along and loaded in the
outermost loop where they are known, so nothing is recomputed or re-read per element.

Adjacent axes along which every operand behaves alike are merged first, so a plain
elementwise kernel is one flat loop and a bias over NCHW is three loops (N, C, H*W).
Because each element is read before the same element is written, an output may alias
an input of its own shape (the memory planner reuses buffers that way). LLVM cannot
tell such an alias from a partial overlap and would not vectorize the loop, so a big
loop comes twice: storing through the input's view when the arrays coincide, and as
written otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from purinec.codegen.cpu_module import HELPERS, KernelModule, literal, numpy_name
from purinec.codegen.kernel import CodegenError
from purinec.ir.graph import Node, Value
from purinec.ir.nnref import splitmix64
from purinec.ir.types import DType

# ---------------------------------------------------------------------------------------
# Scalar rules.


@dataclass
class ScalarContext:
    """What a scalar rule may use besides its operands.

    ``index``: the element's flat C-order index in the loop's shape. ``let(expr)``
    binds ``expr`` to a new local inside the loop body and returns its name (for values a
    rule uses twice); ``hoist(expr)`` does the same before the loops, for values that
    depend only on 0-d inputs and constants.
    """

    module: KernelModule
    index: str
    body: list[tuple[str, str]] = field(default_factory=list)
    prologue: list[tuple[str, str]] = field(default_factory=list)

    def let(self, expr: str, hint: str = "t") -> str:
        name = self.module.fresh(hint)
        self.body.append((name, expr))
        return name

    def hoist(self, expr: str, hint: str = "c") -> str:
        name = self.module.fresh(hint)
        self.prologue.append((name, expr))
        return name


ScalarRule = Callable[[Node, ScalarContext, list[str]], list[str]]

SCALAR_RULES: dict[str, ScalarRule] = {}


def scalar_rule(*ops: str):
    """Register the decorated function as the scalar rule of ``ops``."""
    def register(fn: ScalarRule) -> ScalarRule:
        for op in ops:
            SCALAR_RULES[op] = fn
        return fn
    return register


def _dtype(node: Node) -> DType:
    return node.outputs[0].type.dtype


def _c(node: Node, value) -> str:
    """A constant in the node's output dtype."""
    return literal(value, _dtype(node))


@scalar_rule("relu")
def _relu(node, ctx, args):
    (x,), zero = args, _c(node, 0)
    return [f"{x} if not {x} <= {zero} else {zero}"]  # NaN passes through, as np.maximum


@scalar_rule("sigmoid")
def _sigmoid(node, ctx, args):
    (x,), one = args, _c(node, 1)
    return [f"{one} / ({one} + np.exp(-{x}))"]


@scalar_rule("tanh")
def _tanh(node, ctx, args):
    return [f"np.tanh({args[0]})"]


@scalar_rule("scale")
def _scale(node, ctx, args):
    return [f"{args[0]} * {_c(node, node.attrs['alpha'])}"]


@scalar_rule("add_scalar")
def _add_scalar(node, ctx, args):
    value = _c(node, node.attrs["value"])
    if _dtype(node) is DType.bool:  # NumPy's bool + bool is "or"
        return [f"{args[0]} or {value}"]
    return [f"{args[0]} + {value}"]


@scalar_rule("cast")
def _cast(node, ctx, args):
    (x,) = args
    src, dst = node.inputs[0].type.dtype, _dtype(node)
    if dst is DType.bool:
        return [f"{x} != 0"]
    if src is DType.bool:
        return [f"{_c(node, 1)} if {x} else {_c(node, 0)}"]
    return [f"{numpy_name(dst)}({x})"]


@scalar_rule("add", "bias_add")
def _add(node, ctx, args):
    return [f"{args[0]} + {args[1]}"]


@scalar_rule("sub")
def _sub(node, ctx, args):
    return [f"{args[0]} - {args[1]}"]


@scalar_rule("mul")
def _mul(node, ctx, args):
    return [f"{args[0]} * {args[1]}"]


@scalar_rule("relu_grad")
def _relu_grad(node, ctx, args):
    (x, gy), zero = args, _c(node, 0)
    return [f"{gy} if {x} > {zero} else {zero}"]


@scalar_rule("sigmoid_grad")
def _sigmoid_grad(node, ctx, args):
    (y, gy), one = args, _c(node, 1)
    return [f"{gy} * {y} * ({one} - {y})"]


@scalar_rule("tanh_grad")
def _tanh_grad(node, ctx, args):
    (y, gy), one = args, _c(node, 1)
    return [f"{gy} * ({one} - {y} * {y})"]


@scalar_rule("broadcast_to")
def _broadcast_to(node, ctx, args):
    return [args[0]]


@scalar_rule("global_avg_pool_grad")
def _global_avg_pool_grad(node, ctx, args):
    _, _, h, w = node.attrs["input_shape"]
    return [f"{args[0]} / {_c(node, h * w)}"]


@scalar_rule("fill")
def _fill(node, ctx, args):
    return [_c(node, node.attrs["value"])]


@scalar_rule("sgd")
def _sgd(node, ctx, args):
    w, h, g = args
    lr, momentum, decay = (_c(node, node.attrs[k]) for k in ("lr", "momentum", "weight_decay"))
    update = ctx.let(f"{momentum} * {h} + {lr} * ({g} + {decay} * {w})", "update")
    return [f"{w} - {update}", update]


HELPERS["splitmix64"] = '''\
@njit(inline="always")
def splitmix64(z):
    # purinec.ir.nnref.splitmix64 on uint64, wrapping modulo 2**64
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))'''


@scalar_rule("dropout_mask")
def _dropout_mask(node, ctx, args):
    """nnref.dropout_mask bit for bit: ``key = splitmix64(splitmix64(seed) ^ iteration)``
    (iteration in two's complement modulo 2**64), ``h = splitmix64(key ^ i)``, dropped
    where ``(h >> 11) < ceil(p * 2**53)``, the exact integer form of ``u < p``."""
    (iteration,) = args
    mix = ctx.module.helper("splitmix64")
    p = node.attrs["p"]
    seeded = splitmix64(node.attrs["seed"] & 0xFFFFFFFFFFFFFFFF)
    key = ctx.hoist(f"{mix}(np.uint64({seeded}) ^ np.uint64(np.int64({iteration})))", "key")
    bits = ctx.let(f"{mix}({key} ^ np.uint64({ctx.index})) >> np.uint64(11)", "bits")
    threshold = math.ceil(p * 2.0 ** 53)  # exact: p * 2**53 is a float64 product by 2**53
    keep = _c(node, 1.0 / (1.0 - p))
    return [f"{_c(node, 0)} if {bits} < np.uint64({threshold}) else {keep}"]


# ---------------------------------------------------------------------------------------
# How each input of an elementwise or broadcast op lines up with its output.


def input_axes(node: Node, i: int) -> tuple[int | None, ...]:
    """For each axis of input ``i``, the output axis it runs along, or None where the
    input has size 1 and is broadcast. NumPy's right-aligned broadcasting, except for
    ``bias_add``'s bias, which runs along the ``axis`` attribute."""
    value = node.inputs[i]
    out_shape = node.outputs[0].type.shape
    if node.op == "bias_add" and i == 1:
        return (node.attrs["axis"],)
    shape = value.type.shape
    offset = len(out_shape) - len(shape)
    if offset < 0:
        raise CodegenError(f"{node!r}: input %{value.name} has more axes than the output")
    axes = []
    for d, size in enumerate(shape):
        if size == out_shape[offset + d]:
            axes.append(offset + d)
        elif size == 1:
            axes.append(None)
        else:
            raise CodegenError(f"{node!r}: input %{value.name}: {value.type} does not "
                               f"broadcast to {node.outputs[0].type}")
    return tuple(axes)


# ---------------------------------------------------------------------------------------
# The loop emitter.


@dataclass
class _Operand:
    """An array the loop reads or writes, and the loop axes it varies along."""

    array: str  # source of the array (perhaps one image of it: ``x[n]``)
    hint: str  # what to name its locals after
    axes: frozenset[int]  # loop axes (before merging) it varies along
    merged: tuple[int, ...] = ()  # merged loop axes it varies along
    view: str = ""  # the array reshaped to its merged axes
    element: str = ""  # the local holding the current element (inputs only)


def emit_loop(module: KernelModule, members: Sequence[Node], arrays: dict[Value, str],
              outputs: Sequence[Value], outer: str | None = None,
              local: frozenset[Value] = frozenset(),
              columns: tuple[str, str] | None = None) -> None:
    """Write into ``module.body`` one loop nest computing ``outputs`` from ``members``.

    ``members`` are elementwise/broadcast nodes in dependency order, each with a scalar
    rule and every output of the shape of ``outputs``; ``arrays`` names the kernel's
    array for each value read from outside the group and for each of ``outputs``.

    With ``outer`` (an index expression), the loop covers only ``[outer, ...]``: one
    image or row, as an epilogue inside its producer's loop. Arrays varying along axis
    0 are then indexed at ``outer``, except the ``local`` ones, which hold just that
    image already (a producer's scratch). With ``columns`` too (``lo, hi``), only that
    block of a row: a matmul computed in blocks of columns. Otherwise the outermost
    loop may become the kernel's blocked loop (`KernelModule.split`).
    """
    shape = outputs[0].type.shape
    _check_group(members, outputs, shape)
    first = 1 if outer is not None else 0  # loops run over shape[first:]

    def operand(value: Value, axes: frozenset[int]) -> _Operand:
        array = arrays[value]
        if first and 0 in axes and value not in local:
            array = f"{array}[{outer}]"
        return _Operand(array, value.name, frozenset(a - first for a in axes if a >= first))

    produced = {v for n in members for v in n.outputs}
    loads: dict[tuple[Value, frozenset[int]], _Operand] = {}
    for node in members:
        for i, value in enumerate(node.inputs):
            if value not in produced:
                key = (value, _varying_axes(node, i))
                if key not in loads:
                    loads[key] = operand(*key)
    stores = [operand(v, frozenset(range(len(shape)))) for v in outputs]
    extents = _merge_axes(shape[first:], list(loads.values()) + stores)
    loop_vars = [module.fresh(f"i{k}") for k in range(len(extents))]
    for op in loads.values():
        op.element = module.fresh(op.hint)
    # The outermost loop over lo:hi when the kernel is blocked. It counts from 0 over
    # views sliced to the block: a loop from ``lo`` would index with a variable of
    # unknown sign, and Numba's negative-index wraparound then keeps LLVM from
    # vectorizing (4-8x slower on a flat loop).
    bounds = ("0", str(extents[0])) if extents else None
    if extents and not first:
        bounds = module.split(extents[0], _prod(shape))
    if extents and columns is not None:
        bounds = columns
    block_start = bounds[0] if bounds and bounds[0] != "0" else None

    # Evaluate the members' rules in order; each result becomes a local.
    index = _flat_index([f"({v} + {block_start})" if k == 0 and block_start else v
                         for k, v in enumerate(loop_vars)], extents)
    if first:
        index = f"({outer} * {_prod(shape[1:])} + {index})"
    ctx = ScalarContext(module, index)
    results: dict[Value, str] = {}
    statements: list[tuple[Node, list[tuple[str, str]]]] = []
    for node in members:
        ctx.body = []
        args = [results[v] if v in produced else loads[(v, _varying_axes(node, i))].element
                for i, v in enumerate(node.inputs)]
        exprs = SCALAR_RULES[node.op](node, ctx, args)
        for value, expr in zip(node.outputs, exprs):
            results[value] = ctx.let(expr, value.name)
        statements.append((node, ctx.body))

    body = module.body
    count = (f"{bounds[1]} - {block_start}" if block_start else bounds[1]) if extents else ""
    operands = [(value, op) for (value, _), op in loads.items()] + list(zip(outputs, stores))
    with body.origin(*members):
        for value, op in operands:
            op.view = module.fresh(op.hint + "_v")
            dims = [str(extents[k]) for k in op.merged] or ["1"]
            sliced = ""
            if block_start is not None and 0 in op.merged:
                if value in local:  # a producer's scratch holds just the block already
                    dims[0] = count
                else:
                    sliced = f"[{block_start}:{bounds[1]}]"
            body.line(f"{op.view} = {op.array}.reshape(({', '.join(dims)},)){sliced}")
        for op in loads.values():
            if not op.merged:  # the same element everywhere: read it once
                body.line(f"{op.element} = {op.view}[0]")
        for name, expr in ctx.prologue:
            body.line(f"{name} = {expr}")

    def nest(store_views: dict[int, str]) -> None:
        """The loops, storing output k into ``store_views[k]`` (default: its view)."""
        with body.origin(*members):
            _open_loops(module, loop_vars, extents, list(loads.values()), count)
        with body.indent(len(extents)):
            for node, lines in statements:
                with body.origin(node):
                    for name, expr in lines:
                        body.line(f"{name} = {expr}")
            for k, (op, value) in enumerate(zip(stores, outputs)):
                with body.origin(value.producer or members[-1]):
                    view = store_views.get(k, op.view)
                    body.line(f"{view}[{_index(op, loop_vars)}] = {results[value]}")

    pairs = _in_place_pairs(loads, stores, outputs, local)
    if not pairs or _prod(shape) < IN_PLACE_MIN:
        nest({})
        return
    # The memory planner often puts an output over an input of its shape (an SGD step
    # updates the weight and its history in place). LLVM cannot tell "the same array"
    # from "overlapping", so it would run such a loop unvectorized; storing through the
    # input's own view when the arrays coincide lets it vectorize (an SGD step: 3x).
    same = " and ".join(f"{arrays[outputs[k]]}.ctypes.data == {arrays[value]}.ctypes.data"
                        for k, value, _ in pairs)
    with body.origin(*members), body.block(f"if {same}:"):
        nest({k: load.view for k, _, load in pairs})
    with body.origin(*members), body.block("else:"):
        nest({})


# Outputs of fewer elements than this take a few microseconds unvectorized: not worth
# compiling a second copy of their loop for.
IN_PLACE_MIN = 4096


def _in_place_pairs(loads: dict, stores: list[_Operand], outputs: Sequence[Value],
                    local: frozenset[Value]) -> list[tuple[int, Value, _Operand]]:
    """For each output k, the first input not yet paired that the memory planner could
    put it over: of its type and read at every element (not a producer's scratch)."""
    pairs, taken = [], set()
    for k, (out, store) in enumerate(zip(outputs, stores)):
        for (value, _), load in loads.items():
            if (value not in taken and value not in local and value.type == out.type
                    and load.axes == store.axes):
                taken.add(value)
                pairs.append((k, value, load))
                break
    return pairs


def _open_loops(module, loop_vars, extents, loads, count: str) -> None:
    """The loop headers (the outermost over ``count``), each followed by the loads of
    operands whose last varying axis it is. Leaves the body's indentation where it was:
    the caller indents the nest."""
    body = module.body
    for k, (var, extent) in enumerate(zip(loop_vars, extents)):
        with body.indent(k):
            body.line(f"for {var} in range({count if k == 0 else extent}):")
        with body.indent(k + 1):
            for op in loads:
                if op.merged and op.merged[-1] == k:
                    body.line(f"{op.element} = {op.view}[{_index(op, loop_vars)}]")


def _index(op: _Operand, loop_vars: list[str]) -> str:
    return ", ".join(loop_vars[k] for k in op.merged) if op.merged else "0"


def _check_group(members: Sequence[Node], outputs: Sequence[Value], shape) -> None:
    for node in members:
        if node.op not in SCALAR_RULES:
            raise CodegenError(f"{node!r}: op {node.op} is not elementwise; it cannot be "
                               f"part of a loop")
        for value in node.outputs:
            if value.type.shape != shape:
                raise CodegenError(f"{node!r}: output %{value.name}: {value.type} differs "
                                   f"from the loop's shape {list(shape)}; the nodes of one "
                                   f"loop must produce one shape")
    for value in outputs:
        if value.type.shape != shape:
            raise CodegenError(f"loop outputs differ in shape: %{value.name}: {value.type} "
                               f"vs {list(shape)}")


def _varying_axes(node: Node, i: int) -> frozenset[int]:
    return frozenset(a for a in input_axes(node, i) if a is not None)


def _merge_axes(shape, operands: list[_Operand]) -> list[int]:
    """Drop size-1 axes and merge neighbours along which every operand varies alike
    (for C-contiguous arrays that is a plain reshape). Returns the merged extents and
    sets each operand's ``merged`` axes."""
    groups: list[list[int]] = []
    for a, size in enumerate(shape):
        if size == 1:
            continue
        if groups and all((a in op.axes) == (groups[-1][-1] in op.axes) for op in operands):
            groups[-1].append(a)
        else:
            groups.append([a])
    for op in operands:
        op.merged = tuple(k for k, g in enumerate(groups) if g[0] in op.axes)
    return [_prod(shape[a] for a in g) for g in groups]


def _prod(values) -> int:
    result = 1
    for v in values:
        result *= v
    return result


def _flat_index(loop_vars: list[str], extents: list[int]) -> str:
    """The C-order flat index of the current element (merging keeps C order)."""
    terms = []
    for k, var in enumerate(loop_vars):
        stride = _prod(extents[k + 1:])
        terms.append(var if stride == 1 else f"{var} * {stride}")
    return "(" + " + ".join(terms) + ")" if terms else "0"
