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


SOLVER = dict(lr=0.01, momentum=0.9, weight_decay=5e-4)
STEPS = 2  # the second step is the first that momentum changes


@functools.cache
def pytorch_steps() -> dict[str, np.ndarray]:
    """resnet18's weights and running statistics after `STEPS` of PyTorch's SGD."""
    pytest.importorskip("torch", reason="PyTorch is the reference of training")
    from tests.onnx.torch_step import sgd_step

    x, labels = batch()
    _, weights = sgd_step(load("resnet18"), x, labels, steps=STEPS, **SOLVER)
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


def assert_same_steps(got: dict, want: dict) -> None:
    """Each of the file's tensors moved as PyTorch moved it, within 2% of the largest
    change (both in float32, whose rounding at batch 2 through twenty batch
    normalizations differs by about 0.5%; each differs from a float64 step by 5%).
    ``got`` also holds the momentum (``NAME.history``)."""
    start = {t.name: numpy_helper.to_array(t) for t in load("resnet18").graph.initializer}
    assert set(want) == set(start) and set(want) <= set(got)
    for name in want:
        change = np.abs(want[name] - start[name]).max()
        assert change > 0, name
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=0.02 * change,
                                   err_msg=name)


@pytest.mark.slow
def test_resnet18_steps_equal_pytorch():
    assert_same_steps(purinec_steps(target="cpu"), pytorch_steps())


@pytest.mark.slow
def test_resnet18_steps_data_parallel_over_two_devices_equal_pytorch():
    assert_same_steps(purinec_steps(target="cpu", devices=2, parallel="data"),
                      pytorch_steps())
