"""The cuda target's collectives among one process's GPUs as copies and kernels
(`purinec.passes.parallel.local`): every conversion and every strategy computes the
very same bytes as the host's collectives, and nothing is left for the host."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import purinec
from purinec.compiler import build_graph, checked_layout, load_source
from purinec.ir.graph import Graph
from purinec.ir.ops import Trait, op_has
from purinec.ir.parser import parse
from purinec.ir.types import Device, DistKind, Distribution
from purinec.ir.verify import verify
from purinec.passes.parallel import partition
from purinec.passes.parallel.local import lower_local_collectives
from purinec.runtime.reference import execute
from purinec.targets import get_target
from tests.passes.test_parallel import KINDS, _boxed, _dist

def _host_work(graph: Graph) -> list[str]:
    """Host nodes other than copies between devices."""
    return [f"{node.op} %{node.name}" for node in graph.nodes
            if op_has(node.op, Trait.host) and node.op != "copy"]


def _same_bytes(before: Graph, after: Graph, rng) -> None:
    env = {v.name: rng.standard_normal(v.type.shape).astype(v.type.dtype.numpy)
           for v in before.inputs}
    want, got = execute(before, env), execute(after, env)
    assert want.keys() == got.keys()
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name


def _conversion(src: Distribution, dst: Distribution) -> Graph:
    return partition(_boxed(src, dst, (7, 5)), 0)


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("src,dst", [(s, d) for s, d in itertools.product(KINDS, KINDS)
                                     if d[0] != "P" or s[0] == "P"])
def test_every_conversion_among_gpus_moves_the_same_bytes_without_the_host(src, dst, devices):
    group = tuple(Device("gpu", i) for i in range(devices))
    physical = _conversion(_dist(*src, group), _dist(*dst, group))
    lowered = lower_local_collectives(physical)
    verify(lowered)
    assert str(parse(str(lowered))) == str(lowered)
    assert not _host_work(lowered), _host_work(lowered)
    _same_bytes(physical, lowered, np.random.default_rng(devices))


@pytest.mark.parametrize("src,dst", [
    ("P", "B@0"),  # reduce onto a server
    ("B@0", "B"),  # broadcast from it
    ("S1", "B@2"),  # pieces gathered onto it
])
def test_a_parameter_servers_conversions_among_gpus_move_the_same_bytes(src, dst):
    group = tuple(Device("gpu", i) for i in range(3))

    def dist(text):
        if "@" in text:
            return Distribution(DistKind.replicated, (group[int(text[-1])],))
        return _dist(text[0], int(text[1:]) if text[1:] else None, group)
    physical = _conversion(dist(src), dist(dst))
    assert _host_work(physical)  # (what the pass takes away)
    lowered = lower_local_collectives(physical)
    verify(lowered)
    assert not _host_work(lowered), _host_work(lowered)
    _same_bytes(physical, lowered, np.random.default_rng(3))


BUCKET = """graph b(%a0: f32[3] @gpu:0, %c0: f32[2,2] @gpu:0, %a1: f32[3] @gpu:1,
                    %c1: f32[2,2] @gpu:1) {
  %sa0, %sc0, %sa1, %sc1 = allreduce(%a0, %c0, %a1, %c1) {group="gpu:0,gpu:1", tensors=2} : f32[3] @gpu:0, f32[2,2] @gpu:0, f32[3] @gpu:1, f32[2,2] @gpu:1
  return %sa0, %sc0, %sa1, %sc1
}"""


def test_a_buckets_tensors_are_summed_on_the_members_in_turn():
    graph = parse(BUCKET)
    lowered = lower_local_collectives(graph)
    verify(lowered)
    sums = [node for node in lowered.nodes if node.op == "add"]
    assert [node.device for node in sums] == [Device("gpu", 0), Device("gpu", 1)]
    assert [node.outputs[0].name for node in sums] == ["sa0", "sc1"]
    _same_bytes(graph, lowered, np.random.default_rng(0))


def test_collectives_over_ranks_or_cpus_stay_for_the_host():
    over_ranks = parse(BUCKET.replace("gpu:1", "r1/gpu:0"))
    on_cpus = parse(BUCKET.replace("gpu", "cpu"))
    for graph in (over_ranks, on_cpus):
        assert str(lower_local_collectives(graph)) == str(graph)


@pytest.mark.parametrize("strategy", ["data", "ps", "model", "hybrid", "pipeline"])
def test_every_strategys_training_step_on_gpus_computes_the_same_bytes(strategy):
    """The cuda target's physical graph of a training step (fused, as it runs) against
    the same graph before the pass, both run by the reference ops: every output (the
    loss, every replica's new weights) the same bytes; no host work but copies."""
    spread = checked_layout("cuda", "gpu:0,gpu:1", strategy)
    sgd = purinec.SGD(lr=0.1, momentum=0.9, weight_decay=1e-3)
    logical = build_graph(load_source("mlp", 8), sgd, target="cuda", parallel=spread)
    stages = {}
    final = get_target("cuda").pipeline(sgd, spread).run_physical(
        logical, lambda name, graph: stages.setdefault(name, graph))
    before = stages["on_gpus"]
    assert _host_work(before)
    assert not _host_work(final), _host_work(final)
    rng = np.random.default_rng(5)
    env = {}
    for value in before.inputs:
        if value.type.dtype.is_float:
            env[value.name] = rng.standard_normal(value.type.shape).astype(np.float32)
        else:
            env[value.name] = rng.integers(0, 10, value.type.shape).astype(
                value.type.dtype.numpy)
    want, got = execute(before, env), execute(final, env)
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name
