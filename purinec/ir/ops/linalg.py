"""Matrix products and convolutions, with the convolution's two gradients. Both
forward ops are epilogue anchors: elementwise consumers of their output fuse into the
kernel that computes it."""

from __future__ import annotations

import numpy as np

from purinec.ir import nnref
from purinec.ir.nnref import conv_output_size
from purinec.ir.ops.helpers import (check_float, check_rank, emit1, fail, only, pad_attr,
                                    pair, shape_attr)
from purinec.ir.ops.registry import Attr, FusionKind, OpDef, SplitSignature, Trait, register
from purinec.ir.types import TensorType

O, X = FusionKind.out_elementwise_fusable, FusionKind.opaque
ANCHOR = frozenset({Trait.epilogue_anchor})

def _matmul_infer(types, attrs):
    a, b = types
    for t, what in ((a, "a"), (b, "b")):
        check_float("matmul", t, what)
        check_rank("matmul", t, 2, what)
    m, k = a.shape[::-1] if attrs["trans_a"] else a.shape
    k2, n = b.shape[::-1] if attrs["trans_b"] else b.shape
    if k != k2 or a.dtype != b.dtype:
        raise fail("matmul", f"cannot multiply {a}{'^T' if attrs['trans_a'] else ''} by "
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


# For C = op(A) op(B): (inputs, trans_a, trans_b) of the matmuls giving gA and gB, by
# (trans_a, trans_b); "a", "b" are the forward inputs and "g" is gC.
_MATMUL_GRADS = {
    (False, False): ((("g", "b"), False, True), (("a", "g"), True, False)),
    (False, True): ((("g", "b"), False, False), (("g", "a"), True, False)),
    (True, False): ((("b", "g"), False, True), (("a", "g"), False, False)),
    (True, True): ((("b", "g"), True, True), (("g", "a"), True, True)),
}


def _matmul_gradient(g, node, gys, needs=None):
    """C = op(A) op(B): gA and gB are matmuls of gC with B and A (table above)."""
    env = {"a": node.inputs[0], "b": node.inputs[1], "g": gys[0]}
    specs = _MATMUL_GRADS[(node.attrs["trans_a"], node.attrs["trans_b"])]

    def builder(spec):
        names, ta, tb = spec
        return lambda: emit1(g, node, "matmul", [env[n] for n in names],
                             {"trans_a": ta, "trans_b": tb})
    return only(needs, *(builder(s) for s in specs))


def _matmul_flops(node) -> int:
    a, _ = node.inputs
    m, n = node.outputs[0].type.shape
    k = a.type.shape[0] if node.attrs["trans_a"] else a.type.shape[1]
    return 2 * m * n * k


register(OpDef("matmul", ("a", "b"), _matmul_infer, _matmul_ref, O,
               attrs={"trans_a": Attr("bool", False), "trans_b": Attr("bool", False)},
               split=_matmul_split, gradient=_matmul_gradient, flops=_matmul_flops,
               traits=ANCHOR, model_split={1: lambda attrs: 0 if attrs["trans_b"] else 1},
               doc="op(a) @ op(b); inner product is matmul(x, w^T)"))


def _conv_check(x: TensorType, w_shape, attrs, op: str):
    check_rank(op, x, 4)
    groups = attrs["groups"]
    cout, cin_g, kh, kw = w_shape
    if groups < 1 or x.shape[1] != cin_g * groups or cout % groups:
        raise fail(op, f"input {x} with {groups} group(s) does not fit weight "
                        f"[{','.join(map(str, w_shape))}] (out, in/groups, kh, kw)")
    sh, sw = pair(op, attrs, "stride")
    dh, dw = pair(op, attrs, "dilation")
    top, left, bottom, right = pad_attr(op, attrs)
    if min(sh, sw, dh, dw) < 1:
        raise fail(op, f"stride and dilation must be >= 1, got {attrs['stride']}, "
                        f"{attrs['dilation']}")
    oh = conv_output_size(x.shape[2], kh, sh, top, bottom, dh)
    ow = conv_output_size(x.shape[3], kw, sw, left, right, dw)
    if oh < 1 or ow < 1:
        raise fail(op, f"kernel {kh}x{kw} does not fit input {x} with pad {attrs['pad']} "
                        f"and dilation {attrs['dilation']}")
    return (x.shape[0], cout, oh, ow)


# pad: [ph, pw], or [top, left, bottom, right] as ONNX orders them; dilation: the
# spacing of the kernel's taps (ONNX's dilations).
CONV_ATTRS = {"stride": Attr("ints", [1, 1]), "pad": Attr("ints", [0, 0]),
              "groups": Attr("int", 1), "dilation": Attr("ints", [1, 1])}


def _conv_operands(op: str, types, weight_rank: int):
    """A convolution's input and weight types, checked: float, of one dtype."""
    x, w = types
    check_float(op, x)
    check_rank(op, w, weight_rank, "weight")
    if w.dtype != x.dtype:
        raise fail(op, f"weight {w} and input {x} differ in dtype")
    return x, w


def _conv2d_infer(types, attrs):
    x, w = _conv_operands("conv2d", types, 4)
    return [x.with_shape(_conv_check(x, w.shape, attrs, "conv2d"))]


def _conv2d_split(types, attrs):
    sigs = [SplitSignature(("S0", "B"), ("S0",)), SplitSignature(("B", "B"), ("B",))]
    if attrs["groups"] == 1:
        sigs += [SplitSignature(("B", "S0"), ("S1",)), SplitSignature(("S1", "S1"), ("P",))]
    return sigs


def _conv2d_gradient(g, node, gys, needs=None):
    """gx = conv2d_grad_input(gy, w), gw = conv2d_grad_weight(x, gy)."""
    x, w = node.inputs
    conv = {k: node.attrs[k] for k in CONV_ATTRS}
    return only(
        needs,
        lambda: emit1(g, node, "conv2d_grad_input", [gys[0], w],
                      {**conv, "input_shape": list(x.type.shape)}),
        lambda: emit1(g, node, "conv2d_grad_weight", [x, gys[0]],
                      {**conv, "kernel": list(w.type.shape[2:])}))


def _conv_flops(output, weight_shape) -> int:
    """2 FLOPs per multiply-add: every output element sums Cin/groups * kh * kw products
    (dilation spaces the taps out, it adds none).
    Both gradients cost what the forward convolution does: the transposed convolution
    scatters the same products, and every weight sums N * OH * OW of them."""
    n, cout, oh, ow = output.type.shape
    _, cin_g, kh, kw = weight_shape
    return 2 * n * cout * oh * ow * cin_g * kh * kw


register(OpDef("conv2d", ("x", "w"), _conv2d_infer, nnref.conv2d, O, attrs=dict(CONV_ATTRS),
               split=_conv2d_split, gradient=_conv2d_gradient,
               flops=lambda node: _conv_flops(node.outputs[0], node.inputs[1].type.shape),
               traits=ANCHOR, model_split={1: lambda attrs: 0},
               doc="cross-correlation, NCHW input, OIHW weight; pad [ph, pw] or [top, left, "
                   "bottom, right], dilation spaces the taps; output floor((H + top + bottom "
                   "- dh*(kh-1) - 1)/sh) + 1"))


# ``conv2d_panels``: conv2d with its weight in panels of filters, (O/V, C, kh, kw, V):
# panel j, a matrix of C*kh*kw rows by V filters, holds filters j*V to (j + 1)*V, what
# a product of pixels (rows) by filters (columns) reads, one contiguous panel at a time.
# The cpu target computes small maps that way in inference graphs
# (`purinec.codegen.cpu_layout`), from weights rearranged once: it has no gradient.


def panels_oihw(shape) -> tuple[int, int, int, int]:
    """The OIHW shape of a conv2d_panels weight of ``shape``."""
    panels, c, kh, kw, width = shape
    return panels * width, c, kh, kw


def _conv2d_panels_infer(types, attrs):
    x, w = _conv_operands("conv2d_panels", types, 5)
    if attrs["groups"] != 1:
        raise fail("conv2d_panels", f"groups must be 1, got {attrs['groups']}")
    return [x.with_shape(_conv_check(x, panels_oihw(w.shape), attrs, "conv2d_panels"))]


def _conv2d_panels_reference(x, w, **attrs):
    oihw = np.transpose(w, (0, 4, 1, 2, 3)).reshape(panels_oihw(w.shape))
    return nnref.conv2d(x, oihw, **attrs)


register(OpDef("conv2d_panels", ("x", "w"), _conv2d_panels_infer, _conv2d_panels_reference,
               O, attrs=dict(CONV_ATTRS),
               split=lambda types, attrs: [SplitSignature(("S0", "B"), ("S0",)),
                                           SplitSignature(("B", "B"), ("B",))],
               flops=lambda node: _conv_flops(node.outputs[0],
                                              panels_oihw(node.inputs[1].type.shape)),
               traits=ANCHOR,
               doc="conv2d (one group) with its weight in panels of filters, (O/V, C, "
                   "kh, kw, V): what the cpu target computes pixel by filter"))


def _conv2d_grad_input_infer(types, attrs):
    gy, w = types
    x = TensorType(shape_attr("conv2d_grad_input", attrs, "input_shape"), gy.dtype)
    if _conv_check(x, w.shape, attrs, "conv2d_grad_input") != gy.shape:
        raise fail("conv2d_grad_input", f"gradient {gy} does not match the output of "
                                         f"input {x} and weight {w}")
    return [x]


register(OpDef("conv2d_grad_input", ("gy", "w"), _conv2d_grad_input_infer,
               nnref.conv2d_grad_input, X,
               attrs={**CONV_ATTRS, "input_shape": Attr("ints")},
               split=lambda t, a: [SplitSignature(("S0", "B"), ("S0",)),
                                   SplitSignature(("B", "B"), ("B",))] + (
                   [SplitSignature(("S1", "S0"), ("P",))] if a["groups"] == 1 else []),
               flops=lambda node: _conv_flops(node.inputs[0], node.inputs[1].type.shape),
               shape_attr="input_shape"))


def _conv2d_grad_weight_infer(types, attrs):
    x, gy = types
    kh, kw = pair("conv2d_grad_weight", attrs, "kernel")
    groups = attrs["groups"]
    w_shape = (gy.shape[1], x.shape[1] // max(groups, 1), kh, kw) if gy.rank == 4 else ()
    check_rank("conv2d_grad_weight", gy, 4, "gradient")
    if _conv_check(x, w_shape, attrs, "conv2d_grad_weight") != gy.shape:
        raise fail("conv2d_grad_weight", f"gradient {gy} does not match the output of "
                                          f"input {x} with a {kh}x{kw} kernel")
    return [x.with_shape(w_shape)]


register(OpDef("conv2d_grad_weight", ("x", "gy"), _conv2d_grad_weight_infer,
               nnref.conv2d_grad_weight, X,
               attrs={**CONV_ATTRS, "kernel": Attr("ints")},
               split=lambda t, a: [SplitSignature(("S0", "S0"), ("P",)),
                                   SplitSignature(("B", "B"), ("B",))] + (
                   [SplitSignature(("B", "S1"), ("S0",))] if a["groups"] == 1 else []),
               flops=lambda node: _conv_flops(node.inputs[1], node.outputs[0].type.shape)))
