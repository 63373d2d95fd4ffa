"""Sizes: element counts that never wrap, fillers that draw in the tensor's own dtype, and
a memory limit checked before anything user-sized is allocated."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import purinec
from purinec.errors import MemoryLimitError, PurinecError, VerifyError
from purinec.ir.graph import Graph
from purinec.ir.init import initial_value
from purinec.ir.parser import parse
from purinec.ir.types import DType, TensorType
from purinec.runtime.memory import LIMIT_VARIABLE, memory_limit

F32, F64 = DType.f32, DType.f64


def test_sizes_are_exact():
    huge = TensorType((2**32, 2**32), F32)
    assert huge.size == 2**64 and huge.nbytes == 2**66  # not wrapped around to 0


@pytest.mark.parametrize("spec", ["gaussian(0.5)", "uniform(2)", "xavier", "msra"])
@pytest.mark.parametrize("dtype", [F32, F64])
def test_fillers_draw_in_the_tensors_dtype_reproducibly(spec, dtype):
    ty = TensorType((1000, 1000), dtype)
    tracemalloc.start()
    try:
        a = initial_value(spec, ty, np.random.default_rng(7))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert a.dtype == dtype.numpy and a.shape == ty.shape
    assert peak < 1.25 * ty.nbytes  # no float64 copy of a float32 tensor on the way
    assert np.isfinite(a).all() and a.std() > 0
    np.testing.assert_array_equal(a, initial_value(spec, ty, np.random.default_rng(7)))
    assert not np.array_equal(a, initial_value(spec, ty, np.random.default_rng(8)))


def test_a_huge_scale_gives_inf_draws_not_a_warning():
    a = initial_value("gaussian(3e38)", TensorType((1000,), F32), np.random.default_rng(0))
    assert np.isinf(a).any() and not np.isnan(a).any()


@pytest.mark.parametrize("setting, limit", [("1000", 1000), ("64M", 64 * 2**20),
                                            ("8G", 8 * 2**30), ("2 TiB", 2 * 2**40),
                                            ("3k", 3 * 1024)])
def test_the_memory_limit_can_be_set(monkeypatch, setting, limit):
    monkeypatch.setenv(LIMIT_VARIABLE, setting)
    bytes_, says = memory_limit()
    assert bytes_ == limit and f"({LIMIT_VARIABLE}={setting})" in says


def test_a_memory_limit_that_is_not_a_size_is_refused(monkeypatch):
    monkeypatch.setenv(LIMIT_VARIABLE, "lots")
    with pytest.raises(PurinecError, match=r"PURINEC_MEMORY_LIMIT='lots' is not a size"):
        memory_limit()


def _param_graph(shape) -> Graph:
    text = (f"graph big(%x: f32[2] @cpu:0, %w: f32[{','.join(map(str, shape))}] @cpu:0 "
            f"{{param, init=\"gaussian(1)\"}}) {{\n  return %x\n}}")
    return parse(text, verify=True)


def test_a_parameter_beyond_the_machines_memory_is_refused_before_it_is_drawn(monkeypatch):
    monkeypatch.delenv(LIMIT_VARIABLE, raising=False)
    with pytest.raises(MemoryLimitError) as info:
        purinec.compile(_param_graph([2**48]), target="reference")  # 1 PiB
    message = str(info.value)
    assert "the inputs of graph big (parameters, state and one batch of data)" in message
    assert "would take 1.0 PiB (the largest, %w: f32[281474976710656], 1.0 PiB)" in message
    assert "this machine has" in message and LIMIT_VARIABLE in message


def test_the_limit_applies_to_weights_data_and_the_values_a_run_keeps(monkeypatch):
    monkeypatch.setenv(LIMIT_VARIABLE, "1G")
    with pytest.raises(MemoryLimitError, match=r"8.0 GiB .*%w: f32\[2,1073741824\].*"
                                               r"the limit is 1.0 GiB \(PURINEC_MEMORY_LIMIT"):
        purinec.compile(_param_graph([2, 2**30]), target="reference")
    data = ("graph g(%x: f32[65536,65536] @cpu:0) {\n  %y = relu(%x) : f32[65536,65536] "
            "@cpu:0\n  return %y\n}")
    with pytest.raises(MemoryLimitError, match=r"inputs of graph g .* 16.0 GiB"):
        purinec.compile(parse(data, verify=True), target="reference")
    made = ("graph g(%x: f32[2] @cpu:0) {\n  %y = fill() {shape=[8192,65536]} : "
            "f32[8192,65536] @cpu:0\n  return %y\n}")
    with pytest.raises(MemoryLimitError, match=r"the values of graph g \(the reference target "
                                               r"keeps each until the run ends\) would take "
                                               r"2.0 GiB \(the largest, %y"):
        purinec.compile(parse(made, verify=True), target="reference")


def test_a_tensor_of_two_to_the_64_elements_is_refused_where_it_is_written():
    text = "graph g(%x: f32[4294967296,4294967296] @cpu:0) {\n  return %x\n}"
    with pytest.raises(PurinecError, match=r"^g\.pir:1:13: a f32 tensor of this shape has "
                                           r"more than 2\*\*56 elements"):
        parse(text, source="g.pir")
    graph = parse("graph g(%x: f32[2] @cpu:0) {\n  return %x\n}")
    graph.inputs[0].type = TensorType((2**32, 2**32), F32)  # as Python can build it
    with pytest.raises(VerifyError, match="more than 2\\*\\*56 elements"):
        purinec.compile(graph, target="reference")
