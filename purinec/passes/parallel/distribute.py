"""parallelize: give every value of a logical graph a distribution over a device group,
inserting the boxing conversions wherever a consumer needs another one.

A strategy sets the distributions of the graph's inputs; each node then takes the split
signature of its op (from the registry) that is cheapest given its inputs' current
distributions: bytes its inputs' conversions move, plus what its outputs will cost to
convert where the graph returns them (half an allreduce for a partial sum), plus the
work repeated when a value is computed whole on every device (FLOPs, at
cost.FLOPS_PER_BYTE: work done whole on every device wastes (n-1)/n of it). Repeated
memory traffic is not counted: priced like communication it would shard every SGD update
and gather the weights and momenta back, moving twice the bytes of an allreduce.
An op with no signature that fits runs replicated. The choice is greedy, node by node in
order. Conversions are placed right after their producer, so a gradient's allreduce
comes as early in the schedule as the gradient does.

"ps" is data parallelism with parameter servers, as in Purine: the batch is split as
in "data", and each parameter has a server (the largest parameters first, each onto
the device serving the fewest bytes so far, so the servers share the update work and
traffic), which holds its momentum and runs its sgd node: the boxing pass reduces the
partial gradients onto the server, takes the server's own replica of the weights, and
broadcasts the new weights from it to every device as soon as they are made, so the
next forward pass finds them in place.

Strategies that do not spread nodes over the group ("pipeline" after its stages and
micro-batches, "placement" for models that place layers themselves) run each node on
its own device, whole, and only get copies where a consumer sits elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from purinec.errors import PurinecError
from purinec.ir.graph import Graph, Node, Value
from purinec.ir.ops import SplitSignature, Trait, get_op, op_has
from purinec.ir.types import Device, DistKind, Distribution, TensorType
from purinec.ir.verify import describe
from purinec.passes.cost import FLOPS_PER_BYTE, node_flops
from purinec.passes.parallel.boxing import conversion_cost, convert
from purinec.passes.parallel.bucket import bucket

# Strategies that spread every node over all the devices; the others run each node on
# one device (where the model or the pipeline stages put it) and copy between them.
SPREAD = ("data", "ps", "model", "hybrid")

STRATEGIES = {
    "data": "split the batch over the devices, replicate the parameters, allreduce the "
            "gradients",
    "ps": "split the batch over the devices; each parameter has a server device, which "
          "sums its gradients, updates it and broadcasts the new weights to the others",
    "model": "split every layer's output features or channels (weights, biases and their "
             "momentum) over the devices, gather the activations between layers",
    "hybrid": "data-parallel convolutions, model-parallel fully connected layers",
    "pipeline": "consecutive layers as stages on the devices, balanced by work; the batch "
                "cut into micro-batches that flow through the stages at once",
    "placement": "run every node on the device the model placed it on, copying tensors "
                 "between devices (used when a model places its layers itself)",
}

# The strategies a user picks ("placement" follows a model's own placement).
USER_STRATEGIES = ("data", "ps", "model", "hybrid", "pipeline")


def _updates(node: Node) -> bool:
    """Whether ``node`` is a solver's update of the variable it reads first."""
    return op_has(node.op, Trait.solver_update)


def check_micro_batches(micro_batches: int, strategy: str | None) -> None:
    """Micro-batches cut the batch of a pipeline only; any other layout has none."""
    if strategy != "pipeline":
        raise PurinecError(f"micro-batches ({micro_batches}) go with the pipeline strategy "
                           f"only, not {strategy or 'one device'} (parallel=\"pipeline\", "
                           f"--parallel pipeline)")
    if micro_batches < 1:
        raise PurinecError(f"micro-batches must be at least 1, got {micro_batches}")


@dataclass(frozen=True)
class Parallel:
    """How to spread a graph: over ``devices`` (two or more), with ``strategy``."""

    devices: tuple[Device, ...]
    strategy: str = "data"
    micro_batches: int | None = None  # pipeline: default twice the stages
    # Variables to place where another graph of the program keeps them, by name
    # (pipeline: the inference graph's parameters on the stages that train them).
    pinned: tuple[tuple[str, Device], ...] = ()

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise PurinecError(f"unknown parallel strategy {self.strategy!r}; available: "
                               f"{', '.join(USER_STRATEGIES)}")
        if len(set(self.devices)) != len(self.devices) or not self.devices:
            raise PurinecError(f"devices must be distinct and at least one, got "
                               f"{', '.join(map(str, self.devices)) or 'none'}")
        if self.micro_batches is not None:
            check_micro_batches(self.micro_batches, self.strategy)

    @property
    def ranks(self) -> int:
        return max(d.rank for d in self.devices) + 1

    def describe(self) -> str:
        return f"{self.strategy} over {','.join(map(str, self.devices))}"


def parse_devices(text: str) -> tuple[Device, ...]:
    """``cpu:0,cpu:1`` or ``r0/cpu:0,r1/cpu:0``; ``N`` alone means cpu:0..cpu:N-1."""
    text = text.strip()
    if text.isdigit():
        if int(text) < 1:
            raise PurinecError(f"devices {text}: give at least one device")
        return tuple(Device("cpu", i) for i in range(int(text)))
    try:
        return tuple(Device.parse(part) for part in text.split(","))
    except ValueError as err:
        raise PurinecError(f"devices {text!r}: {err}") from None


def parallelize(graph: Graph, parallel: Parallel) -> Graph:
    """The logical graph with a distribution on every value, boxing nodes added and
    small allreduces bucketed."""
    return bucket(Distributor(graph, parallel).run())


class Distributor:
    """One walk over a graph's nodes in order, laying out each and boxing its inputs
    (see the module doc); `pipeline.microbatch` runs it over micro-batches."""

    def __init__(self, graph: Graph, parallel: Parallel):
        self.source = graph
        self.parallel = parallel
        self.spread = parallel.strategy in SPREAD
        self.group = parallel.devices  # of the node being placed
        self.new = Graph(graph.name)
        self.mapping: dict[Value, Value] = {}
        self.converted: dict[tuple[int, Distribution], Value] = {}
        self.after: dict[int, list[Node]] = {}  # conversions placed after a producer
        self.head: list[Node] = []  # conversions of graph inputs
        self.param_axes = self._param_axes()
        self.servers = self._servers()
        self.wanted_out = self._wanted_outputs()

    def dist(self, kind: DistKind, axis: int | None = None) -> Distribution:
        return Distribution(kind, self.group, axis)

    def _param_axes(self) -> dict[str, int]:
        """The model-parallel split axis of each parameter (and its momentum) that the
        strategy splits."""
        if self.parallel.strategy not in ("model", "hybrid"):
            return {}
        fully_connected = {id(n.inputs[1]) for n in self.source.nodes if n.op == "matmul"}
        axes: dict[str, int] = {}
        for node in self.source.nodes:
            for position, v in enumerate(node.inputs):
                rule = get_op(node.op).model_split.get(position)
                if rule is None or v.role != "param":
                    continue
                if self.parallel.strategy == "hybrid" and not self._feeds_matmul(
                        v, fully_connected):
                    continue
                axes.setdefault(v.name, rule(node.attrs))  # as the forward pass reads it
        for node in self.source.nodes:  # the momentum is laid out like its weight
            if _updates(node) and node.inputs[0].name in axes:
                axes[node.inputs[1].name] = axes[node.inputs[0].name]
        return {name: axis for name, axis in axes.items()
                if self.source.input(name).type.shape[axis] >= len(self.group)}

    def _servers(self) -> dict[str, Device]:
        """ps: the server of each parameter and of its momentum. The largest parameter
        goes first, each to the device with the fewest bytes to serve so far (the first
        such device on a tie)."""
        if self.parallel.strategy != "ps":
            return {}
        params = sorted(self.source.inputs_with_role("param"), key=lambda v: -v.type.nbytes)
        load = {device: 0 for device in self.parallel.devices}
        servers: dict[str, Device] = {}
        for param in params:
            device = min(load, key=load.__getitem__)
            servers[param.name] = device
            load[device] += param.type.nbytes
        for node in self.source.nodes:  # the momentum lives with its weight
            if _updates(node) and node.inputs[0].name in servers:
                servers[node.inputs[1].name] = servers[node.inputs[0].name]
        return servers

    def _feeds_matmul(self, param: Value, fully_connected: set[int]) -> bool:
        """Whether ``param`` belongs to a fully connected layer: a matmul's weight, or a
        bias added to a matmul's output."""
        if id(param) in fully_connected:
            return True
        return any(n.op == "bias_add" and n.inputs[1] is param and
                   n.inputs[0].producer is not None and n.inputs[0].producer.op == "matmul"
                   for n in self.source.nodes)

    def _group_for(self, device: Device, variable: str | None = None) -> tuple[Device, ...]:
        """The group of a node on ``device``, or of one that updates ``variable`` or
        holds it (ps: the server alone; a parameter itself is held by every device, a
        momentum only by the server), else every device where the strategy spreads."""
        if variable in self.servers:
            return (self.servers[variable],)
        return self.parallel.devices if self.spread else (device,)

    def _holder(self, name: str) -> str | None:
        """``name`` if that variable lives on its server alone (ps: a momentum)."""
        held = name in self.servers and self.source.input(name).role != "param"
        return name if held else None

    def _wanted_outputs(self) -> dict[int, Distribution]:
        """A variable's next value comes back as the variable is laid out (a parameter's,
        the iteration counter's): the next step reads it there. Other graph outputs come
        back whole on every device, or in placed graphs where they are made."""
        variables = {v.name: v for v in self.source.inputs_with_role("param", "state")}
        wanted = {}
        for name, value in self.source.outputs:
            variable = variables.get(name)
            if variable is None and not self.spread:
                continue
            where = value.device if self.spread or variable is None else variable.device
            self.group = self._group_for(where, self._holder(name))
            wanted[id(value)] = (self._input_dist(variable) if variable is not None
                                 else self.dist(DistKind.replicated))
        return wanted

    def run(self) -> Graph:
        for v in self.source.inputs:
            self.group = self._group_for(v.device, self._holder(v.name))
            self.mapping[v] = self.new.add_input(v.name, v.type, self.group[0], v.role,
                                                 self._input_dist(v), v.init)
        body = [self._place(node) for node in self.source.nodes]
        outputs = []
        for name, v in self.source.outputs:
            wanted = self.wanted_out.get(id(v), self.mapping[v].dist)
            outputs.append((name, self._converted(self.mapping[v], wanted, f"output {name}")))
        self.new.nodes = [n for node in self.head + body for n in self._with_conversions(node)]
        self.new.set_outputs(outputs)
        return self.new

    def _with_conversions(self, node: Node) -> list[Node]:
        result = [node]
        for conversion in self.after.get(id(node), []):
            result += self._with_conversions(conversion)
        return result

    def _input_dist(self, v: Value) -> Distribution:
        if not self.spread:
            return self.dist(DistKind.replicated)
        if v.name in self.param_axes:
            return self.dist(DistKind.split, self.param_axes[v.name])
        if (v.role == "data" and self.parallel.strategy != "model" and v.type.rank >= 1
                and v.type.shape[0] >= len(self.group)):
            return self.dist(DistKind.split, 0)
        return self.dist(DistKind.replicated)

    # -- one node ---------------------------------------------------------------------

    def _place(self, node: Node) -> Node:
        if node.body is not None:
            raise PurinecError(f"graph {self.source.name}: fused node {describe(node)}; a "
                               f"graph is laid out over devices before fusion, which runs "
                               f"on each rank's own graph: lay it out as it was before")
        inputs = [self.mapping[v] for v in node.inputs]
        updated = node.inputs[0].name if _updates(node) else None
        self.group = self._group_for(node.device, updated)
        signature = self._choose(node, inputs)
        why = f"{node.op} %{node.outputs[0].name}" if node.outputs else node.op
        boxed = [self._converted(v, self._entry_dist(entry), why)
                 for v, entry in zip(inputs, signature.inputs)]
        copy = self.new.make_node(node.op, boxed, dict(node.attrs),
                                  names=[v.name for v in node.outputs],
                                  types=[v.type for v in node.outputs],
                                  device=self.group[0], loc=node.loc)
        for old, new, entry in zip(node.outputs, copy.outputs, signature.outputs):
            new.dist = self._entry_dist(entry)
            self.mapping[old] = new
        return copy

    def _entry_dist(self, entry: str) -> Distribution:
        if entry == "B":
            return self.dist(DistKind.replicated)
        if entry == "P":
            return self.dist(DistKind.partial)
        return self.dist(DistKind.split, int(entry[1:]))

    def _fits(self, entry: str, ty: TensorType) -> bool:
        if not entry.startswith("S"):
            return True
        axis = int(entry[1:])
        return axis < ty.rank and ty.shape[axis] >= len(self.group)

    def _choose(self, node: Node, inputs: list[Value]) -> SplitSignature:
        opdef = get_op(node.op)
        types = [v.type for v in inputs]
        signatures = opdef.signatures(types, node.attrs)
        for s in signatures:
            assert (len(s.inputs), len(s.outputs)) == (len(inputs), len(node.outputs)), \
                f"split signature {s} of {node.op} does not match its arity"
        candidates = [s for s in signatures
                      if all(map(self._fits, s.inputs, types)) and
                      all(map(self._fits, s.outputs, [v.type for v in node.outputs]))]
        fallback = SplitSignature(("B",) * len(inputs), ("B",) * len(node.outputs))
        if not self.spread:
            return fallback  # one device: the whole tensors
        if self.parallel.strategy in ("data", "ps"):
            # Data parallelism as users know it: a node keeps its inputs' layouts where its
            # op can (the batch stays split, a weight gradient stays a partial sum for the
            # allreduce), so no conversion lands on the forward or backward critical path.
            # A gather that moves fewer bytes would still wait there (lenet's ip1). (A
            # server's weight is broadcast whatever the layout; only values on the node's
            # group have one to keep.)
            keeping = [s for s in candidates
                       if all(self._entry_dist(e) == v.dist for v, e in zip(inputs, s.inputs)
                              if v.dist.group == self.group)]
            candidates = keeping or candidates
            if keeping:
                fallback = min(keeping, key=lambda s: self._cost(node, inputs, s))
        best, best_cost = fallback, self._cost(node, inputs, fallback)
        for signature in candidates:
            cost = self._cost(node, inputs, signature)
            if cost < best_cost:
                best, best_cost = signature, cost
        if best_cost == math.inf:
            raise PurinecError(f"node {node!r}: no way to lay out its inputs "
                               f"({', '.join(str(v.dist) for v in inputs)}) for any of its "
                               f"split signatures")
        return best

    def _cost(self, node: Node, inputs: list[Value], signature: SplitSignature) -> float:
        """Bytes moved to lay the inputs out, plus what the outputs will cost: their
        conversion where the graph returns them, half an allreduce for a partial sum
        (which nearly always needs one), and work repeated on every device."""
        cost = sum(conversion_cost(v.dist, self._entry_dist(e), v.type.nbytes)
                   for v, e in zip(inputs, signature.inputs))
        for v, e in zip(node.outputs, signature.outputs):
            if id(v) in self.wanted_out:
                cost += conversion_cost(self._entry_dist(e), self.wanted_out[id(v)],
                                        v.type.nbytes)
            elif e == "P":
                cost += v.type.nbytes
        if all(e == "B" for e in signature.outputs):
            n = len(self.group)
            cost += node_flops(node) * (n - 1) / n / FLOPS_PER_BYTE
        return cost

    def _converted(self, value: Value, dst: Distribution, why: str) -> Value:
        key = (id(value), dst)
        if value.dist == dst:
            return value
        if key not in self.converted:
            nodes = convert(self.new, value, dst, why)
            for node in nodes:
                producer = node.inputs[0].producer
                place = self.after.setdefault(id(producer), []) if producer else self.head
                place.append(node)
            self.converted[key] = nodes[-1].outputs[0]
        return self.converted[key]
