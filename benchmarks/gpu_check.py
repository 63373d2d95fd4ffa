"""The cuda target on a real GPU, in one command that finishes within about 8 minutes:

    python -m benchmarks.gpu_check [--json FILE] [--budget SECONDS]
    NUMBA_ENABLE_CUDASIM=1 python -m benchmarks.gpu_check --smoke   # the script itself

1. numerics: every zoo model's training step, 3 steps on ``cuda`` from the reference
   target's initial weights and batches, against the reference (the tolerances of
   `benchmarks.bench_train`: each loss within 1e-4, each weight's change within 1e-2);
   lenet also with the tiled GEMM kernels, and data-parallel over two devices on the
   one GPU (its allreduces as copies and sums on the GPU);
2. speed: a training step of lenet b64, cifar_quick b100 and b1024 and inception b64,
   launched task by task and replayed as one CUDA graph, against PyTorch eager and
   ``torch.compile`` on the same GPU from the same weights (medians, and purinec's time
   over each peer's);
3. bandwidth: a fused elementwise kernel over 2**26 float32 elements, as a share of a
   device-to-device copy's bandwidth (both timed by CUDA events);
4. CUDA graphs: training steps of lenet b64 and cifar_quick b100, and lenet b64 over
   two devices on the one GPU, replaying one captured CUDA graph
   (``PURINEC_CUDA_GRAPHS=1``) against launching task by task, and their losses after
   the same steps.

It prints a table and writes everything as JSON (``--json``, default
``gpu_check.json``). A section that fails is reported and the others still run; one that
would pass the time budget is skipped and says so. Nothing here is a test: it measures.
``--smoke`` runs every section on tiny sizes (a small mlp from a model file,
`tests/on_cuda/tiny_net.py`, at batch 2; 4,096 elements; one timed step), which Numba's
CUDA simulator can do: the test suite runs it so, so that a GPU's few minutes are not
lost to a bug in this script. (The PyTorch peers know the zoo's networks only: on it
they report an error, as they would for a network they lack.)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from unittest import mock

import numpy as np

from benchmarks.bench_train import CheckData, PurinecTrainer, compare, solver
from purinec.codegen.cuda import blas
from purinec.runtime import gpu

CHECK_STEPS = 3
PEERS = ("torch", "torch.compile")
TINY_NET = str(Path(__file__).resolve().parents[1] / "tests" / "on_cuda" / "tiny_net.py")
TWO_DEVICES = "gpu:0,gpu:1"  # data parallelism; both on GPU 0 where it is the only one


class Sizes:
    """What each section runs: the real check, or ``smoke``'s tiny one."""

    def __init__(self, smoke: bool = False):
        from purinec.models.zoo import ZOO

        models = [TINY_NET] if smoke else sorted(ZOO)
        # checked and timed with the tiled GEMM kernels too (the default: cuBLAS), and
        # checked over two devices
        self.tiled = TINY_NET if smoke else "lenet"
        # (model, products form, devices): what the numerics check
        self.variants = ([(model, None, None) for model in models]
                         + [(self.tiled, "tiled", None), (self.tiled, None, TWO_DEVICES)])
        # (model, batch, devices): timed replaying a CUDA graph against launching
        self.graphs = ([(TINY_NET, 2, None), (TINY_NET, 2, TWO_DEVICES)] if smoke else
                       [("lenet", 64, None), ("cifar_quick", 100, None),
                        ("lenet", 64, TWO_DEVICES)])
        self.check_batch = 2 if smoke else 4
        self.speed = ([(TINY_NET, 2)] if smoke else
                      [("lenet", 64), ("cifar_quick", 100), ("cifar_quick", 1024),
                       ("inception", 64)])
        self.warmup, self.iterations = (1, 1) if smoke else (3, 20)
        self.elements = 1 << 12 if smoke else 1 << 26
        self.reserve = 0 if smoke else 60  # seconds a section needs to start


class Budget:
    """Seconds left of the whole check."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def environment() -> dict:
    """The date, the machine, the GPU and the versions that matter (each fact that
    cannot be read says why)."""
    from numba import cuda

    info = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "machine": platform.node()}
    facts = {
        "gpu": lambda: cuda.get_current_device().name,
        "compute_capability": lambda: list(cuda.get_current_device().compute_capability),
        "driver": lambda: cuda.cudadrv.driver.driver.get_version(),
        "simulated": lambda: bool(cuda.simulator_enabled()) if hasattr(
            cuda, "simulator_enabled") else __import__("numba").config.ENABLE_CUDASIM,
    }
    for module in ("numba", "numba_cuda", "torch", "nvmath"):
        facts[module] = lambda module=module: __import__(module).__version__
    facts["products"] = lambda: f"{blas.products()} ({blas.cublas_missing() or 'cuBLAS loads'})"
    for name, read in facts.items():
        try:
            value = read()
            info[name] = value.decode() if isinstance(value, bytes) else value
        except Exception as err:  # absent, or not in the simulator: say which
            info[name] = f"unavailable ({type(err).__name__})"
    return info


# -- 1. numerics --------------------------------------------------------------------


def check_numerics(budget: Budget, sizes: Sizes) -> list[dict]:
    rows = []
    for model, form, devices in sizes.variants:
        if budget.left() < sizes.reserve:
            rows.append({"model": model, "skipped": "time budget"})
            continue
        start = time.perf_counter()
        try:
            check = _more_steps(CheckData.compute(model, sizes.check_batch), model,
                                sizes.check_batch)
            with products(form):
                trainer = PurinecTrainer(model, sizes.check_batch, "cuda", check.init,
                                         devices)
            losses = [trainer.step({"data": x, "label": y}) for x, y in check.batches]
            errors, problems = compare(check, losses, trainer.params())
            trainer.close()
            rows.append({"model": model, "batch": sizes.check_batch, **errors,
                         "products": form or blas.products(), "devices": devices or "gpu:0",
                         "problems": problems, "seconds": time.perf_counter() - start})
        except Exception:
            rows.append({"model": model, "error": traceback.format_exc(limit=-3)})
        say(f"numerics {model}: {rows[-1].get('problems', rows[-1].get('error', ''))}")
    return rows


def _more_steps(check: CheckData, model: str, batch: int) -> CheckData:
    """``check`` run for CHECK_STEPS steps (bench_train's has fewer)."""
    import purinec

    program = purinec.compile(model, target="reference", train=solver(), batch=batch)
    for name, value in check.init.items():
        program.params[name] = value.copy()
    rng = np.random.default_rng(5)
    batches = list(check.batches)
    while len(batches) < CHECK_STEPS:
        x, y = check.batches[0]
        batches.append((rng.random(x.shape, dtype=np.float32),
                        rng.integers(0, int(y.max()) + 1, y.shape).astype(np.int32)))
    losses = [program.step({"data": x, "label": y}) for x, y in batches]
    final = {k: np.array(v) for k, v in program.params.items()}
    return CheckData(check.init, batches, losses, final)


# -- 2. speed -----------------------------------------------------------------------


def check_speed(budget: Budget, sizes: Sizes) -> list[dict]:
    from benchmarks import peers

    rows = []
    for model, batch in sizes.speed:
        if budget.left() < 1.5 * sizes.reserve:
            rows.append({"model": model, "batch": batch, "skipped": "time budget"})
            continue
        row = {"model": model, "batch": batch}
        params, x, y = _problem(model, batch)
        # purinec as it is, replaying one CUDA graph, and with the tiled GEMM kernels
        ways = {"purinec": (gpu.GRAPHS_VAR, None), "purinec graph": (gpu.GRAPHS_VAR, "1")}
        if model == sizes.tiled:
            ways["purinec tiled"] = (blas.PRODUCTS_VAR, "tiled")
        contenders = {name: functools.partial(_purinec_with, *way, model, batch, params)
                      for name, way in ways.items()}
        for peer in PEERS:
            contenders[peer] = (lambda peer=peer: peers.make_trainer(
                peer, model, params, device="cuda", **_solver_args()))
        for name, make in contenders.items():
            try:
                row[name] = _median_step_ms(make(), x, y, sizes)
            except Exception as err:
                row[name] = None
                row[f"{name}_error"] = f"{type(err).__name__}: {str(err)[:300]}"
            say(f"speed {model} b{batch} {name}: {row[name]}")
        for peer in PEERS:
            for way, name in (("", "purinec"), ("graph_", "purinec graph")):
                if row.get(name) and row.get(peer):
                    row[f"ratio_{way}{peer}"] = row[name] / row[peer]
        rows.append(row)
    return rows


def _problem(model: str, batch: int):
    """The reference target's initial weights of ``model``, and a random batch."""
    import purinec

    program = purinec.compile(model, target="reference", train=solver(), batch=batch)
    params = {k: np.array(v) for k, v in program.params.items()}
    classes = program.ir.value("logits").type.shape[1]
    rng = np.random.default_rng(0)
    x = rng.random(program.ir.input("data").type.shape, dtype=np.float32)
    return params, x, rng.integers(0, classes, batch).astype(np.int32)


def _environment(variable: str, value: str | None):
    """``variable`` set to ``value`` meanwhile (None: left as it is)."""
    return mock.patch.dict(os.environ, {} if value is None else {variable: value})


def products(form: str | None):
    """Compile the cuda target's products in ``form`` (None: the default)."""
    return _environment(blas.PRODUCTS_VAR, form)


def _purinec_with(variable: str, value: str | None, model: str, batch: int, params):
    """purinec's trainer of ``model`` on cuda, made while ``variable`` is ``value``."""
    with _environment(variable, value):
        return PurinecTrainer(model, batch, "cuda", params)


def _solver_args() -> dict:
    sgd = solver()
    return {"lr": sgd.lr, "momentum": sgd.momentum, "weight_decay": sgd.weight_decay}


def _median_step_ms(trainer, x, y, sizes: Sizes, close: bool = True) -> float:
    batch = trainer.prepare(x, y)
    for _ in range(sizes.warmup):
        trainer.step(batch)  # (each step returns its loss: the GPU is done with it)
    times = []
    for _ in range(sizes.iterations):
        start = time.perf_counter()
        trainer.step(batch)
        times.append((time.perf_counter() - start) * 1e3)
    if close and hasattr(trainer, "close"):
        trainer.close()
    return float(np.median(times))


# -- 3. bandwidth -------------------------------------------------------------------


def check_bandwidth(sizes: Sizes) -> dict:
    """A fused scale+add+relu over ``sizes.elements`` float32 (three arrays: 12 bytes an
    element) against a device-to-device copy (8 bytes an element), each the median of
    20 runs timed by CUDA events."""
    from numba import cuda

    from purinec.codegen.cuda import compile_module, render_module
    from purinec.ir.graph import Graph
    from purinec.ir.types import Device, DType, TensorType
    from purinec.passes.fuse import fuse

    elements = sizes.elements
    graph = Graph("bandwidth")
    gpu0 = Device("gpu", 0)
    a = graph.add_input("a", TensorType((elements,), DType.f32), gpu0)
    b = graph.add_input("b", TensorType((elements,), DType.f32), gpu0)
    (scaled,) = graph.add_node("scale", [a], {"alpha": 2.0}).outputs
    (total,) = graph.add_node("add", [scaled, b]).outputs
    (out,) = graph.add_node("relu", [total]).outputs
    graph.outputs = [("out", out)]
    (node,) = fuse(graph).nodes
    kernel = compile_module(render_module(node))
    stream = cuda.stream()
    x = cuda.to_device(np.ones(elements, np.float32), stream=stream)
    y = cuda.to_device(np.ones(elements, np.float32), stream=stream)
    z = cuda.device_array(elements, np.float32, stream=stream)
    fused_ms = _event_ms(lambda: kernel.launch(stream, x, y, z), stream)
    copy_ms = _event_ms(lambda: z.copy_to_device(x, stream=stream), stream)
    fused_rate = 12 * elements / fused_ms / 1e6  # GB/s
    copy_rate = 8 * elements / copy_ms / 1e6
    return {"elements": elements, "fused_ms": fused_ms, "copy_ms": copy_ms,
            "fused_GBps": fused_rate, "copy_GBps": copy_rate,
            "share_of_copy": fused_rate / copy_rate}


def _event_ms(work, stream, runs: int = 20) -> float:
    """The median time of ``work`` on ``stream``: by CUDA events, or in the simulator
    (which has no event timing) by the wall clock."""
    from numba import config, cuda

    work()
    stream.synchronize()
    times = []
    for _ in range(runs):
        if config.ENABLE_CUDASIM:
            start = time.perf_counter()
            work()
            stream.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
            continue
        start, end = cuda.event(), cuda.event()
        start.record(stream)
        work()
        end.record(stream)
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end))
    return float(np.median(times))


# -- 4. CUDA graphs -----------------------------------------------------------------


def check_cuda_graphs(budget: Budget, sizes: Sizes) -> list[dict]:
    """Training steps replaying one CUDA graph (``PURINEC_CUDA_GRAPHS=1``) against
    launching task by task, from the same weights on the same batch: median ms, and
    the losses of the two after the same steps (they must agree)."""
    rows = []
    for model, batch, devices in sizes.graphs:
        if budget.left() < sizes.reserve:
            rows.append({"model": model, "batch": batch, "skipped": "time budget"})
            continue
        params, x, y = _problem(model, batch)
        row: dict = {"model": model, "batch": batch, "devices": devices or "gpu:0"}
        for name, flag in (("launches", "0"), ("graph", "1")):
            try:
                with _environment(gpu.GRAPHS_VAR, flag):
                    trainer = PurinecTrainer(model, batch, "cuda", params, devices)
                    row[f"{name}_ms"] = _median_step_ms(trainer, x, y, sizes, close=False)
                    row[f"{name}_loss"] = trainer.step({"data": x, "label": y})
                    row[f"{name}_status"] = trainer.program.cuda_graphs
                    trainer.close()
            except Exception as err:
                row[f"{name}_error"] = f"{type(err).__name__}: {str(err)[:300]}"
        if "launches_ms" in row and "graph_ms" in row:
            row["speedup"] = row["launches_ms"] / row["graph_ms"]
            row["same_loss"] = bool(np.isclose(row["launches_loss"], row["graph_loss"],
                                               rtol=1e-5))
        say(f"cuda graphs {model} b{batch}: {row}")
        rows.append(row)
    return rows


# -- the report ---------------------------------------------------------------------


def table(report: dict) -> str:
    lines = [f"purinec gpu_check, {report['environment'].get('date')}, "
             f"{report['environment'].get('gpu')}", "", "numerics (3 steps vs reference):"]
    for row in report.get("numerics", []):
        state = ("skipped: " + row["skipped"] if "skipped" in row else
                 "ERROR " + row["error"].splitlines()[-1] if "error" in row else
                 "ok" if not row["problems"] else "; ".join(row["problems"][:2]))
        lines.append(f"  {row['model']:<12} {row.get('products', ''):<7} "
                     f"{row.get('devices', ''):<12} {state}")
    lines += ["", "training step, median ms (purinec / peer):"]
    for row in report.get("speed", []):
        if "skipped" in row:
            lines.append(f"  {row['model']} b{row['batch']}: skipped ({row['skipped']})")
            continue
        cells = [f"{name} {_ms(row.get(name))}"
                 for name in ("purinec", "purinec graph", "purinec tiled", *PEERS)
                 if name in row]
        ratios = [f"{row[f'ratio_{way}{p}']:.2f}x {p}{label}" for p in PEERS
                  for way, label in (("", ""), ("graph_", " (graph)"))
                  if f"ratio_{way}{p}" in row]
        lines.append(f"  {row['model']} b{row['batch']}: " + ", ".join(cells)
                     + (f"  ({', '.join(ratios)})" if ratios else ""))
    bandwidth = report.get("bandwidth", {})
    if "share_of_copy" in bandwidth:
        lines += ["", f"fused elementwise, 2^26 f32: {bandwidth['fused_GBps']:.0f} GB/s, "
                      f"{bandwidth['share_of_copy']:.0%} of a device copy's "
                      f"{bandwidth['copy_GBps']:.0f} GB/s"]
    lines += ["", "CUDA graphs (replay / launches, median ms):"]
    graphs = report.get("cuda_graphs", [])
    for row in graphs if isinstance(graphs, list) else [graphs]:
        if "speedup" in row:
            lines.append(f"  {row['model']} b{row['batch']} on {row['devices']}: "
                         f"{row['graph_ms']:.2f} / "
                         f"{row['launches_ms']:.2f} ({row['speedup']:.2f}x faster; same "
                         f"loss: {row['same_loss']}; {row['graph_status']})")
        else:
            lines.append(f"  {row}")
    return "\n".join(lines)


def _ms(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="gpu_check.json", help="where the JSON goes")
    parser.add_argument("--budget", type=float, default=450,
                        help="seconds for the whole check (default 450)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, to check this script (in the CUDA simulator)")
    args = parser.parse_args(argv)
    if args.smoke:  # in Numba's CUDA simulator: its threads take turns more often
        sys.setswitchinterval(5e-4)  # (see tests/on_cuda/simulate.quicker_threads)
    budget = Budget(args.budget)
    sizes = Sizes(args.smoke)
    report: dict = {"environment": environment()}
    say(f"gpu_check on {report['environment']['gpu']}")
    sections = [("numerics", lambda: check_numerics(budget, sizes)),
                ("bandwidth", lambda: check_bandwidth(sizes)),
                ("speed", lambda: check_speed(budget, sizes)),
                ("cuda_graphs", lambda: check_cuda_graphs(budget, sizes))]
    for name, run in sections:
        try:
            report[name] = run()
        except Exception:
            report[name] = {"error": traceback.format_exc(limit=-4)}
            say(f"{name} failed:\n{report[name]['error']}")
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
