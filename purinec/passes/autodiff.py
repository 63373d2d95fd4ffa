"""Reverse-mode automatic differentiation over the IR.

`autodiff(graph, loss, wrt)` returns a copy of ``graph`` extended with the backward
pass and one output ``grad.<input>`` per ``wrt`` input. The algorithm:

1. **Activity.** A value is *active* when it is a float value that depends on a ``wrt``
   input (forward sweep, through float values only) and the loss depends on it
   (backward sweep). Only active values get gradients, so no node is built for an
   input that is an integer, constant data, or off the path to the loss.
2. **Seed.** The loss (a float scalar) gets the gradient ``fill(1.0)``.
3. **Reverse sweep.** Nodes are visited in reverse topological order. A node with an
   active output is on the path, so its op must be differentiable; its rule in
   `GRADIENT_RULES` gets the summed gradients of its outputs (None where an output has
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
`emit`, which places them on the forward node's device with its loc.
"""

from __future__ import annotations

from typing import Callable, Sequence

from purinec.errors import AutodiffError
from purinec.ir.graph import Graph, Node, Value
from purinec.ir.ops import get_op

Rule = Callable[[Graph, Node, list, list], list]
GRADIENT_RULES: dict[str, Rule] = {}


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


def _rule_for(node: Node, needs: list[bool]) -> Rule:
    opdef = get_op(node.op)
    if not opdef.differentiable or node.op not in GRADIENT_RULES:
        why = ("is not differentiable" if not opdef.differentiable
               else "has no gradient rule")
        wanted = ", ".join(f"%{v.name}" for v, n in zip(node.inputs, needs) if n)
        where = f" at {node.loc}" if node.loc else ""
        raise AutodiffError(f"autodiff: node %{node.name} ({node.op}){where} lies between a "
                            f"differentiated input and the loss, but op {node.op} {why} "
                            f"(gradient needed for {wanted})")
    return GRADIENT_RULES[node.op]


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


# ---------------------------------------------------------------------------------------
# Helpers for rules.


def emit(g: Graph, node: Node, op: str, inputs: Sequence[Value], attrs: dict | None = None,
         n_outputs: int = 1) -> list[Value]:
    """Add a backward node for forward ``node``: same device and loc, fresh names
    ``<node>.bwd``, ``<node>.bwd.1``, ... (final gradients are renamed ``grad.<v>``)."""
    return g.add_node(op, list(inputs), attrs, names=_fresh_names(g, f"{node.name}.bwd",
                                                                   n_outputs),
                      device=node.device, loc=node.loc).outputs


def _fresh_names(g: Graph, base: str, n: int) -> list[str]:
    """``n`` distinct unclaimed names: ``base``, ``base.1``, ... (skipping used ones)."""
    names: list[str] = []
    i = 0
    while len(names) < n:
        name = base if i == 0 else f"{base}.{i}"
        if g.fresh_name(name) == name:
            names.append(name)
        i += 1
    return names


def emit1(g: Graph, node: Node, op: str, inputs: Sequence[Value],
          attrs: dict | None = None) -> Value:
    return emit(g, node, op, inputs, attrs)[0]


def zeros_like(g: Graph, node: Node, v: Value) -> Value:
    return emit1(g, node, "fill", [], {"shape": list(v.type.shape),
                                       "dtype": str(v.type.dtype), "value": 0.0})


def rule(*ops: str):
    """Register the decorated function as the gradient rule of ``ops``."""
    def register(fn: Rule) -> Rule:
        for op in ops:
            GRADIENT_RULES[op] = fn
        return fn
    return register


def _only(needs, *builders):
    """Per input: call its builder if the input needs a gradient (all do when ``needs``
    is None), else None."""
    if needs is None:
        needs = [True] * len(builders)
    return [b() if need else None for need, b in zip(needs, builders)]


# ---------------------------------------------------------------------------------------
# The rules, one per differentiable op.


@rule("relu")
def _relu(g, node, gys, needs=None):
    """gx = gy * (x > 0)."""
    return _only(needs, lambda: emit1(g, node, "relu_grad", [node.inputs[0], gys[0]]))


@rule("sigmoid", "tanh")
def _sigmoid_tanh(g, node, gys, needs=None):
    """From the output: sigmoid_grad(y, gy) = gy y (1-y); tanh_grad(y, gy) = gy (1-y^2)."""
    op = node.op + "_grad"
    return _only(needs, lambda: emit1(g, node, op, [node.outputs[0], gys[0]]))


@rule("scale")
def _scale(g, node, gys, needs=None):
    """gx = alpha * gy."""
    return _only(needs, lambda: emit1(g, node, "scale", [gys[0]],
                                      {"alpha": node.attrs["alpha"]}))


@rule("add_scalar")
def _add_scalar(g, node, gys, needs=None):
    """gx = gy (passed through)."""
    return _only(needs, lambda: gys[0])


@rule("add")
def _add(g, node, gys, needs=None):
    """ga = gb = gy (passed through)."""
    return _only(needs, lambda: gys[0], lambda: gys[0])


@rule("sub")
def _sub(g, node, gys, needs=None):
    """ga = gy, gb = -gy."""
    return _only(needs, lambda: gys[0],
                 lambda: emit1(g, node, "scale", [gys[0]], {"alpha": -1.0}))


@rule("mul")
def _mul(g, node, gys, needs=None):
    """ga = gy * b, gb = gy * a."""
    a, b = node.inputs
    return _only(needs, lambda: emit1(g, node, "mul", [gys[0], b]),
                 lambda: emit1(g, node, "mul", [gys[0], a]))


@rule("bias_add")
def _bias_add(g, node, gys, needs=None):
    """gx = gy; gb = gy summed over every axis but ``axis``."""
    axis = node.attrs["axis"]
    others = [a for a in range(gys[0].type.rank) if a != axis]
    return _only(needs, lambda: gys[0],
                 lambda: emit1(g, node, "reduce_sum", [gys[0]], {"axes": others}))


@rule("reduce_sum")
def _reduce_sum(g, node, gys, needs=None):
    """gx = gy with the reduced axes restored (reshape to keepdims form) and broadcast."""
    x = node.inputs[0]
    kept = [1 if a in node.attrs["axes"] else d for a, d in enumerate(x.type.shape)]

    def build():
        gy = gys[0]
        if list(gy.type.shape) != kept:
            gy = emit1(g, node, "reshape", [gy], {"shape": kept})
        if kept == list(x.type.shape):
            return gy
        return emit1(g, node, "broadcast_to", [gy], {"shape": list(x.type.shape)})
    return _only(needs, build)


@rule("broadcast_to")
def _broadcast_to(g, node, gys, needs=None):
    """gx = gy summed over the broadcast axes (leading ones, and those where x has 1),
    reshaped to x's shape."""
    x, gy = node.inputs[0], gys[0]
    shape = node.attrs["shape"]
    lead = len(shape) - x.type.rank
    axes = [a for a in range(len(shape))
            if a < lead or (x.type.shape[a - lead] == 1 and shape[a] != 1)]

    def build():
        out = gy
        if axes:
            out = emit1(g, node, "reduce_sum", [out], {"axes": axes})
        if out.type.shape != x.type.shape:
            out = emit1(g, node, "reshape", [out], {"shape": list(x.type.shape)})
        return out
    return _only(needs, build)


@rule("reshape")
def _reshape(g, node, gys, needs=None):
    """gx = reshape(gy, shape of x)."""
    x = node.inputs[0]
    return _only(needs, lambda: emit1(g, node, "reshape", [gys[0]],
                                      {"shape": list(x.type.shape)}))


@rule("concat")
def _concat(g, node, gys, needs=None):
    """gxs = split(gy) into the inputs' sizes along ``axis`` (one node)."""
    axis = node.attrs["axis"]
    sections = [v.type.shape[axis] for v in node.inputs]
    if len(sections) == 1:
        return _only(needs, lambda: gys[0])
    parts = emit(g, node, "split", [gys[0]], {"axis": axis, "sections": sections},
                 n_outputs=len(sections))
    return [p if need else None for p, need in zip(parts, needs)]


@rule("split")
def _split(g, node, gys, needs=None):
    """gx = concat of the outputs' gradients, zeros where an output has none."""
    def build():
        parts = [gy if gy is not None else zeros_like(g, node, y)
                 for y, gy in zip(node.outputs, gys)]
        if len(parts) == 1:
            return parts[0]
        return emit1(g, node, "concat", parts, {"axis": node.attrs["axis"]})
    return _only(needs, build)


# For C = op(A) op(B): (inputs, trans_a, trans_b) of the matmuls giving gA and gB, by
# (trans_a, trans_b); "a", "b" are the forward inputs and "g" is gC.
_MATMUL_GRADS = {
    (False, False): ((("g", "b"), False, True), (("a", "g"), True, False)),
    (False, True): ((("g", "b"), False, False), (("g", "a"), True, False)),
    (True, False): ((("b", "g"), False, True), (("a", "g"), False, False)),
    (True, True): ((("b", "g"), True, True), (("g", "a"), True, True)),
}


@rule("matmul")
def _matmul(g, node, gys, needs=None):
    """C = op(A) op(B): gA and gB are matmuls of gC with B and A (table above)."""
    env = {"a": node.inputs[0], "b": node.inputs[1], "g": gys[0]}
    specs = _MATMUL_GRADS[(node.attrs["trans_a"], node.attrs["trans_b"])]

    def builder(spec):
        names, ta, tb = spec
        return lambda: emit1(g, node, "matmul", [env[n] for n in names],
                             {"trans_a": ta, "trans_b": tb})
    return _only(needs, *(builder(s) for s in specs))


@rule("conv2d")
def _conv2d(g, node, gys, needs=None):
    """gx = conv2d_grad_input(gy, w), gw = conv2d_grad_weight(x, gy)."""
    x, w = node.inputs
    conv = {k: node.attrs[k] for k in ("stride", "pad", "groups")}
    return _only(
        needs,
        lambda: emit1(g, node, "conv2d_grad_input", [gys[0], w],
                      {**conv, "input_shape": list(x.type.shape)}),
        lambda: emit1(g, node, "conv2d_grad_weight", [x, gys[0]],
                      {**conv, "kernel": list(w.type.shape[2:])}))


def _pool_attrs(node):
    return {k: node.attrs[k] for k in ("kernel", "stride", "pad")}


@rule("max_pool2d")
def _max_pool2d(g, node, gys, needs=None):
    """gx = max_pool2d_grad(x, y, gy): gy routed to each window's first maximum."""
    args = [node.inputs[0], node.outputs[0], gys[0]]
    return _only(needs, lambda: emit1(g, node, "max_pool2d_grad", args, _pool_attrs(node)))


@rule("avg_pool2d")
def _avg_pool2d(g, node, gys, needs=None):
    """gx = avg_pool2d_grad(gy), the adjoint of the average."""
    attrs = {**_pool_attrs(node), "input_shape": list(node.inputs[0].type.shape)}
    return _only(needs, lambda: emit1(g, node, "avg_pool2d_grad", [gys[0]], attrs))


@rule("global_avg_pool")
def _global_avg_pool(g, node, gys, needs=None):
    """gx = gy / (H*W) broadcast over H and W."""
    attrs = {"input_shape": list(node.inputs[0].type.shape)}
    return _only(needs, lambda: emit1(g, node, "global_avg_pool_grad", [gys[0]], attrs))


@rule("lrn")
def _lrn(g, node, gys, needs=None):
    """gx = lrn_grad(x, gy) with the forward attributes."""
    return _only(needs, lambda: emit1(g, node, "lrn_grad", [node.inputs[0], gys[0]],
                                      dict(node.attrs)))


@rule("softmax")
def _softmax(g, node, gys, needs=None):
    """gx = y * (gy - sum(gy * y, axis))."""
    return _only(needs, lambda: emit1(g, node, "softmax_grad", [node.outputs[0], gys[0]],
                                      {"axis": node.attrs["axis"]}))


@rule("softmax_xent")
def _softmax_xent(g, node, gys, needs=None):
    """glogits = (softmax(logits) - onehot(label)) * gy / batch; labels get none."""
    logits, label = node.inputs
    return _only(needs, lambda: emit1(g, node, "softmax_xent_grad", [logits, label, gys[0]]),
                 lambda: None)
