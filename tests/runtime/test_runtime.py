"""The runtime: plans, execution by counting, failures and traces, on random DAGs.

Random graphs are built from registry ops (elementwise, binary, matmul, reshape, concat,
split, sgd) with random devices, and run with the reference adapter as kernels, so
every result must equal `purinec.runtime.reference.execute` bitwise.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import threading
import time
from typing import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from purinec.errors import ExecutionError, PurinecError, VerifyError
from purinec.ir.graph import Graph, Node
from purinec.ir.types import DType, Device, TensorType
from purinec.runtime import plan as plan_module
from purinec.runtime.devices import Lane
from purinec.runtime.executor import Executable
from purinec.runtime.memory import is_view, plan_memory
from purinec.runtime.plan import reference_kernel, reference_kernels
from purinec.runtime.reference import execute
from purinec.runtime.trace import Trace

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

F32 = DType.f32
SHAPES = [(2, 3), (3, 2), (2, 2), (3, 3), (6,), (4,), (1, 6)]
UNARY = [("relu", {}), ("sigmoid", {}), ("tanh", {}), ("scale", {"alpha": 0.5}),
         ("add_scalar", {"value": 1.0})]


# ---------------------------------------------------------------------------------------
# Random graphs.


class _Builder:
    def __init__(self, rng: np.random.Generator, graph: Graph, devices: list[Device]):
        self.rng, self.graph, self.devices = rng, graph, devices
        self.pool = []

    def pick(self, want=lambda v: True):
        candidates = [v for v in self.pool if want(v)]
        return candidates[self.rng.integers(len(candidates))] if candidates else None

    def same_type(self, value):
        return self.pick(lambda v: v.type == value.type) or value

    def add_random_node(self) -> None:
        rng = self.rng
        kind = rng.choice(["unary", "binary", "matmul", "reshape", "concat", "split"])
        a = self.pick()
        if kind == "matmul" and a.type.rank == 2:
            b = self.pick(lambda v: v.type.rank == 2 and v.type.shape[0] == a.type.shape[1])
            op, inputs, attrs = "matmul", [a, b], {}
            if b is None:  # a @ a^T always fits
                inputs, attrs = [a, a], {"trans_b": True}
        elif kind == "binary":
            op, inputs, attrs = str(rng.choice(["add", "sub", "mul"])), [a, self.same_type(a)], {}
        elif kind == "reshape":
            size = a.type.size
            shapes = [[size], [1, size], [size, 1]]
            if a.type.rank == 2:
                shapes.append(list(a.type.shape[::-1]))
            op, inputs, attrs = "reshape", [a], {"shape": shapes[rng.integers(len(shapes))]}
        elif kind == "concat" and a.type.size <= 12:
            operands = [a, self.same_type(a)] + ([a] if rng.random() < 0.3 else [])
            op, inputs, attrs = "concat", operands, {"axis": int(rng.integers(a.type.rank))}
        elif kind == "split" and max(a.type.shape) >= 2:
            axis = int(rng.choice([i for i, d in enumerate(a.type.shape) if d >= 2]))
            first = int(rng.integers(1, a.type.shape[axis]))
            op, inputs, attrs = "split", [a], {"axis": axis,
                                               "sections": [first, a.type.shape[axis] - first]}
        else:
            op, attrs = UNARY[rng.integers(len(UNARY))]
            inputs = [a]
        device = self.devices[rng.integers(len(self.devices))]
        node = self.graph.add_node(op, inputs, attrs, device=device)
        self.pool.extend(node.outputs)


def random_graph(seed: int, n_nodes: int = 12, n_devices: int = 1) -> Graph:
    """A random DAG with data inputs, params updated in several ways, and outputs."""
    rng = np.random.default_rng(seed)
    graph = Graph(f"random{seed}")
    devices = [Device("cpu", i) for i in range(n_devices)]
    build = _Builder(rng, graph, devices)

    def random_type():
        return TensorType(SHAPES[rng.integers(len(SHAPES))], F32)

    for i in range(rng.integers(1, 3)):
        build.pool.append(graph.add_input(f"x{i}", random_type()))
    params = [graph.add_input(f"w{i}", random_type(), role="param")
              for i in range(rng.integers(0, 3))]
    build.pool += params
    for _ in range(n_nodes):
        build.add_random_node()
    outputs = []
    for w in params:
        update = rng.choice(["sgd", "add", "concat", "keep"])
        device = devices[rng.integers(n_devices)]
        if update == "sgd":
            history = graph.add_input(f"{w.name}.history", w.type, role="state")
            node = graph.add_node("sgd", [w, history, build.same_type(w)],
                                  {"lr": 0.1, "momentum": 0.9}, device=device)
            outputs += [(w.name, node.outputs[0]), (history.name, node.outputs[1])]
        elif update == "add":
            node = graph.add_node("add", [w, build.same_type(w)], device=device)
            outputs.append((w.name, node.outputs[0]))
        elif update == "concat":  # not elementwise: the update needs a fresh array
            node = graph.add_node("concat", [w], {"axis": 0}, device=device)
            outputs.append((w.name, node.outputs[0]))
        else:
            outputs.append((w.name, w))
        if update != "keep":
            build.pool.extend(node.outputs)
    for _ in range(rng.integers(0, 4)):  # late readers, possibly of the old params
        build.add_random_node()
    for i in range(rng.integers(1, 4)):
        outputs.append((f"out{i}", build.pick()))
    graph.set_outputs(outputs)
    return graph


def random_env(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {v.name: rng.standard_normal(v.type.shape).astype(v.type.dtype.numpy)
            for v in graph.inputs}


def copied(env):
    return {k: v.copy() for k, v in env.items()}


def assert_same(expected: dict, actual: dict) -> None:
    assert set(expected) == set(actual)
    for name in expected:
        assert actual[name].dtype == expected[name].dtype, name
        np.testing.assert_array_equal(actual[name], expected[name], err_msg=name)


def next_env(graph: Graph, env: dict, outputs: dict) -> dict:
    """The env of the next iteration: params and state replaced by their updates."""
    new = dict(env)
    for v in graph.inputs_with_role("param", "state"):
        if v.name in outputs:
            new[v.name] = outputs[v.name]
    return new


def call_with_timeout(fn, *args, timeout: float = 30.0):
    """Call fn in a helper thread so a hang fails the test instead of blocking it."""
    result = {}

    def target():
        try:
            result["value"] = fn(*args)
        except BaseException as err:  # handed to the test
            result["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "the executable did not return"
    return result


class Recorder:
    """Wraps kernels to log when each starts and ends, from any thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.log: list[tuple[str, Node]] = []

    def wrap(self, node: Node, fn):
        def kernel(*arrays):
            with self.lock:
                self.log.append(("start", node))
            fn(*arrays)
            with self.lock:
                self.log.append(("end", node))
        return kernel

    def kernels(self, graph: Graph):
        return {node: self.wrap(node, fn) for node, fn in reference_kernels(graph).items()}


def producer_tasks(value, elided=frozenset()) -> list[Node]:
    """The nodes whose kernels write ``value``'s memory: its producer (through views), or
    for a concat whose inputs were computed in place (``elided``), their producers."""
    node = value.producer
    while node is not None and is_view(node):
        node = node.inputs[0].producer
    if node in elided:
        return [p for v in node.inputs for p in producer_tasks(v, elided)]
    return [] if node is None else [node]


def check_log(graph: Graph, log: list, elided=frozenset()) -> None:
    """Every kernel node (not a view, not an ``elided`` concat) started and ended
    exactly once, after all its inputs' producers."""
    kernel_nodes = [n for n in graph.nodes if not is_view(n) and n not in elided]
    starts = {node: i for i, (what, node) in enumerate(log) if what == "start"}
    ends = {node: i for i, (what, node) in enumerate(log) if what == "end"}
    assert len(log) == 2 * len(kernel_nodes)
    assert set(starts) == set(ends) == set(kernel_nodes)
    for node in kernel_nodes:
        for value in node.inputs:
            for producer in producer_tasks(value, elided):
                assert ends[producer] < starts[node], f"{node!r} ran before {producer!r}"


# ---------------------------------------------------------------------------------------
# Random DAGs: exactly once, in order, same results as the reference.


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n_nodes=st.integers(1, 20),
       n_devices=st.integers(1, 3), workers=st.integers(1, 3),
       order=st.one_of(st.none(), st.integers(0, 2**32 - 1)))
def test_random_dags_run_each_task_once_after_its_inputs(seed, n_nodes, n_devices, workers,
                                                        order):
    graph = random_graph(seed, n_nodes, n_devices)
    recorder = Recorder()
    exe = Executable(graph, recorder.kernels(graph), workers=workers,
                     order=None if order is None else random.Random(order))
    env = random_env(graph, seed)
    with np.errstate(all="ignore"):
        for _ in range(2):  # two iterations, state carried as a program would
            expected = execute(graph, copied(env))
            recorder.log.clear()
            outputs = exe(copied(env))
            check_log(graph, recorder.log, exe.plan.memory.elided)
            assert_same(expected, outputs)
            env = next_env(graph, env, outputs)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n_devices=st.integers(1, 3),
       workers=st.integers(1, 3))
def test_repeated_calls_give_the_same_results(seed, n_devices, workers):
    graph = random_graph(seed, 10, n_devices)
    exe = Executable(graph, reference_kernels(graph), workers=workers)
    env = random_env(graph, seed)
    with np.errstate(all="ignore"):
        expected = execute(graph, copied(env))
        first = exe(copied(env))
        second = exe(copied(env))
    assert_same(expected, first)
    assert_same(expected, second)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1))
def test_a_random_order_gives_the_same_results(seed):
    graph = random_graph(seed, 15, 2)
    env = random_env(graph, seed)
    with np.errstate(all="ignore"):
        expected = execute(graph, copied(env))
        for order in range(3):
            exe = Executable(graph, reference_kernels(graph), order=random.Random(order))
            assert_same(expected, exe(copied(env)))


# ---------------------------------------------------------------------------------------
# Failures.


class Boom(RuntimeError):
    pass


def failing_once(fn):
    state = {"failed": False}

    def kernel(*arrays):
        if not state["failed"]:
            state["failed"] = True
            raise Boom("kernel exploded")
        return fn(*arrays)  # a collective's Pending, if any
    return kernel


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n_devices=st.integers(1, 3),
       workers=st.integers(1, 3), which=st.integers(0, 1000))
def test_a_failing_kernel_raises_names_the_node_and_leaves_no_thread(seed, n_devices,
                                                                     workers, which):
    graph = random_graph(seed, 12, n_devices)
    kernels = reference_kernels(graph)
    elided = plan_memory(graph).elided  # (concats that run nothing)
    candidates = [n for n in graph.nodes if not is_view(n) and n not in elided]
    bad = candidates[which % len(candidates)]
    kernels[bad] = failing_once(kernels[bad])
    exe = Executable(graph, kernels, workers=workers)
    env = random_env(graph, seed)
    before = set(threading.enumerate())
    with np.errstate(all="ignore"):
        result = call_with_timeout(exe, copied(env))
        err = result.get("error")
        assert isinstance(err, ExecutionError), result
        assert repr(bad) in str(err)
        for value in bad.inputs:
            assert f"%{value.name}: {value.type} @{value.device}" in str(err)
        assert isinstance(err.__cause__, Boom)
        assert set(threading.enumerate()) <= before | {threading.current_thread()}
        # The same executable runs again, correctly.
        result = call_with_timeout(exe, copied(env))
        assert "error" not in result, result.get("error")
        assert_same(execute(graph, copied(env)), result["value"])


def test_a_failure_stops_the_other_workers():
    """Device 1 runs a chain of slow kernels; device 0 fails once the chain started:
    the run stops long before the chain is done."""
    graph = Graph("stop")
    x = graph.add_input("x", TensorType((2, 2), F32))
    v = x
    chain = []
    for _ in range(20):
        v = graph.add_node("relu", [v], device=Device("cpu", 1)).outputs[0]
        chain.append(v.producer)
    bad = graph.add_node("tanh", [x], device=Device("cpu", 0))
    graph.set_outputs([("y", v), ("z", bad.outputs[0])])
    started = threading.Event()
    ran = []

    def slow(node, fn):
        def kernel(*arrays):
            started.set()
            ran.append(node)
            time.sleep(0.05)
            fn(*arrays)
        return kernel

    def fail(*arrays):
        started.wait(10)
        raise Boom("no")

    kernels = reference_kernels(graph)
    kernels.update({n: slow(n, kernels[n]) for n in chain})
    kernels[bad] = fail
    result = call_with_timeout(Executable(graph, kernels), random_env(graph))
    assert isinstance(result.get("error"), ExecutionError)
    assert len(ran) < len(chain)


def test_inline_failure_names_node_and_location():
    graph = Graph("g")
    x = graph.add_input("x", TensorType((2, 3), F32))
    node = graph.add_node("relu", [x], loc="model.py:7")
    graph.set_outputs([("y", node.outputs[0])])

    def bad(*arrays):
        raise ValueError("bad value")

    exe = Executable(graph, {node: bad})
    with pytest.raises(ExecutionError) as info:
        exe(random_env(graph))
    message = str(info.value)
    assert "%relu = relu(%x)" in message and "model.py:7" in message
    assert "%x: f32[2,3] @cpu:0" in message and "ValueError: bad value" in message
    assert isinstance(info.value.__cause__, ValueError)


def test_a_nested_call_is_refused():
    graph = Graph("g")
    x = graph.add_input("x", TensorType((2,), F32))
    node = graph.add_node("relu", [x])
    graph.set_outputs([("y", node.outputs[0])])
    exe = Executable(graph, {node: lambda *arrays: exe(random_env(graph))})
    with pytest.raises(ExecutionError, match="already running on this thread"):
        try:
            exe(random_env(graph))
        except ExecutionError as err:
            raise err.__cause__


def test_calls_from_several_threads_take_turns():
    """A server calling one executable from a thread pool: every call waits for the one
    before it and gets its own right answer, even though the plan's memory is shared."""
    graph = Graph("g")
    x = graph.add_input("x", TensorType((64,), F32))
    node = graph.add_node("relu", [x])
    graph.set_outputs([("y", node.outputs[0])])

    def slow_relu(x, y):
        np.maximum(x, 0, out=y)
        time.sleep(0.001)  # let another thread in while this call holds the memory

    exe = Executable(graph, {node: slow_relu})
    inputs = [np.random.default_rng(i).standard_normal(64).astype(np.float32)
              for i in range(40)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(lambda a: exe({"x": a})["y"], inputs))
    for a, y in zip(inputs, outputs):
        np.testing.assert_array_equal(y, np.maximum(a, 0))


# ---------------------------------------------------------------------------------------
# The caller's arrays.


def small_graph():
    graph = Graph("small")
    x = graph.add_input("x", TensorType((2, 3), F32))
    w = graph.add_input("w", TensorType((2, 3), F32), role="param")
    node = graph.add_node("add", [w, x])
    graph.set_outputs([("w", node.outputs[0]), ("y", graph.add_node("tanh", [x]).outputs[0])])
    return graph


def test_env_is_checked():
    graph = small_graph()
    exe = Executable(graph, reference_kernels(graph))
    env = random_env(graph)
    with pytest.raises(ExecutionError, match="no array given for input %w"):
        exe({"x": env["x"]})
    with pytest.raises(ExecutionError, match=r"%x .* f32\[2,3\] array, got a float64\[2, 3\]"):
        exe({**env, "x": env["x"].astype(np.float64)})
    with pytest.raises(ExecutionError, match="non-contiguous"):
        exe({**env, "x": np.asfortranarray(np.ones((2, 3), np.float32))})
    with pytest.raises(ExecutionError, match="got a list"):
        exe({**env, "x": [[1, 2, 3], [4, 5, 6]]})
    frozen = env["w"].copy()
    frozen.flags.writeable = False
    with pytest.raises(ExecutionError, match="read-only"):
        exe({**env, "w": frozen})
    with pytest.raises(ExecutionError, match="share memory"):
        exe({"x": env["w"], "w": env["w"]})
    # Extra names (a program's other state) are ignored, and the executable still works.
    assert_same(execute(graph, copied(env)), exe({**copied(env), "other": np.zeros(3)}))


def test_contiguous_arrays_with_any_strides_on_unit_dimensions_are_taken():
    # numpy calls an array C-contiguous whatever its strides along dimensions of one
    # element; the check looks at C order's strides first and must not refuse these.
    graph = Graph("row")
    x = graph.add_input("x", TensorType((1, 3), F32))
    graph.set_outputs([("y", graph.add_node("tanh", [x]).outputs[0])])
    exe = Executable(graph, reference_kernels(graph))
    column = np.arange(3, dtype=np.float32).reshape(3, 1)
    row = column.T  # shape (1, 3), strides (4, 4): C order's are (12, 4)
    assert row.flags.c_contiguous and row.strides != (12, 4)
    np.testing.assert_array_equal(exe({"x": row})["y"], np.tanh(row))
    with pytest.raises(ExecutionError, match=r"must be a C-contiguous f32\[1,3\] array, "
                                             r"got a float32\[3, 1\] array"):
        exe({"x": column})


def bound_arrays(exe, graph) -> dict[str, list]:
    """What the plan's argument slots hold of each graph input, between calls."""
    held: dict[str, list] = {}
    for task in exe.plan.tasks:
        for value, array in zip([*task.node.inputs, *task.node.outputs], task.args):
            if value in graph.inputs:
                held.setdefault(value.name, []).append(array)
    return held


def test_only_the_variables_arrays_stay_bound_between_calls():
    graph = small_graph()
    exe = Executable(graph, reference_kernels(graph))
    env = random_env(graph)
    exe(env)
    held = bound_arrays(exe, graph)
    assert all(array is None for array in held["x"])  # the caller's batch: dropped
    assert all(array is env["w"] for array in held["w"])  # a parameter: kept bound
    exe.close()
    assert all(array is None for arrays in bound_arrays(exe, graph).values()
               for array in arrays)
    env = random_env(graph, seed=1)
    assert_same(execute(graph, copied(env)), exe(env))  # (works again after closing)


def test_a_held_variable_is_checked_again_when_another_array_comes():
    graph = small_graph()
    exe = Executable(graph, reference_kernels(graph))
    env = random_env(graph)
    exe(copied(env))
    with pytest.raises(ExecutionError, match=r"%w .* f32\[2,3\] array, got a float64"):
        exe({**env, "w": env["w"].astype(np.float64)})
    frozen = env["w"].copy()
    frozen.flags.writeable = False
    with pytest.raises(ExecutionError, match="read-only"):
        exe({**env, "w": frozen})
    w = env["w"].copy()
    exe({**env, "w": w})
    w.flags.writeable = False  # the same array, held, made read-only since
    with pytest.raises(ExecutionError, match="read-only"):
        exe({**env, "w": w})
    w.flags.writeable = True
    with pytest.raises(ExecutionError, match="share memory"):
        exe({"x": w, "w": w})  # a new batch that is the held parameter
    env = random_env(graph, seed=2)
    assert_same(execute(graph, copied(env)), exe(copied(env)))  # the new values count


def test_missing_kernel_is_an_error():
    graph = small_graph()
    kernels = reference_kernels(graph)
    del kernels[graph.nodes[0]]
    with pytest.raises(PurinecError, match="no kernel for node %add = add"):
        Executable(graph, kernels)


def test_a_bad_schedule_is_refused():
    graph = Graph("g")
    x = graph.add_input("x", TensorType((2,), F32))
    a = graph.add_node("relu", [x])
    b = graph.add_node("tanh", a.outputs)
    graph.set_outputs([("y", b.outputs[0])])
    with pytest.raises(VerifyError, match="runs %tanh = tanh"):
        Executable(graph, reference_kernels(graph), schedule=[b, a])
    with pytest.raises(VerifyError, match="exactly once"):
        Executable(graph, reference_kernels(graph), schedule=[a])


def test_reference_adapter_checks_what_the_reference_returns():
    graph = small_graph()
    node = graph.nodes[0]
    kernel = reference_kernel(node)
    with pytest.raises(ValueError, match="returned float32"):
        kernel(np.ones((2, 3), np.float32), np.ones((2, 3), np.float32),
               np.empty((3, 2), np.float32))


# ---------------------------------------------------------------------------------------
# Write-after-read hazards: reuse is only correct with the extra edges.


def reuse_graph():
    """%a dies at the matmul; %b, independent of both, takes its memory."""
    graph = Graph("reuse")
    x = graph.add_input("x", TensorType((4, 4), F32))
    a = graph.add_node("scale", [x], {"alpha": 2.0}).outputs[0]
    r = graph.add_node("matmul", [a, a]).outputs[0]
    b = graph.add_node("tanh", [x]).outputs[0]
    graph.set_outputs([("r", r), ("b", b)])
    return graph


def in_place_update_graph():
    """%w is read by a matmul and updated in place by an add the matmul does not feed."""
    graph = Graph("update")
    x = graph.add_input("x", TensorType((4, 4), F32))
    w = graph.add_input("w", TensorType((4, 4), F32), role="param")
    y = graph.add_node("matmul", [x, w]).outputs[0]
    w_next = graph.add_node("add", [w, x]).outputs[0]
    graph.set_outputs([("y", y), ("w", w_next)])
    return graph


@pytest.mark.parametrize("make_graph", [reuse_graph, in_place_update_graph])
def test_hazard_edges_make_any_order_correct(make_graph, monkeypatch):
    graph = make_graph()
    memory = plan_memory(graph)
    assert memory.hazards, "the example must reuse memory"
    env = random_env(graph)
    expected = execute(graph, copied(env))

    def wrong_in_some_order():
        wrong = 0
        for seed in range(40):
            exe = Executable(graph, reference_kernels(graph), order=random.Random(seed))
            outputs = exe(copied(env))
            wrong += any(not np.array_equal(outputs[k], expected[k]) for k in expected)
        return wrong

    assert wrong_in_some_order() == 0

    def without_hazards(*args, **kwargs):
        plan = plan_memory(*args, **kwargs)
        plan.hazards = []
        return plan

    monkeypatch.setattr(plan_module, "plan_memory", without_hazards)
    assert wrong_in_some_order() > 0  # so the test above can fail


# ---------------------------------------------------------------------------------------
# Traces and the plan's shape.


def test_trace_has_one_event_per_task_per_call(tmp_path):
    graph = random_graph(7, 15, 2)
    trace = Trace()
    exe = Executable(graph, reference_kernels(graph), trace=trace, workers=2)
    env = random_env(graph)
    with np.errstate(all="ignore"):
        exe(copied(env))
        exe(copied(env))
    path = tmp_path / "trace.json"
    trace.write(str(path))
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 2 * len(exe.plan.tasks)
    for call in (0, 1):
        names = sorted(e["name"] for e in complete if e["args"]["call"] == call)
        assert names == sorted(task.name for task in exe.plan.tasks)
    named = {(e["pid"], e.get("tid")) for e in events if e["ph"] == "M"}
    for e in complete:
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert e["dur"] >= 0 and e["ts"] >= 0
        assert (e["pid"], None) in named and (e["pid"], e["tid"]) in named
    processes = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes <= {"cpu:0", "cpu:1"}
    summary = trace.summary()
    assert summary.tasks == len(complete) and summary.calls == 2
    assert summary.span >= max(summary.busy.values()) >= 0
    assert "busy" in str(summary)


def test_inline_trace_and_plan_summary():
    graph = random_graph(3, 8, 1)
    trace = Trace()
    exe = Executable(graph, reference_kernels(graph), trace=trace)
    assert exe.executor.inline
    with np.errstate(all="ignore"):
        exe(random_env(graph))
    assert len(trace.records) == len(exe.plan.tasks)
    text = exe.plan.summary()
    assert f"{len(exe.plan.tasks)} tasks" in text and "peak" in text


def test_plan_counts_match_predecessors():
    graph = random_graph(11, 20, 3)
    plan = Executable(graph, reference_kernels(graph)).plan
    incoming = [0] * len(plan.tasks)
    for task in plan.tasks:
        assert list(task.successors) == sorted(set(task.successors))
        for s in task.successors:
            assert s > task.index
            incoming[s] += 1
    assert incoming == list(plan.initial_counts)
    assert plan.roots == tuple(i for i, c in enumerate(incoming) if c == 0)
    assert {t.node for t in plan.tasks} == {n for n in graph.nodes if not is_view(n)}


def new_threads(before: set) -> set:
    return set(threading.enumerate()) - before


def test_workers_persist_between_calls_and_close():
    graph = random_graph(5, 12, 3)
    env = random_env(graph)
    before = set(threading.enumerate())
    exe = Executable(graph, reference_kernels(graph))
    assert not exe.executor.inline
    with np.errstate(all="ignore"):
        expected = execute(graph, copied(env))
        assert_same(expected, exe(copied(env)))
        workers = new_threads(before)
        assert len(workers) == len(exe.executor.lanes)
        assert_same(expected, exe(copied(env)))
        assert new_threads(before) == workers  # the same threads served the second call
        exe.close()
        assert not new_threads(before)
        assert_same(expected, exe(copied(env)))  # new workers
    del exe  # dropping the executable stops its workers
    for _ in range(100):
        if not new_threads(before):
            break
        time.sleep(0.05)
    assert not new_threads(before)


# ---------------------------------------------------------------------------------------
# The comm queue: posting in plan order, polling what is pending. Fake collectives stand
# in for MPI: each returns a Pending whose test() decides when it is complete.


class FakePending:
    """Completes (copying x into y) once ``ready()`` holds; refuses to be waited for,
    since the comm worker must only poll."""

    def __init__(self, comm, node, x, y, ready):
        self.comm, self.node, self.x, self.y, self.ready = comm, node, x, y, ready
        self.done = False

    def test(self) -> bool:
        if self.comm.broken is self.node:
            raise Boom("lost the network")
        if not self.done and self.ready():
            np.copyto(self.y, self.x)
            self.comm.log("done", self.node)
            self.done = True
        return self.done

    def wait(self) -> None:
        raise AssertionError("the comm worker blocked on one operation")


class FakeComm:
    """Kernels for a graph whose allreduce nodes return FakePendings; logs every event."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.lock = threading.Lock()
        self.events: list[tuple[str, Node]] = []
        self.ready_when: dict[Node, Callable] = {}
        self.broken: Node | None = None  # this node's test() raises
        self.posters: list[str] = []  # the thread that posted each collective

    def log(self, what: str, node: Node) -> None:
        with self.lock:
            self.events.append((what, node))

    def happened(self, what: str, node: Node) -> bool:
        with self.lock:
            return (what, node) in self.events

    def collective(self, node: Node):
        def post(x, y):
            self.log("post", node)
            self.posters.append(threading.current_thread().name)
            return FakePending(self, node, x, y, self.ready_when.get(node, lambda: True))
        post.asynchronous = True  # it only posts, as an MPI kernel does
        return post

    def kernels(self, delays: dict[Node, float]):
        kernels = reference_kernels(self.graph)
        for node in self.graph.nodes:
            if node.op == "allreduce":
                kernels[node] = self.collective(node)
            else:
                kernels[node] = self.timed(node, kernels[node], delays.get(node, 0.0))
        return kernels

    def timed(self, node: Node, fn, delay: float):
        def kernel(*arrays):
            self.log("start", node)
            time.sleep(delay)
            fn(*arrays)
        return kernel


def comm_graph(n: int = 4, comm_devices: int = 1):
    """n chains on their own devices, each feeding an allreduce on the comm queue of
    one of ``comm_devices`` other devices, each read by a relu on that device."""
    graph = Graph("comm")
    x = graph.add_input("x", TensorType((2, 3), F32))
    chains, reduces, readers = [], [], []
    for k in range(n):
        chains.append(graph.add_node("tanh", [x], device=Device("cpu", k + 1)))
        device = Device("cpu", n + 1 + k % comm_devices)
        reduces.append(graph.add_node("allreduce", chains[-1].outputs,
                                      attrs={"group": str(device)}, device=device))
    for node in reduces:
        readers.append(graph.add_node("relu", node.outputs, device=node.device))
    graph.set_outputs([(f"y{k}", r.outputs[0]) for k, r in enumerate(readers)])
    return graph, chains, reduces, readers


@pytest.mark.parametrize("comm_devices", [1, 2])
def test_comm_tasks_are_posted_in_plan_order_and_release_on_completion(comm_devices):
    graph, chains, reduces, readers = comm_graph(4, comm_devices)
    comm = FakeComm(graph)
    # Later chains finish first, so later collectives are ready first; and each pending
    # operation completes only after the next one was posted, so a worker that waited
    # for one before posting the next would never finish.
    for a, b in zip(reduces, reduces[1:]):
        comm.ready_when[a] = lambda b=b: comm.happened("post", b)
    delays = {chain: 0.02 * (len(chains) - k) for k, chain in enumerate(chains)}
    exe = Executable(graph, comm.kernels(delays), trace=Trace())
    env = random_env(graph)
    for call in range(2):
        comm.events.clear()
        result = call_with_timeout(exe, copied(env))
        assert "error" not in result, result.get("error")
        assert_same(execute(graph, copied(env)), result["value"])
        posts = [node for what, node in comm.events if what == "post"]
        assert posts == reduces
        # Posted by the compute workers that made them ready, with no hand-off to the
        # comm worker's thread (which a busy core may not schedule for milliseconds).
        assert all("compute" in name for name in comm.posters), comm.posters
        comm.posters.clear()
        for node, reader in zip(reduces, readers):
            assert comm.events.index(("done", node)) < comm.events.index(("start", reader))
    comm_lanes = [lane for _, lane, *_ in exe.trace.records if lane.queue.kind == "comm"]
    assert sorted(comm_lanes) == sorted(2 * [Lane(task.queue) for task in exe.plan.tasks
                                             if task.node in reduces])


@pytest.mark.parametrize("where", ["post", "test"])
def test_a_failing_collective_stops_the_run_and_leaves_no_thread(where):
    graph, chains, reduces, readers = comm_graph(3)
    comm = FakeComm(graph)
    kernels = comm.kernels({})
    bad = reduces[1]
    if where == "post":
        kernels[bad] = failing_once(kernels[bad])
    else:
        comm.broken = bad
        comm.ready_when[reduces[0]] = lambda: False  # still pending when the run stops
    before = set(threading.enumerate())
    exe = Executable(graph, kernels)
    env = random_env(graph)
    result = call_with_timeout(exe, copied(env))
    err = result.get("error")
    assert isinstance(err, ExecutionError) and isinstance(err.__cause__, Boom), result
    assert repr(bad) in str(err)
    assert set(threading.enumerate()) <= before | {threading.current_thread()}
    comm.broken = None
    comm.ready_when.clear()
    result = call_with_timeout(exe, copied(env))
    assert "error" not in result, result.get("error")
    assert_same(execute(graph, copied(env)), result["value"])


def test_a_synchronous_comm_kernel_runs_on_the_comm_worker():
    """An in-process collective does its sums and copies when called: the comm worker's
    thread runs it, not the compute worker that made it ready."""
    graph, chains, reduces, readers = comm_graph(2)
    kernels = reference_kernels(graph)
    threads = []
    for node in reduces:
        def summed(*arrays, fn=kernels[node]):
            threads.append(threading.current_thread().name)
            return fn(*arrays)
        kernels[node] = summed
    exe = Executable(graph, kernels)
    env = random_env(graph)
    result = call_with_timeout(exe, copied(env))
    assert "error" not in result, result.get("error")
    assert_same(execute(graph, copied(env)), result["value"])
    assert threads and all(name.endswith("/comm") for name in threads), threads


def test_compute_workers_nudge_pending_communication_between_tasks():
    """MPI moves a collective along only while the process calls into it: between their
    tasks the compute workers nudge what is pending (here an operation that completes
    only once nudged twice, while another device computes a chain of three tasks)."""
    graph = Graph("nudged")
    x = graph.add_input("x", TensorType((2, 3), F32))
    sent = graph.add_node("tanh", [x], device=Device("cpu", 1))
    reduce = graph.add_node("allreduce", sent.outputs, attrs={"group": "cpu:2"},
                            device=Device("cpu", 2))
    reader = graph.add_node("relu", reduce.outputs, device=Device("cpu", 2))
    chain = [x]
    for _ in range(3):
        chain.append(graph.add_node("tanh", [chain[-1]], device=Device("cpu", 3)).outputs[0])
    graph.set_outputs([("y", reader.outputs[0]), ("z", chain[-1])])
    comm = FakeComm(graph)
    nudges = []

    class Nudged(FakePending):
        def nudge(self):
            nudges.append(threading.current_thread().name)

    comm.ready_when[reduce] = lambda: len(nudges) >= 2
    kernels = comm.kernels({node: 0.01 for node in graph.nodes if node.op == "tanh"})
    kernels[reduce] = lambda x, y: Nudged(comm, reduce, x, y, comm.ready_when[reduce])
    exe = Executable(graph, kernels)
    env = random_env(graph)
    result = call_with_timeout(exe, copied(env))
    assert "error" not in result, result.get("error")
    assert_same(execute(graph, copied(env)), result["value"])
    assert nudges and all("compute" in name for name in nudges)


def rank_graph():
    """An MPI rank with one device: a gradient reduced over the group while the rest of
    the backward pass (a chain of three) goes on; then its reader."""
    graph = Graph("rank")
    x = graph.add_input("x", TensorType((2, 3), F32))
    grad = graph.add_node("tanh", [x], names=["grad"])
    reduce = graph.add_node("allreduce", grad.outputs, attrs={"group": "cpu:0"})
    chain = [x]
    for i in range(3):
        chain.append(graph.add_node("sigmoid", [chain[-1]], names=[f"c{i}"]).outputs[0])
    reader = graph.add_node("relu", reduce.outputs, names=["update"])
    graph.set_outputs([("y", reader.outputs[0]), ("z", chain[-1])])
    return graph, reduce, [v.producer for v in chain[1:]]


def test_one_device_with_communication_runs_on_the_calling_thread():
    graph, reduce, chain = rank_graph()
    comm = FakeComm(graph)
    # Complete only once the whole chain has run: compute goes on while it is pending.
    comm.ready_when[reduce] = lambda: comm.happened("start", chain[-1])
    threads = set()
    kernels = comm.kernels({})
    for node, fn in list(kernels.items()):
        def noted(*arrays, fn=fn):
            threads.add(threading.current_thread())
            return fn(*arrays)
        kernels[node] = noted
    exe = Executable(graph, kernels, trace=Trace())
    assert exe.executor.one_thread
    env = random_env(graph)
    for _ in range(2):
        comm.events.clear()
        threads.clear()
        result = call_with_timeout(exe, copied(env))  # (calls on a thread of its own)
        assert "error" not in result, result.get("error")
        assert_same(execute(graph, copied(env)), result["value"])
        assert comm.events.index(("post", reduce)) < comm.events.index(("start", chain[0]))
        assert len(threads) == 1  # the caller's, for every kernel and post
    lanes = {str(lane) for _, lane, *_ in exe.trace.records}
    assert lanes == {"cpu:0/compute", "cpu:0/comm"}


def test_one_device_whose_last_task_is_a_collective():
    graph = Graph("last")
    x = graph.add_input("x", TensorType((2, 3), F32))
    grad = graph.add_node("tanh", [x])
    reduce = graph.add_node("allreduce", grad.outputs, attrs={"group": "cpu:0"})
    graph.set_outputs([("y", reduce.outputs[0])])
    comm = FakeComm(graph)
    tests = iter(range(3))
    comm.ready_when[reduce] = lambda: next(tests, 2) >= 2  # done at the third test
    exe = Executable(graph, comm.kernels({}))
    assert exe.executor.one_thread
    env = random_env(graph)
    result = call_with_timeout(exe, copied(env))
    assert "error" not in result, result.get("error")
    assert_same(execute(graph, copied(env)), result["value"])


def test_one_device_with_a_failing_collective_names_it():
    graph, reduce, chain = rank_graph()
    comm = FakeComm(graph)
    comm.broken = reduce
    exe = Executable(graph, comm.kernels({}))
    result = call_with_timeout(exe, random_env(graph))
    err = result.get("error")
    assert isinstance(err, ExecutionError) and isinstance(err.__cause__, Boom), result
    assert repr(reduce) in str(err)
    comm.broken = None
    result = call_with_timeout(exe, random_env(graph))
    assert "error" not in result, result.get("error")


def test_a_comm_only_plan_runs_inline_and_polls_its_collectives():
    graph = Graph("g")
    x = graph.add_input("x", TensorType((2, 3), F32))
    node = graph.add_node("allreduce", [x], attrs={"group": "cpu:0"})
    graph.set_outputs([("y", node.outputs[0])])

    class Later:
        """Complete at the third test."""

        def __init__(self, x, y):
            self.x, self.y, self.tests = x, y, 0

        def test(self):
            self.tests += 1
            if self.tests == 3:
                np.copyto(self.y, self.x)
            return self.tests >= 3

    exe = Executable(graph, {node: lambda x, y: Later(x, y)})
    assert exe.executor.inline
    env = random_env(graph)
    assert_same(execute(graph, copied(env)), exe(copied(env)))
    exe.order = random.Random(0)
    assert_same(execute(graph, copied(env)), exe(copied(env)))


# ---------------------------------------------------------------------------------------
# Worker set-up and the injected failure.


def test_worker_init_runs_once_in_each_worker_thread():
    graph = random_graph(5, 12, 3)
    seen = []
    exe = Executable(graph, reference_kernels(graph), workers=2,
                     worker_init=lambda lane: seen.append((lane, threading.current_thread())))
    env = random_env(graph)
    with np.errstate(all="ignore"):
        exe(copied(env))
        exe(copied(env))
    assert sorted(lane for lane, _ in seen) == sorted(lane for lane, _ in exe.executor.lanes)
    threads = {thread for _, thread in seen}
    assert len(threads) == len(seen) and threading.current_thread() not in threads
    exe.close()


def test_worker_init_runs_on_the_calling_thread_when_inline():
    graph = small_graph()
    seen = []
    exe = Executable(graph, reference_kernels(graph),
                     worker_init=lambda lane: seen.append((lane, threading.current_thread())))
    assert exe.executor.inline
    exe(random_env(graph))
    assert seen == [(exe.executor.lanes[0][0], threading.current_thread())]


def test_a_failing_worker_init_is_an_error_and_leaves_no_thread():
    graph = random_graph(5, 12, 3)
    before = set(threading.enumerate())

    def init(lane):
        if lane.queue.device == Device("cpu", 1):
            raise Boom("no cores")

    exe = Executable(graph, reference_kernels(graph), worker_init=init)
    with pytest.raises(ExecutionError, match=r"worker of cpu:1/compute failed: Boom: no cores"):
        exe(random_env(graph))
    assert set(threading.enumerate()) <= before


def test_injected_failure_fails_the_first_run_of_each_graph(monkeypatch):
    graph = small_graph()
    exe = Executable(graph, reference_kernels(graph))
    monkeypatch.setenv("PURINEC_FAIL_RANK", "0")
    with pytest.raises(PurinecError, match="injected failure"):
        exe(random_env(graph))
    exe(random_env(graph))  # only the first run fails
    monkeypatch.setenv("PURINEC_FAIL_RANK", "1")  # another rank: this one runs
    Executable(graph, reference_kernels(graph))(random_env(graph))
