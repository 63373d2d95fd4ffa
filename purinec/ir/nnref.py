"""NumPy references of the convolution, pooling, LRN and dropout ops.

These are the oracles generated kernels are tested against, so they are written for
clarity first: a loop over kernel offsets (or pooling windows) with whole-array NumPy
slices inside. Every function takes the op's input arrays positionally and its
attributes by keyword, and returns a tuple of output arrays. Outputs have the dtype of
the (first float) input; arithmetic happens in that dtype.

Layouts: activations are NCHW, convolution weights OIHW, i.e. ``(Cout, Cin/groups, kh,
kw)``. A ``pad`` attribute has 2 entries ``[ph, pw]`` (both sides alike) or 4, ONNX's
``[top, left, bottom, right]`` (`pad_edges`); ``dilation`` spaces a window's taps
(`window_extent`). Pooling defaults to Caffe's semantics (ceil-mode output size from
`pool_output_size`, max windows clipped to the input, Caffe's average-pool divisor);
``ceil_mode`` and ``count_include_pad`` give ONNX's others (`pool_axis`).
"""

from __future__ import annotations

import math

import numpy as np

# ---------------------------------------------------------------------------------------
# Convolution.


def pad_edges(pad) -> tuple[int, int, int, int]:
    """``pad`` as ``(top, left, bottom, right)``: 2 entries ``[ph, pw]`` pad both sides
    of an axis alike; 4 are ONNX's order, ``[top, left, bottom, right]``."""
    top, left, bottom, right = pad if len(pad) == 4 else (*pad, *pad)
    return top, left, bottom, right


def window_extent(kernel: int, dilation: int) -> int:
    """The span of a window of ``kernel`` taps, ``dilation`` apart."""
    return dilation * (kernel - 1) + 1


def _pad_hw(x, pad):
    top, left, bottom, right = pad_edges(pad)
    return np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))


def _grouped(a, groups):
    """(N, C, H, W) -> (N, groups, C/groups, H, W)."""
    n, c, h, w = a.shape
    return a.reshape(n, groups, c // groups, h, w)


def _window(a, i, j, oh, ow, sh, sw):
    """``a[..., i + sh*p, j + sw*q]`` for p < oh, q < ow: one kernel offset's view."""
    return a[..., i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw]


def _conv_output(x_shape, kernel, stride, pad, dilation) -> tuple[int, int]:
    top, left, bottom, right = pad_edges(pad)
    return (conv_output_size(x_shape[2], kernel[0], stride[0], top, bottom, dilation[0]),
            conv_output_size(x_shape[3], kernel[1], stride[1], left, right, dilation[1]))


def conv2d(x, w, stride, pad, groups, dilation=(1, 1)):
    """Cross-correlation with zero padding:
    ``y[n, o, p, q] = sum_{c, i, j} w[o, c, i, j] * xpad[n, g*Cin_g + c, sh*p + dh*i, sw*q + dw*j]``
    where ``g = o // (Cout/groups)`` and ``xpad`` is x with its top and left padding
    before it."""
    (sh, sw), (dh, dw) = stride, dilation
    n = x.shape[0]
    cout, _, kh, kw = w.shape
    oh, ow = _conv_output(x.shape, (kh, kw), stride, pad, dilation)
    xg = _grouped(_pad_hw(x, pad), groups)                         # n g c H W
    wg = w.reshape(groups, cout // groups, *w.shape[1:])           # g o c kh kw
    y = np.zeros((n, groups, cout // groups, oh, ow), dtype=x.dtype)
    for i in range(kh):
        for j in range(kw):
            y += np.einsum("goc,ngcpq->ngopq", wg[:, :, :, i, j],
                           _window(xg, dh * i, dw * j, oh, ow, sh, sw))
    return (y.reshape(n, cout, oh, ow),)


def conv2d_grad_input(gy, w, stride, pad, groups, input_shape, dilation=(1, 1)):
    """The adjoint of `conv2d` in x: scatter ``w * gy`` back over every window, crop
    the padding. Input rows/columns no window reaches get zero."""
    (sh, sw), (dh, dw) = stride, dilation
    top, left, bottom, right = pad_edges(pad)
    n, cin, h, wd = input_shape
    cout, _, kh, kw = w.shape
    oh, ow = gy.shape[2:]
    hp, wp = h + top + bottom, wd + left + right
    gxp = np.zeros((n, groups, cin // groups, hp, wp), dtype=gy.dtype)
    gyg = _grouped(gy, groups)                                     # n g o p q
    wg = w.reshape(groups, cout // groups, *w.shape[1:])           # g o c kh kw
    for i in range(kh):
        for j in range(kw):
            _window(gxp, dh * i, dw * j, oh, ow, sh, sw)[...] += np.einsum(
                "goc,ngopq->ngcpq", wg[:, :, :, i, j], gyg)
    gxp = gxp.reshape(n, cin, hp, wp)
    return (np.ascontiguousarray(gxp[:, :, top:top + h, left:left + wd]),)


def conv2d_grad_weight(x, gy, stride, pad, groups, kernel, dilation=(1, 1)):
    """The gradient of `conv2d` in w: ``gw[o, c, i, j] = sum_{n, p, q} gy[n, o, p, q] *
    xpad[n, g*Cin_g + c, sh*p + dh*i, sw*q + dw*j]``."""
    (sh, sw), (dh, dw) = stride, dilation
    kh, kw = kernel
    n, cin, _, _ = x.shape
    cout, oh, ow = gy.shape[1:]
    xg = _grouped(_pad_hw(x, pad), groups)                         # n g c H W
    gyg = _grouped(gy, groups)                                     # n g o p q
    gw = np.zeros((groups, cout // groups, cin // groups, kh, kw), dtype=x.dtype)
    for i in range(kh):
        for j in range(kw):
            gw[:, :, :, i, j] = np.einsum("ngopq,ngcpq->goc", gyg,
                                          _window(xg, dh * i, dw * j, oh, ow, sh, sw))
    return (gw.reshape(cout, cin // groups, kh, kw),)


# ---------------------------------------------------------------------------------------
# Pooling (Caffe's semantics by default, ONNX's through ceil_mode and count_include_pad).


def pool_output_size(size: int, kernel: int, stride: int, pad: int, pad_end: int | None = None,
                     dilation: int = 1, ceil_mode: bool = True) -> int:
    """The number of windows along an axis padded by ``pad`` before and ``pad_end``
    (``pad`` by default) after. Caffe's ceil mode (the default; ONNX's ``ceil_mode=1``
    and PyTorch's agree) lets the last window hang out of the padded input as long as
    it starts inside the input or its leading pad; without it, windows fit the padded
    input (ONNX's default)."""
    pad_end = pad if pad_end is None else pad_end
    room = size + pad + pad_end - window_extent(kernel, dilation)
    if not ceil_mode:
        return room // stride + 1
    out = -(-room // stride) + 1
    # Caffe tests this only when some pad is nonzero; without pad it can fire only when
    # kernel < stride, where Caffe's last window would be empty (and its average 0/0).
    if (out - 1) * stride >= size + pad:
        out -= 1
    return out


def conv_output_size(size: int, kernel: int, stride: int, pad: int, pad_end: int | None = None,
                     dilation: int = 1) -> int:
    """The number of windows along an axis padded by ``pad`` before and ``pad_end``
    (``pad`` by default) after: every window fits the padded input."""
    pad_end = pad if pad_end is None else pad_end
    return (size + pad + pad_end - window_extent(kernel, dilation)) // stride + 1


def pool_axis(size: int, kernel: int, stride: int, pad: int, pad_end: int, dilation: int,
              ceil_mode: bool) -> list[tuple[np.ndarray, int]]:
    """Per window along one axis: the indices of its taps inside the input, and how
    many of its taps lie inside the padded input ``[-pad, size + pad_end)``. (A
    ceil-mode window can hang out of that too: Caffe does not count what does.)"""
    windows = []
    for p in range(pool_output_size(size, kernel, stride, pad, pad_end, dilation, ceil_mode)):
        taps = p * stride - pad + dilation * np.arange(kernel)
        windows.append((taps[(taps >= 0) & (taps < size)], int(np.sum(taps < size + pad_end))))
    return windows


def pool_divisors(size: int, kernel: int, stride: int, pad: int, pad_end: int, dilation: int,
                  ceil_mode: bool, count_include_pad: bool) -> list[int]:
    """Per window along one axis, its factor of the average's divisor: its taps inside
    the padded input with ``count_include_pad``, else inside the input."""
    return [padded if count_include_pad else len(taps)
            for taps, padded in pool_axis(size, kernel, stride, pad, pad_end, dilation,
                                          ceil_mode)]


def _pool_windows(h, w, kernel, stride, pad, dilation, ceil_mode, count_include_pad):
    """Yield ``(p, q, rows, cols, divisor)`` per output position: the input rows and
    columns of its taps (each window is their product) and its average's divisor,
    the taps inside the padded input (Caffe's; ``count_include_pad``) or the input."""
    top, left, bottom, right = pad_edges(pad)
    axes = ((h, kernel[0], stride[0], top, bottom, dilation[0], ceil_mode),
            (w, kernel[1], stride[1], left, right, dilation[1], ceil_mode))
    (rows, cols), (row_divisors, col_divisors) = (
        [pool_axis(*axis) for axis in axes],
        [pool_divisors(*axis, count_include_pad) for axis in axes])
    for p, (r, _) in enumerate(rows):
        for q, (c, _) in enumerate(cols):
            yield p, q, r[:, None], c[None, :], row_divisors[p] * col_divisors[q]


def _pool_out(x, kernel, stride, pad, dilation, ceil_mode):
    top, left, bottom, right = pad_edges(pad)
    n, c, h, w = x.shape
    oh = pool_output_size(h, kernel[0], stride[0], top, bottom, dilation[0], ceil_mode)
    ow = pool_output_size(w, kernel[1], stride[1], left, right, dilation[1], ceil_mode)
    return np.zeros((n, c, oh, ow), dtype=x.dtype)


def max_pool2d(x, kernel, stride, pad, dilation=(1, 1), ceil_mode=True):
    """Max over each window's taps inside the input (padding is never the maximum)."""
    y = _pool_out(x, kernel, stride, pad, dilation, ceil_mode)
    for p, q, rows, cols, _ in _pool_windows(*x.shape[2:], kernel, stride, pad, dilation,
                                             ceil_mode, True):
        y[:, :, p, q] = x[:, :, rows, cols].max(axis=(2, 3))
    return (y,)


def max_pool2d_grad(x, y, gy, kernel, stride, pad, dilation=(1, 1), ceil_mode=True):
    """Route each ``gy`` to the first maximum (row-major among the window's taps inside
    the input) of its window, as Caffe's forward pass records it; overlapping windows
    accumulate. ``y`` is accepted for the op's signature; the argmax is recomputed
    from ``x``."""
    n, c, h, w = x.shape
    gx = np.zeros_like(x)
    nn, cc = np.meshgrid(np.arange(n), np.arange(c), indexing="ij")
    for p, q, rows, cols, _ in _pool_windows(h, w, kernel, stride, pad, dilation,
                                             ceil_mode, True):
        # (The window's size, not -1, which is ambiguous for an empty batch.)
        win = x[:, :, rows, cols].reshape(n, c, rows.size * cols.size)
        k = win.argmax(axis=2)                       # the first maximum, row-major
        np.add.at(gx, (nn, cc, rows[k // cols.size, 0], cols[0, k % cols.size]),
                  gy[:, :, p, q])
    return (gx,)


def avg_pool2d(x, kernel, stride, pad, dilation=(1, 1), ceil_mode=True,
               count_include_pad=True):
    """Sum over each window's taps inside the input, divided by the number of its taps
    inside the padded input (Caffe's pool size, by default) or, without
    ``count_include_pad``, inside the input."""
    y = _pool_out(x, kernel, stride, pad, dilation, ceil_mode)
    for p, q, rows, cols, size in _pool_windows(*x.shape[2:], kernel, stride, pad, dilation,
                                                ceil_mode, count_include_pad):
        y[:, :, p, q] = x[:, :, rows, cols].sum(axis=(2, 3)) / x.dtype.type(size)
    return (y,)


def avg_pool2d_grad(gy, kernel, stride, pad, input_shape, dilation=(1, 1), ceil_mode=True,
                    count_include_pad=True):
    """The adjoint of `avg_pool2d`: each ``gy / divisor`` spread over its window's taps
    inside the input; overlapping windows accumulate."""
    gx = np.zeros(input_shape, dtype=gy.dtype)
    for p, q, rows, cols, size in _pool_windows(*input_shape[2:], kernel, stride, pad,
                                                dilation, ceil_mode, count_include_pad):
        gx[:, :, rows, cols] += (gy[:, :, p, q] / gy.dtype.type(size))[:, :, None, None]
    return (gx,)


# ---------------------------------------------------------------------------------------
# Local response normalisation (Caffe's ACROSS_CHANNELS).


def _channel_window_sum(a, size):
    """``s[:, c] = sum of a[:, c']`` for ``|c' - c| <= (size-1)/2``, clipped to [0, C)."""
    half = (size - 1) // 2
    c = a.shape[1]
    s = np.zeros_like(a)
    for d in range(-half, half + 1):
        lo, hi = max(0, -d), min(c, c - d)           # c in [lo, hi) has c + d in [0, C)
        if lo < hi:
            s[:, lo:hi] += a[:, lo + d:hi + d]
    return s


def _lrn_scale(x, size, alpha, k):
    t = x.dtype.type
    return t(k) + t(alpha / size) * _channel_window_sum(x * x, size)


def lrn(x, size, alpha, beta, k):
    """``y = x * scale^-beta``, ``scale_c = k + alpha/size * sum_{|c'-c| <= (size-1)/2} x_c'^2``."""
    scale = _lrn_scale(x, size, alpha, k)
    return (x * scale ** x.dtype.type(-beta),)


def lrn_grad(x, gy, size, alpha, beta, k):
    """Exact derivative of `lrn` (the window is symmetric, so its transpose is itself):
    ``gx_j = gy_j * scale_j^-beta
    - 2*alpha*beta/size * x_j * sum_{|c-j| <= half} gy_c * x_c * scale_c^(-beta-1)``."""
    t = x.dtype.type
    scale = _lrn_scale(x, size, alpha, k)
    inner = _channel_window_sum(gy * x * scale ** t(-beta - 1), size)
    return (gy * scale ** t(-beta) - t(2 * alpha * beta / size) * x * inner,)


# ---------------------------------------------------------------------------------------
# Dropout masks from a counter-based hash.

_M64 = 0xFFFFFFFFFFFFFFFF
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def splitmix64(z):
    """SplitMix64's output function on uint64 (NumPy arrays wrap modulo 2^64):
    ``z += 0x9E3779B97F4A7C15; z = (z ^ z>>30) * 0xBF58476D1CE4E5B9;
    z = (z ^ z>>27) * 0x94D049BB133111EB; return z ^ z>>31``.
    Accepts a Python int (returns an int) or a uint64 array."""
    if isinstance(z, (int, np.integer)):
        z = (int(z) + _GOLDEN) & _M64
        z = ((z ^ (z >> 30)) * _MIX1) & _M64
        z = ((z ^ (z >> 27)) * _MIX2) & _M64
        return z ^ (z >> 31)
    u = np.uint64
    with np.errstate(over="ignore"):
        z = z + u(_GOLDEN)
        z = (z ^ (z >> u(30))) * u(_MIX1)
        z = (z ^ (z >> u(27))) * u(_MIX2)
        return z ^ (z >> u(31))


def dropout_key(seed: int, iteration: int) -> int:
    """The per-draw key: ``splitmix64(splitmix64(seed) ^ iteration)``, seed and
    iteration taken modulo 2^64 (two's complement for negatives)."""
    return splitmix64(splitmix64(int(seed) & _M64) ^ (int(iteration) & _M64))


def dropout_mask(iteration, shape, p, seed, dtype):
    """A dropout mask of ``shape``: 0 with probability ``p``, else ``1/(1-p)``.

    The exact recipe, which every backend reproduces bit for bit (all arithmetic on
    uint64, wrapping modulo 2^64)::

        key  = splitmix64(splitmix64(seed) ^ iteration)
        h[i] = splitmix64(key ^ i)                  # i: flat C-order element index
        u[i] = (h[i] >> 11) * 2**-53                # float64 in [0, 1), exact
        mask[i] = 0 if u[i] < p else dtype(1.0 / (1.0 - p))   # quotient in float64

    with ``splitmix64(z)`` as in `splitmix64`. ``u < p`` is the same test as the
    integer comparison ``(h >> 11) < ceil(p * 2**53)``. ``iteration`` is a 0-d integer
    array (the program's iteration counter); ``dtype`` an IR dtype name such as "f32".
    """
    from purinec.ir.types import DType

    np_dtype = DType(dtype).numpy
    size = math.prod(shape)
    key = np.uint64(dropout_key(seed, int(np.asarray(iteration))))
    h = splitmix64(np.arange(size, dtype=np.uint64) ^ key)
    u = (h >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    keep = np_dtype.type(1.0 / (1.0 - p))
    mask = np.where(u < p, np_dtype.type(0), keep).astype(np_dtype)
    return (mask.reshape(tuple(shape)),)
