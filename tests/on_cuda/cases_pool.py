"""Simulator cases: pooling and LRN (see `tests.on_cuda.simulate`). Images are 5x7 or
6x6, so that windows of 3 with stride 2 overlap, and padding or Caffe's ceil mode lets
the last windows hang out of the input."""

import numpy as np

from purinec.ir import nnref
from tests.on_cuda.simulate import random_array as R

SHAPE = (2, 3, 5, 7)


def _window(kernel, stride=(1, 1), pad=(0, 0), **onnx):
    """A window's attributes; ``onnx``: dilation and ceil_mode."""
    return {"kernel": list(kernel), "stride": list(stride), "pad": list(pad), **onnx}


def _ties(rng, shape):
    """Integer-valued floats: windows often hold their maximum more than once."""
    return rng.integers(0, 3, shape).astype(np.float32)


def _pool(op, attrs, shape=SHAPE, dtype="float32"):
    return lambda rng: (op, [R(rng, shape, dtype)], attrs)


def _max_grad(attrs, shape=SHAPE):
    """x with ties, y its max pooling, random gy."""
    def case(rng):
        x = _ties(rng, shape)
        (y,) = nnref.max_pool2d(x, **attrs)
        return "max_pool2d_grad", [x, y, R(rng, y.shape, "float32")], attrs
    return case


def _avg_grad(attrs, shape=SHAPE, dtype="float32"):
    def case(rng):
        (y,) = nnref.avg_pool2d(np.zeros(shape, dtype), **attrs)
        return "avg_pool2d_grad", [R(rng, y.shape, dtype)], {**attrs,
                                                            "input_shape": list(shape)}
    return case


OVERLAP_PADDED = _window((3, 3), (2, 2), (1, 1))
CEIL_MODE = _window((2, 2), (2, 2))  # 5x7: the last row and column of windows hang out
OVERHANG_PADDED = _window((3, 3), (2, 2), (1, 1))  # on 6x6: divisors vary at the edge
RECTANGLE = _window((3, 2), (1, 2), (1, 0))
# ONNX-style: floor mode, uneven padding, dilated taps; in ceil mode, windows hanging
# out of the padded input. Averages divide with the padding and without it.
ONNX_FLOOR = _window((3, 2), (2, 1), (1, 0, 2, 1), dilation=[2, 3], ceil_mode=False)
ONNX_CEIL = _window((2, 3), (2, 2), (0, 1, 1, 0), dilation=[1, 2], ceil_mode=True)
LRN = {"size": 3, "alpha": 0.5, "beta": 0.75, "k": 2.0}
LRN_WIDE = {"size": 5, "alpha": 0.3, "beta": 0.6, "k": 1.0}  # wider than the channels

CASES = {
    "max_pool2d_overlap_padded": _pool("max_pool2d", OVERLAP_PADDED),
    "max_pool2d_ceil_mode": _pool("max_pool2d", CEIL_MODE),
    "max_pool2d_rectangle_f64": _pool("max_pool2d", RECTANGLE, dtype="float64"),
    "max_pool2d_ties": lambda rng: ("max_pool2d", [_ties(rng, SHAPE)], OVERLAP_PADDED),
    "max_pool2d_grad_ties_overlap_padded": _max_grad(OVERLAP_PADDED),
    "max_pool2d_grad_ties_ceil_mode": _max_grad(CEIL_MODE),
    "max_pool2d_grad_ties_stride1": _max_grad(_window((2, 2))),
    "max_pool2d_grad_ties_rectangle": _max_grad(RECTANGLE),
    "avg_pool2d_overlap_padded": _pool("avg_pool2d", OVERLAP_PADDED),
    "avg_pool2d_overhang_padded": _pool("avg_pool2d", OVERHANG_PADDED, (2, 3, 6, 6)),
    "avg_pool2d_ceil_mode_f64": _pool("avg_pool2d", CEIL_MODE, dtype="float64"),
    "avg_pool2d_rectangle": _pool("avg_pool2d", RECTANGLE),
    "avg_pool2d_grad_overlap_padded": _avg_grad(OVERLAP_PADDED),
    "avg_pool2d_grad_overhang_padded": _avg_grad(OVERHANG_PADDED, (2, 3, 6, 6)),
    "avg_pool2d_grad_ceil_mode_f64": _avg_grad(CEIL_MODE, dtype="float64"),
    "avg_pool2d_grad_rectangle": _avg_grad(RECTANGLE),
    "max_pool2d_onnx_floor": _pool("max_pool2d", ONNX_FLOOR),
    "max_pool2d_grad_ties_onnx_ceil": _max_grad(ONNX_CEIL),
    "max_pool2d_grad_ties_onnx_floor": _max_grad(ONNX_FLOOR),
    "avg_pool2d_onnx_floor_exclude_pad": _pool("avg_pool2d",
                                               {**ONNX_FLOOR, "count_include_pad": False}),
    "avg_pool2d_onnx_ceil_exclude_pad_f64": _pool("avg_pool2d",
                                                  {**ONNX_CEIL, "count_include_pad": False},
                                                  dtype="float64"),
    "avg_pool2d_grad_onnx_floor": _avg_grad({**ONNX_FLOOR, "count_include_pad": True}),
    "avg_pool2d_grad_onnx_ceil_exclude_pad": _avg_grad({**ONNX_CEIL,
                                                        "count_include_pad": False}),
    "global_avg_pool": _pool("global_avg_pool", {}),
    "global_avg_pool_f64": _pool("global_avg_pool", {}, (2, 2, 12, 13), "float64"),
    "lrn": _pool("lrn", LRN),
    "lrn_wide_window_f64": _pool("lrn", LRN_WIDE, dtype="float64"),
    "lrn_grad": lambda rng: ("lrn_grad", [R(rng, SHAPE, "float32"), R(rng, SHAPE, "float32")],
                             LRN),
    "lrn_grad_wide_window": lambda rng: ("lrn_grad", [R(rng, (2, 4, 3, 2), "float32"),
                                                      R(rng, (2, 4, 3, 2), "float32")],
                                         LRN_WIDE),
}
