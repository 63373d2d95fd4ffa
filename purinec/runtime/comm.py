"""Communication across ranks: the MPI world, collective kernels, failing as one job.

A program spanning several ranks runs as one process per rank under ``mpiexec``;
``MPI.COMM_WORLD``'s rank is `Device.rank`. A process that no launcher started is a
world of one, and never initialises MPI (mpi4py is imported only under a launcher).

`comm_kernels` gives physical ``allreduce``, ``allgather``, ``reduce`` and ``broadcast``
nodes of one rank's graph their kernels. A kernel takes the executor's
``fn(*inputs, *outputs)`` arrays, packs what this rank's members contribute into one
contiguous buffer (a reduce: its output; a broadcast: its first output), posts a
non-blocking collective over the group's ranks and returns a `Pending` that unpacks the
result into every local output once ``test()`` sees the collective complete (the
executor's comm queue polls it; see `purinec.runtime.executor`). Results are bitwise
identical on every rank when every rank receives the same reduced bytes: MPI advises
but does not promise it, MPICH's algorithms do it, and tests/runtime/test_mpi.py checks it.
A group that lives wholly on this rank needs no MPI: its kernel finishes at once and
returns None. Collectives over ranks of one machine get the kernels of
`purinec.runtime.shm` instead where it can share the ranks' memory.

A group of some of the ranks gets its own communicator. Creating one is collective over
its ranks, so `comm_kernels` creates them when kernels are built, every rank in the same
(sorted) order, never while running.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterable, NoReturn

import numpy as np

from purinec.errors import ExecutionError, PurinecError
from purinec.ir.graph import Node
from purinec.ir.ops import broadcast_types
from purinec.ir.types import Device
from purinec.runtime import shm
from purinec.runtime.signals import interruption, terminating
from purinec.runtime.collectives import (Copies, Packing, PerArrays, broadcast_copies,
                                         sum_in_order, summand_types)

# What MPI launchers set in each process they start: MPICH's Hydra (PMI_RANK, PMI_SIZE,
# MPI_LOCALRANKID) and Open MPI (OMPI_COMM_WORLD_RANK).
LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_RANK")

# Test hook: the rank named here fails at the start of each graph's first run.
FAIL_RANK_VARIABLE = "PURINEC_FAIL_RANK"

COLLECTIVES = ("allreduce", "allgather", "reduce", "broadcast")


@dataclass(eq=False)
class World:
    """This process's place among the ranks: ``comm`` is ``MPI.COMM_WORLD``, or None in a
    world of one that never started MPI."""

    rank: int
    size: int
    comm: object | None
    _groups: dict[tuple[int, ...], object] = field(default_factory=dict, repr=False)

    def group_comm(self, ranks: tuple[int, ...]):
        """The communicator over ``ranks`` (their order is its rank order), created at the
        first request; collective over those ranks only."""
        comm = self._groups.get(ranks)
        if comm is None:
            group = self.comm.Get_group().Incl(list(ranks))
            comm = self._groups[ranks] = self.comm.Create_group(group)
            group.Free()
        return comm

    def wait_for_all(self) -> None:
        """Return once every rank has called this, sleeping while it waits: a spinning
        rank would take a core from ranks still at work (compiling, timing)."""
        if self.size == 1:
            return
        request = self.comm.Ibarrier()
        while not request.Test():
            time.sleep(1e-3)


_world: World | None = None
_world_lock = threading.Lock()


def launched_by_mpi() -> bool:
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


def world() -> World:
    """This process's world, made once: MPI's when a launcher started the process."""
    global _world
    with _world_lock:
        if _world is None:
            if launched_by_mpi():
                if os.environ.get("MPI_LOCALRANKID") == "0":  # (Hydra's; once a machine)
                    _unlink_stale_segments()
                comm = _mpi().COMM_WORLD  # the import initialises MPI, thread level MULTIPLE
                _world = World(comm.Get_rank(), comm.Get_size(), comm)
            else:
                _world = World(0, 1, None)
        return _world


# ---------------------------------------------------------------------------------------
# Kernels.


def comm_kernels(nodes: Iterable[Node], world: World) -> dict[Node, Callable]:
    """Kernels for the collectives and sends and receives of this rank's graph (e.g. all
    those whose group spans ranks). Their communicators are created first, in sorted
    order, which no two ranks can disagree on; creating them node by node instead
    (`mpi_kernel` alone) could deadlock if two ranks met shared groups in different
    orders. Collectives over ranks of one machine work in shared memory where
    `purinec.runtime.shm` can arrange it (its `SharedGroup`, likewise agreed in
    sorted order), with MPI's kernel as the fallback."""
    nodes = list(nodes)
    kernels = {node: _point_to_point(node, world) for node in nodes
               if node.op in POINT_TO_POINT}
    nodes = [node for node in nodes if node.op not in POINT_TO_POINT]
    spans = sorted({_ranks(_group(node)) for node in nodes})
    for ranks in spans:
        if len(ranks) > 1 and world.rank in ranks:  # (mpi_kernel refuses the others)
            _check_world(ranks, world, f"node {nodes[0]!r}")
            world.group_comm(ranks)
    shareable = {_ranks(_group(node)) for node in nodes if node.op in shm.SHAREABLE}
    shared = shm.shared_groups(
        sorted(ranks for ranks in shareable if len(ranks) > 1 and world.rank in ranks), world)
    for node in nodes:
        kernels[node] = mpi_kernel(node, world)
        ranks = _ranks(_group(node))
        if node.op in shm.SHAREABLE and ranks in shared:
            kernels[node] = shm.shared_kernel(node, kernels[node], shared[ranks])
    return kernels


def describe(kernels: Iterable[Callable]) -> str | None:
    """How ``kernels`` exchange data with other ranks: "shared memory", "MPI", both
    ("shared memory and MPI"), or None when none does."""
    ways = set()
    for fn in kernels:
        group = getattr(fn, "group", None)
        if isinstance(group, shm.SharedGroup) and group.shared:
            ways.add("shared memory")
        elif getattr(fn, "asynchronous", False):
            ways.add("MPI")
    return " and ".join(sorted(ways, reverse=True)) or None


POINT_TO_POINT = ("send", "recv")


def _point_to_point(node: Node, world: World) -> Callable:
    """A ``send`` (Isend of its input; its token output set once sent) or a ``recv``
    (Irecv into its output) to or from the peer's rank, matched by the node's tag."""
    peer = Device.parse(node.attrs["peer"])
    _check_world(tuple(sorted((world.rank, peer.rank))), world, f"node {node!r}")
    if peer.rank == world.rank:
        raise PurinecError(f"node {node!r}: {node.op} to its own rank; a copy within a rank "
                           f"is a copy node")
    tag = node.attrs["tag"]

    if node.op == "send":
        def send(x: np.ndarray, sent: np.ndarray) -> _Pending:
            sent[()] = False
            request = world.comm.Isend(x, dest=peer.rank, tag=tag)
            return _Pending([request], lambda: sent.fill(True))
        kernel = send
    else:
        def receive(y: np.ndarray) -> _Pending:
            return _Pending([world.comm.Irecv(y, source=peer.rank, tag=tag)], lambda: None)
        kernel = receive
    kernel.asynchronous = True
    return kernel


def mpi_kernel(node: Node, world: World) -> Callable:
    """The kernel of one physical collective (COLLECTIVES) on this rank.
    Creates the group's communicator if no earlier kernel did (see `comm_kernels`)."""
    if node.op not in COLLECTIVES:
        raise PurinecError(f"node {node!r}: no communication kernel for op {node.op}")
    group = _group(node)
    ranks = _ranks(group)
    if world.rank not in ranks:
        raise PurinecError(f"node {node!r} is on rank {world.rank}, which has no member in "
                           f"its group {node.attrs['group']}")
    local = [k for k, device in enumerate(group) if device.rank == world.rank]
    comm = None
    if len(ranks) > 1:
        _check_world(ranks, world, f"node {node!r}")
        comm = world.group_comm(ranks)
    if node.op == "allreduce":
        kernel = _Allreduce(node, len(local), comm)
    elif node.op == "reduce":
        kernel = _Reduce(node, ranks, local, comm, world.rank)
    elif node.op == "broadcast":
        kernel = _Broadcast(node, ranks, local, comm, world.rank)
    else:
        kernel = _Allgather(node, group, ranks, local, comm)
    kernel.asynchronous = comm is not None  # it posts and returns a Pending
    return kernel


def _group(node: Node) -> tuple[Device, ...]:
    return tuple(Device.parse(text) for text in node.attrs["group"].split(","))


def _ranks(group: tuple[Device, ...]) -> tuple[int, ...]:
    return tuple(sorted({device.rank for device in group}))


def _check_world(ranks: tuple[int, ...], world: World, where: str) -> None:
    if ranks[-1] >= world.size:
        raise PurinecError(f"{where} spans ranks {', '.join(map(str, ranks))} but this "
                           f"process is rank {world.rank} of {world.size}: run it under "
                           f"`mpiexec -n {ranks[-1] + 1}`")


# A tag no message of purinec's is sent with (MPI guarantees tags up to 32767): probing
# for it finds nothing, but runs MPI's progress engine, which moves every posted
# operation of this process along.
PROGRESS_TAG = 32767


def _progress() -> None:
    MPI = _mpi()
    MPI.COMM_WORLD.Iprobe(MPI.ANY_SOURCE, PROGRESS_TAG)


class _Pending:
    """Posted MPI requests; ``finish`` unpacks the result once they are all complete.
    ``nudge`` (any thread, any time) progresses them without completing them."""

    nudge = staticmethod(_progress)

    def __init__(self, requests: list, finish: Callable[[], None]):
        self.requests = requests
        self.finish = finish
        self.done = False

    def test(self) -> bool:
        if not self.done and _mpi().Request.Testall(self.requests):
            self._complete()
        return self.done

    def wait(self) -> None:
        if not self.done:
            _mpi().Request.Waitall(self.requests)
            self._complete()

    def _complete(self) -> None:
        self.finish()
        self.done = True


class _Allreduce:
    """Sum each of the ``tensors`` tensors over the members: locally first, then one
    in-place ``Iallreduce`` per dtype of the bucket, all its tensors packed together.
    One tensor of one member (a large gradient, one device a rank) needs no packing: it
    is reduced straight into its output."""

    def __init__(self, node: Node, members: int, comm):
        types = summand_types(node, members)
        self.direct = comm is not None and members == len(types) == 1
        if not self.direct:
            self.packing = Packing(types, members)
            self.copies = PerArrays(lambda arrays: (
                self.packing.packer(arrays[:self.count]),
                self.packing.unpacker(arrays[self.count:])))
        self.count, self.comm = members * len(types), comm

    def __call__(self, *arrays: np.ndarray) -> _Pending | None:
        if self.direct:
            return self._reduce_into(*arrays)
        pack, unpack = self.copies(arrays)
        pack()
        if self.comm is None:
            unpack()
            return None
        MPI = _mpi()
        requests = [self.comm.Iallreduce(MPI.IN_PLACE, buffer, MPI.SUM)
                    for buffer in self.packing.buffers.values()]
        return _Pending(requests, unpack)

    def _reduce_into(self, x: np.ndarray, y: np.ndarray) -> _Pending:
        """In place when the memory planner put the output over the input (it does when
        nothing else reads the input: no copy, no second buffer)."""
        MPI = _mpi()
        send = x
        if np.may_share_memory(x, y):
            if x.__array_interface__["data"][0] != y.__array_interface__["data"][0]:
                np.copyto(y, x)  # overlapping otherwise: not the planner's doing
            send = MPI.IN_PLACE
        return _Pending([self.comm.Iallreduce(send, y, MPI.SUM)], lambda: None)


class _Allgather:
    """Concatenate the members' pieces along ``axis``: each rank packs its pieces (axis
    moved first, so each is contiguous) as bytes in group order, one ``Iallgatherv``
    gathers every rank's block, and each output is filled piece by piece."""

    def __init__(self, node: Node, group, ranks, local: list[int], comm):
        axis, sizes = node.attrs["axis"], node.attrs["sizes"]
        if len(node.inputs) != len(local):
            raise PurinecError(f"node {node!r}: {len(node.inputs)} inputs for the "
                               f"{len(local)} member(s) of its group on this rank")
        for k, value in zip(local, node.inputs):
            if value.type.shape[axis] != sizes[k]:
                raise PurinecError(f"node {node!r}: input %{value.name} is {value.type}, "
                                   f"but member {group[k]}'s piece has extent {sizes[k]} "
                                   f"on axis {axis}")
        whole = node.outputs[0].type
        self.dtype = whole.dtype.numpy
        self.rest = tuple(n for i, n in enumerate(whole.shape) if i != axis)
        self.row_items = int(np.prod(self.rest, dtype=np.int64))
        row = self.row_items * self.dtype.itemsize
        # The gathered bytes: each rank's block in rank order, its members in group order.
        order = [k for r in ranks for k in range(len(group)) if group[k].rank == r]
        self.offsets = dict(zip(order, _starts([sizes[k] * row for k in order])))
        blocks = [sum(sizes[k] * row for k in order if group[k].rank == r) for r in ranks]
        self.counts = (blocks, _starts(blocks))
        self.received = np.empty(sum(blocks), np.uint8)
        self.sent = (self.received if comm is None
                     else np.empty(blocks[ranks.index(group[local[0]].rank)], np.uint8))
        self.first_rows = _starts(sizes)
        self.axis, self.sizes, self.local, self.comm = axis, sizes, local, comm
        self.copies = PerArrays(lambda arrays: (self.packer(arrays[:len(local)]),
                                                self.unpacker(arrays[len(local):])))

    def __call__(self, *arrays: np.ndarray) -> _Pending | None:
        pack, unpack = self.copies(arrays)
        pack()
        if self.comm is None:
            unpack()
            return None
        MPI = _mpi()
        request = self.comm.Iallgatherv([self.sent, MPI.BYTE],
                                        [self.received, self.counts, MPI.BYTE])
        return _Pending([request], unpack)

    def packer(self, inputs) -> Copies:
        """What puts this rank's pieces into ``sent``, axis first, in group order."""
        pairs, start = [], 0
        for k, piece in zip(self.local, inputs):
            pairs.append((self._rows(self.sent, start, k), np.moveaxis(piece, self.axis, 0)))
            start += piece.nbytes
        return Copies(pairs)

    def _rows(self, buffer: np.ndarray, start: int, k: int) -> np.ndarray:
        """Member ``k``'s piece in ``buffer`` from byte ``start``, axis first."""
        stop = start + self.sizes[k] * self.row_items * self.dtype.itemsize
        return buffer[start:stop].view(self.dtype).reshape((self.sizes[k], *self.rest))

    def unpacker(self, outputs) -> Copies:
        """What fills every output from the gathered bytes in ``received``."""
        return Copies([(np.moveaxis(out, self.axis, 0)[row:row + size],
                        self._rows(self.received, self.offsets[k], k))
                       for out in outputs
                       for k, (row, size) in enumerate(zip(self.first_rows, self.sizes))])


class _Reduce:
    """Sum the members' summands of each tensor onto the root: this rank's members'
    pieces added up in group order, then one ``Ireduce`` over the group's ranks to the
    root's rank (per dtype, a bucket's tensors packed together; one tensor is summed
    straight into its output). The outputs are the sums on the root's rank, and what
    this rank sent on the others."""

    def __init__(self, node: Node, ranks, local: list[int], comm, rank: int):
        types = summand_types(node, len(local))
        self.per, self.packing = len(types), None
        if self.per > 1:
            self.packing = Packing(types, len(local))
            self.copies = PerArrays(lambda arrays: (
                self.packing.packer(arrays[:-self.per]),
                self.packing.unpacker(arrays[-self.per:])))
        root = Device.parse(node.attrs["root"]).rank
        self.root, self.at_root, self.comm = ranks.index(root), root == rank, comm

    def __call__(self, *arrays: np.ndarray) -> _Pending | None:
        if self.packing is None:
            sum_in_order(*arrays)
            buffers, finish = arrays[-1:], lambda: None
        else:
            pack, finish = self.copies(arrays)
            pack()
            buffers = list(self.packing.buffers.values())
        if self.comm is None:
            finish()
            return None
        MPI = _mpi()
        if self.at_root:
            requests = [self.comm.Ireduce(MPI.IN_PLACE, b, MPI.SUM, root=self.root)
                        for b in buffers]
        else:
            requests = [self.comm.Ireduce(b, None, MPI.SUM, root=self.root) for b in buffers]
        return _Pending(requests, finish)


class _Broadcast:
    """The root's tensors to every member: one ``Ibcast`` from the root's rank into the
    first local output (a bucket's tensors packed into one buffer instead), then copied
    to the other local outputs."""

    def __init__(self, node: Node, ranks, local: list[int], comm, rank: int):
        root = Device.parse(node.attrs["root"]).rank
        types = broadcast_types(node.attrs)
        self.per, self.at_root = len(types), root == rank
        if (len(node.inputs) != self.per * self.at_root or
                len(node.outputs) != self.per * len(local)):
            raise PurinecError(f"node {node!r}: {len(node.inputs)} input(s) and "
                               f"{len(node.outputs)} output(s), but this rank has "
                               f"{'the' if self.at_root else 'not the'} root and "
                               f"{len(local)} member(s) of the group, {self.per} "
                               f"tensor(s) each")
        self.packing = Packing(types, 1) if self.per > 1 else None
        self.root, self.comm = ranks.index(root), comm
        inputs = self.per * self.at_root
        # The buffer sent, and the copies: the root's (before sending) fill it and the
        # outputs; the others' (once received) fill the outputs from it.
        self.copies = PerArrays(lambda arrays: broadcast_copies(
            arrays[:inputs], arrays[inputs:], self.packing))

    def __call__(self, *arrays: np.ndarray) -> _Pending | None:
        buffer, copies = self.copies(arrays)
        if self.at_root:
            copies()
        if self.comm is None:
            return None
        request = self.comm.Ibcast(buffer, root=self.root)
        return _Pending([request], (lambda: None) if self.at_root else copies)


def _starts(extents: list[int]) -> list[int]:
    """Where each of consecutive extents starts."""
    return [int(n) for n in np.cumsum([0, *extents[:-1]])]


def _mpi():
    from mpi4py import MPI

    return MPI


# ---------------------------------------------------------------------------------------
# Failing as one job.


def check_injected_failure() -> None:
    """Test hook, called by the executor at each graph's first run: the rank named by
    PURINEC_FAIL_RANK raises, as a real failure on one rank would."""
    target = os.environ.get(FAIL_RANK_VARIABLE)
    if target is None:
        return
    try:
        rank = int(target)
    except ValueError:
        raise PurinecError(f"{FAIL_RANK_VARIABLE}={target!r} is not a rank number") from None
    if rank == world().rank:
        raise ExecutionError(f"injected failure ({FAIL_RANK_VARIABLE}={target})")


def run_guarded(main: Callable[[], int]) -> int:
    """Run the command line's ``main`` and return its exit status. Under MPI with several
    ranks, a rank that fails (raises, returns non-zero, or is interrupted or terminated)
    says so on stderr and aborts the whole job with that status: the other ranks would
    otherwise wait for it in a collective forever. In a world of one this is just
    ``main()``."""
    here = world()
    if here.size == 1:
        return main()
    try:
        with terminating():
            status = main()
    except SystemExit as err:
        if not err.code:
            raise
        status = err.code if isinstance(err.code, int) else 1
        _abort(here, f"exited with status {err.code}", status)
    except PurinecError as err:
        _abort(here, str(err), 1)
    except KeyboardInterrupt as err:  # mpiexec passes Ctrl-C to every rank: no trace wanted
        _abort(here, *interruption(err))
    except BaseException as err:  # a bug: still end the job, with a trace
        traceback.print_exc()
        _abort(here, f"{type(err).__name__}: {err}", 1)
    if status:
        _abort(here, f"exited with status {status}", status)
    return status


# How long a failing rank lets the launcher forward its last words before aborting: Hydra
# ends every process (and drops what their pipes still hold) as soon as one aborts.
ABORT_GRACE = 0.5


def _abort(here: World, message: str, status: int) -> NoReturn:
    # Every rank meets a mistake in the command or the model (a layout that does not fit
    # the job, say) at about the same moment. Rank 0 speaks first and the others hold
    # their tongue a little longer than its grace, so the launcher usually ends them
    # before they repeat it; a rank failing alone is heard a moment later.
    if here.rank > 0:
        time.sleep(2 * ABORT_GRACE)
    print(f"purinec: rank {here.rank}: {message}", file=sys.stderr, flush=True)
    _unlink_shared_segments()
    time.sleep(ABORT_GRACE)
    # MPICH's Abort prints a line of its own ("Abort(1) on node 0 ...: application called
    # MPI_Abort"), which says nothing the line above did not: it goes nowhere.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
    here.comm.Abort(status)
    os._exit(status)  # MPICH's Abort may return before the launcher ends this process


# Where MPICH puts the memory ranks of one machine share (its queues, shared windows).
_MPICH_SEGMENT = "/dev/shm/mpich_shm_"


def _unlink_shared_segments() -> None:
    """Remove the names of the MPICH shared-memory segments this process has mapped. An
    aborted job never finalizes, so MPICH would leave them in /dev/shm for good; the
    memory itself goes once the job's last process exits (the others keep their
    mappings until then)."""
    for path in _mapped_segments(["/proc/self/maps"]):
        with contextlib.suppress(OSError):
            os.unlink(path)


# A segment younger than this may belong to a job still starting: MPICH creates the file
# a moment before it maps it.
STALE_AFTER = 60.0  # seconds


def _unlink_stale_segments() -> None:
    """Remove this user's MPICH segments that no process maps any more: those of a job
    whose ranks were all killed (by the launcher, after one was killed), which cleaned
    nothing. Run by the first rank on each machine as a job starts."""
    mine = [path for path in glob.glob(_MPICH_SEGMENT + "*") if _owned_and_old(path)]
    if not mine:
        return
    in_use = _mapped_segments(glob.glob("/proc/[0-9]*/maps"))
    for path in set(mine) - in_use:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _owned_and_old(path: str) -> bool:
    try:
        info = os.stat(path)
    except OSError:
        return False
    return info.st_uid == os.getuid() and time.time() - info.st_mtime > STALE_AFTER


def _mapped_segments(maps_files: list[str]) -> set[str]:
    """The MPICH segments mapped by the processes whose /proc maps are given (those that
    cannot be read, another user's, are skipped: their segments are not ours to remove)."""
    paths: set[str] = set()
    for maps in maps_files:
        try:
            with open(maps) as f:
                paths.update(_SEGMENT_IN_MAPS.findall(f.read()))
        except OSError:  # gone, another user's, or not Linux
            continue
    return paths


_SEGMENT_IN_MAPS = re.compile(re.escape(_MPICH_SEGMENT) + r"\S+")
