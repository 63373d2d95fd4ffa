"""Simulator cases: elementwise and broadcast ops (see `tests.on_cuda.simulate`)."""

from tests.on_cuda.simulate import random_array as R


def _unary(op, attrs=None, dtype="float32", shape=(3, 5, 7)):
    return lambda rng: (op, [R(rng, shape, dtype)], attrs or {})


def _binary(op, dtype="float32", shape=(2, 3, 4)):
    return lambda rng: (op, [R(rng, shape, dtype), R(rng, shape, dtype)], {})


CASES = {
    "relu": _unary("relu"),
    "sigmoid": _unary("sigmoid"),
    "tanh": _unary("tanh", dtype="float64"),
    "scale": _unary("scale", {"alpha": 0.37}),
    "add_scalar_int": _unary("add_scalar", {"value": 3}, dtype="int32"),
    "cast_f32_to_i32": _unary("cast", {"dtype": "i32"}),
    "add": _binary("add"),
    "sub": _binary("sub", dtype="float64"),
    "mul_int": _binary("mul", dtype="int32"),
    "relu_grad": _binary("relu_grad"),
    "sigmoid_grad": _binary("sigmoid_grad"),
    "tanh_grad": _binary("tanh_grad"),
    "bias_add_nchw": lambda rng: ("bias_add", [R(rng, (2, 3, 4, 5), "float32"),
                                               R(rng, (3,), "float32")], {"axis": 1}),
    "broadcast_to": lambda rng: ("broadcast_to", [R(rng, (3, 1), "float32")],
                                 {"shape": [2, 3, 4]}),
    "global_avg_pool_grad": lambda rng: ("global_avg_pool_grad",
                                         [R(rng, (2, 3, 1, 1), "float32")],
                                         {"input_shape": [2, 3, 4, 4]}),
    "fill": lambda rng: ("fill", [], {"shape": [4, 5], "dtype": "f32", "value": 1.5}),
    "dropout_mask": lambda rng: ("dropout_mask", [R(rng, (), "int64")],
                                 {"shape": [6, 7], "p": 0.3, "seed": 11, "dtype": "f32"}),
    "sgd": lambda rng: ("sgd", [R(rng, (5, 6), "float32") for _ in range(3)],
                        {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
}


def fused_case(members, export_all: bool = False):
    """A case: the fused graph of ``members``: first the inputs, (name, shape) of f32;
    then (op, input names, attrs) in order, their outputs named o0, o1... The graph
    returns the last output, or with ``export_all`` every one (so a fused node exports
    its anchor's output too)."""
    def case(rng):
        from purinec.ir.graph import Graph
        from purinec.ir.types import Device, DType, TensorType
        from purinec.passes.fuse import fuse

        graph = Graph("t")
        values = {}
        for name, shape in members[0]:
            values[name] = graph.add_input(name, TensorType(shape, DType.f32),
                                           device=Device.parse("gpu:0"))
        for k, (op, names, attrs) in enumerate(members[1:]):
            (values[f"o{k}"],) = graph.add_node(op, [values[n] for n in names], attrs,
                                                names=[f"o{k}"]).outputs
        last = len(members) - 2
        graph.outputs = [(f"y{k}", values[f"o{k}"])
                         for k in (range(last + 1) if export_all else [last])]
        return fuse(graph)
    return case


def horizontal_sgd(rng):
    """Two parameters' SGD updates fused horizontally (members of several shapes)."""
    from purinec.ir.graph import Graph
    from purinec.ir.types import Device, DType, TensorType

    graph = Graph("t")
    gpu0 = Device("gpu", 0)
    outputs = []
    for name, shape in (("a", (5, 3)), ("b", (7,))):
        w, g, h = (graph.add_input(f"{name}.{part}", TensorType(shape, DType.f32), gpu0)
                   for part in ("w", "g", "h"))
        node = graph.add_node("sgd", [w, g, h], {"lr": 0.1, "momentum": 0.9,
                                                 "weight_decay": 0.01})
        outputs += [(f"{name}{k}", v) for k, v in enumerate(node.outputs)]
    body = list(graph.nodes)
    graph.nodes = []
    graph.add_fused(body, [v for n in body for v in n.inputs], [v for _, v in outputs],
                    "fused_sgd_x2")
    graph.outputs = outputs
    return graph


CASES.update({
    "fused_horizontal_sgd": horizontal_sgd,
    "fused_loop": fused_case([[("x", (4, 3, 5)), ("b", (3,))],
                          ("bias_add", ["x", "b"], {"axis": 1}), ("relu", ["o0"], {}),
                          ("scale", ["o1"], {"alpha": 2.0})]),
})

# ONNX's arithmetic and activations and their gradients (log, sqrt and pow on positive
# inputs; the kinked ones across their kinks).


def _on(op, arity, low, high, attrs=None, dtype="float32", shape=(3, 4)):
    return lambda rng: (op, [R(rng, shape, dtype, low, high) for _ in range(arity)],
                        attrs or {})


CASES.update({
    "neg": _on("neg", 1, -2, 2), "exp": _on("exp", 1, -2, 2),
    "log": _on("log", 1, 0.1, 3), "sqrt_f64": _on("sqrt", 1, 0.1, 3, dtype="float64"),
    "abs": _on("abs", 1, -2, 2), "erf": _on("erf", 1, -2, 2),
    "erf_f64": _on("erf", 1, -2, 2, dtype="float64"),
    "leaky_relu": _on("leaky_relu", 1, -2, 2, {"alpha": 0.1}),
    "clip": _on("clip", 1, -2, 2, {"min": -0.5, "max": 1.0}),
    "clip_no_upper_bound": _on("clip", 1, -2, 2, {"min": -0.5, "max": float("inf")}),
    "hard_sigmoid": _on("hard_sigmoid", 1, -4, 4, {"alpha": 0.3, "beta": 0.4}),
    "hard_swish": _on("hard_swish", 1, -5, 5),
    "div": _on("div", 2, 0.5, 2), "pow": _on("pow", 2, 0.1, 2),
    "pow_f64": _on("pow", 2, 0.1, 2, dtype="float64"),
    "div_grad_b": _on("div_grad_b", 3, 0.5, 2), "pow_grad_a": _on("pow_grad_a", 3, 0.1, 2),
    "pow_grad_b": _on("pow_grad_b", 3, 0.1, 2), "sqrt_grad": _on("sqrt_grad", 2, 0.1, 3),
    "abs_grad": _on("abs_grad", 2, -2, 2), "erf_grad": _on("erf_grad", 2, -2, 2),
    "leaky_relu_grad": _on("leaky_relu_grad", 2, -2, 2, {"alpha": 0.1}),
    "clip_grad": _on("clip_grad", 2, -2, 2, {"min": -0.5, "max": 1.0}),
    "hard_sigmoid_grad": _on("hard_sigmoid_grad", 2, -4, 4, {"alpha": 0.3, "beta": 0.4}),
    "hard_swish_grad": _on("hard_swish_grad", 2, -5, 5),
    "fused_gelu": fused_case([[("x", (3, 7))], ("scale", ["x"], {"alpha": 2 ** -0.5}),
                              ("erf", ["o0"], {}), ("add_scalar", ["o1"], {"value": 1.0}),
                              ("scale", ["x"], {"alpha": 0.5}), ("mul", ["o3", "o2"], {})]),
})

CASES["add_scalar_on_a_scalar"] = _unary("add_scalar", {"value": 1}, dtype="int64", shape=())
CASES["relu_on_one_element"] = _unary("relu", shape=(1, 1))
