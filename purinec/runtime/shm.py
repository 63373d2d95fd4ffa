"""Collectives through shared memory, for a group of ranks on one machine.

MPI's collectives between processes of one machine copy the data through MPICH's
shared-memory queues and sum it inside MPI calls, a piece per call: on lenet over two
ranks that cost 1.5-2 ms of each rank's only core per iteration, most of it in the tests
polling the operations between kernels. Here the group's ranks instead allocate their
memory arenas (and the kernels' staging buffers) in one MPI-3 shared window
(``MPI.Win.Allocate_shared``), so a rank can read and write every rank's buffers where
they lie, and a collective is one pass over memory:

1. post: a rank writes where its buffers lie (byte offsets in its own segment) into its
   control words for the kernel (when they change), fences and sets ``ready`` to the
   call's step number;
2. once every rank is ready, the work, cut into items that whoever claims them (an
   atomic compare-and-swap) does: an allreduce's buffers (its outputs where they lie,
   or a bucket packed) in one share per rank, whose claimer sums every rank's copy in
   rank order and stores the sum into all of them,
   so every rank ends with the same bytes, as replicas must; a parameter server's
   reduce likewise, adding into the root's copy only; its broadcast, a copy of the
   root's tensor into each other rank's buffer. A rank does items only when it has
   nothing else to do (`Pending.help`): then it claims every item left, its own
   first. So a rank busy in a long kernel holds nobody up, and the work falls to the
   rank that would otherwise wait: on a machine whose ranks each have a core, the
   sums of a rank slowed down cost it nothing. An allgather's rank copies every
   rank's block into its own result at its first test, then sets ``done``;
3. the operation is complete when every item is done (a counter beside the claims),
   or for an allgather every rank is done: no rank will touch this rank's buffers
   again, so the memory planner may reuse them.

Each kernel counts its calls, the same on every rank, so steps only grow and neither a
flag nor a claim ever needs resetting. MPI allocates and maps the memory; the ranks
synchronise through it with the CPU's own atomics and fences (`purinec.runtime.atomics`),
not MPI's one-sided calls, which cost ten to twenty times as much. A buffer outside the
window (a caller's array) is staged through the kernel's buffers, which are in it.

The window is allocated when the plan places the arenas (`SharedGroup.allocate`), which
is collective over the group's ranks; it is never freed (``MPI_Win_free`` is collective
too, and ranks drop programs at different times), but closing the program gives the
pages of its arenas back (`SharedGroup.release`, each rank on its own), and the rest
goes when the process exits. A group shares memory only when every one of its ranks
agrees, when kernels are built, that the group is on one machine, and, when the arenas
are placed, that the machine's /dev/shm (where MPICH puts windows) has room; otherwise
its kernels are MPI's. ``PURINEC_SHARED_MEMORY=0`` turns this off. A rank whose
collectives span several groups of ranks has a window for each; its arenas lie in the
first (`SharedGroup.order`), and the other groups' kernels stage their buffers.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import time
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from purinec.errors import PurinecError
from purinec.ir.graph import Node
from purinec.ir.ops import broadcast_types
from purinec.ir.types import Device
from purinec.runtime import sums
from purinec.runtime.atomics import compare_and_swap, fence, fetch_add, ready as ready_atomics
from purinec.runtime.collectives import (Copies, Packing, PerArrays, broadcast_copies,
                                         reducer, summand_types)
from purinec.runtime.memory import ALIGNMENT, aligned
from purinec.runtime.plan import FreshArenas, aligned_start

if TYPE_CHECKING:
    from purinec.runtime.comm import World

SWITCH_VARIABLE = "PURINEC_SHARED_MEMORY"
SHAREABLE = ("allreduce", "allgather", "reduce", "broadcast")
# Where MPICH creates the files behind shared windows.
SHARED_MEMORY_DIR = "/dev/shm"

# ALIGNMENT (the arenas' 64 bytes) is a cache line: ranks writing neighbouring chunks
# never share one.
# Each kernel has its control words on each rank, on cache lines of their own (int64):
# ready, done, then the byte offset of each of its buffers in the rank's segment.
READY, DONE, OFFSETS = 0, 1, 2


def shared_groups(spans: Sequence[tuple[int, ...]], world: "World") -> dict:
    """The spans (sorted tuples of ranks, this rank among them) of a rank's SHAREABLE
    collectives that get a `SharedGroup`: collective over each span's ranks, in sorted
    order, as the communicators are made."""
    if not spans:
        return {}  # (and a world of one never imports MPI)
    from mpi4py import MPI

    wanted = os.environ.get(SWITCH_VARIABLE, "1") != "0"
    groups = {}
    for ranks in sorted(spans):
        comm = world.group_comm(ranks)
        machine = comm.Split_type(MPI.COMM_TYPE_SHARED)
        one_machine = machine.Get_size() == comm.Get_size()
        machine.Free()
        if comm.allreduce(wanted and one_machine, op=MPI.LAND):
            groups[ranks] = SharedGroup(comm, ranks)
    return groups


def shared_kernel(node: Node, mpi_kernel: Callable, group: "SharedGroup") -> Callable:
    """The kernel of a SHAREABLE node over ``group``; ``mpi_kernel`` (comm.py's) runs
    it if the group's memory cannot be shared after all."""
    kinds = {"allreduce": SharedAllreduce, "allgather": SharedAllgather,
             "reduce": SharedReduce, "broadcast": SharedBroadcast}
    return kinds[node.op](node, group, mpi_kernel)


def _paged(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


class SharedGroup:
    """The ranks of one group on one machine and the kernels that work over them; once
    the plan has called `allocate`, ``shared`` says whether they share memory. A plan
    whose kernels work over several groups allocates in ``order`` (the same on every
    rank, as allocating is collective), its arenas in the first group's window."""

    def __init__(self, comm, ranks: tuple[int, ...]):
        self.comm, self.order = comm, ranks
        self.kernels: list[_SharedCollective] = []
        self.shared: bool | None = None  # not known until `allocate`
        ready_atomics()

    def allocate(self, arena_bytes: dict[Device, int]) -> dict[Device, np.ndarray]:
        """Each device's arena of ``arena_bytes`` bytes: in a shared window (collective
        over the group's ranks), to which the kernels are then bound, when every rank
        agrees there is room; else private memory, and the kernels use MPI. This rank's
        segment: the kernels' control words and claims, then, on pages of their own, the
        kernels' staging buffers and the arenas."""
        from mpi4py import MPI

        if self.shared is not None:
            raise PurinecError("a shared-memory group's kernels serve one plan; these are "
                               "already bound to another")
        counts = self.comm.allgather(len(self.kernels))
        if len(set(counts)) > 1:
            raise PurinecError(f"ranks disagree on the collectives they share: "
                               f"{', '.join(map(str, counts))} kernels")
        size = self.comm.size
        controls, claims, top = {}, {}, 0
        for kernel in self.kernels:
            controls[kernel], top = top, top + aligned(8 * (OFFSETS + kernel.buffer_count))
        for kernel in self.kernels:
            claims[kernel], top = top, top + aligned(8 * kernel.claim_words(size))
        # The rest (scratch, which `release` gives back) on whole pages of its own.
        control = top = _paged(top)
        starts = {}
        for kernel in self.kernels:
            starts[kernel], top = top, top + aligned(kernel.staging_bytes)
        for device in sorted(arena_bytes):
            starts[device], top = top, top + aligned(arena_bytes[device])
        top = _paged(top)
        self._scratch = (control, top)
        top += ALIGNMENT  # room to align the segment's start
        self.shared = self.comm.allreduce(_room(self.comm.allreduce(top)), op=MPI.LAND)
        if not self.shared:
            return FreshArenas.allocate(arena_bytes)
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # each rank's segment on its own pages
        try:
            self.window = MPI.Win.Allocate_shared(top, 1, info, comm=self.comm)
        finally:
            info.Free()
        _WINDOWS.append(self.window)
        self.segments = [_aligned_segment(self.window, r) for r in range(size)]
        mine = self.segments[self.comm.rank]
        mine[:control] = 0  # no step is ready, done or claimed yet
        for kernel in self.kernels:
            staging = mine[starts[kernel]:starts[kernel] + kernel.staging_bytes]
            kernel.bind(controls[kernel], claims[kernel], staging)
        fence()
        self.comm.Barrier()  # every rank's control words are zero before any is read
        return {device: mine[starts[device]:starts[device] + arena_bytes[device]]
                for device in arena_bytes}

    def release(self) -> None:
        """Give the pages of this rank's staging buffers and arenas back to the system
        (``MADV_REMOVE``: they read as zeros when next touched). Not collective: once a
        call has returned here, no rank touches these buffers until the next one, and
        what a call leaves there is scratch. The control words stay, with their steps."""
        if not self.shared or not hasattr(mmap, "MADV_REMOVE"):
            return
        base = self.segments[self.comm.rank].ctypes.data
        start = _paged(base + self._scratch[0])  # whole pages only, rounding inwards
        stop = (base + self._scratch[1]) // mmap.PAGESIZE * mmap.PAGESIZE
        if stop <= start:
            return
        if _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start),
                           mmap.MADV_REMOVE) != 0:
            raise PurinecError(f"could not give back shared memory: "
                               f"{os.strerror(ctypes.get_errno())}")

    def offset(self, array: np.ndarray) -> int | None:
        """Where ``array`` (contiguous) lies in this rank's segment, in bytes; None when
        it lies elsewhere."""
        mine = self.segments[self.comm.rank]
        start = array.ctypes.data - mine.ctypes.data
        return start if 0 <= start and start + array.nbytes <= mine.nbytes else None


# Every window made, kept until the process exits (see the module's docstring).
_WINDOWS: list = []


@functools.cache
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _room(machine_bytes: int) -> bool:
    """Whether SHARED_MEMORY_DIR can hold ``machine_bytes`` more (a mapped file there
    that outgrows it kills the process with SIGBUS, not an error); true where it is not
    a directory to ask."""
    try:
        stat = os.statvfs(SHARED_MEMORY_DIR)
    except OSError:
        return True
    return machine_bytes < stat.f_bavail * stat.f_frsize


def _aligned_segment(window, rank: int) -> np.ndarray:
    """Rank ``rank``'s segment of ``window`` as bytes, from its first ALIGNMENT-aligned
    byte (the segment has ALIGNMENT bytes to spare)."""
    memory, _ = window.Shared_query(rank)
    raw = np.frombuffer(memory, np.uint8)
    return aligned_start(raw, raw.nbytes - ALIGNMENT)


class _SharedCollective:
    """What a collective over a `SharedGroup` does in every case (see the module's
    docstring); `_stage` (the buffers to publish) and `_advance` (this rank's part) are
    the op's."""

    asynchronous = True
    buffer_count = 1  # the most buffers a call publishes

    def __init__(self, node: Node, group: SharedGroup, fallback: Callable,
                 staging_bytes: int):
        self.node, self.group, self.fallback = node, group, fallback
        self.staging_bytes = staging_bytes
        self.arena_allocator = group
        self.step = 0
        self.controls: list[np.ndarray] | None = None
        self._staged = PerArrays(self._restage)
        self._views: tuple[tuple, list] = ((), [])
        group.kernels.append(self)

    def claim_words(self, size: int) -> int:
        """How many int64 words of rank 0's segment the ranks share, over ``size`` ranks
        (see `_ClaimedWork`)."""
        return 0

    def bind(self, control: int, claims: int, staging: np.ndarray) -> None:
        """The kernel's control words from byte ``control`` of each rank's segment, its
        shared words from byte ``claims`` of rank 0's, and ``staging`` bytes in this
        rank's."""
        segments, rank = self.group.segments, self.group.comm.rank
        words = OFFSETS + self.buffer_count
        self.controls = [segment[control:control + 8 * words].view(np.int64)
                         for segment in segments]
        self.mine = self.controls[rank]
        self.peers = [c for q, c in enumerate(self.controls) if q != rank]
        shared = self.claim_words(len(segments))
        self.claims = segments[0][claims:claims + 8 * shared].view(np.int64)
        self._bind_staging(staging)

    def __call__(self, *arrays: np.ndarray):
        if self.group.shared is False:
            return self.fallback(*arrays)
        if self.controls is None:
            raise PurinecError(f"node {self.node!r}: its shared-memory kernel was never "
                               f"given its window (its plan did not allocate the arenas "
                               f"through `arena_allocator`)")
        staged = self._staged(arrays)
        staged.prepare()
        self.step += 1
        fence()  # the data and its offsets before the flag
        self.mine[READY] = self.step
        return _SharedPending(self, staged.buffers, staged.finish)

    def _restage(self, arrays) -> "_Staged":
        """What a call with ``arrays`` (not the last call's) uses, its buffers' offsets
        published for the other ranks (read once they see this call's flag)."""
        staged = _Staged(*self._stage(arrays), self.group)
        self.mine[OFFSETS:OFFSETS + len(staged.offsets)] = staged.offsets
        return staged

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

    def __init__(self, buffers, prepare, finish, group: SharedGroup):
        self.buffers, self.prepare, self.finish = buffers, prepare, finish
        self.offsets = [group.offset(buffer) for buffer in buffers]


class _SharedPending:
    """One call of a shared-memory collective in flight, complete once every rank's
    part is done: `test` says whether it is (an allgather's rank also copies its part
    once every rank is ready); `help` also does what work is left."""

    def __init__(self, kernel: _SharedCollective, buffers: list[np.ndarray],
                 finish: Callable[[], None]):
        self.kernel, self.buffers, self.finish = kernel, buffers, finish
        self.step = kernel.step
        self.ready = self.done = False
        self.tried = False  # (`_ClaimedWork`) whether this rank has claimed what it could

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
            fence()  # the peers' data after their flags
            self.ready = True
        if not kernel._advance(self, idle):
            return False
        fence()  # the others' writes before reading the result
        self.finish()
        self.done = True
        return True


def _nothing() -> None:
    pass


def _packed_bytes(types) -> int:
    """The staging bytes a `Packing` of ``types`` takes from `_staging_allocator`: a
    buffer per dtype, each from an aligned byte."""
    per_dtype: dict = {}
    for t in types:
        per_dtype[t.dtype] = per_dtype.get(t.dtype, 0) + t.nbytes
    return sum(aligned(nbytes) for nbytes in per_dtype.values())


def _staging_allocator(staging: np.ndarray) -> Callable[[int, np.dtype], np.ndarray]:
    """A `Packing`'s ``allocate(size, dtype)``: consecutive buffers in the bytes
    ``staging``, each from an aligned byte."""
    top = 0

    def allocate(size: int, dtype) -> np.ndarray:
        nonlocal top
        start, nbytes = top, size * np.dtype(dtype).itemsize
        top += aligned(nbytes)
        return staging[start:start + nbytes].view(dtype)

    return allocate


class _ClaimedWork(_SharedCollective):
    """A collective whose work, once every rank is ready, is cut into items any rank may
    do (`_items`, `_do`): a rank with nothing else to do (`help`) claims every item
    still unclaimed, its own (`_owned`) first, and a busy one (`test`) none, so a rank
    busy in a long kernel does not hold up the others, and on a machine whose ranks
    each have a core the work falls to a rank that would otherwise wait for the slowest
    (lenet over two ranks: 0.2-1.5% faster than each rank summing its own chunk at its
    first test, same processes, taking turns). A claim is an atomic compare-and-swap of
    the item's word in rank 0's segment from the last step to this one; a rank that
    has done an item adds one to a counter beside them, and the operation is complete
    on every rank when the counter reaches step x items."""

    def claim_words(self, size: int) -> int:
        return self._items(size) + 1  # a claim per item, then the counter

    def _items(self, size: int) -> int:
        raise NotImplementedError

    def _owned(self, size: int, rank: int) -> list[int]:
        raise NotImplementedError

    def _do(self, item: int, buffers: list[np.ndarray]) -> None:
        raise NotImplementedError

    def bind(self, control: int, claims: int, staging: np.ndarray) -> None:
        super().bind(control, claims, staging)
        size, rank = len(self.controls), self.group.comm.rank
        self.items = self._items(size)
        own = self._owned(size, rank)
        self.claim_order = own + [i for i in range(self.items) if i not in own]

    def _advance(self, pending: "_SharedPending", idle: bool) -> bool:
        if idle and not pending.tried:
            pending.tried = True
            self._try(self.claim_order, pending)
        return self.claims[self.items] >= pending.step * self.items

    def _try(self, items: list[int], pending: "_SharedPending") -> None:
        step = pending.step
        for item in items:
            if compare_and_swap(self.claims, item, step - 1, step) == step - 1:
                self._do(item, pending.buffers)
                fetch_add(self.claims, self.items, 1)  # the counter (after the stores)


class _Sum(_ClaimedWork):
    """A sum over the members (an allreduce's or a reduce's) of a bucket's tensors, in
    one buffer a tensor in the window: where this rank's outputs of the sums all lie in
    the window (the planner's arena), the outputs themselves, summed where they lie
    (`_into_place` puts this rank's part there first); otherwise their segments of the
    kernel's staging buffers, into which this rank's members' pieces are packed. Either
    way, buffer i is tensor i on every rank. The buffers' elements, taken as one
    sequence, are cut into one share per rank (`_shares`), which is an item: `_combine`
    says what its claimer does with every rank's copy of each of its pieces."""

    def __init__(self, node: Node, group: SharedGroup, fallback: Callable):
        members = len(node.inputs) // node.attrs["tensors"]
        self.types = summand_types(node, members)
        super().__init__(node, group, fallback, _packed_bytes(self.types))
        self.members = members
        self.per = self.buffer_count = len(self.types)
        self._chunked: tuple[list | None, list] = (None, [])

    def _items(self, size: int) -> int:
        return size

    def _owned(self, size: int, rank: int) -> list[int]:
        return [rank]

    def _bind_staging(self, staging: np.ndarray) -> None:
        self.packing = Packing(self.types, self.members, _staging_allocator(staging))

    def _stage(self, arrays):
        inputs, outputs = self._operands(arrays)
        if len(outputs) == self.per and all(
                self.group.offset(y) is not None for y in outputs):
            return ([y.reshape(-1) for y in outputs], self._into_place(inputs, outputs),
                    _nothing)
        packing = self.packing
        return packing.segments, packing.packer(inputs), packing.unpacker(outputs)

    def _operands(self, arrays) -> tuple[Sequence[np.ndarray], Sequence[np.ndarray]]:
        raise NotImplementedError

    def _into_place(self, inputs, outputs) -> Callable[[], None]:
        """What puts this rank's part of each sum into its output, at every call."""
        raise NotImplementedError

    def _do(self, item: int, buffers: list[np.ndarray]) -> None:
        for copies in self._chunks(buffers)[item]:
            self._combine(copies)

    def _chunks(self, buffers: list[np.ndarray]) -> list[list[list[np.ndarray]]]:
        """Each item's pieces, each in every rank's copy, made again only when some
        rank's buffers have moved (`views`)."""
        views = self.views([b.nbytes for b in buffers])
        if views is not self._chunked[0]:
            shares = _shares([b.size for b in buffers], [b.itemsize for b in buffers],
                             len(self.controls))
            chunks = [[[copy.view(buffers[i].dtype)[lo:hi] for copy in views[i]]
                       for i, lo, hi in share] for share in shares]
            self._chunked = (views, chunks)
        return self._chunked[1]

    def _combine(self, copies: list[np.ndarray]) -> None:
        raise NotImplementedError


class SharedAllreduce(_Sum):
    """The sum over the members, into every rank's copy (see `_Sum`, `_ClaimedWork`):
    a chunk's claimer adds every rank's copy in rank order and stores the sum into all
    of them, so every rank gets the same bytes."""

    def __init__(self, node: Node, group: SharedGroup, fallback: Callable):
        super().__init__(node, group, fallback)
        self.count = len(node.inputs)

    def _operands(self, arrays):
        return arrays[:self.count], arrays[self.count:]

    def _into_place(self, inputs, outputs) -> Callable[[], None]:
        pairs = [(y, x) for x, y in zip(inputs, outputs) if x.ctypes.data != y.ctypes.data]
        return Copies(pairs) if pairs else _nothing

    def bind(self, control: int, claims: int, staging: np.ndarray) -> None:
        super().bind(control, claims, staging)
        for dtype in {t.dtype.numpy for t in self.types}:
            sums.ready(dtype, len(self.controls))

    def _combine(self, copies: list[np.ndarray]) -> None:
        sums.sum_into_each(copies)


class SharedReduce(_Sum):
    """A parameter server's reduce (see `_Sum`, `_ClaimedWork`): a chunk's claimer adds
    the other ranks' copies (in rank order) into the root's. The root's outputs are the
    sums; another rank's, what it gave (its copy, which nobody writes)."""

    def __init__(self, node: Node, group: SharedGroup, fallback):
        super().__init__(node, group, fallback)
        self.root = fallback.root  # the root's rank in the group's communicator

    def _operands(self, arrays):
        return arrays[:-self.per], arrays[-self.per:]

    def _into_place(self, inputs, outputs) -> Callable[[], None]:
        return functools.partial(reducer(self.per), *inputs, *outputs)

    def _combine(self, copies: list[np.ndarray]) -> None:
        total = copies[self.root]
        for q, other in enumerate(copies):
            if q != self.root:
                np.add(total, other, out=total)


class SharedBroadcast(_ClaimedWork):
    """A parameter server's broadcast (see `_ClaimedWork`): the root's tensors, packed
    into the staging buffer (one tensor: in its first output instead, where that lies in
    the window), and an item per other rank: copy that buffer into the rank's own, from
    which the rank copies them to its outputs."""

    def __init__(self, node: Node, group: SharedGroup, fallback):
        self.types = broadcast_types(node.attrs)
        super().__init__(node, group, fallback, _packed_bytes(self.types))
        self.root, self.at_root = fallback.root, fallback.at_root

    def _items(self, size: int) -> int:
        return size

    def _owned(self, size: int, rank: int) -> list[int]:
        return [rank]

    def _bind_staging(self, staging: np.ndarray) -> None:
        self.packing = Packing(self.types, 1, _staging_allocator(staging))

    def _stage(self, arrays):
        per = len(self.types)
        inputs, outputs = (arrays[:per], arrays[per:]) if self.at_root else ((), arrays)
        direct = per == 1 and self.group.offset(outputs[0]) is not None
        buffer, copies = broadcast_copies(inputs, outputs, None if direct else self.packing)
        return [buffer], *((copies, _nothing) if self.at_root else (_nothing, copies))

    def _do(self, item: int, buffers: list[np.ndarray]) -> None:
        if item != self.root:
            [copies] = self.views([buffers[0].nbytes])
            np.copyto(copies[item], copies[self.root])


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
        return ([self.layout.sent], self.layout.packer(arrays[:count]),
                self.layout.unpacker(arrays[count:]))

    def _advance(self, pending: "_SharedPending", idle: bool) -> bool:
        """Every rank's block copied into this rank's result (once), then complete
        when every rank has done the same: none reads this rank's block any more."""
        if self.mine[DONE] < pending.step:
            blocks, starts = self.layout.counts
            received = self.layout.received
            [sent] = self.views([max(blocks)])
            for nbytes, start, block in zip(blocks, starts, sent):
                np.copyto(received[start:start + nbytes], block[:nbytes])
            fence()
            self.mine[DONE] = pending.step
        return all(control[DONE] >= pending.step for control in self.peers)


def _shares(sizes: Sequence[int], itemsizes: Sequence[int], parts: int
            ) -> list[list[tuple[int, int, int]]]:
    """The elements of buffers of ``sizes`` (and ``itemsizes``), taken as one sequence,
    cut into ``parts`` shares as even as cache lines allow: for each share, its pieces
    (buffer, lo, hi), none empty. A cut within a buffer falls on one of its cache lines,
    so ranks writing neighbouring shares never write one line."""
    total, start = sum(sizes), 0
    shares: list[list[tuple[int, int, int]]] = [[] for _ in range(parts)]
    for i, (n, itemsize) in enumerate(zip(sizes, itemsizes)):
        per_line = max(1, ALIGNMENT // itemsize)

        def cut(part: int) -> int:
            local = min(max(total * part // parts - start, 0), n)
            return local if local == n else local // per_line * per_line

        for part in range(parts):
            lo, hi = cut(part), cut(part + 1)
            if lo < hi:
                shares[part].append((i, lo, hi))
        start += n
    return shares
