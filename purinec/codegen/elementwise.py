"""The CPU's loop emitter: elementwise ops, alone or fused, as Numba loops.

Each elementwise or broadcast op has an *element expression* (`OpDef.expr`, see
`purinec.ir.expr`): from one expression per input element, one per output. `emit_loop`
renders any group of such nodes whose outputs share one shape, a single node or a fused
chain alike, as one loop nest: it loads each element of each outside input once,
prints the members' expressions in order (each result bound to a local; through
`CPU_FUNCTIONS`, the CPU's spelling of each function), and stores the group's outputs.
Broadcast inputs (a bias along one axis, a 0-d scalar, a size-1 axis) are indexed by
the loop variables of the axes they vary along and loaded in the outermost loop where
they are known, so nothing is recomputed or re-read per element.

Adjacent axes along which every operand behaves alike are merged first, so a plain
elementwise kernel is one flat loop and a bias over NCHW is three loops (N, C, H*W).
Because each element is read before the same element is written, an output may alias
an input of its own shape (the memory planner reuses buffers that way). LLVM cannot
tell such an alias from a partial overlap and would not vectorize the loop, so a big
loop comes twice: storing through the input's view when the arrays coincide, and as
written otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from purinec.codegen.cpu_module import HELPERS, KernelModule, atom, literal, numpy_name
from purinec.codegen.expr_print import PYTHON_OPERATORS, print_exprs
from purinec.codegen.kernel import CodegenError
from purinec.ir.expr import U64, Arg, Call, Const, walk
from purinec.ir.graph import Node, Value
from purinec.ir.ops import get_op
from purinec.ir.types import DType

# ---------------------------------------------------------------------------------------
# How the CPU prints element expressions (purinec.ir.expr): Numba-compiled Python.


def numpy_cast(call: Call, args: list[str]) -> str:
    """A cast printed as NumPy's scalar constructor (``np.float32(x)``), which Numba
    compiles for the CPU and for CUDA alike."""
    return f"{numpy_name(DType(call.dtype))}({args[0]})"


CPU_FUNCTIONS = {
    **PYTHON_OPERATORS,
    "exp": "np.exp({0})", "tanh": "np.tanh({0})", "log": "np.log({0})",
    "sqrt": "np.sqrt({0})", "abs": "np.abs({0})", "erf": "math.erf({0})",
    "pow": "np.power({0}, {1})", "cast": numpy_cast,
    "u64": "np.uint64(np.int64({0}))", "mix64": "splitmix64({0})",
}


def numpy_literal(const: Const) -> str:
    """A constant of exactly its type, for the CPU and for CUDA alike."""
    if const.dtype == U64:
        return f"np.uint64({int(const.value)})"
    return literal(const.value, DType(const.dtype))


HELPERS["splitmix64"] = '''\
@njit(inline="always")
def splitmix64(z):
    # purinec.ir.nnref.splitmix64 on uint64, wrapping modulo 2**64
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))'''


# ---------------------------------------------------------------------------------------
# How each input of an elementwise or broadcast op lines up with its output.


def input_axes(node: Node, i: int) -> tuple[int | None, ...]:
    """For each axis of input ``i``, the output axis it runs along, or None where the
    input has size 1 and is broadcast. NumPy's right-aligned broadcasting, except for
    an input its op aligns otherwise (`OpDef.aligned`: ``bias_add``'s bias runs along
    its ``axis`` attribute)."""
    value = node.inputs[i]
    out_shape = node.outputs[0].type.shape
    aligned = get_op(node.op).aligned
    axes = aligned(node.attrs, i) if aligned is not None else None
    if axes is not None:
        return axes
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
    shape: tuple[int, ...] | None = None  # the shape of ``array``, where known
    view: str = ""  # the array reshaped to its merged axes
    element: str = ""  # the local holding the current element (inputs only)


def emit_loop(module: KernelModule, members: Sequence[Node], arrays: dict[Value, str],
              outputs: Sequence[Value], outer: str | None = None,
              local: frozenset[Value] = frozenset(),
              block: tuple[int, str, str] | None = None,
              sizes: tuple[int, ...] | None = None) -> None:
    """Write into ``module.body`` one loop nest computing ``outputs`` from ``members``.

    ``members`` are elementwise/broadcast nodes in dependency order, each with a scalar
    rule and every output of the shape of ``outputs``; ``arrays`` names the kernel's
    array for each value read from outside the group and for each of ``outputs``.

    With ``outer`` (an index expression), the loop covers only ``[outer, ...]``: one
    image or row, as an epilogue inside its producer's loop. Arrays varying along axis
    0 are then indexed at ``outer``, except the ``local`` ones, which hold just that
    image already (a producer's scratch). With ``block`` too (``axis, lo, hi``), only
    indices ``lo:hi`` along output axis ``axis``: the block of a row a matmul computed
    by columns, or of an image's output rows a convolution computed. Otherwise the
    outermost loop may become the kernel's blocked loop (`KernelModule.split`).
    ``sizes``: the outputs' shape as the producer computed with it, some of it
    `purinec.codegen.extent.Extent`s read from its arrays (default: the outputs' type).
    """
    shape = sizes or outputs[0].type.shape
    _check_group(members, outputs, shape)
    first = 1 if outer is not None else 0  # loops run over shape[first:]

    def operand(value: Value, axes: frozenset[int]) -> _Operand:
        array, shape = arrays[value], _shape_along(value.type.shape, axes, sizes)
        if first and 0 in axes and value not in local:
            array, shape = f"{array}[{outer}]", shape[1:]
        return _Operand(array, value.name, frozenset(a - first for a in axes if a >= first),
                        shape=None if value in local else shape)

    produced = {v for n in members for v in n.outputs}
    loads: dict[tuple[Value, frozenset[int]], _Operand] = {}
    for node in members:
        for i, value in enumerate(node.inputs):
            if value not in produced:
                key = (value, varying_axes(node, i))
                if key not in loads:
                    loads[key] = operand(*key)
    stores = [operand(v, frozenset(range(len(shape)))) for v in outputs]
    cut = block[0] - first if block else None
    groups = merge_axes(shape[first:], list(loads.values()) + stores, cut)
    extents = [_prod(shape[first + a] for a in group) for group in groups]
    loop_vars = [module.fresh(f"i{k}") for k in range(len(extents))]
    for op in loads.values():
        op.element = module.fresh(op.hint)
    # One loop (``blocked``, the outermost unless ``block`` says) runs over
    # ``bounds``: lo:hi when the kernel is blocked. It counts from 0 over views sliced
    # to the block: a loop from ``lo`` would index with a variable of unknown sign, and
    # Numba's negative-index wraparound then keeps LLVM from vectorizing (4-8x slower
    # on a flat loop).
    blocked = 0
    # A flat loop over whole arrays reads its length from them, so nodes differing in
    # size only (one layer's gradient and another's, at any batch) share its code and
    # compile it once, in a process and in the kernel cache.
    length = _length_of(module, groups, first, block, list(loads.values()) + stores)
    bounds = ("0", str(extents[0])) if extents else None
    if extents and not first:
        bounds = module.split(extents[0], _prod(shape), extent=length)
    restricted = [k for k, group in enumerate(groups) if block and group[0] >= cut]
    if restricted:  # the block's indices times the size of the axes merged after it
        blocked = restricted[0]
        inner = _prod(shape[first + a] for a in groups[blocked] if a > cut)
        bounds = tuple(bound if inner == 1 else f"{atom(bound)} * {inner}"
                       for bound in block[1:])
    block_start = bounds[0] if bounds and bounds[0] != "0" else None

    # Evaluate the members' rules in order; each result becomes a local.
    index = _flat_index([f"({v} + {block_start})" if k == blocked and block_start else v
                         for k, v in enumerate(loop_vars)], extents)
    if first:
        index = f"({outer} * {_prod(shape[1:])} + {index})"
    # Each member's statements in the loop body; what depends on no per-element operand
    # goes into the prologue, before the loops.
    prologue: list[tuple[str, str]] = []
    results: dict[Value, str] = {}
    statements: list[tuple[Node, list[tuple[str, str]]]] = []

    def bind(source: str, hoist: bool, hint: str = "t") -> str:
        name = module.fresh("c" if hoist else hint)
        (prologue if hoist else statements[-1][1]).append((name, source))
        return name

    for node in members:
        statements.append((node, []))
        args = [(results[v], False) if v in produced
                else _loaded(loads[v, varying_axes(node, i)])
                for i, v in enumerate(node.inputs)]
        texts = _print_expressions(module, node, args, index, bind)
        for value, text in zip(node.outputs, texts):
            results[value] = bind(text, False, value.name)

    body = module.body
    count = (f"{bounds[1]} - {block_start}" if block_start else bounds[1]) if extents else ""
    operands = list(loads.values()) + stores
    rows: list[str] = []  # views of rows sliced to the block, made in the loops around it
    with body.origin(*members):
        if length and (count == length or not all(_has_shape(op, [length], length)
                                                   for op in operands)):
            body.line(f"{length} = {stores[0].array}.size")
        for op in operands:
            op.view = module.fresh(op.hint + "_v")
            dims = [length or str(extents[k]) for k in op.merged] or ["1"]
            sliced = block_start is not None and blocked in op.merged
            outside = [loop_vars[k] for k in op.merged if k < blocked]
            block_slice = f"{block_start}:{bounds[1]}" if sliced else ""
            # (a view of the shape it has would cost Numba compiling, for nothing)
            whole = op.array if _has_shape(op, dims, length) else module.view(op.array, dims)
            body.line(f"{op.view} = {whole}[{block_slice}]" if sliced and not outside
                      else f"{op.view} = {whole}")
            if sliced and outside:  # ``v[:, a:b]`` is not contiguous: Numba would not
                # vectorize loops over it; ``v[i, a:b]`` is
                row = module.fresh(op.hint + "_r")
                rows.append(f"{row} = {op.view}[{', '.join(outside)}, {block_slice}]")
                op.view, op.merged = row, tuple(k for k in op.merged if k >= blocked)
        for op in loads.values():
            if not op.merged:  # the same element everywhere: read it once
                body.line(f"{op.element} = {op.view}[0]")
        for name, expr in prologue:
            body.line(f"{name} = {expr}")

    def nest(store_views: dict[int, str]) -> None:
        """The loops, storing output k into ``store_views[k]`` (default: its view)."""
        with body.origin(*members):
            _open_loops(module, loop_vars, extents, list(loads.values()), blocked, count, rows)
        with body.indent(len(extents)):
            for node, lines in statements:
                with body.origin(node):
                    for name, expr in lines:
                        body.line(f"{name} = {expr}")
            for k, (op, value) in enumerate(zip(stores, outputs)):
                with body.origin(value.producer or members[-1]):
                    view = store_views.get(k, op.view)
                    body.line(f"{view}[{_index(op, loop_vars)}] = {results[value]}")

    # The memory planner often puts an output over an input of its shape (an SGD step
    # updates the weight and its history in place), and an epilogue rewrites its
    # anchor's result where it lies (`anchor_destination`). LLVM cannot tell "the same
    # array" from "overlapping", so it would run such a loop unvectorized; storing
    # through the input's own view lets it vectorize (an SGD step: 3x). Where the two
    # are one array by name that is the loop; where they may coincide, a test picks.
    pairs = _in_place_pairs(loads, stores, outputs, local, arrays)
    known = {k: load.view for k, value, load in pairs if arrays[outputs[k]] == arrays[value]}
    maybe = [(k, value, load) for k, value, load in pairs if k not in known]
    # (a loop reading its length from its arrays serves every size: it has both copies)
    if not maybe or (length is None and _prod(shape) < IN_PLACE_MIN):
        nest(known)
        return
    same = " and ".join(f"{arrays[outputs[k]]}.ctypes.data == {arrays[value]}.ctypes.data"
                        for k, value, _ in maybe)
    with body.origin(*members), body.block(f"if {same}:"):
        nest(known | {k: load.view for k, _, load in maybe})
    with body.origin(*members), body.block("else:"):
        nest(known)


def _has_shape(op: _Operand, dims: list[str], length: str | None) -> bool:
    """Whether ``op``'s array has the shape ``dims`` already (``length``: the flat
    loop's length, read from an array of the shape of every operand)."""
    if op.shape is None:
        return False
    if length is not None:
        return dims == [length] and len(op.shape) == 1
    return tuple(map(str, op.shape)) == tuple(dims)


def _length_of(module: KernelModule, groups: list[list[int]], first: int, block,
               operands: list[_Operand]) -> str | None:
    """A local for the loop's length (read from its first output's size), if the loop
    is one flat loop over whole arrays: every operand varies along all of its axes, and
    it is no epilogue inside a producer's loop. Else None: lengths are literals."""
    if first or block or len(groups) != 1 or any(op.merged != (0,) for op in operands):
        return None
    return module.fresh("n")


# Outputs of fewer elements than this take a few microseconds unvectorized: not worth
# compiling a second copy of their loop for, where the loop is for their size only.
IN_PLACE_MIN = 4096


def _in_place_pairs(loads: dict, stores: list[_Operand], outputs: Sequence[Value],
                    local: frozenset[Value], arrays: dict[Value, str]
                    ) -> list[tuple[int, Value, _Operand]]:
    """For each output k, an input not yet paired that the memory planner could put it
    over (of its type and read at every element, not a producer's scratch): the one in
    the same array if there is one, else the first."""
    pairs, taken = [], set()
    for k, (out, store) in enumerate(zip(outputs, stores)):
        fits = [(value, load) for (value, _), load in loads.items()
                if value not in taken and value not in local and value.type == out.type
                and load.axes == store.axes]
        if fits:
            value, load = next(((value, load) for value, load in fits
                                if arrays[value] == arrays[out]), fits[0])
            taken.add(value)
            pairs.append((k, value, load))
    return pairs


def _open_loops(module, loop_vars, extents, loads, blocked: int, count: str,
                rows: list[str]) -> None:
    """The loop headers (loop ``blocked`` over ``count``, after the lines ``rows``),
    each followed by the loads of operands whose last varying axis it is. Leaves the
    body's indentation where it was: the caller indents the nest."""
    body = module.body
    for k, (var, extent) in enumerate(zip(loop_vars, extents)):
        with body.indent(k):
            if k == blocked:
                body.lines(rows)
            body.line(f"for {var} in range({count if k == blocked else extent}):")
        with body.indent(k + 1):
            for op in loads:
                if op.merged and op.merged[-1] == k:
                    body.line(f"{op.element} = {op.view}[{_index(op, loop_vars)}]")


def _index(op: _Operand, loop_vars: list[str]) -> str:
    return ", ".join(loop_vars[k] for k in op.merged) if op.merged else "0"


def _loaded(load: _Operand) -> tuple[str, bool]:
    """A loaded element's local, and whether it is the same at every element."""
    return load.element, not load.merged


def _print_expressions(module: KernelModule, node: Node, args: list[tuple[str, bool]],
                       index: str, bind) -> list[str]:
    """The source of each output of ``node``'s element expression over ``args``."""
    exprs = get_op(node.op).expr(node, [Arg(i) for i in range(len(args))])
    used = {e.fn for e in walk(exprs) if isinstance(e, Call)}
    if "mix64" in used:
        module.helper("splitmix64")
    if "erf" in used:
        module.import_line("import math")  # NumPy has no erf; Numba compiles math.erf
    return print_exprs(exprs, args, CPU_FUNCTIONS, numpy_literal, index, bind)


def _check_group(members: Sequence[Node], outputs: Sequence[Value], shape) -> None:
    for node in members:
        if get_op(node.op).expr is None:
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


def _shape_along(shape: tuple[int, ...], axes: frozenset[int],
                 sizes: tuple[int, ...] | None) -> tuple[int, ...]:
    """The shape of an operand varying along the loop's ``axes``, its sizes taken from
    the loop's ``sizes`` (which may be `Extent`s): the operand's axes longer than 1
    run along those loop axes longer than 1, in order. Where a size differs from the
    operand's own (a mismatch this rule did not foresee) the operand's stays."""
    if sizes is None:
        return shape
    along = iter(a for a in sorted(axes) if sizes[a] != 1)
    sized = []
    for size in shape:
        axis = next(along, None) if size != 1 else None
        sized.append(sizes[axis] if axis is not None and sizes[axis] == size else size)
    return tuple(sized)


def varying_axes(node: Node, i: int) -> frozenset[int]:
    return frozenset(a for a in input_axes(node, i) if a is not None)


def merge_axes(shape, operands: list[_Operand], cut: int | None = None) -> list[list[int]]:
    """Drop size-1 axes and merge neighbours along which every operand varies alike
    (for C-contiguous arrays that is a plain reshape), never axis ``cut`` with the one
    before. Returns the groups of merged axes and sets each operand's ``merged`` ones."""
    groups: list[list[int]] = []
    for a, size in enumerate(shape):
        if size == 1:
            continue
        if groups and a != cut and \
                all((a in op.axes) == (groups[-1][-1] in op.axes) for op in operands):
            groups[-1].append(a)
        else:
            groups.append([a])
    for op in operands:
        op.merged = tuple(k for k, g in enumerate(groups) if g[0] in op.axes)
    return groups


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
