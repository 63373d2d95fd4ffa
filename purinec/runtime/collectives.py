"""Kernels for the communication nodes of a physical graph whose members all live in
this process: copies between device buffers, slices, and collectives over the local
members. Each sums or gathers once and writes the same bytes to every member, so
replicas stay bitwise identical; a parameter server's reduce sums the members' pieces in
group order onto the root, and its broadcast copies the root's tensor to every member.
Groups that span ranks get MPI kernels from `purinec.runtime.comm` instead.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from purinec.errors import PurinecError
from purinec.ir.graph import Node
from purinec.ir.ops import broadcast_types
from purinec.ir.types import TensorType

def host_kernel(node: Node) -> Callable:
    """The in-process kernel of a node whose op runs on the host (`Trait.host`) within
    one process: ``fn(*inputs, *outputs)``. (Across ranks, `comm.comm_kernels`.)"""
    try:
        make = _HOST_KERNELS[node.op]
    except KeyError:
        raise PurinecError(f"no in-process kernel for op {node.op} (node %{node.name}); "
                           f"it moves data between ranks") from None
    return make(node.attrs)


def _copy(x: np.ndarray, y: np.ndarray) -> None:
    np.copyto(y, x)


def _slicer(axis: int, start: int, stop: int) -> Callable:
    def fn(x: np.ndarray, y: np.ndarray) -> None:
        index = [slice(None)] * x.ndim
        index[axis] = slice(start, stop)
        np.copyto(y, x[tuple(index)])
    return fn


def _allreducer(tensors: int) -> Callable:
    """Each tensor's members added up in group order into the first member's output,
    which is then copied to the others'. An output may lie over its own input (memory
    planned in place): the first sum reads it before writing, the copies come after."""
    def fn(*arrays: np.ndarray) -> None:
        half = len(arrays) // 2
        xs, ys = arrays[:half], arrays[half:]
        for t in range(tensors):
            first, rest, total = xs[t], xs[tensors + t::tensors], ys[t]
            if rest:
                np.add(first, rest[0], out=total)
                for x in rest[1:]:
                    np.add(total, x, out=total)
            else:
                np.copyto(total, first)
            for y in ys[tensors + t::tensors]:
                np.copyto(y, total)
    return fn


def _allgatherer(axis: int) -> Callable:
    def fn(*arrays: np.ndarray) -> None:
        half = len(arrays) // 2
        xs, ys = arrays[:half], arrays[half:]
        np.concatenate(xs, axis=axis, out=ys[0])
        for y in ys[1:]:
            np.copyto(y, ys[0])
    return fn


def _broadcaster(tensors: int) -> Callable:
    """The root's ``tensors`` tensors, then every member's outputs (member-major)."""
    def fn(*arrays: np.ndarray) -> None:
        xs, ys = arrays[:tensors], arrays[tensors:]
        for i, y in enumerate(ys):
            np.copyto(y, xs[i % tensors])
    return fn


def reducer(tensors: int) -> Callable:
    """Each of ``tensors`` tensors' members (``fn``'s inputs, member-major) summed in
    group order into its output (``fn``'s last ``tensors`` arrays)."""
    def fn(*arrays: np.ndarray) -> None:
        xs, totals = arrays[:-tensors], arrays[-tensors:]
        for t, total in enumerate(totals):
            sum_in_order(*xs[t::tensors], total)
    return fn


def sum_in_order(*arrays: np.ndarray) -> None:
    """The members' pieces (in group order), then the output: their sum, added up in
    that order (a reduce's, here and in the MPI kernel's local part)."""
    xs, total = arrays[:-1], arrays[-1]
    np.copyto(total, xs[0])
    for x in xs[1:]:
        np.add(total, x, out=total)


class Copies:
    """(destination, source) array pairs, made once and copied at every call: for small
    tensors, making the views costs more than the copies."""

    def __init__(self, pairs: list[tuple[np.ndarray, np.ndarray]]):
        self.pairs = pairs

    def __call__(self) -> None:
        for destination, source in self.pairs:
            np.copyto(destination, source)


class PerArrays:
    """What ``make(arrays)`` returned for the latest call's arrays, made again only when
    they are not the same objects as the call before's. A plan passes a kernel the same
    arena views at every call, so what a collective derives from them (copies between
    its buffers and the arrays, their offsets) is made once; it keeps the arrays alive
    until the next call's differ."""

    def __init__(self, make: Callable[[tuple[np.ndarray, ...]], Any]):
        self.make = make
        self.arrays: tuple[np.ndarray, ...] | None = None
        self.made: Any = None

    def __call__(self, arrays: tuple[np.ndarray, ...]) -> Any:
        last = self.arrays
        if last is None or len(arrays) != len(last) or any(
                a is not b for a, b in zip(arrays, last)):
            self.made = self.make(arrays)
            self.arrays = arrays
        return self.made


def summand_types(node: Node, members: int) -> list[TensorType]:
    """The types of the tensors each member gives a sum (an allreduce's or reduce's
    bucket), checked against the node's inputs."""
    per = node.attrs["tensors"]
    if len(node.inputs) != members * per:
        raise PurinecError(f"node {node!r}: {len(node.inputs)} inputs, but its group has "
                           f"{members} member(s) on this rank with {per} tensor(s) each")
    if any(value.type.dtype.numpy == np.bool_ for value in node.inputs[:per]):
        raise PurinecError(f"node {node!r}: cannot sum bool tensors")
    return [value.type for value in node.inputs[:per]]


class Packing:
    """A bucket's tensors (``types``) packed together, one contiguous buffer per dtype (a
    segment per tensor), with what packs given arrays into it and unpacks it (`packer`,
    `unpacker`: made once for the arrays of a plan, used at every call).
    ``allocate(size, dtype)`` makes each buffer (shared memory, for
    `purinec.runtime.shm`)."""

    def __init__(self, types: list[TensorType], members: int,
                 allocate: Callable[[int, np.dtype], np.ndarray] = np.empty):
        sizes: dict[np.dtype, int] = {}
        spans = []  # for each tensor: its dtype's buffer and its place in it
        for t in types:
            start = sizes.get(t.dtype.numpy, 0)
            sizes[t.dtype.numpy] = start + t.size
            spans.append((t.dtype.numpy, start, start + t.size))
        self.buffers = {dtype: allocate(size, dtype) for dtype, size in sizes.items()}
        self.segments = [self.buffers[dtype][start:stop] for dtype, start, stop in spans]
        self.members, self.per = members, len(types)

    def packer(self, inputs) -> Callable[[], None]:
        """What adds up each tensor's pieces from this rank's members (``inputs``, in
        group order) into its segment."""
        def into(t: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return self.segments[t].reshape(x.shape), x

        copies = Copies([into(t, inputs[t]) for t in range(self.per)])
        adds = [into(t, inputs[m * self.per + t])
                for t in range(self.per) for m in range(1, self.members)]
        return functools.partial(_copy_then_add, copies, adds) if adds else copies

    def unpacker(self, outputs) -> Copies:
        """What copies the segments out to every member's outputs."""
        return Copies([(out, self.segments[i % self.per].reshape(out.shape))
                       for i, out in enumerate(outputs)])


def broadcast_copies(inputs, outputs, packing: Packing | None
                     ) -> tuple[np.ndarray, Copies]:
    """The buffer a broadcast sends or receives on one rank (``packing``'s, of one dtype;
    None: the first local output, flat), and its copies there: the root's ``inputs``
    (none on another rank) into the buffer, then the buffer into every local output
    (member-major) that is not the buffer itself."""
    if packing is None:
        [buffer] = segments = [outputs[0].reshape(-1)]
    else:
        [buffer] = packing.buffers.values()
        segments = packing.segments
    per = len(segments)
    shaped = [segment.reshape(out.shape) for segment, out in zip(segments, outputs)]
    pairs = [(segment, x) for segment, x in zip(shaped, inputs)]
    pairs += [(out, shaped[i % per]) for i, out in enumerate(outputs)
              if out.ctypes.data != shaped[i % per].ctypes.data]
    return buffer, Copies(pairs)


def _copy_then_add(copies: Copies, adds: list[tuple[np.ndarray, np.ndarray]]) -> None:
    copies()
    for total, x in adds:
        np.add(total, x, out=total)


_HOST_KERNELS: dict[str, Callable[[dict], Callable]] = {
    "copy": lambda attrs: _copy,
    "slice": lambda attrs: _slicer(attrs["axis"], attrs["start"], attrs["stop"]),
    "allreduce": lambda attrs: _allreducer(attrs["tensors"]),
    "allgather": lambda attrs: _allgatherer(attrs["axis"]),
    "reduce": lambda attrs: reducer(attrs["tensors"]),
    "broadcast": lambda attrs: _broadcaster(len(broadcast_types(attrs))),
}
