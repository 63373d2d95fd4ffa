"""`compile()`: the default pipeline from a model to a runnable `Program`."""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import MutableMapping
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from purinec.errors import (ExecutionError, ModelError, PurinecError, PurinecWarning,
                            UnknownNameError)
from purinec.ir.graph import Graph, Value
from purinec.ir.init import initial_value
from purinec.ir.ops import spans_ranks
from purinec.ir.parser import parse
from purinec.ir.types import Device, Distribution, DType, TensorType
from purinec.ir.verify import verify
from purinec.passes.autodiff import autodiff
from purinec.passes.fuse import fuse
from purinec.passes.optimizer import SGD
from purinec.passes.parallel import Parallel, parallelize, parse_devices, partition
from purinec.passes.parallel.distribute import check_micro_batches
from purinec.passes.parallel.pipeline import assign_stages, microbatch
from purinec.passes.pipeline import Pass, StageHook, run_passes
from purinec.passes.simplify import cse, dce, infer_shapes
from purinec.runtime.collectives import HOST_OPS, host_kernel
from purinec.runtime.distributed import DistributedExecutable, Replicas
from purinec.runtime.reference import execute


@dataclass(frozen=True)
class Target:
    """Where a program runs: how to build an executable from final IR (the contract in
    docs/architecture.md), and the passes this target adds at the end of the pipeline."""

    name: str
    build: Callable[..., Callable[[Mapping[str, np.ndarray]], dict]]  # (graph, trace)
    passes: tuple[Pass, ...] = ()
    records_traces: bool = False
    doc: str = ""
    device_kinds: tuple[str, ...] = ("cpu",)  # the devices its kernels run on


def _reference_executable(graph: Graph, trace: Any = None):
    if not any(spans_ranks(node) for node in graph.nodes):
        return lambda env: execute(graph, env)
    # Collectives across ranks: each op's NumPy reference, run by the counting executor
    # alongside the MPI kernels.
    from purinec.runtime.executor import Executable
    from purinec.runtime.plan import reference_kernels

    return Executable(graph, {**reference_kernels(graph), **host_kernels(graph)})


def generated_kernels(graph: Graph) -> dict:
    """The cpu target's compiled kernel of every node but the communication nodes,
    which the runtime runs itself (`host_kernels`)."""
    from purinec.codegen.cpu import compile_kernels

    generated = Graph(graph.name)
    generated.nodes = [node for node in graph.nodes if node.op not in HOST_OPS]
    return compile_kernels(generated)


def _cpu_executable(graph: Graph, trace: Any = None):
    from purinec.runtime.executor import Executable

    kernels = {node: kernel.fn for node, kernel in generated_kernels(graph).items()}
    kernels.update(host_kernels(graph))
    return Executable(graph, kernels, trace=trace, worker_init=_core_share(graph))


def host_kernels(graph: Graph) -> dict:
    """Kernels of the communication nodes: in-process, or MPI for groups that span
    ranks (those need the job to run under mpiexec). The MPI ones are made together,
    so every rank creates their communicators in the same order."""
    host = [node for node in graph.nodes if node.op in HOST_OPS]
    kernels = {node: host_kernel(node) for node in host if not spans_ranks(node)}
    spanning = [node for node in host if spans_ranks(node)]
    if spanning:
        from purinec.runtime import comm

        kernels.update(comm.comm_kernels(spanning, comm.world()))
    return kernels


def _core_share(graph: Graph) -> Callable:
    """Each device's compute threads get an equal share of the cores this process may
    use (with the other ranks on this machine), so devices working at once do not
    oversubscribe them."""
    from purinec.codegen.cpu_runtime import process_cpus, set_threads

    devices = {v.device for node in graph.nodes for v in node.outputs}
    share = max(1, process_cpus() // max(1, len(devices)))
    return lambda lane: set_threads(share)


TARGETS: dict[str, Target] = {
    "reference": Target("reference", _reference_executable,
                        doc="NumPy, one op at a time: the oracle"),
    "cpu": Target("cpu", _cpu_executable,
                  passes=(Pass("fuse", fuse, "group nodes into fused kernels"),),
                  records_traces=True,
                  doc="fused Numba kernels run by the dependency-counting runtime"),
}

# Every stage a dump can show, in pipeline order. "lower" is the graph as the front end
# produced it (for a .pir file: as parsed). autodiff and optimizer run only for training,
# fuse only for targets that fuse (cpu).
# With several devices, "parallel" (distributions and boxing) ends the logical pipeline
# and "partition" starts each rank's physical one.
STAGES = ("lower", "infer_shapes", "verify", "stages", "autodiff", "optimizer", "dce", "cse",
          "microbatch", "parallel", "partition", "fuse")


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise PurinecError(f"unknown target {name!r}; available: {', '.join(TARGETS)}") from None


def _verify_pass(graph: Graph) -> Graph:
    verify(graph)
    return graph


def passes_for(train: SGD | None, target: str = "reference",
               parallel: Parallel | None = None) -> list[Pass]:
    """The pipeline to final IR; with ``parallel``, to the distributed logical graph
    (each rank's physical pipeline follows: `physical_passes`)."""
    passes = [Pass("infer_shapes", infer_shapes, "recompute output types from inputs"),
              Pass("verify", _verify_pass, "check every IR invariant")]
    pipelined = parallel is not None and parallel.strategy == "pipeline"
    if pipelined:
        passes.append(Pass("stages", lambda g: assign_stages(g, parallel.devices,
                                                             dict(parallel.pinned)),
                           "put layers on the devices in stages of equal work"))
    if train is not None:
        passes += [Pass("autodiff", autodiff, "append the backward graph"),
                   Pass("optimizer", train.apply, "append the solver's updates")]
    passes += [Pass("dce", dce, "drop nodes that reach no output"),
               Pass("cse", cse, "merge identical nodes")]
    if pipelined:
        passes.append(Pass("microbatch", lambda g: microbatch(g, parallel.micro_batches or
                                                              default_micro_batches(g, parallel)),
                           "one copy of the batch's work per micro-batch"))
    if parallel is not None:
        return passes + [Pass("parallel", lambda g: parallelize(g, parallel),
                              f"distribute: {parallel.describe()}")]
    return passes + list(get_target(target).passes)


def default_micro_batches(graph: Graph, parallel: Parallel) -> int:
    from purinec.passes.parallel.pipeline import default_micro_batches as default

    data = graph.inputs_with_role("data")
    return default(len(parallel.devices), min((v.type.shape[0] for v in data if v.type.rank),
                                              default=1))


def physical_passes(rank: int, target: str) -> list[Pass]:
    """From a distributed logical graph to the physical graph ``rank`` runs."""
    return [Pass("partition", lambda g: partition(g, rank), f"the graph of rank {rank}"),
            *get_target(target).passes]


def is_distributed(graph: Graph) -> bool:
    return any(v.dist is not None for v in graph.inputs)


# Node attributes that name devices (of collectives and point-to-point copies).
DEVICE_ATTRS = ("group", "root", "peer")


def onto_ranks(ranks: int, *graphs: Graph) -> list[Graph]:
    """``graphs`` (of one program) laid out over devices of some number of ranks, moved
    onto ``ranks`` ranks: the layout's devices, in rank order, are dealt out in equal
    consecutive blocks, the k-th device of a rank's block becoming its cpu:k (one rank:
    every device becomes a device of this process). The same work on the same pieces,
    with collectives between threads where devices now share a process: a checkpoint
    saved by one job runs in a job of another size, or without mpiexec."""
    devices = layout_devices(*graphs)
    if len(devices) < ranks:
        raise PurinecError(f"the program is laid out over {len(devices)} device(s); it "
                           f"cannot be spread over {ranks} ranks: run it on at most "
                           f"{len(devices)} (mpiexec -n {len(devices)}, or without mpiexec)")
    blocks = [k * ranks // len(devices) for k in range(len(devices))]
    here = {d: Device(d.kind, blocks[:k].count(blocks[k]), blocks[k])
            for k, d in enumerate(devices)}
    return [_moved(graph, here) for graph in graphs]


def _check_device_kinds(target: str, devices, what: str) -> None:
    """A target refuses devices it has no kernels for, rather than running them on
    the host under another name."""
    kinds = get_target(target).device_kinds
    foreign = sorted(str(d) for d in devices if d.kind not in kinds)
    if foreign:
        raise PurinecError(f"target {target} runs on {' or '.join(kinds)} devices, not on "
                           f"{', '.join(foreign)} ({what})")


def layout_devices(*graphs: Graph) -> list[Device]:
    """Every device the graphs' values live on or are laid out over, in rank order."""
    return sorted({d for g in graphs for v in g.values() if v.dist is not None
                   for d in v.dist.group} | {d for g in graphs for d in g.devices()},
                  key=lambda d: (d.rank, d.kind, d.index))


def _moved(graph: Graph, here: dict[Device, Device]) -> Graph:
    moved = graph.clone()
    for v in moved.values():
        v.device = here[v.device]
        if v.dist is not None:
            v.dist = Distribution(v.dist.kind, tuple(here[d] for d in v.dist.group),
                                  v.dist.axis)
    for node in moved.nodes:
        for key in DEVICE_ATTRS:
            if key in node.attrs:
                node.attrs[key] = ",".join(str(here[Device.parse(text)])
                                           for text in node.attrs[key].split(","))
    return moved


def layout_ranks(graph: Graph) -> int:
    """How many ranks ``graph`` is laid out over (1 for a graph of one process)."""
    return 1 + max(d.rank for d in layout_devices(graph))


def rank_of(graph: Graph) -> int:
    """This process's rank in the job ``graph`` is laid out for: 0 unless its devices
    span ranks, which needs a job started with mpiexec of the right size."""
    from purinec.runtime import comm

    ranks = {d.rank for v in graph.inputs if v.dist is not None for d in v.dist.group}
    world = comm.world()
    if ranks <= {0} and world.size > 1:
        raise PurinecError(f"graph {graph.name} is laid out over devices of rank 0 only, but "
                           f"this job has {world.size} ranks: lay it out over every rank "
                           f"(devices such as r0/cpu:0,r1/cpu:0; in the model, "
                           f"Location(rank=1, ...)), or give no devices and no placement "
                           f"for one device per rank")
    if ranks <= {0}:
        return 0
    if world.size != max(ranks) + 1:
        raise PurinecError(f"graph {graph.name} is laid out over {max(ranks) + 1} ranks but "
                           f"this job has {world.size}; start it with "
                           f"mpiexec -n {max(ranks) + 1}")
    return world.rank


def load_source(model: Any, batch: int | None = None, **model_kwargs) -> Any:
    """A bi-graph Net or an IR Graph from whatever the user named."""
    from purinec.bigraph import Net
    from purinec.models import load_model

    if isinstance(model, (Net, Graph)):
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


def build_graph(source: Any, train: SGD | None, after: StageHook | None = None,
                target: str = "reference", parallel: Parallel | None = None) -> Graph:
    """Lower (or take) the graph and run ``target``'s pipeline (with ``parallel``: to the
    distributed logical graph); ``after`` sees every stage."""
    from purinec.passes.lower import lower

    if isinstance(source, Graph):
        graph = source.clone()
    else:
        graph = lower(source, mode="train" if train is not None else "inference")
    if after is not None:
        after("lower", graph)
    parallel = parallel or placement(graph)
    return run_passes(graph, passes_for(train, target, parallel), after).graph


def placement(graph: Graph) -> Parallel | None:
    """For a graph whose model put its layers on several devices itself: run each node
    where it was put, with copies between devices."""
    devices = graph.devices()
    return Parallel(tuple(devices), "placement") if len(devices) > 1 else None


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

    def __getitem__(self, name: str) -> np.ndarray:
        self._check_known(name)
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

    def _follow(self, name: str, value: np.ndarray) -> None:
        """Keep a step's new value of ``name`` in the array the views look at (a target
        that updated it in place has put it there already)."""
        current = self._arrays[name]
        if not np.may_share_memory(value, current):
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


def variables(*graphs: Graph | None) -> dict[str, Value]:
    """The param and state inputs of ``graphs`` by name; a name the graphs declare
    differently (type or role) is an error, since a program holds one array per name."""
    found: dict[str, Value] = {}
    for graph in graphs:
        if graph is None:
            continue
        for v in graph.inputs_with_role("param", "state"):
            seen = found.setdefault(v.name, v)
            if (seen.role, seen.type) != (v.role, v.type):
                raise PurinecError(f"{v.role} {v.name} is {v.type} in graph {graph.name} but "
                                   f"{seen.role} {seen.type} in another graph of the program")
    return found


def _describe_array(array: np.ndarray) -> str:
    """The array's type as the IR spells it, or NumPy's spelling (e.g. '>f4', '<U3') for
    what the IR cannot hold."""
    try:
        dtype = DType.from_numpy(array.dtype)
        name = str(dtype) if dtype.numpy == array.dtype else array.dtype.str
    except ValueError:
        name = array.dtype.str
    return f"{name}[{','.join(str(d) for d in array.shape)}]"


def check_weights(graphs: list[Graph], role: str, arrays: Mapping[str, np.ndarray]) -> None:
    """Raise unless ``arrays`` holds exactly the graphs' inputs of ``role`` (param or
    state), each with the declared shape and dtype."""
    wanted = {name: v for name, v in variables(*graphs).items() if v.role == role}
    missing = sorted(set(wanted) - set(arrays))
    extra = sorted(set(arrays) - set(wanted))
    if missing or extra:
        raise PurinecError(
            f"the {role} arrays do not match the IR's {role} inputs"
            + (f"; missing {', '.join(missing)}" if missing else "")
            + (f"; not in the IR: {', '.join(extra)}" if extra else ""))
    for name, v in wanted.items():
        array = arrays[name]
        if array.shape != v.type.shape or array.dtype != v.type.dtype.numpy:
            raise PurinecError(f"{role} {name}: the IR declares {v.type}, the array is "
                               f"{_describe_array(array)}")


class Program:
    """A compiled model: run it, train it, read and set its parameters.

    ``ir`` is the final IR of the main graph (the training iteration when compiled with
    ``train=``). ``run`` evaluates the inference graph and leaves every parameter as it
    is; ``step`` runs one training iteration and keeps the updated parameters and state.

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
        if trace is not None and not get_target(target).records_traces:
            raise PurinecError(f"target {target} does not record traces; run without a trace "
                               f"or on a target that records them")
        _check_device_kinds(target, layout_devices(graph, eval_graph or graph),
                            f"devices of graph {graph.name}")
        self.ir = graph
        self.eval_ir = eval_graph or graph
        self.target = target
        self.metadata = dict(metadata or {})
        graphs = [graph] if self.eval_ir is graph else [graph, self.eval_ir]
        _check_variables_stay(graph, self.eval_ir)
        rng = np.random.default_rng(seed)
        self.params = TensorStore("parameter", _initial_arrays(graphs, "param", params, rng))
        self.state = TensorStore("state", _initial_arrays(graphs, "state", state, rng))
        # What this rank runs, when the program is distributed.
        self.physical_ir: Graph | None = None
        self.physical_eval_ir: Graph | None = None
        self._replicas = Replicas()  # shared by the distributed executables
        self._run_main = self._executable(graph, trace, after)
        self._run_eval = (self._run_main if self.eval_ir is graph
                          else self._executable(self.eval_ir, trace))
        self.last_outputs: dict[str, np.ndarray] = {}  # of the latest step
        if self.trainable:
            _warn_if_frozen(graph, self.params)
        self._partial_weights = False  # weights split over ranks, not gathered since

    @classmethod
    def from_ir(cls, graph: Graph, eval_graph: Graph | None = None, target: str = "reference",
                params: Mapping[str, np.ndarray] | None = None,
                state: Mapping[str, np.ndarray] | None = None, *, seed: int = 0,
                trace: Any = None, metadata: dict | None = None) -> "Program":
        """A program from final IR and (optionally) its weights, with no pipeline run."""
        return cls(graph, eval_graph, target, seed, params, state, trace, metadata)

    def _executable(self, graph: Graph, trace: Any, after: StageHook | None = None):
        build = get_target(self.target).build
        if not is_distributed(graph):
            return build(graph, trace)
        # The job is the one the main graph is laid out for: the inference graph of a
        # pipeline may live on the first stages' ranks only.
        rank = rank_of(self.ir)
        physical = run_passes(graph, physical_passes(rank, self.target), after).graph
        if graph is self.ir:
            self.physical_ir = physical
        if graph is self.eval_ir:
            self.physical_eval_ir = physical
        return DistributedExecutable(graph, build(physical, trace), rank,
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
        """The executables of the training and inference graphs (one, when the same)."""
        return list({id(r): r for r in (self._run_main, self._run_eval)}.values())

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
        return any(name in self.params for name, _ in self.ir.outputs)

    def _env(self, graph: Graph, feeds: Mapping[str, Any], copy_variables: bool = False
             ) -> dict[str, np.ndarray]:
        if not isinstance(feeds, Mapping):
            raise ExecutionError(f"feeds: give a dict of input name -> array (graph "
                                 f"{graph.name} takes "
                                 f"{', '.join(v.name for v in graph.inputs_with_role('data'))}"
                                 f"), got a {type(feeds).__name__}")
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
            if want.kind in "iu" and not np.can_cast(array.dtype, want) and array.size:
                _check_fits(v, array, np.iinfo(want))
            env[v.name] = array.astype(want, order="C", copy=False)
        for store in (self.params, self.state):
            # The arrays themselves: a step updates them in place.
            env.update({name: array.copy() for name, array in store._arrays.items()}
                       if copy_variables else store._arrays)
        return env

    def run(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Evaluate the inference graph; returns its outputs by name. Parameters and
        state stay as they are, even when that graph computes their updates (a training
        graph run as it is, such as a .pir file of one): it then works on copies."""
        updates = bool(updated_variables(self.eval_ir))
        outputs = self._run_eval(self._env(self.eval_ir, feeds, copy_variables=updates))
        return {k: v for k, v in outputs.items()
                if k not in self.params and k not in self.state}

    def step(self, feeds: Mapping[str, Any]) -> float:
        """Run one training iteration, keep the new parameters and state; return the loss."""
        if not self.trainable:
            raise PurinecError("this program was compiled for inference; compile with "
                               "train=purinec.SGD(...) to train it")
        outputs = self._run_main(self._env(self.ir, feeds))
        self._partial_weights = getattr(self._run_main, "spans_ranks", False)
        for name, value in outputs.items():
            for store in (self.params, self.state):
                if name in store:
                    store._follow(name, value)
        self.last_outputs = outputs
        return float(outputs["loss"])

    def gather_weights(self) -> None:
        """Make every parameter and state array whole on this rank. Needed only when a
        strategy splits weights over MPI ranks (model, hybrid): after a step each rank
        holds its own pieces. Collective: every rank of the job must call it."""
        gather = getattr(self._run_main, "gather_variables", None)
        if gather is not None:
            gather({**self.params._arrays, **self.state._arrays})
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


def _check_fits(v: Value, array: np.ndarray, limits: np.iinfo) -> None:
    """Integers cast to ``v``'s narrower type must keep their values (NumPy wraps them
    around: a label 2**32 + 3 would become 3)."""
    low, high = array.min(), array.max()
    if low < limits.min or high > limits.max:
        raise ExecutionError(f"input {v.name}: values from {low} to {high} do not fit "
                             f"{v.type} ({limits.min} to {limits.max})")


def _warn_if_placement_dropped(source: Any) -> None:
    """A model that puts its layers on devices itself, compiled with devices or a
    strategy: the strategy lays it out anew and the model's placement is not used."""
    from purinec.passes.lower import lower

    graph = source if isinstance(source, Graph) else lower(source, mode="inference")
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


def updated_variables(graph: Graph) -> list[str]:
    """The params and state whose next value ``graph`` returns (an output of the name):
    none for an inference graph, all of them for a training iteration."""
    names = {v.name for v in graph.inputs_with_role("param", "state")}
    return [name for name, _ in graph.outputs if name in names]


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
    get_target(target)
    if train is not None and not isinstance(train, SGD):
        raise PurinecError(f"train={train!r}: give purinec.SGD(lr=..., momentum=..., "
                           f"weight_decay=...) to compile the training iteration, or None")
    if devices is not None:
        devices = as_devices(devices)
        _check_device_kinds(target, devices, "the devices asked for")
    spread = parallel_plan(devices, parallel, micro_batches)
    source = load_source(model, batch, **model_kwargs)
    if train is not None and isinstance(source, Graph) and updated_variables(source):
        raise ModelError(f"graph {source.name} is a training iteration already (it returns "
                         f"the next {', '.join(updated_variables(source)[:3])}, ...), with "
                         f"its solver in its IR: compile it without train= (--train; "
                         f"purinec train trains it as it is)")
    graph = build_graph(source, train, after, target, spread)
    _check_batch_taken(graph, batch, model)
    if spread is not None:
        _warn_if_placement_dropped(source)
    eval_graph = (build_graph(source, None, target=target,
                              parallel=spread and _pinned_to(graph, spread))
                  if train is not None else None)
    program = Program(graph, eval_graph, target, seed, trace=trace, after=after)
    if spread is not None:
        warn_if_idle(spread, program.ir)
    return program


def warn_if_idle(spread: Parallel, graph: Graph) -> None:
    """Say so when the layout of ``graph`` leaves some of the devices asked for without
    work (a pipeline cuts stages between layers by their work, so an uneven model may
    leave devices over): they would sit idle, and under mpiexec a rank holding only idle
    devices merely waits for the others."""
    used = set(layout_devices(graph))
    idle = [d for d in spread.devices if d not in used]
    if idle:
        warnings.warn(PurinecWarning(
            f"{spread.strategy} parallelism puts {graph.name} on {len(used)} of the "
            f"{len(spread.devices)} devices given; {', '.join(map(str, idle))} "
            f"{'gets' if len(idle) == 1 else 'get'} no work"
            + (": its layers' work cuts into fewer stages of about equal work (a layer "
               "is never split)" if spread.strategy == "pipeline" else "")), stacklevel=3)


def _pinned_to(graph: Graph, spread: Parallel) -> Parallel:
    """``spread`` for the inference graph of a program whose training graph is
    ``graph``: a pipeline keeps every parameter on the stage that trains it."""
    if spread.strategy != "pipeline":
        return spread
    return replace(spread, pinned=tuple(
        (v.name, v.device) for v in graph.inputs_with_role("param")))


def parallel_plan(devices: Any, strategy: str | None,
                  micro_batches: int | None = None) -> Parallel | None:
    """A `Parallel` from compile()'s arguments, or None for one device."""
    if micro_batches is not None:  # (also where no Parallel is made to check them)
        check_micro_batches(micro_batches, strategy or (None if devices is None else "data"))
    if devices is None and strategy is None:
        return None
    if devices is None:
        from purinec.runtime import comm

        size = comm.world().size
        if size == 1:
            raise PurinecError(f"parallel {strategy} needs several devices: give devices "
                               f"(--devices), e.g. cpu:0,cpu:1, or start the job with "
                               f"mpiexec")
        devices = [Device("cpu", 0, r) for r in range(size)]
    spread = Parallel(as_devices(devices), strategy or "data", micro_batches)
    if len(spread.devices) > 1:
        return spread
    if spread.devices[0].rank != 0:
        raise PurinecError(f"one device ({spread.devices[0]}) makes the one-device program, "
                           f"which every process runs on its own: name devices of every "
                           f"rank (r0/cpu:0,r1/cpu:0, ...) to spread it over the ranks")
    if strategy is not None:
        warnings.warn(PurinecWarning(
            f"{strategy} parallelism over one device ({spread.devices[0]}) is the plain "
            f"one-device program"), stacklevel=3)
    return None


def as_devices(devices: Any) -> tuple[Device, ...]:
    """compile()'s ``devices``: "cpu:0,cpu:1", a count, or a sequence of Device objects
    or their names."""
    if isinstance(devices, str) or (isinstance(devices, int) and not isinstance(devices,
                                                                                bool)):
        return parse_devices(str(devices))
    if isinstance(devices, (list, tuple)) and devices:
        if all(isinstance(d, Device) for d in devices):
            return tuple(devices)
        if all(isinstance(d, str) for d in devices):
            return parse_devices(",".join(devices))
    raise PurinecError(f"devices={devices!r}: give a count, a string such as "
                       f"\"cpu:0,cpu:1\", or a list of Device objects or device names")


def load(path: str | os.PathLike, target: str | None = None, trace: Any = None) -> Program:
    """Load a ``.purine`` artifact written by `Program.save` (see purinec.artifact);
    ``target`` overrides the one it was compiled for."""
    from purinec.artifact import load as load_artifact

    return load_artifact(path, target, trace)
