"""Two ranks; each runs: p = tanh(a), s = allreduce(p) over cpu:0 of both ranks, a chain
of slow tanh kernels on the compute queue that does not need s, then y = s + chain.
Rank 1 makes its p late, so rank 0's allreduce stays pending while its chain runs.
Saves inputs and outputs to OUTDIR/rank<R>.npz and the trace's intervals (seconds) to
OUTDIR/rank<R>.json."""

from __future__ import annotations

import sys

from common import allreduced_tanh, run_traced_once, slow

from purinec.runtime import comm

CHAIN = 6
CHAIN_SLEEP = 0.05  # seconds each chain kernel takes at least
LATE = 0.3  # how much later than rank 0 rank 1 posts its allreduce


def main() -> int:
    world = comm.world()
    rank = world.rank
    graph, a, p, reduce = allreduced_tanh(world, "overlap")
    chain = [graph.add_node("tanh", [a])]
    for _ in range(CHAIN - 1):
        chain.append(graph.add_node("tanh", chain[-1].outputs))
    y = graph.add_node("add", [reduce.outputs[0], chain[-1].outputs[0]])
    graph.set_outputs([("y", y.outputs[0]), ("p", p.outputs[0])])
    kernels = {node: slow(node, CHAIN_SLEEP) for node in chain}
    kernels[p] = slow(p, LATE if rank == 1 else 0.0)
    run_traced_once(graph, world, kernels, sys.argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(comm.run_guarded(main))
