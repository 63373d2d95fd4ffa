"""Parallelism by graph rewriting: boxing keeps the logical tensor, data-parallel programs
equal the single-device one, and the dumps say what was inserted and why."""

from __future__ import annotations

import itertools
import types
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import purinec
from purinec.errors import PurinecError, PurinecWarning
from purinec.ir.graph import Graph, member_name
from purinec.ir.parser import parse
from purinec.ir.types import Device, DistKind, Distribution, DType, TensorType
from purinec.ir.verify import verify
from purinec.passes.parallel import (Parallel, assign_stages, conversion_cost, convert,
                                     explain, parse_devices, partition)
from purinec.runtime.reference import execute
from tests.mpi_scripts.common import (adopt_weights, assert_output_close, assert_weights_close,
                                      random_net, weight_scales)

SGD = purinec.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4)

KINDS = [("B", None), ("S", 0), ("S", 1), ("P", None)]


def _dist(kind: str, axis, group) -> Distribution:
    kinds = {"B": DistKind.replicated, "S": DistKind.split, "P": DistKind.partial}
    return Distribution(kinds[kind], group, axis)


def _pieces(x: np.ndarray, dist: Distribution, rng) -> list[np.ndarray]:
    """What each member holds of logical ``x`` under ``dist`` (random summands for a
    partial sum, so a wrong reduction cannot pass by accident)."""
    n = len(dist.group)
    if dist.kind is DistKind.replicated:
        return [x.copy() for _ in range(n)]
    if dist.kind is DistKind.split:
        return np.array_split(x, n, axis=dist.axis)
    parts = [rng.standard_normal(x.shape) for _ in range(n - 1)]
    return parts + [x - sum(parts)]


def _whole(pieces: list[np.ndarray], dist: Distribution) -> np.ndarray:
    if dist.kind is DistKind.split:
        return np.concatenate(pieces, axis=dist.axis)
    if dist.kind is DistKind.partial:
        return sum(pieces)
    for piece in pieces[1:]:
        np.testing.assert_array_equal(piece, pieces[0])  # replicas agree exactly
    return pieces[0]


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("src,dst", [(s, d) for s, d in itertools.product(KINDS, KINDS)
                                     if d[0] != "P" or s[0] == "P"])
def test_every_boxing_conversion_keeps_the_logical_tensor(src, dst, devices):
    group = tuple(Device("cpu", i) for i in range(devices))
    rng = np.random.default_rng(devices)
    shape = (7, 5)  # uneven pieces on both axes
    src_dist, dst_dist = _dist(*src, group), _dist(*dst, group)
    g = Graph("box")
    x = g.add_input("x", TensorType(shape, DType.f64), group[0], dist=src_dist)
    nodes = convert(g, x, dst_dist, "the test")
    g.nodes = nodes
    g.set_outputs([("y", nodes[-1].outputs[0] if nodes else x)])
    verify(g)
    physical = partition(g, 0)
    verify(physical)
    assert str(parse(str(physical))) == str(physical)
    logical = rng.standard_normal(shape)
    env = {member_name("x", k, devices): p for k, p in enumerate(_pieces(logical, src_dist, rng))}
    out = execute(physical, env)
    got = _whole([out[member_name("y", k, devices)] for k in range(devices)], dst_dist)
    np.testing.assert_allclose(got, logical, rtol=1e-12, atol=1e-12)
    assert conversion_cost(src_dist, dst_dist, logical.nbytes) < float("inf")


def _boxed(src: Distribution, dst: Distribution, shape) -> Graph:
    g = Graph("box")
    x = g.add_input("x", TensorType(shape, DType.f64), src.group[0], dist=src)
    g.nodes = convert(g, x, dst, "the test")
    g.set_outputs([("y", g.nodes[-1].outputs[0] if g.nodes else x)])
    verify(g)
    return g


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("server", [0, -1])
@pytest.mark.parametrize("direction", ["to the server", "from the server",
                                       "pieces to the server"])
def test_a_parameter_servers_conversions_keep_the_logical_tensor(devices, server, direction):
    """partial over the group -> whole on its server (reduce), whole on the server ->
    whole on every member (broadcast), and pieces -> whole on the server (allgather,
    then the server's own piece), in process on both targets' kernels."""
    from purinec.runtime.executor import Executable
    from purinec.runtime.host import host_kernels

    group = tuple(Device("cpu", i) for i in range(devices))
    alone = Distribution(DistKind.replicated, (group[server],))
    src, dst, ops = {
        "to the server": (Distribution(DistKind.partial, group), alone, ["reduce"]),
        "from the server": (alone, Distribution(DistKind.replicated, group), ["broadcast"]),
        "pieces to the server": (Distribution(DistKind.split, group, 1), alone,
                                 ["allgather", "copy"]),
    }[direction]
    rng = np.random.default_rng(devices)
    shape = (7, 5)
    g = _boxed(src, dst, shape)
    assert [n.op for n in g.nodes] == ops
    node = g.nodes[0]
    if node.op != "allgather":
        assert node.attrs["root"] == str(group[server]) and explain(g) == [
            f"{node.op} %{node.outputs[0].name}: %x is {src}, the test needs {dst}"]
    physical = partition(g, 0)
    verify(physical)
    assert str(parse(str(physical))) == str(physical)
    logical = rng.standard_normal(shape)
    n = len(src.group)
    env = {member_name("x", k, n): p for k, p in enumerate(_pieces(logical, src, rng))}
    out = execute(physical, env)
    pieces = [out[member_name("y", k, len(dst.group))] for k in range(len(dst.group))]
    np.testing.assert_allclose(_whole(pieces, dst), logical, rtol=1e-12, atol=1e-12)
    # The runtime's kernels add up in the same (group) order: the very same bytes.
    ran = Executable(physical, host_kernels(physical))({k: v.copy() for k, v in env.items()})
    for name, array in out.items():
        assert ran[name].tobytes() == array.tobytes(), name
    assert 0 < conversion_cost(src, dst, logical.nbytes) < float("inf")


def test_a_parameter_servers_conversions_over_ranks_partition_per_rank():
    """Over two ranks: the reduce sums each rank's members toward the root (the rank
    without it keeps what it sent, which nobody reads); the broadcast reads the root's
    tensor on its rank only and writes every local member."""
    group = (Device("cpu", 0), Device("cpu", 1), Device("cpu", 0, 1))
    server = Distribution(DistKind.replicated, (group[2],))
    to_server = _boxed(Distribution(DistKind.partial, group), server, (4,))
    from_server = _boxed(server, Distribution(DistKind.replicated, group), (4,))
    shapes = {}
    for rank in (0, 1):
        for g in (to_server, from_server):
            physical = partition(g, rank)
            verify(physical)
            assert str(parse(str(physical))) == str(physical)
            [node] = physical.nodes
            shapes[node.op, rank] = ([(v.name, str(v.device)) for v in node.inputs],
                                     [(v.name, str(v.device)) for v in node.outputs])
    assert shapes["reduce", 0] == ([("x.p0", "cpu:0"), ("x.p1", "cpu:1")],
                                   [("x.sum.sent", "cpu:0")])
    assert shapes["reduce", 1] == ([("x.p2", "r1/cpu:0")], [("x.sum", "r1/cpu:0")])
    assert shapes["broadcast", 0] == ([], [("x.all.p0", "cpu:0"), ("x.all.p1", "cpu:1")])
    assert shapes["broadcast", 1] == ([("x", "r1/cpu:0")], [("x.all.p2", "r1/cpu:0")])


def test_reduce_and_broadcast_nodes_are_checked():
    g = Graph("g")
    x = g.add_input("x", TensorType((3,), DType.f32))
    with pytest.raises(PurinecError, match="root cpu:2 is not in its group cpu:0,cpu:1"):
        g.add_node("reduce", [x], {"group": "cpu:0,cpu:1", "root": "cpu:2"})
    node = g.add_node("reduce", [x], {"group": "cpu:0,cpu:1", "root": "cpu:1"})
    node.attrs["root"] = "r1/cpu:0"  # as a hand-edited .pir file might say
    with pytest.raises(PurinecError, match=r"reduce.*root r1/cpu:0 is not in its group"):
        verify(g)
    z = g.add_input("z", TensorType((2,), DType.f32), Device("cpu", 0))
    bucket = {"group": "cpu:0,cpu:1", "root": "cpu:1", "tensors": 2}
    with pytest.raises(PurinecError, match=r"3 inputs are not 2 tensor\(s\) for each"):
        g.add_node("reduce", [x, z, x], bucket)
    with pytest.raises(PurinecError, match=r"input 2 is f32\[2\] but the same tensor"):
        g.add_node("reduce", [x, z, z, x], bucket)
    text = ('graph g(%x: f32[3] @cpu:0) {\n  %y = broadcast(%x) {group="cpu:0,cpu:1", '
            'root="cpu:0", shape=[4], dtype="f32", members=1} : f32[4] @cpu:0\n'
            '  return y=%y\n}\n')
    with pytest.raises(PurinecError, match=r"broadcast: takes the root's f32\[4\]"):
        verify(parse(text))
    # A bucket: shape holds the tensors' shapes in turn, ndims cuts it.
    sent = {"group": "cpu:0,cpu:1", "root": "cpu:0", "shape": [3, 2], "ndims": [1, 1]}
    y = g.add_node("broadcast", [x, z], {**sent, "members": 2}).outputs
    assert [v.type for v in y] == [x.type, z.type] * 2
    assert [v.type for v in g.add_node("broadcast", [], sent).outputs] == [x.type, z.type]
    with pytest.raises(PurinecError, match=r"takes the root's f32\[3\], f32\[2\] .*got f32\[3\]$"):
        g.add_node("broadcast", [x], sent)
    with pytest.raises(PurinecError, match=r"ndims=\[2, 1\] does not cut shape=\[3, 2\]"):
        g.add_node("broadcast", [], {**sent, "ndims": [2, 1]})


def test_a_conversion_the_table_lacks_is_refused_with_the_consumer_named():
    group = (Device("cpu", 0), Device("cpu", 1))
    g = Graph("box")
    x = g.add_input("x", TensorType((4,), DType.f32), group[0],
                    dist=Distribution(DistKind.replicated, group))
    with pytest.raises(PurinecError, match="relu %y needs partial"):
        convert(g, x, Distribution(DistKind.partial, group), "relu %y")


def _feeds(graph, rng, classes: int = 10):
    """Random images in [0, 1), as the zoo's models take them, and labels."""
    feeds = {}
    for v in graph.inputs_with_role("data"):
        if v.type.dtype.is_float:
            feeds[v.name] = rng.random(v.type.shape).astype(v.type.dtype.numpy)
        else:
            feeds[v.name] = rng.integers(0, classes, v.type.shape).astype(v.type.dtype.numpy)
    return feeds


def _assert_same_training(model: str, batch: int, devices: str, target: str,
                          iterations: int = 2, strategy: str = "data") -> purinec.Program:
    """A zoo model trained on ``devices`` as on one: every device used, and (where
    the strategy replicates parameters) every replica bitwise the same."""
    many = _assert_trains_as_one_device(model, batch, devices, target, iterations,
                                        strategy)
    assert len({n.device for n in many.physical_ir.nodes}) == len(parse_devices(devices))
    replicas = many._run_main.replicas.arrays
    assert replicas or strategy in ("model", "pipeline", "ps")  # nothing replicated
    return many


def _assert_trains_as_one_device(model, batch: int | None, devices, target: str,
                                 iterations: int = 2, strategy: str = "data",
                                 classes: int = 10, alone=None) -> purinec.Program:
    """The losses, weights and inference outputs on ``devices`` equal one device's
    (``alone``'s, if given: ``model`` without its placement; after training, with the
    weights ``devices`` trained, `adopt_weights`); the replicas of each parameter are
    bitwise the same. A placed model runs where it says."""
    one = purinec.compile(alone or model, target=target, train=SGD, batch=batch, seed=7)
    placed = strategy == "placement"
    with warnings.catch_warnings():  # a random net may have fewer layers than stages
        warnings.simplefilter("ignore", PurinecWarning)
        many = purinec.compile(model, target=target, train=SGD, batch=batch, seed=7,
                               devices=None if placed else devices,
                               parallel=None if placed else strategy)
    rng = np.random.default_rng(1)
    inputs = _feeds(one.eval_ir, rng, classes)
    _assert_same_inference(one, many, inputs)
    scale = weight_scales(one.params)
    for _ in range(iterations):
        feeds = _feeds(one.ir, rng, classes)
        loss_one, loss_many = one.step(feeds), many.step(feeds)
        assert loss_many == pytest.approx(loss_one, rel=1e-5)
        scale = weight_scales(one.params, scale)
    for name in one.params:
        assert_weights_close(many.params[name], one.params[name], scale[name], name)
    adopt_weights(one, many)
    _assert_same_inference(one, many, inputs)  # with the weights the steps made
    # Every replica holds bitwise the same weights and momentum.
    for (name, device), array in many._run_main.replicas.arrays.items():
        store = many.params if name in many.params else many.state
        np.testing.assert_array_equal(array, store[name], err_msg=f"{name} on {device}")
    one.close()
    return many


def _assert_same_inference(one: purinec.Program, many: purinec.Program, feeds) -> None:
    expected, got = one.run(feeds), many.run(feeds)
    for name, value in expected.items():
        assert_output_close(got[name], value, f"inference output {name}")


@st.composite
def _small_nets(draw):
    devices = [Device("cpu", i) for i in range(draw(st.sampled_from([2, 3])))]
    return len(devices), *random_net(lambda options: draw(st.sampled_from(options)), devices)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(_small_nets())
def test_every_strategy_trains_random_small_networks_as_one_device(case):
    """Odd sizes: batches that do not divide evenly, fewer output features or channels
    than devices, layers that shrink to 1x1; layers placed by the model."""
    devices, net, alone, strategy, classes = case
    _assert_trains_as_one_device(net, None, devices, "reference", strategy=strategy,
                                 classes=classes, alone=alone).close()


@pytest.mark.parametrize("model,batch", [("lenet", 12), ("cifar_quick", 10)])
@pytest.mark.parametrize("devices", ["2", "3"])
def test_data_parallel_training_equals_one_device(model, batch, devices):
    many = _assert_same_training(model, batch, devices, "reference")
    sizes = {v.type.shape[0] for v in many.physical_ir.inputs if v.name.startswith("data.")}
    assert sizes == {batch // int(devices)} if batch % int(devices) == 0 else len(sizes) == 2
    many.close()


@pytest.mark.parametrize("model,batch", [("lenet", 12), ("cifar_quick", 10)])
@pytest.mark.parametrize("devices", ["2", "3"])
@pytest.mark.parametrize("strategy", ["model", "hybrid"])
def test_model_and_hybrid_training_equals_one_device(model, batch, devices, strategy):
    many = _assert_same_training(model, batch, devices, "reference", strategy=strategy)
    split = {v.name: v.dist for v in many.ir.inputs_with_role("param")
             if v.dist.kind is DistKind.split}
    fully_connected = {name for name in split if name.startswith("ip")}
    assert fully_connected and all(d.axis == 0 for d in split.values())
    if strategy == "hybrid":  # convolutions stay data-parallel
        assert set(split) == fully_connected
        assert many.ir.input("data").dist.kind is DistKind.split
    else:
        assert any(name.startswith("conv") for name in split)
    many.close()


@pytest.mark.parametrize("model,batch", [("lenet", 12), ("cifar_quick", 10)])
@pytest.mark.parametrize("devices", ["2", "3"])
def test_pipeline_training_equals_one_device(model, batch, devices):
    many = _assert_same_training(model, batch, devices, "reference", strategy="pipeline")
    physical = many.physical_ir
    # Stages: every device runs some of the heavy work, in contiguous layers.
    heavy = [n for n in physical.nodes if n.op in ("conv2d", "matmul")]
    assert {n.device for n in heavy} == set(parse_devices(devices))
    # Micro-batches: twice the stages, each its own copy of the forward pass.
    count = 2 * int(devices)
    assert len([n for n in physical.nodes if n.op == "softmax_xent"]) == count
    # One update per parameter, on the device of its layer, after all micro-batches.
    updates = [n for n in physical.nodes if n.op == "sgd"]
    assert len(updates) == len(many.params)
    copies = [n for n in physical.nodes if n.op == "copy"]
    assert copies and all(n.inputs[0].device != n.outputs[0].device for n in copies)
    many.close()


def _assert_every_device_gets_the_servers_weights(program: purinec.Program, feeds) -> None:
    """One more step of a ps program, its broadcasts' outputs returned too: every
    device's copy of every new weight, sent as soon as the server made it, is bitwise
    the server's."""
    from purinec.targets import get_target

    physical = parse(str(program.physical_ir))
    copies = [n for n in physical.nodes if n.op == "broadcast"]
    physical.set_outputs(physical.outputs + [(v.name, v) for n in copies for v in n.outputs])
    run = get_target(program.target).executable(physical)
    seen = {}

    def capture(env):
        seen.update(run(env))
        return seen

    distributed = program._run_main
    distributed.physical, original = capture, distributed.physical
    try:
        program.step(feeds)
    finally:
        distributed.physical = original
        getattr(run, "close", lambda: None)()
    sent = [x.name for n in copies for x in n.inputs]
    assert sorted(sent) == sorted(f"{name}.next" for name in program.params)
    assert len(copies) < len(sent)  # the small ones bucketed
    for node in copies:  # each tensor of a bucket, for each member in turn
        per = len(node.inputs)
        assert [v.device for v in node.outputs] == [
            device for device in program.devices for _ in range(per)]
        for i, v in enumerate(node.outputs):
            served = program.params[node.inputs[i % per].name[:-len(".next")]]
            assert seen[v.name].tobytes() == served.tobytes(), v.name


@pytest.mark.parametrize("model,batch", [("lenet", 12), ("cifar_quick", 10)])
@pytest.mark.parametrize("devices", ["2", "3"])
def test_parameter_server_training_equals_one_device(model, batch, devices):
    many = _assert_same_training(model, batch, devices, "reference", strategy="ps")
    _assert_every_device_gets_the_servers_weights(many, _feeds(many.ir,
                                                               np.random.default_rng(3)))
    many.close()


def test_parameter_server_training_on_the_cpu_target_equals_one_device():
    many = _assert_same_training("lenet", 16, "cpu:0,cpu:1", "cpu", strategy="ps")
    _assert_every_device_gets_the_servers_weights(many, _feeds(many.ir,
                                                               np.random.default_rng(3)))
    many.close()


@pytest.mark.parametrize("model,devices", [("lenet", "2"), ("cifar_quick", "3")])
def test_parameter_servers_share_the_parameters_by_bytes(model, devices):
    from purinec.compiler import build_graph, load_source

    logical = build_graph(load_source(model, 8), SGD,
                          parallel=Parallel(parse_devices(devices), "ps"))
    updates = [n for n in logical.nodes if n.op == "sgd"]
    servers = {n.inputs[0].producer.inputs[0].name: n.outputs[0].dist.group
               for n in updates}  # (each reads the server's replica of its weight)
    params = [v for v in logical.inputs if v.role == "param"]
    assert len(updates) == len(params) and all(len(g) == 1 for g in servers.values())
    assert {group[0] for group in servers.values()} == set(parse_devices(devices))
    largest = max(params, key=lambda v: v.type.nbytes)
    assert servers[largest.name] == (Device("cpu", 0),)
    if model == "lenet":  # ip1.weight outweighs the rest together: cpu:1 serves them
        assert {v.name for v in params if servers[v.name] == (Device("cpu", 0),)} == {
            "ip1.weight"}
    # As in Purine: the weights are whole on every device, the momentum on the server
    # alone; each update runs on the server, from a reduce there and the server's own
    # replica, and its result is broadcast as soon as it is made (small ones together,
    # once the last of them is: only updates and broadcasts in between); the batch stays
    # split.
    position = {id(n): i for i, n in enumerate(logical.nodes)}
    readers = logical.users()
    for node in updates:
        weight, history, grad = node.inputs
        group = servers[weight.producer.inputs[0].name]
        assert weight.producer.op == "copy" and weight.dist.group == group
        assert weight.producer.inputs[0].dist.group == tuple(parse_devices(devices))
        assert history.dist.group == group and history.producer is None
        assert grad.producer.op == "reduce" and grad.dist.group == group
        (sent,) = readers[node.outputs[0]]
        assert sent.op == "broadcast" and sent.attrs["root"] == str(group[0])
        between = logical.nodes[position[id(node)] + 1:position[id(sent)]]
        assert all(n.op in ("sgd", "broadcast") for n in between)
    assert logical.input("data").dist.kind is DistKind.split


def test_a_pipelines_inference_graph_keeps_each_parameter_on_its_training_stage(monkeypatch):
    """The training graph's work (loss, backward) moves the stage boundaries. Over MPI
    ranks only the training stage's rank holds a parameter's new values after a step,
    so inference must use it there."""
    from purinec.bigraph import Accuracy, Blob, InnerProduct, Net, ReLU, SoftmaxWithLoss

    with Net("shifts") as net:
        data, label = Blob("data", (8, 1, 7, 7)), Blob("label", (8,), "i32")
        logits = (data >> InnerProduct("ip0", 2) >> ReLU("relu0") >> InnerProduct("out", 4)
                  >> Blob("logits"))
        net.outputs = [logits, [logits, label] >> SoftmaxWithLoss("loss"),
                       [logits, label] >> Accuracy("accuracy")]
    with pytest.warns(PurinecWarning, match="cpu:1 gets no work"):  # two layers, 3 devices
        program = purinec.compile(net, train=SGD, devices=3, parallel="pipeline")
    trained = {v.name: v.dist for v in program.ir.inputs_with_role("param")}
    used = {v.name: v.dist for v in program.eval_ir.inputs_with_role("param")}
    assert used == trained and len({d.group for d in trained.values()}) == 2
    # Laid out by their own work, the graphs would disagree: refused by name.
    monkeypatch.setattr(purinec.compiler, "pinned_to", lambda graph, spread: spread)
    with pytest.raises(PurinecError, match=r"param ip0.weight: graph shifts.train reads it "
                                           r"as replicated\[cpu:0\] but graph shifts reads "
                                           r"it as replicated\[cpu:1\]"):
        purinec.compile(net, train=SGD, devices=3, parallel="pipeline")


DROPOUT_PIPELINE = """
from purinec.bigraph import (Accuracy, Blob, Dropout, GlobalAvgPool, InnerProduct, Net, ReLU,
                             SoftmaxWithLoss)

def build(batch=8):
    with Net("dropouts") as net:
        data, label = Blob("data", (batch, 1, 6, 6)), Blob("label", (batch,), "i32")
        logits = (data >> GlobalAvgPool("pool") >> InnerProduct("ip0", 5) >> ReLU("relu0")
                  >> Dropout("drop0", 0.3) >> InnerProduct("ip1", 10) >> ReLU("relu1")
                  >> Dropout("drop1", 0.3) >> InnerProduct("out", 10) >> Blob("logits"))
        net.outputs = [logits, [logits, label] >> SoftmaxWithLoss("loss"),
                       [logits, label] >> Accuracy("accuracy")]
    return net
"""


def test_a_pipelines_iteration_counter_comes_back_where_it_is_kept(tmp_path):
    """Dropout's iteration counter is read on two stages and counted up on a third; the
    next value goes back to the counter's device (over ranks, another device's rank
    would never see it, and the next step would draw the same masks)."""
    model = tmp_path / "dropouts.py"
    model.write_text(DROPOUT_PIPELINE)
    program = purinec.compile(str(model), train=SGD, devices=3, parallel="pipeline")
    counter = program.ir.input("iteration")
    [after] = [v for name, v in program.ir.outputs if name == "iteration"]
    assert after.dist == counter.dist
    readers = {n.device for n in program.ir.nodes if n.op == "dropout_mask"}
    [counting] = [n for n in program.ir.nodes if n.op == "add_scalar"]
    assert len(readers | {counting.device}) == 3 and counting.device != counter.device
    _assert_trains_as_one_device(str(model), None, 3, "reference", iterations=3,
                                 strategy="pipeline").close()


def test_a_pipeline_longer_than_the_model_says_which_devices_sit_idle():
    with pytest.warns(PurinecWarning) as warned:
        program = purinec.compile("mlp", batch=8, devices=6, parallel="pipeline")
    used = [str(d) for d in program.devices]
    idle = [f"cpu:{i}" for i in range(6) if f"cpu:{i}" not in used]
    assert 1 < len(used) < 6
    assert str(warned[0].message) == (
        f"pipeline parallelism puts mlp on {len(used)} of the 6 devices given; "
        f"{', '.join(idle)} {'gets' if len(idle) == 1 else 'get'} no work: its layers' "
        f"work cuts into fewer stages of about equal work (a layer is never split)")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PurinecWarning)  # every device works: no warning
        purinec.compile("mlp", batch=8, devices=2, parallel="pipeline")
        purinec.compile("mlp", batch=8, devices=6, parallel="data")


def test_a_pipeline_gives_no_stage_to_the_flattening_of_its_input():
    """mlp's first node reshapes the image batch: nearly no work, so the cut by work
    put it on a stage (and a device) of its own, with a copy of the batch after it."""
    from purinec.compiler import build_graph, load_source

    graph = assign_stages(build_graph(load_source("mlp", 8), None), tuple(parse_devices("9")))
    flatten, first_product = graph.nodes[:2]
    assert flatten.op == "reshape" and first_product.op == "matmul"
    assert flatten.outputs[0].device == first_product.outputs[0].device
    assert graph.inputs[0].device == first_product.outputs[0].device


def test_a_strategy_over_one_device_says_it_is_the_one_device_program():
    with pytest.warns(PurinecWarning, match=r"model parallelism over one device \(cpu:0\) "
                                            r"is the plain one-device program"):
        program = purinec.compile("mlp", batch=4, devices=1, parallel="model")
    assert program.devices == [Device("cpu", 0)] and program.physical_ir is None
    # A lone device of another rank is not quietly made this process's cpu:0.
    with pytest.raises(PurinecError, match=r"one device \(r1/cpu:0\) makes the one-device "
                                           r"program, which every process runs on its own"):
        purinec.compile("mlp", batch=4, devices="r1/cpu:0")


def test_pipeline_micro_batches_are_checked():
    with pytest.raises(PurinecError, match="cannot cut a batch of 4 into 5 micro-batches"):
        purinec.compile("mlp", batch=4, devices=2, parallel="pipeline", micro_batches=5)
    with pytest.raises(PurinecError, match=r"micro-batches \(2\) go with the pipeline "
                                           r"strategy only, not data"):
        purinec.compile("mlp", batch=4, devices=2, parallel="data", micro_batches=2)
    with pytest.raises(PurinecError, match="not data"):  # data: the default strategy
        purinec.compile("mlp", batch=4, devices=2, micro_batches=2)
    with pytest.raises(PurinecError, match="not one device"):  # they used to be ignored
        purinec.compile("mlp", batch=4, micro_batches=2)
    with pytest.raises(PurinecError, match="micro-batches must be at least 1, got 0"):
        purinec.compile("mlp", batch=4, devices=2, parallel="pipeline", micro_batches=0)


def test_data_parallel_on_the_cpu_target_equals_one_device():
    many = _assert_same_training("lenet", 16, "cpu:0,cpu:1", "cpu", iterations=3)
    devices = {n.device for n in many.physical_ir.nodes}
    assert devices == {Device("cpu", 0), Device("cpu", 1)}
    fused = [n for n in many.physical_ir.nodes if n.op == "fused"]
    assert fused and all(len({m.device for m in n.body}) == 1 for n in fused)
    many.close()


def test_uneven_batch_weights_each_piece_by_its_rows():
    # 10 rows over 3 devices: 4, 3, 3. The loss is the mean over all 10 rows.
    _assert_same_training("mlp", 10, "3", "reference", iterations=1).close()


@pytest.mark.parametrize("strategy", ["data", "ps"])
def test_inference_outputs_are_gathered_whole(strategy):
    one = purinec.compile("lenet", batch=6, seed=2)
    many = purinec.compile("lenet", batch=6, seed=2, devices=3, parallel=strategy)
    feeds = _feeds(one.ir, np.random.default_rng(0))
    a, b = one.run(feeds), many.run(feeds)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("target", ["reference", "cpu"])
def test_new_weights_are_set_by_assignment_and_reach_every_device(target):
    # Every device holds its own replica of a replicated weight. Writing into the array
    # the program hands out would change one of them, so that array is read-only.
    one = purinec.compile("lenet", batch=6, seed=2, target=target)
    many = purinec.compile("lenet", batch=6, seed=2, target=target, devices=3)
    feeds = _feeds(one.ir, np.random.default_rng(0))
    many.run(feeds)  # the replicas exist
    with pytest.raises(ValueError, match="read-only"):
        many.params["ip2.weight"][...] = 0
    rng = np.random.default_rng(1)
    for name in ("ip2.weight", "conv1.bias"):
        new = rng.standard_normal(one.params[name].shape)
        one.params[name] = many.params[name] = new
    a, b = one.run(feeds), many.run(feeds)
    np.testing.assert_allclose(b["logits"], a["logits"], rtol=1e-5, atol=1e-5)
    many.close()


def test_distributed_graph_prints_and_parses_back_and_explains_itself():
    from purinec.compiler import build_graph, load_source

    logical = build_graph(load_source("lenet", 64), SGD,
                          parallel=Parallel(parse_devices("cpu:0,cpu:1")))
    text = str(logical)
    assert str(parse(text)) == text
    assert "~ split(0)[cpu:0,cpu:1]" in text and "~ partial[cpu:0,cpu:1]" in text
    reasons = explain(logical)
    comm = [n for n in logical.nodes if n.op in ("allreduce", "allgather", "slice", "copy")]
    assert len(reasons) == sum(len(n.inputs) for n in comm) > 0
    # Every gradient is made whole for its sgd update by an allreduce of partial sums;
    # small ones share a bucket.
    params = [v.name for v in logical.inputs if v.role == "param"]
    for param in params:
        assert any(f"%grad.{param} is partial[cpu:0,cpu:1], sgd %{param}.next needs "
                   f"replicated" in why for why in reasons), param
    buckets = [n for n in comm if n.op == "allreduce" and n.attrs["tensors"] > 1]
    assert buckets and all(n.attrs["tensors"] == len(n.inputs) for n in buckets)
    assert any("(bucket of" in why for why in reasons)
    # Each allreduce follows right after the node that makes its last input, so the
    # runtime can post it while the backward pass goes on.
    position = {id(n): i for i, n in enumerate(logical.nodes)}
    for node in (n for n in comm if n.op == "allreduce"):
        last = max(position[id(v.producer)] for v in node.inputs)
        assert position[id(node)] == last + 1


@pytest.mark.parametrize("model,batch", [("lenet", 8), ("lenet", 64), ("inception", 8),
                                         ("nin", 8)])
def test_data_parallelism_communicates_only_gradients_and_outputs(model, batch):
    """The batch stays split through the forward and backward passes: no activation is
    gathered for a consumer, even where that would move fewer bytes than reducing a
    weight gradient (lenet's ip1 at batch 8), since the gather would stall the pass.
    (inception: the gradient of a concat is split; nin: a global average pool's
    gradient is broadcast back over H and W.)"""
    from purinec.compiler import build_graph, load_source

    logical = build_graph(load_source(model, batch), SGD,
                          parallel=Parallel(parse_devices("cpu:0,cpu:1")))
    readers = logical.users()
    returned = {id(v) for _, v in logical.outputs}
    for node in logical.nodes:
        # (A dropout mask is drawn whole on every device, the same numbers as on one
        # device, and each takes its rows: no communication.)
        mask = node.op == "slice" and node.inputs[0].producer.op == "dropout_mask"
        if node.op in ("allgather", "slice", "copy") and not mask:
            assert all(id(v) in returned and not readers.get(v) for v in node.outputs), node
        if node.op == "allreduce":
            assert all(r.op == "sgd" for v in node.outputs for r in readers.get(v, [])), node
    reduced = {v.name for n in logical.nodes if n.op == "allreduce" for v in n.inputs}
    assert {f"grad.{v.name}" for v in logical.inputs if v.role == "param"} <= reduced


@pytest.mark.parametrize("strategy", ["data", "ps", "hybrid", "pipeline"])
def test_a_training_step_gathers_no_batch_sized_output(strategy):
    """The logical training iteration returns the logits (gathered from the devices),
    but a step runs it without them: it returns the loss and keeps the new weights
    (every gather left feeds a computation: hybrid's model-parallel layers), and the
    program's inference graph gives the logits."""
    program = purinec.compile("lenet", batch=6, seed=2, train=SGD, devices=2,
                              parallel=strategy)
    assert "logits" in dict(program.ir.outputs)
    runs = program.physical_ir
    assert not [n for n, _ in runs.outputs if n.startswith("logits")]
    readers = runs.users()
    assert all(readers.get(v) for n in runs.nodes if n.op == "allgather" for v in n.outputs)
    returned = {n.split(".p")[0] for n, _ in runs.outputs}
    assert {"loss", "accuracy", "ip2.weight", "ip2.weight.history"} <= returned
    one = purinec.compile("lenet", batch=6, seed=2, train=SGD)
    feeds = _feeds(one.ir, np.random.default_rng(0))
    for _ in range(2):
        assert program.step(feeds) == pytest.approx(one.step(feeds), rel=1e-5)
    assert program.last_outputs["accuracy"] == one.last_outputs["accuracy"]
    images = {"data": feeds["data"]}
    np.testing.assert_allclose(program.run(images)["logits"], one.run(images)["logits"],
                               rtol=1e-5, atol=1e-5)
    program.close()


def test_a_training_iteration_from_a_file_keeps_its_outputs(tmp_path):
    """A training iteration compiled as it is (a .pir file) is its program's inference
    graph too: its steps keep the logits, which `run` reads."""
    from purinec.compiler import build_graph, load_source

    logical = build_graph(load_source("lenet", 6), SGD,
                          parallel=Parallel(parse_devices("cpu:0,cpu:1")))
    path = tmp_path / "lenet.train.pir"
    path.write_text(str(logical))
    program = purinec.compile(str(path))
    assert program.eval_ir is program.ir
    assert any(n.startswith("logits") for n, _ in program.physical_ir.outputs)
    feeds = _feeds(program.ir, np.random.default_rng(0))
    assert program.run(feeds)["logits"].shape == (6, 10)
    program.close()


def test_parallel_options_are_checked():
    with pytest.raises(PurinecError, match="unknown parallel strategy"):
        Parallel(parse_devices("2"), "sideways")
    with pytest.raises(PurinecError, match="not a device"):
        parse_devices("cpu:0,gpu")
    with pytest.raises(PurinecError, match="distinct"):
        Parallel(parse_devices("cpu:0,cpu:0"))
    with pytest.raises(PurinecError, match="needs several devices"):
        purinec.compile("mlp", parallel="data")
    with pytest.raises(PurinecError, match="no device kind cuda; the kinds are cpu, gpu"):
        parse_devices("cpu:0,cuda:1")


@pytest.mark.parametrize("devices, refused", [
    ("gpu:0,gpu:1", "gpu:0, gpu:1"), ("gpu:0", "gpu:0"), ("cpu:0,r1/gpu:0", "r1/gpu:0"),
    ((Device("tpu", 0), Device("cpu", 1)), "tpu:0")])
@pytest.mark.parametrize("target", ["reference", "cpu"])
def test_targets_refuse_devices_they_have_no_kernels_for(devices, refused, target):
    """A GPU device is refused by the cpu targets, one device alone too, instead of
    running on the host under the GPU's name, and the error names the target that runs
    it."""
    unsupported = "; gpu devices run on target cuda" if "gpu" in refused else "$"
    with pytest.raises(PurinecError, match=f"target {target} runs on cpu devices, not on "
                                           f"{refused} \\(the devices asked for\\)"
                                           f"{unsupported}"):
        purinec.compile("mlp", target=target, batch=4, devices=devices)


def test_a_program_over_ranks_refuses_to_start_without_mpiexec():
    with pytest.raises(PurinecError, match="mpiexec -n 2"):
        purinec.compile("mlp", batch=4, devices="r0/cpu:0,r1/cpu:0")


def test_a_rank_only_an_output_is_laid_out_over_needs_mpiexec_too():
    """A .pir file whose inputs are all on rank 0 but one of whose outputs is laid out
    over rank 1 too: the job needs both ranks (it failed in its first step, on an MPI
    broadcast without MPI)."""
    logical = purinec.compile("mlp", batch=4, input_shape=(1, 2, 2), devices=2).ir
    head, body = str(logical).split(") {\n", 1)  # a node's output's, not an input's
    text = head + ") {\n" + body.replace("~ replicated[cpu:0,cpu:1]",
                                         "~ replicated[r1/cpu:0,cpu:1]", 1)
    with pytest.raises(PurinecError, match="laid out over 2 ranks .*mpiexec -n 2"):
        purinec.compile(parse(text, verify=True))


PLACED_MODEL = """
from purinec.bigraph import Accuracy, Blob, InnerProduct, Location, Net, ReLU, SoftmaxWithLoss


def build(batch=16, input_shape=(1, 8, 8), num_classes=10, second=None):
    with Net("placed") as net:
        data = Blob("data", (batch, *input_shape))
        label = Blob("label", (batch,), "i32")
        hidden = data >> InnerProduct("ip1", 32) >> ReLU("relu1")
        logits = (hidden >> InnerProduct("ip2", num_classes, location=second)
                  >> Blob("logits"))
        loss = [logits, label] >> SoftmaxWithLoss("loss")
        accuracy = [logits, label] >> Accuracy("accuracy")
        net.outputs = [logits, loss, accuracy]
    return net
"""


def test_devices_given_for_a_placed_model_say_its_placement_is_not_used(tmp_path):
    from purinec.bigraph import Location

    path = tmp_path / "placed.py"
    path.write_text(PLACED_MODEL)
    with pytest.warns(PurinecWarning, match=r"placed places its layers on cpu:0, cpu:5 "
                                            r"itself; the devices and strategy given lay it "
                                            r"out anew"):
        program = purinec.compile(str(path), devices=2, second=Location(0, "cpu", 5))
    assert [str(d) for d in program.devices] == ["cpu:0", "cpu:1"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", PurinecWarning)  # not placed: nothing to say
        purinec.compile(str(path), devices=2)


@pytest.mark.parametrize("target", ["reference", "cpu"])
def test_layers_placed_by_the_model_run_there_with_copies_between(tmp_path, target):
    from purinec.bigraph import Location

    path = tmp_path / "placed.py"
    path.write_text(PLACED_MODEL)
    one = purinec.compile(str(path), target=target, train=SGD, seed=4)
    placed = purinec.compile(str(path), target=target, train=SGD, seed=4,
                             second=Location(0, "cpu", 1))
    copies = [n for n in placed.ir.nodes if n.op == "copy"]
    # Activations forward and gradients back, each way across the cut.
    assert sorted(n.inputs[0].name for n in copies) == [
        "grad.logits", "grad.relu1", "logits", "relu1"]
    assert all(n.loc.startswith("boxing: ") for n in copies)
    with pytest.raises(PurinecError, match=f"target {target} runs on cpu devices, not on "
                                           r"gpu:1 \(devices of graph placed.train\)"):
        purinec.compile(str(path), target=target, train=SGD, second=Location(0, "gpu", 1))
    assert {str(n.device) for n in placed.physical_ir.nodes} == {"cpu:0", "cpu:1"}
    rng = np.random.default_rng(5)
    for _ in range(2):
        feeds = _feeds(one.ir, rng)
        assert placed.step(feeds) == pytest.approx(one.step(feeds), rel=1e-6)
    for name in one.params:
        np.testing.assert_allclose(placed.params[name], one.params[name], rtol=1e-6,
                                   atol=1e-7)
    one.close()
    placed.close()




def test_a_distributed_program_saves_and_loads_bitwise(tmp_path):
    program = purinec.compile("mlp", target="cpu", train=SGD, batch=8, devices=2, seed=3)
    feeds = _feeds(program.ir, np.random.default_rng(2))
    program.step(feeds)
    program.save(tmp_path / "dp.purine")
    loaded = purinec.load(tmp_path / "dp.purine")
    assert loaded.devices == program.devices and loaded.physical_ir is not None
    assert program.step(feeds) == loaded.step(feeds)
    for name in program.params:
        np.testing.assert_array_equal(loaded.params[name], program.params[name])
    program.close()
    loaded.close()


@pytest.mark.parametrize("strategy", ["data", "ps", "model", "pipeline"])
def test_a_layout_over_ranks_runs_in_one_process(strategy):
    """What a checkpoint of an MPI job holds (a graph laid out over two ranks), moved
    onto this process's devices, trains and evaluates as one device does."""
    from purinec.compiler import build_graph, load_source
    from purinec.layout import layout_ranks, onto_ranks

    parallel = Parallel(parse_devices("r0/cpu:0,r1/cpu:0"), strategy)
    graphs = [build_graph(load_source("lenet", 12), train, parallel=parallel)
              for train in (SGD, None)]
    assert [layout_ranks(g) for g in graphs] == [2, 2]
    moved = onto_ranks(1, *graphs)
    assert [layout_ranks(g) for g in moved] == [1, 1]
    assert str(parse(str(moved[0]))) == str(moved[0])  # device attributes moved too
    one = purinec.compile("lenet", train=SGD, batch=12, seed=7)
    many = purinec.Program.from_ir(*moved, params=dict(one.params), state=dict(one.state))
    assert [str(d) for d in many.devices] == ["cpu:0", "cpu:1"]
    rng = np.random.default_rng(1)
    inputs = _feeds(one.eval_ir, rng)
    for _ in range(2):
        feeds = _feeds(one.ir, rng)
        assert many.step(feeds) == pytest.approx(one.step(feeds), rel=1e-5)
    _assert_same_inference(one, many, inputs)
    one.close()
    many.close()


def test_a_layout_is_dealt_out_over_the_ranks_of_a_job():
    from purinec.compiler import build_graph, load_source
    from purinec.layout import layout_devices, onto_ranks
    from purinec.program import Program

    four = build_graph(load_source("mlp", 8), SGD,
                       parallel=Parallel(parse_devices("4"), "data"))
    (two,) = onto_ranks(2, four)
    assert [str(d) for d in layout_devices(two)] == ["cpu:0", "cpu:1", "r1/cpu:0",
                                                     "r1/cpu:1"]
    assert str(parse(str(two))) == str(two)
    assert 'group="cpu:0,cpu:1,r1/cpu:0,r1/cpu:1"' in str(two)
    # What a program on them says it runs on (compile and train print it), in that order.
    assert Program.devices.fget(types.SimpleNamespace(ir=two)) == layout_devices(two)
    with pytest.raises(PurinecError, match=r"over 4 device.*cannot be spread over 5 ranks: "
                                           r"run it on at most 4 \(mpiexec -n 4"):
        onto_ranks(5, four)


def _partial_graph(sizes: list[int]) -> tuple[Graph, list]:
    """Partial sums of the given sizes, each allreduced by the boxing pass."""
    group = (Device("cpu", 0), Device("cpu", 1))
    g = Graph("buckets")
    partial = Distribution(DistKind.partial, group)
    whole = Distribution(DistKind.replicated, group)
    reduced = []
    for i, n in enumerate(sizes):
        x = g.add_input(f"g{i}", TensorType((n,), DType.f32), group[0], dist=partial)
        reduced.append(convert(g, x, whole, f"use {i}")[0])
    return g, reduced


def test_buckets_fill_up_to_their_size_in_order():
    from purinec.passes.parallel.bucket import bucket

    g, reduced = _partial_graph([100, 100, 200_000, 100])  # f32: 400 B, 400 B, 800 kB
    g.nodes = reduced
    g.set_outputs([(f"y{i}", n.outputs[0]) for i, n in enumerate(reduced)])
    merged = bucket(g, limit=1000)
    assert [len(n.inputs) for n in merged.nodes] == [2, 1, 1]
    assert merged.nodes[0].attrs["tensors"] == 2
    verify(merged)


def test_a_bucket_never_grows_past_a_read_of_its_results():
    from purinec.passes.parallel.bucket import bucket

    g, reduced = _partial_graph([10, 10])
    read = g.make_node("relu", [reduced[0].outputs[0]], names=["r"])
    read.outputs[0].dist = reduced[0].outputs[0].dist
    g.nodes = [reduced[0], read, reduced[1]]  # the first sum is needed before the second
    g.set_outputs([("r", read.outputs[0]), ("y1", reduced[1].outputs[0])])
    merged = bucket(g, limit=1 << 20)
    assert [n.op for n in merged.nodes] == ["allreduce", "relu", "allreduce"]


def test_a_bucket_spans_little_work_counting_memory_traffic():
    """Two gradients (not small ones) made on either side of a node that does no
    arithmetic but moves a lot of memory (a pooling gradient, a concat) are not held
    back for each other."""
    from purinec.passes.parallel.bucket import SMALL_BUCKET_BYTES, bucket

    g, reduced = _partial_graph([SMALL_BUCKET_BYTES // 4, 10])
    group = reduced[0].outputs[0].dist.group
    whole = Distribution(DistKind.replicated, group)
    a = g.add_input("a", TensorType((64, 64), DType.f32), group[0], dist=whole)
    product = g.make_node("matmul", [a, a], names=["p"])  # most of the graph's FLOPs
    parts = [g.add_input(f"c{i}", TensorType((10_000,), DType.f32), group[0], dist=whole)
             for i in range(2)]
    joined = g.make_node("concat", parts, {"axis": 0}, names=["joined"])  # no FLOPs
    for node in (product, joined):
        node.outputs[0].dist = whole
    g.nodes = [product, reduced[0], joined, reduced[1]]
    g.set_outputs([("p", product.outputs[0]), ("joined", joined.outputs[0]),
                   ("y0", reduced[0].outputs[0]), ("y1", reduced[1].outputs[0])])
    merged = bucket(g, limit=1 << 20)
    assert [n.op for n in merged.nodes] == ["matmul", "allreduce", "concat", "allreduce"]
    g.nodes = [product, reduced[0], reduced[1], joined]  # nothing between them: one bucket
    assert [n.op for n in bucket(g, limit=1 << 20).nodes] == ["matmul", "allreduce",
                                                             "concat"]


def test_small_gradients_wait_for_the_next_bucket_however_much_work_comes_between():
    from purinec.passes.parallel.bucket import SMALL_BUCKET_BYTES, bucket

    g, reduced = _partial_graph([10, SMALL_BUCKET_BYTES // 8])
    group = reduced[0].outputs[0].dist.group
    whole = Distribution(DistKind.replicated, group)
    a = g.add_input("a", TensorType((64, 64), DType.f32), group[0], dist=whole)
    product = g.make_node("matmul", [a, a], names=["p"])  # the graph's work
    product.outputs[0].dist = whole
    g.nodes = [reduced[0], product, *reduced[1:]]
    g.set_outputs([("p", product.outputs[0])] +
                  [(f"y{i}", n.outputs[0]) for i, n in enumerate(reduced)])
    merged = bucket(g, limit=1 << 20)
    verify(merged)
    assert [(n.op, n.attrs.get("tensors")) for n in merged.nodes] == [
        ("matmul", None), ("allreduce", 2)]


def test_reduces_onto_one_server_are_bucketed_and_sum_as_before():
    """A parameter server's small gradients: reduces onto the same root merge into one
    (across a reduce onto another root in between), each with its own sums."""
    from purinec.passes.parallel.bucket import bucket

    group = (Device("cpu", 0), Device("cpu", 1))
    g = Graph("servers")
    partial = Distribution(DistKind.partial, group)
    nodes = []
    for i, server in enumerate([group[1], group[0], group[1]]):
        x = g.add_input(f"g{i}", TensorType((3 + i, 2), DType.f32), group[0], dist=partial)
        nodes.extend(convert(g, x, Distribution(DistKind.replicated, (server,)), f"use {i}"))
    whole = Distribution(DistKind.replicated, group)
    a = g.add_input("a", TensorType((64, 64), DType.f32), group[0], dist=whole)
    product = g.make_node("matmul", [a, a], names=["p"])  # the graph's work
    product.outputs[0].dist = whole
    g.nodes = [product, *nodes]
    g.set_outputs([("p", product.outputs[0])] +
                  [(f"y{i}", n.outputs[0]) for i, n in enumerate(nodes)])
    merged = bucket(g)
    verify(merged)
    assert [(n.op, n.attrs.get("root"), len(n.outputs)) for n in merged.nodes] == [
        ("matmul", None, 1), ("reduce", "cpu:0", 1), ("reduce", "cpu:1", 2)]
    from purinec.runtime.executor import Executable
    from purinec.runtime.host import host_kernels
    from purinec.runtime.plan import reference_kernels

    before, after = partition(g, 0), partition(merged, 0)
    verify(after)
    assert str(parse(str(after))) == str(after)
    rng = np.random.default_rng(0)
    env = {v.name: rng.standard_normal(v.type.shape).astype(np.float32)
           for v in before.inputs}
    want = execute(before, env)
    for got in (execute(after, env),
                Executable(after, {**reference_kernels(after), **host_kernels(after)})(
                    {k: v.copy() for k, v in env.items()})):
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].tobytes() == want[name].tobytes(), name
