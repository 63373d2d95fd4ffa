"""The memory planner: where every value of a graph lives while the graph runs.

Values are grouped into *alias classes*: a value and the ``reshape`` views of it share
one piece of memory (a reshape of a C-contiguous array is free). Each class lives in one
of three places:

- ``external``: the array the caller passes in ``env`` for a graph input, and the next
  value of a param or state when it can be computed in place in that very array;
- ``fresh``: a new array each call, for a param or state update that cannot be done in
  place (the executable returns it);
- ``arena``: an offset in its device's byte arena. Offsets are assigned by walking the
  schedule with liveness: a class is live from its producer to its last reader (to the
  end for graph outputs, which are copied out after the run), and memory of dead classes
  is reused (best fit, 64-byte aligned). An elementwise node may write its output into
  an input of the same type that dies at that node (in place).

A ``concat`` whose inputs are contiguous runs of its output (every axis before the
joined one of size 1: the channels of an image at batch 1) costs no copy where its
inputs are free to move (`_concats_in_place`): each input's class is placed *within*
the output's memory, at its run, and its writer computes it there. The output's memory
is then taken when its first input is written and lives until the last reader of any
of them; the concat itself runs nothing (`MemoryPlan.elided`), and the cpu target
compiles no kernel for it (`concats_in_place`). squeezenet1_1's fire modules at batch 1
copied 1.2 of 7.1 ms that way.

Reusing memory creates write-after-read hazards: the node that writes a class into
memory that held another must wait for everything that touched the earlier one. So the
inputs of a communication node stay live until its result is first read: a transfer in
flight is not waited for by whatever would reuse its memory. The
planner lists those pairs (`MemoryPlan.hazards`) so the runtime plan is correct under any
execution order its dependency counts allow, not only the schedule's order.
"""

from __future__ import annotations

import bisect
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from purinec.errors import MemoryLimitError, PurinecError, VerifyError
from purinec.ir.graph import (Graph, Node, Value, anchor_destination,
                               stable_topological_order)
from purinec.ir.ops import REGISTRY, FusionKind, Trait, op_has
from purinec.ir.types import Device

ALIGNMENT = 64

ARENA = "arena"
EXTERNAL = "external"
FRESH = "fresh"

# How a graph output is handed back: the caller's own array of the variable it updates
# (in place), the fresh array it was computed in, or a copy taken after the run.
VARIABLE = "variable"
COPY = "copy"

VARIABLE_ROLES = ("param", "state")


def is_view(node: Node) -> bool:
    """Nodes whose output is a zero-copy view of their input: no kernel runs for them.
    A reshape onto another device moves data, so it stays a kernel."""
    return op_has(node.op, Trait.view) and node.outputs[0].device == node.inputs[0].device


def elementwise(node: Node) -> bool:
    opdef = REGISTRY.get(node.op)
    return opdef is not None and opdef.fusion is FusionKind.elementwise


def in_place(node: Node) -> bool:
    """Whether ``node``'s op is marked `in_place` in the registry (see `may_alias`)."""
    return node.body is None and op_has(node.op, Trait.in_place)


def may_alias(node: Node, output: Value, input: Value) -> bool:
    """Whether ``node``'s kernel stays correct when ``output`` is written into the memory
    of ``input`` (of the same type). The kernel contract promises that for elementwise
    ops, and for an op marked `in_place` when both hold the same position (an allreduce
    then sums a gradient where it lies, with no copy). In a fused node it holds when one
    elementwise member writes ``output`` and no other member reads ``input`` (members of
    a group may run as separate loops), but never over the output an epilogue's anchor
    computes into (`anchor_destination`: written before any member reads)."""
    if in_place(node):
        return node.outputs.index(output) == node.inputs.index(input)
    if node.body is None:
        return elementwise(node)
    if output is anchor_destination(node):
        return False
    writers = [m for m in node.body if output in m.outputs]
    readers = [m for m in node.body if input in m.inputs]
    return len(writers) == 1 and readers == writers and elementwise(writers[0])


def aligned(nbytes: int) -> int:
    """Bytes a value takes in an arena: rounded up to the alignment, never zero."""
    return max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)


@dataclass(eq=False)
class AliasClass:
    """A value and its reshape views: one piece of memory."""

    root: Value
    writer: Node | None  # the node producing root; None for graph inputs
    start: int  # schedule position of the writer; -1 for graph inputs
    end: int  # last schedule position that needs it intact (len(schedule) for outputs)
    storage: str
    members: list[Value] = field(default_factory=list)
    readers: list[Node] = field(default_factory=list)  # kernel nodes reading any member
    external: Value | None = None  # for external storage: the graph input holding it
    offset: int = -1  # for arena storage
    size: int = 0  # for arena storage: aligned bytes
    donor: "AliasClass | None" = None  # the class whose memory it took over in place
    # A concat's input placed within the concat's output (`_concats_in_place`): that
    # class, and the bytes from its start to this one's.
    within: "AliasClass | None" = None
    at: int = 0
    holds_parts: bool = False  # a concat's output holding its inputs
    # The last position that reads it (or `end`, for outputs): `end` less the time a
    # communication node may still be reading it in flight.
    read_end: int = -1

    @property
    def device(self) -> Device:
        return self.root.device

    def touchers(self) -> list[Node]:
        """Every node that reads or writes this class's memory."""
        return ([self.writer] if self.writer is not None else []) + self.readers

    def where(self) -> str:
        if self.storage == ARENA:
            taken = (f", in place of %{self.donor.root.name}" if self.donor else
                     f", within %{self.within.root.name}" if self.within else "")
            return f"{self.device} [{self.offset}, {self.offset + self.size}){taken}"
        if self.storage == EXTERNAL:
            if self.external is self.root:
                return "caller's array"
            return f"in place in the caller's array of %{self.external.name}"
        return "fresh array each call"


@dataclass(frozen=True)
class OutputSpec:
    name: str
    value: Value
    mode: str  # VARIABLE, FRESH or COPY


@dataclass
class MemoryPlan:
    graph: Graph
    schedule: list[Node]
    classes: list[AliasClass]
    class_of: dict[Value, AliasClass]
    arena_bytes: dict[Device, int]  # the arena each device needs: its peak
    naive_bytes: dict[Device, int]  # what giving every class its own memory would take
    hazards: list[tuple[Node, Node]]  # (a, b): a must finish before b starts
    outputs: list[OutputSpec]
    elided: frozenset[Node] = frozenset()  # concats whose inputs lie in place: no work

    @property
    def saved_bytes(self) -> dict[Device, int]:
        return {d: self.naive_bytes[d] - self.arena_bytes[d] for d in self.arena_bytes}

    def summary(self) -> str:
        """A human-readable report: bytes per device, then where every value lives."""
        lines = [f"memory plan of graph {self.graph.name}:"]
        for device in sorted(self.arena_bytes):
            in_place = sum(1 for c in self.classes
                           if c.device == device and c.donor is not None)
            lines.append(f"  {device}: peak {_bytes(self.arena_bytes[device])} "
                         f"(without reuse {_bytes(self.naive_bytes[device])}, saved "
                         f"{_bytes(self.saved_bytes[device])}; {in_place} in place)")
        if self.elided:
            lines.append(f"  concats copying nothing (their inputs computed within their "
                         f"outputs): {len(self.elided)}")
        for cls in self.classes:
            lines.append(f"  %{cls.root.name}: {cls.root.type} {cls.where()}"
                         + (f"  live {cls.start}..{cls.end}" if cls.storage == ARENA else ""))
            for view in cls.members[1:]:
                lines.append(f"    %{view.name}: {view.type} view of %{cls.root.name}")
        return "\n".join(lines)


def _bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for power, unit in enumerate(("KiB", "MiB", "GiB", "TiB", "PiB"), 1):
        if n < 1024 ** (power + 1) or unit == "PiB":
            return f"{n / 1024 ** power:.1f} {unit}"
    raise AssertionError(n)


# -- the memory limit --------------------------------------------------------------------

LIMIT_VARIABLE = "PURINEC_MEMORY_LIMIT"
_UNITS = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4}


def memory_limit() -> tuple[int | None, str]:
    """The most bytes of tensors purinec allocates at once for one request, and a phrase
    saying what it is: PURINEC_MEMORY_LIMIT (bytes, or with a K, M, G or T suffix) when
    set, else the machine's physical memory (None where the system does not say)."""
    setting = os.environ.get(LIMIT_VARIABLE, "").strip()
    if setting:
        m = re.fullmatch(r"([0-9]{1,15})\s*([KMGT]?)(?:i?B)?", setting, flags=re.IGNORECASE)
        if not m:
            raise PurinecError(f"{LIMIT_VARIABLE}={setting!r} is not a size; give bytes, "
                               f"or a number with K, M, G or T (e.g. 8G)")
        limit = int(m[1]) * _UNITS[m[2].upper()]
        return limit, f"the limit is {_bytes(limit)} ({LIMIT_VARIABLE}={setting})"
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None, "no limit"
    return physical, (f"this machine has {_bytes(physical)} of memory (set "
                      f"{LIMIT_VARIABLE} to allow more or less)")


def check_allocation(nbytes: int, what: str, detail: str = "") -> None:
    """Refuse, before allocating it, ``nbytes`` of memory for ``what`` beyond the memory
    limit: a clear error rather than a MemoryError, or a machine swapping to a halt."""
    limit, says = memory_limit()
    if limit is not None and nbytes > limit:
        raise MemoryLimitError(f"{what} would take {_bytes(nbytes)}{detail}; {says}")


def check_values_fit(values: Iterable[Value], what: str) -> None:
    """`check_allocation` for one array per value, naming the largest."""
    values = list(values)
    if values:
        largest = max(values, key=lambda v: v.type.nbytes)
        check_allocation(sum(v.type.nbytes for v in values), what,
                         f" (the largest, %{largest.name}: {largest.type}, "
                         f"{_bytes(largest.type.nbytes)})")


def updates_after_readers(graph: Graph) -> list[Node]:
    """Graph order, except that a node making a variable's next value waits for the
    variable's other readers (a view's readers included), and the nodes reading what it
    makes wait with it: the update may then be written over the variable in place
    (`_updates_in_place`). A fused weight gradient + SGD node comes before the matrix
    product that reads the same weight for the data gradient; in that order the new
    weight needed a fresh array every step, and a copy into the program's own. (A reader
    that needs the update itself, through its other outputs, keeps it where it is.)"""
    order = list(graph.nodes)
    producer = {v: node for node in order for v in node.outputs}
    before = {node: {producer[v] for v in node.inputs if v in producer} for node in order}
    variables = {v.name: v for v in graph.inputs if v.role in VARIABLE_ROLES}
    for name, value in graph.outputs:
        writer, variable = producer.get(value), variables.get(name)
        if writer is None or variable is None:
            continue
        aliases = _aliases(order, variable)
        for reader in order:
            if (reader is not writer and any(v in aliases for v in reader.inputs)
                    and not _reaches(writer, reader, before)):
                before[writer].add(reader)
    return _stable_topological(order, before)


def _reaches(source: Node, target: Node, before: dict[Node, set[Node]]) -> bool:
    """Whether ``target`` depends on ``source`` (``before``: each node's predecessors)."""
    seen, stack = set(), [target]
    while stack:
        node = stack.pop()
        if node is source:
            return True
        for predecessor in before[node] - seen:
            seen.add(predecessor)
            stack.append(predecessor)
    return False


def _stable_topological(order: list[Node], before: dict[Node, set[Node]]) -> list[Node]:
    """``order``'s nodes, each after its ``before``, otherwise as early as in ``order``."""
    index = {node: i for i, node in enumerate(order)}
    after: list[list[int]] = [[] for _ in order]
    for node in order:
        for predecessor in before[node]:
            after[index[predecessor]].append(index[node])
    return [order[i] for i in stable_topological_order(range(len(order)), after)]


def _aliases(order: list[Node], variable: Value) -> set[Value]:
    """``variable`` and the views of it (and of those) that nodes make."""
    aliases = {variable}
    for node in order:
        if is_view(node) and node.inputs[0] in aliases:
            aliases.add(node.outputs[0])
    return aliases


def check_schedule(graph: Graph, schedule: Sequence[Node] | None) -> list[Node]:
    """The schedule as a list: every node of the graph once, each after its inputs."""
    if schedule is None:
        return list(graph.nodes)
    schedule = list(schedule)
    if len(schedule) != len(graph.nodes) or set(schedule) != set(graph.nodes):
        raise VerifyError(f"a schedule of graph {graph.name} must list each of its "
                          f"{len(graph.nodes)} nodes exactly once, got {len(schedule)} entries")
    defined = set(graph.inputs)
    for node in schedule:
        for v in node.inputs:
            if v not in defined:
                raise VerifyError(f"the schedule of graph {graph.name} runs {node!r} "
                                  f"before %{v.name} is computed")
        defined.update(node.outputs)
    return schedule


def plan_memory(graph: Graph, schedule: Sequence[Node] | None = None,
                may_alias: Callable[[Node, Value, Value], bool] = may_alias) -> MemoryPlan:
    """Assign every value of ``graph`` its memory for running ``schedule`` (a topological
    order of all its nodes; default: `updates_after_readers`). ``may_alias(node, output,
    input)`` says whether a node may write an output over an input (default:
    `may_alias`)."""
    schedule = check_schedule(graph, updates_after_readers(graph) if schedule is None
                              else schedule)
    classes, class_of = _alias_classes(graph, schedule)
    hazards: set[tuple[Node, Node]] = set()
    _place_variable_updates(graph, schedule, class_of, may_alias, hazards)
    elided = _concats_in_place(graph, schedule, class_of)
    arena_bytes, naive_bytes = _place_in_arenas(graph, schedule, classes, class_of,
                                                may_alias, hazards)
    position = {node: i for i, node in enumerate(schedule)}
    return MemoryPlan(graph, schedule, classes, class_of, arena_bytes, naive_bytes,
                      sorted(hazards, key=lambda h: (position[h[1]], position[h[0]])),
                      _output_specs(graph, class_of), elided)


def _alias_classes(graph: Graph, schedule: list[Node]):
    """Group values into alias classes and find each class's readers and live range."""
    classes: list[AliasClass] = []
    class_of: dict[Value, AliasClass] = {}

    def new_class(root: Value, writer: Node | None, start: int, storage: str) -> None:
        cls = AliasClass(root, writer, start, start, storage, members=[root],
                         external=root if storage == EXTERNAL else None)
        classes.append(cls)
        class_of[root] = cls

    for value in graph.inputs:
        new_class(value, None, -1, EXTERNAL)
    for position, node in enumerate(schedule):
        if is_view(node):
            cls = class_of[node.inputs[0]]
            cls.members.append(node.outputs[0])
            class_of[node.outputs[0]] = cls
            continue
        for cls in dict.fromkeys(class_of[v] for v in node.inputs):
            cls.readers.append(node)
            cls.end = position
        for value in node.outputs:
            new_class(value, node, position, ARENA)
    for _, value in graph.outputs:
        class_of[value].end = len(schedule)  # copied out (or returned) after the run
    for cls in classes:
        cls.read_end = cls.end
    _keep_in_flight_inputs(schedule, class_of)
    return classes, class_of


def _keep_in_flight_inputs(schedule: list[Node], class_of) -> None:
    """A communication node (a copy, a collective) reads its inputs for as long as it is
    in flight, which may be until its result is first needed: nothing scheduled before
    that reuses their memory. Reusing it sooner would make the reusing node wait for the
    transfer (a write-after-read hazard), putting the transfer on the critical path. An
    output nobody reads (what a rank sends toward a reduce's root) is in flight until
    the end of the run."""
    position = {node: i for i, node in enumerate(schedule)}
    first_read: dict[Value, int] = {}
    for node in reversed(schedule):
        for v in node.inputs:
            first_read[v] = position[node]
    for node in schedule:
        if not op_has(node.op, Trait.communicates):
            continue
        needed = min((first_read.get(v, len(schedule)) for v in node.outputs),
                     default=len(schedule))
        for v in node.inputs:
            class_of[v].end = max(class_of[v].end, needed - 1)
        for v in node.outputs:
            if v not in first_read:
                class_of[v].end = max(class_of[v].end, len(schedule) - 1)


def _place_variable_updates(graph, schedule, class_of, may_alias, hazards) -> None:
    """Give each param/state update the caller's array of its variable when that is safe,
    else a fresh array per call."""
    position = {node: i for i, node in enumerate(schedule)}
    variables = {v.name: v for v in graph.inputs if v.role in VARIABLE_ROLES}
    output_classes = {class_of[v] for _, v in graph.outputs}
    for name, value in graph.outputs:
        target = variables.get(name)
        cls = class_of[value]
        if target is None or cls.storage != ARENA:
            continue  # not an update, or an input, or already placed for another output
        target_cls = class_of[target]
        if (value.type == target.type and target_cls not in output_classes
                and _updates_in_place(cls, target_cls, position, class_of, may_alias)):
            cls.storage = EXTERNAL
            cls.external = target
            cls.donor = target_cls
            output_classes.add(target_cls)  # one update per variable
            hazards.update((node, cls.writer) for node in target_cls.readers
                           if node is not cls.writer)
        else:
            cls.storage = FRESH


def _updates_in_place(cls: AliasClass, target_cls: AliasClass, position, class_of,
                      may_alias) -> bool:
    """An update may overwrite its variable when its writer reads the variable as an
    input it may alias (same type), runs on its device, and every other reader of the
    variable comes before it in the schedule (the plan makes them finish first)."""
    writer = cls.writer
    reads = [v for v in writer.inputs if class_of[v] is target_cls]
    return (bool(reads) and target_cls.device == cls.device
            and all(v.type == cls.root.type and may_alias(writer, cls.root, v) for v in reads)
            and all(position[r] < position[writer] for r in target_cls.readers
                    if r is not writer))


def concats_in_place(graph: Graph) -> frozenset[Node]:
    """The concats that run nothing (`MemoryPlan.elided`) where ``graph`` is planned
    as a target's `purinec.runtime.executor.Executable` plans it (its default order and
    aliasing): they need no kernel, and compiling one costs a cold compile 0.2 s."""
    if not any(node.op == "concat" and _joins_runs(node) for node in graph.nodes):
        return frozenset()  # (no plan to make)
    return plan_memory(graph).elided


def _joins_runs(concat: Node) -> bool:
    """Whether each input of ``concat`` is one contiguous run of its output."""
    axis = concat.attrs["axis"]
    return all(size == 1 for size in concat.outputs[0].type.shape[:axis])


def _concats_in_place(graph: Graph, schedule: list[Node], class_of) -> frozenset[Node]:
    """Place the inputs of each concat that can take them within its output (see the
    module's notes); returns those concats. Each input must be a contiguous run of the
    output, in the arena on the output's device, written by a kernel that is not a
    communication (which may write in place of its input), and not a graph output; no
    class may be placed twice; CPU memory only (`_movable`)."""
    outputs = {class_of[v] for _, v in graph.outputs}
    placed: set[AliasClass] = set()
    elided = set()
    for node in schedule:
        if node.op != "concat" or not _joins_runs(node):
            continue  # (a concat not joining runs has its inputs strided through it)
        whole = class_of[node.outputs[0]]
        if whole.storage != ARENA:
            continue
        parts = [class_of[v] for v in node.inputs]
        if (len(set(parts)) != len(parts)
                or not all(_movable(part, whole, outputs, placed) for part in parts)):
            continue
        at = 0
        for value, part in zip(node.inputs, parts):
            part.within, part.at = whole, at
            at += value.type.nbytes
            whole.end = max(whole.end, part.end)
            whole.read_end = max(whole.read_end, part.read_end)
            # Whoever touches a part touches the whole's memory: what reuses it waits.
            whole.readers.extend(n for n in part.touchers() if n not in whole.readers)
        whole.holds_parts = True
        placed.update(parts)
        placed.add(whole)
        elided.add(node)
    return frozenset(elided)


def _movable(part: AliasClass, whole: AliasClass, outputs, placed) -> bool:
    """Whether a concat's input class ``part`` may be placed within its output ``whole``
    (see `_concats_in_place`). CPU memory only: on a GPU the concat, left with nothing
    to launch, would run as a host task waiting for its inputs' streams, so it copies
    there."""
    return (part.storage == ARENA and part.device == whole.device
            and whole.device.kind == "cpu" and part not in outputs and part not in placed
            and part.writer is not None and not op_has(part.writer.op, Trait.communicates))


def _place_in_arenas(graph, schedule, classes, class_of, may_alias, hazards):
    devices = {v.device for v in graph.values()}
    arenas = {device: _Arena() for device in devices}
    dying: dict[int, list[AliasClass]] = {}
    for cls in classes:
        dying.setdefault(cls.end, []).append(cls)
    donors: set[AliasClass] = set()  # their memory lives on in the class that took it
    for position, node in enumerate(schedule):
        if is_view(node):
            continue
        for value in node.outputs:
            cls = class_of[value]
            if cls.storage != ARENA:
                continue
            arena = arenas[cls.device]
            whole = cls.within or cls
            if whole.offset < 0:  # (a concat's output: taken when its first part is)
                whole.size = aligned(whole.root.type.nbytes)
                donor = (None if whole.holds_parts else
                         _in_place_donor(node, cls, position, class_of, donors, may_alias))
                if donor is not None:
                    cls.offset, cls.donor = donor.offset, donor
                    donors.add(donor)
                else:
                    whole.offset = arena.alloc(whole.size)
            if cls.within is not None:
                cls.offset, cls.size = whole.offset + cls.at, cls.root.type.nbytes
            elif whole.holds_parts:
                continue  # its parts took its memory, and their writers wrote it
            for previous in arena.occupy(cls.offset, cls.size, whole):
                hazards.update((n, node) for n in previous.touchers() if n is not node)
        for cls in dying.get(position, ()):
            if cls.storage == ARENA and cls not in donors and cls.within is None:
                arenas[cls.device].release(cls.offset, cls.size)
    naive = {device: 0 for device in devices}
    for cls in classes:
        if cls.storage == ARENA and cls.within is None:
            naive[cls.device] += cls.size
    return {device: arena.top for device, arena in arenas.items()}, naive


def _in_place_donor(node: Node, cls: AliasClass, position: int, class_of, taken: set,
                    may_alias) -> AliasClass | None:
    """An arena input of ``node`` whose memory ``cls`` can take: same device and type,
    read by nothing after ``node``, not already taken by another output. (An input of a
    communication node is kept while the node is in flight; when an `in_place` node's
    own output takes its memory, the output's life covers that. Any other node waits
    until no transfer reads the input.)"""
    own_transfer = in_place(node)
    for value in node.inputs:
        donor = class_of[value]
        last = donor.read_end if own_transfer else donor.end
        if (donor.storage == ARENA and last == position and donor not in taken
                and donor.within is None and not donor.holds_parts
                and donor.device == cls.device
                and all(v.type == cls.root.type and may_alias(node, cls.root, v)
                        for v in node.inputs if class_of[v] is donor)):
            return donor
    return None


def _output_specs(graph: Graph, class_of) -> list[OutputSpec]:
    """How each output is returned; no two outputs ever share memory."""
    variables = {v.name: v for v in graph.inputs if v.role in VARIABLE_ROLES}
    returned: set[AliasClass] = set()
    specs = []
    for name, value in graph.outputs:
        cls = class_of[value]
        target = variables.get(name)
        mode = COPY
        if target is not None and cls not in returned:
            if cls.storage == EXTERNAL and cls.external is target and value.type == target.type:
                mode = VARIABLE
            elif cls.storage == FRESH:
                mode = FRESH
        if mode != COPY:
            returned.add(cls)
        specs.append(OutputSpec(name, value, mode))
    return specs


class _Arena:
    """Offsets in one device's arena: a best-fit free list below a growing top, and the
    last class that occupied each byte range (to find write-after-read hazards)."""

    def __init__(self):
        self.top = 0
        self.free: list[tuple[int, int]] = []  # (offset, size), sorted, coalesced
        self.segments: list[tuple[int, int, AliasClass]] = []  # (start, end, occupant)

    def alloc(self, size: int) -> int:
        fits = [(gap, offset) for offset, gap in self.free if gap >= size]
        if fits:
            gap, offset = min(fits)
            self.free.remove((offset, gap))
            if gap > size:
                bisect.insort(self.free, (offset + size, gap - size))
            return offset
        if self.free and sum(self.free[-1]) == self.top:  # grow the last gap
            offset, _ = self.free.pop()
        else:
            offset = self.top
        self.top = offset + size
        return offset

    def release(self, offset: int, size: int) -> None:
        i = bisect.bisect(self.free, (offset, size))
        self.free.insert(i, (offset, size))
        if i + 1 < len(self.free) and offset + size == self.free[i + 1][0]:
            self.free[i] = (offset, size + self.free.pop(i + 1)[1])
        if i > 0 and sum(self.free[i - 1]) == offset:
            prev_offset, prev_size = self.free[i - 1]
            self.free[i - 1] = (prev_offset, prev_size + self.free.pop(i)[1])

    def occupy(self, offset: int, size: int, cls: AliasClass) -> list[AliasClass]:
        """Record that ``cls`` now holds [offset, offset + size); return the classes that
        held any of it before."""
        end = offset + size
        previous, kept = [], []
        for start, stop, occupant in self.segments:
            if stop <= offset or start >= end:
                kept.append((start, stop, occupant))
                continue
            previous.append(occupant)
            if start < offset:
                kept.append((start, offset, occupant))
            if stop > end:
                kept.append((end, stop, occupant))
        kept.append((offset, end, cls))
        kept.sort(key=lambda segment: segment[0])
        self.segments = kept
        return list(dict.fromkeys(previous))
