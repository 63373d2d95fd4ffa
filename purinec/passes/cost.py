"""FLOP counts over the IR: one rule per op kind.

`flops(graph)` is the total for one run of the graph, `node_flops(node)` one node's
share and `flops_by_node(graph)` every node's. Counts are the floating-point operations
of a straightforward implementation, the usual convention for reporting GFLOP/s:

* a multiply-add is 2: ``conv2d`` is ``2*N*Cout*OH*OW*(Cin/groups)*kh*kw``, ``matmul``
  is ``2*m*n*k``; both gradients of a convolution cost what the forward one does;
* elementwise ops count their arithmetic per element (``relu`` 1, ``sgd`` 6, ...), a
  transcendental function (exp, log, tanh, pow) counts 1;
* pooling counts the nominal window per pooled element (``kh*kw``, edges not clipped);
* moving data (``reshape``, ``concat``, ``split``, ``broadcast_to``, ``cast``,
  ``fill``) and integer work (``dropout_mask``'s hash) count 0;
* a fused node costs what its members do: fusing saves memory traffic, not arithmetic.

The numbers are exact for the dominant ops (convolutions, matrix products) and close
estimates for the rest; they serve GFLOP/s in the benchmarks. `node_work` adds memory
traffic to estimate time, for balancing a pipeline's stages and bounding gradient
buckets. A new op needs a rule here (`RULES`); counting a graph with an op that has
none raises a `PurinecError` naming it.
"""

from __future__ import annotations

from typing import Callable

from purinec.errors import PurinecError
from purinec.ir.graph import Graph, Node

Rule = Callable[[Node], int]

RULES: dict[str, Rule] = {}


def node_flops(node: Node) -> int:
    """The floating-point operations of one run of ``node``."""
    rule = RULES.get(node.op)
    if rule is None:
        raise PurinecError(f"no FLOP rule for op {node.op!r} (node %{node.name}); add one to "
                           f"purinec.passes.cost.RULES")
    return int(rule(node))


# The exchange rate between arithmetic and memory traffic: moving one byte (to or from
# memory, or between devices) takes about as long as this many floating-point operations
# (~10 GB/s against ~80 GFLOP/s of GEMM on these machines' cores).
FLOPS_PER_BYTE = 8


def node_work(node: Node) -> int:
    """An estimate of ``node``'s run time in FLOP-equivalents: its FLOPs or the bytes it
    reads and writes (at FLOPS_PER_BYTE), whichever is larger. Pooling's gradients and
    reductions do little arithmetic on a lot of memory: counted by FLOPs alone they look
    free, yet they take a sizeable share of a backward pass. A reshape is a view: free."""
    if node.op == "reshape":
        return 0
    traffic = sum(v.type.nbytes for v in (*node.inputs, *node.outputs))
    return max(node_flops(node), FLOPS_PER_BYTE * traffic)


def flops_by_node(graph: Graph) -> dict[Node, int]:
    """Every node's FLOPs, in graph order."""
    return {node: node_flops(node) for node in graph.nodes}


def flops(graph: Graph) -> int:
    """The floating-point operations of one run of ``graph``."""
    return sum(flops_by_node(graph).values())


# ---------------------------------------------------------------------------------------
# The rules.


def _size(values, index: int = 0) -> int:
    return values[index].type.size


def _conv_flops(n: int, cout: int, oh: int, ow: int, cin_per_group: int, kh: int,
                kw: int) -> int:
    """2 FLOPs per multiply-add: every output element sums Cin/groups * kh * kw products."""
    return 2 * n * cout * oh * ow * cin_per_group * kh * kw


def _conv2d(node: Node) -> int:
    _, w = node.inputs
    n, cout, oh, ow = node.outputs[0].type.shape
    _, cin_g, kh, kw = w.type.shape
    return _conv_flops(n, cout, oh, ow, cin_g, kh, kw)


def _conv2d_grad_input(node: Node) -> int:
    # The transposed convolution: the same products as the forward one, scattered.
    gy, w = node.inputs
    n, cout, oh, ow = gy.type.shape
    _, cin_g, kh, kw = w.type.shape
    return _conv_flops(n, cout, oh, ow, cin_g, kh, kw)


def _conv2d_grad_weight(node: Node) -> int:
    # Every weight sums N * OH * OW products: again the forward convolution's count.
    _, gy = node.inputs
    n, cout, oh, ow = gy.type.shape
    _, cin_g, kh, kw = node.outputs[0].type.shape
    return _conv_flops(n, cout, oh, ow, cin_g, kh, kw)


def _matmul(node: Node) -> int:
    a, _ = node.inputs
    m, n = node.outputs[0].type.shape
    k = a.type.shape[0] if node.attrs["trans_a"] else a.type.shape[1]
    return 2 * m * n * k


def _window(node: Node) -> int:
    kh, kw = node.attrs["kernel"]
    return kh * kw


def _reduce_sum(node: Node) -> int:
    # Summing s elements into one takes s - 1 additions.
    return _size(node.inputs) - _size(node.outputs)


def _per_output_element(cost: int) -> Rule:
    return lambda node: cost * _size(node.outputs)


def _per_input_element(cost: int, index: int = 0) -> Rule:
    return lambda node: cost * _size(node.inputs, index)


def _lrn(node: Node) -> int:
    # A window of `size` squares summed (2*size), then scale, add k, pow, multiply (4).
    return (2 * node.attrs["size"] + 4) * _size(node.outputs)


RULES.update({
    # Convolutions and matrix products.
    "conv2d": _conv2d,
    "conv2d_grad_input": _conv2d_grad_input,
    "conv2d_grad_weight": _conv2d_grad_weight,
    "matmul": _matmul,
    # Elementwise: arithmetic per output element.
    "relu": _per_output_element(1),
    "sigmoid": _per_output_element(3),          # exp, add, divide
    "tanh": _per_output_element(1),
    "scale": _per_output_element(1),
    "add_scalar": _per_output_element(1),
    "add": _per_output_element(1),
    "sub": _per_output_element(1),
    "mul": _per_output_element(1),
    "bias_add": _per_output_element(1),
    "relu_grad": _per_output_element(1),        # a select
    "sigmoid_grad": _per_output_element(3),     # gy * y * (1 - y)
    "tanh_grad": _per_output_element(3),        # gy * (1 - y * y)
    "sgd": _per_output_element(6),              # m*h + lr*(g + wd*w), then w - update
    # Reductions and pooling.
    "reduce_sum": _reduce_sum,
    "max_pool2d": lambda node: _window(node) * _size(node.outputs),
    "avg_pool2d": lambda node: _window(node) * _size(node.outputs),
    "max_pool2d_grad": lambda node: _window(node) * _size(node.inputs, 2),
    "avg_pool2d_grad": lambda node: _window(node) * _size(node.inputs, 0),
    "global_avg_pool": _per_input_element(1),
    "global_avg_pool_grad": _per_output_element(1),
    "lrn": _lrn,
    "lrn_grad": lambda node: 2 * _lrn(node),    # recomputes the scale, then its adjoint
    # Softmax and the loss, per logit.
    "softmax": _per_output_element(5),          # max, subtract, exp, sum, divide
    "softmax_grad": _per_output_element(4),     # gy * y, sum, subtract, multiply
    "softmax_xent": _per_input_element(4),      # max, subtract, exp, sum
    "softmax_xent_grad": _per_input_element(6),  # the softmax again, then scale
    "accuracy": _per_input_element(1),          # argmax comparisons
    # Data movement and integer work.
    "reshape": lambda node: 0,
    "broadcast_to": lambda node: 0,
    "concat": lambda node: 0,
    "split": lambda node: 0,
    "cast": lambda node: 0,
    "fill": lambda node: 0,
    "dropout_mask": lambda node: 0,
    # Communication: moving data; an allreduce or reduce adds each member's tensors into
    # the sum.
    "copy": lambda node: 0,
    "slice": lambda node: 0,
    "allgather": lambda node: 0,
    "broadcast": lambda node: 0,
    "reduce": lambda node: sum(v.type.size for v in node.inputs),
    "send": lambda node: 0,
    "recv": lambda node: 0,
    "allreduce": lambda node: sum(v.type.size for v in node.inputs),
    # A fused group (purinec.passes.fuse): its members, one by one.
    "fused": lambda node: sum(node_flops(member) for member in node.body),
})
