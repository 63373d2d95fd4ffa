"""The IR verifier: checks a graph's invariants and says which node breaks one, and how.

`verify(graph)` raises `VerifyError` on the first problem, in graph order:

- names: the graph's, every value's and every output's match `NAME_RE`;
- graph inputs: a valid role, no producer, defined once;
- each node: a registered op, the right number of inputs, attributes complete, bounded and
  normalised (``OpDef.complete_attrs`` leaves them unchanged), inputs defined earlier
  (a use before definition is reported as a cycle when the nodes form one), outputs
  defined once with the node as producer, declared output types equal to the types the
  registry infers from the declared input types;
- types: at most 32 dimensions and 2**56 elements, no negative sizes; a param's or
  state's init a filler for its dtype (`purinec.ir.init.check_init`);
- placements: known device kinds, non-negative indices and ranks;
- locations: one line with no surrounding whitespace (so the text form round-trips);
- fused nodes: a non-empty body of plain members (no nesting) checked like any node,
  each reading only the fused node's inputs or earlier members' outputs, all on one
  device; inputs exactly the outside values the members read, in first-use order;
  outputs outputs of members; a unique kernel name; values a fused node does not export
  are invisible after it;
- graph outputs: defined values under unique names; an output named after a param or
  state input is its next value, of its type;
- with ``program=True`` (a graph a `Program` runs, not one rank's piece of one): a
  graph that returns a param's next value (a training iteration) returns ``loss``, a
  float scalar; a fused graph lives on one device.

A `VerifyError` carries what breaks the invariant (a node, graph input or output), so
the parser can name its line.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

from purinec.errors import PurinecError, ShapeError, UnknownOpError, VerifyError
from purinec.ir.graph import FUSED, INPUT_ROLES, NAME_RE, Graph, Node, Value, external_inputs
from purinec.ir.init import check_init
from purinec.ir.ops import get_op, unknown_op_message
from purinec.ir.types import DEVICE_KINDS, Device, Distribution, TensorType, shape_problem


def verify(graph: Graph, *, program: bool = False) -> None:
    """Raise `VerifyError` naming the first node (or input, or output) that breaks an
    IR invariant; return None when the graph is well formed. With ``program``, the graph
    is one a `Program` runs (a model's own graph, a .pir file, an artifact's), not one
    rank's piece of a distributed one: check what running it relies on too."""
    _Verifier(graph, program).run()


@contextlib.contextmanager
def _blaming(**culprit):
    """Mark a `VerifyError` raised inside with ``culprit`` (``node=``, ``value=`` or
    ``output=``, see VerifyError), unless something within it (a fused node's member)
    was marked first."""
    try:
        yield
    except VerifyError as err:
        if err.node is None and err.value is None and err.output is None:
            for key, obj in culprit.items():
                setattr(err, key, obj)
        raise


def describe(node: Node) -> str:
    """``%y = relu(%x)``, with `` (at lenet.py:12)`` when the node has a location."""
    text = repr(node) if node.outputs else repr(node).lstrip(" =")
    if node.loc:
        loc = node.loc if isinstance(node.loc, str) and node.loc.isprintable() else repr(node.loc)
        text += f" (at {loc})"
    return text


class _Verifier:
    def __init__(self, graph: Graph, program: bool = False):
        self.graph = graph
        self.program = program
        self.defined_ids: set[int] = set()       # id() of every Value nodes may read now
        self.defined_names: dict[str, str] = {}  # name -> where it was defined
        self.internal: dict[int, Node] = {}      # id() of member values not exported -> fused
        self.kernels: dict[str, Node] = {}       # kernel name -> fused node
        self.seen_nodes: set[int] = set()

    def run(self) -> None:
        graph = self.graph
        if not isinstance(graph.name, str) or not NAME_RE.fullmatch(graph.name):
            raise VerifyError(f"graph name {graph.name!r} is not a valid name; names match "
                              f"{NAME_RE.pattern}")
        for value in graph.inputs:
            with _blaming(value=value):
                self.check_input(value)
        for index, node in enumerate(graph.nodes):
            with _blaming(node=node):
                self.check_unique(node)
                if node.op == FUSED or node.body is not None:
                    self.check_fused(index, node)
                else:
                    self.check_node(index, node)
        self.check_outputs()
        if self.program:
            self.check_program()

    def check_unique(self, node: Node) -> None:
        if id(node) in self.seen_nodes:
            raise VerifyError(f"node {describe(node)} appears twice in graph "
                              f"{self.graph.name} (its node list or a fused node's body); "
                              f"keep one copy")
        self.seen_nodes.add(id(node))

    # -- inputs ---------------------------------------------------------------------

    def check_input(self, value: Value) -> None:
        what = f"graph input %{getattr(value, 'name', value)}"
        self.check_value(value, what)
        if value.role not in INPUT_ROLES:
            raise VerifyError(f"{what} has role {value.role!r}; it must be one of "
                              f"{', '.join(INPUT_ROLES)}")
        if value.producer is not None:
            raise VerifyError(f"{what} has producer {describe(value.producer)}; a graph "
                              f"input must have none (set value.producer = None, or make "
                              f"it a node output)")
        if value.init is not None and not isinstance(value.init, str):
            raise VerifyError(f"{what} has init {value.init!r}; it must be a string or None")
        if value.init is not None and value.role in ("param", "state"):
            try:  # (a data input's init is free text: nothing reads it)
                check_init(value.init, value.type.dtype)
            except PurinecError as err:
                raise VerifyError(f"{what}: {err}") from None
        self.define(value, what)

    # -- nodes ----------------------------------------------------------------------

    def check_node(self, index: int, node: Node) -> None:
        """A node of the graph's node list (not fused)."""
        where = f"node {describe(node)}"
        opdef = self.check_op(where, node)
        for pos, value in enumerate(node.inputs):
            if id(value) not in self.defined_ids:
                self.undefined_input(index, node, pos, value)
        self.check_node_outputs(where, node)
        self.check_types(where, opdef, node)

    def check_op(self, where: str, node: Node):
        """The node's op, arity, attributes and location; returns its OpDef."""
        try:
            opdef = get_op(node.op)
        except UnknownOpError:
            raise VerifyError(f"{where}: {unknown_op_message(node.op)} (use an op of "
                              f"purinec.ir.ops.REGISTRY, or register this one)") from None
        try:
            opdef.check_arity(len(node.inputs))
        except VerifyError as e:
            raise VerifyError(f"{where}: {e}") from None
        self.check_attrs(where, opdef, node)
        if node.loc is not None:
            if (not isinstance(node.loc, str) or "\n" in node.loc or "\r" in node.loc
                    or node.loc != node.loc.rstrip(" \t")):
                raise VerifyError(f"{where}: location {node.loc!r} must be one line with no "
                                  f"trailing whitespace, or the text form cannot hold it")
        return opdef

    def check_node_outputs(self, where: str, node: Node) -> None:
        if not node.outputs:
            raise VerifyError(f"{where}: the node has no outputs; every op has at least one")
        for value in node.outputs:
            what = f"output %{getattr(value, 'name', value)} of {where}"
            self.check_value(value, what)
            if value.producer is not node:
                other = ("no producer" if value.producer is None
                         else f"producer {describe(value.producer)}")
                raise VerifyError(f"{what} has {other}; its producer must be the node that "
                                  f"defines it (set value.producer = node)")
            if value.role is not None or value.init is not None:
                raise VerifyError(f"{what} has role {value.role!r} and init {value.init!r}; "
                                  f"only graph inputs have a role and an init (set both to "
                                  f"None)")
            self.define(value, what)

    # -- fused nodes ----------------------------------------------------------------

    def check_fused(self, index: int, node: Node) -> None:
        """A fused node: a body of plain members on one device, each reading only the
        fused node's inputs and earlier members' outputs; inputs exactly what the members
        read from outside, in first-use order; outputs member outputs."""
        where = f"fused node {describe(node)}"
        if node.op != FUSED:
            raise VerifyError(f"{where}: op {node.op} has a body; only op {FUSED} holds "
                              f"members (set body = None)")
        if not isinstance(node.body, list) or not node.body:
            raise VerifyError(f"{where}: its body must be a non-empty list of member nodes, "
                              f"got {node.body!r}")
        self.check_op(where, node)
        self.check_kernel_name(where, node)
        for pos, value in enumerate(node.inputs):
            if id(value) not in self.defined_ids:
                self.undefined_input(index, node, pos, value)
        if len({id(v) for v in node.inputs}) != len(node.inputs):
            raise VerifyError(f"{where}: an input is listed twice; list each once")
        scope = {id(v) for v in node.inputs}
        for member in node.body:
            self.check_member(node, member, scope)
        self.check_fused_interface(where, node)
        exported = {id(v) for v in node.outputs}
        for member in node.body:
            for value in member.outputs:
                if id(value) not in exported:
                    self.defined_ids.discard(id(value))
                    self.internal[id(value)] = node

    def check_kernel_name(self, where: str, node: Node) -> None:
        kernel = node.attrs["kernel"]
        if not (kernel.isascii() and kernel.isidentifier()):
            raise VerifyError(f"{where}: kernel name {kernel!r} must be an identifier "
                              f"(letters, digits, underscores)")
        if kernel in self.kernels:
            raise VerifyError(f"{where}: kernel name {kernel} is also the name of "
                              f"{describe(self.kernels[kernel])}; fused nodes are named "
                              f"uniquely in a graph (add a suffix)")
        self.kernels[kernel] = node

    def check_member(self, fused: Node, member: Node, scope: set[int]) -> None:
        with _blaming(node=member):
            self.check_member_node(fused, member, scope)

    def check_member_node(self, fused: Node, member: Node, scope: set[int]) -> None:
        where = f"node {describe(member)} in the body of fused node %{fused.name}"
        self.check_unique(member)
        if member.op == FUSED or member.body is not None:
            raise VerifyError(f"{where}: fused nodes do not nest; put its members in the "
                              f"outer body")
        opdef = self.check_op(where, member)
        for pos, value in enumerate(member.inputs):
            if id(value) not in scope:
                self.unreadable_in_body(where, fused, pos, value)
        self.check_node_outputs(where, member)
        self.check_types(where, opdef, member)
        device = fused.body[0].outputs[0].device  # checked above to exist
        for value in member.outputs:
            if value.device != device:
                raise VerifyError(f"{where}: output %{value.name} is placed on "
                                  f"{value.device}, but the fused node runs on {device}; "
                                  f"all members of a fused node run on one device")
            scope.add(id(value))

    def unreadable_in_body(self, where: str, fused: Node, pos: int, value: Value) -> None:
        name = getattr(value, "name", repr(value))
        if any(value is v for m in fused.body for v in m.outputs):
            raise VerifyError(f"{where}: input {pos} %{name} is used before the member "
                              f"that defines it; members must be in topological order")
        if id(value) in self.defined_ids:
            raise VerifyError(f"{where}: input {pos} %{name} is not an input of the fused "
                              f"node; members read only its inputs and earlier members' "
                              f"outputs (add %{name} to the fused node's inputs)")
        raise VerifyError(f"{where}: input {pos} %{name} is not defined before the fused "
                          f"node (not a graph input nor an output of an earlier node)")

    def check_fused_interface(self, where: str, node: Node) -> None:
        members = {id(v) for m in node.body for v in m.outputs}
        if len({id(v) for v in node.outputs}) != len(node.outputs):
            raise VerifyError(f"{where}: an output is listed twice; list each once")
        for value in node.outputs:
            if id(value) not in members:
                raise VerifyError(f"{where}: output %{getattr(value, 'name', value)} is not "
                                  f"defined by any member of its body; a fused node "
                                  f"exports outputs of its members")
        if not node.outputs:
            raise VerifyError(f"{where}: the fused node exports no outputs; it needs at "
                              f"least one")
        read = external_inputs(node.body)
        if [id(v) for v in read] != [id(v) for v in node.inputs]:
            unread = [v.name for v in node.inputs if all(v is not r for r in read)]
            problem = (f"input(s) {', '.join('%' + n for n in unread)} are read by no "
                       f"member" if unread else "its inputs are not in first-use order")
            raise VerifyError(f"{where}: {problem}; its inputs must be exactly what its "
                              f"members read from outside, in the order they first read "
                              f"them: ({', '.join('%' + v.name for v in read)})")

    def check_attrs(self, where: str, opdef, node: Node) -> None:
        if not isinstance(node.attrs, dict):
            raise VerifyError(f"{where}: attributes must be a dict, got "
                              f"{type(node.attrs).__name__}")
        try:
            complete = opdef.complete_attrs(node.attrs)
        except VerifyError as e:
            raise VerifyError(f"{where}: {e}") from None
        for key, want in complete.items():
            if key not in node.attrs:
                raise VerifyError(f"{where}: attribute {key} is missing; the IR keeps every "
                                  f"attribute explicit (build nodes with Graph.add_node or "
                                  f"OpDef.complete_attrs, which fill in the default "
                                  f"{want!r})")
            have = node.attrs[key]
            if not _same_attr(have, want):
                raise VerifyError(f"{where}: attribute {key}={have!r} is not normalised "
                                  f"(expected {want!r} of kind {opdef.attrs[key].kind}); "
                                  f"pass attributes through OpDef.complete_attrs")

    def undefined_input(self, index: int, node: Node, pos: int, value: Value) -> None:
        where = f"node {describe(node)}"
        name = getattr(value, "name", repr(value))
        if id(value) in self.internal:
            raise VerifyError(f"{where}: input {pos} %{name} {self.internal_to(value)}")
        later = next((i for i, n in enumerate(self.graph.nodes[index:], index)
                      if any(o is value for o in n.defined_values())), None)
        if later is not None:
            cycle = _find_cycle(self.graph)
            if cycle:
                chain = " -> ".join(describe(n) for n in cycle + cycle[:1])
                raise VerifyError(f"nodes form a cycle: {chain}; a dataflow graph must be "
                                  f"acyclic (thread state through a graph output instead)")
            producer = self.graph.nodes[later]
            raise VerifyError(f"{where}: input {pos} %{name} is used before it is defined by "
                              f"node {describe(producer)} (node {later}, this is node "
                              f"{index}); nodes must be in topological order")
        if name in self.defined_names:
            raise VerifyError(f"{where}: input {pos} %{name} is a different Value object "
                              f"from the %{name} defined as {self.defined_names[name]}; "
                              f"use that one")
        raise VerifyError(f"{where}: input {pos} %{name} is not defined in graph "
                          f"{self.graph.name} (not a graph input nor an output of an earlier "
                          f"node); add it as an input or compute it first")

    def check_types(self, where: str, opdef, node: Node) -> None:
        in_types = [v.type for v in node.inputs]
        try:
            inferred = opdef.infer(in_types, node.attrs)
        except (ShapeError, VerifyError) as e:
            raise VerifyError(f"{where}: inputs of types "
                              f"{', '.join(map(str, in_types)) or '(none)'} are not accepted: "
                              f"{e}") from None
        except (ValueError, TypeError, IndexError, KeyError, ZeroDivisionError) as e:
            raise VerifyError(f"{where}: type inference failed on inputs "
                              f"{', '.join(map(str, in_types)) or '(none)'}: "
                              f"{type(e).__name__}: {e}") from None
        declared = [v.type for v in node.outputs]
        if len(inferred) != len(declared):
            raise VerifyError(f"{where}: op {node.op} has {len(inferred)} output(s) here "
                              f"({', '.join(map(str, inferred))}) but the node declares "
                              f"{len(declared)}")
        for value, want in zip(node.outputs, inferred):
            if value.type != want:
                raise VerifyError(f"{where}: output %{value.name} is declared {value.type} but "
                                  f"op {node.op} gives {want} for inputs "
                                  f"{', '.join(map(str, in_types)) or '(none)'}; fix the "
                                  f"declared type or the inputs")

    # -- values ---------------------------------------------------------------------

    def check_value(self, value: Value, what: str) -> None:
        if not isinstance(value, Value):
            raise VerifyError(f"{what} is a {type(value).__name__}, not a Value")
        if not isinstance(value.name, str) or not NAME_RE.fullmatch(value.name):
            raise VerifyError(f"{what}: name {value.name!r} is not a valid name; names match "
                              f"{NAME_RE.pattern}")
        if not isinstance(value.type, TensorType):
            raise VerifyError(f"{what} has type {value.type!r}, not a TensorType")
        problem = shape_problem(value.type.shape)
        if problem:
            raise VerifyError(f"{what} has {problem} in {value.type}")
        _check_device(value.device, what)
        if value.dist is not None:
            if not isinstance(value.dist, Distribution):
                raise VerifyError(f"{what} has distribution {value.dist!r}, not a "
                                  f"Distribution")
            for device in value.dist.group:
                _check_device(device, f"{what} (distribution {value.dist})")
            if len(set(value.dist.group)) != len(value.dist.group):
                raise VerifyError(f"{what} is laid out over {value.dist}, which names a "
                                  f"device twice; a group's devices are distinct")
            axis = value.dist.axis
            if axis is not None and not 0 <= axis < value.type.rank:
                raise VerifyError(f"{what} is split along axis {axis}, which {value.type} "
                                  f"does not have")

    def define(self, value: Value, what: str) -> None:
        if id(value) in self.defined_ids:
            raise VerifyError(f"{what}: this Value object is already defined as "
                              f"{self.defined_names.get(value.name, 'an earlier value')}; "
                              f"a value is defined once (make a new Value)")
        if value.name in self.defined_names:
            raise VerifyError(f"{what}: value %{value.name} is defined twice (first as "
                              f"{self.defined_names[value.name]}); rename one "
                              f"(Graph.fresh_name gives an unused name)")
        self.defined_ids.add(id(value))
        self.defined_names[value.name] = what

    # -- outputs --------------------------------------------------------------------

    def check_outputs(self) -> None:
        names: set[str] = set()
        variables = {v.name: v for v in self.graph.inputs if v.role in ("param", "state")}
        for entry in self.graph.outputs:
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise VerifyError(f"graph output {entry!r} must be a (name, Value) pair")
            with _blaming(output=entry[0]):
                self.check_output(*entry, names, variables)

    def check_output(self, name: str, value: Value, names: set[str],
                     variables: dict[str, Value]) -> None:
        vname = getattr(value, "name", repr(value))
        what = f"graph output {name}=%{vname}"
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise VerifyError(f"{what}: name {name!r} is not a valid name; names match "
                              f"{NAME_RE.pattern}")
        if name in names:
            raise VerifyError(f"{what}: output name {name} is used twice; output names "
                              f"must be unique")
        names.add(name)
        if id(value) in self.internal:
            raise VerifyError(f"{what}: %{vname} {self.internal_to(value)}")
        if id(value) not in self.defined_ids:
            raise VerifyError(f"{what}: %{vname} is not a value of graph "
                              f"{self.graph.name} (not an input nor a node output)")
        variable = variables.get(name)
        if variable is not None and value.type != variable.type:
            raise VerifyError(f"{what}: an output named after {variable.role} {name} is "
                              f"its next value, so it must have its type "
                              f"{variable.type}, not {value.type}")

    # -- what a program relies on -------------------------------------------------

    def check_program(self) -> None:
        self.check_training_outputs()
        self.check_fused_on_one_device()

    def check_training_outputs(self) -> None:
        """A graph that returns a parameter's next value is a training iteration, whose
        loss `Program.step` reports: it returns ``loss``, a float scalar."""
        graph = self.graph
        params = {v.name for v in graph.inputs_with_role("param")}
        updates = [name for name, _ in graph.outputs if name in params]
        if not updates:
            return
        loss = dict(graph.outputs).get("loss")
        if loss is None:
            raise VerifyError(
                f"graph {graph.name} returns the next value of param {updates[0]}, so it is "
                f"a training iteration, but it returns no loss; a training iteration "
                f"returns loss=%value, the float scalar each step reports (or, if this is "
                f"one rank's piece of a distributed program, compile the whole graph)",
                output=updates[0])
        if loss.type.rank != 0 or not loss.type.dtype.is_float:
            raise VerifyError(f"graph output loss=%{loss.name} is {loss.type}; the loss of "
                              f"a training iteration is a float scalar (f32[] or f64[])",
                              output="loss")

    def check_fused_on_one_device(self) -> None:
        """A program's graph is laid out over its devices before fusion, which runs on
        each rank's own graph: a fused graph lives on one device."""
        fused = next((node for node in self.graph.nodes if node.body is not None), None)
        devices = self.graph.devices()
        if fused is not None and len(devices) > 1:
            raise VerifyError(
                f"fused node {describe(fused)}: graph {self.graph.name} is fused, yet it "
                f"places values on {', '.join(map(str, devices))}; a graph is laid out over "
                f"several devices before fusion, so give it as it was before (purinec dump "
                f"--stage cse), placed as you want it", fused)

    def internal_to(self, value: Value) -> str:
        fused = self.internal[id(value)]
        return (f"is internal to fused node {describe(fused)}: it is not among the outputs "
                f"the fused node exports (add it to them to read it outside)")


def _check_device(device: Device, what: str) -> None:
    if not isinstance(device, Device):
        raise VerifyError(f"{what} has device {device!r}, not a Device")
    if device.kind not in DEVICE_KINDS or device.index < 0 or device.rank < 0:
        raise VerifyError(f"{what} is placed on {device}; devices are "
                          f"{' or '.join(DEVICE_KINDS)} with a non-negative index and rank")


def _same_attr(a: Any, b: Any) -> bool:
    """Equal and of the same Python type (so 1 is not 1.0 and a tuple is not a list)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same_attr(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def _find_cycle(graph: Graph) -> list[Node]:
    """The nodes of one cycle in the dataflow between ``graph.nodes``, or []."""
    import networkx as nx  # only a malformed graph gets here: keep its import off loading

    dg = nx.DiGraph()
    producer: dict[int, int] = {}
    for i, node in enumerate(graph.nodes):
        dg.add_node(i)
        for value in node.outputs:
            producer[id(value)] = i
    for i, node in enumerate(graph.nodes):
        for value in node.inputs:
            if id(value) in producer:
                dg.add_edge(producer[id(value)], i)
    try:
        edges = nx.find_cycle(dg)
    except nx.NetworkXNoCycle:
        return []
    return [graph.nodes[u] for u, _ in edges]
