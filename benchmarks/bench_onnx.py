"""Time inference of imported ONNX models on purinec's cpu target and on onnxruntime,
side by side.

    python -m benchmarks.bench_onnx [--models resnet18,mobilenet_v2,squeezenet1_1,googlenet]
        [--batches 1,32] [--iterations N] [--warmup N] [--rounds R] [--threads 2]
        [--max-seconds S] [--quick] [--json OUT]

The models are torchvision's, exported by PyTorch with random weights
(tests/onnx/models, filled by tests.onnx.torchvision_models). Each contender runs in
its own fresh processes with the same thread budget, taking turns over a few rounds;
before timing, purinec's outputs on one batch must equal onnxruntime's within 1e-4
(relative to the largest output). benchmarks/README.md says what each number means.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import numpy as np

from benchmarks.bench_train import (child_env, load_average, machine, run_job, run_worker,
                                    say, summarize, version)

MODELS = ("resnet18", "mobilenet_v2", "squeezenet1_1", "googlenet")
CONTENDERS = ("purinec:cpu", "onnxruntime")
CHECK_RTOL = 1e-4
MIN_TIMED = 3


def inputs(batch: int) -> np.ndarray:
    return np.random.default_rng(batch).standard_normal((batch, 3, 224, 224)).astype(
        np.float32)


# -- the worker: one contender, one model, one batch ------------------------------------


def _runner(job: dict):
    """(build seconds, a function of the input array giving the scores)."""
    from tests.onnx.torchvision_models import load

    model = load(job["model"])
    began = time.perf_counter()
    if job["contender"] == "onnxruntime":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = job["threads"]
        options.inter_op_num_threads = 1
        session = ort.InferenceSession(model.SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
        return time.perf_counter() - began, lambda x: session.run(None, {"input": x})[0]
    import purinec
    from threadpoolctl import threadpool_limits

    threadpool_limits(job["threads"])
    program = purinec.compile(model, target=job["contender"].split(":")[1],
                              batch=job["batch"])
    return time.perf_counter() - began, lambda x: program.run({"input": x})["logits"]


def work(job: dict) -> dict:
    build_s, run = _runner(job)
    x = inputs(job["batch"])
    np.save(job["result"] + ".npy", run(x))
    start = time.perf_counter()
    for _ in range(job["warmup"]):
        run(x)
        if time.perf_counter() - start > job["max_seconds"] / 4:
            break
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < job["iterations"]:
        t = time.perf_counter()
        run(x)
        times.append(time.perf_counter() - t)
        if len(times) >= MIN_TIMED and time.perf_counter() - start > job["max_seconds"]:
            break
    return {"status": "ok", "build_s": build_s, "times_ms": [t * 1e3 for t in times],
            "outputs": job["result"] + ".npy"}


# -- the parent -------------------------------------------------------------------------


def bench(model: str, batch: int, args, workdir: str) -> list[dict]:
    """Both contenders' rows for ``model`` at ``batch``: they take turns over
    ``args.rounds`` rounds, a fresh process each."""
    job = {"model": model, "batch": batch, "threads": args.threads, "warmup": args.warmup,
           "iterations": -(-args.iterations // args.rounds),
           "max_seconds": args.max_seconds / args.rounds}
    runs: dict[str, list[dict]] = {c: [] for c in CONTENDERS}
    for r in range(args.rounds):
        for contender in CONTENDERS:
            if runs[contender] and runs[contender][-1]["status"] != "ok":
                continue
            say(f"[{model} b{batch}] {contender}, round {r + 1}/{args.rounds} ...")
            result = run_worker({**job, "contender": contender}, child_env(args.threads),
                                workdir, args.timeout, module="benchmarks.bench_onnx")
            runs[contender].append(result)
    rows = [_row(model, batch, c, runs[c]) for c in CONTENDERS]
    _check(rows, runs)
    ours, peer = rows
    if ours["status"] == peer["status"] == "ok":
        peer["peer_over_purinec"] = peer["median_ms"] / ours["median_ms"]
        peer["peer_over_purinec_p10"] = peer["p10_ms"] / ours["p10_ms"]
    return rows


def _row(model: str, batch: int, contender: str, results: list[dict]) -> dict:
    row = {"model": model, "batch": batch, "contender": contender,
           "status": results[-1]["status"],
           "problems": [p for r in results for p in r.get("problems", [])],
           "load_1m": max((r["load_1m"] or 0) for r in results)}
    if row["status"] == "ok":
        row.update(summarize([t for r in results for t in r["times_ms"]]))
        row["build_s"] = results[0]["build_s"]
    return row


def _check(rows: list[dict], runs: dict) -> None:
    """purinec's scores against onnxruntime's, from each one's first round."""
    ours, peer = rows
    if ours["status"] != "ok" or peer["status"] != "ok":
        return
    got, want = (np.load(runs[c][0]["outputs"]) for c in CONTENDERS)
    error = float(np.abs(got - want).max() / np.abs(want).max())
    ours["check_error"] = error
    if error > CHECK_RTOL:
        ours["status"] = "mismatch"
        ours["problems"].append(f"largest difference from onnxruntime {error:.1e} of the "
                                f"largest score (allowed {CHECK_RTOL:.0e})")


def table(rows: list[dict], threads: int) -> str:
    lines = [f"Inference of one batch, {threads} threads each; ort/purinec = onnxruntime's "
             f"median over purinec's (>1: purinec is faster), and its 10th percentile "
             f"over purinec's (on a shared machine the host slows whole processes: the "
             f"fast runs compare the code); build = compile or session creation; check "
             f"= largest difference from onnxruntime's scores over the largest score.", ""]
    head = (f"{'model':<15}{'batch':>6}  {'contender':<13}{'median ms':>10}{'p10':>9}"
            f"{'p90':>9}{'n':>5}{'ort/purinec':>12}{'(p10)':>7}{'build s':>9}{'load':>6}"
            f"  check")
    lines += [head, "-" * len(head)]
    for r in rows:
        ok = r["status"] == "ok"
        num = (lambda key, spec: format(r[key], spec) if ok and key in r else "-")
        check = (f"{r['check_error']:.0e}" if "check_error" in r else
                 "" if r["contender"] == "onnxruntime" else r["status"].upper())
        lines.append(f"{r['model']:<15}{r['batch']:>6}  {r['contender']:<13}"
                     f"{num('median_ms', '.2f'):>10}{num('p10_ms', '.2f'):>9}"
                     f"{num('p90_ms', '.2f'):>9}{num('n', 'd'):>5}"
                     f"{num('peer_over_purinec', '.2f'):>12}"
                     f"{num('peer_over_purinec_p10', '.2f'):>7}{num('build_s', '.1f'):>9}"
                     f"{r['load_1m']:>6.1f}  {check}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_onnx",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated, from {', '.join(MODELS)} (default: all)")
    p.add_argument("--batches", default="1,32", help="comma-separated batch sizes (1,32)")
    p.add_argument("--iterations", type=int, help="timed runs per contender (default 30)")
    p.add_argument("--warmup", type=int, help="untimed runs first, each round (default 3)")
    p.add_argument("--max-seconds", type=float,
                   help=f"time budget per contender and case, over all rounds; stops early "
                        f"keeping at least {MIN_TIMED} runs a round (default 30)")
    p.add_argument("--rounds", type=int, help="turns the contenders take, a fresh process "
                                              "each (default 2)")
    p.add_argument("--threads", type=int, default=2, help="threads per contender (default 2)")
    p.add_argument("--quick", action="store_true",
                   help="3 runs, 1 warm-up, 1 round: a smoke test")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per worker process")
    p.add_argument("--json", metavar="OUT", help="also write every number to this file")
    p.add_argument("--worker", metavar="JOB", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = (3, 1, 10.0, 1) if args.quick else (30, 3, 30.0, 2)
    for key, default in zip(("iterations", "warmup", "max_seconds", "rounds"), defaults):
        if getattr(args, key) is None:
            setattr(args, key, default)
    if args.worker:
        return args
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        p.error(f"--batches must be integers, got {args.batches}")
    if min(args.batches + [args.iterations, args.rounds, args.threads]) < 1:
        p.error("batches, --iterations, --rounds and --threads must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_job(args.worker, work)
    info = machine()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="purinec-bench-onnx-") as workdir:
        for model in args.models:
            for batch in args.batches:
                rows += bench(model, batch, args, workdir)
    info["load_1m_end"] = load_average()
    print(f"{info['cpu']} ({info['cpus']} CPUs), Python {info['python']}, "
          f"{', '.join(f'{k} {v}' for k, v in info['versions'].items())}, "
          f"onnxruntime {version('onnxruntime') or '?'}\n")
    print(table(rows, args.threads))
    problems = [f"{r['model']} b{r['batch']} {r['contender']}: {p}" for r in rows
                for p in r["problems"]]
    for line in problems:
        print(f"problem: {line}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": info, "threads": args.threads, "rows": rows}, f, indent=1)
    return 1 if problems or any(r["status"] != "ok" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
