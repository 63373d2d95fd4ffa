"""The op registry: every IR op is defined once, here.

An `OpDef` says what an op takes (inputs and typed attributes), how its output types
follow from its input types (`infer`), how it fuses (`FusionKind`, TVM's lattice), how
it may be split across devices (`split` signatures, OneFlow's SBP idea) and what it
computes (`reference`, in NumPy: the oracle every generated kernel is tested against).
Gradient rules live with autodiff (`purinec.passes.autodiff`), kernels with codegen.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from purinec.errors import ShapeError, UnknownOpError, VerifyError
from purinec.ir.types import DType, TensorType


class FusionKind(enum.IntEnum):
    """TVM's pattern kinds, ordered: a group fuses into a consumer of a higher kind."""

    elementwise = 0
    broadcast = 1
    injective = 2
    reduction = 3
    out_elementwise_fusable = 4
    opaque = 5


REQUIRED = object()

ATTR_KINDS = ("int", "float", "bool", "str", "ints", "floats")


@dataclass(frozen=True)
class Attr:
    kind: str
    default: Any = REQUIRED
    doc: str = ""


# A split signature: one entry per input then one per output, each "B" (broadcast, i.e.
# replicated), "P" (partial sum) or "S<axis>" (split along axis). For example matmul
# with (S0, B) -> (S0,) is data parallelism; (B, S0) -> (S1,) splits output features.
@dataclass(frozen=True)
class SplitSignature:
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def __str__(self) -> str:
        return f"({', '.join(self.inputs)}) -> ({', '.join(self.outputs)})"


InferFn = Callable[[list[TensorType], dict], list[TensorType]]
SplitFn = Callable[[list[TensorType], dict], list[SplitSignature]]


@dataclass(frozen=True)
class OpDef:
    name: str
    inputs: tuple[str, ...]
    infer: InferFn
    reference: Callable[..., tuple]
    fusion: FusionKind
    attrs: dict[str, Attr] = field(default_factory=dict)
    variadic: bool = False  # the last input may repeat (one or more times)
    split: SplitFn | None = None
    differentiable: bool = True  # False for backward-only and integer ops
    # Each output may be written over the input in the same position: the kernel is done
    # reading an input before it writes the output that takes its memory. (Elementwise
    # ops may do this for any output and input of the same type.)
    in_place: bool = False
    doc: str = ""

    def complete_attrs(self, attrs: dict) -> dict:
        """Check ``attrs`` against the schema, fill defaults, normalise number types."""
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise VerifyError(f"op {self.name} has no attribute(s) {', '.join(sorted(unknown))}"
                              f"; it takes: {', '.join(self.attrs) or 'none'}")
        result = {}
        for key, spec in self.attrs.items():
            if key in attrs:
                result[key] = _coerce_attr(self.name, key, spec.kind, attrs[key])
            elif spec.default is REQUIRED:
                raise VerifyError(f"op {self.name} needs attribute {key} ({spec.kind})")
            else:
                result[key] = _coerce_attr(self.name, key, spec.kind, spec.default)
        return result

    def check_arity(self, n: int) -> None:
        fixed = len(self.inputs) - (1 if self.variadic else 0)
        ok = n >= fixed + 1 if self.variadic else n == len(self.inputs)
        if not ok:
            want = f"at least {fixed + 1}" if self.variadic else str(len(self.inputs))
            raise VerifyError(f"op {self.name} takes {want} input(s) "
                              f"({', '.join(self.inputs)}), got {n}")

    def signatures(self, types: list[TensorType], attrs: dict) -> list[SplitSignature]:
        return self.split(types, attrs) if self.split else []


def _coerce_attr(op: str, key: str, kind: str, value: Any) -> Any:
    def bad():
        return VerifyError(f"op {op}: attribute {key} must be {kind}, got {value!r}")

    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise bad()
        return int(value)
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise bad()
        return float(value)
    if kind == "bool":
        if not isinstance(value, (bool, np.bool_)):
            raise bad()
        return bool(value)
    if kind == "str":
        if not isinstance(value, str):
            raise bad()
        return value
    if kind in ("ints", "floats"):
        if not isinstance(value, (list, tuple)):
            raise bad()
        scalar = "int" if kind == "ints" else "float"
        return [_coerce_attr(op, key, scalar, v) for v in value]
    raise AssertionError(kind)


REGISTRY: dict[str, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    assert opdef.name not in REGISTRY, opdef.name
    REGISTRY[opdef.name] = opdef
    return opdef


def get_op(name: str) -> OpDef:
    try:
        return REGISTRY[name]
    except KeyError:
        close = [n for n in REGISTRY if n.startswith(name[:3])]
        hint = f"; did you mean {', '.join(sorted(close))}?" if close else ""
        raise UnknownOpError(f"unknown op {name!r}{hint}") from None


# ---------------------------------------------------------------------------------------
# Shape rules and helpers.


def _fail(op: str, msg: str) -> ShapeError:
    return ShapeError(f"{op}: {msg}")


def _float(op: str, t: TensorType, what: str = "input") -> None:
    if not t.dtype.is_float:
        raise _fail(op, f"{what} must be a float tensor, got {t}")


def _integer(op: str, t: TensorType, what: str) -> None:
    if t.dtype not in (DType.i32, DType.i64):
        raise _fail(op, f"{what} must be an i32 or i64 tensor, got {t}")


def _same(op: str, types: Sequence[TensorType]) -> None:
    first = types[0]
    for t in types[1:]:
        if t != first:
            raise _fail(op, f"operands must have the same type, got "
                            f"{', '.join(str(x) for x in types)}")


def _rank(op: str, t: TensorType, rank: int, what: str = "input") -> None:
    if t.rank != rank:
        raise _fail(op, f"{what} must have rank {rank}, got {t}")


def pool_output_size(size: int, kernel: int, stride: int, pad: int) -> int:
    """Caffe's pooled size: ceil mode, and the last window must start inside the input
    (plus the leading pad)."""
    out = -(-(size + 2 * pad - kernel) // stride) + 1
    # Caffe tests this only when some pad is nonzero; without pad it can fire only when
    # kernel < stride, where Caffe's last window would be empty (and its average 0/0).
    if (out - 1) * stride >= size + pad:
        out -= 1
    return out


def conv_output_size(size: int, kernel: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - kernel) // stride + 1


def _pair(op: str, attrs: dict, key: str) -> list[int]:
    value = attrs[key]
    if len(value) != 2:
        raise VerifyError(f"op {op}: attribute {key} must have 2 entries, got {value}")
    return value


def _shape_attr(op: str, attrs: dict, key: str = "shape") -> tuple[int, ...]:
    shape = tuple(attrs[key])
    if any(d < 0 for d in shape):
        raise _fail(op, f"attribute {key} must not have negative sizes, got {list(shape)}")
    return shape


def _unary_infer(op):
    def infer(types, attrs):
        _float(op, types[0])
        return [types[0]]
    return infer


def _binary_infer(op):
    def infer(types, attrs):
        _same(op, types)
        return [types[0]]
    return infer


def _grad_pair_infer(op):
    """(y or x, gy) -> gx, all of one type."""
    def infer(types, attrs):
        _float(op, types[0])
        _same(op, types)
        return [types[0]]
    return infer


def _elementwise_split(types, attrs):
    """Any split axis, or all replicated; linear ops also pass partial sums through."""
    rank = types[0].rank
    n_in = len(types)
    sigs = [SplitSignature(("S%d" % a,) * n_in, ("S%d" % a,)) for a in range(rank)]
    sigs.append(SplitSignature(("B",) * n_in, ("B",)))
    return sigs


def _linear_split(types, attrs):
    """Elementwise ops linear in every input (add, sub, scale) also map P -> P."""
    return _elementwise_split(types, attrs) + [SplitSignature(("P",) * len(types), ("P",))]


def _batch_split(types, attrs):
    """Ops independent per sample: split the batch axis of every input and output."""
    return [SplitSignature(("S0",) * len(types), ("S0",)),
            SplitSignature(("B",) * len(types), ("B",))]


# ---------------------------------------------------------------------------------------
# The ops. NumPy references of the convolution, pooling and LRN families live in
# `purinec.ir.nnref`; the short ones are written inline.

from purinec.ir import nnref  # noqa: E402  (after the helpers it does not need)

E, B, I, R, O, X = (FusionKind.elementwise, FusionKind.broadcast, FusionKind.injective,
                    FusionKind.reduction, FusionKind.out_elementwise_fusable,
                    FusionKind.opaque)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


register(OpDef("relu", ("x",), _unary_infer("relu"), lambda x: (np.maximum(x, 0).astype(x.dtype),),
               E, split=_elementwise_split, doc="max(x, 0)"))
register(OpDef("sigmoid", ("x",), _unary_infer("sigmoid"), lambda x: (_sigmoid(x),), E,
               split=_elementwise_split, doc="1 / (1 + exp(-x))"))
register(OpDef("tanh", ("x",), _unary_infer("tanh"), lambda x: (np.tanh(x),), E,
               split=_elementwise_split))
register(OpDef("scale", ("x",), _unary_infer("scale"),
               lambda x, alpha: ((x * x.dtype.type(alpha)),), E,
               attrs={"alpha": Attr("float")}, split=_linear_split, doc="alpha * x"))


def _add_scalar_infer(types, attrs):
    return [types[0]]


register(OpDef("add_scalar", ("x",), _add_scalar_infer,
               lambda x, value: ((x + x.dtype.type(value)),), E,
               attrs={"value": Attr("float")}, split=_elementwise_split, differentiable=True,
               doc="x + value (any dtype; the iteration counter is one)"))


def _dtype_attr(op: str, attrs: dict) -> DType:
    try:
        return DType(attrs["dtype"])
    except ValueError:
        raise VerifyError(f"op {op}: unknown dtype {attrs['dtype']!r}; use one of "
                          f"{', '.join(d.value for d in DType)}") from None


def _cast_infer(types, attrs):
    return [TensorType(types[0].shape, _dtype_attr("cast", attrs))]


register(OpDef("cast", ("x",), _cast_infer,
               lambda x, dtype: (x.astype(DType(dtype).numpy),), E,
               attrs={"dtype": Attr("str")}, split=_elementwise_split, differentiable=False))

register(OpDef("add", ("a", "b"), _binary_infer("add"), lambda a, b: (a + b,), E,
               split=_linear_split))
register(OpDef("sub", ("a", "b"), _binary_infer("sub"), lambda a, b: (a - b,), E,
               split=_linear_split))
register(OpDef("mul", ("a", "b"), _binary_infer("mul"), lambda a, b: (a * b,), E,
               split=_elementwise_split))

register(OpDef("relu_grad", ("x", "gy"), _grad_pair_infer("relu_grad"),
               lambda x, gy: (np.where(x > 0, gy, 0).astype(gy.dtype),), E,
               split=_elementwise_split, differentiable=False, doc="gy * (x > 0)"))
register(OpDef("sigmoid_grad", ("y", "gy"), _grad_pair_infer("sigmoid_grad"),
               lambda y, gy: (gy * y * (1 - y),), E, split=_elementwise_split,
               differentiable=False, doc="gy * y * (1 - y), y = sigmoid(x)"))
register(OpDef("tanh_grad", ("y", "gy"), _grad_pair_infer("tanh_grad"),
               lambda y, gy: (gy * (1 - y * y),), E, split=_elementwise_split,
               differentiable=False, doc="gy * (1 - y^2), y = tanh(x)"))


def _bias_add_infer(types, attrs):
    x, b = types
    _float("bias_add", x)
    axis = attrs["axis"]
    if not 0 <= axis < x.rank:
        raise _fail("bias_add", f"axis {axis} out of range for {x}")
    if b.shape != (x.shape[axis],) or b.dtype != x.dtype:
        raise _fail("bias_add", f"bias must be {x.dtype}[{x.shape[axis]}] for input {x} "
                                f"on axis {axis}, got {b}")
    return [x]


def _bias_add_ref(x, b, axis):
    shape = [1] * x.ndim
    shape[axis] = b.shape[0]
    return (x + b.reshape(shape),)


def _bias_add_split(types, attrs):
    axis = attrs["axis"]
    sigs = [SplitSignature((f"S{a}", "B"), (f"S{a}",)) for a in range(types[0].rank)
            if a != axis]
    sigs.append(SplitSignature((f"S{axis}", "S0"), (f"S{axis}",)))
    sigs.append(SplitSignature(("B", "B"), ("B",)))
    sigs.append(SplitSignature(("P", "P"), ("P",)))
    return sigs


register(OpDef("bias_add", ("x", "b"), _bias_add_infer, _bias_add_ref, B,
               attrs={"axis": Attr("int", 1)}, split=_bias_add_split,
               doc="x + b broadcast along axis"))


def _reduce_sum_infer(types, attrs):
    x = types[0]
    axes = attrs["axes"]
    if len(set(axes)) != len(axes) or any(not 0 <= a < x.rank for a in axes):
        raise _fail("reduce_sum", f"bad axes {axes} for {x}")
    if attrs["keepdims"]:
        shape = [1 if i in axes else d for i, d in enumerate(x.shape)]
    else:
        shape = [d for i, d in enumerate(x.shape) if i not in axes]
    return [x.with_shape(shape)]


def _reduce_sum_split(types, attrs):
    axes = attrs["axes"]
    sigs = [SplitSignature(("B",), ("B",)), SplitSignature(("P",), ("P",))]
    for a in range(types[0].rank):
        if a in axes:
            sigs.append(SplitSignature((f"S{a}",), ("P",)))
        elif not attrs["keepdims"]:
            sigs.append(SplitSignature((f"S{a}",), (f"S{a - sum(x < a for x in axes)}",)))
        else:
            sigs.append(SplitSignature((f"S{a}",), (f"S{a}",)))
    return sigs


register(OpDef("reduce_sum", ("x",), _reduce_sum_infer,
               lambda x, axes, keepdims: (np.sum(x, axis=tuple(axes), keepdims=keepdims)
                                          .astype(x.dtype),), R,
               attrs={"axes": Attr("ints"), "keepdims": Attr("bool", False)},
               split=_reduce_sum_split))


def _broadcast_to_infer(types, attrs):
    x = types[0]
    shape = _shape_attr("broadcast_to", attrs)
    try:
        fits = np.broadcast_shapes(x.shape, shape) == shape
    except ValueError:
        fits = False
    if not fits:
        raise _fail("broadcast_to", f"cannot broadcast {x} to {list(shape)}")
    return [x.with_shape(shape)]


def _broadcast_to_split(types, attrs):
    """An axis that is not broadcast keeps its pieces (x's axes align with the shape's
    last ones)."""
    x, shape = types[0], attrs["shape"]
    lead = len(shape) - x.rank
    sigs = [SplitSignature((f"S{a}",), (f"S{lead + a}",)) for a in range(x.rank)
            if x.shape[a] == shape[lead + a]]
    return sigs + [SplitSignature(("B",), ("B",)), SplitSignature(("P",), ("P",))]


register(OpDef("broadcast_to", ("x",), _broadcast_to_infer,
               lambda x, shape: (np.broadcast_to(x, shape).copy(),), B,
               attrs={"shape": Attr("ints")}, split=_broadcast_to_split,
               doc="NumPy broadcasting to shape"))


def _reshape_infer(types, attrs):
    x = types[0]
    shape = attrs["shape"]
    if any(d < 0 for d in shape) or int(np.prod(shape, dtype=np.int64)) != x.size:
        raise _fail("reshape", f"cannot reshape {x} ({x.size} elements) to {shape}")
    return [x.with_shape(shape)]


register(OpDef("reshape", ("x",), _reshape_infer,
               lambda x, shape: (x.reshape(shape),), I, attrs={"shape": Attr("ints")},
               split=lambda types, attrs: [SplitSignature(("S0",), ("S0",)),
                                           SplitSignature(("B",), ("B",))]))


def _concat_infer(types, attrs):
    axis = attrs["axis"]
    first = types[0]
    if not 0 <= axis < first.rank:
        raise _fail("concat", f"axis {axis} out of range for {first}")
    for t in types[1:]:
        if t.dtype != first.dtype:
            raise _fail("concat", f"operands are of different dtypes: "
                                  f"{', '.join(str(x) for x in types)}")
        if (t.rank != first.rank or
                any(a != b for i, (a, b) in enumerate(zip(t.shape, first.shape)) if i != axis)):
            raise _fail("concat", f"operands differ outside axis {axis}: "
                                  f"{', '.join(str(x) for x in types)}")
    shape = list(first.shape)
    shape[axis] = sum(t.shape[axis] for t in types)
    return [first.with_shape(shape)]


def _concat_split(types, attrs):
    axis = attrs["axis"]
    n = len(types)
    sigs = [SplitSignature((f"S{a}",) * n, (f"S{a}",)) for a in range(types[0].rank)
            if a != axis]
    return sigs + [SplitSignature(("B",) * n, ("B",)), SplitSignature(("P",) * n, ("P",))]


register(OpDef("concat", ("xs",), _concat_infer,
               lambda *xs, axis: (np.concatenate(xs, axis=axis),), I,
               attrs={"axis": Attr("int", 1)}, variadic=True, split=_concat_split))


def _split_infer(types, attrs):
    x = types[0]
    axis, sections = attrs["axis"], attrs["sections"]
    if not 0 <= axis < x.rank:
        raise _fail("split", f"axis {axis} out of range for {x}")
    if not sections or any(s <= 0 for s in sections) or sum(sections) != x.shape[axis]:
        raise _fail("split", f"sections {sections} must be positive and add up to "
                             f"{x.shape[axis]} (axis {axis} of {x})")
    out = []
    for s in sections:
        shape = list(x.shape)
        shape[axis] = s
        out.append(x.with_shape(shape))
    return out


def _split_ref(x, axis, sections):
    return tuple(np.split(x, np.cumsum(sections)[:-1], axis=axis))


def _split_split(types, attrs):
    """Pieces along any other axis than the one cut split the same way (concat's
    gradient in a data-parallel inception: the batch stays split)."""
    axis, n = attrs["axis"], len(attrs["sections"])
    sigs = [SplitSignature((f"S{a}",), (f"S{a}",) * n) for a in range(types[0].rank)
            if a != axis]
    return sigs + [SplitSignature(("B",), ("B",) * n), SplitSignature(("P",), ("P",) * n)]


register(OpDef("split", ("x",), _split_infer, _split_ref, I,
               attrs={"axis": Attr("int", 1), "sections": Attr("ints")},
               split=_split_split, doc="slices of x along axis; the inverse of concat"))


def _matmul_infer(types, attrs):
    a, b = types
    for t, what in ((a, "a"), (b, "b")):
        _float("matmul", t, what)
        _rank("matmul", t, 2, what)
    m, k = a.shape[::-1] if attrs["trans_a"] else a.shape
    k2, n = b.shape[::-1] if attrs["trans_b"] else b.shape
    if k != k2 or a.dtype != b.dtype:
        raise _fail("matmul", f"cannot multiply {a}{'^T' if attrs['trans_a'] else ''} by "
                              f"{b}{'^T' if attrs['trans_b'] else ''}")
    return [TensorType((m, n), a.dtype)]


def _matmul_ref(a, b, trans_a, trans_b):
    # Contiguous operands: NumPy's product of strided views (a split's pieces) can differ
    # in the last bit from that of the same values in contiguous arrays.
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    # OpenBLAS's kernels can leave the "invalid" flag raised on finite operands and a
    # correct, finite product (numpy/numpy#24067, OpenMathLib/OpenBLAS#1924); seen here
    # now and then on f32[1,5] @ f32[5,2] with OpenBLAS 0.3.31. NumPy would report it as
    # "invalid value encountered in matmul". A real NaN still shows in the result.
    with np.errstate(invalid="ignore"):
        return ((a.T if trans_a else a) @ (b.T if trans_b else b),)


def _matmul_split(types, attrs):
    # Axes of a and b holding m, k and n, after the transposes.
    am, ak = (1, 0) if attrs["trans_a"] else (0, 1)
    bk, bn = (1, 0) if attrs["trans_b"] else (0, 1)
    return [SplitSignature((f"S{am}", "B"), ("S0",)),
            SplitSignature(("B", f"S{bn}"), ("S1",)),
            SplitSignature((f"S{ak}", f"S{bk}"), ("P",)),
            SplitSignature(("P", "B"), ("P",)),
            SplitSignature(("B", "P"), ("P",)),
            SplitSignature(("B", "B"), ("B",))]


register(OpDef("matmul", ("a", "b"), _matmul_infer, _matmul_ref, O,
               attrs={"trans_a": Attr("bool", False), "trans_b": Attr("bool", False)},
               split=_matmul_split, doc="op(a) @ op(b); inner product is matmul(x, w^T)"))


def _conv_check(x: TensorType, w_shape, attrs, op: str):
    _rank(op, x, 4)
    groups = attrs["groups"]
    cout, cin_g, kh, kw = w_shape
    if groups < 1 or x.shape[1] != cin_g * groups or cout % groups:
        raise _fail(op, f"input {x} with {groups} group(s) does not fit weight "
                        f"[{','.join(map(str, w_shape))}] (out, in/groups, kh, kw)")
    sh, sw = _pair(op, attrs, "stride")
    ph, pw = _pair(op, attrs, "pad")
    if sh < 1 or sw < 1 or ph < 0 or pw < 0:
        raise _fail(op, f"stride must be >= 1 and pad >= 0, got {attrs['stride']}, {attrs['pad']}")
    oh = conv_output_size(x.shape[2], kh, sh, ph)
    ow = conv_output_size(x.shape[3], kw, sw, pw)
    if oh < 1 or ow < 1:
        raise _fail(op, f"kernel {kh}x{kw} does not fit input {x} with pad {attrs['pad']}")
    return (x.shape[0], cout, oh, ow)


CONV_ATTRS = {"stride": Attr("ints", [1, 1]), "pad": Attr("ints", [0, 0]),
              "groups": Attr("int", 1)}


def _conv2d_infer(types, attrs):
    x, w = types
    _float("conv2d", x)
    _rank("conv2d", w, 4, "weight")
    if w.dtype != x.dtype:
        raise _fail("conv2d", f"weight {w} and input {x} differ in dtype")
    return [x.with_shape(_conv_check(x, w.shape, attrs, "conv2d"))]


def _conv2d_split(types, attrs):
    sigs = [SplitSignature(("S0", "B"), ("S0",)), SplitSignature(("B", "B"), ("B",))]
    if attrs["groups"] == 1:
        sigs += [SplitSignature(("B", "S0"), ("S1",)), SplitSignature(("S1", "S1"), ("P",))]
    return sigs


register(OpDef("conv2d", ("x", "w"), _conv2d_infer, nnref.conv2d, O, attrs=dict(CONV_ATTRS),
               split=_conv2d_split, doc="cross-correlation, NCHW input, OIHW weight"))


def _conv2d_grad_input_infer(types, attrs):
    gy, w = types
    x = TensorType(_shape_attr("conv2d_grad_input", attrs, "input_shape"), gy.dtype)
    if _conv_check(x, w.shape, attrs, "conv2d_grad_input") != gy.shape:
        raise _fail("conv2d_grad_input", f"gradient {gy} does not match the output of "
                                         f"input {x} and weight {w}")
    return [x]


register(OpDef("conv2d_grad_input", ("gy", "w"), _conv2d_grad_input_infer,
               nnref.conv2d_grad_input, X,
               attrs={**CONV_ATTRS, "input_shape": Attr("ints")},
               split=lambda t, a: [SplitSignature(("S0", "B"), ("S0",)),
                                   SplitSignature(("B", "B"), ("B",))] + (
                   [SplitSignature(("S1", "S0"), ("P",))] if a["groups"] == 1 else []),
               differentiable=False))


def _conv2d_grad_weight_infer(types, attrs):
    x, gy = types
    kh, kw = _pair("conv2d_grad_weight", attrs, "kernel")
    groups = attrs["groups"]
    w_shape = (gy.shape[1], x.shape[1] // max(groups, 1), kh, kw) if gy.rank == 4 else ()
    _rank("conv2d_grad_weight", gy, 4, "gradient")
    if _conv_check(x, w_shape, attrs, "conv2d_grad_weight") != gy.shape:
        raise _fail("conv2d_grad_weight", f"gradient {gy} does not match the output of "
                                          f"input {x} with a {kh}x{kw} kernel")
    return [x.with_shape(w_shape)]


register(OpDef("conv2d_grad_weight", ("x", "gy"), _conv2d_grad_weight_infer,
               nnref.conv2d_grad_weight, X,
               attrs={**CONV_ATTRS, "kernel": Attr("ints")},
               split=lambda t, a: [SplitSignature(("S0", "S0"), ("P",)),
                                   SplitSignature(("B", "B"), ("B",))] + (
                   [SplitSignature(("B", "S1"), ("S0",))] if a["groups"] == 1 else []),
               differentiable=False))


POOL_ATTRS = {"kernel": Attr("ints"), "stride": Attr("ints", [1, 1]),
              "pad": Attr("ints", [0, 0])}


def _pool_shape(op, x: TensorType, attrs):
    _float(op, x)
    _rank(op, x, 4)
    kh, kw = _pair(op, attrs, "kernel")
    sh, sw = _pair(op, attrs, "stride")
    ph, pw = _pair(op, attrs, "pad")
    if min(kh, kw, sh, sw) < 1 or min(ph, pw) < 0 or ph >= kh or pw >= kw:
        raise _fail(op, f"bad window: kernel {attrs['kernel']}, stride {attrs['stride']}, "
                        f"pad {attrs['pad']} (pad must be smaller than the kernel)")
    oh = pool_output_size(x.shape[2], kh, sh, ph)
    ow = pool_output_size(x.shape[3], kw, sw, pw)
    if oh < 1 or ow < 1:
        raise _fail(op, f"window {kh}x{kw} does not fit input {x}")
    return (x.shape[0], x.shape[1], oh, ow)


def _pool_infer(op):
    def infer(types, attrs):
        return [types[0].with_shape(_pool_shape(op, types[0], attrs))]
    return infer


def _nc_split(types, attrs):
    """Per-sample, per-channel ops: batch or channel axis may be split."""
    n = len(types)
    return [SplitSignature(("S0",) * n, ("S0",)), SplitSignature(("S1",) * n, ("S1",)),
            SplitSignature(("B",) * n, ("B",))]


register(OpDef("max_pool2d", ("x",), _pool_infer("max_pool2d"), nnref.max_pool2d, X,
               attrs=dict(POOL_ATTRS), split=_nc_split,
               doc="max over windows, Caffe's ceil-mode output size"))
register(OpDef("avg_pool2d", ("x",), _pool_infer("avg_pool2d"), nnref.avg_pool2d, X,
               attrs=dict(POOL_ATTRS), split=_nc_split,
               doc="mean over windows, Caffe's ceil-mode size and divisor"))


def _max_pool_grad_infer(types, attrs):
    x, y, gy = types
    expect = _pool_shape("max_pool2d_grad", x, attrs)
    if y.shape != expect or gy != y:
        raise _fail("max_pool2d_grad", f"output {y} and gradient {gy} must be "
                                       f"{x.dtype}[{','.join(map(str, expect))}]")
    return [x]


register(OpDef("max_pool2d_grad", ("x", "y", "gy"), _max_pool_grad_infer,
               nnref.max_pool2d_grad, X, attrs=dict(POOL_ATTRS), split=_nc_split,
               differentiable=False, doc="routes gy to the first maximum of each window"))


def _avg_pool_grad_infer(types, attrs):
    gy = types[0]
    x = TensorType(_shape_attr("avg_pool2d_grad", attrs, "input_shape"), gy.dtype)
    if _pool_shape("avg_pool2d_grad", x, attrs) != gy.shape:
        raise _fail("avg_pool2d_grad", f"gradient {gy} does not match pooling input {x}")
    return [x]


register(OpDef("avg_pool2d_grad", ("gy",), _avg_pool_grad_infer, nnref.avg_pool2d_grad, X,
               attrs={**POOL_ATTRS, "input_shape": Attr("ints")}, split=_nc_split,
               differentiable=False))


def _global_avg_pool_infer(types, attrs):
    x = types[0]
    _float("global_avg_pool", x)
    _rank("global_avg_pool", x, 4)
    return [x.with_shape((x.shape[0], x.shape[1], 1, 1))]


register(OpDef("global_avg_pool", ("x",), _global_avg_pool_infer,
               lambda x: (x.mean(axis=(2, 3), keepdims=True).astype(x.dtype),), R,
               split=_nc_split, doc="mean over H and W, output N x C x 1 x 1"))


def _global_avg_pool_grad_infer(types, attrs):
    gy = types[0]
    shape = _shape_attr("global_avg_pool_grad", attrs, "input_shape")
    if len(shape) != 4 or gy.shape != (shape[0], shape[1], 1, 1):
        raise _fail("global_avg_pool_grad", f"gradient {gy} does not match input {shape}")
    return [gy.with_shape(shape)]


register(OpDef("global_avg_pool_grad", ("gy",), _global_avg_pool_grad_infer,
               lambda gy, input_shape: (np.broadcast_to(
                   gy / gy.dtype.type(input_shape[2] * input_shape[3]), input_shape).copy(),), B,
               attrs={"input_shape": Attr("ints")}, split=_nc_split, differentiable=False))

LRN_ATTRS = {"size": Attr("int", 5), "alpha": Attr("float", 1e-4),
             "beta": Attr("float", 0.75), "k": Attr("float", 1.0)}


def _lrn_infer(types, attrs):
    x = types[0]
    _float("lrn", x)
    _rank("lrn", x, 4)
    if attrs["size"] < 1 or attrs["size"] % 2 == 0:
        raise _fail("lrn", f"size must be odd and positive, got {attrs['size']}")
    return [x]


register(OpDef("lrn", ("x",), _lrn_infer, nnref.lrn, X, attrs=dict(LRN_ATTRS),
               split=_batch_split,
               doc="Caffe's across-channel LRN: x * (k + alpha/size * sum x^2)^-beta"))
register(OpDef("lrn_grad", ("x", "gy"), _grad_pair_infer("lrn_grad"), nnref.lrn_grad, X,
               attrs=dict(LRN_ATTRS), split=_batch_split, differentiable=False))


def _softmax_ref(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True),)


def _softmax_infer(types, attrs):
    x = types[0]
    _float("softmax", x)
    if not 0 <= attrs["axis"] < x.rank:
        raise _fail("softmax", f"axis {attrs['axis']} out of range for {x}")
    return [x]


def _softmax_split(types, attrs):
    n = len(types)
    return [SplitSignature((f"S{a}",) * n, (f"S{a}",)) for a in range(types[0].rank)
            if a != attrs["axis"]] + [SplitSignature(("B",) * n, ("B",))]


register(OpDef("softmax", ("x",), _softmax_infer, _softmax_ref, X,
               attrs={"axis": Attr("int", 1)}, split=_softmax_split))
register(OpDef("softmax_grad", ("y", "gy"), _grad_pair_infer("softmax_grad"),
               lambda y, gy, axis: (y * (gy - (gy * y).sum(axis=axis, keepdims=True)),), X,
               attrs={"axis": Attr("int", 1)}, split=_softmax_split, differentiable=False))


def _xent_check(op, logits: TensorType, label: TensorType):
    _float(op, logits, "logits")
    _rank(op, logits, 2, "logits")
    _integer(op, label, "label")
    if label.shape != logits.shape[:1]:
        raise _fail(op, f"label {label} must hold one class per row of logits {logits}")


def _xent_infer(types, attrs):
    _xent_check("softmax_xent", *types)
    return [TensorType((), types[0].dtype)]


def _check_labels(label: np.ndarray, classes: int) -> None:
    """Labels index the logits' columns: refuse one outside [0, classes) rather than
    wrap it around as NumPy indexing would."""
    bad = np.flatnonzero((label < 0) | (label >= classes))
    if bad.size:
        raise ValueError(f"label {label[bad[0]]} at row {bad[0]} is outside [0, {classes})")


def _xent_ref(logits, label):
    _check_labels(label, logits.shape[1])
    shifted = logits - logits.max(axis=1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return (np.asarray(-logp[np.arange(len(label)), label].mean(), dtype=logits.dtype),)


def _xent_grad_infer(types, attrs):
    logits, label, gy = types
    _xent_check("softmax_xent_grad", logits, label)
    if gy != TensorType((), logits.dtype):
        raise _fail("softmax_xent_grad", f"gradient must be a {logits.dtype} scalar, got {gy}")
    return [logits]


def _xent_grad_ref(logits, label, gy):
    _check_labels(label, logits.shape[1])
    (p,) = _softmax_ref(logits, 1)
    p[np.arange(len(label)), label] -= 1
    return ((p * (gy / len(label))).astype(logits.dtype),)


# Means over the batch rows (the loss, its gradient's 1/batch factor, accuracy) split by
# rows into partial sums once each piece is weighted by its share of the rows: the
# partitioner does that weighting (purinec.passes.parallel.partition.ROW_MEANS).
def _row_mean_split(types, attrs):
    return [SplitSignature(("S0", "S0"), ("P",)), SplitSignature(("B", "B"), ("B",))]


register(OpDef("softmax_xent", ("logits", "label"), _xent_infer, _xent_ref, X,
               split=_row_mean_split, doc="mean over the batch of -log softmax(logits)[label]"))
register(OpDef("softmax_xent_grad", ("logits", "label", "gy"), _xent_grad_infer,
               _xent_grad_ref, X,
               split=lambda t, a: [SplitSignature(("S0", "S0", "B"), ("S0",)),
                                   SplitSignature(("B", "B", "B"), ("B",))],
               differentiable=False))


def _accuracy_infer(types, attrs):
    _xent_check("accuracy", *types)
    return [TensorType((), types[0].dtype)]


register(OpDef("accuracy", ("logits", "label"), _accuracy_infer,
               lambda logits, label: (np.asarray((logits.argmax(axis=1) == label).mean(),
                                                 dtype=logits.dtype),), X,
               split=_row_mean_split, differentiable=False,
               doc="fraction of rows whose largest logit is the label (first on ties)"))


def _fill_infer(types, attrs):
    return [TensorType(_shape_attr("fill", attrs), _dtype_attr("fill", attrs))]


register(OpDef("fill", (), _fill_infer,
               lambda shape, dtype, value: (np.full(shape, value, DType(dtype).numpy),), E,
               attrs={"shape": Attr("ints"), "dtype": Attr("str", "f32"),
                      "value": Attr("float", 0.0)},
               split=lambda t, a: [SplitSignature((), ("B",))], differentiable=False))


def _dropout_mask_infer(types, attrs):
    _rank("dropout_mask", types[0], 0, "iteration counter")
    _integer("dropout_mask", types[0], "iteration counter")
    if not 0.0 <= attrs["p"] < 1.0:
        raise _fail("dropout_mask", f"drop probability must be in [0, 1), got {attrs['p']}")
    return [TensorType(_shape_attr("dropout_mask", attrs), _dtype_attr("dropout_mask", attrs))]


register(OpDef("dropout_mask", ("iteration",), _dropout_mask_infer, nnref.dropout_mask, E,
               attrs={"shape": Attr("ints"), "p": Attr("float", 0.5), "seed": Attr("int", 0),
                      "dtype": Attr("str", "f32")},
               differentiable=False,
               doc="0 with probability p, else 1/(1-p); a counter-based hash of (seed, "
                   "iteration, index), so every backend draws the same mask"))


def _sgd_infer(types, attrs):
    w, h, g = types
    _float("sgd", w, "weight")
    _same("sgd", types)
    return [w, h]


def _sgd_ref(w, h, g, lr, momentum, weight_decay):
    t = w.dtype.type
    update = t(momentum) * h + t(lr) * (g + t(weight_decay) * w)
    return (w - update, update)


register(OpDef("sgd", ("weight", "history", "grad"), _sgd_infer, _sgd_ref, E,
               attrs={"lr": Attr("float"), "momentum": Attr("float", 0.0),
                      "weight_decay": Attr("float", 0.0)},
               split=lambda t, a: [SplitSignature(s.inputs, s.outputs * 2)
                                   for s in _elementwise_split(t, a)],
               differentiable=False,
               doc="Purine's solver: update = momentum*history + lr*(grad + wd*weight); "
                   "returns (weight - update, update)"))


# ---------------------------------------------------------------------------------------
# Communication: what the boxing pass inserts where a producer's distribution differs
# from what its consumer needs. In a logical graph (one value per logical tensor, with a
# distribution) each is the identity on the logical tensor; the partitioner turns it into
# one physical node per rank whose inputs and outputs are that rank's members' pieces, in
# group order (see purinec.passes.parallel). `group` lists the devices, comma-separated.


def _group_attr(op: str, attrs: dict) -> tuple:
    from purinec.ir.types import Device

    try:
        group = tuple(Device.parse(d) for d in attrs["group"].split(","))
    except ValueError as err:
        raise VerifyError(f"op {op}: attribute group: {err}") from None
    if len(set(group)) != len(group):
        raise VerifyError(f"op {op}: group {attrs['group']} names a device twice")
    return group


def _copy_infer(types, attrs):
    return [types[0]]


def _allreduce_infer(types, attrs):
    group = _group_attr("allreduce", attrs)
    per = attrs["tensors"]
    if per < 1 or len(types) % per or len(types) // per > len(group):
        raise _fail("allreduce", f"{len(types)} inputs are not {per} tensor(s) for each of at "
                                 f"most {len(group)} local member(s) of the group")
    for i, t in enumerate(types):
        if t != types[i % per]:
            raise _fail("allreduce", f"input {i} is {t} but the same tensor on the first "
                                     f"member is {types[i % per]}")
    return list(types)


def _allreduce_ref(*xs, group, tensors):
    members = len(xs) // tensors
    if members != len(group.split(",")):
        raise ValueError("allreduce across ranks has no in-process reference")
    sums = [sum(xs[m * tensors + t] for m in range(members)).astype(xs[t].dtype)
            for t in range(tensors)]
    return tuple(sums[i % tensors].copy() for i in range(len(xs)))


def _allgather_infer(types, attrs):
    group = _group_attr("allgather", attrs)
    axis, sizes = attrs["axis"], attrs["sizes"]
    if len(sizes) != len(group) or any(n < 0 for n in sizes):
        raise _fail("allgather", f"sizes {sizes} must give one extent per group member "
                                 f"({len(group)})")
    if len(types) > len(group):
        raise _fail("allgather", f"{len(types)} inputs for a group of {len(group)}")
    out = []
    for t in types:
        if not 0 <= axis < t.rank:
            raise _fail("allgather", f"axis {axis} out of range for {t}")
        if t.shape[axis] not in (*sizes, sum(sizes)):
            raise _fail("allgather", f"input {t} has extent {t.shape[axis]} on axis {axis}, "
                                     f"not one of the pieces {sizes}")
        shape = list(t.shape)
        shape[axis] = sum(sizes)
        out.append(t.with_shape(shape))
    return out


def _allgather_ref(*xs, group, axis, sizes):
    if len(xs) == 1 and xs[0].shape[axis] == sum(sizes):  # logical: the identity
        return (xs[0].copy(),)
    if len(xs) != len(sizes):
        raise ValueError("allgather across ranks has no in-process reference")
    whole = np.concatenate(xs, axis=axis)
    return tuple(whole.copy() for _ in xs)


def _root_attr(op: str, attrs: dict, group: tuple):
    """The ``root`` device of a reduce or broadcast, which must be in its group."""
    from purinec.ir.types import Device

    try:
        root = Device.parse(attrs["root"])
    except ValueError as err:
        raise VerifyError(f"op {op}: attribute root: {err}") from None
    if root not in group:
        raise VerifyError(f"op {op}: root {root} is not in its group {attrs['group']}; "
                          f"the root must be one of the group's devices")
    return root


def _reduce_infer(types, attrs):
    group = _group_attr("reduce", attrs)
    _root_attr("reduce", attrs, group)
    per = attrs["tensors"]
    if per < 1 or len(types) % per or len(types) // per > len(group):
        raise _fail("reduce", f"{len(types)} inputs are not {per} tensor(s) for each of at "
                              f"most {len(group)} local member(s) of the group")
    for i, t in enumerate(types):
        if t != types[i % per]:
            raise _fail("reduce", f"input {i} is {t} but the same tensor on the first member "
                                  f"is {types[i % per]}")
    return list(types[:per])


def _reduce_ref(*xs, group, root, tensors):
    if len(xs) != tensors * len(group.split(",")):
        raise ValueError("reduce across ranks has no in-process reference")
    totals = []
    for t in range(tensors):
        total = xs[t].copy()
        for x in xs[t + tensors::tensors]:  # in group order, as the runtime's kernels sum
            total += x
        totals.append(total)
    return tuple(totals)


def broadcast_types(attrs: dict) -> list[TensorType]:
    """The tensors a broadcast sends: ``shape`` cut into one shape per tensor by
    ``ndims`` (each tensor's number of dimensions; none: one tensor), all ``dtype``."""
    shape = _shape_attr("broadcast", attrs)
    ndims = attrs.get("ndims") or [len(shape)]
    if any(n < 0 for n in ndims) or sum(ndims) != len(shape):
        raise _fail("broadcast", f"ndims={list(ndims)} does not cut shape={list(shape)} "
                                 f"into tensors (their numbers of dimensions must add up "
                                 f"to the shape's {len(shape)} entries)")
    dtype, starts = _dtype_attr("broadcast", attrs), [0, *itertools.accumulate(ndims)]
    return [TensorType(shape[a:b], dtype) for a, b in zip(starts[:-1], starts[1:])]


def _broadcast_infer(types, attrs):
    group = _group_attr("broadcast", attrs)
    _root_attr("broadcast", attrs, group)
    tensors = broadcast_types(attrs)
    if types and list(types) != tensors:
        raise _fail("broadcast", f"takes the root's {', '.join(map(str, tensors))} (or "
                                 f"nothing, on a rank without the root), got "
                                 f"{', '.join(map(str, types))}")
    if not 1 <= attrs["members"] <= len(group):
        raise _fail("broadcast", f"members={attrs['members']} is not between 1 and the "
                                 f"group's {len(group)}")
    return tensors * attrs["members"]


def _broadcast_ref(*xs, group, root, shape, dtype, members, ndims):
    if not xs:
        raise ValueError("broadcast from another rank has no in-process reference")
    return tuple(x.copy() for _ in range(members) for x in xs)


def _slice_infer(types, attrs):
    x = types[0]
    axis, start, stop = attrs["axis"], attrs["start"], attrs["stop"]
    if not 0 <= axis < x.rank:
        raise _fail("slice", f"axis {axis} out of range for {x}")
    if not 0 <= start <= stop <= x.shape[axis]:
        raise _fail("slice", f"[{start}:{stop}] is outside axis {axis} of {x}")
    shape = list(x.shape)
    shape[axis] = stop - start
    return [x.with_shape(shape)]


def _slice_ref(x, axis, start, stop):
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop)
    return (np.ascontiguousarray(x[tuple(index)]),)


def _send_infer(types, attrs):
    _peer_attr("send", attrs)
    return [TensorType((), DType.bool)]


def _recv_infer(types, attrs):
    _peer_attr("recv", attrs)
    return [TensorType(_shape_attr("recv", attrs), _dtype_attr("recv", attrs))]


def _peer_attr(op: str, attrs: dict):
    from purinec.ir.types import Device

    try:
        return Device.parse(attrs["peer"])
    except ValueError as err:
        raise VerifyError(f"op {op}: attribute peer: {err}") from None


def _across_ranks(op: str):
    def refuse(*args, **kwargs):
        raise ValueError(f"{op} moves data between MPI ranks; it has no in-process reference")
    return refuse


COMM_OPS = ("copy", "allreduce", "allgather", "reduce", "broadcast", "send", "recv")


def spans_ranks(node) -> bool:
    """Whether ``node`` talks to other ranks: a send or receive, or a collective whose
    group does."""
    from purinec.ir.types import Device

    if node.op in ("send", "recv"):
        return True
    group = node.attrs.get("group")
    return group is not None and len({Device.parse(d).rank for d in group.split(",")}) > 1

register(OpDef("copy", ("x",), _copy_infer, lambda x: (x.copy(),), X, differentiable=False,
               doc="the same tensor on another device"))
register(OpDef("allreduce", ("xs",), _allreduce_infer, _allreduce_ref, X,
               attrs={"group": Attr("str"), "tensors": Attr("int", 1)}, variadic=True,
               differentiable=False, in_place=True,
               doc="sum over the group's members; inputs and outputs are `tensors` tensors "
                   "for each member on this rank, in group order"))
register(OpDef("allgather", ("xs",), _allgather_infer, _allgather_ref, X,
               attrs={"group": Attr("str"), "axis": Attr("int"), "sizes": Attr("ints")},
               variadic=True, differentiable=False,
               doc="every member gets the concatenation of the members' pieces along axis; "
                   "one input and one output for each member on this rank"))
# A parameter server's conversions (data parallelism with --parallel ps): the partial
# gradients summed onto the server, and its new weights sent to every member.
register(OpDef("reduce", ("xs",), _reduce_infer, _reduce_ref, X,
               attrs={"group": Attr("str"), "root": Attr("str"), "tensors": Attr("int", 1)},
               variadic=True, differentiable=False,
               doc="sum over the group's members onto `root`; inputs are `tensors` tensors "
                   "for each member on this rank, in group order; the outputs are their "
                   "sums on the root's rank, and what this rank sent toward it on the "
                   "others"))
register(OpDef("broadcast", (), _broadcast_infer, _broadcast_ref, X,
               attrs={"group": Attr("str"), "root": Attr("str"), "shape": Attr("ints"),
                      "dtype": Attr("str", "f32"), "members": Attr("int", 1),
                      "ndims": Attr("ints", [])},
               variadic=True,  # the root's tensors on its rank, nothing on the others
               differentiable=False,
               doc="root's tensors (a bucket: `shape` holds their shapes one after another, "
                   "`ndims` their numbers of dimensions; none: one tensor) to every member "
                   "of the group; each tensor for each member on this rank, in group order"))
# A copy between ranks: the sending rank's half (its output is a token that the send
# completed, read by nobody) and the receiving rank's, matched by tag.
register(OpDef("send", ("x",), _send_infer, _across_ranks("send"), X,
               attrs={"peer": Attr("str"), "tag": Attr("int")}, differentiable=False,
               doc="x to device `peer` on another rank; the output says it was sent"))
register(OpDef("recv", (), _recv_infer, _across_ranks("recv"), X,
               attrs={"peer": Attr("str"), "tag": Attr("int"), "shape": Attr("ints"),
                      "dtype": Attr("str", "f32")}, differentiable=False,
               doc="the tensor that `peer` on another rank sends with the same tag"))
register(OpDef("slice", ("x",), _slice_infer, _slice_ref, I,
               attrs={"axis": Attr("int"), "start": Attr("int"), "stop": Attr("int")},
               differentiable=False, doc="x[start:stop] along axis"))


def _from_body(what: str):
    def refuse(*args, **kwargs):
        raise VerifyError(f"op fused: a fused node's {what} come from its body, one member "
                          f"at a time; fused nodes are made by purinec.passes.fuse (or "
                          f"Graph.add_fused), not by Graph.add_node")
    return refuse


# A fused group is one node holding its members (`Node.body`); the registry entry gives
# its attribute schema and arity so the generic paths (printer, parser, complete_attrs)
# work, while types and values come from the body: `infer`/`reference` refuse, and the
# verifier, `infer_shapes` and the reference target walk the members instead. Opaque: a
# fused node never fuses again, and the memory planner aliases nothing across it.
register(OpDef("fused", (), _from_body("output types"), _from_body("results"), X,
               attrs={"kernel": Attr("str")},
               variadic=True,  # with no fixed inputs: any number, none included
               differentiable=False,
               doc="a fused group: its members run as one kernel named by `kernel`"))
