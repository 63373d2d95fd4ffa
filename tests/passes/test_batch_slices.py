"""Inference batches in slices (`purinec.passes.batch_slices`): the sliced graph computes
what the whole one does, slice by slice, and is made only where it can be and pays."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import purinec
from purinec.errors import PurinecError
from purinec.compiler import lowered
from purinec.ir.graph import Graph
from purinec.ir.types import CPU0, Device, DType, TensorType
from purinec.ir.verify import verify
from purinec.passes import batch_slices
from purinec.passes.batch_slices import in_slices, slice_count
from purinec.runtime.reference import execute
from tests.mpi_scripts.common import random_net


def _random_env(graph: Graph, rng) -> dict[str, np.ndarray]:
    return {v.name: rng.standard_normal(v.type.shape).astype(v.type.dtype.numpy)
            for v in graph.inputs}


def _slice_of_each_node(graph: Graph) -> list[int]:
    """Which slice each node computes: the latest it reads (the k-th slice of a data
    input is slice k), -1 for none, found independently of the pass's own order."""
    slices_made: dict[str, int] = {}
    slice_of: dict[int, int] = {}
    result = []
    for node in graph.nodes:
        reads = [slice_of[id(v)] for v in node.inputs if id(v) in slice_of]
        if node.op == "slice" and node.inputs[0] in graph.inputs:
            k = slices_made[node.inputs[0].name] = slices_made.get(node.inputs[0].name, -1) + 1
        else:
            k = max(reads, default=-1)
        for v in node.outputs:
            slice_of[id(v)] = k
        result.append(k)
    return result


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16), slices=st.integers(2, 9))
def test_random_networks_in_slices_compute_what_the_whole_batch_does(seed, slices):
    """Convolutions, pools, joined branches, normalizations and dense layers over odd
    batches, in up to as many slices as images: the same outputs, one slice after
    another."""
    choices = random.Random(seed)
    net, alone, *_ = random_net(lambda options: choices.choice(list(options)), [CPU0],
                                "data")
    graph = lowered(alone, "inference")
    count = min(slices, graph.input("data").type.shape[0])
    sliced = in_slices(graph, count)
    if count == 1:
        assert sliced is graph
        return
    verify(sliced)
    assert sum(node.op == "slice" for node in sliced.nodes) == count
    order = _slice_of_each_node(sliced)
    assert order == sorted(order)  # slice by slice
    env = _random_env(graph, np.random.default_rng(seed))
    for name, want in execute(graph, env).items():  # (the BLAS sums in another order)
        np.testing.assert_allclose(execute(sliced, env)[name], want, rtol=1e-5,
                                   atol=1e-5 * np.abs(want).max())


def _scaled_images(batch: int = 6) -> Graph:
    """data * a per-channel factor broadcast to the batch's shape (a batch norm's)."""
    graph = Graph("scaled")
    x = graph.add_input("data", TensorType((batch, 3, 4, 4), DType.f32))
    factor = graph.add_input("factor", TensorType((1, 3, 1, 1), DType.f32), role="param")
    wide = graph.add_node("broadcast_to", [factor], {"shape": [batch, 3, 4, 4]}).outputs[0]
    graph.set_outputs([("y", graph.add_node("mul", [x, wide]).outputs[0])])
    return graph


def test_a_broadcast_is_made_at_each_slices_shape():
    """Not broadcast whole and then sliced, a copy that would no longer fuse."""
    graph = _scaled_images()
    sliced = in_slices(graph, 3)
    broadcasts = [node for node in sliced.nodes if node.op == "broadcast_to"]
    assert [node.attrs["shape"] for node in broadcasts] == [[2, 3, 4, 4]] * 3
    assert all(node.inputs[0] in sliced.inputs for node in sliced.nodes if node.op == "slice")
    env = _random_env(graph, np.random.default_rng(0))
    np.testing.assert_array_equal(execute(sliced, env)["y"], execute(graph, env)["y"])


def test_graphs_that_cannot_be_cut_are_left_whole():
    graph = _scaled_images()
    assert in_slices(graph, 1) is graph
    summed = _scaled_images()  # an output over the whole batch: a loss's sum
    total = summed.add_node("reduce_sum", [summed.output("y")], {"axes": [0, 1, 2, 3]})
    summed.set_outputs([("total", total.outputs[0])])
    assert in_slices(summed, 2) is summed
    placed = _scaled_images()  # laid out over two devices
    placed.output("y").device = Device("cpu", 1)
    assert in_slices(placed, 2) is placed


def _pointwise(channels: int, filters: int, size: int, batch: int = 8) -> Graph:
    """A 1x1 convolution of ``channels`` to ``filters`` channels of ``size`` squared."""
    graph = Graph("pointwise")
    x = graph.add_input("data", TensorType((batch, channels, size, size), DType.f32))
    w = graph.add_input("w", TensorType((filters, channels, 1, 1), DType.f32), role="param")
    graph.set_outputs([("y", graph.add_node("conv2d", [x, w]).outputs[0])])
    return graph


def test_slices_are_as_many_as_the_budget_needs_and_only_where_they_pay():
    few_weights = _pointwise(4, 64, 64)  # 1 MB of output an image, 1 KB of weights
    image = 64 * 64 * 64 * 4
    assert slice_count(few_weights, 2 * image) == 4
    assert slice_count(few_weights, 3 * image) == 3  # slices of 3, 3 and 2
    assert slice_count(few_weights, 8 * image) == 1  # the batch fits
    assert slice_count(few_weights, 0) == 1  # never
    # 2 GFLOP a batch for 1 MB of traffic an image: slices would save little time
    compute_bound = _pointwise(1024, 1024, 4)
    assert slice_count(compute_bound, 1024 * 16 * 4) == 1


def test_the_slices_budget_is_two_fifths_of_the_cache_unless_set(monkeypatch):
    from purinec.codegen import cpu_runtime

    monkeypatch.delenv("PURINEC_SLICE_BYTES", raising=False)
    assert cpu_runtime.slice_budget() == cpu_runtime.last_level_cache() * 2 // 5 > 0
    monkeypatch.setenv("PURINEC_SLICE_BYTES", "0")
    assert cpu_runtime.slice_budget() == 0
    monkeypatch.setenv("PURINEC_SLICE_BYTES", "12MB")
    with pytest.raises(PurinecError, match="PURINEC_SLICE_BYTES='12MB': give a number of "
                                           "bytes"):
        cpu_runtime.slice_budget()


@pytest.mark.slow  # compiles kernels
def test_the_cpu_target_runs_an_inference_batch_in_slices(monkeypatch, tmp_path):
    """The ``slices`` stage under `PURINEC_SLICE_BYTES`: the program's results are the
    whole batch's, and its artifact keeps the slices."""
    feeds = {"data": np.random.default_rng(1).random((6, 3, 32, 32), dtype=np.float32)}
    monkeypatch.setenv("PURINEC_SLICE_BYTES", "0")
    whole = purinec.compile("cifar_quick", target="cpu", batch=6)
    monkeypatch.setenv("PURINEC_SLICE_BYTES", str(2 * 32 * 32 * 32 * 4))  # 2 images
    monkeypatch.setattr(batch_slices, "WORTH_IT", float("inf"))  # (it is compute-bound)
    sliced = purinec.compile("cifar_quick", target="cpu", batch=6)
    assert [node.op for node in sliced.ir.nodes].count("slice") == 3
    assert "slice" not in [node.op for node in whole.ir.nodes]
    for name, array in whole.params.items():
        sliced.params[name] = array
    want = whole.run(feeds)["logits"]
    np.testing.assert_allclose(sliced.run(feeds)["logits"], want, rtol=1e-5, atol=1e-6)
    sliced.save(tmp_path / "sliced.purine")
    loaded = purinec.load(tmp_path / "sliced.purine")
    np.testing.assert_allclose(loaded.run(feeds)["logits"], want, rtol=1e-5, atol=1e-6)
