"""The memory planner: reuse by liveness, in-place updates, views, outputs that survive."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from purinec.errors import MemoryLimitError
from purinec.ir.graph import Graph, Node, anchor_destination, external_inputs
from purinec.ir.ops import REGISTRY, FusionKind
from purinec.ir.types import DType, Device, TensorType
from purinec.runtime.executor import Executable
from purinec.runtime.memory import (ALIGNMENT, ARENA, COPY, EXTERNAL, FRESH, LIMIT_VARIABLE,
                                    VARIABLE, aligned, is_view, may_alias, plan_memory)
from purinec.runtime.plan import Plan, reference_kernels
from purinec.runtime.reference import execute
from test_runtime import assert_same, copied, random_env, random_graph

F32 = DType.f32
T44 = TensorType((4, 4), F32)


def matmul_chain(length: int) -> Graph:
    graph = Graph("chain")
    v = graph.add_input("x", T44)
    for _ in range(length):
        v = graph.add_node("matmul", [v, v]).outputs[0]
    graph.set_outputs([("y", v)])
    return graph


def test_liveness_reuse_lowers_the_peak_on_a_chain():
    memory = plan_memory(matmul_chain(6))
    cpu = Device()
    # A matmul cannot write over its input, so two buffers take turns.
    assert memory.arena_bytes[cpu] == 2 * aligned(T44.nbytes)
    assert memory.naive_bytes[cpu] == 6 * aligned(T44.nbytes)
    assert memory.saved_bytes[cpu] == 4 * aligned(T44.nbytes)
    assert "peak 128 B" in memory.summary()


def test_an_elementwise_chain_runs_in_one_buffer():
    graph = Graph("chain")
    v = graph.add_input("x", T44)
    v = graph.add_node("scale", [v], {"alpha": 2.0}).outputs[0]
    for op in ("relu", "tanh", "sigmoid"):
        v = graph.add_node(op, [v]).outputs[0]
    graph.set_outputs([("y", v)])
    memory = plan_memory(graph)
    assert memory.arena_bytes[Device()] == aligned(T44.nbytes)
    assert sum(1 for c in memory.classes if c.donor is not None) == 3
    env = random_env(graph)
    assert_same(execute(graph, copied(env)), Executable(graph, reference_kernels(graph))(env))


def independent_liveness(graph: Graph, schedule: list[Node]) -> tuple[dict, dict]:
    """Live ranges recomputed from the graph alone, run in ``schedule``: a value is
    live from the node that writes its memory to its last reader (to the end for
    outputs)."""
    position = {node: i for i, node in enumerate(schedule)}
    start, end = {}, {}
    for node in schedule:
        for value in node.outputs:
            writer = node
            while is_view(writer) and writer.inputs[0].producer is not None:
                writer = writer.inputs[0].producer
            start[value] = end[value] = position[writer]
        if not is_view(node):
            for value in node.inputs:
                if value in end:
                    end[value] = max(end[value], position[node])
    for _, value in graph.outputs:
        if value in end:
            end[value] = len(graph.nodes)
    # A view keeps its base alive and the other way round.
    changed = True
    while changed:
        changed = False
        for node in graph.nodes:
            if is_view(node) and node.inputs[0] in end:
                a, b = node.inputs[0], node.outputs[0]
                if end[a] != end[b]:
                    end[a] = end[b] = max(end[a], end[b])
                    changed = True
    return start, end


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n_nodes=st.integers(1, 25),
       n_devices=st.integers(1, 2))
def test_no_two_live_values_overlap(seed, n_nodes, n_devices):
    graph = random_graph(seed, n_nodes, n_devices)
    memory = plan_memory(graph)
    start, end = independent_liveness(graph, memory.schedule)
    arena = [v for v in start if memory.class_of[v].storage == ARENA]
    group = {}  # what holds each value's memory: its class, or the concat's output
    for v in arena:
        group.setdefault((memory.class_of[v].within or memory.class_of[v]).root, []).append(v)

    def held(v):
        members = group[(memory.class_of[v].within or memory.class_of[v]).root]
        return min(start[u] for u in members), max(end[u] for u in members)

    for v in arena:
        cls = memory.class_of[v]
        whole = cls.within or cls
        assert whole.offset % ALIGNMENT == 0 and cls.device == v.device
        assert cls.offset + v.type.nbytes <= memory.arena_bytes[v.device]
        if cls.within is not None:  # a concat's input, at its run of the output
            assert whole.offset <= cls.offset < whole.offset + whole.root.type.nbytes
            (concat, part), = [(n, u) for n in memory.elided for u in n.inputs
                               if memory.class_of[u] is cls]
            assert concat.outputs[0] in whole.members
            run = sum(u.type.nbytes for u in concat.inputs[:concat.inputs.index(part)])
            assert cls.offset == whole.offset + run
    for i, a in enumerate(arena):
        for b in arena[i + 1:]:
            ca, cb = memory.class_of[a], memory.class_of[b]
            if ca is cb or a.device != b.device or ca.within is cb or cb.within is ca:
                continue
            if ca.within is not None and ca.within is cb.within:
                assert ca.offset + ca.size <= cb.offset or cb.offset + cb.size <= ca.offset
                continue
            ca, cb = ca.within or ca, cb.within or cb
            if ca.offset >= cb.offset + cb.size or cb.offset >= ca.offset + ca.size:
                continue
            # Overlapping memory: one must be dead before the other is written, or the
            # later one is written in place by the elementwise node that last reads it.
            # (A concat's inputs and output hold its memory from the first input's
            # writer to the last reader of any of them.)
            first, second = (a, b) if held(a)[0] <= held(b)[0] else (b, a)
            if held(first)[1] < held(second)[0]:
                continue
            assert not (ca.holds_parts or cb.holds_parts), (first, second)
            writer = second.producer
            while is_view(writer):
                writer = writer.inputs[0].producer
            assert end[first] == start[second], (first, second)
            assert REGISTRY[writer.op].fusion is FusionKind.elementwise
            assert any(memory.class_of[u] is memory.class_of[first] for u in writer.inputs)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_variables_updated_in_place_only_when_safe(seed):
    graph = random_graph(seed, 12, 2)
    memory = plan_memory(graph)
    position = {node: i for i, node in enumerate(memory.schedule)}
    for cls in memory.classes:
        if cls.storage == EXTERNAL and cls.external is not cls.root:
            variable = memory.class_of[cls.external]
            assert REGISTRY[cls.writer.op].fusion is FusionKind.elementwise
            assert cls.writer in variable.readers
            assert all(position[r] <= position[cls.writer] for r in variable.readers)
            assert all(v is not cls.external for _, v in graph.outputs)


def sgd_graph(late_reader: bool) -> Graph:
    graph = Graph("train")
    x = graph.add_input("x", T44)
    w = graph.add_input("w", T44, role="param")
    h = graph.add_input("w.history", T44, role="state")
    y = graph.add_node("matmul", [x, w]).outputs[0]
    grad = graph.add_node("matmul", [x, y], {"trans_a": True}).outputs[0]
    sgd = graph.add_node("sgd", [w, h, grad], {"lr": 0.1, "momentum": 0.9},
                         names=["w.next", "w.history.next"])
    outputs = [("y", y), ("w", sgd.outputs[0]), ("w.history", sgd.outputs[1])]
    if late_reader:  # reads the old weight after the update: no longer safe in place
        outputs.append(("late", graph.add_node("relu", [w]).outputs[0]))
    graph.set_outputs(outputs)
    return graph


def test_sgd_updates_the_params_own_array():
    graph = sgd_graph(late_reader=False)
    memory = plan_memory(graph)
    assert {o.name: o.mode for o in memory.outputs} == {
        "y": COPY, "w": VARIABLE, "w.history": VARIABLE}
    exe = Executable(graph, reference_kernels(graph))
    env = random_env(graph)
    expected = execute(graph, copied(env))
    for _ in range(2):
        outputs = exe(env)
        assert outputs["w"] is env["w"] and outputs["w.history"] is env["w.history"]
        assert_same(expected, outputs)
        env = {**env, "x": env["x"]}
        expected = execute(graph, copied(env))


def test_an_update_moves_after_the_variables_last_reader_to_be_made_in_place():
    graph = sgd_graph(late_reader=True)
    sgd, late = graph.nodes[2], graph.nodes[3]
    memory = plan_memory(graph)
    assert memory.schedule == graph.nodes[:2] + [late, sgd]
    assert {o.name: o.mode for o in memory.outputs}["w"] == VARIABLE
    exe = Executable(graph, reference_kernels(graph))
    env = random_env(graph)
    expected = execute(graph, copied(env))
    outputs = exe(env)
    assert outputs["w"] is env["w"]
    assert_same(expected, outputs)  # the late reader saw the old weight


def _with_a_reader_of_the_history(graph: Graph, op: str, old_weight: bool) -> Node:
    """A node right after the update reading its new history (and the old weight):
    what a fused sum + SGD exporting the sum for a copy looks like to the planner."""
    w, sgd = graph.input("w"), graph.nodes[2]
    node = graph.make_node(op, [w, sgd.outputs[1]] if old_weight else [sgd.outputs[1]])
    graph.nodes.insert(3, node)
    graph.set_outputs([*graph.outputs, ("after", node.outputs[0])])
    return node


@pytest.mark.parametrize("old_weight", [False, True])
def test_an_update_whose_other_output_is_read_moves_with_its_reader(old_weight):
    graph = sgd_graph(late_reader=True)
    sgd, late = graph.nodes[2], graph.nodes[3]
    after = _with_a_reader_of_the_history(graph, "add" if old_weight else "tanh", old_weight)
    memory = plan_memory(graph)
    if old_weight:  # it reads the old weight but needs the update: a fresh array
        assert {o.name: o.mode for o in memory.outputs}["w"] == FRESH
    else:
        assert memory.schedule == graph.nodes[:2] + [late, sgd, after]
        assert {o.name: o.mode for o in memory.outputs}["w"] == VARIABLE
    exe = Executable(graph, reference_kernels(graph))
    env = random_env(graph)
    assert_same(execute(graph, copied(env)), exe(env))


def test_an_unsafe_update_gets_a_fresh_array():
    graph = sgd_graph(late_reader=True)
    memory = plan_memory(graph, graph.nodes)  # the update before a reader of the old weight
    modes = {o.name: o.mode for o in memory.outputs}
    assert modes["w"] == FRESH and modes["w.history"] == VARIABLE
    exe = Executable(graph, reference_kernels(graph), schedule=graph.nodes)
    env = random_env(graph)
    w_before = env["w"].copy()
    expected = execute(graph, copied(env))
    first = exe(env)
    assert_same(expected, first)
    np.testing.assert_array_equal(env["w"], w_before)
    assert first["w"] is not env["w"]
    second = exe({**env, "w": first["w"]})
    assert second["w"] is not first["w"]  # fresh each call


def test_reshape_outputs_are_views():
    graph = Graph("views")
    x = graph.add_input("x", T44)
    a = graph.add_node("matmul", [x, x]).outputs[0]
    r = graph.add_node("reshape", [a], {"shape": [16]}).outputs[0]
    r2 = graph.add_node("reshape", [r], {"shape": [2, 8]}).outputs[0]
    t = graph.add_node("tanh", [r2]).outputs[0]
    xr = graph.add_node("reshape", [x], {"shape": [2, 8]}).outputs[0]
    s = graph.add_node("add", [t, xr]).outputs[0]
    graph.set_outputs([("s", s)])
    memory = plan_memory(graph)
    assert memory.class_of[r] is memory.class_of[r2] is memory.class_of[a]
    assert memory.class_of[xr].storage == EXTERNAL
    assert "%reshape.1: f32[2,8] view of %matmul" in memory.summary()
    exe = Executable(graph, reference_kernels(graph))
    assert np.shares_memory(exe.plan.array(a), exe.plan.array(r2))
    assert len(exe.plan.tasks) == 3  # no kernel for a view
    env = random_env(graph)
    assert_same(execute(graph, copied(env)), exe(env))


def test_outputs_survive_and_are_fresh():
    graph = Graph("outputs")
    x = graph.add_input("x", T44)
    early = graph.add_node("matmul", [x, x]).outputs[0]
    v = early
    for _ in range(5):  # plenty of later values that could reuse memory
        v = graph.add_node("matmul", [v, x]).outputs[0]
        v = graph.add_node("tanh", [v]).outputs[0]
    graph.set_outputs([("early", early), ("late", v), ("x", x)])
    memory = plan_memory(graph)
    assert memory.class_of[early].end == len(graph.nodes)
    exe = Executable(graph, reference_kernels(graph))
    env = random_env(graph)
    first = exe(env)
    assert_same(execute(graph, env), first)
    arena = exe.plan.arenas[Device()]
    for name, array in first.items():
        assert not np.shares_memory(array, arena), name
    assert first["x"] is not env["x"]  # not a state update: a copy
    kept = {k: a.copy() for k, a in first.items()}
    exe(random_env(graph, seed=1))
    assert_same(kept, first)


def test_a_value_returned_twice_is_returned_as_two_arrays():
    graph = Graph("twice")
    x = graph.add_input("x", T44)
    w = graph.add_input("w", T44, role="param")
    graph.add_input("v", T44, role="param")  # updated to the same value as w
    both = graph.add_node("add", [w, x]).outputs[0]
    graph.set_outputs([("w", both), ("v", both), ("y", both)])
    exe = Executable(graph, reference_kernels(graph))
    env = random_env(graph)
    expected = execute(graph, copied(env))
    outputs = exe(env)
    assert_same(expected, outputs)
    assert outputs["w"] is env["w"]
    assert not np.shares_memory(outputs["v"], outputs["w"])
    assert not np.shares_memory(outputs["y"], outputs["w"])


def test_fused_nodes_alias_only_through_their_one_elementwise_reader():
    graph = Graph("fused")
    x = graph.add_input("x", T44)
    a = graph.add_node("matmul", [x, x]).outputs[0]
    b = graph.add_node("matmul", [x, a]).outputs[0]
    relu = graph.make_node("relu", [a])  # the only member reading %a: may write over it
    tanh = graph.make_node("tanh", [b])  # %b is read by two members: nothing over it
    add = graph.make_node("add", [relu.outputs[0], b])
    outputs = [relu.outputs[0], tanh.outputs[0], add.outputs[0]]
    graph.add_fused([relu, tanh, add], [a, b], outputs, kernel="fused_relu_tanh_add")
    graph.set_outputs([(f"y{i}", v) for i, v in enumerate(outputs)])
    memory = plan_memory(graph)
    donors = {cls.root: cls.donor.root for cls in memory.classes if cls.donor is not None}
    assert donors == {relu.outputs[0]: a}
    env = random_env(graph)
    x_ = env["x"]
    a_ = x_ @ x_
    b_ = x_ @ a_
    relu_ = np.maximum(a_, 0)
    expected = {"y0": relu_, "y1": np.tanh(b_), "y2": relu_ + b_}
    assert_same(expected, Executable(graph, reference_kernels(graph))(env))


def epilogue_node(graph: Graph, members_of) -> Node:
    """A fused matmul of ``x`` by itself whose epilogue ``members_of(graph, product)``
    makes (returning the members and the node's outputs)."""
    x = graph.add_input("x", T44)
    product = graph.make_node("matmul", [x, x])
    members, outputs = members_of(graph, product.outputs[0])
    body = [product, *members]
    node = graph.add_fused(body, external_inputs(body), outputs, kernel="fused_test")
    graph.set_outputs([(f"y{i}", v) for i, v in enumerate(outputs)])
    return node


def residual(g, product, skip, outputs: str):
    relu = g.make_node("relu", [product])
    summed = g.make_node("add", [relu.outputs[0], skip])
    exported = {"both": [relu.outputs[0], summed.outputs[0]], "sum": [summed.outputs[0]]}
    return [relu, summed], exported[outputs]


@pytest.mark.parametrize("outputs", ["both", "sum"])
def test_an_epilogue_computes_into_an_output_no_input_may_lie_under(outputs):
    """The anchor writes its result into `anchor_destination` before the members read
    their inputs: the planner never puts that output over one, not even a residual sum
    over the input it adds (which it would otherwise take)."""
    graph = Graph("epilogue")
    skip = graph.add_input("skip", T44)
    node = epilogue_node(graph, lambda g, product: residual(g, product, skip, outputs))
    destination = anchor_destination(node)
    assert destination is node.outputs[0]
    assert not any(may_alias(node, destination, v) for v in node.inputs)
    if outputs == "both":
        assert may_alias(node, node.outputs[1], skip)  # the sum, not the destination
    memory = plan_memory(graph)
    assert all(cls.donor is None or cls.root is not destination for cls in memory.classes)
    env = random_env(graph)
    relu_ = np.maximum(env["x"] @ env["x"], 0)
    expected = {"both": {"y0": relu_, "y1": relu_ + env["skip"]},
                "sum": {"y0": relu_ + env["skip"]}}[outputs]
    assert_same(expected, Executable(graph, reference_kernels(graph))(copied(env)))


def test_no_destination_where_the_anchor_is_exported_or_every_output_updates():
    graph = Graph("update")
    w = graph.add_input("w", T44)
    node = epilogue_node(graph, lambda g, product: (
        [sgd := g.make_node("sgd", [w, g.add_input("h", T44), product], {"lr": 0.1})],
        list(sgd.outputs)))
    assert anchor_destination(node) is None  # w.next may be made over w, in place
    graph = Graph("exported")
    node = epilogue_node(graph, lambda g, product: (
        [relu := g.make_node("relu", [product])], [product, relu.outputs[0]]))
    assert anchor_destination(node) is None


def test_a_transfer_in_flight_keeps_its_input_memory():
    """A copy reads its input until its result is needed; a node scheduled in between
    must not take that memory, or it would have to wait for the transfer."""
    graph = Graph("in flight")
    cpu0, cpu1 = Device("cpu", 0), Device("cpu", 1)
    x = graph.add_input("x", T44, cpu0)
    sent = graph.add_node("matmul", [x, x], device=cpu0).outputs[0]
    copy = graph.add_node("copy", [sent], device=cpu1)
    later = graph.add_node("matmul", [x, x], device=cpu0)  # while the copy is in flight
    received = graph.add_node("matmul", [copy.outputs[0], copy.outputs[0]], device=cpu1)
    graph.set_outputs([("a", later.outputs[0]), ("b", received.outputs[0])])
    memory = plan_memory(graph)
    assert memory.class_of[later.outputs[0]].offset != memory.class_of[sent].offset
    assert (copy, later) not in memory.hazards
    exe = Executable(graph, reference_kernels(graph))
    env = random_env(graph)
    assert_same(execute(graph, copied(env)), exe(env))


def test_an_elementwise_node_does_not_write_over_an_input_in_flight():
    """Only an in_place node may take an input that its own transfer still reads: a
    relu reading the same value after a copy has started must not overwrite it."""
    graph = Graph("in flight, then relu")
    cpu0, cpu1 = Device("cpu", 0), Device("cpu", 1)
    x = graph.add_input("x", T44, cpu0)
    sent = graph.add_node("tanh", [x], device=cpu0).outputs[0]
    copy = graph.add_node("copy", [sent], device=cpu1)
    relu = graph.add_node("relu", [sent], device=cpu0)  # the last reader of %sent here
    later = graph.add_node("matmul", [x, x], device=cpu0)  # the copy is still in flight
    received = graph.add_node("matmul", [copy.outputs[0], copy.outputs[0]], device=cpu1)
    graph.set_outputs([("a", relu.outputs[0]), ("b", received.outputs[0]),
                       ("c", later.outputs[0])])
    memory = plan_memory(graph)
    assert memory.class_of[relu.outputs[0]].donor is None
    env = random_env(graph)
    assert_same(execute(graph, copied(env)), Executable(graph, reference_kernels(graph))(env))


def test_an_unread_transfer_output_is_kept_to_the_end():
    """What a rank sends toward a reduce's root is read by nobody here, but the transfer
    reads it until it completes: no later node may take its memory."""
    graph = Graph("sent")
    x = graph.add_input("x", T44)
    summand = graph.add_node("tanh", [x]).outputs[0]
    sent = graph.add_node("reduce", [summand], {"group": "cpu:0,cpu:1", "root": "cpu:1"})
    later = graph.add_node("matmul", [x, x])
    graph.set_outputs([("y", later.outputs[0])])
    memory = plan_memory(graph)
    assert memory.class_of[later.outputs[0]].offset != memory.class_of[sent.outputs[0]].offset
    assert (sent, later) not in memory.hazards


def allreduce_graph(read_again: bool) -> tuple[Graph, list]:
    """Two devices' gradients summed by one in-process allreduce, each sum then used;
    with ``read_again``, device 0's gradient is also read after the allreduce."""
    graph = Graph("allreduce")
    cpu0, cpu1 = Device("cpu", 0), Device("cpu", 1)
    xs = [graph.add_input(f"x{k}", T44, d) for k, d in enumerate((cpu0, cpu1))]
    grads = [graph.add_node("tanh", [x], device=x.device).outputs[0] for x in xs]
    total = graph.add_node("allreduce", grads, {"group": "cpu:0,cpu:1"})
    for out, grad in zip(total.outputs, grads):
        out.device = grad.device  # each member's sum on its device, as partition does
    outputs = [graph.add_node("matmul", [s, s], device=s.device).outputs[0]
               for s in total.outputs]
    if read_again:
        outputs.append(graph.add_node("sigmoid", [grads[0]], device=cpu0).outputs[0])
    graph.set_outputs([(f"y{i}", v) for i, v in enumerate(outputs)])
    return graph, grads


def test_an_allreduce_sums_each_gradient_where_it_lies():
    """Nothing reads a gradient after its allreduce, so each member's sum takes its own
    gradient's memory (MPI then reduces in place, with no copy), although the
    collective keeps its inputs while in flight."""
    graph, grads = allreduce_graph(read_again=False)
    memory = plan_memory(graph)
    total = graph.nodes[2]
    donors = {cls.root: cls.donor.root for cls in memory.classes if cls.donor is not None}
    assert {v: donors.get(v) for v in total.outputs} == dict(zip(total.outputs, grads))
    env = random_env(graph)
    assert_same(execute(graph, copied(env)), Executable(graph, reference_kernels(graph))(env))
    from purinec.runtime.collectives import host_kernel

    kernels = {**reference_kernels(graph), total: host_kernel(total)}
    assert_same(execute(graph, copied(env)), Executable(graph, kernels)(env))


def test_an_allreduce_leaves_a_gradient_read_later_alone():
    graph, grads = allreduce_graph(read_again=True)
    memory = plan_memory(graph)
    total = graph.nodes[2]
    assert memory.class_of[total.outputs[0]].donor is None
    assert memory.class_of[total.outputs[1]].donor is memory.class_of[grads[1]]
    env = random_env(graph)
    assert_same(execute(graph, copied(env)), Executable(graph, reference_kernels(graph))(env))


def test_arenas_beyond_the_memory_limit_are_refused_before_they_are_allocated(monkeypatch):
    monkeypatch.setenv(LIMIT_VARIABLE, "1M")
    big = TensorType((1024, 1024), F32)  # 4 MiB
    graph = Graph("big")
    x = graph.add_input("x", big)
    graph.set_outputs([("y", graph.add_node("relu", [graph.add_node("relu", [x]).outputs[0]])
                        .outputs[0])])
    with pytest.raises(MemoryLimitError, match=r"the working memory of graph big \(its arenas\) "
                                               r"would take 4.0 MiB; the limit is 1.0 MiB"):
        Plan(graph, reference_kernels(graph))


def branches_into_a_concat(batch: int, variant: str = "") -> tuple[Graph, Node]:
    """Three branches of an image (as an inception block's) joined along the channels;
    ``variant`` "exported": the second branch is a graph output too; "twice": the first
    branch is joined twice; "input": the image itself is joined."""
    graph = Graph("branches")
    x = graph.add_input("x", TensorType((batch, 4, 3, 3), F32))
    w = graph.add_input("w", TensorType((5, 4, 1, 1), F32), role="param")
    first = graph.add_node("conv2d", [x, w]).outputs[0]
    second = graph.add_node("tanh", [x]).outputs[0]
    third = graph.add_node("relu", [graph.add_node("conv2d", [x, w]).outputs[0]]).outputs[0]
    parts = {"twice": [first, second, first], "input": [first, x, third]}.get(
        variant, [first, second, third])
    concat = graph.add_node("concat", parts, {"axis": 1})
    y = graph.add_node("sigmoid", [concat.outputs[0]]).outputs[0]
    late = graph.add_node("relu", [second]).outputs[0]  # read after the concat
    outputs = [("y", y), ("late", late)] + ([("second", second)] if variant == "exported" else [])
    graph.set_outputs(outputs)
    return graph, concat


def test_a_concat_of_runs_of_its_output_is_computed_in_place():
    """At batch 1 each branch is a run of the concat's output: its writer computes it
    there, the concat copies nothing, and a branch read after the concat keeps the whole
    alive; the results stay the reference's in any order the dependencies allow."""
    graph, concat = branches_into_a_concat(batch=1)
    memory = plan_memory(graph)
    assert memory.elided == {concat}
    whole = memory.class_of[concat.outputs[0]]
    runs = [memory.class_of[v].offset - whole.offset for v in concat.inputs]
    assert runs == [0, 5 * 9 * 4, (5 + 4) * 9 * 4]  # f32 channels of 3x3: 5, 4, 5
    assert whole.end == memory.schedule.index(graph.nodes[-1])  # the late relu reads it
    summary = memory.summary()
    assert "within %" in summary and "computed within their outputs): 1" in summary
    env = random_env(graph)
    want = execute(graph, copied(env))
    assert_same(want, Executable(graph, reference_kernels(graph))(copied(env)))
    for seed in range(5):
        exe = Executable(graph, reference_kernels(graph), workers=3, order=random.Random(seed))
        assert_same(want, exe(copied(env)))


@pytest.mark.slow  # compiles the branches' kernels
@pytest.mark.parametrize("batch", [1, 2])
def test_the_cpu_target_compiles_no_kernel_for_a_concat_that_runs_nothing(batch):
    """A concat computed in place needs no kernel (each costs a cold compile 0.2 s):
    the cpu target compiles one only where the concat copies (batch 2), and its results
    are the reference's either way."""
    from purinec.targets.cpu import CpuTarget

    graph, concat = branches_into_a_concat(batch)
    target = CpuTarget()
    assert (concat in target.generated(graph)) == (batch > 1)
    assert (concat in target.kernels(graph)) == (batch > 1)
    env = random_env(graph)
    want, got = execute(graph, copied(env)), target.executable(graph)(env)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("batch, variant", [(2, ""), (1, "exported"), (1, "twice"),
                                            (1, "input")])
def test_a_concat_copies_what_cannot_move_into_it(batch, variant):
    """Strided runs (batch 2), a graph output, a value joined twice, a graph input: the
    concat copies them, and no input lies within its output."""
    graph, concat = branches_into_a_concat(batch, variant)
    memory = plan_memory(graph)
    assert not memory.elided
    assert all(cls.within is None for cls in memory.classes)
    env = random_env(graph)
    assert_same(execute(graph, copied(env)), Executable(graph, reference_kernels(graph))(env))


def test_what_reuses_a_concats_memory_waits_for_every_reader_of_its_inputs():
    """A branch read after the concat's own readers keeps the concat's memory; what
    takes that memory next must wait for that late reader, not only for the concat's."""
    graph = Graph("late")
    x = graph.add_input("x", TensorType((1, 4, 3, 3), F32))
    a, b = (graph.add_node(op, [x]).outputs[0] for op in ("tanh", "sigmoid"))
    joined = graph.add_node("concat", [a, b], {"axis": 1}).outputs[0]
    pooled = graph.add_node("reduce_sum", [joined], {"axes": [1]}).outputs[0]
    late = graph.add_node("reduce_sum", [b], {"axes": [1]})
    reuse = graph.add_node("concat", [pooled, pooled, pooled, pooled, pooled, pooled,
                                      pooled, pooled], {"axis": 1})
    graph.set_outputs([("late", late.outputs[0]), ("y", reuse.outputs[0])])
    memory = plan_memory(graph)
    whole = memory.class_of[joined]
    assert whole.holds_parts and memory.class_of[reuse.outputs[0]].offset == whole.offset
    assert (late, reuse) in memory.hazards
    env = random_env(graph)
    want = execute(graph, copied(env))
    for seed in range(10):
        exe = Executable(graph, reference_kernels(graph), workers=2, order=random.Random(seed))
        assert_same(want, exe(copied(env)))
