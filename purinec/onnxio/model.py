"""Reading an ONNX file into an `OnnxModel`: checked by the onnx package, its batch
fixed, its shapes inferred, every computation on constants folded away, and every op
it still needs known to purinec (or the whole import is refused).

What stays is lowered to IR by `OnnxModel.lower`, once for inference and once for
the training iteration; the file's initializers become the program's starting weights
(`OnnxModel.variables`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from purinec.errors import ModelError
from purinec.ir.graph import Graph
from purinec.ir.types import TensorType
from purinec.onnxio.lowering import Lowering
from purinec.onnxio.ops import CONVERTERS, SUPPORTED_OPS
from purinec.onnxio.proto import ONNX_DTYPES, describe, onnx_package

# The oldest default-domain opset the converters know the attributes of.
MIN_OPSET = 7

IR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


def read_onnx(source: Any, batch: int | None = None,
              known: dict[str, np.ndarray] | None = None) -> "OnnxModel":
    """The model in ``source`` (a path, or an ``onnx.ModelProto``), with every data
    input's first axis set to ``batch`` (when given; a symbolic one otherwise becomes
    1). ``known`` gives the values of graph inputs the model uses as attributes (what
    `ConstantNeeded` names): they become constants. Raises `ModelError` naming what is wrong and where: an unreadable or invalid
    file, a symbolic dimension that is not the batch, and every node whose op purinec
    does not support."""
    onnx = onnx_package()
    where = os.fspath(source) if isinstance(source, (str, os.PathLike)) else "the ONNX model"
    proto = _load(onnx, source, where)
    _bind_known(onnx, proto.graph, known or {}, where)
    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as err:
        raise ModelError(f"{where} is not a valid ONNX model: {_first_line(err)}") from None
    opset = _default_opset(proto, where)
    _fix_batch(proto.graph, batch, where)
    try:
        proto = onnx.shape_inference.infer_shapes(proto, strict_mode=True, data_prop=True)
    except Exception as err:  # onnx raises its C++ errors as several Python classes
        raise ModelError(f"{where}: ONNX shape inference failed: {_first_line(err)}") from None
    model = OnnxModel(where, proto, opset)
    model.fold()
    model.check_supported()
    return model


def _load(onnx, source: Any, where: str):
    if isinstance(source, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(source)  # the batch is fixed in place
        return copy
    if not isinstance(source, (str, os.PathLike)):
        raise ModelError(f"cannot read an ONNX model from a {type(source).__name__}: give "
                         f"a path or an onnx.ModelProto")
    if not os.path.isfile(source):
        raise ModelError(f"ONNX file {where} does not exist" if not os.path.exists(source)
                         else f"{where} is not a file")
    try:
        return onnx.load(os.fspath(source))
    except Exception as err:  # protobuf's DecodeError, a missing external data file
        raise ModelError(f"{where} is not an ONNX model file: {_first_line(err)}") from None


def _bind_known(onnx, graph, known: dict[str, np.ndarray], where: str) -> None:
    """The inputs named in ``known`` become initializers holding their values."""
    from onnx import numpy_helper

    inputs = {v.name for v in graph.input}
    for name, array in known.items():
        if name not in inputs:
            raise ModelError(f"{where} has no input {name} to give a value")
        graph.initializer.append(numpy_helper.from_array(np.asarray(array), name))


def _first_line(err: Exception) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


def _default_opset(proto, where: str) -> int:
    from onnx.defs import onnx_opset_version

    versions = [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")]
    if not versions:
        raise ModelError(f"{where} imports no version of the default ONNX opset")
    opset = versions[0]
    if not MIN_OPSET <= opset <= onnx_opset_version():
        raise ModelError(f"{where} uses ONNX opset {opset}; purinec reads opsets "
                         f"{MIN_OPSET} to {onnx_opset_version()}")
    return opset


def _fix_batch(graph, batch: int | None, where: str) -> None:
    """Every data input's axis 0 becomes ``batch`` (given) or 1 (symbolic, none given);
    any other symbolic dimension is refused: purinec compiles static shapes."""
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int)
                              or batch < 1):
        raise ModelError(f"batch must be a positive integer, got {batch!r}")
    initialized = {t.name for t in graph.initializer}
    for value in graph.input:
        if value.name in initialized:
            continue
        tensor = value.type.tensor_type
        if not value.type.HasField("tensor_type") or not tensor.HasField("shape"):
            raise ModelError(f"{where}: input {value.name} has no tensor shape; purinec "
                             f"compiles tensors of static shapes")
        for axis, dim in enumerate(tensor.shape.dim):
            if axis == 0 and (batch is not None or not dim.HasField("dim_value")):
                dim.Clear()
                dim.dim_value = batch if batch is not None else 1
            elif not dim.HasField("dim_value"):
                name = dim.dim_param or "unknown"
                raise ModelError(f"{where}: input {value.name} has a symbolic dimension "
                                 f"{name!r} at axis {axis}; purinec compiles static shapes "
                                 f"and fixes only the batch (axis 0, --batch)")


@dataclass
class OnnxModel:
    """An ONNX model read for compiling (see `read_onnx`).

    ``names`` maps every ONNX value name to its IR name: the same where the IR allows
    it, else with each character the IR does not take replaced by ``_`` (``onnx::Add_3``
    becomes ``onnx__Add_3``), a ``v`` before a leading digit, and ``.1``, ``.2`` after a
    name already taken. ``constants`` holds the initializers and every value the
    file computes from constants alone (folded at import with onnx's reference
    evaluator, so they mean what ONNX says)."""

    where: str
    proto: Any  # onnx.ModelProto
    opset: int
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    initializers: frozenset[str] = frozenset()
    names: dict[str, str] = field(default_factory=dict)
    types: dict[str, TensorType] = field(default_factory=dict)
    # The ONNX value each input of a lowered graph stands for (a constant for params
    # and state).
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        from onnx import numpy_helper

        graph = self.proto.graph
        for tensor in graph.initializer:
            self.constants[tensor.name] = numpy_helper.to_array(tensor)
        self.initializers = frozenset(self.constants)
        self.names = _ir_names(self._value_names())
        self.types = {v.name: t for v in [*graph.input, *graph.value_info, *graph.output]
                      if (t := _tensor_type(v)) is not None}

    @property
    def name(self) -> str:
        """The IR graph's name: the ONNX graph's, else the file's stem."""
        base = self.proto.graph.name or os.path.splitext(os.path.basename(self.where))[0]
        return _ir_names([base or "onnx"])[base or "onnx"]

    def _value_names(self) -> list[str]:
        graph = self.proto.graph
        seen = [t.name for t in graph.initializer] + [v.name for v in graph.input]
        for node in graph.node:
            seen += [name for name in node.output if name]
        return list(dict.fromkeys(seen))

    @property
    def data_inputs(self) -> list:
        """The graph inputs fed at each run (those without an initializer)."""
        return [v for v in self.proto.graph.input if v.name not in self.initializers]

    # -- folding ----------------------------------------------------------------------

    def fold(self) -> None:
        """Compute every node whose inputs are all constants (shapes included, since
        every shape is static), in the file's own semantics."""
        for node in self.proto.graph.node:
            if node.op_type in ("Shape", "Size") and node.input[0] in self.types:
                shape = _shape_of(node, self.types[node.input[0]])
                self.constants[node.output[0]] = (shape if node.op_type == "Shape" else
                                                  np.array(np.prod(shape), np.int64))
            elif all(name in self.constants for name in node.input if name) and \
                    node.op_type not in NEVER_FOLDED:
                for name, value in zip(node.output, self._evaluate(node)):
                    if name:
                        self.constants[name] = value

    def _evaluate(self, node) -> list[np.ndarray]:
        from onnx import helper
        from onnx.reference import ReferenceEvaluator

        inputs = [name for name in node.input if name]
        graph = helper.make_graph(
            [node], "fold", [helper.make_tensor_value_info(name, 0, None) for name in inputs],
            [helper.make_tensor_value_info(name, 0, None) for name in node.output if name])
        model = helper.make_model(graph, opset_imports=list(self.proto.opset_import))
        try:
            results = ReferenceEvaluator(model).run(
                None, {name: self.constants[name] for name in inputs})
        except Exception as err:
            raise ModelError(f"{self.where}: node {describe(node)} computes on constants "
                             f"only, and evaluating it failed: {_first_line(err)}") from None
        return [np.asarray(r) for r in results]

    def check_supported(self) -> None:
        """Refuse, all at once, every node left to lower whose op has no converter."""
        unsupported = [node for node in self.proto.graph.node
                       if not self.folded(node)
                       and (node.domain not in ("", "ai.onnx") or node.op_type not in CONVERTERS)]
        if unsupported:
            listed = "; ".join(describe(n) for n in unsupported[:12])
            more = f" and {len(unsupported) - 12} more" if len(unsupported) > 12 else ""
            raise ModelError(f"{self.where}: {len(unsupported)} node(s) use ops purinec does "
                             f"not support: {listed}{more}. Supported ops: "
                             f"{', '.join(sorted(SUPPORTED_OPS))}")

    def folded(self, node) -> bool:
        return all(name in self.constants for name in node.output if name)

    # -- lowering ---------------------------------------------------------------------

    def lower(self, mode: str = "inference") -> Graph:
        """The IR graph: ``"inference"`` computes the file's outputs; ``"train"`` adds a
        ``label`` input and the ``loss`` and ``accuracy`` of the one output, whose batch
        normalizations then use batch statistics and update their running ones."""
        return Lowering(self, mode, CONVERTERS).run()

    def variables(self, graph: Graph) -> dict[str, dict[str, np.ndarray]]:
        """The arrays the file gives for ``graph``'s params and state, by role and IR
        name (those the import adds, such as the dropout counter, are not among them)."""
        found: dict[str, dict[str, np.ndarray]] = {"param": {}, "state": {}}
        for value in graph.inputs_with_role("param", "state"):
            array = self.constants.get(self.sources.get(value.name, ""))
            if array is not None:
                found[value.role][value.name] = np.ascontiguousarray(
                    array, dtype=value.type.dtype.numpy).reshape(value.type.shape)
        return found

    def mapping(self) -> list[tuple[str, str]]:
        """(ONNX name, IR name) of every graph input, initializer and output whose IR
        name differs: what a dump shows."""
        graph = self.proto.graph
        shown = [v.name for v in graph.input] + [t.name for t in graph.initializer] + \
                [v.name for v in graph.output]
        return [(name, self.names[name]) for name in dict.fromkeys(shown)
                if name in self.names and self.names[name] != name]


# Ops whose result is not a function of their inputs' values.
NEVER_FOLDED = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                "Multinomial", "Bernoulli", "Dropout"}


def _shape_of(node, type: TensorType) -> np.ndarray:
    shape = np.array(type.shape, dtype=np.int64)
    start = next((a.i for a in node.attribute if a.name == "start"), 0)
    end = next((a.i for a in node.attribute if a.name == "end"), len(shape))
    return shape[start:end]  # ONNX clamps start and end as Python's slices do


def _tensor_type(value) -> TensorType | None:
    """The IR type of an ONNX value_info, or None when it has no static tensor type."""
    if not value.type.HasField("tensor_type"):
        return None
    tensor = value.type.tensor_type
    if tensor.elem_type not in ONNX_DTYPES or not tensor.HasField("shape"):
        return None
    if not all(d.HasField("dim_value") for d in tensor.shape.dim):
        return None
    return TensorType(tuple(d.dim_value for d in tensor.shape.dim), ONNX_DTYPES[tensor.elem_type])


def _ir_names(names: list[str]) -> dict[str, str]:
    """Each ONNX name's IR name (see `OnnxModel`), in order, all distinct."""
    taken: set[str] = set()
    result = {}
    for name in names:
        base = name if IR_NAME.fullmatch(name) else _sanitized(name)
        ir, k = base, 0
        while ir in taken:
            k += 1
            ir = f"{base}.{k}"
        taken.add(ir)
        result[name] = ir
    return result


def _sanitized(name: str) -> str:
    text = re.sub(r"[^A-Za-z0-9_.\-]", "_", name)
    return text if re.match(r"[A-Za-z_]", text) else "v" + text
