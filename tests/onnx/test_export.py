"""ONNX export: every zoo model and every op with an ONNX spelling written, checked by
the onnx package and run by onnxruntime against the reference target; files read back
by purinec; trained weights, the command line, and what is refused."""

import contextlib
import itertools
import os

import numpy as np
import pytest

import purinec
from purinec.cli import main
from purinec.errors import ArtifactError, ExportError, ShapeError
from purinec.ir.graph import Graph
from purinec.ir.ops import REGISTRY, Trait, op_has
from purinec.ir.types import Device, DType, TensorType
from purinec.models.zoo import ZOO
from purinec.onnxio import OPSET, export_onnx
from purinec.onnxio.export import WRITERS
from purinec.program import Program

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

RTOL, ATOL = 1e-4, 1e-5


def onnxruntime_outputs(path, feeds) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(os.fspath(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))


def random_feeds(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {v.name: rng.standard_normal(v.type.shape).astype(v.type.dtype.numpy)
            for v in graph.inputs_with_role("data")}


def assert_same_outputs(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


def checked(path) -> "onnx.ModelProto":
    model = onnx.load(os.fspath(path))
    onnx.checker.check_model(model, full_check=True)
    return model


# -- the zoo --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(ZOO))
def test_a_zoo_model_exports_and_onnxruntime_computes_what_the_reference_does(name, tmp_path):
    program = purinec.compile(name, target="reference", batch=2)
    path = tmp_path / f"{name}.onnx"
    exported = program.export_onnx(path)
    model = checked(path)
    assert exported.opset == OPSET and [o.version for o in model.opset_import] == [OPSET]
    graph = program.eval_ir
    data = graph.inputs_with_role("data")
    assert [(i.name, tuple(d.dim_value for d in i.type.tensor_type.shape.dim))
            for i in model.graph.input] == [(v.name, v.type.shape) for v in data]
    assert sorted(t.name for t in model.graph.initializer) == sorted(program.params)
    feeds = random_feeds(graph)
    assert_same_outputs(onnxruntime_outputs(path, feeds), program.run(feeds))


@pytest.mark.parametrize("name", sorted(ZOO))
def test_a_zoo_model_read_back_from_its_onnx_file_is_the_same_model(name, tmp_path):
    program = purinec.compile(name, target="reference", batch=2, seed=5)
    path = tmp_path / f"{name}.onnx"
    program.export_onnx(path)
    again = purinec.compile(path, target="reference")
    assert sorted(again.params) == sorted(program.params)  # the biases stay parameters
    for name_ in program.params:
        np.testing.assert_array_equal(again.params[name_], program.params[name_])
    feeds = random_feeds(program.eval_ir, seed=1)
    assert_same_outputs(again.run(feeds), program.run(feeds))


@pytest.mark.slow  # Numba compiles the kernels
def test_a_fused_cpu_program_exports_its_members(tmp_path):
    program = purinec.compile("lenet", target="cpu", batch=2)
    assert any(node.body for node in program.eval_ir.nodes)
    path = tmp_path / "lenet.onnx"
    program.export_onnx(path)
    checked(path)
    feeds = random_feeds(program.eval_ir)
    assert_same_outputs(onnxruntime_outputs(path, feeds), program.run(feeds))
    program.close()


# -- every op -------------------------------------------------------------------------------

def f32(*shape) -> TensorType:
    return TensorType(shape, DType.f32)


class Builder:
    """A graph of one data input ``x`` and many small computations on it, each returned."""

    def __init__(self, name: str, shape):
        self.graph = Graph(name)
        self.x = self.graph.add_input("x", f32(*shape))
        self.outputs = []
        self.params: dict[str, np.ndarray] = {}
        self.rng = np.random.default_rng(7)

    def param(self, name: str, *shape):
        self.params[name] = self.rng.standard_normal(shape).astype(np.float32)
        return self.graph.add_input(name, f32(*shape), role="param", init="xavier")

    def op(self, op: str, inputs, **attrs):
        return self.graph.add_node(op, inputs, attrs).outputs

    def out(self, value, name: str | None = None):
        self.outputs.append((name or value.name, value))
        return value

    def done(self) -> Graph:
        self.graph.set_outputs(self.outputs)
        return self.graph


def elementwise_graph() -> tuple[Graph, dict]:
    b = Builder("elementwise", (2, 3, 4, 5))
    x = b.x
    (positive,) = b.op("add_scalar", b.op("abs", [x]), value=0.5)
    for op in ("relu", "sigmoid", "tanh", "neg", "exp", "abs", "erf", "hard_swish"):
        b.out(b.op(op, [x])[0])
    for op in ("log", "sqrt"):
        b.out(b.op(op, [positive])[0])
    b.out(b.op("leaky_relu", [x], alpha=0.2)[0])
    b.out(b.op("hard_sigmoid", [x], alpha=0.3, beta=0.4)[0])
    b.out(b.op("clip", [x], min=-0.5, max=0.25)[0])
    b.out(b.op("clip", [x], min=0.0)[0])
    b.out(b.op("scale", [x], alpha=-1.5)[0])
    (y,) = b.op("scale", [x], alpha=0.5)
    for op in ("add", "sub", "mul", "div"):
        b.out(b.op(op, [x, y])[0])
    b.out(b.op("pow", [positive, y])[0])
    (ints,) = b.op("cast", [b.op("scale", [x], alpha=4.0)[0]], dtype="i32")
    b.out(ints)
    b.out(b.op("cast", [ints], dtype="f32")[0])
    (flags,) = b.op("cast", [b.op("relu", [x])[0]], dtype="bool")
    b.out(b.op("add_scalar", [flags], value=0.0)[0])
    for axis in (1, 3):
        bias = b.param(f"bias{axis}", x.type.shape[axis])
        b.out(b.op("bias_add", [x, bias], axis=axis)[0])
    b.out(b.op("fill", [], shape=[2, 3], dtype="f32", value=2.5)[0])
    b.out(b.op("broadcast_to", [b.op("reshape", [b.param("row", 5)], shape=[1, 5])[0]],
               shape=[2, 3, 4, 5])[0])
    return b.done(), b.params


def shape_graph() -> tuple[Graph, dict]:
    b = Builder("shapes", (2, 3, 4, 5))
    x = b.x
    b.out(b.op("reshape", [x], shape=[6, 20])[0])
    b.out(b.op("transpose", [x], perm=[0, 2, 3, 1])[0])
    pieces = b.op("split", [x], axis=2, sections=[1, 3])
    for piece in pieces:
        b.out(piece)
    b.out(b.op("concat", [pieces[1], pieces[0], x], axis=2)[0])
    b.out(b.op("strided_slice", [x], starts=[1, 2, 0, 4], steps=[1, -1, 2, -2],
               sizes=[1, 3, 2, 3])[0])
    b.out(b.op("strided_slice", [x], starts=[0, 0, 1, 1], steps=[1, 1, 1, 3],
               sizes=[2, 3, 3, 2])[0])
    for mode, value in (("constant", 1.5), ("reflect", 0.0), ("edge", 0.0)):
        b.out(b.op("pad", [x], pads=[0, 0, 1, 2, 0, 1, 2, 0], mode=mode, value=value)[0])
    for axes, keep in (([1, 3], True), ([0], False), ([], False)):
        b.out(b.op("reduce_sum", [x], axes=axes, keepdims=keep)[0])
    for axis in (1, 3):
        b.out(b.op("softmax", [x], axis=axis)[0])
        b.out(b.op("log_softmax", [x], axis=axis)[0])
    b.out(x, "x_again")  # a graph input returned: an Identity
    return b.done(), b.params


def window_graph() -> tuple[Graph, dict]:
    b = Builder("windows", (2, 4, 9, 8))
    x = b.x
    w = b.param("w", 6, 2, 3, 3)
    (conv,) = b.op("conv2d", [x, w], stride=[2, 1], pad=[1, 0, 2, 1], groups=2,
                   dilation=[1, 2])
    b.out(conv)  # returned, and read by the bias_add: the Conv has no bias of its own
    b.out(b.op("bias_add", [conv, b.param("conv_bias", 6)], axis=1)[0])
    (plain,) = b.op("conv2d", [x, b.param("w1", 3, 4, 1, 1)])
    b.out(b.op("bias_add", [plain, b.param("w1_bias", 3)], axis=1)[0], "biased")
    for ceil in (True, False):
        b.out(b.op("max_pool2d", [x], kernel=[3, 3], stride=[2, 2], pad=[1, 1],
                   ceil_mode=ceil)[0])
        for count in (True, False):
            b.out(b.op("avg_pool2d", [x], kernel=[3, 2], stride=[2, 3], pad=[1, 0, 0, 1],
                       dilation=[2, 1], ceil_mode=ceil, count_include_pad=count)[0])
    b.out(b.op("global_avg_pool", [x])[0])
    for size in (1, 5):
        b.out(b.op("lrn", [x], size=size, alpha=0.01, beta=0.6, k=2.0)[0])
    (flat,) = b.op("reshape", [x], shape=[2, 288])
    for trans_a, trans_b in ((False, True), (True, False)):
        a = b.op("transpose", [flat], perm=[1, 0])[0] if trans_a else flat
        w = b.param(f"fc{int(trans_a)}", *((7, 288) if trans_b else (288, 7)))
        (product,) = b.op("matmul", [a, w], trans_a=trans_a, trans_b=trans_b)
        b.out(b.op("bias_add", [product, b.param(f"fc{int(trans_a)}_bias", 7)], axis=1)[0])
    return b.done(), b.params


GRAPHS = [elementwise_graph, shape_graph, window_graph]


def pool_graph(width: int) -> Graph:
    """Pools of every small window along the width, in floor and ceil mode: last windows
    that fit, hang out of the padded input, or would start past the input (which Caffe
    and onnxruntime drop, and onnx's shape inference counts); the height's windows (3,
    stride 2, over 6) hang out in ceil mode."""
    b = Builder(f"pools{width}", (1, 2, 6, width))
    for k, stride, begin, end, d, ceil, op, count in itertools.product(
            (1, 2, 3), (1, 2, 3), (0, 1, 2), (0, 1, 2), (1, 2), (True, False),
            ("max_pool2d", "avg_pool2d"), (True, False)):
        if max(begin, end) >= k or op == "max_pool2d" and not count:
            continue  # (onnxruntime wants pads below the kernel)
        attrs = dict(kernel=[3, k], stride=[2, stride], pad=[0, begin, 0, end],
                     dilation=[1, d], ceil_mode=ceil)
        if op == "avg_pool2d":
            attrs["count_include_pad"] = count
        with contextlib.suppress(ShapeError):  # a window of padding alone
            b.out(b.op(op, [b.x], **attrs)[0])
    return b.done()


@pytest.mark.parametrize("width", range(4, 9))
def test_pool_windows_at_every_edge_are_the_reference_windows(width, tmp_path):
    graph = pool_graph(width)
    path = tmp_path / "pools.onnx"
    export_onnx(graph, {}, {}, path)
    feeds = random_feeds(graph)
    assert_same_outputs(onnxruntime_outputs(path, feeds), Program.from_ir(graph).run(feeds))


@pytest.mark.parametrize("build", GRAPHS, ids=lambda f: f.__name__)
def test_every_op_onnxruntime_computes_what_the_reference_does(build, tmp_path):
    graph, params = build()
    program = Program.from_ir(graph, params=params)
    path = tmp_path / f"{graph.name}.onnx"
    export_onnx(graph, params, {}, path)
    checked(path)
    feeds = random_feeds(graph)
    assert_same_outputs(onnxruntime_outputs(path, feeds), program.run(feeds))


def test_the_op_graphs_use_every_op_with_an_onnx_spelling():
    used = {node.op for build in GRAPHS for node in build()[0].nodes}
    assert set(WRITERS) & set(REGISTRY) <= used


def test_a_conv_followed_by_its_bias_is_one_onnx_conv():
    graph, params = window_graph()
    model = onnx_model(graph, params)
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert [len(n.input) for n in convs] == [2, 3]  # the first conv is returned as it is
    assert [n.op_type for n in model.graph.node].count("Gemm") == 2


def onnx_model(graph, params):
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "m.onnx")
        export_onnx(graph, params, {}, path)
        return onnx.load(path)


def test_a_later_opset_spells_the_ops_alike(tmp_path):
    graph, params = window_graph()
    path = tmp_path / "w.onnx"
    assert export_onnx(graph, params, {}, path, opset=OPSET + 2).opset == OPSET + 2
    assert checked(path).opset_import[0].version == OPSET + 2


# -- trained weights, Program and the command line ------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """mlp on 8x8 images, three steps of SGD, saved."""
    program = purinec.compile("mlp", train=purinec.SGD(lr=0.1), batch=4,
                              input_shape=(1, 8, 8))
    rng = np.random.default_rng(0)
    for _ in range(3):
        program.step({"data": rng.standard_normal((4, 1, 8, 8)).astype(np.float32),
                      "label": rng.integers(0, 10, 4).astype(np.int32)})
    path = tmp_path_factory.mktemp("trained") / "mlp.purine"
    program.save(path)
    return program, path


def test_a_trained_artifact_exports_its_trained_weights(trained, tmp_path, capsys):
    program, artifact = trained
    path = tmp_path / "trained.onnx"
    assert main(["export", str(artifact), "-o", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {path} (")
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in checked(path).graph.initializer}
    fresh = purinec.compile("mlp", batch=4, input_shape=(1, 8, 8))
    assert sorted(weights) == sorted(program.params)
    for name in program.params:
        np.testing.assert_array_equal(weights[name], program.params[name])
        assert not np.array_equal(weights[name], fresh.params[name]), name
    feeds = random_feeds(program.eval_ir)
    assert_same_outputs(onnxruntime_outputs(path, feeds), program.run(feeds))


def test_export_writes_the_weights_compile_starts_from(tmp_path, capsys):
    path = tmp_path / "convnet.onnx"
    assert main(["export", "convnet", "-o", str(path), "--batch", "3", "--seed", "4"]) == 0
    assert "ONNX opset" in capsys.readouterr().out
    model = checked(path)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 3
    program = purinec.compile("convnet", batch=3, seed=4)
    for tensor in model.graph.initializer:
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(tensor),
                                      program.params[tensor.name])


def test_export_takes_an_onnx_file_and_a_pir_file(tmp_path, capsys):
    first, second, pir = tmp_path / "a.onnx", tmp_path / "b.onnx", tmp_path / "m.pir"
    assert main(["export", "mlp", "--batch", "2", "-o", str(first)]) == 0
    pir.write_text(str(purinec.compile("mlp", batch=2).eval_ir))
    for source, target in ((first, second), (pir, tmp_path / "c.onnx")):
        assert main(["export", str(source), "-o", str(target)]) == 0
        feeds = random_feeds(purinec.compile("mlp", batch=2).eval_ir)
        assert_same_outputs(onnxruntime_outputs(target, feeds),
                            onnxruntime_outputs(first, feeds))


@pytest.mark.parametrize("args, fragment", [
    (["mlp", "-o", "m.purine"], "name the file FILE.onnx"),
    (["mlp", "-o", "missing/m.onnx"], "does not exist"),
    (["ARTIFACT", "-o", "m.onnx", "--batch", "2"], "--batch: "),
    (["ARTIFACT", "-o", "m.onnx", "--seed", "1"], "--seed: "),
    (["nosuchmodel", "-o", "m.onnx"], "nosuchmodel"),
])
def test_export_command_refusals(args, fragment, trained, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = [str(trained[1]) if a == "ARTIFACT" else a for a in args]
    assert main(["export", *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("purinec: error: ") and fragment in err, err
    assert os.listdir(tmp_path) == []


# -- refusals -------------------------------------------------------------------------------

def test_an_op_without_an_onnx_spelling_is_refused_naming_the_node(trained, tmp_path):
    program, _ = trained
    graph = program.ir  # the training iteration: losses, gradients, SGD
    state = {name: program.state[name] for name in program.state}
    with pytest.raises(ExportError, match=r"node %\S+ \((softmax_xent|accuracy).*no ONNX "
                                          r"spelling"):
        export_onnx(graph, dict(program.params.items()), state, tmp_path / "t.onnx")
    assert os.listdir(tmp_path) == []
    refused = sorted(op for op in REGISTRY if op not in WRITERS and op != "fused"
                     and not op_has(op, Trait.communicates))
    assert {"softmax_xent", "sgd", "dropout_mask", "conv2d_grad_input"} <= set(refused)


def test_a_program_over_several_devices_is_refused(tmp_path):
    program = purinec.compile("mlp", batch=4, devices=2)
    with pytest.raises(ExportError, match="cpu:0, cpu:1.*compile the model for one device"):
        program.export_onnx(tmp_path / "m.onnx")
    with pytest.raises(ExportError, match="distributed program cannot be written"):
        export_onnx(program.eval_ir, dict(program.params.items()), {}, tmp_path / "m.onnx")
    program.close()
    assert os.listdir(tmp_path) == []


def test_a_graph_on_one_rank_with_communication_is_refused(tmp_path):
    graph = Graph("moving")
    x = graph.add_input("x", f32(2, 3))
    (y,) = graph.add_node("copy", [x], device=Device.parse("cpu:0")).outputs
    graph.set_outputs([("y", y)])
    with pytest.raises(ExportError, match=r"node %\S+ \(copy\) communicates"):
        export_onnx(graph, {}, {}, tmp_path / "m.onnx")


def test_an_unwritable_path_leaves_nothing_behind(tmp_path):
    program = purinec.compile("mlp", batch=2)
    with pytest.raises(ArtifactError, match="cannot write"):
        program.export_onnx(tmp_path / "missing" / "m.onnx")
    (tmp_path / "folder.onnx").mkdir()
    with pytest.raises(ArtifactError, match="cannot write"):
        program.export_onnx(tmp_path / "folder.onnx")
    assert os.listdir(tmp_path) == ["folder.onnx"]
    assert os.listdir(tmp_path / "folder.onnx") == []


def test_a_missing_weight_and_a_wrong_opset_are_refused(tmp_path):
    graph, params = window_graph()
    with pytest.raises(ExportError, match=r"no array given for param w \(f32\[6,2,3,3\]\)"):
        export_onnx(graph, {k: v for k, v in params.items() if k != "w"}, {},
                    tmp_path / "w.onnx")
    with pytest.raises(ExportError, match=f"opset 17: purinec writes ONNX opsets {OPSET} to"):
        export_onnx(graph, params, {}, tmp_path / "w.onnx", opset=17)
    assert os.listdir(tmp_path) == []
