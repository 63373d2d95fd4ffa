"""torchvision's resnet18, mobilenet_v2, squeezenet1_1 and googlenet as real ONNX graphs
for the importer's tests, with random weights.

The files in ``models/`` are torchvision's own exports (benchmarks/export_torchvision.py
writes them) with their weights taken out, so that they are small enough to commit and a
test needs neither torchvision nor a download. A *weightless* initializer keeps its name,
dims and data type, but its data says it lives in an external file that is not shipped:
``data_location`` EXTERNAL, with the single ``external_data`` entry ``location`` =
`NOT_SHIPPED`. That is ONNX's own way of saying "the data is elsewhere", so that any
reader that does not know the trick refuses the file, naming the missing file, rather
than reading zeros: ``onnx.load`` with its default ``load_external_data=True``, and
``onnx.checker`` (a tensor with no data at all is invalid too). Only float
initializers are taken out; integer ones (shape constants) stay. `load` fills every
weightless initializer again.

Only onnx and numpy are needed here.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

NAMES = ("resnet18", "mobilenet_v2", "squeezenet1_1", "googlenet")
MODELS_DIR = Path(__file__).with_name("models")
NOT_SHIPPED = "weights-not-shipped"  # the external file a weightless initializer names

# The parameters a node reads, by input position (None: an activation); the roles say
# how `load` draws them.
ROLES = {
    "Conv": (None, "weight", "bias"),
    "Gemm": (None, "weight", "bias"),
    "BatchNormalization": (None, "bn_scale", "bn_bias", "bn_mean", "bn_var"),
}


def path(name: str) -> Path:
    """The weightless file of model ``name`` (one of `NAMES`)."""
    if name not in NAMES:
        raise ValueError(f"no torchvision model {name!r}: one of {', '.join(NAMES)}")
    return MODELS_DIR / f"{name}.onnx"


def load(name: str, seed: int = 0) -> onnx.ModelProto:
    """Model ``name`` with every weightless initializer filled from ``seed``. Each tensor
    is drawn from its own stream (seed, name), so that its values do not depend on the
    order or number of the others."""
    model = onnx.load(path(name), load_external_data=False)
    roles = _roles(model.graph)
    for tensor in model.graph.initializer:
        if is_weightless(tensor):
            if tensor.name not in roles:
                raise ValueError(f"{name}: no rule to fill initializer {tensor.name!r}")
            rng = np.random.default_rng([seed, zlib.crc32(tensor.name.encode())])
            values = _draw(*roles[tensor.name], tuple(tensor.dims), rng)
            dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
            tensor.CopyFrom(numpy_helper.from_array(values.astype(dtype), tensor.name))
    onnx.checker.check_model(model)
    return model


def is_weightless(tensor: TensorProto) -> bool:
    return (tensor.data_location == TensorProto.EXTERNAL
            and [(e.key, e.value) for e in tensor.external_data] == [("location", NOT_SHIPPED)])


def strip_weights(model: onnx.ModelProto) -> None:
    """Make every float initializer of ``model`` weightless, in place."""
    for tensor in model.graph.initializer:
        if helper.tensor_dtype_to_np_dtype(tensor.data_type).kind == "f":
            kept = TensorProto(name=tensor.name, dims=tensor.dims, data_type=tensor.data_type,
                               data_location=TensorProto.EXTERNAL)
            kept.external_data.add(key="location", value=NOT_SHIPPED)
            tensor.CopyFrom(kept)


def _roles(graph: onnx.GraphProto) -> dict[str, tuple[str, int]]:
    """Each parameter's role and fan-in, from the node that reads it (BatchNormalization's
    four are told apart only by their input position)."""
    dims = {t.name: list(t.dims) for t in graph.initializer}
    roles = {}
    for node in graph.node:
        for name, role in zip(node.input, ROLES.get(node.op_type, ())):
            if role and name in dims:
                roles[name] = (role, _fan_in(node, dims[name]))
    return roles


def _fan_in(node: onnx.NodeProto, dims: list[int]) -> int:
    """How many inputs each output of ``node`` sums, for a weight of these dims: a Conv
    weight is [out, in/group, kh, kw], a Gemm's B [out, in] with transB, else [in, out]."""
    trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
    if node.op_type == "Gemm" and not trans_b:
        return dims[0]
    return int(np.prod(dims[1:]))


def _draw(role: str, fan_in: int, shape: tuple[int, ...], rng) -> np.ndarray:
    """He-normal weights keep the second moment of ReLU activations from layer to layer,
    and BatchNormalization near the identity (statistics near 0 and 1, scale near 1)
    leaves it alone in eval mode, so that activations stay O(1) through the deep nets
    and a wrong op shows as a large error rather than drowning in under- or overflow.
    The statistics are not exact (0, 1), so that an op that confuses them is caught."""
    if role == "weight":
        return rng.normal(0.0, np.sqrt(2.0 / fan_in), shape)
    if role == "bias":
        return rng.normal(0.0, 0.01, shape)
    if role in ("bn_scale", "bn_var"):
        return rng.uniform(0.8, 1.2, shape)
    return rng.normal(0.0, 0.1, shape)  # bn_bias, bn_mean
