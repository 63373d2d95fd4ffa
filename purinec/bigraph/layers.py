"""Built-in layers (Caffe's, with Caffe's and PyTorch's parameter names).

Each layer builds its forward ops when connected; backward comes from autodiff.
Parameters are ``<layer>.weight`` and ``<layer>.bias``; their shapes follow the input
(`Lazy`) and are known when the net is lowered. A parameter blob may be passed in
(``weight=other.weight``) to share it between layers.
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

from purinec.bigraph.core import Blob, Layer, Lazy, Op
from purinec.errors import ModelError, ShapeError

__all__ = ["Conv", "InnerProduct", "Bias", "ReLU", "Sigmoid", "TanH", "MaxPool", "AvgPool",
           "GlobalAvgPool", "LRN", "Dropout", "Softmax", "SoftmaxWithLoss", "Accuracy",
           "Concat", "Split", "Flatten", "Eltwise", "Scale", "DropoutOp", "FlattenOp"]


def _fmt(shape) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _pair(layer: Layer, what: str, value, least: int) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value, value]
    try:
        pair = [int(v) for v in value]
        if len(pair) != 2 or any(isinstance(v, bool) for v in value):
            raise ValueError
    except (TypeError, ValueError):
        raise ModelError(f"{layer.describe()}: {what} must be an int or a pair of ints, "
                         f"got {value!r}") from None
    if min(pair) < least:
        raise ModelError(f"{layer.describe()}: {what} must be >= {least}, got {value!r}")
    return pair


def _positive(layer: Layer, what: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelError(f"{layer.describe()}: {what} must be a positive int, got {value!r}")
    return value


def _number(layer: Layer, what: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ModelError(f"{layer.describe()}: {what} must be a finite number, got {value!r}")
    return float(value)


def _shared(layer: Layer, what: str, blob) -> Blob:
    if not isinstance(blob, Blob) or blob.role != "param":
        raise ModelError(f"{layer.describe()}: {what} must be a param Blob to share, "
                         f"got {blob!r}")
    return blob


# ---------------------------------------------------------------------------------------
# Ops with special lowering


class FlattenOp(Op):
    """``reshape`` to (N, everything else); lowered to nothing when already 2-D."""

    def __init__(self, name: str | None = "flatten", *, location=None):
        super().__init__("reshape", name, location=location,
                         shape=Lazy(self._shape, "(N, C*H*W)"))

    def _shape(self, shape) -> list[int]:
        x = shape(self.inputs[0])
        if len(x) < 1:
            raise ShapeError("flatten: input must have a batch axis, got a scalar")
        return [x[0], math.prod(x[1:])]

    def lower(self, ctx, inputs):
        shape = ctx.resolve_attrs(self)["shape"]
        if tuple(shape) == inputs[0].type.shape:
            return [inputs[0]]
        return super().lower(ctx, inputs)


class DropoutOp(Op):
    """Dropout: identity in inference; in training ``dropout_mask(%iteration)`` then
    ``mul``, with a seed derived from the layer's name."""

    virtual = True

    def __init__(self, name: str | None = "dropout", p: float = 0.5, *, location=None):
        super().__init__("dropout", name, location=location, p=p)
        self.p = float(p)

    def arity(self):
        return (1, 1)

    def n_outputs(self) -> int:
        return 1

    def input_names(self) -> str:
        return "x"

    def lower(self, ctx, inputs):
        (x,) = inputs
        if ctx.mode != "train" or self.p == 0.0:
            return [x]
        (out,) = self.outputs
        seed = ctx.seed_for(self.layer.path if self.layer is not None else self.path)
        (mask,) = ctx.emit(self, "dropout_mask", [ctx.iteration()],
                           {"shape": list(x.type.shape), "p": self.p, "seed": seed,
                            "dtype": str(x.type.dtype)},
                           [ctx.fresh_name(out.path + ".mask")])
        return ctx.emit(self, "mul", [x, mask], {}, [out.path])


# ---------------------------------------------------------------------------------------
# Layers with parameters


class Conv(Layer):
    """Convolution: weight (out, in/groups, kh, kw), bias (out,); conv2d then
    bias_add on axis 1."""

    def __init__(self, name: str, num_output: int, kernel, stride=1, pad=0, groups: int = 1,
                 bias=True, *, weight_init: str = "xavier", bias_init: str = "constant(0)",
                 weight: Blob | None = None, location=None):
        super().__init__(name, location=location)
        self.num_output = _positive(self, "num_output", num_output)
        self.kernel = _pair(self, "kernel", kernel, 1)
        self.stride = _pair(self, "stride", stride, 1)
        self.pad = _pair(self, "pad", pad, 0)
        self.groups = _positive(self, "groups", groups)
        if num_output % groups:
            raise ModelError(f"{self.describe()}: num_output {num_output} is not divisible "
                             f"by groups {groups}")
        self.weight = (_shared(self, "weight", weight) if weight is not None else
                       self.param("weight", Lazy(self._weight_shape, "(out, in/groups, kh, kw)"),
                                  weight_init))
        if isinstance(bias, Blob):
            self.bias = _shared(self, "bias", bias)
        else:
            self.bias = self.param("bias", (num_output,), bias_init) if bias else None

    def _weight_shape(self, shape):
        x = shape(self.bottom[0])
        if len(x) != 4:
            raise ShapeError(f"conv2d: input must have rank 4 (N, C, H, W), got {_fmt(x)}")
        if x[1] % self.groups:
            raise ShapeError(f"conv2d: {x[1]} input channels do not split into "
                             f"{self.groups} groups")
        return (self.num_output, x[1] // self.groups, *self.kernel)

    def build(self, x):
        y = [x, self.weight] >> Op("conv2d", "conv", stride=self.stride, pad=self.pad,
                                   groups=self.groups)
        if self.bias is not None:
            y = [y, self.bias] >> Op("bias_add", "bias_add", axis=1)
        return y


class InnerProduct(Layer):
    """Fully connected: flattens a >2-D input, weight (out, in), ``matmul(x, w)`` with
    trans_b, then bias_add on axis 1."""

    def __init__(self, name: str, num_output: int, bias=True, *, weight_init: str = "xavier",
                 bias_init: str = "constant(0)", weight: Blob | None = None, location=None):
        super().__init__(name, location=location)
        self.num_output = _positive(self, "num_output", num_output)
        self.weight = (_shared(self, "weight", weight) if weight is not None else
                       self.param("weight", Lazy(self._weight_shape, "(out, in)"),
                                  weight_init))
        if isinstance(bias, Blob):
            self.bias = _shared(self, "bias", bias)
        else:
            self.bias = self.param("bias", (num_output,), bias_init) if bias else None

    def _weight_shape(self, shape):
        x = shape(self.bottom[0])
        if len(x) < 2:
            raise ShapeError(f"inner product: input must have a batch axis and features, "
                             f"got {_fmt(x)}")
        return (self.num_output, math.prod(x[1:]))

    def build(self, x):
        y = x >> FlattenOp("flatten")
        y = [y, self.weight] >> Op("matmul", "matmul", trans_b=True)
        if self.bias is not None:
            y = [y, self.bias] >> Op("bias_add", "bias_add", axis=1)
        return y


class Bias(Layer):
    """Adds a learned bias (C,) along axis 1."""

    def __init__(self, name: str, *, init: str = "constant(0)", location=None):
        super().__init__(name, location=location)
        self.bias = self.param("bias", Lazy(self._bias_shape, "(C,)"), init)

    def _bias_shape(self, shape):
        x = shape(self.bottom[0])
        if len(x) < 2:
            raise ShapeError(f"bias: input must have a channel axis 1, got {_fmt(x)}")
        return (x[1],)

    def build(self, x):
        return [x, self.bias] >> Op("bias_add", "bias_add", axis=1)


# ---------------------------------------------------------------------------------------
# One-op layers


class _OneOp(Layer):
    op_name = ""
    n_bottom = 1

    def attrs(self) -> dict:
        return {}

    def build(self, *xs):
        return list(xs) >> Op(self.op_name, self.op_name, **self.attrs())


class ReLU(_OneOp):
    op_name = "relu"


class Sigmoid(_OneOp):
    op_name = "sigmoid"


class TanH(_OneOp):
    op_name = "tanh"


class _Pool(_OneOp):
    def __init__(self, name: str, kernel, stride=1, pad=0, *, location=None):
        super().__init__(name, location=location)
        self.kernel = _pair(self, "kernel", kernel, 1)
        self.stride = _pair(self, "stride", stride, 1)
        self.pad = _pair(self, "pad", pad, 0)

    def attrs(self):
        return {"kernel": self.kernel, "stride": self.stride, "pad": self.pad}


class MaxPool(_Pool):
    """Max pooling, Caffe's ceil-mode output size."""

    op_name = "max_pool2d"


class AvgPool(_Pool):
    """Average pooling, Caffe's ceil-mode output size and divisor."""

    op_name = "avg_pool2d"


class GlobalAvgPool(_OneOp):
    """Mean over H and W: N x C x 1 x 1."""

    op_name = "global_avg_pool"


class LRN(_OneOp):
    """Caffe's across-channel local response normalization."""

    op_name = "lrn"

    def __init__(self, name: str, size: int = 5, alpha: float = 1e-4, beta: float = 0.75,
                 k: float = 1.0, *, location=None):
        super().__init__(name, location=location)
        if _positive(self, "size", size) % 2 == 0:
            raise ModelError(f"{self.describe()}: size must be odd, got {size}")
        self.size = size
        self.alpha, self.beta, self.k = (_number(self, what, value) for what, value in
                                         (("alpha", alpha), ("beta", beta), ("k", k)))

    def attrs(self):
        return {"size": self.size, "alpha": self.alpha, "beta": self.beta, "k": self.k}


class Softmax(_OneOp):
    op_name = "softmax"

    def __init__(self, name: str, axis: int = 1, *, location=None):
        super().__init__(name, location=location)
        self.axis = axis

    def attrs(self):
        return {"axis": self.axis}


class SoftmaxWithLoss(_OneOp):
    """Mean cross-entropy of softmax(logits) against integer labels: inputs
    ``[logits, label]``."""

    op_name = "softmax_xent"
    n_bottom = 2


class Accuracy(_OneOp):
    """Fraction of rows whose largest logit is the label: inputs ``[logits, label]``."""

    op_name = "accuracy"
    n_bottom = 2


class Scale(_OneOp):
    """``alpha * x``."""

    op_name = "scale"

    def __init__(self, name: str, alpha: float, *, location=None):
        super().__init__(name, location=location)
        self.alpha = _number(self, "alpha", alpha)

    def attrs(self):
        return {"alpha": self.alpha}


class Concat(_OneOp):
    op_name = "concat"
    n_bottom = (1, None)

    def __init__(self, name: str, axis: int = 1, *, location=None):
        super().__init__(name, location=location)
        self.axis = axis

    def attrs(self):
        return {"axis": self.axis}


class Split(Layer):
    """Slices of the input along ``axis`` (Caffe's Slice); one top per section, named
    ``<name>_0``, ``<name>_1``, ..."""

    def __init__(self, name: str, sections: Sequence[int], axis: int = 1, *, location=None):
        super().__init__(name, location=location)
        try:
            self.sections = [int(s) for s in sections]
        except (TypeError, ValueError):
            raise ModelError(f"{self.describe()}: sections must be a list of ints, "
                             f"got {sections!r}") from None
        if not self.sections or min(self.sections) < 1:
            raise ModelError(f"{self.describe()}: sections must be positive, got {sections!r}")
        self.axis = axis

    def n_top(self) -> int:
        return len(self.sections)

    def build(self, x):
        return x >> Op("split", "split", axis=self.axis, sections=self.sections)


class Flatten(Layer):
    """Reshape to (N, everything else)."""

    def build(self, x):
        return x >> FlattenOp("flatten")


class Eltwise(Layer):
    """Elementwise sum or product of two or more inputs of one shape."""

    n_bottom = (2, None)
    _OPS = {"add": "add", "sum": "add", "mul": "mul", "prod": "mul"}

    def __init__(self, name: str, op: str = "add", *, location=None):
        super().__init__(name, location=location)
        if op not in self._OPS:
            raise ModelError(f"{self.describe()}: op must be 'add' or 'mul', got {op!r}")
        self.op = self._OPS[op]

    def build(self, first, *rest):
        acc = first
        for x in rest:
            acc = [acc, x] >> Op(self.op)
        return acc


class Dropout(Layer):
    """Drops each element with probability p in training (scaling the rest by
    1/(1-p)); the identity in inference."""

    def __init__(self, name: str, p: float = 0.5, *, location=None):
        super().__init__(name, location=location)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise ModelError(f"{self.describe()}: p must be in [0, 1), got {p!r}")
        self.p = float(p)

    def build(self, x):
        return x >> DropoutOp("dropout", self.p)
