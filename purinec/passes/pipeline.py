"""The pass pipeline, and running passes by name with verification and IR dumps
between them.

A pass is a named function from Graph to Graph (xDSL's shape: small, frozen, with a
name). `run_passes` calls a hook after each one; that is how ``purinec dump`` shows the
IR after any or all stages, and how debug mode verifies after every pass. `Pipeline`
says which passes take a lowered graph to final IR for a training or inference graph,
one device or a layout over several, and a target: `compile()` runs it and ``purinec
dump`` shows it, stage by stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from purinec.ir.graph import Graph
from purinec.ir.verify import verify
from purinec.passes.autodiff import autodiff
from purinec.passes.optimizer import SGD
from purinec.passes.parallel import Parallel, parallelize, partition
from purinec.passes.parallel.pipeline import assign_stages, default_micro_batches, microbatch
from purinec.passes.simplify import cse, dce, infer_shapes

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


# Every stage a dump can show, in pipeline order. "lower" is the graph as the front end
# produced it (for a .pir file: as parsed). autodiff and optimizer run only for training,
# on_gpus and local_collectives only for the cuda target, slices and panels only for the
# cpu target, fuse only for targets that fuse (cpu, cuda). With several devices,
# "parallel" (distributions and boxing) ends the logical pipeline and "partition" starts
# each rank's physical one.
STAGES = ("lower", "infer_shapes", "verify", "stages", "autodiff", "optimizer", "dce", "cse",
          "microbatch", "parallel", "partition", "on_gpus", "local_collectives", "slices",
          "panels", "fuse")


@dataclass(frozen=True)
class Pipeline:
    """The passes from a lowered graph to what a target runs.

    ``train`` appends the backward pass and the solver; ``parallel`` lays the graph out
    over devices, after which `logical` ends with the distributed logical graph and
    `physical` cuts out the graph of ``rank``; ``target_passes`` (a target's own, such as
    fusion) end the pipeline of whatever graph is run.
    """

    train: SGD | None = None
    parallel: Parallel | None = None
    target_passes: tuple[Pass, ...] = ()
    rank: int = 0

    def logical(self) -> list[Pass]:
        """To final IR; with ``parallel``, to the distributed logical graph."""
        passes = [Pass("infer_shapes", infer_shapes, "recompute output types from inputs"),
                  Pass("verify", _verified, "check every IR invariant")]
        spread = self.parallel
        pipelined = spread is not None and spread.strategy == "pipeline"
        if pipelined:
            passes.append(Pass("stages", lambda g: assign_stages(g, spread.devices,
                                                                 dict(spread.pinned)),
                               "put layers on the devices in stages of equal work"))
        if self.train is not None:
            passes += [Pass("autodiff", autodiff, "append the backward graph"),
                       Pass("optimizer", self.train.apply, "append the solver's updates")]
        passes += [Pass("dce", dce, "drop nodes that reach no output"),
                   Pass("cse", cse, "merge identical nodes")]
        if pipelined:
            passes.append(Pass("microbatch", lambda g: microbatch(g, spread.micro_batches or
                                                                  _micro_batches(g, spread)),
                               "one copy of the batch's work per micro-batch"))
        if spread is not None:
            return passes + [Pass("parallel", lambda g: parallelize(g, spread),
                                  f"distribute: {spread.describe()}")]
        return passes + list(self.target_passes)

    def physical(self) -> list[Pass]:
        """From a distributed logical graph to the physical graph ``rank`` runs."""
        rank = self.rank
        return [Pass("partition", lambda g: partition(g, rank), f"the graph of rank {rank}"),
                *self.target_passes]

    def stages(self) -> list[str]:
        """The names of the stages that run, "lower" first."""
        physical = self.physical() if self.parallel is not None else []
        return ["lower"] + [p.name for p in self.logical() + physical]

    def run(self, graph: Graph, after: StageHook | None = None) -> Graph:
        return run_passes(graph, self.logical(), after).graph

    def run_physical(self, graph: Graph, after: StageHook | None = None) -> Graph:
        return run_passes(graph, self.physical(), after).graph


def _verified(graph: Graph) -> Graph:
    verify(graph, program=True)  # (the whole graph of a program: no rank's piece yet)
    return graph


def _micro_batches(graph: Graph, parallel: Parallel) -> int:
    data = graph.inputs_with_role("data")
    return default_micro_batches(len(parallel.devices),
                                 min((v.type.shape[0] for v in data if v.type.rank), default=1))
