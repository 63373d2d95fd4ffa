"""`Program`: a compiled model, ready to run, train, inspect and save."""

from __future__ import annotations

import difflib
import os
import threading
import warnings
from collections.abc import MutableMapping
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from purinec.errors import (ExecutionError, ExportError, PurinecError, PurinecWarning,
                            UnknownNameError)
from purinec.ir.graph import Graph, Value, updated_variables
from purinec.ir.init import initial_value
from purinec.ir.types import Device, DType, TensorType
from purinec.ir.verify import verify
from purinec.layout import is_distributed, layout_devices, layout_ranks, rank_of
from purinec.onnxio import OPSET, Exported, export_onnx
from purinec.passes.pipeline import StageHook
from purinec.passes.simplify import keep_outputs, split_fixed_part
from purinec.runtime.distributed import DistributedExecutable, Replicas
from purinec.runtime.memory import check_values_fit
from purinec.targets import get_target
from purinec.weights import check_weights, variables


class TensorStore(MutableMapping):
    """Named arrays with fixed types: assigning checks the shape and casts the dtype.

    Reading gives a read-only view, which follows the updates a step makes in place. New
    values are set by assignment only: a distributed program keeps a replica of each
    variable per device, refreshed when it is assigned, and a write into the array
    itself would reach one device and leave the others computing with the old values.
    """

    def __init__(self, kind: str, arrays: dict[str, np.ndarray]):
        self._kind = kind
        self._arrays = arrays
        # Set by the program: bring the arrays up to date before they are read (values
        # kept on a device), and say when one was assigned.
        self.before_read: Callable[[], None] = lambda: None
        self.assigned: Callable[[str], None] = lambda name: None

    def __getitem__(self, name: str) -> np.ndarray:
        self._check_known(name)
        self.before_read()
        view = self._arrays[name].view()
        view.flags.writeable = False
        return view

    def _check_known(self, name: str) -> None:
        if name not in self._arrays:
            raise UnknownNameError(f"no {self._kind} named {name!r}; the program has "
                                   f"{', '.join(self._arrays) or 'none'}")

    def __contains__(self, name: object) -> bool:
        return name in self._arrays  # (Mapping's would make a view to find out)

    def __setitem__(self, name: str, value) -> None:
        self._check_known(name)
        current = self._arrays[name]
        array = np.asarray(value)
        # Integers may become floats; nothing else changes kind (strings, complex
        # numbers, objects; floats into integers would be rounded).
        allowed = {"f": "iuf", "i": "iu", "u": "iu"}.get(current.dtype.kind, "b")
        if array.dtype.kind not in allowed:
            raise PurinecError(f"{self._kind} {name} is {current.dtype}, got an array of "
                               f"{array.dtype}")
        if array.shape != current.shape:
            raise PurinecError(f"{self._kind} {name} has shape {list(current.shape)}, "
                               f"got an array of shape {list(array.shape)}")
        self._arrays[name] = array.astype(current.dtype, copy=True)
        self.assigned(name)

    def _follow(self, name: str, value: np.ndarray) -> None:
        """Keep a step's new value of ``name`` in the array the views look at (a target
        that updated it in place has put it there already)."""
        current = self._arrays[name]
        if value is not current and not np.may_share_memory(value, current):
            np.copyto(current, value)

    def __delitem__(self, name: str) -> None:
        raise PurinecError(f"cannot delete {self._kind} {name!r}: the program needs it")

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __repr__(self) -> str:
        return (f"<{self._kind} arrays: "
                f"{', '.join(map(self._describe, self._arrays)) or 'none'}>")

    def _describe(self, name: str) -> str:
        array = self._arrays[name]
        return f"{name} {TensorType(array.shape, DType.from_numpy(array.dtype))}"

    def __len__(self) -> int:
        return len(self._arrays)


class Program:
    """A compiled model: run it, train it, read and set its parameters.

    ``ir`` is the final IR of the main graph (the training iteration when compiled with
    ``train=``). ``run`` evaluates the inference graph and leaves every parameter as it
    is; ``step`` runs one training iteration and keeps the updated parameters and state.
    Both may be called from several threads (a server's pool): the calls take turns.

    Built from final IR, no pipeline runs here: ``params`` and ``state`` given as dicts
    must match the IR's inputs exactly; left out (None) they are filled by the IR's
    ``init`` fillers, seeded by ``seed``. ``trace``, a `purinec.runtime.trace.Trace`,
    goes to the target's executables, which record every task into it; a target whose
    factory takes no ``trace`` keyword refuses one rather than ignore it.
    ``metadata`` is free JSON-able information that `save` stores (a checkpoint's epoch).
    """

    def __init__(self, graph: Graph, eval_graph: Graph | None = None,
                 target: str = "reference", seed: int = 0,
                 params: Mapping[str, np.ndarray] | None = None,
                 state: Mapping[str, np.ndarray] | None = None,
                 trace: Any = None, metadata: dict | None = None,
                 after: StageHook | None = None):
        plugin = get_target(target)
        if trace is not None:
            plugin.check_records_traces()
        plugin.check_devices(layout_devices(graph, eval_graph or graph),
                             f"devices of graph {graph.name}")
        self.ir = graph
        self.eval_ir = eval_graph or graph
        self.target = target
        self.metadata = dict(metadata or {})
        graphs = [graph] if self.eval_ir is graph else [graph, self.eval_ir]
        for g in graphs:
            verify(g, program=True)
        _check_variables_stay(graph, self.eval_ir)
        # The params and state each graph returns the next values of (none, or all).
        self._updated_by_step = updated_variables(graph)
        self._run_updates = bool(updated_variables(self.eval_ir))
        self._feeds = {id(g): _Feeds(g) for g in graphs}
        inputs = {v.name: v for g in graphs for v in g.inputs}
        check_values_fit(inputs.values(), f"the inputs of graph {graph.name} (parameters, "
                                          f"state and one batch of data)")
        rng = np.random.default_rng(seed)
        self.params = TensorStore("parameter", _initial_arrays(graphs, "param", params, rng))
        self.state = TensorStore("state", _initial_arrays(graphs, "state", state, rng))
        self._trainable = any(name in self.params for name, _ in graph.outputs)
        self._variable_names = frozenset(self.params) | frozenset(self.state)
        # What this rank runs, when the program is distributed.
        self.physical_ir: Graph | None = None
        self.physical_eval_ir: Graph | None = None
        self._replicas = Replicas()  # shared by the distributed executables
        self._run_main = self._executable(graph, trace, after)
        self._trace = trace
        self._run_eval = self._run_main if self.eval_ir is graph else None
        if self._run_eval is None and not self._defers_inference(plugin):
            self._run_eval = self._executable(self.eval_ir, trace)
        self._keep_variables_on_devices()
        self.last_outputs: dict[str, np.ndarray] = {}  # of the latest step
        if self.trainable:
            _warn_if_frozen(graph, self.params)
        self._partial_weights = False  # weights split over ranks, not gathered since
        # Calls from several threads take turns: a step updates the weights a run reads.
        self._turn = threading.Lock()

    def _defers_inference(self, target) -> bool:
        """Whether the inference graph's executable is built (its kernels compiled) when
        first run rather than now: for a training program, so that a cold start and a
        job that never runs inference skip that compile (a third of the kernels of a
        small net). Not where executables keep variables on devices or span ranks: their
        bookkeeping starts with every executable built."""
        return (self.trainable and not target.keeps_variables
                and not is_distributed(self.eval_ir))

    def _inference_run(self):
        if self._run_eval is None:
            self._run_eval = self._executable(self.eval_ir, self._trace)
        return self._run_eval

    def _keep_variables_on_devices(self) -> None:
        """Let executables that can keep variables on their devices between calls do so
        (`purinec.runtime.gpu.GpuExecutable`): a step then leaves the new values
        there (``_on_device``), and they are pulled into the host's arrays only when
        something reads them."""
        self._kept = {id(run): keep() for run in self._runs()
                      for keep in [getattr(run, "keep_variables", None)] if keep}
        self._on_device: set[str] = set()  # variables whose latest value the main run holds
        for store in (self.params, self.state):
            store.before_read = self._pull
            store.assigned = self._assigned

    def _pull(self) -> None:
        """Bring the host's arrays of the variables a step left on a device up to date."""
        if not self._on_device:
            return
        names = sorted(self._on_device)
        self._on_device.clear()
        self._run_main.pull({name: self._variable(name) for name in names})
        self._replicas_stale(names)
        self._host_changed(names, but=self._run_main)

    def _assigned(self, name: str) -> None:
        """The caller set variable ``name`` (`TensorStore.__setitem__`)."""
        self._replicas_stale([name])
        self._host_changed([name])

    def _replicas_stale(self, names: list[str]) -> None:
        """The host arrays of ``names`` changed in place: the copies made of them for a
        distributed run's other devices (which a run that does not keep a variable,
        such as the inference graph's of running statistics, reads) are out of date."""
        for name in names:
            self._replicas.synced.pop(name, None)

    def _host_changed(self, names: list[str], but: Any = None) -> None:
        """Tell each run that keeps variables (except ``but``) that the host's arrays of
        ``names`` changed, and each that keeps results of the weights that they are out
        of date."""
        for run in self._runs():
            if isinstance(run, _WeightsCached):
                run.weights_changed()
            kept = self._kept.get(id(run), ())
            changed = [name for name in names if name in kept]
            if run is not but and changed:
                run.host_changed(changed)
        if but is None:
            self._on_device.difference_update(names)

    def _variable(self, name: str) -> np.ndarray:
        store = self.params if name in self.params else self.state
        return store._arrays[name]

    @classmethod
    def from_ir(cls, graph: Graph, eval_graph: Graph | None = None, target: str = "reference",
                params: Mapping[str, np.ndarray] | None = None,
                state: Mapping[str, np.ndarray] | None = None, *, seed: int = 0,
                trace: Any = None, metadata: dict | None = None) -> "Program":
        """A program from final IR and (optionally) its weights, with no pipeline run."""
        return cls(graph, eval_graph, target, seed, params, state, trace, metadata)

    def _executable(self, graph: Graph, trace: Any, after: StageHook | None = None):
        target = get_target(self.target)
        if not is_distributed(graph):
            return _weights_cached(graph, target, trace) or target.executable(graph, trace)
        # The job is the one the main graph is laid out for: the inference graph of a
        # pipeline may live on the first stages' ranks only.
        rank = rank_of(self.ir)
        steps_only = graph is self.ir and self.eval_ir is not self.ir
        runs = step_graph(graph) if steps_only else graph
        physical = target.pipeline(rank=rank).run_physical(runs, after)
        if graph is self.ir:
            self.physical_ir = physical
        if graph is self.eval_ir:
            self.physical_eval_ir = physical
        return DistributedExecutable(runs, target.executable(physical, trace), rank,
                                     layout_ranks(self.ir), self._replicas)

    def executed_graphs(self) -> list[Graph]:
        """The graphs this process runs: the final IR, or this rank's physical graphs."""
        graphs = [self.physical_ir or self.ir, self.physical_eval_ir or self.eval_ir]
        return graphs[:1] if self.eval_ir is self.ir else graphs

    @property
    def devices(self) -> list[Device]:
        """Every device the program runs on (on every rank), in rank order."""
        return layout_devices(self.ir)

    def _runs(self) -> list:
        """The executables built of the training and inference graphs (one, when the
        same or when inference has not run yet)."""
        return list({id(r): r for r in (self._run_main, self._run_eval)
                     if r is not None}.values())

    @property
    def cuda_graphs(self) -> str | None:
        """How the cuda target runs the training (or only) graph's calls: task by task,
        or replaying one CUDA graph (``PURINEC_CUDA_GRAPHS=1`` or ``auto``), and why;
        None on other targets."""
        run = self._run_main
        return getattr(getattr(run, "physical", run), "graph_status", None)

    @property
    def communication(self) -> str | None:
        """How this rank exchanges data with other ranks: "shared memory" (ranks of one
        machine), "MPI", "shared memory and MPI", or None when it does not."""
        from purinec.runtime import comm

        kernels = []
        for run in self._runs():
            plan = getattr(getattr(run, "physical", run), "plan", None)
            kernels += [task.fn for task in plan.tasks] if plan is not None else []
        return comm.describe(kernels)

    @property
    def trainable(self) -> bool:
        return self._trainable

    def _env(self, graph: Graph, feeds: Mapping[str, Any], copy_variables: bool = False
             ) -> dict[str, np.ndarray]:
        env = self._feeds[id(graph)].arrays(feeds)
        for store in (self.params, self.state):
            # The arrays themselves: a step updates them in place.
            env.update({name: array.copy() for name, array in store._arrays.items()}
                       if copy_variables else store._arrays)
        return env

    def run(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Evaluate the inference graph; returns its outputs by name. Parameters and
        state stay as they are, even when that graph computes their updates (a training
        graph run as it is, such as a .pir file of one): it then works on copies."""
        with self._turn:
            self._pull()
            outputs = self._inference_run()(self._env(self.eval_ir, feeds,
                                                      copy_variables=self._run_updates))
        return {k: v for k, v in outputs.items() if k not in self._variable_names}

    def step(self, feeds: Mapping[str, Any]) -> float:
        """Run one training iteration, keep the new parameters and state; return the loss."""
        if not self.trainable:
            raise PurinecError("this program was compiled for inference; compile with "
                               "train=purinec.SGD(...) to train it")
        with self._turn:
            outputs = self._run_main(self._env(self.ir, feeds))
            self._partial_weights = getattr(self._run_main, "spans_ranks", False)
            followed = [name for name in self._updated_by_step if name in outputs]
            for name in followed:
                store = self.params if name in self.params else self.state
                store._follow(name, outputs[name])
            self._host_changed(followed, but=self._run_main)
            self._on_device.update(name for name in self._updated_by_step
                                   if name in self._kept.get(id(self._run_main), ()))
            self.last_outputs = outputs
        return float(outputs["loss"])

    def gather_weights(self) -> None:
        """Make every parameter and state array whole on this rank. Needed only when a
        strategy splits weights over MPI ranks (model, hybrid): after a step each rank
        holds its own pieces. Collective: every rank of the job must call it."""
        gather = getattr(self._run_main, "gather_variables", None)
        self._pull()
        if gather is not None:
            gather({**self.params._arrays, **self.state._arrays})
            self._host_changed([*self.params, *self.state], but=self._run_main)
        self._partial_weights = False

    def save(self, path: str | os.PathLike, metadata: dict | None = None):
        """Write this program (IR, weights, kernel sources) to a ``.purine`` artifact,
        atomically. ``metadata`` is merged into `self.metadata` and stored with it.
        Returns a `purinec.artifact.Saved` describing what was written."""
        from purinec.artifact import save

        if self._partial_weights:
            raise PurinecError("this rank holds only its pieces of weights split over MPI "
                               "ranks: call gather_weights() on every rank before saving")
        merged = {**self.metadata, **(metadata or {})}
        saved = save(self, path, merged)
        self.metadata = merged
        return saved

    def export_onnx(self, path: str | os.PathLike, opset: int = OPSET) -> Exported:
        """Write the inference graph and the current weights to ``path`` as an ONNX
        model of ``opset`` (see `purinec.onnxio.export`), atomically. A program over
        several devices is refused: export the model compiled for one device (weights
        can be moved over by assigning them)."""
        if len(self.devices) > 1:
            raise ExportError(f"this program runs on {', '.join(map(str, self.devices))}; an "
                              f"ONNX model is one device's computation: compile the model "
                              f"for one device, assign it these weights (params[name] = "
                              f"array) and export that")
        params = {name: self.params[name] for name in self.params}
        state = {name: self.state[name] for name in self.state}
        return export_onnx(self.eval_ir, params, state, path, opset)

    def close(self) -> None:
        """Release what the target holds (worker threads; a trace is written out)."""
        for run in self._runs():
            close = getattr(run, "close", None)
            if close is not None:
                close()

    def __repr__(self) -> str:
        graphs = (self.ir.name if self.eval_ir is self.ir
                  else f"{self.ir.name} and {self.eval_ir.name}")
        return (f"<Program {graphs}, target {self.target}, on "
                f"{','.join(map(str, self.devices))}, {len(self.params)} parameter(s)>")

    def __enter__(self) -> "Program":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Feeds:
    """What a graph is fed at each call (its inputs of role data), and how the caller's
    arrays are checked and converted: built once, as a call's checks should cost little
    next to small nets' kernels."""

    def __init__(self, graph: Graph):
        self.graph = graph.name
        self.inputs = [(v, v.name, v.type.shape, v.type.dtype.numpy)
                       for v in graph.inputs_with_role("data")]
        self.names = frozenset(name for _, name, _, _ in self.inputs)

    def arrays(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The fed arrays by name, each of its input's dtype and C-contiguous."""
        if not isinstance(feeds, Mapping):
            raise ExecutionError(f"feeds: give a dict of input name -> array (graph "
                                 f"{self.graph} takes "
                                 f"{', '.join(name for _, name, _, _ in self.inputs)}), "
                                 f"got a {type(feeds).__name__}")
        if feeds.keys() != self.names:
            self._refuse_names(feeds)
        env: dict[str, np.ndarray] = {}
        for v, name, shape, want in self.inputs:
            array = np.asarray(feeds[name])
            if array.shape != shape:
                raise ExecutionError(f"input {name}: expected {v.type}, got an array of "
                                     f"shape {list(array.shape)}")
            if array.dtype is not want:
                self._check_kind(v, array, want)
            env[name] = array.astype(want, order="C", copy=False)
        return env

    def _refuse_names(self, feeds: Mapping[str, Any]) -> None:
        unknown = sorted(set(feeds) - self.names)
        missing = sorted(self.names - set(feeds))
        raise ExecutionError(
            f"graph {self.graph} takes inputs {', '.join(sorted(self.names)) or 'none'}"
            + (f"; missing {', '.join(missing)}" if missing else "")
            + (f"; unknown {', '.join(unknown)}" if unknown else ""))

    @staticmethod
    def _check_kind(v: Value, array: np.ndarray, want: np.dtype) -> None:
        if array.dtype.kind != want.kind and not (array.dtype.kind in "iu" and
                                                  want.kind in "iu"):
            raise ExecutionError(f"input {v.name}: expected {v.type}, got {array.dtype}")
        if want.kind in "iu" and not np.can_cast(array.dtype, want) and array.size:
            _check_fits(v, array, np.iinfo(want))


def _check_fits(v: Value, array: np.ndarray, limits: np.iinfo) -> None:
    """Integers cast to ``v``'s narrower type must keep their values (NumPy wraps them
    around: a label 2**32 + 3 would become 3)."""
    low, high = array.min(), array.max()
    if low < limits.min or high > limits.max:
        raise ExecutionError(f"input {v.name}: values from {low} to {high} do not fit "
                             f"{v.type} ({limits.min} to {limits.max})")


class _WeightsCached:
    """An inference graph's executable in two (`split_fixed_part`): the part that reads
    parameters and state alone runs at the first call and then only after the weights
    changed (`weights_changed`, from `Program._host_changed`: an assignment, a step),
    the rest at every call, reading the first part's results. mobilenet_v2 recomputed
    every batch norm's ``gamma / sqrt(var + eps)`` at every call: 52 of its 106 tasks,
    3.6% of a batch-1 inference on the 2-core Zen 4."""

    def __init__(self, fixed, rest, fixed_inputs: list[str]):
        self.fixed, self.rest, self.fixed_inputs = fixed, rest, fixed_inputs
        self.results: dict[str, np.ndarray] | None = None
        self.owners: set[int] = set()  # of the results' memory

    def __call__(self, env: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.results is None:
            self.results = self.fixed({name: env[name] for name in self.fixed_inputs})
            self.owners = {id(_owner(array)) for array in self.results.values()}
        outputs = self.rest({**env, **self.results})
        # An output that is a result, or a view of one (a target may return an input
        # as it is), is the caller's to change: a copy.
        return {name: array.copy() if id(_owner(array)) in self.owners else array
                for name, array in outputs.items()}

    def weights_changed(self) -> None:
        self.results = None

    def close(self) -> None:
        for part in (self.fixed, self.rest):
            close = getattr(part, "close", None)
            if close is not None:
                close()

    def __getattr__(self, name: str):
        return getattr(self.rest, name)  # (its plan: the tasks of every call)


def _owner(array: np.ndarray) -> np.ndarray:
    """The array whose memory ``array`` is (itself, or what it is a view of)."""
    return array if array.base is None else array.base


def _weights_cached(graph: Graph, target, trace: Any) -> _WeightsCached | None:
    """``graph``'s executable as a `_WeightsCached`, where ``graph`` is an inference
    graph (it updates no variable) with a part that reads parameters and state alone;
    else None. (Where a target keeps variables on its devices, the rest keeps the
    part's results there too: they are its parameters, the same arrays until the part
    runs again.)"""
    if updated_variables(graph):
        return None
    split = split_fixed_part(graph)
    if split is None:
        return None
    fixed, rest = split
    opening = trace.opening() if trace is not None else None
    return _WeightsCached(target.executable(fixed, opening), target.executable(rest, trace),
                          [v.name for v in fixed.inputs])


def step_graph(graph: Graph) -> Graph:
    """What the steps of ``graph``, a distributed training iteration whose program has
    an inference graph of its own, run: the graph returning the loss and other scalars
    (an accuracy) and the next params and state, not its batch-sized outputs (the
    logits), which would be gathered from every device at every step for nobody
    (`Program.step` returns the loss; on lenet over two MPI ranks the gather took up
    to 1.5% of a step). A graph that is also the program's inference graph (a training
    iteration from a .pir file) keeps them: `Program.run` reads them."""
    names = {v.name for v in graph.inputs_with_role("param", "state")}
    return keep_outputs(graph, lambda name, value: name in names or value.type.rank == 0)


def _warn_if_frozen(graph: Graph, params: TensorStore) -> None:
    """A training graph updates a parameter by returning an output of its name; say so
    when some are left out (a misspelt output name in a .pir file, most likely)."""
    outputs = [name for name, _ in graph.outputs]
    frozen = [name for name in params if name not in outputs]
    if not frozen:
        return
    spare = [name for name in outputs if name not in params]
    hints = [f"output {close[0]} for {name}?" for name in frozen
             for close in [difflib.get_close_matches(name, spare, n=1)] if close]
    warnings.warn(PurinecWarning(
        f"graph {graph.name} updates some parameters but leaves {', '.join(frozen)} as "
        f"{'it is' if len(frozen) == 1 else 'they are'}: no output has "
        f"{'its' if len(frozen) == 1 else 'their'} name"
        + (f" (did you mean {' '.join(hints)})" if hints else "")), stacklevel=4)


def _check_variables_stay(graph: Graph, eval_graph: Graph) -> None:
    """Every variable must be laid out alike wherever a program's graphs read or write
    it: over MPI ranks, only the ranks a step's new value is made on hold it."""
    where = {}
    for g in (graph, eval_graph):
        variables = g.inputs_with_role("param", "state")
        updates = {name: v for name, v in g.outputs}
        for v in variables:
            for seen, how in ((v, f"graph {g.name} reads it as"),
                              (updates.get(v.name), f"graph {g.name} makes it as")):
                if seen is None or seen.dist is None:
                    continue
                first = where.setdefault(v.name, (seen.dist, how))
                if first[0] != seen.dist:
                    raise PurinecError(
                        f"{v.role} {v.name}: {first[1]} {first[0]} but {how} {seen.dist}; "
                        f"a program must keep each variable in one place (compile the "
                        f"model again)")


def _initial_arrays(graphs: list[Graph], role: str, given: Mapping[str, np.ndarray] | None,
                    rng: np.random.Generator) -> dict[str, np.ndarray]:
    if given is not None:
        check_weights(graphs, role, given)
        # Copies: a target may update them in place, and they are the program's own.
        return {name: np.array(given[name], order="C", copy=True) for name in given}
    return {name: initial_value(v.init, v.type, rng)
            for name, v in variables(*graphs).items() if v.role == role}
