"""Simulator cases: reshape, concat, split, transpose, strided slices and pads (see
`tests.on_cuda.simulate`)."""

from tests.on_cuda.simulate import random_array as R


def _concat(shapes, axis, dtype="float32"):
    return lambda rng: ("concat", [R(rng, s, dtype) for s in shapes], {"axis": axis})


def _split(shape, axis, sections, dtype="float32"):
    return lambda rng: ("split", [R(rng, shape, dtype)], {"axis": axis,
                                                          "sections": list(sections)})


CASES = {
    "reshape": lambda rng: ("reshape", [R(rng, (2, 3, 5), "float32")], {"shape": [6, 5]}),
    "reshape_int32_to_flat": lambda rng: ("reshape", [R(rng, (2, 3, 5), "int32")],
                                          {"shape": [30]}),
    "concat_channels": _concat([(2, 3, 5), (2, 1, 5), (2, 2, 5)], 1),
    "concat_batch": _concat([(2, 3), (1, 3)], 0, "int32"),
    "concat_last_axis_f64": _concat([(2, 3, 2), (2, 3, 4)], 2, "float64"),
    "split_channels": _split((2, 4, 5), 1, [3, 1]),
    "split_batch_int32": _split((5, 3), 0, [2, 2, 1], "int32"),
    "split_last_axis": _split((2, 3, 6), 2, [1, 5]),
}


def _one(op, shape, attrs, dtype="float32"):
    return lambda rng: (op, [R(rng, shape, dtype)], attrs)


CASES.update({
    "transpose_3d": _one("transpose", (2, 3, 4), {"perm": [2, 0, 1]}),
    "transpose_int32": _one("transpose", (3, 5), {"perm": [1, 0]}, "int32"),
    "strided_slice": _one("strided_slice", (5, 4, 3), {"starts": [1, 3, 0],
                                                       "steps": [2, -1, 1], "sizes": [2, 3, 3]}),
    "strided_slice_grad": _one("strided_slice_grad", (2, 3), {"input_shape": [5, 6],
                                                              "starts": [4, 0],
                                                              "steps": [-3, 2]}),
    "pad_constant": _one("pad", (2, 3), {"pads": [1, 0, 2, 1], "value": -1.5}),
    "pad_constant_int64_0d": _one("pad", (), {"pads": [], "value": 3.0}, "int64"),
    "pad_reflect": _one("pad", (3, 4), {"pads": [2, 1, 1, 3], "mode": "reflect"}),
    "pad_edge_f64": _one("pad", (2, 3), {"pads": [3, 0, 1, 2], "mode": "edge"}, "float64"),
    "pad_grad_reflect": _one("pad_grad", (6, 8), {"pads": [2, 1, 1, 3], "mode": "reflect",
                                                  "input_shape": [3, 4]}),
    "pad_grad_edge": _one("pad_grad", (2, 5, 6), {"pads": [0, 3, 0, 0, 0, 2], "mode": "edge",
                                                  "input_shape": [2, 2, 4]}),
})
