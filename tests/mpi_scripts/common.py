"""What the scripts tests/runtime/test_mpi.py runs under mpiexec share: building one rank's
physical graph with collectives, running it, saving what each rank saw."""

from __future__ import annotations

import json
import time

import numpy as np

from purinec.ir.graph import Graph, Node, Value
from purinec.ir.types import DType, Device, TensorType
from purinec.runtime import comm
from purinec.runtime.executor import Executable
from purinec.runtime.plan import reference_kernel, reference_kernels
from purinec.runtime.trace import Trace


def group_text(group: list[Device]) -> str:
    return ",".join(str(device) for device in group)


def add_collective(graph: Graph, op: str, inputs: list[Value], group: list[Device],
                   attrs: dict, name: str) -> Node:
    """A physical collective whose outputs mirror its inputs' devices, named
    ``<name>.p<k>`` after the member k each belongs to (as the partitioner names them)."""
    local = [k for k, device in enumerate(group) if device.rank == inputs[0].device.rank]
    per = len(inputs) // len(local)
    names = [f"{name}{i % per if per > 1 else ''}.p{local[i // per]}"
             for i in range(len(inputs))]
    node = graph.add_node(op, inputs, attrs={"group": group_text(group), **attrs},
                          names=names)
    for out, value in zip(node.outputs, inputs):
        out.device = value.device
    return node


def executable(graph: Graph, world: comm.World, kernels: dict | None = None,
               **options) -> Executable:
    """Reference kernels for compute (unless given), MPI kernels for the collectives."""
    chosen = reference_kernels(graph)
    chosen.update(comm.comm_kernels([n for n in graph.nodes if n.op in comm.COLLECTIVES],
                                     world))
    chosen.update(kernels or {})
    return Executable(graph, chosen, **options)


def allreduced_tanh(world: comm.World, name: str) -> tuple[Graph, Value, Node, Node]:
    """A graph on cpu:0 of this rank: input ``a`` [64, 256], p = tanh(a), and s, the
    allreduce of p over cpu:0 of every rank. Returns the graph, a, p's node and s's."""
    rank = world.rank
    group = [Device("cpu", 0, r) for r in range(world.size)]
    graph = Graph(f"{name}_r{rank}")
    a = graph.add_input("a", TensorType((64, 256), DType.f32), group[rank])
    p = graph.add_node("tanh", [a], names=[f"p.p{rank}"])
    return graph, a, p, add_collective(graph, "allreduce", p.outputs, group, {"tensors": 1}, "s")


def slow(node: Node, seconds: float):
    """``node``'s reference kernel, taking at least ``seconds``."""
    fn = reference_kernel(node)

    def kernel(*arrays):
        time.sleep(seconds)
        fn(*arrays)
    return kernel


def run_traced_once(graph: Graph, world: comm.World, kernels: dict, outdir: str) -> None:
    """Run ``graph`` once (reference kernels but ``kernels``), every rank starting
    together, on inputs seeded by the rank; save its inputs and outputs to
    OUTDIR/rank<R>.npz and its trace's intervals (queue, op, node, start and end, on the
    monotonic clock, which every process of the machine shares) to OUTDIR/rank<R>.json."""
    trace = Trace()
    exe = executable(graph, world, kernels, trace=trace)
    env = random_env(graph, np.random.default_rng(world.rank))
    world.comm.Barrier()
    outputs = exe(env)
    exe.close()
    save(f"{outdir}/rank{world.rank}.npz", env, outputs)
    intervals = [{"queue": lane.queue.kind, "op": task.node.op, "node": task.node.name,
                  "start": start, "end": end}
                 for task, lane, start, end, _ in trace.records]
    with open(f"{outdir}/rank{world.rank}.json", "w") as file:
        json.dump(intervals, file)


def random_env(graph: Graph, rng: np.random.Generator) -> dict[str, np.ndarray]:
    env = {}
    for value in graph.inputs:
        dtype = value.type.dtype.numpy
        if np.issubdtype(dtype, np.integer):
            env[value.name] = rng.integers(-1000, 1000, value.type.shape).astype(dtype)
        else:
            env[value.name] = rng.standard_normal(value.type.shape).astype(dtype)
    return env


def save(path: str, env: dict, outputs: dict) -> None:
    np.savez(path, **{f"in:{k}": v for k, v in env.items()},
             **{f"out:{k}": v for k, v in outputs.items()})


def assert_weights_close(got: np.ndarray, want: np.ndarray, scale: float, name: str) -> None:
    """Weights trained on several devices against one device's, within float32 rounding
    of ``scale``: the largest the weight has been (a step can take back what the last
    one added, leaving a value near zero whose rounding looks large beside it; 1e-8 for
    a gradient that sums to almost nothing)."""
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale + 1e-8, err_msg=name)


def weight_scales(params, so_far: dict[str, float] | None = None) -> dict[str, float]:
    """The largest magnitude each weight has reached: ``so_far`` (the scales of earlier
    steps, if any) updated with ``params`` now; the ``scale`` of `assert_weights_close`."""
    return {name: max(float(np.abs(w).max()), (so_far or {}).get(name, 0.0))
            for name, w in params.items()}


def adopt_weights(one, many) -> None:
    """Give the one-device program ``many``'s trained parameters and state, so that
    inference after training compares the two programs' computations on the same
    weights. (Two programs trained apart hold weights that differ in float32 rounding,
    which `assert_weights_close` bounds; through the layers such differences can add up
    to more than an output's own rounding.)"""
    for store, trained in ((one.params, many.params), (one.state, many.state)):
        for name, value in trained.items():
            store[name] = value


def assert_output_close(got: np.ndarray, want: np.ndarray, name: str) -> None:
    """An inference output on several devices against one device's, within float32
    rounding of the output's largest value."""
    scale = np.max(np.abs(want)) + 1e-12
    np.testing.assert_allclose(got / scale, want / scale, atol=2e-5, err_msg=name)


STRATEGIES = ("data", "ps", "model", "hybrid", "pipeline", "placement")


def random_net(choose, devices: list[Device], strategy: str | None = None):
    """A random small network for ``devices``, with a strategy and a batch that strategy
    can cut: ``(net, alone, strategy, classes)``. Convolutions (with activations and
    pooling), then maybe two branches joined (concatenated, added or multiplied), or
    the channels split and put back in another order, maybe a global average pool or a
    local response normalization, then fully connected layers (maybe with dropout). In
    odd sizes: batches that do not divide evenly, fewer features or channels than
    devices, layers shrunk to 1x1. With ``placement`` the model puts each block of
    layers on one of the devices itself (the output layer on the last, the data on the
    first); ``alone`` is the same network without the placement, for one device (the
    very network otherwise). ``choose(options)`` picks one option: hypothesis's draw, or
    a seeded generator's; it picks the strategy too unless one is given."""
    from purinec.bigraph import (LRN, Accuracy, AvgPool, Blob, Concat, Conv, Dropout, Eltwise,
                                 GlobalAvgPool, InnerProduct, Location, MaxPool, Net, ReLU,
                                 Sigmoid, SoftmaxWithLoss, Split, TanH)

    strategy = strategy or choose(STRATEGIES)
    fewest = 2 * len(devices) if strategy == "pipeline" else 1  # a micro-batch each
    batch = choose(range(fewest, max(fewest, 9) + 1))
    channels, size = choose(range(1, 4)), choose(range(5, 10))
    convs = [(choose(range(1, 6)), choose([1, 3]), choose([0, 1]),
              choose([ReLU, Sigmoid, TanH, None]), choose([MaxPool, AvgPool, None]))
             for _ in range(choose(range(3)))]
    join = choose([None, "concat", "add", "mul", "split"])
    widths_of_branches = (choose(range(1, 4)), choose(range(1, 4)))
    summary = choose([None, GlobalAvgPool, LRN])
    widths = [(choose(range(1, 8)), choose([None, Dropout]))
              for _ in range(choose(range(3)))]
    classes = choose(range(2, 6))
    # Where each block goes: the conv blocks, the join, the summary, the fully
    # connected blocks, then the output layer (last device) and the loss.
    spots = ([choose(devices) for _ in range(len(convs) + len(widths) + 2)]
             + [devices[-1], choose(devices)] if strategy == "placement" else None)

    def build(placed: bool):
        blocks = iter(spots or [])

        def at():
            device = next(blocks, None)
            if not placed or device is None:
                return None
            return Location(device.rank, device.kind, device.index)

        size_now, channels_now = size, channels
        with Net("random") as net:
            x = Blob("data", (batch, channels, size, size))
            label = Blob("label", (batch,), "i32")
            for i, (out, kernel, pad, activation, pool) in enumerate(convs):
                where = at()
                if size_now + 2 * pad < kernel:
                    continue  # too small for this kernel
                size_now += 2 * pad - kernel + 1
                x = x >> Conv(f"conv{i}", out, kernel, pad=pad, location=where)
                channels_now = out
                if activation is not None:
                    x = x >> activation(f"act{i}", location=where)
                if pool is not None and size_now >= 2:
                    x = x >> pool(f"pool{i}", 2, 2, location=where)
                    size_now = (size_now - 1) // 2 + 1
            where = at()
            if join in ("concat", "add", "mul"):
                first, second = (widths_of_branches if join == "concat"
                                 else (widths_of_branches[0],) * 2)
                left = (x >> Conv("left", first, 1, location=where)
                        >> ReLU("left_relu", location=where))
                right = (x >> Conv("right", second, 3, pad=1, location=where)
                         >> TanH("right_tanh", location=where))
                joined = (Concat("join", axis=1, location=where) if join == "concat"
                          else Eltwise("join", join, location=where))
                x = [left, right] >> joined
            elif join == "split" and channels_now >= 2:
                low, high = x >> Split("halves", [1, channels_now - 1], location=where)
                x = [high, low] >> Concat("swapped", axis=1, location=where)
            where = at()
            if summary is not None:
                x = x >> summary("summary", location=where)
            for j, (width, dropout) in enumerate(widths):
                where = at()
                x = (x >> InnerProduct(f"ip{j}", width, location=where)
                     >> ReLU(f"relu{j}", location=where))
                if dropout is not None:
                    x = x >> dropout(f"drop{j}", 0.3, location=where)
            logits = x >> InnerProduct("out", classes, location=at()) >> Blob("logits")
            where = at()
            net.outputs = [logits,
                           [logits, label] >> SoftmaxWithLoss("loss", location=where),
                           [logits, label] >> Accuracy("accuracy", location=where)]
        return net

    net = build(placed=True)
    return net, (build(placed=False) if spots else net), strategy, classes
