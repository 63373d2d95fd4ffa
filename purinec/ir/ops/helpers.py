"""What the op families share: shape checks, split signatures, cost rules and the
builders gradient rules use."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from purinec.errors import ShapeError, VerifyError
from purinec.ir.expr import Const
from purinec.ir.nnref import pad_edges
from purinec.ir.ops.registry import SplitSignature
from purinec.ir.types import DType, TensorType

if TYPE_CHECKING:
    from purinec.ir.graph import Graph, Node, Value

# ---------------------------------------------------------------------------------------
# Shape and dtype checks.


def fail(op: str, msg: str) -> ShapeError:
    return ShapeError(f"{op}: {msg}")


def check_float(op: str, t: TensorType, what: str = "input") -> None:
    if not t.dtype.is_float:
        raise fail(op, f"{what} must be a float tensor, got {t}")


def check_integer(op: str, t: TensorType, what: str) -> None:
    if t.dtype not in (DType.i32, DType.i64):
        raise fail(op, f"{what} must be an i32 or i64 tensor, got {t}")


def check_same(op: str, types: Sequence[TensorType]) -> None:
    first = types[0]
    for t in types[1:]:
        if t != first:
            raise fail(op, f"operands must have the same type, got "
                           f"{', '.join(str(x) for x in types)}")


def check_rank(op: str, t: TensorType, rank: int, what: str = "input") -> None:
    if t.rank != rank:
        raise fail(op, f"{what} must have rank {rank}, got {t}")


def pair(op: str, attrs: dict, key: str) -> list[int]:
    value = attrs[key]
    if len(value) != 2:
        raise VerifyError(f"op {op}: attribute {key} must have 2 entries, got {value}")
    return value


def pad_attr(op: str, attrs: dict) -> tuple[int, int, int, int]:
    """The ``pad`` attribute as ``(top, left, bottom, right)``, from 2 entries (both
    sides of an axis alike) or 4 (ONNX's order; see `purinec.ir.nnref.pad_edges`)."""
    value = attrs["pad"]
    if len(value) not in (2, 4):
        raise VerifyError(f"op {op}: attribute pad must have 2 entries [ph, pw] or 4 "
                          f"[top, left, bottom, right], got {value}")
    if min(value) < 0:
        raise fail(op, f"pad must be >= 0, got {value}")
    return pad_edges(value)


def shape_attr(op: str, attrs: dict, key: str = "shape") -> tuple[int, ...]:
    shape = tuple(attrs[key])
    if any(d < 0 for d in shape):
        raise fail(op, f"attribute {key} must not have negative sizes, got {list(shape)}")
    return shape


def dtype_attr(op: str, attrs: dict) -> DType:
    try:
        return DType(attrs["dtype"])
    except ValueError:
        raise VerifyError(f"op {op}: unknown dtype {attrs['dtype']!r}; use one of "
                          f"{', '.join(d.value for d in DType)}") from None


def unary_infer(op):
    def infer(types, attrs):
        check_float(op, types[0])
        return [types[0]]
    return infer


def binary_infer(op):
    def infer(types, attrs):
        check_same(op, types)
        return [types[0]]
    return infer


def float_infer(op):
    """Float operands, all of one type -> one output of that type: div, pow and the
    gradient ops ((y or x, gy) -> gx)."""
    def infer(types, attrs):
        check_float(op, types[0])
        check_same(op, types)
        return [types[0]]
    return infer


# ---------------------------------------------------------------------------------------
# Split signatures shared by several ops.


def elementwise_split(types, attrs):
    """Any split axis, or all replicated; linear ops also pass partial sums through."""
    rank = types[0].rank
    n_in = len(types)
    sigs = [SplitSignature(("S%d" % a,) * n_in, ("S%d" % a,)) for a in range(rank)]
    sigs.append(SplitSignature(("B",) * n_in, ("B",)))
    return sigs


def linear_split(types, attrs):
    """Elementwise ops linear in every input (add, sub, scale) also map P -> P."""
    return elementwise_split(types, attrs) + [SplitSignature(("P",) * len(types), ("P",))]


def batch_split(types, attrs):
    """Ops independent per sample: split the batch axis of every input and output."""
    return [SplitSignature(("S0",) * len(types), ("S0",)),
            SplitSignature(("B",) * len(types), ("B",))]


def nc_split(types, attrs):
    """Per-sample, per-channel ops: batch or channel axis may be split."""
    n = len(types)
    return [SplitSignature(("S0",) * n, ("S0",)), SplitSignature(("S1",) * n, ("S1",)),
            SplitSignature(("B",) * n, ("B",))]


# ---------------------------------------------------------------------------------------
# Costs (the conventions are purinec.passes.cost's).


def size(values, index: int = 0) -> int:
    return values[index].type.size


def per_output_element(cost: int) -> Callable[[Node], int]:
    return lambda node: cost * size(node.outputs)


def per_input_element(cost: int, index: int = 0) -> Callable[[Node], int]:
    return lambda node: cost * size(node.inputs, index)


def free(node: Node) -> int:
    """Moving data, integer work: no floating-point operations."""
    return 0


# ---------------------------------------------------------------------------------------
# Element expressions.


def constant(node: Node, value) -> Const:
    """``value`` as a constant of the node's output dtype."""
    return Const(value, str(node.outputs[0].type.dtype))


# ---------------------------------------------------------------------------------------
# Building gradients. A rule is ``rule(g, node, gys, needs=None) -> list[Value | None]``
# (see purinec.passes.autodiff); it adds nodes with `emit`, which places them on the
# forward node's device with its loc.


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


def only(needs, *builders):
    """Per input: call its builder if the input needs a gradient (all do when ``needs``
    is None), else None."""
    if needs is None:
        needs = [True] * len(builders)
    return [b() if need else None for need, b in zip(needs, builders)]
