"""Reverse-mode automatic differentiation over the IR.

`autodiff(graph, loss, wrt)` returns a copy of ``graph`` extended with the backward
pass and one output ``grad.<input>`` per ``wrt`` input. The algorithm:

1. **Activity.** A value is *active* when it is a float value that depends on a ``wrt``
   input (forward sweep, through float values only) and the loss depends on it
   (backward sweep). Only active values get gradients, so no node is built for an
   input that is an integer, constant data, or off the path to the loss.
2. **Seed.** The loss (a float scalar) gets the gradient ``fill(1.0)``.
3. **Reverse sweep.** Nodes are visited in reverse topological order. A node with an
   active output is on the path, so its op must be differentiable; its gradient rule
   (`OpDef.gradient`, defined with the op in `purinec.ir.ops`) gets the summed
   gradients of its outputs (None where an output has
   none) and returns one gradient per input (None where not needed). Backward nodes
   are placed on the forward node's device and carry its source ``loc``; those that
   compute a graph input's (a parameter's) gradient come before the rest of what the
   rule built, so parallel training can send that gradient while the sweep goes on.
4. **Accumulation.** The partial gradients a value collects from its users are summed
   with ``add`` nodes when the sweep reaches the value's producer (all users come later
   in topological order, so by then all partials are in). The final gradient of value
   ``%v`` is named ``%grad.v`` (fresh), unless it is shared with another value (rules
   pass some gradients through unchanged, as ``add`` does).
5. **Outputs.** ``grad.<input>`` outputs are appended in ``wrt`` order; an input the
   loss does not depend on gets a ``fill`` of zeros.

A rule is ``rule(graph, node, output_grads, needs=None) -> list[Value | None]``, one
entry per input. ``needs[i]`` says whether input ``i`` needs a gradient; rules build
nothing for the others (``None``: every input that can have one). Rules add nodes with
`purinec.ir.ops.helpers.emit`, which places them on the forward node's device with its
loc.
"""

from __future__ import annotations

from typing import Sequence

from purinec.errors import AutodiffError
from purinec.ir.graph import Graph, Node, Value
from purinec.ir.ops import get_op
from purinec.ir.ops.registry import GradientRule


def autodiff(graph: Graph, loss: str = "loss", wrt: Sequence[str] | None = None) -> Graph:
    """The gradients of output ``loss`` with respect to inputs ``wrt`` (default: every
    ``param`` input), appended as outputs ``grad.<name>`` to a copy of ``graph``."""
    g = graph.clone()
    loss_v = _loss_value(g, loss)
    targets = _wrt_values(g, wrt)
    taken = {name for name, _ in g.outputs} & {f"grad.{v.name}" for v in targets}
    if taken:
        raise AutodiffError(f"autodiff: graph {g.name} already has output(s) "
                            f"{', '.join(sorted(taken))}; was it differentiated already?")
    active = _active_values(g, targets, loss_v)
    grads: dict[Value, Value] = {}
    if loss_v in active:
        seed = g.add_node("fill", [], {"shape": [], "dtype": str(loss_v.type.dtype),
                                       "value": 1.0},
                          names=[g.fresh_name(f"grad.{loss_v.name}")],
                          device=loss_v.device).outputs[0]
        grads = _backward(g, active, {loss_v: [seed]}, owner={seed: loss_v})
    for v in targets:
        if v not in grads:
            grads[v] = g.add_node("fill", [], {"shape": list(v.type.shape),
                                               "dtype": str(v.type.dtype), "value": 0.0},
                                  names=[g.fresh_name(f"grad.{v.name}")],
                                  device=v.device).outputs[0]
    g.set_outputs(g.outputs + [(f"grad.{v.name}", grads[v]) for v in targets])
    return g


# ---------------------------------------------------------------------------------------
# The driver.


def _loss_value(g: Graph, loss: str) -> Value:
    try:
        v = g.output(loss)
    except KeyError:
        names = ", ".join(name for name, _ in g.outputs) or "none"
        raise AutodiffError(f"autodiff: graph {g.name} has no output named {loss!r} "
                            f"(its outputs: {names})") from None
    if v.type.shape != () or not v.type.dtype.is_float:
        raise AutodiffError(f"autodiff: the loss {loss!r} (value %{v.name}) must be a float "
                            f"scalar, got {v.type}; reduce it first (e.g. reduce_sum)")
    return v


def _wrt_values(g: Graph, wrt: Sequence[str] | None) -> list[Value]:
    if wrt is None:
        values = g.inputs_with_role("param")
    else:
        values = []
        for name in wrt:
            try:
                values.append(g.input(name))
            except KeyError:
                raise AutodiffError(f"autodiff: {name!r} is not an input of graph "
                                    f"{g.name}") from None
    if len({v.name for v in values}) != len(values):
        raise AutodiffError(f"autodiff: repeated names in wrt {[v.name for v in values]}")
    for v in values:
        if not v.type.dtype.is_float:
            raise AutodiffError(f"autodiff: cannot differentiate with respect to %{v.name}: "
                                f"{v.type} is not a float tensor")
    return values


def _active_values(g: Graph, targets: list[Value], loss_v: Value) -> set[Value]:
    """Float values that depend on a target and that the loss depends on."""
    depends = set(targets)
    for node in g.nodes:
        if any(v in depends for v in node.inputs):
            depends.update(v for v in node.outputs if v.type.dtype.is_float)
    reaches = {loss_v}
    for node in reversed(g.nodes):
        if any(v in reaches for v in node.outputs):
            reaches.update(node.inputs)
    return depends & reaches


def _backward(g: Graph, active: set[Value], partials: dict[Value, list[Value]],
              owner: dict[Value, Value]) -> dict[Value, Value]:
    """The reverse sweep; returns the summed gradient of every active value.
    ``owner`` maps a gradient value built for exactly one forward value to it (only
    those may be renamed after it)."""
    grads: dict[Value, Value] = {}
    for node in reversed(list(g.nodes)):
        out_grads = [_finish(g, v, partials, owner, grads) for v in node.outputs]
        if all(gy is None for gy in out_grads):
            continue
        needs = [v in active for v in node.inputs]
        rule = _rule_for(node, needs)
        before = len(g.nodes)
        in_grads = rule(g, node, out_grads, needs)
        _final_gradients_first(g.nodes, before, [
            gx for v, need, gx in zip(node.inputs, needs, in_grads)
            if need and v.producer is None])
        created = {v for n in g.nodes[before:] for v in n.outputs}
        for v, need, gx in zip(node.inputs, needs, in_grads):
            if need:
                assert gx is not None and gx.type == v.type, \
                    f"gradient rule of {node.op} gave {gx!r} for %{v.name}: {v.type}"
                partials.setdefault(v, []).append(gx)
                if gx in created and sum(r is gx for r in in_grads) == 1:
                    owner[gx] = v
    for v in list(partials):
        _finish(g, v, partials, owner, grads)
    return grads


def _final_gradients_first(nodes: list[Node], start: int, final: list[Value]) -> None:
    """Reorder the nodes a rule added (``nodes[start:]``) so that those computing the
    ``final`` gradients (of graph inputs: parameters; nothing adds to them later) come
    first, each part in its own order: a layer's weight gradient is then ready, and its
    allreduce or update can start, before the data gradient that continues the sweep."""
    needed = set(final)
    first = []
    for node in reversed(nodes[start:]):
        if any(v in needed for v in node.outputs):
            first.append(node)
            needed.update(node.inputs)
    if first:
        chosen = set(first)
        nodes[start:] = first[::-1] + [n for n in nodes[start:] if n not in chosen]


def _rule_for(node: Node, needs: list[bool]) -> GradientRule:
    opdef = get_op(node.op)
    if opdef.gradient is None:
        wanted = ", ".join(f"%{v.name}" for v, n in zip(node.inputs, needs) if n)
        where = f" at {node.loc}" if node.loc else ""
        raise AutodiffError(f"autodiff: node %{node.name} ({node.op}){where} lies between a "
                            f"differentiated input and the loss, but op {node.op} is not "
                            f"differentiable (gradient needed for {wanted})")
    return opdef.gradient


def _finish(g: Graph, v: Value, partials, owner, grads) -> Value | None:
    """Sum the partial gradients of ``v`` (once) and name the result ``grad.<v>``."""
    if v in grads:
        return grads[v]
    parts = partials.pop(v, None)
    if not parts:
        return None
    loc = v.producer.loc if v.producer else None
    total = parts[0]
    for i, p in enumerate(parts[1:], start=2):
        base = f"grad.{v.name}" if i == len(parts) else f"grad.{v.name}.acc"
        total = g.add_node("add", [total, p], names=[g.fresh_name(base)],
                           device=v.device, loc=loc).outputs[0]
    if len(parts) == 1 and owner.get(total) is v:
        _rename(g, total, f"grad.{v.name}")
    grads[v] = total
    return total


def _rename(g: Graph, v: Value, base: str) -> None:
    g._names.discard(v.name)  # the graph's set of claimed names; see Graph.fresh_name
    v.name = g.fresh_name(base)
    g._names.add(v.name)
