"""Reverse-mode autodiff against central finite differences, op by op.

Each case builds a tiny float64 graph: random ``param`` inputs, the op under test, then
``loss = sum(out * r)`` for a fixed random ``r`` per output, so every output element is
weighted differently. A small NumPy interpreter (each node's registry reference) runs
the differentiated graph; its ``grad.*`` outputs must match finite differences of the
forward graph.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from purinec.errors import AutodiffError, ShapeError
from purinec.ir.graph import Graph
from purinec.ir.ops import REGISTRY, conv_output_size
from purinec.ir.types import Device, DType, TensorType
from purinec.passes.autodiff import autodiff

F64 = DType.f64


# ---------------------------------------------------------------------------------------
# A tiny interpreter and finite differences.


def run(graph: Graph, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Evaluate the nodes in order with the registry's references, checking every
    result against its value's declared type."""
    env = {v: feeds[v.name] for v in graph.inputs}
    for node in graph.nodes:
        outs = REGISTRY[node.op].reference(*[env[v] for v in node.inputs], **node.attrs)
        assert len(outs) == len(node.outputs), node
        for v, a in zip(node.outputs, outs):
            a = np.asarray(a)
            assert a.shape == v.type.shape and a.dtype == v.type.dtype.numpy, \
                f"{node}: got {a.dtype}{list(a.shape)}, declared {v.type}"
            env[v] = a
    return {name: env[v] for name, v in graph.outputs}


def numeric_grad(graph, feeds, name, eps=1e-6):
    x = feeds[name] = feeds[name].copy()
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + eps
        fp = run(graph, feeds)["loss"]
        x[idx] = old - eps
        fm = run(graph, feeds)["loss"]
        x[idx] = old
        g[idx] = (fp - fm) / (2 * eps)
    return g


class Builder:
    """Builds a test graph and the values fed to its inputs."""

    def __init__(self, name: str, dtype=np.float64):
        self.dtype = np.dtype(dtype)
        self.g = Graph(name)
        self.rng = np.random.default_rng(zlib.crc32(name.encode()))
        self.feeds: dict[str, np.ndarray] = {}
        self.count = 0

    def param(self, name, shape, low=-1.0, high=1.0):
        self.feeds[name] = self.rng.uniform(low, high, shape).astype(self.dtype)
        return self.g.add_input(name, TensorType(shape, DType.from_numpy(self.dtype)),
                                role="param")

    def data(self, name, array):
        array = np.asarray(array)
        self.feeds[name] = array
        return self.g.add_input(name, TensorType(array.shape, DType.from_numpy(array.dtype)))

    def op(self, op, *inputs, loc=None, device=None, **attrs):
        n_out = len(REGISTRY[op].infer([v.type for v in inputs],
                                       REGISTRY[op].complete_attrs(attrs)))
        self.count += 1
        names = [f"{op}{self.count}" + (f"_{i}" if n_out > 1 else "") for i in range(n_out)]
        node = self.g.add_node(op, inputs, attrs, names=names, loc=loc, device=device)
        return node.outputs if n_out > 1 else node.outputs[0]

    def weighted_loss(self, *outputs):
        """loss = sum_i reduce_sum(out_i * r_i), r_i fixed random data."""
        total = None
        for i, y in enumerate(outputs):
            r = self.data(f"r{i}", self.rng.standard_normal(y.type.shape).astype(self.dtype))
            s = self.op("reduce_sum", self.op("mul", y, r), axes=list(range(y.type.rank)))
            total = s if total is None else self.op("add", total, s)
        self.g.set_outputs([("loss", total)])
        return self.g


def check_gradients(b: Builder, wrt=None, rtol=1e-5, atol=1e-7):
    """autodiff's gradients equal finite differences; returns the differentiated graph."""
    graph = b.g
    before = (len(graph.nodes), list(graph.outputs))
    dg = autodiff(graph, "loss", wrt)
    assert (len(graph.nodes), list(graph.outputs)) == before, "autodiff mutated its input"
    names = wrt if wrt is not None else [v.name for v in graph.inputs_with_role("param")]
    assert dg.outputs[:len(graph.outputs)] == [(n, dg.output(n)) for n, _ in graph.outputs]
    assert [n for n, _ in dg.outputs] == ([n for n, _ in graph.outputs] +
                                          [f"grad.{n}" for n in names])
    out = run(dg, dict(b.feeds))
    np.testing.assert_allclose(out["loss"], run(graph, dict(b.feeds))["loss"], rtol=1e-12)
    for name in names:
        assert np.any(b.feeds[name] != 0)
        num = numeric_grad(graph, dict(b.feeds), name)
        got = out[f"grad.{name}"]
        assert got.shape == b.feeds[name].shape and got.dtype == np.float64
        np.testing.assert_allclose(got, num, rtol=rtol, atol=atol, err_msg=f"grad.{name}")
    return dg


# ---------------------------------------------------------------------------------------
# One or more cases per differentiable op. Each returns its Builder with the loss set.

CASES: dict[str, dict[str, callable]] = {}


def case(op, variant="default"):
    def register(fn):
        CASES.setdefault(op, {})[variant] = fn
        return fn
    return register


def _unary(op, name, **attrs):
    b = Builder(name)
    b.weighted_loss(b.op(op, b.param("x", (3, 4), -2, 2), **attrs))
    return b


for _op in ("relu", "sigmoid", "tanh"):
    case(_op)(lambda op=_op: _unary(op, op))
case("scale")(lambda: _unary("scale", "scale", alpha=-2.5))
case("add_scalar")(lambda: _unary("add_scalar", "add_scalar", value=0.75))


def _binary(op):
    b = Builder(op)
    b.weighted_loss(b.op(op, b.param("a", (2, 3)), b.param("b", (2, 3))))
    return b


for _op in ("add", "sub", "mul"):
    case(_op)(lambda op=_op: _binary(op))


@case("bias_add", "axis1")
def _():
    b = Builder("bias_add1")
    b.weighted_loss(b.op("bias_add", b.param("x", (2, 3, 4)), b.param("b", (3,)), axis=1))
    return b


@case("bias_add", "axis0")
def _():
    b = Builder("bias_add0")
    b.weighted_loss(b.op("bias_add", b.param("x", (4, 2)), b.param("b", (4,)), axis=0))
    return b


def _reduce(axes, keepdims):
    b = Builder(f"reduce_sum{axes}{keepdims}")
    b.weighted_loss(b.op("reduce_sum", b.param("x", (2, 3, 4)), axes=axes,
                         keepdims=keepdims))
    return b


case("reduce_sum", "axis1")(lambda: _reduce([1], False))
case("reduce_sum", "axes02_keep")(lambda: _reduce([0, 2], True))
case("reduce_sum", "all")(lambda: _reduce([0, 1, 2], False))
case("reduce_sum", "none")(lambda: _reduce([], False))


@case("broadcast_to", "lead_and_ones")
def _():
    b = Builder("broadcast_to")
    b.weighted_loss(b.op("broadcast_to", b.param("x", (3, 1)), shape=[2, 3, 4]))
    return b


@case("broadcast_to", "scalar")
def _():
    b = Builder("broadcast_to_scalar")
    b.weighted_loss(b.op("broadcast_to", b.param("x", ()), shape=[2, 3]))
    return b


@case("broadcast_to", "identity")
def _():
    b = Builder("broadcast_to_id")
    b.weighted_loss(b.op("broadcast_to", b.param("x", (2, 3)), shape=[2, 3]))
    return b


@case("reshape")
def _():
    b = Builder("reshape")
    b.weighted_loss(b.op("reshape", b.param("x", (2, 6)), shape=[3, 2, 2]))
    return b


@case("concat", "three_inputs_one_data")
def _():
    b = Builder("concat")
    xs = [b.param("x0", (2, 1, 3)), b.data("d", b.rng.standard_normal((2, 2, 3))),
          b.param("x2", (2, 3, 3))]
    b.weighted_loss(b.op("concat", *xs, axis=1))
    return b


@case("concat", "single")
def _():
    b = Builder("concat1")
    b.weighted_loss(b.op("concat", b.param("x", (2, 3)), axis=0))
    return b


@case("split", "all_outputs_used")
def _():
    b = Builder("split")
    b.weighted_loss(*b.op("split", b.param("x", (2, 6)), axis=1, sections=[1, 2, 3]))
    return b


@case("split", "middle_output_unused")
def _():
    b = Builder("split_unused")
    y0, _, y2 = b.op("split", b.param("x", (5, 2)), axis=0, sections=[2, 1, 2])
    b.weighted_loss(y2, y0)
    return b


def _matmul(ta, tb):
    b = Builder(f"matmul{ta}{tb}")
    m, k, n = 2, 3, 4
    a = b.param("a", (k, m) if ta else (m, k))
    w = b.param("b", (n, k) if tb else (k, n))
    b.weighted_loss(b.op("matmul", a, w, trans_a=ta, trans_b=tb))
    return b


for _ta in (False, True):
    for _tb in (False, True):
        case("matmul", f"t{int(_ta)}{int(_tb)}")(lambda ta=_ta, tb=_tb: _matmul(ta, tb))


def _conv(name, x_shape, w_shape, x_is_param=True, **attrs):
    b = Builder(name)
    x = (b.param("x", x_shape) if x_is_param
         else b.data("x", b.rng.standard_normal(x_shape)))
    b.weighted_loss(b.op("conv2d", x, b.param("w", w_shape), **attrs))
    return b


case("conv2d", "plain")(lambda: _conv("conv", (2, 2, 4, 4), (3, 2, 3, 3)))
case("conv2d", "stride_pad")(lambda: _conv("conv_sp", (1, 2, 6, 5), (2, 2, 3, 2),
                                           stride=[2, 3], pad=[1, 2]))
case("conv2d", "groups")(lambda: _conv("conv_g", (2, 4, 4, 4), (6, 2, 2, 2), stride=[2, 1],
                                       pad=[0, 1], groups=2))
case("conv2d", "dilated_uneven_pad")(lambda: _conv("conv_dil", (1, 4, 7, 6), (4, 2, 3, 2),
                                                   stride=[1, 2], pad=[2, 0, 1, 1],
                                                   dilation=[2, 3], groups=2))
case("conv2d", "data_input")(lambda: _conv("conv_d", (2, 2, 4, 4), (2, 2, 3, 3), False,
                                           pad=[1, 1]))


def _pool(op, name, shape, **attrs):
    b = Builder(name)
    b.weighted_loss(b.op(op, b.param("x", shape, -3, 3), **attrs))
    return b


case("max_pool2d", "overlap")(lambda: _pool("max_pool2d", "mp", (2, 2, 5, 5), kernel=[3, 3],
                                            stride=[2, 2]))
case("max_pool2d", "pad_ceil")(lambda: _pool("max_pool2d", "mp_pad", (1, 2, 6, 5),
                                             kernel=[3, 2], stride=[2, 2], pad=[1, 1]))
case("avg_pool2d", "overlap")(lambda: _pool("avg_pool2d", "ap", (2, 2, 5, 5), kernel=[3, 3],
                                            stride=[2, 2]))
case("avg_pool2d", "pad_ceil")(lambda: _pool("avg_pool2d", "ap_pad", (1, 2, 6, 5),
                                             kernel=[3, 2], stride=[2, 2], pad=[1, 1]))
case("max_pool2d", "onnx_floor_dilated")(lambda: _pool(
    "max_pool2d", "mp_onnx", (1, 2, 7, 6), kernel=[2, 3], stride=[2, 1], pad=[1, 0, 0, 2],
    dilation=[2, 2], ceil_mode=False))
for _include in (False, True):
    case("avg_pool2d", f"onnx_count_include_pad{int(_include)}")(lambda include=_include: _pool(
        "avg_pool2d", f"ap_onnx{int(include)}", (1, 2, 6, 7), kernel=[3, 2], stride=[2, 2],
        pad=[1, 0, 2, 1], dilation=[1, 2], ceil_mode=True, count_include_pad=include))
case("global_avg_pool")(lambda: _pool("global_avg_pool", "gap", (2, 3, 3, 2)))
case("lrn", "strong")(lambda: _pool("lrn", "lrn", (2, 5, 2, 2), size=3, alpha=0.5, beta=0.75,
                                    k=2.0))
case("lrn", "caffe_defaults")(lambda: _pool("lrn", "lrn5", (1, 7, 2, 2)))
case("softmax", "axis1")(lambda: _unary("softmax", "softmax1", axis=1))
case("softmax", "axis0")(lambda: _unary("softmax", "softmax0", axis=0))
case("log_softmax", "axis1")(lambda: _unary("log_softmax", "log_softmax1", axis=1))
case("log_softmax", "axis0")(lambda: _unary("log_softmax", "log_softmax0", axis=0))


def _xent(label_dtype):
    b = Builder(f"xent_{label_dtype}")
    logits = b.param("logits", (4, 5), -2, 2)
    label = b.data("label", np.array([0, 4, 2, 4], dtype=label_dtype))
    b.weighted_loss(b.op("softmax_xent", logits, label))
    return b


case("softmax_xent", "i32")(lambda: _xent(np.int32))
case("softmax_xent", "i64")(lambda: _xent(np.int64))


# -- ONNX's arithmetic and activations ---------------------------------------------------
# Inputs keep clear of where a derivative is undefined (kinks, log at 0) and reach
# both sides of every kink.


def _onnx_unary(op, low=-2.0, high=2.0, **attrs):
    b = Builder(f"{op}{sorted(attrs.items())}")
    b.weighted_loss(b.op(op, b.param("x", (3, 4), low, high), **attrs))
    return b


for _op in ("neg", "exp", "abs", "erf"):
    case(_op)(lambda op=_op: _onnx_unary(op))
for _op in ("log", "sqrt"):
    case(_op)(lambda op=_op: _onnx_unary(op, 0.3, 3.0))
case("leaky_relu")(lambda: _onnx_unary("leaky_relu", alpha=0.2))
case("clip", "both_bounds")(lambda: _onnx_unary("clip", min=-0.5, max=0.7))
case("clip", "no_lower_bound")(lambda: _onnx_unary("clip", min=-np.inf, max=0.3))
case("hard_sigmoid")(lambda: _onnx_unary("hard_sigmoid", -4.0, 4.0, alpha=0.2, beta=0.5))
case("hard_swish")(lambda: _onnx_unary("hard_swish", -5.0, 5.0))


@case("div")
def _():
    b = Builder("div")
    b.weighted_loss(b.op("div", b.param("a", (2, 3)), b.param("b", (2, 3), 0.5, 2.0)))
    return b


@case("pow")
def _():
    b = Builder("pow")
    b.weighted_loss(b.op("pow", b.param("a", (2, 3), 0.3, 2.0), b.param("b", (2, 3), -2, 2)))
    return b



# -- ONNX's data movement ----------------------------------------------------------------


def _moved(op, shape, name=None, **attrs):
    b = Builder(name or op)
    b.weighted_loss(b.op(op, b.param("x", shape), **attrs))
    return b


case("transpose", "3d")(lambda: _moved("transpose", (2, 3, 4), perm=[2, 0, 1]))
case("transpose", "2d")(lambda: _moved("transpose", (3, 2), "transpose2", perm=[1, 0]))
case("strided_slice", "steps_and_reversal")(
    lambda: _moved("strided_slice", (5, 4, 3), starts=[1, 3, 0], steps=[2, -1, 1],
                   sizes=[2, 3, 3]))
case("strided_slice", "reversed_with_stride")(
    lambda: _moved("strided_slice", (7,), "strided_slice1", starts=[6], steps=[-3],
                   sizes=[3]))
case("pad", "constant")(lambda: _moved("pad", (2, 3), pads=[1, 0, 2, 1], mode="constant",
                                       value=1.5))
case("pad", "reflect")(lambda: _moved("pad", (3, 4), "pad_reflect", pads=[2, 1, 1, 3],
                                      mode="reflect"))
case("pad", "edge")(lambda: _moved("pad", (2, 3), "pad_edge", pads=[3, 0, 1, 2], mode="edge"))

ALL_CASES = [(op, variant) for op, variants in sorted(CASES.items()) for variant in variants]


# ---------------------------------------------------------------------------------------
# The per-op tests.


def test_every_differentiable_op_has_a_case():
    differentiable = {name for name, d in REGISTRY.items() if d.differentiable}
    assert differentiable - set(CASES) == set(), "differentiable ops without a test case"
    assert set(CASES) <= differentiable


@pytest.mark.parametrize("op,variant", ALL_CASES)
def test_gradient_matches_finite_differences(op, variant):
    b = CASES[op][variant]()
    assert any(n.op == op for n in b.g.nodes)
    dg = check_gradients(b)
    _check_gradient_names(b.g, dg)
    # Backward nodes exist only for what is needed: no gradient flows into data inputs.
    data_names = {v.name for v in b.g.inputs if v.role == "data"}
    for node in dg.nodes[len(b.g.nodes):]:
        for v in node.outputs:
            assert not any(v.name == f"grad.{d}" for d in data_names)


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(["conv2d", "max_pool2d", "avg_pool2d"]), st.integers(1, 3),
       st.integers(1, 3), st.integers(0, 2), st.integers(3, 6), st.sampled_from([1, 2]),
       st.integers(0, 2), st.integers(1, 2), st.booleans(), st.booleans())
def test_window_ops_with_random_attributes(op, kernel, stride, pad, size, groups, pad_end,
                                           dilation, ceil_mode, count_include_pad):
    """Along rows: padding ``pad`` before and ``pad_end`` after, and ``dilation``."""
    window = dict(stride=[stride, 1], pad=[pad, 0, pad_end, 0], dilation=[dilation, 1])
    if op == "conv2d":
        assume(conv_output_size(size, kernel, stride, pad, pad_end, dilation) >= 1)
        attrs = dict(window, groups=groups)
    else:
        attrs = dict(window, kernel=[kernel, 2], ceil_mode=ceil_mode,
                     **({"count_include_pad": count_include_pad} if op == "avg_pool2d" else {}))
        try:
            REGISTRY[op].infer([TensorType((1, 2 * groups, size, 4), DType.f64)],
                               REGISTRY[op].complete_attrs(attrs))
        except ShapeError:
            assume(False)  # a window of padding alone
    b = Builder(f"{op}{kernel}{stride}{pad}{size}{groups}{pad_end}{dilation}")
    x = b.param("x", (1, 2 * groups, size, 4), -3, 3)
    inputs = [x, b.param("w", (groups, 2, kernel, 2))] if op == "conv2d" else [x]
    b.weighted_loss(b.op(op, *inputs, **attrs))
    check_gradients(b)


def test_conv_with_data_input_builds_no_input_gradient():
    b = CASES["conv2d"]["data_input"]()
    dg = autodiff(b.g)
    ops = [n.op for n in dg.nodes[len(b.g.nodes):]]
    assert "conv2d_grad_weight" in ops and "conv2d_grad_input" not in ops


def test_softmax_xent_label_gets_no_gradient():
    b = CASES["softmax_xent"]["i32"]()
    dg = autodiff(b.g)
    with pytest.raises(AutodiffError, match="not a float"):
        autodiff(b.g, wrt=["logits", "label"])
    assert [n for n, _ in dg.outputs] == ["loss", "grad.logits"]


# ---------------------------------------------------------------------------------------
# Graph-level behaviour.


def test_value_used_several_times_sums_gradients():
    b = Builder("reuse")
    x = b.param("x", (3,))
    y = b.op("mul", x, x)
    z = b.op("add", y, b.op("tanh", x))
    b.weighted_loss(z, x)
    dg = check_gradients(b)
    grad_x = dg.output("grad.x")
    assert grad_x.name == "grad.x" and grad_x.producer.op == "add"
    names = [v.name for v in dg.values()]
    assert len(names) == len(set(names))
    # The seed belongs to the loss; add passes it through to both summands unrenamed.
    loss = b.g.output("loss")
    seed = next(n for n in dg.nodes if n.op == "fill").outputs[0]
    assert seed.name == f"grad.{loss.name}"
    summands = {v.name for v in loss.producer.inputs}
    assert not {f"grad.{n}" for n in summands} & set(names)
    _check_gradient_names(b.g, dg)


def _check_gradient_names(graph, dg):
    """A value named grad.<v> has v's type, and v is a float value of the forward graph."""
    forward = {v.name: v for v in graph.values()}
    for v in dg.values():
        if v.name.startswith("grad.") and v.name[5:] in forward:
            assert v.type == forward[v.name[5:]].type, v


def _small_network(dtype):
    """A small network: conv, relu, pool, reshape, matmul, bias, softmax_xent."""
    b = Builder("net", dtype)
    x = b.data("x", b.rng.standard_normal((2, 1, 6, 6)).astype(dtype))
    label = b.data("label", np.array([1, 2], dtype=np.int32))
    w1, b1 = b.param("w1", (2, 1, 3, 3)), b.param("b1", (2,))
    w2, b2 = b.param("w2", (3, 18)), b.param("b2", (3,))
    h = b.op("relu", b.op("bias_add", b.op("conv2d", x, w1, pad=[1, 1]), b1))
    h = b.op("max_pool2d", h, kernel=[3, 3], stride=[2, 2])
    h = b.op("reshape", h, shape=[2, 18])   # ceil mode: 6x6 -> 3x3
    logits = b.op("bias_add", b.op("matmul", h, w2, trans_b=True), b2)
    loss = b.op("softmax_xent", logits, label)
    b.g.set_outputs([("loss", loss)])
    return b


def test_small_network():
    check_gradients(_small_network(np.float64))


def test_small_network_float32():
    """Every backward value stays f32 (the interpreter checks each against its type)."""
    b32, b64 = _small_network(np.float32), _small_network(np.float64)
    out32 = run(autodiff(b32.g), b32.feeds)
    out64 = run(autodiff(b64.g), b64.feeds)
    for name, value in out32.items():
        assert value.dtype == np.float32
        np.testing.assert_allclose(value, out64[name], rtol=1e-4, atol=1e-5)


def test_parameter_gradients_come_before_the_sweep_goes_on():
    """Where a rule builds a parameter's gradient and another input's, the parameter's
    comes first in the graph (so parallel training can send it early); the gradients
    still match finite differences (test_small_network)."""
    forward = _small_network(np.float64).g
    backward = autodiff(forward).nodes[len(forward.nodes):]
    matmul_grads = [n.outputs[0].name for n in backward if n.op == "matmul"]
    assert len(matmul_grads) == 2 and matmul_grads[0] == "grad.w2"  # then grad of h


def test_differentiating_twice_is_an_error():
    dg = autodiff(_small_network(np.float64).g)
    with pytest.raises(AutodiffError, match="already has output"):
        autodiff(dg)


def test_unused_param_gets_zeros():
    b = Builder("unused")
    x = b.param("x", (2, 2))
    u = b.param("u", (3,))
    b.weighted_loss(b.op("tanh", x))
    dg = check_gradients(b)
    gu = dg.output("grad.u")
    assert gu.producer.op == "fill" and gu.name == "grad.u"
    assert np.all(run(dg, dict(b.feeds))["grad.u"] == 0)
    assert all(u not in n.inputs for n in dg.nodes)


def test_param_off_the_loss_path_builds_nothing():
    b = Builder("side")
    x, v = b.param("x", (2,)), b.param("v", (2,))
    side = b.op("sigmoid", v)
    g = b.weighted_loss(b.op("relu", x))
    g.set_outputs(g.outputs + [("side", side)])
    dg = autodiff(g, wrt=["x", "v"])
    new_ops = [n.op for n in dg.nodes[len(g.nodes):]]
    assert "sigmoid_grad" not in new_ops
    assert dg.output("grad.v").producer.op == "fill"
    assert [n for n, _ in dg.outputs] == ["loss", "side", "grad.x", "grad.v"]


def test_wrt_order_and_subset():
    b = Builder("order")
    x, y = b.param("x", (2,)), b.param("y", (2,))
    b.weighted_loss(b.op("mul", x, y))
    check_gradients(b, wrt=["y", "x"])
    dg = check_gradients(b, wrt=["y"])
    assert "grad.x" not in [n for n, _ in dg.outputs]


def test_integer_path_and_dropout_mask():
    """The iteration counter (integer add_scalar) and its dropout mask get no gradients."""
    b = Builder("dropout")
    it = b.data("it", np.array(7, np.int64))
    x = b.param("x", (4, 5))
    mask = b.op("dropout_mask", b.op("add_scalar", it, value=1.0), shape=[4, 5], p=0.5,
                dtype="f64")
    b.weighted_loss(b.op("mul", x, mask))
    dg = check_gradients(b)
    new_nodes = dg.nodes[len(b.g.nodes):]
    assert all(mask not in n.outputs for n in new_nodes)
    # The seed, reduce_sum's (reshape, broadcast_to), then d(y * r) and d(x * mask).
    assert [n.op for n in new_nodes] == ["fill", "reshape", "broadcast_to", "mul", "mul"]


def test_backward_nodes_inherit_device_and_loc():
    b = Builder("placed")
    x = b.param("x", (2, 3))
    dev = Device("cpu", 1)
    y = b.op("relu", x, loc="net.py:3", device=dev)
    z = b.op("tanh", y, loc="net.py:4")
    b.weighted_loss(z)
    dg = autodiff(b.g)
    by_op = {n.op: n for n in dg.nodes[len(b.g.nodes):]}
    assert by_op["relu_grad"].device == dev and by_op["relu_grad"].loc == "net.py:3"
    assert by_op["tanh_grad"].loc == "net.py:4"
    assert dg.output("grad.x").name == "grad.x"


def test_loss_that_is_a_param():
    g = Graph("trivial")
    s = g.add_input("s", TensorType((), F64), role="param")
    g.set_outputs([("loss", s)])
    dg = autodiff(g)
    assert run(dg, {"s": np.array(3.0)})["grad.s"] == 1.0


def test_rule_called_without_needs():
    b = Builder("direct")
    a, c = b.param("a", (2,)), b.param("c", (2,))
    y = b.op("mul", a, c)
    node = y.producer
    ga, gc = REGISTRY["mul"].gradient(b.g, node, [a])
    assert ga.producer.op == gc.producer.op == "mul"


# ---------------------------------------------------------------------------------------
# Errors.


def test_non_scalar_loss_is_an_error():
    b = Builder("vector_loss")
    x = b.param("x", (3,))
    b.g.set_outputs([("loss", b.op("tanh", x))])
    with pytest.raises(AutodiffError, match="scalar"):
        autodiff(b.g)


def test_integer_loss_and_missing_loss_are_errors():
    g = Graph("int_loss")
    n = g.add_input("n", TensorType((), DType.i32))
    g.set_outputs([("loss", n)])
    with pytest.raises(AutodiffError, match="float scalar"):
        autodiff(g)
    with pytest.raises(AutodiffError, match="no output named 'total'"):
        autodiff(g, loss="total")


def test_unknown_wrt_is_an_error():
    b = Builder("unknown_wrt")
    b.weighted_loss(b.op("tanh", b.param("x", (2,))))
    with pytest.raises(AutodiffError, match="'nope' is not an input"):
        autodiff(b.g, wrt=["nope"])


def test_non_differentiable_op_on_the_path_is_an_error():
    b = Builder("nondiff")
    x = b.param("x", (2, 3))
    y = b.op("cast", b.op("tanh", x), dtype="f64", loc="model.py:12")
    b.weighted_loss(y)
    with pytest.raises(AutodiffError) as err:
        autodiff(b.g)
    msg = str(err.value)
    assert y.name in msg and "cast" in msg and "model.py:12" in msg


def test_non_differentiable_op_off_the_path_is_fine():
    b = Builder("acc")
    logits = b.param("logits", (3, 4))
    label = b.data("label", np.array([0, 3, 1], np.int32))
    acc = b.op("accuracy", logits, label)
    g = b.weighted_loss(b.op("softmax_xent", logits, label))
    g.set_outputs(g.outputs + [("accuracy", acc)])
    check_gradients(b)
