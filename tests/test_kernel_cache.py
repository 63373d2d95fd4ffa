"""The kernel cache: generated sources on disk, found again by later processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from purinec.codegen import cache, cpu
from purinec.codegen.source import node_comment
from purinec.ir.graph import Graph
from purinec.ir.types import DType, TensorType


def small_graph(batch: int = 3) -> Graph:
    g = Graph("cached")
    x = g.add_input("x", TensorType((batch, 4), DType.f32))
    w = g.add_input("w", TensorType((5, 4), DType.f32), role="param")
    y = g.add_node("matmul", [x, w], {"trans_b": True}, names=["y"], loc="net.py:3").outputs[0]
    z = g.add_node("relu", [y], names=["z"], loc="net.py:4").outputs[0]
    g.set_outputs([("z", z)])
    return g


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_VAR, str(tmp_path))
    return tmp_path


# A child process compiling `small_graph` and reporting the cache's counters.
CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from test_kernel_cache import small_graph
    from purinec.codegen import cache, cpu
    kernels = cpu.compile_kernels(small_graph({batch}))
    print(json.dumps(cache.STATS.as_dict()))
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


def test_one_file_per_source_named_by_its_hash(cache_dir):
    node = small_graph().nodes[1]
    source = cpu.render(node)
    assert cpu.render(node) == source  # deterministic: the same node, the same text
    kernel = cpu.compile_node(node)
    path = cache_dir / "cpu" / f"k_{cache.source_hash(source)}.py"
    assert kernel.path == path and path.read_text() == source == kernel.source
    assert len(cache.source_hash(source)) == 20
    again = cpu.compile_node(node)
    assert again.path == path and sorted(p.name for p in path.parent.glob("k_*.py")) == [path.name]


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
