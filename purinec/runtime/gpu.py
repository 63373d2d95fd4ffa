"""GPUs as the counting runtime drives them (the cuda target's runtime half).

As in Purine, each GPU device gets a compute stream and two copy streams (inbound,
outbound). The host keeps counting dependencies as for any target, but a task on a
stream is *launched*, not finished, when its call returns: the work is queued on its
stream, and the stream runs it in order. So `order_streams` gives every task of a plan
what it must wait for, from the plan's own dependencies (data and memory hazards
alike):

* a task on a stream waits on the GPU, by a CUDA event, for each predecessor on
  another stream (the predecessor records its event after its launch); predecessors
  on its own stream come first anyway;
* a task on the host (a CPU kernel, a collective, a copy to host memory) first waits
  for its predecessors on streams to finish, on their events.

Copies to and from host memory finish before their call returns, so everything a call
returns is complete when the call does, and host memory is never read or written by a
copy the host has stopped counting. Calls follow one another on the GPUs (`CallOrder`):
each call's streams wait, on the GPU, for everything the previous call queued. A
kernel that fails on the GPU (an illegal address) is found out at the next wait, by
whichever task waits: the error says so, and with ``PURINEC_CUDA_SYNC=1`` every launch
is waited for, which names the node that failed (slower: for finding faults only).
Graph inputs and outputs live on the host (`with_host_io`): each input a GPU reads is
copied in by a task of its own, so copies of one layer's weights overlap the compute
of the layers before it.

Logical devices map onto physical GPUs by `gpu_map`: ``gpu:N`` is GPU ``N`` modulo
the GPUs visible (under mpiexec, the ranks of one machine take the GPUs in turn: the
second rank's gpu:0 is GPU 1), unless ``PURINEC_GPU_MAP`` lists each logical device's
GPU (``0,0,1,1``: gpu:0 and gpu:1 on GPU 0, gpu:2 and gpu:3 on GPU 1; the same list in
every process). Several logical
devices on one GPU share it, each with its own streams: multi-device programs run on a
single-GPU machine.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import nullcontext, suppress
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from purinec.errors import ExecutionError, PurinecError
from purinec.ir.graph import Graph, Node, Value
from purinec.ir.ops import Trait, op_has
from purinec.ir.types import Device
from purinec.runtime.devices import Lane
from purinec.runtime.memory import ALIGNMENT
from purinec.runtime.plan import Plan, Task, aligned_start

log = logging.getLogger(__name__)

GPU = "gpu"
MAP_VAR = "PURINEC_GPU_MAP"
SYNC_VAR = "PURINEC_CUDA_SYNC"


def synchronize(waitable) -> None:
    """Wait for a stream or an event; a failure of work queued before it says where
    to look."""
    try:
        waitable.synchronize()
    except Exception as err:
        if os.environ.get(SYNC_VAR) == "1":
            raise
        raise ExecutionError(f"{type(err).__name__}: {err} (found while waiting for GPU "
                             f"work queued earlier, which may belong to another node; "
                             f"with {SYNC_VAR}=1 each kernel is waited for as it is "
                             f"launched, which names the node that failed)") from err


def is_gpu(device: Device) -> bool:
    return device.kind == GPU


def host_of(device: Device) -> Device:
    """The host memory of ``device``'s process: cpu:0 of its rank."""
    return Device("cpu", 0, device.rank)


def local_rank() -> int:
    """This process's rank among the job's processes on this machine (0 outside a job),
    as MPICH's and Open MPI's launchers say it."""
    for variable in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        value = os.environ.get(variable, "")
        if value.isdigit():
            return int(value)
    return 0


def gpu_map(visible: int, per_process: int = 1) -> Callable[[Device], int]:
    """Logical gpu device -> physical GPU index; see the module doc. Processes of one
    job on one machine (``per_process`` gpu devices each) take GPUs in turn."""
    text = os.environ.get(MAP_VAR, "").strip()
    if not text:
        first = local_rank() * per_process
        return lambda device: (first + device.index) % visible
    try:
        table = [int(part) for part in text.split(",")]
    except ValueError:
        raise PurinecError(f"{MAP_VAR}={text!r}: give a comma-separated list of GPU "
                           f"indices, one per logical gpu device (0,0 puts gpu:0 and "
                           f"gpu:1 on GPU 0)") from None
    bad = [i for i in table if not 0 <= i < visible]
    if bad:
        raise PurinecError(f"{MAP_VAR}={text!r} names GPU {bad[0]}, but this machine "
                           f"shows {visible} GPU(s) (0..{visible - 1})")

    def physical(device: Device) -> int:
        if device.index >= len(table):
            raise PurinecError(f"{MAP_VAR}={text!r} maps {len(table)} logical gpu "
                               f"devices, not {device}; add its GPU to the list")
        return table[device.index]
    return physical


def with_host_io(graph: Graph, resident: frozenset[str] = frozenset()
                 ) -> tuple[Graph, list[Node]]:
    """A copy of ``graph`` whose inputs and outputs live on the host: each graph input
    placed on a GPU becomes a host input of the same name copied to the GPU by a
    ``copy`` node (the graph reads the copy), and each output on a GPU is copied back.
    Names and roles of inputs and outputs are kept: callers see no difference. The
    variables named in ``resident`` stay on their GPU, inputs and outputs alike (the
    executable keeps them there between calls: `GpuExecutable`). Also returns the new
    graph's copies of ``graph``'s nodes, in order."""
    new = graph.clone()
    copied = list(new.nodes)
    inputs, copies_in = [], []
    for value in new.inputs:
        if not is_gpu(value.device) or value.name in resident:
            inputs.append(value)
            continue
        host = Value(value.name, value.type, host_of(value.device), value.dist, None,
                     value.role, value.init)
        value.name = new.fresh_name(f"{value.name}.gpu")
        value.role = value.init = None
        new.rebuild_names()
        copy = Node("copy", [host], [value], {}, None)
        value.producer = copy
        inputs.append(host)
        copies_in.append(copy)
    new.inputs = inputs
    new.nodes = copies_in + new.nodes
    new.rebuild_names()
    outputs = []
    for name, value in new.outputs:
        if is_gpu(value.device) and name not in resident:
            (value,) = new.add_node("copy", [value], names=[new.fresh_name(f"{name}.host")],
                                    device=host_of(value.device)).outputs
        outputs.append((name, value))
    new.outputs = outputs
    return new, copied


@dataclass
class Streams:
    """One logical GPU device: its physical GPU and its streams."""

    gpu: int
    compute: Any
    copy_in: Any
    copy_out: Any

    def each(self) -> tuple:
        return self.compute, self.copy_in, self.copy_out


class Gpus:
    """The logical GPU devices of a graph, each with its physical GPU and streams."""

    def __init__(self, graph: Graph):
        from numba import cuda

        self.cuda = cuda
        self.simulated = _simulated()
        self.launching = _SIMULATED_LAUNCHES if self.simulated else None
        visible = len(cuda.gpus)
        if visible == 0:
            raise PurinecError("no CUDA GPU is visible to this process")
        devices = [d for d in graph.devices() if is_gpu(d)]
        physical = gpu_map(visible, len(devices))
        self.devices: dict[Device, Streams] = {}
        for device in devices:
            gpu = physical(device)
            with cuda.gpus[gpu]:
                self.devices[device] = Streams(gpu, cuda.stream(), cuda.stream(),
                                               cuda.stream())
        if not self.simulated:
            _enable_peer_access(sorted({streams.gpu for streams in self.devices.values()}))

    def allocate(self, device: Device, shape: tuple, dtype, what: str):
        """A device array on ``device``'s GPU, or an error saying what did not fit."""
        gpu = self.devices[device].gpu
        try:
            with self.cuda.gpus[gpu]:
                return self.cuda.device_array(shape, dtype)
        except Exception as err:
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            raise ExecutionError(f"allocating {what} for {device} ({nbytes:,} bytes) on "
                                 f"GPU {gpu} failed: {type(err).__name__}: {err}") from err

    def event(self, gpu: int | None = None):
        """An event for ordering only (no timing, which costs on every record), made on
        physical GPU ``gpu`` (default: the current one): an event is recorded only on
        streams of the GPU it was made on."""
        if self.simulated:
            return self.cuda.event()
        with self.cuda.gpus[gpu] if gpu is not None else nullcontext():
            return self.cuda.event(timing=False)

    def gpu_of(self, stream) -> int:
        """The physical GPU ``stream`` belongs to."""
        for streams in self.devices.values():
            if stream in streams.each():
                return streams.gpu
        raise PurinecError(f"stream {stream} belongs to none of the program's GPUs")

    def streams(self) -> list:
        """Every stream of the program's devices, the first device's compute first."""
        return [stream for streams in self.devices.values() for stream in streams.each()]

    def select(self, device: Device) -> None:
        """Make ``device``'s GPU current on the calling thread."""
        self.cuda.select_device(self.devices[device].gpu)


# Numba's simulator runs a launch's threads against state of the whole process (the
# kernel being launched, its grid): two host threads launching at once (two devices'
# workers, or two programs') would mix them up.
_SIMULATED_LAUNCHES = threading.Lock()


def _simulated() -> bool:
    from numba import config

    return bool(config.ENABLE_CUDASIM)


def _enable_peer_access(gpus: list[int]) -> None:
    """Let each of these GPUs read the others' memory where the hardware can, so that a
    copy between two goes straight over NVLink or PCIe instead of through host memory.
    Where it cannot, or enabling fails, copies still work (through the driver): said
    in the log, not raised."""
    from numba import cuda

    for here in gpus:
        for there in gpus:
            if here == there:
                continue
            try:
                with cuda.gpus[there]:
                    peer = cuda.current_context()
                with cuda.gpus[here]:
                    context = cuda.current_context()
                    if context.can_access_peer(there):
                        context.enable_peer_access(peer.handle)
                        log.info("GPU %d reads GPU %d's memory directly", here, there)
            except Exception as err:  # (enabled already, say: copies work either way)
                log.info("peer access from GPU %d to GPU %d not enabled: %s", here, there,
                         err)


class PinnedArenas:
    """Host arenas in page-locked memory, which copies to and from a GPU read and write
    directly (pageable memory goes through a driver buffer, at a fraction of the
    speed)."""

    def __init__(self, gpus: Gpus):
        self.gpus = gpus

    def allocate(self, sizes: Mapping) -> dict:
        return {device: aligned_start(self.gpus.cuda.pinned_array(n + ALIGNMENT, np.uint8), n)
                for device, n in sizes.items()}

    def release(self) -> None:
        pass


class GpuArenas:
    """The memory planner's arenas: one device allocation per GPU device; the host's
    from ``host``: pinned memory, or the allocator the host kernels need (shared memory
    for collectives between the ranks of a machine: `purinec.runtime.plan.arena_source`)."""

    holds_kernel_allocators = True  # (``host`` is theirs: see `arena_source`)

    def __init__(self, gpus: Gpus, host=None):
        self.gpus, self.host = gpus, host or PinnedArenas(gpus)

    def allocate(self, sizes: Mapping) -> dict:
        arenas = self.host.allocate({d: n for d, n in sizes.items() if not is_gpu(d)})
        for device, nbytes in sizes.items():
            if is_gpu(device):
                arenas[device] = self.gpus.allocate(device, (max(nbytes, 1),), np.uint8,
                                                    "its working memory (the arena)")
        return arenas

    def release(self) -> None:
        self.host.release()

    @staticmethod
    def device_memory(device: Device) -> bool:
        """Whether ``device``'s values are in GPU memory (the executable binds them)."""
        return is_gpu(device)

    def empty(self, value: Value):
        """A new array for ``value`` (one computed into fresh memory each call)."""
        if not is_gpu(value.device):
            return np.empty(value.type.shape, value.type.dtype.numpy)
        return self.gpus.allocate(value.device, value.type.shape, value.type.dtype.numpy,
                                  f"%{value.name}")


# -- kernels that move data ---------------------------------------------------------


def is_transfer(node: Node) -> bool:
    """A copy with a GPU at one end or both."""
    return node.op == "copy" and (is_gpu(node.inputs[0].device) or is_gpu(node.device))


class Transfer:
    """A copy to, from or between GPU devices, on the copy stream of the GPU that
    receives (or, to the host, sends) it. A copy to or from host memory finishes before
    its call returns: the host's memory is the host's again at once (a copy from pinned
    memory, the host arenas', would otherwise still be reading it while the next call's
    host kernels, or the caller, write it)."""

    def __init__(self, node: Node, gpus: Gpus):
        source, destination = node.inputs[0].device, node.device
        self.to_host = not is_gpu(destination)
        self.from_host = not is_gpu(source)
        streams = gpus.devices[source if self.to_host else destination]
        self.stream = streams.copy_out if self.to_host else streams.copy_in
        # for a copy to or from the host; not while captured (`CapturedStep`)
        self.waits = self.to_host or self.from_host

    def launch(self, stream, source, destination) -> None:
        if self.to_host:
            source.copy_to_host(destination, stream=stream)
        else:
            destination.copy_to_device(source, stream=stream)
        if self.waits:
            synchronize(stream)

    def __call__(self, source, destination) -> None:
        self.launch(self.stream, source, destination)


class Staged:
    """A host kernel (a collective, a slice) run on GPU values through host memory: the
    GPU inputs are copied to pinned host buffers, the host kernel runs (a pending MPI
    operation included), and the results are copied back to their GPUs. Finished when
    its call (or its pending operation) is."""

    def __init__(self, node: Node, host_fn: Callable, gpus: Gpus):
        self.host_fn = host_fn
        self.asynchronous = getattr(host_fn, "asynchronous", False)
        operands = [*node.inputs, *node.outputs]
        self.staging = [gpus.cuda.pinned_array(v.type.shape, v.type.dtype.numpy)
                        if is_gpu(v.device) else None for v in operands]
        self.streams = [gpus.devices[v.device] if is_gpu(v.device) else None
                        for v in operands]
        self.inputs = len(node.inputs)

    def __call__(self, *arrays):
        host = list(arrays)
        for k in range(self.inputs):
            if self.staging[k] is not None:
                arrays[k].copy_to_host(self.staging[k], stream=self.streams[k].copy_out)
                synchronize(self.streams[k].copy_out)
                host[k] = self.staging[k]
        for k in range(self.inputs, len(arrays)):
            if self.staging[k] is not None:
                host[k] = self.staging[k]
        pending = self.host_fn(*host)
        if pending is None:
            self._copy_back(arrays)
            return None
        return _StagedPending(pending, lambda: self._copy_back(arrays))

    def _copy_back(self, arrays) -> None:
        for k in range(self.inputs, len(arrays)):
            if self.staging[k] is not None:
                stream = self.streams[k].copy_in
                arrays[k].copy_to_device(self.staging[k], stream=stream)
                synchronize(stream)


class _StagedPending:
    """A staged kernel's pending host operation; its results go back to the GPU once
    it completes."""

    def __init__(self, pending, copy_back: Callable[[], None]):
        self.pending, self.copy_back = pending, copy_back
        self.nudge = getattr(pending, "nudge", None)
        if hasattr(pending, "help"):  # (shared memory: an idle rank does the work)
            self.help = lambda: self._done(pending.help())

    def test(self) -> bool:
        return self._done(self.pending.test())

    def _done(self, complete: bool) -> bool:
        if complete:
            self.copy_back()
        return complete

    def wait(self) -> None:
        self.pending.wait()
        self.copy_back()


# -- ordering streams by events -----------------------------------------------------


def order_streams(plan: Plan, gpus: Gpus) -> None:
    """Give each task of ``plan`` its stream and its waits (see the module doc): a
    task whose kernel has a ``launch(stream, *arrays)`` and a ``stream`` (or runs on a
    GPU device: its compute stream) is launched there; any other runs on the host."""
    streams = [_stream_of(task, gpus) for task in plan.tasks]
    predecessors: list[list[int]] = [[] for _ in plan.tasks]
    for task in plan.tasks:
        for successor in task.successors:
            predecessors[successor].append(task.index)
    events = {}
    for task in plan.tasks:
        stream = streams[task.index]
        if stream is not None and any(streams[s] is not stream for s in task.successors):
            events[task.index] = gpus.event(gpus.gpu_of(stream))
    for task in plan.tasks:
        stream = streams[task.index]
        waits = [events[p] for p in predecessors[task.index]
                 if streams[p] is not None and streams[p] is not stream]
        task.fn = (_on_stream(task, stream, waits, events.get(task.index),
                              gpus.launching or nullcontext(),
                              os.environ.get(SYNC_VAR) == "1")
                   if stream is not None else _on_host(task.fn, waits))


def _stream_of(task: Task, gpus: Gpus):
    fn = task.fn
    if getattr(fn, "launch", None) is None:
        return None
    stream = getattr(fn, "stream", None)
    return stream if stream is not None else gpus.devices[task.node.device].compute


def _on_stream(task: Task, stream, waits: list, record, launching,
               wait_each: bool) -> Callable:
    launch = task.fn.launch
    # Arrays bound once for all calls go over in the shape the kernels read them in
    # (an array bound per call is reshaped by the kernel's host function).
    for position, shape in getattr(task.fn, "views", {}).items():
        if task.args[position] is not None:
            task.args[position] = task.args[position].reshape(shape)

    def run(*arrays):
        for event in waits:
            event.wait(stream)
        with launching:
            launch(stream, *arrays)
        if record is not None:
            record.record(stream)
        if wait_each:
            stream.synchronize()
    run.stream, run.kernel = stream, task.fn
    return run


def _on_host(fn: Callable, waits: list) -> Callable:
    if not waits:
        return fn

    def run(*arrays):
        for event in waits:
            synchronize(event)
        return fn(*arrays)
    run.asynchronous = getattr(fn, "asynchronous", False)
    return run


def gpu_kernels(graph: Graph, gpus: Gpus, host_fns: Mapping[Node, Callable]) -> dict:
    """Kernels of ``graph``'s host nodes that touch GPU values: transfers, and the other
    host kernels (``host_fns``) staged through host memory."""
    kernels = {}
    for node in graph.nodes:
        if not op_has(node.op, Trait.host):
            continue
        if is_transfer(node):
            kernels[node] = Transfer(node, gpus)
        elif any(is_gpu(v.device) for v in (*node.inputs, *node.outputs)):
            kernels[node] = Staged(node, host_fns[node], gpus)
    return kernels


def worker_setup(gpus: Gpus) -> Callable[[Lane], None]:
    """Each worker makes its device's GPU current (the host's lanes keep the first)."""
    def setup(lane: Lane) -> None:
        device = lane.queue.device
        if device in gpus.devices:
            gpus.select(device)
        elif gpus.devices:
            gpus.select(next(iter(gpus.devices)))
    return setup


# -- an iteration as one CUDA graph ------------------------------------------------

GRAPHS_VAR = "PURINEC_CUDA_GRAPHS"
GRAPH_MODES = ("0", "1", "auto")
TRIAL_CALLS = 3  # calls timed each way before ``auto`` chooses


def graphs_mode() -> str:
    """``PURINEC_CUDA_GRAPHS``: ``0`` (the default) launches task by task, ``1`` replays
    one CUDA graph per call, ``auto`` times both and keeps the faster (`GraphChoice`)."""
    value = os.environ.get(GRAPHS_VAR, "0").strip() or "0"
    if value not in GRAPH_MODES:
        raise PurinecError(f"{GRAPHS_VAR}={value!r}: 1 captures a cuda program's "
                           f"iteration as a CUDA graph and replays it, auto does where "
                           f"that measures faster, 0 (the default) does not")
    return value


class GraphChoice:
    """How a `GpuExecutable`'s calls run: task by task, or replaying one CUDA graph
    (`CapturedStep`), captured at the second call, once the first has compiled every
    kernel. With ``PURINEC_CUDA_GRAPHS=1`` every later call replays it. With ``auto``,
    TRIAL_CALLS calls are first timed launching task by task and as many replaying the
    graph, and the faster way runs from then on: a graph saves a launch per task, which
    bounds small networks on a big GPU, but replays copy the inputs and outputs through
    staging buffers. A capture that fails in ``auto`` is logged and that call runs
    task by task; with ``1`` it raises. ``status`` says which way calls run, and why."""

    clock = staticmethod(time.perf_counter)

    def __init__(self, name: str, gpus: Gpus):
        self.name, self.gpus, self.mode = name, gpus, graphs_mode()
        self.status = "launching task by task"
        # "launching", "timing launches", "capturing", "timing replays" or "replaying"
        self.phase = "launching"
        self.captured: CapturedStep | None = None
        self.calls = 0
        self.times: dict[str, list[float]] = {"launches": [], "replays": []}

    def run(self, inner, bound: dict) -> dict:
        self.calls += 1
        if self.calls == 2 and self.mode != "0":
            self._begin(inner)
        if self.phase == "launching":
            return inner(bound)
        if self.phase == "timing launches":
            outputs = self._timed("launches", inner, bound)
            if len(self.times["launches"]) == TRIAL_CALLS:
                self.phase = "capturing"
            return outputs
        if self.phase == "capturing":
            return self._capture(inner, bound)
        outputs = (self._timed("replays", inner, bound, self.captured)
                   if self.phase == "timing replays" else inner(bound, self.captured))
        if self.captured.given_up:
            self._settle("launching", f"launching task by task: the CUDA graph was given "
                                      f"up, as {self.captured.given_up}")
        elif len(self.times["replays"]) == TRIAL_CALLS:
            self._choose()
        return outputs

    def _begin(self, inner) -> None:
        from purinec.runtime.executor import Executable

        reason = (CapturedStep.refusal(inner, self.gpus) if isinstance(inner, Executable)
                  else "it spans processes")
        if reason is not None:
            self._settle("launching", f"launching task by task: not one CUDA graph, as "
                                      f"{reason}")
        elif self.mode == "1":
            self.captured = CapturedStep(inner, self.gpus)
            self._settle("replaying", "replaying one CUDA graph per call")
        else:
            self.phase = "timing launches"
            self.status = "timing launches task by task against a CUDA graph's replays"

    def _capture(self, inner, bound: dict) -> dict:
        self.captured = CapturedStep(inner, self.gpus)
        try:
            outputs = inner(bound, self.captured)
        except Exception as err:  # (whatever the driver said: the launches still work)
            self._settle("launching", f"launching task by task: capturing a CUDA graph "
                                      f"failed ({type(err).__name__}: {err})")
            return inner(bound)
        self.phase = "timing replays"
        return outputs

    def _timed(self, way: str, inner, *args) -> dict:
        start = self.clock()
        outputs = inner(*args)
        self.times[way].append(self.clock() - start)
        return outputs

    def _choose(self) -> None:
        launches, replays = (1e3 * float(np.median(self.times[way]))
                             for way in ("launches", "replays"))
        if replays < launches:
            self._settle("replaying", f"replaying one CUDA graph per call ({replays:.3g} "
                                      f"ms a call against {launches:.3g} launching)")
        else:
            self._settle("launching", f"launching task by task ({launches:.3g} ms a call "
                                      f"against {replays:.3g} replaying a CUDA graph)")

    def _settle(self, phase: str, status: str) -> None:
        self.phase, self.status = phase, status
        if phase == "launching":
            self.captured = None
        log.info("graph %s: %s", self.name, status)


class CapturedStep:
    """A plan's iteration captured once as a CUDA graph and replayed at every later
    call: one launch instead of one per task, which bounds small networks on a big GPU.
    It is the runner the executable is called with (`Executable.__call__`), given the
    plan bound to the call's arrays.

    Possible when every task is queued on streams of one GPU (no host kernel, no
    collective; `refusal` says why not). A graph holds fixed addresses, so the graph's
    inputs are copied from pinned staging buffers, which each call fills from the
    caller's arrays first; its outputs are copied into pinned staging buffers, which
    each call copies into the plan's arrays after the graph is done; and every other
    array a task uses must be the one it was captured with (arena memory, variables kept
    on the GPU). A call that binds another one (fresh memory) runs its tasks the usual
    way instead, and the graph is given up (``given_up`` says why).

    Captured by making each task's launches in the plan's serial order on the calling
    thread while the first device's compute stream captures, with every other stream
    forked from it by an event and joined back at the end: the tasks' own events between
    streams become the graph's edges. In Numba's CUDA simulator, which has no graphs,
    capturing records each task's call and a replay makes the calls again, in order,
    with the same arguments: what a graph does, so the staging is tested there.
    """

    def __init__(self, executable, gpus: Gpus):
        self.executable, self.gpus = executable, gpus
        self.tasks = executable.plan.tasks
        self.streams = gpus.streams()
        self.graph = None
        self.given_up: str | None = None
        self.staged_in: list[tuple[int, np.ndarray]] = []   # (task, pinned source)
        self.staged_out: list[tuple[int, np.ndarray]] = []  # (task, pinned destination)
        self.captured_args: list[list] = []

    @staticmethod
    def refusal(executable, gpus: Gpus) -> str | None:
        """Why ``executable``'s iteration cannot be one graph, or None."""
        if executable.trace is not None:
            return "a trace times each task"
        if os.environ.get(SYNC_VAR) == "1":
            return f"{SYNC_VAR}=1 waits for each launch"
        if len({streams.gpu for streams in gpus.devices.values()}) > 1:
            return "its devices are on several GPUs"
        for task in executable.plan.tasks:
            if getattr(task.fn, "stream", None) is None:
                return f"{task.describe()} runs on the host"
        return None

    def __call__(self, plan: Plan) -> None:
        if self.graph is None:
            self._capture()
        elif not self._same_arrays():
            self.given_up = ("a task was given other memory than it was captured with "
                             "(a value in fresh memory each call)")
            self.executable.executor.run(self.executable.trace, self.executable.order)
            return
        for index, pinned in self.staged_in:
            np.copyto(pinned, self.tasks[index].args[0])
        self.graph.launch(self.streams[0])
        synchronize(self.streams[0])
        for index, pinned in self.staged_out:
            np.copyto(self.tasks[index].args[1], pinned)

    def _capture(self) -> None:
        calls, waiting = [], []
        for task in self.tasks:
            args, transfer = list(task.args), task.fn.kernel
            if isinstance(transfer, Transfer) and transfer.from_host:
                args[0] = self.gpus.cuda.pinned_array(args[0].shape, args[0].dtype)
                self.staged_in.append((task.index, args[0]))
            elif isinstance(transfer, Transfer) and transfer.to_host:
                args[1] = self.gpus.cuda.pinned_array(args[1].shape, args[1].dtype)
                self.staged_out.append((task.index, args[1]))
            if isinstance(transfer, Transfer) and transfer.waits:
                waiting.append(transfer)
            calls.append((task, args))
        self.captured_args = [list(task.args) for task in self.tasks]
        self.gpus.select(next(iter(self.gpus.devices)))
        graph = (_SimulatedGraph if self.gpus.simulated else _DriverGraph)(
            self.streams, self.gpus)
        for transfer in waiting:  # (no waiting while capturing: it would end the capture)
            transfer.waits = False
        try:
            graph.capture(calls)
        finally:
            for transfer in waiting:
                transfer.waits = True
        self.graph = graph

    def _same_arrays(self) -> bool:
        staged = {(index, 0) for index, _ in self.staged_in} | {
            (index, 1) for index, _ in self.staged_out}
        return all(now is then or (task.index, k) in staged
                   for task, captured in zip(self.tasks, self.captured_args)
                   for k, (now, then) in enumerate(zip(task.args, captured)))


def _call(task: Task, args: list) -> None:
    try:
        task.fn(*args)
    except Exception as err:
        raise ExecutionError(f"{task.describe()} failed in a CUDA graph's capture or "
                             f"replay: {type(err).__name__}: {err}") from err


class _DriverGraph:
    """A CUDA graph captured from streams through the driver (cuda-bindings)."""

    def __init__(self, streams: list, gpus: Gpus):
        self.streams, self.exec = streams, None
        self.fork = gpus.event()
        self.joins = [gpus.event() for _ in streams[1:]]

    def capture(self, calls: list) -> None:
        from cuda.bindings import driver

        origin = _driver_stream(self.streams[0])
        _check(driver.cuStreamBeginCapture(
            origin, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED), "begin")
        try:
            self.fork.record(self.streams[0])
            for stream in self.streams[1:]:
                self.fork.wait(stream)
            for task, args in calls:
                _call(task, args)
            for stream, join in zip(self.streams[1:], self.joins):
                join.record(stream)
                join.wait(self.streams[0])
        except BaseException:
            driver.cuStreamEndCapture(origin)
            raise
        graph = _check(driver.cuStreamEndCapture(origin), "end")
        try:
            self.exec = _check(driver.cuGraphInstantiate(graph, 0), "instantiate")
        finally:
            driver.cuGraphDestroy(graph)

    def launch(self, stream) -> None:
        from cuda.bindings import driver

        _check(driver.cuGraphLaunch(self.exec, _driver_stream(stream)), "launch")

    def __del__(self):
        if self.exec is not None:
            try:
                from cuda.bindings import driver
                driver.cuGraphExecDestroy(self.exec)
            except Exception:  # (at interpreter exit the driver may be gone)
                pass


class _SimulatedGraph:
    """The simulator's stand-in: the captured calls, made again at each launch."""

    def __init__(self, streams: list, gpus: Gpus):
        self.calls: list = []

    def capture(self, calls: list) -> None:
        self.calls = calls

    def launch(self, stream) -> None:
        for task, args in self.calls:
            _call(task, args)


def _driver_stream(stream):
    from cuda.bindings import driver

    return driver.CUstream(int(stream))


def _check(result, what: str):
    """The value of a cuda-bindings call, or an ExecutionError saying what failed."""
    from cuda.bindings import driver

    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise ExecutionError(f"CUDA graph {what} failed: "
                             f"{name.decode() if isinstance(name, bytes) else name}")
    return values[0] if values else None


# -- variables kept on the GPU between calls ----------------------------------------

_NEVER = object()  # a variable never copied to its GPU, or changed on the host since


class CallOrder:
    """Each call's GPU work after all of the previous call's. A call returns once its
    outputs are on the host, while kernels it launched (the solver's updates, say) may
    still run; the next call's tasks are ordered after their predecessors of the same
    call only, so, unordered, its first copy in could overwrite a batch still being
    read, on another stream. So a call ends by joining every stream into one event
    (`end`), and the next begins by making every stream wait for it (`begin`): the host
    does not wait, and launches the next call while the GPUs finish this one. What the
    host itself copies between calls (a program's weights kept on the GPU, in or out)
    waits for all of it first (`settle`)."""

    def __init__(self, gpus: Gpus):
        self.streams = gpus.streams()
        self.first, self.others = self.streams[0], self.streams[1:]
        self.ends = [gpus.event(gpus.gpu_of(stream)) for stream in self.others]
        self.joined = gpus.event(gpus.gpu_of(self.first))
        self.after_call = False

    def begin(self) -> None:
        if self.after_call:
            for stream in self.others:
                self.joined.wait(stream)

    def end(self, copies: Sequence[tuple[Any, Any]] = ()) -> None:
        """``copies``: (destination, source) device arrays to copy after all of the
        call's work."""
        for stream, event in zip(self.others, self.ends):
            event.record(stream)
            event.wait(self.first)
        for destination, source in copies:
            destination.copy_to_device(source, stream=self.first)
        self.joined.record(self.first)
        self.after_call = True

    def settle(self) -> None:
        """Wait, on the host, for everything the calls so far queued. (Copies outside
        the streams, of one GPU's memory while another GPU is current, are ordered
        after nothing on the streams.)"""
        if self.after_call:
            synchronize(self.joined)


class GpuExecutable:
    """A cuda program's executable, ``exe(env) -> outputs``, built at its first call.

    By default every call copies the graph's inputs to the GPUs and its outputs back.
    A caller that keeps the program's variables (params, state) calls `keep_variables`
    first: the variables on GPUs then stay there between calls, each copied in only
    when the host's array is new to it or reported changed (`host_changed`); their next
    values stay on the GPU too (the call's outputs leave them out) until `pull` copies
    them into host arrays. A training step then moves only its batch and its loss.
    """

    def __init__(self, graph: Graph, build: Callable[[frozenset[str]], Any], gpus: Gpus):
        self.graph, self._build, self.gpus = graph, build, gpus
        self._inner = None
        self._graphs = GraphChoice(graph.name, gpus)
        self._order = CallOrder(gpus)
        self.resident: frozenset[str] = frozenset()
        self._mirrors: dict[str, Any] = {}
        self._loaded: dict[str, Any] = {}  # name -> host array the GPU holds, None: newer
        self._refreshes: list = []

    def keep_variables(self) -> frozenset[str]:
        """Keep the variables that live on GPUs there between calls; returns their names.
        Only before the first call."""
        if self._inner is None:
            updated = {name for name, _ in self.graph.outputs}
            self.resident = frozenset(v.name for v in self.graph.inputs
                                      if v.role in ("param", "state") and is_gpu(v.device)
                                      and (v.name in updated or v.role == "param"))
        return self.resident

    @property
    def plan(self):
        return getattr(self._built(), "plan", None)

    def _built(self):
        if self._inner is None:
            self._inner = self._build(self.resident)
            for value in self.graph.inputs:
                if value.name in self.resident:
                    self._mirrors[value.name] = self.gpus.allocate(
                        value.device, value.type.shape, value.type.dtype.numpy,
                        f"{value.role} {value.name}")
        return self._inner

    def __call__(self, env: Mapping[str, np.ndarray]) -> dict:
        inner = self._built()
        bound = dict(env)
        stale = [name for name in self._mirrors if self._stale(name, env[name])]
        if stale:  # (the last call's kernels may still read or update these)
            self._order.settle()
        for name in stale:
            self._mirrors[name].copy_to_device(np.ascontiguousarray(env[name]))
            self._loaded[name] = env[name]
        bound.update(self._mirrors)
        self._order.begin()
        try:
            outputs = self._graphs.run(inner, bound)
        except BaseException:  # its kernels launched before the failure may still run
            with suppress(Exception):  # (the failure is the error to see)
                self._order.end()
            raise
        refreshes = []
        for name, mirror in self._mirrors.items():
            if name in outputs:
                value = outputs.pop(name)
                if value is not mirror:  # an update not made in place: copied in after
                    refreshes.append((mirror, value))
                self._loaded[name] = None
        self._order.end(copies=refreshes)
        # Their arrays live until the next call has returned: its outputs come after them.
        self._refreshes = refreshes
        return outputs

    def _stale(self, name: str, host: np.ndarray) -> bool:
        """Whether the GPU's copy of variable ``name`` is not ``host``'s."""
        loaded = self._loaded.get(name, _NEVER)
        return loaded is _NEVER or (loaded is not None and loaded is not host)

    @property
    def graph_status(self) -> str:
        """Whether calls launch task by task or replay a CUDA graph, and why."""
        return self._graphs.status

    def pull(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Copy the GPU's values of these variables into the host ``arrays``."""
        self._order.settle()
        for name, host in arrays.items():
            self._mirrors[name].copy_to_host(host)
            self._loaded[name] = host

    def host_changed(self, names) -> None:
        """The host arrays of these variables changed: copy them in at the next call."""
        for name in names:
            self._loaded.pop(name, None)

    def close(self) -> None:
        if self._inner is not None:
            # Its memory goes back once the GPU is done with it. (A GPU that failed has
            # already said so, at the call that found it.)
            with suppress(Exception):
                self._order.settle()
            self._inner.close()
