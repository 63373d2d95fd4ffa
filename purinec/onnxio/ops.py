"""One converter per ONNX op: ONNX's semantics (attributes, inputs that act as
attributes, their defaults across opsets) written as IR ops of the registry.

A converter takes the `Lowering`, the ONNX node and its attributes, and returns one
IR value per node output (None for an output it does not make). What it cannot do it
refuses with `Lowering.fail`, naming the node, the attribute value and what is
supported. Broadcasting is spelled out (`reshape` to the same rank, then
`broadcast_to`), which the fuse pass folds into the consumer's loop.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import numpy as np

from purinec.ir.graph import Value
from purinec.ir.ops import by_name
from purinec.onnxio.proto import array_dtype, ir_dtype

if TYPE_CHECKING:
    from purinec.onnxio.lowering import Lowering

Converter = Callable[["Lowering", object, dict], list]
CONVERTERS, converts = by_name("converters")  # ONNX op type -> Converter


# -- shared pieces ------------------------------------------------------------------------


def axis(lo: Lowering, value: int, rank: int, what: str = "axis") -> int:
    """``value`` (negative counts from the end) as an axis of a rank-``rank`` tensor."""
    if not -rank <= value < rank:
        raise lo.fail(f"{what} {value} is out of range for a tensor of rank {rank}")
    return value % rank


def reshape(lo: Lowering, x: Value, shape, name: str | None = None) -> Value:
    shape = [int(d) for d in shape]
    if list(x.type.shape) == shape:
        return x
    return lo.emit("reshape", [x], {"shape": shape}, name)


def broadcast(lo: Lowering, x: Value, shape: tuple[int, ...]) -> Value:
    """``x`` broadcast to ``shape`` NumPy's way (right-aligned)."""
    if x.type.shape == tuple(shape):
        return x
    aligned = reshape(lo, x, (1,) * (len(shape) - x.type.rank) + x.type.shape)
    return lo.emit("broadcast_to", [aligned], {"shape": list(shape)})


def broadcast_pair(lo: Lowering, a: Value, b: Value) -> tuple[Value, Value]:
    try:
        shape = np.broadcast_shapes(a.type.shape, b.type.shape)
    except ValueError:
        raise lo.fail(f"operands {a.type} and {b.type} do not broadcast") from None
    return broadcast(lo, a, shape), broadcast(lo, b, shape)


def inputs(lo: Lowering, count: int | None = None) -> list[Value]:
    names = [name for name in lo.node.input if name][:count]
    return [lo.value(name) for name in names]


def ints(array, lo: Lowering, what: str) -> list[int]:
    if array is None:
        return []
    array = np.asarray(array)
    if array.dtype.kind not in "iu":
        raise lo.fail(f"{what} must be integers, got {array.dtype}")
    return [int(v) for v in array.reshape(-1)]


def attr_or_input(lo: Lowering, a: dict, name: str, k: int, since: int):
    """An attribute that became input ``k`` in opset ``since``."""
    if lo.model.opset >= since:
        return lo.constant(k, name)
    return a.get(name)


# -- elementwise --------------------------------------------------------------------------

UNARY = {"Relu": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh", "Sqrt": "sqrt", "Exp": "exp",
         "Log": "log", "Neg": "neg", "Abs": "abs", "Erf": "erf", "HardSwish": "hard_swish"}


@converts(*UNARY)
def unary(lo, node, a):
    (x,) = inputs(lo)
    return [lo.emit(UNARY[node.op_type], [x], {}, lo.out(0))]


@converts("LeakyRelu")
def leaky_relu(lo, node, a):
    (x,) = inputs(lo)
    return [lo.emit("leaky_relu", [x], {"alpha": a.get("alpha", 0.01)}, lo.out(0))]


@converts("HardSigmoid")
def hard_sigmoid(lo, node, a):
    (x,) = inputs(lo)
    return [lo.emit("hard_sigmoid", [x], {"alpha": a.get("alpha", 0.2),
                                          "beta": a.get("beta", 0.5)}, lo.out(0))]


@converts("Clip")
def clip(lo, node, a):
    x = lo.value(lo.input(0))
    if lo.model.opset >= 11:
        low, high = lo.constant(1, "min"), lo.constant(2, "max")
    else:
        low, high = a.get("min"), a.get("max")
    bounds = [-math.inf if low is None else float(np.asarray(low).reshape(-1)[0]),
              math.inf if high is None else float(np.asarray(high).reshape(-1)[0])]
    return [lo.emit("clip", [x], {"min": bounds[0], "max": bounds[1]}, lo.out(0))]


BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Pow": "pow"}


@converts(*BINARY)
def binary(lo, node, a):
    x, y = inputs(lo)
    if node.op_type == "Pow" and y.type.dtype != x.type.dtype:
        y = lo.emit("cast", [y], {"dtype": str(x.type.dtype)})
    if x.type.dtype != y.type.dtype:
        raise lo.fail(f"operands are of different types: {x.type} and {y.type}")
    x, y = broadcast_pair(lo, x, y)
    return [lo.emit(BINARY[node.op_type], [x, y], {}, lo.out(0))]


@converts("Cast")
def cast(lo, node, a):
    (x,) = inputs(lo)
    dtype = ir_dtype(a["to"], f"{lo.where()}: the type it casts to")
    if dtype == x.type.dtype:
        return [x]
    return [lo.emit("cast", [x], {"dtype": str(dtype)}, lo.out(0))]


@converts("Identity")
def identity(lo, node, a):
    return inputs(lo)


@converts("Dropout")
def dropout(lo, node, a):
    x = lo.value(lo.input(0))
    if lo.model.opset >= 12:
        ratio = lo.constant(1, "ratio")
        ratio = 0.5 if ratio is None else float(np.asarray(ratio))
        mode = lo.constant(2, "training_mode")
        in_file = mode is not None and bool(np.asarray(mode))
    else:
        ratio, in_file = a.get("ratio", 0.5), False
    if len(node.output) > 1 and node.output[1]:
        raise lo.fail("its mask output is not supported (purinec draws masks inside the "
                      "training step)")
    if in_file:
        raise lo.fail("training_mode=1 in the file is not supported: purinec drops out "
                      "when it trains the model (purinec train), not in inference")
    if not lo.training or ratio == 0.0:
        return [x]
    mask = lo.emit("dropout_mask", [lo.iteration()],
                   {"shape": list(x.type.shape), "p": ratio, "seed": lo.seed(),
                    "dtype": str(x.type.dtype)})
    return [lo.emit("mul", [x, mask], {}, lo.out(0))]


# -- products and windows -----------------------------------------------------------------


@converts("MatMul")
def matmul(lo, node, a):
    x, w = inputs(lo)
    if x.type.rank == 0 or w.type.rank == 0:
        raise lo.fail("MatMul of a scalar is not defined")
    if w.type.rank > 2:
        raise lo.fail(f"batched MatMul ({x.type} @ {w.type}) is not supported: the second "
                      f"operand must be a matrix or a vector")
    x2 = x if x.type.rank == 2 else reshape(lo, x, (math.prod(x.type.shape[:-1]),
                                                    x.type.shape[-1]))
    w2 = w if w.type.rank == 2 else reshape(lo, w, (w.type.shape[0], 1))
    if x2.type.shape[1] != w2.type.shape[0]:
        raise lo.fail(f"operands {x.type} and {w.type} do not multiply")
    shape = x.type.shape[:-1] + w.type.shape[1:]
    whole = shape == (x2.type.shape[0], w2.type.shape[1])
    product = lo.emit("matmul", [x2, w2], {}, lo.out(0) if whole else None)
    return [product if whole else reshape(lo, product, shape, lo.out(0))]


@converts("Gemm")
def gemm(lo, node, a):
    x, w = lo.value(lo.input(0)), lo.value(lo.input(1))
    alpha, beta = a.get("alpha", 1.0), a.get("beta", 1.0)
    has_c = lo.input(2) is not None
    product = lo.emit("matmul", [x, w], {"trans_a": bool(a.get("transA", 0)),
                                         "trans_b": bool(a.get("transB", 0))},
                      lo.out(0) if alpha == 1.0 and not has_c else None)
    if alpha != 1.0:
        product = lo.emit("scale", [product], {"alpha": alpha},
                          None if has_c else lo.out(0))
    if not has_c:
        return [product]
    c = lo.value(lo.input(2), init="constant(0)")
    if beta != 1.0:
        c = lo.emit("scale", [c], {"alpha": beta})
    if c.type.shape == product.type.shape[1:]:
        return [lo.emit("bias_add", [product, c], {"axis": 1}, lo.out(0))]
    return [lo.emit("add", [product, broadcast(lo, c, product.type.shape)], {}, lo.out(0))]


def window_pads(lo: Lowering, a: dict, sizes, kernel, strides, dilations) -> list[int]:
    """ONNX's pads ([begins..., ends...]) from ``pads`` or ``auto_pad``."""
    n = len(kernel)
    auto = a.get("auto_pad", "NOTSET")
    if auto in ("NOTSET", ""):
        pads = list(a.get("pads", [0] * 2 * n))
        if len(pads) != 2 * n or min(pads) < 0:
            raise lo.fail(f"pads {pads} must be {2 * n} numbers >= 0")
        return pads
    if auto == "VALID":
        return [0] * 2 * n
    if auto not in ("SAME_UPPER", "SAME_LOWER"):
        raise lo.fail(f"auto_pad {auto!r} is not one of NOTSET, VALID, SAME_UPPER, SAME_LOWER")
    begins, ends = [], []
    for size, k, s, d in zip(sizes, kernel, strides, dilations):
        total = max(0, (math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size)
        small = total // 2
        begins.append(small if auto == "SAME_UPPER" else total - small)
        ends.append(total - begins[-1])
    return begins + ends


def as_2d(lo: Lowering, x: Value, what: str) -> Value:
    """A 1-d window op's input [N, C, L] as [N, C, 1, L]; 2-d as it is."""
    if x.type.rank == 4:
        return x
    if x.type.rank == 3:
        return reshape(lo, x, (x.type.shape[0], x.type.shape[1], 1, x.type.shape[2]))
    raise lo.fail(f"{what} over {x.type.rank - 2} spatial dimension(s) is not supported "
                  f"(1 or 2 are)")


def from_2d(lo: Lowering, x: Value, y: Value) -> Value:
    """The result ``y`` of a window op on ``x``: as it is for a 2-d ``x``; for a 1-d
    one, [N, C, 1, L] as [N, C, L]."""
    if x.type.rank == 4:
        return y
    return reshape(lo, y, y.type.shape[:2] + y.type.shape[3:], lo.out(0))


def window_attrs(lo: Lowering, a: dict, x: Value, kernel: list[int]) -> dict:
    """stride, pad ([top, left, bottom, right]) and dilation of a 2-d window op."""
    n = len(kernel)
    strides = list(a.get("strides", [1] * n))
    dilations = list(a.get("dilations", [1] * n))
    pads = window_pads(lo, a, x.type.shape[2:], kernel, strides, dilations)
    if n == 1:
        return {"stride": [1] + strides, "dilation": [1] + dilations,
                "pad": [0, pads[0], 0, pads[1]]}
    return {"stride": strides, "dilation": dilations, "pad": pads}


@converts("Conv")
def conv(lo, node, a):
    x, w = lo.value(lo.input(0)), lo.value(lo.input(1))
    kernel = list(w.type.shape[2:])
    attrs = window_attrs(lo, a, x, kernel)
    x4 = as_2d(lo, x, "Conv")
    w4 = reshape(lo, w, (*w.type.shape[:2], 1, kernel[0])) if len(kernel) == 1 else w
    attrs["groups"] = a.get("group", 1)
    bias = lo.input(2)
    rank_kept = x4 is x
    y = lo.emit("conv2d", [x4, w4], attrs, lo.out(0) if rank_kept and not bias else None)
    if bias:
        y = lo.emit("bias_add", [y, lo.value(bias, init="constant(0)")], {"axis": 1},
                    lo.out(0) if rank_kept else None)
    return [from_2d(lo, x, y)]


def _pool(lo, node, a, op: str, extra: dict) -> list:
    if len(node.output) > 1 and node.output[1]:
        raise lo.fail("its Indices output is not supported")
    if a.get("storage_order", 0):
        raise lo.fail("storage_order=1 is not supported")
    x = lo.value(lo.input(0))
    kernel = list(a["kernel_shape"])
    attrs = window_attrs(lo, a, x, kernel)
    attrs["kernel"] = [1] + kernel if len(kernel) == 1 else kernel
    attrs["ceil_mode"] = bool(a.get("ceil_mode", 0))
    x4 = as_2d(lo, x, node.op_type)
    y = lo.emit(op, [x4], {**attrs, **extra}, lo.out(0) if x4 is x else None)
    return [from_2d(lo, x, y)]


@converts("MaxPool")
def max_pool(lo, node, a):
    return _pool(lo, node, a, "max_pool2d", {})


@converts("AveragePool")
def average_pool(lo, node, a):
    return _pool(lo, node, a, "avg_pool2d",
                 {"count_include_pad": bool(a.get("count_include_pad", 0))})


@converts("GlobalAveragePool", "GlobalMaxPool")
def global_pool(lo, node, a):
    (x,) = inputs(lo)
    x4 = as_2d(lo, x, node.op_type)
    name = lo.out(0) if x4 is x else None
    if node.op_type == "GlobalAveragePool":
        y = lo.emit("global_avg_pool", [x4], {}, name)
    else:
        y = lo.emit("max_pool2d", [x4], {"kernel": list(x4.type.shape[2:]), "stride": [1, 1],
                                         "pad": [0, 0], "ceil_mode": False}, name)
    return [from_2d(lo, x, y)]


@converts("LRN")
def lrn(lo, node, a):
    (x,) = inputs(lo)
    size = a["size"]
    if size % 2 == 0:
        raise lo.fail(f"size {size}: only odd sizes are supported (an even one makes "
                      f"ONNX's window lopsided)")
    return [lo.emit("lrn", [x], {"size": size, "alpha": a.get("alpha", 1e-4),
                                 "beta": a.get("beta", 0.75), "k": a.get("bias", 1.0)},
                    lo.out(0))]


# -- normalization ------------------------------------------------------------------------


def per_channel(lo: Lowering, v: Value, like: Value) -> Value:
    """A [C] vector broadcast along axis 1 of ``like``."""
    shape = (1, v.type.shape[0]) + (1,) * (like.type.rank - 2)
    return broadcast(lo, reshape(lo, v, shape), like.type.shape)


@converts("BatchNormalization")
def batch_norm(lo, node, a):
    x = lo.value(lo.input(0))
    scale = lo.value(lo.input(1), init="constant(1)")
    bias = lo.value(lo.input(2), init="constant(0)")
    mean = lo.value(lo.input(3), role="state", init="constant(0)")
    var = lo.value(lo.input(4), role="state", init="constant(1)")
    if not a.get("spatial", 1):
        raise lo.fail("spatial=0 (statistics per element) is not supported")
    eps, momentum = a.get("epsilon", 1e-5), a.get("momentum", 0.9)
    in_file = bool(a.get("training_mode", 0))
    if x.type.rank < 2:
        raise lo.fail(f"input {x.type} has no channel axis")
    if not (lo.training or in_file):
        return [_normalized(lo, x, mean, var, scale, bias, eps, lo.out(0))]
    axes = [0] + list(range(2, x.type.rank))
    count = x.type.size // x.type.shape[1]
    batch_mean = _channel_mean(lo, x, axes, count)
    centered = lo.emit("sub", [x, per_channel(lo, batch_mean, x)])
    batch_var = _channel_mean(lo, lo.emit("mul", [centered, centered]), axes, count)
    y = _normalized(lo, centered, None, batch_var, scale, bias, eps, lo.out(0))
    # PyTorch's running variance (what trains the models people export) is unbiased;
    # ONNX's training_mode output is the batch's own.
    unbiased = count / max(count - 1, 1) if not in_file else 1.0
    following = [_running(lo, mean, batch_mean, momentum, 1.0),
                 _running(lo, var, batch_var, momentum, unbiased)]
    if in_file:
        return [y, *following]
    for state, value in zip((mean, var), following):
        lo.update(state, value)
    return [y]


def _channel_mean(lo: Lowering, x: Value, axes: list[int], count: int) -> Value:
    total = lo.emit("reduce_sum", [x], {"axes": axes, "keepdims": False})
    return lo.emit("scale", [total], {"alpha": 1.0 / count})


def _normalized(lo, x, mean, var, scale, bias, eps, name) -> Value:
    """scale * (x - mean) / sqrt(var + eps) + bias, per channel (``mean`` None: x is
    centered already)."""
    std = lo.emit("sqrt", [lo.emit("add_scalar", [var], {"value": eps})])
    gain = lo.emit("div", [scale, std])
    if mean is not None:
        x = lo.emit("sub", [x, per_channel(lo, mean, x)])
    scaled = lo.emit("mul", [x, per_channel(lo, gain, x)])
    return lo.emit("bias_add", [scaled, bias], {"axis": 1}, name)


def _running(lo, running: Value, batch: Value, momentum: float, correction: float) -> Value:
    """running * momentum + batch * correction * (1 - momentum)."""
    kept = lo.emit("scale", [running], {"alpha": momentum})
    new = lo.emit("scale", [batch], {"alpha": (1.0 - momentum) * correction})
    return lo.emit("add", [kept, new])


def _softmax(lo, node, a, op: str) -> list:
    (x,) = inputs(lo)
    if lo.model.opset >= 13:
        k = axis(lo, a.get("axis", -1), x.type.rank)
        return [lo.emit(op, [x], {"axis": k}, lo.out(0))]
    k = axis(lo, a.get("axis", 1), x.type.rank)  # older opsets: over a 2-d view
    rows = math.prod(x.type.shape[:k])
    flat = reshape(lo, x, (rows, x.type.size // max(rows, 1)))
    y = lo.emit(op, [flat], {"axis": 1}, lo.out(0) if flat is x else None)
    return [reshape(lo, y, x.type.shape, lo.out(0)) if flat is not x else y]


@converts("Softmax")
def softmax(lo, node, a):
    return _softmax(lo, node, a, "softmax")


@converts("LogSoftmax")
def log_softmax(lo, node, a):
    return _softmax(lo, node, a, "log_softmax")


@converts("ReduceSum", "ReduceMean")
def reduce(lo, node, a):
    (x,) = inputs(lo, 1)
    since = 13 if node.op_type == "ReduceSum" else 18
    given = attr_or_input(lo, a, "axes", 1, since)
    axes = sorted({axis(lo, k, x.type.rank, "an axis") for k in ints(given, lo, "axes")}
                  if given is not None else [])
    if not axes:
        if a.get("noop_with_empty_axes", 0):
            return [x]
        axes = list(range(x.type.rank))
    keepdims = bool(a.get("keepdims", 1))
    mean = node.op_type == "ReduceMean"
    y = lo.emit("reduce_sum", [x], {"axes": axes, "keepdims": keepdims},
                None if mean else lo.out(0))
    if mean:
        count = math.prod(x.type.shape[k] for k in axes)
        y = lo.emit("scale", [y], {"alpha": 1.0 / count}, lo.out(0))
    return [y]


# -- moving data --------------------------------------------------------------------------


@converts("Flatten")
def flatten(lo, node, a):
    (x,) = inputs(lo)
    k = a.get("axis", 1)
    if not -x.type.rank <= k <= x.type.rank:
        raise lo.fail(f"axis {k} is out of range for {x.type}")
    k %= x.type.rank + (k >= 0)
    return [reshape(lo, x, (math.prod(x.type.shape[:k]), math.prod(x.type.shape[k:])),
                    lo.out(0))]


@converts("Reshape")
def reshape_op(lo, node, a):
    x = lo.value(lo.input(0))
    if lo.model.opset >= 5:
        shape = ints(lo.constant(1, "shape"), lo, "shape")
    else:
        shape = list(a["shape"])
    allow_zero = bool(a.get("allowzero", 0))
    shape = [x.type.shape[k] if d == 0 and not allow_zero else d for k, d in enumerate(shape)]
    if shape.count(-1) > 1:
        raise lo.fail(f"shape {shape} has more than one -1")
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        if known == 0 or x.type.size % known:
            raise lo.fail(f"cannot reshape {x.type} to {shape}")
        shape[shape.index(-1)] = x.type.size // known
    if math.prod(shape) != x.type.size or min(shape, default=0) < 0:
        raise lo.fail(f"cannot reshape {x.type} to {shape}")
    return [reshape(lo, x, shape, lo.out(0))]


@converts("Squeeze", "Unsqueeze")
def squeeze(lo, node, a):
    x = lo.value(lo.input(0))
    given = attr_or_input(lo, a, "axes", 1, 13)
    listed = ints(given, lo, "axes") if given is not None else None
    shape = list(x.type.shape)
    if node.op_type == "Squeeze":
        drop = ({axis(lo, k, len(shape)) for k in listed} if listed is not None
                else {k for k, d in enumerate(shape) if d == 1})
        if any(shape[k] != 1 for k in drop):
            raise lo.fail(f"cannot squeeze axes {sorted(drop)} of {x.type}")
        shape = [d for k, d in enumerate(shape) if k not in drop]
    else:
        rank = len(shape) + len(listed or [])
        for k in sorted(axis(lo, k, rank) for k in listed or []):
            shape.insert(k, 1)
    return [reshape(lo, x, shape, lo.out(0))]


@converts("Transpose")
def transpose(lo, node, a):
    (x,) = inputs(lo)
    perm = list(a.get("perm", reversed(range(x.type.rank))))
    if sorted(perm) != list(range(x.type.rank)):
        raise lo.fail(f"perm {perm} is not a permutation of the axes of {x.type}")
    if perm == list(range(x.type.rank)):
        return [x]
    return [lo.emit("transpose", [x], {"perm": perm}, lo.out(0))]


@converts("Concat")
def concat(lo, node, a):
    xs = inputs(lo)
    k = axis(lo, a["axis"], xs[0].type.rank)
    if len(xs) == 1:
        return xs
    return [lo.emit("concat", xs, {"axis": k}, lo.out(0))]


@converts("Split")
def split(lo, node, a):
    x = lo.value(lo.input(0))
    k = axis(lo, a.get("axis", 0), x.type.rank)
    given = attr_or_input(lo, a, "split", 1, 13)
    sections = ints(given, lo, "split") if given is not None else []
    n = len(node.output)
    if not sections:
        size = x.type.shape[k]
        if "num_outputs" in a:
            n = a["num_outputs"]
        part = math.ceil(size / n)
        sections = [part] * (size // part) + ([size % part] if size % part else [])
        if len(sections) != n or (size % n and "num_outputs" not in a):
            raise lo.fail(f"axis {k} of {x.type} does not split into {n} equal parts")
    if len(sections) != len(node.output):
        raise lo.fail(f"{len(sections)} sections for {len(node.output)} outputs")
    if len(sections) == 1:
        return [x]
    return lo.emit("split", [x], {"axis": k, "sections": sections}, n=len(sections))


@converts("Slice")
def slice_op(lo, node, a):
    x = lo.value(lo.input(0))
    if lo.model.opset >= 10:
        starts = ints(lo.constant(1, "starts"), lo, "starts")
        ends = ints(lo.constant(2, "ends"), lo, "ends")
        axes = ints(lo.constant(3, "axes"), lo, "axes") or list(range(len(starts)))
        steps = ints(lo.constant(4, "steps"), lo, "steps") or [1] * len(starts)
    else:
        starts, ends = list(a["starts"]), list(a["ends"])
        axes = list(a.get("axes", range(len(starts))))
        steps = [1] * len(starts)
    shape = x.type.shape
    begin, step, size = [0] * len(shape), [1] * len(shape), list(shape)
    for k, start, end, by in zip(axes, starts, ends, steps):
        k = axis(lo, k, len(shape), "an axis")
        if by == 0:
            raise lo.fail("a step of 0")
        first, stop, by = slice(start, end, by).indices(shape[k])
        begin[k], step[k], size[k] = first, by, len(range(first, stop, by))
    if 0 in size:
        raise lo.fail(f"the slice of {x.type} is empty; purinec has no empty tensors")
    if size == list(shape) and step == [1] * len(shape):
        return [x]
    return [lo.emit("strided_slice", [x], {"starts": begin, "steps": step, "sizes": size},
                    lo.out(0))]


@converts("Pad")
def pad(lo, node, a):
    x = lo.value(lo.input(0))
    rank = x.type.rank
    mode = a.get("mode", "constant")
    if mode not in ("constant", "reflect", "edge"):
        raise lo.fail(f"mode {mode!r} is not supported (constant, reflect and edge are)")
    if lo.model.opset >= 11:
        pads = ints(lo.constant(1, "pads"), lo, "pads")
        fill = lo.constant(2, "constant_value")
        value = 0.0 if fill is None or fill.size == 0 else float(np.asarray(fill).reshape(-1)[0])
        axes = ints(lo.constant(3, "axes"), lo, "axes") or list(range(rank))
    else:
        pads, value, axes = list(a.get("pads", a.get("paddings", []))), a.get("value", 0.0), \
            list(range(rank))
    if len(pads) != 2 * len(axes):
        raise lo.fail(f"pads {pads} must have 2 entries per padded axis ({len(axes)})")
    full = [0] * 2 * rank
    for j, k in enumerate(axis(lo, k, rank, "an axis") for k in axes):
        full[k], full[rank + k] = pads[j], pads[len(axes) + j]
    grown = [max(p, 0) for p in full]
    y = x
    if any(grown):
        last = min(full) >= 0
        y = lo.emit("pad", [x], {"pads": grown, "mode": mode, "value": value},
                    lo.out(0) if last else None)
    if min(full) < 0:  # negative pads crop
        begin = [-min(p, 0) for p in full[:rank]]
        size = [d - b - max(-e, 0) for d, b, e in zip(y.type.shape, begin, full[rank:])]
        y = lo.emit("strided_slice", [y], {"starts": begin, "steps": [1] * rank,
                                           "sizes": size}, lo.out(0))
    return [y]


@converts("ConstantOfShape")
def constant_of_shape(lo, node, a):
    shape = ints(lo.constant(0, "shape"), lo, "shape")
    value = np.asarray(a.get("value", np.zeros(1, np.float32)))
    dtype = array_dtype(value, f"{lo.where()}: its value")
    if 0 in shape:
        raise lo.fail(f"shape {shape} is empty; purinec has no empty tensors")
    return [lo.emit("fill", [], {"shape": shape, "dtype": str(dtype),
                                 "value": float(value.reshape(-1)[0])}, lo.out(0))]


# Ops a file may use that never reach the IR: computed at import from constants and
# static shapes (any op whose inputs are all constants folds, these always do).
FOLDED_ALWAYS = {"Constant", "Shape", "Size"}

SUPPORTED_OPS = frozenset(CONVERTERS) | FOLDED_ALWAYS
