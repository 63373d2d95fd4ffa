"""The kernel cache: generated sources on disk, found again by later processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from purinec.codegen import cache, compile_helpers, cpu, progress
from purinec.codegen.source import node_comment
from purinec.codegen.cpu_module import HEADER
from purinec.ir import nnref
from purinec.ir.graph import Graph
from purinec.ir.types import Device, DType, TensorType

pytestmark = pytest.mark.slow  # compiles in child processes


def small_graph(batch: int = 3) -> Graph:
    g = Graph("cached")
    x = g.add_input("x", TensorType((batch, 4), DType.f32))
    w = g.add_input("w", TensorType((5, 4), DType.f32), role="param")
    y = g.add_node("matmul", [x, w], {"trans_b": True}, names=["y"], loc="net.py:3").outputs[0]
    z = g.add_node("relu", [y], names=["z"], loc="net.py:4").outputs[0]
    g.set_outputs([("z", z)])
    return g


def twin_graph(batch: int = 3) -> Graph:
    """The same layers twice under other names: a matmul on two devices, as the
    data-parallel partitioner names them (``y.p0``, ``y.p1``), two relu layers, and two
    fused bias_add + tanh nodes (kernel names made unique by a suffix)."""
    g = Graph("twins")
    w = g.add_input("w", TensorType((5, 4), DType.f32), role="param")
    b = g.add_input("b", TensorType((5,), DType.f32), role="param")
    outputs = []
    for k in range(2):
        device = Device("cpu", k)
        x = g.add_input(f"x.p{k}", TensorType((batch, 4), DType.f32), device)
        y = g.add_node("matmul", [x, w], {"trans_b": True}, names=[f"y.p{k}"],
                       device=device, loc=f"net.py:{10 + k}").outputs[0]
        z = g.add_node("relu", [y], names=[f"relu{k + 1}"], loc=f"net.py:{20 + k}")
        added = g.make_node("bias_add", [z.outputs[0], b], names=[f"biased{k}"])
        t = g.make_node("tanh", added.outputs, names=[f"t{k}"])
        kernel = "fused_bias_add_tanh" + ("_1" if k else "")
        g.add_fused([added, t], [z.outputs[0], b], t.outputs, kernel, loc=f"net.py:{30 + k}")
        outputs.append((f"t{k}", t.outputs[0]))
    g.set_outputs(outputs)
    return g


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty kernel cache; one process compiles (no helpers), so the counters say
    what this process did."""
    monkeypatch.setenv(cache.ENV_VAR, str(tmp_path))
    monkeypatch.setenv(compile_helpers.JOBS_VAR, "1")
    cache.STATS.reset()
    return tmp_path


# A child process compiling `small_graph`, running its kernels on fixed random inputs,
# and reporting the cache's counters, the output, and whether Numba got ready to compile
# (its array-math implementations are imported only for that).
CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    from test_kernel_cache import small_graph
    from purinec.codegen import cache, cpu
    graph = small_graph({batch})
    kernels = cpu.compile_kernels(graph)
    rng = np.random.default_rng(7)
    x = rng.standard_normal(graph.inputs[0].type.shape).astype(np.float32)
    w = rng.standard_normal(graph.inputs[1].type.shape).astype(np.float32)
    y, z = np.empty(({batch}, 5), np.float32), np.empty(({batch}, 5), np.float32)
    matmul, relu = graph.nodes
    kernels[matmul].fn(x, w, y)
    kernels[relu].fn(y, z)
    print(json.dumps({{**cache.STATS.as_dict(), "z": z.tolist(),
                      "ready_to_compile": "numba.np.arraymath" in sys.modules}}))
""")


def run_child(cache_dir, batch: int = 3) -> dict:
    env = dict(os.environ, PURINEC_CACHE_DIR=str(cache_dir))
    code = CHILD.format(tests=os.path.dirname(__file__), batch=batch)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_cache_lives_where_the_environment_says(monkeypatch, tmp_path):
    monkeypatch.delenv(cache.ENV_VAR, raising=False)
    assert cache.cache_dir() == cache.Path.home() / ".cache" / "purinec"
    monkeypatch.setenv(cache.ENV_VAR, str(tmp_path / "elsewhere"))
    assert cache.cache_dir() == tmp_path / "elsewhere"


def test_one_file_per_source_named_by_the_hash_of_its_code(cache_dir):
    node = small_graph().nodes[1]
    source = cpu.render(node)
    assert cpu.render(node) == source  # deterministic: the same node, the same text
    kernel = cpu.compile_node(node)
    code = cache.code_of(source)  # the text without its comment lines
    assert code.splitlines() == [line for line in source.splitlines()
                                 if not line.lstrip().startswith("#")]
    path = cache_dir / "cpu" / f"k_{cache.source_hash(code + cache.runtime_stamp('cpu'))}.py"
    assert kernel.path == path and path.read_text() == source == kernel.source
    assert len(cache.source_hash(code)) == 20
    again = cpu.compile_node(node)
    assert again.path == path and sorted(p.name for p in path.parent.glob("k_*.py")) == [path.name]


def test_a_changed_runtime_moves_every_kernel(cache_dir, tmp_path, monkeypatch, request):
    """Numba checks only a kernel's own file before it reuses its machine code, so a
    change to what kernels import from purinec (`cpu_runtime`, `cpu_gemm`, `cpu_window`)
    must give them new files, compiled afresh."""
    source = cpu.render(small_graph().nodes[1])
    before = cache.kernel_path(source)
    request.addfinalizer(cache.runtime_stamp.cache_clear)  # even if an assert fails
    originals = cache.RUNTIMES["cpu"]
    assert {path.name for path in originals} >= {"cpu_runtime.py", "cpu_gemm.py",
                                                 "cpu_window.py"}
    for k, original in enumerate(originals):
        changed = tmp_path / original.name
        changed.write_text(original.read_text() + "\n# changed\n")
        with_changed = (*originals[:k], changed, *originals[k + 1:])
        for runtime, moved in ((with_changed, True), (originals, False)):
            monkeypatch.setitem(cache.RUNTIMES, "cpu", runtime)
            cache.runtime_stamp.cache_clear()
            assert (cache.kernel_path(source) != before) == moved
            assert cache.kernel_path(source).parent == before.parent


def test_generated_files_say_which_ir_nodes_they_came_from(cache_dir):
    graph = small_graph()
    for node, kernel in cpu.compile_kernels(graph).items():
        text = kernel.path.read_text()
        assert node_comment(node) in text  # the IR line, attributes and # loc included
        assert "net.py:" in text


def test_a_later_process_loads_kernels_without_compiling(cache_dir):
    first = run_child(cache_dir)
    assert first["misses"] == 2 and first["compiles"] == 2
    index_files = list((cache_dir / "cpu" / "__pycache__").glob("*.nbi"))
    assert len(index_files) == 2  # Numba's cache index, one per kernel
    second = run_child(cache_dir)
    assert second["hits"] == 2 and second["misses"] == 0
    assert second["compiles"] == 0 and second["loads"] == 2
    assert second["z"] == first["z"]  # bit for bit: the same machine code
    # Loading cached code skips readying Numba to compile, a fifth of a warm start.
    assert first["ready_to_compile"] and not second["ready_to_compile"]


WARM_RUN = textwrap.dedent("""
    import sys
    import numpy as np
    import purinec
    program = purinec.load({artifact!r})
    program.run({{value.name: np.zeros(value.type.shape, value.type.dtype.numpy)
                 for value in program.eval_ir.inputs_with_role("data")}})
    print("numba.np.arraymath" in sys.modules)
""")


@pytest.mark.slow  # compiles lenet's inference kernels where the cache lacks them
def test_a_warm_run_of_an_artifact_never_readies_numba_to_compile(tmp_path):
    """Everything a saved program's run calls (its kernels, the GEMM they call, the
    team's functions) loads from Numba's cache without readying Numba to compile: that
    took a warm ``purinec run`` of lenet from 0.44 to 0.96 s when one part did not."""
    artifact = tmp_path / "lenet.purine"
    made = subprocess.run([sys.executable, "-m", "purinec", "compile", "lenet", "-o",
                           str(artifact)], capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr[-3000:]
    done = subprocess.run([sys.executable, "-c", WARM_RUN.format(artifact=str(artifact))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False"]


def test_a_corrupt_or_unreadable_file_is_rewritten(cache_dir):
    node = small_graph().nodes[1]
    kernel = cpu.compile_node(node)
    for damage in ("# not the kernel\n", b"\xff\xfe\x00 binary"):
        if isinstance(damage, bytes):
            kernel.path.write_bytes(damage)
        else:
            kernel.path.write_text(damage)
        before = cache.STATS.rewrites
        again = cpu.compile_node(node)
        assert cache.STATS.rewrites == before + 1
        assert again.path.read_text() == kernel.source
    x = np.array([[-1.0, 2.0, 0.5, -3.0, 4.0]] * 3, np.float32)
    out = np.empty_like(x)
    again.fn(x, out)
    np.testing.assert_array_equal(out, np.maximum(x, 0))


def test_a_kernel_file_damaged_before_any_import_is_not_trusted(cache_dir):
    """A file that is there but wrong, in a process that never imported it, is
    rewritten before it is imported."""
    node = small_graph(batch=4).nodes[0]
    source = cpu.render(node)
    path = cache.kernel_path(source)
    path.parent.mkdir(parents=True)
    path.write_text("raise SystemExit('this must never run')\n")
    kernel = cpu.compile_node(node)
    assert path.read_text() == source and kernel.source == source


def test_processes_writing_the_same_kernels_at_once_agree(cache_dir):
    env = dict(os.environ, PURINEC_CACHE_DIR=str(cache_dir))
    code = CHILD.format(tests=os.path.dirname(__file__), batch=6)
    children = [subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                for _ in range(3)]
    for child in children:
        _, err = child.communicate(timeout=300)
        assert child.returncode == 0, err
    sources = {kernel.path: kernel.source
               for kernel in cpu.compile_kernels(small_graph(6)).values()}
    for path, source in sources.items():
        assert path.read_text() == source
    assert not list((cache_dir / "cpu").glob("*.tmp"))  # no temporary file left behind


# Children that start compiling `small_graph` together, once the parent says go.
TOGETHER = textwrap.dedent("""
    import json, os, pathlib, sys, time
    sys.path.insert(0, {tests!r})
    from test_kernel_cache import small_graph
    from purinec.codegen import cache, cpu, cpu_gemm
    pathlib.Path({ready!r}).touch()
    while not os.path.exists({go!r}):
        time.sleep(0.001)
    {work}
""")
COMPILE_KERNELS = ("cpu.compile_kernels(small_graph(4)); "
                   "print(json.dumps(cache.STATS.as_dict()))")
# Whether this process found the GEMM's C function in Numba's cache (or compiled it).
READY_GEMM = "print(json.dumps({'loaded': cpu_gemm._compiled('tiled_sgemm').cache_hits}))"


def run_together(cache_dir, work: str, env: dict) -> list[dict]:
    """What two processes that start ``work`` at the same moment print last, as JSON."""
    go = cache_dir / "go"
    children, ready = [], []
    for k in range(2):
        ready.append(cache_dir / f"ready{k}")
        code = TOGETHER.format(tests=os.path.dirname(__file__), ready=str(ready[k]),
                               go=str(go), work=work)
        children.append(subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    deadline = time.monotonic() + 120
    while not all(path.exists() for path in ready) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()
    results = []
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_processes_compiling_the_same_kernels_at_once_compile_each_once(cache_dir):
    """One compiles each kernel; the other loads it from Numba's cache (without the
    lock both would compile both kernels: 4 compiles)."""
    env = dict(os.environ, PURINEC_CACHE_DIR=str(cache_dir))
    stats = run_together(cache_dir, COMPILE_KERNELS, env)
    assert sum(s["compiles"] for s in stats) == 2
    assert sum(s["loads"] for s in stats) == 2


def test_processes_needing_the_gemm_at_once_compile_it_once(cache_dir, tmp_path):
    """The GEMM's C function, which kernels link, is compiled by one of two processes
    that need it at once (a compile helper and its main process); the other loads it.
    Numba's cache starts empty (in a folder of its own) and the kernel cache's folder
    does not exist yet."""
    env = dict(os.environ, PURINEC_CACHE_DIR=str(cache_dir / "fresh"),
               NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    loaded = sorted(r["loaded"] for r in run_together(cache_dir, READY_GEMM, env))
    assert loaded == [0, 1]


def test_hits_and_misses_are_logged(cache_dir, caplog):
    node = small_graph(batch=5).nodes[1]
    with caplog.at_level("DEBUG", logger="purinec.codegen.cache"):
        cpu.compile_node(node)
        cpu.compile_node(node)
    messages = [r.getMessage() for r in caplog.records]
    assert any("miss" in m for m in messages) and any("hit" in m for m in messages)


def test_an_unwritable_cache_is_a_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(cache.ENV_VAR, str(blocker))
    with pytest.raises(cache.CacheError, match="PURINEC_CACHE_DIR"):
        cpu.compile_node(small_graph(batch=7).nodes[1])


# -- kernels shared by nodes that render to the same code --------------------------------

def by_op(graph: Graph) -> dict[str, list]:
    groups: dict[str, list] = {}
    for node in graph.nodes:
        groups.setdefault(node.op, []).append(node)
    return groups


def test_nodes_with_the_same_code_share_one_file_and_one_compile(cache_dir):
    graph = twin_graph()
    kernels = cpu.compile_kernels(graph)
    assert cache.STATS.compiles == 3 and cache.STATS.misses == 3
    assert len(list((cache_dir / "cpu").glob("k_*.py"))) == 3
    for first, second in by_op(graph).values():
        a, b = kernels[first], kernels[second]
        assert a is not b and a.dispatcher is b.dispatcher  # each runs its own size
        assert a.path == b.path and cache.code_of(a.source) == cache.code_of(b.source)
        # each kernel's source quotes its own node; the file, the node it was made for
        assert node_comment(first) in a.source and node_comment(second) in b.source
        assert node_comment(second) not in a.source
        assert a.path.read_text() == a.source
        assert b.nodes == ((second,) if second.body is None else tuple(second.body))
    assert [kernels[n].name for n in by_op(graph)["fused"]] == [
        "fused_bias_add_tanh", "fused_bias_add_tanh_1"]


def test_shared_kernels_compute_each_node(cache_dir):
    graph = twin_graph(batch=4)
    kernels = cpu.compile_kernels(graph)
    rng = np.random.default_rng(0)
    w = rng.normal(size=(5, 4)).astype(np.float32)
    b = rng.normal(size=5).astype(np.float32)
    for k, (matmul, relu, fused) in enumerate(zip(*by_op(graph).values())):
        x = rng.normal(size=(4, 4)).astype(np.float32)
        y, z, t = (np.empty((4, 5), np.float32) for _ in range(3))
        kernels[matmul].fn(x, w, y)
        kernels[relu].fn(y, z)
        kernels[fused].fn(z, b, t)
        want = np.tanh(np.maximum(x.astype(np.float64) @ w.T, 0) + b)
        np.testing.assert_allclose(t, want, rtol=1e-5, atol=1e-6)


def sized_graph(sizes) -> Graph:
    """The same elementwise op (relu_grad) on arrays of several shapes and ranks."""
    g = Graph("sized")
    outputs = []
    for k, shape in enumerate(sizes):
        x = g.add_input(f"x{k}", TensorType(shape, DType.f32))
        dy = g.add_input(f"dy{k}", TensorType(shape, DType.f32))
        dx = g.add_node("relu_grad", [x, dy], names=[f"dx{k}"]).outputs[0]
        outputs.append((f"dx{k}", dx))
    g.set_outputs(outputs)
    return g


@pytest.mark.parametrize("options", [cpu.CpuOptions(), cpu.CpuOptions(parallel_min=0)],
                         ids=["whole", "blocked"])
def test_elementwise_nodes_differing_in_size_only_share_their_compiled_code(cache_dir,
                                                                            options):
    """A flat elementwise loop reads its length from its arrays: relu_grad at any size
    is one file and one compile per rank (the code names its arguments' ranks), each
    node run over its own size and, blocked, in its own blocks."""
    sizes = [(3, 7), (64, 50), (2, 3, 4, 5), (6, 5, 4, 3)]
    graph = sized_graph(sizes)
    kernels = cpu.compile_kernels(graph, options)
    assert cache.STATS.compiles == 2  # rank 2 and rank 4
    assert len({k.path for k in kernels.values()}) == 2
    rng = np.random.default_rng(3)
    for node, shape in zip(graph.nodes, sizes):
        x, dy = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
        dx = np.full(shape, np.nan, np.float32)
        kernels[node].fn(x, dy, dx)
        np.testing.assert_array_equal(dx, np.where(x > 0, dy, np.float32(0)))
    with pytest.raises(ValueError, match="must be"):  # each checks its own node's shapes
        kernels[graph.nodes[0]].fn(*(np.zeros((64, 50), np.float32) for _ in range(3)))


def pooling_graph(shapes) -> Graph:
    """2x2 max pooling of several sizes, and its gradient (ceil mode: the last window
    of an odd size hangs out)."""
    g = Graph("pooled")
    outputs = []
    attrs = {"kernel": [2, 2], "stride": [2, 2]}
    for k, shape in enumerate(shapes):
        x = g.add_input(f"x{k}", TensorType(shape, DType.f32))
        y = g.add_node("max_pool2d", [x], attrs, names=[f"y{k}"]).outputs[0]
        gy = g.add_input(f"gy{k}", y.type)
        gx = g.add_node("max_pool2d_grad", [x, y, gy], attrs, names=[f"gx{k}"]).outputs[0]
        outputs += [(f"y{k}", y), (f"gx{k}", gx)]
    g.set_outputs(outputs)
    return g


@pytest.mark.parametrize("options", [cpu.CpuOptions(), cpu.CpuOptions(parallel_min=0)],
                         ids=["whole", "blocked"])
def test_pooling_at_every_batch_shares_its_compiled_code(cache_dir, options):
    """Pooling reads how many planes it has from its arrays: a layer's code serves
    every batch size and channel count, each node run over its own planes; a plane's
    size is in the code."""
    shapes = [(2, 3, 7, 7), (4, 2, 7, 7), (1, 1, 7, 7), (2, 2, 6, 8)]
    graph = pooling_graph(shapes)
    kernels = cpu.compile_kernels(graph, options)
    assert cache.STATS.compiles == 4  # max_pool2d and its gradient for 7x7, for 6x8
    rng = np.random.default_rng(7)
    attrs = {"kernel": [2, 2], "stride": [2, 2], "pad": [0, 0], "dilation": [1, 1],
             "ceil_mode": True}
    for pool, grad in zip(graph.nodes[::2], graph.nodes[1::2]):
        x = rng.standard_normal(pool.inputs[0].type.shape).astype(np.float32)
        (want,) = nnref.max_pool2d(x, **attrs)
        y = np.full(want.shape, np.nan, np.float32)
        kernels[pool].fn(x, y)
        np.testing.assert_array_equal(y, want)
        gy = rng.standard_normal(y.shape).astype(np.float32)
        (want_gx,) = nnref.max_pool2d_grad(x, y, gy, **attrs)
        gx = np.full(x.shape, np.nan, np.float32)
        kernels[grad].fn(x, y, gy, gx)
        np.testing.assert_allclose(gx, want_gx, rtol=1e-6, atol=1e-6)


def conv_graph(sizes) -> Graph:
    """For each (batch, channels in, channels out): a 3x3 "same" convolution of 6x6
    images fused with its bias and relu, and both its gradients."""
    g = Graph("convolved")
    outputs = []
    attrs = {"stride": [1, 1], "pad": [1, 1], "groups": 1, "dilation": [1, 1]}
    for k, (n, c, o) in enumerate(sizes):
        x = g.add_input(f"x{k}", TensorType((n, c, 6, 6), DType.f32))
        w = g.add_input(f"w{k}", TensorType((o, c, 3, 3), DType.f32))
        b = g.add_input(f"b{k}", TensorType((o,), DType.f32))
        conv = g.make_node("conv2d", [x, w], attrs, names=[f"conv{k}"])
        biased = g.make_node("bias_add", [conv.outputs[0], b], {}, names=[f"biased{k}"])
        relu = g.make_node("relu", biased.outputs, {}, names=[f"relu{k}"])
        g.add_fused([conv, biased, relu], [x, w, b], relu.outputs, "fused_conv2d_relu")
        gy = g.add_input(f"gy{k}", conv.outputs[0].type)
        gx = g.add_node("conv2d_grad_input", [gy, w],
                        {**attrs, "input_shape": [n, c, 6, 6]}, names=[f"gx{k}"])
        gw = g.add_node("conv2d_grad_weight", [x, gy], {**attrs, "kernel": [3, 3]},
                        names=[f"gw{k}"])
        outputs += [(f"relu{k}", relu.outputs[0]), (f"gx{k}", gx.outputs[0]),
                    (f"gw{k}", gw.outputs[0])]
    g.set_outputs(outputs)
    return g


@pytest.mark.parametrize("options", [cpu.CpuOptions(), cpu.CpuOptions(
    parallel_min=0, parallel_min_products=0)], ids=["whole", "blocked"])
def test_convolutions_at_every_batch_and_channel_count_share_their_code(cache_dir,
                                                                         options):
    """A convolution reads its batch and channel counts from its arrays (the image and
    kernel sizes are in the code): convolutions differing in those only, as an
    inception module's branches do, are one file and one compile for the fused
    forward, one for each gradient, each node run over its own sizes."""
    sizes = [(2, 3, 7), (3, 5, 8), (2, 4, 11)]  # more channels out than in, fewer than 4
    graph = conv_graph(sizes)                     # images: the same algorithms for all
    kernels = cpu.compile_kernels(graph, options)
    assert cache.STATS.compiles == 3
    assert len({kernels[node].path for node in graph.nodes}) == 3
    rng = np.random.default_rng(11)
    attrs = {"stride": [1, 1], "pad": [1, 1], "dilation": [1, 1], "groups": 1}
    for k, (n, c, o) in enumerate(sizes):
        fused, grad_input, grad_weight = graph.nodes[3 * k:3 * k + 3]
        x, gy = (rng.standard_normal(shape).astype(np.float32)
                 for shape in ((n, c, 6, 6), (n, o, 6, 6)))
        w, b = rng.standard_normal((o, c, 3, 3)).astype(np.float32), rng.standard_normal(o)
        (conv,) = nnref.conv2d(x, w, **attrs)
        results = {}
        for node, inputs, shape in ((fused, (x, w, b.astype(np.float32)), (n, o, 6, 6)),
                                    (grad_input, (gy, w), (n, c, 6, 6)),
                                    (grad_weight, (x, gy), (o, c, 3, 3))):
            results[node] = np.full(shape, np.nan, np.float32)
            kernels[node].fn(*inputs, results[node])
        np.testing.assert_allclose(results[fused],
                                   np.maximum(conv + b[:, None, None], 0), rtol=1e-4,
                                   atol=1e-4)
        (want_gx,) = nnref.conv2d_grad_input(gy, w, input_shape=[n, c, 6, 6], **attrs)
        np.testing.assert_allclose(results[grad_input], want_gx, rtol=1e-4, atol=1e-4)
        (want_gw,) = nnref.conv2d_grad_weight(x, gy, kernel=[3, 3], **attrs)
        np.testing.assert_allclose(results[grad_weight], want_gw, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="must be"):  # each checks its own node's shapes
        kernels[graph.nodes[1]].fn(gy, w, np.zeros((2, 3, 6, 6), np.float32))


def data_movement_graph(shapes) -> Graph:
    """For each (batch, channels of part one, of part two): their concat along the
    channels, its split back, and a reshape of it to one row per image."""
    g = Graph("moved")
    outputs = []
    for k, (n, c1, c2) in enumerate(shapes):
        a = g.add_input(f"a{k}", TensorType((n, c1, 3, 4), DType.f32))
        b = g.add_input(f"b{k}", TensorType((n, c2, 3, 4), DType.f32))
        (joined,) = g.add_node("concat", [a, b], {"axis": 1}, names=[f"j{k}"]).outputs
        back = g.add_node("split", [joined], {"axis": 1, "sections": [c2, c1]},
                          names=[f"s{k}", f"t{k}"]).outputs
        (flat,) = g.add_node("reshape", [joined], {"shape": [n, (c1 + c2) * 12]},
                             names=[f"f{k}"]).outputs
        outputs += [(v.name, v) for v in (joined, *back, flat)]
    g.set_outputs(outputs)
    return g


@pytest.mark.parametrize("options", [cpu.CpuOptions(), cpu.CpuOptions(parallel_min=0)],
                         ids=["whole", "blocked"])
def test_concat_split_and_reshape_serve_every_batch_and_channel_count(cache_dir, options):
    """concat and split read the batch and each part's channels from their arrays
    (an image's size is in the code), reshape its length: one compile each."""
    shapes = [(2, 3, 5), (4, 1, 2), (3, 6, 6)]  # (a batch of 1 is not split in blocks)
    graph = data_movement_graph(shapes)
    kernels = cpu.compile_kernels(graph, options)
    assert cache.STATS.compiles == 3
    rng = np.random.default_rng(13)
    for k, (n, c1, c2) in enumerate(shapes):
        concat, split, reshape = graph.nodes[3 * k:3 * k + 3]
        a, b = (rng.standard_normal((n, c, 3, 4)).astype(np.float32) for c in (c1, c2))
        joined = np.full((n, c1 + c2, 3, 4), np.nan, np.float32)
        kernels[concat].fn(a, b, joined)
        np.testing.assert_array_equal(joined, np.concatenate([a, b], axis=1))
        parts = [np.full((n, c, 3, 4), np.nan, np.float32) for c in (c2, c1)]
        kernels[split].fn(joined, *parts)
        np.testing.assert_array_equal(parts[0], joined[:, :c2])
        np.testing.assert_array_equal(parts[1], joined[:, c2:])
        flat = np.full((n, (c1 + c2) * 12), np.nan, np.float32)
        kernels[reshape].fn(joined, flat)
        np.testing.assert_array_equal(flat, joined.reshape(n, -1))


def updates_graph(shapes) -> Graph:
    """One horizontal group: an sgd update of a parameter of each shape."""
    g = Graph("updates")
    members, inputs = [], []
    for k, shape in enumerate(shapes):
        w, h, grad = (g.add_input(f"{name}{k}", TensorType(shape, DType.f32))
                      for name in ("w", "h", "g"))
        members.append(g.make_node("sgd", [w, h, grad],
                                   {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
                                   names=[f"w{k}.next", f"h{k}.next"]))
        inputs += [w, h, grad]
    outputs = [v for member in members for v in member.outputs]
    g.add_fused(members, inputs, outputs, f"fused_sgd_x{len(shapes)}")
    g.set_outputs([(v.name, v) for v in outputs])
    return g


def test_a_horizontal_groups_members_share_one_kernel_at_every_size(cache_dir):
    """Each member of a horizontal group is a kernel of its own over 1-D views of its
    arrays, so updates of every size and rank compile once (but a 1-element one, whose
    code has no loop); on a warm cache each part loads at its first call."""
    shapes = [(3, 4), (5,), (), (70, 8, 3, 3)]
    graph = updates_graph(shapes)
    (node,) = graph.nodes
    kernel = cpu.compile_kernels(graph)[node]
    assert cache.STATS.compiles == 2
    assert len(kernel.parts) == len(shapes) and len({k.path for k in kernel.parts}) == 2
    assert kernel.parts[0].path == kernel.parts[1].path == kernel.parts[3].path
    assert kernel.source.count("def sgd(") == len(shapes)
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(shape).astype(np.float32)
              for shape in shapes for _ in range(3)]
    want = []
    for w, h, grad in zip(*[iter(arrays)] * 3):
        history = 0.9 * h.astype(np.float64) + 0.1 * (grad + 0.01 * w.astype(np.float64))
        want += [w - history, history]
    for run in (kernel.fn, cpu.kernel_calls(graph)[node]):  # compiled; loaded when warm
        outputs = [np.full(w.shape, np.nan, np.float32) for w in want]
        run(*arrays, *outputs)
        for got, expected in zip(outputs, want):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert cache.STATS.compiles == 2
    with pytest.raises(ValueError, match="must be"):  # the node's own shapes, checked
        kernel.fn(*arrays[3:], *arrays[:3], *outputs)


def test_a_file_another_node_wrote_is_shared_and_kept(cache_dir):
    first, second = by_op(twin_graph(batch=5))["relu"]
    kernel = cpu.compile_node(first)
    written = kernel.path.stat().st_mtime_ns, kernel.path.read_text()
    other = cpu.compile_node(second)
    assert other.path == kernel.path and other.source != kernel.source
    assert (kernel.path.stat().st_mtime_ns, kernel.path.read_text()) == written
    assert cache.STATS.hits == 1 and cache.STATS.rewrites == 0


def test_comments_that_change_the_code_are_not_trusted(cache_dir):
    """Same code, but a comment declaring the encoding: Python would read the file
    differently, so it is rewritten."""
    node = small_graph(batch=8).nodes[1]
    source = cpu.render(node)
    path = cache.kernel_path(source)
    path.parent.mkdir(parents=True)
    path.write_text("# -*- coding: latin-1 -*-\n" + source)
    kernel = cpu.compile_node(node)
    assert cache.STATS.rewrites == 1 and path.read_text() == source == kernel.source
    assert source.splitlines()[:2] == list(HEADER)


# A child process compiling `twin_graph`, with every value renamed, and reporting the
# cache's counters and where its kernels live.
TWIN_CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from test_kernel_cache import twin_graph
    from purinec.codegen import cache, cpu
    graph = twin_graph()
    for value in graph.values():
        value.name = "renamed_" + value.name
    kernels = cpu.compile_kernels(graph)
    print(json.dumps({{"stats": cache.STATS.as_dict(),
                      "paths": sorted({{str(k.path) for k in kernels.values()}})}}))
""")


# A process that holds the lock of the kernel whose source is in file argv[1].
HOLDER = textwrap.dedent("""
    import sys, time
    from purinec.codegen import cache
    with cache.one_compiler(open(sys.argv[1]).read()):
        print("holding", flush=True)
        time.sleep(600)
""")


def wait_for(condition, what: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_kernel_another_process_holds_is_taken_last_and_freed_if_that_process_dies(
        cache_dir):
    graph = small_graph(7)
    held, free = (cpu.render_module(node) for node in graph.nodes)
    (cache_dir / "cpu").mkdir()
    (cache_dir / "held.py").write_text(held.text())
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(cache_dir / "held.py")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        made = {}
        compiling = threading.Thread(target=lambda: made.update(cpu.compile_kernels(graph)))
        compiling.start()
        wait_for(lambda: cache.compiled_on_disk(free.text(), free.function),
                 "the kernel nobody holds")
        assert compiling.is_alive()
        assert not cache.compiled_on_disk(held.text(), held.function)
    finally:
        holder.kill()  # dies holding the lock: the operating system releases it
        holder.wait()
    compiling.join(120)
    assert not compiling.is_alive() and len(made) == 2
    assert cache.STATS.compiles == 2  # this process compiled the held kernel itself
    x = np.random.default_rng(1).normal(size=(7, 4)).astype(np.float32)
    w = np.random.default_rng(2).normal(size=(5, 4)).astype(np.float32)
    y, z = np.empty((7, 5), np.float32), np.empty((7, 5), np.float32)
    matmul, relu = graph.nodes
    made[matmul].fn(x, w, y)
    made[relu].fn(y, z)
    np.testing.assert_allclose(z, np.maximum(x.astype(np.float64) @ w.T, 0), rtol=1e-5,
                               atol=1e-6)


def test_a_helper_compiles_its_jobs_into_numbas_cache_for_later_processes(cache_dir):
    modules = [cpu.render_module(node) for node in twin_graph(batch=6).nodes]
    jobs = {cache.code_of(job.source): job for job in map(cpu._job, modules)}
    assert len(jobs) == 3
    listing = cache_dir / "jobs.json"
    listing.write_text(json.dumps([[j.source, j.function, j.arrays, j.blocked, j.links]
                                   for j in jobs.values()]))
    done = subprocess.run([sys.executable, "-m", compile_helpers.__name__, str(listing)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert all(job.compiled_on_disk() for job in jobs.values())
    kernels = cpu.compile_kernels(twin_graph(batch=6))
    assert cache.STATS.compiles == 0 and cache.STATS.loads == 3 and len(kernels) == 6


def test_a_kernel_linking_the_gemm_another_process_compiles_is_known_to_wait(cache_dir):
    """While another process holds the GEMM's lock (compiling it), a kernel module that
    imports it would wait; one that does not, or once the lock is free, would not."""
    from purinec.codegen.cpu_gemm import linked

    gemm = linked("import numpy as np\nfrom purinec.codegen.cpu_gemm import tiled_sgemm\n")
    assert gemm == ("purinec_tiled_sgemm",) and linked("import numpy as np\n") == ()
    (cache_dir / "symbol").write_text(gemm[0])
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(cache_dir / "symbol")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        assert compile_helpers.compiling_elsewhere(gemm)
        assert not compile_helpers.compiling_elsewhere(())
    finally:
        holder.kill()
        holder.wait()
    assert not compile_helpers.compiling_elsewhere(gemm)


def test_a_helper_takes_kernels_waiting_on_the_gemm_after_the_others(monkeypatch):
    """Not sitting out the GEMM's compile in another process: a helper compiles the
    kernels that do not link it first."""
    jobs = [compile_helpers.Job(f"# {k}", f"kernel{k}", (), False,
                                ("purinec_tiled_sgemm",) if k in (0, 2) else ())
            for k in range(4)]
    taken = []
    monkeypatch.setattr(compile_helpers, "compiling_elsewhere", lambda links: bool(links))
    monkeypatch.setattr(compile_helpers, "_take", lambda job: taken.append(job.function))
    compile_helpers.work_through(jobs)
    assert taken == ["kernel1", "kernel3", "kernel0", "kernel2"]


def test_helpers_share_the_compiling_and_are_gone_when_it_ends(cache_dir, monkeypatch):
    monkeypatch.setenv(compile_helpers.JOBS_VAR, "3")
    started = []
    start = compile_helpers._start

    def recorded(listing):
        helper = start(listing)
        started.append(helper)
        return helper

    monkeypatch.setattr(compile_helpers, "_start", recorded)
    graph = twin_graph(batch=8)
    kernels = cpu.compile_kernels(graph)
    assert len(started) == 2  # 3 kernels to compile, 3 processes: this one and 2 helpers
    assert all(helper.returncode is not None for helper in started)
    # each kernel made once: compiled here, or by a helper and loaded here
    assert cache.STATS.compiles + cache.STATS.loads == 3
    assert len(kernels) == 6 and all(k.path.read_text() for k in kernels.values())
    again = cpu.compile_kernels(twin_graph(batch=8))  # all in the cache: no helpers
    assert len(started) == 2 and len(again) == 6


def test_kernels_in_numbas_own_cache_dir_are_found_there(cache_dir, monkeypatch):
    from numba.core import config

    monkeypatch.setattr(config, "CACHE_DIR", str(cache_dir / "numba"))  # $NUMBA_CACHE_DIR
    module = cpu.render_module(small_graph(9).nodes[1])
    assert not cache.compiled_on_disk(module.text(), module.function)
    cpu.compile_module(module)
    assert cache.compiled_on_disk(module.text(), module.function)
    assert list((cache_dir / "numba").rglob("*.nbi"))
    assert not list((cache_dir / "cpu").rglob("*.nbi"))


@pytest.mark.parametrize("setting, jobs", [("1", 1), ("4", 4), ("0", 1), ("many", 1)])
def test_compile_jobs_follow_the_environment(monkeypatch, caplog, setting, jobs):
    monkeypatch.setenv(compile_helpers.JOBS_VAR, setting)
    assert compile_helpers.compile_jobs() == jobs
    assert ("is not a count" in caplog.text) == (setting == "many")


def test_a_later_process_shares_kernels_made_for_other_nodes(cache_dir):
    kernels = cpu.compile_kernels(twin_graph())
    texts = {k.path: k.path.read_text() for k in kernels.values()}
    env = dict(os.environ, PURINEC_CACHE_DIR=str(cache_dir))
    code = TWIN_CHILD.format(tests=os.path.dirname(__file__))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    child = json.loads(done.stdout.strip().splitlines()[-1])
    assert child["paths"] == sorted(str(p) for p in texts)
    assert child["stats"]["compiles"] == 0 and child["stats"]["loads"] == 3
    assert child["stats"]["misses"] == 0
    assert {p: p.read_text() for p in texts} == texts  # still the first nodes' comments


STARTUP_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    from numba import njit
    sys.path.insert(0, {tests!r})
    from test_kernel_cache import small_graph
    from purinec.codegen import cpu
    cpu.compile_kernels(small_graph())
    hidden = "scipy.linalg" not in sys.modules

    @njit
    def product(a, b):
        return np.dot(a, b)

    a = np.arange(6.0).reshape(2, 3)
    print(hidden, np.array_equal(product(a, a.T), a @ a.T))
""")


def test_numba_starts_without_scipy_linalg_which_still_works_after(cache_dir):
    env = {k: v for k, v in os.environ.items() if k != "PURINEC_CPU_BLAS"}
    code = STARTUP_CHILD.format(tests=os.path.dirname(__file__))
    done = subprocess.run([sys.executable, "-c", code], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]


@pytest.mark.parametrize("style", [progress.BAR, progress.LINES, None])
def test_a_slow_compile_shows_its_progress_when_asked(cache_dir, monkeypatch, capsys, style):
    """The command line asks for a bar (a terminal) or lines (a log); the bar appears once
    compiling has taken a second, the log's first line after LINE_AFTER_S (here each
    kernel is made to take 0.6 s), and nothing when not asked."""
    compile_module = cpu.compile_module

    def slow_compile(*args, **kwargs):
        time.sleep(0.6)
        return compile_module(*args, **kwargs)

    monkeypatch.setattr(cpu, "compile_module", slow_compile)
    monkeypatch.setattr(progress, "LINE_AFTER_S", 0.3)
    with progress.kernel_progress(style):
        kernels = cpu.compile_kernels(small_graph())
    assert len(kernels) == 2
    err = capsys.readouterr().err
    if style == progress.BAR:
        assert "kernels of cached" in err and "2/2" in err
    elif style == progress.LINES:
        lines = err.splitlines()
        assert lines[0] == "purinec: compiling 2 kernels of cached (cold kernel cache) ..."
        assert re.fullmatch(r"purinec: compiled 2 kernels of cached in \d+\.\d s "
                            r"\(0 cached\)", lines[1]), err
        assert len(lines) == 2
    else:
        assert err == ""
