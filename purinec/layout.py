"""Where a program runs: devices, ranks and the layout of a graph over them.

`parallel_plan` turns compile()'s ``devices``/``parallel`` into a `Parallel`;
`layout_devices` and `layout_ranks` read a distributed graph's layout back; `rank_of`
checks the MPI job fits it; `onto_ranks` moves a layout onto a job of another size.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

from purinec.errors import PurinecError, PurinecWarning
from purinec.ir.graph import Graph
from purinec.ir.types import Device, Distribution
from purinec.passes.parallel import Parallel, parse_devices
from purinec.passes.parallel.distribute import check_micro_batches


def is_distributed(graph: Graph) -> bool:
    return any(v.dist is not None for v in graph.inputs)


# Node attributes that name devices (of collectives and point-to-point copies).
DEVICE_ATTRS = ("group", "root", "peer")


def onto_ranks(ranks: int, *graphs: Graph) -> list[Graph]:
    """``graphs`` (of one program) laid out over devices of some number of ranks, moved
    onto ``ranks`` ranks: the layout's devices, in rank order, are dealt out in equal
    consecutive blocks, the k-th device of a rank's block becoming its cpu:k (one rank:
    every device becomes a device of this process). The same work on the same pieces,
    with collectives between threads where devices now share a process: a checkpoint
    saved by one job runs in a job of another size, or without mpiexec."""
    devices = layout_devices(*graphs)
    if len(devices) < ranks:
        raise PurinecError(f"the program is laid out over {len(devices)} device(s); it "
                           f"cannot be spread over {ranks} ranks: run it on at most "
                           f"{len(devices)} (mpiexec -n {len(devices)}, or without mpiexec)")
    blocks = [k * ranks // len(devices) for k in range(len(devices))]
    here = {d: Device(d.kind, blocks[:k].count(blocks[k]), blocks[k])
            for k, d in enumerate(devices)}
    return [_moved(graph, here) for graph in graphs]


def layout_devices(*graphs: Graph) -> list[Device]:
    """Every device the graphs' values live on or are laid out over, in rank order."""
    return sorted({d for g in graphs for v in g.values() if v.dist is not None
                   for d in v.dist.group} | {d for g in graphs for d in g.devices()},
                  key=lambda d: (d.rank, d.kind, d.index))


def _moved(graph: Graph, here: dict[Device, Device]) -> Graph:
    moved = graph.clone()
    for v in moved.values():
        v.device = here[v.device]
        if v.dist is not None:
            v.dist = Distribution(v.dist.kind, tuple(here[d] for d in v.dist.group),
                                  v.dist.axis)
    for node in moved.nodes:
        for key in DEVICE_ATTRS:
            if key in node.attrs:
                node.attrs[key] = ",".join(str(here[Device.parse(text)])
                                           for text in node.attrs[key].split(","))
    return moved


def layout_ranks(graph: Graph) -> int:
    """How many ranks ``graph`` is laid out over (1 for a graph of one process)."""
    return 1 + max(d.rank for d in layout_devices(graph))


def rank_of(graph: Graph) -> int:
    """This process's rank in the job ``graph`` is laid out for: 0 unless its devices
    span ranks, which needs a job started with mpiexec of the right size."""
    from purinec.runtime import comm

    # Every rank the layout names, as layout_ranks counts them: a value laid out over a
    # rank no input is on still needs that rank in the job.
    ranks = {d.rank for d in layout_devices(graph)}
    world = comm.world()
    if ranks <= {0} and world.size > 1:
        raise PurinecError(f"graph {graph.name} is laid out over devices of rank 0 only, but "
                           f"this job has {world.size} ranks: lay it out over every rank "
                           f"(devices such as r0/cpu:0,r1/cpu:0; in the model, "
                           f"Location(rank=1, ...)), or give no devices and no placement "
                           f"for one device per rank")
    if ranks <= {0}:
        return 0
    if world.size != max(ranks) + 1:
        raise PurinecError(f"graph {graph.name} is laid out over {max(ranks) + 1} ranks but "
                           f"this job has {world.size}; start it with "
                           f"mpiexec -n {max(ranks) + 1}")
    return world.rank


def placement(graph: Graph) -> Parallel | None:
    """For a graph whose model put its layers on several devices itself: run each node
    where it was put, with copies between devices."""
    devices = graph.devices()
    return Parallel(tuple(devices), "placement") if len(devices) > 1 else None


def warn_if_idle(spread: Parallel, graph: Graph) -> None:
    """Say so when the layout of ``graph`` leaves some of the devices asked for without
    work (a pipeline cuts stages between layers by their work, so an uneven model may
    leave devices over): they would sit idle, and under mpiexec a rank holding only idle
    devices merely waits for the others."""
    used = set(layout_devices(graph))
    idle = [d for d in spread.devices if d not in used]
    if idle:
        warnings.warn(PurinecWarning(
            f"{spread.strategy} parallelism puts {graph.name} on {len(used)} of the "
            f"{len(spread.devices)} devices given; {', '.join(map(str, idle))} "
            f"{'gets' if len(idle) == 1 else 'get'} no work"
            + (": its layers' work cuts into fewer stages of about equal work (a layer "
               "is never split)" if spread.strategy == "pipeline" else "")), stacklevel=3)


def pinned_to(graph: Graph, spread: Parallel) -> Parallel:
    """``spread`` for the inference graph of a program whose training graph is
    ``graph``: a pipeline keeps every parameter on the stage that trains it."""
    if spread.strategy != "pipeline":
        return spread
    return replace(spread, pinned=tuple(
        (v.name, v.device) for v in graph.inputs_with_role("param")))


def parallel_plan(devices: Any, strategy: str | None,
                  micro_batches: int | None = None) -> Parallel | None:
    """A `Parallel` from compile()'s arguments, or None for one device."""
    if micro_batches is not None:  # (also where no Parallel is made to check them)
        check_micro_batches(micro_batches, strategy or (None if devices is None else "data"))
    if devices is None and strategy is None:
        return None
    if devices is None:
        from purinec.runtime import comm

        size = comm.world().size
        if size == 1:
            raise PurinecError(f"parallel {strategy} needs several devices: give devices "
                               f"(--devices), e.g. cpu:0,cpu:1, or start the job with "
                               f"mpiexec")
        devices = [Device("cpu", 0, r) for r in range(size)]
    spread = Parallel(as_devices(devices), strategy or "data", micro_batches)
    if len(spread.devices) > 1:
        return spread
    if spread.devices[0].rank != 0:
        raise PurinecError(f"one device ({spread.devices[0]}) makes the one-device program, "
                           f"which every process runs on its own: name devices of every "
                           f"rank (r0/cpu:0,r1/cpu:0, ...) to spread it over the ranks")
    if strategy is not None:
        warnings.warn(PurinecWarning(
            f"{strategy} parallelism over one device ({spread.devices[0]}) is the plain "
            f"one-device program"), stacklevel=3)
    return None


def as_devices(devices: Any) -> tuple[Device, ...]:
    """compile()'s ``devices``: "cpu:0,cpu:1", a count, or a sequence of Device objects
    or their names."""
    if isinstance(devices, str) or (isinstance(devices, int) and not isinstance(devices,
                                                                                bool)):
        return parse_devices(str(devices))
    if isinstance(devices, (list, tuple)) and devices:
        if all(isinstance(d, Device) for d in devices):
            return tuple(devices)
        if all(isinstance(d, str) for d in devices):
            return parse_devices(",".join(devices))
    raise PurinecError(f"devices={devices!r}: give a count, a string such as "
                       f"\"cpu:0,cpu:1\", or a list of Device objects or device names")
