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
                                    free, grad_pair_infer, linear_split, only,
                                    per_output_element, shape_attr, unary_infer)
from purinec.ir.ops.registry import Attr, FusionKind, OpDef, SplitSignature, register
from purinec.ir.types import DType, TensorType

E, B = FusionKind.elementwise, FusionKind.broadcast


def _sigmoid(x):
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


register(OpDef("relu_grad", ("x", "gy"), grad_pair_infer("relu_grad"),
               lambda x, gy: (np.where(x > 0, gy, 0).astype(gy.dtype),), E,
               split=elementwise_split, flops=per_output_element(1),  # a select
               expr=_relu_grad_expr, doc="gy * (x > 0)"))
register(OpDef("sigmoid_grad", ("y", "gy"), grad_pair_infer("sigmoid_grad"),
               lambda y, gy: (gy * y * (1 - y),), E, split=elementwise_split,
               flops=per_output_element(3), expr=_sigmoid_grad_expr,
               doc="gy * y * (1 - y), y = sigmoid(x)"))
register(OpDef("tanh_grad", ("y", "gy"), grad_pair_infer("tanh_grad"),
               lambda y, gy: (gy * (1 - y * y),), E, split=elementwise_split,
               flops=per_output_element(3), expr=_tanh_grad_expr,
               doc="gy * (1 - y^2), y = tanh(x)"))


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
