"""FLOP counts over the IR: one rule per op (`OpDef.flops`, defined with the op).

`flops(graph)` is the total for one run of the graph, `node_flops(node)` one node's
share and `flops_by_node(graph)` every node's. Counts are the floating-point operations
of a straightforward implementation, the usual convention for reporting GFLOP/s:

* a multiply-add is 2: ``conv2d`` is ``2*N*Cout*OH*OW*(Cin/groups)*kh*kw``, ``matmul``
  is ``2*m*n*k``; both gradients of a convolution cost what the forward one does;
* elementwise ops count their arithmetic per element (``relu`` 1, ``sgd`` 6, ...), a
  transcendental function (exp, log, tanh, pow) counts 1;
* pooling counts the nominal window per pooled element (``kh*kw``, edges not clipped);
* moving data (``reshape``, ``concat``, ``split``, ``transpose``, ``strided_slice``,
  ``pad``, ``broadcast_to``, ``cast``, ``fill``) and integer work (``dropout_mask``'s
  hash) count 0; ``pad_grad`` counts an addition per element of its gradient;
* a fused node costs what its members do: fusing saves memory traffic, not arithmetic.

The numbers are exact for the dominant ops (convolutions, matrix products) and close
estimates for the rest; they serve GFLOP/s in the benchmarks. `node_work` adds memory
traffic to estimate time, for balancing a pipeline's stages and bounding gradient
buckets.
"""

from __future__ import annotations

from purinec.ir.graph import Graph, Node
from purinec.ir.ops import Trait, get_op


def node_flops(node: Node) -> int:
    """The floating-point operations of one run of ``node``."""
    return int(get_op(node.op).flops(node))


# The exchange rate between arithmetic and memory traffic: moving one byte (to or from
# memory, or between devices) takes about as long as this many floating-point operations
# (~10 GB/s against ~80 GFLOP/s of GEMM on these machines' cores).
FLOPS_PER_BYTE = 8


def node_work(node: Node) -> int:
    """An estimate of ``node``'s run time in FLOP-equivalents: its FLOPs or the bytes it
    reads and writes (at FLOPS_PER_BYTE), whichever is larger. Pooling's gradients and
    reductions do little arithmetic on a lot of memory: counted by FLOPs alone they look
    free, yet they take a sizeable share of a backward pass. A view (reshape) is free."""
    if get_op(node.op).has(Trait.view):
        return 0
    traffic = sum(v.type.nbytes for v in (*node.inputs, *node.outputs))
    return max(node_flops(node), FLOPS_PER_BYTE * traffic)


def flops_by_node(graph: Graph) -> dict[Node, int]:
    """Every node's FLOPs, in graph order."""
    return {node: node_flops(node) for node in graph.nodes}


def flops(graph: Graph) -> int:
    """The floating-point operations of one run of ``graph``."""
    return sum(flops_by_node(graph).values())
