"""The IR's data structure: values, nodes and graphs.

A `Graph` is a flat dataflow DAG in SSA form: every `Value` is defined once, either as
a graph input or as an output of exactly one `Node`, and nodes are kept in topological
order. State (weights, momentum history) is threaded through: a state input ``%w`` and
an output named ``w`` in the return list are the same variable before and after one
run of the graph.

A *fused* node (op ``fused``, made by `purinec.passes.fuse`) is one kernel holding a
``body``: its member nodes in execution order. Members live in the graph's namespace
(their values keep their names and the member is each value's producer); the fused
node's inputs are the outside values its members read, in first-use order, and its
outputs are those member outputs read outside it or returned, the very same `Value`
objects. Graph-level queries (`Graph.nodes`, `values`, `users`) see the fused node;
`flat_nodes` sees its members instead. Fused nodes do not nest.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field
from typing import Any, Collection, Iterable, Sequence

from purinec.errors import VerifyError
from purinec.ir.ops import Trait, get_op
from purinec.ir.printer import print_graph
from purinec.ir.types import CPU0, Device, Distribution, TensorType

# Value names: what a user's hierarchical names can look like (``net.conv1.weight``).
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")

# Roles of graph inputs: fed each run (data), or held by the program between runs.
INPUT_ROLES = ("data", "param", "state")


@dataclass(eq=False)
class Value:
    """A tensor in the IR: named, typed and placed."""

    name: str
    type: TensorType
    device: Device = CPU0
    dist: Distribution | None = None
    producer: "Node | None" = field(default=None, repr=False)
    role: str | None = None  # for graph inputs: one of INPUT_ROLES
    init: str | None = None  # for params and state: how to fill it, see purinec.ir.init

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type} @{self.device}"


FUSED = "fused"


@dataclass(eq=False)
class Node:
    """One operator application. ``loc`` is the user's source line, where known.
    ``body`` is None except for fused nodes, which hold their members there."""

    op: str
    inputs: list[Value]
    outputs: list[Value]
    attrs: dict[str, Any] = field(default_factory=dict)
    loc: str | None = None
    body: "list[Node] | None" = None

    def defined_values(self) -> list[Value]:
        """Every value this node defines: its outputs, or for a fused node all its
        members' outputs (the ones it exports and the internal ones)."""
        if self.body is None:
            return list(self.outputs)
        return [v for member in self.body for v in member.outputs]

    @property
    def device(self) -> Device:
        return self.outputs[0].device if self.outputs else CPU0

    @property
    def name(self) -> str:
        """A node is named after its first output, as in the IR text."""
        return self.outputs[0].name if self.outputs else f"<{self.op}>"

    def __repr__(self) -> str:
        outs = ", ".join("%" + v.name for v in self.outputs)
        ins = ", ".join("%" + v.name for v in self.inputs)
        return f"{outs} = {self.op}({ins})"


class Graph:
    """A named dataflow graph: inputs, nodes in topological order, named outputs."""

    def __init__(self, name: str):
        self.name = name
        self.inputs: list[Value] = []
        self.nodes: list[Node] = []
        self.outputs: list[tuple[str, Value]] = []
        self._names: set[str] = set()

    # -- building -------------------------------------------------------------------

    def fresh_name(self, base: str, avoid: Collection[str] = ()) -> str:
        """``base`` if unused in this graph (and not in ``avoid``: names a front end
        keeps for values still to come), else ``base.1``, ``base.2``, ..."""
        name, i = base, 0
        while name in self._names or name in avoid:
            i += 1
            name = f"{base}.{i}"
        return name

    def _claim(self, name: str) -> str:
        if name in self._names:
            raise VerifyError(f"value %{name} is already defined in graph {self.name}")
        self._names.add(name)
        return name

    def add_input(self, name: str, type: TensorType, device: Device = CPU0,
                  role: str = "data", dist: Distribution | None = None,
                  init: str | None = None) -> Value:
        if role not in INPUT_ROLES:
            raise ValueError(f"unknown input role {role!r}")
        value = Value(self._claim(name), type, device, dist, None, role, init)
        self.inputs.append(value)
        return value

    def add_node(self, op: str, inputs: Iterable[Value], attrs: dict | None = None,
                 names: Iterable[str] | None = None, types: Iterable[TensorType] | None = None,
                 device: Device | None = None, loc: str | None = None) -> Node:
        """Append a node. Output types come from the op registry unless given;
        output names default to fresh names after the op."""
        node = self.make_node(op, inputs, attrs, names, types, device, loc)
        self.nodes.append(node)
        return node

    def make_node(self, op: str, inputs: Iterable[Value], attrs: dict | None = None,
                  names: Iterable[str] | None = None, types: Iterable[TensorType] | None = None,
                  device: Device | None = None, loc: str | None = None) -> Node:
        """A node as `add_node` builds it (its output names claimed in this graph), but
        not appended: for the members of a fused node's body."""
        inputs = list(inputs)
        opdef = get_op(op)
        attrs = opdef.complete_attrs(attrs or {})
        if types is None:
            types = opdef.infer([v.type for v in inputs], attrs)
        types = list(types)
        if names is None:
            names = []
            for _ in types:  # claim as we go, so a multi-output op gets distinct names
                names.append(self.fresh_name(op))
                self._names.add(names[-1])
            self._names.difference_update(names)
        names = list(names)
        if len(names) != len(types):
            raise ValueError(f"{op}: {len(names)} output names for {len(types)} outputs")
        if device is None:
            device = inputs[0].device if inputs else CPU0
        node = Node(op, inputs, [], attrs, loc)
        for name, ty in zip(names, types):
            node.outputs.append(Value(self._claim(name), ty, device, None, node))
        return node

    def add_fused(self, body: Iterable[Node], inputs: Iterable[Value],
                  outputs: Iterable[Value], kernel: str, loc: str | None = None) -> Node:
        """Append a fused node over ``body`` (members made with `make_node`, or taken
        from this graph's nodes) exporting ``outputs``, values the members define."""
        node = Node(FUSED, list(inputs), list(outputs), {"kernel": kernel}, loc, list(body))
        self.nodes.append(node)
        return node

    def set_outputs(self, outputs: Iterable[tuple[str, Value]]) -> None:
        self.outputs = list(outputs)

    # -- queries --------------------------------------------------------------------

    def values(self) -> Iterable[Value]:
        """Graph inputs and node outputs (of a fused node: the values it exports)."""
        yield from self.inputs
        for node in self.nodes:
            yield from node.outputs

    def devices(self) -> list[Device]:
        """Every device a value of this graph lives on (inside fused nodes too), sorted."""
        return sorted({v.device for v in self.inputs} |
                      {v.device for node in self.flat_nodes() for v in node.outputs})

    def flat_nodes(self) -> Iterable[Node]:
        """The nodes in execution order, each fused node replaced by its members."""
        for node in self.nodes:
            if node.body is None:
                yield node
            else:
                yield from node.body

    def value(self, name: str) -> Value:
        """The value named ``name``, wherever it is defined (inside fused nodes too)."""
        for v in self.inputs:
            if v.name == name:
                return v
        for node in self.flat_nodes():
            for v in node.outputs:
                if v.name == name:
                    return v
        raise KeyError(name)

    def input(self, name: str) -> Value:
        for v in self.inputs:
            if v.name == name:
                return v
        raise KeyError(name)

    def output(self, name: str) -> Value:
        for out_name, v in self.outputs:
            if out_name == name:
                return v
        raise KeyError(name)

    def inputs_with_role(self, *roles: str) -> list[Value]:
        return [v for v in self.inputs if v.role in roles]

    def users(self) -> dict[Value, list[Node]]:
        """Map from each value to the nodes that read it, in graph order."""
        result: dict[Value, list[Node]] = {v: [] for v in self.values()}
        for node in self.nodes:
            for v in node.inputs:
                result.setdefault(v, []).append(node)
        return result

    def clone(self) -> "Graph":
        """A deep copy sharing nothing mutable with this graph (attrs are copied)."""
        new = Graph(self.name)
        mapping: dict[Value, Value] = {}
        for v in self.inputs:
            mapping[v] = new.add_input(v.name, v.type, v.device, v.role, v.dist, v.init)
        for node in self.nodes:
            new.nodes.append(new.copy_node(node, mapping))
        new.outputs = [(name, mapping[v]) for name, v in self.outputs]
        return new

    def copy_node(self, node: Node, mapping: dict[Value, Value]) -> Node:
        """A copy of ``node`` in this graph, reading ``mapping``'s copies of its inputs;
        adds the copies of the values it defines to ``mapping``."""
        inputs = [mapping[v] for v in node.inputs]
        if node.body is not None:
            body = [self.copy_node(member, mapping) for member in node.body]
            return Node(node.op, inputs, [mapping[v] for v in node.outputs],
                        _copy_attrs(node.attrs), node.loc, body)
        copy = Node(node.op, inputs, [], _copy_attrs(node.attrs), node.loc)
        for v in node.outputs:
            out = Value(self._claim(v.name), v.type, v.device, v.dist, copy)
            copy.outputs.append(out)
            mapping[v] = out
        return copy

    def rebuild_names(self) -> None:
        """Recompute the set of claimed names after a pass removed nodes."""
        self._names = {v.name for v in self.inputs}
        self._names.update(v.name for node in self.flat_nodes() for v in node.outputs)

    def __str__(self) -> str:
        return print_graph(self)

    def __repr__(self) -> str:
        return f"<Graph {self.name}: {len(self.inputs)} inputs, {len(self.nodes)} nodes>"


def member_name(name: str, member: int, members: int) -> str:
    """The physical name of group member ``member``'s piece of logical value ``name``
    (see purinec.passes.parallel.partition); a value on one device keeps its name."""
    return name if members == 1 else f"{name}.p{member}"


def anchor_destination(node: Node) -> Value | None:
    """The output of fused ``node`` its epilogue anchor (a conv2d or matmul that
    elementwise members follow, `Trait.epilogue_anchor`) computes into when nothing
    outside the node reads the anchor's result: the first output of its type that no
    solver update writes (an update goes over its variable, in place), which the
    members then rewrite in place, element by element. A scratch of the anchor's size
    would take a write and a read more through memory (a 1x1 convolution to 96 channels
    of 112x112 with its batch norm: 306 -> 261 us hot, 706 -> 537 with cold caches).
    The anchor writes it before any member reads the node's inputs, so the memory
    planner never puts it over one (`purinec.runtime.memory.may_alias`; a residual sum
    then takes memory of its own rather than its input's). None where the anchor's
    result is exported or no output qualifies: the anchor then computes into a
    scratch."""
    if node.body is None or not get_op(node.body[0].op).has(Trait.epilogue_anchor):
        return None
    (produced,) = node.body[0].outputs
    if produced in node.outputs:
        return None
    for value in node.outputs:
        writer = next(member for member in node.body if value in member.outputs)
        if value.type == produced.type and not get_op(writer.op).has(Trait.solver_update):
            return value
    return None


def external_inputs(body: Iterable[Node]) -> list[Value]:
    """The values ``body``'s members read that no member defines, in first-use order:
    what a fused node over ``body`` takes as inputs."""
    defined: set[int] = set()
    seen: set[int] = set()
    result = []
    for member in body:
        for v in member.inputs:
            if id(v) not in defined and id(v) not in seen:
                seen.add(id(v))
                result.append(v)
        defined.update(id(v) for v in member.outputs)
    return result


def stable_topological_order(keys: Sequence, successors: Sequence[Iterable[int]]
                             ) -> list[int]:
    """Items ``0..n-1`` in an order where each comes before its ``successors`` (an edge
    listed twice counts twice), otherwise as early as its key allows: of the items ready
    at each point, the one with the least key (Kahn's algorithm). Items on a cycle, or
    after one, are left out: a caller checks that every item is there."""
    waiting = [0] * len(keys)
    for after in successors:
        for item in after:
            waiting[item] += 1
    ready = [(keys[i], i) for i in range(len(keys)) if not waiting[i]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, item = heapq.heappop(ready)
        order.append(item)
        for successor in successors[item]:
            waiting[successor] -= 1
            if not waiting[successor]:
                heapq.heappush(ready, (keys[successor], successor))
    return order


def _copy_attrs(attrs: dict) -> dict:
    return {k: (list(v) if isinstance(v, list) else v) for k, v in attrs.items()}


def updated_variables(graph: Graph) -> list[str]:
    """The params and state whose next value ``graph`` returns (an output of the name):
    none for an inference graph, all of them for a training iteration."""
    names = {v.name for v in graph.inputs_with_role("param", "state")}
    return [name for name, _ in graph.outputs if name in names]
