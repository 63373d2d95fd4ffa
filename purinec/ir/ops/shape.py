"""Ops that move data without arithmetic: reshape, concat, split, transpose, strided
slices and pads (and the gradients of the last two)."""

from __future__ import annotations

import math

import numpy as np

from purinec.ir.ops.helpers import (check_float, emit, emit1, fail, free, only,
                                    per_input_element, shape_attr, zeros_like)
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


# ---------------------------------------------------------------------------------------
# Transposes, strided slices and pads (what ONNX models use). Each output element copies
# one input element (or a constant); only pad's gradient adds several up.


def _replicated_or_partial(n: int) -> list[SplitSignature]:
    """B -> B and P -> P over ``n`` inputs: for ops linear in their inputs."""
    return [SplitSignature(("B",) * n, ("B",)), SplitSignature(("P",) * n, ("P",))]


def _transpose_infer(types, attrs):
    x, perm = types[0], attrs["perm"]
    if sorted(perm) != list(range(x.rank)):
        raise fail("transpose", f"perm {perm} is not an order of the {x.rank} axes of {x}")
    return [x.with_shape([x.shape[p] for p in perm])]


def _transpose_split(types, attrs):
    """Output axis k is input axis perm[k]: a piece along one is a piece along the other."""
    return ([SplitSignature((f"S{p}",), (f"S{k}",)) for k, p in enumerate(attrs["perm"])]
            + _replicated_or_partial(1))


def _transpose_gradient(g, node, gys, needs=None):
    """gx = gy transposed back, by the inverse permutation."""
    inverse = list(np.argsort(node.attrs["perm"]))
    return only(needs, lambda: emit1(g, node, "transpose", [gys[0]],
                                     {"perm": [int(p) for p in inverse]}))


register(OpDef("transpose", ("x",), _transpose_infer,
               lambda x, perm: (np.transpose(x, perm).copy(),), I,
               attrs={"perm": Attr("ints")}, split=_transpose_split,
               gradient=_transpose_gradient, flops=free,
               doc="np.transpose(x, perm): output axis k is input axis perm[k]"))


def check_window(op: str, shape, starts, steps, sizes) -> None:
    """Every index ``starts[a] + i * steps[a]`` (``i < sizes[a]``) lies inside axis ``a``
    of ``shape``: a strided window reads (or its gradient writes) nothing outside."""
    for key, values in (("starts", starts), ("steps", steps), ("sizes", sizes)):
        if len(values) != len(shape):
            raise fail(op, f"{key} needs one entry per axis of {list(shape)}, got {values}")
    for a, (n, start, step, size) in enumerate(zip(shape, starts, steps, sizes)):
        if step == 0 or size < 0:
            raise fail(op, f"axis {a}: the step must not be 0 nor the size negative, got "
                           f"step {step}, size {size}")
        last = start + (size - 1) * step
        if size and not (0 <= start < n and 0 <= last < n):
            raise fail(op, f"axis {a}: indices {start}, {start + step}, ..., {last} "
                           f"(size {size}, step {step}) leave the axis's [0, {n})")


def _window(starts, steps, sizes):
    """The NumPy index of a strided window."""
    return np.ix_(*[start + step * np.arange(size)
                    for start, step, size in zip(starts, steps, sizes)])


def _whole_axes(shape, starts, steps, sizes) -> list[int]:
    """The axes a strided window takes whole and in order: pieces along them stay."""
    return [a for a, n in enumerate(shape)
            if (starts[a], steps[a], sizes[a]) == (0, 1, n)]


def _strided_slice_infer(types, attrs):
    x = types[0]
    check_window("strided_slice", x.shape, attrs["starts"], attrs["steps"], attrs["sizes"])
    return [x.with_shape(attrs["sizes"])]


def _strided_slice_split(types, attrs):
    whole = _whole_axes(types[0].shape, attrs["starts"], attrs["steps"], attrs["sizes"])
    return ([SplitSignature((f"S{a}",), (f"S{a}",)) for a in whole]
            + _replicated_or_partial(1))


def _strided_slice_gradient(g, node, gys, needs=None):
    """gx = gy scattered back into zeros of x's shape."""
    attrs = {"input_shape": list(node.inputs[0].type.shape),
             "starts": node.attrs["starts"], "steps": node.attrs["steps"]}
    return only(needs, lambda: emit1(g, node, "strided_slice_grad", [gys[0]], attrs))


register(OpDef("strided_slice", ("x",), _strided_slice_infer,
               lambda x, starts, steps, sizes: (np.array(x[_window(starts, steps, sizes)]),),
               I, attrs={"starts": Attr("ints"), "steps": Attr("ints"), "sizes": Attr("ints")},
               split=_strided_slice_split, gradient=_strided_slice_gradient, flops=free,
               shape_attr="sizes",
               doc="out[i, j, ...] = x[starts[0] + i * steps[0], starts[1] + j * steps[1], "
                   "...], of shape sizes; steps may be negative"))


def _strided_slice_grad_infer(types, attrs):
    gy = types[0]
    shape = shape_attr("strided_slice_grad", attrs, "input_shape")
    check_window("strided_slice_grad", shape, attrs["starts"], attrs["steps"], gy.shape)
    return [gy.with_shape(shape)]


def _strided_slice_grad_ref(gy, input_shape, starts, steps):
    gx = np.zeros(input_shape, gy.dtype)
    gx[_window(starts, steps, gy.shape)] = gy
    return (gx,)


def _strided_slice_grad_split(types, attrs):
    whole = _whole_axes(attrs["input_shape"], attrs["starts"], attrs["steps"], types[0].shape)
    return ([SplitSignature((f"S{a}",), (f"S{a}",)) for a in whole]
            + _replicated_or_partial(1))


register(OpDef("strided_slice_grad", ("gy",), _strided_slice_grad_infer,
               _strided_slice_grad_ref, I,
               attrs={"input_shape": Attr("ints"), "starts": Attr("ints"),
                      "steps": Attr("ints")},
               split=_strided_slice_grad_split, flops=free, shape_attr="input_shape",
               doc="zeros of input_shape, with gy where strided_slice took x"))


PAD_MODES = ("constant", "reflect", "edge")


def pad_sources(n: int, before: int, after: int, mode: str) -> list[int]:
    """For each index of an axis of ``n`` padded by ``before`` and ``after``, the input
    index np.pad copies there, or -1 where it writes the constant."""
    sources = []
    for j in range(-before, n + after):
        if 0 <= j < n:
            sources.append(j)
        elif mode == "constant":
            sources.append(-1)
        elif mode == "edge":
            sources.append(min(max(j, 0), n - 1))
        else:  # reflect, about the first and last index (pads shorter than the axis)
            sources.append(-j if j < 0 else 2 * (n - 1) - j)
    return sources


def check_pads(op: str, shape, pads, mode: str) -> list[int]:
    """The padded shape, after checking ``pads`` (every begin, then every end) and
    ``mode`` against ``shape``."""
    rank = len(shape)
    if mode not in PAD_MODES:
        raise fail(op, f"mode must be one of {', '.join(PAD_MODES)}, got {mode!r}")
    if len(pads) != 2 * rank or any(p < 0 for p in pads):
        raise fail(op, f"pads needs {2 * rank} entries >= 0 (every axis's begin, then "
                       f"every end) for shape {list(shape)}, got {pads}")
    for a, n in enumerate(shape):
        before, after = pads[a], pads[rank + a]
        if mode == "reflect" and (before or after) and max(before, after) >= n:
            raise fail(op, f"axis {a}: a reflection needs pads shorter than the axis "
                           f"({n}), got {before} and {after}")
        if mode == "edge" and (before or after) and n == 0:
            raise fail(op, f"axis {a}: an empty axis has no edge to repeat")
    return [n + pads[a] + pads[rank + a] for a, n in enumerate(shape)]


def _pad_infer(types, attrs):
    x = types[0]
    shape = check_pads("pad", x.shape, attrs["pads"], attrs["mode"])
    if attrs["mode"] == "constant" and not x.dtype.is_float and not math.isfinite(attrs["value"]):
        raise fail("pad", f"{x} cannot hold the constant {attrs['value']}")
    return [x.with_shape(shape)]


def _pad_ref(x, pads, mode, value):
    if x.ndim == 0:  # (np.pad refuses to pad no axes)
        return (x.copy(),)
    widths = np.reshape(pads, (2, -1)).T
    if mode == "constant":
        return (np.pad(x, widths, mode, constant_values=value),)
    return (np.pad(x, widths, mode),)


def _unpadded_axes(pads) -> list[int]:
    rank = len(pads) // 2
    return [a for a in range(rank) if pads[a] == pads[rank + a] == 0]


def _pad_split(types, attrs):
    """Axes not padded keep their pieces; a partial sum stays one unless the constant
    (which every piece would add) is not 0."""
    sigs = [SplitSignature((f"S{a}",), (f"S{a}",)) for a in _unpadded_axes(attrs["pads"])]
    sigs.append(SplitSignature(("B",), ("B",)))
    if attrs["mode"] != "constant" or attrs["value"] == 0:
        sigs.append(SplitSignature(("P",), ("P",)))
    return sigs


def _pad_gradient(g, node, gys, needs=None):
    """constant: gx = the window of gy over x; reflect, edge: pad_grad, which adds the
    gradients of x's copies to their originals."""
    x, pads, mode = node.inputs[0], node.attrs["pads"], node.attrs["mode"]
    shape = list(x.type.shape)
    if mode == "constant":
        attrs = {"starts": pads[:len(shape)], "steps": [1] * len(shape), "sizes": shape}
        return only(needs, lambda: emit1(g, node, "strided_slice", [gys[0]], attrs))
    attrs = {"pads": pads, "mode": mode, "input_shape": shape}
    return only(needs, lambda: emit1(g, node, "pad_grad", [gys[0]], attrs))


register(OpDef("pad", ("x",), _pad_infer, _pad_ref, I,
               attrs={"pads": Attr("ints"), "mode": Attr("str", "constant"),
                      "value": Attr("float", 0.0)},
               split=_pad_split, gradient=_pad_gradient, flops=free,
               doc="np.pad(x, mode): pads are every axis's begin, then every end (ONNX's "
                   "order); reflect needs pads shorter than the axis"))


def _pad_grad_infer(types, attrs):
    gy = types[0]
    check_float("pad_grad", gy, "gradient")
    shape = shape_attr("pad_grad", attrs, "input_shape")
    padded = check_pads("pad_grad", shape, attrs["pads"], attrs["mode"])
    if list(gy.shape) != padded:
        raise fail("pad_grad", f"gradient must have the padded shape {padded}, got {gy}")
    return [gy.with_shape(shape)]


def _pad_grad_ref(gy, pads, mode, input_shape):
    """Axis by axis, each index's gradient added to the input index it copies."""
    gx, rank = gy, len(input_shape)
    for a, n in enumerate(input_shape):
        sources = np.array(pad_sources(n, pads[a], pads[rank + a], mode))
        copies = np.moveaxis(gx, a, 0)
        total = np.zeros((n, *copies.shape[1:]), gy.dtype)
        np.add.at(total, sources[sources >= 0], copies[sources >= 0])
        gx = np.moveaxis(total, 0, a)
    return (gx.copy(),)


def _pad_grad_split(types, attrs):
    return ([SplitSignature((f"S{a}",), (f"S{a}",)) for a in _unpadded_axes(attrs["pads"])]
            + _replicated_or_partial(1))


register(OpDef("pad_grad", ("gy",), _pad_grad_infer, _pad_grad_ref, I,
               attrs={"pads": Attr("ints"), "mode": Attr("str"), "input_shape": Attr("ints")},
               split=_pad_grad_split, flops=per_input_element(1), shape_attr="input_shape",
               doc="pad's gradient: each element of x gets the sum of gy over its copies"))
