"""Lowering an `OnnxModel` to an IR graph: the state of one walk over its nodes, and
what converters (`purinec.onnxio.ops`) build IR with."""

from __future__ import annotations

import os
import zlib
from typing import Any, Sequence

import numpy as np

from purinec.errors import ModelError, PurinecError
from purinec.ir.graph import Graph, Value
from purinec.ir.types import DType, TensorType
from purinec.onnxio.proto import array_dtype, attributes, describe, ir_dtype

MODES = ("inference", "train")


class ConstantNeeded(ModelError):
    """A graph input that the model uses as an attribute (a Reshape's shape, a Slice's
    starts): compiling needs its value (`read_onnx`'s ``known``)."""

    def __init__(self, message: str, input: str):
        super().__init__(message)
        self.input = input


class Lowering:
    """One lowering of ``model`` for ``mode``. Converters read the node's inputs with
    `value` (a tensor computed at run time) or `constant` (an array known at import,
    for inputs that act as attributes), and add IR with `emit`; the values they return
    become the node's outputs."""

    def __init__(self, model, mode: str, converters: dict):
        if mode not in MODES:
            raise ModelError(f"unknown lowering mode {mode!r}; use one of {', '.join(MODES)}")
        self.model = model
        self.mode = mode
        self.converters = converters  # ONNX op -> converter (purinec.onnxio.ops)
        self.graph = Graph(model.name if mode == "inference" else f"{model.name}.train")
        self.values: dict[str, Value] = {}
        self.reserved = set(model.names.values())
        self.node: Any = None  # the ONNX node being lowered
        self._iteration: Value | None = None
        self.updates: list[tuple[str, Value]] = []  # state name, its next value

    @property
    def training(self) -> bool:
        return self.mode == "train"

    # -- the walk ---------------------------------------------------------------------

    def run(self) -> Graph:
        for node in self.model.proto.graph.node:
            if self.model.folded(node):
                continue
            self.node = node
            try:
                results = self.converters[node.op_type](self, node, attributes(node))
            except ModelError:
                raise
            except PurinecError as err:  # a shape the IR refuses: say which node
                raise ModelError(f"{self.where()}: {err}") from None
            for name, result in zip(node.output, results):
                if name and result is not None:
                    self.values[name] = result
        self.node = None
        outputs = [(self.model.names[v.name], self.value(v.name))
                   for v in self.model.proto.graph.output]
        for value in self.model.data_inputs:  # those nothing reads are inputs all the same
            self.value(value.name)
        order = {v.name: k for k, v in enumerate(self.model.data_inputs)}
        self.graph.inputs.sort(key=lambda v: order.get(self.model.sources.get(v.name),
                                                       len(order)))
        self.graph.set_outputs(self._with_loss(outputs) + self.updates if self.training
                               else outputs)
        if self._iteration is not None:
            it = self._iteration
            (following,) = self.graph.add_node("add_scalar", [it], {"value": 1.0},
                                               names=[self.fresh("iteration.next")]).outputs
            self.graph.outputs.append(("iteration", following))
        return self.graph

    def _with_loss(self, outputs: list[tuple[str, Value]]) -> list[tuple[str, Value]]:
        """``loss`` and ``accuracy`` of the one output against a new ``label`` input,
        first, as a training graph has them."""
        if len(outputs) != 1 or outputs[0][1].type.rank != 2 or \
                not outputs[0][1].type.dtype.is_float:
            shown = ", ".join(f"{name}: {v.type}" for name, v in outputs)
            raise ModelError(f"{self.model.where}: training an ONNX model needs one output of "
                             f"class scores [batch, classes] (softmax cross-entropy against "
                             f"a label input); it has {shown}")
        logits = outputs[0][1]
        label = self.graph.add_input(self.fresh("label"), TensorType((logits.type.shape[0],),
                                                                    DType.i32), role="data")
        (loss,) = self.graph.add_node("softmax_xent", [logits, label],
                                      names=[self.fresh("loss")]).outputs
        (accuracy,) = self.graph.add_node("accuracy", [logits, label],
                                          names=[self.fresh("accuracy")]).outputs
        return [("loss", loss), ("accuracy", accuracy), *outputs]

    # -- what converters use ----------------------------------------------------------

    def where(self) -> str:
        if self.node is None:
            return f"{self.model.where}: the graph's outputs"
        return f"{self.model.where}: node {describe(self.node)}"

    def fail(self, message: str) -> ModelError:
        """An error naming the node being lowered."""
        return ModelError(f"{self.where()}: {message}")

    def input(self, k: int) -> str | None:
        """The name of the node's input ``k``, or None where it is absent or empty."""
        names = self.node.input
        return names[k] if k < len(names) and names[k] else None

    def value(self, name: str, role: str = "param", init: str | None = None) -> Value:
        """The run-time value of ONNX value ``name``. An initializer used as a tensor
        becomes a graph input of ``role`` (param, or state for running statistics)
        under its own name; a computed constant becomes a `fill` where all its
        elements are equal, else a state input nothing updates."""
        if name in self.values:
            return self.values[name]
        fed = next((v for v in self.model.data_inputs if v.name == name), None)
        if fed is not None:
            self.values[name] = self._data_input(fed)
            return self.values[name]
        if name not in self.model.constants:
            raise self.fail(f"input {name} is neither an input, an initializer nor "
                            f"computed before this node")
        array = self.model.constants[name]
        dtype = array_dtype(array, f"{self.where()}: constant {name}")
        if array.size == 0:
            raise self.fail(f"constant {name} is empty; purinec has no empty tensors")
        type = TensorType(array.shape, dtype)
        initializer = name in self.model.initializers
        if initializer and dtype.is_float and role == "param":
            value = self._variable(name, self.model.names[name], type, "param",
                                   init or _default_init(type))
        elif not initializer and _uniform(array):
            (value,) = self.graph.add_node(
                "fill", [], {"shape": list(array.shape), "dtype": str(dtype),
                             "value": float(array.flat[0])},
                names=[self.model.names[name]], loc=self.loc()).outputs
        else:  # a computed constant's own name may be a graph output's
            ir_name = self.model.names[name] if initializer else self.fresh(
                f"{self.model.names[name]}.value")
            value = self._variable(name, ir_name, type, "state", init)
        self.values[name] = value
        return value

    def _data_input(self, value) -> Value:
        """The graph input fed as ONNX input ``value``, made when first read: an input
        used as an attribute is never one (`constant`)."""
        what = f"{self.model.where}: input {value.name}"
        dtype = ir_dtype(value.type.tensor_type.elem_type, what)
        shape = tuple(d.dim_value for d in value.type.tensor_type.shape.dim)
        if 0 in shape:
            raise ModelError(f"{what} is empty ({list(shape)}); purinec has no empty tensors")
        self.model.sources[self.model.names[value.name]] = value.name
        return self.graph.add_input(self.model.names[value.name], TensorType(shape, dtype),
                                    role="data")

    def _variable(self, name: str, ir_name: str, type: TensorType, role: str,
                  init: str | None) -> Value:
        """A param or state input holding the file's constant ``name``."""
        self.model.sources[ir_name] = name
        return self.graph.add_input(ir_name, type, role=role, init=init)

    def constant(self, k: int, what: str) -> np.ndarray | None:
        """The array of the node's input ``k``, which must be known at import (None
        where the input is absent): ``what`` names it in the error."""
        name = self.input(k)
        if name is None:
            return None
        if name not in self.model.constants:
            message = (f"{self.where()}: {what} (input {name}) must be a constant: purinec "
                       f"compiles static shapes and attributes")
            fed = any(v.name == name for v in self.model.data_inputs)
            raise ConstantNeeded(message, name) if fed else ModelError(message)
        return self.model.constants[name]

    def loc(self) -> str | None:
        if self.node is None:
            return None
        return f"{os.path.basename(self.model.where)}: {describe(self.node)}"

    def emit(self, op: str, inputs: Sequence[Value], attrs: dict | None = None,
             name: str | None = None, n: int = 1) -> Value | list[Value]:
        """Add one IR node; its output is named ``name`` (an IR name: `out` gives the
        node's own), else after the node's first output and ``op``. Returns the output
        value, or the list of ``n`` > 1 outputs."""
        base = self.out(0) if self.node is not None else op
        names = [name] if name is not None else [self.fresh(f"{base}.{op}")]
        if n > 1:
            names = [self.out(k) if k < len(self.node.output) and self.node.output[k]
                     else self.fresh(f"{base}.{op}") for k in range(n)]
        node = self.graph.add_node(op, list(inputs), attrs or {}, names=names, loc=self.loc())
        return node.outputs if n > 1 else node.outputs[0]

    def out(self, k: int) -> str:
        """The IR name of the node's output ``k``."""
        return self.model.names[self.node.output[k]]

    def fresh(self, base: str) -> str:
        """A name no ONNX value has and this graph has not used."""
        name = self.graph.fresh_name(base, avoid=self.reserved)
        self.reserved.add(name)
        return name

    def update(self, state: Value, following: Value) -> None:
        """``following`` is state input ``state``'s value after each training step."""
        self.updates.append((state.name, following))

    def iteration(self) -> Value:
        """The ``%iteration: i64[]`` state input that draws new dropout masks each step."""
        if self._iteration is None:
            if "iteration" in self.reserved:
                raise self.fail("a value named 'iteration' clashes with the iteration "
                                "counter that dropout in training needs")
            self._iteration = self.graph.add_input("iteration", TensorType((), DType.i64),
                                                   role="state", init="constant(0)")
        return self._iteration

    def seed(self) -> int:
        """The dropout seed of the node being lowered, from its output's name."""
        return zlib.crc32(self.node.output[0].encode()) & 0x7FFFFFFF


def _uniform(array: np.ndarray) -> bool:
    first = array.flat[0]
    exact = array.dtype.kind in "fb" or abs(int(first)) < 2**53  # fill's value is a float
    return bool(exact and np.all(array == first))


def _default_init(type: TensorType) -> str:
    """How a dumped graph fills a parameter when compiled without the file's weights:
    He's for weights, zeros for biases."""
    return "msra" if type.rank >= 2 else "constant(0)"
