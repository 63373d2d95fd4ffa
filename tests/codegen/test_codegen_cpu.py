"""Every CPU kernel against its op's NumPy reference, on random shapes and values.

Numba compiles one kernel per distinct node (shapes and attributes are baked in), so
the strategies draw from few small sizes: examples repeat nodes and reuse kernels that
are already compiled, which keeps this file to a few hundred compilations. Kernels are
also checked *blocked* (`BLOCKED`: both thresholds 0 split every splittable loop) on three
threads, the way big kernels run.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from numba import njit
from numba.core.errors import TypingError

from purinec.codegen import CodegenError, cpu, cpu_conv
from purinec.codegen.cpu_module import RENDERERS, CpuOptions, KernelModule
from purinec.codegen.cpu_runtime import Blocked, copy_run, empty, opaque, set_threads, view
from purinec.errors import ShapeError
from purinec.ir import nnref
from purinec.ir.graph import Graph, Node, external_inputs
from purinec.ir.ops import REGISTRY, conv_output_size
from purinec.ir.types import DType, TensorType

SETTINGS = settings(max_examples=6, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])
FEW = settings(SETTINGS, max_examples=4)
BLOCKED = CpuOptions(parallel_min=0, parallel_min_products=0)
OPTIONS = [CpuOptions(), BLOCKED]
GEMMS = CpuOptions(parallel_min=0, parallel_min_products=0,
                   direct_max_channels=0)  # no direct convolutions
VECTOR_CODE = CpuOptions(tiled_gemm=True)  # purinec's own vector code, whatever the CPU
FLOATS = [DType.f32, DType.f64]


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path_factory, monkeypatch):
    """Kernels go to one temporary cache for the whole module, never to ~/.cache."""
    monkeypatch.setenv("PURINEC_CACHE_DIR", str(_cache_dir(tmp_path_factory)))
    set_threads(3)  # more blocks than cores: blocked kernels really split
    yield
    set_threads(2)


_CACHE: list = []


def _cache_dir(factory):
    if not _CACHE:
        _CACHE.append(factory.mktemp("kernels"))
    return _CACHE[0]


# ---------------------------------------------------------------------------------------
# Helpers.


def random_array(rng, shape, dtype: DType, low=-2.0, high=2.0) -> np.ndarray:
    if dtype.is_float:
        return rng.uniform(low, high, shape).astype(dtype.numpy)
    if dtype is DType.bool:
        return rng.integers(0, 2, shape).astype(bool)
    return rng.integers(-50, 50, shape).astype(dtype.numpy)


def one_node(op: str, inputs: list[np.ndarray], attrs: dict | None = None) -> Node:
    graph = Graph("t")
    values = [graph.add_input(f"in{i}", TensorType(a.shape, DType.from_numpy(a.dtype)))
              for i, a in enumerate(inputs)]
    return graph.add_node(op, values, attrs or {})


def run_kernel(node: Node, inputs: list[np.ndarray], options=CpuOptions()) -> list[np.ndarray]:
    """Run the node's kernel on outputs filled with garbage (it must overwrite all)."""
    kernel = cpu.compile_node(node, options)
    outputs = [np.full(v.type.shape, 7, v.type.dtype.numpy) for v in node.outputs]
    for out in outputs:
        if out.dtype.kind == "f":
            out[...] = np.nan
    kernel.fn(*inputs, *outputs)
    return outputs


def reference(node: Node, inputs: list[np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(r) for r in REGISTRY[node.op].reference(*inputs, **node.attrs)]


def check(op: str, inputs: list[np.ndarray], attrs: dict | None = None, options=CpuOptions(),
          exact: bool = False) -> None:
    node = one_node(op, inputs, attrs)
    got = run_kernel(node, inputs, options)
    want = reference(node, inputs)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        if exact or g.dtype.kind not in "f":
            np.testing.assert_array_equal(g, w)
        else:
            tol = 2e-5 if g.dtype == np.float32 else 1e-12
            scale = max(1.0, float(np.abs(w).max(initial=0)))
            np.testing.assert_allclose(g, w, rtol=tol * 10, atol=tol * scale * 10)


def shapes(max_rank=4, sizes=(1, 2, 3, 5)):
    return st.lists(st.sampled_from(sizes), min_size=0, max_size=max_rank).map(tuple)


seeds = st.integers(0, 2**32 - 1)

# ---------------------------------------------------------------------------------------
# Elementwise and broadcast ops.


@SETTINGS
@given(op=st.sampled_from(["relu", "sigmoid", "tanh", "scale", "add_scalar"]),
       shape=shapes(), dtype=st.sampled_from(FLOATS), seed=seeds,
       options=st.sampled_from(OPTIONS))
def test_unary(op, shape, dtype, seed, options):
    attrs = {"scale": {"alpha": -1.5}, "add_scalar": {"value": 0.25}}.get(op, {})
    check(op, [random_array(np.random.default_rng(seed), shape, dtype)], attrs, options)


@FEW
@given(dtype=st.sampled_from([DType.i32, DType.i64, DType.bool]), shape=shapes(), seed=seeds)
def test_add_scalar_on_integers_and_bools(dtype, shape, seed):
    check("add_scalar", [random_array(np.random.default_rng(seed), shape, dtype)],
          {"value": 1.0})


@SETTINGS
@given(src=st.sampled_from(list(DType)), dst=st.sampled_from(list(DType)), shape=shapes(3),
       seed=seeds)
def test_cast(src, dst, shape, seed):
    x = random_array(np.random.default_rng(seed), shape, src, -100, 100)
    check("cast", [x], {"dtype": dst.value})


@SETTINGS
@given(op=st.sampled_from(["add", "sub", "mul", "relu_grad", "sigmoid_grad", "tanh_grad"]),
       shape=shapes(), dtype=st.sampled_from(FLOATS), seed=seeds,
       options=st.sampled_from(OPTIONS))
def test_binary(op, shape, dtype, seed, options):
    rng = np.random.default_rng(seed)
    check(op, [random_array(rng, shape, dtype), random_array(rng, shape, dtype)], {}, options)


# ONNX's arithmetic and activations and their gradients: op -> (attrs, the range of its
# inputs), log, sqrt and pow on positive inputs, the kinked ones across their kinks.
ONNX_ELEMENTWISE = {
    "neg": ({}, (-2, 2)), "exp": ({}, (-2, 2)), "log": ({}, (0.1, 3)),
    "sqrt": ({}, (0.1, 3)), "abs": ({}, (-2, 2)), "erf": ({}, (-2, 2)),
    "leaky_relu": ({"alpha": 0.1}, (-2, 2)), "clip": ({"min": -0.5, "max": 1.0}, (-2, 2)),
    "hard_sigmoid": ({"alpha": 0.3, "beta": 0.4}, (-4, 4)), "hard_swish": ({}, (-5, 5)),
    "div": ({}, (0.5, 2)), "pow": ({}, (0.1, 2)), "div_grad_b": ({}, (0.5, 2)),
    "pow_grad_a": ({}, (0.1, 2)), "pow_grad_b": ({}, (0.1, 2)), "sqrt_grad": ({}, (0.1, 3)),
    "abs_grad": ({}, (-2, 2)), "erf_grad": ({}, (-2, 2)),
    "leaky_relu_grad": ({"alpha": 0.1}, (-2, 2)),
    "clip_grad": ({"min": -0.5, "max": 1.0}, (-2, 2)),
    "hard_sigmoid_grad": ({"alpha": 0.3, "beta": 0.4}, (-4, 4)),
    "hard_swish_grad": ({}, (-5, 5)),
}


@pytest.mark.parametrize("op", sorted(ONNX_ELEMENTWISE))
@settings(SETTINGS, max_examples=2)
@given(shape=shapes(), dtype=st.sampled_from(FLOATS), seed=seeds,
       options=st.sampled_from(OPTIONS))
def test_onnx_elementwise(op, shape, dtype, seed, options):
    attrs, (low, high) = ONNX_ELEMENTWISE[op]
    rng = np.random.default_rng(seed)
    inputs = [random_array(rng, shape, dtype, low, high) for _ in REGISTRY[op].inputs]
    check(op, inputs, attrs, options)


def test_clip_takes_infinite_bounds_and_passes_nan_through():
    x = np.array([-np.inf, -3.0, np.nan, 0.25, 2.0, np.inf], np.float32)
    check("clip", [x], {"min": -np.inf, "max": 1.0}, exact=True)
    check("clip", [x], {"min": -1.0, "max": np.inf}, exact=True)
    check("clip_grad", [x, np.ones_like(x)], {"min": -1.0, "max": 2.0}, exact=True)


@SETTINGS
@given(shape=shapes(4).filter(len), dtype=st.sampled_from(FLOATS), data=st.data(),
       options=st.sampled_from(OPTIONS))
def test_bias_add(shape, dtype, data, options):
    axis = data.draw(st.integers(0, len(shape) - 1))
    rng = np.random.default_rng(data.draw(seeds))
    check("bias_add", [random_array(rng, shape, dtype),
                       random_array(rng, (shape[axis],), dtype)], {"axis": axis}, options)


@SETTINGS
@given(target=shapes(4).filter(len), data=st.data(), dtype=st.sampled_from(FLOATS))
def test_broadcast_to(target, data, dtype):
    # (not to shape []: the reference's np.ascontiguousarray turns a 0-d result 1-d)
    keep = data.draw(st.integers(0, len(target)))
    source = tuple(d if data.draw(st.booleans()) else 1 for d in target[len(target) - keep:])
    x = random_array(np.random.default_rng(data.draw(seeds)), source, dtype)
    check("broadcast_to", [x], {"shape": list(target)})


@FEW
@given(shape=st.sampled_from([(2, 3, 1, 1), (1, 4, 1, 1), (3, 2, 1, 1)]),
       hw=st.sampled_from([(1, 1), (2, 3), (4, 4)]), dtype=st.sampled_from(FLOATS),
       seed=seeds)
def test_global_avg_pool_grad(shape, hw, dtype, seed):
    gy = random_array(np.random.default_rng(seed), shape, dtype)
    check("global_avg_pool_grad", [gy], {"input_shape": [*shape[:2], *hw]})


@FEW
@given(shape=shapes(3), dtype=st.sampled_from(list(DType)), value=st.sampled_from([0.0, 1.5, -3.0]))
def test_fill(shape, dtype, value):
    check("fill", [], {"shape": list(shape), "dtype": dtype.value, "value": value})


@SETTINGS
@given(shape=shapes(3, sizes=(1, 3, 7, 64)), p=st.sampled_from([0.0, 0.1, 0.5, 0.9]),
       seed=st.integers(-2**63, 2**63 - 1), iteration=st.integers(-2**31, 2**31 - 1),
       dtype=st.sampled_from(["f32", "f64"]), counter=st.sampled_from(["i32", "i64"]))
def test_dropout_mask_is_bitwise_the_reference(shape, p, seed, iteration, dtype, counter):
    it = np.array(iteration, DType(counter).numpy)
    attrs = {"shape": list(shape), "p": p, "seed": seed, "dtype": dtype}
    check("dropout_mask", [it], attrs, exact=True)


def test_dropout_mask_changes_with_the_iteration_and_keeps_the_rate():
    attrs = {"shape": [4096], "p": 0.3, "seed": 7, "dtype": "f32"}
    node = one_node("dropout_mask", [np.array(0, np.int64)], attrs)
    masks = [run_kernel(node, [np.array(i, np.int64)])[0] for i in range(3)]
    assert not np.array_equal(masks[0], masks[1])
    assert abs((masks[2] == 0).mean() - 0.3) < 0.03
    assert set(np.unique(masks[0])) == {np.float32(0), np.float32(1 / 0.7)}


@SETTINGS
@given(shape=shapes(3).filter(len), dtype=st.sampled_from(FLOATS), seed=seeds,
       options=st.sampled_from(OPTIONS))
def test_sgd(shape, dtype, seed, options):
    rng = np.random.default_rng(seed)
    args = [random_array(rng, shape, dtype) for _ in range(3)]
    check("sgd", args, {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}, options)


@pytest.mark.parametrize("options", OPTIONS)
def test_sgd_updates_weight_and_history_in_place(options):
    rng = np.random.default_rng(0)
    w, h, g = (random_array(rng, (64, 513), DType.f32) for _ in range(3))
    node = one_node("sgd", [w, h, g], {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3})
    want = reference(node, [w, h, g])
    cpu.compile_node(node, options).fn(w, h, g, w, h)  # outputs are the inputs
    np.testing.assert_array_equal(w, want[0])
    np.testing.assert_array_equal(h, want[1])


@pytest.mark.slow  # a Numba compile per case
@pytest.mark.parametrize("op", ["relu", "sigmoid", "scale", "add", "relu_grad", "bias_add",
                                "cast"])
@pytest.mark.parametrize("options", OPTIONS)
def test_elementwise_output_may_alias_its_input(op, options):
    """Writing into an input gives what writing into a fresh array gives."""
    rng = np.random.default_rng(1)
    x = random_array(rng, (4, 3, 33), DType.f32)
    other = {"add": x + 1, "relu_grad": random_array(rng, (4, 3, 33), DType.f32),
             "bias_add": random_array(rng, (3,), DType.f32)}.get(op)
    inputs = [x] if other is None else [x, other]
    attrs = {"scale": {"alpha": 3.0}, "cast": {"dtype": "f32"}}.get(op, {})
    node = one_node(op, inputs, attrs)
    (fresh,) = run_kernel(node, inputs, options)
    np.testing.assert_allclose(fresh, reference(node, inputs)[0], rtol=1e-6)
    reused = other if op == "relu_grad" else x  # the gradient is what a planner reuses
    cpu.compile_node(node, options).fn(*inputs, reused)
    np.testing.assert_array_equal(reused, fresh)


# ---------------------------------------------------------------------------------------
# Reductions and data movement.


@SETTINGS
@given(shape=shapes(4), data=st.data(), dtype=st.sampled_from([*FLOATS, DType.i32]),
       keepdims=st.booleans(), options=st.sampled_from(OPTIONS))
def test_reduce_sum(shape, data, dtype, keepdims, options):
    axes = data.draw(st.lists(st.integers(0, max(len(shape) - 1, 0)), unique=True,
                              max_size=len(shape)))
    x = random_array(np.random.default_rng(data.draw(seeds)), shape, dtype)
    check("reduce_sum", [x], {"axes": axes, "keepdims": keepdims}, options)


@pytest.mark.slow  # a Numba compile per case
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("dtype", [DType.f32, DType.i32])
@pytest.mark.parametrize("shape, axes", [((9, 70), [0]), ((3, 9, 70), [1]),
                                         ((2, 3, 4, 70), [1, 2])])
def test_sums_down_columns_add_whole_rows(shape, axes, dtype, options):
    """A sum whose innermost axis is kept (a fully connected layer's bias gradient)
    adds rows into a row of sums; blocked, over the outer axis or over columns."""
    x = random_array(np.random.default_rng(3), shape, dtype)
    node = one_node("reduce_sum", [x], {"axes": axes})
    assert "total[" in cpu.render(node, options)
    check("reduce_sum", [x], {"axes": axes}, options)


def test_kernels_arrays_view_and_empty_are_numpys_reshape_and_empty():
    """Kernels make their arrays with `cpu_runtime`'s ``view`` and ``empty`` (cheaper
    for Numba to compile than ``reshape`` and ``np.empty``): the same arrays, sharing
    or owning their memory as NumPy's would, for any rank, dtype and integer type of
    the shape, and no reference to a viewed array left behind."""
    @njit
    def made(x, rows):
        seen = view(x[2:], (rows, 2, 3))  # a C-contiguous slice, a size read at run time
        seen[0, 1, 2] = -1.0
        counts = empty((np.int32(rows), 4), np.int64)
        counts[:] = 7
        return seen, view(x, (x.size,)), counts, empty((3,), np.float32)

    x = np.arange(14, dtype=np.float64)
    before = sys.getrefcount(x)
    seen, flat, counts, fresh = made(x, 2)
    expected = np.arange(2, 14.0).reshape(2, 2, 3)
    expected[0, 1, 2] = -1.0
    np.testing.assert_array_equal(seen, expected)
    assert x[7] == -1.0 and seen.flags.c_contiguous and np.shares_memory(seen, x)
    assert flat.shape == (14,) and np.shares_memory(flat, x)
    assert counts.dtype == np.int64 and counts.shape == (2, 4) and (counts == 7).all()
    assert fresh.dtype == np.float32 and fresh.shape == (3,) and fresh.flags.c_contiguous
    del seen, flat
    for _ in range(1000):
        made(x, 2)
    assert sys.getrefcount(x) == before


def test_view_refuses_an_array_that_is_not_c_contiguous():
    @njit
    def column(x):
        return view(x[:, 0], (2, 2))

    with pytest.raises(TypingError, match="view"):
        column(np.zeros((4, 3)))


def test_copy_run_copies_a_run_between_indexed_elements_and_opaque_is_its_count():
    """`copy_run` copies ``count`` contiguous elements from one indexed element of an
    array of any rank to another's (the run may cross rows); `opaque` hides a loop's
    trip count from LLVM, and is the count."""
    @njit
    def copied(dst, src, row, count):
        copy_run(dst, (row, np.int32(2)), src, (1, row, 0), count)
        total = 0
        for i in range(opaque(np.int16(5))):
            total += i
        return total

    src = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    dst = np.zeros((3, 5), np.float32)
    assert copied(dst, src, 1, 6) == 10
    expected = np.zeros(15, np.float32)
    expected[7:13] = src[1].ravel()[4:10]  # from src[1, 1, 0] on, into dst[1, 2] on
    np.testing.assert_array_equal(dst.ravel(), expected)


def test_loops_around_loops_llvm_keeps_get_hidden_trip_counts():
    """A literal-count loop holding a loop that stays a loop (opaque or known at run
    time), or heading a nest of more than UNROLLED_NEST trips, gets its count from
    `opaque`; a small nest of literal loops (a pool's window) and innermost loops keep
    theirs; writing the text again changes nothing."""
    graph = Graph("t")
    (x,) = graph.add_node("fill", [], {"shape": [4], "value": 1.0}).outputs
    module = KernelModule("k", [x.producer], [], [x])
    out = module.params[0][0]
    body = module.body
    for header, inner in (("for a in range(12):", "for b in range(opaque(8)):"),
                          ("for c in range(2, 40, 2):", "for d in range(40):"),
                          ("for e in range(3):", "for f in range(3):"),
                          ("for g in range(1):", "for h in range(n):")):
        with body.block(header), body.block(inner):
            body.line(f"{out}[0] += 1")
    with body.block("for i in range(64):"):
        body.line(f"{out}[1] += 1")
    text = module.text()
    assert module.text() == text
    loops = [line.strip() for line in text.splitlines() if line.strip().startswith("for ")]
    assert loops == ["for a in range(opaque(12)):", "for b in range(opaque(8)):",
                     "for c in range(2, opaque(40), 2):", "for d in range(40):",
                     "for e in range(3):", "for f in range(3):",
                     "for g in range(opaque(1)):", "for h in range(n):",
                     "for i in range(64):"]
    assert "from purinec.codegen.cpu_runtime import opaque" in text


def test_copy_run_refuses_other_dtypes_and_indexes_of_another_rank():
    @njit
    def across_dtypes(dst, src):
        copy_run(dst, (0, 0), src, (0, 0), 2)

    @njit
    def short_index(dst, src):
        copy_run(dst, (0,), src, (0, 0), 2)

    for run, src in ((across_dtypes, np.zeros((2, 2), np.float32)),
                     (short_index, np.zeros((2, 2)))):
        with pytest.raises(TypingError, match="copy_run"):
            run(np.zeros((2, 2)), src)


@pytest.mark.parametrize("options", OPTIONS)
def test_loops_view_only_operands_not_of_their_shape(options):
    """A view costs Numba some compiling: a bias (1-D) and a 1-D flat loop's arrays are
    used as they are; an image's last two axes become one loop, over a view of them
    as one axis."""
    rng = np.random.default_rng(4)
    x, b = random_array(rng, (4, 6, 5, 3), DType.f32), random_array(rng, (6,), DType.f32)
    biased = cpu.render(one_node("bias_add", [x, b], {"axis": 1}), options)
    assert "view(in1" not in biased and "view(in0, (4, 6, 15))" in biased
    flat = cpu.render(one_node("relu", [b]), options)
    assert "view(" not in flat and ".size" not in flat
    check("bias_add", [x, b], {"axis": 1}, options)
    check("relu", [b], {}, options)


@pytest.mark.parametrize("options", OPTIONS)
def test_a_long_sum_is_vectorized_yet_as_exact_and_keeps_nan_and_inf(options):
    """reduce_sum lets LLVM reassociate its float64 sums (vector lanes): the result must
    stay within float32 rounding of the exact sum, and NaN and infinities must still
    come through (reassoc alone assumes no finite math)."""
    x = random_array(np.random.default_rng(7), (6, 5, 700), DType.f32)
    x[2, 1, 333] = np.nan
    x[4, 3, 5] = np.inf
    node = one_node("reduce_sum", [x], {"axes": [0, 2]})
    assert "fastmath={'reassoc'}" in cpu.render(node, options)
    (got,) = run_kernel(node, [x], options)
    exact = x.astype(np.float64).sum(axis=(0, 2))
    assert np.isnan(got[1]) and got[3] == np.inf
    finite = [0, 2, 4]
    np.testing.assert_allclose(got[finite], exact[finite], rtol=1e-7)


@SETTINGS
@given(shape=shapes(4), data=st.data(), dtype=st.sampled_from([*FLOATS, DType.i64]),
       options=st.sampled_from(OPTIONS))
def test_reshape(shape, data, dtype, options):
    target = list(data.draw(st.permutations(shape))) + [1] * data.draw(st.integers(0, 1))
    x = random_array(np.random.default_rng(data.draw(seeds)), shape, dtype)
    check("reshape", [x], {"shape": target}, options, exact=True)


@SETTINGS
@given(shape=shapes(4).filter(len), data=st.data(), options=st.sampled_from(OPTIONS),
       dtype=st.sampled_from([*FLOATS, DType.i64, DType.bool]))
def test_concat_and_split(shape, data, options, dtype):
    axis = data.draw(st.integers(0, len(shape) - 1))
    sections = data.draw(st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=3))
    rng = np.random.default_rng(data.draw(seeds))
    parts = []
    for s in sections:
        part_shape = list(shape)
        part_shape[axis] = s
        parts.append(random_array(rng, tuple(part_shape), dtype))
    check("concat", parts, {"axis": axis}, options, exact=True)
    whole = np.concatenate(parts, axis=axis)
    check("split", [whole], {"axis": axis, "sections": sections}, options, exact=True)


@pytest.mark.parametrize("x_shape, w_shape, attrs", [
    ((2, 6, 9, 40), (6, 1, 3, 3), {"stride": [2, 2], "pad": [1, 1], "groups": 6}),
    ((1, 4, 7, 50), (8, 1, 3, 3), {"stride": [1, 3], "pad": [0, 0], "groups": 4,
                                   "dilation": [1, 2]}),
    ((1, 4, 6, 37), (4, 2, 2, 3), {"stride": [2, 2], "pad": [0, 1, 1, 2], "groups": 2}),
])
def test_direct_conv_over_column_phases_agrees(x_shape, w_shape, attrs):
    """A direct convolution with a column stride and rows of a vector or more reads its
    image split by column phase (`_column_phases`), padded or not, dilated or not."""
    from purinec.codegen.cpu_conv import VECTOR

    rng = np.random.default_rng(9)
    x, w = random_array(rng, x_shape, DType.f32), random_array(rng, w_shape, DType.f32)
    node = one_node("conv2d", [x, w], attrs)
    assert node.outputs[0].type.shape[3] >= VECTOR
    source = cpu.render(node, BLOCKED)
    assert f"xpad = empty(({w_shape[1]}, " in source and " % " in source
    check("conv2d", [x, w], attrs, BLOCKED)
    check("conv2d", [x, w], attrs)


@pytest.mark.parametrize("x_shape, w_shape, attrs", [
    ((1, 8, 7, 7), (8, 1, 3, 3), {"pad": [1, 1]}),
    ((2, 5, 14, 14), (5, 1, 3, 3), {"pad": [1, 1]}),
    ((1, 3, 9, 20), (3, 1, 5, 5), {"pad": [2, 2]}),
    ((1, 3, 9, 20), (3, 1, 3, 3), {"pad": [0, 1, 2, 1]}),
    ((1, 4, 11, 13), (4, 1, 3, 3), {"pad": [2, 2], "dilation": [2, 2]}),
    ((1, 4, 3, 2), (4, 1, 3, 3), {"pad": [1, 1]}),
    ((1, 2, 1, 1), (2, 1, 1, 1), {"pad": [0, 0]}),
    ((1, 8, 14, 14), (8, 1, 3, 3), {"stride": [2, 2], "pad": [1, 1]}),
    ((2, 5, 7, 7), (5, 1, 3, 3), {"stride": [2, 2], "pad": [1, 1]}),
    ((1, 3, 14, 14), (3, 1, 3, 3), {"stride": [2, 2], "pad": [0, 0, 1, 1]}),
    ((1, 3, 15, 13), (3, 1, 5, 5), {"stride": [2, 2], "pad": [2, 2]}),
    ((1, 3, 16, 15), (3, 1, 3, 3), {"stride": [3, 3], "pad": [1, 1]}),
    ((1, 3, 16, 15), (3, 1, 3, 3), {"stride": [1, 2], "pad": [1, 1]}),
    ((1, 3, 16, 15), (3, 1, 3, 3), {"stride": [2, 1], "pad": [1, 1]}),
    ((1, 4, 13, 14), (4, 1, 3, 3), {"stride": [2, 2], "pad": [2, 2], "dilation": [2, 2]}),
    ((1, 2, 36, 36), (2, 1, 3, 3), {"stride": [2, 2], "pad": [1, 1]}),
    ((1, 4, 9, 9), (4, 1, 3, 3), {"stride": [1, 1], "pad": [0, 0]}),
    ((1, 4, 9, 9), (4, 1, 3, 3), {"stride": [2, 2], "pad": [0, 0]}),
    ((1, 3, 6, 7), (3, 1, 3, 3), {"stride": [1, 1], "pad": [2, 3, 0, 2]}),
    ((1, 3, 14, 14), (3, 1, 3, 3), {"stride": [2, 2], "pad": [2, 2]}),
], ids=["7x7", "batch-2", "5x5", "uneven-pad", "dilated", "tiny", "1x1", "stride-2",
        "stride-2-odd", "stride-2-pad-after", "stride-2-5x5", "stride-3", "column-stride",
        "row-stride", "stride-2-dilated", "stride-2-rows-of-vectors", "narrower",
        "stride-2-narrower", "wider", "stride-2-wider"])
def test_depthwise_as_vector_code_agrees(x_shape, w_shape, attrs):
    """A depthwise convolution is vector code over flat planes (`cpu_window`): its
    masks keep out every tap that falls in the padding or past a row's end, whatever
    the padding, kernel, stride, dilation or plane (one partial vector, or several and
    a remainder; odd sizes leave some phase planes a row or column short), output rows
    as wide as the input's (its phase planes'), narrower (computed as wide, then copied
    out) or wider (planes made as wide). Batches of two are also split between threads
    (a Numba compile each: not every case)."""
    attrs = {"stride": [1, 1], "groups": x_shape[1], "dilation": [1, 1], **attrs}
    rng = np.random.default_rng(13)
    x, w = random_array(rng, x_shape, DType.f32), random_array(rng, w_shape, DType.f32)
    for options in _vector_code_options(x_shape):
        assert "depthwise_vectors(" in cpu.render(one_node("conv2d", [x, w], attrs), options)
        check("conv2d", [x, w], attrs, options)


def _vector_code_options(shape) -> list[CpuOptions]:
    """Vector code as one block, and for a batch of several images also split between
    threads."""
    return [VECTOR_CODE] + ([replace(BLOCKED, tiled_gemm=True)] if shape[0] > 1 else [])


def test_depthwise_of_other_shapes_is_not_vector_code():
    """A channel multiplier, or f64: the other paths."""
    rng = np.random.default_rng(14)
    for x_shape, w_shape, attrs, dtype in [
            ((1, 4, 9, 9), (8, 1, 3, 3), {"stride": [1, 1], "pad": [1, 1]}, DType.f32),
            ((1, 4, 9, 9), (4, 1, 3, 3), {"stride": [1, 1], "pad": [1, 1]}, DType.f64)]:
        attrs = {"groups": 4, "dilation": [1, 1], **attrs}
        x, w = random_array(rng, x_shape, dtype), random_array(rng, w_shape, dtype)
        assert "depthwise_vectors(" not in cpu.render(one_node("conv2d", [x, w], attrs),
                                                       VECTOR_CODE)
        check("conv2d", [x, w], attrs, VECTOR_CODE)


def test_concat_and_split_of_one_row_run_on_every_thread():
    """Blocks split a concat's elements, not its rows: one image's channels (3 parts
    of 2, 5 and 1 channels, a block ending inside a part) are copied by 3 blocks."""
    rng = np.random.default_rng(11)
    parts = [random_array(rng, (1, c, 3, 4), DType.f32) for c in (2, 5, 1)]
    node = one_node("concat", parts, {"axis": 1})
    assert "first = max(lo - r * " in cpu.render(node, BLOCKED)
    check("concat", parts, {"axis": 1}, BLOCKED, exact=True)
    whole = np.concatenate(parts, axis=1)
    check("split", [whole], {"axis": 1, "sections": [2, 5, 1]}, BLOCKED, exact=True)


@SETTINGS
@given(shape=shapes(4), data=st.data(), dtype=st.sampled_from([*FLOATS, DType.i64, DType.bool]),
       options=st.sampled_from(OPTIONS))
def test_transpose(shape, data, dtype, options):
    perm = data.draw(st.permutations(range(len(shape))))
    x = random_array(np.random.default_rng(data.draw(seeds)), shape, dtype)
    check("transpose", [x], {"perm": list(perm)}, options, exact=True)


@st.composite
def windows(draw, shape):
    """starts, steps and sizes of a random strided window inside ``shape`` (no empty
    axes)."""
    axes = []
    for n in shape:
        step = draw(st.sampled_from([1, 2, 3, -1, -2]))
        start = draw(st.integers(0, n - 1))
        room = (n - 1 - start) // step if step > 0 else start // -step
        axes.append((start, step, draw(st.integers(0, room + 1))))
    starts, steps, sizes = zip(*axes) if axes else ((), (), ())
    return list(starts), list(steps), list(sizes)


@SETTINGS
@given(shape=shapes(4, sizes=(1, 2, 5, 7)), data=st.data(),
       dtype=st.sampled_from([DType.f32, DType.i32]), options=st.sampled_from(OPTIONS))
def test_strided_slice_and_its_gradient(shape, data, dtype, options):
    starts, steps, sizes = data.draw(windows(shape))
    rng = np.random.default_rng(data.draw(seeds))
    x = random_array(rng, shape, dtype)
    check("strided_slice", [x], {"starts": starts, "steps": steps, "sizes": sizes}, options,
          exact=True)
    gy = random_array(rng, tuple(sizes), dtype)
    check("strided_slice_grad", [gy], {"input_shape": list(shape), "starts": starts,
                                       "steps": steps}, options, exact=True)


@SETTINGS
@given(shape=shapes(3, sizes=(1, 3, 4)), data=st.data(),
       mode=st.sampled_from(["constant", "reflect", "edge"]), options=st.sampled_from(OPTIONS))
def test_pad_and_its_gradient(shape, data, mode, options):
    most = [n - 1 if mode == "reflect" else 3 for n in shape]
    pads = [data.draw(st.integers(0, m)) for m in most * 2]
    rng = np.random.default_rng(data.draw(seeds))
    x = random_array(rng, shape, DType.f32)
    check("pad", [x], {"pads": pads, "mode": mode, "value": -1.5}, options, exact=True)
    padded = tuple(n + pads[a] + pads[len(shape) + a] for a, n in enumerate(shape))
    gy = random_array(rng, padded, DType.f64)
    check("pad_grad", [gy], {"pads": pads, "mode": mode, "input_shape": list(shape)}, options)


def test_pad_of_integers_and_what_pads_are_refused():
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    check("pad", [x], {"pads": [1, 2, 0, 1], "value": 7.0}, exact=True)
    with pytest.raises(ShapeError, match="reflection needs pads shorter than the axis"):
        one_node("pad", [x], {"pads": [0, 3, 0, 0], "mode": "reflect"})
    with pytest.raises(ShapeError, match=r"indices 1, 3, \.\.\., 5 .* leave"):
        one_node("strided_slice", [x], {"starts": [0, 1], "steps": [1, 2], "sizes": [2, 3]})


# ---------------------------------------------------------------------------------------
# Matrix products and convolutions.


@SETTINGS
@given(m=st.sampled_from([1, 3, 8]), n=st.sampled_from([1, 4, 9]), k=st.sampled_from([1, 5, 16]),
       trans_a=st.booleans(), trans_b=st.booleans(), dtype=st.sampled_from(FLOATS), seed=seeds,
       options=st.sampled_from(OPTIONS))
def test_matmul(m, n, k, trans_a, trans_b, dtype, seed, options):
    rng = np.random.default_rng(seed)
    a = random_array(rng, (k, m) if trans_a else (m, k), dtype)
    b = random_array(rng, (n, k) if trans_b else (k, n), dtype)
    check("matmul", [a, b], {"trans_a": trans_a, "trans_b": trans_b}, options)


@pytest.mark.parametrize("shape, blocked", [((70, 100, 40), False), ((70, 100, 40), True),
                                           ((150, 60, 33), True)],
                         ids=["whole", "blocks-of-columns", "blocks-of-rows"])
def test_products_of_rows_by_rows_run_in_unpacked_tiles_and_agree(shape, blocked):
    """``a @ b^T`` where the BLAS multiplies small ones unpacked: in 32 x 32 tiles (and
    the edges' smaller ones) of the whole product or of a thread's block of it."""
    m, n, k = shape
    options = CpuOptions(small_gemm_macs=100 ** 3,
                         **({"parallel_min": 0, "parallel_min_products": 0} if blocked else {}))
    rng = np.random.default_rng(8)
    a, b = random_array(rng, (m, k), DType.f32), random_array(rng, (n, k), DType.f32)
    attrs = {"trans_a": False, "trans_b": True}
    assert "for c0 in range(0, " in cpu.render(one_node("matmul", [a, b], attrs), options)
    check("matmul", [a, b], attrs, options)


def test_products_that_stream_their_weights_split_between_threads():
    """A dense layer at batch 1 (512 -> 1000: 0.5M multiply-adds, fewer than a product
    is split for, but 2 MB of weights to read) runs in blocks of its columns; mlp's
    64 x 512 -> 10 layer (0.3M multiply-adds, 38K elements) stays whole."""
    rng = np.random.default_rng(9)
    attrs = {"trans_a": False, "trans_b": True}
    x, w = random_array(rng, (1, 512), DType.f32), random_array(rng, (1000, 512), DType.f32)
    gemv = one_node("matmul", [x, w], attrs)
    assert cpu.render_module(gemv).parallel
    check("matmul", [x, w], attrs)
    h, w3 = random_array(rng, (64, 512), DType.f32), random_array(rng, (10, 512), DType.f32)
    assert not cpu.render_module(one_node("matmul", [h, w3], attrs)).blocks


@st.composite
def conv_problems(draw):
    """(x shape, w shape, attrs) of a small valid convolution."""
    groups = draw(st.sampled_from([1, 1, 2]))
    cin_g, cout_g = draw(st.sampled_from([1, 3])), draw(st.sampled_from([1, 2]))
    kh, kw = draw(st.sampled_from([(1, 1), (3, 3), (2, 3)]))
    stride = draw(st.sampled_from([(1, 1), (2, 2), (1, 2)]))
    dilation = draw(st.sampled_from([(1, 1), (1, 1), (2, 1), (2, 2)]))
    pad = draw(st.sampled_from([(0, 0), (1, 1), (0, 2), (1, 0, 2, 1), (0, 2, 0, 0)]))
    h, w = draw(st.sampled_from([(4, 5), (3, 3), (6, 4)]))
    top, left, bottom, right = nnref.pad_edges(pad)
    assume(conv_output_size(h, kh, stride[0], top, bottom, dilation[0]) >= 1)
    assume(conv_output_size(w, kw, stride[1], left, right, dilation[1]) >= 1)
    n = draw(st.sampled_from([1, 2, 5]))  # 5: weight gradients sum parts of the images
    attrs = {"stride": list(stride), "pad": list(pad), "groups": groups,
             "dilation": list(dilation)}
    return (n, cin_g * groups, h, w), (cout_g * groups, cin_g, kh, kw), attrs


def check_conv_gradients(rng, x_shape, w_shape, attrs, dtype, options) -> None:
    """Both gradients of the convolution of ``x_shape`` by ``w_shape``, random."""
    (y,) = one_node("conv2d", [np.zeros(x_shape, dtype.numpy), np.zeros(w_shape, dtype.numpy)],
                    attrs).outputs
    gy, w = random_array(rng, y.type.shape, dtype), random_array(rng, w_shape, dtype)
    check("conv2d_grad_input", [gy, w], {**attrs, "input_shape": list(x_shape)}, options)
    x = random_array(rng, x_shape, dtype)
    check("conv2d_grad_weight", [x, gy], {**attrs, "kernel": list(w_shape[2:])}, options)


@pytest.mark.slow  # a Numba compile per example
@settings(SETTINGS, max_examples=8)
@given(problem=conv_problems(), dtype=st.sampled_from(FLOATS), seed=seeds,
       options=st.sampled_from(OPTIONS + [GEMMS]))
def test_conv2d_and_its_gradients(problem, dtype, seed, options):
    x_shape, w_shape, attrs = problem
    rng = np.random.default_rng(seed)
    x, w = random_array(rng, x_shape, dtype), random_array(rng, w_shape, dtype)
    check("conv2d", [x, w], attrs, options)
    check_conv_gradients(rng, x_shape, w_shape, attrs, dtype, options)


@pytest.mark.slow  # a Numba compile per case
@pytest.mark.parametrize("x_shape, w_shape, attrs", [
    ((2, 3, 15, 13), (8, 3, 3, 3), {"stride": [2, 2], "pad": [0, 0]}),  # no border
    ((1, 4, 11, 12), (6, 4, 3, 3), {"stride": [1, 3], "pad": [1, 2, 0, 1],
                                    "dilation": [1, 2]}),
    ((2, 6, 9, 10), (4, 3, 2, 2), {"stride": [2, 2], "pad": [1, 1], "groups": 2}),
], ids=["stride-2", "stride-3-dilated", "groups"])
@pytest.mark.parametrize("options", [CpuOptions(direct_max_channels=0), GEMMS])
def test_strided_im2col_reads_the_image_split_by_column_phase(x_shape, w_shape, attrs,
                                                               options):
    """An im2col with a column stride (the forward product's, the weight gradient's)
    copies each output row's taps as one run from the image split by column phase
    (``j*dw % sw``), not every ``sw``-th column."""
    attrs = {"groups": 1, "dilation": [1, 1], **attrs}
    rng = np.random.default_rng(len(x_shape) + sum(w_shape))
    x, w = random_array(rng, x_shape, DType.f32), random_array(rng, w_shape, DType.f32)
    options = replace(options, tiled_gemm=False)  # the BLAS: im2col, never implicit
    forward = one_node("conv2d", [x, w], attrs)
    gy = random_array(rng, forward.outputs[0].type.shape, DType.f32)
    gradient_attrs = {**attrs, "kernel": list(w_shape[2:])}
    for node in (forward, one_node("conv2d_grad_weight", [x, gy], gradient_attrs)):
        assert f") % {attrs['stride'][1]}, (" in cpu.render(node, options), node.op
    check("conv2d", [x, w], attrs, options)
    check("conv2d_grad_weight", [x, gy], gradient_attrs, options)


@pytest.mark.slow  # a Numba compile per case
@pytest.mark.parametrize("x_shape, w_shape, attrs", [
    ((5, 3, 6, 7), (4, 3, 3, 3), {"stride": [1, 2], "pad": [1, 1], "groups": 1}),
    ((6, 4, 5, 6), (6, 2, 1, 1), {"stride": [1, 1], "pad": [0, 0], "groups": 2}),
    ((5, 32, 6, 6), (3, 32, 3, 3), {"stride": [1, 1], "pad": [1, 1], "groups": 1}),
], ids=["im2col", "pointwise", "by-kernel-rows"])
@pytest.mark.parametrize("options", [CpuOptions(), GEMMS])
def test_weight_gradients_of_few_rows_sum_parts_of_the_images(x_shape, w_shape, attrs,
                                                               options):
    """Few im2col rows: blocks take parts of the images (uneven ones here), each summing
    its own gradient, and the parts are added once all are done (on 3 threads: see
    `kernel_cache`)."""
    rng = np.random.default_rng(5)
    x = random_array(rng, x_shape, DType.f32)
    (y,) = one_node("conv2d", [x, np.zeros(w_shape, np.float32)], attrs).outputs
    gy = random_array(rng, y.type.shape, DType.f32)
    attrs = {**attrs, "kernel": list(w_shape[2:])}
    source = cpu.render(one_node("conv2d_grad_weight", [x, gy], attrs), options)
    assert "gw_t = parts[part]" in source
    # Blocked (GEMMS: at any size), the kernel adds the parts up after its blocks.
    assert ("if threads == 0:" in source) == (options is GEMMS)
    check("conv2d_grad_weight", [x, gy], attrs, options)


@pytest.mark.slow  # a Numba compile per case
@pytest.mark.parametrize("x_shape, w_shape, attrs, macs_per_column", [
    # im2col (3x3x3 rows); 5 images: the weight gradient sums parts of them.
    ((5, 3, 12, 12), (8, 3, 3, 3), {"stride": [1, 1], "pad": [1, 1], "groups": 1}, 8 * 27),
    # Kernel rows (16 channels x 5 columns), 6 output channels a group (the transposed
    # gradient's rows in 8s and a tail); the input gradient as a convolution too.
    ((2, 32, 10, 10), (12, 16, 5, 5), {"stride": [1, 1], "pad": [2, 2], "groups": 2},
     6 * 80),
    ((5, 16, 12, 12), (12, 16, 1, 1), {"stride": [1, 1], "pad": [0, 0], "groups": 1},
     12 * 16),
    # More channels out than in (as in the first): the input gradient by col2im.
    ((2, 8, 10, 10), (32, 8, 3, 3), {"stride": [1, 1], "pad": [1, 1], "groups": 1}, 32 * 72),
    ((11, 32, 10, 10), (64, 32, 3, 3), {"stride": [1, 1], "pad": [1, 1], "groups": 1},
     64 * 96),  # (images enough to copy the weights by kernel rows: 16 pixels a filter)
], ids=["im2col", "by-kernel-rows", "pointwise", "col2im", "col2im-by-kernel-rows"])
@pytest.mark.parametrize("blocked", [False, True])
def test_convolutions_in_unpacked_chunks_agree(x_shape, w_shape, attrs, macs_per_column,
                                               blocked):
    """A BLAS that multiplies small products unpacked (`CpuOptions.small_gemm_macs`, here
    64 columns' worth): the forward product runs in chunks of columns (of a block's
    rows, when blocked), the weight gradient multiplies ``col @ gy_t`` in chunks of
    pixels, ``gy_t`` being ``gy`` transposed, and col2im's products in chunks of
    pixels."""
    options = CpuOptions(small_gemm_macs=64 * macs_per_column, direct_max_channels=0,
                         **({"parallel_min": 0, "parallel_min_products": 0} if blocked
                            else {}))
    rng = np.random.default_rng(11)
    x, w = random_array(rng, x_shape, DType.f32), random_array(rng, w_shape, DType.f32)
    assert "for s in range(0, " in cpu.render(one_node("conv2d", [x, w], attrs), options)
    (y,) = one_node("conv2d", [x, w], attrs).outputs
    gy = random_array(rng, y.type.shape, DType.f32)
    weight_gradient = one_node("conv2d_grad_weight", [x, gy],
                               {**attrs, "kernel": list(w_shape[2:])})
    assert "gy_t = " in cpu.render(weight_gradient, options)
    input_gradient = cpu.render(one_node("conv2d_grad_input", [gy, w],
                                         {**attrs, "input_shape": list(x_shape)}), options)
    by_col2im = "] += col[" in input_gradient  # else as a convolution: more channels in
    assert by_col2im == (w_shape[0] > x_shape[1])
    assert "for s in range(0, " in input_gradient or not by_col2im
    check("conv2d", [x, w], attrs, options)
    check_conv_gradients(rng, x_shape, w_shape, attrs, DType.f32, options)


@pytest.mark.slow  # a Numba compile per case
@pytest.mark.parametrize("options", [CpuOptions(direct_max_channels=0), GEMMS])
def test_pointwise_conv_skips_im2col_and_agrees(options):
    rng = np.random.default_rng(3)
    x, w = random_array(rng, (3, 4, 5, 6), DType.f32), random_array(rng, (6, 2, 1, 1), DType.f32)
    attrs = {"stride": [1, 1], "pad": [0, 0], "groups": 2}
    source = cpu.render(one_node("conv2d", [x, w], attrs), options)
    assert "col = " not in source
    check("conv2d", [x, w], attrs, options)
    gy = random_array(rng, (3, 6, 5, 6), DType.f32)
    check("conv2d_grad_input", [gy, w], {**attrs, "input_shape": [3, 4, 5, 6]}, options)
    check("conv2d_grad_weight", [x, gy], {**attrs, "kernel": [1, 1]}, options)



@pytest.mark.slow  # a Numba compile per case
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("x_shape, w_shape, attrs", [
    ((2, 16, 12, 11), (16, 16, 5, 5), {"stride": [1, 1], "pad": [2, 2], "groups": 1}),
    ((4, 8, 26, 9), (12, 8, 3, 8), {"stride": [1, 2], "pad": [0, 1], "groups": 1}),
    ((1, 24, 26, 26), (16, 12, 3, 6), {"stride": [1, 1], "pad": [1, 1], "groups": 2}),
    # Dilated, padded unevenly: kernel rows dh rows apart; the input gradient as a
    # convolution (pads within the dilated kernel's reach), then by col2im (a pad past it).
    ((5, 16, 8, 7), (16, 16, 3, 5), {"stride": [1, 1], "pad": [1, 2, 3, 2],
                                     "dilation": [2, 1], "groups": 1}),
    ((14, 8, 6, 9), (12, 8, 2, 8), {"stride": [1, 2], "pad": [3, 0, 0, 1],
                                   "dilation": [2, 1], "groups": 1}),
])
def test_conv_by_kernel_rows_agrees(x_shape, w_shape, attrs, options):
    """Enough channels times kernel columns for the kernel-row GEMMs, and pixels per
    output channel for their weights' copy (forward, and both ways of the input
    gradient: as a convolution and by col2im)."""
    rng = np.random.default_rng(5)
    x, w = random_array(rng, x_shape, DType.f32), random_array(rng, w_shape, DType.f32)
    assert "w_rows" in cpu.render(one_node("conv2d", [x, w], attrs), options)
    check("conv2d", [x, w], attrs, options)
    check_conv_gradients(rng, x_shape, w_shape, attrs, DType.f32, options)

@given(size=st.tuples(st.integers(1, 12), st.integers(1, 12)),
       kernel=st.tuples(st.integers(1, 5), st.integers(1, 5)),
       stride=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       dilation=st.tuples(st.integers(1, 2), st.integers(1, 2)),
       pad=st.tuples(*[st.integers(0, 3)] * 4), seed=seeds)
def test_phase_planes_read_every_tap_as_one_run(size, kernel, stride, dilation, pad, seed):
    """The flat phase planes (`cpu_conv._plane_shape`), filled as the kernels fill
    them, give every output pixel's every tap its padded image's value at one offset
    from the pixel, rows read past their end included (into the next row's border);
    the columns computed for nothing stay inside the planes; and a plane is never
    wider than the padded image's phase."""
    (h, w), (kh, kw), (sh, sw), (dh, dw), (pt, pl, pb, pr) = size, kernel, stride, dilation, pad
    assume(conv_output_size(h, kh, sh, pt, pb, dh) >= 1)
    assume(conv_output_size(w, kw, sw, pl, pr, dw) >= 1)
    x = np.random.default_rng(seed).uniform(1, 2, (h, w))
    node = one_node("conv2d", [np.zeros((1, 1, h, w), np.float32),
                               np.zeros((1, 1, kh, kw), np.float32)],
                    {"stride": [sh, sw], "pad": [pt, pl, pb, pr], "dilation": [dh, dw],
                     "groups": 1})
    g = cpu_conv.node_conv(node)
    rows, width = cpu_conv._plane_shape(g)
    padded = np.pad(x, ((pt, pb), (pl, pr)))
    planes = np.zeros((sh, sw, rows, width))
    for row in range(pt, pt + h):
        for column in range(pl, pl + w):
            planes[row % sh, column % sw, row // sh, column // sw] = padded[row, column]
    flat = planes.reshape(sh, sw, rows * width)
    assert width <= -(-(w + pl + pr) // sw)
    for i in range(kh):
        for j in range(kw):
            row_phase, column_phase, offset = cpu_conv.tap_in_phases(i, j, (sh, sw),
                                                                     (dh, dw), width)
            run = flat[row_phase, column_phase, offset:offset + g.oh * width]
            assert run.size == g.oh * width  # the columns for nothing, inside
            np.testing.assert_array_equal(
                run.reshape(g.oh, width)[:, :g.ow],
                padded[i * dh::sh][:g.oh, j * dw::sw][:, :g.ow])


def test_phase_planes_share_a_border_between_rows():
    """A 3x3 window padded by 1 reads its rows' right border from the next row's left:
    rows of 57 for 56 pixels."""
    node = one_node("conv2d", [np.zeros((1, 64, 56, 56), np.float32),
                               np.zeros((64, 64, 3, 3), np.float32)],
                    {"stride": [1, 1], "pad": [1, 1], "dilation": [1, 1], "groups": 1})
    assert cpu_conv._plane_shape(cpu_conv.node_conv(node)) == (59, 57)


@pytest.mark.slow  # a Numba compile per case
@pytest.mark.parametrize("x_shape, w_shape, attrs", [
    ((1, 6, 7, 7), (6, 1, 3, 3), {"pad": [1, 1], "groups": 6}),
    ((2, 8, 9, 5), (8, 2, 3, 3), {"pad": [1, 1], "groups": 4}),
    # dilated, padded unevenly: taps dh rows apart, reads past a row's end
    ((2, 4, 8, 9), (8, 1, 3, 5), {"pad": [2, 1, 0, 3], "groups": 4, "dilation": [2, 1]}),
    ((3, 2, 6, 6), (4, 1, 3, 3), {"pad": [1, 1], "groups": 2}),
    # strided: the taps read four phase planes (two, or three) at their offsets
    ((2, 6, 14, 14), (6, 1, 3, 3), {"stride": [2, 2], "pad": [1, 1], "groups": 6}),
    ((1, 4, 9, 11), (8, 2, 3, 3), {"stride": [2, 1], "pad": [1, 0, 2, 1], "groups": 2}),
    ((2, 3, 8, 13), (6, 1, 2, 3), {"stride": [1, 3], "groups": 3, "dilation": [2, 2]}),
    ((1, 2, 7, 7), (2, 1, 3, 3), {"stride": [3, 2], "pad": [2, 2], "groups": 2}),
])
@pytest.mark.parametrize("options", OPTIONS)
def test_direct_convolutions_over_flat_planes_agree(x_shape, w_shape, attrs, options):
    """Narrow rows, padded or strided: one loop over a block's rows of the phase planes
    (`cpu_conv._direct_conv_flat`), whose extra columns read into the next row and
    the spare one, then each row's pixels out; and the gradients."""
    rng = np.random.default_rng(9)
    x, w = random_array(rng, x_shape, DType.f32), random_array(rng, w_shape, DType.f32)
    assert "sums[" in cpu.render(one_node("conv2d", [x, w], attrs), options)
    check("conv2d", [x, w], attrs, options)
    check_conv_gradients(rng, x_shape, w_shape, attrs, DType.f32, options)


@pytest.mark.slow  # a Numba compile per case
@pytest.mark.parametrize("x_shape, w_shape, attrs, direct", [
    ((1, 8, 9, 7), (12, 8, 3, 3), {"stride": [2, 1], "pad": [1, 1], "groups": 1}, False),
    ((1, 16, 17, 16), (16, 16, 5, 5), {"stride": [1, 1], "pad": [2, 2], "groups": 1},
     False),  # by kernel rows
    ((1, 24, 13, 5), (32, 24, 1, 1), {"stride": [1, 1], "pad": [0, 0], "groups": 1}, False),
    # Depthwise and few channels a group: direct loop nests.
    ((1, 6, 9, 8), (6, 1, 3, 3), {"stride": [2, 2], "pad": [1, 1], "groups": 6}, True),
    ((2, 6, 9, 8), (12, 1, 3, 3), {"stride": [1, 2], "pad": [1, 0, 2, 1], "groups": 6,
                                   "dilation": [2, 1]}, True),
    ((1, 8, 7, 9), (8, 2, 3, 5), {"stride": [2, 1], "pad": [0, 2], "groups": 4,
                                  "dilation": [1, 2]}, True),
])
def test_conv_in_blocks_of_output_rows_agrees(x_shape, w_shape, attrs, direct):
    """Fewer images than blocks (3): threads split output rows, a block computing
    part of an image (and, with 2 images, the end of one and the start of the next);
    rows enough not to split output channels instead (`FILTER_SPLIT_MAX_ROWS`)."""
    rng = np.random.default_rng(7)
    x, w = random_array(rng, x_shape, DType.f32), random_array(rng, w_shape, DType.f32)
    source = cpu.render(one_node("conv2d", [x, w], attrs), BLOCKED)
    assert "r0 = max(lo - n * " in source
    assert ("col = " not in source and "w_mat[" in source) == direct
    check("conv2d", [x, w], attrs, BLOCKED)


# ---------------------------------------------------------------------------------------
# Pooling, LRN, softmax and the losses.


def pool_fits(shape, attrs) -> bool:
    """Whether the op takes these windows (each must hold an input element)."""
    try:
        REGISTRY["max_pool2d"].infer([TensorType(shape, DType.f32)],
                                     REGISTRY["max_pool2d"].complete_attrs(attrs))
    except ShapeError:
        return False
    return True


@st.composite
def pool_problems(draw):
    """(x shape, max pooling's attrs); average pooling draws count_include_pad too."""
    kernel = draw(st.sampled_from([(2, 2), (3, 3), (1, 2)]))
    stride = draw(st.sampled_from([(1, 1), (2, 2), (3, 2)]))
    dilation = draw(st.sampled_from([(1, 1), (1, 1), (2, 1), (1, 3)]))
    pad = [draw(st.integers(0, kernel[k % 2] - 1)) for k in range(draw(st.sampled_from([2, 4])))]
    h, w = draw(st.sampled_from([(4, 4), (5, 7), (3, 6)]))
    shape = (draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 3])), h, w)
    attrs = {"kernel": list(kernel), "stride": list(stride), "pad": pad,
             "dilation": list(dilation), "ceil_mode": draw(st.booleans())}
    assume(pool_fits(shape, attrs))
    return shape, attrs


@pytest.mark.slow  # a Numba compile per example
@settings(SETTINGS, max_examples=6)
@given(problem=pool_problems(), count_include_pad=st.booleans(), dtype=st.sampled_from(FLOATS),
       seed=seeds, options=st.sampled_from(OPTIONS))
def test_pooling_and_its_gradients(problem, count_include_pad, dtype, seed, options):
    shape, attrs = problem
    rng = np.random.default_rng(seed)
    x = random_array(rng, shape, dtype)
    check("max_pool2d", [x], attrs, options, exact=True)
    avg = {**attrs, "count_include_pad": count_include_pad}
    check("avg_pool2d", [x], avg, options)
    (y,) = nnref.max_pool2d(x, **attrs)
    gy = random_array(rng, y.shape, dtype)
    check("max_pool2d_grad", [x, y, gy], attrs, options)
    check("avg_pool2d_grad", [gy], {**avg, "input_shape": list(shape)}, options)


@pytest.mark.slow  # a Numba compile per example
@settings(SETTINGS, max_examples=10)
@given(problem=pool_problems(), count_include_pad=st.booleans(), seed=seeds)
def test_avg_pool_grad_sums_every_window_covering_each_input(problem, count_include_pad,
                                                            seed):
    """The gradient adds along rows of windows, then each input row from the rows of
    windows covering it: paddings, strides, dilations and overhanging windows."""
    shape, attrs = problem
    rng = np.random.default_rng(seed)
    avg = {**attrs, "count_include_pad": count_include_pad}
    (y,) = nnref.avg_pool2d(random_array(rng, shape, DType.f32), **avg)
    gy = random_array(rng, y.shape, DType.f32)
    check("avg_pool2d_grad", [gy], {**avg, "input_shape": list(shape)})


def test_max_pool_grad_routes_ties_to_the_first_maximum():
    x = np.zeros((1, 1, 4, 4), np.float32)  # every window is a tie
    attrs = {"kernel": [3, 3], "stride": [1, 1], "pad": [1, 1]}
    (y,) = nnref.max_pool2d(x, **attrs)
    check("max_pool2d_grad", [x, y, np.ones_like(y)], attrs, exact=True)



@pytest.mark.parametrize("shape, attrs", [
    ((2, 3, 8, 8), {"kernel": [3, 3], "stride": [1, 1], "pad": [1, 1]}),
    ((1, 2, 9, 19), {"kernel": [3, 3], "stride": [2, 2], "pad": [0, 0], "ceil_mode": True}),
])
def test_max_pool_grad_over_rows_of_8_to_15_windows(shape, attrs):
    """Rows of windows 8 to 15 long loop a trip count hidden from LLVM (`SHORT_ROWS`):
    the gradient still goes to each window's first maximum."""
    from purinec.codegen.cpu_pool import SHORT_ROWS

    rng = np.random.default_rng(3)
    x = random_array(rng, shape, DType.f32)
    (y,) = nnref.max_pool2d(x, **attrs)
    assert SHORT_ROWS[0] <= y.shape[3] < SHORT_ROWS[1]
    check("max_pool2d_grad", [x, y, random_array(rng, y.shape, DType.f32)], attrs)
    x[:, :, ::2] = 0  # ties in every other row
    (y,) = nnref.max_pool2d(x, **attrs)
    check("max_pool2d_grad", [x, y, np.ones_like(y)], attrs, exact=True)


@pytest.mark.parametrize("flat", [True, False])
@pytest.mark.parametrize("shape, attrs", [
    ((2, 3, 7, 7), {"kernel": [3, 3], "stride": [1, 1], "pad": [1, 1]}),
    ((1, 2, 9, 21), {"kernel": [3, 3], "stride": [2, 2], "pad": [0, 0], "ceil_mode": True}),
    ((1, 2, 10, 21), {"kernel": [2, 3], "stride": [3, 2], "pad": [1, 0, 0, 2],
                      "dilation": [2, 1]}),
])
def test_max_pool_over_flat_phase_planes_and_rows_of_windows_agree(shape, attrs, flat,
                                                                   monkeypatch):
    """Narrow rows of windows run as one loop over planes split by row and column
    phase (`_max_over_flat_planes`), wide ones row by row: both give the reference's
    maxima, and the gradient goes to each window's first maximum, row strides,
    padding, ceil mode and dilation included."""
    from purinec.codegen import cpu_pool

    if not flat:
        monkeypatch.setattr(cpu_pool, "FLAT_WINDOWS_MAX_WIDTH", 0)
    rng = np.random.default_rng(5)
    x = random_array(rng, shape, DType.f32)
    assert ("maxima[" in cpu.render(one_node("max_pool2d", [x], attrs), BLOCKED)) == flat
    for ties in (False, True):
        if ties:
            x[:, :, 1::2] = 0
        check("max_pool2d", [x], attrs, BLOCKED, exact=True)
        (y,) = nnref.max_pool2d(x, **attrs)
        gy = random_array(rng, y.shape, DType.f32)
        check("max_pool2d_grad", [x, y, gy], attrs, BLOCKED)
        check("max_pool2d_grad", [x, y, np.ones_like(y)], attrs, exact=True)


@pytest.mark.parametrize("shape, attrs", [
    ((1, 8, 14, 14), {"kernel": [2, 2], "stride": [2, 2], "pad": [0, 0], "ceil_mode": True}),
    ((2, 3, 28, 28), {"kernel": [3, 3], "stride": [2, 2], "pad": [0, 0], "ceil_mode": True}),
    ((1, 8, 14, 14), {"kernel": [3, 3], "stride": [1, 1], "pad": [1, 1]}),
    ((1, 3, 7, 7), {"kernel": [3, 3], "stride": [2, 2], "pad": [1, 1]}),
    ((1, 3, 9, 11), {"kernel": [2, 3], "stride": [2, 2], "pad": [0, 1, 1, 0],
                     "ceil_mode": True}),
    ((1, 2, 13, 15), {"kernel": [3, 3], "stride": [2, 2], "pad": [2, 2], "dilation": [2, 2]}),
    ((1, 3, 55, 55), {"kernel": [3, 3], "stride": [2, 2], "pad": [0, 0], "ceil_mode": True}),
    ((2, 3, 8, 9), {"kernel": [3, 3], "stride": [1, 1], "pad": [0, 0]}),
], ids=["2x2-stride-2", "ceil-hangs-out", "stride-1-padded", "odd", "uneven", "dilated",
        "narrower", "stride-1-narrower"])
def test_max_pool_as_vector_code_agrees(shape, attrs):
    """Max pooling is vector code (`cpu_window.max_vectors`): the reference's maxima
    exactly, windows hanging out of the image (padding, ceil mode) never taking what
    lies outside, output rows narrower than the input's phase planes computed as wide
    and copied out; with ties, and with a NaN, which wins where it is a window's first
    tap and only there, as in the loops' ``if v > best``. Batches of two are also split
    between threads."""
    attrs = {"dilation": [1, 1], **attrs}
    rng = np.random.default_rng(6)
    x = random_array(rng, shape, DType.f32)
    node = one_node("max_pool2d", [x], attrs)
    assert "max_vectors(" in cpu.render(node, VECTOR_CODE)
    for options in _vector_code_options(shape):
        check("max_pool2d", [x], attrs, options, exact=True)
    x[:, :, 1::2] = 0
    check("max_pool2d", [x], attrs, VECTOR_CODE, exact=True)
    x[0, 0, 0, 0] = x[0, 0, 1, 1] = np.nan
    (got,), (loops,) = (run_kernel(node, [x], options) for options in (VECTOR_CODE, BLOCKED))
    np.testing.assert_array_equal(got, loops)
    if not any(attrs["pad"]):  # the first window's first tap
        assert np.isnan(got[0, 0, 0, 0])


@pytest.mark.slow  # a Numba compile per case
@pytest.mark.parametrize("kernel, stride, pad, dilation", [
    ([6, 5], [2, 3], [2, 1], [1, 1]), ([2, 3], [1, 3], [1, 2], [1, 1]),
    ([6, 5], [2, 3], [2, 1, 0, 3], [1, 2]), ([2, 3], [1, 3], [1, 0, 2, 2], [2, 2])])
def test_max_pool_with_big_windows_and_column_strides(kernel, stride, pad, dilation):
    """Windows over the unrolling limit run as loops; column strides of 3 make three
    phase planes, padding and ceil mode leave some of them short; dilated taps step
    across phases."""
    rng = np.random.default_rng(7)
    x = random_array(rng, (2, 3, 11, 13), DType.f32)
    attrs = {"kernel": kernel, "stride": stride, "pad": pad, "dilation": dilation}
    check("max_pool2d", [x], attrs, exact=True)
    (y,) = nnref.max_pool2d(x, **attrs)
    check("max_pool2d_grad", [x, y, random_array(rng, y.shape, DType.f32)], attrs)
    x[:] = 0  # every window a tie: the first element wins
    check("max_pool2d_grad", [x, y * 0, np.ones_like(y)], attrs, exact=True)

@FEW
@given(shape=st.sampled_from([(1, 1, 1, 1), (2, 3, 4, 5), (3, 2, 1, 6)]),
       dtype=st.sampled_from(FLOATS), seed=seeds, options=st.sampled_from(OPTIONS))
def test_global_avg_pool(shape, dtype, seed, options):
    check("global_avg_pool", [random_array(np.random.default_rng(seed), shape, dtype)], {},
          options)


@pytest.mark.slow  # a Numba compile per example
@pytest.mark.parametrize("beta", [0.75, 0.5, 0.6])
@settings(SETTINGS, max_examples=3)
@given(shape=st.sampled_from([(1, 1, 2, 2), (2, 5, 3, 2), (1, 7, 1, 3)]),
       size=st.sampled_from([1, 3, 5]), dtype=st.sampled_from(FLOATS), seed=seeds,
       options=st.sampled_from(OPTIONS))
def test_lrn_and_its_gradient(beta, shape, size, dtype, seed, options):
    """Quarter powers (beta 0.75, 0.5: from square roots) and others (0.6: pow)."""
    rng = np.random.default_rng(seed)
    attrs = {"size": size, "alpha": 0.3, "beta": beta, "k": 2.0}
    x, gy = random_array(rng, shape, dtype), random_array(rng, shape, dtype)
    check("lrn", [x], attrs, options)
    check("lrn_grad", [x, gy], attrs, options)


@pytest.mark.slow  # a Numba compile per example
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@SETTINGS
@given(shape=shapes(3).filter(len), data=st.data(), dtype=st.sampled_from(FLOATS),
       options=st.sampled_from(OPTIONS))
def test_softmax_and_its_gradient(op, shape, data, dtype, options):
    axis = data.draw(st.integers(0, len(shape) - 1))
    rng = np.random.default_rng(data.draw(seeds))
    x = random_array(rng, shape, dtype, -5, 5)
    check(op, [x], {"axis": axis}, options)
    (y,) = REGISTRY[op].reference(x, axis=axis)
    check(f"{op}_grad", [y, random_array(rng, shape, dtype)], {"axis": axis}, options)


@pytest.mark.slow  # a Numba compile per example
@SETTINGS
@given(rows=st.sampled_from([1, 4, 7]), classes=st.sampled_from([1, 3, 10]),
       dtype=st.sampled_from(FLOATS), label=st.sampled_from([DType.i32, DType.i64]),
       seed=seeds)
def test_softmax_xent_its_gradient_and_accuracy(rows, classes, dtype, label, seed):
    rng = np.random.default_rng(seed)
    logits = random_array(rng, (rows, classes), dtype, -4, 4)
    labels = rng.integers(0, classes, rows).astype(label.numpy)
    check("softmax_xent", [logits, labels])
    check("softmax_xent_grad", [logits, labels, np.array(0.7, dtype.numpy)])
    check("accuracy", [logits, labels], exact=True)
    logits[:, :] = 1  # ties: the first largest logit counts
    check("accuracy", [logits, labels], exact=True)


def test_a_label_outside_the_classes_raises():
    logits = np.zeros((2, 3), np.float32)
    node = one_node("softmax_xent", [logits, np.array([0, 3], np.int32)])
    with pytest.raises(ValueError, match="label"):
        run_kernel(node, [logits, np.array([0, 3], np.int32)])


# ---------------------------------------------------------------------------------------
# Fused nodes: the three shapes of group `purinec.passes.fuse` makes.


def fused_graph(build) -> tuple[Graph, Node]:
    """``build(graph, make)`` makes members with ``make(op, inputs, attrs, name)``
    and returns (members, exported values); the graph gets one fused node."""
    graph = Graph("f")

    def make(op, inputs, attrs=None, names=None):
        return graph.make_node(op, inputs, attrs or {}, names=names)

    members, exported = build(graph, make)
    node = graph.add_fused(members, external_inputs(members), exported, "fused_test")
    graph.set_outputs([(v.name, v) for v in exported])
    return graph, node


def member_references(node: Node, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every value a node (fused or not) computes, by name, from its members' NumPy
    references in order."""
    values = {v.name: inputs[v.name] for v in node.inputs}
    for member in node.body or [node]:
        results = reference(member, [values[v.name] for v in member.inputs])
        values.update({v.name: r for v, r in zip(member.outputs, results)})
    return values


def check_fused(graph: Graph, node: Node, inputs: dict[str, np.ndarray], options) -> None:
    values = member_references(node, inputs)
    got = run_kernel(node, [inputs[v.name] for v in node.inputs], options)
    for value, array in zip(node.outputs, got):
        np.testing.assert_allclose(array, values[value.name], rtol=1e-4, atol=1e-4)


def _inputs(graph: Graph, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {v.name: random_array(rng, v.type.shape, v.type.dtype) for v in graph.inputs}


def conv_with_epilogue(x_shape, w_shape, attrs: dict, bias: bool, export_conv: bool
                       ) -> tuple[Graph, Node]:
    """A fused convolution, ``bias_add`` (if ``bias``) and ``relu``, exporting the
    convolution's output too if ``export_conv``."""
    def build(g, make):
        x = g.add_input("x", TensorType(x_shape, DType.f32))
        w = g.add_input("w", TensorType(w_shape, DType.f32))
        conv = make("conv2d", [x, w], attrs, ["conv"])
        members = [conv]
        if bias:
            b = g.add_input("b", TensorType((w_shape[0],), DType.f32))
            members.append(make("bias_add", [conv.outputs[0], b], {}, ["biased"]))
        members.append(make("relu", members[-1].outputs, {}, ["relu"]))
        exported = [conv.outputs[0]] if export_conv else []
        return members, exported + [v for m in members[1:] for v in m.outputs]
    return fused_graph(build)


@pytest.mark.slow  # a Numba compile per case
@pytest.mark.parametrize("export_conv", [False, True])
@pytest.mark.parametrize("options", OPTIONS + [GEMMS])
@pytest.mark.parametrize("batch, bias", [(3, True), (1, True), (1, False)])
def test_fused_conv2d_epilogue(export_conv, options, batch, bias):
    """Image by image, or (one image, blocked) on each block of output rows: with a
    bias the epilogue loops over channels, then the block's pixels; without, over one
    flat range the block's rows cut."""
    graph, node = conv_with_epilogue((batch, 2, 6, 5), (4, 2, 3, 3), {"pad": [1, 1]}, bias,
                                     export_conv)
    check_fused(graph, node, _inputs(graph, 0), options)


def conv_with_residual(x_shape, w_shape, attrs: dict, cast: bool = False
                       ) -> tuple[Graph, Node]:
    """A fused convolution, ``relu`` and the sum with an input of the output's shape,
    the node's only output (the convolution computes into it, `anchor_destination`);
    or with ``cast``, that sum cast to float64 (no output of the convolution's type:
    it computes into a scratch)."""
    def build(g, make):
        x = g.add_input("x", TensorType(x_shape, DType.f32))
        w = g.add_input("w", TensorType(w_shape, DType.f32))
        conv = make("conv2d", [x, w], attrs, ["conv"])
        skip = g.add_input("skip", conv.outputs[0].type)
        relu = make("relu", conv.outputs, {}, ["relu"])
        members = [conv, relu, make("add", [relu.outputs[0], skip], {}, ["summed"])]
        if cast:
            members.append(make("cast", members[-1].outputs, {"dtype": "f64"}, ["wide"]))
        return members, members[-1].outputs
    return fused_graph(build)


@pytest.mark.parametrize("x_shape, w_shape, attrs", [
    ((2, 6, 9, 10), (6, 1, 3, 3), {"pad": [1, 1], "groups": 6}),  # flat phase planes
    ((1, 4, 9, 40), (8, 2, 3, 3), {"stride": [2, 2], "pad": [1, 1], "groups": 2}),
    ((3, 4, 5, 70), (4, 1, 3, 3), {"pad": [1, 1], "groups": 4}),  # rows of 70: a nest
], ids=["depthwise", "grouped-strided", "wide-rows"])
@pytest.mark.parametrize("epilogue", ["bias", "exported", "residual", "cast"])
def test_direct_convolutions_run_each_groups_epilogue_after_it(x_shape, w_shape, attrs,
                                                                epilogue):
    """Blocks split a direct convolution's groups, and each group's epilogue runs as soon
    as the group is computed: into the node's output (or the exported convolution),
    rewritten in place, or with no output of its type, into a scratch."""
    if epilogue in ("residual", "cast"):
        graph, node = conv_with_residual(x_shape, w_shape, attrs, cast=epilogue == "cast")
    else:
        graph, node = conv_with_epilogue(x_shape, w_shape, attrs, epilogue == "bias",
                                         epilogue == "exported")
    source = cpu.render(node, BLOCKED)
    assert "for g in range(lo, hi):" in source
    assert ("y_img = empty(" in source) == (epilogue == "cast")
    if epilogue in ("bias", "residual"):  # in place by name: no test at run time
        assert "ctypes.data ==" not in source
    check_fused(graph, node, _inputs(graph, 5), BLOCKED)


@pytest.mark.slow  # a Numba compile per case
@pytest.mark.parametrize("kernel, pad", [(3, 1), (1, 0)], ids=["im2col", "pointwise"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("epilogue", [None, "bias", "exported"])
def test_small_images_split_their_output_channels_between_blocks(kernel, pad, batch,
                                                                 epilogue):
    """Fewer output rows than `cpu_conv.FILTER_SPLIT_MAX_ROWS` in all (5x5 images): a
    block computes its output channels of every pixel, and the epilogue runs on those
    channels: with a bias, a loop over them, then their pixels; without, one flat loop
    over their pixels."""
    if epilogue is None:
        rng = np.random.default_rng(3)
        x = random_array(rng, (batch, 8, 5, 5), DType.f32)
        w = random_array(rng, (40, 8, kernel, kernel), DType.f32)
        assert "w_mat[lo:hi]" in cpu.render(one_node("conv2d", [x, w], {"pad": [pad, pad]}),
                                            BLOCKED)
        check("conv2d", [x, w], {"pad": [pad, pad]}, BLOCKED)
        return

    graph, node = conv_with_epilogue((batch, 8, 5, 5), (40, 8, kernel, kernel),
                                     {"pad": [pad, pad]}, epilogue == "bias",
                                     epilogue == "exported")
    assert "w_mat[lo:hi]" in cpu.render(node, BLOCKED)
    check_fused(graph, node, _inputs(graph, 3), BLOCKED)


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("epilogue", [None, "bias", "exported"])
def test_im2col_in_chunks_of_output_rows(options, epilogue, monkeypatch):
    """An im2col matrix over `cpu_conv.COL_CHUNK_BYTES` is made a few output rows at a
    time (here 2 of 5 rows, within blocks that may begin mid-image), each chunk
    multiplied and its epilogue run before the next."""
    from purinec.codegen import cpu_conv

    monkeypatch.setattr(cpu_conv, "COL_CHUNK_MIN_COLUMNS", 1)
    monkeypatch.setattr(cpu_conv, "COL_CHUNK_BYTES", 4 * 3 * 3 * 11 * 4 * 2)  # 2 rows
    check_conv_in_chunks((2, 4, 9, 11), (8, 4, 3, 3), {"stride": [2, 1], "pad": [1, 1]},
                         epilogue, options)


def check_conv_in_chunks(x_shape, w_shape, attrs: dict, epilogue: str | None,
                         options) -> str:
    """A convolution (``epilogue`` None), or one fused with a bias and relu (``"bias"``)
    or with relu, its own output exported (``"exported"``: `conv_with_epilogue`),
    against the reference, its code computing a few output rows at a time; returns
    that code."""
    if epilogue is None:
        rng = np.random.default_rng(4)
        x, w = random_array(rng, x_shape, DType.f32), random_array(rng, w_shape, DType.f32)
        source = cpu.render(one_node("conv2d", [x, w], attrs), options)
        check("conv2d", [x, w], attrs, options)
    else:
        graph, node = conv_with_epilogue(x_shape, w_shape, attrs, epilogue == "bias",
                                         epilogue == "exported")
        source = cpu.render(node, options)
        check_fused(graph, node, _inputs(graph, 4), options)
    assert "rows_at_once = " in source
    return source


@pytest.mark.slow  # a Numba compile per case
@pytest.mark.parametrize("export_product", [False, True])
@pytest.mark.parametrize("options", OPTIONS)
def test_fused_matmul_epilogue_with_an_sgd_update(export_product, options):
    def build(g, make):
        a = g.add_input("a", TensorType((7, 5), DType.f32))
        b = g.add_input("b", TensorType((7, 6), DType.f32))
        w = g.add_input("w", TensorType((5, 6), DType.f32))
        h = g.add_input("h", TensorType((5, 6), DType.f32))
        grad = make("matmul", [a, b], {"trans_a": True}, ["grad"])
        sgd = make("sgd", [w, h, grad.outputs[0]], {"lr": 0.1, "momentum": 0.9},
                   ["w.next", "h.next"])
        return [grad, sgd], ([grad.outputs[0]] if export_product else []) + sgd.outputs
    graph, node = fused_graph(build)
    check_fused(graph, node, _inputs(graph, 1), options)


def _sgd_in_place(graph: Graph, node: Node, inputs: dict[str, np.ndarray], options,
                  where: dict[str, str]) -> None:
    """Run ``node`` with each output ``where`` names stored over that input's array (as
    the memory planner does), and check every output against the members' references."""
    values = member_references(node, inputs)
    arrays = {v.name: inputs[v.name].copy() for v in node.inputs}
    outputs = [arrays[where[v.name]] if v.name in where else
               np.full(v.type.shape, np.nan, v.type.dtype.numpy) for v in node.outputs]
    cpu.compile_node(node, options).fn(*arrays.values(), *outputs)
    for value, array in zip(node.outputs, outputs):
        np.testing.assert_allclose(array, values[value.name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("where", [{}, {"w.next": "w", "h.next": "h"}, {"w.next": "w"},
                                   {"w.next": "h", "h.next": "w"}])
def test_a_big_update_is_right_over_its_inputs_or_not(where, options):
    """A loop over IN_PLACE_MIN elements or more comes twice, one copy storing through
    the inputs' views when outputs lie over them: right whichever arrays coincide."""
    def build(g, make):
        w, h, grad = (g.add_input(k, TensorType((70, 64), DType.f32)) for k in "whg")
        return [make("sgd", [w, h, grad], {"lr": 0.1, "momentum": 0.9,
                                            "weight_decay": 0.01}, ["w.next", "h.next"])], None
    graph = Graph("f")
    (sgd,), _ = build(graph, lambda op, inputs, attrs, names: graph.add_node(
        op, inputs, attrs, names=names))
    assert "ctypes.data" in cpu.render(sgd, options)
    _sgd_in_place(graph, sgd, _inputs(graph, 4), options, where)


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("where", [{}, {"w.next": "w", "h.next": "h"}])
def test_a_big_matmul_epilogue_updates_in_place(where, options):
    def build(g, make):
        a = g.add_input("a", TensorType((9, 70), DType.f32))
        b = g.add_input("b", TensorType((9, 64), DType.f32))
        w, h = (g.add_input(k, TensorType((70, 64), DType.f32)) for k in "wh")
        grad = make("matmul", [a, b], {"trans_a": True}, ["grad"])
        sgd = make("sgd", [w, h, grad.outputs[0]], {"lr": 0.1, "momentum": 0.9},
                   ["w.next", "h.next"])
        return [grad, sgd], sgd.outputs
    graph, node = fused_graph(build)
    _sgd_in_place(graph, node, _inputs(graph, 5), options, where)


@pytest.mark.parametrize("options", OPTIONS)
def test_fused_loop_and_horizontal_groups(options):
    def chain(g, make):
        x = g.add_input("x", TensorType((4, 3, 5), DType.f32))
        b = g.add_input("b", TensorType((3,), DType.f32))
        s = g.add_input("s", TensorType((), DType.f32))
        t = make("bias_add", [x, b], {}, ["t"])
        u = make("sigmoid", t.outputs, {}, ["u"])
        v = make("mul", [u.outputs[0], t.outputs[0]], {}, ["v"])
        grown = make("broadcast_to", [s], {"shape": [4, 3, 5]}, ["grown"])
        out = make("add", [v.outputs[0], grown.outputs[0]], {}, ["out"])
        return [t, u, v, grown, out], [u.outputs[0], out.outputs[0]]

    def updates(g, make):
        members = []
        for i, shape in enumerate([(3, 4), (5,), ()]):
            w, h, grad = (g.add_input(f"{k}{i}", TensorType(shape, DType.f32)) for k in "whg")
            members.append(make("sgd", [w, h, grad], {"lr": 0.5, "weight_decay": 0.1},
                                [f"w{i}.next", f"h{i}.next"]))
        return members, [v for m in members for v in m.outputs]

    for build in (chain, updates):
        graph, node = fused_graph(build)
        check_fused(graph, node, _inputs(graph, 2), options)


def test_a_fused_gelu_imports_what_its_erf_needs():
    """erf is Python's math.erf (NumPy has none): a fused loop using it imports math."""
    def gelu(g, make):
        x = g.add_input("x", TensorType((3, 7), DType.f32))
        s = make("scale", [x], {"alpha": 2 ** -0.5}, ["s"])
        e = make("erf", s.outputs, {}, ["e"])
        one = make("add_scalar", e.outputs, {"value": 1.0}, ["one"])
        half = make("scale", [x], {"alpha": 0.5}, ["half"])
        y = make("mul", [half.outputs[0], one.outputs[0]], {}, ["y"])
        return [s, e, one, half, y], y.outputs

    graph, node = fused_graph(gelu)
    assert "import math" in cpu.render(node)
    check_fused(graph, node, _inputs(graph, 3), CpuOptions())


def _relu_then_tanh(g, make):
    x = g.add_input("x", TensorType((2, 3), DType.f32))
    a = make("relu", [x], {}, ["a"])
    b = make("tanh", a.outputs, {}, ["b"])
    return [a, b], b.outputs


def test_fused_kernel_source_names_every_member():
    _, node = fused_graph(_relu_then_tanh)
    source = cpu.render(node)
    assert "def fused_test(" in source
    for member in node.body:
        assert f"%{member.outputs[0].name} = {member.op}(" in source


def test_every_generated_line_maps_back_to_its_ir_node():
    _, node = fused_graph(_relu_then_tanh)
    builder = cpu.render_module(node).builder()
    lines = builder.text().splitlines()
    origins = builder.origins()
    tanh_lines = [i for i, line in enumerate(lines, 1) if "np.tanh(" in line]
    assert tanh_lines
    for tanh_line in tanh_lines:
        assert origins[tanh_line] == (node.body[1],)
        assert lines[tanh_line - 2].strip().startswith("# %b = tanh(%a)")


# ---------------------------------------------------------------------------------------
# The registry, errors and inspection.


def test_every_registered_op_has_a_cpu_renderer():
    from purinec.codegen.cpu_fused import EPILOGUES
    from purinec.ir.ops import Trait, ops_with  # host ops run in the runtime, not kernels

    assert sorted(set(REGISTRY) - set(RENDERERS) - ops_with(Trait.host)) == []
    assert set(EPILOGUES) == ops_with(Trait.epilogue_anchor)


def test_an_op_without_a_renderer_is_a_clear_error(monkeypatch):
    node = one_node("relu", [np.zeros(3, np.float32)])
    node.loc = "model.py:7"
    monkeypatch.delitem(RENDERERS, "relu")
    with pytest.raises(CodegenError, match=r"no kernel for op 'relu'.*%relu = relu\(%in0\).*"
                                           r"model.py:7"):
        cpu.render(node)


@pytest.mark.parametrize("options", OPTIONS)
def test_a_kernel_refuses_arrays_of_another_shape(options):
    node = one_node("relu", [np.zeros((2, 3), np.float32)])
    kernel = cpu.compile_node(node, options)
    # a loop reading its length from its arrays takes lo, hi; threads only when big
    if options is BLOCKED:
        assert isinstance(kernel.run, Blocked)
    else:  # all 6 elements as one block, on the calling thread
        assert (kernel.run.func, kernel.run.args) == (kernel.dispatcher, (0, 6, 0, 1))
    message = r"relu: arguments must be in0 f32\[2,3\], out0 f32\[2,3\]"
    with pytest.raises(ValueError, match=message):
        kernel.fn(np.zeros((3, 2), np.float32), np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=message):
        kernel.fn(np.zeros((2, 3), np.float32), np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match=message):
        kernel.fn(np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float64))
    with pytest.raises(ValueError, match=message):  # a view of other strides
        kernel.fn(np.zeros((3, 2), np.float32).T, np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=message):
        kernel.fn(np.zeros((2, 3), np.float32))


def test_kernels_show_their_llvm_and_assembly():
    node = one_node("scale", [np.zeros(5, np.float32)], {"alpha": 2.0})
    kernel = cpu.compile_node(node)
    assert "define" in kernel.llvm() and "scale" in kernel.llvm()
    assert "scale" in kernel.asm() and "ret" in kernel.asm()


def test_compile_kernels_covers_every_node_of_a_graph():
    g = Graph("g")
    x = g.add_input("x", TensorType((2, 4), DType.f32))
    w = g.add_input("w", TensorType((3, 4), DType.f32))
    y = g.add_node("matmul", [x, w], {"trans_b": True}).outputs[0]
    z = g.add_node("relu", [y]).outputs[0]
    g.set_outputs([("z", z)])
    kernels = cpu.compile_kernels(g)
    assert list(kernels) == g.nodes
    assert [k.name for k in kernels.values()] == ["matmul", "relu"]
    assert kernels[g.nodes[1]].nodes == (g.nodes[1],)


@given(size=st.integers(0, 40), before=st.integers(0, 5), after=st.integers(0, 5),
       stride=st.integers(1, 4), spare=st.integers(0, 2))
def test_a_padded_axis_is_zeroed_exactly_outside_its_image(size, before, after, stride,
                                                           spare):
    """`cpu_conv._outside`: in each phase of an axis of ``before + size + after``
    positions split ``stride`` ways (and ``spare`` more indices, as a phase plane's spare
    row), the ranges zeroed are the indices standing for positions outside the image."""
    from purinec.codegen.cpu_conv import _outside

    padded = before + size + after
    extent = -(-padded // stride) + spare
    for phase in range(stride):
        zeroed = np.zeros(extent, bool)
        for span in _outside(size, before, stride, phase, extent):
            lo, hi = map(int, span.split(":"))
            assert lo < hi
            zeroed[lo:hi] = True
        position = np.arange(extent) * stride + phase
        assert (zeroed == ((position < before) | (position >= before + size))).all()
