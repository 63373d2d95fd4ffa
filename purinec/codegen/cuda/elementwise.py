"""CUDA elementwise kernels: elementwise ops, alone or fused, printed from the same
element expressions (`OpDef.expr`) the CPU's loops come from.

`emit_element` writes the statements for one element of a group of elementwise members
(each outside input loaded once, each member's expression printed through
`CUDA_FUNCTIONS`, each output stored), wherever the caller's element is: in a
grid-stride loop (`emit_loop_kernel`: one thread per element, a single node or a fused
chain alike), or in a matrix product's store (an epilogue, `purinec.codegen.cuda.gemm`).
As on the CPU, neighbouring axes along which every operand varies alike are merged
first (`purinec.codegen.elementwise.merge_axes`), so a plain elementwise kernel indexes
flat and a bias over NCHW needs one division per element.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from purinec.codegen.cpu_module import HELPERS as CPU_HELPERS
from purinec.codegen.cuda.module import HELPERS, THREADS, CudaModule, blocks_for, renders
from purinec.codegen.elementwise import merge_axes, numpy_cast, numpy_literal, varying_axes
from purinec.codegen.expr_print import PYTHON_OPERATORS, print_exprs
from purinec.codegen.kernel import CodegenError
from purinec.codegen.source import SourceBuilder
from purinec.ir.expr import Arg, Call, walk
from purinec.ir.graph import Node, Value
from purinec.ir.ops import REGISTRY, get_op


# How element expressions print in a Numba CUDA kernel: `math` functions of float32
# arguments become CUDA's single-precision ones (expf, tanhf, powf).
CUDA_FUNCTIONS = {
    **PYTHON_OPERATORS,
    "exp": "math.exp({0})", "tanh": "math.tanh({0})", "log": "math.log({0})",
    "sqrt": "math.sqrt({0})", "abs": "math.fabs({0})", "erf": "math.erf({0})",
    "pow": "math.pow({0}, {1})", "cast": numpy_cast,
    "u64": "np.uint64(np.int64({0}))", "mix64": "splitmix64({0})",
}


# The CPU's helper as a device function.
HELPERS["splitmix64"] = CPU_HELPERS["splitmix64"].replace('@njit(inline="always")',
                                                          "@cuda.jit(device=True, inline=True)")


@dataclass
class _Operand:
    """An outside input (or an output) of a group and the loop axes it varies along;
    `merge_axes` fills ``merged``."""

    value: Value
    axes: frozenset[int]
    merged: tuple[int, ...] = ()
    element: str = field(default="")


def emit_element(m: CudaModule, body: SourceBuilder, members: Sequence[Node],
                 outputs: Sequence[Value], load: Callable[[Node, int], str],
                 store: Callable[[Value, str], str], index: str,
                 prologue: SourceBuilder | None = None,
                 given: dict[Value, str] | None = None) -> None:
    """Statements into ``body`` computing one element of ``outputs`` from ``members``.

    ``load(node, i)`` is the source of input ``i`` of member ``node`` at this element
    (called once per distinct operand: the caller caches); ``store(value, text)`` the
    statement storing an output; ``index`` spells the element's flat index (for the
    expressions that use it: dropout masks). ``given`` maps values the caller computed
    already (a product's element) to their local. What depends on no per-element
    operand is bound in ``prologue`` (default: ``body``) once."""
    prologue = prologue if prologue is not None else body
    results: dict[Value, str] = dict(given or {})

    def bind(source: str, hoist: bool, hint: str = "t") -> str:
        name = m.fresh("c" if hoist else hint)
        (prologue if hoist else body).line(f"{name} = {source}")
        return name

    for node in members:
        opdef = get_op(node.op)
        if opdef.expr is None:
            raise CodegenError(f"{node!r}: op {node.op} is not elementwise; it cannot be "
                               f"part of a loop")
        args = [(results[v], False) if v in results else (load(node, i), False)
                for i, v in enumerate(node.inputs)]
        exprs = opdef.expr(node, [Arg(i) for i in range(len(args))])
        if any(isinstance(e, Call) and e.fn == "mix64" for e in walk(exprs)):
            m.helper("splitmix64")
        with body.origin(node):
            texts = print_exprs(exprs, args, CUDA_FUNCTIONS, numpy_literal, index, bind)
            for value, text in zip(node.outputs, texts):
                results[value] = bind(text, False, value.name)
    for value in outputs:
        with body.origin(value.producer or members[-1]):
            body.line(store(value, results[value]))


def emit_loop_kernel(m: CudaModule, members: Sequence[Node], arrays: dict[Value, str],
                     outputs: Sequence[Value], hint: str = "loop") -> None:
    """One grid-stride kernel computing ``outputs`` (all of one shape) from the
    elementwise ``members``, launched by the module's host function. ``arrays`` names
    the module's array of each outside input and each output."""
    with m.kernel(hint) as (name, body):
        count = emit_loop(m, body, members, arrays, outputs)
    m.launch(name, blocks_for(count), THREADS)


def emit_loop(m: CudaModule, body: SourceBuilder, members: Sequence[Node],
              arrays: dict[Value, str], outputs: Sequence[Value]) -> int:
    """The grid-stride loop of `emit_loop_kernel` into a kernel's ``body``; returns how
    many elements it covers."""
    shape = outputs[0].type.shape
    for node in members:
        for value in node.outputs:
            if value.type.shape != shape:
                raise CodegenError(f"{node!r}: output %{value.name}: {value.type} differs "
                                   f"from the loop's shape {list(shape)}; the nodes of one "
                                   f"loop must produce one shape")
    produced = {v for node in members for v in node.outputs}
    loads: dict[tuple[Value, frozenset[int]], _Operand] = {}
    for node in members:
        for i, value in enumerate(node.inputs):
            if value not in produced:
                key = (value, varying_axes(node, i))
                loads.setdefault(key, _Operand(*key))
    stores = [_Operand(v, frozenset(range(len(shape)))) for v in outputs]
    extents = [_prod(shape[a] for a in group)
               for group in merge_axes(shape, list(loads.values()) + stores)]
    count = _prod(extents)
    views: dict[tuple[Value, tuple[int, ...]], str] = {}
    for op in list(loads.values()) + stores:
        key = (op.value, op.merged)
        if key not in views:
            full = len(op.merged) == len(extents)  # indexed flat, by the loop's index
            dims = [count] if full else [extents[k] for k in op.merged] or [1]
            views[key] = m.view(arrays[op.value], dims)
    coords = _coordinates(m, extents)
    head = SourceBuilder()
    loop = SourceBuilder()
    index = m.fresh("i")

    def at(op: _Operand) -> str:
        if not op.merged:
            return "0"  # the same element everywhere (a scalar, a 1-element loop)
        if len(op.merged) == len(extents):
            return index  # varies along every axis: its flat index is the loop's
        return ", ".join(coords[k][0] for k in op.merged)

    needed = {k for op in list(loads.values()) + stores
              if 0 < len(op.merged) < len(extents) for k in op.merged}
    for k in sorted(needed):
        loop.line(f"{coords[k][0]} = {coords[k][1].format(index)}")

    def load(node: Node, i: int) -> str:
        op = loads[node.inputs[i], varying_axes(node, i)]
        if not op.element:
            op.element = m.fresh(op.value.name)
            target = loop if op.merged else head
            target.line(f"{op.element} = {views[op.value, op.merged]}[{at(op)}]")
        return op.element

    def store(value: Value, text: str) -> str:
        op = stores[list(outputs).index(value)]
        return f"{views[value, op.merged]}[{at(op)}] = {text}"

    emit_element(m, loop, members, outputs, load, store, index, prologue=head)
    body.extend(head)
    with body.block(f"for {index} in range(cuda.grid(1), {count}, cuda.gridsize(1)):"):
        body.extend(loop)
    return count


def _coordinates(m: CudaModule, extents: list[int]) -> list[tuple[str, str]]:
    """For each merged axis, a local name and the template (of the flat index) that
    computes its coordinate."""
    result = []
    for k, extent in enumerate(extents):
        stride = _prod(extents[k + 1:])
        template = "{0}" if stride == 1 else f"{{0}} // {stride}"
        if k > 0:
            template = f"({template}) % {extent}" if stride != 1 else f"{{0}} % {extent}"
        result.append((m.fresh(f"a{k}"), template))
    return result


def _prod(values) -> int:
    result = 1
    for v in values:
        result *= v
    return result


@renders(*(name for name, opdef in REGISTRY.items() if opdef.expr is not None))
def render_elementwise(node: Node, m: CudaModule) -> None:
    arrays = dict(zip(node.inputs, m.inputs)) | dict(zip(node.outputs, m.outputs))
    emit_loop_kernel(m, [node], arrays, node.outputs)

