"""Simulator cases: whole programs on the cuda target against the reference target (see
`tests.on_cuda.simulate`): training steps, data parallelism over two gpu devices."""

from __future__ import annotations

import os
import threading
from unittest import mock

import numpy as np


def tiny_mlp(batch: int = 4, hidden: int = 8, classes: int = 3):
    from purinec.bigraph import Accuracy, Blob, InnerProduct, Net, ReLU, SoftmaxWithLoss

    with Net("tiny_mlp") as net:
        data = Blob("data", (batch, 2, 3), "f32")
        label = Blob("label", (batch,), "i32")
        logits = (data >> InnerProduct("ip1", hidden) >> ReLU("relu1")
                  >> InnerProduct("ip2", classes) >> Blob("logits"))
        loss = [logits, label] >> SoftmaxWithLoss("loss")
        accuracy = [logits, label] >> Accuracy("accuracy")
        net.outputs = [logits, loss, accuracy]
    return net


def tiny_convnet(batch: int = 2, classes: int = 3):
    """lenet's layers (and an LRN, an average pool) at a size the simulator runs."""
    from purinec.bigraph import (LRN, Accuracy, AvgPool, Blob, Conv, InnerProduct, MaxPool,
                                 Net, ReLU, SoftmaxWithLoss)

    with Net("tiny_convnet") as net:
        data = Blob("data", (batch, 2, 7, 7), "f32")
        label = Blob("label", (batch,), "i32")
        logits = (data >> Conv("conv1", 3, 3, pad=1) >> ReLU("relu1")
                  >> MaxPool("pool1", 3, 2) >> LRN("norm1", size=3)
                  >> Conv("conv2", 4, 2, stride=1) >> AvgPool("pool2", 2, 1)
                  >> InnerProduct("ip1", classes) >> Blob("logits"))
        loss = [logits, label] >> SoftmaxWithLoss("loss")
        accuracy = [logits, label] >> Accuracy("accuracy")
        net.outputs = [logits, loss, accuracy]
    return net


def tiny_onnx_cnn(batch: int = 2, classes: int = 3):
    """An ONNX model of what imported CNNs are made of: a strided convolution with
    uneven pads, batch normalization (batch statistics when training), a clip (ReLU6),
    global average pooling, a Gemm."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    weights = {"w": rng.normal(0, 0.5, (4, 2, 3, 3)), "b": rng.normal(0, 0.1, 4),
               "scale": rng.uniform(0.5, 1.5, 4), "shift": rng.normal(0, 0.1, 4),
               "mean": rng.normal(0, 0.1, 4), "var": rng.uniform(0.5, 1.5, 4),
               "fc": rng.normal(0, 0.5, (classes, 4)), "fc_b": rng.normal(0, 0.1, classes),
               "low": np.array(0.0), "high": np.array(6.0)}
    nodes = [helper.make_node("Conv", ["data", "w", "b"], ["c"], strides=[2, 2],
                              pads=[1, 0, 0, 1]),
             helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"],
                              ["n"]),
             helper.make_node("Clip", ["n", "low", "high"], ["r"]),
             helper.make_node("GlobalAveragePool", ["r"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "fc", "fc_b"], ["logits"], transB=1)]
    graph = helper.make_graph(
        nodes, "tiny_onnx_cnn",
        [helper.make_tensor_value_info("data", TensorProto.FLOAT, [batch, 2, 6, 6])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])],
        [numpy_helper.from_array(a.astype(np.float32), name) for name, a in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def feeds_for(graph, rng, classes: int) -> dict:
    """Random data inputs of ``graph``: integer ones are labels below ``classes``."""
    feeds = {}
    for value in graph.inputs_with_role("data"):
        shape, dtype = value.type.shape, value.type.dtype.numpy
        feeds[value.name] = (rng.integers(0, classes, shape).astype(dtype)
                             if dtype.kind == "i" else rng.normal(size=shape).astype(dtype))
    return feeds


def same_training(model, **options) -> None:
    """`trained_alike` (a case returns nothing: it checks itself)."""
    trained_alike(model, **options)


def trained_alike(model, steps: int = 2, classes: int = 10, rtol: float = 2e-4,
                  devices=None, parallel=None, **model_options):
    """``steps`` SGD steps on cuda and on the reference target, from the same weights
    and data: losses and every weight after them agree, and then inference. Returns the
    cuda program."""
    import purinec

    rng = np.random.default_rng(1)
    sgd = purinec.SGD(lr=0.1, momentum=0.9, weight_decay=1e-3)
    cuda = purinec.compile(model, target="cuda", train=sgd, devices=devices,
                           parallel=parallel, **model_options)
    reference = purinec.compile(model, target="reference", train=sgd, **model_options)
    for name in reference.params:
        cuda.params[name] = reference.params[name].copy()
    for step in range(steps):
        feeds = feeds_for(reference.ir, rng, classes)
        want, got = reference.step(feeds), cuda.step(feeds)
        if not np.isclose(got, want, rtol=rtol, atol=1e-6):
            raise AssertionError(f"step {step}: loss {got} on cuda, {want} on reference")
    cuda.gather_weights()
    for name in reference.params:
        np.testing.assert_allclose(cuda.params[name], reference.params[name], rtol=rtol,
                                   atol=1e-5, err_msg=f"param {name}")
    feeds = feeds_for(reference.eval_ir, rng, classes)
    got, want = cuda.run(feeds), reference.run(feeds)
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=rtol, atol=1e-5,
                               err_msg="inference logits")
    return cuda


def graphed_training(model, expect: str = "replaying one CUDA graph per call", **options):
    """`trained_alike` with ``PURINEC_CUDA_GRAPHS=1``: the second step captures the
    iteration as a CUDA graph, later ones replay it (the simulator's stand-in: the
    captured calls with their captured arguments), on new batches each step; and the
    program says it ran so (``expect``, the start of its ``cuda_graphs``)."""
    with graphs_on():
        program = trained_alike(model, steps=4, classes=3, **options)
    assert program.cuda_graphs.startswith(expect), program.cuda_graphs


def graphs_on(mode: str = "1"):
    """``PURINEC_CUDA_GRAPHS=mode`` meanwhile."""
    from purinec.runtime.gpu import GRAPHS_VAR

    return mock.patch.dict(os.environ, {GRAPHS_VAR: mode})


def graphs_chosen_by_time() -> None:
    """``PURINEC_CUDA_GRAPHS=auto`` keeps the graph where replays time faster than
    launches and launches where not (a clock that says so: every timed call takes
    0.5 s, a replay ``extra`` more), and launches where capturing fails; training is
    right in every case, on new batches each step through the trials and after (call
    1 compiles, 2 is timed launching, 3 captures, 4 is timed replaying, 5 runs the
    chosen way)."""
    from purinec.runtime import gpu

    replay, capture = gpu.CapturedStep.__call__, gpu._SimulatedGraph.capture
    now = [0.0]

    def fake_clock():
        now[0] += 0.5
        return now[0]

    def failing_capture(graph, calls):
        raise gpu.ExecutionError("the driver refused (a stand-in)")

    for extra, fails, expect in ((-0.25, False, "replaying one CUDA graph per call "
                                                "(250 ms a call against 500 launching"),
                                 (0.5, False, "launching task by task (500 ms a call "
                                              "against 1e+03 replaying"),
                                 (0.0, True, "launching task by task: capturing a CUDA "
                                             "graph failed (ExecutionError: the driver "
                                             "refused")):
        def timed_replay(step, plan, extra=extra):
            now[0] += extra
            return replay(step, plan)
        # (the simulator is slow: one call timed each way)
        with mock.patch.object(gpu, "TRIAL_CALLS", 1), \
                mock.patch.object(gpu.GraphChoice, "clock", staticmethod(fake_clock)), \
                mock.patch.object(gpu.CapturedStep, "__call__", timed_replay), \
                mock.patch.object(gpu._SimulatedGraph, "capture",
                                  failing_capture if fails else capture), \
                graphs_on("auto"):
            program = trained_alike(tiny_mlp(), steps=5, classes=3)
        assert program.cuda_graphs.startswith(expect), program.cuda_graphs


def weights_stay_on_the_gpu(devices=None) -> None:
    """Between steps the weights stay on the GPU (nothing copies them in or out); a read,
    an assignment and an inference run in between each see and use the latest values,
    as on the reference target. With ``devices``, every replica stays on its GPU."""
    import purinec
    from purinec.runtime.gpu import GpuExecutable

    rng = np.random.default_rng(4)
    sgd = purinec.SGD(lr=0.1, momentum=0.9)
    cuda = purinec.compile(tiny_mlp(), target="cuda", train=sgd, devices=devices)
    reference = purinec.compile(tiny_mlp(), target="reference", train=sgd)
    for name in reference.params:
        cuda.params[name] = reference.params[name].copy()
    main = cuda._run_main
    if devices is not None:
        assert main.kept >= set(reference.params), main.kept
        main = main.physical
    assert isinstance(main, GpuExecutable) and main.resident, main

    def step_both():
        feeds = feeds_for(reference.ir, rng, classes=3)
        want, got = reference.step(feeds), cuda.step(feeds)
        assert np.isclose(got, want, rtol=2e-4), (got, want)

    step_both()
    assert main._loaded and all(host is None for host in main._loaded.values()), \
        "after a step the GPU holds the newest weights, and no host array does"
    stale = cuda.params._arrays["ip1.weight"].copy()
    step_both()
    np.testing.assert_array_equal(cuda.params._arrays["ip1.weight"], stale)  # not pulled
    np.testing.assert_allclose(cuda.params["ip1.weight"], reference.params["ip1.weight"],
                               rtol=2e-4, atol=1e-6)  # a read pulls
    for program in (cuda, reference):
        program.params["ip2.weight"] = program.params["ip2.weight"] * 0.5
    step_both()
    feeds = feeds_for(reference.eval_ir, rng, classes=3)
    np.testing.assert_allclose(cuda.run(feeds)["logits"], reference.run(feeds)["logits"],
                               rtol=2e-4, atol=1e-5)
    step_both()
    for name in reference.params:
        np.testing.assert_allclose(cuda.params[name], reference.params[name], rtol=2e-4,
                                   atol=1e-5, err_msg=name)


def weight_only_values_stay_on_the_gpu() -> None:
    """An inference run computes what reads the weights alone (the batch norm's scale
    and shift) once and keeps it on the GPU as parameters of the rest of the graph; an
    assignment and a training step each make the next run compute it again; every
    run equals the reference target's."""
    import purinec
    from purinec.program import _WeightsCached

    rng = np.random.default_rng(6)
    sgd = purinec.SGD(lr=0.1)
    cuda = purinec.compile(tiny_onnx_cnn(), target="cuda", train=sgd)
    reference = purinec.compile(tiny_onnx_cnn(), target="reference", train=sgd)
    run = cuda._inference_run()
    assert isinstance(run, _WeightsCached), run
    computed = []
    fixed = run.fixed
    run.fixed = lambda env: computed.append(1) or fixed(env)
    kept = {name for name, _ in fixed.graph.outputs}
    assert kept and kept <= run.rest.resident, (kept, run.rest.resident)

    def run_both(times_computed: int) -> None:
        feeds = feeds_for(reference.eval_ir, rng, classes=3)
        np.testing.assert_allclose(cuda.run(feeds)["logits"],
                                   reference.run(feeds)["logits"], rtol=2e-4, atol=1e-5)
        assert len(computed) == times_computed, (len(computed), times_computed)
        assert all(run.rest._loaded[name] is run.results[name] for name in kept)

    run_both(1)
    run_both(1)
    for program in (cuda, reference):
        program.state["var"] = program.state["var"] * 2
    run_both(2)
    feeds = feeds_for(reference.ir, rng, classes=3)
    assert np.isclose(cuda.step(feeds), reference.step(feeds), rtol=2e-4)
    run_both(3)
    run_both(3)


PROGRAMS = {
    "program_weights_stay_on_the_gpu": lambda rng: weights_stay_on_the_gpu(),
    "program_weight_only_values_stay_on_the_gpu":
        lambda rng: weight_only_values_stay_on_the_gpu(),
    "program_weights_stay_on_2_gpus": lambda rng: weights_stay_on_the_gpu("gpu:0,gpu:1"),
    "program_tiny_mlp_steps": lambda rng: same_training(tiny_mlp(), classes=3),
    "program_tiny_mlp_data_parallel_2_gpus": lambda rng: same_training(
        tiny_mlp(), classes=3, devices="gpu:0,gpu:1"),
    **{f"program_tiny_mlp_{strategy}_2_gpus": (lambda rng, strategy=strategy: same_training(
        tiny_mlp(), classes=3, devices="gpu:0,gpu:1", parallel=strategy))
       for strategy in ("ps", "model", "pipeline")},
    "program_tiny_convnet_hybrid_2_gpus": lambda rng: same_training(
        tiny_convnet(), classes=3, devices=2, parallel="hybrid"),
    "program_tiny_convnet_steps": lambda rng: same_training(tiny_convnet(), classes=3),
    "program_tiny_onnx_cnn_steps": lambda rng: same_training(tiny_onnx_cnn(), classes=3),
    # Inference after the steps reads the running statistics on both GPUs.
    "program_tiny_onnx_cnn_data_parallel_2_gpus": lambda rng: same_training(
        tiny_onnx_cnn(), classes=3, devices="gpu:0,gpu:1"),
}


def two_programs_at_once() -> None:
    """Two programs training in two threads at once: the simulator runs one launch at a
    time in a process, whichever program it belongs to."""
    failures = []

    def train():
        try:
            trained_alike(tiny_mlp(), classes=3, steps=3)
        except BaseException as err:  # (raised below, in the case's own thread)
            failures.append(err)

    threads = [threading.Thread(target=train) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]


PROGRAMS["program_two_programs_at_once"] = lambda rng: two_programs_at_once()


def lazily(check, *args, **options) -> None:
    """``check(*args, **options)`` on streams that run only when waited for
    (`lazy_gpu`): every order the runtime relies on must be one it asked the GPU for."""
    from tests.on_cuda.lazy_gpu import lazy_gpu

    with lazy_gpu():
        check(*args, **options)


def on_a_lazy_gpu(model, **options) -> None:
    """`trained_alike`, three steps, on lazy streams."""
    lazily(trained_alike, model, steps=3, classes=3, **options)


def lazy_gpu_finds_calls_unordered() -> None:
    """Without `CallOrder`'s waits, a lazy GPU runs the last call's backward pass after
    the next call's batch has been copied over its own: the weights come out wrong.
    (That the lazy streams show what a GPU would.)"""
    from purinec.runtime.gpu import CallOrder

    with mock.patch.object(CallOrder, "begin", lambda self: None):
        try:
            on_a_lazy_gpu(tiny_mlp())
        except AssertionError:
            return
    raise AssertionError("trained alike with calls unordered on a lazy GPU")


PROGRAMS.update({
    "program_tiny_mlp_on_a_lazy_gpu": lambda rng: on_a_lazy_gpu(tiny_mlp()),
    "program_tiny_convnet_on_a_lazy_gpu": lambda rng: on_a_lazy_gpu(tiny_convnet()),
    "program_tiny_convnet_hybrid_2_gpus_on_a_lazy_gpu": lambda rng: on_a_lazy_gpu(
        tiny_convnet(), devices=2, parallel="hybrid"),
    **{f"program_tiny_mlp_{strategy}_2_gpus_on_a_lazy_gpu": (
        lambda rng, strategy=strategy: on_a_lazy_gpu(tiny_mlp(), devices="gpu:0,gpu:1",
                                                     parallel=strategy))
       for strategy in ("data", "ps", "model", "pipeline")},
    "program_lazy_gpu_finds_calls_unordered": lambda rng: lazy_gpu_finds_calls_unordered(),
    # (the replayed graph's calls are ordered by the events captured with them)
    "program_tiny_mlp_graphed_on_a_lazy_gpu": lambda rng: lazily(graphed_training,
                                                                 tiny_mlp()),
    "program_tiny_mlp_data_parallel_2_gpus_graphed_on_a_lazy_gpu":
        lambda rng: lazily(graphed_training, tiny_mlp(), devices="gpu:0,gpu:1"),
})


# A graph placed by hand on a cpu and a gpu device, with copies between them.
MIXED = """graph t(%x: f32[4,3] @cpu:0, %b: f32[3] @gpu:0) {
  %xg = copy(%x) : f32[4,3] @gpu:0
  %y = bias_add(%xg, %b) {axis=1} : f32[4,3] @gpu:0
  %yc = copy(%y) : f32[4,3] @cpu:0
  %z = sigmoid(%yc) : f32[4,3] @cpu:0
  %w = tanh(%y) : f32[4,3] @gpu:0
  return %z, %y, %w
}"""


def same_outputs(text: str, expect_graphs: str | None = None) -> None:
    """``text`` run on cuda (three times with ``expect_graphs``, the start of its
    ``cuda_graphs`` after) as on the reference target."""
    import purinec
    from purinec.ir.parser import parse

    rng = np.random.default_rng(2)
    cuda = purinec.compile(parse(text), target="cuda")
    # (the reference target runs cpu devices only: the gpu's nodes go to another)
    reference = purinec.compile(parse(text.replace("@gpu:0", "@cpu:1")), target="reference")
    for _ in range(1 if expect_graphs is None else 3):
        feeds = feeds_for(reference.ir, rng, classes=1)
        got, want = cuda.run(feeds), reference.run(feeds)
        assert set(got) == set(want), (sorted(got), sorted(want))
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6,
                                       err_msg=f"output {name}")
    if expect_graphs is not None:
        assert cuda.cuda_graphs.startswith(expect_graphs), cuda.cuda_graphs


PROGRAMS["program_mixed_cpu_and_gpu"] = lambda rng: same_outputs(MIXED)
PROGRAMS["program_mixed_cpu_and_gpu_on_a_lazy_gpu"] = lambda rng: lazily(
    same_outputs, MIXED, expect_graphs="launching")  # (three calls)
# Training steps with every product through cuBLAS's calls (the simulator's stand-in),
# in one process and over two GPUs; the convolutions in chunks of images as well.
# Iterations captured as CUDA graphs: on one GPU, with products through cuBLAS's calls
# (the simulator's stand-in) in chunks too; data parallelism over two devices on one GPU
# (its allreduces as copies and sums on the GPU); two devices with copies between them
# (`two_gpus_graphed`); refused where a node runs on the host (`mixed_graphed`).
PROGRAMS.update({
    "program_tiny_mlp_graphed": lambda rng: graphed_training(tiny_mlp()),
    "program_tiny_convnet_graphed@cublas-chunked": lambda rng: graphed_training(
        tiny_convnet()),
    "program_tiny_mlp_data_parallel_2_gpus_graphed@cublas": lambda rng: graphed_training(
        tiny_mlp(), devices="gpu:0,gpu:1"),
    "program_two_gpus_graphed": lambda rng: two_gpus_graphed(),
    "program_mixed_cpu_and_gpu_graphed": lambda rng: mixed_graphed(),
    "program_tiny_mlp_graphs_chosen_by_time": lambda rng: graphs_chosen_by_time(),
    "program_tiny_mlp_steps@cublas": PROGRAMS["program_tiny_mlp_steps"],
})

TWO_GPUS = """graph t(%x: f32[4,3] @gpu:0, %b: f32[3] @gpu:1) {
  %x1 = copy(%x) : f32[4,3] @gpu:1
  %y = bias_add(%x1, %b) {axis=1} : f32[4,3] @gpu:1
  %y0 = copy(%y) : f32[4,3] @gpu:0
  %z = tanh(%y0) : f32[4,3] @gpu:0
  return %z, %y
}"""


def two_gpus_graphed() -> None:
    """A graph placed on gpu:0 and gpu:1 (one GPU here) with copies between them, run
    four times on new inputs as one CUDA graph from the second call on."""
    import purinec
    from purinec.ir.parser import parse

    rng = np.random.default_rng(3)
    with graphs_on():
        program = purinec.compile(parse(TWO_GPUS), target="cuda")
        for _ in range(4):
            x, b = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=3).astype(
                np.float32)
            got = program.run({"x": x, "b": b})
            np.testing.assert_allclose(got["y"], x + b, rtol=1e-6)
            np.testing.assert_allclose(got["z"], np.tanh(x + b), rtol=1e-5, atol=1e-6)
    assert program.cuda_graphs == "replaying one CUDA graph per call", program.cuda_graphs


def mixed_graphed() -> None:
    """`MIXED` (a node on the cpu) asked to run as a CUDA graph: it runs task by task,
    right, and says which node kept it from being one graph."""
    with graphs_on():
        same_outputs(MIXED, expect_graphs="launching task by task: not one CUDA graph, as "
                                          "node %")
