"""bucket: reduce small tensors together.

Every allreduce costs a fixed latency (an MPI message, a runtime task) besides its bytes,
and the backward pass makes many small gradients (biases). Allreduce nodes over the same
group (and a parameter server's reduce nodes onto the same root, and its broadcasts of
new weights from the same root) are merged, in schedule order, into one multi-tensor
node of up to BUCKET_BYTES, placed where its last member was: it starts as soon as its
last gradient exists, while the rest of the backward pass goes on. A bucket never grows
past a point where one of its results is already needed, nor across more than
BUCKET_SPAN of the graph's work (`cost.node_work`: FLOPs, or memory traffic where that
dominates): a gradient made early is not held back for one made much later (the last
bucket of an iteration, which nothing can hide, stays small). A bucket of under
SMALL_BUCKET_BYTES has no such limit: its bytes take less time to move than its fixed
cost (posting and completing a collective costs a rank 10-40 us of Python with cold
caches), so sending them early gains nothing and a collective of their own costs that.
"""

from __future__ import annotations

import itertools

from purinec.ir.graph import Graph, Node
from purinec.ir.ops import Trait, op_has
from purinec.passes.cost import node_work

BUCKET_BYTES = 1 << 19
BUCKET_SPAN = 0.05  # of the graph's work, from a bucket's first member to its last
SMALL_BUCKET_BYTES = 1 << 16


def bucket(graph: Graph, limit: int = BUCKET_BYTES) -> Graph:
    new = graph.clone()
    position = {id(node): i for i, node in enumerate(new.nodes)}
    first_use = _first_uses(new, position)
    done = list(itertools.accumulate(node_work(node) for node in new.nodes))
    span = BUCKET_SPAN * (done[-1] if done else 0)
    groups: list[list[Node]] = []
    filling: dict[tuple, list[Node]] = {}  # the latest bucket of each kind
    for node in new.nodes:
        if not op_has(node.op, Trait.bucketable):
            continue
        key = _kind(node)
        current = filling.get(key)
        if (current is not None and _fits(current, node, limit, position, first_use) and
                (sum(map(_bytes, current)) < SMALL_BUCKET_BYTES or
                 done[position[id(node)]] - done[position[id(current[0])]] <= span)):
            current.append(node)
        else:
            filling[key] = [node]
            groups.append(filling[key])
    merged = {id(group[-1]): group for group in groups if len(group) > 1}
    gone = {id(n) for group in merged.values() for n in group[:-1]}
    nodes = []
    for node in new.nodes:
        if id(node) in gone:
            continue
        nodes.append(_merge(merged[id(node)]) if id(node) in merged else node)
    new.nodes = nodes
    return new


def _first_uses(graph: Graph, position: dict[int, int]) -> dict[int, int]:
    """For each value, the position of the first node reading it."""
    first: dict[int, int] = {}
    for node in graph.nodes:
        for v in node.inputs:
            first.setdefault(id(v), position[id(node)])
    return first


def _kind(node: Node) -> tuple:
    """What nodes merged into one must share: the op, its group (and root), and the
    dtype (a bucket is one buffer)."""
    return (node.op, node.attrs["group"], node.attrs.get("root"), node.inputs[0].type.dtype)


def _fits(group: list[Node], node: Node, limit: int, position, first_use) -> bool:
    if sum(_bytes(n) for n in group) + _bytes(node) > limit:
        return False
    # Merged, every member's results appear where ``node`` is: none may be read before.
    here = position[id(node)]
    return all(first_use.get(id(v), here + 1) > here for n in group for v in n.outputs)


def _bytes(node: Node) -> int:
    return sum(v.type.nbytes for v in node.inputs)


def _merge(group: list[Node]) -> Node:
    inputs = [v for n in group for v in n.inputs]
    outputs = [v for n in group for v in n.outputs]
    reasons = "; ".join(n.loc[len("boxing: "):] for n in group if n.loc)
    node = Node(group[0].op, inputs, outputs, {**group[0].attrs, **_counts(group[0].op, inputs)},
                f"boxing: {reasons}")
    for v in outputs:
        v.producer = node
    return node


def _counts(op: str, inputs: list) -> dict:
    """The attributes that say which tensors a bucket of ``inputs`` holds: how many, or
    for a broadcast (its receiving ranks have no inputs to tell) their shapes."""
    if op == "broadcast":
        shapes = [v.type.shape for v in inputs]
        return {"shape": [n for shape in shapes for n in shape],
                "ndims": [len(shape) for shape in shapes]}
    return {"tensors": len(inputs)}
