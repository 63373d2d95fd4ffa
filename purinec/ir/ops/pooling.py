"""Pooling and reductions: max and average pooling over windows (Caffe's semantics by
default, ONNX's through attributes), global average pooling, sums over axes, and their
gradients."""

from __future__ import annotations

import numpy as np

from purinec.ir import nnref
from purinec.ir.nnref import pool_output_size, window_extent
from purinec.ir.ops.helpers import (check_float, check_rank, constant, emit1, fail, nc_split,
                                    only, pad_attr, pair, per_input_element,
                                    per_output_element, shape_attr, size)
from purinec.ir.ops.registry import Attr, FusionKind, OpDef, SplitSignature, register
from purinec.ir.types import TensorType

B, R, X = FusionKind.broadcast, FusionKind.reduction, FusionKind.opaque

def _reduce_sum_infer(types, attrs):
    x = types[0]
    axes = attrs["axes"]
    if len(set(axes)) != len(axes) or any(not 0 <= a < x.rank for a in axes):
        raise fail("reduce_sum", f"bad axes {axes} for {x}")
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


def _reduce_sum_gradient(g, node, gys, needs=None):
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
    return only(needs, build)


register(OpDef("reduce_sum", ("x",), _reduce_sum_infer,
               lambda x, axes, keepdims: (np.sum(x, axis=tuple(axes), keepdims=keepdims)
                                          .astype(x.dtype),), R,
               attrs={"axes": Attr("ints"), "keepdims": Attr("bool", False)},
               split=_reduce_sum_split, gradient=_reduce_sum_gradient,
               # summing s elements into one takes s - 1 additions
               flops=lambda node: size(node.inputs) - size(node.outputs)))


# pad: [ph, pw], or [top, left, bottom, right] as ONNX orders them; dilation: the
# spacing of a window's taps; ceil_mode: Caffe's output size (the default), else ONNX's
# default floor (`purinec.ir.nnref.pool_output_size`).
POOL_ATTRS = {"kernel": Attr("ints"), "stride": Attr("ints", [1, 1]),
              "pad": Attr("ints", [0, 0]), "dilation": Attr("ints", [1, 1]),
              "ceil_mode": Attr("bool", True)}
# count_include_pad: the average's divisor counts the window's taps inside the padded
# input (Caffe's, the default), else only those inside the input.
AVG_POOL_ATTRS = {**POOL_ATTRS, "count_include_pad": Attr("bool", True)}


def _pool_shape(op, x: TensorType, attrs):
    check_float(op, x)
    check_rank(op, x, 4)
    kh, kw = pair(op, attrs, "kernel")
    sh, sw = pair(op, attrs, "stride")
    dh, dw = pair(op, attrs, "dilation")
    top, left, bottom, right = pad_attr(op, attrs)
    if min(kh, kw, sh, sw, dh, dw) < 1:
        raise fail(op, f"bad window: kernel {attrs['kernel']}, stride {attrs['stride']}, "
                        f"dilation {attrs['dilation']} must be >= 1")
    out = []
    for length, k, s, begin, end, d in ((x.shape[2], kh, sh, top, bottom, dh),
                                        (x.shape[3], kw, sw, left, right, dw)):
        windows = pool_output_size(length, k, s, begin, end, d, attrs["ceil_mode"])
        if windows < 1:
            raise fail(op, f"window {kh}x{kw} does not fit input {x}")
        if d > length:
            raise fail(op, f"dilation {attrs['dilation']} spaces taps further apart than "
                            f"input {x} is long: a window may hold only padding")
        # A window of padding alone has no maximum, nor an average without its pad. With
        # taps at most the input's length apart, a window reaching into the input has a
        # tap in it, so only the first window (before it) and the last (after) can miss.
        if -begin + window_extent(k, d) <= 0 or (windows - 1) * s - begin >= length:
            raise fail(op, f"some window of kernel {attrs['kernel']}, stride "
                            f"{attrs['stride']}, dilation {attrs['dilation']} holds only "
                            f"padding ({attrs['pad']}) of input {x}")
        out.append(windows)
    return (x.shape[0], x.shape[1], *out)


def _pool_infer(op):
    def infer(types, attrs):
        return [types[0].with_shape(_pool_shape(op, types[0], attrs))]
    return infer


def _window_flops(value_at):
    """The nominal window (kh*kw, edges not clipped) per element of ``value_at(node)``."""
    def flops(node):
        kh, kw = node.attrs["kernel"]
        return kh * kw * value_at(node).type.size
    return flops


def _max_pool2d_gradient(g, node, gys, needs=None):
    """gx = max_pool2d_grad(x, y, gy): gy routed to each window's first maximum."""
    args = [node.inputs[0], node.outputs[0], gys[0]]
    return only(needs, lambda: emit1(g, node, "max_pool2d_grad", args, dict(node.attrs)))


def _avg_pool2d_gradient(g, node, gys, needs=None):
    """gx = avg_pool2d_grad(gy), the adjoint of the average."""
    attrs = {**node.attrs, "input_shape": list(node.inputs[0].type.shape)}
    return only(needs, lambda: emit1(g, node, "avg_pool2d_grad", [gys[0]], attrs))


register(OpDef("max_pool2d", ("x",), _pool_infer("max_pool2d"), nnref.max_pool2d, X,
               attrs=dict(POOL_ATTRS), split=nc_split, gradient=_max_pool2d_gradient,
               flops=_window_flops(lambda node: node.outputs[0]),
               doc="max over each window's taps inside the input; ceil_mode (default) is "
                   "Caffe's output size, else floor"))
register(OpDef("avg_pool2d", ("x",), _pool_infer("avg_pool2d"), nnref.avg_pool2d, X,
               attrs=dict(AVG_POOL_ATTRS), split=nc_split, gradient=_avg_pool2d_gradient,
               flops=_window_flops(lambda node: node.outputs[0]),
               doc="sum over each window's taps inside the input, divided by the number "
                   "of its taps inside the padded input [-top, H + bottom) with "
                   "count_include_pad (default; Caffe's divisor, ONNX's count_include_pad=1, "
                   "PyTorch's True), else inside the input (ONNX's 0); a ceil-mode window's "
                   "taps beyond the padded input never count; ceil_mode as max_pool2d"))


def _max_pool_grad_infer(types, attrs):
    x, y, gy = types
    expect = _pool_shape("max_pool2d_grad", x, attrs)
    if y.shape != expect or gy != y:
        raise fail("max_pool2d_grad", f"output {y} and gradient {gy} must be "
                                       f"{x.dtype}[{','.join(map(str, expect))}]")
    return [x]


register(OpDef("max_pool2d_grad", ("x", "y", "gy"), _max_pool_grad_infer,
               nnref.max_pool2d_grad, X, attrs=dict(POOL_ATTRS), split=nc_split,
               flops=_window_flops(lambda node: node.inputs[2]),
               doc="routes gy to the first maximum of each window"))


def _avg_pool_grad_infer(types, attrs):
    gy = types[0]
    x = TensorType(shape_attr("avg_pool2d_grad", attrs, "input_shape"), gy.dtype)
    if _pool_shape("avg_pool2d_grad", x, attrs) != gy.shape:
        raise fail("avg_pool2d_grad", f"gradient {gy} does not match pooling input {x}")
    return [x]


register(OpDef("avg_pool2d_grad", ("gy",), _avg_pool_grad_infer, nnref.avg_pool2d_grad, X,
               attrs={**AVG_POOL_ATTRS, "input_shape": Attr("ints")}, split=nc_split,
               flops=_window_flops(lambda node: node.inputs[0]), shape_attr="input_shape"))


def _global_avg_pool_infer(types, attrs):
    x = types[0]
    check_float("global_avg_pool", x)
    check_rank("global_avg_pool", x, 4)
    return [x.with_shape((x.shape[0], x.shape[1], 1, 1))]


def _global_avg_pool_gradient(g, node, gys, needs=None):
    """gx = gy / (H*W) broadcast over H and W."""
    attrs = {"input_shape": list(node.inputs[0].type.shape)}
    return only(needs, lambda: emit1(g, node, "global_avg_pool_grad", [gys[0]], attrs))


register(OpDef("global_avg_pool", ("x",), _global_avg_pool_infer,
               lambda x: (x.mean(axis=(2, 3), keepdims=True).astype(x.dtype),), R,
               split=nc_split, gradient=_global_avg_pool_gradient, flops=per_input_element(1),
               doc="mean over H and W, output N x C x 1 x 1"))


def _global_avg_pool_grad_infer(types, attrs):
    gy = types[0]
    shape = shape_attr("global_avg_pool_grad", attrs, "input_shape")
    if len(shape) != 4 or gy.shape != (shape[0], shape[1], 1, 1):
        raise fail("global_avg_pool_grad", f"gradient {gy} does not match input {shape}")
    return [gy.with_shape(shape)]


def _global_avg_pool_grad_expr(node, args):
    _, _, h, w = node.attrs["input_shape"]
    return [args[0] / constant(node, h * w)]


register(OpDef("global_avg_pool_grad", ("gy",), _global_avg_pool_grad_infer,
               lambda gy, input_shape: (np.broadcast_to(
                   gy / gy.dtype.type(input_shape[2] * input_shape[3]), input_shape).copy(),), B,
               attrs={"input_shape": Attr("ints")}, split=nc_split, flops=per_output_element(1),
               expr=_global_avg_pool_grad_expr, shape_attr="input_shape"))