"""Execution traces: every task's start and end on its lane, as Chrome trace events.

The JSON is the Trace Event Format's object form (``{"traceEvents": [...]}``) with one
complete ("X") event per task run, one process per device and one thread per lane (a
worker of a compute or copy queue), named by metadata ("M") events; Perfetto
(ui.perfetto.dev) and chrome://tracing open it.
"""

from __future__ import annotations

import json
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

    # -- Chrome trace events ----------------------------------------------------------

    def events(self) -> list[dict]:
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
                           "ts": (start - self.origin) * 1e6, "dur": (end - start) * 1e6,
                           "pid": pid[lane.queue.device], "tid": tid[lane], "args": args})
        return events

    def to_json(self) -> str:
        return json.dumps({"traceEvents": self.events(), "displayTimeUnit": "ms"})

    def write(self, path: str) -> None:
        """Write the Chrome trace JSON to ``path`` atomically."""
        atomic_write_text(path, self.to_json())

    def summary(self) -> "TraceSummary":
        busy: dict[str, float] = {}
        for _, lane, start, end, _ in self.records:
            busy[str(lane)] = busy.get(str(lane), 0.0) + (end - start)
        if not self.records:
            return TraceSummary(0.0, busy, 0, self.calls)
        span = (max(r[3] for r in self.records) - min(r[2] for r in self.records))
        return TraceSummary(span, busy, len(self.records), self.calls)


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
