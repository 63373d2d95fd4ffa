"""Communication across ranks (purinec.runtime.comm).

The scripts in tests/mpi_scripts run under ``mpiexec -n R``, one process per rank; each
saves its inputs and outputs, and these tests check every rank's results against NumPy
(sums, concatenations) and against each other (bitwise). The first tests run in this
process, in a world of one: groups on this rank's devices only, and the errors.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import purinec
from purinec.errors import PurinecError
from purinec.ir.graph import Graph
from purinec.ir.types import DType, Device, TensorType
from purinec.runtime import comm, shm
from purinec.runtime.collectives import PerArrays
from purinec.runtime.executor import Executable
from tests.mpi_scripts.common import assert_output_close, assert_weights_close

pytestmark = [pytest.mark.slow, pytest.mark.mpi]

SCRIPTS = Path(__file__).resolve().parents[1] / "mpi_scripts"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
TIMEOUT = 120  # seconds; a hung job fails the test instead of the suite
# Where MPICH keeps the memory the ranks of one machine share.
SHARED_SEGMENTS = Path("/dev/shm/mpich_shm_*")


# ---------------------------------------------------------------------------------------
# In this process: a world of one.


def local_group_graph():
    """An allreduce (a bucket of two tensors of two dtypes) and an allgather (unequal
    pieces) over devices of this one rank."""
    graph = Graph("local")
    devices = [Device("cpu", i) for i in range(3)]
    xs = [graph.add_input(f"x{t}.p{k}", TensorType(shape, dtype), devices[k])
          for k in range(3) for t, (shape, dtype) in enumerate([((4, 3), DType.f32),
                                                                ((5,), DType.f64)])]
    reduce = graph.add_node("allreduce", xs, attrs={"group": "cpu:0,cpu:1,cpu:2",
                                                    "tensors": 2})
    pieces = [graph.add_input(f"g.p{k}", TensorType((2, k + 1, 3), DType.i32), devices[k])
              for k in range(3)]
    gather = graph.add_node("allgather", pieces, attrs={"group": "cpu:0,cpu:1,cpu:2",
                                                        "axis": 1, "sizes": [1, 2, 3]})
    for node in (reduce, gather):
        for out, value in zip(node.outputs, node.inputs):
            out.device = value.device
    graph.set_outputs([(f"y{i}", v) for i, v in enumerate(reduce.outputs + gather.outputs)])
    return graph


def test_collectives_within_one_rank_need_no_mpi():
    graph = local_group_graph()
    world = comm.world()
    assert (world.rank, world.size, world.comm) == (0, 1, None)
    exe = Executable(graph, comm.comm_kernels(graph.nodes, world))
    rng = np.random.default_rng(0)
    env = {v.name: (rng.standard_normal(v.type.shape) * 10).astype(v.type.dtype.numpy)
           for v in graph.inputs}
    out = exe({k: v.copy() for k, v in env.items()})
    sums = [env["x0.p0"] + env["x0.p1"] + env["x0.p2"], env["x1.p0"] + env["x1.p1"] + env["x1.p2"]]
    for i in range(6):
        np.testing.assert_array_equal(out[f"y{i}"], sums[i % 2])
    whole = np.concatenate([env[f"g.p{k}"] for k in range(3)], axis=1)
    for i in range(6, 9):
        np.testing.assert_array_equal(out[f"y{i}"], whole)


def test_collective_kernels_make_their_copies_once_per_set_of_arrays():
    """The kernels keep what they derive from their arrays (`PerArrays`) while a plan
    passes the same ones, and remake it for others: results are right either way."""
    graph = local_group_graph()
    world = comm.world()
    rng = np.random.default_rng(1)
    for node in graph.nodes:
        kernel = comm.mpi_kernel(node, world)

        def fresh():
            return ([(rng.standard_normal(v.type.shape) * 10).astype(v.type.dtype.numpy)
                     for v in node.inputs],
                    [np.empty(v.type.shape, v.type.dtype.numpy) for v in node.outputs])

        first, second = fresh(), fresh()
        made = []
        for xs, ys in (first, second, first, second):
            xs[0] += 1  # the same arrays, new contents: read at each call
            kernel(*xs, *ys)
            made.append(kernel.copies.made)
            if node.op == "allreduce":
                expected = [sum(xs[t::2]) for t in range(2)] * 3
            else:
                expected = [np.concatenate(xs, axis=1)] * 3
            for y, want in zip(ys, expected):
                np.testing.assert_array_equal(y, want)
        assert made[0] is not made[1] and made[1] is not made[2]
        kernel(*second[0], *second[1])
        assert kernel.copies.made is made[3]


def test_per_arrays_remakes_only_for_other_arrays():
    calls = []
    memo = PerArrays(lambda arrays: calls.append(arrays) or len(calls))
    a, b = np.zeros(3), np.zeros(3)
    assert memo((a, b)) == 1 and memo((a, b)) == 1
    assert memo((a, b.copy())) == 2 and memo((a,)) == 3 and memo((a,)) == 3
    assert memo((a, b)) == 4 and len(calls) == 4


def test_a_parameter_servers_reduce_and_broadcast_within_one_rank_need_no_mpi():
    graph = Graph("server")
    devices = [Device("cpu", i) for i in range(3)]
    attrs = {"group": "cpu:0,cpu:1,cpu:2", "root": "cpu:1"}
    xs = [graph.add_input(f"x.p{k}", TensorType((4, 3), DType.f32), devices[k])
          for k in range(3)]
    total = graph.add_node("reduce", xs, attrs, names=["sum"], device=devices[1])
    copies = graph.add_node("broadcast", total.outputs, {**attrs, "shape": [4, 3],
                                                         "members": 3})
    for out, device in zip(copies.outputs, devices):
        out.device = device
    graph.set_outputs([(f"y{k}", v) for k, v in enumerate(copies.outputs)])
    exe = Executable(graph, comm.comm_kernels(graph.nodes, comm.world()))
    rng = np.random.default_rng(0)
    env = {v.name: rng.standard_normal(v.type.shape).astype(np.float32) for v in graph.inputs}
    out = exe({k: v.copy() for k, v in env.items()})
    expected = (env["x.p0"] + env["x.p1"]) + env["x.p2"]  # in group order
    for k in range(3):
        assert out[f"y{k}"].tobytes() == expected.tobytes()
    b = graph.add_input("b", TensorType((3,), DType.bool))
    with pytest.raises(PurinecError, match="cannot sum bool"):
        comm.mpi_kernel(graph.add_node("reduce", [b], {"group": "cpu:0", "root": "cpu:0"}),
                        comm.world())


def test_a_group_beyond_this_world_asks_for_mpiexec():
    graph = Graph("g")
    x = graph.add_input("x.p0", TensorType((3,), DType.f32))
    graph.add_node("allreduce", [x], attrs={"group": "cpu:0,r2/cpu:0"})
    with pytest.raises(PurinecError, match=r"spans ranks 0, 2 .* rank 0 of 1.*mpiexec -n 3"):
        comm.comm_kernels(graph.nodes, comm.world())


def test_kernels_refuse_what_they_cannot_do():
    graph = Graph("g")
    x = graph.add_input("x.p1", TensorType((3,), DType.f32), Device("cpu", 0, 1))
    elsewhere = graph.add_node("allreduce", [x], attrs={"group": "r1/cpu:0"})
    with pytest.raises(PurinecError, match="rank 0, which has no member in its group"):
        comm.mpi_kernel(elsewhere, comm.world())
    b = graph.add_input("b.p0", TensorType((3,), DType.bool))
    with pytest.raises(PurinecError, match="cannot sum bool"):
        comm.mpi_kernel(graph.add_node("allreduce", [b], attrs={"group": "cpu:0"}),
                        comm.world())
    with pytest.raises(PurinecError, match="no communication kernel for op copy"):
        comm.mpi_kernel(graph.add_node("copy", [b]), comm.world())


@given(buffers=st.lists(st.tuples(st.integers(0, 3000), st.sampled_from([4, 8])),
                        min_size=1, max_size=6),
       parts=st.integers(1, 9))
def test_shared_memory_shares_cover_every_buffer_once_evenly_from_cache_lines(buffers,
                                                                            parts):
    sizes, itemsizes = [n for n, _ in buffers], [itemsize for _, itemsize in buffers]
    shares = shm._shares(sizes, itemsizes, parts)
    assert len(shares) == parts
    covered = [np.zeros(n, int) for n in sizes]
    for share in shares:
        for i, lo, hi in share:
            assert lo < hi and lo * itemsizes[i] % shm.ALIGNMENT == 0
            covered[i][lo:hi] += 1
    assert all((c == 1).all() for c in covered)
    # Each share within a cache line per buffer of an even cut.
    slack = sum(shm.ALIGNMENT // itemsize for itemsize in itemsizes)
    for part, share in enumerate(shares):
        even = sum(sizes) * (part + 1) // parts - sum(sizes) * part // parts
        assert abs(sum(hi - lo for _, lo, hi in share) - even) <= slack


def test_a_shared_memory_allreduce_without_its_window_says_so():
    graph = Graph("g")
    x = graph.add_input("x.p0", TensorType((3,), DType.f32))
    node = graph.add_node("allreduce", [x], attrs={"group": "cpu:0,r1/cpu:0"})
    kernel = shm.SharedAllreduce(node, shm.SharedGroup(comm=None, ranks=(0, 1)),
                                 fallback=None)
    with pytest.raises(PurinecError, match="never given its window"):
        kernel(np.ones(3, np.float32), np.ones(3, np.float32))


def test_without_a_launcher_mpi_is_never_started():
    env = {k: v for k, v in os.environ.items() if k not in comm.LAUNCHER_VARIABLES}
    code = ("import sys; from purinec.runtime import comm; w = comm.world(); "
            "print(w.rank, w.size, comm.run_guarded(lambda: 7), 'mpi4py' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert done.stdout.split() == ["0", "1", "7", "False"], done.stderr


# ---------------------------------------------------------------------------------------
# Under mpiexec.


def mpirun(ranks: int, script: str, *args, **env: str):
    environ = {k: v for k, v in os.environ.items() if k != comm.FAIL_RANK_VARIABLE}
    return subprocess.run([str(MPIEXEC), "-n", str(ranks), sys.executable,
                           str(SCRIPTS / script), *map(str, args)],
                          env={**environ, **env}, capture_output=True, text=True,
                          timeout=TIMEOUT)


def ran(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"


def load(path: Path) -> tuple[dict, dict]:
    with np.load(path) as data:
        inputs = {k[3:]: data[k] for k in data.files if k.startswith("in:")}
        outputs = {k[4:]: data[k] for k in data.files if k.startswith("out:")}
    return inputs, outputs


def check_sum(inputs: list[np.ndarray], outputs: list[np.ndarray]) -> None:
    """Each member's output is the sum of the members' inputs, all the same bytes."""
    assert len(outputs) == len(inputs)
    expected = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    tolerance = 1e-5 if inputs[0].dtype == np.float32 else 1e-12
    for out in outputs:
        assert out.dtype == inputs[0].dtype and out.shape == inputs[0].shape
        np.testing.assert_allclose(out, expected, rtol=tolerance, atol=tolerance)
        assert out.tobytes() == outputs[0].tobytes()


def check_gather(inputs: list[np.ndarray], outputs: list[np.ndarray], axis: int) -> None:
    assert len(outputs) == len(inputs)
    whole = np.concatenate(inputs, axis=axis)
    for out in outputs:
        assert out.dtype == whole.dtype
        np.testing.assert_array_equal(out, whole)


def check_collectives(outdir: Path, size: int, ends: bool = True) -> None:
    """What tests/mpi_scripts/collectives.py computed on ``size`` ranks (its groups: two
    devices a rank, ranks interleaved; the first device of each rank; each rank's own
    two devices; and the first and last rank; a parameter server's reduce of a bucket
    and broadcast of its f32 sums over the first group, rooted on the last rank)."""
    for call in range(2):
        ranks = [load(outdir / f"rank{r}.call{call}.npz") for r in range(size)]
        inputs = {k: v for r_in, _ in ranks for k, v in r_in.items()}
        outputs = [r_out for _, r_out in ranks]

        def member_outs(name):
            return [out[k] for out in outputs for k in out if k.startswith(f"{name}.p")]

        for t in range(3):
            check_sum([inputs[f"bucket{t}.p{k}"] for k in range(2 * size)],
                      member_outs(f"bucket_out{t}"))
        pairs = {name.split(".")[0] for name in inputs if name.startswith("pair")}
        assert len(pairs) == 9
        for pair in pairs:
            check_sum([inputs[f"{pair}.p{r}"] for r in range(size)],
                      member_outs(pair.replace("pair", "pair_out")))
        check_sum([inputs[f"one.p{r}"] for r in range(size)], member_outs("one_out"))
        for r_in, r_out in ranks:
            check_sum([r_in["local.p0"], r_in["local.p1"]],
                      [r_out["local_out.p0"], r_out["local_out.p1"]])
        check_gather([inputs[f"gather.p{k}"] for k in range(2 * size)],
                     member_outs("gather_out"), axis=1)
        check_gather([inputs[f"rows.p{r}"] for r in range(size)], member_outs("rows_out"),
                     axis=0)
        for t in range(3):  # the parameter server's bucket
            summands = [inputs[f"ps{t}.p{k}"] for k in range(2 * size)]
            total = outputs[-1][f"ps_sum{t}"]
            assert total.dtype == summands[0].dtype
            np.testing.assert_allclose(total, np.sum(summands, axis=0, dtype=np.float64),
                                       rtol=1e-5, atol=1e-5)
            for r, (r_in, r_out) in enumerate(ranks[:-1]):  # what each other rank sent
                assert r_out[f"ps_sum{t}.sent"].tobytes() == (
                    r_in[f"ps{t}.p{r}"] + r_in[f"ps{t}.p{r + size}"]).tobytes()
        for t in (0, 2):  # the f32 sums
            assert ([out.tobytes() for out in member_outs(f"ps_all{t}")] ==
                    [outputs[-1][f"ps_sum{t}"].tobytes()] * 2 * size)
        if ends and size >= 3:
            check_sum([ranks[0][0]["ends.p0"], ranks[-1][0]["ends.p1"]],
                      member_outs("ends_out"))
            assert not any(k.startswith("ends") for k in outputs[1])
    for r in range(size):
        flags, again = load(outdir / f"rank{r}.after_close.npz")
        assert flags["released"] or not flags["shared"]
        _, first = load(outdir / f"rank{r}.call0.npz")
        assert again.keys() == first.keys()
        for name in first:
            assert again[name].tobytes() == first[name].tobytes(), name
        _, aliased = load(outdir / f"rank{r}.aliased.npz")
        np.testing.assert_array_equal(aliased["x"], size * (size + 1) / 2)
        np.testing.assert_array_equal(aliased["y"], size * (size + 1) / 2)
        _, mixed = load(outdir / f"rank{r}.mixed.npz")
        assert len(mixed) == 9
        for t in range(9):
            np.testing.assert_array_equal(mixed[f"t{t}"], (t + 1) * size * (size + 1) / 2)


def kernels_over_all_ranks(outdir: Path, size: int) -> set[str]:
    """The kinds of kernel the collectives over every rank got, on any rank; checks
    that every rank describes its communication as they say."""
    saved = [json.loads((outdir / f"rank{r}.kernels.json").read_text()) for r in range(size)]
    kinds = {kind for ranks in saved for name, kind in ranks["kinds"].items()
             if name.startswith(("bucket_out", "pair_out", "one_out", "gather_out", "rows_out", "ps_"))}
    shared = any(kind.endswith("in shared memory") for kind in kinds)
    for ranks in saved:
        assert ranks["communication"] == ("shared memory" if shared else "MPI")
    return kinds


COLLECTIVE_KINDS = ("Allreduce", "Allgather", "Reduce", "Broadcast")
SHARED = {f"Shared{op} in shared memory" for op in COLLECTIVE_KINDS}
MPIS = {f"_{op}" for op in COLLECTIVE_KINDS}


@pytest.mark.parametrize("shared", ["1", "0"])
def test_collectives_on_two_ranks(tmp_path, shared):
    """Collectives over ranks of one machine work in shared memory, unless turned off."""
    ran(mpirun(2, "collectives.py", tmp_path, **{shm.SWITCH_VARIABLE: shared}))
    check_collectives(tmp_path, 2)
    assert kernels_over_all_ranks(tmp_path, 2) == (SHARED if shared == "1" else MPIS)


def test_collectives_fall_back_to_mpi_when_a_rank_finds_no_room_in_shared_memory(tmp_path):
    ran(mpirun(2, "collectives.py", tmp_path, "no-room"))
    check_collectives(tmp_path, 2)
    assert kernels_over_all_ranks(tmp_path, 2) == {kind.split()[0] for kind in SHARED}


@pytest.mark.parametrize("shared", ["1", "0"])
def test_collectives_on_three_ranks_with_a_subgroup(tmp_path, shared):
    """Ranks 0 and 2 also reduce over a group of their own: their arenas lie in the
    first group's window, and that group's kernels stage their buffers in theirs."""
    ran(mpirun(3, "collectives.py", tmp_path, **{shm.SWITCH_VARIABLE: shared}))
    check_collectives(tmp_path, 3)
    assert kernels_over_all_ranks(tmp_path, 3) == (SHARED if shared == "1" else MPIS)
    if shared == "1":
        saved = json.loads((tmp_path / "rank0.kernels.json").read_text())
        assert saved["kinds"]["ends_out.p0"] == "SharedAllreduce in shared memory"


def test_collectives_on_three_ranks_in_shared_memory(tmp_path):
    ran(mpirun(3, "collectives.py", tmp_path, "no-ends"))
    check_collectives(tmp_path, 3, ends=False)
    assert kernels_over_all_ranks(tmp_path, 3) == SHARED


def test_compute_overlaps_a_pending_allreduce(tmp_path):
    ran(mpirun(2, "overlap.py", tmp_path))
    runs = [load(tmp_path / f"rank{r}.npz") for r in range(2)]
    total = np.tanh(runs[0][0]["a"]) + np.tanh(runs[1][0]["a"])
    for r, (inputs, outputs) in enumerate(runs):
        chain = inputs["a"]
        for _ in range(6):
            chain = np.tanh(chain)
        np.testing.assert_allclose(outputs["y"], total + chain, rtol=1e-5, atol=1e-6)
    assert runs[0][1]["y"].tobytes() != runs[1][1]["y"].tobytes()  # different chains
    # Rank 1 posts its allreduce late, so rank 0's stays pending while its compute
    # queue runs the chain: some chain kernel runs wholly inside that window.
    intervals = json.loads((tmp_path / "rank0.json").read_text())
    [reduce] = [i for i in intervals if i["queue"] == "comm"]
    compute = [i for i in intervals if i["queue"] == "compute"]
    assert any(reduce["start"] <= i["start"] and i["end"] <= reduce["end"] for i in compute)


def test_a_rank_with_nothing_else_to_do_sums_for_a_busy_one(tmp_path):
    """In shared memory, rank 0 (late, then idle) sums the whole allreduce while rank 1,
    which posted first, is busy in a long kernel: rank 0's result is complete long
    before rank 1 looks again."""
    ran(mpirun(2, "busy_peer.py", tmp_path, **{shm.SWITCH_VARIABLE: "1"}))
    runs = [load(tmp_path / f"rank{r}.npz") for r in range(2)]
    total = np.tanh(runs[0][0]["a"]) + np.tanh(runs[1][0]["a"])
    for inputs, outputs in runs:
        np.testing.assert_allclose(outputs["y"], 2 * total, rtol=1e-6)
    assert runs[0][1]["y"].tobytes() == runs[1][1]["y"].tobytes()
    traces = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    [reduced] = [i for i in traces[0] if i["queue"] == "comm"]
    [busy] = [i for i in traces[1] if i["node"] == "q"]
    assert reduced["end"] < busy["end"] - 0.5, (reduced, busy)


def test_a_failing_rank_ends_the_whole_job(tmp_path):
    done = mpirun(2, "collectives.py", tmp_path, **{comm.FAIL_RANK_VARIABLE: "1"})
    assert done.returncode != 0
    assert "purinec: rank 1: injected failure" in done.stderr, done.stderr
    assert "rank 0:" not in done.stderr


@pytest.mark.parametrize("how, message", [("raise", "ValueError: a bug on rank 1"),
                                          ("return", "exited with status 3")])
def test_a_rank_failing_outside_a_run_ends_the_job(how, message):
    done = mpirun(2, "fails.py", "-", how)
    assert done.returncode != 0
    assert f"purinec: rank 1: {message}" in done.stderr, done.stderr


def test_a_mistake_every_rank_meets_is_said_once():
    done = mpirun(2, "fails.py", "-", "everyone")
    assert done.returncode != 0
    assert "purinec: rank 0: the same mistake on every rank" in done.stderr, done.stderr
    assert "rank 1:" not in done.stderr, done.stderr


@pytest.mark.parametrize("how, said, status", [("interrupt", "interrupted", 130),
                                                ("terminate", "terminated", 143)])
def test_an_interrupted_rank_ends_the_job_with_one_line_and_its_status(how, said, status):
    done = mpirun(2, "fails.py", "-", how)
    assert done.returncode == status, done.stderr
    assert done.stderr.strip() == f"purinec: rank 1: {said}", done.stderr


def shared_segments() -> set[Path]:
    return set(SHARED_SEGMENTS.parent.glob(SHARED_SEGMENTS.name))


@pytest.mark.parametrize("how", ["raise", "return", "everyone", "interrupt"])
def test_a_failed_job_leaves_no_shared_memory_behind(how):
    before = shared_segments()
    done = mpirun(2, "fails.py", "-", how)
    assert done.returncode != 0
    assert shared_segments() <= before


def test_the_next_job_removes_the_shared_memory_of_a_killed_one():
    """Killed ranks clean nothing (the launcher kills the others too): the next job's
    first rank removes what no process maps any more, once it is old enough not to be a
    starting job's."""
    before = shared_segments()
    done = mpirun(2, "fails.py", "-", "die")
    assert done.returncode != 0
    left = shared_segments() - before
    assert left, "MPICH now cleans up after killed jobs: this test and the sweep can go"
    for path in left:
        os.utime(path, (time.time() - 2 * comm.STALE_AFTER,) * 2)
    code = "from purinec.runtime import comm; comm.world().comm.Barrier()"
    ran(subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=TIMEOUT))
    assert not left & shared_segments()


@pytest.mark.parametrize("fail", [False, True])
def test_a_users_script_run_with_python_m_mpi4py_ends_when_a_rank_raises(tmp_path, fail):
    """What the README tells users whose scripts do not use run_guarded: rank 0 waits
    in a step's collectives for rank 1, which raises; mpi4py's runner aborts the job."""
    environ = {k: v for k, v in os.environ.items() if k != comm.FAIL_RANK_VARIABLE}
    failing_rank_stderr = tmp_path / "rank1.err"
    done = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-m", "mpi4py",
                           str(SCRIPTS / "unguarded.py"),
                           *(["fail", str(failing_rank_stderr)] if fail else [])],
                          env=environ, capture_output=True, text=True, timeout=TIMEOUT)
    if not fail:
        ran(done)
        # (the ranks' lines may come through the launcher run together)
        assert sorted(re.findall(r"rank \d: loss \d\.\d{4}", done.stdout)) == [
            "rank 0: loss 2.5463", "rank 1: loss 2.5463"], done.stdout
        return
    assert done.returncode != 0, done.stdout
    assert "rank 0: loss" not in done.stdout  # rank 0 was ended in its step
    written = failing_rank_stderr.read_text()
    assert "ValueError: a bug in the user's script on rank 1" in written, written
    assert "MPI_Abort" in written, written


def test_a_killed_rank_ends_the_job_instead_of_hanging():
    done = mpirun(2, "fails.py", "-", "die")
    assert done.returncode != 0
    assert "signal 9" in done.stdout + done.stderr


# ---------------------------------------------------------------------------------------
# Whole programs over ranks.


@pytest.mark.parametrize("model,batch,per_rank,strategy", [
    (model, batch, 1, strategy) for model, batch in (("lenet", 12), ("cifar_quick", 10))
    for strategy in ("data", "model", "hybrid", "pipeline", "ps")] + [
    ("lenet", 12, 2, "data")])
def test_training_over_two_ranks_equals_one_device(tmp_path, model, batch, per_rank,
                                                   strategy):
    ran(mpirun(2, "train_equal.py", model, batch, "reference", tmp_path, per_rank, strategy))
    check_same_training(tmp_path, 2)


@pytest.mark.parametrize("strategy", ["data", "hybrid"])
def test_training_over_two_ranks_with_mpis_collectives_equals_one_device(tmp_path, strategy):
    """As above with shared memory turned off: every collective goes through MPI."""
    ran(mpirun(2, "train_equal.py", "lenet", 12, "cpu", tmp_path, 1, strategy,
               **{shm.SWITCH_VARIABLE: "0"}))
    check_same_training(tmp_path, 2)


@pytest.mark.parametrize("ranks", [2, 3])
def test_random_small_networks_train_over_ranks_as_on_one_device(tmp_path, ranks):
    """Odd sizes (see tests/mpi_scripts/common.random_net), every strategy twice, on one
    or two devices a rank."""
    cases = 10
    ran(mpirun(ranks, "train_equal.py", f"random:{ranks}:{cases}", "-", "reference",
               tmp_path))
    for case in range(cases):
        check_same_training(tmp_path / str(case), ranks)


def test_a_pipeline_with_dropout_over_three_ranks_trains_as_on_one_device(tmp_path):
    """The iteration counter that dropout reads lives on one stage's rank and is counted
    up on another's (see test_parallel.DROPOUT_PIPELINE)."""
    from tests.passes.test_parallel import DROPOUT_PIPELINE

    model = tmp_path / "dropouts.py"
    model.write_text(DROPOUT_PIPELINE)
    ran(mpirun(3, "train_equal.py", model, 8, "reference", tmp_path, 1, "pipeline"))
    check_same_training(tmp_path, 3)


TANH_PIPELINE = """
from purinec.bigraph import Accuracy, Blob, Conv, InnerProduct, Net, SoftmaxWithLoss, TanH

def build(batch=9):
    with Net("tanh") as net:
        data, label = Blob("data", (batch, 1, 9, 9)), Blob("label", (batch,), "i32")
        logits = (data >> Conv("conv0", 1, 3, pad=1) >> TanH("act0")
                  >> InnerProduct("out", 10) >> Blob("logits"))
        net.outputs = [logits, [logits, label] >> SoftmaxWithLoss("loss"),
                       [logits, label] >> Accuracy("accuracy")]
    return net
"""


def test_fused_kernels_never_wait_for_their_own_exchange(tmp_path):
    """On the cpu target, fusion on the first stage's rank once put the tanh with its
    gradient, which comes back from the other rank made from the tanh's output: both
    ranks waited forever. (tests/passes/test_fuse.py checks the rule on a graph.)"""
    model = tmp_path / "tanh.py"
    model.write_text(TANH_PIPELINE)
    ran(mpirun(2, "train_equal.py", model, 9, "cpu", tmp_path, 1, "pipeline"))
    check_same_training(tmp_path, 2)


def check_same_training(folder: Path, size: int) -> None:
    """What tests/mpi_scripts/train_equal.py saved: on every rank, the losses, weights
    and inference outputs of the program over the ranks equal one device's (weights at
    the largest scale they reached, `assert_weights_close`), and the replicas
    on the ranks hold bitwise the same weights and momentum."""
    ranks = [dict(np.load(folder / f"rank{r}.npz")) for r in range(size)]
    for rank in ranks:
        one_loss, many_loss = rank["losses"].T
        np.testing.assert_allclose(many_loss, one_loss, rtol=1e-5)
        params = [k[len("one/"):] for k in rank if k.startswith("one/")]
        for name in params:
            one, many = rank[f"one/{name}"], rank[f"many/{name}"]
            assert_weights_close(many, one, rank[f"scale/{name}"], name)
        outputs = [k[len("one_"):] for k in rank if k.startswith(("one_before/", "one_after/"))]
        assert outputs
        # Inference before training, and with the weights it made (given to the one
        # device too: `adopt_weights`).
        for key in outputs:
            assert_output_close(rank[f"many_{key}"], rank[f"one_{key}"], key)
    for key in ranks[0]:
        if key.startswith("many"):
            for rank in ranks[1:]:
                np.testing.assert_array_equal(rank[key], ranks[0][key], err_msg=key)


def test_a_model_placing_a_layer_on_another_rank_trains_as_on_one_device(tmp_path):
    from tests.passes.test_parallel import PLACED_MODEL

    model = tmp_path / "placed.py"
    model.write_text(PLACED_MODEL)
    ran(mpirun(2, "placed_equal.py", model, tmp_path))
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    for rank in ranks:
        one_loss, many_loss = rank["losses"].T
        np.testing.assert_allclose(many_loss, one_loss, rtol=1e-6)
        for key in (k for k in rank if k.startswith("one/")):
            np.testing.assert_allclose(rank["many/" + key[4:]], rank[key], rtol=1e-6,
                                       atol=1e-7, err_msg=key)
    for key in ranks[0]:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)


WAIT_FOR_ALL = """
import pathlib, sys, time
from purinec.runtime import comm
here = comm.world()
marks = pathlib.Path(sys.argv[1])
if here.rank == 1:
    time.sleep(0.5)  # still compiling, say
    (marks / "rank1").touch()
here.wait_for_all()
if here.rank == 0:
    assert (marks / "rank1").exists(), "rank 0 went on before rank 1 got there"
    print("waited")
"""


def test_wait_for_all_returns_once_every_rank_got_there(tmp_path):
    done = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-c", WAIT_FOR_ALL,
                           str(tmp_path)], capture_output=True, text=True, timeout=TIMEOUT)
    ran(done)
    assert "waited" in done.stdout


def test_under_mpiexec_a_model_is_spread_over_the_ranks_unless_it_places_itself(tmp_path):
    """Without --devices or --parallel, every rank would otherwise train its own copy."""
    from tests.passes.test_parallel import PLACED_MODEL

    # The model puts ip2 on rank 1 itself (by default, not through a build option).
    placed = PLACED_MODEL.replace("second=None", 'second=Location(1, "cpu", 0)')
    assert placed != PLACED_MODEL
    (tmp_path / "placed.py").write_text(placed)
    said = {}
    for model in ("mlp", "placed.py"):
        done = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-m", "purinec",
                               "train", model, "--epochs", "1", "--quiet"],
                              capture_output=True, text=True, timeout=600, cwd=tmp_path)
        ran(done)
        said[model] = re.search(r"on 2 devices \(cpu:0,r1/cpu:0; ranks exchange through "
                                r"(\w+( \w+)?)\)", done.stdout)
    # Data parallelism: gradients allreduced in shared memory. The model's own placement:
    # activations sent from rank 0 to rank 1 and back, by MPI.
    assert said["mlp"] and said["mlp"].group(1) == "shared memory"
    assert said["placed.py"] and said["placed.py"].group(1) == "MPI"


@pytest.mark.parametrize("command", [["train", "one.purine"], ["run", "one.purine"],
                                     ["train", "--resume", "one.purine"]])
def test_under_mpiexec_an_artifact_of_one_device_is_refused(tmp_path, command):
    """Every rank would run all of it alone: N copies of the same work."""
    from purinec.train import Checkpoint

    program = purinec.compile("mlp", target="cpu", train=purinec.SGD(), batch=8)
    Checkpoint(epoch=1, seed=0, data="digits").save(program, tmp_path / "one.purine")
    program.close()
    done = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-m", "purinec",
                           *command, "--epochs" if command[0] == "train" else "--iterations",
                           "2"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode != 0
    assert ("purinec: rank 0: one.purine runs on cpu:0, not over 2 ranks: under mpiexec "
            "every rank would run all of it alone") in done.stderr, done.stderr
    assert "epoch" not in done.stdout and "ms per iteration" not in done.stdout


def test_purinec_dump_under_mpiexec_shows_what_train_would_run(tmp_path):
    """The same default as train and run: data parallelism over the ranks."""
    done = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-m", "purinec", "dump",
                           "mlp", "--train", "--stage", "parallel"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    ran(done)
    assert "%data: f32[64,1,28,28] @cpu:0 ~ split(0)[cpu:0,r1/cpu:0]" in done.stdout
    assert "allreduce" in done.stdout
    assert done.stdout.count("graph mlp") == 1  # printed by rank 0 alone


def test_purinec_train_under_mpiexec(tmp_path):
    checkpoint = tmp_path / "ck.purine"
    done = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-m", "purinec", "train",
                           "convnet", "--target", "cpu", "--parallel", "data", "--epochs", "2",
                           "--quiet", "--checkpoint", str(checkpoint)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    ran(done)
    assert "on 2 devices (cpu:0,r1/cpu:0; ranks exchange through shared memory)" in done.stdout
    assert done.stdout.count("epoch   2") == 1  # rank 0 reports, the others are quiet
    accuracy = float(done.stdout.split("test accuracy")[-1].splitlines()[0])
    assert accuracy > 0.8
    assert checkpoint.exists()
    # Without mpiexec the checkpoint runs its two devices in this process, and evaluates
    # as one device with its weights does.
    loaded = purinec.load(checkpoint)
    assert [str(d) for d in loaded.devices] == ["cpu:0", "cpu:1"]
    one = purinec.compile("convnet", target="cpu", batch=loaded.eval_ir.inputs[0].type.shape[0])
    for name in one.params:
        one.params[name] = loaded.params[name]
    feeds = {v.name: np.random.default_rng(0).standard_normal(v.type.shape).astype(np.float32)
             for v in one.ir.inputs_with_role("data")}
    expected, got = one.run(feeds), loaded.run(feeds)
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        # Half the batch per device: other GEMM shapes, other float32 rounding, which a
        # logit near zero among logits of ~10 feels most (seen: 2.4e-6 at 0.13).
        np.testing.assert_allclose(got[name], value, rtol=1e-5,
                                   atol=1e-6 * max(1.0, np.abs(value).max()), err_msg=name)
    one.close()
    loaded.close()
    resumed = subprocess.run([sys.executable, "-m", "purinec", "train", "--resume",
                              str(checkpoint), "--epochs", "3", "--quiet"],
                             capture_output=True, text=True, timeout=600, cwd=tmp_path)
    ran(resumed)
    assert "after epoch 2 on 2 devices (cpu:0,cpu:1)" in resumed.stdout


def test_only_rank_0_draws_the_progress_bar(tmp_path):
    done = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-m", "purinec", "train",
                           "mlp", "--epochs", "2", "--progress"],
                          capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    ran(done)
    lines = done.stderr.replace("\r", "\n").splitlines()
    started = [line for line in lines if re.fullmatch(r"epoch \d/2: +0%\|.*step/s\]", line)]
    assert [line.split(":")[0] for line in started] == ["epoch 1/2", "epoch 2/2"]


def test_purinec_run_under_mpiexec_traces_every_rank_on_one_clock(tmp_path):
    done = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-m", "purinec", "run",
                           "lenet", "--target", "cpu", "--parallel", "data", "--iterations",
                           "3", "--trace", "t.json", "--timeline", "t.png"],
                          capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    ran(done)
    assert "over 3 iteration(s) on 2 ranks" in done.stdout
    assert re.search(r"wrote timeline t.png: [\d.]+ ms on 2 ranks, communication [\d.]+ ms "
                     r"\(\d+% hidden behind each rank's own compute\)", done.stdout)
    assert (tmp_path / "t.png").stat().st_size > 0
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["name"] == "thread_name"}
    assert sorted(lanes.values()) == ["cpu:0/comm", "cpu:0/compute", "r1/cpu:0/comm",
                                      "r1/cpu:0/compute"]
    # One clock: neither rank completes a collective (the logits' allgather, once an
    # iteration) before the other has posted it.
    spans: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e["ph"] == "X" and lanes[e["pid"], e["tid"]].endswith("/comm"):
            spans.setdefault(e["args"]["call"], []).append((e["ts"], e["ts"] + e["dur"]))
    assert sorted(spans) == [0, 1, 2]
    for (start0, end0), (start1, end1) in spans.values():
        assert end0 >= start1 - 50 and end1 >= start0 - 50  # microseconds


def test_a_program_saved_by_one_process_resumes_over_two_ranks(tmp_path):
    """Two devices of one process, saved, then loaded by a job of two ranks: each rank
    hosts one of the devices, and the steps equal the ones taken in one process."""
    program = purinec.compile("lenet", target="cpu", train=purinec.SGD(lr=0.05, momentum=0.9),
                              batch=12, seed=3, devices=2, parallel="data")
    program.save(tmp_path / "two.purine")
    program.close()
    ran(mpirun(2, "load_elsewhere.py", tmp_path / "two.purine", tmp_path))
    here = tmp_path / "here"
    here.mkdir()
    done = subprocess.run([sys.executable, SCRIPTS / "load_elsewhere.py",
                           tmp_path / "two.purine", here], capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    alone = np.load(here / "rank0.npz")
    assert list(alone["devices"]) == ["cpu:0", "cpu:1"]
    for rank in range(2):
        job = np.load(tmp_path / f"rank{rank}.npz")
        assert list(job["devices"]) == ["cpu:0", "r1/cpu:0"]
        np.testing.assert_allclose(job["losses"], alone["losses"], rtol=1e-6)
        for key in (k for k in alone.files if k.startswith("param/")):
            np.testing.assert_allclose(job[key], alone[key], rtol=1e-5, atol=1e-7,
                                       err_msg=key)


def test_devices_of_one_rank_in_a_job_of_two_is_an_error(tmp_path):
    done = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-m", "purinec", "train",
                           "mlp", "--devices", "2", "--epochs", "1", "--quiet"],
                          capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert done.returncode != 0
    assert "laid out over devices of rank 0 only, but this job has 2 ranks" in done.stderr
