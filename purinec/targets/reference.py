"""The reference target: NumPy, one op at a time. The oracle every other target's
kernels are checked against."""

from __future__ import annotations

from typing import Any

from purinec.ir.graph import Graph
from purinec.ir.ops import spans_ranks
from purinec.runtime.memory import check_values_fit
from purinec.runtime.reference import execute
from purinec.targets.base import Runnable, Target


class ReferenceTarget(Target):
    name = "reference"
    doc = "NumPy, one op at a time: the oracle"

    def kernels(self, graph: Graph) -> dict:
        from purinec.runtime.plan import reference_kernels

        return reference_kernels(graph)

    def executable(self, graph: Graph, trace: Any = None) -> Runnable:
        if not any(spans_ranks(node) for node in graph.nodes):
            # It keeps every value until the run ends: all of them must fit at once.
            check_values_fit([v for node in graph.flat_nodes() for v in node.outputs],
                             f"the values of graph {graph.name} (the reference target keeps "
                             f"each until the run ends)")
            return lambda env: execute(graph, env)
        # Collectives across ranks: each op's NumPy reference, run by the counting
        # executor alongside the MPI kernels.
        return super().executable(graph, trace)
