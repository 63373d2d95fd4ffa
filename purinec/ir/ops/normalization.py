"""Normalization: Caffe's local response normalization, softmax and log-softmax, with
gradients."""

from __future__ import annotations

import numpy as np

from purinec.ir import nnref
from purinec.ir.ops.helpers import (batch_split, check_float, check_rank, emit1, fail,
                                    float_infer, only, per_output_element)
from purinec.ir.ops.registry import FINITE, Attr, FusionKind, OpDef, SplitSignature, register

X = FusionKind.opaque

LRN_ATTRS = {"size": Attr("int", 5), "alpha": Attr("float", 1e-4, bound=FINITE),
             "beta": Attr("float", 0.75, bound=FINITE), "k": Attr("float", 1.0, bound=FINITE)}


def _lrn_infer(types, attrs):
    x = types[0]
    check_float("lrn", x)
    check_rank("lrn", x, 4)
    if attrs["size"] < 1 or attrs["size"] % 2 == 0:
        raise fail("lrn", f"size must be odd and positive, got {attrs['size']}")
    return [x]


def _lrn_gradient(g, node, gys, needs=None):
    """gx = lrn_grad(x, gy) with the forward attributes."""
    return only(needs, lambda: emit1(g, node, "lrn_grad", [node.inputs[0], gys[0]],
                                     dict(node.attrs)))


def _lrn_flops(node) -> int:
    # A window of `size` squares summed (2*size), then scale, add k, pow, multiply (4).
    return (2 * node.attrs["size"] + 4) * node.outputs[0].type.size


register(OpDef("lrn", ("x",), _lrn_infer, nnref.lrn, X, attrs=dict(LRN_ATTRS),
               split=batch_split, gradient=_lrn_gradient, flops=_lrn_flops,
               doc="Caffe's across-channel LRN: x * (k + alpha/size * sum x^2)^-beta"))
register(OpDef("lrn_grad", ("x", "gy"), float_infer("lrn_grad"), nnref.lrn_grad, X,
               attrs=dict(LRN_ATTRS), split=batch_split,
               flops=lambda node: 2 * _lrn_flops(node)))  # the scale again, then its adjoint


def softmax_ref(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True),)


def log_softmax_ref(x, axis):
    shifted = x - x.max(axis=axis, keepdims=True)
    return (shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True)),)


def _along_axis_infer(op: str):
    """Float data and an axis in range: both ops of the softmax family."""
    def infer(types, attrs):
        x = types[0]
        check_float(op, x)
        if not 0 <= attrs["axis"] < x.rank:
            raise fail(op, f"axis {attrs['axis']} out of range for {x}")
        return [x]
    return infer


def _softmax_split(types, attrs):
    n = len(types)
    return [SplitSignature((f"S{a}",) * n, (f"S{a}",)) for a in range(types[0].rank)
            if a != attrs["axis"]] + [SplitSignature(("B",) * n, ("B",))]


def _gradient_from_output(op: str):
    """softmax's and log_softmax's rule: ``gx = op(y, gy)`` with the forward axis, from
    the output alone (softmax_grad: y * (gy - sum(gy * y, axis)); log_softmax_grad:
    gy - exp(y) * sum(gy, axis))."""
    def gradient(g, node, gys, needs=None):
        return only(needs, lambda: emit1(g, node, op, [node.outputs[0], gys[0]],
                                         {"axis": node.attrs["axis"]}))
    return gradient


register(OpDef("softmax", ("x",), _along_axis_infer("softmax"), softmax_ref, X,
               attrs={"axis": Attr("int", 1)}, split=_softmax_split,
               gradient=_gradient_from_output("softmax_grad"),
               flops=per_output_element(5),  # max, subtract, exp, sum, divide
               doc="exp(x - max) / sum exp(x - max) along the axis"))
register(OpDef("softmax_grad", ("y", "gy"), float_infer("softmax_grad"),
               lambda y, gy, axis: (y * (gy - (gy * y).sum(axis=axis, keepdims=True)),), X,
               attrs={"axis": Attr("int", 1)}, split=_softmax_split,
               flops=per_output_element(4)))  # gy * y, sum, subtract, multiply
register(OpDef("log_softmax", ("x",), _along_axis_infer("log_softmax"), log_softmax_ref, X,
               attrs={"axis": Attr("int", 1)}, split=_softmax_split,
               gradient=_gradient_from_output("log_softmax_grad"),
               flops=per_output_element(5),  # max, subtract, exp, sum, subtract its log
               doc="x - max - log(sum exp(x - max)) along the axis"))
register(OpDef("log_softmax_grad", ("y", "gy"), float_infer("log_softmax_grad"),
               lambda y, gy, axis: (gy - np.exp(y) * gy.sum(axis=axis, keepdims=True),), X,
               attrs={"axis": Attr("int", 1)}, split=_softmax_split,
               flops=per_output_element(4)))  # sum, exp, multiply, subtract
