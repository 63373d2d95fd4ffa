"""Pictures: the IR as DOT (checked by parsing it back), rendering through Graphviz,
timelines of real traces, and communication overlap against hand-computed numbers and
an independent sweep over elementary segments."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat

import numpy as np
import pytest

import purinec
from purinec import viz
from purinec.errors import ArtifactError, PurinecError
from purinec.ir.graph import Graph
from purinec.ir.parser import parse
from purinec.ir.printer import print_graph
from purinec.ir.types import Device, DistKind, Distribution, DType, TensorType
from purinec.runtime.executor import Executable
from purinec.runtime.plan import reference_kernels
from purinec.runtime.trace import Trace

C0, C1 = Device("cpu", 0), Device("cpu", 1)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HAS_DOT = shutil.which("dot") is not None
needs_dot = pytest.mark.skipif(not HAS_DOT, reason="Graphviz's dot is not installed "
                                                   "(apt-get install graphviz)")


def T(*shape):
    return TensorType(shape, DType.f32)


def two_device_graph(n: int = 16) -> Graph:
    """A hand-partitioned product: copies to cpu:1, a matmul on each device, an
    allreduce over both and a slice of cpu:1's result."""
    g = Graph("two")
    x = g.add_input("x", T(n, n), C0)
    w = g.add_input("w", T(n, n), C0, role="param", init="xavier")
    it = g.add_input("iteration", TensorType((), DType.i64), C0, role="state",
                     init="constant(0)")
    a0 = g.add_node("matmul", [x, w], names=["a.p0"]).outputs[0]
    x1 = g.add_node("copy", [x], names=["x.p1"], device=C1).outputs[0]
    w1 = g.add_node("copy", [w], names=["w.p1"], device=C1).outputs[0]
    a1 = g.add_node("matmul", [x1, w1], names=["a.p1"]).outputs[0]
    r0, r1 = g.add_node("allreduce", [a0, a1], {"group": "cpu:0,cpu:1"},
                        names=["r.p0", "r.p1"]).outputs
    r1.device = C1
    r0.dist = Distribution(DistKind.replicated, (C0, C1))
    s = g.add_node("slice", [r1], {"axis": 0, "start": 0, "stop": 2}, names=["s"]).outputs[0]
    it2 = g.add_node("add_scalar", [it], {"value": 1}, names=["iteration.next"]).outputs[0]
    g.set_outputs([("r", r0), ("s", s), ("iteration", it2)])
    return g


# ---------------------------------------------------------------------------------------
# Reading DOT back: statements one a line, as to_dot writes them.

_ATTR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^,\]]+)')
_ID = r'"((?:[^"\\]|\\.)*)"'
_NODE = re.compile(rf"^\s*{_ID} \[(.*)\];$")
_EDGE = re.compile(rf"^\s*{_ID} -> {_ID} \[(.*)\];$")


def _unquote(text: str) -> str:
    if not text.startswith('"'):
        return text
    return re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), text[1:-1])


def parse_dot(text: str) -> tuple[dict[str, dict], list[tuple[str, str, dict]]]:
    """(nodes by id with their attributes, edges as (tail, head, attributes))."""
    nodes, edges = {}, []
    for line in text.splitlines():
        if m := _EDGE.match(line):
            attrs = {k: _unquote(v) for k, v in _ATTR.findall(m.group(3))}
            edges.append((_unquote('"' + m.group(1) + '"'), _unquote('"' + m.group(2) + '"'),
                          attrs))
        elif m := _NODE.match(line):
            nodes[_unquote('"' + m.group(1) + '"')] = {
                k: _unquote(v) for k, v in _ATTR.findall(m.group(2))}
    return nodes, edges


def ops_of(nodes: dict) -> dict[str, dict]:
    return {k: v for k, v in nodes.items() if re.fullmatch(r"op\d+", k)}


def values_of(nodes: dict) -> dict[str, dict]:
    return {k: v for k, v in nodes.items() if k.startswith("%")}


# ---------------------------------------------------------------------------------------
# to_dot


def test_every_op_and_value_appears_with_its_edges():
    g = two_device_graph()
    nodes, edges = parse_dot(viz.to_dot(g))
    ops, values = ops_of(nodes), values_of(nodes)
    assert set(values) == {"%" + v.name for v in g.values()}
    assert all(attrs["shape"] == "ellipse" for attrs in values.values())
    assert set(ops) == {f"op{i}" for i in range(len(g.nodes))}
    assert all(attrs["shape"] == "box" for attrs in ops.values())
    for i, node in enumerate(g.nodes):
        assert ops[f"op{i}"]["label"].split("\n")[0] == node.op
    want = set()
    for i, node in enumerate(g.nodes):
        want |= {("%" + v.name, f"op{i}") for v in node.inputs}
        want |= {(f"op{i}", "%" + v.name) for v in node.outputs}
    assert sorted((a, b) for a, b, _ in edges) == sorted(want)  # each edge once, nothing else


def test_values_show_name_type_device_distribution_role_and_return():
    g = two_device_graph()
    values = values_of(parse_dot(viz.to_dot(g))[0])
    assert values["%r.p0"]["label"].split("\n") == [
        "%r.p0", "f32[16,16] @cpu:0", "replicated[cpu:0,cpu:1]", "return r"]
    assert values["%x.p1"]["label"].split("\n") == ["%x.p1", "f32[16,16] @cpu:1"]
    assert values["%x"]["label"].endswith("\ndata")
    assert values["%w"]["label"].endswith("\nparam = xavier")
    assert values["%iteration"]["label"].endswith("\nstate = constant(0)")
    styles = {name: values[name]["style"] for name in ("%x", "%w", "%iteration", "%a.p0")}
    assert styles["%x"] == styles["%a.p0"] == "filled"
    assert len({styles["%x"], styles["%w"], styles["%iteration"]}) == 3


def test_colours_follow_devices():
    g = two_device_graph()
    nodes, edges = parse_dot(viz.to_dot(g))
    colour_of = {}
    for v in g.values():
        colour_of.setdefault(v.device, set()).add(nodes["%" + v.name]["fillcolor"])
    for i, node in enumerate(g.nodes):
        colour_of[node.device].add(nodes[f"op{i}"]["fillcolor"])
    assert all(len(colours) == 1 for colours in colour_of.values())
    assert colour_of[C0] != colour_of[C1]
    # An edge takes its tensor's colour: a copy's edges have both devices' colours.
    border = {v.name: nodes["%" + v.name]["color"] for v in g.values()}
    for tail, head, attrs in edges:
        tensor = tail if tail.startswith("%") else head
        if tensor.startswith("%"):
            assert attrs["color"] == border[tensor[1:]]
    legend = {k: v for k, v in nodes.items() if k.startswith("legend:")}
    assert legend["legend:cpu:0"]["fillcolor"] == nodes["%x"]["fillcolor"]
    assert legend["legend:cpu:1"]["fillcolor"] == nodes["%x.p1"]["fillcolor"]


def test_communication_ops_are_marked_with_their_attributes():
    g = two_device_graph()
    ops = ops_of(parse_dot(viz.to_dot(g))[0])
    marked = {g.nodes[int(k[2:])].op for k, attrs in ops.items()
              if attrs.get("peripheries") == "2"}
    assert marked == {"copy", "allreduce", "slice"}
    allreduce = next(attrs for attrs in ops.values() if attrs["label"].startswith("allreduce"))
    assert allreduce["label"].split("\n") == ["allreduce", "group=cpu:0,cpu:1", "tensors=1"]
    assert "filled" in allreduce["style"] and "bold" in allreduce["style"]


def test_output_is_deterministic_and_survives_the_text_form():
    g = two_device_graph()
    text = viz.to_dot(g)
    assert viz.to_dot(g.clone()) == text
    assert viz.to_dot(parse(print_graph(g))) == text


def test_names_are_quoted_safely(tmp_path):
    g = Graph('net "a"\\b')
    x = g.add_input('x"y\\z', T(2))
    y = g.add_node("relu", [x], names=['a "b"']).outputs[0]
    g.set_outputs([("y", y)])
    text = viz.to_dot(g)
    assert text.startswith('digraph "net \\"a\\"\\\\b" {')
    nodes, edges = parse_dot(text)
    assert {'%x"y\\z', '%a "b"'} <= set(nodes)
    assert nodes['%x"y\\z']["label"].split("\n")[0] == '%x"y\\z'
    assert ('%x"y\\z', "op0") in [(a, b) for a, b, _ in edges]
    if HAS_DOT:  # Graphviz itself reads it back, names intact
        viz.render_graph(g, tmp_path / "g.svg")
        assert "%a &quot;b&quot;" in (tmp_path / "g.svg").read_text()


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    """A real CPU program (fused, trained a few steps) and the trace of its runs."""
    trace = Trace()
    program = purinec.compile("mlp", target="cpu", train=purinec.SGD(lr=0.1), batch=8,
                              trace=trace)
    rng = np.random.default_rng(0)
    feeds = {"data": rng.standard_normal((8, 1, 28, 28)).astype(np.float32),
             "label": rng.integers(0, 10, 8).astype(np.int32)}
    for _ in range(3):
        program.step(feeds)
    path = tmp_path_factory.mktemp("trace") / "mlp.json"
    trace.write(str(path))
    return program, trace, path


def test_fused_nodes_are_one_box_named_by_their_kernel(mlp_run):
    program = mlp_run[0]
    g = program.ir
    fused = [(i, n) for i, n in enumerate(g.nodes) if n.body is not None]
    assert fused, "the cpu target fuses the mlp"
    nodes, edges = parse_dot(viz.to_dot(g))
    for i, node in fused:
        label = nodes[f"op{i}"]["label"].split("\n")
        assert label == [node.attrs["kernel"], " ".join(m.op for m in node.body)]
        internal = {v.name for v in node.defined_values()} - {v.name for v in node.outputs}
        assert not internal & {k[1:] for k in values_of(nodes)}
    assert set(values_of(nodes)) == {"%" + v.name for v in g.values()}


# ---------------------------------------------------------------------------------------
# render_graph


def test_render_dot_text(tmp_path):
    g = two_device_graph()
    path = tmp_path / "g.dot"
    assert viz.render_graph(g, path) == str(path)
    assert path.read_text() == viz.to_dot(g)
    viz.render_graph(g, tmp_path / "g.txt", fmt="dot")
    assert (tmp_path / "g.txt").read_text() == viz.to_dot(g)
    assert sorted(os.listdir(tmp_path)) == ["g.dot", "g.txt"]  # no temporary files left


@needs_dot
def test_render_svg_and_png_with_graphviz(tmp_path, mlp_run):
    for g in (two_device_graph(), mlp_run[0].ir):
        viz.render_graph(g, tmp_path / "g.svg")
        svg = (tmp_path / "g.svg").read_text()
        assert "<svg" in svg and f"%{g.outputs[0][1].name}" in svg
        viz.render_graph(g, tmp_path / "g.png")
        data = (tmp_path / "g.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
    viz.render_graph(two_device_graph(), tmp_path / "picture", fmt="png")
    assert (tmp_path / "picture").read_bytes().startswith(PNG_MAGIC)
    assert sorted(os.listdir(tmp_path)) == ["g.png", "g.svg", "picture"]


def test_missing_graphviz_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr(viz.shutil, "which", lambda name: None)
    for suffix in ("svg", "png"):
        with pytest.raises(PurinecError, match="apt-get install graphviz") as info:
            viz.render_graph(two_device_graph(), tmp_path / f"g.{suffix}")
        assert "`dot`" in str(info.value) and suffix in str(info.value)
    viz.render_graph(two_device_graph(), tmp_path / "g.dot")  # text needs no Graphviz
    assert os.listdir(tmp_path) == ["g.dot"]


def _fake_dot(tmp_path, script: str) -> str:
    path = tmp_path / "fake-dot"
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_graphviz_failure_is_reported_and_keeps_the_old_file(tmp_path, monkeypatch):
    fake = _fake_dot(tmp_path, "echo 'Error: syntax error in line 3' >&2; exit 2")
    monkeypatch.setattr(viz.shutil, "which", lambda name: fake)
    out = tmp_path / "g.svg"
    out.write_text("old")
    with pytest.raises(PurinecError, match="exit status 2: Error: syntax error in line 3"):
        viz.render_graph(two_device_graph(), out)
    assert out.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["fake-dot", "g.svg"]


def test_graphviz_timeout(tmp_path, monkeypatch):
    fake = _fake_dot(tmp_path, "exec sleep 30")
    monkeypatch.setattr(viz.shutil, "which", lambda name: fake)
    monkeypatch.setattr(viz, "GRAPHVIZ_TIMEOUT_S", 0.2)
    with pytest.raises(PurinecError, match="took over 0.2 s"):
        viz.render_graph(two_device_graph(), tmp_path / "g.png")
    assert sorted(os.listdir(tmp_path)) == ["fake-dot"]


def test_bad_format_and_unwritable_path(tmp_path):
    g = two_device_graph()
    with pytest.raises(PurinecError, match=r"suffix; name it \.dot, \.svg, \.png"):
        viz.render_graph(g, tmp_path / "g.jpeg")
    with pytest.raises(PurinecError, match="cannot draw a graph as 'pdf'"):
        viz.render_graph(g, tmp_path / "g.dot", fmt="pdf")
    with pytest.raises(ArtifactError, match="cannot write"):
        viz.render_graph(g, tmp_path / "missing" / "g.dot")


# ---------------------------------------------------------------------------------------
# Traces: synthetic ones, built the way purinec.runtime.trace.Trace writes them.


def synthetic(lanes: dict[str, list[tuple[float, float, str]]], named: bool = True) -> dict:
    """A Chrome trace with one thread per lane (``cpu:0/comm``), tasks given as (start ms,
    end ms, op); ``named=False`` leaves out the metadata, as other tools' traces may."""
    devices = list(dict.fromkeys(name.rsplit("/", 1)[0] for name in lanes))
    events = []
    for tid, (name, tasks) in enumerate(lanes.items(), 1):
        pid = devices.index(name.rsplit("/", 1)[0]) + 1
        if named:
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": name}})
        for start, end, op in tasks:
            events.append({"name": f"{op} %t", "cat": "kernel", "ph": "X", "ts": start * 1e3,
                           "dur": (end - start) * 1e3, "pid": pid, "tid": tid, "args": {}})
    if named:
        events += [{"name": "process_name", "ph": "M", "pid": i + 1, "args": {"name": d}}
                   for i, d in enumerate(devices)]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def test_overlap_hand_computed():
    # compute [2,12] on cpu:0; copy_in [7,17] on cpu:1; comm [14,22] on cpu:0.
    # Communication (copy or comm) is busy over [7,22] = 15 ms; compute covers [7,12].
    trace = synthetic({"cpu:0/compute": [(2, 6, "matmul"), (6, 12, "relu")],
                       "cpu:0/comm": [(14, 22, "allreduce")],
                       "cpu:1/copy_in": [(7, 17, "copy")]})
    stats = viz.overlap(trace)
    assert stats["wall_ms"] == pytest.approx(20)
    assert stats["busy_ms"] == pytest.approx({"cpu:0/compute": 10, "cpu:0/comm": 8,
                                              "cpu:1/copy_in": 10})
    assert stats["lane_kind"] == {"cpu:0/compute": "compute", "cpu:0/comm": "communication",
                                  "cpu:1/copy_in": "copy"}
    assert stats["compute_ms"] == pytest.approx(10)
    assert stats["comm_ms"] == pytest.approx(15)
    assert stats["hidden_ms"] == pytest.approx(5)
    assert stats["hidden_fraction"] == pytest.approx(1 / 3)


def test_overlap_counts_compute_of_any_device_once():
    # Two compute lanes on two devices overlap each other over [4,6]: compute busy
    # [0,6] u [8,9] = 7 ms. The comm task [5,10] is hidden over [5,6] and [8,9]: 2 of 5.
    trace = synthetic({"cpu:0/compute": [(0, 6, "matmul")],
                       "cpu:0/comm": [(5, 10, "allgather")],
                       "cpu:1/compute": [(4, 6, "add"), (8, 9, "add")],
                       "cpu:1/compute#1": [(4.5, 5.5, "add")]})
    stats = viz.overlap(trace)
    assert stats["compute_ms"] == pytest.approx(7)
    assert stats["comm_ms"] == pytest.approx(5)
    assert stats["hidden_ms"] == pytest.approx(2)
    assert stats["hidden_fraction"] == pytest.approx(0.4)
    assert stats["wall_ms"] == pytest.approx(10)


def test_overlap_of_several_ranks_counts_each_rank_on_its_own():
    """A job's merged trace: a rank's communication is hidden only by its own compute
    (not by another process's), and the ranks' times add up."""
    trace = synthetic({"cpu:0/compute": [(0, 10, "conv")], "cpu:0/comm": [(8, 14, "ar")],
                       "r1/cpu:0/compute": [(0, 14, "conv")],
                       "r1/cpu:0/comm": [(12, 16, "ar")]})
    stats = viz.overlap(trace)
    assert stats["ranks"] == 2 and stats["wall_ms"] == pytest.approx(16)
    assert (stats["compute_ms"], stats["comm_ms"], stats["hidden_ms"]) == pytest.approx(
        (10 + 14, 6 + 4, 2 + 2))
    assert viz.overlap(synthetic({"cpu:0/compute": [(0, 1, "conv")]}))["ranks"] == 1


def test_merged_traces_of_ranks_keep_their_devices_apart(tmp_path):
    from purinec.runtime.trace import merge_events

    ranks = [synthetic({"cpu:0/compute": [(5, 9, "conv")], "cpu:0/comm": [(9, 12, "ar")]}),
             synthetic({"r1/cpu:0/compute": [(3, 10, "conv")],
                         "r1/cpu:0/comm": [(10, 12, "ar")]})]
    merged = merge_events([trace["traceEvents"] for trace in ranks])
    assert min(e["ts"] for e in merged if "ts" in e) == 0  # from the first task of all
    lanes = viz.lanes_of(merged)
    assert [(lane.name, lane.device, [t[:2] for t in lane.tasks]) for lane in lanes] == [
        ("cpu:0/compute", "cpu:0", [(2, 6)]), ("cpu:0/comm", "cpu:0", [(6, 9)]),
        ("r1/cpu:0/compute", "r1/cpu:0", [(0, 7)]), ("r1/cpu:0/comm", "r1/cpu:0", [(7, 9)])]
    assert viz.timeline(merged, tmp_path / "job.png") == str(tmp_path / "job.png")


def test_overlap_without_lane_names_uses_op_names():
    trace = synthetic({"cpu:0/a": [(0, 4, "conv2d")], "cpu:0/b": [(2, 6, "copy")],
                       "cpu:0/c": [(3, 8, "allreduce")]}, named=False)
    stats = viz.overlap(trace["traceEvents"])
    assert stats["comm_ms"] == pytest.approx(6)  # [2,8]
    assert stats["hidden_ms"] == pytest.approx(2)  # [2,4]
    assert sorted(stats["lane_kind"].values()) == ["communication", "compute", "copy"]


def test_overlap_without_communication():
    stats = viz.overlap(synthetic({"cpu:0/compute": [(1, 3, "relu")]}))
    assert stats["comm_ms"] == stats["hidden_ms"] == stats["hidden_fraction"] == 0.0
    assert stats["wall_ms"] == pytest.approx(2)
    empty = viz.overlap({"traceEvents": []})
    assert empty["wall_ms"] == 0.0 and empty["busy_ms"] == {}


def _segment_reference(lanes: dict[str, list[tuple[float, float, str]]]) -> tuple:
    """(compute, comm, hidden) by cutting time at every task boundary and asking, for
    each elementary segment, which kinds of lane are busy somewhere inside it."""
    cuts = sorted({t for tasks in lanes.values() for a, b, _ in tasks for t in (a, b)})
    compute = comm = hidden = 0.0
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        busy = {name.rsplit("/", 1)[1].split("#")[0] for name, tasks in lanes.items()
                if any(s < mid < e for s, e, _ in tasks)}
        is_compute, is_comm = "compute" in busy, bool(busy - {"compute"})
        compute += (b - a) * is_compute
        comm += (b - a) * is_comm
        hidden += (b - a) * (is_compute and is_comm)
    return compute, comm, hidden


@pytest.mark.parametrize("seed", range(8))
def test_overlap_matches_a_segment_sweep_on_random_traces(seed):
    rng = np.random.default_rng(seed)
    lanes = {}
    for name in ("cpu:0/compute", "cpu:0/compute#1", "cpu:0/comm", "cpu:1/compute",
                 "cpu:1/copy_in", "cpu:1/copy_out"):
        t, tasks = float(rng.integers(0, 5)), []
        for _ in range(int(rng.integers(0, 6))):  # a lane's tasks never overlap
            start = t + float(rng.integers(0, 4))
            t = start + float(rng.integers(1, 6))
            tasks.append((start, t, "op"))
        lanes[name] = tasks
    stats = viz.overlap(synthetic(lanes))
    compute, comm, hidden = _segment_reference(lanes)
    assert (stats["compute_ms"], stats["comm_ms"], stats["hidden_ms"]) == pytest.approx(
        (compute, comm, hidden))
    for name, tasks in lanes.items():
        if tasks:
            assert stats["busy_ms"][name] == pytest.approx(sum(b - a for a, b, _ in tasks))


def test_bad_traces_are_purinec_errors(tmp_path):
    with pytest.raises(PurinecError, match="cannot read trace"):
        viz.overlap(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PurinecError, match="cannot read trace"):
        viz.overlap(str(tmp_path / "bad.json"))
    with pytest.raises(PurinecError, match="traceEvents"):
        viz.overlap({"events": []})
    with pytest.raises(PurinecError, match="no tasks to draw"):
        viz.timeline({"traceEvents": []}, tmp_path / "t.png")
    with pytest.raises(PurinecError, match=r"name it \.png, \.svg"):
        viz.timeline(synthetic({"cpu:0/compute": [(0, 1, "relu")]}), tmp_path / "t.pdf")


# ---------------------------------------------------------------------------------------
# Real traces: the CPU target's mlp, and a two-device graph with copies and an allreduce.


def test_timeline_of_a_real_cpu_run(mlp_run, tmp_path):
    _, trace, path = mlp_run
    png = tmp_path / "t.png"
    assert viz.timeline(path, png) == str(png)
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    viz.timeline(json.loads(path.read_text()), tmp_path / "t.svg")
    assert "<svg" in (tmp_path / "t.svg").read_text()
    assert sorted(os.listdir(tmp_path)) == ["t.png", "t.svg"]
    stats = viz.overlap(trace.events())
    summary = trace.summary()
    assert stats["wall_ms"] == pytest.approx(summary.span * 1e3, rel=1e-6)
    assert stats["busy_ms"] == pytest.approx({k: s * 1e3 for k, s in summary.busy.items()},
                                             rel=1e-6)
    assert set(stats["lane_kind"].values()) == {"compute"} and stats["comm_ms"] == 0.0


def test_timeline_and_overlap_of_a_two_device_run(tmp_path):
    g = two_device_graph(48)
    trace = Trace()
    exe = Executable(g, reference_kernels(g), trace=trace, workers=2)
    rng = np.random.default_rng(1)
    env = {"x": rng.standard_normal((48, 48)).astype(np.float32),
           "w": rng.standard_normal((48, 48)).astype(np.float32),
           "iteration": np.zeros((), np.int64)}
    for _ in range(3):
        exe(dict(env))
    stats = viz.overlap(trace.events())
    kinds = stats["lane_kind"]
    assert kinds["cpu:1/copy_in"] == "copy" and kinds["cpu:0/comm"] == "communication"
    copy_lanes = [lane for lane, kind in kinds.items() if kind != "compute"]
    assert stats["comm_ms"] <= sum(stats["busy_ms"][lane] for lane in copy_lanes) + 1e-9
    assert 0 <= stats["hidden_ms"] <= min(stats["comm_ms"], stats["compute_ms"]) + 1e-9
    assert stats["hidden_fraction"] == pytest.approx(stats["hidden_ms"] / stats["comm_ms"])
    lanes = viz.lanes_of(trace.events())
    devices = [lane.device for lane in lanes]
    assert devices == sorted(devices)  # grouped by device, cpu:0 first
    viz.timeline(trace.events(), tmp_path / "two.png")
    assert (tmp_path / "two.png").read_bytes().startswith(PNG_MAGIC)
