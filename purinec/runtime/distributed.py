"""Running one rank's physical graph behind the logical graph's names.

A distributed program keeps the logical graph's interface: it is fed whole inputs and
holds one array per parameter. `DistributedExecutable` hands each local group member its
piece: a split input as a view of the rows it owns, a replicated parameter as the
caller's own array for the first local member (so in-place updates land there) and as
a replica for every other member. The replicas are updated by the same kernels on the
same bytes, so they stay identical; when the caller passes a different array for a
variable (new weights were set), the replicas are refreshed from it. The executables of
one program (its training step and its inference graph) share one `Replicas`: a step
updates the caller's array in place, and the inference graph's replicas must follow.
Outputs come back under their logical names, from the first local member.

When ``physical`` can keep variables on its devices between calls (`keep_variables`,
`purinec.runtime.gpu.GpuExecutable`) and every variable is replicated on this rank, so
can this executable: every member's copy stays on its device, `pull` fetches the first
member's, and `host_changed` refreshes the replicas too.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from purinec.ir.graph import Graph, member_name
from purinec.ir.types import Device, DistKind

VARIABLE_ROLES = ("param", "state")


class Replicas:
    """The copies of replicated variables held for the local devices after the first,
    by (variable, device), and the caller's array each variable's copies were made from
    (or last updated with)."""

    def __init__(self):
        self.arrays: dict[tuple[str, Device], np.ndarray] = {}
        self.synced: dict[str, np.ndarray] = {}


class DistributedExecutable:
    """``exe(env) -> outputs`` over logical names, running ``physical`` (an executable
    of the physical graph of ``rank``) in a job of ``ranks`` ranks (a program's
    inference graph may live on fewer ranks than its training graph); ``replicas`` may
    be shared with the other executables of a program."""

    def __init__(self, logical: Graph, physical: Callable, rank: int, ranks: int,
                 replicas: Replicas | None = None):
        self.physical = physical
        self.inputs = [(v, v.dist.members_on(rank)) for v in logical.inputs]
        self.outputs = [(name, v.dist.members_on(rank), len(v.dist.group))
                        for name, v in logical.outputs]
        self.variables = {v.name for v in logical.inputs_with_role(*VARIABLE_ROLES)}
        self.ranks = ranks
        # What a call passes of each input this rank has members of, by their physical
        # names: the array itself (`_whole`: physical name -> logical name), a replica
        # to each member after the first of a variable (`_replicated`), or each member
        # its piece (`_split`, by name, with where each lies in the whole).
        self._whole: list[tuple[str, str]] = []
        self._replicated: list[tuple] = []
        self._split: dict[str, tuple] = {}
        for v, members in self.inputs:
            names = [member_name(v.name, k, len(v.dist.group)) for k, _ in members]
            if v.dist.kind is DistKind.split and members:
                self._split[v.name] = (members, names,
                                       [_piece_index(v, v.type.shape, k) for k, _ in members])
            elif v.name in self.variables and len(members) > 1:
                self._replicated.append((v.name, members, names))
            else:
                self._whole += [(physical, v.name) for physical in names]
        # Whether some variable is not whole on this rank after a step (until
        # `gather_variables`).
        self.spans_ranks = any(self._elsewhere(v, members) for v, members in self.inputs)
        # Outputs other than variables that live on some ranks only (a pipeline's loss on
        # its last stage): their owner broadcasts them after each call, so every rank
        # returns them.
        self.owners = {name: min(d.rank for d in v.dist.group) for name, v in logical.outputs
                       if name not in self.variables and self._on_some_ranks(v)}
        self.replicas = replicas or Replicas()
        self.kept: frozenset[str] = frozenset()
        self._members: dict[str, list[str]] = {}  # each kept variable's physical names
        self._returned = self._returns()

    def _returns(self) -> list[tuple]:
        """What a call returns of each output this rank has members of (kept variables
        excepted): its name, the first member's physical name, the other members' devices
        and physical names, whether it is a variable, and how many members it has."""
        return [(name, member_name(name, members[0][0], n),
                 [(device, member_name(name, k, n)) for k, device in members[1:]],
                 name in self.variables, n)
                for name, members, n in self.outputs if members and name not in self.kept]

    def keep_variables(self) -> frozenset[str]:
        """Keep the variables on the devices between calls, where ``physical`` can and
        each variable is replicated over this rank's members (see the module doc)."""
        keep = getattr(self.physical, "keep_variables", None)
        members = self._variable_members()
        if keep is None or members is None:
            return frozenset()
        kept = keep()
        self._members = members
        self.kept = frozenset(name for name, names in members.items()
                              if all(member in kept for member in names))
        self._returned = self._returns()
        return self.kept

    def _variable_members(self) -> dict[str, list[str]] | None:
        """Each variable's physical names on this rank, or None if one is split or lives
        on other ranks only."""
        members = {}
        for v, on_rank in self.inputs:
            if v.name in self.variables:
                if v.dist.kind is DistKind.split or not on_rank:
                    return None
                members[v.name] = [member_name(v.name, k, len(v.dist.group))
                                   for k, _ in on_rank]
        return members

    def pull(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Copy the devices' values of these kept variables into ``arrays``."""
        self.physical.pull({self._members[name][0]: array
                            for name, array in arrays.items()})

    def host_changed(self, names) -> None:
        """The caller's arrays of these variables changed: refresh them everywhere."""
        self.physical.host_changed([m for name in names for m in self._members[name]])
        for name in names:
            self.replicas.synced.pop(name, None)

    def __call__(self, env: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        physical_env = {physical: env[name] for physical, name in self._whole}
        for name, members, names in self._replicated:
            physical_env.update(self._replicas(name, env[name], members, names))
        split_variables = {}
        for name, (members, names, indices) in self._split.items():
            pieces = self._pieces(env[name], members, indices)
            physical_env.update(zip(names, [piece for _, piece in pieces.values()]))
            if name in self.variables:
                split_variables[name] = (env[name], pieces)
        results = self.physical(physical_env)
        outputs = {}
        for name, first, others, is_variable, n in self._returned:
            if name in split_variables:
                outputs[name] = self._assembled(name, n, results, *split_variables[name])
                continue
            value = outputs[name] = results[first]
            if is_variable:
                for device, physical in others:
                    self.replicas.arrays[name, device] = results[physical]
                self.replicas.synced[name] = value
        self._share_outputs(outputs)
        return outputs

    def _share_outputs(self, outputs: dict[str, np.ndarray]) -> None:
        """Every rank gets the outputs that live elsewhere (variables excepted: see
        `gather_variables`); every rank takes part, in the same order."""
        if not self.owners:
            return
        from purinec.runtime import comm

        world = comm.world()
        for name, owner in self.owners.items():
            outputs[name] = world.comm.bcast(outputs.get(name), root=owner)

    def _on_some_ranks(self, v) -> bool:
        return len({d.rank for d in v.dist.group}) < self.ranks

    @staticmethod
    def _pieces(array: np.ndarray, members, indices: list[tuple]
                ) -> dict[int, tuple[tuple, np.ndarray]]:
        """Member -> (index into ``array``, its piece): a view where the piece is
        contiguous (always along axis 0), so in-place updates land in ``array``."""
        return {k: (index, np.ascontiguousarray(array[index]))
                for (k, _), index in zip(members, indices)}

    @staticmethod
    def _assembled(name: str, n: int, results, array: np.ndarray, pieces) -> np.ndarray:
        """A split variable's next value, written back into the caller's array where a
        piece was not updated in place. (On this rank's members only: a variable split
        over ranks is whole on no rank.)"""
        for k, (index, piece) in pieces.items():
            result = results[member_name(name, k, n)]
            if result is not piece:
                array[index] = result
        return array

    def _elsewhere(self, v, members) -> bool:
        """Whether this rank lacks some of variable ``v`` after a step: pieces of a split
        one, or all of one that lives on other ranks only."""
        return v.name in self.variables and (
            not members or v.dist.kind is DistKind.split and len(members) < len(v.dist.group))

    def gather_variables(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Make every variable whole in ``arrays`` (the program's own, by name) on every
        rank: each rank sends the pieces its members hold of split variables, and the
        variables that some rank lacks whole. Collective: every rank must call it."""
        from purinec.runtime import comm

        world = comm.world()
        if world.size == 1:
            return
        needed = [v for v, members in self.inputs if v.name in self.variables and
                  (v.dist.kind is DistKind.split or self._on_some_ranks(v))]
        mine = {}
        for v, members in self.inputs:
            if v not in needed or not members:
                continue
            if v.dist.kind is DistKind.split:
                _, _, indices = self._split[v.name]
                mine[v.name] = {k: piece for k, (_, piece) in
                                self._pieces(arrays[v.name], members, indices).items()}
            else:
                mine[v.name] = {None: arrays[v.name]}
        for theirs in world.comm.allgather(mine):
            for v in needed:
                array = arrays[v.name]
                for k, piece in theirs.get(v.name, {}).items():
                    array[... if k is None else _piece_index(v, array.shape, k)] = piece

    def _replicas(self, name: str, array: np.ndarray, members, names: list[str]
                  ) -> dict[str, np.ndarray]:
        """The caller's array for the first member, a replica for each other one."""
        replicas = self.replicas
        others = members[1:]
        if replicas.synced.get(name) is not array or any(
                (name, device) not in replicas.arrays for _, device in others):
            for _, device in others:
                replicas.arrays[name, device] = array.copy()
            replicas.synced[name] = array
        return {names[0]: array, **{physical: replicas.arrays[name, device]
                                    for physical, (_, device) in zip(names[1:], others)}}

    def close(self) -> None:
        close = getattr(self.physical, "close", None)
        if close is not None:
            close()


def _piece_index(v, shape: tuple[int, ...], member: int) -> tuple:
    """Where group member ``member``'s piece of split value ``v`` sits in the whole."""
    sizes = v.dist.pieces(shape[v.dist.axis])
    start = sum(sizes[:member])
    index = [slice(None)] * len(shape)
    index[v.dist.axis] = slice(start, start + sizes[member])
    return tuple(index)
