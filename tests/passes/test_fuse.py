"""The fuse pass: which nodes become one kernel, why others do not, and that fusing never
changes a result (TVM's before/expected style, kernel counts on the zoo, random DAGs)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import purinec
from purinec.compiler import build_graph, load_source
from purinec.errors import PurinecError, VerifyError
from purinec.ir.graph import Graph, Node
from purinec.ir.ops import FusionKind, get_op
from purinec.ir.parser import parse
from purinec.ir.printer import print_graph
from purinec.ir.types import CPU0, Device, DType, TensorType
from purinec.ir.verify import verify
from purinec.passes.fuse import MAX_KERNEL_NAME, MAX_SOLVER_GROUP, explain, fuse, kernel_name
from purinec.passes.simplify import cse, dce, infer_shapes
from purinec.runtime.reference import execute

F32 = DType.f32
CPU1 = Device("cpu", 1)


def T(*shape):
    return TensorType(tuple(shape), F32)


def layout(g: Graph) -> list:
    """Each node by name, each fused node as (kernel, [member names])."""
    return [(n.attrs["kernel"], [m.name for m in n.body]) if n.body is not None else n.name
            for n in g.nodes]


def reasons(g: Graph, **options) -> dict[tuple[str, str], str]:
    return {(a.value, a.consumer): a.reason for a in explain(g, **options)}


def fused_nodes(g: Graph) -> list[Node]:
    return [n for n in g.nodes if n.body is not None]


def random_env(g: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    env = {}
    for v in g.inputs:
        if v.type.dtype.is_float:
            env[v.name] = rng.standard_normal(v.type.shape).astype(v.type.dtype.numpy)
        else:
            env[v.name] = rng.integers(0, 2, v.type.shape).astype(v.type.dtype.numpy)
    return env


def assert_same_results(g: Graph, fused: Graph) -> None:
    env = random_env(g)
    want, got = execute(g, env), execute(fused, env)
    assert list(want) == list(got)
    for name in want:
        assert np.array_equal(want[name], got[name], equal_nan=True), name


# -- before / expected ------------------------------------------------------------------


def test_conv_bias_relu_becomes_one_node():
    g = Graph("before")
    x = g.add_input("x", T(2, 3, 6, 6))
    w = g.add_input("w", T(4, 3, 3, 3), role="param")
    b = g.add_input("b", T(4), role="param")
    conv = g.add_node("conv2d", [x, w], names=["conv"], loc="net.py:1")
    biased = g.add_node("bias_add", [conv.outputs[0], b], names=["biased"], loc="net.py:1")
    act = g.add_node("relu", biased.outputs, names=["act"], loc="net.py:2")
    pool = g.add_node("max_pool2d", act.outputs, {"kernel": [2, 2], "stride": [2, 2]},
                      names=["pool"])
    g.set_outputs([("pool", pool.outputs[0])])
    before = print_graph(g)

    after = fuse(g)
    verify(after)
    assert print_graph(g) == before  # the argument is untouched
    assert layout(after) == [("fused_conv2d_bias_add_relu", ["conv", "biased", "act"]), "pool"]
    node = after.nodes[0]
    assert [v.name for v in node.inputs] == ["x", "w", "b"]
    assert node.outputs == [node.body[2].outputs[0]]
    assert node.body[1].loc == "net.py:1" and node.loc is None
    assert reasons(g) == {("act", "pool"): "max_pool2d is opaque"}
    assert_same_results(g, after)


def test_elementwise_chain_with_a_diamond_is_one_loop():
    g = Graph("before")
    x = g.add_input("x", T(4, 5))
    r = g.add_node("relu", [x], names=["r"]).outputs[0]
    s = g.add_node("sigmoid", [r], names=["s"]).outputs[0]
    t = g.add_node("tanh", [r], names=["t"]).outputs[0]
    a = g.add_node("add", [s, t], names=["a"]).outputs[0]
    y = g.add_node("scale", [a], {"alpha": 2.0}, names=["y"]).outputs[0]
    g.set_outputs([("y", y)])
    after = fuse(g)
    assert layout(after) == [("fused_relu_sigmoid_tanh_add_scale", ["r", "s", "t", "a", "y"])]
    assert after.nodes[0].inputs == [after.input("x")]
    assert explain(g) == []
    assert_same_results(g, after)


def test_a_value_read_outside_its_group_is_exported_not_recomputed():
    # %h feeds the relu in its group and softmax outside it: the group exports it.
    g = Graph("before")
    x = g.add_input("x", T(2, 3))
    w = g.add_input("w", T(4, 3), role="param")
    b = g.add_input("b", T(4), role="param")
    mm = g.add_node("matmul", [x, w], {"trans_b": True}, names=["mm"]).outputs[0]
    h = g.add_node("bias_add", [mm, b], names=["h"]).outputs[0]
    act = g.add_node("relu", [h], names=["act"]).outputs[0]
    prob = g.add_node("softmax", [h], names=["prob"]).outputs[0]
    g.set_outputs([("act", act), ("prob", prob)])
    after = fuse(g)
    assert layout(after) == [("fused_matmul_bias_add_relu", ["mm", "h", "act"]), "prob"]
    assert [v.name for v in after.nodes[0].outputs] == ["h", "act"]
    assert reasons(g) == {("h", "prob"): "softmax is opaque"}
    assert_same_results(g, after)


def test_a_value_consumed_by_two_groups_joins_one_of_them():
    # %e = relu(%x) is read by the epilogues of two matmuls: it joins the first group and
    # that group exports it to the second; each group keeps its one anchor.
    g = Graph("before")
    x = g.add_input("x", T(3, 3))
    w1 = g.add_input("w1", T(3, 3), role="param")
    w2 = g.add_input("w2", T(3, 3), role="param")
    e = g.add_node("relu", [x], names=["e"]).outputs[0]
    m1 = g.add_node("matmul", [x, w1], names=["m1"]).outputs[0]
    m2 = g.add_node("matmul", [x, w2], names=["m2"]).outputs[0]
    a1 = g.add_node("add", [m1, e], names=["a1"]).outputs[0]
    a2 = g.add_node("add", [m2, e], names=["a2"]).outputs[0]
    g.set_outputs([("a1", a1), ("a2", a2)])
    after = fuse(g)
    assert layout(after) == [("fused_matmul_relu_add", ["m1", "e", "a1"]),
                             ("fused_matmul_add", ["m2", "a2"])]
    assert [v.name for v in after.nodes[0].outputs] == ["e", "a1"]
    assert [v.name for v in after.nodes[1].inputs] == ["x", "w2", "e"]
    assert reasons(g) == {("e", "a2"): "%m1 (matmul) and %m2 (matmul) would share a group; "
                                       "a group has one out_elementwise_fusable member"}
    assert_same_results(g, after)


def test_the_path_check_refuses_a_cycle_through_an_outside_node():
    # sgd's outputs go different ways: %s1 to add directly, %s2 through opaque softmax.
    # Putting add with sgd would make a cycle sgd -> softmax -> add.
    g = Graph("before")
    w, h, gr = (g.add_input(n, T(3, 4)) for n in ("w", "h", "g"))
    s1, s2 = g.add_node("sgd", [w, h, gr], {"lr": 0.1}, names=["s1", "s2"]).outputs
    y = g.add_node("softmax", [s2], names=["y"]).outputs[0]
    z = g.add_node("add", [s1, y], names=["z"]).outputs[0]
    g.set_outputs([("z", z)])
    after = fuse(g)
    assert layout(after) == ["s1", "y", "z"]
    assert reasons(g) == {
        ("s2", "y"): "softmax is opaque",
        ("s1", "z"): "fusing would make a cycle through %y (softmax), which reads the group "
                     "and feeds it",
        ("y", "z"): "softmax is opaque"}
    assert_same_results(g, after)


def test_the_path_check_follows_exchanges_through_other_ranks():
    # A pipeline stage on rank 0: its activation goes to rank 1, whose gradient comes
    # back. Within this rank's graph no path joins tanh and tanh_grad's second input,
    # but rank 1 makes that gradient from the activation: one fused node would wait for
    # its own output (both ranks would hang).
    here, there = Device("cpu", 0), Device("cpu", 0, rank=1)
    g = Graph("stage0")
    x = g.add_input("x", T(3, 4), here)
    y = g.add_node("tanh", [x], names=["y"]).outputs[0]
    g.add_node("send", [y], {"peer": str(there), "tag": 1}, names=["y.sent"])
    gy = g.add_node("recv", [], {"peer": str(there), "tag": 2, "shape": [3, 4]},
                    names=["gy"], device=here).outputs[0]
    gx = g.add_node("tanh_grad", [y, gy], names=["gx"]).outputs[0]
    g.set_outputs([("gx", gx)])
    assert layout(fuse(g)) == ["y", "y.sent", "gy", "gx"]
    assert reasons(g)[("y", "gx")] == ("fusing would make a cycle through %y.sent (send), "
                                       "which reads the group and feeds it")
    # With the gradient from anywhere else, the two fuse.
    g = Graph("alone")
    x, gy = g.add_input("x", T(3, 4), here), g.add_input("gy", T(3, 4), here)
    y = g.add_node("tanh", [x], names=["y"]).outputs[0]
    g.set_outputs([("y", y), ("gx", g.add_node("tanh_grad", [y, gy], names=["gx"]).outputs[0])])
    assert [members for _, members in layout(fuse(g))] == [["y", "gx"]]


def test_nothing_fuses_into_an_anchor_even_through_its_epilogue():
    # %p feeds the matmul and the matmul's epilogue: joining the epilogue would put the
    # edge %p -> %a inside the group, making %p a prologue of the matmul.
    g = Graph("before")
    x = g.add_input("x", T(3, 3))
    p = g.add_node("relu", [x], names=["p"]).outputs[0]
    a = g.add_node("matmul", [p, x], names=["a"]).outputs[0]
    q = g.add_node("add", [a, p], names=["q"]).outputs[0]
    g.set_outputs([("q", q)])
    after = fuse(g)
    assert layout(after) == ["p", ("fused_matmul_add", ["a", "q"])]
    assert reasons(g)[("p", "q")] == (
        "the group would take in %p -> %a, but matmul is out_elementwise_fusable: only its "
        "consumers fuse with it, as its epilogue")
    assert_same_results(g, after)


def test_reshape_reductions_and_anchors_as_consumers_stay_apart():
    g = Graph("before")
    x = g.add_input("x", T(2, 6))
    w = g.add_input("w", T(6, 6), role="param")
    r = g.add_node("relu", [x], names=["r"]).outputs[0]
    flat = g.add_node("reshape", [r], {"shape": [12]}, names=["flat"]).outputs[0]
    back = g.add_node("reshape", [flat], {"shape": [2, 6]}, names=["back"]).outputs[0]
    s = g.add_node("sigmoid", [back], names=["s"]).outputs[0]
    mm = g.add_node("matmul", [s, w], names=["mm"]).outputs[0]
    total = g.add_node("reduce_sum", [mm], {"axes": [0]}, names=["total"]).outputs[0]
    y = g.add_node("tanh", [total], names=["y"]).outputs[0]
    g.set_outputs([("y", y)])
    after = fuse(g)
    assert layout(after) == ["r", "flat", "back", "s", "mm", "total", "y"]
    assert reasons(g) == {
        ("r", "flat"): "reshape is injective",
        ("flat", "back"): "reshape is injective",
        ("back", "s"): "reshape is injective",
        ("s", "mm"): "matmul is out_elementwise_fusable: only its consumers fuse with it, "
                     "as its epilogue",
        ("mm", "total"): "reduce_sum is a reduction",
        ("total", "y"): "reduce_sum is a reduction"}


def test_ops_on_different_devices_stay_apart():
    g = Graph("before")
    x = g.add_input("x", T(4))
    a = g.add_node("relu", [x], names=["a"]).outputs[0]
    b = g.add_node("tanh", [a], names=["b"], device=CPU1).outputs[0]
    c = g.add_node("sigmoid", [b], names=["c"], device=CPU1).outputs[0]
    g.set_outputs([("c", c)])
    after = fuse(g)
    assert layout(after) == ["a", ("fused_tanh_sigmoid", ["b", "c"])]
    assert after.nodes[1].device == CPU1
    assert reasons(g) == {("a", "b"): "%a is on cpu:0 and %b on cpu:1"}


def test_broadcast_inside_a_group_only_from_outside():
    # global_avg_pool_grad broadcasts its input: it may start a group, reading %gy from
    # outside, but may not broadcast a member's value.
    g = Graph("before")
    x = g.add_input("x", T(2, 3, 4, 4))
    gy = g.add_input("gy", T(2, 3, 1, 1))
    s = g.add_node("scale", [gy], {"alpha": 0.5}, names=["s"]).outputs[0]
    up = g.add_node("global_avg_pool_grad", [s], {"input_shape": [2, 3, 4, 4]},
                    names=["up"]).outputs[0]
    gx = g.add_node("relu_grad", [x, up], names=["gx"]).outputs[0]
    g.set_outputs([("gx", gx)])
    after = fuse(g)
    assert layout(after) == ["s", ("fused_global_avg_pool_grad_relu_grad", ["up", "gx"])]
    assert reasons(g) == {("s", "up"): "global_avg_pool_grad broadcasts %s (f32[2,3,1,1] to "
                                       "f32[2,3,4,4]); a group broadcasts only inputs from "
                                       "outside it"}
    assert_same_results(g, after)


def test_max_group_size():
    g = Graph("before")
    v = g.add_input("x", T(3))
    for i in range(5):
        v = g.add_node("relu", [v], names=[f"r{i}"]).outputs[0]
    g.set_outputs([("y", v)])
    assert layout(fuse(g, max_group_size=2)) == [("fused_relu_x2", ["r0", "r1"]),
                                                 ("fused_relu_x2_1", ["r2", "r3"]), "r4"]
    assert reasons(g, max_group_size=2)[("r1", "r2")] == (
        "the group would have 4 members, more than max_group_size=2")
    assert layout(fuse(g, max_group_size=1)) == ["r0", "r1", "r2", "r3", "r4"]
    assert layout(fuse(g)) == [("fused_relu_x5", ["r0", "r1", "r2", "r3", "r4"])]
    with pytest.raises(PurinecError, match="max_group_size must be at least 1"):
        fuse(g, max_group_size=0)


def solver_graph(devices=(CPU0, CPU0, CPU0)) -> Graph:
    """Three parameters whose gradients come from opaque ops, each with an sgd."""
    g = Graph("solver")
    x = g.add_input("x", T(4, 4))
    outputs = []
    for i, device in enumerate(devices):
        w = g.add_input(f"w{i}", T(i + 1, 4), device=device, role="param")
        h = g.add_input(f"h{i}", T(i + 1, 4), device=device, role="state")
        grad = g.add_node("softmax", [w], names=[f"g{i}"], device=device).outputs[0]
        w2, h2 = g.add_node("sgd", [w, h, grad], {"lr": 0.1, "momentum": 0.9},
                            names=[f"w{i}.next", f"h{i}.next"], device=device).outputs
        outputs += [(f"w{i}", w2), (f"h{i}", h2)]
    g.add_node("relu", [x], names=["y"])
    g.set_outputs(outputs + [("y", g.nodes[-1].outputs[0])])
    return g


def test_solver_updates_group_horizontally():
    g = solver_graph()
    after = fuse(g)
    assert layout(after) == ["g0", "g1", "g2",
                             ("fused_sgd_x3", ["w0.next", "w1.next", "w2.next"]), "y"]
    node = after.nodes[3]
    assert [v.name for v in node.inputs] == ["w0", "h0", "g0", "w1", "h1", "g1", "w2", "h2",
                                             "g2"]
    assert [v.name for v in node.outputs] == ["w0.next", "h0.next", "w1.next", "h1.next",
                                              "w2.next", "h2.next"]
    assert_same_results(g, after)
    assert layout(fuse(g, max_group_size=2)) == [
        "g0", "g1", ("fused_sgd_x2", ["w0.next", "w1.next"]), "g2", "w2.next", "y"]


def test_solver_updates_group_at_most_max_solver_group_at_a_time():
    # Numba's compile time grows faster than a kernel's loop count: inception's 41
    # updates as one kernel took 58 s to compile, 12 s in groups of 8.
    count = 2 * MAX_SOLVER_GROUP + 1
    g = solver_graph(devices=(CPU0,) * count)
    after = fuse(g)
    groups = [n.body for n in after.nodes if n.op == "fused"]
    assert [len(body) for body in groups] == [MAX_SOLVER_GROUP, MAX_SOLVER_GROUP]
    assert {m.op for body in groups for m in body} == {"sgd"}
    assert_same_results(g, after)


def test_solver_updates_group_by_the_communication_their_gradients_arrive_from():
    # Data parallelism: g0 and g1 are reduced in one bucket, g2 alone. Fusing all three
    # updates would hold w0's and w1's back until g2 arrives.
    g = Graph("solver")
    grads, updates = [], []
    for i in range(3):
        w = g.add_input(f"w{i}", T(i + 1, 4), role="param")
        h = g.add_input(f"h{i}", T(i + 1, 4), role="state")
        grads.append(g.add_node("softmax", [w], names=[f"g{i}"]).outputs[0])
        updates.append((w, h))
    bucket = g.add_node("allreduce", grads[:2], {"group": "cpu:0", "tensors": 2},
                        names=["s0", "s1"])
    alone = g.add_node("allreduce", grads[2:], {"group": "cpu:0", "tensors": 1},
                       names=["s2"])
    outputs = []
    for i, ((w, h), summed) in enumerate(zip(updates, [*bucket.outputs, *alone.outputs])):
        w2, h2 = g.add_node("sgd", [w, h, summed], {"lr": 0.1, "momentum": 0.9},
                            names=[f"w{i}.next", f"h{i}.next"]).outputs
        outputs += [(f"w{i}", w2), (f"h{i}", h2)]
    g.set_outputs(outputs)
    after = fuse(g)
    assert layout(after) == ["g0", "g1", "g2", "s0", "s2",
                             ("fused_sgd_x2", ["w0.next", "w1.next"]), "w2.next"]
    assert_same_results(g, after)


def test_solver_updates_group_per_device():
    after = fuse(solver_graph(devices=(CPU0, CPU1, CPU0)))
    assert layout(after) == ["g0", "g1", "w1.next", "g2",
                             ("fused_sgd_x2", ["w0.next", "w2.next"]), "y"]
    assert fused_nodes(after)[0].device == CPU0


def test_solver_updates_sharing_an_input_stay_apart():
    # Members of a horizontal group may update their own inputs in place, so no two of
    # them read one value.
    g = Graph("solver")
    grad = g.add_input("g", T(3))
    for i in range(3):
        w = g.add_input(f"w{i}", T(3), role="param")
        h = g.add_input(f"h{i}", T(3), role="state")
        g.add_node("sgd", [w, h, grad], {"lr": 0.1}, names=[f"w{i}.next", f"h{i}.next"])
    g.set_outputs([(v.name, v) for n in g.nodes for v in n.outputs])
    assert layout(fuse(g)) == ["w0.next", "w1.next", "w2.next"]


def test_kernel_names():
    def nodes(*ops):
        return [Node(op, [], []) for op in ops]

    assert kernel_name(nodes("conv2d", "bias_add", "relu")) == "fused_conv2d_bias_add_relu"
    assert kernel_name(nodes("sgd", "sgd", "sgd")) == "fused_sgd_x3"
    assert kernel_name(nodes("mul", "add", "add", "mul")) == "fused_mul_add_x2_mul"
    long = kernel_name(nodes(*["relu", "sigmoid"] * 10))
    assert len(long) <= MAX_KERNEL_NAME and long.endswith("_more")
    assert long.startswith("fused_relu_sigmoid_relu")


def test_new_kernel_names_do_not_reuse_the_graphs_own():
    g = Graph("before")
    v = g.add_input("x", T(3))
    for i in range(5):
        v = g.add_node("relu", [v], names=[f"r{i}"]).outputs[0]
    g.set_outputs([("y", v)])
    once = fuse(g, max_group_size=2)
    r5 = once.add_node("relu", [once.value("r4")], names=["r5"]).outputs[0]
    once.set_outputs([("y", r5)])
    twice = fuse(once)
    verify(twice)
    assert layout(twice) == [("fused_relu_x2", ["r0", "r1"]), ("fused_relu_x2_1", ["r2", "r3"]),
                             ("fused_relu_x2_2", ["r4", "r5"])]


def test_fusing_a_fused_graph_changes_nothing():
    g = build_graph(load_source("lenet", batch=1), purinec.SGD(lr=0.01, momentum=0.9))
    once = fuse(g)
    assert print_graph(fuse(once)) == print_graph(once)
    assert get_op("fused").fusion is FusionKind.opaque


# -- the zoo: kernel counts ------------------------------------------------------------------


def training_graph(model: str, batch: int = 2) -> Graph:
    return build_graph(load_source(model, batch=batch),
                       purinec.SGD(lr=0.01, momentum=0.9, weight_decay=0.0005))


def kernels_of(g: Graph, op: str) -> list[Node]:
    """The top-level nodes (kernels) that compute an op, fused or not."""
    return [n for n in g.nodes if n.op == op or n.body and any(m.op == op for m in n.body)]


def assert_solver_fused(before: Graph, after: Graph) -> None:
    """Every sgd is in a matmul's epilogue or in a horizontal group of MAX_SOLVER_GROUP
    updates, except one group that takes the rest (or one sgd left alone)."""
    sgd_kernels = kernels_of(after, "sgd")
    horizontal = [n for n in sgd_kernels if all(m.op == "sgd" for m in n.body or [n])]
    sizes = sorted(len(n.body or [n]) for n in horizontal)
    assert sizes[1:] == [MAX_SOLVER_GROUP] * (len(sizes) - 1)
    epilogues = [n for n in sgd_kernels if n not in horizontal]
    assert all([m.op for m in n.body] == ["matmul", "sgd"] for n in epilogues)
    assert sum(m.op == "sgd" for n in sgd_kernels for m in n.body or [n]) == \
        sum(n.op == "sgd" for n in before.nodes)


def test_lenet_kernel_counts():
    before = training_graph("lenet")
    after = fuse(before)
    verify(after)
    assert (len(before.nodes), len(after.nodes), len(fused_nodes(after))) == (39, 26, 8)
    kernels = [n.attrs["kernel"] for n in fused_nodes(after)]
    assert kernels == ["fused_conv2d_bias_add", "fused_conv2d_bias_add_1",
                       "fused_matmul_bias_add_relu", "fused_matmul_bias_add",
                       "fused_matmul_sgd", "fused_matmul_relu_grad", "fused_matmul_sgd_1",
                       "fused_sgd_x6"]
    for conv in kernels_of(after, "conv2d"):  # lenet pools right after the bias
        assert [m.op for m in conv.body] == ["conv2d", "bias_add"]
    assert_solver_fused(before, after)
    why = reasons(before)
    assert why[("conv1", "pool1")] == "max_pool2d is opaque"
    assert why[("ip1.flatten", "ip1.matmul")] == "reshape is injective"


def test_cifar_quick_kernel_counts():
    before = training_graph("cifar_quick")
    after = fuse(before)
    verify(after)
    assert (len(before.nodes), len(after.nodes), len(fused_nodes(after))) == (53, 37, 8)
    # (the scale of the images to 0-255 is a kernel of its own: it does not fuse into conv1)
    convs = [[m.op for m in n.body] for n in kernels_of(after, "conv2d")]
    assert convs == [["conv2d", "bias_add"], ["conv2d", "bias_add", "relu"],
                     ["conv2d", "bias_add", "relu"]]
    # conv2's value also feeds relu_grad in the backward pass: the group exports it
    conv2 = kernels_of(after, "conv2d")[1]
    assert [v.name for v in conv2.outputs] == ["conv2", "relu2"]
    assert_solver_fused(before, after)
    assert reasons(before)[("conv2", "grad.conv2")].startswith(
        "fusing would make a cycle through %pool2 (avg_pool2d)")


@pytest.mark.parametrize("model, nodes, fused", [
    ("mlp", (29, 17), 9), ("convnet", (43, 28), 8), ("nin", (99, 63), 15),
    ("inception", (229, 145), 31)])
def test_zoo_kernel_counts(model, nodes, fused):
    before = training_graph(model, batch=1)
    after = fuse(before)
    assert (len(before.nodes), len(after.nodes)) == nodes
    assert len(fused_nodes(after)) == fused
    assert_solver_fused(before, after)


# -- the zoo: same results, text round trip, other passes --------------------------------


@pytest.mark.parametrize("model", ["mlp", "lenet", "convnet", "cifar_quick", "nin",
                                   "inception"])
def test_fused_zoo_graphs_compute_exactly_the_same(model):
    before = training_graph(model, batch=1)
    after = fuse(before)
    verify(after)
    assert_same_results(before, after)
    text = print_graph(after)
    back = parse(text)
    verify(back)
    assert print_graph(back) == text
    assert_same_results(before, back)


def test_other_passes_keep_working_on_fused_graphs():
    after = fuse(training_graph("lenet"))
    text = print_graph(after)
    for new in (after.clone(), dce(after), cse(after), infer_shapes(after)):
        verify(new)
        assert print_graph(new) == text
    users = after.users()
    conv1 = after.nodes[0]
    assert [n.op for n in users[after.value("conv1")]] == ["max_pool2d", "max_pool2d_grad"]
    assert after.value("conv1.conv").producer is conv1.body[0]
    assert after.value("conv1.conv") not in set(after.values())
    with pytest.raises(VerifyError, match="fused node's output types come from its body"):
        after.add_node("fused", [after.input("data")], {"kernel": "k"})


def test_cse_merges_values_members_read():
    g = Graph("g")
    x = g.add_input("x", T(3))
    a = g.add_node("softmax", [x], {"axis": 0}, names=["a"]).outputs[0]
    b = g.add_node("softmax", [x], {"axis": 0}, names=["b"]).outputs[0]
    y = g.add_node("add", [a, b], names=["y"]).outputs[0]
    z = g.add_node("mul", [y, b], names=["z"]).outputs[0]
    g.set_outputs([("z", z)])
    after = fuse(g)
    assert layout(after) == ["a", "b", ("fused_add_mul", ["y", "z"])]
    assert [v.name for v in after.nodes[-1].inputs] == ["a", "b"]
    merged = cse(after)
    verify(merged)
    assert layout(merged) == ["a", ("fused_add_mul", ["y", "z"])]
    assert [v.name for v in merged.nodes[-1].inputs] == ["a"]
    assert_same_results(g, merged)


# -- random DAGs ---------------------------------------------------------------------------

SQUARE = (3, 3)
UNARY = ["relu", "sigmoid", "tanh", "scale", "softmax"]
BINARY = ["add", "sub", "mul", "matmul"]


@st.composite
def dags(draw):
    """Random graphs over f32[3,3] values: elementwise, broadcast, anchor, injective,
    reduction, opaque and multi-output ops, on one or two devices."""
    g = Graph("dag")
    pool = [g.add_input(f"x{i}", T(*SQUARE)) for i in range(draw(st.integers(1, 3)))]
    bias = g.add_input("bias", T(3))
    for i in range(draw(st.integers(1, 14))):
        device = draw(st.sampled_from([CPU0, CPU0, CPU0, CPU1]))

        def pick():  # mostly recent values, so that paths meet again
            return draw(st.sampled_from(pool[-3:] if draw(st.booleans()) else pool))

        kind = draw(st.sampled_from(UNARY + BINARY + ["bias_add", "roundtrip", "reduce",
                                                      "sgd"]))
        name = f"n{i}"
        if kind in UNARY:
            attrs = {"alpha": 0.5} if kind == "scale" else {}
            outs = g.add_node(kind, [pick()], attrs, names=[name], device=device).outputs
        elif kind in BINARY:
            outs = g.add_node(kind, [pick(), pick()], names=[name], device=device).outputs
        elif kind == "bias_add":
            outs = g.add_node("bias_add", [pick(), bias], names=[name], device=device).outputs
        elif kind == "roundtrip":  # injective: reshape away and back
            flat = g.add_node("reshape", [pick()], {"shape": [9]}, names=[name + "f"],
                              device=device).outputs[0]
            outs = g.add_node("reshape", [flat], {"shape": list(SQUARE)}, names=[name],
                              device=device).outputs
        elif kind == "reduce":  # a reduction, then a broadcast back
            r = g.add_node("reduce_sum", [pick()], {"axes": [1], "keepdims": True},
                           names=[name + "r"], device=device).outputs[0]
            outs = g.add_node("broadcast_to", [r], {"shape": list(SQUARE)}, names=[name],
                              device=device).outputs
        else:
            outs = g.add_node("sgd", [pick(), pick(), pick()], {"lr": 0.1, "momentum": 0.5},
                              names=[name, name + "h"], device=device).outputs
        pool.extend(outs)
    values = [v for n in g.nodes for v in n.outputs]
    returned = draw(st.lists(st.sampled_from(values), min_size=1, max_size=4, unique=True))
    returned.append(values[-1])
    g.set_outputs([(v.name, v) for v in dict.fromkeys(returned)])
    return g, draw(st.integers(1, 6))


def check_groups(before: Graph, after: Graph, max_group_size: int) -> None:
    """Every node is in exactly one place; groups keep the pass's promises."""
    assert sorted(n.name for n in after.flat_nodes()) == sorted(n.name for n in before.nodes)
    for node in fused_nodes(after):
        kinds = [get_op(m.op).fusion for m in node.body]
        assert 2 <= len(node.body) <= max_group_size
        assert len({m.device for m in node.body}) == 1
        assert all(k in (FusionKind.elementwise, FusionKind.broadcast) for k in kinds[1:])
        assert kinds[0] in (FusionKind.elementwise, FusionKind.broadcast,
                            FusionKind.out_elementwise_fusable)
        if all(m.op == "sgd" for m in node.body) and len(node.body) > 1:
            continue  # horizontal
        assert len({v.type.shape for m in node.body for v in m.outputs}) == 1


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags())
def test_random_dags_fuse_verify_and_compute_the_same(case):
    g, max_group_size = case
    verify(g)
    before = print_graph(g)
    after = fuse(g, max_group_size=max_group_size)
    assert print_graph(g) == before
    verify(after)  # topological order, so no cycle between groups
    check_groups(g, after, max_group_size)
    assert_same_results(g, after)
    back = parse(print_graph(after))
    assert print_graph(back) == print_graph(after)
    apart = explain(g, max_group_size=max_group_size)
    assert all(a.reason for a in apart)
