"""Two ranks; each runs: p = tanh(a), s = allreduce(p) over cpu:0 of both ranks, a chain
of slow tanh kernels on the compute queue that does not need s, then y = s + chain.
Rank 1 makes its p late, so rank 0's allreduce stays pending while its chain runs.
Saves inputs and outputs to OUTDIR/rank<R>.npz and the trace's intervals (seconds) to
OUTDIR/rank<R>.json."""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from common import add_collective, executable, random_env, save

from purinec.ir.graph import Graph
from purinec.ir.types import DType, Device, TensorType
from purinec.runtime import comm
from purinec.runtime.plan import reference_kernel
from purinec.runtime.trace import Trace

CHAIN = 6
CHAIN_SLEEP = 0.05  # seconds each chain kernel takes at least
LATE = 0.3  # how much later than rank 0 rank 1 posts its allreduce


def slow(node, seconds: float):
    fn = reference_kernel(node)

    def kernel(*arrays):
        time.sleep(seconds)
        fn(*arrays)
    return kernel


def main() -> int:
    world = comm.world()
    rank = world.rank
    group = [Device("cpu", 0, r) for r in range(world.size)]
    graph = Graph(f"overlap_r{rank}")
    a = graph.add_input("a", TensorType((64, 256), DType.f32), group[rank])
    p = graph.add_node("tanh", [a], names=[f"p.p{rank}"])
    reduce = add_collective(graph, "allreduce", p.outputs, group, {"tensors": 1}, "s")
    chain = [graph.add_node("tanh", [a])]
    for _ in range(CHAIN - 1):
        chain.append(graph.add_node("tanh", chain[-1].outputs))
    y = graph.add_node("add", [reduce.outputs[0], chain[-1].outputs[0]])
    graph.set_outputs([("y", y.outputs[0]), ("p", p.outputs[0])])
    kernels = {node: slow(node, CHAIN_SLEEP) for node in chain}
    kernels[p] = slow(p, LATE if rank == 1 else 0.0)
    trace = Trace()
    exe = executable(graph, world, kernels, trace=trace)
    env = random_env(graph, np.random.default_rng(rank))
    world.comm.Barrier()  # start together, so only LATE separates the two posts
    outputs = exe(env)
    exe.close()
    save(f"{sys.argv[1]}/rank{rank}.npz", env, outputs)
    intervals = [{"queue": lane.queue.kind, "op": task.node.op, "start": start, "end": end}
                 for task, lane, start, end, _ in trace.records]
    with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
        json.dump(intervals, f)
    return 0


if __name__ == "__main__":
    sys.exit(comm.run_guarded(main))
