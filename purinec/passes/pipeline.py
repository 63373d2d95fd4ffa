"""Running passes by name, with verification and IR dumps between them.

A pass is a named function from Graph to Graph (xDSL's shape: small, frozen, with a
name). `run_passes` calls a hook after each one; that is how ``purinec dump`` shows the
IR after any or all stages, and how debug mode verifies after every pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from purinec.ir.graph import Graph
from purinec.ir.verify import verify

StageHook = Callable[[str, Graph], None]


@dataclass(frozen=True)
class Pass:
    """A named graph-to-graph transformation. Passes never mutate their argument."""

    name: str
    run: Callable[[Graph], Graph]
    doc: str = ""

    def __call__(self, graph: Graph) -> Graph:
        return self.run(graph)


@dataclass
class PassTiming:
    name: str
    seconds: float
    nodes_before: int
    nodes_after: int


@dataclass
class PipelineResult:
    graph: Graph
    timings: list[PassTiming] = field(default_factory=list)


def run_passes(graph: Graph, passes: Iterable[Pass], after: StageHook | None = None,
               verify_each: bool = True) -> PipelineResult:
    """Run ``passes`` in order; call ``after(name, graph)`` once each has run."""
    result = PipelineResult(graph)
    for p in passes:
        start = time.perf_counter()
        before = len(result.graph.nodes)
        result.graph = p(result.graph)
        result.timings.append(PassTiming(p.name, time.perf_counter() - start, before,
                                         len(result.graph.nodes)))
        if verify_each:
            verify(result.graph)
        if after is not None:
            after(p.name, result.graph)
    return result
