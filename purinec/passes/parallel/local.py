"""Collectives among the GPUs of one process as copies and kernels on those GPUs.

Purine summed gradients by copying them to one GPU and adding them there, then copying
the sum back: the data never leaves the GPUs. The partitioner's collectives are host
operations (`Trait.host`): a target that keeps tensors on GPUs would have to stage each
one through host memory. `lower_local_collectives` rewrites every collective and slice
whose members all live on GPUs of this process into the same work as graph nodes:

* ``allreduce``: each tensor's members copied to one member (its *root*: tensor ``k`` of
  the graph's allreduces goes to member ``k`` modulo the members, spreading the sums
  over the GPUs), added there in group order (as the host kernel adds, so replicas agree
  bitwise with the host's sum), and the sum copied back to every other member;
* ``reduce``: the same onto the reduce's root, with no copies back;
* ``broadcast``: the root's tensors copied to every member;
* ``allgather``: each member concatenates the pieces, copied to it, along the axis;
* ``slice``: a ``strided_slice`` on the sliced value's device.

The new nodes produce the collective's very output values, so its users are unchanged.
The copies then run on the GPUs' copy streams, the additions as generated kernels
(which the fuser may merge with their users, an SGD update say), and an iteration of a
data-parallel program has no host work left. Collectives that span ranks stay as they
are (MPI, staged through host memory).
"""

from __future__ import annotations

import itertools

from purinec.ir.graph import Graph, Node, Value
from purinec.ir.ops import get_op, spans_ranks
from purinec.ir.types import Device


def lower_local_collectives(graph: Graph) -> Graph:
    """``graph`` with its in-process GPU collectives and slices as copies and kernels
    (see the module doc)."""
    new = graph.clone()
    roots = itertools.count()
    nodes: list[Node] = []
    for node in new.nodes:
        if _lowered(node):
            nodes.extend(_LOWERINGS[node.op](_Builder(new, node), node, roots))
        else:
            nodes.append(node)
    new.nodes = nodes
    new.rebuild_names()
    return new


def _lowered(node: Node) -> bool:
    return (node.op in _LOWERINGS and not spans_ranks(node)
            and all(v.device.kind == "gpu" for v in (*node.inputs, *node.outputs)))


class _Builder:
    """Nodes standing in for one collective, in order; each either makes a fresh value
    or produces one of the collective's outputs."""

    def __init__(self, graph: Graph, collective: Node):
        self.graph, self.loc, self.nodes = graph, collective.loc, []

    def node(self, op: str, inputs: list[Value], device: Device, attrs: dict | None = None,
             name: str = "", output: Value | None = None) -> Value:
        if output is None:
            node = self.graph.make_node(op, inputs, attrs, names=[self.graph.fresh_name(name)],
                                        device=device, loc=self.loc)
        else:
            node = Node(op, inputs, [output], get_op(op).complete_attrs(attrs or {}),
                        self.loc)
            output.producer = node
        self.nodes.append(node)
        return node.outputs[0]

    def to(self, value: Value, device: Device, name: str, output: Value | None = None
           ) -> Value:
        """``value`` on ``device``: itself, or a copy (into ``output`` where given)."""
        if value.device == device and output is None:
            return value
        return self.node("copy", [value], device, name=name, output=output)

    def total(self, members: list[Value], device: Device, output: Value) -> None:
        """``output`` on ``device``: the members added up in order."""
        parts = [self.to(x, device, f"{output.name}.from{m}") for m, x in enumerate(members)]
        if len(parts) == 1:
            self.to(parts[0], device, "", output=output)
            return
        total = parts[0]
        for m, part in enumerate(parts[1:], start=1):
            last = m == len(parts) - 1
            total = self.node("add", [total, part], device, name=f"{output.name}.upto{m}",
                              output=output if last else None)


def _allreduce(b: _Builder, node: Node, roots) -> list[Node]:
    tensors = node.attrs["tensors"]
    members = len(node.inputs) // tensors
    for t in range(tensors):
        xs, ys = node.inputs[t::tensors], node.outputs[t::tensors]
        root = next(roots) % members
        b.total(xs, ys[root].device, ys[root])
        for m, y in enumerate(ys):
            if m != root:
                b.to(ys[root], y.device, "", output=y)
    return b.nodes


def _reduce(b: _Builder, node: Node, roots) -> list[Node]:
    tensors = node.attrs["tensors"]
    for t, y in enumerate(node.outputs):
        b.total(node.inputs[t::tensors], y.device, y)
    return b.nodes


def _broadcast(b: _Builder, node: Node, roots) -> list[Node]:
    tensors = len(node.inputs)
    for k, y in enumerate(node.outputs):
        b.to(node.inputs[k % tensors], y.device, "", output=y)
    return b.nodes


def _allgather(b: _Builder, node: Node, roots) -> list[Node]:
    for y in node.outputs:
        pieces = [b.to(x, y.device, f"{y.name}.from{m}") for m, x in enumerate(node.inputs)]
        b.node("concat", pieces, y.device, {"axis": node.attrs["axis"]}, output=y)
    return b.nodes


def _slice(b: _Builder, node: Node, roots) -> list[Node]:
    (x,), (y,) = node.inputs, node.outputs
    axis, start = node.attrs["axis"], node.attrs["start"]
    window = {"starts": [start if a == axis else 0 for a in range(x.type.rank)],
              "steps": [1] * x.type.rank, "sizes": list(y.type.shape)}
    if x.device == y.device:
        b.node("strided_slice", [x], y.device, window, output=y)
    else:
        piece = b.node("strided_slice", [x], x.device, window, name=f"{y.name}.piece")
        b.to(piece, y.device, "", output=y)
    return b.nodes


_LOWERINGS = {"allreduce": _allreduce, "reduce": _reduce, "broadcast": _broadcast,
              "allgather": _allgather, "slice": _slice}
