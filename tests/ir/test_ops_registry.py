"""The op registry: every op carries every fact it needs, in one place, and the element
expressions mean what the NumPy references compute."""

import math

import numpy as np
import pytest

from purinec.errors import IRSyntaxError, VerifyError
from purinec.ir.expr import Arg, Call, Const, Index, U64
from purinec.ir.graph import Graph
from purinec.ir.ops import (REGISTRY, FusionKind, OpDef, Trait, get_op,
                            missing_facets, register)
from purinec.ir.ops.helpers import elementwise_split, unary_infer
from purinec.ir.parser import parse
from purinec.ir.types import DType, TensorType


def test_every_op_has_every_facet_it_needs():
    incomplete = {name: missing_facets(opdef) for name, opdef in REGISTRY.items()
                  if missing_facets(opdef)}
    assert incomplete == {}


def test_traits_replace_the_name_lists():
    def having(trait):
        return {name for name, d in REGISTRY.items() if d.has(trait)}

    assert having(Trait.communicates) == {"copy", "allreduce", "allgather", "reduce",
                                          "broadcast", "send", "recv"}
    assert having(Trait.host) == having(Trait.communicates) | {"slice"}
    assert having(Trait.bucketable) == {"allreduce", "reduce", "broadcast"}
    assert having(Trait.epilogue_anchor) == {"conv2d", "conv2d_panels", "matmul"}
    assert having(Trait.solver_update) == {"sgd"}
    assert having(Trait.view) == {"reshape"}
    assert {name for name, d in REGISTRY.items() if d.row_mean} == {
        "softmax_xent", "accuracy", "softmax_xent_grad"}


def test_an_op_lacking_a_facet_is_refused_when_registered():
    incomplete = OpDef("twice", ("x",), unary_infer("twice"), lambda x: (2 * x,),
                       FusionKind.elementwise, split=elementwise_split)
    with pytest.raises(VerifyError, match="op twice lacks: flops .*; expr"):
        register(incomplete)
    assert "twice" not in REGISTRY
    with pytest.raises(VerifyError, match="op relu is registered twice"):
        register(get_op("relu"))


def test_an_anchor_kind_without_the_anchor_trait_is_incomplete():
    opdef = OpDef("gemm_like", ("a", "b"), lambda t, a: [t[0]], lambda a, b: (a,),
                  FusionKind.out_elementwise_fusable, flops=lambda node: 0)
    assert any("epilogue_anchor" in m for m in missing_facets(opdef))


# ---------------------------------------------------------------------------------------
# Element expressions, evaluated by a third printer: NumPy over whole arrays.

_NUMPY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
    "neg": np.negative, "lt": np.less, "le": np.less_equal, "gt": np.greater,
    "ne": np.not_equal, "or": np.logical_or, "select": np.where, "exp": np.exp,
    "tanh": np.tanh, "xor": np.bitwise_xor, "shr": np.right_shift, "log": np.log,
    "sqrt": np.sqrt, "abs": np.abs, "erf": np.vectorize(math.erf), "pow": np.power,
}


def _mix64(z):
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def evaluate(expr, args, shape):
    if isinstance(expr, Arg):
        return args[expr.index]
    if isinstance(expr, Const):
        if expr.dtype == U64:
            return np.uint64(expr.value)
        return DType(expr.dtype).numpy.type(expr.value)
    if isinstance(expr, Index):
        return np.arange(int(np.prod(shape)), dtype=np.uint64).reshape(shape)
    assert isinstance(expr, Call)
    values = [evaluate(a, args, shape) for a in expr.args]
    if expr.fn == "cast":
        return np.asarray(values[0]).astype(DType(expr.dtype).numpy)
    if expr.fn == "u64":
        return np.asarray(values[0]).astype(np.int64).astype(np.uint64)
    if expr.fn == "mix64":
        return _mix64(values[0])
    return _NUMPY[expr.fn](*values)


def _aligned(node, i, value):
    """The input as NumPy broadcasting lines it up with the output."""
    aligned = get_op(node.op).aligned
    axes = aligned(node.attrs, i) if aligned else None
    if axes is None:
        return value
    shape = [1] * node.outputs[0].type.rank
    for axis, size in zip(axes, value.shape):
        shape[axis] = size
    return value.reshape(shape)


CASES = [
    ("relu", [(3, 4)], {}), ("sigmoid", [(5,)], {}), ("tanh", [(2, 3)], {}),
    ("scale", [(4,)], {"alpha": -1.5}), ("add_scalar", [(3,)], {"value": 2.0}),
    ("cast", [(6,)], {"dtype": "i32"}), ("add", [(2, 3), (2, 3)], {}),
    ("sub", [(4,), (4,)], {}), ("mul", [(3, 2), (3, 2)], {}),
    ("relu_grad", [(5,), (5,)], {}), ("sigmoid_grad", [(5,), (5,)], {}),
    ("tanh_grad", [(5,), (5,)], {}), ("bias_add", [(2, 3, 4), (3,)], {"axis": 1}),
    ("broadcast_to", [(1, 3)], {"shape": [2, 3]}),
    ("global_avg_pool_grad", [(2, 3, 1, 1)], {"input_shape": [2, 3, 4, 5]}),
    ("fill", [], {"shape": [2, 2], "value": 3.5}),
    ("dropout_mask", [()], {"shape": [4, 5], "p": 0.3, "seed": 7}),
    ("sgd", [(6,), (6,), (6,)], {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    # ONNX's arithmetic and activations (negative inputs of log, sqrt, pow: NaN in both)
    ("div", [(3, 4), (3, 4)], {}), ("neg", [(5,)], {}), ("exp", [(5,)], {}),
    ("log", [(2, 5)], {}), ("sqrt", [(2, 5)], {}), ("abs", [(7,)], {}), ("erf", [(7,)], {}),
    ("pow", [(3, 4), (3, 4)], {}), ("leaky_relu", [(6,)], {"alpha": 0.1}),
    ("clip", [(4, 5)], {"min": -0.5, "max": 0.75}), ("clip", [(4, 5)], {"max": 0.2}),
    ("hard_sigmoid", [(4, 5)], {"alpha": 0.7, "beta": 0.4}), ("hard_swish", [(4, 5)], {}),
    ("div_grad_b", [(5,), (5,), (5,)], {}), ("pow_grad_a", [(5,), (5,), (5,)], {}),
    ("pow_grad_b", [(5,), (5,), (5,)], {}), ("sqrt_grad", [(5,), (5,)], {}),
    ("abs_grad", [(5,), (5,)], {}), ("erf_grad", [(5,), (5,)], {}),
    ("leaky_relu_grad", [(5,), (5,)], {"alpha": 0.2}),
    ("clip_grad", [(4, 5), (4, 5)], {"min": -0.5, "max": 0.5}),
    ("hard_sigmoid_grad", [(4, 5), (4, 5)], {"alpha": 0.7, "beta": 0.4}),
    ("hard_swish_grad", [(4, 5), (4, 5)], {}),
]


def test_the_cases_cover_every_op_with_an_expression():
    assert {op for op, _, _ in CASES} == {n for n, d in REGISTRY.items() if d.expr}


@pytest.mark.parametrize("op, shapes, attrs", CASES, ids=[c[0] for c in CASES])
def test_an_element_expression_computes_what_the_reference_does(op, shapes, attrs):
    rng = np.random.default_rng(0)
    g = Graph("one")
    dtype = "i64" if op == "dropout_mask" else "f32"
    inputs = [g.add_input(f"x{i}", TensorType(shape, DType(dtype)))
              for i, shape in enumerate(shapes)]
    node = g.add_node(op, inputs, attrs)
    arrays = [rng.standard_normal(s).astype(np.float32) if dtype == "f32"
              else np.array(rng.integers(-2**40, 2**40), dtype=np.int64) for s in shapes]
    if op in ("hard_swish", "hard_swish_grad"):
        arrays[0] *= 4  # reach past the kinks at -3 and 3
    with np.errstate(invalid="ignore", divide="ignore"):
        expected = get_op(op).reference(*arrays, **node.attrs)
    shape = node.outputs[0].type.shape
    exprs = get_op(op).expr(node, [Arg(i) for i in range(len(arrays))])
    args = [_aligned(node, i, a) for i, a in enumerate(arrays)]
    for out, want, expr in zip(node.outputs, expected, exprs):
        with np.errstate(invalid="ignore", divide="ignore"):
            got = np.broadcast_to(evaluate(expr, args, shape), shape)
        np.testing.assert_allclose(got.astype(want.dtype), want, rtol=1e-6, atol=1e-7,
                                   err_msg=f"{op} output %{out.name}")


# -- attribute bounds ----------------------------------------------------------------------


@pytest.mark.parametrize("op, attrs, words", [
    ("sgd", {"lr": math.nan}, ["attribute lr must be a finite number", "nan"]),
    ("sgd", {"lr": 0.1, "momentum": math.inf}, ["attribute momentum must be a finite"]),
    ("lrn", {"beta": -math.inf}, ["attribute beta must be a finite number"]),
    ("scale", {"alpha": 10**400}, ["attribute alpha must be float", "(401 characters)"]),
    ("scale", {"alpha": 10**5000}, ["attribute alpha must be float", "4,300 digits"]),
    ("reshape", {"shape": [1, 2**63]}, ["attribute shape must be an int64"]),
    ("dropout_mask", {"shape": [2], "seed": -2**63 - 1}, ["attribute seed must be an int64"]),
])
def test_attributes_are_bounded_as_their_schema_says(op, attrs, words):
    """Every integer is an int64, and an attribute's bound (a finite learning rate) is
    checked wherever attributes are: here, when a node is built."""
    with pytest.raises(VerifyError) as info:
        REGISTRY[op].complete_attrs(attrs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_a_bound_is_checked_where_the_ir_text_says_it():
    text = ("graph g(%w: f32[2] @cpu:0 {param}, %h: f32[2] @cpu:0 {state}) {\n"
            "  %w.next, %h.next = sgd(%w, %h, %w) {lr=nan} : f32[2] @cpu:0, f32[2] @cpu:0\n"
            "  return w=%w.next, h=%h.next\n}")
    with pytest.raises(IRSyntaxError, match=r"^g\.pir:2:42: op sgd: attribute lr must be a "
                                            r"finite number, got nan"):
        parse(text, source="g.pir")
