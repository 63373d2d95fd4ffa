"""Simulator cases: sums over axes, softmax, log_softmax and the losses (see
`tests.on_cuda.simulate`). Some rows are longer than a block (`REDUCE_THREADS`), so
its threads take several elements each."""

import numpy as np

from tests.on_cuda.simulate import random_array as R


def _sum(shape, axes, keepdims=False, dtype="float32"):
    return lambda rng: ("reduce_sum", [R(rng, shape, dtype)],
                        {"axes": list(axes), "keepdims": keepdims})


def _labels(rng, rows, classes):
    return rng.integers(0, classes, rows).astype(np.int32)


def _logits(op, rows, classes, dtype="float32", scalar_gradient=False):
    def case(rng):
        inputs = [R(rng, (rows, classes), dtype), _labels(rng, rows, classes)]
        if scalar_gradient:
            inputs.append(R(rng, (), dtype))
        return op, inputs, {}
    return case


def _tied_accuracy(rng):
    """Integer-valued logits: rows often hold their largest logit twice, and the first
    one counts."""
    logits = rng.integers(0, 3, (9, 4)).astype(np.float32)
    return "accuracy", [logits, _labels(rng, 9, 4)], {}


CASES = {
    "reduce_sum_axis0": _sum((5, 2, 4), [0]),
    "reduce_sum_bias_grad_keepdims": _sum((2, 3, 5, 7), [0, 2, 3], keepdims=True),
    "reduce_sum_bias_grad": _sum((2, 3, 5, 7), [0, 2, 3]),
    "reduce_sum_last_axis_long_rows": _sum((3, 300), [1], dtype="float64"),
    "reduce_sum_last_axis_keepdims": _sum((2, 2, 6), [2], keepdims=True),
    "reduce_sum_middle_with_ones": _sum((2, 1, 3, 4), [1, 2]),
    "reduce_sum_everything": _sum((3, 4), [0, 1]),
    "reduce_sum_int32": _sum((4, 5, 6), [1, 2], dtype="int32"),
    "softmax_last_axis": lambda rng: ("softmax", [R(rng, (4, 10), "float32")], {"axis": 1}),
    "softmax_long_rows_f64": lambda rng: ("softmax", [R(rng, (2, 300), "float64", -30, 30)],
                                          {"axis": 1}),
    "softmax_axis1_of_4d": lambda rng: ("softmax", [R(rng, (2, 3, 2, 2), "float32")],
                                        {"axis": 1}),
    "softmax_grad_last_axis": lambda rng: ("softmax_grad", [R(rng, (4, 10), "float32"),
                                                            R(rng, (4, 10), "float32")],
                                           {"axis": 1}),
    "softmax_grad_axis1_of_4d": lambda rng: ("softmax_grad",
                                             [R(rng, (2, 3, 2, 2), "float32"),
                                              R(rng, (2, 3, 2, 2), "float32")], {"axis": 1}),
    "log_softmax_last_axis": lambda rng: ("log_softmax", [R(rng, (4, 10), "float32")],
                                          {"axis": 1}),
    "log_softmax_long_rows_f64": lambda rng: ("log_softmax",
                                              [R(rng, (2, 300), "float64", -30, 30)],
                                              {"axis": 1}),
    "log_softmax_axis1_of_4d": lambda rng: ("log_softmax", [R(rng, (2, 3, 2, 2), "float32")],
                                            {"axis": 1}),
    "log_softmax_grad_last_axis": lambda rng: ("log_softmax_grad",
                                               [R(rng, (4, 10), "float32", -5, 0),
                                                R(rng, (4, 10), "float32")], {"axis": 1}),
    "log_softmax_grad_axis1_of_4d": lambda rng: ("log_softmax_grad",
                                                 [R(rng, (2, 3, 2, 2), "float32", -5, 0),
                                                  R(rng, (2, 3, 2, 2), "float32")],
                                                 {"axis": 1}),
    "softmax_xent": _logits("softmax_xent", 4, 10),
    "softmax_xent_long_rows_f64": _logits("softmax_xent", 3, 200, "float64"),
    "softmax_xent_grad": _logits("softmax_xent_grad", 4, 10, scalar_gradient=True),
    "softmax_xent_grad_long_rows": _logits("softmax_xent_grad", 3, 200,
                                           scalar_gradient=True),
    "accuracy": _logits("accuracy", 7, 5),
    "accuracy_ties": _tied_accuracy,
    "accuracy_more_rows_than_threads_f64": _logits("accuracy", 300, 3, "float64"),
}
