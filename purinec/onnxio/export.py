"""Writing an IR graph as an ONNX model: the inverse of `purinec.onnxio.ops`.

One writer per IR op spells it in ONNX opset `OPSET` (the first whose AveragePool
takes dilations); later opsets spell these ops the same way, so a caller may ask for
one of them. The graph's data inputs keep their names and exact types (the batch is
static); its params and state become initializers under their own names, and nothing
else does: the constants a writer needs (shapes, axes, a scale's factor) are
`Constant` nodes, so that reading the file back gives the same parameters and nothing
more. The graph's outputs keep their names; the next values of variables (which only a
training graph computes) are left out, as `Program.run` leaves them out.

A graph is exported as it is: an op with no writer (a loss, a gradient, an optimizer
step, a dropout mask) is refused naming its node, and so is a distributed program,
whose communication ops ONNX cannot spell. The file is checked by the onnx package
(``full_check``: types inferred through every node) before it is written, atomically.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from purinec.errors import ExportError
from purinec.fileio import replacing
from purinec.ir.graph import Graph, Node, Value
from purinec.ir.nnref import pad_edges, window_extent
from purinec.ir.ops import Trait, by_name, op_has
from purinec.ir.types import DType
from purinec.onnxio.proto import onnx_package
from purinec.version import __version__

# Opset 19 added AveragePool's dilations; every op below is spelled alike through the
# newest opsets.
OPSET = 19

# The ONNX element type (TensorProto.DataType) of each IR dtype.
ONNX_TYPES = {DType.f32: 1, DType.f64: 11, DType.i32: 6, DType.i64: 7, DType.bool: 9}


@dataclass
class Exported:
    """What `export_onnx` wrote."""

    path: str
    size: int  # bytes
    opset: int
    nodes: int  # ONNX nodes
    parameters: int  # elements of the initializers

    def __str__(self) -> str:
        return (f"wrote {self.path} ({self.size:,} bytes): ONNX opset {self.opset}, "
                f"{self.nodes} node(s), {self.parameters:,} weights")


def export_onnx(graph: Graph, params: Mapping[str, np.ndarray],
                state: Mapping[str, np.ndarray], path: str | os.PathLike,
                opset: int = OPSET) -> Exported:
    """Write ``graph`` (an inference graph on one device) to ``path`` as an ONNX model
    of ``opset``, with the arrays of its param and state inputs, by name, in
    ``params`` and ``state`` as its initializers. Raises `ExportError` naming what
    cannot be written and where; nothing is written then."""
    onnx = onnx_package()
    _check_opset(onnx, opset)
    _check_one_device(graph)
    model = Writer(onnx, graph).model({**params, **state}, opset)
    onnx.checker.check_model(model, full_check=True)
    path = os.fspath(path)
    with replacing(path) as tmp:
        onnx.save_model(model, tmp)
    return Exported(path, os.path.getsize(path), opset, len(model.graph.node),
                    sum(int(np.prod(t.dims)) for t in model.graph.initializer))


def _check_opset(onnx, opset: int) -> None:
    newest = onnx.defs.onnx_opset_version()
    if isinstance(opset, bool) or not isinstance(opset, int) or not OPSET <= opset <= newest:
        raise ExportError(f"opset {opset!r}: purinec writes ONNX opsets {OPSET} to {newest}")


def _check_one_device(graph: Graph) -> None:
    """An ONNX model is one computation on one device: a distributed program (its
    logical graph over several devices, or one rank's piece with its copies and
    collectives) is exported as the model it was compiled from."""
    devices = graph.devices()
    moving = next((n for n in graph.flat_nodes() if op_has(n.op, Trait.communicates)), None)
    if len(devices) > 1 or moving is not None:
        where = (f"runs on {', '.join(map(str, devices))}" if len(devices) > 1
                 else f"node %{moving.name} ({moving.op}) communicates")
        raise ExportError(f"graph {graph.name} {where}: a distributed program cannot be "
                          f"written as ONNX; export the model itself (compiled for one "
                          f"device) instead")


class Writer:
    """One export of ``graph``: ONNX nodes in graph order, under names that are the IR's
    wherever no graph output claims them for another value."""

    def __init__(self, onnx, graph: Graph):
        self.onnx = onnx
        self.graph = graph
        variables = {v.name for v in graph.inputs_with_role("param", "state")}
        self.outputs = [(name, v) for name, v in graph.outputs if name not in variables]
        values = [*graph.inputs, *(v for n in graph.flat_nodes() for v in n.outputs)]
        claimed = {name for name, v in self.outputs if name != v.name}
        self.taken = {v.name for v in values} | claimed
        self.names: dict[int, str] = {}
        for value in values:
            if value.name in claimed and value.role is not None:
                raise ExportError(f"graph {graph.name}: output {value.name} is another "
                                  f"value than input {value.name}; ONNX would name both "
                                  f"alike")
            self.names[id(value)] = (self.fresh(value.name) if value.name in claimed
                                     else value.name)
        self.readers: dict[int, list[Node]] = {}
        for node in graph.flat_nodes():
            for value in node.inputs:
                self.readers.setdefault(id(value), []).append(node)
        self.returned = {id(v) for _, v in graph.outputs}
        self.absorbed: set[int] = set()  # nodes another node's ONNX node computes
        self.nodes: list = []
        self.node: Node | None = None  # the IR node being written

    # -- the walk ---------------------------------------------------------------------

    def model(self, arrays: Mapping[str, np.ndarray], opset: int):
        helper = self.onnx.helper
        for node in self.graph.flat_nodes():
            if id(node) in self.absorbed:
                continue
            self.node = node
            writer = WRITERS.get(node.op)
            if writer is None:
                raise ExportError(f"graph {self.graph.name}: node %{node.name} ({node.op}"
                                  f"{', ' + node.loc if node.loc else ''}): op {node.op} has "
                                  f"no ONNX spelling; ONNX export writes inference graphs of "
                                  f"{', '.join(sorted(WRITERS))}")
            writer(self, node)
        self.node = None
        for name, value in self.outputs:
            if self.names[id(value)] != name:
                self.nodes.append(helper.make_node("Identity", [self.names[id(value)]],
                                                   [name], name=name))
        graph = helper.make_graph(
            self.nodes, self.graph.name,
            [self.value_info(v.name, v) for v in self.graph.inputs_with_role("data")],
            [self.value_info(name, v) for name, v in self.outputs],
            [self.initializer(v, arrays) for v in self.graph.inputs_with_role("param", "state")])
        imports = [helper.make_opsetid("", opset)]
        return helper.make_model(graph, opset_imports=imports, producer_name="purinec",
                                 producer_version=__version__,
                                 ir_version=helper.find_min_ir_version_for(imports))

    def value_info(self, name: str, value: Value):
        return self.onnx.helper.make_tensor_value_info(
            name, ONNX_TYPES[value.type.dtype], list(value.type.shape))

    def initializer(self, value: Value, arrays: Mapping[str, np.ndarray]):
        if value.name not in arrays:
            raise ExportError(f"graph {self.graph.name}: no array given for {value.role} "
                              f"{value.name} ({value.type})")
        array = np.asarray(arrays[value.name])
        if array.shape != value.type.shape:
            raise ExportError(f"{value.role} {value.name}: expected {value.type}, got an "
                              f"array of shape {list(array.shape)}")
        return self.onnx.numpy_helper.from_array(
            np.ascontiguousarray(array, dtype=value.type.dtype.numpy), value.name)

    # -- names ------------------------------------------------------------------------

    def fresh(self, base: str) -> str:
        """A name no value of the export has: ``base``, else ``base.1``, ``base.2``..."""
        name, k = base, 0
        while name in self.taken:
            k += 1
            name = f"{base}.{k}"
        self.taken.add(name)
        return name

    # -- what writers use -------------------------------------------------------------

    def name(self, value: Value) -> str:
        return self.names[id(value)]

    def emit(self, op_type: str, inputs: list, outputs: list[Value] | None = None,
             **attrs) -> str:
        """One ONNX node of the IR node being written, reading ``inputs`` (values, ONNX
        names, or None for an input left out) into ``outputs`` (IR values; by default
        one fresh name); returns its first output's name."""
        names = [self.name(v) for v in outputs] if outputs is not None else \
            [self.fresh(f"{self.node.name}.{op_type}")]
        self.nodes.append(self.onnx.helper.make_node(
            op_type, [self._input_name(x) for x in inputs], names, name=names[0],
            doc_string=self.node.loc or "", **attrs))
        return names[0]

    def _input_name(self, x) -> str:
        if x is None:
            return ""
        return x if isinstance(x, str) else self.name(x)

    def sole_bias(self, node: Node) -> Node | None:
        """The bias_add along axis 1 that alone reads ``node``'s output (which the graph
        does not return), absorbed by the caller: ONNX's Conv and Gemm add a bias
        themselves, and reading the file back then keeps the bias a parameter (a
        Reshape of it would be folded into a constant)."""
        value = node.outputs[0]
        readers = self.readers.get(id(value), [])
        if len(readers) != 1 or id(value) in self.returned:
            return None
        bias = readers[0]
        if bias.op != "bias_add" or bias.attrs["axis"] != 1 or bias.inputs[0] is not value:
            return None
        self.absorbed.add(id(bias))
        return bias

    def constant(self, values, dtype: DType = DType.i64) -> str:
        """A `Constant` node of ``values`` (a list: a 1-d tensor; a number: a scalar)."""
        array = np.asarray(values, dtype=dtype.numpy)
        name = self.fresh(f"{self.node.name}.const")
        self.nodes.append(self.onnx.helper.make_node(
            "Constant", [], [name], name=name,
            value=self.onnx.numpy_helper.from_array(array, name)))
        return name

    def out(self, op_type: str, *inputs, **attrs) -> str:
        """The IR node's ``op_type`` over ``inputs`` into its own outputs."""
        return self.emit(op_type, list(inputs), self.node.outputs, **attrs)


# -- the writers --------------------------------------------------------------------------

WriterFn = Callable[[Writer, Node], Any]
WRITERS, writes = by_name("writers")  # IR op -> WriterFn


SAME = {"relu": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh", "neg": "Neg", "exp": "Exp",
        "log": "Log", "sqrt": "Sqrt", "abs": "Abs", "erf": "Erf", "hard_swish": "HardSwish",
        "add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "pow": "Pow",
        "concat": "Concat", "transpose": "Transpose", "softmax": "Softmax",
        "log_softmax": "LogSoftmax", "leaky_relu": "LeakyRelu", "hard_sigmoid": "HardSigmoid",
        "global_avg_pool": "GlobalAveragePool"}


@writes(*SAME)
def same(w: Writer, node: Node):
    """Ops ONNX has as they are, their attributes (axis, perm, alpha, beta) included."""
    w.out(SAME[node.op], *node.inputs, **node.attrs)


@writes("scale", "add_scalar")
def with_scalar(w: Writer, node: Node):
    """x * alpha, x + value (on bools: x or value, as NumPy adds them)."""
    x = node.inputs[0]
    dtype = x.type.dtype
    op = "Mul" if node.op == "scale" else "Or" if dtype is DType.bool else "Add"
    w.out(op, x, w.constant(node.attrs["alpha" if node.op == "scale" else "value"], dtype))


@writes("clip")
def clip(w: Writer, node: Node):
    """Infinite bounds are no bounds: those inputs are left out."""
    dtype = node.inputs[0].type.dtype
    bounds = [w.constant(node.attrs[k], dtype) if np.isfinite(node.attrs[k]) else None
              for k in ("min", "max")]
    w.out("Clip", node.inputs[0], *bounds)


@writes("cast")
def cast(w: Writer, node: Node):
    w.out("Cast", node.inputs[0], to=ONNX_TYPES[DType(node.attrs["dtype"])])


@writes("bias_add")
def bias_add(w: Writer, node: Node):
    """b, as [C, 1, ...] with a 1 for each axis after ``axis``, broadcast by Add."""
    x, b = node.inputs
    trailing = x.type.rank - 1 - node.attrs["axis"]
    aligned = w.emit("Reshape", [b, w.constant([b.type.shape[0]] + [1] * trailing)]) \
        if trailing else b
    w.out("Add", x, aligned)


@writes("broadcast_to")
def broadcast_to(w: Writer, node: Node):
    w.out("Expand", node.inputs[0], w.constant(node.attrs["shape"]))


@writes("fill")
def fill(w: Writer, node: Node):
    value = np.asarray([node.attrs["value"]], dtype=DType(node.attrs["dtype"]).numpy)
    w.out("ConstantOfShape", w.constant(node.attrs["shape"]),
          value=w.onnx.numpy_helper.from_array(value))


@writes("reshape")
def reshape(w: Writer, node: Node):
    """The IR's shape has no 0 and no -1: ONNX reads it as it is."""
    w.out("Reshape", node.inputs[0], w.constant(node.attrs["shape"]))


@writes("split")
def split(w: Writer, node: Node):
    w.out("Split", node.inputs[0], w.constant(node.attrs["sections"]), axis=node.attrs["axis"])


@writes("reduce_sum")
def reduce_sum(w: Writer, node: Node):
    """No axes sums nothing in the IR, everything in ONNX unless told otherwise."""
    axes = node.attrs["axes"]
    w.out("ReduceSum", node.inputs[0], w.constant(axes), keepdims=int(node.attrs["keepdims"]),
          noop_with_empty_axes=int(not axes))


@writes("strided_slice")
def strided_slice(w: Writer, node: Node):
    """ONNX's ends are exclusive: one step past the last index, where that falls before
    index 0 (a negative step to the axis's start), the smallest int64, which ONNX
    clamps to "before the first"."""
    starts, steps, sizes = (node.attrs[k] for k in ("starts", "steps", "sizes"))
    ends = [start + step * size for start, step, size in zip(starts, steps, sizes)]
    ends = [end if end >= 0 else np.iinfo(np.int64).min for end in ends]
    w.out("Slice", node.inputs[0], w.constant(starts), w.constant(ends),
          w.constant(list(range(len(starts)))), w.constant(steps))


@writes("pad")
def pad(w: Writer, node: Node):
    """The IR's pads are ONNX's order: every axis's begin, then every end."""
    x, mode = node.inputs[0], node.attrs["mode"]
    value = w.constant(node.attrs["value"], x.type.dtype) if mode == "constant" else None
    w.out("Pad", x, w.constant(node.attrs["pads"]), value, mode=mode)


def with_bias(w: Writer, node: Node, op_type: str, **attrs):
    """``node`` as ``op_type`` (Conv, Gemm: input 2 is a bias along axis 1), with the
    bias_add that follows it, if any (`Writer.sole_bias`)."""
    bias = w.sole_bias(node)
    if bias is None:
        w.out(op_type, *node.inputs, **attrs)
    else:
        w.emit(op_type, [*node.inputs, bias.inputs[1]], bias.outputs, **attrs)


@writes("matmul")
def matmul(w: Writer, node: Node):
    with_bias(w, node, "Gemm", transA=int(node.attrs["trans_a"]),
              transB=int(node.attrs["trans_b"]))


def window(node: Node) -> dict:
    """strides, pads ([top, left, bottom, right]) and dilations of a 2-d window op."""
    return {"strides": node.attrs["stride"], "pads": list(pad_edges(node.attrs["pad"])),
            "dilations": node.attrs["dilation"]}


@writes("conv2d")
def conv2d(w: Writer, node: Node):
    with_bias(w, node, "Conv", kernel_shape=list(node.inputs[1].type.shape[2:]),
              group=node.attrs["groups"], **window(node))


@writes("max_pool2d", "avg_pool2d")
def pool(w: Writer, node: Node):
    """Written with ceil_mode exactly when a last window hangs out of the padded input
    (Caffe's ceil mode is ONNX's then, an average's divisor counting the taps inside
    it alone), and with each end pad cut to what the windows reach. Caffe's ceil mode
    also drops a last window that would start past the input, as onnxruntime does, but
    onnx's shape inference (the checker's) counts it; so no such window is left to
    count: where a window hangs out along one axis, the input's tail that no window
    reads along another is sliced off first."""
    x = node.inputs[0]
    top, left, bottom, right = pad_edges(node.attrs["pad"])
    sizes = x.type.shape[2:]
    reach = [(count - 1) * stride + window_extent(k, d) - begin  # past the last tap
             for count, k, stride, d, begin in zip(
                 node.outputs[0].type.shape[2:], node.attrs["kernel"], node.attrs["stride"],
                 node.attrs["dilation"], (top, left))]
    hangs = any(r > size + end for r, size, end in zip(reach, sizes, (bottom, right)))
    if hangs and any(r < size for r, size in zip(reach, sizes)):
        x = w.emit("Slice", [x, w.constant([0, 0]),
                             w.constant([min(r, size) for r, size in zip(reach, sizes)]),
                             w.constant([2, 3])])
    ends = [min(end, max(0, r - size)) for r, size, end in zip(reach, sizes, (bottom, right))]
    extra = ({"count_include_pad": int(node.attrs["count_include_pad"])}
             if node.op == "avg_pool2d" else {})
    w.out("MaxPool" if node.op == "max_pool2d" else "AveragePool", x,
          kernel_shape=node.attrs["kernel"], ceil_mode=int(hangs),
          **{**window(node), "pads": [top, left, *ends]}, **extra)


@writes("lrn")
def lrn(w: Writer, node: Node):
    """Caffe's across-channel LRN is ONNX's, its k ONNX's bias (the IR's sizes are odd,
    so both windows are symmetric)."""
    w.out("LRN", node.inputs[0], size=node.attrs["size"], alpha=node.attrs["alpha"],
          beta=node.attrs["beta"], bias=node.attrs["k"])
