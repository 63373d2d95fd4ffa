"""`compile()`: the default pipeline from a model to a runnable `Program`."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from purinec.errors import ExecutionError, ModelError, PurinecError
from purinec.ir.graph import Graph
from purinec.ir.init import initial_value
from purinec.ir.parser import parse
from purinec.ir.verify import verify
from purinec.passes.autodiff import autodiff
from purinec.passes.optimizer import SGD
from purinec.passes.pipeline import Pass, StageHook, run_passes
from purinec.passes.simplify import cse, dce, infer_shapes
from purinec.runtime.reference import execute

TARGETS: dict[str, Callable[[Graph], Callable[[Mapping[str, np.ndarray]], dict]]] = {
    "reference": lambda graph: (lambda env: execute(graph, env)),
}

# Every stage a dump can show, in pipeline order. "lower" is the graph as the front end
# produced it (for a .pir file: as parsed). autodiff and optimizer run only for training.
STAGES = ("lower", "infer_shapes", "verify", "autodiff", "optimizer", "dce", "cse")


def _verify_pass(graph: Graph) -> Graph:
    verify(graph)
    return graph


def passes_for(train: SGD | None) -> list[Pass]:
    passes = [Pass("infer_shapes", infer_shapes, "recompute output types from inputs"),
              Pass("verify", _verify_pass, "check every IR invariant")]
    if train is not None:
        passes += [Pass("autodiff", autodiff, "append the backward graph"),
                   Pass("optimizer", train.apply, "append the solver's updates")]
    passes += [Pass("dce", dce, "drop nodes that reach no output"),
               Pass("cse", cse, "merge identical nodes")]
    return passes


def load_source(model: Any, batch: int | None = None, **model_kwargs) -> Any:
    """A bi-graph Net or an IR Graph from whatever the user named."""
    from purinec.bigraph import Net
    from purinec.models import load_model

    if isinstance(model, (Net, Graph)):
        return model
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str):
        raise ModelError(f"cannot compile a {type(model).__name__}: pass a purinec.bigraph.Net, "
                         "a zoo name, a Python file with build(batch), or a .pir file")
    if model.endswith(".pir"):
        if batch is not None or model_kwargs:
            raise ModelError(f"{model}: a .pir file has fixed shapes; --batch and model "
                             "options apply only to zoo models and Python files")
        try:
            with open(model, encoding="utf-8") as f:
                text = f.read()
        except OSError as err:
            raise ModelError(f"cannot read {model}: {err.strerror}") from None
        return parse(text, source=model)
    return load_model(model, batch, **model_kwargs)


def build_graph(source: Any, train: SGD | None, after: StageHook | None = None) -> Graph:
    """Lower (or take) the graph and run the pipeline; ``after`` sees every stage."""
    from purinec.passes.lower import lower

    if isinstance(source, Graph):
        graph = source.clone()
    else:
        graph = lower(source, mode="train" if train is not None else "inference")
    if after is not None:
        after("lower", graph)
    return run_passes(graph, passes_for(train), after).graph


class TensorStore(MutableMapping):
    """Named arrays with fixed types: assigning checks the shape and casts the dtype."""

    def __init__(self, kind: str, arrays: dict[str, np.ndarray]):
        self._kind = kind
        self._arrays = arrays

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def __setitem__(self, name: str, value) -> None:
        if name not in self._arrays:
            raise PurinecError(f"no {self._kind} named {name!r}; the program has "
                               f"{', '.join(self._arrays) or 'none'}")
        current = self._arrays[name]
        array = np.asarray(value)
        if array.shape != current.shape:
            raise PurinecError(f"{self._kind} {name} has shape {list(current.shape)}, "
                               f"got an array of shape {list(array.shape)}")
        self._arrays[name] = array.astype(current.dtype, copy=True)

    def __delitem__(self, name: str) -> None:
        raise PurinecError(f"cannot delete {self._kind} {name!r}: the program needs it")

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)


class Program:
    """A compiled model: run it, train it, read and set its parameters.

    ``ir`` is the final IR of the main graph (the training iteration when compiled with
    ``train=``). ``run`` evaluates the inference graph and leaves every parameter as it
    is; ``step`` runs one training iteration and keeps the updated parameters and state.
    """

    def __init__(self, graph: Graph, eval_graph: Graph | None = None,
                 target: str = "reference", seed: int = 0):
        if target not in TARGETS:
            raise PurinecError(f"unknown target {target!r}; available: {', '.join(TARGETS)}")
        self.ir = graph
        self.eval_ir = eval_graph or graph
        self.target = target
        rng = np.random.default_rng(seed)
        stores: dict[str, dict[str, np.ndarray]] = {"param": {}, "state": {}}
        for g in (graph, self.eval_ir):
            for v in g.inputs_with_role("param", "state"):
                stores[v.role].setdefault(v.name, initial_value(v.init, v.type, rng))
        self.params = TensorStore("parameter", stores["param"])
        self.state = TensorStore("state", stores["state"])
        self._run_main = TARGETS[target](graph)
        self._run_eval = TARGETS[target](self.eval_ir)
        self.last_outputs: dict[str, np.ndarray] = {}  # of the latest step

    @property
    def trainable(self) -> bool:
        return any(name in self.params for name, _ in self.ir.outputs)

    def _env(self, graph: Graph, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        data = graph.inputs_with_role("data")
        names = {v.name for v in data}
        unknown = sorted(set(feeds) - names)
        missing = sorted(names - set(feeds))
        if unknown or missing:
            raise ExecutionError(
                f"graph {graph.name} takes inputs {', '.join(sorted(names)) or 'none'}"
                + (f"; missing {', '.join(missing)}" if missing else "")
                + (f"; unknown {', '.join(unknown)}" if unknown else ""))
        env: dict[str, np.ndarray] = {}
        for v in data:
            array = np.asarray(feeds[v.name])
            want = v.type.dtype.numpy
            if array.shape != v.type.shape:
                raise ExecutionError(f"input {v.name}: expected {v.type}, got an array of "
                                     f"shape {list(array.shape)}")
            if array.dtype.kind != want.kind and not (array.dtype.kind in "iu" and
                                                      want.kind in "iu"):
                raise ExecutionError(f"input {v.name}: expected {v.type}, got {array.dtype}")
            env[v.name] = array.astype(want, copy=False)
        for store in (self.params, self.state):
            env.update({name: store[name] for name in store})
        return env

    def run(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Evaluate the inference graph; returns its outputs by name."""
        outputs = self._run_eval(self._env(self.eval_ir, feeds))
        return {k: v for k, v in outputs.items()
                if k not in self.params and k not in self.state}

    def step(self, feeds: Mapping[str, Any]) -> float:
        """Run one training iteration, keep the new parameters and state; return the loss."""
        if not self.trainable:
            raise PurinecError("this program was compiled for inference; compile with "
                               "train=purinec.SGD(...) to train it")
        outputs = self._run_main(self._env(self.ir, feeds))
        for name, value in outputs.items():
            for store in (self.params, self.state):
                if name in store:
                    store._arrays[name] = value
        self.last_outputs = outputs
        return float(outputs["loss"])


def compile(model: Any, target: str = "reference", train: SGD | None = None,
            batch: int | None = None, seed: int = 0, after: StageHook | None = None,
            **model_kwargs) -> Program:
    """Compile ``model`` for ``target``.

    ``model`` is a purinec.bigraph.Net, a zoo name ("lenet"), a Python file defining
    ``build(batch)``, a ``.pir`` IR file, or an IR Graph. With ``train=SGD(...)`` the
    program's main graph is the training iteration. ``after(stage, graph)`` is called
    with the IR after every stage of the main graph's pipeline (see STAGES).
    """
    if target not in TARGETS:
        raise PurinecError(f"unknown target {target!r}; available: {', '.join(TARGETS)}")
    source = load_source(model, batch, **model_kwargs)
    graph = build_graph(source, train, after)
    eval_graph = build_graph(source, None) if train is not None else None
    return Program(graph, eval_graph, target, seed)
