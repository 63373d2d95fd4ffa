"""Time one training iteration on purinec's targets and on PyTorch and JAX, side by side.

    python -m benchmarks.bench_train [--models mlp,lenet,cifar_quick,inception]
        [--targets reference,cpu] [--peers torch,torch.compile,jax|none]
        [--iterations N] [--warmup N] [--rounds R]
        [--threads 2] [--max-seconds S] [--startup-repeats R] [--no-startup] [--quick]
        [--json OUT]

One iteration is forward, backward and SGD (lr 0.01, momentum 0.9, weight decay 5e-4) of
`mlp` (batch 64), `lenet` (64), `cifar_quick` (100) and `inception` (32). Every contender
runs in its own processes (the contenders take turns over a few rounds), with the same
thread budget, after its numerics were checked against purinec's reference target (the
peers given the dropout masks that purinec drew); a contender that disagrees is reported
and not timed. Then fresh processes measure purinec's cold compile and the warm start
from a saved artifact.
benchmarks/README.md says what each number means.
"""

from __future__ import annotations

import argparse
import compileall
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from benchmarks.peers import NETS, PEERS, dropout_layers, make_trainer, output_shapes

MODELS = {"mlp": 64, "lenet": 64, "cifar_quick": 100, "inception": 32}
SOLVER = {"lr": 0.01, "momentum": 0.9, "weight_decay": 5e-4}
PURINEC = "purinec:"  # contenders "purinec:<target>" are purinec's targets

# The numerics check: CHECK_STEPS iterations from purinec's initial weights; each loss
# within LOSS_RTOL of the reference's and every parameter's change over those steps
# within PARAM_RTOL of the reference's change (relative to its largest entry), beyond
# the rounding of the float32 weights themselves: a change of 1e-6 to a weight of 0.05
# (cifar_quick's conv2 in two steps) is only 270 float32 steps of that weight, so each
# weight may also differ by ULPS_PER_STEP of its own spacing per step. PARAM_RTOL leaves
# room for float32 sums of ~1e5 partly cancelling terms: cifar_quick's conv1 gradients
# at batch 100 come out of PyTorch's kernels 1.4e-3 (relative) from float64, out of the
# reference target 7e-7. A wrong layer or solver is off by 0.1 and more.
CHECK_STEPS = 2
LOSS_RTOL = 1e-4
PARAM_RTOL = 1e-2
ULPS_PER_STEP = 2

MIN_TIMED = 3  # timed iterations kept even past --max-seconds
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "NUMBA_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")
REPO = Path(__file__).resolve().parent.parent
VERSIONED = ("purinec", "numpy", "numba", "scipy", "torch", "jax", "jaxlib")


# ---------------------------------------------------------------------------------------
# Shared by parent and workers: the solver, batches, the numerics check.


def solver():
    import purinec

    return purinec.SGD(**SOLVER)


def random_batch(rng: np.random.Generator, data_shape, classes: int):
    x = rng.random(data_shape, dtype=np.float32)
    y = rng.integers(0, classes, data_shape[0]).astype(np.int32)
    return x, y


class CheckData:
    """purinec reference target's CHECK_STEPS iterations: the initial weights, the
    batches, each step's loss and the weights afterwards; and per step the dropout
    masks it drew, by layer name (none for a network without dropout), which the peers
    are given."""

    def __init__(self, init: dict, batches: list, losses: list[float], final: dict,
                 masks: list[dict] | None = None):
        self.init, self.batches, self.losses, self.final = init, batches, losses, final
        self.masks = masks if masks is not None else [{} for _ in batches]

    @classmethod
    def compute(cls, model: str, batch: int, seed: int = 0) -> "CheckData":
        import purinec

        program = purinec.compile(model, target="reference", train=solver(), batch=batch,
                                  seed=seed)
        rng = np.random.default_rng(seed + 1)
        data_shape = program.ir.input("data").type.shape
        classes = program.ir.value("logits").type.shape[1]
        init = {k: np.array(v) for k, v in program.params.items()}
        batches = [random_batch(rng, data_shape, classes) for _ in range(CHECK_STEPS)]
        losses, masks = [], []
        for x, y in batches:
            masks.append(purinec_dropout_masks(program, model, batch))
            losses.append(program.step({"data": x, "label": y}))
        final = {k: np.array(v) for k, v in program.params.items()}
        return cls(init, batches, losses, final, masks)

    def save(self, path: str) -> None:
        arrays = {f"init/{k}": v for k, v in self.init.items()}
        arrays.update({f"final/{k}": v for k, v in self.final.items()})
        for i, (x, y) in enumerate(self.batches):
            arrays[f"x{i}"], arrays[f"y{i}"] = x, y
        for i, masks in enumerate(self.masks):
            arrays.update({f"mask{i}/{k}": v for k, v in masks.items()})
        np.savez(path, losses=np.array(self.losses, dtype=np.float64), **arrays)

    @classmethod
    def load(cls, path: str) -> "CheckData":
        with np.load(path) as f:
            init = {k[5:]: f[k] for k in f.files if k.startswith("init/")}
            final = {k[6:]: f[k] for k in f.files if k.startswith("final/")}
            losses = [float(v) for v in f["losses"]]
            batches = [(f[f"x{i}"], f[f"y{i}"]) for i in range(len(losses))]
            masks = [{k.split("/", 1)[1]: f[k] for k in f.files if k.startswith(f"mask{i}/")}
                     for i in range(len(losses))]
        return cls(init, batches, losses, final, masks)


def purinec_dropout_masks(program, model: str, batch: int) -> dict[str, np.ndarray]:
    """The dropout masks that ``program``'s next training step multiplies by, one per
    dropout layer of the peers' description of ``model``: purinec's NumPy reference
    (`purinec.ir.nnref.dropout_mask`, a counter hash) at the program's iteration
    counter (its ``iteration`` state, which each step increments), with the seed purinec
    gave that layer (in its IR's ``dropout_mask`` node: a crc32 of the layer's name) and
    the layer's p and input shape from the description. The peers cannot draw these
    numbers; the check gives them these masks, so that it compares everything else."""
    layers = dropout_layers(model) if model in NETS else []
    if not layers:
        return {}
    from purinec.ir.nnref import dropout_mask

    seeds = {node.outputs[0].name: node.attrs["seed"] for node in program.ir.nodes
             if node.op == "dropout_mask"}
    shapes = output_shapes(model, batch)
    masks = {}
    for layer in layers:
        seed = seeds.get(f"{layer.name}.mask")
        if seed is None:
            raise ValueError(f"{model}: no dropout_mask node {layer.name}.mask in purinec's "
                             f"IR for the peers' dropout layer {layer.name}")
        (masks[layer.name],) = dropout_mask(program.state["iteration"],
                                            shapes[layer.output], layer.p, seed, "f32")
    return masks


def compare(check: CheckData, losses: list[float],
            params: dict[str, np.ndarray]) -> tuple[dict, list[str]]:
    """The largest relative errors against the reference, and every problem found.
    A parameter's error is how far its change exceeds the reference's change plus the
    float32 rounding of the weight, relative to the largest entry of that change."""
    problems = []
    loss_err = 0.0
    for i, (got, want) in enumerate(zip(losses, check.losses), 1):
        err = abs(got - want) / max(abs(want), 1e-30)
        loss_err = max(loss_err, err) if np.isfinite(err) else float("inf")
        if not err <= LOSS_RTOL:
            problems.append(f"step {i}: loss {got:.7g}, purinec's reference {want:.7g}")
    param_err = 0.0
    for name, start in check.init.items():
        if name not in params:
            problems.append(f"parameter {name} is missing")
            continue
        want = check.final[name] - start
        got = params[name] - start
        rounding = ULPS_PER_STEP * len(losses) * np.spacing(
            np.maximum(np.abs(start), np.abs(check.final[name])))
        excess = np.maximum(np.abs(got - want) - rounding, 0)
        err = float(excess.max() / max(float(np.abs(want).max()), 1e-30))
        param_err = max(param_err, err) if np.isfinite(err) else float("inf")
        if not err <= PARAM_RTOL:
            problems.append(f"{name}: its change over {len(losses)} steps differs from the "
                            f"reference's by {err:.3g} of the largest change (beyond the "
                            f"weights' float32 rounding)")
    return {"loss_rel_err": loss_err, "param_rel_err": param_err}, problems


# ---------------------------------------------------------------------------------------
# Workers: one process per measurement.


class PurinecTrainer:
    """purinec's `Program` behind the peers' trainer interface (see benchmarks.peers)."""

    def __init__(self, model: str, batch: int, target: str, params: dict,
                 devices: str | None = None):
        import purinec

        self.program = purinec.compile(model, target=target, train=solver(), batch=batch,
                                       devices=devices)
        for name, value in params.items():
            self.program.params[name] = value

    def prepare(self, x, y, masks=None):
        """The feeds; ``masks`` (the peers' dropout masks) are not: purinec draws its
        own, the same ones in the check (its iteration counter starts from 0 there)."""
        return {"data": x, "label": y}

    def step(self, feeds) -> float:
        return self.program.step(feeds)

    def params(self) -> dict[str, np.ndarray]:
        return {k: np.array(v) for k, v in self.program.params.items()}

    def close(self) -> None:
        close_program(self.program)


def close_program(program) -> None:
    """Stop the program's worker threads, where its runtime has any."""
    if hasattr(program, "close"):
        program.close()


def _limit_threads(threads: int, contender: str) -> None:
    """Keep the process on ``threads`` CPUs (JAX sizes its pool from them) and set each
    library's own knob; the thread variables came in the environment."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) > threads:
        os.sched_setaffinity(0, cpus[:threads])
    if contender.startswith("torch"):
        import torch

        torch.set_num_threads(threads)
    if contender.startswith(PURINEC):
        from threadpoolctl import threadpool_limits

        threadpool_limits(threads)


def _timed(step: Callable, batch, warmup: int, iterations: int,
           max_seconds: float) -> list[float]:
    """Seconds per iteration; warm-up stops after a quarter of the budget, timing after
    the whole budget once MIN_TIMED iterations are in."""
    start = time.perf_counter()
    for _ in range(warmup):
        step(batch)
        if time.perf_counter() - start > max_seconds / 4:
            break
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < iterations:
        t = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - t)
        if len(times) >= MIN_TIMED and time.perf_counter() - start > max_seconds:
            break
    return times


def _shape_problems(trainer, batch: int, expected: dict) -> list[str]:
    got = trainer.layer_shapes(batch)
    problems = []
    for value, shape in got.items():
        if value not in expected:
            problems.append(f"{value}: no such value in purinec's graph")
        elif tuple(shape) != tuple(expected[value]):
            problems.append(f"{value}: shape {list(shape)}, purinec's {list(expected[value])}")
    return problems


def work_train(job: dict) -> dict:
    """Check one contender's numerics, then time its training iteration."""
    contender, model, batch = job["contender"], job["model"], job["batch"]
    check = CheckData.load(job["check_file"])
    t0 = time.perf_counter()
    if contender.startswith(PURINEC):
        trainer = PurinecTrainer(model, batch, contender[len(PURINEC):], check.init)
        problems = []
    else:
        trainer = make_trainer(contender, model, check.init, **SOLVER)
        problems = _shape_problems(trainer, batch, job["shapes"])
    # The check's steps, with the dropout masks purinec's reference drew (if any).
    (first, first_masks), *rest = zip(check.batches, check.masks)
    losses = [trainer.step(trainer.prepare(*first, first_masks))]
    startup = time.perf_counter() - t0  # build (compile) and the first step
    losses += [trainer.step(trainer.prepare(*batch, masks)) for batch, masks in rest]
    errors, numeric_problems = compare(check, losses, trainer.params())
    problems += numeric_problems
    result = {"startup_s": startup, "check": errors}
    if problems:
        result.update(status="mismatch", problems=problems)
    else:
        # Timed: the first batch, and for a peer the fixed dropout masks
        # (peers.fixed_dropout_masks: a multiply, negligible; purinec draws its own).
        batch_data = trainer.prepare(*check.batches[0])
        times = _timed(trainer.step, batch_data, job["warmup"], job["iterations"],
                       job["max_seconds"])
        result.update(status="ok", times_ms=[t * 1e3 for t in times])
    if isinstance(trainer, PurinecTrainer):
        trainer.close()
    return result


def _first_batch(program) -> dict:
    x, y = random_batch(np.random.default_rng(0), program.ir.input("data").type.shape,
                        program.ir.value("logits").type.shape[1])
    return {"data": x, "label": y}


def _first_result(program) -> float:
    """Run the program's first step (or inference, if it cannot train) on a random
    batch; returns the seconds that took."""
    feeds = _first_batch(program)
    start = time.perf_counter()
    if program.trainable:
        program.step(feeds)
    else:
        program.run({"data": feeds["data"]})
    return time.perf_counter() - start


def work_cold(job: dict) -> dict:
    """Import, compile with an empty kernel cache, first step; then save the artifact."""
    t0 = time.perf_counter()
    import purinec

    t_import = time.perf_counter()
    program = purinec.compile(job["model"], target=job["target"], train=solver(),
                              batch=job["batch"])
    t_compile = time.perf_counter()
    first_step = _first_result(program)
    result = {"status": "ok", "import_s": t_import - t0, "compile_s": t_compile - t_import,
              "first_step_s": first_step, "saved": False}
    if hasattr(program, "save"):
        t_save = time.perf_counter()
        program.save(job["artifact"])
        result.update(saved=True, save_s=time.perf_counter() - t_save)
    close_program(program)
    return result


def work_warm(job: dict) -> dict:
    """Import, load the artifact (kernel cache warm), first step."""
    t0 = time.perf_counter()
    import purinec

    t_import = time.perf_counter()
    program = purinec.load(job["artifact"])
    t_load = time.perf_counter()
    first_step = _first_result(program)
    close_program(program)
    return {"status": "ok", "import_s": t_import - t0, "load_s": t_load - t_import,
            "first_step_s": first_step}


def work_peer_cold(job: dict) -> dict:
    """A peer's cold start: import its framework, build the trainer from the check's
    initial weights and run the first step (torch.compile's JIT compile happens there),
    in a process whose compiler caches are empty (`bench_peer_startup`)."""
    check = CheckData.load(job["check_file"])
    importlib.import_module(job["contender"].split(".")[0])  # timed apart, as purinec's
    t0 = time.perf_counter()
    trainer = make_trainer(job["contender"], job["model"], check.init, **SOLVER)
    t_built = time.perf_counter()
    trainer.step(trainer.prepare(*check.batches[0], check.masks[0]))
    # "compile" is building the trainer: a JIT peer compiles in its first step
    return {"status": "ok", "compile_s": t_built - t0,
            "first_step_s": time.perf_counter() - t_built}


WORK = {"train": work_train, "cold": work_cold, "warm": work_warm,
        "peer_cold": work_peer_cold}


def worker_main(job_path: str) -> int:
    def work(job: dict) -> dict:
        _limit_threads(job["threads"], job.get("contender", PURINEC))
        return WORK[job["kind"]](job)
    return run_job(job_path, work)


def run_job(job_path: str, work: Callable[[dict], dict]) -> int:
    """A worker process's whole life: the job read, ``work(job)`` done, its result (or
    the error it raised) written where the parent looks (`run_worker`)."""
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    try:
        result = work(job)
    except Exception as err:  # reported in the table, with the traceback on stderr
        import traceback

        traceback.print_exc()
        result = {"status": "error", "problems": [f"{type(err).__name__}: {err}"]}
    with open(job["result"], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


# ---------------------------------------------------------------------------------------
# The parent: plan, run workers, print.


def avx2_only() -> dict[str, str]:
    """Variables that keep every contender to AVX2 on an AVX-512 machine (``--isa
    avx2``): an AVX2 machine emulated on the same cores, not measured on one. LLVM
    (purinec's kernels, through Numba) compiles for the host's features without
    AVX-512 and for a CPU of the same maker without it; OpenBLAS takes its Haswell
    kernels; PyTorch's kernels, oneDNN and Inductor's code, and XLA's stop at AVX2."""
    import llvmlite.binding as llvm

    features = llvm.get_host_cpu_features().flatten()
    without = ",".join(("-" + f[1:]) if f[1:].startswith("avx512") else f
                       for f in features.split(","))
    host = llvm.get_host_cpu_name()
    return {"NUMBA_CPU_NAME": "znver3" if host.startswith("znver") else "skylake",
            "NUMBA_CPU_FEATURES": without, "OPENBLAS_CORETYPE": "Haswell",
            "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "XLA_FLAGS": "--xla_cpu_max_isa=AVX2"}


def child_env(threads: int, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({var: str(threads) for var in THREAD_VARS})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run_worker(job: dict, env: dict[str, str], workdir: str, timeout: float,
               module: str = "benchmarks.bench_train") -> dict:
    """Run ``job`` in a fresh process (``python -m module --worker JOB``); its result,
    plus the process's wall time."""
    fd, job_path = tempfile.mkstemp(suffix=".json", dir=workdir)
    job = {**job, "result": job_path + ".out"}
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(job, f)
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", module, "--worker", job_path],
                              cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "error", "problems": [f"no result within {timeout:.0f} s"]}
    wall = time.perf_counter() - start
    try:
        with open(job["result"], encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, ValueError):
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        result = {"status": "error",
                  "problems": [f"worker exited with status {proc.returncode}: {tail}"]}
    if result["status"] == "error" and proc.stderr.strip():
        result["stderr"] = proc.stderr[-4000:]
    result["process_s"] = wall
    result["load_1m"] = load_average()
    return result


def load_average() -> float | None:
    """The 1-minute load average: how busy the (shared) machine was."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(),
            "versions": {d: version(d) for d in VERSIONED if version(d)},
            "load_1m": load_average()}
    try:
        from threadpoolctl import threadpool_info

        info["blas"] = [f"{p.get('internal_api')} {p.get('version')} "
                        f"({p.get('architecture', '?')})" for p in threadpool_info()
                        if p.get("user_api") == "blas"]
    except ImportError:
        pass
    return info


SGEMM_SIZE = 2048


def sgemm_rate(threads: int, repeats: int = 5) -> float | None:
    """The machine's float32 matrix-product rate in GFLOP/s: the best of ``repeats``
    2048-cube products by NumPy's BLAS on ``threads`` threads, the yardstick issue 27
    measures a training step's FLOP rate against."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((SGEMM_SIZE, SGEMM_SIZE), dtype=np.float32) for _ in "ab")
    best = float("inf")
    with threadpool_limits(threads):
        a @ b  # BLAS's threads started, buffers allocated
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    return 2 * SGEMM_SIZE ** 3 / best / 1e9


def summarize(times_ms: list[float]) -> dict:
    t = np.array(times_ms)
    return {"median_ms": float(np.median(t)), "p10_ms": float(np.percentile(t, 10)),
            "p90_ms": float(np.percentile(t, 90)), "n": len(t)}


def model_facts(model: str, batch: int) -> dict:
    """The training graph's FLOPs and the shapes of the values the peers produce."""
    import purinec
    from purinec.compiler import build_graph, load_source
    from purinec.passes.cost import flops

    graph = build_graph(load_source(model, batch), purinec.SGD(**SOLVER))
    shapes = {name: list(graph.value(name).type.shape)
              for name in output_shapes(model, batch)}
    return {"flops": flops(graph), "shapes": shapes}


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def bench_model(model: str, batch: int, contenders: list[str], args, workdir: str) -> list:
    """Every contender's row for ``model``. The contenders take turns over
    ``args.rounds`` rounds, a fresh process each, so that a burst of load from elsewhere
    on a shared machine falls on all of them rather than on one."""
    facts = model_facts(model, batch)
    say(f"[{model}] computing the reference check ({CHECK_STEPS} steps on the reference "
        f"target)")
    check_file = os.path.join(workdir, f"{model}.check.npz")
    CheckData.compute(model, batch).save(check_file)
    job = {"kind": "train", "model": model, "batch": batch, "check_file": check_file,
           "shapes": facts["shapes"], "iterations": -(-args.iterations // args.rounds),
           "warmup": args.warmup, "max_seconds": args.max_seconds / args.rounds,
           "threads": args.threads}
    runs: dict[str, list[dict]] = {c: [] for c in contenders}
    for r in range(args.rounds):
        for contender in contenders:
            if runs[contender] and runs[contender][-1]["status"] != "ok":
                continue  # it failed or disagreed: once is enough
            say(f"[{model}] {contender}, round {r + 1}/{args.rounds} ...")
            result = run_worker({**job, "contender": contender}, child_env(args.threads),
                                workdir, args.timeout)
            say(f"[{model}] {contender}: " + (
                f"{np.median(result['times_ms']):.2f} ms" if result["status"] == "ok"
                else result["status"].upper()))
            runs[contender].append(result)
    rows = [{"model": model, "batch": batch, "flops": facts["flops"], "contender": c,
             **merge_rounds(runs[c])} for c in contenders]
    for row in rows:
        if row["status"] == "ok":
            row["gflops_per_s"] = facts["flops"] / row["median_ms"] / 1e6
    best = min((r["median_ms"] for r in rows
                if r["status"] == "ok" and r["contender"].startswith(PURINEC)), default=None)
    for row in rows:
        if best is not None and row["status"] == "ok" and not row["contender"].startswith(
                PURINEC):
            row["peer_over_purinec"] = row["median_ms"] / best
    return rows


def merge_rounds(results: list[dict]) -> dict:
    """One row from a contender's rounds: all timed iterations together, the first
    round's startup, the largest check errors and load; the last round's status."""
    last = results[-1]
    row = {"status": last["status"], "rounds": len(results),
           "startup_s": results[0].get("startup_s"),
           "load_1m": max((r["load_1m"] for r in results if r.get("load_1m") is not None),
                          default=None),
           "process_s": sum(r["process_s"] for r in results if "process_s" in r)}
    for key in ("problems", "stderr"):
        if key in last:
            row[key] = last[key]
    checks = [r["check"] for r in results if "check" in r]
    if checks:
        row["check"] = {k: max(c[k] for c in checks) for k in checks[0]}
    if last["status"] == "ok":
        row["times_ms"] = [t for r in results for t in r["times_ms"]]
        row.update(summarize(row["times_ms"]))
    return row


def bench_startup(model: str, batch: int, target: str, args, workdir: str) -> dict:
    """Cold compile and warm start, each in fresh processes, ``args.startup_repeats``
    times; every cold run gets an empty kernel cache, its warm run reuses that cache."""
    row: dict[str, Any] = {"model": model, "contender": PURINEC + target, "cold": [],
                           "warm": []}
    base = {"model": model, "batch": batch, "target": target, "threads": args.threads}
    for r in range(args.startup_repeats):
        cache = tempfile.mkdtemp(prefix=f"cache-{model}-{target}-{r}-", dir=workdir)
        env = child_env(args.threads, PURINEC_CACHE_DIR=cache)
        env.pop("NUMBA_CACHE_DIR", None)  # Numba caches beside the kernels, in `cache`
        artifact = os.path.join(cache, f"{model}.purine")
        say(f"[{model}] {PURINEC}{target} cold start {r + 1}/{args.startup_repeats} ...")
        cold = run_worker({**base, "kind": "cold", "artifact": artifact}, env, workdir,
                          args.timeout)
        row["cold"].append(cold)
        if cold["status"] != "ok":
            continue
        if not cold["saved"]:
            row["note"] = f"target {target} programs have no save(): warm start not measured"
            continue
        say(f"[{model}] {PURINEC}{target} warm start {r + 1}/{args.startup_repeats} ...")
        row["warm"].append(run_worker({**base, "kind": "warm", "artifact": artifact}, env,
                                      workdir, args.timeout))
    _summarize_startup(row)
    return row


def compile_bytecode() -> None:
    """Write purinec's bytecode, as installing a package does, so that the startups
    import it as a user's would: where ``PYTHONDONTWRITEBYTECODE`` is set (some
    sandboxes set it) an editable checkout never gets it, and every process compiled
    purinec's sources again (0.2 s of each warm start, on the Zen 4 machine)."""
    compileall.compile_dir(REPO / "purinec", quiet=1)


JIT_PEERS = ("torch.compile", "jax")  # peers that compile: their cold start is measured
# Where the peers keep compiled code between processes; a cold start gets them empty.
PEER_CACHE_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
                   "JAX_COMPILATION_CACHE_DIR")


def bench_peer_startup(model: str, batch: int, peer: str, args, workdir: str) -> dict:
    """A peer's cold start (build + first step, its compiler caches empty), in fresh
    processes, ``args.startup_repeats`` times: what purinec's cold compile is held
    against. There is no warm start to compare: the peers save no compiled program."""
    row: dict[str, Any] = {"model": model, "contender": peer, "cold": [], "warm": []}
    job = {"model": model, "batch": batch, "contender": peer, "threads": args.threads,
           "kind": "peer_cold", "check_file": os.path.join(workdir, f"{model}.check.npz")}
    for r in range(args.startup_repeats):
        cache = tempfile.mkdtemp(prefix=f"cache-{model}-{peer}-{r}-", dir=workdir)
        env = child_env(args.threads, **{var: cache for var in PEER_CACHE_VARS})
        say(f"[{model}] {peer} cold start {r + 1}/{args.startup_repeats} ...")
        row["cold"].append(run_worker(job, env, workdir, args.timeout))
    _summarize_startup(row)
    return row


def _summarize_startup(row: dict) -> None:
    def median(runs, *keys):
        ok = [r for r in runs if r["status"] == "ok"]
        return float(np.median([sum(r[k] for k in keys) for r in ok])) if ok else None

    row["cold_s"] = median(row["cold"], "compile_s", "first_step_s")
    row["cold_process_s"] = median(row["cold"], "process_s")
    row["warm_s"] = median(row["warm"], "load_s", "first_step_s")
    row["warm_process_s"] = median(row["warm"], "process_s")
    row["import_s"] = median([r for r in row["cold"] + row["warm"] if "import_s" in r],
                             "import_s")
    failed = [p for r in row["cold"] + row["warm"] if r["status"] != "ok"
              for p in r.get("problems", [])]
    row["status"] = "error" if failed else "ok"
    row["problems"] = failed


# ---------------------------------------------------------------------------------------
# Reporting.


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def check_text(row: dict) -> str:
    if row["status"] in ("ok", "mismatch") and "check" in row:
        c = row["check"]
        head = "ok" if row["status"] == "ok" else "MISMATCH"
        return f"{head} (loss {c['loss_rel_err']:.0e}, dw {c['param_rel_err']:.0e})"
    return row["status"].upper()


def train_table(rows: list[dict], threads: int) -> str:
    lines = [f"One training iteration: forward, backward, SGD (lr {SOLVER['lr']}, momentum "
             f"{SOLVER['momentum']}, weight decay {SOLVER['weight_decay']}), {threads} "
             f"threads each.",
             "peer/purinec = peer median / purinec's best target median (>1: purinec is "
             "faster); n = timed iterations over all rounds; startup = build (compile) + "
             "first step in the first round's process; load = the machine's highest "
             "1-minute load average after a round; check = largest relative error vs "
             "purinec's reference target.",
             ""]
    head = (f"{'model':<12}{'batch':>6}{'GFLOP':>8}  {'contender':<19}{'median ms':>10}"
            f"{'p10':>9}{'p90':>9}{'n':>5}{'GFLOP/s':>9}{'peer/purinec':>13}"
            f"{'startup s':>10}{'load':>6}  check")
    lines += [head, "-" * len(head)]
    last_model = None
    for r in rows:
        first = r["model"] != last_model
        last_model = r["model"]
        model_cols = (f"{r['model']:<12}{r.get('batch', ''):>6}"
                      f"{_fmt(r.get('flops') and r['flops'] / 1e9, '.3f', ''):>8}"
                      if first else " " * 26)
        ok = r["status"] == "ok"
        lines.append(
            f"{model_cols}  {r['contender']:<19}"
            f"{_fmt(r.get('median_ms') if ok else None, '.2f'):>10}"
            f"{_fmt(r.get('p10_ms') if ok else None, '.2f'):>9}"
            f"{_fmt(r.get('p90_ms') if ok else None, '.2f'):>9}"
            f"{_fmt(r.get('n') if ok else None, 'd'):>5}"
            f"{_fmt(r.get('gflops_per_s') if ok else None, '.1f'):>9}"
            f"{_fmt(r.get('peer_over_purinec'), '.2f'):>13}"
            f"{_fmt(r.get('startup_s'), '.2f'):>10}{_fmt(r.get('load_1m'), '.1f'):>6}"
            f"  {check_text(r)}")
    return "\n".join(lines)


def sgemm_shares(rows: list[dict], sgemm_gflops: float | None) -> list[str]:
    """Each model's fastest purinec target's FLOP rate as a share of the machine's
    sgemm rate (also kept in its row)."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        ours = [r for r in rows if r["model"] == model and r["contender"].startswith(PURINEC)
                and r.get("gflops_per_s")]
        if not ours or not sgemm_gflops:
            continue
        best = max(ours, key=lambda r: r["gflops_per_s"])
        best["share_of_sgemm"] = best["gflops_per_s"] / sgemm_gflops
        lines.append(f"{model}: {best['contender']} at {best['share_of_sgemm']:.0%} of the "
                     f"machine's sgemm rate")
    return [""] + lines if lines else []


def startup_table(rows: list[dict]) -> str:
    lines = ["Startup, fresh processes (medians): cold = compile with an empty kernel cache "
             "+ first step (a peer: build + first step, its compiler caches empty); warm = "
             "purinec.load(artifact) + first step, kernel cache warm; process = the whole "
             "process, interpreter and imports included.", ""]
    head = (f"{'model':<12}  {'contender':<19}{'import s':>9}{'cold s':>9}{'process':>9}"
            f"{'warm s':>9}{'process':>9}{'cold/warm':>10}")
    lines += [head, "-" * len(head)]
    for r in rows:
        ratio = r["cold_s"] / r["warm_s"] if r["cold_s"] and r["warm_s"] else None
        lines.append(f"{r['model']:<12}  {r['contender']:<19}"
                     f"{_fmt(r['import_s'], '.2f'):>9}{_fmt(r['cold_s'], '.3f'):>9}"
                     f"{_fmt(r['cold_process_s'], '.2f'):>9}{_fmt(r['warm_s'], '.3f'):>9}"
                     f"{_fmt(r['warm_process_s'], '.2f'):>9}{_fmt(ratio, '.1f'):>10}")
    notes = sorted({r["note"] for r in rows if r.get("note")})
    return "\n".join(lines + _cold_ratios(rows) + [f"note: {n}" for n in notes])


def _cold_ratios(rows: list[dict]) -> list[str]:
    """Each model's cold start on each purinec target that compiles kernels, as a share
    of each compiling peer's."""
    from purinec.targets import TARGETS

    compiling = {PURINEC + name for name, target in TARGETS.items() if target.generates_code}
    lines = []
    for ours in (r for r in rows if r["contender"] in compiling and r["cold_s"]):
        for peer in (r for r in rows if r["model"] == ours["model"] and r["cold_s"]
                     and not r["contender"].startswith(PURINEC)):
            lines.append(f"{ours['model']}: {ours['contender']}'s cold start is "
                         f"{ours['cold_s'] / peer['cold_s']:.2f} of {peer['contender']}'s")
    return [""] + lines if lines else []


def problems_text(train_rows: list[dict], startup_rows: list[dict]) -> str:
    blocks = []
    for r in train_rows:
        if r["status"] == "mismatch":
            blocks.append(f"!!! NUMERICS MISMATCH: {r['contender']} on {r['model']} disagrees "
                          f"with purinec's reference target; it was NOT timed:")
        elif r["status"] == "error":
            blocks.append(f"!!! FAILED: {r['contender']} on {r['model']}:")
        else:
            continue
        blocks += [f"      {p}" for p in r.get("problems", [])]
    for r in startup_rows:
        if r["status"] != "ok":
            blocks.append(f"!!! FAILED: startup of {r['contender']} on {r['model']}:")
            blocks += [f"      {p}" for p in r["problems"]]
    return "\n".join(blocks)


def machine_text(info: dict, threads: int) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    start, end = info.get("load_1m"), info.get("load_1m_end")
    load_text = (f", 1-minute load average {start:.2f} at the start, {end:.2f} at the end"
                 if start is not None and end is not None else "")
    return "\n".join([
        f"machine: {info['cpu']}, {info['cpus']} CPUs{load_text}; {threads} threads per "
        f"contender (a shared machine: expect noise)",
        f"BLAS: {'; '.join(info.get('blas', [])) or '?'}" + (
            f"; sgemm {SGEMM_SIZE}^3 on {threads} threads: {info['sgemm_gflops']:.0f} GFLOP/s"
            if info.get("sgemm_gflops") else ""),
        f"versions: Python {info['python']}, {versions}"])


# ---------------------------------------------------------------------------------------
# Command line.


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_train",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated, from {', '.join(MODELS)} (default: all)")
    p.add_argument("--targets",
                   help="purinec targets (default: every registered one that can run here)")
    p.add_argument("--peers", help=f"from {', '.join(PEERS)}, or none (default: every "
                                   "installed one)")
    p.add_argument("--iterations", type=int, help="timed iterations (default 60)")
    p.add_argument("--warmup", type=int, help="untimed iterations first (default 5)")
    p.add_argument("--max-seconds", type=float,
                   help="time budget per contender; stops early, keeping at least "
                        f"{MIN_TIMED} iterations a round (default 45)")
    p.add_argument("--rounds", type=int,
                   help="the contenders take turns this many times, a fresh process each; "
                        "iterations and budget are split between the rounds (default 3)")
    p.add_argument("--threads", type=int, default=2, help="threads per contender (default 2)")
    p.add_argument("--isa", choices=("host", "avx2"), default="host",
                   help="avx2: every contender kept to AVX2 (an AVX2 machine emulated on "
                        "an AVX-512 one; see avx2_only). Default: what the host has")
    p.add_argument("--startup-repeats", type=int,
                   help="fresh-process cold/warm starts per model and target (default 3)")
    p.add_argument("--no-startup", action="store_true", help="skip the cold/warm starts")
    p.add_argument("--quick", action="store_true",
                   help="tiny counts (3 iterations, 1 warm-up, 1 round, 1 startup repeat): "
                        "a smoke test")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per worker process")
    p.add_argument("--json", metavar="OUT", help="also write every number to this file")
    p.add_argument("--worker", metavar="JOB", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = ((3, 1, 10.0, 1, 1) if args.quick else (60, 5, 45.0, 3, 3))
    for key, default in zip(("iterations", "warmup", "max_seconds", "startup_repeats",
                             "rounds"), defaults):
        if getattr(args, key) is None:
            setattr(args, key, default)
    if args.worker:
        return args
    args.models = _names(args.models)
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    from purinec.targets import TARGETS

    args.targets = _names(args.targets) if args.targets else runnable_targets()
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        p.error(f"unknown target(s) {', '.join(unknown)}; registered: {', '.join(TARGETS)}")
    args.peers = [] if args.peers == "none" else _names(args.peers or ",".join(PEERS))
    unknown = [n for n in args.peers if n not in PEERS]
    if unknown:
        p.error(f"unknown peer(s) {', '.join(unknown)}; peers: {', '.join(PEERS)}, or none")
    if min(args.iterations, args.rounds, args.threads, args.startup_repeats) < 1 or \
            args.warmup < 0:
        p.error("--iterations, --rounds, --threads and --startup-repeats must be >= 1, "
                "--warmup >= 0")
    return args


def runnable_targets() -> list[str]:
    """Every registered purinec target that can run here (cuda only with a GPU), saying
    which were left out and why."""
    from purinec.targets import TARGETS

    runnable = []
    for name, target in TARGETS.items():
        reason = target.missing() or target.cannot_run()
        if reason:
            say(f"target {name} left out: {reason.splitlines()[0]}")
        else:
            runnable.append(name)
    return runnable


def installed_peers(names: list[str]) -> tuple[list[str], list[str]]:
    """The peers whose framework is installed, and notes about the others."""
    chosen = [n for n in names if installed(n.split(".")[0])]
    notes = [f"{n}: {n.split('.')[0]} is not installed; skipped (pip install the 'bench' "
             f"extras)" for n in names if n not in chosen]
    return chosen, notes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if args.isa == "avx2":  # (the workers inherit it; this process's BLAS has started)
        os.environ.update(avx2_only())
    peers, notes = installed_peers(args.peers)
    from purinec.targets import TARGETS

    if "cpu" not in TARGETS:
        notes.append("purinec's cpu target is not registered in this build; only "
                     f"{', '.join(TARGETS)} measured")
    info = machine()
    info["sgemm_gflops"] = sgemm_rate(args.threads)
    if args.isa == "avx2":
        info["cpu"] += (" with every contender kept to AVX2 (--isa avx2, an emulation; "
                        "the sgemm rate below is not kept to it)")
    contenders = [PURINEC + t for t in args.targets] + peers
    train_rows, startup_rows = [], []
    with tempfile.TemporaryDirectory(prefix="purinec-bench-") as workdir:
        for model in args.models:
            train_rows += bench_model(model, MODELS[model], contenders, args, workdir)
        if not args.no_startup:
            compile_bytecode()
            for model in args.models:
                for target in args.targets:
                    startup_rows.append(bench_startup(model, MODELS[model], target, args,
                                                      workdir))
                for peer in (p for p in peers if p in JIT_PEERS):
                    startup_rows.append(bench_peer_startup(model, MODELS[model], peer, args,
                                                           workdir))
    info["load_1m_end"] = load_average()
    report = [machine_text(info, args.threads), "", train_table(train_rows, args.threads),
              *sgemm_shares(train_rows, info["sgemm_gflops"])]
    if startup_rows:
        report += ["", startup_table(startup_rows)]
    report += [f"note: {n}" for n in notes]
    problems = problems_text(train_rows, startup_rows)
    if problems:
        report += ["", problems]
    print("\n".join(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": info, "threads": args.threads, "solver": SOLVER,
                       "train": train_rows, "startup": startup_rows, "notes": notes}, f,
                      indent=1)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
