"""Two ranks; each runs: p = tanh(a), s = allreduce(p) over cpu:0 of both ranks, and
q = tanh(a), which does not need s; y = s * 2. Rank 1 makes its p at once and then
spends BUSY seconds in q; rank 0 makes its p LATE seconds later and has nothing else to
do. Saves inputs and outputs to OUTDIR/rank<R>.npz, and the trace's intervals (start
and end: the monotonic clock, the same for both processes) to OUTDIR/rank<R>.json."""

from __future__ import annotations

import json
import sys

import numpy as np
from common import add_collective, executable, random_env, save
from overlap import slow

from purinec.ir.graph import Graph
from purinec.ir.types import DType, Device, TensorType
from purinec.runtime import comm
from purinec.runtime.trace import Trace

LATE = 0.3
BUSY = 1.5


def main() -> int:
    world = comm.world()
    rank = world.rank
    group = [Device("cpu", 0, r) for r in range(world.size)]
    graph = Graph(f"busy_r{rank}")
    a = graph.add_input("a", TensorType((64, 256), DType.f32), group[rank])
    p = graph.add_node("tanh", [a], names=[f"p.p{rank}"])
    reduce = add_collective(graph, "allreduce", p.outputs, group, {"tensors": 1}, "s")
    q = graph.add_node("tanh", [a], names=["q"])
    y = graph.add_node("scale", reduce.outputs, {"alpha": 2.0}, names=["y"])
    graph.set_outputs([("y", y.outputs[0]), ("q", q.outputs[0])])
    kernels = {p: slow(p, LATE if rank == 0 else 0.0), q: slow(q, BUSY if rank == 1 else 0.0)}
    trace = Trace()
    exe = executable(graph, world, kernels, trace=trace)
    env = random_env(graph, np.random.default_rng(rank))
    world.comm.Barrier()
    outputs = exe(env)
    exe.close()
    save(f"{sys.argv[1]}/rank{rank}.npz", env, outputs)
    intervals = [{"queue": lane.queue.kind, "node": task.node.name, "start": start, "end": end}
                 for task, lane, start, end, _ in trace.records]
    with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
        json.dump(intervals, f)
    return 0


if __name__ == "__main__":
    sys.exit(comm.run_guarded(main))
