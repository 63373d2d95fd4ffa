"""Allreduce and allgather through shared memory, for a group of ranks on one machine.

MPI's collectives between processes of one machine copy the data through MPICH's
shared-memory queues and sum it inside MPI calls, a piece per call: on lenet over two
ranks that cost 1.5-2 ms of each rank's only core per iteration, most of it in the tests
polling the operations between kernels. Here the group's ranks instead allocate their
memory arenas (and the kernels' staging buffers) in one MPI-3 shared window
(``MPI.Win.Allocate_shared``), so a rank can read and write every rank's buffers where
they lie, and a collective is one pass over memory:

1. post: a rank writes where its buffers lie (byte offsets in its own segment) into its
   control line for the kernel, fences (``Win.Sync``) and sets ``ready`` to the call's
   step number;
2. once every rank is ready, the work: an allreduce's buffers are cut into one chunk
   per rank, and whoever claims a chunk (an atomic compare-and-swap) sums every rank's
   copy of it in rank order and stores the sum into all of them, so every rank ends
   with the same bytes, as replicas must. A rank claims its own chunks at its first
   test after everyone is ready, and any chunk left when it has nothing else to do
   (`Pending.help`), so a rank busy in a long kernel holds nobody up. An allgather's
   rank copies every rank's block into its own result, then sets ``done``;
3. the operation is complete when every chunk is summed (a counter beside the claims)
   or every rank is done: no rank will touch this rank's buffers again, so the memory
   planner may reuse them.

Each kernel counts its calls, the same on every rank, so steps only grow and neither a
flag nor a claim ever needs resetting. A buffer outside the window (a caller's array) is staged through
the kernel's buffers, which are in it.

The window is allocated when the plan places the arenas (`SharedGroup.allocate`), which
is collective over the group's ranks; it is never freed (``MPI_Win_free`` is collective
too, and ranks drop programs at different times): its memory goes when the process
exits. A group shares memory only when every one of its ranks agrees, when kernels are
built, that the group is on one machine and is the only group of ranks the graph's
allreduces and allgathers span (a rank's arenas can lie in one window only), and, when
the arenas are placed, that the machine's /dev/shm (where MPICH puts windows) has room;
otherwise its kernels are MPI's. ``PURINEC_SHARED_MEMORY=0`` turns this off.
"""

from __future__ import annotations

import functools
import os
import time
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from purinec.errors import PurinecError
from purinec.ir.graph import Node
from purinec.ir.types import Device
from purinec.runtime.collectives import Packing, summands
from purinec.runtime.plan import aligned_bytes

if TYPE_CHECKING:
    from purinec.runtime.comm import World

SWITCH_VARIABLE = "PURINEC_SHARED_MEMORY"
SHAREABLE = ("allreduce", "allgather")
# Where MPICH creates the files behind shared windows.
SHARED_MEMORY_DIR = "/dev/shm"

ALIGNMENT = 64  # a cache line: ranks writing neighbouring chunks never share one
# Each kernel has one control line per rank, int64 words: ready, done, then the byte
# offset of each of its buffers (one per dtype of a bucket) in the rank's segment.
READY, DONE, OFFSETS = 0, 1, 2
CONTROL_WORDS = ALIGNMENT // 8
MAX_BUFFERS = CONTROL_WORDS - OFFSETS


def shared_groups(spans: Sequence[tuple[int, ...]], world: "World") -> dict:
    """The spans (sorted tuples of ranks, this rank among them) of a rank's SHAREABLE
    collectives that get a `SharedGroup`: collective over each span's ranks, in sorted
    order, as the communicators are made."""
    if not spans:
        return {}  # (and a world of one never imports MPI)
    from mpi4py import MPI

    wanted = len(spans) == 1 and os.environ.get(SWITCH_VARIABLE, "1") != "0"
    groups = {}
    for ranks in sorted(spans):
        comm = world.group_comm(ranks)
        machine = comm.Split_type(MPI.COMM_TYPE_SHARED)
        one_machine = machine.Get_size() == comm.Get_size()
        machine.Free()
        if comm.allreduce(wanted and one_machine, op=MPI.LAND):
            groups[ranks] = SharedGroup(comm)
    return groups


def shared_kernel(node: Node, mpi_kernel: Callable, group: "SharedGroup") -> Callable:
    """The kernel of a SHAREABLE node over ``group``; ``mpi_kernel`` (comm.py's) runs
    it if the group's memory cannot be shared after all."""
    if node.op == "allreduce":
        return SharedAllreduce(node, group, mpi_kernel)
    return SharedAllgather(node, group, mpi_kernel)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class SharedGroup:
    """The ranks of one group on one machine and the kernels that work over them; once
    the plan has called `allocate`, ``shared`` says whether they share memory."""

    def __init__(self, comm):
        self.comm = comm
        self.kernels: list[_SharedCollective] = []
        self.shared: bool | None = None  # not known until `allocate`

    def allocate(self, arena_bytes: dict[Device, int]) -> dict[Device, np.ndarray]:
        """Each device's arena of ``arena_bytes`` bytes: in a shared window (collective
        over the group's ranks), to which the kernels are then bound, when every rank
        agrees there is room; else private memory, and the kernels use MPI. This rank's
        segment: the kernels' control lines, their staging buffers, the arenas."""
        from mpi4py import MPI

        if self.shared is not None:
            raise PurinecError("a shared-memory group's kernels serve one plan; these are "
                               "already bound to another")
        counts = self.comm.allgather(len(self.kernels))
        if len(set(counts)) > 1:
            raise PurinecError(f"ranks disagree on the collectives they share: "
                               f"{', '.join(map(str, counts))} kernels")
        size = self.comm.size
        claims, top = {}, len(self.kernels) * ALIGNMENT
        for kernel in self.kernels:
            claims[kernel], top = top, top + _aligned(8 * kernel.claim_words(size))
        control = top
        starts = {}
        for kernel in self.kernels:
            starts[kernel], top = top, top + _aligned(kernel.staging_bytes)
        for device in sorted(arena_bytes):
            starts[device], top = top, top + _aligned(arena_bytes[device])
        top += ALIGNMENT  # room to align the segment's start
        self.shared = self.comm.allreduce(_room(self.comm.allreduce(top)), op=MPI.LAND)
        if not self.shared:
            return {device: aligned_bytes(n) for device, n in arena_bytes.items()}
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # each rank's segment on its own pages
        try:
            self.window = MPI.Win.Allocate_shared(top, 1, info, comm=self.comm)
        finally:
            info.Free()
        _WINDOWS.append(self.window)
        self.window.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch: Win.Sync is then a fence
        self.segments, self.shifts = zip(*[_aligned_segment(self.window, r)
                                           for r in range(size)])
        mine = self.segments[self.comm.rank]
        mine[:control] = 0  # no step is ready, done or claimed yet
        for k, kernel in enumerate(self.kernels):
            kernel.bind(k, claims[kernel], mine[starts[kernel]:starts[kernel] + kernel.staging_bytes])
        self.window.Sync()
        self.comm.Barrier()  # every rank's control lines are zero before any is read
        return {device: mine[starts[device]:starts[device] + arena_bytes[device]]
                for device in arena_bytes}

    def offset(self, array: np.ndarray) -> int | None:
        """Where ``array`` (contiguous) lies in this rank's segment, in bytes; None when
        it lies elsewhere."""
        mine = self.segments[self.comm.rank]
        start = array.ctypes.data - mine.ctypes.data
        return start if 0 <= start and start + array.nbytes <= mine.nbytes else None

    def fence(self) -> None:
        self.window.Sync()


# Every window made, kept until the process exits (see the module's docstring).
_WINDOWS: list = []


def _room(machine_bytes: int) -> bool:
    """Whether SHARED_MEMORY_DIR can hold ``machine_bytes`` more (a mapped file there
    that outgrows it kills the process with SIGBUS, not an error); true where it is not
    a directory to ask."""
    try:
        stat = os.statvfs(SHARED_MEMORY_DIR)
    except OSError:
        return True
    return machine_bytes < stat.f_bavail * stat.f_frsize


def _aligned_segment(window, rank: int) -> tuple[np.ndarray, int]:
    """Rank ``rank``'s segment of ``window`` as bytes, from its first ALIGNMENT-aligned
    byte (the segment has ALIGNMENT bytes to spare), and how far into the segment that
    byte is."""
    memory, _ = window.Shared_query(rank)
    raw = np.frombuffer(memory, np.uint8)
    shift = -raw.ctypes.data % ALIGNMENT
    return raw[shift:shift + raw.nbytes - ALIGNMENT], shift


class _SharedCollective:
    """What a collective over a `SharedGroup` does in every case (see the module's
    docstring); `_stage` (the buffers to publish) and `_advance` (this rank's part) are
    the op's."""

    asynchronous = True

    def __init__(self, node: Node, group: SharedGroup, fallback: Callable,
                 staging_bytes: int):
        self.node, self.group, self.fallback = node, group, fallback
        self.staging_bytes = staging_bytes
        self.arena_allocator = group.allocate
        self.step = 0
        self.controls: list[np.ndarray] | None = None
        self._staged = _Staged((), [], _nothing, _nothing, group)
        self._views: tuple[tuple, list] = ((), [])
        group.kernels.append(self)

    def claim_words(self, size: int) -> int:
        """How many int64 words of rank 0's segment the ranks share, over ``size`` ranks
        (see `SharedAllreduce`)."""
        return 0

    def bind(self, k: int, claims: int, staging: np.ndarray) -> None:
        """Kernel ``k`` of the group's window, its shared words from byte ``claims`` of
        rank 0's segment, and ``staging`` bytes in this rank's segment."""
        segments, rank = self.group.segments, self.group.comm.rank
        self.controls = [s[k * ALIGNMENT:(k + 1) * ALIGNMENT].view(np.int64) for s in segments]
        self.mine = self.controls[rank]
        self.peers = [c for q, c in enumerate(self.controls) if q != rank]
        words = self.claim_words(len(segments))
        self.claims = segments[0][claims:claims + 8 * words].view(np.int64)
        self.claims_disp = self.group.shifts[0] + claims  # for MPI's atomics
        self._bind_staging(staging)

    def __call__(self, *arrays: np.ndarray):
        if self.group.shared is False:
            return self.fallback(*arrays)
        if self.controls is None:
            raise PurinecError(f"node {self.node!r}: its shared-memory kernel was never "
                               f"given its window (its plan did not allocate the arenas "
                               f"through `arena_allocator`)")
        staged = self._staged
        if len(arrays) != len(staged.arrays) or any(
                a is not b for a, b in zip(arrays, staged.arrays)):
            staged = self._staged = _Staged(arrays, *self._stage(arrays), self.group)
        staged.prepare()
        self.step += 1
        self.mine[OFFSETS:OFFSETS + len(staged.offsets)] = staged.offsets
        self.group.fence()  # the data and its offsets before the flag
        self.mine[READY] = self.step
        return _SharedPending(self, staged.buffers, staged.finish)

    def views(self, nbytes: Sequence[int]) -> list[list[np.ndarray]]:
        """Every rank's buffers of this call, as bytes (``nbytes[i]``: buffer i's length
        on each rank; a list per buffer, rank order). Offsets rarely change between
        calls (arenas are planned once), so the views made last time usually serve."""
        key = tuple(int(c[OFFSETS + i]) for c in self.controls for i in range(len(nbytes)))
        if key != self._views[0]:
            size = len(self.controls)
            self._views = (key, [
                [self.group.segments[q][key[q * len(nbytes) + i]:][:n] for q in range(size)]
                for i, n in enumerate(nbytes)])
        return self._views[1]

    def _bind_staging(self, staging: np.ndarray) -> None:
        raise NotImplementedError

    def _stage(self, arrays) -> tuple[list[np.ndarray], Callable[[], None],
                                      Callable[[], None]]:
        """For a call with ``arrays``: the buffers (in the window) to publish, what
        fills them at each call, and what to do once complete. Made again only when
        the arrays change: the plan's arena views stay the same objects."""
        raise NotImplementedError

    def _advance(self, pending: "_SharedPending", idle: bool) -> bool:
        """Once every rank is ready: do this rank's part (more of it when ``idle``);
        whether the operation is complete."""
        raise NotImplementedError


class _Staged:
    """What `_SharedCollective._stage` said for one set of arrays, and the buffers'
    offsets in this rank's segment."""

    def __init__(self, arrays, buffers, prepare, finish, group: SharedGroup):
        self.arrays, self.buffers, self.prepare, self.finish = arrays, buffers, prepare, finish
        self.offsets = [group.offset(buffer) for buffer in buffers]


class _SharedPending:
    """One call of a shared-memory collective in flight: `test` does this rank's part
    once every rank is ready, and is true once every rank has done its own."""

    def __init__(self, kernel: _SharedCollective, buffers: list[np.ndarray],
                 finish: Callable[[], None]):
        self.kernel, self.buffers, self.finish = kernel, buffers, finish
        self.step = kernel.step
        self.ready = self.done = False
        self.untried: list[int] | None = None  # chunks this rank may still claim

    def test(self) -> bool:
        return self._check(idle=False)

    def help(self) -> bool:
        return self._check(idle=True)

    def wait(self) -> None:
        while not self.help():
            time.sleep(0)

    def _check(self, idle: bool) -> bool:
        if self.done:
            return True
        kernel = self.kernel
        if not self.ready:
            for control in kernel.peers:
                if control[READY] < self.step:
                    return False
            kernel.group.fence()  # the peers' data after their flags
            self.ready = True
        if not kernel._advance(self, idle):
            return False
        kernel.group.fence()  # the others' writes before reading the result
        self.finish()
        self.done = True
        return True


def _nothing() -> None:
    pass


class SharedAllreduce(_SharedCollective):
    """The sum over the members (see the module's docstring). One tensor of one member
    whose output lies in the window (the planner's arena) is summed where it lies;
    anything else is packed into the kernel's staging buffers first (this rank's
    members' pieces added up in group order) and unpacked after.

    Each buffer is cut into one chunk per rank, and whoever claims a chunk sums it
    (every rank's copy of it, in rank order, then the sum stored into all of them): a
    rank claims its own chunks when it first finds everyone ready, and, when it has
    nothing else to do (`help`), any chunk still unclaimed, so a rank busy in a long
    kernel does not hold up the others. A claim is an atomic compare-and-swap of the
    chunk's word in rank 0's segment from the last step to this one; a rank that has
    summed a chunk adds one to a counter beside them, and the operation is complete on
    every rank when the counter reaches step x chunks."""

    def __init__(self, node: Node, group: SharedGroup, fallback: Callable):
        per = node.attrs["tensors"]
        members = len(node.inputs) // per
        summands(node, members)
        if len({v.type.dtype for v in node.inputs[:per]}) > MAX_BUFFERS:
            raise PurinecError(f"node {node!r}: a bucket of more than {MAX_BUFFERS} dtypes")
        super().__init__(node, group, fallback,
                         sum(_aligned(v.type.nbytes) for v in node.inputs[:per]))
        self.members, self.count = members, len(node.inputs)
        self.single = members == per == 1
        self.buffer_count = len({v.type.dtype for v in node.inputs[:per]})
        # MPI's atomics take and give their operands in arrays.
        self._compare, self._swap, self._result = (np.zeros(1, np.int64) for _ in range(3))
        self._one = np.ones(1, np.int64)

    def claim_words(self, size: int) -> int:
        return self.buffer_count * size + 1  # a claim per chunk, then the counter

    def _bind_staging(self, staging: np.ndarray) -> None:
        top = 0

        def allocate(size: int, dtype) -> np.ndarray:
            nonlocal top
            start, nbytes = top, size * np.dtype(dtype).itemsize
            top += _aligned(nbytes)
            return staging[start:start + nbytes].view(dtype)

        self.packing = Packing(self.node, self.members, allocate)

    def _stage(self, arrays):
        inputs, outputs = arrays[:self.count], arrays[self.count:]
        if self.single and self.group.offset(outputs[0]) is not None:
            x, y = inputs[0], outputs[0]
            same = x.ctypes.data == y.ctypes.data
            return [y.reshape(-1)], _nothing if same else functools.partial(np.copyto, y, x), _nothing
        return (list(self.packing.buffers.values()),
                functools.partial(self.packing.pack, inputs),
                functools.partial(self.packing.unpack, outputs))

    def _advance(self, pending: "_SharedPending", idle: bool) -> bool:
        size, rank = self.group.comm.size, self.group.comm.rank
        chunks = self.buffer_count * size
        if pending.untried is None:  # chunk c is chunk c % size of buffer c // size
            own = [i * size + rank for i in range(self.buffer_count)]
            pending.untried = own + [c for c in range(chunks) if c not in own]
        tries = pending.untried if idle else pending.untried[:self.buffer_count]
        for c in list(tries):
            pending.untried.remove(c)
            if self._claim(c, pending.step):
                self._sum_chunk(pending.buffers, c // size, c % size)
                self.group.fence()
                self._count_summed()
        return self.claims[chunks] >= pending.step * chunks

    def _claim(self, chunk: int, step: int) -> bool:
        self._compare[0], self._swap[0] = step - 1, step
        window = self.group.window
        window.Compare_and_swap(self._swap, self._compare, self._result, 0,
                                target_disp=self.claims_disp + 8 * chunk)
        window.Flush(0)
        return self._result[0] == step - 1

    def _count_summed(self) -> None:
        from mpi4py import MPI

        chunks = len(self.claims) - 1
        window = self.group.window
        window.Fetch_and_op(self._one, self._result, 0,
                            target_disp=self.claims_disp + 8 * chunks, op=MPI.SUM)
        window.Flush(0)

    def _sum_chunk(self, buffers: list[np.ndarray], i: int, r: int) -> None:
        """Chunk ``r`` of buffer ``i``: every rank's copy summed in rank order, and the
        sum stored into each."""
        buffer = buffers[i]
        lo, hi = _chunk(buffer.size, buffer.itemsize, r, self.group.comm.size)
        if lo == hi:
            return
        views = self.views([b.nbytes for b in buffers])[i]
        copies = [copy.view(buffer.dtype)[lo:hi] for copy in views]
        total = copies[0]
        for other in copies[1:]:
            np.add(total, other, out=total)
        for other in copies[1:]:
            np.copyto(other, total)


class SharedAllgather(_SharedCollective):
    """The members' pieces concatenated: each rank packs its pieces into its staging
    buffer as MPI's kernel does (``layout``, comm.py's, which is also the fallback),
    copies every rank's block into its result, and unpacks it."""

    def __init__(self, node: Node, group: SharedGroup, layout):
        super().__init__(node, group, layout, layout.sent.nbytes)
        self.layout = layout

    def _bind_staging(self, staging: np.ndarray) -> None:
        self.layout.sent = staging

    def _stage(self, arrays):
        count = len(self.layout.local)
        return ([self.layout.sent], functools.partial(self.layout.pack, arrays[:count]),
                functools.partial(self.layout.unpack, arrays[count:]))

    def _advance(self, pending: "_SharedPending", idle: bool) -> bool:
        """Every rank's block copied into this rank's result (once), then complete
        when every rank has done the same: none reads this rank's block any more."""
        if pending.untried is None:
            blocks, starts = self.layout.counts
            received = self.layout.received
            [sent] = self.views([max(blocks)])
            for nbytes, start, block in zip(blocks, starts, sent):
                np.copyto(received[start:start + nbytes], block[:nbytes])
            self.group.fence()
            self.mine[DONE] = pending.step
            pending.untried = []
        return all(control[DONE] >= pending.step for control in self.peers)


def _chunk(n: int, itemsize: int, rank: int, size: int) -> tuple[int, int]:
    """Rank ``rank``'s share of ``n`` items: consecutive, starting on a cache line."""
    per_line = max(1, ALIGNMENT // itemsize)

    def bound(r: int) -> int:
        return n if r == size else n * r // size // per_line * per_line

    return bound(rank), bound(rank + 1)
