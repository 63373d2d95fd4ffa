"""The `fuse` pass: groups nodes into fused nodes, one kernel each (TVM's FuseOps).

Every op has a `FusionKind` in the registry, TVM's lattice: elementwise < broadcast <
injective < reduction < out_elementwise_fusable (conv2d, matmul) < opaque. Nodes are
grouped with union-find in three steps; every merge passes the same checks (below).

1. Post-dominators, as TVM does. In the dataflow DAG, with a virtual sink after every
   node whose value is returned or never read, a node joins its immediate
   post-dominator together with every node on the paths between them. That fuses
   chains and diamonds of elementwise ops, and folds the elementwise consumers of a
   conv2d or matmul into its epilogue (conv2d -> bias_add -> relu).
2. Escaping values. A training graph reads most forward values again in the backward
   pass (%conv1 feeds relu and relu_grad), so there a producer rarely has a
   post-dominator it could fuse with. This step lets a consumer join its producer's
   group anyway; the fused node then exports the value to its other readers. Nothing is
   computed twice (every node is in exactly one group), and the path check refuses any
   merge that would make a cycle through an outside node. Repeated until nothing merges.
3. Solver updates, horizontally. The `sgd` nodes still alone (one per parameter; those
   fed by a matmul joined its epilogue in step 1) become one fused node per device of
   independent members, in chunks of at most `MAX_SOLVER_GROUP` (and
   ``max_group_size``), when no path joins two of them and no two share an input (so
   each member may update its own weight and history in place without disturbing
   another). Updates whose gradients arrive from different communication nodes
   (allreduces of a data-parallel graph) stay apart: one fused update would wait for
   the last gradient, while apart each runs when its own arrives, filling the wait for
   the next.

The checks. Every value that would flow inside the merged group, from a producer to a
consumer: the consumer is elementwise or broadcast (nothing fuses into a conv2d or
matmul but its epilogue); the producer is elementwise, broadcast or
out_elementwise_fusable (injective ops stay alone: a reshape is a free view for the
memory planner, and concat or split would break the one-loop shape; reductions and
opaque ops stay alone); both run on one device; the value has the shape of the
consumer's outputs (a broadcast op broadcasts only inputs from outside its group). The
merged group: at most one out_elementwise_fusable member, at most ``max_group_size``
members, and no path from it back into it through an outside node (a cycle).

A rank's graph does not show every path. What a receive or a collective across ranks
gives may depend on what this rank sent or contributed to an earlier exchange, through
other ranks' work (a pipeline stage's gradient comes back from the stage its
activations went to). So the planner chains this rank's exchanges, each after the one
before it (the order every rank posts them in): a group that both feeds an exchange and
waits for a later one would wait for itself, and the path check refuses it.

So the pass makes three shapes of group, which is what a renderer has to handle:

- loop: elementwise and broadcast members whose outputs all have one shape;
- epilogue: ``body[0]`` is a conv2d or matmul, then a loop over its output's shape;
- horizontal: independent ``sgd`` members, each a loop of its own shape.

Members are in topological order, the anchor first. A fused node exports the member
outputs read outside it or returned (and any read by nobody: removing dead code is
`dce`'s job, not this pass's). Its kernel is named after its members' ops, TVM style
(``fused_conv2d_bias_add_relu``), a run of one op counted (``fused_sgd_x8``), with
``_1``, ``_2``, ... for a name already used in the graph.

`explain(graph)` says, for every value that flows between two nodes `fuse(graph)` leaves
in different groups, why they were not fused (``%conv1 -> %pool1: max_pool2d is
opaque``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from purinec.errors import PurinecError
from purinec.ir.graph import FUSED, Graph, Node, Value, external_inputs, stable_topological_order
from purinec.ir.ops import FusionKind, Trait, get_op, op_has, spans_ranks

DEFAULT_MAX_GROUP_SIZE = 64

LOOP_KINDS = (FusionKind.elementwise, FusionKind.broadcast)
ANCHOR = FusionKind.out_elementwise_fusable
# Updates per horizontal group. Numba's compile time grows faster than the number of
# loops in a kernel (inception's 41 updates: 58 s as one kernel, 16 s in groups of 16,
# 12 s in groups of 8 or 4), while fusing saves a kernel launch per update and nothing
# else: each member is a loop of its own.
MAX_SOLVER_GROUP = 8

# Kernel names longer than this keep their first ops and say how many more there are.
MAX_KERNEL_NAME = 64

_KIND_WORDS = {FusionKind.injective: "injective", FusionKind.reduction: "a reduction",
               FusionKind.opaque: "opaque"}


@dataclass(frozen=True)
class Apart:
    """A value read by a node of another group, and why the two did not fuse."""

    value: str     # the value's name
    consumer: str  # the reading node's name
    reason: str

    def __str__(self) -> str:
        return f"%{self.value} -> %{self.consumer}: {self.reason}"


def fuse(graph: Graph, max_group_size: int = DEFAULT_MAX_GROUP_SIZE) -> Graph:
    """A new graph in which every group of two or more nodes is one fused node."""
    new = graph.clone()
    planner = _Planner(new, max_group_size)
    planner.plan()
    new.nodes = _rebuild(new, planner)
    return new


def explain(graph: Graph, max_group_size: int = DEFAULT_MAX_GROUP_SIZE) -> list[Apart]:
    """Why `fuse` leaves each producer-consumer pair of ``graph`` in different nodes."""
    planner = _Planner(graph, max_group_size)
    return planner.plan()


def kernel_name(body: list[Node]) -> str:
    """``fused_`` and the members' ops in order, a run of one op as ``op_xN``."""
    parts = []
    for op, run in itertools.groupby(member.op for member in body):
        count = len(list(run))
        parts.append(op if count == 1 else f"{op}_x{count}")
    name = "fused_" + "_".join(parts)
    kept = len(parts)
    while len(name) > MAX_KERNEL_NAME and kept > 1:
        kept -= 1
        name = "fused_" + "_".join(parts[:kept]) + f"_and_{len(parts) - kept}_more"
    return name


class _Planner:
    """Union-find over the nodes of ``graph`` (indices in graph order)."""

    def __init__(self, graph: Graph, max_group_size: int):
        if max_group_size < 1:
            raise PurinecError(f"fuse: max_group_size must be at least 1, got "
                               f"{max_group_size}")
        self.nodes = graph.nodes
        self.max_group_size = max_group_size
        # A fused node's registry entry is opaque: fusing a fused graph changes nothing.
        self.kinds = [get_op(n.op).fusion for n in self.nodes]
        producer = {id(v): i for i, n in enumerate(self.nodes) for v in n.outputs}
        # One edge per (value, reader): (producer, consumer, value), by consumer.
        self.edges: list[tuple[int, int, Value]] = []
        self.succ: list[set[int]] = [set() for _ in self.nodes]
        self.flows: dict[tuple[int, int], list[Value]] = {}  # the values on p -> c
        for c, node in enumerate(self.nodes):
            for v in dict.fromkeys(node.inputs):
                if id(v) in producer:
                    p = producer[id(v)]
                    self.edges.append((p, c, v))
                    self.succ[p].add(c)
                    self.flows.setdefault((p, c), []).append(v)
        # Paths through other ranks, for the cycle check only (see the module doc).
        self.reach = [set(c) for c in self.succ]
        exchanges = [i for i, n in enumerate(self.nodes) if spans_ranks(n)]
        for before, after in zip(exchanges, exchanges[1:]):
            self.reach[before].add(after)
        returned = {id(v) for _, v in graph.outputs}
        self.returned = {i for i, n in enumerate(self.nodes)
                         if any(id(v) in returned for v in n.outputs)}
        self.parent = list(range(len(self.nodes)))
        self.members: dict[int, list[int]] = {i: [i] for i in range(len(self.nodes))}

    # -- union-find -----------------------------------------------------------------

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def merge(self, roots: set[int]) -> int:
        """Make the groups ``roots`` one; returns its root."""
        into, *rest = sorted(roots)
        for r in rest:
            self.parent[r] = into
            self.members[into] += self.members.pop(r)
        return into

    def groups(self) -> list[list[int]]:
        return [sorted(m) for m in self.members.values()]

    # -- the steps --------------------------------------------------------------------

    def plan(self) -> list[Apart]:
        """Group the nodes; return why the pairs left apart are apart."""
        self.fuse_post_dominated()
        apart = self.fuse_escaping()
        self.fuse_solver_updates()
        return apart

    def fuse_post_dominated(self) -> None:
        """Step 1: each node with its immediate post-dominator and the paths between."""
        ipdom = self.post_dominators()
        for i in range(len(self.nodes)):
            d = ipdom[i]
            if d is None or self.find(i) == self.find(d):
                continue
            roots = {self.find(x) for x in {i, d} | self.between(i, d)}
            if self.group_blocker(roots) is None:
                self.merge(roots)

    def fuse_escaping(self) -> list[Apart]:
        """Step 2: consumers join their producers' groups until nothing more merges;
        the reasons of the last round are why the rest stayed apart."""
        while True:
            apart, merged = [], False
            for p, c, v in self.edges:
                a, b = self.find(p), self.find(c)
                if a == b:
                    continue
                reason = self.edge_blocker(p, c, v) or self.group_blocker({a, b})
                if reason:
                    apart.append(Apart(v.name, self.nodes[c].name, reason))
                else:
                    self.merge({a, b})
                    merged = True
            if not merged:
                return apart

    def fuse_solver_updates(self) -> None:
        """Step 3: lone sgd nodes, per device and arrival of their inputs, into as few
        independent groups as fit."""
        open_groups: dict = {}
        limit = min(self.max_group_size, MAX_SOLVER_GROUP)
        for i, node in enumerate(self.nodes):
            if not op_has(node.op, Trait.solver_update) or len(self.members[self.find(i)]) != 1:
                continue
            arrival = tuple(sorted({id(v.producer) for v in node.inputs
                                    if v.producer is not None
                                    and op_has(v.producer.op, Trait.communicates)}))
            groups = open_groups.setdefault((node.device, arrival), [])
            home = next((r for r in groups if self.independent(r, i)
                         and len(self.members[r]) < limit), None)
            if home is None:
                groups.append(i)
            else:
                groups[groups.index(home)] = self.merge({home, i})

    # -- checks -----------------------------------------------------------------------

    def edge_blocker(self, p: int, c: int, value: Value) -> str | None:
        """Why ``value`` may not flow from node p to node c inside one group, if so."""
        producer, consumer = self.nodes[p], self.nodes[c]
        if self.kinds[p] not in LOOP_KINDS and self.kinds[p] != ANCHOR:
            return f"{producer.op} is {_KIND_WORDS[self.kinds[p]]}"
        if self.kinds[c] == ANCHOR:
            return (f"{consumer.op} is out_elementwise_fusable: only its consumers fuse "
                    f"with it, as its epilogue")
        if self.kinds[c] not in LOOP_KINDS:
            return f"{consumer.op} is {_KIND_WORDS[self.kinds[c]]}"
        if producer.device != consumer.device:
            return (f"%{producer.name} is on {producer.device} and %{consumer.name} on "
                    f"{consumer.device}")
        for out in consumer.outputs:
            if out.type.shape != value.type.shape:
                return (f"{consumer.op} broadcasts %{value.name} ({value.type} to "
                        f"{out.type}); a group broadcasts only inputs from outside it")
        return None

    def group_blocker(self, roots: set[int]) -> str | None:
        """Why the groups ``roots`` may not become one, if so: every value flowing
        between them must be able to flow inside a group, and the merged group must
        keep one anchor, fit in max_group_size and make no cycle."""
        members = [m for r in roots for m in self.members[r]]
        for p in members:
            for c in self.succ[p]:
                if self.find(c) in roots and self.find(c) != self.find(p):
                    for v in self.flows[p, c]:
                        reason = self.edge_blocker(p, c, v)
                        if reason:
                            return (f"the group would take in %{v.name} -> "
                                    f"%{self.nodes[c].name}, but {reason}")
        anchors = [self.nodes[m] for m in sorted(members) if self.kinds[m] == ANCHOR]
        if len(anchors) > 1:
            a, b = anchors[:2]
            return (f"%{a.name} ({a.op}) and %{b.name} ({b.op}) would share a group; a "
                    f"group has one out_elementwise_fusable member")
        if len(members) > self.max_group_size:
            return (f"the group would have {len(members)} members, more than "
                    f"max_group_size={self.max_group_size}")
        through = self.cycle_through(roots)
        if through is not None:
            node = self.nodes[through]
            return (f"fusing would make a cycle through %{node.name} ({node.op}), which "
                    f"reads the group and feeds it")
        return None

    def independent(self, root: int, i: int) -> bool:
        """No edge or path joins group ``root`` and node i, and they share no input."""
        group = self.members[root]
        if any(i in self.succ[m] or m in self.succ[i] for m in group):
            return False
        read = {id(v) for m in group for v in self.nodes[m].inputs}
        if any(id(v) in read for v in self.nodes[i].inputs):
            return False
        return self.cycle_through({root, self.find(i)}) is None

    def cycle_through(self, roots: set[int]) -> int | None:
        """A node outside ``roots`` on a path from one of those groups to another (which
        merging them would turn into a cycle), or None."""
        origin: dict[int, int] = {}  # outside group -> first outside node on its path
        stack = []
        for r in roots:
            for m in self.members[r]:
                for c in self.reach[m]:
                    g = self.find(c)
                    if g not in roots and g not in origin:
                        origin[g] = c
                        stack.append(g)
        while stack:
            g = stack.pop()
            for m in self.members[g]:
                for c in self.reach[m]:
                    h = self.find(c)
                    if h in roots:
                        return origin[g]
                    if h not in origin:
                        origin[h] = origin[g]
                        stack.append(h)
        return None

    # -- the DAG ----------------------------------------------------------------------

    def post_dominators(self) -> list[int | None]:
        """Each node's immediate post-dominator, None where it is the virtual sink."""
        import networkx as nx  # a tenth of a second to import: not on a warm load's path

        sink = -1
        dag = nx.DiGraph()
        dag.add_node(sink)
        for i in range(len(self.nodes)):
            dag.add_node(i)
            if i in self.returned or not self.succ[i]:
                dag.add_edge(i, sink)
            dag.add_edges_from((i, c) for c in self.succ[i])
        idom = nx.immediate_dominators(dag.reverse(copy=False), sink)
        return [None if idom[i] == sink else idom[i] for i in range(len(self.nodes))]

    def between(self, i: int, d: int) -> set[int]:
        """The nodes on paths from i to its post-dominator d, neither included."""
        seen: set[int] = set()
        stack = [c for c in self.succ[i] if c != d]
        while stack:
            x = stack.pop()
            if x not in seen:
                seen.add(x)
                stack.extend(c for c in self.succ[x] if c != d)
        return seen


def _rebuild(graph: Graph, planner: _Planner) -> list[Node]:
    """The graph's node list with each group of two or more as one fused node."""
    nodes = graph.nodes
    groups = planner.groups()
    group_of = {m: g for g, members in enumerate(groups) for m in members}
    returned = {id(v) for _, v in graph.outputs}
    readers: dict[int, set[int]] = {}  # value -> the groups reading it
    for _, c, v in planner.edges:
        readers.setdefault(id(v), set()).add(group_of[c])
    kernels = {n.attrs["kernel"] for n in nodes if n.body is not None}
    result = []
    for g in _group_order(groups, group_of, planner.edges):
        if len(groups[g]) == 1:
            result.append(nodes[groups[g][0]])
            continue
        anchor_first = sorted(groups[g], key=lambda m: planner.kinds[m] != ANCHOR)
        body = [nodes[m] for m in anchor_first]
        # Values read outside, returned, or read by nobody (dead code is dce's job).
        exported = [v for m in body for v in m.outputs
                    if id(v) in returned or readers.get(id(v), {None}) - {g}]
        result.append(_fused_node(body, exported, kernels))
    return result


def _group_order(groups: list[list[int]], group_of: dict[int, int], edges) -> list[int]:
    """The groups in a topological order, as close to the original order as it allows
    (Kahn's algorithm, taking the ready group whose first member comes first)."""
    succ: list[set[int]] = [set() for _ in groups]
    for p, c, _ in edges:
        a, b = group_of[p], group_of[c]
        if a != b:
            succ[a].add(b)
    order = stable_topological_order([members[0] for members in groups], succ)
    assert len(order) == len(groups), "fuse: groups in a cycle (the path check failed)"
    return order


def _fused_node(body: list[Node], outputs: list[Value], kernels: set[str]) -> Node:
    """A fused node over ``body`` named after it, uniquely among ``kernels``."""
    name = base = kernel_name(body)
    suffix = itertools.count(1)
    while name in kernels:
        name = f"{base}_{next(suffix)}"
    kernels.add(name)
    return Node(FUSED, external_inputs(body), outputs, {"kernel": name}, body=body)
