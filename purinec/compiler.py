"""`compile()`: from a model to a runnable `Program`, through the pass pipeline of its
target; and `load()`, of a compiled artifact."""

from __future__ import annotations

import os
import warnings
from typing import Any

from purinec.artifact import read_program
from purinec.errors import ModelError, PurinecError, PurinecWarning
from purinec.ir.graph import Graph
from purinec.ir.parser import parse
from purinec.layout import as_devices, parallel_plan, pinned_to, placement, warn_if_idle
from purinec.onnxio import OnnxModel, read_onnx
from purinec.passes.optimizer import SGD
from purinec.passes.parallel import Parallel
from purinec.passes.pipeline import StageHook
from purinec.program import Program, updated_variables
from purinec.targets import get_target


def load_source(model: Any, batch: int | None = None, **model_kwargs) -> Any:
    """A bi-graph Net or an IR Graph from whatever the user named: a Net or Graph as it
    is, a ``.pir`` file parsed, a zoo name or a Python file (``.py``) built by
    `load_model`, an ONNX file (``.onnx``, or an ``onnx.ModelProto``) read as an
    `OnnxModel`. Any other file is refused, said what it is where that shows (an
    artifact, a NumPy array), and never run."""
    from purinec.bigraph import Net
    from purinec.models import load_model

    if type(model).__name__ == "ModelProto" or \
            (isinstance(model, (str, os.PathLike)) and os.fspath(model).endswith(".onnx")):
        if model_kwargs:
            raise ModelError(f"an ONNX model takes no model options (given "
                             f"{', '.join(sorted(model_kwargs))}); only batch (--batch)")
        return read_onnx(model, batch)
    if isinstance(model, (Net, Graph, OnnxModel)):
        if batch is not None or model_kwargs:
            raise ModelError(f"a {type(model).__name__} has fixed shapes; batch and model "
                             f"options apply only to zoo models and Python files (build "
                             f"the Net for the batch you want)")
        return model
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str):
        raise ModelError(f"cannot compile a {type(model).__name__}: pass a purinec.bigraph.Net, "
                         "a zoo name, a Python file with build(batch), or a .pir file")
    if model.endswith(".purine"):
        raise ModelError(f"{model} is a compiled artifact: load it with purinec.load (its "
                         f"graphs are compiled already)")
    if model.endswith(".pir"):
        if batch is not None or model_kwargs:
            raise ModelError(f"{model}: a .pir file has fixed shapes; batch (--batch) and "
                             "model options apply only to zoo models and Python files")
        try:
            with open(model, encoding="utf-8") as f:
                text = f.read()
        except OSError as err:
            raise ModelError(f"cannot read {model}: {err.strerror}") from None
        except UnicodeDecodeError as err:
            raise ModelError(f"{model} is not IR text (byte {err.start} is not UTF-8); a "
                             f".pir file is what purinec dump writes") from None
        # Verified as written: infer_shapes would otherwise quietly replace a type that
        # disagrees with what its op computes.
        return parse(text, source=model, verify=True)
    return load_model(model, batch, **model_kwargs)


def lowered(source: Any, mode: str = "inference") -> Graph:
    """The IR graph of what `load_source` gave, for ``mode`` (a Graph is copied)."""
    from purinec.bigraph.lower import lower

    if isinstance(source, Graph):
        return source.clone()
    if isinstance(source, OnnxModel):
        return source.lower(mode)
    return lower(source, mode=mode)


def build_graph(source: Any, train: SGD | None, after: StageHook | None = None,
                target: str = "reference", parallel: Parallel | None = None) -> Graph:
    """Lower (or take) the graph and run ``target``'s pipeline (with ``parallel``, or
    the model's own placement: to the distributed logical graph); ``after`` sees every
    stage."""
    graph = lowered(source, "train" if train is not None else "inference")
    if after is not None:
        after("lower", graph)
    return get_target(target).pipeline(train, parallel or placement(graph)).run(graph, after)


def check_differentiable(source: Any, train: SGD | None, model: Any = None) -> None:
    """With ``train``, refuse an IR graph that a pipeline stage made a training graph
    already (a dump of a training pipeline; ``model``: its file): differentiating it
    again is never meant. A dump at the optimizer stage or a later one is a whole
    training iteration, which compiles and trains as it is; one at the autodiff stage
    lacks the solver."""
    if train is None or not isinstance(source, Graph):
        return
    where = f"{model}: graph {source.name}" if isinstance(model, str) else f"graph {source.name}"
    updated = updated_variables(source)
    if updated:
        raise ModelError(f"{where} is a training iteration already (it returns the next "
                         f"{', '.join(updated[:3])}, ...), with its solver in its IR: "
                         f"compile it without train= (--train); purinec train trains it as "
                         f"it is")
    params = {v.name for v in source.inputs_with_role("param")}
    gradients = [name for name, _ in source.outputs
                 if name.startswith("grad.") and name[len("grad."):] in params]
    if gradients:
        raise ModelError(f"{where} is differentiated already (it returns "
                         f"{', '.join(gradients[:3])}, ...) but has no solver: a dump at "
                         f"--stage autodiff. Dump the model at --stage optimizer or a later "
                         f"stage (purinec dump MODEL --train --stage optimizer -o "
                         f"FILE.pir): that is a whole training iteration, which purinec "
                         f"train trains as it is; or dump it without --train")


def checked_layout(target: str, devices: Any = None, parallel: str | None = None,
                   micro_batches: int | None = None, trace: Any = None) -> Parallel | None:
    """The layout compile() makes of its ``devices``, ``parallel`` and ``micro_batches``
    (None for one device), with them, ``target`` and ``trace`` checked: cheap, before
    any work (train checks them before it loads its data set)."""
    target_plugin = get_target(target)
    if trace is not None:
        target_plugin.check_records_traces()
    if devices is not None:
        devices = as_devices(devices)
        target_plugin.check_devices(devices, "the devices asked for")
    return target_plugin.lay_out(parallel_plan(devices, parallel, micro_batches))


def compile(model: Any, target: str = "reference", train: SGD | None = None, *,
            batch: int | None = None, seed: int = 0, devices: Any = None,
            parallel: str | None = None, micro_batches: int | None = None,
            trace: Any = None, after: StageHook | None = None, **model_kwargs) -> Program:
    """Compile ``model`` for ``target``.

    ``model`` is a purinec.bigraph.Net, a zoo name ("lenet"), a Python file defining
    ``build(batch)``, a ``.pir`` IR file, or an IR Graph. With ``train=SGD(...)`` the
    program's main graph is the training iteration. ``after(stage, graph)`` is called
    with the IR after every stage of the main graph's pipeline (see STAGES). ``trace``
    goes to the target (see `Program`). ``devices`` ("cpu:0,cpu:1", a count, or Device
    objects; ranks as ``r1/cpu:0``) and ``parallel`` (a strategy in
    purinec.passes.parallel.STRATEGIES, default "data") spread the program over
    several devices; ``Program.ir`` is then the distributed logical graph.
    ``micro_batches`` goes with ``parallel="pipeline"``.
    """
    if train is not None and not isinstance(train, SGD):
        raise PurinecError(f"train={train!r}: give purinec.SGD(lr=..., momentum=..., "
                           f"weight_decay=...) to compile the training iteration, or None")
    spread = checked_layout(target, devices, parallel, micro_batches, trace)
    source = load_source(model, batch, **model_kwargs)
    if isinstance(source, Graph):  # placed already: refuse devices before any pass runs
        named = f" in {os.fspath(model)}" if isinstance(model, (str, os.PathLike)) else ""
        get_target(target).check_devices(source.devices(),
                                         f"devices of graph {source.name}{named}")
    check_differentiable(source, train, model)
    graph = build_graph(source, train, after, target, spread)
    _check_batch_taken(graph, batch, model)
    if spread is not None:
        _warn_if_placement_dropped(source)
    eval_graph = (build_graph(source, None, target=target,
                              parallel=spread and pinned_to(graph, spread))
                  if train is not None else None)
    program = Program(graph, eval_graph, target, seed, trace=trace, after=after)
    if isinstance(source, OnnxModel):
        _start_from_file(program, source)
    if spread is not None:
        warn_if_idle(spread, program.ir)
    return program


def _start_from_file(program: Program, source: Any) -> None:
    """The weights an ONNX file gives, in place of the fillers' draws."""
    for role, arrays in source.variables(program.ir).items():
        store = program.params if role == "param" else program.state
        for name, array in arrays.items():
            store[name] = array


def _warn_if_placement_dropped(source: Any) -> None:
    """A model that puts its layers on devices itself, compiled with devices or a
    strategy: the strategy lays it out anew and the model's placement is not used."""
    graph = source if isinstance(source, Graph) else lowered(source)
    own = placement(graph)
    if own is not None:
        warnings.warn(PurinecWarning(
            f"{graph.name} places its layers on {', '.join(map(str, own.devices))} itself; "
            f"the devices and strategy given lay it out anew, without that placement "
            f"(give neither to run it as placed)"), stacklevel=3)


def _check_batch_taken(graph: Graph, batch: int | None, model: Any) -> None:
    """A batch asked for must be the batch of the graph's data input: a build() that
    ignores its batch argument would otherwise run another one without a word."""
    data = next((v for v in graph.inputs_with_role("data") if v.name == "data"), None)
    if batch is None or data is None or not data.type.shape or data.type.shape[0] == batch:
        return
    raise ModelError(f"batch {batch} (--batch) was asked for, but {model} makes input data "
                     f"{data.type}: let its build() use its batch argument")


def load(path: str | os.PathLike, target: str | None = None, trace: Any = None) -> Program:
    """Load a ``.purine`` artifact written by `Program.save` (see purinec.artifact);
    ``target`` overrides the one it was compiled for."""
    saved = read_program(path, target)
    return Program.from_ir(saved.graph, saved.eval_graph, saved.target, saved.params,
                           saved.state, trace=trace, metadata=saved.metadata)
