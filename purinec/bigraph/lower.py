"""Lowering: a bi-graph `Net` to a flat, typed, placed IR `Graph`.

``lower(net, mode)`` validates the net (`purinec.bigraph.analyze`), walks its ops in
topological order and emits one or more IR nodes per op, inferring every shape with the
op registry. Inputs are the data blobs, then the params (with their init), then state,
each in creation order and placed at its location. IR value names are the blobs'
hierarchical names.

* ``inference``: ops that depend on the ``label`` input (loss, accuracy) are left out and
  dropout is the identity; outputs are ``logits`` then the other declared outputs.
* ``train``: outputs are ``loss``, ``accuracy`` (if present), ``logits``, the other
  declared outputs, and, if the net has dropout, ``iteration``: the state input
  ``%iteration: i64[]`` plus one, so each step draws new masks.
"""

from __future__ import annotations

import zlib

from purinec.bigraph.core import Graph as Graph_
from purinec.bigraph.core import (Blob, Lazy, LayerShapeError, Net, NetStructure, Op, analyze,
                                  label_dependent, resolve)
from purinec.errors import ModelError, ShapeError, UnknownOpError, VerifyError
from purinec.ir.graph import Graph, Value
from purinec.ir.types import DType, TensorType

MODES = ("inference", "train")

_ROLE_ORDER = {"data": 0, "param": 1, "state": 2}


def lower(net: Net, mode: str = "inference") -> Graph:
    """Lower ``net`` to a `purinec.ir.Graph` named after it (plus ``.train`` when
    training), for ``mode``
    (``"inference"`` or ``"train"``). Raises `ModelError` (a `LayerShapeError` for
    shapes) naming the layer and its source line."""
    if not isinstance(net, Net):
        raise ModelError(f"lower() takes a purinec.bigraph.Net, got {type(net).__name__}")
    if mode not in MODES:
        raise ModelError(f"unknown lowering mode {mode!r}; use one of {', '.join(MODES)}")
    return Lowering(net, mode).run()


def _fmt(value: Value) -> str:
    return f"%{value.name}: {value.type}"


class Lowering:
    """The state of one lowering; ops emit IR through it (see `Op.lower`)."""

    def __init__(self, net: Net, mode: str):
        self.net = net
        self.mode = mode
        self.structure: NetStructure = analyze(net)
        # "lenet" for inference, "lenet.train" for the training iteration: dumps of the
        # two then land in different files.
        self.graph = Graph(net.name if mode == "inference" else f"{net.name}.train")
        self.values: dict[int, Value] = {}
        self.reserved = {b.path for b in self.structure.blobs}
        self._input_keys: dict[int, tuple] = {}
        self._iteration: Value | None = None
        self._seeds: set[int] = set()

    # -- the walk ---------------------------------------------------------------------

    def run(self) -> Graph:
        s = self.structure
        skip = label_dependent(s) if self.mode == "inference" else set()
        for op in s.ops:
            if id(op) in skip:
                continue
            inputs = [self.value(b) for b in op.inputs or []]
            outs = op.lower(self, inputs)
            if len(outs) != len(op.outputs):
                raise ModelError(f"{op.blame()}: lowering {op.op_name} gave {len(outs)} "
                                 f"value(s) for {len(op.outputs)} output(s)")
            for blob, value in zip(op.outputs, outs):
                self._check_declared(blob, value)
                self.values[id(blob)] = value
        outputs = [(b.path, self._materialize(b)) for b in self._output_blobs(skip)]
        if self._iteration is not None:
            it = self._iteration
            (nxt,) = self.graph.add_node("add_scalar", [it], {"value": 1.0},
                                         names=[self.fresh_name("iteration.next")],
                                         device=it.device).outputs
            outputs.append(("iteration", nxt))
        self.graph.set_outputs(outputs)
        self.graph.inputs.sort(key=lambda v: self._input_keys[id(v)])
        return self.graph

    def _output_blobs(self, skip: set[int]) -> list[Blob]:
        s = self.structure
        by_name = {b.path: b for b in s.blobs}
        declared = [b for b in s.outputs if id(b) not in skip]
        first: list[Blob] = []
        if self.mode == "train":
            if "loss" not in by_name:
                raise ModelError(f"{self.net.describe()} has no blob named 'loss'; training "
                                 f"needs one (e.g. [logits, label] >> SoftmaxWithLoss('loss'))")
            first = [by_name[n] for n in ("loss", "accuracy", "logits") if n in by_name]
        elif "logits" in by_name and id(by_name["logits"]) not in skip:
            first = [by_name["logits"]]
        result = list(first)
        for b in declared:
            if resolve(b).producer is None and not resolve(b).consumers:
                raise ModelError(f"{b.describe()} is in the net's outputs, but no op makes "
                                 f"or reads it: connect it (>>) or leave it out")
            if b not in result:
                result.append(b)
        if not result:
            raise ModelError(f"{self.net.describe()} has no outputs in {self.mode} mode; "
                             f"set net.outputs")
        return result

    # -- values -----------------------------------------------------------------------

    def value(self, blob: Blob) -> Value:
        """The IR value of a blob; graph inputs are created when first used."""
        blob = resolve(blob)
        value = self.values.get(id(blob))
        if value is None:
            if blob.producer is not None:
                raise ModelError(f"{blob.describe()} is needed before "
                                 f"{blob.producer.blame()} computes it")
            value = self._add_input(blob)
            self.values[id(blob)] = value
        return value

    def shape_of(self, blob: Blob) -> tuple[int, ...]:
        return self.value(blob).type.shape

    def _add_input(self, blob: Blob) -> Value:
        role = blob.role or "data"
        shape = blob.shape
        if isinstance(shape, Lazy):
            owner = blob.parent.describe() if blob.parent is not None else blob.describe()
            bottoms = blob.parent.bottom if isinstance(blob.parent, Graph_) else []
            known = [self.values[id(b)] for b in bottoms if id(b) in self.values]
            shape = self._evaluate(shape, owner, f"the shape of {blob.path}", known)
            try:
                shape = tuple(int(d) for d in shape)
            except (TypeError, ValueError):
                raise ModelError(f"{owner}: the shape of {blob.path} came out as "
                                 f"{shape!r}, not a tuple of ints") from None
        if shape is None:
            raise ModelError(f"{blob.describe()} is an input ({role}) without a shape; "
                             f"give Blob(..., shape=...)")
        value = self.graph.add_input(blob.path, TensorType(shape, blob.dtype),
                                     blob.location.device, role, init=blob.init)
        self._input_keys[id(value)] = (_ROLE_ORDER[role], blob._serial)
        return value

    def _check_declared(self, blob: Blob, value: Value) -> None:
        if blob.shape is None or isinstance(blob.shape, Lazy):
            return
        declared = TensorType(blob.shape, blob.dtype)
        if declared != value.type:
            raise ModelError(f"{blob.describe()} is declared {declared} but "
                             f"{blob.producer.blame()} produces {value.type}")

    def _materialize(self, blob: Blob) -> Value:
        """An output's value, under the blob's own name (an identity reshape when the
        blob is an alias, e.g. of dropout in inference)."""
        value = self.value(blob)
        if value.name == blob.path:
            return value
        return self.graph.add_node("reshape", [value], {"shape": list(value.type.shape)},
                                   names=[blob.path], device=value.device,
                                   loc=blob.loc).outputs[0]

    # -- for ops ------------------------------------------------------------------------

    def _evaluate(self, lazy: Lazy, owner: str, what: str, inputs: list[Value]):
        try:
            return lazy(self.shape_of)
        except ShapeError as e:
            shapes = f" (inputs: {', '.join(_fmt(v) for v in inputs)})" if inputs else ""
            raise LayerShapeError(f"{owner}: {e}{shapes}") from e
        except ModelError:
            raise
        except Exception as e:  # a user's Lazy failing
            raise ModelError(f"{owner}: computing {what} failed: "
                             f"{type(e).__name__}: {e}") from e

    def resolve_attrs(self, op: Op) -> dict:
        """The op's attributes with every `Lazy` evaluated, and a negative ``axis``
        counted from the end of the first input's axes (as Caffe and NumPy count; the
        IR keeps axes non-negative)."""
        inputs = [self.values[id(b)] for b in op.inputs or [] if id(b) in self.values]
        attrs = {k: (self._evaluate(v, op.blame(), f"attribute {k} of {op.op_name}", inputs)
                     if isinstance(v, Lazy) else v) for k, v in op.attrs.items()}
        axis = attrs.get("axis")
        if (isinstance(axis, int) and not isinstance(axis, bool) and axis < 0 and inputs
                and -inputs[0].type.rank <= axis):
            attrs["axis"] = axis + inputs[0].type.rank
        return attrs

    def emit(self, op: Op, ir_op: str, inputs: list[Value], attrs: dict,
             names: list[str]) -> list[Value]:
        """Append one IR node for ``op``, placed at its location with its source line;
        registry errors become errors naming op's layer and line."""
        try:
            from purinec.ir.ops import get_op

            get_op(ir_op).check_arity(len(inputs))
            node = self.graph.add_node(ir_op, inputs, attrs, names=names,
                                       device=op.location.device, loc=op.loc)
        except ShapeError as e:
            raise LayerShapeError(f"{op.blame()}: {e} (inputs: "
                                  f"{', '.join(_fmt(v) for v in inputs)})") from e
        except (VerifyError, UnknownOpError) as e:  # (a name claimed twice, too)
            raise ModelError(f"{op.blame()}: {e}") from e
        return node.outputs

    def fresh_name(self, base: str) -> str:
        """A value name unused in the graph and by every blob of the net."""
        name = self.graph.fresh_name(base, avoid=self.reserved)
        self.reserved.add(name)
        return name

    def iteration(self) -> Value:
        """The ``%iteration: i64[]`` state input (created once)."""
        if self._iteration is None:
            if "iteration" in self.reserved:
                raise ModelError(f"{self.net.describe()}: a blob named 'iteration' clashes "
                                 f"with the iteration counter that dropout needs; rename it")
            self._iteration = self.graph.add_input(
                "iteration", TensorType((), DType.i64), self.net.location.device, "state",
                init="constant(0)")
            self._input_keys[id(self._iteration)] = (3, 0)
        return self._iteration

    def seed_for(self, name: str) -> int:
        """A seed derived from a name (crc32), distinct within this graph."""
        seed = zlib.crc32(name.encode()) & 0x7FFFFFFF
        while seed in self._seeds:
            seed = (seed + 1) & 0x7FFFFFFF
        self._seeds.add(seed)
        return seed
