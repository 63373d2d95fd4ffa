"""What a command does differently when it runs as one rank of an ``mpiexec`` job, where
every rank runs it: how a model is spread over the ranks by default, which artifacts
can run over the job, waiting for every rank, and which rank reports. Shared by the
command line and `purinec.train`, whose sessions run under mpiexec too."""

from __future__ import annotations

from typing import Any, Callable

from purinec.errors import PurinecError


def default_strategy(parallel: str | None, devices: Any,
                     placement: Callable[[], object]) -> str | None:
    """``parallel``, or under mpiexec, with neither ``devices`` nor ``parallel``, "data"
    for a model that does not place its layers itself (``placement()`` says whether it
    does): every rank runs the command, and on one device each the ranks would all
    repeat rank 0's work, and only rank 0 reports."""
    from purinec.runtime import comm

    if (parallel is None and devices is None and comm.world().size > 1
            and placement() is None):
        return "data"
    return parallel


def placement_of(source):
    """The `Parallel` of a model that puts its layers on several devices itself, or None
    (lowering it takes milliseconds; compile() lowers it again)."""
    from purinec.compiler import lowered
    from purinec.ir.graph import Graph
    from purinec.layout import placement

    return placement(source if isinstance(source, Graph) else lowered(source))


def spread_options(model, batch: int | None, devices: Any, parallel: str | None,
                   micro_batches: int | None, **model_kwargs) -> dict:
    """compile()'s devices, parallel and micro_batches for ``model``: as given, with
    `default_strategy`'s default for parallel."""
    from purinec.compiler import load_source

    strategy = default_strategy(
        parallel, devices, lambda: placement_of(load_source(model, batch, **model_kwargs)))
    return {"devices": devices, "parallel": strategy, "micro_batches": micro_batches}


def check_spans_the_job(program, path: str) -> None:
    """Under mpiexec, refuse an artifact whose program leaves ranks without devices (one
    compiled for one device): every rank would run all of it alone, N copies of the
    work, which is never what the job was started for. (A program laid out over
    devices is dealt out over the job's ranks when loaded.)"""
    from purinec.runtime import comm

    ranks = comm.world().size
    used = {device.rank for device in program.devices}
    if len(used) < ranks:
        devices = ",".join(str(d) for d in program.devices)
        raise PurinecError(f"{path} runs on {devices}, not over {ranks} ranks: under mpiexec "
                           "every rank would run all of it alone; run it without mpiexec, "
                           "or compile or train the MODEL under mpiexec (data parallelism "
                           "over the ranks)")


def wait_for_every_rank() -> None:
    """Under mpiexec, wait until every rank has its program: the ranks of a pipeline
    compile different kernels (lenet over 2 ranks, cold cache: 12 and 51), and the
    time reported for compiling should cover the slowest rank rather than show up in
    the first step."""
    from purinec.runtime import comm

    comm.world().wait_for_all()


def is_reporting_rank() -> bool:
    """Whether this process is the one that writes files: rank 0 of an MPI job (every
    rank holds the same replicated weights)."""
    from purinec.runtime import comm

    return comm.world().rank == 0


def on_devices(program) -> str:
    """`` on N devices (...)`` for a program on several devices, with how this rank
    exchanges data with the others when it does; else nothing."""
    devices = program.devices
    if len(devices) == 1:
        return ""
    how = program.communication
    between = "" if how is None else f"; ranks exchange through {how}"
    return f" on {len(devices)} devices ({','.join(map(str, devices))}{between})"
