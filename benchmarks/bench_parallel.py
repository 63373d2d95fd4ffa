"""Weak scaling of data parallelism: the same per-device batch on 1 and on N devices.

    python -m benchmarks.bench_parallel [--models lenet,cifar_quick] [--ranks 2]
        [--iterations 30] [--warmup 5] [--repeats 3] [--mode mpi,threads] [--json OUT]

For each model, one training iteration (forward, backward, SGD) is timed on the cpu
target with the model's batch on one device pinned to one core, then with that batch on
each of N devices: N MPI ranks (`--mode mpi`: mpiexec, one process and one core per
rank) or N devices in one process (`--mode threads`: one worker thread and one core's
share each). Weak-scaling efficiency is t(1) / t(N): 1.0 means N devices do N times the
work in the same time. From a trace of the timed iterations on rank 0, the share of
communication time that some compute lane was busy through ("hidden") says how well
the allreduces overlap the backward pass, and "exposed" is the communication time per
iteration during which no compute lane was busy. (A collective's time in the trace runs
until the runtime sees it complete, which it checks rarely while compute is busy: that
lengthens hidden time, never exposed time.)

Timings on a shared machine drift by 15-20% over minutes, so the one-device and the
N-device runs alternate (`--repeats` rounds of one, then each mode) and each round gives
its own efficiency: the table shows their median and range.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MODELS = {"lenet": 64, "cifar_quick": 100}
SOLVER = {"lr": 0.01, "momentum": 0.9, "weight_decay": 5e-4}
REPO = Path(__file__).resolve().parent.parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def worker(args) -> None:
    """One process of a measurement: compile, warm up, time, and (rank 0) report."""
    import purinec
    from purinec.runtime import comm
    from purinec.runtime.trace import Trace
    from purinec.viz import overlap

    here = comm.world()
    if args.devices and not here.size > 1:
        os.sched_setaffinity(0, set(range(len(args.devices.split(",")))))
    elif here.size == 1:
        os.sched_setaffinity(0, {0})
    per_device = MODELS[args.worker]
    devices = args.devices or (",".join(f"r{r}/cpu:0" for r in range(here.size))
                               if here.size > 1 else None)
    count = len(devices.split(",")) if devices else 1
    trace = Trace()
    program = purinec.compile(args.worker, target="cpu", train=purinec.SGD(**SOLVER),
                              batch=per_device * count, devices=devices,
                              parallel="data" if devices else None, trace=trace)
    rng = np.random.default_rng(0)
    feeds = {v.name: (rng.standard_normal(v.type.shape).astype(np.float32)
                      if v.type.dtype.is_float else
                      rng.integers(0, 10, v.type.shape).astype(v.type.dtype.numpy))
             for v in program.ir.inputs_with_role("data")}
    for _ in range(args.warmup):
        program.step(feeds)
    trace.clear()
    times = []
    for _ in range(args.iterations):
        start = time.perf_counter()
        program.step(feeds)
        times.append(time.perf_counter() - start)
    program.close()
    if here.rank == 0:
        stats = overlap(trace.events())
        Path(args.out).write_text(json.dumps({
            "median_ms": float(np.median(times)) * 1e3, "times_ms": [t * 1e3 for t in times],
            "comm_ms_per_iteration": stats["comm_ms"] / args.iterations,
            "exposed_ms_per_iteration": (stats["comm_ms"] - stats["hidden_ms"]) / args.iterations,
            "hidden_fraction": stats["hidden_fraction"]}))


def measure(model: str, launcher: list[str], extra: list[str], args) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        command = [*launcher, sys.executable, "-m", "benchmarks.bench_parallel",
                   "--worker", model, "--iterations", str(args.iterations),
                   "--warmup", str(args.warmup), "--out", str(out), *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
        return json.loads(out.read_text())


def measure_many(model: str, mode: str, args) -> dict:
    if mode == "mpi":
        return measure(model, [str(MPIEXEC), "-n", str(args.ranks), "-bind-to", "core"], [],
                       args)
    return measure(model, [], ["--devices", ",".join(f"cpu:{i}" for i in range(args.ranks))],
                   args)


def summarize(runs: list[dict]) -> dict:
    """Medians over the rounds; each round's efficiency from its own pair of runs."""
    efficiencies = [run["one"]["median_ms"] / run["many"]["median_ms"] for run in runs]
    return {
        "one_ms": float(np.median([run["one"]["median_ms"] for run in runs])),
        "many_ms": float(np.median([run["many"]["median_ms"] for run in runs])),
        "efficiency": float(np.median(efficiencies)),
        "efficiency_range": (min(efficiencies), max(efficiencies)),
        "comm_ms_per_iteration": float(np.median(
            [run["many"]["comm_ms_per_iteration"] for run in runs])),
        "hidden_fraction": float(np.median([run["many"]["hidden_fraction"] for run in runs])),
        "exposed_ms_per_iteration": float(np.median(
            [run["many"]["exposed_ms_per_iteration"] for run in runs])),
        "rounds": runs,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)} (all)")
    parser.add_argument("--ranks", type=int, default=2, help="devices to scale to (2)")
    parser.add_argument("--iterations", type=int, default=30,
                        help="timed training iterations per run (30)")
    parser.add_argument("--warmup", type=int, default=5,
                        help="untimed iterations before them (5)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of one-device and N-device runs, alternating (3)")
    parser.add_argument("--mode", default="mpi,threads",
                        help="mpi: one process per device; threads: devices of one process")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--devices", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    modes = args.mode.split(",")
    results = {}
    print(f"{'model':12} {'mode':8} {'1 device ms':>12} {f'{args.ranks} devices ms':>14} "
          f"{'efficiency (range)':>19} {'comm ms':>8} {'hidden':>7} {'exposed ms':>10}")
    for model in args.models.split(","):
        rounds = {mode: [] for mode in modes}
        for _ in range(args.repeats):
            one = measure(model, [], [], args)
            for mode in modes:
                rounds[mode].append({"one": one, "many": measure_many(model, mode, args)})
        for mode, runs in rounds.items():
            results[f"{model}/{mode}"] = summary = summarize(runs)
            low, high = summary["efficiency_range"]
            print(f"{model:12} {mode:8} {summary['one_ms']:12.2f} {summary['many_ms']:14.2f} "
                  f"{summary['efficiency']:6.2f} ({low:.2f}-{high:.2f}) "
                  f"{summary['comm_ms_per_iteration']:8.2f} {summary['hidden_fraction']:7.0%} "
                  f"{summary['exposed_ms_per_iteration']:10.2f}",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
