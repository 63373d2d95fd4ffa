"""Shape inference, dead-code and common-subexpression elimination."""

from __future__ import annotations

from purinec.errors import PurinecError, ShapeError
from purinec.ir.graph import Graph, Node, Value, external_inputs
from purinec.ir.ops import get_op


def describe(node: Node) -> str:
    """``%conv1 = conv2d(%data, %conv1.weight)`` plus the user's source line if known."""
    where = f" ({node.loc})" if node.loc else ""
    return f"{node!r}{where}"


def infer_shapes(graph: Graph) -> Graph:
    """Recompute every node's output types from its inputs' types, in order.

    After a change of input shapes this propagates the new shapes; a node that cannot
    take its new inputs raises ShapeError naming the node. Fused nodes are inferred
    member by member (they export their members' very values).
    """
    new = graph.clone()
    for node in new.flat_nodes():
        opdef = get_op(node.op)
        try:
            types = opdef.infer([v.type for v in node.inputs], node.attrs)
        except PurinecError as err:
            shapes = ", ".join(str(v.type) for v in node.inputs)
            raise ShapeError(f"{describe(node)}: {err} (inputs: {shapes})") from None
        for value, ty in zip(node.outputs, types):
            value.type = ty
    return new


def dce(graph: Graph) -> Graph:
    """Drop nodes none of whose outputs reach a graph output."""
    new = graph.clone()
    live = {id(v) for _, v in new.outputs}
    kept = []
    for node in reversed(new.nodes):
        if any(id(v) in live for v in node.outputs):
            kept.append(node)
            live.update(id(v) for v in node.inputs)
    new.nodes = kept[::-1]
    new.rebuild_names()
    return new


def keep_outputs(graph: Graph, keep) -> Graph:
    """``graph`` returning only the outputs ``keep(name, value)`` accepts, without the
    nodes that served only the others (`dce`)."""
    new = graph.clone()
    new.set_outputs([(name, v) for name, v in new.outputs if keep(name, v)])
    return dce(new)


def split_fixed_part(graph: Graph) -> tuple[Graph, Graph] | None:
    """``graph`` cut in two: the nodes that read parameters and state alone, however
    indirectly (a batch norm's ``gamma / sqrt(var + eps)``), as a graph of their own
    returning what the others read; and the others, reading those values as
    parameters of the same names (which a target that keeps parameters on its devices
    keeps there). None where no node reads only parameters and state. Their results
    change only when the weights do, so a program that runs inference again and again
    need not recompute them at every call."""
    fixed = set(graph.inputs_with_role("param", "state"))
    part = []
    for node in graph.nodes:
        if node.inputs and all(v in fixed for v in node.inputs):
            part.append(node)
            fixed.update(node.outputs)
    if not part:
        return None
    in_part = {id(node) for node in part}
    others = [node for node in graph.nodes if id(node) not in in_part]
    read = {v for node in others for v in node.inputs} | {v for _, v in graph.outputs}
    made = [v for node in part for v in node.outputs if v in read]
    weights = {v for node in part for v in node.inputs}
    first = Graph(f"{graph.name}.fixed")
    mapping = {v: first.add_input(v.name, v.type, v.device, v.role, v.dist, v.init)
               for v in graph.inputs if v in weights}
    first.nodes = [first.copy_node(node, mapping) for node in part]
    first.set_outputs((v.name, mapping[v]) for v in made)
    rest = Graph(graph.name)
    mapping = {v: rest.add_input(v.name, v.type, v.device, v.role, v.dist, v.init)
               for v in graph.inputs}
    mapping.update((v, rest.add_input(v.name, v.type, v.device, "param")) for v in made)
    rest.nodes = [rest.copy_node(node, mapping) for node in others]
    rest.set_outputs((name, mapping[v]) for name, v in graph.outputs)
    return first, rest


def _freeze(value):
    return tuple(value) if isinstance(value, list) else value


def cse(graph: Graph) -> Graph:
    """Merge nodes that apply the same op with the same attributes to the same inputs.

    Every op in the registry is pure (random masks are a hash of their inputs), so two
    such nodes always compute the same values; the later one is removed and its users
    read the earlier one's outputs. Fused nodes are kept as they are (their kernel names
    differ); their members read the merged values too.
    """
    new = graph.clone()
    replace: dict[int, Value] = {}
    seen: dict[tuple, Node] = {}
    kept = []
    for node in new.nodes:
        for reader in [node] + (node.body or []):
            reader.inputs = [replace.get(id(v), v) for v in reader.inputs]
        if node.body is not None:
            node.inputs = external_inputs(node.body)  # two inputs may have merged
            kept.append(node)
            continue
        key = (node.op, node.device, tuple(id(v) for v in node.inputs),
               tuple(sorted((k, _freeze(v)) for k, v in node.attrs.items())))
        twin = seen.get(key)
        if twin is None:
            seen[key] = node
            kept.append(node)
            continue
        for old, kept_value in zip(node.outputs, twin.outputs):
            replace[id(old)] = kept_value
    new.nodes = kept
    new.outputs = [(name, replace.get(id(v), v)) for name, v in new.outputs]
    new.rebuild_names()
    return new
