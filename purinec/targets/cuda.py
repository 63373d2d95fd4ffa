"""The cuda target: Numba CUDA kernels (`purinec.codegen.cuda`), printed from the same IR
and fused groups as the CPU's, launched on GPU streams ordered by events, with the
dependency-counting runtime on the host (`purinec.runtime.gpu`).

Graphs run on ``gpu:N`` devices. One placed on cpu devices only (any model not placed
by its author: the default ``cpu:0``, or ``--devices 2``) runs on the GPUs of the same
numbers; a graph naming gpu devices keeps its placement, cpu nodes included (their
kernels are the cpu target's). Without a GPU, a cuda program still compiles, dumps its
kernels and their PTX, and saves; running it says what is missing.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import replace
from typing import Any, Callable

from purinec.errors import PurinecError
from purinec.ir.graph import Graph
from purinec.ir.types import Device
from purinec.passes.parallel import Parallel
from purinec.passes.parallel.local import lower_local_collectives
from purinec.passes.fuse import fuse
from purinec.passes.pipeline import Pass
from purinec.runtime.host import host_kernels, kernel_nodes
from purinec.runtime.plan import arena_source
from purinec.targets.base import Runnable, Target
from purinec.targets.cpu import CpuTarget

INSTALL = "pip install -e '.[cuda]' (numba-cuda with its CUDA 13 wheels, nvmath-python, cuBLAS)"


def _gpu(device: Device) -> Device:
    return replace(device, kind="gpu")


def on_gpus(graph: Graph) -> Graph:
    """A graph placed on cpu devices only, moved to the gpu devices of the same numbers
    (ranks kept); any other graph as it is."""
    if any(d.kind != "cpu" for d in graph.devices()):
        return graph
    moved = graph.clone()
    for value in [*moved.inputs, *(v for node in moved.flat_nodes() for v in node.outputs)]:
        value.device = _gpu(value.device)
    return moved


@functools.cache
def gpu_missing() -> str | None:
    """Why kernels cannot run on a GPU here, or None (asked of the driver once)."""
    from numba import cuda

    if cuda.is_available():
        return None
    try:
        cuda.detect()
        reason = "no CUDA GPU is visible"
    except Exception as err:  # the driver's own words
        reason = " ".join(str(err).split())
    return (f"running a cuda program needs an NVIDIA GPU and its driver, and this machine "
            f"has none usable ({reason}). It still compiles, dumps its kernels "
            f"(purinec dump --target cuda --stage kernels, --ptx) and saves; "
            f"NUMBA_ENABLE_CUDASIM=1 runs it in Numba's CUDA simulator, very slowly")


class _NeedsGpu:
    """The executable of a cuda program on a machine that cannot run it: refuses to run,
    saying why."""

    def __init__(self, graph: Graph, reason: str):
        self.graph, self.reason = graph, reason

    def __call__(self, env) -> dict:
        raise PurinecError(f"graph {self.graph.name} cannot run: {self.reason}")


class CudaTarget(Target):
    name = "cuda"
    doc = "Numba CUDA kernels on GPU streams, ordered by events, counted on the host"
    device_kinds = ("gpu", "cpu")
    generates_code = True
    keeps_variables = True

    def missing(self) -> str | None:
        if importlib.util.find_spec("numba_cuda") is None:
            return f"numba-cuda is not installed; install the cuda extra: {INSTALL}"
        return None

    def cannot_run(self) -> str | None:
        return gpu_missing()

    def lay_out(self, spread: Parallel | None) -> Parallel | None:
        """A layout over cpu devices only (``--devices 2``, the ranks of an MPI job, a
        model that placed itself on cpus) runs on the gpus of the same numbers."""
        if spread is None or any(d.kind != "cpu" for d in spread.devices):
            return spread
        return replace(spread, devices=tuple(map(_gpu, spread.devices)))

    def passes(self, training: bool) -> list[Pass]:
        return [Pass("on_gpus", on_gpus, "run a graph placed on cpu devices only on the "
                                         "gpu devices of the same numbers"),
                Pass("local_collectives", lower_local_collectives,
                     "sum, broadcast, gather and slice among this process's GPUs with "
                     "copies and kernels on them, not through host memory"),
                Pass("fuse", fuse, "group nodes into fused kernels")]

    def generated(self, graph: Graph) -> dict:
        from purinec.codegen import cpu, cuda

        compute = kernel_nodes(graph)
        on_gpu, on_cpu = _split_by_kind(compute)
        kernels = cuda.compile_kernels(on_gpu)
        if on_cpu.nodes:
            kernels.update(cpu.compile_kernels(on_cpu))
        return {node: kernels[node] for node in compute.nodes}

    def kernels(self, graph: Graph) -> dict:
        return {node: kernel if hasattr(kernel, "launch") else kernel.run
                for node, kernel in self.generated(graph).items()}

    def hold(self) -> Callable[[], None]:
        return CpuTarget().hold()

    def executable(self, graph: Graph, trace: Any = None) -> Runnable:
        from purinec.runtime import gpu
        from purinec.runtime.executor import Executable

        missing = self.cannot_run()
        if missing:
            return _NeedsGpu(graph, missing)
        gpus = gpu.Gpus(graph)
        compute = self.kernels(graph)  # compiled now: a renderer's error surfaces here

        def build(resident: frozenset[str]) -> Executable:
            io, copied = gpu.with_host_io(graph, resident)
            kernels = {copy: compute[node] for node, copy in zip(graph.nodes, copied)
                       if node in compute}
            host = host_kernels(io)
            kernels.update({**host, **gpu.gpu_kernels(io, gpus, host)})
            # The host kernels' allocator (shared memory between ranks) for host memory.
            arenas = gpu.GpuArenas(gpus, arena_source(host, None))
            return Executable(io, kernels, worker_init=gpu.worker_setup(gpus),
                              arenas=arenas, hold=self.hold,
                              prepare=lambda plan: gpu.order_streams(plan, gpus))
        return gpu.GpuExecutable(graph, build, gpus)


def _split_by_kind(graph: Graph) -> tuple[Graph, Graph]:
    """The nodes of ``graph`` on gpu devices, and those on cpu devices."""
    on_gpu, on_cpu = Graph(graph.name), Graph(graph.name)
    on_gpu.nodes = [n for n in graph.nodes if n.device.kind == "gpu"]
    on_cpu.nodes = [n for n in graph.nodes if n.device.kind != "gpu"]
    return on_gpu, on_cpu
