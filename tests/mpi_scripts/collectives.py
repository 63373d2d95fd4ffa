"""Each rank runs a graph of allreduce and allgather nodes over every rank (two devices a
rank; and a bucket over the first device of each), over this rank's two devices only, and (with 3 ranks or more, unless an option
says "no-ends") over the first and last rank, and a parameter server's reduce (of a
bucket) and broadcast (of the bucket's f32 sums) over every rank; saves its inputs and
outputs of each call to OUTDIR/rank<R>.call<C>.npz, and the kind of kernel each
collective got (with " in shared memory" where it shares the ranks' memory) and
`comm.describe`'s summary to OUTDIR/rank<R>.kernels.json.
Option "no-room": rank 1 finds no room for shared memory.

    collectives.py OUTDIR [no-ends] [no-room]
"""

from __future__ import annotations

import json
import sys

import numpy as np
from common import add_collective, executable, group_text, random_env, save

from purinec.ir.graph import Graph
from purinec.ir.types import DType, Device, TensorType
from purinec.runtime import comm, shm
from purinec.runtime.memory import ALIGNMENT

CALLS = 2
BUCKET = [((5, 4), DType.f32), ((7,), DType.f64), ((3, 2, 2), DType.f32)]
# More tensors than a cache line of control words has room for the offsets of.
PAIRS = BUCKET + [((3,), DType.f32)] * 3 + [((2, 5), DType.f64)] * 3


def build(world: comm.World, ends: bool = True) -> Graph:
    rank, size = world.rank, world.size
    both = [Device("cpu", i, r) for i in range(2) for r in range(size)]  # ranks interleaved
    firsts = [Device("cpu", 0, r) for r in range(size)]
    mine = [Device("cpu", i, rank) for i in range(2)]
    graph = Graph(f"collectives_r{rank}")
    outputs = []

    def inputs(name, group, types):
        return [graph.add_input(f"{name}{t if len(types) > 1 else ''}.p{k}", TensorType(*ty),
                                device)
                for k, device in enumerate(group) if device.rank == rank
                for t, ty in enumerate(types)]

    def reduce(name, group, types):
        node = add_collective(graph, "allreduce", inputs(name, group, types), group,
                              {"tensors": len(types)}, f"{name}_out")
        outputs.extend((v.name, v) for v in node.outputs)

    def gather(pieces, group, name, **attrs):
        node = add_collective(graph, "allgather", pieces, group, attrs, name)
        outputs.extend((v.name, v) for v in node.outputs)

    reduce("bucket", both, BUCKET)
    reduce("pair", firsts, PAIRS)  # (one member a rank: summed where the outputs lie)
    reduce("one", firsts, [((1000,), DType.f64)])
    reduce("local", mine, [((6,), DType.f32)])
    if ends and size >= 3 and rank in (0, size - 1):
        reduce("ends", [firsts[0], firsts[-1]], [((4, 4), DType.f32)])
    # Pieces of unequal extents: k + 1 on axis 1 for member k; r + 2 rows for rank r.
    sizes = [k + 1 for k in range(len(both))]
    pieces = [graph.add_input(f"gather.p{k}", TensorType((3, sizes[k], 2), DType.f32), device)
              for k, device in enumerate(both) if device.rank == rank]
    gather(pieces, both, axis=1, sizes=sizes, name="gather_out")
    rows = [r + 2 for r in range(size)]
    piece = graph.add_input(f"rows.p{rank}", TensorType((rows[rank], 3), DType.i32),
                            firsts[rank])
    gather([piece], firsts, axis=0, sizes=rows, name="rows_out")
    # A parameter server on the last rank's second device: every member's summands (a
    # bucket of tensors) onto it, then its f32 sums (a bucket too) to every member.
    server = Device("cpu", 1, size - 1)
    here = server.rank == rank
    attrs = {"group": group_text(both), "root": str(server)}
    total = graph.add_node("reduce", inputs("ps", both, BUCKET),
                           {**attrs, "tensors": len(BUCKET)},
                           names=[f"ps_sum{t}{'' if here else '.sent'}"
                                  for t in range(len(BUCKET))],
                           device=server if here else mine[0])
    local = [k for k, device in enumerate(both) if device.rank == rank]
    sent = [t for t, (_, dtype) in enumerate(BUCKET) if dtype == DType.f32]  # (one dtype)
    shapes = [BUCKET[t][0] for t in sent]
    copies = graph.add_node("broadcast", [total.outputs[t] for t in sent] if here else [],
                            {**attrs, "shape": [n for shape in shapes for n in shape],
                             "ndims": [len(shape) for shape in shapes],
                             "members": len(local)},
                            names=[f"ps_all{t}.p{k}" for k in local for t in sent])
    for i, out in enumerate(copies.outputs):
        out.device = both[local[i // len(sent)]]
    outputs.extend((v.name, v) for v in total.outputs + copies.outputs)
    graph.set_outputs(outputs)
    return graph


def main() -> int:
    world = comm.world()
    options = sys.argv[2:]
    if "no-room" in options and world.rank == 1:
        shm._room = lambda machine_bytes: False
    graph = build(world, ends="no-ends" not in options)
    exe = executable(graph, world)
    kinds = {task.node.name: type(task.fn).__name__ + (
                 " in shared memory" if comm.describe([task.fn]) == "shared memory" else "")
             for task in exe.plan.tasks if task.node.op in comm.COLLECTIVES}
    communication = comm.describe(task.fn for task in exe.plan.tasks)
    with open(f"{sys.argv[1]}/rank{world.rank}.kernels.json", "w") as file:
        json.dump({"kinds": kinds, "communication": communication}, file)
    for call in range(CALLS):
        env = random_env(graph, np.random.default_rng([call, world.rank]))
        outputs = exe({k: v.copy() for k, v in env.items()})
        save(f"{sys.argv[1]}/rank{world.rank}.call{call}.npz", env, outputs)
    exe.close()
    # Closing gave the shared arenas' pages back (they read as zeros), and the
    # executable still runs, as call 0 did.
    shared = communication == "shared memory"
    released = all(not arena.any() for arena in exe.plan.arenas.values())
    env = random_env(graph, np.random.default_rng([0, world.rank]))
    outputs = exe({k: v.copy() for k, v in env.items()})
    save(f"{sys.argv[1]}/rank{world.rank}.after_close.npz",
         {"shared": np.array(shared), "released": np.array(released)}, outputs)
    exe.close()
    # A kernel called with its output over its input (which the planner never does),
    # waited for directly.
    [one] = [node for node in graph.nodes if node.inputs and
             node.inputs[0].name.startswith("one.")]
    x = np.full(one.inputs[0].type.shape, world.rank + 1.0)
    comm.mpi_kernel(one, world)(x, x).wait()
    # The same through the executable's kernel, which may reduce in shared memory, where
    # this x (the caller's array) is not: it is staged through the kernel's buffers.
    [ran] = [task.fn for task in exe.plan.tasks if task.node is one]
    y = np.full(one.inputs[0].type.shape, world.rank + 1.0)
    ran(y, y).wait()
    save(f"{sys.argv[1]}/rank{world.rank}.aliased.npz", {}, {"x": x, "y": y})
    # The bucket of one member a rank, its arrays in rank 0's window (summed where they
    # lie) and the caller's elsewhere (staged): every rank's buffers still line up.
    [pair] = [task for task in exe.plan.tasks if task.node.op == "allreduce" and
              task.node.outputs[0].name.startswith("pair_out")]
    value_types = [value.type for value in pair.node.inputs]
    arrays = (_in_window(exe, value_types) if world.rank == 0 else
              [np.empty(t.shape, t.dtype.numpy) for t in value_types])
    group = getattr(pair.fn, "group", None)  # (a shared-memory kernel's)
    if world.rank == 0 and group is not None and group.shared:
        assert all(group.offset(array) is not None for array in arrays)
    for t, array in enumerate(arrays):
        array[...] = (world.rank + 1) * (t + 1)
    pair.fn(*arrays, *arrays).wait()
    save(f"{sys.argv[1]}/rank{world.rank}.mixed.npz", {},
         {f"t{t}": array for t, array in enumerate(arrays)})
    return 0


def _in_window(exe, value_types) -> list[np.ndarray]:
    """Arrays of ``value_types`` one after another in this rank's arena (scratch between
    calls), each from an aligned byte."""
    arena = max(exe.plan.arenas.values(), key=len)  # (in the window of every rank's group)
    arrays, top = [], 0
    for t in value_types:
        start = -(-top // ALIGNMENT) * ALIGNMENT
        top = start + t.nbytes
        assert top <= len(arena), "too small an arena"
        arrays.append(arena[start:top].view(t.dtype.numpy).reshape(t.shape))
    return arrays


if __name__ == "__main__":
    sys.exit(comm.run_guarded(main))
