"""partition: cut a distributed logical graph into the physical graph of one rank.

Every logical value becomes one physical value per group member on this rank, named
``<name>.p<k>`` (k: the member's position in the group) and typed as that member's
piece. Every compute node becomes one node per member, reading and writing pieces;
attributes that spell the output's shape are rewritten to the piece's shape. Boxing
nodes become what the runtime executes: one `allreduce` or `allgather` per rank over its
members' pieces (the group may span ranks), and one `slice` per member at its offset. A
parameter server's `reduce` takes this rank's members' summands and gives the sum on the
root (or, on a rank without the root, what this rank sent toward it, which nobody reads);
its `broadcast` takes the root's tensor where the root is and gives one copy to each
member on this rank.

A mean over the batch rows (loss, accuracy, and the 1/batch of the loss gradient) on a
piece of the rows is weighted by the piece's share of the rows, which makes the pieces'
results partial sums of the whole batch's mean (`OpDef.row_mean`).
"""

from __future__ import annotations

from purinec.errors import PurinecError
from purinec.ir.graph import Graph, Node, Value, member_name
from purinec.ir.ops import get_op
from purinec.ir.types import DistKind, Distribution


def partition(graph: Graph, rank: int = 0) -> Graph:
    """The physical graph of ``rank`` (see the module doc)."""
    return Partitioner(graph, rank).run()


def _dist(value: Value) -> Distribution:
    if value.dist is None:
        raise PurinecError(f"partition needs a distributed graph; %{value.name} has no "
                           f"distribution (run parallelize first)")
    return value.dist


class Partitioner:
    """Cuts a distributed logical graph into the physical graph of one rank (see the
    module doc); `pipeline` subclasses it to unroll micro-batches."""

    def __init__(self, graph: Graph, rank: int):
        self.source = graph
        self.rank = rank
        self.new = Graph(graph.name)
        self.pieces: dict[tuple[int, int], Value] = {}  # (id(logical), member) -> piece
        # A copy between ranks is tagged with its position: the same on every rank.
        self.tags = {id(node): i for i, node in enumerate(graph.nodes)}

    def piece(self, value: Value, member: int) -> Value:
        try:
            return self.pieces[id(value), member]
        except KeyError:
            raise PurinecError(f"%{value.name} has no piece on member {member} of "
                               f"{value.dist} on rank {self.rank}") from None

    def members(self, value: Value) -> list[tuple[int, object]]:
        """(position, device) of the members of ``value``'s group this graph holds."""
        return _dist(value).members_on(self.rank)

    def run(self) -> Graph:
        for v in self.source.inputs:
            self._input(v)
        for node in self.source.nodes:
            try:
                self._partition(node)
            except PurinecError as err:  # say which node, as the IR shows it
                at = f" ({node.loc})" if node.loc else ""
                raise type(err)(f"partitioning {node!r}{at} for rank {self.rank}: "
                                f"{err}") from None
        self.new.set_outputs([out for name, v in self.source.outputs
                              for out in self._outputs(name, v)])
        return self.new

    def _outputs(self, name: str, v: Value) -> list[tuple[str, Value]]:
        return [(member_name(name, k, len(v.dist.group)), self.piece(v, k))
                for k, _ in self.members(v)]

    def _input(self, v: Value) -> None:
        dist = _dist(v)
        for k, device in self.members(v):
            self.pieces[id(v), k] = self.new.add_input(
                member_name(v.name, k, len(dist.group)), dist.local_type(v.type, k), device,
                v.role, None, v.init)

    def _partition(self, node: Node) -> None:
        if node.op in ("allreduce", "allgather"):
            self._collective(node)
        elif node.op == "reduce":
            self._reduce(node)
        elif node.op == "broadcast":
            self._broadcast(node)
        elif node.op == "copy" and _own_replica(node):
            self._own_replica(node)
        elif node.op == "copy" and node.inputs[0].device.rank != node.outputs[0].device.rank:
            self._across_ranks(node)
        elif (node.op == "slice" and node.inputs[0].dist.kind is DistKind.replicated and
              node.outputs[0].dist.kind is DistKind.split):  # boxing's, not the model's
            self._local_slices(node)
        else:
            for k, device in self.members(node.outputs[0]):
                self._compute(node, k, device)

    def _add(self, op: str, inputs: list[Value], attrs: dict, outputs: list[tuple],
             loc: str | None) -> Node:
        """A physical node; ``outputs`` holds (logical value, member, device) triples."""
        physical = self.new.add_node(
            op, inputs, attrs, names=[member_name(v.name, k, len(_dist(v).group)) for v, k, _ in outputs],
            types=[_dist(v).local_type(v.type, k) for v, k, _ in outputs], loc=loc)
        for out, (v, k, device) in zip(physical.outputs, outputs):
            out.device = device
            self.pieces[id(v), k] = out
        return physical

    def _collective(self, node: Node) -> None:
        """One node over this rank's members: for each member, its pieces of every
        tensor (a bucket holds several), in group order."""
        members = self.members(node.inputs[0])
        if members:
            self._add(node.op, [self.piece(x, k) for k, _ in members for x in node.inputs],
                      dict(node.attrs),
                      [(y, k, device) for k, device in members for y in node.outputs],
                      node.loc)

    def _reduce(self, node: Node) -> None:
        """The sums of this rank's members' summands (of each tensor of a bucket): onto
        the root where it lives here, else into values of this rank's part, sent to the
        root and read by nobody."""
        members = self.members(node.inputs[0])
        if not members:
            return
        inputs = [self.piece(x, k) for k, _ in members for x in node.inputs]
        if self.members(node.outputs[0]):
            self._add("reduce", inputs, dict(node.attrs),
                      [(y, 0, y.device) for y in node.outputs], node.loc)
        else:
            self.new.add_node("reduce", inputs, dict(node.attrs),
                              names=[self.new.fresh_name(f"{y.name}.sent")
                                     for y in node.outputs],
                              device=members[0][1], loc=node.loc)

    def _broadcast(self, node: Node) -> None:
        """The root's tensors (inputs only on its rank) to each member on this rank."""
        members = self.members(node.outputs[0])
        if members:
            at_root = bool(self.members(node.inputs[0]))
            self._add("broadcast", [self.piece(x, 0) for x in node.inputs] if at_root else [],
                      {**node.attrs, "members": len(members)},
                      [(y, k, device) for k, device in members for y in node.outputs],
                      node.loc)

    def _own_replica(self, node: Node) -> None:
        """A device's piece of a value replicated over a group it belongs to (a parameter
        server's own replica of the weights): that very piece, no node."""
        (x,), (y,) = node.inputs, node.outputs
        if self.members(y):
            self.pieces[id(y), 0] = self.piece(x, x.dist.group.index(y.device))

    def _across_ranks(self, node: Node) -> None:
        """A copy between ranks: a send on the source's rank, a receive on the
        destination's, matched by the copy's position in the logical graph."""
        (x,), (y,) = node.inputs, node.outputs
        tag = self.tags[id(node)]
        if x.device.rank == self.rank:
            self.new.add_node("send", [self.piece(x, 0)],
                              {"peer": str(y.device), "tag": tag},
                              names=[self.new.fresh_name(f"{y.name}.sent")], loc=node.loc)
        if y.device.rank == self.rank:
            self._add("recv", [], {"peer": str(x.device), "tag": tag,
                                   "shape": list(y.type.shape), "dtype": str(y.type.dtype)},
                      [(y, 0, y.device)], node.loc)

    def _local_slices(self, node: Node) -> None:
        (x,), (y,) = node.inputs, node.outputs
        dist = _dist(y)
        sizes = dist.pieces(y.type.shape[dist.axis])
        for k, device in self.members(y):
            start = sum(sizes[:k])
            self._add("slice", [self.piece(x, k)],
                      {"axis": dist.axis, "start": start, "stop": start + sizes[k]},
                      [(y, k, device)], node.loc)

    def _compute(self, node: Node, k: int, device) -> None:
        inputs = [self.piece(v, k) for v in node.inputs]
        attrs = self._local_attrs(node, k)
        weight = self._row_share(node, k)
        where = get_op(node.op).row_mean
        if weight is not None and where[0] == "input":
            inputs[where[1]] = self._scaled(inputs[where[1]], weight, device, node.loc)
        if weight is not None and where[0] == "output":
            (y,) = node.outputs
            mean = self.new.add_node(node.op, inputs, attrs,
                                     names=[member_name(f"{y.name}.rows", k, len(y.dist.group))],
                                     types=[y.type], device=device, loc=node.loc).outputs[0]
            self._add("scale", [mean], {"alpha": weight}, [(y, k, device)], node.loc)
            return
        self._add(node.op, inputs, attrs, [(v, k, device) for v in node.outputs], node.loc)

    def _scaled(self, value: Value, weight: float, device, loc) -> Value:
        return self.new.add_node("scale", [value], {"alpha": weight},
                                 names=[self.new.fresh_name(f"{value.name}.rows")],
                                 device=device, loc=loc).outputs[0]

    def _row_share(self, node: Node, k: int) -> float | None:
        """For a row mean over a piece of the rows: the piece's share of them."""
        if get_op(node.op).row_mean is None:
            return None
        dist = _dist(node.inputs[0])
        if dist.kind is not DistKind.split:
            return None
        rows = node.inputs[0].type.shape[0]
        return dist.pieces(rows)[k] / rows

    def _local_attrs(self, node: Node, k: int) -> dict:
        attrs = dict(node.attrs)
        out = node.outputs[0] if node.outputs else None
        key = get_op(node.op).shape_attr
        if key is None or out is None:
            return attrs
        if list(attrs[key]) != list(out.type.shape):
            raise PurinecError(f"node {node!r}: cannot partition attribute {key}="
                               f"{attrs[key]}, which is not its output's shape")
        attrs[key] = list(_dist(out).local_type(out.type, k).shape)
        return attrs


def _own_replica(node: Node) -> bool:
    """Whether a copy takes a device's own replica: from a value replicated over a group
    to one device of that group."""
    x, y = node.inputs[0], node.outputs[0]
    return (x.dist is not None and x.dist.kind is DistKind.replicated and
            len(x.dist.group) > 1 and y.device in x.dist.group and
            (y.dist is None or len(y.dist.group) == 1))
