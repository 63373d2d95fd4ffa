"""Every CUDA renderer against the NumPy reference, in Numba's CUDA simulator.

The simulator must be chosen before Numba is imported, so the cases run in processes of
their own (`tests.on_cuda.simulate`), a few at a time across the two cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.on_cuda.simulate import all_cases

pytest.importorskip("numba_cuda", reason="the [cuda] extra (numba-cuda) is not installed")

ROOT = Path(__file__).resolve().parents[2]
CASES = sorted(all_cases(kinds=("CASES",)))
PROGRAMS = sorted(all_cases(kinds=("PROGRAMS",)))
PROCESSES = 2


def simulate(names: list[str], cache_dir: Path, timeout: float = 600) -> dict[str, str | None]:
    """Run ``names`` in the simulator; each case's error, or None."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "PURINEC_CACHE_DIR": str(cache_dir)}
    done = subprocess.run([sys.executable, "-m", "tests.on_cuda.simulate", *names], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            results[entry["case"]] = entry["error"]
    missing = [n for n in names if n not in results]
    if missing:
        raise AssertionError(f"the simulator process (exit {done.returncode}) reported "
                             f"nothing for {missing}:\n{done.stderr[-3000:]}")
    return results


def simulate_all(names: list[str], cache_dir: Path) -> dict[str, str | None]:
    """``names`` shared out over PROCESSES simulator processes."""
    shares = [names[i::PROCESSES] for i in range(PROCESSES)]
    with ThreadPoolExecutor(PROCESSES) as pool:
        parts = pool.map(lambda share: simulate(share, cache_dir), shares)
    return {name: error for part in parts for name, error in part.items()}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, str | None]:
    return simulate_all(CASES, tmp_path_factory.mktemp("cuda_cache"))


@pytest.fixture(scope="module")
def program_outcomes(tmp_path_factory) -> dict[str, str | None]:
    return simulate_all(PROGRAMS, tmp_path_factory.mktemp("cuda_cache"))


@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_the_reference_in_the_simulator(outcomes, case):
    error = outcomes[case]
    assert error is None, error


@pytest.mark.slow
@pytest.mark.parametrize("case", PROGRAMS)
def test_program_on_cuda_equals_the_reference_in_the_simulator(program_outcomes, case):
    """Training steps of an mlp and a small convnet, data parallelism over two gpu
    devices, a graph placed on a cpu and a gpu: whole programs, in the simulator."""
    error = program_outcomes[case]
    assert error is None, error


# Each also on streams that run only when waited for (`tests.on_cuda.lazy_gpu`).
MPI_STRATEGIES = tuple(f"{lazy}{strategy}" for lazy in ("", "lazy-")
                       for strategy in ("data", "ps", "model", "pipeline"))


@pytest.mark.slow
@pytest.mark.mpi
def test_every_strategy_over_mpi_ranks_each_driving_a_gpu_equals_one_device(tmp_path):
    """Two ranks, r0/gpu:0 and r1/gpu:0, their collectives, sends and receives through
    host memory (shared memory between the ranks), against the reference target."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "PURINEC_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": str(ROOT)}
    mpiexec = Path(sys.executable).parent / "mpiexec"
    done = subprocess.run([str(mpiexec), "-n", "2", sys.executable,
                           str(ROOT / "tests" / "on_cuda" / "mpi_train.py"), str(tmp_path),
                           *MPI_STRATEGIES], env=env, capture_output=True, text=True,
                          timeout=600)
    for strategy in MPI_STRATEGIES:
        for rank in range(2):
            report = tmp_path / f"{strategy}.rank{rank}.txt"
            assert report.exists(), f"rank {rank} wrote nothing: {done.stderr[-2000:]}"
            assert report.read_text() == "ok", f"{strategy}: {report.read_text()}"
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_gpu_check_runs_every_section_in_the_simulator(tmp_path):
    """benchmarks/gpu_check.py --smoke: the script a GPU's few minutes go to, end to end
    on tiny sizes, so that they are not lost to a bug in it."""
    # (products through cuBLAS's calls, as on a GPU: the simulator's stand-in)
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "PURINEC_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": str(ROOT), "PURINEC_CUDA_PRODUCTS": "cublas"}
    report = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--smoke",
                           "--json", str(report)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(report.read_text())
    assert [(row["products"], row["devices"]) for row in result["numerics"]] == [
        ("cublas", "gpu:0"), ("tiled", "gpu:0"), ("cublas", "gpu:0,gpu:1")]
    for row in result["numerics"]:
        assert row["problems"] == [], row
    assert result["bandwidth"]["share_of_copy"] > 0, result["bandwidth"]
    (speed,) = result["speed"]
    assert all(speed[way] > 0 for way in ("purinec", "purinec graph", "purinec tiled")), speed
    assert [row["devices"] for row in result["cuda_graphs"]] == ["gpu:0", "gpu:0,gpu:1"]
    for graphs in result["cuda_graphs"]:
        assert graphs["same_loss"] and graphs["speedup"] > 0, graphs
        assert graphs["graph_status"].startswith("replaying"), graphs
    assert graphs["graph_status"] == "replaying one CUDA graph per call", graphs
    assert "numerics (3 steps vs reference)" in done.stdout
