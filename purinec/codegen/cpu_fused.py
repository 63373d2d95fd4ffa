"""CPU renderer of fused nodes, the three shapes of group `purinec.passes.fuse` makes.

* epilogue: a ``conv2d`` or ``matmul`` anchor, then elementwise members run on each of
  its images (or rows; a product computed in blocks of columns: each row's block) as
  soon as it is computed; an anchor output nobody outside the node reads lives only in
  a scratch;
* loop: elementwise and broadcast members whose outputs have one shape, one loop;
* horizontal: members of several shapes that do not read one another (the solver's
  updates): each member its own kernel (`members_apart`), run one after another.

The loops come from the element expressions and loop emitter of `purinec.codegen.elementwise`,
the ones single elementwise nodes use.
"""

from __future__ import annotations

from purinec.codegen.cpu_conv import emit_conv2d, emit_matmul
from purinec.codegen.cpu_module import KernelModule, renders
from purinec.codegen.cpu_ops import span_of
from purinec.codegen.elementwise import emit_loop
from purinec.codegen.kernel import CodegenError
from purinec.ir.graph import Node, Value, anchor_destination
from purinec.ir.ops import Trait, op_has


@renders("fused")
def render_fused(node: Node, m: KernelModule) -> None:
    """Two of the three shapes of group the fuse pass makes: a conv2d or matmul with an
    elementwise epilogue; elementwise members of one shape, one loop. The third,
    members that do not read one another (the solver's updates), is no one kernel: each
    member is a kernel of its own (`members_apart`)."""
    arrays = dict(zip(node.inputs, m.inputs)) | dict(zip(node.outputs, m.outputs))
    body = node.body
    if op_has(body[0].op, Trait.epilogue_anchor):
        _render_epilogue(node, m, arrays)
        return
    if members_apart(node):
        raise CodegenError(f"fused node {node!r}: its members run apart, each a kernel "
                           f"of its own; there is no one module for it")
    emit_loop(m, body, arrays, node.outputs)


def members_apart(node: Node) -> bool:
    """Whether fused ``node`` is a horizontal group: members of several shapes that do
    not read one another, run one after another, each its own kernel. Apart, one
    member's code serves every size (a flat loop), so a model's updates compile once or
    twice, where one module of all of them compiled its loop once per member (lenet's
    six updates: 1.7 s)."""
    if node.body is None or op_has(node.body[0].op, Trait.epilogue_anchor):
        return False
    if len({v.type.shape for member in node.body for v in member.outputs}) == 1:
        return False
    defined = {v for member in node.body for v in member.outputs}
    if any(v in defined for member in node.body for v in member.inputs):
        raise CodegenError(f"fused node {node!r}: members of several shapes that read one "
                           f"another cannot be one loop nor independent loops")
    if any(v not in node.outputs for v in defined):
        raise CodegenError(f"fused node {node!r}: a member of a horizontal group defines a "
                           f"value its node does not export")
    return True


def _render_epilogue(node: Node, m: KernelModule, arrays: dict[Value, str]) -> None:
    """The anchor, then the elementwise members on each of its images (or rows) as soon
    as it is computed. An anchor output nobody outside reads lives in a scratch array
    only."""
    anchor = node.body[0]
    (produced,) = anchor.outputs
    outputs = [v for v in node.outputs if v is not produced]
    if not outputs:
        raise CodegenError(f"fused node {node!r}: its epilogue exports nothing")
    try:
        render = EPILOGUES[anchor.op]
    except KeyError:
        raise CodegenError(f"fused node {node!r}: the cpu target has no epilogue renderer "
                           f"for anchor op {anchor.op}") from None
    render(node, m, arrays, outputs)


def _conv2d_epilogue(node: Node, m: KernelModule, arrays: dict[Value, str],
                     outputs: list[Value]) -> None:
    """The convolution image by image (or block of rows or of channels), each image's
    epilogue on what was just computed of it: into the output it exports, else where
    the members rewrite it in place (`anchor_destination`), else a scratch."""
    anchor, rest = node.body[0], node.body[1:]
    (produced,) = anchor.outputs
    into = produced if produced in node.outputs else anchor_destination(node)

    def epilogue(n: str, scratch: str | None, block: tuple | None,
                 sizes: tuple[int, ...]) -> None:
        local = dict(arrays)
        local[produced] = scratch if scratch is not None else arrays[into]
        emit_loop(m, rest, local, outputs, outer=n,
                  local=frozenset([produced]) if scratch else frozenset(),
                  block=block, sizes=sizes)
    with m.body.origin(anchor):
        emit_conv2d(anchor, m, *[arrays[v] for v in anchor.inputs],
                    arrays[into] if into is not None else None, epilogue)


def _matmul_epilogue(node: Node, m: KernelModule, arrays: dict[Value, str],
                     outputs: list[Value]) -> None:
    """The product (in blocks of rows or columns) into the output it exports, else
    where the members rewrite it in place (`anchor_destination`), else a scratch; then
    the epilogue on each row of the block."""
    anchor, rest = node.body[0], node.body[1:]
    (produced,) = anchor.outputs
    into = produced if produced in node.outputs else anchor_destination(node)
    with m.body.origin(anchor):
        lo, hi, by_columns = emit_matmul(anchor, m, *[arrays[v] for v in anchor.inputs],
                                         arrays[into] if into is not None else None)
    r = m.fresh("r")
    rows = produced.type.shape[0]
    with m.body.block(f"for {r} in range({rows if by_columns else span_of(lo, hi)}):"):
        local = dict(arrays)
        if into is not None:
            local[produced] = arrays[into]
        else:
            local[produced] = (f"product[{r}]" if by_columns or lo == "0"
                               else f"product[{r} - {lo}]")
        emit_loop(m, rest, local, outputs, outer=r,
                  local=frozenset() if into is not None else frozenset([produced]),
                  block=(1, lo, hi) if by_columns and lo != "0" else None)


# The renderer of each epilogue anchor's op (`Trait.epilogue_anchor`) and its epilogue.
EPILOGUES = {"conv2d": _conv2d_epilogue, "conv2d_panels": _conv2d_epilogue,
             "matmul": _matmul_epilogue}
