"""CUDA renderer of fused nodes, the three shapes of group `purinec.passes.fuse` makes:

* epilogue: a ``conv2d`` or ``matmul`` anchor whose elementwise members run in the
  product's store, on each element as it is computed (`EPILOGUES`, filled by
  `purinec.codegen.cuda.gemm`); an anchor output nobody outside reads is never stored;
* loop: elementwise and broadcast members whose outputs have one shape: one
  grid-stride kernel;
* horizontal: members of several shapes that do not read one another (the solver's
  updates): one kernel, each thread taking its share of one loop after another (one
  launch for every parameter's update).
"""

from __future__ import annotations

from typing import Callable

from purinec.codegen.cuda.elementwise import emit_loop, emit_loop_kernel
from purinec.codegen.cuda.module import THREADS, CudaModule, blocks_for, renders
from purinec.codegen.kernel import CodegenError
from purinec.ir.graph import Node, Value
from purinec.ir.ops import Trait, op_has

# anchor op -> fn(node, module, arrays, outputs): the product with the members after it
EPILOGUES: dict[str, Callable[[Node, CudaModule, dict[Value, str], list[Value]], None]] = {}


@renders("fused")
def render_fused(node: Node, m: CudaModule) -> None:
    arrays = dict(zip(node.inputs, m.inputs)) | dict(zip(node.outputs, m.outputs))
    body = node.body
    if op_has(body[0].op, Trait.epilogue_anchor):
        anchor = body[0]
        outputs = [v for v in node.outputs if v is not anchor.outputs[0]]
        if anchor.op not in EPILOGUES:
            raise CodegenError(f"fused node {node!r}: the cuda target has no epilogue "
                               f"renderer for anchor op {anchor.op}")
        EPILOGUES[anchor.op](node, m, arrays, outputs)
        return
    if len({v.type.shape for member in body for v in member.outputs}) == 1:
        emit_loop_kernel(m, body, arrays, node.outputs)
        return
    defined = {v for member in body for v in member.outputs}
    if any(v in defined for member in body for v in member.inputs):
        raise CodegenError(f"fused node {node!r}: members of several shapes that read one "
                           f"another cannot be one loop nor independent loops")
    exported = set(node.outputs)
    with m.kernel("loops") as (name, kernel):
        counts = [emit_loop(m, kernel, [member], arrays, outputs) for member in body
                  for outputs in [[v for v in member.outputs if v in exported]] if outputs]
    m.launch(name, blocks_for(max(counts)), THREADS)
