"""Pipeline parallelism: consecutive layers as stages on devices, micro-batches through
them.

`assign_stages` runs on the forward graph, before autodiff: it cuts the nodes, in
order, into one contiguous stage per device with about equal forward work (the
backward pass of a layer costs about twice its forward, so this balances both) and puts
every parameter where its first reader runs. Autodiff and the optimizer then place each
backward node and update with its forward node, as for any placed model.

`microbatch` runs on the training graph: it splits the batch into micro-batches and
gives every batch-dependent node one copy per micro-batch, on the node's stage device,
while what does not depend on the batch (the parameters, their updates) stays one.
Which values depend on the batch, and how the per-micro-batch results combine, is the
data-parallel analysis over a group of micro-batches instead of devices: partial sums
(gradients, the loss) are added up, split values (logits) concatenated. The placement
pass then inserts the copies between stages, and the dependency-counting runtime runs
micro-batch m+1's first stage while micro-batch m is in the second: the pipeline.
"""

from __future__ import annotations

from typing import Mapping

from purinec.errors import PurinecError
from purinec.ir.graph import Graph, Node, Value, member_name
from purinec.ir.ops import FusionKind, get_op
from purinec.ir.types import Device, DistKind
from purinec.passes.cost import node_work
from purinec.passes.parallel.partition import Partitioner


def assign_stages(graph: Graph, devices: tuple[Device, ...],
                  pinned: Mapping[str, Device] | None = None) -> Graph:
    """Every node on one of ``devices``, in contiguous stages of about equal work
    (`cost.node_work`: FLOPs, or memory traffic where that dominates). A
    cheap elementwise, broadcast or injective node (a bias, a relu, a reshape) stays
    with its input's producer, so stages are cut between layers, not inside one. A node
    reading a ``pinned`` input (by name) runs where that input is pinned: a program's
    inference graph uses each parameter on the device its training graph updates it on,
    although the two graphs' work (and so their stages) differ."""
    new = graph.clone()
    pinned = pinned or {}
    costs = [max(node_work(node), 1) for node in new.nodes]
    total = sum(costs)
    done = 0
    leading: list[Node] = []  # cheap nodes with no producer to follow
    for node, cost in zip(new.nodes, costs):
        stage = min(len(devices) - 1, int((done + cost / 2) / total * len(devices)))
        done += cost
        producer = node.inputs[0].producer if node.inputs else None
        cheap = get_op(node.op).fusion <= FusionKind.injective
        device = producer.device if cheap and producer is not None else devices[stage]
        if cheap and all(v.producer is None or v.producer in leading for v in node.inputs):
            leading.append(node)
        device = next((pinned[v.name] for v in node.inputs if v.name in pinned), device)
        for v in node.outputs:
            v.device = device
    readers = new.users()
    # A cheap node on the inputs (the flattening of an image batch) runs where its first
    # reader does: on a stage of its own it would cost a device and a copy of the batch.
    for node in reversed(leading):
        first_reader = next(iter(readers.get(node.outputs[0]) or ()), None)
        if first_reader is not None and not any(v.name in pinned for v in node.inputs):
            for v in node.outputs:
                v.device = first_reader.outputs[0].device
    for v in new.inputs:
        if readers.get(v):
            v.device = readers[v][0].device
    return new


def default_micro_batches(stages: int, batch: int) -> int:
    """Twice as many micro-batches as stages keeps every stage busy most of the time."""
    return max(1, min(2 * stages, batch))


def batch_sizes(graph: Graph) -> set[int]:
    """The leading sizes of ``graph``'s data inputs: its batch, where there is one."""
    return {v.type.shape[0] for v in graph.inputs_with_role("data") if v.type.rank}


def microbatch(graph: Graph, count: int) -> Graph:
    """``graph`` with its batch-dependent part unrolled over ``count`` micro-batches."""
    from purinec.passes.parallel.distribute import Parallel, Distributor

    batch = batch_sizes(graph)
    if len(batch) != 1 or count > min(batch):
        raise PurinecError(f"graph {graph.name}: cannot cut a batch of "
                           f"{' or '.join(map(str, sorted(batch))) or 'nothing'} into "
                           f"{count} micro-batches")
    if count == 1:
        return graph
    slots = tuple(Device("cpu", m) for m in range(count))  # micro-batches, not devices
    laid_out = Distributor(graph, Parallel(slots, "data")).run()
    return _Unroller(laid_out, {v.name: v.device for v in graph.values()}).run()


class _Unroller(Partitioner):
    """The partitioner over micro-batches: every member lives on the stage device of
    its node, and a replicated value is one value that all micro-batches share."""

    def __init__(self, graph: Graph, device_of: dict[str, Device]):
        super().__init__(graph, 0)
        self.device_of = dict(device_of)

    def device(self, value: Value) -> Device:
        """Where ``value`` lives: its node's stage; a conversion's, its input's."""
        if value.name not in self.device_of:
            self.device_of[value.name] = self.device(value.producer.inputs[0])
        return self.device_of[value.name]

    def members(self, value: Value) -> list[tuple[int, Device]]:
        return [(k, self.device(value)) for k in range(len(value.dist.group))]

    def _share(self, logical: Value, physical: Value) -> None:
        for k in range(len(logical.dist.group)):
            self.pieces[id(logical), k] = physical

    def _outputs(self, name: str, v: Value) -> list[tuple[str, Value]]:
        if v.dist.kind is not DistKind.replicated:
            raise PurinecError(f"output {name} of {self.source.name} is {v.dist} over the "
                               f"micro-batches; outputs must be whole")
        return [(name, self.piece(v, 0))]

    def _input(self, v: Value) -> None:
        whole = self.new.add_input(v.name, v.type, self.device(v), v.role, None, v.init)
        self._share(v, whole)
        if v.dist.kind is DistKind.split:  # the micro-batches' rows
            sizes = v.dist.pieces(v.type.shape[v.dist.axis])
            for k, _ in self.members(v):
                start = sum(sizes[:k])
                self.pieces[id(v), k] = self.new.add_node(
                    "slice", [whole], {"axis": v.dist.axis, "start": start,
                                       "stop": start + sizes[k]},
                    names=[member_name(v.name, k, len(sizes))], device=whole.device).outputs[0]

    def _partition(self, node: Node) -> None:
        if node.op == "allreduce":
            for x, y in zip(node.inputs, node.outputs):
                self._share(y, self._sum(x, y))
        elif node.op == "allgather":
            (x,), (y,) = node.inputs, node.outputs
            pieces = [self.piece(x, k) for k, _ in self.members(x)]
            self._share(y, self.new.add_node("concat", pieces, {"axis": node.attrs["axis"]},
                                             names=[y.name], device=self.device(x),
                                             loc=node.loc).outputs[0])
        elif all(v.dist.kind is DistKind.replicated for v in node.outputs):
            once = self.new.add_node(node.op, [self.piece(v, 0) for v in node.inputs],
                                     dict(node.attrs), names=[v.name for v in node.outputs],
                                     types=[v.type for v in node.outputs],
                                     device=self.device(node.outputs[0]), loc=node.loc)
            for logical, physical in zip(node.outputs, once.outputs):
                self._share(logical, physical)
        else:
            super()._partition(node)

    def _sum(self, x: Value, y: Value) -> Value:
        """The micro-batches' partial sums of ``x`` added up, in order."""
        members = self.members(x)
        total = self.piece(x, 0)
        for k, device in members[1:]:
            name = y.name if k == len(members) - 1 else f"{y.name}.{k}"
            total = self.new.add_node("add", [total, self.piece(x, k)], names=[name],
                                      device=device, loc=x.producer.loc).outputs[0]
        return total
