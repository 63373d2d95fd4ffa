"""Simulator cases: matrix products, convolutions and their epilogues (see
`tests.on_cuda.simulate`), in the tiled form and through cuBLAS's calls. Sizes are tiny,
as the simulator runs each thread as a Python thread, and none is a multiple of the
kernels' 16x16 tiles."""

from purinec.ir.nnref import conv_output_size, pad_edges
from tests.on_cuda.cases_elementwise import fused_case
from tests.on_cuda.simulate import random_array as R


def _matmul(m, n, k, trans_a, trans_b, dtype):
    a_shape = (k, m) if trans_a else (m, k)
    b_shape = (n, k) if trans_b else (k, n)
    return lambda rng: ("matmul", [R(rng, a_shape, dtype), R(rng, b_shape, dtype)],
                        {"trans_a": trans_a, "trans_b": trans_b})


# Convolution problems: (input shape, weight shape, stride, pad, groups, dtype, dilation);
# pad is [ph, pw] or [top, left, bottom, right].
CONVOLUTIONS = {
    "stride2_pad1": ((2, 3, 7, 5), (4, 3, 3, 3), 2, [1, 1], 1, "float32", [1, 1]),
    "groups2": ((1, 4, 5, 6), (6, 2, 3, 3), 1, [1, 1], 2, "float32", [1, 1]),
    "1x1": ((2, 3, 4, 5), (5, 3, 1, 1), 1, [0, 0], 1, "float64", [1, 1]),
    # ONNX-style: dilated taps, uneven padding; strided, and grouped with stride 1.
    "dilated_uneven_pad_stride2": ((1, 3, 8, 7), (4, 3, 3, 2), 2, [2, 0, 1, 3], 1, "float32",
                                   [2, 3]),
    "dilated_uneven_pad_groups2": ((2, 4, 6, 5), (4, 2, 2, 3), 1, [0, 2, 1, 1], 2, "float64",
                                   [2, 1]),
}


def _output_shape(x, w, stride, pad, dilation):
    top, left, bottom, right = pad_edges(pad)
    return (x[0], w[0], conv_output_size(x[2], w[2], stride, top, bottom, dilation[0]),
            conv_output_size(x[3], w[3], stride, left, right, dilation[1]))


def _conv_cases(name, problem):
    x, w, stride, pad, groups, dtype, dilation = problem
    y = _output_shape(x, w, stride, pad, dilation)
    attrs = {"stride": [stride, stride], "pad": pad, "groups": groups, "dilation": dilation}
    return {
        f"conv2d_{name}": lambda rng: ("conv2d", [R(rng, x, dtype), R(rng, w, dtype)], attrs),
        f"conv2d_grad_input_{name}": lambda rng: (
            "conv2d_grad_input", [R(rng, y, dtype), R(rng, w, dtype)],
            {**attrs, "input_shape": list(x)}),
        f"conv2d_grad_weight_{name}": lambda rng: (
            "conv2d_grad_weight", [R(rng, x, dtype), R(rng, y, dtype)],
            {**attrs, "kernel": list(w[2:])}),
    }




CONV = {"stride": [1, 1], "pad": [1, 1], "groups": 1}

CASES = {
    "matmul_nn_5x7x19_f32": _matmul(5, 7, 19, False, False, "float32"),
    "matmul_nt_33x9x17_f64": _matmul(33, 9, 17, False, True, "float64"),
    "matmul_tn_33x9x17_f32": _matmul(33, 9, 17, True, False, "float32"),
    "matmul_tt_5x7x19_f64": _matmul(5, 7, 19, True, True, "float64"),
    # The convolution's output is not exported: it lives only in a register.
    "fused_conv2d_bias_add_relu": fused_case([[("x", (2, 3, 6, 5)), ("w", (4, 3, 3, 3)),
                                               ("b", (4,))],
                                              ("conv2d", ["x", "w"], CONV),
                                              ("bias_add", ["o0", "b"], {"axis": 1}),
                                              ("relu", ["o1"], {})]),
    # Grouped and strided, with an epilogue reading a full-size input.
    "fused_conv2d_add_relu": fused_case([[("x", (1, 4, 7, 6)), ("w", (6, 2, 3, 3)),
                                          ("r", (1, 6, 4, 3))],
                                         ("conv2d", ["x", "w"],
                                          {"stride": [2, 2], "pad": [1, 1], "groups": 2}),
                                         ("add", ["o0", "r"], {}), ("relu", ["o1"], {})]),
    # The product is exported as well as the epilogue's outputs.
    "fused_matmul_bias_add_relu": fused_case([[("a", (6, 19)), ("b", (19, 5)), ("c", (5,))],
                                              ("matmul", ["a", "b"], {}),
                                              ("bias_add", ["o0", "c"], {"axis": 1}),
                                              ("relu", ["o1"], {})], export_all=True),
}
for _name, _problem in CONVOLUTIONS.items():
    CASES.update(_conv_cases(_name, _problem))
# Each again with its product through cuBLAS's calls (the simulator's stand-in), and the
# convolutions of two images in chunks of one.
CASES.update({f"{name}@cublas": case for name, case in list(CASES.items())})
CASES.update({f"{name}@cublas-chunked": case for name, case in list(CASES.items())
              if name.startswith(("conv2d", "fused_conv2d")) and "@" not in name})
