"""Importing ONNX files: numerics against onnxruntime, training, names, refusals."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="the ONNX front end is the onnx extra")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime is the independent reference")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import purinec  # noqa: E402
from purinec.errors import ModelError  # noqa: E402
from purinec.onnxio import read_onnx  # noqa: E402

F = TensorProto.FLOAT


def model(nodes, inputs, outputs, initializers=(), opset=17, name="net"):
    graph = helper.make_graph(nodes, name, inputs, outputs,
                              [numpy_helper.from_array(a, n) for n, a in initializers])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def save(proto, tmp_path, name="net.onnx") -> str:
    path = str(tmp_path / name)
    onnx.save(proto, path)
    return path


def onnxruntime(path, feeds):
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def small_cnn(rng, batch="N"):
    """Conv (uneven pads) + BatchNormalization + Relu + MaxPool (floor mode) + Flatten +
    Gemm + Softmax: what exported classifiers are made of."""
    weights = [("conv.w", rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3),
               ("conv.b", rng.standard_normal(4).astype(np.float32) * 0.1),
               ("bn.scale", rng.uniform(0.5, 1.5, 4).astype(np.float32)),
               ("bn.bias", rng.standard_normal(4).astype(np.float32) * 0.1),
               ("bn.mean", rng.standard_normal(4).astype(np.float32) * 0.1),
               ("bn.var", rng.uniform(0.5, 1.5, 4).astype(np.float32)),
               ("fc.w", rng.standard_normal((5, 4 * 4 * 4)).astype(np.float32) * 0.2),
               ("fc.b", rng.standard_normal(5).astype(np.float32) * 0.1)]
    nodes = [
        helper.make_node("Conv", ["input", "conv.w", "conv.b"], ["c"], pads=[1, 0, 0, 1],
                         strides=[1, 1]),
        helper.make_node("BatchNormalization", ["c", "bn.scale", "bn.bias", "bn.mean",
                                                "bn.var"], ["b"], epsilon=1e-3),
        helper.make_node("Relu", ["b"], ["r"]),
        helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "fc.w", "fc.b"], ["logits"], transB=1),
        helper.make_node("Softmax", ["logits"], ["prob"], axis=1),
    ]
    return model(nodes, [helper.make_tensor_value_info("input", F, [batch, 3, 9, 9])],
                 [helper.make_tensor_value_info("prob", F, [batch, 5])], weights)


@pytest.mark.parametrize("target", ["reference", "cpu"])
def test_a_small_cnn_equals_onnxruntime_at_the_batch_asked_for(tmp_path, target):
    rng = np.random.default_rng(0)
    path = save(small_cnn(rng), tmp_path)
    x = rng.standard_normal((6, 3, 9, 9)).astype(np.float32)
    with purinec.compile(path, target=target, batch=6) as program:
        got = program.run({"input": x})
    np.testing.assert_allclose(got["prob"], onnxruntime(path, {"input": x})["prob"],
                               rtol=1e-5, atol=1e-6)


def with_weights(proto, tmp_path, weights: dict, name: str) -> str:
    """``proto`` saved with the initializers in ``weights`` replaced."""
    new = onnx.ModelProto()
    new.CopyFrom(proto)
    for i, tensor in enumerate(new.graph.initializer):
        if tensor.name in weights:
            new.graph.initializer[i].CopyFrom(numpy_helper.from_array(
                np.asarray(weights[tensor.name], np.float32), tensor.name))
    return save(new, tmp_path, name)


def test_what_reads_the_weights_alone_runs_again_only_after_they_change(tmp_path):
    """Batch norm's ``scale / sqrt(var + eps)`` reads parameters and state alone: an
    inference run computes it at the first call and again only after an assignment or
    a training step changed the weights, each time equal to onnxruntime's with those
    weights (a trace counts the tasks of each call)."""
    from purinec.runtime.trace import Trace

    rng = np.random.default_rng(3)
    proto = small_cnn(rng)
    path = save(proto, tmp_path)
    x = rng.standard_normal((2, 3, 9, 9)).astype(np.float32)
    trace = Trace()

    def check(weights: dict, name: str) -> int:
        """The run's result against onnxruntime's; how many tasks it ran."""
        trace.clear()
        got = program.run({"input": x})["prob"]
        tasks = len(trace.records)
        reference = onnxruntime(with_weights(proto, tmp_path, weights, name), {"input": x})
        np.testing.assert_allclose(got, reference["prob"], rtol=1e-5, atol=1e-6)
        return tasks

    with purinec.compile(path, target="cpu", batch=2, trace=trace,
                         train=purinec.SGD(lr=0.1)) as program:
        first = check({}, "same.onnx")
        assert trace.calls == 1  # (the cached part's tasks are that call's)
        again = check({}, "same.onnx")
        assert first > again
        program.state["bn.var"] = rng.uniform(0.5, 1.5, 4)
        assert check({"bn.var": program.state["bn.var"]}, "var.onnx") == first
        program.step({"input": x, "label": np.array([1, 4], np.int32)})
        assert check({**program.params, **program.state}, "trained.onnx") == first
        assert check({**program.params, **program.state}, "trained.onnx") == again


def test_initializers_become_parameters_and_running_statistics_state(tmp_path):
    rng = np.random.default_rng(1)
    proto = small_cnn(rng)
    program = purinec.compile(save(proto, tmp_path), batch=2)
    given = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    assert sorted(program.params) == ["bn.bias", "bn.scale", "conv.b", "conv.w", "fc.b",
                                      "fc.w"]
    assert sorted(program.state) == ["bn.mean", "bn.var"]
    for name, array in {**program.params, **program.state}.items():
        np.testing.assert_array_equal(array, given[name])


def test_a_training_step_normalizes_by_the_batch_and_updates_running_statistics(tmp_path):
    rng = np.random.default_rng(2)
    path = save(small_cnn(rng), tmp_path)
    x = rng.standard_normal((4, 3, 9, 9)).astype(np.float32)
    label = np.array([0, 3, 1, 4], np.int32)
    steps = {}
    for target in ("reference", "cpu"):
        with purinec.compile(path, target=target, train=purinec.SGD(lr=0.1, momentum=0.9),
                             batch=4) as program:
            before = {k: v.copy() for k, v in program.state.items()}
            loss = program.step({"input": x, "label": label})
            steps[target] = (loss, dict(program.params), dict(program.state))
    loss, params, state = steps["reference"]
    assert np.isfinite(loss) and loss > 0
    # PyTorch's running statistics: momentum 0.9 (ONNX's), the unbiased batch variance.
    conv = _conv_output(x, path)
    count = conv.size // conv.shape[1]
    mean = conv.mean(axis=(0, 2, 3))
    var = conv.var(axis=(0, 2, 3)) * count / (count - 1)
    np.testing.assert_allclose(state["bn.mean"], 0.9 * before["bn.mean"] + 0.1 * mean,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["bn.var"], 0.9 * before["bn.var"] + 0.1 * var,
                               rtol=1e-5, atol=1e-6)
    cpu_loss, cpu_params, cpu_state = steps["cpu"]
    assert cpu_loss == pytest.approx(loss, rel=1e-5)
    for name in params:
        np.testing.assert_allclose(cpu_params[name], params[name], rtol=1e-4, atol=1e-6)


def _conv_output(x, path):
    """The convolution's output, by onnxruntime (the batch statistics' input)."""
    proto = onnx.load(path)
    proto.graph.output.append(helper.make_tensor_value_info("c", F, None))
    del proto.graph.output[0]
    changed = path.replace(".onnx", ".conv.onnx")
    onnx.save(proto, changed)
    return onnxruntime(changed, {"input": x})["c"]


def test_dropout_drops_only_in_training(tmp_path):
    nodes = [helper.make_node("Dropout", ["x", "ratio"], ["d"]),
             helper.make_node("Gemm", ["d", "w"], ["y"])]
    w = np.eye(8, 3, dtype=np.float32)
    proto = model(nodes, [helper.make_tensor_value_info("x", F, [2, 8])],
                  [helper.make_tensor_value_info("y", F, [2, 3])],
                  [("w", w), ("ratio", np.array(0.5, np.float32))])
    path = save(proto, tmp_path)
    x = np.ones((2, 8), np.float32)
    np.testing.assert_array_equal(purinec.compile(path).run({"x": x})["y"], x @ w)
    program = purinec.compile(path, train=purinec.SGD(lr=0.01))
    assert "dropout_mask" in {n.op for n in program.ir.nodes}
    program.step({"x": x, "label": np.zeros(2, np.int32)})
    assert program.state["iteration"] == 1


def test_names_the_ir_cannot_take_are_sanitized_and_shown(tmp_path):
    nodes = [helper.make_node("Relu", ["input:0"], ["onnx::Relu_1"]),
             helper.make_node("Add", ["onnx::Relu_1", "7bias"], ["out/put"])]
    proto = model(nodes, [helper.make_tensor_value_info("input:0", F, [2, 3])],
                  [helper.make_tensor_value_info("out/put", F, [2, 3])],
                  [("7bias", np.ones(3, np.float32))])
    imported = read_onnx(proto)
    assert dict(imported.mapping()) == {"input:0": "input_0", "7bias": "v7bias",
                                        "out/put": "out_put"}
    program = purinec.compile(proto)
    x = np.array([[-1, 0, 2], [3, -4, 5]], np.float32)
    np.testing.assert_array_equal(program.run({"input_0": x})["out_put"],
                                  np.maximum(x, 0) + 1)


def test_dump_shows_the_onnx_names_it_changed(tmp_path, capsys):
    from purinec.cli import main

    nodes = [helper.make_node("Relu", ["input:0"], ["y"])]
    path = save(model(nodes, [helper.make_tensor_value_info("input:0", F, [2, 3])],
                      [helper.make_tensor_value_info("y", F, [2, 3])]), tmp_path)
    assert main(["dump", path, "--stage", "lower"]) == 0
    out = capsys.readouterr().out
    assert "# ONNX 'input:0' is %input_0" in out
    assert "%y = relu(%input_0)" in out


def test_a_symbolic_batch_takes_the_batch_asked_for_and_one_by_default():
    proto = model([helper.make_node("Relu", ["x"], ["y"])],
                  [helper.make_tensor_value_info("x", F, ["batch", 3])],
                  [helper.make_tensor_value_info("y", F, ["batch", 3])])
    assert purinec.compile(proto).ir.inputs[0].type.shape == (1, 3)
    assert purinec.compile(proto, batch=7).ir.inputs[0].type.shape == (7, 3)


def test_shapes_computed_from_constants_fold_away():
    # x.view(x.size(0), -1) as PyTorch's tracer writes it.
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Unsqueeze", ["n", "zero1"], ["n1"]),
             helper.make_node("Concat", ["n1", "minus1"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    proto = model(nodes, [helper.make_tensor_value_info("x", F, ["N", 2, 3])],
                  [helper.make_tensor_value_info("y", F, ["N", 6])],
                  [("zero", np.array(0, np.int64)), ("zero1", np.array([0], np.int64)),
                   ("minus1", np.array([-1], np.int64))])
    program = purinec.compile(proto, batch=4)
    assert [n.op for n in program.ir.nodes] == ["reshape"]
    x = np.arange(24, dtype=np.float32).reshape(4, 2, 3)
    np.testing.assert_array_equal(program.run({"x": x})["y"], x.reshape(4, 6))


# -- refusals -------------------------------------------------------------------------------


def test_every_unsupported_node_is_named_at_once():
    nodes = [helper.make_node("Relu", ["x"], ["a"]),
             helper.make_node("TopK", ["a", "k"], ["b", "i"], name="top"),
             helper.make_node("Einsum", ["b"], ["y"], equation="ij->ji", name="ein")]
    proto = model(nodes, [helper.make_tensor_value_info("x", F, [2, 3]),
                          helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
                  [helper.make_tensor_value_info("y", F, ["a", "b"])])
    with pytest.raises(ModelError, match=r"2 node\(s\) use ops purinec does not support: "
                                         r"top \(TopK\); ein \(Einsum\)\. Supported ops: "
                                         r"Abs, Add, "):
        read_onnx(proto)


def test_an_attribute_value_purinec_cannot_take_names_the_node():
    nodes = [helper.make_node("Pad", ["x", "pads"], ["y"], mode="wrap", name="padding")]
    proto = model(nodes, [helper.make_tensor_value_info("x", F, [2, 3])],
                  [helper.make_tensor_value_info("y", F, [4, 5])],
                  [("pads", np.array([1, 1, 1, 1], np.int64))])
    with pytest.raises(ModelError, match=r"node padding \(Pad\): mode 'wrap' is not "
                                         r"supported \(constant, reflect and edge are\)"):
        purinec.compile(proto)


def test_a_symbolic_dimension_besides_the_batch_is_refused():
    proto = model([helper.make_node("Relu", ["x"], ["y"])],
                  [helper.make_tensor_value_info("x", F, ["N", "seq"])],
                  [helper.make_tensor_value_info("y", F, ["N", "seq"])])
    with pytest.raises(ModelError, match=r"input x has a symbolic dimension 'seq' at axis "
                                         r"1; .*fixes only the batch"):
        read_onnx(proto)


def test_types_purinec_does_not_compute_in_are_refused():
    proto = model([helper.make_node("Relu", ["x"], ["y"])],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2])])
    with pytest.raises(ModelError, match=r"input x is of ONNX type float16; purinec "
                                         r"computes in float, double, int32, int64 and bool"):
        purinec.compile(proto)


def test_files_that_are_not_onnx_models_are_refused(tmp_path):
    with pytest.raises(ModelError, match=r"ONNX file .*missing.onnx does not exist"):
        purinec.compile(str(tmp_path / "missing.onnx"))
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00\xffnot a protobuf" * 10)
    with pytest.raises(ModelError, match=r"garbage.onnx is not an? (ONNX model file|valid)"):
        purinec.compile(str(garbage))
    invalid = model([helper.make_node("Relu", ["nowhere"], ["y"])],
                    [helper.make_tensor_value_info("x", F, [2])],
                    [helper.make_tensor_value_info("y", F, [2])])
    with pytest.raises(ModelError, match=r"is not a valid ONNX model"):
        purinec.compile(save(invalid, tmp_path, "invalid.onnx"))


def test_training_needs_one_output_of_class_scores():
    proto = model([helper.make_node("Relu", ["x"], ["y"])],
                  [helper.make_tensor_value_info("x", F, [2, 3, 4])],
                  [helper.make_tensor_value_info("y", F, [2, 3, 4])])
    with pytest.raises(ModelError, match=r"training an ONNX model needs one output of class "
                                         r"scores \[batch, classes\].*y: f32\[2,3,4\]"):
        purinec.compile(proto, train=purinec.SGD(lr=0.1))


def test_model_options_other_than_the_batch_are_refused(tmp_path):
    path = save(small_cnn(np.random.default_rng(0)), tmp_path)
    with pytest.raises(ModelError, match=r"an ONNX model takes no model options \(given "
                                         r"num_classes\); only batch"):
        purinec.compile(path, num_classes=3)


def test_purinec_train_trains_a_classifier_from_an_onnx_file(tmp_path, capsys):
    from purinec.cli import main

    rng = np.random.default_rng(3)
    weights = [("c.w", (rng.standard_normal((8, 1, 3, 3)) * 0.4).astype(np.float32)),
               ("c.b", np.zeros(8, np.float32)),
               ("f.w", (rng.standard_normal((10, 8 * 4 * 4)) * 0.1).astype(np.float32)),
               ("f.b", np.zeros(10, np.float32))]
    nodes = [helper.make_node("Conv", ["image", "c.w", "c.b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "f.w", "f.b"], ["scores"], transB=1)]
    path = save(model(nodes, [helper.make_tensor_value_info("image", F, ["N", 1, 8, 8])],
                      [helper.make_tensor_value_info("scores", F, ["N", 10])], weights),
                tmp_path, "digits.onnx")
    checkpoint = str(tmp_path / "digits.purine")
    assert main(["train", path, "--data", "digits", "--epochs", "2", "--batch", "32",
                 "--target", "reference", "--checkpoint", checkpoint, "--quiet"]) == 0
    accuracy = float(capsys.readouterr().out.split("test accuracy")[-1].split()[0])
    assert accuracy > 0.8
    trained = purinec.load(checkpoint)
    assert not np.array_equal(trained.params["c.w"], weights[0][1])


def test_purinec_compile_and_run_take_an_onnx_file(tmp_path, capsys):
    from purinec.cli import main

    rng = np.random.default_rng(4)
    path = save(small_cnn(rng), tmp_path)
    x = rng.standard_normal((3, 3, 9, 9)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    artifact, out = str(tmp_path / "cnn.purine"), str(tmp_path / "out.npz")
    assert main(["compile", path, "--batch", "3", "--target", "reference",
                 "-o", artifact]) == 0
    assert main(["run", artifact, "--input", f"input={tmp_path / 'x.npy'}",
                 "--output", out]) == 0
    with np.load(out) as saved:
        np.testing.assert_allclose(saved["prob"], onnxruntime(path, {"input": x})["prob"],
                                   rtol=1e-5, atol=1e-6)
