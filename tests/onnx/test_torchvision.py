"""torchvision's resnet18, mobilenet_v2, squeezenet1_1 and googlenet, exported by
PyTorch (benchmarks/export_torchvision.py, random weights: tests.onnx.torchvision_models):
imported inference equals onnxruntime's, and an imported resnet18's SGD steps equal
PyTorch's from the same weights, on one device and data-parallel over two."""

from __future__ import annotations

import functools

import numpy as np
import pytest

pytest.importorskip("onnx", reason="the ONNX front end is the onnx extra")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime is the reference of inference")

import purinec  # noqa: E402
from onnx import numpy_helper  # noqa: E402
from tests.onnx.torchvision_models import NAMES, load  # noqa: E402

BATCH = 2


@functools.cache
def batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((BATCH, 3, 224, 224)).astype(np.float32),
            rng.integers(0, 1000, BATCH).astype(np.int32))


@pytest.mark.parametrize("target", ["reference", pytest.param("cpu", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", NAMES)
def test_imported_inference_equals_onnxruntime(name, target):
    model = load(name)
    x, _ = batch()
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    (want,) = session.run(None, {"input": x})
    with purinec.compile(model, target=target, batch=BATCH) as program:
        got = program.run({"input": x})["logits"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.slow  # compiles squeezenet1_1's kernels
def test_fire_modules_concatenate_in_place_at_batch_1():
    """At batch 1 each fire module's two expand convolutions compute straight into the
    concat's memory (`purinec.runtime.memory._concats_in_place`): the cpu kernels still
    agree with onnxruntime."""
    model = load("squeezenet1_1")
    x = batch()[0][:1]
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    (want,) = session.run(None, {"input": x})
    with purinec.compile(model, target="cpu", batch=1) as program:
        got = program.run({"input": x})["logits"]
        elided = program._inference_run().plan.memory.elided
    assert len(elided) == 8 and all(node.op == "concat" for node in elided)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


SOLVER = dict(lr=0.01, momentum=0.9, weight_decay=5e-4)
STEPS = 2  # the second step is the first that momentum changes


@functools.cache
def pytorch_steps(dtype: str = "float32") -> dict[str, np.ndarray]:
    """resnet18's weights and running statistics after `STEPS` of PyTorch's SGD, computed
    in ``dtype``."""
    torch = pytest.importorskip("torch", reason="PyTorch is the reference of training")
    from tests.onnx.torch_step import sgd_step

    x, labels = batch()
    _, weights = sgd_step(load("resnet18"), x, labels, steps=STEPS,
                          dtype=getattr(torch, dtype), **SOLVER)
    return weights


def purinec_steps(**compile_options) -> dict[str, np.ndarray]:
    x, labels = batch()
    solver = purinec.SGD(**SOLVER)
    with purinec.compile(load("resnet18"), train=solver, batch=BATCH,
                         **compile_options) as program:
        for _ in range(STEPS):
            program.step({"input": x, "label": labels})
        program.gather_weights()
        return {**program.params, **program.state}


def assert_same_steps(got: dict) -> None:
    """Each of the file's tensors moved as PyTorch's float64 steps moved it, as closely as
    PyTorch's own float32 steps do, within a factor of two. Measured as a share of each
    tensor's largest change, float32 rounding moves PyTorch's running statistics by
    about 0.02%, but its parameters by 1-6%: their gradients at batch 2 pass through
    twenty batch normalizations (the most on AVX-512 machines). So the two are held to
    PyTorch's errors in each (and at least 0.1%), where a mistake moves them by far
    more. ``got`` also holds the momentum (``NAME.history``)."""
    from tests.onnx.torch_step import TorchGraph

    start = {t.name: numpy_helper.to_array(t) for t in load("resnet18").graph.initializer}
    exact, rounded = pytorch_steps("float64"), pytorch_steps("float32")
    assert set(exact) == set(start) and set(exact) <= set(got)
    change = {name: np.abs(exact[name] - start[name]).max() for name in exact}
    assert all(change.values())
    running = set(TorchGraph(load("resnet18")).stats)
    for group in (running, set(exact) - running):
        float32_error = max(np.abs(rounded[name] - exact[name]).max() / change[name]
                            for name in group)
        for name in group:
            np.testing.assert_allclose(
                got[name], exact[name], rtol=0,
                atol=2 * max(float32_error, 1e-3) * change[name],
                err_msg=f"{name}: PyTorch's float32 steps are within {float32_error:.2%} "
                        f"of the largest change of tensors of its kind")


@pytest.mark.slow
def test_resnet18_steps_equal_pytorch():
    assert_same_steps(purinec_steps(target="cpu"))


@pytest.mark.slow
def test_resnet18_steps_data_parallel_over_two_devices_equal_pytorch():
    assert_same_steps(purinec_steps(target="cpu", devices=2, parallel="data"))
