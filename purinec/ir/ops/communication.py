"""Communication: what the boxing pass inserts where a producer's distribution differs
from what its consumer needs. In a logical graph (one value per logical tensor, with a
distribution) each is the identity on the logical tensor; the partitioner turns it into
one physical node per rank whose inputs and outputs are that rank's members' pieces, in
group order (see purinec.passes.parallel). `group` lists the devices, comma-separated.
These ops run in the runtime on the host (`Trait.host`), never as generated kernels.
"""

from __future__ import annotations

import itertools

import numpy as np

from purinec.errors import VerifyError
from purinec.ir.ops.helpers import dtype_attr, fail, free, shape_attr
from purinec.ir.ops.registry import Attr, FusionKind, OpDef, Trait, register
from purinec.ir.types import Device, DType, TensorType

I, X = FusionKind.injective, FusionKind.opaque
HOST = frozenset({Trait.host})
MOVES = frozenset({Trait.host, Trait.communicates})
BUCKETS = MOVES | {Trait.bucketable}


def _summands(node) -> int:
    """An allreduce or reduce adds each member's tensors into the sum."""
    return sum(v.type.size for v in node.inputs)


def _group_attr(op: str, attrs: dict) -> tuple:
    try:
        group = tuple(Device.parse(d) for d in attrs["group"].split(","))
    except ValueError as err:
        raise VerifyError(f"op {op}: attribute group: {err}") from None
    if len(set(group)) != len(group):
        raise VerifyError(f"op {op}: group {attrs['group']} names a device twice")
    return group


def _copy_infer(types, attrs):
    return [types[0]]


def _check_per_member(op: str, types, per: int, group: tuple) -> None:
    """Inputs that are ``per`` tensors for each of this rank's members of ``group``,
    every member's alike."""
    if per < 1 or len(types) % per or len(types) // per > len(group):
        raise fail(op, f"{len(types)} inputs are not {per} tensor(s) for each of at "
                       f"most {len(group)} local member(s) of the group")
    for i, t in enumerate(types):
        if t != types[i % per]:
            raise fail(op, f"input {i} is {t} but the same tensor on the first member "
                           f"is {types[i % per]}")


def _allreduce_infer(types, attrs):
    _check_per_member("allreduce", types, attrs["tensors"], _group_attr("allreduce", attrs))
    return list(types)


def _allreduce_ref(*xs, group, tensors):
    members = len(xs) // tensors
    if members != len(group.split(",")):
        raise ValueError("allreduce across ranks has no in-process reference")
    sums = [sum(xs[m * tensors + t] for m in range(members)).astype(xs[t].dtype)
            for t in range(tensors)]
    return tuple(sums[i % tensors].copy() for i in range(len(xs)))


def _allgather_infer(types, attrs):
    group = _group_attr("allgather", attrs)
    axis, sizes = attrs["axis"], attrs["sizes"]
    if len(sizes) != len(group) or any(n < 0 for n in sizes):
        raise fail("allgather", f"sizes {sizes} must give one extent per group member "
                                 f"({len(group)})")
    if len(types) > len(group):
        raise fail("allgather", f"{len(types)} inputs for a group of {len(group)}")
    out = []
    for t in types:
        if not 0 <= axis < t.rank:
            raise fail("allgather", f"axis {axis} out of range for {t}")
        if t.shape[axis] not in (*sizes, sum(sizes)):
            raise fail("allgather", f"input {t} has extent {t.shape[axis]} on axis {axis}, "
                                     f"not one of the pieces {sizes}")
        shape = list(t.shape)
        shape[axis] = sum(sizes)
        out.append(t.with_shape(shape))
    return out


def _allgather_ref(*xs, group, axis, sizes):
    if len(xs) == 1 and xs[0].shape[axis] == sum(sizes):  # logical: the identity
        return (xs[0].copy(),)
    if len(xs) != len(sizes):
        raise ValueError("allgather across ranks has no in-process reference")
    whole = np.concatenate(xs, axis=axis)
    return tuple(whole.copy() for _ in xs)


def _root_attr(op: str, attrs: dict, group: tuple):
    """The ``root`` device of a reduce or broadcast, which must be in its group."""
    try:
        root = Device.parse(attrs["root"])
    except ValueError as err:
        raise VerifyError(f"op {op}: attribute root: {err}") from None
    if root not in group:
        raise VerifyError(f"op {op}: root {root} is not in its group {attrs['group']}; "
                          f"the root must be one of the group's devices")
    return root


def _reduce_infer(types, attrs):
    group = _group_attr("reduce", attrs)
    _root_attr("reduce", attrs, group)
    _check_per_member("reduce", types, attrs["tensors"], group)
    return list(types[:attrs["tensors"]])


def _reduce_ref(*xs, group, root, tensors):
    if len(xs) != tensors * len(group.split(",")):
        raise ValueError("reduce across ranks has no in-process reference")
    totals = []
    for t in range(tensors):
        total = xs[t].copy()
        for x in xs[t + tensors::tensors]:  # in group order, as the runtime's kernels sum
            total += x
        totals.append(total)
    return tuple(totals)


def broadcast_types(attrs: dict) -> list[TensorType]:
    """The tensors a broadcast sends: ``shape`` cut into one shape per tensor by
    ``ndims`` (each tensor's number of dimensions; none: one tensor), all ``dtype``."""
    shape = shape_attr("broadcast", attrs)
    ndims = attrs.get("ndims") or [len(shape)]
    if any(n < 0 for n in ndims) or sum(ndims) != len(shape):
        raise fail("broadcast", f"ndims={list(ndims)} does not cut shape={list(shape)} "
                                 f"into tensors (their numbers of dimensions must add up "
                                 f"to the shape's {len(shape)} entries)")
    dtype, starts = dtype_attr("broadcast", attrs), [0, *itertools.accumulate(ndims)]
    return [TensorType(shape[a:b], dtype) for a, b in zip(starts[:-1], starts[1:])]


def _broadcast_infer(types, attrs):
    group = _group_attr("broadcast", attrs)
    _root_attr("broadcast", attrs, group)
    tensors = broadcast_types(attrs)
    if types and list(types) != tensors:
        raise fail("broadcast", f"takes the root's {', '.join(map(str, tensors))} (or "
                                 f"nothing, on a rank without the root), got "
                                 f"{', '.join(map(str, types))}")
    if not 1 <= attrs["members"] <= len(group):
        raise fail("broadcast", f"members={attrs['members']} is not between 1 and the "
                                 f"group's {len(group)}")
    return tensors * attrs["members"]


def _broadcast_ref(*xs, group, root, shape, dtype, members, ndims):
    if not xs:
        raise ValueError("broadcast from another rank has no in-process reference")
    return tuple(x.copy() for _ in range(members) for x in xs)


def _slice_infer(types, attrs):
    x = types[0]
    axis, start, stop = attrs["axis"], attrs["start"], attrs["stop"]
    if not 0 <= axis < x.rank:
        raise fail("slice", f"axis {axis} out of range for {x}")
    if not 0 <= start <= stop <= x.shape[axis]:
        raise fail("slice", f"[{start}:{stop}] is outside axis {axis} of {x}")
    shape = list(x.shape)
    shape[axis] = stop - start
    return [x.with_shape(shape)]


def _slice_ref(x, axis, start, stop):
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop)
    return (np.ascontiguousarray(x[tuple(index)]),)


def _send_infer(types, attrs):
    _peer_attr("send", attrs)
    return [TensorType((), DType.bool)]


def _recv_infer(types, attrs):
    _peer_attr("recv", attrs)
    return [TensorType(shape_attr("recv", attrs), dtype_attr("recv", attrs))]


def _peer_attr(op: str, attrs: dict):
    try:
        return Device.parse(attrs["peer"])
    except ValueError as err:
        raise VerifyError(f"op {op}: attribute peer: {err}") from None


def _across_ranks(op: str):
    def refuse(*args, **kwargs):
        raise ValueError(f"{op} moves data between MPI ranks; it has no in-process reference")
    return refuse


def spans_ranks(node) -> bool:
    """Whether ``node`` talks to other ranks: a send or receive, or a collective whose
    group does."""
    if node.op in ("send", "recv"):
        return True
    group = node.attrs.get("group")
    return group is not None and len({Device.parse(d).rank for d in group.split(",")}) > 1


register(OpDef("copy", ("x",), _copy_infer, lambda x: (x.copy(),), X, flops=free,
               traits=MOVES, doc="the same tensor on another device"))
register(OpDef("allreduce", ("xs",), _allreduce_infer, _allreduce_ref, X,
               attrs={"group": Attr("str"), "tensors": Attr("int", 1)}, variadic=True,
               flops=_summands, traits=BUCKETS | {Trait.in_place},
               doc="sum over the group's members; inputs and outputs are `tensors` tensors "
                   "for each member on this rank, in group order"))
register(OpDef("allgather", ("xs",), _allgather_infer, _allgather_ref, X,
               attrs={"group": Attr("str"), "axis": Attr("int"), "sizes": Attr("ints")},
               variadic=True, flops=free, traits=MOVES,
               doc="every member gets the concatenation of the members' pieces along axis; "
                   "one input and one output for each member on this rank"))
# A parameter server's conversions (data parallelism with --parallel ps): the partial
# gradients summed onto the server, and its new weights sent to every member.
register(OpDef("reduce", ("xs",), _reduce_infer, _reduce_ref, X,
               attrs={"group": Attr("str"), "root": Attr("str"), "tensors": Attr("int", 1)},
               variadic=True, flops=_summands, traits=BUCKETS,
               doc="sum over the group's members onto `root`; inputs are `tensors` tensors "
                   "for each member on this rank, in group order; the outputs are their "
                   "sums on the root's rank, and what this rank sent toward it on the "
                   "others"))
register(OpDef("broadcast", (), _broadcast_infer, _broadcast_ref, X,
               attrs={"group": Attr("str"), "root": Attr("str"), "shape": Attr("ints"),
                      "dtype": Attr("str", "f32"), "members": Attr("int", 1),
                      "ndims": Attr("ints", [])},
               variadic=True,  # the root's tensors on its rank, nothing on the others
               flops=free, traits=BUCKETS,
               doc="root's tensors (a bucket: `shape` holds their shapes one after another, "
                   "`ndims` their numbers of dimensions; none: one tensor) to every member "
                   "of the group; each tensor for each member on this rank, in group order"))


# A copy between ranks: the sending rank's half (its output is a token that the send
# completed, read by nobody) and the receiving rank's, matched by tag.
register(OpDef("send", ("x",), _send_infer, _across_ranks("send"), X,
               attrs={"peer": Attr("str"), "tag": Attr("int")}, flops=free, traits=MOVES,
               doc="x to device `peer` on another rank; the output says it was sent"))
register(OpDef("recv", (), _recv_infer, _across_ranks("recv"), X,
               attrs={"peer": Attr("str"), "tag": Attr("int"), "shape": Attr("ints"),
                      "dtype": Attr("str", "f32")}, flops=free, traits=MOVES,
               doc="the tensor that `peer` on another rank sends with the same tag"))
register(OpDef("slice", ("x",), _slice_infer, _slice_ref, I,
               attrs={"axis": Attr("int"), "start": Attr("int"), "stop": Attr("int")},
               flops=free, traits=HOST,
               doc="x[start:stop] along axis (boxing's local piece of a replicated value)"))
