"""Pictures: the IR as Purine drew it, and execution timelines.

`to_dot` draws a graph as a bi-graph: ops are boxes, tensors are ellipses, edges run
tensor -> op -> tensor, and everything is coloured by the device it lives on, so where
data crosses devices (and which collective moves it) is visible at a glance.
`render_graph` writes that as ``.dot`` text or, through Graphviz's ``dot``, SVG/PNG.

`timeline` draws a Chrome trace written by `purinec.runtime.trace.Trace` as one lane per
device queue, and `overlap` measures how much communication ran while some compute lane
was busy (the point of Purine's separate copy queues).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any, Iterable

from purinec.errors import PurinecError
from purinec.fileio import atomic_write_text, replacing
from purinec.ir.graph import Graph, Node, Value
from purinec.ir.ops import Trait, op_has
from purinec.ir.types import Device
from purinec.runtime.devices import COMM, COMPUTE, COPY_IN, COPY_OUT, QUEUE_KINDS

# (border and edge colour, fill colour) per device, in sorted device order: ColorBrewer's
# Dark2 with its matching Pastel2, distinct in print and for most colour-blind readers.
DEVICE_COLOURS = (
    ("#1b9e77", "#b3e2cd"), ("#d95f02", "#fdcdac"), ("#7570b3", "#cbd5e8"),
    ("#e7298a", "#f4cae4"), ("#66a61e", "#e6f5c9"), ("#e6ab02", "#fff2ae"),
    ("#a6761d", "#f1e2cc"), ("#666666", "#cccccc"),
)

GRAPH_FORMATS = ("dot", "svg", "png")
GRAPHVIZ_TIMEOUT_S = 120
GRAPHVIZ_MISSING = ("drawing {fmt} needs Graphviz's `dot` program, which is not on PATH; "
                    "install Graphviz (Debian/Ubuntu: apt-get install graphviz, macOS: brew "
                    "install graphviz, conda: conda install graphviz), or write .dot text "
                    "instead and render it elsewhere")


# ---------------------------------------------------------------------------------------
# The IR graph as DOT.


def quote(text: str) -> str:
    """``text`` as a DOT quoted string (IDs and attribute values)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _label(lines: Iterable[str]) -> str:
    """A multi-line label: each line quoted on its own, joined by DOT's line break."""
    return '"' + "\\n".join(quote(line)[1:-1] for line in lines) + '"'


def _attrs(**attrs: str) -> str:
    """``[k=v, ...]`` in the order given; values are already DOT text."""
    return "[" + ", ".join(f"{k}={v}" for k, v in attrs.items()) + "]"


def value_id(value: Value) -> str:
    return quote("%" + value.name)


def node_id(index: int) -> str:
    return quote(f"op{index}")


def device_colours(graph: Graph) -> dict[Device, tuple[str, str]]:
    """(border, fill) for each device; beyond eight devices the colours repeat (the
    labels still say ``@device``)."""
    return {d: DEVICE_COLOURS[i % len(DEVICE_COLOURS)]
            for i, d in enumerate(graph.devices())}


def to_dot(graph: Graph) -> str:
    """The graph as Graphviz DOT text, the same text for the same graph."""
    colours = device_colours(graph)
    returned: dict[Value, list[str]] = {}
    for name, v in graph.outputs:
        returned.setdefault(v, []).append(name)
    lines = [f"digraph {quote(graph.name)} {{",
             f"  graph {_attrs(label=quote(graph.name), labelloc='t', fontname='Helvetica')};",
             "  node [fontname=Helvetica, fontsize=10];",
             "  edge [arrowsize=0.6];"]
    for v in graph.inputs:
        lines.append(_value_line(v, colours, returned.get(v, [])))
    for i, node in enumerate(graph.nodes):
        lines.append(_node_line(i, node, colours))
        lines.extend(_value_line(v, colours, returned.get(v, [])) for v in node.outputs)
    for i, node in enumerate(graph.nodes):
        lines.extend(_edge_lines(i, node, colours))
    lines.extend(_legend(colours))
    lines.append("}")
    return "\n".join(lines) + "\n"


def _value_line(value: Value, colours: dict, returned: list[str]) -> str:
    border, fill = colours[value.device]
    text = [f"%{value.name}", f"{value.type} @{value.device}"]
    if value.dist is not None:
        text.append(str(value.dist))
    if value.role is not None:
        text.append(value.role if value.init is None else f"{value.role} = {value.init}")
    text.extend(f"return {name}" for name in returned)
    # Graph inputs stand out by role: data plain, params bold, state dashed.
    style = {"param": "filled,bold", "state": "filled,dashed"}.get(value.role, "filled")
    return f"  {value_id(value)} " + _attrs(
        shape="ellipse", label=_label(text), style=quote(style), color=quote(border),
        fillcolor=quote(fill)) + ";"


def _node_line(index: int, node: Node, colours: dict) -> str:
    border, fill = colours[node.device]
    attrs = dict(shape="box", label=_label(_node_text(node)), color=quote(border),
                 fillcolor=quote(fill))
    if _moves_data(node):
        # Data movement gets a double, heavy border: the eye finds it among the compute.
        attrs.update(style=quote("filled,bold"), peripheries="2", penwidth="2")
    elif node.body is not None:
        attrs.update(style=quote("filled,rounded"))
    else:
        attrs.update(style=quote("filled"))
    if node.loc:
        attrs["tooltip"] = quote(node.loc)
    return f"  {node_id(index)} " + _attrs(**attrs) + ";"


def _moves_data(node: Node) -> bool:
    """Drawn as data movement: the collectives and copies, and the partitioner's
    `slice` of a device's piece: every op the runtime runs on the host."""
    return op_has(node.op, Trait.host)


def _node_text(node: Node) -> list[str]:
    if node.body is not None:
        return [node.attrs["kernel"], " ".join(member.op for member in node.body)]
    if _moves_data(node):
        return [node.op, *(f"{k}={_attr_text(v)}" for k, v in node.attrs.items())]
    return [node.op]


def _attr_text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(x) for x in value) + "]"
    return str(value)


def _edge_lines(index: int, node: Node, colours: dict) -> list[str]:
    """Edges into the node from its inputs and out to its outputs, each coloured by the
    tensor's device (a copy's input edge and output edge differ)."""
    me = node_id(index)
    into = [f"  {value_id(v)} -> {me} {_attrs(color=quote(colours[v.device][0]))};"
            for v in node.inputs]
    out = [f"  {me} -> {value_id(v)} {_attrs(color=quote(colours[v.device][0]))};"
           for v in node.outputs]
    return into + out


def _legend(colours: dict[Device, tuple[str, str]]) -> list[str]:
    """A box per device in its colours, and one with the data-movement border."""
    lines = ["  subgraph cluster_legend {",
             f"    graph {_attrs(label=quote('devices'), style='dashed', fontsize='10')};"]
    for device, (border, fill) in colours.items():
        lines.append(f"    {quote(f'legend:{device}')} " + _attrs(
            shape="box", label=quote(str(device)), style="filled", color=quote(border),
            fillcolor=quote(fill)) + ";")
    lines.append(f"    {quote('legend:movement')} " + _attrs(
        shape="box", label=quote("copy / collective"), style="bold", peripheries="2",
        penwidth="2") + ";")
    lines.append("  }")
    return lines


def render_graph(graph: Graph, path: str | os.PathLike, fmt: str | None = None) -> str:
    """Write ``graph``'s picture to ``path`` as ``dot`` text, ``svg`` or ``png`` (from the
    suffix unless ``fmt`` says). Returns the path written."""
    path = os.fspath(path)
    fmt = fmt or _suffix(path, GRAPH_FORMATS, "graph picture")
    if fmt not in GRAPH_FORMATS:
        raise PurinecError(f"cannot draw a graph as {fmt!r}; use one of "
                           f"{', '.join(GRAPH_FORMATS)}")
    text = to_dot(graph)
    if fmt == "dot":
        atomic_write_text(path, text)
        return path
    dot = graphviz_dot(fmt)
    with replacing(path) as tmp:
        _run_dot(dot, fmt, text, tmp)
    return path


def graphviz_dot(fmt: str) -> str:
    """The path of Graphviz's ``dot``, which drawing ``fmt`` (svg, png) needs."""
    dot = shutil.which("dot")
    if dot is None:
        raise PurinecError(GRAPHVIZ_MISSING.format(fmt=fmt))
    return dot


def _run_dot(dot: str, fmt: str, text: str, out: str) -> None:
    try:
        result = subprocess.run([dot, f"-T{fmt}", "-o", out], input=text.encode(),
                                capture_output=True, timeout=GRAPHVIZ_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PurinecError(f"Graphviz ({dot}) took over {GRAPHVIZ_TIMEOUT_S} s to draw the "
                           f"graph; write .dot text instead and render it with other "
                           f"options (e.g. sfdp)") from None
    if result.returncode != 0:
        message = result.stderr.decode(errors="replace").strip()
        raise PurinecError(f"Graphviz ({dot} -T{fmt}) failed with exit status "
                           f"{result.returncode}: {message}")


# ---------------------------------------------------------------------------------------
# File names.


def _suffix(path: str, formats: tuple[str, ...], what: str) -> str:
    fmt = os.path.splitext(path)[1].lstrip(".").lower()
    if fmt not in formats:
        raise PurinecError(f"cannot tell the format of {what} {path!r} from its suffix; "
                           f"name it .{', .'.join(formats)}")
    return fmt


# ---------------------------------------------------------------------------------------
# Traces: lanes, tasks and their overlap.

COMPUTE_KIND, COPY_KIND, COMM_KIND = "compute", "copy", "communication"
KIND_COLOURS = {COMPUTE_KIND: "#4c72b0", COPY_KIND: "#dd8452", COMM_KIND: "#c44e52"}
_QUEUE_TASK_KIND = {COMPUTE: COMPUTE_KIND, COPY_IN: COPY_KIND, COPY_OUT: COPY_KIND,
                    COMM: COMM_KIND}
TIMELINE_FORMATS = ("png", "svg")


class TraceLane:
    """One trace thread: its name (``cpu:0/compute#1``), device and tasks (ms)."""

    def __init__(self, name: str, device: str):
        self.name, self.device = name, device
        self.tasks: list[tuple[float, float, str]] = []  # (start, end, kind)

    @property
    def queue_kind(self) -> str | None:
        """The queue kind its name ends with, if it is a purinec lane name."""
        kind = self.name.rsplit("/", 1)[-1].split("#", 1)[0]
        return kind if kind in QUEUE_KINDS else None


def _task_kind(lane: TraceLane, event: dict) -> str:
    """Compute, copy or communication: from the lane's queue kind, else from the op
    the event names (``"copy %x"``) for traces whose lanes are not named."""
    if lane.queue_kind is not None:
        return _QUEUE_TASK_KIND[lane.queue_kind]
    op = str(event.get("name", "")).split(" ", 1)[0]
    if op == "copy":
        return COPY_KIND
    return COMM_KIND if op_has(op, Trait.communicates) else COMPUTE_KIND


def _events(trace_events: Any) -> list[dict]:
    """The event list of a trace given as a path, a parsed JSON object or a list."""
    if isinstance(trace_events, (str, os.PathLike)):
        try:
            with open(trace_events, encoding="utf-8") as f:
                trace_events = json.load(f)
        except (OSError, ValueError) as e:
            raise PurinecError(f"cannot read trace {os.fspath(trace_events)}: {e}") from None
    if isinstance(trace_events, dict):
        trace_events = trace_events.get("traceEvents")
    if not isinstance(trace_events, list) or not all(isinstance(e, dict) for e in trace_events):
        raise PurinecError("a trace is Chrome trace event JSON: a list of events or an "
                           "object with a 'traceEvents' list, as purinec's Trace writes")
    return trace_events


def lanes_of(trace_events: Any) -> list[TraceLane]:
    """The trace's lanes in its own order (thread sort index, else first appearance),
    each with its tasks in milliseconds from the trace's first task."""
    events = _events(trace_events)
    processes, threads, order = {}, {}, {}
    for e in events:
        if e.get("ph") != "M":
            continue
        key = (e.get("pid"), e.get("tid"))
        if e.get("name") == "process_name":
            processes[e.get("pid")] = str(e["args"]["name"])
        elif e.get("name") == "thread_name":
            threads[key] = str(e["args"]["name"])
        elif e.get("name") == "thread_sort_index":
            order[key] = e["args"]["sort_index"]
    complete = [e for e in events if e.get("ph") == "X"]
    origin = min((float(e["ts"]) for e in complete), default=0.0)
    lanes: dict[tuple, TraceLane] = {}
    for e in complete:
        key = (e.get("pid"), e.get("tid"))
        if key not in lanes:
            device = processes.get(key[0], f"process {key[0]}")
            lanes[key] = TraceLane(threads.get(key, f"{device}/thread {key[1]}"), device)
        start = (float(e["ts"]) - origin) / 1e3
        lanes[key].tasks.append((start, start + float(e["dur"]) / 1e3,
                                 _task_kind(lanes[key], e)))
    first = {key: i for i, key in enumerate(lanes)}
    ranked = sorted(lanes, key=lambda k: (k[0], order.get(k, len(first) + first[k])))
    return [lanes[k] for k in ranked]


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(xs: list[tuple[float, float]],
                  ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intersection of two sorted disjoint interval lists (one merge sweep)."""
    result, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        start, end = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if start < end:
            result.append((start, end))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return result


def overlap(trace_events: Any) -> dict:
    """How a run spent its time, in milliseconds, from a Chrome trace (path, dict or list).

    ``wall_ms``: first task start to last task end. ``busy_ms``: each lane's summed task
    time; ``lane_kind``: each lane's task kind (compute / copy / communication).
    ``compute_ms``: time some compute lane was busy; ``comm_ms``: time some copy or
    communication lane was busy; ``hidden_ms``: the part of ``comm_ms`` during which
    some compute lane (of any device of the process) was busy too;
    ``hidden_fraction``: hidden_ms / comm_ms, 0.0 when there was no communication. A
    trace of several MPI ranks (lanes of devices ``rR/...``,
    `purinec.runtime.trace.merge_events`) counts each rank apart, its communication
    hidden only by its own compute, and adds the ranks' times up; ``ranks`` says how
    many there were.
    """
    lanes = lanes_of(trace_events)
    ranks: dict[int, list[TraceLane]] = {}
    for lane in lanes:
        ranks.setdefault(_rank_of(lane), []).append(lane)
    compute_ms = comm_ms = hidden_ms = 0.0
    for own in ranks.values():
        tasks = [t for lane in own for t in lane.tasks]
        compute = _union((a, b) for a, b, kind in tasks if kind == COMPUTE_KIND)
        comm = _union((a, b) for a, b, kind in tasks if kind != COMPUTE_KIND)
        compute_ms += _length(compute)
        comm_ms += _length(comm)
        hidden_ms += _length(_intersection(compute, comm))
    tasks = [t for lane in lanes for t in lane.tasks]
    return {
        "wall_ms": (max(b for _, b, _ in tasks) - min(a for a, _, _ in tasks)) if tasks else 0.0,
        "busy_ms": {lane.name: sum(b - a for a, b, _ in lane.tasks) for lane in lanes},
        "lane_kind": {lane.name: _lane_kind(lane) for lane in lanes},
        "compute_ms": compute_ms,
        "comm_ms": comm_ms,
        "hidden_ms": hidden_ms,
        "hidden_fraction": hidden_ms / comm_ms if comm_ms > 0 else 0.0,
        "ranks": max(len(ranks), 1),
    }


def _rank_of(lane: TraceLane) -> int:
    """The MPI rank of a lane's device (0 for a name that is not a purinec device)."""
    try:
        return Device.parse(lane.device).rank
    except ValueError:
        return 0


def _lane_kind(lane: TraceLane) -> str:
    if lane.queue_kind is not None:
        return _QUEUE_TASK_KIND[lane.queue_kind]
    kinds = {kind for _, _, kind in lane.tasks}
    return kinds.pop() if len(kinds) == 1 else "mixed"


# ---------------------------------------------------------------------------------------
# Timelines.


def timeline_format(path: str) -> str:
    """The picture format ``path`` names by its suffix (TIMELINE_FORMATS), else a
    `PurinecError`: for callers to check before the run they will draw."""
    return _suffix(path, TIMELINE_FORMATS, "timeline")


def timeline(trace_events: Any, path: str | os.PathLike, stats: dict | None = None) -> str:
    """Draw the trace (path, dict or list) to ``path`` (``.png`` or ``.svg``): one lane
    per device queue, grouped by device, each task a bar coloured by kind, time in ms;
    the title says what `overlap` says (``stats``, when the caller has them already).
    Returns the path written."""
    path = os.fspath(path)
    fmt = timeline_format(path)
    lanes = lanes_of(trace_events)
    if not lanes:
        raise PurinecError("the trace has no tasks to draw; run the program with a Trace "
                           "first")
    figure = _timeline_figure(lanes, stats or overlap(trace_events))
    with replacing(path) as tmp:
        figure.savefig(tmp, format=fmt, dpi=120)
    return path


def _timeline_figure(lanes: list[TraceLane], stats: dict):
    # Imported here: matplotlib costs a second to import and only pictures need it. A
    # bare Figure on an Agg canvas leaves pyplot's global backend alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    figure = Figure(figsize=(11, 1.2 + 0.45 * len(lanes)), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    rows = list(range(len(lanes)))[::-1]  # the first lane on top
    for row, lane in zip(rows, lanes):
        for kind, colour in KIND_COLOURS.items():
            bars = [(a, b - a) for a, b, k in lane.tasks if k == kind]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colour, linewidth=0)
    _separate_devices(ax, lanes, rows)
    ax.set_yticks(rows, [lane.name for lane in lanes], fontsize=8)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_xlim(0, max(stats["wall_ms"], 1e-6))
    ax.set_xlabel("time (ms)")
    figure.legend(handles=[Patch(color=c, label=k) for k, c in KIND_COLOURS.items()],
                  loc="outside lower center", fontsize=8, ncols=3, frameon=False)
    ax.set_title(_timeline_title(stats), fontsize=10)
    return figure


def _separate_devices(ax, lanes: list[TraceLane], rows: list[int]) -> None:
    """A rule between consecutive devices' lanes, so lanes read grouped by device."""
    for above, below, row in zip(lanes, lanes[1:], rows[1:]):
        if above.device != below.device:
            ax.axhline(row + 0.5, color="#999999", linewidth=0.8)


def _timeline_title(stats: dict) -> str:
    busy = f"compute busy {stats['compute_ms']:.3f} ms"
    if stats["comm_ms"] > 0:
        busy += (f"; communication {stats['comm_ms']:.3f} ms, "
                 f"{stats['hidden_fraction']:.0%} hidden behind compute")
    if stats["ranks"] > 1:
        return (f"total {stats['wall_ms']:.3f} ms on {stats['ranks']} ranks\n"
                f"the ranks' times added up: {busy}")
    return f"total {stats['wall_ms']:.3f} ms, {busy}"
