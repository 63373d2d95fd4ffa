"""The runtime plan: tasks with dependency counts, bound once to their memory.

A task is one unit of work on one queue: a kernel launch now; copies and collectives
later. It carries the callable, the arrays in the callable's argument slots (inputs then
outputs; ``Kernel.run(*inputs, *outputs)``, unchecked: every array bound is of its
value's declared type, as `Plan.bind` checks of what the caller passes), the tasks it
releases and how many tasks it waits for. Dependencies are the data dependencies plus
the write-after-read hazards the memory planner reports, so any execution order the
counts allow is correct.

Everything is computed once: views into the arenas sit in the argument lists, and only
the arrays the caller passes (and fresh arrays for updates that cannot be done in place)
are written into their slots at each call.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from purinec.errors import ExecutionError, PurinecError
from purinec.ir.graph import Graph, Node, Value
from purinec.ir.ops import Trait, get_op, op_has
from purinec.runtime.devices import COMM, COMPUTE, COPY_IN, QueueId
from purinec.runtime.memory import (ALIGNMENT, ARENA, COPY, EXTERNAL, FRESH, VARIABLE,
                                    MemoryPlan, check_allocation, is_view, may_alias,
                                    plan_memory)

KERNEL = "kernel"


def _c_strides(value: Value) -> tuple[int, ...]:
    """The strides of a C-contiguous array of ``value``'s type."""
    strides, step = [], value.type.dtype.numpy.itemsize
    for size in reversed(value.type.shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@dataclass(eq=False)
class Task:
    index: int  # position in the plan, which is also a valid serial order
    kind: str  # KERNEL now; copies and collectives later
    queue: QueueId
    fn: Callable[..., object]
    args: list  # the arrays fn is called with; per-call slots hold None between calls
    node: Node | None  # the IR node it runs, for errors and traces
    bytes_moved: int  # kernels: bytes of their operands and results
    successors: tuple[int, ...] = ()
    count: int = 0  # how many tasks it waits for

    @property
    def name(self) -> str:
        return f"{self.node.op} %{self.node.name}" if self.node is not None else self.kind

    def describe(self) -> str:
        """The task as an error message names it: node, location, device, inputs."""
        if self.node is None:
            return f"{self.kind} task on {self.queue}"
        node = self.node
        loc = f" ({node.loc})" if node.loc else ""
        inputs = ", ".join(f"%{v.name}: {v.type} @{v.device}" for v in node.inputs)
        return f"node {node!r}{loc} on {node.device} with inputs [{inputs}]"


def _nothing(*arrays) -> None:
    """The task of a concat whose inputs were computed in place (`MemoryPlan.elided`):
    it only passes on the dependencies, from its inputs' writers to its readers."""


def queue_of(node: Node) -> QueueId:
    """Copies run on their destination's inbound copy queue and collectives on the
    communication queue, so neither waits behind (or blocks) a device's compute."""
    kind = (COPY_IN if node.op == "copy" else
            COMM if op_has(node.op, Trait.communicates) else COMPUTE)
    return QueueId(node.device, kind)


@dataclass
class _Variable:
    """A class bound per call: to the caller's array of an input, or a fresh array."""

    root: Value
    source: str | None  # the env name for external storage, None for a fresh array
    # Each member: the shape to view the bound array in (None: as it is), its argument
    # slots, and whether `Plan.outputs` reads it.
    members: tuple[tuple[tuple[int, ...] | None, tuple[tuple[list, int], ...], Value | None],
                   ...]
    held: bool  # bound to a parameter's or state's array: see `Plan.bind`


# The roles of the inputs whose arrays stay bound between calls (`Plan.bind`).
HELD_ROLES = ("param", "state")


class Plan:
    """Tasks over one graph, bound to memory; reusable for any number of calls."""

    def __init__(self, graph: Graph, kernels: Mapping[Node, Callable],
                 schedule: Sequence[Node] | None = None,
                 may_alias: Callable[[Node, Value, Value], bool] = may_alias,
                 arenas=None):
        self.graph = graph
        self.memory: MemoryPlan = plan_memory(graph, schedule, may_alias)
        check_allocation(sum(self.memory.arena_bytes.values()),
                         f"the working memory of graph {graph.name} (its arenas)")
        self._arena_source = arena_source(kernels, arenas or FreshArenas)
        self.arenas = self._arena_source.allocate(self.memory.arena_bytes)
        self._static = self._arena_views()
        self.tasks = self._make_tasks(kernels)
        self._link()
        self.initial_counts = tuple(task.count for task in self.tasks)
        self.roots = tuple(task.index for task in self.tasks if task.count == 0)
        self.queues = tuple(sorted({task.queue for task in self.tasks}))
        self._inputs = self._input_checks()
        # A value computed into a new array each call: host memory, or the target's
        # (``empty(value)``) where its arenas have device memory.
        self._fresh = getattr(self._arena_source, "empty",
                              lambda v: np.empty(v.type.shape, v.type.dtype.numpy))
        self._current: dict[Value, np.ndarray] = {}  # the bound values Plan.outputs reads
        self._held_arrays: tuple = ()  # bound to the held variables (`bind`)

    # -- building ---------------------------------------------------------------------

    def _arena_views(self) -> dict[Value, np.ndarray]:
        views = {}
        for cls in self.memory.classes:
            if cls.storage != ARENA:
                continue
            raw = self.arenas[cls.device][cls.offset:cls.offset + cls.root.type.nbytes]
            for value in cls.members:
                views[value] = raw.view(value.type.dtype.numpy).reshape(value.type.shape)
        return views

    def _make_tasks(self, kernels: Mapping[Node, Callable]) -> list[Task]:
        slots: dict[Value, list[tuple[list, int]]] = {}
        tasks = []
        for node in self.memory.schedule:
            if is_view(node):
                continue
            fn = _nothing if node in self.memory.elided else kernels.get(node)
            if not callable(fn):
                raise PurinecError(f"no kernel for node {node!r} of graph {self.graph.name} "
                                   f"(got {type(fn).__name__})")
            operands = [*node.inputs, *node.outputs]
            args = []
            for value in operands:
                if value not in self._static:
                    slots.setdefault(value, []).append((args, len(args)))
                args.append(self._static.get(value))
            tasks.append(Task(len(tasks), KERNEL, queue_of(node), fn, args,
                              node, sum(v.type.nbytes for v in operands)))
        read_by_outputs = {spec.value for spec in self.memory.outputs}
        self._variables = []
        for cls in self.memory.classes:
            if cls.storage not in (EXTERNAL, FRESH):
                continue
            bound = cls.external if cls.storage == EXTERNAL else cls.root
            members = tuple((None if v.type.shape == bound.type.shape else v.type.shape,
                             tuple(slots.get(v, ())), v if v in read_by_outputs else None)
                            for v in cls.members)
            external = cls.storage == EXTERNAL
            self._variables.append(_Variable(
                cls.root, bound.name if external else None,
                tuple(m for m in members if m[1] or m[2] is not None),
                external and bound.role in HELD_ROLES))
        self._held_sources = tuple(dict.fromkeys(var.source for var in self._variables
                                                 if var.held))
        self._per_call_variables = [var for var in self._variables if not var.held]
        self._per_call_slots = self._slots(held=False)
        self._per_call_values = tuple(value for var in self._variables if not var.held
                                      for _, _, value in var.members if value is not None)
        return tasks

    def _slots(self, held: bool) -> tuple[tuple[list, int], ...]:
        return tuple(slot for var in self._variables if var.held == held
                     for _, slots, _ in var.members for slot in slots)

    def _link(self) -> None:
        """Successors and counts from data dependencies and memory hazards."""
        task_of = {task.node: task.index for task in self.tasks}
        edges = set()
        for task in self.tasks:
            for value in task.node.inputs:
                writer = self.memory.class_of[value].writer
                if writer is not None:
                    edges.add((task_of[writer], task.index))
        edges.update((task_of[a], task_of[b]) for a, b in self.memory.hazards)
        # Every edge points forward in the schedule, so the counts can always reach zero.
        assert all(a < b for a, b in edges), "dependency against the schedule"
        successors: dict[int, list[int]] = {}
        for a, b in sorted(edges):
            successors.setdefault(a, []).append(b)
            self.tasks[b].count += 1
        for task in self.tasks:
            task.successors = tuple(successors.get(task.index, ()))

    def _input_checks(self):
        """What to check of each input's array: those in a target's own device memory
        (`device_memory`) are the target's executable's to bind, and not checked here."""
        written = {cls.external for cls in self.memory.classes
                   if cls.storage == EXTERNAL and cls.external is not cls.root}
        device_memory = getattr(self._arena_source, "device_memory", lambda device: False)
        checks = [(v.name, v.type.shape, v.type.dtype.numpy, _c_strides(v), v in written)
                  for v in self.graph.inputs if not device_memory(v.device)]
        self._any_written = any(check[-1] for check in checks)
        held = set(self._held_sources)
        self._unheld_checks = [check for check in checks if check[0] not in held]
        self._written_held = [check[0] for check in checks if check[0] in held and check[-1]]
        return checks

    # -- each call --------------------------------------------------------------------

    def bind(self, env: Mapping[str, np.ndarray]) -> None:
        """Check the caller's arrays and put them (and fresh arrays) into their slots.

        The arrays of parameters and state (`HELD_ROLES`) stay bound after the call:
        passed again, the same objects, as a `Program` passes its own, they are neither
        checked nor bound again. Checking hundreds of parameters at every call, with
        caches cold from the kernels before, took 5% of mobilenet_v2's inference at
        batch 1."""
        try:
            held = tuple(map(env.__getitem__, self._held_sources))
        except KeyError:
            held = None  # (`_check_env` says which is missing)
        same = (held is not None and len(held) == len(self._held_arrays)
                and all(map(operator.is_, held, self._held_arrays)))
        self._check_env(env, held_same=same)
        current = self._current
        for var in self._per_call_variables if same else self._variables:
            base = env[var.source] if var.source is not None else self._fresh(var.root)
            for shape, slots, read_by_outputs in var.members:
                array = base if shape is None else base.reshape(shape)
                if read_by_outputs is not None:
                    current[read_by_outputs] = array
                for args, position in slots:
                    args[position] = array
        self._held_arrays = held

    def _check_env(self, env: Mapping[str, np.ndarray], held_same: bool) -> None:
        """Check every input's array, or with ``held_same`` (the held variables' arrays
        are those checked before) the others', and that the held ones that are written
        are still writable."""
        checks = self._unheld_checks if held_same else self._inputs
        # The common case is tested first, in the fewest attribute reads (strides of C
        # order say C-contiguous).
        for name, shape, dtype, strides, is_written in checks:
            array = env.get(name)
            if (type(array) is not np.ndarray or array.shape != shape
                    or (array.dtype is not dtype and array.dtype != dtype)
                    or (array.strides != strides and not array.flags.c_contiguous)):
                self._refuse(name, array)
            if is_written and not array.flags.writeable:
                self._refuse_read_only(name)
        if held_same:
            for name in self._written_held:
                if not env[name].flags.writeable:
                    self._refuse_read_only(name)
        if self._any_written and (checks or not held_same):
            self._check_no_overlap(env)

    def _refuse_read_only(self, name: str) -> None:
        raise ExecutionError(f"input %{name} of graph {self.graph.name} is updated in "
                             "place but its array is read-only")

    def _refuse(self, name: str, array) -> None:
        if array is None:
            raise ExecutionError(f"no array given for input %{name} of graph "
                                 f"{self.graph.name}")
        if type(array) is not np.ndarray:
            got = f"a {type(array).__name__}"
        else:
            layout = "" if array.flags.c_contiguous else "non-contiguous "
            got = f"a {layout}{array.dtype}{list(array.shape)} array"
        value = self.graph.value(name)
        raise ExecutionError(f"input %{name} of graph {self.graph.name} must be a "
                             f"C-contiguous {value.type} array, got {got}")

    def _check_no_overlap(self, env: Mapping[str, np.ndarray]) -> None:
        """Arrays updated in place must not overlap any other input's array."""
        owners: dict[int, list[tuple[str, bool]]] = {}  # by the object owning the memory
        for name, _, _, _, is_written in self._inputs:
            array = env[name]
            owner = array if array.base is None else array.base
            owners.setdefault(id(owner), []).append((name, is_written))
        for arrays in owners.values():
            if len(arrays) > 1:
                self._check_overlap_of(env, arrays)

    def _check_overlap_of(self, env, arrays: list[tuple[str, bool]]) -> None:
        for i, (name, is_written) in enumerate(arrays):
            for other, other_written in arrays[i + 1:]:
                if ((is_written or other_written)
                        and np.may_share_memory(env[name], env[other])):
                    raise ExecutionError(
                        f"inputs %{name} and %{other} of graph {self.graph.name} share "
                        f"memory, but one is updated in place: pass separate arrays")

    def outputs(self, env: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The graph's outputs after a run: updated variables as computed, copies of the
        rest (arena memory is reused by the next call)."""
        result = {}
        for spec in self.memory.outputs:
            array = self.array(spec.value)
            if spec.mode == VARIABLE:
                result[spec.name] = env[spec.name]
            elif spec.mode == FRESH:
                result[spec.name] = array
            else:
                assert spec.mode == COPY
                result[spec.name] = np.array(array)  # (a device array comes to the host)
        return result

    def array(self, value: Value) -> np.ndarray:
        """The array holding ``value``: its arena view, or during a call its bound array."""
        array = self._static.get(value)
        return array if array is not None else self._current[value]

    def unbind(self) -> None:
        """Drop every reference to the caller's arrays (but the held variables', see
        `bind`) and to this call's fresh arrays."""
        for value in self._per_call_values:
            self._current.pop(value, None)
        for args, position in self._per_call_slots:
            args[position] = None

    def _let_go_of_variables(self) -> None:
        """Drop the references `bind` holds between calls too."""
        self._held_arrays = ()
        self._current.clear()
        for args, position in self._slots(held=True):
            args[position] = None

    def release(self) -> None:
        """Give the arenas' memory back where their allocator can (shared memory, which
        is otherwise kept until the process exits); what a call writes there is scratch,
        so later calls still work."""
        self._let_go_of_variables()
        self._arena_source.release()

    # -- reporting --------------------------------------------------------------------

    def summary(self) -> str:
        lines = [f"plan of graph {self.graph.name}: {len(self.tasks)} tasks, "
                 f"{sum(len(t.successors) for t in self.tasks)} dependencies"]
        for queue in self.queues:
            count = sum(1 for t in self.tasks if t.queue == queue)
            lines.append(f"  {queue}: {count} tasks")
        return "\n".join(lines) + "\n" + self.memory.summary()


class FreshArenas:
    """Arenas in the process's own memory, freed with the plan."""

    @staticmethod
    def allocate(sizes: Mapping) -> dict:
        return {device: _aligned_bytes(n) for device, n in sizes.items()}

    @staticmethod
    def release() -> None:
        pass


class _Sources:
    """Several kernels' allocators (`purinec.runtime.shm`: groups of ranks that share
    memory), each asked in its ``order`` (allocating may be collective, so every rank
    asks in the same order): the first for the arenas, the others for none, which still
    gives them the memory their kernels need."""

    def __init__(self, sources):
        self.sources = sorted(sources, key=lambda source: source.order)

    def allocate(self, sizes: Mapping) -> dict:
        arenas = self.sources[0].allocate(sizes)
        for other in self.sources[1:]:
            other.allocate({})
        return arenas

    def release(self) -> None:
        for source in self.sources:
            source.release()


def arena_source(kernels: Mapping[Node, Callable], target_arenas):
    """What allocates the arenas (``allocate(sizes)``: each device's bytes) and gives
    their memory back (``release()``): the kernels' ``arena_allocator`` where they have
    one (those of `purinec.runtime.shm` need the arenas where other ranks can see them),
    else the target's (``FreshArenas``: the process's own memory). Target arenas that
    take the kernels' allocators in themselves (``holds_kernel_allocators``: the cuda
    target's, for its host memory) are used as they are."""
    if getattr(target_arenas, "holds_kernel_allocators", False):
        return target_arenas
    sources = {getattr(fn, "arena_allocator", None) for fn in kernels.values()}
    sources.discard(None)
    if not sources:
        return target_arenas
    return sources.pop() if len(sources) == 1 else _Sources(sources)


def _aligned_bytes(nbytes: int) -> np.ndarray:
    """A byte array whose first byte is ALIGNMENT-aligned."""
    return aligned_start(np.empty(nbytes + ALIGNMENT, np.uint8), nbytes)


def aligned_start(raw: np.ndarray, nbytes: int) -> np.ndarray:
    """``nbytes`` of the byte array ``raw`` from its first ALIGNMENT-aligned byte (``raw``
    has ALIGNMENT bytes to spare)."""
    shift = -raw.ctypes.data % ALIGNMENT
    return raw[shift:shift + nbytes]


def reference_results(node: Node, inputs: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
    """What ``node`` computes by the NumPy references; a fused node runs its members."""
    if node.body is None:
        return get_op(node.op).reference(*inputs, **node.attrs)
    values = dict(zip(node.inputs, inputs))
    for member in node.body:
        results = get_op(member.op).reference(*[values[v] for v in member.inputs],
                                               **member.attrs)
        values.update(zip(member.outputs, results))
    return [values[v] for v in node.outputs]


def reference_kernel(node: Node) -> Callable[..., None]:
    """The kernel calling convention around the NumPy references: ``fn(*inputs,
    *outputs)`` computes the results, then copies each into its output. Correct even when
    an output aliases an input, since every result is computed before any copy."""
    n_inputs = len(node.inputs)

    def kernel(*arrays):
        results = reference_results(node, arrays[:n_inputs])
        outputs = arrays[n_inputs:]
        if len(results) != len(outputs):
            raise ValueError(f"reference of {node.op} returned {len(results)} results "
                             f"for {len(outputs)} outputs")
        for out, result in zip(outputs, results):
            result = np.asarray(result)
            if result.shape != out.shape or result.dtype != out.dtype:
                raise ValueError(f"reference of {node.op} returned {result.dtype}"
                                 f"{list(result.shape)} for an output of {out.dtype}"
                                 f"{list(out.shape)}")
            np.copyto(out, result)

    kernel.__name__ = kernel.__qualname__ = f"reference_{node.op}"
    return kernel


def reference_kernels(graph: Graph) -> dict[Node, Callable[..., None]]:
    """A reference kernel for every node of ``graph``."""
    return {node: reference_kernel(node) for node in graph.nodes}
