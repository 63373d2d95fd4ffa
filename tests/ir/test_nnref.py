"""The NumPy references of conv, pooling, LRN and dropout against naive loops.

Each naive implementation below loops over output positions in plain Python and
follows the textbook (or Caffe's C++) formula literally; gradient references are also
checked as adjoints of their forward op or by finite differences in float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from purinec.errors import ShapeError, VerifyError
from purinec.ir import nnref
from purinec.ir.ops import REGISTRY, pool_output_size
from purinec.ir.types import DType, TensorType

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------
# Naive implementations.


def edges(pad):
    """[top, left, bottom, right] from 2 entries or 4."""
    return list(pad) * 2 if len(pad) == 2 else list(pad)


def naive_conv_size(size, kernel, stride, begin, end, dilation):
    return (size + begin + end - dilation * (kernel - 1) - 1) // stride + 1


def naive_conv2d(x, w, stride, pad, groups, dilation=(1, 1)):
    n_, c_, h_, w_ = x.shape
    o_, cg, kh, kw = w.shape
    (sh, sw), (dh, dw), (pt, pl, pb, pr) = stride, dilation, edges(pad)
    oh, ow = naive_conv_size(h_, kh, sh, pt, pb, dh), naive_conv_size(w_, kw, sw, pl, pr, dw)
    og = o_ // groups
    y = np.zeros((n_, o_, oh, ow))
    for n in range(n_):
        for o in range(o_):
            g = o // og
            for p in range(oh):
                for q in range(ow):
                    acc = 0.0
                    for c in range(cg):
                        for i in range(kh):
                            for j in range(kw):
                                h, v = p * sh - pt + i * dh, q * sw - pl + j * dw
                                if 0 <= h < h_ and 0 <= v < w_:
                                    acc += w[o, c, i, j] * x[n, g * cg + c, h, v]
                    y[n, o, p, q] = acc
    return y


def naive_conv2d_grad_input(gy, w, stride, pad, groups, input_shape, dilation=(1, 1)):
    n_, c_, h_, w_ = input_shape
    o_, cg, kh, kw = w.shape
    (sh, sw), (dh, dw), (pt, pl, _, _) = stride, dilation, edges(pad)
    og = o_ // groups
    gx = np.zeros(input_shape)
    for n in range(n_):
        for o in range(o_):
            g = o // og
            for p in range(gy.shape[2]):
                for q in range(gy.shape[3]):
                    for c in range(cg):
                        for i in range(kh):
                            for j in range(kw):
                                h, v = p * sh - pt + i * dh, q * sw - pl + j * dw
                                if 0 <= h < h_ and 0 <= v < w_:
                                    gx[n, g * cg + c, h, v] += w[o, c, i, j] * gy[n, o, p, q]
    return gx


def naive_conv2d_grad_weight(x, gy, stride, pad, groups, kernel, dilation=(1, 1)):
    n_, c_, h_, w_ = x.shape
    o_ = gy.shape[1]
    kh, kw = kernel
    (sh, sw), (dh, dw), (pt, pl, _, _) = stride, dilation, edges(pad)
    cg, og = c_ // groups, o_ // groups
    gw = np.zeros((o_, cg, kh, kw))
    for o in range(o_):
        g = o // og
        for c in range(cg):
            for i in range(kh):
                for j in range(kw):
                    acc = 0.0
                    for n in range(n_):
                        for p in range(gy.shape[2]):
                            for q in range(gy.shape[3]):
                                h, v = p * sh - pt + i * dh, q * sw - pl + j * dw
                                if 0 <= h < h_ and 0 <= v < w_:
                                    acc += gy[n, o, p, q] * x[n, g * cg + c, h, v]
                    gw[o, c, i, j] = acc
    return gw


def caffe_pooled_size(size, kernel, stride, pad, any_pad):
    """Caffe's PoolingLayer::Reshape, literally (float ceil; the check when any pad)."""
    out = int(math.ceil(float(size + 2 * pad - kernel) / stride)) + 1
    if any_pad and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def naive_pool_size(size, kernel, stride, begin, end, dilation, ceil_mode):
    """ONNX's output size (its reference's get_output_shape_explicit_padding);
    purinec applies Caffe's last-window check on every axis (see test below)."""
    out = (size + begin + end - dilation * (kernel - 1) - 1) / stride + 1
    if not ceil_mode:
        return int(math.floor(out))
    out = int(math.ceil(out))
    return out - 1 if (out - 1) * stride >= size + begin else out


def naive_taps(size, kernel, stride, begin, end, dilation, ceil_mode):
    """Per window: the input indices of its taps, and how many taps the padded input
    holds."""
    windows = []
    for p in range(naive_pool_size(size, kernel, stride, begin, end, dilation, ceil_mode)):
        taps = [p * stride - begin + i * dilation for i in range(kernel)]
        windows.append(([t for t in taps if 0 <= t < size],
                        sum(-begin <= t < size + end for t in taps)))
    return windows


def naive_windows(x_shape, kernel, stride, pad, dilation, ceil_mode):
    pt, pl, pb, pr = edges(pad)
    return (naive_taps(x_shape[2], kernel[0], stride[0], pt, pb, dilation[0], ceil_mode),
            naive_taps(x_shape[3], kernel[1], stride[1], pl, pr, dilation[1], ceil_mode))


def naive_max_pool(x, kernel, stride, pad, dilation=(1, 1), ceil_mode=True, gy=None):
    """Caffe's MaxPoolForward (and, given gy, the backward through its argmax)."""
    rows, cols = naive_windows(x.shape, kernel, stride, pad, dilation, ceil_mode)
    y = np.zeros((*x.shape[:2], len(rows), len(cols)))
    gx = np.zeros(x.shape)
    for n in range(x.shape[0]):
        for c in range(x.shape[1]):
            for p, (hs, _) in enumerate(rows):
                for q, (vs, _) in enumerate(cols):
                    best, arg = -np.inf, None
                    for h in hs:
                        for v in vs:
                            if x[n, c, h, v] > best:
                                best, arg = x[n, c, h, v], (h, v)
                    y[n, c, p, q] = best
                    if gy is not None:
                        gx[n, c][arg] += gy[n, c, p, q]
    return gx if gy is not None else y


def naive_avg_pool(x, kernel, stride, pad, dilation=(1, 1), ceil_mode=True,
                   count_include_pad=True):
    """Caffe's AvePoolForward (the divisor counts the padding), or ONNX's
    count_include_pad=0 (it does not)."""
    rows, cols = naive_windows(x.shape, kernel, stride, pad, dilation, ceil_mode)
    y = np.zeros((*x.shape[:2], len(rows), len(cols)))
    for n in range(x.shape[0]):
        for c in range(x.shape[1]):
            for p, (hs, h_padded) in enumerate(rows):
                for q, (vs, v_padded) in enumerate(cols):
                    acc = 0.0
                    for h in hs:
                        for v in vs:
                            acc += x[n, c, h, v]
                    size = h_padded * v_padded if count_include_pad else len(hs) * len(vs)
                    y[n, c, p, q] = acc / size
    return y


def naive_lrn(x, size, alpha, beta, k):
    n_, c_, h_, w_ = x.shape
    half = (size - 1) // 2
    y = np.zeros(x.shape)
    for n in range(n_):
        for c in range(c_):
            for h in range(h_):
                for v in range(w_):
                    s = 0.0
                    for cc in range(c - half, c + half + 1):
                        if 0 <= cc < c_:
                            s += x[n, cc, h, v] ** 2
                    y[n, c, h, v] = x[n, c, h, v] * (k + alpha / size * s) ** -beta
    return y


def numeric_grad(f, x, eps=1e-6):
    """Central differences of the scalar function f at x (float64)."""
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + eps
        fp = f(x)
        x[idx] = old - eps
        fm = f(x)
        x[idx] = old
        g[idx] = (fp - fm) / (2 * eps)
    return g


# ---------------------------------------------------------------------------------------
# Strategies.


def draw_pad(draw, most):
    """2 entries [ph, pw] or 4 [top, left, bottom, right], each up to ``most``."""
    count = draw(st.sampled_from([2, 4]))
    return [draw(st.integers(0, most[k % 2])) for k in range(count)]


@st.composite
def conv_cases(draw):
    groups = draw(st.sampled_from([1, 2, 3]))
    cin_g, cout_g = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    sh, sw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    dh, dw = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    pad = draw_pad(draw, (2, 2))
    pt, pl, pb, pr = edges(pad)
    h, w = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    assume(naive_conv_size(h, kh, sh, pt, pb, dh) >= 1)
    assume(naive_conv_size(w, kw, sw, pl, pr, dw) >= 1)
    n = draw(st.integers(1, 2))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, cin_g * groups, h, w))
    wt = rng.standard_normal((cout_g * groups, cin_g, kh, kw))
    attrs = dict(stride=[sh, sw], pad=pad, groups=groups, dilation=[dh, dw])
    return x, wt, attrs, rng


@st.composite
def pool_cases(draw, integers=False):
    """(x, attrs, rng) of max pooling; average pooling takes count_include_pad too."""
    kh, kw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    sh, sw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    dh, dw = draw(st.sampled_from([1, 1, 2])), draw(st.sampled_from([1, 1, 3]))
    pad = draw_pad(draw, (dh * (kh - 1), dw * (kw - 1)))
    h, w = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    attrs = dict(kernel=[kh, kw], stride=[sh, sw], pad=pad, dilation=[dh, dw],
                 ceil_mode=draw(st.booleans()))
    rows, cols = naive_windows((1, 1, h, w), **attrs)
    # Every window must hold an input element (the ops refuse others).
    assume(rows and cols and all(taps for taps, _ in rows + cols))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), h, w)
    # Small integers make ties, which pin down "the first maximum".
    x = (rng.integers(-2, 3, shape).astype(np.float64) if integers
         else rng.standard_normal(shape))
    return x, attrs, rng


# ---------------------------------------------------------------------------------------
# Convolution.


@SETTINGS
@given(conv_cases())
def test_conv2d_matches_loops(case):
    x, w, attrs, _ = case
    (y,) = nnref.conv2d(x, w, **attrs)
    np.testing.assert_allclose(y, naive_conv2d(x, w, **attrs), rtol=1e-10, atol=1e-12)


@SETTINGS
@given(conv_cases())
def test_conv2d_grads_match_loops_and_are_adjoints(case):
    x, w, attrs, rng = case
    (y,) = nnref.conv2d(x, w, **attrs)
    gy = rng.standard_normal(y.shape)
    (gx,) = nnref.conv2d_grad_input(gy, w, **attrs, input_shape=list(x.shape))
    (gw,) = nnref.conv2d_grad_weight(x, gy, **attrs, kernel=list(w.shape[2:]))
    np.testing.assert_allclose(gx, naive_conv2d_grad_input(gy, w, **attrs,
                                                           input_shape=x.shape),
                               rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gw, naive_conv2d_grad_weight(x, gy, **attrs,
                                                            kernel=w.shape[2:]),
                               rtol=1e-10, atol=1e-12)
    # <conv(x, w), gy> = <x, gx> = <w, gw>: the conv is bilinear.
    inner = np.sum(y * gy)
    assert np.isclose(np.sum(x * gx), inner, rtol=1e-10, atol=1e-10)
    assert np.isclose(np.sum(w * gw), inner, rtol=1e-10, atol=1e-10)


def test_conv2d_grad_input_leaves_unreached_rows_zero():
    # 6 rows, kernel 3, stride 2: the last row is in no window.
    x = np.ones((1, 1, 6, 6))
    w = np.ones((1, 1, 3, 3))
    (y,) = nnref.conv2d(x, w, stride=[2, 2], pad=[0, 0], groups=1)
    assert y.shape == (1, 1, 2, 2)
    (gx,) = nnref.conv2d_grad_input(np.ones_like(y), w, stride=[2, 2], pad=[0, 0],
                                    groups=1, input_shape=[1, 1, 6, 6])
    assert np.all(gx[0, 0, 5, :] == 0) and np.all(gx[0, 0, :, 5] == 0)
    assert gx[0, 0, 2, 2] == 4  # the overlap of all four windows


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_conv_family_keeps_dtype(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 5, 5)).astype(dtype)
    w = rng.standard_normal((6, 2, 3, 3)).astype(dtype)
    attrs = dict(stride=[2, 1], pad=[1, 0], groups=2)
    (y,) = nnref.conv2d(x, w, **attrs)
    (gx,) = nnref.conv2d_grad_input(y, w, **attrs, input_shape=list(x.shape))
    (gw,) = nnref.conv2d_grad_weight(x, y, **attrs, kernel=[3, 3])
    assert y.dtype == gx.dtype == gw.dtype == dtype
    assert gx.shape == x.shape and gw.shape == w.shape
    expect = naive_conv2d(x.astype(np.float64), w.astype(np.float64), **attrs)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(y, expect, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------
# Pooling.


def test_pool_sizes_follow_caffe_ceil_mode():
    assert pool_output_size(32, 3, 2, 0) == 16       # cifar_quick's pools: 32 -> 16 -> 8
    assert pool_output_size(16, 3, 2, 0) == 8
    assert pool_output_size(8, 3, 2, 0) == 4
    assert pool_output_size(55, 3, 2, 0) == 27       # AlexNet / NIN
    assert pool_output_size(24, 2, 2, 0) == 12       # LeNet
    assert pool_output_size(5, 3, 2, 1) == 3
    assert pool_output_size(6, 3, 3, 2) == 3         # the window at 9-2=7 would start past 6
    x = np.random.default_rng(0).standard_normal((1, 2, 32, 32)).astype(np.float32)
    for fn in (nnref.max_pool2d, nnref.avg_pool2d):
        (y,) = fn(x, kernel=[3, 3], stride=[2, 2], pad=[0, 0])
        assert y.shape == (1, 2, 16, 16) and y.dtype == np.float32


def test_pool_size_equals_caffe_literal_formula():
    for size in range(1, 12):
        for kernel in range(1, 5):
            for stride in range(1, 4):
                for pad in range(kernel):
                    for other_pad in (0, 1):
                        if caffe_pooled_size(size, kernel, stride, pad, True) < 1:
                            continue
                        any_pad = pad > 0 or other_pad > 0
                        if not any_pad and kernel < stride:
                            continue  # Caffe would make empty windows; purinec drops them
                        assert pool_output_size(size, kernel, stride, pad) == \
                            caffe_pooled_size(size, kernel, stride, pad, any_pad)


def test_registry_pool_shape_matches_reference():
    x = TensorType((2, 3, 7, 6), DType.f32)
    attrs = dict(kernel=[3, 2], stride=[2, 3], pad=[1, 1])
    (t,) = REGISTRY["max_pool2d"].infer([x], REGISTRY["max_pool2d"].complete_attrs(attrs))
    (y,) = nnref.max_pool2d(np.zeros(x.shape, np.float32), **attrs)
    assert t.shape == y.shape


@SETTINGS
@given(pool_cases())
def test_max_pool_matches_loops(case):
    x, attrs, _ = case
    (y,) = nnref.max_pool2d(x, **attrs)
    np.testing.assert_array_equal(y, naive_max_pool(x, **attrs))


@SETTINGS
@given(pool_cases(integers=True))
def test_max_pool_grad_routes_to_first_maximum(case):
    x, attrs, rng = case
    (y,) = nnref.max_pool2d(x, **attrs)
    gy = rng.standard_normal(y.shape)
    (gx,) = nnref.max_pool2d_grad(x, y, gy, **attrs)
    np.testing.assert_allclose(gx, naive_max_pool(x, **attrs, gy=gy), rtol=1e-12, atol=1e-12)


def test_max_pool_grad_ties_and_overlap():
    x = np.zeros((1, 1, 3, 3))
    gy = np.array([[[[1.0, 2.0], [3.0, 4.0]]]])
    (gx,) = nnref.max_pool2d_grad(x, np.zeros((1, 1, 2, 2)), gy, kernel=[2, 2],
                                  stride=[1, 1], pad=[0, 0])
    # Every window is all ties: each routes to its top-left element.
    np.testing.assert_array_equal(gx[0, 0], [[1, 2, 0], [3, 4, 0], [0, 0, 0]])
    # With padding, the top-left window is clipped to x[0:1, 0:1], even with negatives.
    x = -np.ones((1, 1, 2, 2))
    (y,) = nnref.max_pool2d(x, kernel=[2, 2], stride=[2, 2], pad=[1, 1])
    np.testing.assert_array_equal(y[0, 0], [[-1, -1], [-1, -1]])


def test_pooling_and_its_gradients_take_an_empty_batch():
    """A batch of 0 (a .pir file's, as the fuzzer wrote one) was a NumPy reshape error."""
    x = np.zeros((0, 2, 4, 4), np.float32)
    attrs = {"kernel": [2, 2], "stride": [2, 2], "pad": [0, 0]}
    (y,) = nnref.max_pool2d(x, **attrs)
    (gx,) = nnref.max_pool2d_grad(x, y, y, **attrs)
    (ga,) = nnref.avg_pool2d_grad(y, **attrs, input_shape=list(x.shape))
    assert y.shape == (0, 2, 2, 2) and gx.shape == ga.shape == x.shape


@SETTINGS
@given(pool_cases())
def test_max_pool_grad_is_the_derivative(case):
    x, attrs, rng = case
    (y,) = nnref.max_pool2d(x, **attrs)
    gy = rng.standard_normal(y.shape)
    (gx,) = nnref.max_pool2d_grad(x, y, gy, **attrs)
    num = numeric_grad(lambda z: np.sum(nnref.max_pool2d(z, **attrs)[0] * gy), x.copy())
    np.testing.assert_allclose(gx, num, rtol=1e-6, atol=1e-8)


@SETTINGS
@given(pool_cases(), st.booleans())
def test_avg_pool_matches_loops_and_grad_is_adjoint(case, count_include_pad):
    x, attrs, rng = case
    attrs = {**attrs, "count_include_pad": count_include_pad}
    (y,) = nnref.avg_pool2d(x, **attrs)
    np.testing.assert_allclose(y, naive_avg_pool(x, **attrs), rtol=1e-12, atol=1e-12)
    gy = rng.standard_normal(y.shape)
    (gx,) = nnref.avg_pool2d_grad(gy, **attrs, input_shape=list(x.shape))
    assert gx.shape == x.shape
    assert np.isclose(np.sum(y * gy), np.sum(x * gx), rtol=1e-10, atol=1e-12)


def test_avg_pool_divisor_at_borders():
    # 4x4 input, kernel 3, stride 2, pad 1 -> 3x3 windows starting at rows -1, 1, 3.
    # Per axis: [-1, 2) clipped to [0, 2): 2 of Caffe's 3; [1, 4): 3 of 3;
    # [3, min(6, 5)) = [3, 5) clipped to [3, 4): 1 of 2.
    x = np.ones((1, 1, 4, 4), np.float32)
    (y,) = nnref.avg_pool2d(x, kernel=[3, 3], stride=[2, 2], pad=[1, 1])
    per_axis = np.array([2 / 3, 1.0, 1 / 2])
    np.testing.assert_allclose(y[0, 0], np.outer(per_axis, per_axis), rtol=1e-6)
    assert y.dtype == np.float32
    # 3x3, kernel 3, stride 2, pad 1: both windows hold 2 of 3 rows and columns.
    (y,) = nnref.avg_pool2d(np.ones((1, 1, 3, 3)), kernel=[3, 3], stride=[2, 2],
                            pad=[1, 1])
    np.testing.assert_allclose(y[0, 0], np.full((2, 2), 4 / 9))


def test_floor_mode_and_asymmetric_pads():
    # 5 rows, kernel 2, stride 2: ceil mode has a last window hanging out, floor not.
    assert pool_output_size(5, 2, 2, 0, ceil_mode=False) == 2
    assert pool_output_size(5, 2, 2, 0) == 3
    # Pad 1 before, 0 after; dilation 2 makes a 3-tap window span 5.
    assert pool_output_size(7, 3, 1, 1, 0, dilation=2, ceil_mode=False) == 4
    x = np.arange(25.0).reshape(1, 1, 5, 5)
    (y,) = nnref.max_pool2d(x, kernel=[2, 2], stride=[2, 2], pad=[0, 0, 1, 1],
                            ceil_mode=False)
    # The pad after the input makes room for a third window, of one row or column.
    np.testing.assert_array_equal(y[0, 0], [[6, 8, 9], [16, 18, 19], [21, 23, 24]])


def test_pool_refuses_windows_of_padding_alone():
    x = TensorType((1, 1, 4, 4), DType.f32)
    op = REGISTRY["max_pool2d"]
    for attrs in ({"kernel": [2, 2], "pad": [2, 0]},                 # the first window
                  {"kernel": [2, 2], "pad": [0, 0, 2, 0], "ceil_mode": False},  # the last
                  {"kernel": [2, 2], "pad": [1, 0], "dilation": [5, 1]}):       # its taps skip x
        with pytest.raises(ShapeError, match="holds? only padding"):
            op.infer([x], op.complete_attrs(attrs))
    with pytest.raises(VerifyError, match="2 entries"):
        op.infer([x], op.complete_attrs({"kernel": [2, 2], "pad": [1, 1, 1]}))


# ONNX's reference evaluator as an independent oracle: (op, ONNX attributes), with pads
# in ONNX's order [top, left, bottom, right], which is purinec's too.
ONNX_CASES = [
    ("Conv", dict(strides=[2, 1], pads=[1, 0, 2, 1], dilations=[2, 1], group=2)),
    ("Conv", dict(pads=[0, 2, 1, 0], dilations=[2, 3])),
    ("MaxPool", dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 0, 1])),
    ("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1)),
    ("MaxPool", dict(kernel_shape=[2, 3], strides=[1, 2], pads=[1, 0, 2, 1], dilations=[2, 2])),
    ("MaxPool", dict(kernel_shape=[2, 2], strides=[2, 3], dilations=[2, 1], ceil_mode=1)),
    ("AveragePool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ("AveragePool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
                         count_include_pad=1)),
    ("AveragePool", dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 2, 1], ceil_mode=1)),
    ("AveragePool", dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 2, 1], ceil_mode=1,
                         count_include_pad=1)),
    # Ceil-mode windows hanging one column (row) out of the padded input, which the
    # divisor does not count even with count_include_pad (PyTorch's rule too).
    ("AveragePool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1,
                         count_include_pad=1)),
    ("AveragePool", dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1, count_include_pad=1)),
    ("AveragePool", dict(kernel_shape=[2, 2], strides=[1, 2], pads=[0, 1, 1, 0],
                         dilations=[2, 2], count_include_pad=1)),
    ("AveragePool", dict(kernel_shape=[2, 2], strides=[1, 2], pads=[2, 1, 1, 0],
                         dilations=[3, 2])),
]


def _purinec_attrs(op, onnx_attrs):
    attrs = {"stride": onnx_attrs.get("strides", [1, 1]), "pad": onnx_attrs.get("pads", [0] * 4),
             "dilation": onnx_attrs.get("dilations", [1, 1])}
    if op == "Conv":
        return {**attrs, "groups": onnx_attrs.get("group", 1)}
    attrs.update(kernel=onnx_attrs["kernel_shape"], ceil_mode=bool(onnx_attrs.get("ceil_mode")))
    if op == "AveragePool":
        attrs["count_include_pad"] = bool(onnx_attrs.get("count_include_pad"))
    return attrs


@pytest.mark.parametrize("op, onnx_attrs", ONNX_CASES)
def test_references_agree_with_onnx(op, onnx_attrs):
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 7, 8)).astype(np.float32)
    feeds, names = {"x": x}, ["x"]
    if op == "Conv":
        feeds["w"] = rng.standard_normal((6, 4 // onnx_attrs.get("group", 1), 3, 2)
                                         ).astype(np.float32)
        names.append("w")
    graph = helper.make_graph(
        [helper.make_node(op, names, ["y"], **onnx_attrs)], "one",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, feeds[n].shape) for n in names],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    (want,) = ReferenceEvaluator(model).run(None, feeds)
    name = {"Conv": "conv2d", "MaxPool": "max_pool2d", "AveragePool": "avg_pool2d"}[op]
    attrs = REGISTRY[name].complete_attrs(_purinec_attrs(op, onnx_attrs))
    (t,) = REGISTRY[name].infer([TensorType(v.shape, DType.f32) for v in feeds.values()], attrs)
    (got,) = REGISTRY[name].reference(*feeds.values(), **attrs)
    assert t.shape == got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# LRN.


@st.composite
def lrn_cases(draw):
    size = draw(st.sampled_from([1, 3, 5, 7]))
    c = draw(st.integers(1, 6))
    alpha = draw(st.sampled_from([1e-4, 0.3, 2.0]))
    beta = draw(st.sampled_from([0.75, 0.5, 1.3]))
    k = draw(st.sampled_from([1.0, 2.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = rng.standard_normal((2, c, 2, 3))
    return x, dict(size=size, alpha=alpha, beta=beta, k=k), rng


@SETTINGS
@given(lrn_cases())
def test_lrn_matches_loops(case):
    x, attrs, _ = case
    (y,) = nnref.lrn(x, **attrs)
    np.testing.assert_allclose(y, naive_lrn(x, **attrs), rtol=1e-12, atol=1e-14)


@SETTINGS
@given(lrn_cases())
def test_lrn_grad_is_the_derivative(case):
    x, attrs, rng = case
    gy = rng.standard_normal(x.shape)
    (gx,) = nnref.lrn_grad(x, gy, **attrs)
    num = numeric_grad(lambda z: np.sum(nnref.lrn(z, **attrs)[0] * gy), x.copy())
    np.testing.assert_allclose(gx, num, rtol=1e-6, atol=1e-8)


def test_lrn_keeps_float32():
    x = np.random.default_rng(1).standard_normal((1, 5, 2, 2)).astype(np.float32)
    attrs = dict(size=5, alpha=1e-4, beta=0.75, k=1.0)
    (y,) = nnref.lrn(x, **attrs)
    (gx,) = nnref.lrn_grad(x, x, **attrs)
    assert y.dtype == gx.dtype == np.float32
    np.testing.assert_allclose(y, naive_lrn(x.astype(np.float64), **attrs), rtol=1e-5)


# ---------------------------------------------------------------------------------------
# Dropout masks.

M64 = (1 << 64) - 1


def py_splitmix64(z):
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def py_dropout_mask(iteration, shape, p, seed):
    """The docstring's recipe in Python integers."""
    key = py_splitmix64(py_splitmix64(seed & M64) ^ (iteration & M64))
    out = []
    for i in range(int(np.prod(shape))):
        u = (py_splitmix64(key ^ i) >> 11) * 2.0 ** -53
        out.append(0.0 if u < p else 1.0 / (1.0 - p))
    return np.array(out).reshape(shape)


def test_splitmix64_known_values():
    # SplitMix64 seeded with 0: the generator's first output is the hash of 0.
    assert py_splitmix64(0) == 0xE220A8397B1DCDAF
    assert nnref.splitmix64(0) == 0xE220A8397B1DCDAF
    arr = nnref.splitmix64(np.array([0, 1, M64], dtype=np.uint64))
    assert [int(v) for v in arr] == [py_splitmix64(0), py_splitmix64(1), py_splitmix64(M64)]


@pytest.mark.parametrize("seed,iteration,p", [(0, 0, 0.5), (7, 123, 0.3), (-5, -1, 0.9),
                                              (2**40 + 3, 2**33, 0.1)])
def test_dropout_mask_follows_the_documented_hash(seed, iteration, p):
    (m,) = nnref.dropout_mask(np.array(iteration, np.int64), shape=[3, 7], p=p, seed=seed,
                              dtype="f64")
    np.testing.assert_array_equal(m, py_dropout_mask(iteration, (3, 7), p, seed))


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.8])
def test_dropout_mask_statistics(p):
    shape = [200, 500]
    (m,) = nnref.dropout_mask(np.array(3, np.int64), shape=shape, p=p, seed=42, dtype="f32")
    assert m.shape == tuple(shape) and m.dtype == np.float32
    keep = np.float32(1.0 / (1.0 - p))
    assert set(np.unique(m)) <= {np.float32(0), keep}
    n = m.size
    dropped = np.mean(m == 0)
    assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-12
    assert abs(m.mean() - 1.0) < 0.02                  # an unbiased mask


def test_dropout_mask_determinism_and_iteration():
    def mask(it, seed=1, dtype="f32"):
        return nnref.dropout_mask(np.array(it, np.int32), shape=[64, 64], p=0.5, seed=seed,
                                  dtype=dtype)[0]
    np.testing.assert_array_equal(mask(5), mask(5))
    assert not np.array_equal(mask(5), mask(6))
    assert not np.array_equal(mask(5), mask(5, seed=2))
    assert mask(5, dtype="f64").dtype == np.float64
    np.testing.assert_array_equal(mask(5) == 0, mask(5, dtype="f64") == 0)
    # Neighbouring elements and iterations are not correlated in an obvious way.
    a, b = (mask(5) > 0).ravel(), (mask(6) > 0).ravel()
    assert 0.4 < np.mean(a == b) < 0.6
    assert 0.4 < np.mean(a[1:] == a[:-1]) < 0.6


def test_dropout_mask_via_registry():
    op = REGISTRY["dropout_mask"]
    attrs = op.complete_attrs({"shape": [4, 5], "p": 0.25})
    (m,) = op.reference(np.array(0, np.int64), **attrs)
    (t,) = op.infer([TensorType((), DType.i64)], attrs)
    assert m.shape == t.shape and m.dtype == t.dtype.numpy
