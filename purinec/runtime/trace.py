"""Execution traces: every task's start and end on its lane, as Chrome trace events.

The JSON is the Trace Event Format's object form (``{"traceEvents": [...]}``) with one
complete ("X") event per task run, one process per device and one thread per lane (a
worker of a compute or copy queue), named by metadata ("M") events; Perfetto
(ui.perfetto.dev) and chrome://tracing open it. A job of several MPI ranks records a
trace on each; `gather_events` puts them together on rank 0, on one clock.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

from purinec.fileio import atomic_write_text
from purinec.runtime.devices import QUEUE_KINDS, Lane


class Trace:
    """Collects task timings over any number of calls of an executable."""

    def __init__(self):
        self.records: list[tuple] = []  # (task, lane, start, end, call), perf_counter s
        self.calls = 0
        self.origin = time.perf_counter()

    def begin_call(self) -> None:
        self.calls += 1

    def record(self, task, lane: Lane, start: float, end: float) -> None:
        """Called by the executor after each task (from any worker thread)."""
        self.records.append((task, lane, start, end, self.calls - 1))

    def clear(self) -> None:
        """Forget what was recorded (e.g. after warm-up calls)."""
        self.records.clear()
        self.calls = 0
        self.origin = time.perf_counter()

    def opening(self) -> "Trace":
        """What an executable that runs at the start of another's call records into:
        this trace, as part of that call, beginning none of its own (`Program`'s
        cached part of an inference graph, run again after the weights changed)."""
        return _Opening(self)

    # -- Chrome trace events ----------------------------------------------------------

    def events(self, origin: float | None = None) -> list[dict]:
        """The Chrome trace events, times in microseconds from ``origin`` (a
        `time.perf_counter` reading; default: when the trace began or was cleared)."""
        origin = self.origin if origin is None else origin
        lanes = sorted({lane for _, lane, *_ in self.records},
                       key=lambda lane: (lane.queue.device,
                                         QUEUE_KINDS.index(lane.queue.kind), lane.worker))
        devices = list(dict.fromkeys(lane.queue.device for lane in lanes))
        pid = {device: i + 1 for i, device in enumerate(devices)}
        tid = {lane: i + 1 for i, lane in enumerate(lanes)}
        events: list[dict] = []
        for device in devices:
            events.append({"name": "process_name", "ph": "M", "pid": pid[device],
                           "args": {"name": str(device)}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": pid[device],
                           "args": {"sort_index": pid[device]}})
        for lane in lanes:
            where = {"pid": pid[lane.queue.device], "tid": tid[lane]}
            events.append({"name": "thread_name", "ph": "M", **where,
                           "args": {"name": str(lane)}})
            events.append({"name": "thread_sort_index", "ph": "M", **where,
                           "args": {"sort_index": tid[lane]}})
        for task, lane, start, end, call in self.records:
            args = {"call": call, "bytes": task.bytes_moved, "queue": str(task.queue)}
            if task.node is not None:
                args["node"] = repr(task.node)
                if task.node.loc:
                    args["loc"] = task.node.loc
            events.append({"name": task.name, "cat": task.kind, "ph": "X",
                           "ts": (start - origin) * 1e6, "dur": (end - start) * 1e6,
                           "pid": pid[lane.queue.device], "tid": tid[lane], "args": args})
        return events

    def write(self, path: str) -> None:
        """Write the Chrome trace JSON to ``path`` atomically."""
        write_events(path, self.events())

    def summary(self) -> "TraceSummary":
        busy: dict[str, float] = {}
        for _, lane, start, end, _ in self.records:
            busy[str(lane)] = busy.get(str(lane), 0.0) + (end - start)
        if not self.records:
            return TraceSummary(0.0, busy, 0, self.calls)
        span = (max(r[3] for r in self.records) - min(r[2] for r in self.records))
        return TraceSummary(span, busy, len(self.records), self.calls)


def write_events(path: str, events: list[dict]) -> None:
    """Chrome trace events as JSON in ``path``, atomically."""
    atomic_write_text(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


# Barriers whose exits set the ranks' clocks alike (`gather_events`): the median of
# several, so a rank descheduled as it left one does not skew its clock.
CLOCK_SAMPLES = 7


def gather_events(trace: Trace, world) -> list[list[dict]] | None:
    """Every rank's events of ``trace``, on rank 0 (a list per rank; None on the
    others): collective over ``world`` (`purinec.runtime.comm.World`). The ranks leave
    barriers within microseconds of each other, so the differences between their clocks
    at the exits (the median of CLOCK_SAMPLES) put every rank's times on rank 0's clock;
    machines' clocks need not agree."""
    if world.size == 1:
        return [trace.events()]
    exits = []
    for _ in range(CLOCK_SAMPLES):
        world.comm.Barrier()
        exits.append(time.perf_counter())
    gathered = world.comm.gather((trace.events(origin=0.0), exits), root=0)
    if gathered is None:
        return None
    ours = gathered[0][1]
    per_rank = []
    for events, theirs in gathered:
        ahead = statistics.median(t - o for t, o in zip(theirs, ours)) * 1e6
        per_rank.append([{**e, "ts": e["ts"] - ahead} if "ts" in e else e for e in events])
    return per_rank


def merge_events(per_rank: list[list[dict]]) -> list[dict]:
    """One trace of several ranks' events (`gather_events`): each rank's processes (its
    devices) numbered after the ranks' before it, times from the first task of all."""
    merged, first = [], min((e["ts"] for events in per_rank for e in events if "ts" in e),
                            default=0.0)
    offset = 0
    for events in per_rank:
        for e in events:
            merged.append({**e, "pid": e["pid"] + offset,
                           **({"ts": e["ts"] - first} if "ts" in e else {})})
        offset += max((e["pid"] for e in events), default=0)
    return merged


@dataclass(frozen=True)
class TraceSummary:
    span: float  # seconds from the first task's start to the last task's end
    busy: dict[str, float]  # seconds each lane spent running tasks
    tasks: int
    calls: int

    def __str__(self) -> str:
        lines = [f"{self.tasks} tasks in {self.calls} call(s), span {self.span * 1e3:.3f} ms"]
        for lane, seconds in sorted(self.busy.items()):
            share = seconds / self.span if self.span else 0.0
            lines.append(f"  {lane}: busy {seconds * 1e3:.3f} ms ({share:.0%} of the span)")
        return "\n".join(lines)


class _Opening(Trace):
    """`Trace.opening`'s view of ``trace``: calls begin nothing, records go to the call
    about to begin."""

    def __init__(self, trace: Trace):
        self.trace = trace

    def begin_call(self) -> None:
        pass

    def record(self, task, lane: Lane, start: float, end: float) -> None:
        self.trace.records.append((task, lane, start, end, self.trace.calls))
