"""The simplifying passes, the optimizer pass and the pipeline, on small graphs."""

import numpy as np
import pytest

from purinec.errors import PurinecError, ShapeError
from purinec.ir import DType, Graph, TensorType, parse
from purinec.ir.init import initial_value, parse_init
from purinec.passes.optimizer import SGD
from purinec.passes.pipeline import Pass, run_passes
from purinec.passes.simplify import cse, dce, infer_shapes
from purinec.runtime.reference import execute

F32 = DType.f32


def small_graph() -> Graph:
    g = Graph("small")
    x = g.add_input("x", TensorType((2, 3), F32))
    w = g.add_input("w", TensorType((4, 3), F32), role="param", init="xavier")
    y = g.add_node("matmul", [x, w], {"trans_b": True}, names=["y"]).outputs[0]
    a = g.add_node("relu", [y], names=["a"]).outputs[0]
    b = g.add_node("relu", [y], names=["b"]).outputs[0]  # a twin of a
    g.add_node("sigmoid", [y], names=["unused"])
    s = g.add_node("add", [a, b], names=["s"]).outputs[0]
    g.set_outputs([("s", s), ("b", b)])
    return g


def test_dce_drops_only_dead_nodes():
    g = small_graph()
    out = dce(g)
    assert [n.name for n in out.nodes] == ["y", "a", "b", "s"]
    assert len(g.nodes) == 5  # the argument is untouched


def test_cse_merges_twins_and_rewires_outputs():
    out = cse(small_graph())
    assert [n.name for n in out.nodes] == ["y", "a", "unused", "s"]
    s = out.nodes[-1]
    assert s.inputs[0] is s.inputs[1] is out.nodes[1].outputs[0]
    assert out.output("b") is out.nodes[1].outputs[0]  # output name kept, value merged


def test_simplified_graph_computes_the_same():
    g = small_graph()
    rng = np.random.default_rng(0)
    env = {"x": rng.normal(size=(2, 3)).astype(np.float32),
           "w": rng.normal(size=(4, 3)).astype(np.float32)}
    want = execute(g, env)
    got = execute(cse(dce(g)), env)
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(want[k], got[k])


def test_infer_shapes_propagates_new_input_shapes_and_names_bad_nodes():
    g = small_graph()
    g.inputs[0].type = TensorType((5, 3), F32)
    out = infer_shapes(g)
    assert out.value("s").type == TensorType((5, 4), F32)
    g.inputs[0].type = TensorType((5, 2), F32)
    with pytest.raises(ShapeError, match=r"%y = matmul\(%x, %w\).*cannot multiply"):
        infer_shapes(g)


def test_sgd_pass_adds_history_state_and_updates_by_name():
    g = Graph("toy")
    w = g.add_input("w", TensorType((3,), F32), role="param")
    gw = g.add_node("scale", [w], {"alpha": 2.0}, names=["grad.w"]).outputs[0]
    loss = g.add_node("reduce_sum", [w], {"axes": [0]}, names=["loss"]).outputs[0]
    g.set_outputs([("loss", loss), ("grad.w", gw)])
    out = SGD(lr=0.1, momentum=0.5, weight_decay=0.01).apply(g)
    assert [n for n, _ in out.outputs] == ["loss", "w", "w.history"]
    hist = out.input("w.history")
    assert hist.role == "state" and hist.init == "constant(0)"
    node = out.nodes[-1]
    assert node.op == "sgd" and node.attrs == {"lr": 0.1, "momentum": 0.5,
                                               "weight_decay": 0.01}
    w0 = np.array([1.0, -2.0, 3.0], np.float32)
    h0 = np.array([0.5, 0.0, -1.0], np.float32)
    res = execute(out, {"w": w0, "w.history": h0})
    update = 0.5 * h0 + 0.1 * (2 * w0 + 0.01 * w0)
    np.testing.assert_allclose(res["w"], w0 - update, rtol=1e-6)
    np.testing.assert_allclose(res["w.history"], update, rtol=1e-6)
    assert str(parse(str(out))) == str(out)


def test_sgd_needs_gradients_and_sane_settings():
    with pytest.raises(PurinecError, match="no gradient outputs"):
        SGD().apply(small_graph())
    for bad, complaint in ((dict(lr=0), "learning rate must be positive"),
                           (dict(momentum=1.0), r"momentum must be in \[0, 1\)"),
                           (dict(weight_decay=-1), "weight decay must be >= 0")):
        with pytest.raises(PurinecError, match=complaint):
            SGD(**bad)


def test_pipeline_calls_hook_after_each_pass_and_times_them():
    seen = []
    result = run_passes(small_graph(), [Pass("dce", dce), Pass("cse", cse)],
                        after=lambda name, g: seen.append((name, len(g.nodes))))
    assert seen == [("dce", 4), ("cse", 3)]
    assert [t.name for t in result.timings] == ["dce", "cse"]
    assert result.timings[0].nodes_before == 5


@pytest.mark.parametrize("spec, check", [
    ("constant(0.5)", lambda a: np.all(a == 0.5)),
    ("gaussian(0.01)", lambda a: 0.005 < a.std() < 0.02 and abs(a.mean()) < 0.01),
    ("uniform(2)", lambda a: a.min() >= -2 and a.max() <= 2 and a.max() > 1.5),
    ("xavier", lambda a: np.abs(a).max() <= np.sqrt(3 / 75) and a.std() > 0.05),
    ("msra", lambda a: abs(a.std() - np.sqrt(2 / 75)) < 0.03),
])
def test_initializers(spec, check):
    a = initial_value(spec, TensorType((40, 3, 5, 5), F32), np.random.default_rng(0))
    assert a.shape == (40, 3, 5, 5) and a.dtype == np.float32
    assert check(a)


@pytest.mark.parametrize("spec", ["", "zeros", "gaussian", "xavier(1)", "constant(x)"])
def test_bad_initializers_are_refused(spec):
    with pytest.raises(PurinecError, match="initializer"):
        parse_init(spec)


@pytest.mark.parametrize("op, attrs, complaint", [
    ("fill", {"shape": [2, -1]}, "shape must not have negative sizes"),
    ("fill", {"shape": [2], "dtype": "f16"}, "unknown dtype 'f16'"),
])
def test_shape_and_dtype_attributes_are_checked(op, attrs, complaint):
    with pytest.raises(PurinecError, match=f"{op}.*{complaint}"):
        Graph("g").add_node(op, [], attrs)
