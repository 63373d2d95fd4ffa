"""The cuda target on a machine without a GPU: placement, host inputs and outputs, the
device map, what it says when it cannot run, its dumps, artifacts, and the PTX of every
kernel of every zoo model. (Its numbers: `test_simulator`.)"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import subprocess
import sys
import threading
import types
import unittest.mock

import numpy as np
import pytest

import purinec
from purinec.errors import ExecutionError, PurinecError
from purinec.ir.parser import parse
from purinec.ir.types import Device
from purinec.models.zoo import ZOO
from purinec.runtime import gpu
from purinec.targets import get_target
from purinec.targets.cuda import on_gpus

pytest.importorskip("numba_cuda", reason="the [cuda] extra (numba-cuda) is not installed")

from purinec.codegen.cuda import blas  # noqa: E402  (after the skip)

MIXED = """graph t(%x: f32[4,3] @cpu:0, %b: f32[3] @gpu:0 {param}) {
  %xg = copy(%x) : f32[4,3] @gpu:0
  %y = bias_add(%xg, %b) {axis=1} : f32[4,3] @gpu:0
  %yc = copy(%y) : f32[4,3] @cpu:0
  %z = relu(%yc) : f32[4,3] @cpu:0
  return %z, %y
}"""
ON_GPU = """graph t(%x: f32[4,3] @gpu:0, %b: f32[3] @gpu:0 {param}) {
  %y = bias_add(%x, %b) {axis=1} : f32[4,3] @gpu:0
  return %y
}"""
ON_CPU = """graph t(%x: f32[4,3] @cpu:0, %b: f32[3] @cpu:0 {param}) {
  %y = bias_add(%x, %b) {axis=1} : f32[4,3] @cpu:0
  %z = relu(%y) : f32[4,3] @cpu:0
  return %z, %y
}"""


def gpu_here() -> bool:
    from numba import cuda

    return cuda.is_available()


def test_a_graph_on_cpu_devices_only_moves_to_the_gpus_of_the_same_numbers():
    moved = on_gpus(parse(ON_CPU))
    assert moved.devices() == [Device("gpu", 0)]
    mixed = parse(MIXED)
    assert on_gpus(mixed) is mixed


def test_host_io_copies_gpu_inputs_in_and_outputs_out_keeping_names_and_roles():
    graph, copied = gpu.with_host_io(parse(MIXED))
    assert [n.op for n in copied] == [n.op for n in parse(MIXED).nodes]
    b = graph.input("b")
    assert (b.device, b.role) == (Device("cpu", 0), "param")
    copy_in = graph.nodes[0]
    assert copy_in.op == "copy" and copy_in.inputs == [b] and copy_in.device == Device("gpu", 0)
    assert graph.input("x").device == Device("cpu", 0)  # on the host already: no copy
    assert [name for name, _ in graph.outputs] == ["z", "y"]
    y = graph.output("y")
    assert y.device == Device("cpu", 0) and y.producer.op == "copy"
    assert y.producer.inputs[0].device == Device("gpu", 0)
    assert graph.output("z").producer.op == "relu"


def test_the_gpu_map(monkeypatch):
    monkeypatch.delenv(gpu.MAP_VAR, raising=False)
    assert gpu.gpu_map(2)(Device("gpu", 3)) == 1
    monkeypatch.setenv(gpu.MAP_VAR, "0,0,1")
    physical = gpu.gpu_map(2)
    assert [physical(Device("gpu", i)) for i in range(3)] == [0, 0, 1]
    with pytest.raises(PurinecError, match="maps 3 logical gpu devices, not gpu:3"):
        physical(Device("gpu", 3))
    monkeypatch.setenv(gpu.MAP_VAR, "0,2")
    with pytest.raises(PurinecError, match="names GPU 2, but this machine shows 2"):
        gpu.gpu_map(2)
    monkeypatch.setenv(gpu.MAP_VAR, "zero")
    with pytest.raises(PurinecError, match="comma-separated list of GPU indices"):
        gpu.gpu_map(1)


def test_the_switches_of_cuda_graphs_and_products(monkeypatch):
    monkeypatch.delenv(gpu.GRAPHS_VAR, raising=False)
    assert gpu.graphs_mode() == "0"
    for mode in ("1", "auto", "0"):
        monkeypatch.setenv(gpu.GRAPHS_VAR, mode)
        assert gpu.graphs_mode() == mode
    monkeypatch.setenv(gpu.GRAPHS_VAR, "yes")
    with pytest.raises(PurinecError, match="PURINEC_CUDA_GRAPHS='yes': 1 captures"):
        gpu.graphs_mode()
    monkeypatch.delenv(blas.PRODUCTS_VAR, raising=False)
    missing = blas.cublas_missing()
    if not gpu_here():  # cuBLAS cannot load, and says why
        assert missing is not None and "did not load" in missing, missing
        assert blas.products() == "tiled"
    else:
        assert blas.products() == ("tiled" if missing else "cublas")
    monkeypatch.setenv(blas.PRODUCTS_VAR, "cublas")
    assert blas.products() == "cublas"
    monkeypatch.setenv(blas.PRODUCTS_VAR, "fast")
    with pytest.raises(PurinecError, match="choose one of cublas, tiled"):
        blas.products()


def test_without_the_extra_the_target_says_how_to_get_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "numba_cuda" else real(name, *a))
    with pytest.raises(PurinecError, match=r"numba-cuda is not installed.*\[cuda\]"):
        get_target("cuda")


@pytest.mark.skipif("gpu_here()", reason="this machine has a GPU")
def test_without_a_gpu_a_program_compiles_and_saves_but_running_says_why(tmp_path):
    program = purinec.compile(parse(ON_CPU), target="cuda")
    assert program.ir.devices() == [Device("gpu", 0)]
    feeds = {"x": np.ones((4, 3), np.float32)}
    with pytest.raises(PurinecError, match="needs an NVIDIA GPU.*NUMBA_ENABLE_CUDASIM"):
        program.run(feeds)
    saved = program.save(tmp_path / "t.purine")
    loaded = purinec.load(saved.path)
    assert str(loaded.ir) == str(program.ir)
    with pytest.raises(PurinecError, match="needs an NVIDIA GPU"):
        loaded.run(feeds)


def test_dump_shows_cuda_kernels_and_their_ptx(tmp_path):
    path = tmp_path / "t.pir"
    path.write_text(ON_CPU)
    run = [sys.executable, "-m", "purinec", "dump", str(path), "--target", "cuda",
           "--stage", "kernels"]
    source = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    assert "@cuda.jit(cache=True)" in source and "bias_add" in source
    ptx = subprocess.run(run + ["--ptx"], capture_output=True, text=True, check=True).stdout
    assert ".target sm_90" in ptx and ".entry" in ptx
    refused = subprocess.run(run[:-4] + ["--target", "cpu", "--stage", "kernels", "--ptx"],
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "--ptx cuda kernels" in refused.stderr


def zoo_kernels(name: str):
    """The cuda kernels of ``name``'s training step at a small batch (``name``: a zoo
    model, or a torchvision model imported from ONNX)."""
    model = name
    if name in TORCHVISION:
        from tests.onnx.torchvision_models import load

        model = load(name)
    program = purinec.compile(model, target="cuda", train=purinec.SGD(lr=0.01), batch=2)
    return [kernel for graph in program.executed_graphs()
            for kernel in get_target("cuda").generated(graph).values()]


# mobilenet_v2 has what the zoo lacks: clipped activations, batch normalization, grouped
# convolutions.
TORCHVISION = ("mobilenet_v2",)


@pytest.mark.parametrize("products", blas.FORMS)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n != "mlp" else n for n in sorted(ZOO) + list(TORCHVISION)])
def test_every_kernel_of_every_zoo_training_step_compiles_to_ptx_for_sm90(name, products,
                                                                         tmp_path,
                                                                         monkeypatch):
    monkeypatch.setenv("PURINEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(blas.PRODUCTS_VAR, products)
    kernels = {kernel.path: kernel for kernel in zoo_kernels(name)}  # distinct code
    if products == "cublas":  # (the others are the tiled form's kernels)
        kernels = {path: k for path, k in kernels.items() if "blas.gemm(" in k.source}
    assert any(kernel.kernels for kernel in kernels.values())
    for kernel in kernels.values():
        ptx = kernel.ptx()
        # (a product through cuBLAS may need no kernel of its own)
        assert ptx or products == "cublas", kernel.name
        assert all(".target sm_90" in text for text in ptx.values()), kernel.name


@pytest.mark.skipif("gpu_here()", reason="this machine has a GPU")
def test_the_command_line_compiles_for_cuda_without_a_gpu_and_refuses_to_run(tmp_path):
    def purinec_command(*args):
        return subprocess.run([sys.executable, "-m", "purinec", *args], capture_output=True,
                              text=True, cwd=tmp_path)

    artifact = tmp_path / "mlp.purine"
    compiled = purinec_command("compile", "mlp", "--target", "cuda", "--batch", "2",
                               "-o", str(artifact))
    assert compiled.returncode == 0, compiled.stderr
    for refused in (purinec_command("run", str(artifact)),
                    purinec_command("run", "mlp", "--target", "cuda"),
                    purinec_command("train", "mlp", "--target", "cuda", "--data", "digits")):
        assert refused.returncode != 0
        assert "target cuda cannot run programs here" in refused.stderr
        assert "NVIDIA GPU" in refused.stderr and "Traceback" not in refused.stderr
    dumped = purinec_command("dump", str(artifact))
    assert dumped.returncode == 0 and "@gpu:0" in dumped.stdout


def test_a_layout_over_cpu_devices_only_runs_on_the_gpus_of_the_same_numbers():
    for devices in (2, "cpu:0,cpu:1"):
        program = purinec.compile("mlp", target="cuda", batch=4, input_shape=(1, 2, 2),
                                  devices=devices)
        assert program.devices == [Device("gpu", 0), Device("gpu", 1)]
    mixed = purinec.compile("mlp", target="cuda", batch=4, input_shape=(1, 2, 2),
                            devices="cpu:0,gpu:0", parallel="pipeline")
    assert set(mixed.devices) == {Device("cpu", 0), Device("gpu", 0)}


class FakeStream:
    """Records what is asked of it; fails at its wait if told to."""

    def __init__(self, fail: bool = False):
        self.calls, self.fail = [], fail

    def synchronize(self):
        self.calls.append("synchronize")
        if self.fail:
            raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS")


def test_a_failure_found_at_a_wait_says_how_to_find_its_node(monkeypatch):
    monkeypatch.delenv(gpu.SYNC_VAR, raising=False)
    with pytest.raises(PurinecError, match=r"ILLEGAL_ADDRESS \(found while waiting.*"
                                           r"PURINEC_CUDA_SYNC=1"):
        gpu.synchronize(FakeStream(fail=True))
    monkeypatch.setenv(gpu.SYNC_VAR, "1")
    with pytest.raises(RuntimeError, match="ILLEGAL_ADDRESS$"):
        gpu.synchronize(FakeStream(fail=True))


@pytest.mark.parametrize("wait_each", [False, True])
def test_with_cuda_sync_each_launch_is_waited_for(wait_each):
    class Kernel:
        def launch(self, stream, *arrays):
            stream.calls.append(("launch", arrays))

    class Task:
        fn = Kernel()

    stream = FakeStream()
    run = gpu._on_stream(Task(), stream, [], None, gpu.nullcontext(), wait_each)
    run("x", "y")
    assert stream.calls == [("launch", ("x", "y"))] + (["synchronize"] if wait_each else [])


def test_memory_a_gpu_cannot_give_is_an_error_naming_what_and_where():
    class OutOfMemory:
        gpus = {0: gpu.nullcontext()}

        @staticmethod
        def device_array(shape, dtype):
            raise MemoryError("CUDA_ERROR_OUT_OF_MEMORY")

    gpus = object.__new__(gpu.Gpus)
    gpus.cuda = OutOfMemory()
    gpus.devices = {Device("gpu", 1): gpu.Streams(0, None, None, None)}
    with pytest.raises(PurinecError, match=r"allocating param w for gpu:1 \(4,000,000 "
                                           r"bytes\) on GPU 0 failed: MemoryError: "
                                           r"CUDA_ERROR_OUT_OF_MEMORY"):
        gpus.allocate(Device("gpu", 1), (1000, 1000), np.float32, "param w")


def test_a_threads_cublas_handles_are_destroyed_when_it_ends(monkeypatch):
    """Each worker thread makes its own cuBLAS handles; a program's workers end when it
    closes, and their handles must go with them (each holds GPU memory)."""
    from numba import cuda
    from nvmath.bindings import cublas

    destroyed = []
    monkeypatch.setattr(cublas, "destroy", destroyed.append)
    monkeypatch.setattr(cuda, "gpus", [contextlib.nullcontext()] * 2, raising=False)

    def worker():
        blas._local.handles = blas._Handles({0: 11, 1: 12})
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    gc.collect()
    assert sorted(destroyed) == [11, 12]


class _FakeDriver:
    """cuda-bindings' driver calls a capture makes, recorded; each checks its
    arguments' types as the bindings do and answers (CUresult, value) like them."""

    def __init__(self, driver, fail: str | None = None):
        self.driver, self.fail, self.calls = driver, fail, []

    def _answer(self, name, value=None):
        self.calls.append(name)
        ok = self.driver.CUresult.CUDA_SUCCESS
        err = self.driver.CUresult.CUDA_ERROR_INVALID_VALUE if name == self.fail else ok
        return (err, value) if value is not None else (err,)

    def cuStreamBeginCapture(self, stream, mode):
        assert isinstance(stream, self.driver.CUstream) and int(stream) == 7
        assert mode == self.driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        return self._answer("begin")

    def cuStreamEndCapture(self, stream):
        assert int(stream) == 7
        return self._answer("end", "graph")

    def cuGraphInstantiate(self, graph, flags):
        assert graph == "graph" and flags == 0
        return self._answer("instantiate", "exec")

    def cuGraphDestroy(self, graph):
        return self._answer("destroy graph")

    def cuGraphLaunch(self, graph_exec, stream):
        assert graph_exec == "exec" and int(stream) == 7
        return self._answer("launch")

    def cuGraphExecDestroy(self, graph_exec):
        return self._answer("destroy exec")

    def cuGetErrorName(self, err):
        return self.driver.CUresult.CUDA_SUCCESS, err.name.encode()


class _FakeEvent:
    def __init__(self, log):
        self.log = log

    def record(self, stream):
        self.log.append(f"record on {int(stream)}")

    def wait(self, stream):
        self.log.append(f"wait on {int(stream)}")


@pytest.mark.parametrize("fail", [None, "instantiate", "task"])
def test_a_capture_makes_the_drivers_calls_in_order(monkeypatch, fail):
    """`_DriverGraph` against a stand-in for the driver (no GPU here): capture begins
    in relaxed mode on the first stream, the others fork from it and join back before
    it ends, the graph is instantiated and destroyed, launched on the stream asked;
    a failure says which step failed, and a task failing mid-capture still ends it."""
    from cuda.bindings import driver

    fake = _FakeDriver(driver, fail if fail != "task" else None)
    for name in ("cuStreamBeginCapture", "cuStreamEndCapture", "cuGraphInstantiate",
                 "cuGraphDestroy", "cuGraphLaunch", "cuGraphExecDestroy", "cuGetErrorName"):
        monkeypatch.setattr(driver, name, getattr(fake, name))
    log = []
    gpus = types.SimpleNamespace(event=lambda: _FakeEvent(log))
    graph = gpu._DriverGraph([7, 8, 9], gpus)

    def task_fn(*args):
        if fail == "task":
            raise RuntimeError("a launch failed")
        log.append(f"task {args}")
    task = types.SimpleNamespace(fn=task_fn, describe=lambda: "node %t")
    if fail is None:
        graph.capture([(task, [1, 2])])
        graph.launch(7)
        del graph
        gc.collect()
        assert fake.calls == ["begin", "end", "instantiate", "destroy graph", "launch",
                              "destroy exec"]
        assert log == ["record on 7", "wait on 8", "wait on 9", "task (1, 2)",
                       "record on 8", "wait on 7", "record on 9", "wait on 7"]
        return
    with pytest.raises(ExecutionError) as caught:
        graph.capture([(task, [1, 2])])
    if fail == "instantiate":
        assert "CUDA graph instantiate failed: CUDA_ERROR_INVALID_VALUE" in str(caught.value)
        assert fake.calls == ["begin", "end", "instantiate", "destroy graph"]
    else:
        assert "node %t failed in a CUDA graph's capture" in str(caught.value)
        assert fake.calls == ["begin", "end"]


class _FakeDeviceArray:
    """What `blas` reads of a device array: its pointer, dtype and size."""

    def __init__(self, address: int, dtype=np.float32, size: int = 1 << 20):
        self.dtype, self.size = np.dtype(dtype), size
        self.__cuda_array_interface__ = {"data": (address, False)}


@pytest.mark.parametrize("dtype,beta", [(np.float32, 0.0), (np.float64, 1.0)])
def test_a_cublas_product_hands_the_bindings_its_arguments_in_their_order(monkeypatch,
                                                                          dtype, beta):
    """`blas._cublas_gemm` against a stand-in for nvmath's cuBLAS bindings (no GPU here):
    the handle, bound to the stream and a workspace of the stream's own; then the
    strided batched call with offsets turned into addresses and alpha, beta as host
    pointers to 1 and 0 or 1. (What the arguments compute: the simulator's cases.)"""
    import ctypes

    from numba import cuda
    from nvmath.bindings import cublas

    calls = []
    monkeypatch.setattr(blas, "_local", threading.local())
    monkeypatch.setattr(cuda, "get_current_device", lambda: types.SimpleNamespace(id=0))
    monkeypatch.setattr(cuda, "device_array", lambda n, dt: _FakeDeviceArray(0x9000, dt, n))
    monkeypatch.setattr(cublas, "create", lambda: 99)
    monkeypatch.setattr(cublas, "set_stream", lambda *a: calls.append(("stream", *a)))
    monkeypatch.setattr(cublas, "set_workspace", lambda *a: calls.append(("workspace", *a)))
    name = "sgemm_strided_batched" if dtype == np.float32 else "dgemm_strided_batched"
    scalars = []

    def product(*args):
        calls.append((name, *args))
        ctype = ctypes.c_float if dtype == np.float32 else ctypes.c_double
        scalars.extend(ctype.from_address(args[i]).value for i in (6, 13))
    monkeypatch.setattr(cublas, name, product)
    stream = type("Stream", (), {"__int__": lambda self: 0x5000})()  # (weakly keyable)
    a, b, c = (_FakeDeviceArray(base, dtype) for base in (0x1000, 0x2000, 0x3000))
    blas._cublas_gemm(stream, 1, 0, 5, 6, 7, a, 2, 8, 40, b, 3, 9, 50, beta, c, 4, 10,
                      60, 3)
    item = np.dtype(dtype).itemsize
    assert calls[0] == ("stream", 99, 0x5000)
    assert calls[1] == ("workspace", 99, 0x9000, blas.WORKSPACE_BYTES)
    assert calls[2][:7] == (name, 99, 1, 0, 5, 6, 7)
    assert calls[2][8:13] == (0x1000 + 2 * item, 8, 40, 0x2000 + 3 * item, 9)
    assert calls[2][13] == 50 and calls[2][15:] == (0x3000 + 4 * item, 10, 60, 3)
    assert scalars == [1.0, beta]


def test_the_simulators_threads_get_one_shared_array_however_they_interleave():
    """Two simulated threads of a block asking for the same shared array, the first
    paused between finding none and storing the one it made (as a thread switch can
    leave it): the second waits and gets the first's. Without `atomic_shared_arrays`
    it makes its own, and the block's threads no longer share memory."""
    from numba.cuda.simulator import kernelapi

    from purinec.codegen.cuda.simulator import atomic_shared_arrays

    atomic_shared_arrays()
    first_is_making, second_asked = threading.Event(), threading.Event()

    def empty(shape, dtype):  # the simulator makes a shared array with np.empty
        if threading.current_thread() is first:
            first_is_making.set()
            second_asked.wait(timeout=10)
        return np.zeros(shape, dtype)

    shared = kernelapi.FakeCUDAShared(0)
    arrays = {}

    def ask(who):
        arrays[who] = shared.array(4, np.float64)  # (one call site for both threads)

    first = threading.Thread(target=ask, args=("first",))
    second = threading.Thread(target=ask, args=("second",))
    fake_numpy = types.SimpleNamespace(empty=empty, frombuffer=np.frombuffer)
    with unittest.mock.patch.object(kernelapi, "np", fake_numpy):
        first.start()
        assert first_is_making.wait(timeout=10)
        second.start()
        second.join(timeout=0.5)  # (it waits for the first: the test goes on regardless)
        second_asked.set()
        first.join(timeout=10)
        second.join(timeout=10)
    assert arrays["first"] is arrays["second"]


class _GpuLog:
    """A stand-in for Numba's cuda module over two GPUs: each event knows the GPU that
    was current when it was made, and records and waits go to one log."""

    def __init__(self):
        self.log, self.current, self.made = [], 0, []
        self.gpus = self  # (``cuda.gpus[n]``: GPU n current for a while)

    @contextlib.contextmanager
    def __getitem__(self, n):
        before, self.current = self.current, n
        try:
            yield
        finally:
            self.current = before

    def event(self, timing=True):
        name = f"e{len(self.made)}"
        self.made.append(self.current)
        log = self.log
        return types.SimpleNamespace(
            record=lambda stream: log.append(f"record {name} on {stream}"),
            wait=lambda stream: log.append(f"{stream} waits for {name}"),
            synchronize=lambda: log.append(f"the host waits for {name}"))


def _two_gpus(cuda) -> gpu.Gpus:
    gpus = object.__new__(gpu.Gpus)
    gpus.cuda, gpus.simulated, gpus.launching = cuda, False, None
    gpus.devices = {Device("gpu", n): gpu.Streams(n, f"c{n}", f"i{n}", f"o{n}")
                    for n in (0, 1)}
    return gpus


def test_each_event_is_made_on_the_gpu_whose_stream_records_it():
    """A GPU records only its own events: a task on gpu:1 whose successor runs on gpu:0
    gets an event made on GPU 1, whichever GPU the planning thread has current."""
    cuda = _GpuLog()
    gpus = _two_gpus(cuda)

    class Kernel:
        def launch(self, stream, *arrays):
            cuda.log.append(f"launch on {stream}")

    tasks = [types.SimpleNamespace(index=0, fn=Kernel(), args=[], successors=(1,),
                                   node=types.SimpleNamespace(device=Device("gpu", 1))),
             types.SimpleNamespace(index=1, fn=Kernel(), args=[], successors=(),
                                   node=types.SimpleNamespace(device=Device("gpu", 0)))]
    gpu.order_streams(types.SimpleNamespace(tasks=tasks), gpus)
    assert cuda.made == [1]
    tasks[0].fn()
    tasks[1].fn()
    assert cuda.log == ["launch on c1", "record e0 on c1", "c0 waits for e0", "launch on c0"]


def test_a_call_ends_by_joining_every_stream_and_the_next_begins_after_it(monkeypatch):
    """Each call's GPU work after all of the last call's (`CallOrder`), the host never
    waiting: every stream's end event is made on its own GPU and joined into the first
    stream; the next call's streams wait for that before anything is launched on them,
    also after a call that failed."""
    cuda = _GpuLog()
    gpus = _two_gpus(cuda)
    graph = parse(MIXED)
    calls = []

    def inner(bound):
        cuda.log.append("the call's launches")
        calls.append(bound)
        if bound.get("fail"):
            raise ExecutionError("a kernel failed")
        return {}

    monkeypatch.setattr(gpu, "graphs_mode", lambda: "0")
    executable = gpu.GpuExecutable(graph, lambda resident: inner, gpus)
    assert cuda.made == [0, 0, 1, 1, 1, 0]  # i0, o0, c1, i1, o1; then the join on c0
    executable({})
    joined = [f"record e{k} on {s}" if step == "record" else f"c0 waits for e{k}"
              for k, s in enumerate(["i0", "o0", "c1", "i1", "o1"])
              for step in ("record", "wait")] + ["record e5 on c0"]
    assert cuda.log == ["the call's launches"] + joined
    cuda.log.clear()
    with pytest.raises(ExecutionError):
        executable({"fail": True})
    waits = [f"{s} waits for e5" for s in ["i0", "o0", "c1", "i1", "o1"]]
    assert cuda.log == waits + ["the call's launches"] + joined
    cuda.log.clear()
    executable({})
    assert cuda.log == waits + ["the call's launches"] + joined


@pytest.mark.parametrize("source,destination,waits", [
    ("cpu:0", "gpu:0", True), ("gpu:0", "cpu:0", True), ("gpu:0", "gpu:1", False)])
def test_a_copy_with_host_memory_at_one_end_finishes_before_its_call_returns(
        source, destination, waits):
    """The host's memory is the host's again when a copy's call returns (the next call
    may write a pinned buffer still being read); a copy between GPUs is left queued."""
    node = types.SimpleNamespace(inputs=[types.SimpleNamespace(device=Device.parse(source))],
                                 device=Device.parse(destination))
    transfer = gpu.Transfer(node, _two_gpus(_GpuLog()))
    stream = FakeStream()

    class Array:
        def copy_to_device(self, array, stream):
            stream.calls.append("copy")

        copy_to_host = copy_to_device

    transfer.launch(stream, Array(), Array())
    assert stream.calls == ["copy"] + (["synchronize"] if waits else [])


@pytest.mark.parametrize("asked", [None, "1"])
def test_small_grids_launch_without_numbas_occupancy_warning_unless_asked(monkeypatch,
                                                                          asked):
    """A generated kernel's grid is sized to its data: Numba's warning at each launch of
    fewer than 128 blocks is off once a module is loaded, unless the user's
    NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS asks for it."""
    import warnings

    from numba import cuda
    from numba.cuda.core import config

    from purinec.codegen import cuda as codegen

    monkeypatch.setattr(config, "CUDA_LOW_OCCUPANCY_WARNINGS", 1)
    environment = {codegen.OCCUPANCY_WARNINGS_VAR: asked} if asked else {}
    with unittest.mock.patch.dict(os.environ, environment):
        if asked is None:
            os.environ.pop(codegen.OCCUPANCY_WARNINGS_VAR, None)
        codegen.compile_kernels(parse(ON_GPU))

        @cuda.jit
        def kernel(a):
            pass

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kernel[1, 32]  # (configured only: no GPU here)
    occupancy = [w for w in caught
                 if "under-utilization due to low occupancy" in str(w.message)]
    assert len(occupancy) == (asked == "1"), [str(w.message) for w in caught]


def test_kept_weights_and_memory_wait_for_what_the_calls_queued(monkeypatch):
    """What the host does with a program's GPU memory between calls waits for the
    calls' work (`CallOrder.settle`): copying kept weights in (new host arrays) and out
    (`pull`), and giving the memory back (`close`); a variable's new value made in fresh
    memory is copied into its kept array on the first stream, after the call's work."""
    cuda = _GpuLog()
    gpus = _two_gpus(cuda)
    graph = parse(ON_GPU)

    class Mirror:
        def __init__(self, name):
            self.name = name

        def copy_to_device(self, source, stream=None):
            where = f"on {stream}" if stream else "by the host"
            cuda.log.append(f"{self.name} copied in {where}")

        def copy_to_host(self, host):
            cuda.log.append(f"{self.name} copied out")

    class Inner:
        def __call__(self, bound):
            cuda.log.append("the call's launches")
            return {"b": "a fresh array"}

        def close(self):
            cuda.log.append("memory given back")

    monkeypatch.setattr(gpu, "graphs_mode", lambda: "0")
    monkeypatch.setattr(gpu.Gpus, "allocate", lambda self, *args: Mirror("b"))
    executable = gpu.GpuExecutable(graph, lambda resident: Inner(), gpus)
    assert executable.keep_variables() == {"b"}
    host = np.ones(3, np.float32)
    executable({"x": None, "b": host})
    joined = [line for k, s in enumerate(["i0", "o0", "c1", "i1", "o1"])
              for line in (f"record e{k} on {s}", f"c0 waits for e{k}")]
    assert cuda.log == (["b copied in by the host", "the call's launches"] + joined
                        + ["b copied in on c0", "record e5 on c0"])
    cuda.log.clear()
    executable.pull({"b": host})
    executable({"x": None, "b": np.ones(3, np.float32)})  # (a new host array: copied in)
    executable.close()
    waits = [f"{s} waits for e5" for s in ["i0", "o0", "c1", "i1", "o1"]]
    assert cuda.log == (["the host waits for e5", "b copied out",
                         "the host waits for e5", "b copied in by the host"] + waits
                        + ["the call's launches"] + joined
                        + ["b copied in on c0", "record e5 on c0",
                           "the host waits for e5", "memory given back"])
