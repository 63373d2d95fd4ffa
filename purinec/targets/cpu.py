"""The cpu target: fused Numba kernels (`purinec.codegen`) run by the dependency-counting
runtime, one worker thread per device with a share of the cores."""

from __future__ import annotations

from typing import Callable

from purinec.ir.graph import Graph
from purinec.passes.batch_slices import in_slices, slice_count
from purinec.passes.fuse import fuse
from purinec.passes.pipeline import Pass
from purinec.runtime.host import kernel_nodes
from purinec.runtime.memory import concats_in_place
from purinec.targets.base import Target


class CpuTarget(Target):
    name = "cpu"
    doc = "fused Numba kernels run by the dependency-counting runtime"
    records_traces = True
    generates_code = True

    def passes(self, training: bool) -> list[Pass]:
        fusion = [Pass("fuse", fuse, "group nodes into fused kernels")]
        if training:
            return fusion
        from purinec.codegen.cpu_layout import filters_in_panels

        return [Pass("slices", _in_slices, "a batch in slices whose values fit the cache"),
                Pass("panels", filters_in_panels,
                     "small maps' convolutions pixel by filter, weights in panels"), *fusion]

    def generated(self, graph: Graph) -> dict:
        from purinec.codegen.cpu import compile_kernels  # Numba: only when compiling

        return compile_kernels(_computed(graph))

    def kernels(self, graph: Graph) -> dict:
        from purinec.codegen.cpu import kernel_calls

        return kernel_calls(_computed(graph))

    def worker_setup(self, graph: Graph) -> Callable:
        """Each device's compute threads get an equal share of the cores this process
        may use (with the other ranks on this machine), so devices working at once do
        not oversubscribe them."""
        from purinec.codegen.cpu_runtime import process_cpus, set_threads

        devices = {v.device for node in graph.nodes for v in node.outputs}
        share = max(1, process_cpus() // max(1, len(devices)))
        return lambda lane: set_threads(share)

    def hold(self) -> Callable[[], None]:
        """The pool that runs blocked kernels' other blocks, shared by every program."""
        from purinec.codegen.cpu_runtime import hold_team

        return hold_team()


def _computed(graph: Graph) -> Graph:
    """The nodes of ``graph`` that the cpu target's kernels compute: `kernel_nodes`, less
    the concats whose inputs are computed in place (`concats_in_place`)."""
    kept = kernel_nodes(graph)
    elided = concats_in_place(graph)
    kept.nodes = [node for node in kept.nodes if node not in elided]
    return kept


def _in_slices(graph: Graph) -> Graph:
    """An inference batch computed a slice at a time (`purinec.passes.batch_slices`),
    each slice's values within `cpu_runtime.slice_budget`."""
    from purinec.codegen.cpu_runtime import slice_budget

    return in_slices(graph, slice_count(graph, slice_budget()))
