"""Boxing: the one table of conversions between distributions.

Wherever a producer's distribution differs from what its consumer needs, the conversion
is one or two communication nodes (registered in purinec.ir.ops), each the identity on
the logical tensor:

    from \\ to     replicated      split(b)               partial
    replicated    -               slice (local)          (never needed)
    split(a)      allgather       allgather, slice       (never needed)
    partial       allreduce       allreduce, slice       -

Between a group G and one of its devices s (a parameter server, `--parallel ps`):

    from \\ to             replicated[s]          replicated[G]
    partial[G]            reduce to s            allreduce
    split(a)[G]           allgather, s's piece   allgather
    replicated[s]         -                      broadcast from s
    replicated[G]         copy (s's own piece)   -

A value on one device that a consumer needs on another gets a `copy`. The cost of each
conversion, in bytes moved per device, lets the distribution pass pick the cheapest of
an op's split signatures.
"""

from __future__ import annotations

import math

from purinec.errors import PurinecError
from purinec.ir.graph import Graph, Node, Value
from purinec.ir.types import DistKind, Distribution

REPLICATED, SPLIT, PARTIAL = DistKind.replicated, DistKind.split, DistKind.partial


def group_attr(dist: Distribution) -> str:
    return ",".join(str(d) for d in dist.group)


def conversion_cost(src: Distribution, dst: Distribution, nbytes: int) -> float:
    """Bytes each device sends to turn ``src`` into ``dst`` (inf: no conversion)."""
    if src == dst:
        return 0.0
    if src.group != dst.group:
        if len(src.group) == len(dst.group) == 1:
            return float(nbytes)  # copy
        if _to_server(src, dst) or _from_server(src, dst):
            return float(nbytes)  # reduce or broadcast: each member's tensor, once
        if _server_replica(src, dst):
            return 0.0  # the server's own piece
        if _gathered_to_server(src, dst):
            return float(nbytes)  # an allgather, then the server's own piece
        return math.inf
    if dst.kind is PARTIAL:
        return math.inf
    if src.kind is REPLICATED:
        return 0.0  # a local slice
    if src.kind is SPLIT:
        return float(nbytes)  # allgather (then maybe a local slice)
    return 2.0 * nbytes  # allreduce (then maybe a local slice)


def _to_server(src: Distribution, dst: Distribution) -> bool:
    """partial over a group -> whole on one of its devices: a reduce."""
    return (src.kind is PARTIAL and dst.kind is REPLICATED and len(dst.group) == 1 and
            dst.group[0] in src.group)


def _from_server(src: Distribution, dst: Distribution) -> bool:
    """whole on one device -> whole on every device of a group holding it: a broadcast."""
    return (src.kind is REPLICATED and dst.kind is REPLICATED and len(src.group) == 1 and
            src.group[0] in dst.group)


def _server_replica(src: Distribution, dst: Distribution) -> bool:
    """whole on every device of a group -> whole on one of them: that device's piece."""
    return (src.kind is REPLICATED and dst.kind is REPLICATED and len(dst.group) == 1 and
            dst.group[0] in src.group)


def _gathered_to_server(src: Distribution, dst: Distribution) -> bool:
    """pieces over a group -> whole on one of its devices: gathered everywhere, then that
    device's piece. (Rare: a parameter server's gradient made in pieces.)"""
    return (src.kind is SPLIT and dst.kind is REPLICATED and len(dst.group) == 1 and
            dst.group[0] in src.group)


def convert(graph: Graph, value: Value, dst: Distribution, why: str) -> list[Node]:
    """Nodes (not yet placed in ``graph.nodes``) turning ``value`` into ``dst``; the last
    one's output is the converted value. ``why`` names the consumer, for the dump."""
    src = value.dist
    cost = conversion_cost(src, dst, value.type.nbytes)
    if cost == math.inf:
        raise PurinecError(f"%{value.name} is {src} but {why} needs {dst}; purinec has no "
                           f"conversion from one to the other")
    nodes: list[Node] = []
    if src == dst:
        return nodes
    if _to_server(src, dst):
        nodes.append(_node(graph, "reduce", value,
                           {"group": group_attr(src), "root": str(dst.group[0])},
                           dst, "sum", why))
        return nodes
    if _from_server(src, dst):
        ty = value.type
        nodes.append(_node(graph, "broadcast", value,
                           {"group": group_attr(dst), "root": str(src.group[0]),
                            "shape": list(ty.shape), "dtype": str(ty.dtype)},
                           dst, "all", why))
        return nodes
    if _gathered_to_server(src, dst):
        nodes = convert(graph, value, Distribution(REPLICATED, src.group), why)
        return nodes + convert(graph, nodes[-1].outputs[0], dst, why)
    if src.group != dst.group:  # a copy, or the server's own replica (no data moves)
        suffix = "server" if _server_replica(src, dst) else "copy"
        nodes.append(_node(graph, "copy", value, {}, dst, suffix, why, device=dst.group[0]))
        return nodes
    current = value
    if src.kind is PARTIAL:
        full = Distribution(REPLICATED, src.group)
        nodes.append(_node(graph, "allreduce", current,
                           {"group": group_attr(src), "tensors": 1}, full, "sum", why))
        current = nodes[-1].outputs[0]
    elif src.kind is SPLIT and not (dst.kind is SPLIT and dst.axis == src.axis):
        full = Distribution(REPLICATED, src.group)
        sizes = src.pieces(value.type.shape[src.axis])
        nodes.append(_node(graph, "allgather", current,
                           {"group": group_attr(src), "axis": src.axis, "sizes": sizes},
                           full, "all", why))
        current = nodes[-1].outputs[0]
    if dst.kind is SPLIT and current.dist != dst:
        extent = value.type.shape[dst.axis]
        nodes.append(_node(graph, "slice", current, {"axis": dst.axis, "start": 0,
                                                     "stop": extent}, dst, "part", why))
    return nodes


def _node(graph: Graph, op: str, value: Value, attrs: dict, dist: Distribution,
          suffix: str, why: str, device=None) -> Node:
    node = graph.make_node(op, [value], attrs,
                           names=[graph.fresh_name(f"{value.name}.{suffix}")],
                           device=device or dist.group[0], loc=f"boxing: {why}")
    node.outputs[0].dist = dist
    return node


def explain(graph: Graph) -> list[str]:
    """Why each communication node of a distributed graph is there, one line each."""
    lines = []
    for node in graph.nodes:
        if node.loc and node.loc.startswith("boxing: "):
            whys = node.loc[len("boxing: "):].split("; ")
            bucket = f" (bucket of {len(whys)})" if len(whys) > 1 else ""
            for src, dst, why in zip(node.inputs, node.outputs, whys):
                lines.append(f"{node.op} %{dst.name}{bucket}: %{src.name} is {src.dist}, "
                             f"{why} needs {dst.dist}")
    return lines
