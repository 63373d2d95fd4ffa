"""Kernels of the ops every target runs on the host (`Trait.host`): copies, slices and
collectives, in process or over MPI."""

from __future__ import annotations

from purinec.ir.graph import Graph
from purinec.ir.ops import Trait, op_has, spans_ranks
from purinec.runtime.collectives import host_kernel
from purinec.runtime.memory import is_view


def host_kernels(graph: Graph) -> dict:
    """Kernels of the host nodes of ``graph``: in-process, or MPI for groups that span
    ranks (those need the job to run under mpiexec). The MPI ones are made together,
    so every rank creates their communicators in the same order."""
    host = [node for node in graph.nodes if op_has(node.op, Trait.host)]
    kernels = {node: host_kernel(node) for node in host if not spans_ranks(node)}
    spanning = [node for node in host if spans_ranks(node)]
    if spanning:
        from purinec.runtime import comm  # MPI: imported only for a job that needs it

        kernels.update(comm.comm_kernels(spanning, comm.world()))
    return kernels


def kernel_nodes(graph: Graph) -> Graph:
    """``graph`` with only the nodes a target's own kernels compute: no host tasks, and
    no views (a reshape on one device runs nothing, so compiling a kernel for it would
    only lengthen a cold compile)."""
    kept = Graph(graph.name)
    kept.nodes = [node for node in graph.nodes
                  if not op_has(node.op, Trait.host) and not is_view(node)]
    return kept
