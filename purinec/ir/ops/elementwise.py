"""Elementwise and broadcast ops: arithmetic, activations and their gradients, casts,
fills and dropout masks. Each has an element expression, from which every backend
prints its loops (alone, fused into a chain, or as a conv/matmul epilogue)."""

from __future__ import annotations

import math

import numpy as np

from purinec.ir import nnref
from purinec.ir.expr import U64, Const, Index, call, cast, select
from purinec.ir.ops.helpers import (binary_infer, check_float, check_integer, check_rank,
                                    constant, dtype_attr, elementwise_split, emit1, fail,
                                    float_infer, free, linear_split, only,
                                    per_output_element, shape_attr, unary_infer)
from purinec.ir.ops.registry import (FINITE, Attr, Bound, FusionKind, OpDef, SplitSignature,
                                     register)
from purinec.ir.types import DType, TensorType

E, B = FusionKind.elementwise, FusionKind.broadcast


def _sigmoid(x):
    # exp(-x) overflows to inf below x = -88 (f32), and 1 / inf is the limit, 0.
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def _relu_expr(node, args):
    (x,), zero = args, constant(node, 0)
    return [select(call("le", x, zero), zero, x)]  # NaN passes through, as np.maximum


def _relu_gradient(g, node, gys, needs=None):
    """gx = gy * (x > 0)."""
    return only(needs, lambda: emit1(g, node, "relu_grad", [node.inputs[0], gys[0]]))


register(OpDef("relu", ("x",), unary_infer("relu"),
               lambda x: (np.maximum(x, 0).astype(x.dtype),), E, split=elementwise_split,
               gradient=_relu_gradient, flops=per_output_element(1), expr=_relu_expr,
               doc="max(x, 0)"))


def _from_output_gradient(g, node, gys, needs=None):
    """From the output: sigmoid_grad(y, gy) = gy y (1-y); tanh_grad(y, gy) = gy (1-y^2)."""
    return only(needs, lambda: emit1(g, node, node.op + "_grad", [node.outputs[0], gys[0]]))


def _sigmoid_expr(node, args):
    (x,), one = args, constant(node, 1)
    return [one / (one + call("exp", -x))]


register(OpDef("sigmoid", ("x",), unary_infer("sigmoid"), lambda x: (_sigmoid(x),), E,
               split=elementwise_split, gradient=_from_output_gradient,
               flops=per_output_element(3),  # exp, add, divide
               expr=_sigmoid_expr, doc="1 / (1 + exp(-x))"))
register(OpDef("tanh", ("x",), unary_infer("tanh"), lambda x: (np.tanh(x),), E,
               split=elementwise_split, gradient=_from_output_gradient,
               flops=per_output_element(1), expr=lambda node, args: [call("tanh", args[0])]))


def _scale_gradient(g, node, gys, needs=None):
    """gx = alpha * gy."""
    return only(needs, lambda: emit1(g, node, "scale", [gys[0]],
                                     {"alpha": node.attrs["alpha"]}))


register(OpDef("scale", ("x",), unary_infer("scale"),
               lambda x, alpha: ((x * x.dtype.type(alpha)),), E,
               attrs={"alpha": Attr("float")}, split=linear_split, gradient=_scale_gradient,
               flops=per_output_element(1),
               expr=lambda node, args: [args[0] * constant(node, node.attrs["alpha"])],
               doc="alpha * x"))


def _pass_through(g, node, gys, needs=None):
    """Every input's gradient is gy, passed through (add's, add_scalar's)."""
    return only(needs, *[lambda: gys[0]] * len(node.inputs))


def _add_scalar_expr(node, args):
    value = constant(node, node.attrs["value"])
    if node.outputs[0].type.dtype is DType.bool:  # NumPy's bool + bool is "or"
        return [call("or", args[0], value)]
    return [args[0] + value]


register(OpDef("add_scalar", ("x",), lambda types, attrs: [types[0]],
               lambda x, value: ((x + x.dtype.type(value)),), E,
               attrs={"value": Attr("float")}, split=elementwise_split,
               gradient=_pass_through, flops=per_output_element(1), expr=_add_scalar_expr,
               doc="x + value (any dtype; the iteration counter is one)"))


def _cast_infer(types, attrs):
    return [TensorType(types[0].shape, dtype_attr("cast", attrs))]


def _cast_expr(node, args):
    (x,) = args
    src, dst = node.inputs[0].type.dtype, node.outputs[0].type.dtype
    if dst is DType.bool:
        return [call("ne", x, Const(0, str(src)))]
    if src is DType.bool:
        return [select(x, constant(node, 1), constant(node, 0))]
    return [cast(x, str(dst))]


register(OpDef("cast", ("x",), _cast_infer,
               lambda x, dtype: (x.astype(DType(dtype).numpy),), E,
               attrs={"dtype": Attr("str")}, split=elementwise_split, flops=free,
               expr=_cast_expr))


def _sub_gradient(g, node, gys, needs=None):
    """ga = gy, gb = -gy."""
    return only(needs, lambda: gys[0],
                lambda: emit1(g, node, "scale", [gys[0]], {"alpha": -1.0}))


def _mul_gradient(g, node, gys, needs=None):
    """ga = gy * b, gb = gy * a."""
    a, b = node.inputs
    return only(needs, lambda: emit1(g, node, "mul", [gys[0], b]),
                lambda: emit1(g, node, "mul", [gys[0], a]))


register(OpDef("add", ("a", "b"), binary_infer("add"), lambda a, b: (a + b,), E,
               split=linear_split, gradient=_pass_through, flops=per_output_element(1),
               expr=lambda node, args: [args[0] + args[1]]))
register(OpDef("sub", ("a", "b"), binary_infer("sub"), lambda a, b: (a - b,), E,
               split=linear_split, gradient=_sub_gradient, flops=per_output_element(1),
               expr=lambda node, args: [args[0] - args[1]]))
register(OpDef("mul", ("a", "b"), binary_infer("mul"), lambda a, b: (a * b,), E,
               split=elementwise_split, gradient=_mul_gradient, flops=per_output_element(1),
               expr=lambda node, args: [args[0] * args[1]]))


def _relu_grad_expr(node, args):
    (x, gy), zero = args, constant(node, 0)
    return [select(call("gt", x, zero), gy, zero)]


def _sigmoid_grad_expr(node, args):
    (y, gy), one = args, constant(node, 1)
    return [gy * y * (one - y)]


def _tanh_grad_expr(node, args):
    (y, gy), one = args, constant(node, 1)
    return [gy * (one - y * y)]


register(OpDef("relu_grad", ("x", "gy"), float_infer("relu_grad"),
               lambda x, gy: (np.where(x > 0, gy, 0).astype(gy.dtype),), E,
               split=elementwise_split, flops=per_output_element(1),  # a select
               expr=_relu_grad_expr, doc="gy * (x > 0)"))
register(OpDef("sigmoid_grad", ("y", "gy"), float_infer("sigmoid_grad"),
               lambda y, gy: (gy * y * (1 - y),), E, split=elementwise_split,
               flops=per_output_element(3), expr=_sigmoid_grad_expr,
               doc="gy * y * (1 - y), y = sigmoid(x)"))
register(OpDef("tanh_grad", ("y", "gy"), float_infer("tanh_grad"),
               lambda y, gy: (gy * (1 - y * y),), E, split=elementwise_split,
               flops=per_output_element(3), expr=_tanh_grad_expr,
               doc="gy * (1 - y^2), y = tanh(x)"))


# ---------------------------------------------------------------------------------------
# More arithmetic and activations (what ONNX models use). Two-input ops take operands of
# one type: an importer broadcasts them first (broadcast_to). Each gradient op follows
# PyTorch's convention where the derivative is undefined (kinks, pow at a = 0).


def _erf(x):
    """NumPy has no erf: Python's, element by element, in x's dtype."""
    return np.vectorize(math.erf, otypes=[x.dtype])(x)


def _clamp(v, lo, hi):
    """min(max(v, lo), hi) as selects: NaN passes through, as in np.clip."""
    v = select(call("lt", v, lo), lo, v)
    return select(call("gt", v, hi), hi, v)


def _unary(name, reference, expr, gradient, flops=1, split=elementwise_split, doc=""):
    """An elementwise op of one float tensor, attributes none."""
    register(OpDef(name, ("x",), unary_infer(name), lambda x: (reference(x),), E,
                   split=split, gradient=gradient, flops=per_output_element(flops),
                   expr=lambda node, args: [expr(node, args[0])], doc=doc))


def _grad_op(name, inputs, reference, expr, flops, attrs=None, doc=""):
    """A gradient op: float operands of one type -> gx, element by element."""
    register(OpDef(name, inputs, float_infer(name), reference, E, attrs=attrs or {},
                   split=elementwise_split, flops=per_output_element(flops),
                   expr=lambda node, args: [expr(node, *args)], doc=doc))


def _unary_gradient(op, inputs):
    """A rule emitting ``op`` over ``inputs`` (each "x", "y" or "gy") with the forward
    node's attributes."""
    def rule(g, node, gys, needs=None):
        named = {"x": node.inputs[0], "y": node.outputs[0], "gy": gys[0]}
        return only(needs, lambda: emit1(g, node, op, [named[i] for i in inputs],
                                         dict(node.attrs)))
    return rule


_unary("neg", np.negative, lambda node, x: -x, _unary_gradient("neg", ["gy"]),
       split=linear_split)
_unary("exp", np.exp, lambda node, x: call("exp", x), _unary_gradient("mul", ["gy", "y"]),
       doc="e^x; gx = gy * y")
_unary("log", np.log, lambda node, x: call("log", x), _unary_gradient("div", ["gy", "x"]),
       doc="natural logarithm; gx = gy / x")
_unary("sqrt", np.sqrt, lambda node, x: call("sqrt", x),
       _unary_gradient("sqrt_grad", ["y", "gy"]))
_unary("abs", np.abs, lambda node, x: call("abs", x), _unary_gradient("abs_grad", ["x", "gy"]))
_unary("erf", _erf, lambda node, x: call("erf", x), _unary_gradient("erf_grad", ["x", "gy"]))
_unary("hard_swish", lambda x: x * np.clip(x * x.dtype.type(1 / 6) + x.dtype.type(0.5), 0, 1),
       lambda node, x: x * _clamp(x * constant(node, 1 / 6) + constant(node, 0.5),
                                  constant(node, 0), constant(node, 1)),
       _unary_gradient("hard_swish_grad", ["x", "gy"]), flops=5,
       doc="x * max(0, min(1, x/6 + 1/2))")


def _leaky_relu_expr(node, args):
    (x,), zero = args, constant(node, 0)
    return [select(call("gt", x, zero), x, x * constant(node, node.attrs["alpha"]))]


register(OpDef("leaky_relu", ("x",), unary_infer("leaky_relu"),
               lambda x, alpha: (np.where(x > 0, x, x * x.dtype.type(alpha)),), E,
               attrs={"alpha": Attr("float", 0.01, bound=FINITE)}, split=elementwise_split,
               gradient=_unary_gradient("leaky_relu_grad", ["x", "gy"]),
               flops=per_output_element(2), expr=_leaky_relu_expr,
               doc="x where x > 0, else alpha * x"))

# Infinite bounds are the importer's "no bound"; a NaN bound would bound nothing sensibly.
NOT_NAN = Bound(lambda v: not math.isnan(v), "a number or an infinity, not nan")


def _clip_ref(x, **bounds):
    return (np.clip(x, x.dtype.type(bounds["min"]), x.dtype.type(bounds["max"])),)


register(OpDef("clip", ("x",), unary_infer("clip"), _clip_ref, E,
               attrs={"min": Attr("float", -math.inf, bound=NOT_NAN),
                      "max": Attr("float", math.inf, bound=NOT_NAN)},
               split=elementwise_split, gradient=_unary_gradient("clip_grad", ["x", "gy"]),
               flops=per_output_element(2),
               expr=lambda node, args: [_clamp(args[0], constant(node, node.attrs["min"]),
                                               constant(node, node.attrs["max"]))],
               doc="np.clip(x, min, max): NaN passes through"))


def _hard_sigmoid_inner(node, x):
    return x * constant(node, node.attrs["alpha"]) + constant(node, node.attrs["beta"])


def _hard_sigmoid_ref(x, alpha, beta):
    return (np.clip(x * x.dtype.type(alpha) + x.dtype.type(beta), 0, 1).astype(x.dtype),)


register(OpDef("hard_sigmoid", ("x",), unary_infer("hard_sigmoid"), _hard_sigmoid_ref, E,
               attrs={"alpha": Attr("float", 0.2, bound=FINITE),
                      "beta": Attr("float", 0.5, bound=FINITE)},
               split=elementwise_split,
               gradient=_unary_gradient("hard_sigmoid_grad", ["x", "gy"]),
               flops=per_output_element(4),
               expr=lambda node, args: [_clamp(_hard_sigmoid_inner(node, args[0]),
                                               constant(node, 0), constant(node, 1))],
               doc="max(0, min(1, alpha * x + beta))"))


def _div_gradient(g, node, gys, needs=None):
    """ga = gy / b; gb = -gy * y / b."""
    b, y = node.inputs[1], node.outputs[0]
    return only(needs, lambda: emit1(g, node, "div", [gys[0], b]),
                lambda: emit1(g, node, "div_grad_b", [y, b, gys[0]]))


def _pow_gradient(g, node, gys, needs=None):
    a, b = node.inputs
    return only(needs, lambda: emit1(g, node, "pow_grad_a", [a, b, gys[0]]),
                lambda: emit1(g, node, "pow_grad_b", [a, b, gys[0]]))


register(OpDef("div", ("a", "b"), float_infer("div"), lambda a, b: (a / b,), E,
               split=elementwise_split, gradient=_div_gradient, flops=per_output_element(1),
               expr=lambda node, args: [args[0] / args[1]]))
register(OpDef("pow", ("a", "b"), float_infer("pow"), lambda a, b: (np.power(a, b),), E,
               split=elementwise_split, gradient=_pow_gradient, flops=per_output_element(1),
               expr=lambda node, args: [call("pow", *args)],
               doc="a ** b (NaN where a < 0 and b is not an integer)"))


def _pow_grad_a_expr(node, a, b, gy):
    """gy * b * a^(b-1), and 0 where b = 0 (not 0 * inf at a = 0)."""
    one, zero = constant(node, 1), constant(node, 0)
    return select(call("ne", b, zero), gy * b * call("pow", a, b - one), zero)


def _pow_grad_b_expr(node, a, b, gy):
    """gy * a^b * log(a), and 0 where a = 0 and b >= 0 (a^b is flat there: 0 or 1)."""
    zero = constant(node, 0)
    full = gy * call("pow", a, b) * call("log", a)
    return select(call("ne", a, zero), full, select(call("lt", b, zero), full, zero))


def _ignoring_invalid(fn):
    """``fn`` without NumPy's warnings for log(0), 0 * inf and the like."""
    def quiet(*args, **attrs):
        with np.errstate(all="ignore"):
            return fn(*args, **attrs)
    return quiet


@_ignoring_invalid
def _pow_grad_a_ref(a, b, gy):
    return (np.where(b != 0, gy * b * np.power(a, b - 1), 0).astype(gy.dtype),)


@_ignoring_invalid
def _pow_grad_b_ref(a, b, gy):
    full = gy * np.power(a, b) * np.log(a)
    return (np.where((a == 0) & (b >= 0), 0, full).astype(gy.dtype),)


def _abs_grad_expr(node, x, gy):
    zero = constant(node, 0)
    return select(call("gt", x, zero), gy, select(call("lt", x, zero), -gy, zero))


def _hard_sigmoid_grad_expr(node, x, gy):
    """alpha * gy where 0 < alpha x + beta < 1, else 0 (PyTorch's: 0 at the kinks)."""
    v, zero = _hard_sigmoid_inner(node, x), constant(node, 0)
    inside = select(call("lt", v, constant(node, 1)), gy * constant(node, node.attrs["alpha"]),
                    zero)
    return select(call("gt", v, zero), inside, zero)


def _hard_sigmoid_grad_ref(x, gy, alpha, beta):
    v = x * x.dtype.type(alpha) + x.dtype.type(beta)
    return (np.where((v > 0) & (v < 1), gy * gy.dtype.type(alpha), 0).astype(gy.dtype),)


def _hard_swish_grad_expr(node, x, gy):
    """PyTorch's: 0 for x < -3, gy (x/3 + 1/2) for -3 <= x <= 3, gy above."""
    three = constant(node, 3)
    slope = gy * (x / three + constant(node, 0.5))
    return select(call("lt", x, -three), constant(node, 0),
                  select(call("le", x, three), slope, gy))


def _hard_swish_grad_ref(x, gy):
    t = x.dtype.type
    slope = gy * (x / t(3) + t(0.5))
    return (np.where(x < -3, 0, np.where(x <= 3, slope, gy)).astype(gy.dtype),)


def _clip_grad_expr(node, x, gy):
    """gy where min <= x <= max (a NaN x fails both tests: 0, as in PyTorch)."""
    low, high = constant(node, node.attrs["min"]), constant(node, node.attrs["max"])
    zero = constant(node, 0)
    return select(call("le", low, x), select(call("le", x, high), gy, zero), zero)


def _clip_grad_ref(x, gy, **bounds):
    inside = (x >= x.dtype.type(bounds["min"])) & (x <= x.dtype.type(bounds["max"]))
    return (np.where(inside, gy, 0).astype(gy.dtype),)


_TWO_OVER_SQRT_PI = 2 / math.sqrt(math.pi)

_grad_op("div_grad_b", ("y", "b", "gy"),
         lambda y, b, gy: (-(gy * y) / b,),
         lambda node, y, b, gy: -(gy * y) / b, 3, doc="-gy * y / b, y = a / b")
_grad_op("pow_grad_a", ("a", "b", "gy"), _pow_grad_a_ref, _pow_grad_a_expr, 4,
         doc="gy * b * a^(b-1) (0 where b = 0)")
_grad_op("pow_grad_b", ("a", "b", "gy"), _pow_grad_b_ref, _pow_grad_b_expr, 4,
         doc="gy * a^b * log(a) (0 where a = 0 and b >= 0)")
_grad_op("sqrt_grad", ("y", "gy"), lambda y, gy: (gy / (y + y),),
         lambda node, y, gy: gy / (y + y), 2, doc="gy / (2 y), y = sqrt(x)")
_grad_op("abs_grad", ("x", "gy"),
         lambda x, gy: (np.where(x > 0, gy, np.where(x < 0, -gy, 0)).astype(gy.dtype),),
         _abs_grad_expr, 2, doc="gy * sign(x) (0 at 0)")
_grad_op("erf_grad", ("x", "gy"),
         lambda x, gy: (gy * x.dtype.type(_TWO_OVER_SQRT_PI) * np.exp(-(x * x)),),
         lambda node, x, gy: gy * constant(node, _TWO_OVER_SQRT_PI) * call("exp", -(x * x)),
         5, doc="gy * 2/sqrt(pi) * exp(-x^2)")
_grad_op("leaky_relu_grad", ("x", "gy"),
         lambda x, gy, alpha: (np.where(x > 0, gy, gy * gy.dtype.type(alpha)),),
         lambda node, x, gy: select(call("gt", x, constant(node, 0)), gy,
                                    gy * constant(node, node.attrs["alpha"])),
         2, attrs={"alpha": Attr("float", 0.01, bound=FINITE)},
         doc="gy where x > 0, else alpha * gy")
_grad_op("clip_grad", ("x", "gy"), _clip_grad_ref, _clip_grad_expr,
         2, attrs={"min": Attr("float", -math.inf, bound=NOT_NAN),
                   "max": Attr("float", math.inf, bound=NOT_NAN)},
         doc="gy where min <= x <= max, else 0 (PyTorch's: the bounds pass it)")
_grad_op("hard_sigmoid_grad", ("x", "gy"), _hard_sigmoid_grad_ref, _hard_sigmoid_grad_expr,
         4, attrs={"alpha": Attr("float", 0.2, bound=FINITE),
                   "beta": Attr("float", 0.5, bound=FINITE)})
_grad_op("hard_swish_grad", ("x", "gy"), _hard_swish_grad_ref, _hard_swish_grad_expr, 4)


def _bias_add_infer(types, attrs):
    x, b = types
    check_float("bias_add", x)
    axis = attrs["axis"]
    if not 0 <= axis < x.rank:
        raise fail("bias_add", f"axis {axis} out of range for {x}")
    if b.shape != (x.shape[axis],) or b.dtype != x.dtype:
        raise fail("bias_add", f"bias must be {x.dtype}[{x.shape[axis]}] for input {x} "
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


def _bias_add_gradient(g, node, gys, needs=None):
    """gx = gy; gb = gy summed over every axis but ``axis``."""
    axis = node.attrs["axis"]
    others = [a for a in range(gys[0].type.rank) if a != axis]
    return only(needs, lambda: gys[0],
                lambda: emit1(g, node, "reduce_sum", [gys[0]], {"axes": others}))


register(OpDef("bias_add", ("x", "b"), _bias_add_infer, _bias_add_ref, B,
               attrs={"axis": Attr("int", 1)}, split=_bias_add_split,
               gradient=_bias_add_gradient, flops=per_output_element(1),
               expr=lambda node, args: [args[0] + args[1]],
               aligned=lambda attrs, i: (attrs["axis"],) if i == 1 else None,
               model_split={1: lambda attrs: 0},
               doc="x + b broadcast along axis"))


def _broadcast_to_infer(types, attrs):
    x = types[0]
    shape = shape_attr("broadcast_to", attrs)
    try:
        fits = np.broadcast_shapes(x.shape, shape) == shape
    except ValueError:
        fits = False
    if not fits:
        raise fail("broadcast_to", f"cannot broadcast {x} to {list(shape)}")
    return [x.with_shape(shape)]


def _broadcast_to_split(types, attrs):
    """An axis that is not broadcast keeps its pieces (x's axes align with the shape's
    last ones)."""
    x, shape = types[0], attrs["shape"]
    lead = len(shape) - x.rank
    sigs = [SplitSignature((f"S{a}",), (f"S{lead + a}",)) for a in range(x.rank)
            if x.shape[a] == shape[lead + a]]
    return sigs + [SplitSignature(("B",), ("B",)), SplitSignature(("P",), ("P",))]


def _broadcast_to_gradient(g, node, gys, needs=None):
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
    return only(needs, build)


register(OpDef("broadcast_to", ("x",), _broadcast_to_infer,
               lambda x, shape: (np.broadcast_to(x, shape).copy(),), B,
               attrs={"shape": Attr("ints")}, split=_broadcast_to_split,
               gradient=_broadcast_to_gradient, flops=free,
               expr=lambda node, args: [args[0]], shape_attr="shape",
               doc="NumPy broadcasting to shape"))


def _fill_infer(types, attrs):
    return [TensorType(shape_attr("fill", attrs), dtype_attr("fill", attrs))]


register(OpDef("fill", (), _fill_infer,
               lambda shape, dtype, value: (np.full(shape, value, DType(dtype).numpy),), E,
               attrs={"shape": Attr("ints"), "dtype": Attr("str", "f32"),
                      "value": Attr("float", 0.0)},
               split=lambda t, a: [SplitSignature((), ("B",))], flops=free,
               expr=lambda node, args: [constant(node, node.attrs["value"])],
               shape_attr="shape"))


def _dropout_mask_infer(types, attrs):
    check_rank("dropout_mask", types[0], 0, "iteration counter")
    check_integer("dropout_mask", types[0], "iteration counter")
    if not 0.0 <= attrs["p"] < 1.0:
        raise fail("dropout_mask", f"drop probability must be in [0, 1), got {attrs['p']}")
    return [TensorType(shape_attr("dropout_mask", attrs), dtype_attr("dropout_mask", attrs))]


def _dropout_mask_expr(node, args):
    """nnref.dropout_mask bit for bit: ``key = splitmix64(splitmix64(seed) ^ iteration)``
    (iteration in two's complement modulo 2**64), ``h = splitmix64(key ^ i)``, dropped
    where ``(h >> 11) < ceil(p * 2**53)``, the exact integer form of ``u < p``."""
    (iteration,) = args
    p = node.attrs["p"]
    seeded = Const(nnref.splitmix64(node.attrs["seed"] & 0xFFFFFFFFFFFFFFFF), U64)
    key = call("mix64", call("xor", seeded, call("u64", iteration)))
    bits = call("shr", call("mix64", call("xor", key, call("u64", Index()))), Const(11, U64))
    threshold = math.ceil(p * 2.0 ** 53)  # exact: p * 2**53 is a float64 product by 2**53
    dropped = call("lt", bits, Const(threshold, U64))
    return [select(dropped, constant(node, 0.0), constant(node, 1.0 / (1.0 - p)))]


register(OpDef("dropout_mask", ("iteration",), _dropout_mask_infer, nnref.dropout_mask, E,
               attrs={"shape": Attr("ints"), "p": Attr("float", 0.5), "seed": Attr("int", 0),
                      "dtype": Attr("str", "f32")},
               flops=free, expr=_dropout_mask_expr, shape_attr="shape",
               doc="0 with probability p, else 1/(1-p); a counter-based hash of (seed, "
                   "iteration, index), so every backend draws the same mask"))
