"""Pixel-major convolutions: the cpu target's conv2d_panels (weights in panels of
filters) and the pass that picks them (`purinec.codegen.cpu_layout`)."""

from __future__ import annotations

import numpy as np
import pytest

import purinec
from purinec.codegen import cpu
from purinec.codegen.cpu_gemm import VW
from purinec.codegen.cpu_layout import filters_in_panels, panel_width
from purinec.codegen.cpu_module import CpuOptions
from purinec.errors import PurinecError
from purinec.ir.graph import Graph
from purinec.ir.nnref import conv2d as reference_conv2d
from purinec.ir.types import DType, TensorType
from tests.codegen.test_codegen_cpu import check, one_node, random_array

TILED = CpuOptions(tiled_gemm=True, direct_max_channels=0)
TILED_BLOCKED = CpuOptions(tiled_gemm=True, direct_max_channels=0, parallel_min=0,
                           parallel_min_products=0)
BLAS = CpuOptions(tiled_gemm=False)


def in_panels(w: np.ndarray, width: int = 64) -> np.ndarray:
    """An OIHW weight as conv2d_panels reads it, rearranged independently of the pass."""
    return np.ascontiguousarray(np.stack([w[j:j + width].transpose(1, 2, 3, 0)
                                          for j in range(0, w.shape[0], width)]))


CASES = {  # x shape, filters, kernel, attrs[, panel width]
    "3x3-7x7": ((1, 24, 7, 7), 128, 3, {"stride": [1, 1], "pad": [1, 1]}),
    "narrow-panels": ((1, 16, 7, 7), 96, 3, {"stride": [1, 1], "pad": [1, 1]}, 48),
    "3x3-stride-2": ((2, 16, 14, 13), 64, 3, {"stride": [2, 2], "pad": [1, 1]}),
    "1x1-7x7": ((3, 40, 7, 7), 192, 1, {"stride": [1, 1], "pad": [0, 0]}),
    "1x1-stride-2": ((1, 32, 13, 14), 64, 1, {"stride": [2, 2], "pad": [0, 0]}),
    "dilated-uneven-pad": ((2, 16, 9, 8), 128, 3, {"stride": [1, 2], "pad": [2, 1, 0, 2],
                                                   "dilation": [2, 1]}),
    "many-rows": ((5, 16, 20, 6), 64, 3, {"stride": [1, 1], "pad": [1, 1]}),
}


@pytest.mark.slow  # a Numba compile per case
@pytest.mark.parametrize("options", [TILED, TILED_BLOCKED, BLAS], ids=["whole", "blocked",
                                                                       "blas"])
@pytest.mark.parametrize("case", list(CASES))
def test_panel_convolutions_agree_with_conv2d(case, options):
    """conv2d_panels computes what conv2d computes of the same weights, for strides,
    padding, dilation, 1x1 kernels read in place, blocks of filters that cut panels
    (few rows) and blocks of rows (many), panels of any width; its kernel reads the
    image at offsets, with purinec's GEMM wherever the others use the BLAS."""
    x_shape, filters, k, attrs, *width = CASES[case]
    rng = np.random.default_rng(len(case))
    attrs = {"groups": 1, "dilation": [1, 1], **attrs}
    x = random_array(rng, x_shape, DType.f32)
    w = random_array(rng, (filters, x_shape[1], k, k), DType.f32)
    panels = in_panels(w, *width)
    source = cpu.render(one_node("conv2d_panels", [x, panels], attrs), options)
    assert ", taps, " in source and "sgemm(101" not in source
    (want,) = reference_conv2d(x, w, **attrs)
    (theirs,) = purinec.ir.ops.REGISTRY["conv2d_panels"].reference(x, panels, **attrs)
    np.testing.assert_allclose(theirs, want, rtol=1e-5, atol=1e-5)
    check("conv2d_panels", [x, panels], attrs, options)


def test_panel_convolutions_refuse_what_they_cannot_compute():
    x = np.zeros((1, 16, 7, 7), np.float32)
    attrs = {"stride": [1, 1], "pad": [1, 1], "groups": 1}
    with pytest.raises(PurinecError, match="groups must be 1, got 2"):
        one_node("conv2d_panels", [x, np.zeros((1, 8, 3, 3, 64), np.float32)],
                 {**attrs, "groups": 2})
    with pytest.raises(PurinecError, match="weight must have rank 5"):
        one_node("conv2d_panels", [x, np.zeros((64, 16, 3, 3), np.float32)], attrs)
    wide = one_node("conv2d_panels", [x.astype(np.float64),
                                      np.zeros((1, 16, 3, 3, 64), np.float64)], attrs)
    with pytest.raises(PurinecError, match="f32 only, not f64"):
        cpu.render(wide, TILED)


def net(filters: int = 128, channels: int = 32, size: int = 7, groups: int = 1) -> Graph:
    """x -> conv 3x3 -> bias -> relu -> + x's conv 1x1 (a residual sum) -> output."""
    g = Graph("net")
    x = g.add_input("x", TensorType((2, channels, size, size), DType.f32), role="data")
    w = g.add_input("w", TensorType((filters, channels // groups, 3, 3), DType.f32),
                    role="param", init="gaussian(0.1)")
    b = g.add_input("b", TensorType((filters,), DType.f32), role="param", init="gaussian(0.1)")
    v = g.add_input("v", TensorType((filters, channels, 1, 1), DType.f32), role="param",
                    init="gaussian(0.1)")
    y = g.add_node("conv2d", [x, w], {"pad": [1, 1], "groups": groups}).outputs[0]
    y = g.add_node("relu", [g.add_node("bias_add", [y, b], {"axis": 1}).outputs[0]]).outputs[0]
    side = g.add_node("conv2d", [x, v]).outputs[0]
    g.set_outputs([("y", g.add_node("add", [y, side]).outputs[0])])
    return g


def converted(graph: Graph) -> list[str]:
    return [node.op for node in filters_in_panels(graph).nodes if node.op.startswith("conv")]


def test_the_pass_picks_small_maps_of_whole_panels_in_inference_graphs(monkeypatch):
    monkeypatch.setenv("PURINEC_CPU_GEMM", "tiled")
    assert converted(net()) == ["conv2d_panels", "conv2d_panels"]
    assert converted(net(filters=112)) == ["conv2d", "conv2d"]  # no panel width divides
    assert [panel_width(n) for n in (512, 160, 96, 112, 64)] == [64, 80, 48, None, None]
    # 56x56: the 1x1 product's pixels fill the lanes; the 3x3 one's planes waste a few
    # (with AVX-512's tiles, enough)
    assert converted(net(size=56)) == ["conv2d_panels" if VW == 16 else "conv2d", "conv2d"]
    assert converted(net(channels=8)) == ["conv2d", "conv2d"]  # few taps
    assert converted(net(groups=2)) == ["conv2d", "conv2d_panels"]
    monkeypatch.setenv("PURINEC_CPU_GEMM", "blas")
    assert converted(net()) == ["conv2d", "conv2d"]


def test_the_pass_leaves_training_iterations_alone(monkeypatch):
    monkeypatch.setenv("PURINEC_CPU_GEMM", "tiled")
    graph = net()
    graph.set_outputs([*graph.outputs, ("w", graph.add_node("scale", [graph.inputs[1]],
                                                            {"alpha": 0.5}).outputs[0])])
    assert converted(graph) == ["conv2d", "conv2d"]


@pytest.mark.slow  # compiles a program
def test_programs_of_panel_convolutions_follow_their_weights(monkeypatch):
    """An inference program computes its convolutions pixel-major from weights
    rearranged once; after an assignment it rearranges them again: each run equal to
    the reference target's."""
    monkeypatch.setenv("PURINEC_CPU_GEMM", "tiled")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 32, 7, 7)).astype(np.float32)
    with purinec.compile(net(), target="cpu") as program, \
            purinec.compile(net(), target="reference") as reference:
        anchors = [n.body[0] if n.body else n for n in program.ir.nodes]
        assert [n.op for n in anchors].count("conv2d_panels") == 2
        for _ in range(2):
            for name in ("w", "v"):
                program.params[name] = reference.params[name] = rng.standard_normal(
                    program.params[name].shape).astype(np.float32)
            for _ in range(2):
                np.testing.assert_allclose(program.run({"x": x})["y"],
                                           reference.run({"x": x})["y"], rtol=1e-4,
                                           atol=1e-4)


@pytest.mark.slow  # compiles a program, then loads it
def test_artifacts_keep_panel_convolutions(tmp_path, monkeypatch):
    """A saved inference program holds its conv2d_panels and the nodes rearranging the
    weights, not the rearranged weights; loaded, it runs as it did."""
    monkeypatch.setenv("PURINEC_CPU_GEMM", "tiled")
    x = np.random.default_rng(6).standard_normal((2, 32, 7, 7)).astype(np.float32)
    with purinec.compile(net(), target="cpu") as program:
        want = program.run({"x": x})["y"]
        program.save(tmp_path / "net.purine")
    with purinec.load(tmp_path / "net.purine") as loaded:
        assert sorted(loaded.params) == ["b", "v", "w"]
        assert "conv2d_panels" in str(loaded.ir)
        np.testing.assert_array_equal(loaded.run({"x": x})["y"], want)
