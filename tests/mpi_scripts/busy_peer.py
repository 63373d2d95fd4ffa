"""Two ranks; each runs: p = tanh(a), s = allreduce(p) over cpu:0 of both ranks, and
q = tanh(a), which does not need s; y = s * 2. Rank 1 makes its p at once and then
spends BUSY seconds in q; rank 0 makes its p LATE seconds later and has nothing else to
do. Saves inputs and outputs to OUTDIR/rank<R>.npz, and the trace's intervals (start
and end: the monotonic clock, the same for both processes) to OUTDIR/rank<R>.json."""

from __future__ import annotations

import sys

from common import allreduced_tanh, run_traced_once, slow

from purinec.runtime import comm

LATE = 0.3
BUSY = 1.5


def main() -> int:
    world = comm.world()
    rank = world.rank
    graph, a, p, reduce = allreduced_tanh(world, "busy")
    q = graph.add_node("tanh", [a], names=["q"])
    y = graph.add_node("scale", reduce.outputs, {"alpha": 2.0}, names=["y"])
    graph.set_outputs([("y", y.outputs[0]), ("q", q.outputs[0])])
    kernels = {p: slow(p, LATE if rank == 0 else 0.0), q: slow(q, BUSY if rank == 1 else 0.0)}
    run_traced_once(graph, world, kernels, sys.argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(comm.run_guarded(main))
