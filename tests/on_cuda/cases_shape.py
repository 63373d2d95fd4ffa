"""Simulator cases: reshape, concat and split (see `tests.on_cuda.simulate`)."""

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
