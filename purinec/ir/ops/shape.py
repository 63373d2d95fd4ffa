"""Ops that move data without arithmetic: reshape, concat and split."""

from __future__ import annotations

import math

import numpy as np

from purinec.ir.ops.helpers import emit, emit1, fail, free, only, zeros_like
from purinec.ir.ops.registry import Attr, FusionKind, OpDef, SplitSignature, Trait, register

I = FusionKind.injective


def _reshape_infer(types, attrs):
    x = types[0]
    shape = attrs["shape"]
    if any(d < 0 for d in shape) or math.prod(shape) != x.size:
        raise fail("reshape", f"cannot reshape {x} ({x.size} elements) to {shape}")
    return [x.with_shape(shape)]


def _reshape_gradient(g, node, gys, needs=None):
    """gx = reshape(gy, shape of x)."""
    x = node.inputs[0]
    return only(needs, lambda: emit1(g, node, "reshape", [gys[0]],
                                     {"shape": list(x.type.shape)}))


register(OpDef("reshape", ("x",), _reshape_infer,
               lambda x, shape: (x.reshape(shape),), I, attrs={"shape": Attr("ints")},
               split=lambda types, attrs: [SplitSignature(("S0",), ("S0",)),
                                           SplitSignature(("B",), ("B",))],
               gradient=_reshape_gradient, flops=free, traits=frozenset({Trait.view}),
               shape_attr="shape"))


def _concat_infer(types, attrs):
    axis = attrs["axis"]
    first = types[0]
    if not 0 <= axis < first.rank:
        raise fail("concat", f"axis {axis} out of range for {first}")
    for t in types[1:]:
        if t.dtype != first.dtype:
            raise fail("concat", f"operands are of different dtypes: "
                                 f"{', '.join(str(x) for x in types)}")
        if (t.rank != first.rank or
                any(a != b for i, (a, b) in enumerate(zip(t.shape, first.shape)) if i != axis)):
            raise fail("concat", f"operands differ outside axis {axis}: "
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


def _concat_gradient(g, node, gys, needs=None):
    """gxs = split(gy) into the inputs' sizes along ``axis`` (one node)."""
    axis = node.attrs["axis"]
    sections = [v.type.shape[axis] for v in node.inputs]
    if len(sections) == 1:
        return only(needs, lambda: gys[0])
    parts = emit(g, node, "split", [gys[0]], {"axis": axis, "sections": sections},
                 n_outputs=len(sections))
    return [p if need else None for p, need in zip(parts, needs)]


register(OpDef("concat", ("xs",), _concat_infer,
               lambda *xs, axis: (np.concatenate(xs, axis=axis),), I,
               attrs={"axis": Attr("int", 1)}, variadic=True, split=_concat_split,
               gradient=_concat_gradient, flops=free))


def _split_infer(types, attrs):
    x = types[0]
    axis, sections = attrs["axis"], attrs["sections"]
    if not 0 <= axis < x.rank:
        raise fail("split", f"axis {axis} out of range for {x}")
    if not sections or any(s <= 0 for s in sections) or sum(sections) != x.shape[axis]:
        raise fail("split", f"sections {sections} must be positive and add up to "
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


def _split_gradient(g, node, gys, needs=None):
    """gx = concat of the outputs' gradients, zeros where an output has none."""
    def build():
        parts = [gy if gy is not None else zeros_like(g, node, y)
                 for y, gy in zip(node.outputs, gys)]
        if len(parts) == 1:
            return parts[0]
        return emit1(g, node, "concat", parts, {"axis": node.attrs["axis"]})
    return only(needs, build)


register(OpDef("split", ("x",), _split_infer, _split_ref, I,
               attrs={"axis": Attr("int", 1), "sections": Attr("ints")},
               split=_split_split, gradient=_split_gradient, flops=free,
               doc="slices of x along axis; the inverse of concat"))
