"""`purinec run`: the inference graph of an artifact or a model, run on given or random
inputs, with its outputs summarized and timed."""

from __future__ import annotations

import time

import numpy as np

from purinec.cli.common import (MODEL_HELP, PARALLEL_HELP, TARGETS_HELP, HelpFormatter,
                                add_parallel_args, check_writable, is_artifact, parallel_kwargs,
                                positive, seed_value, write_traces)
from purinec.errors import PurinecError, refuse_options
from purinec.job import check_spans_the_job, on_devices, wait_for_every_rank
from purinec.train import DEFAULT_TARGET, num_classes


def add_parser(subparsers) -> None:
    run = subparsers.add_parser(
        "run", help="run a compiled artifact or a model's inference graph",
        description="Run the inference graph of FILE.purine (loaded, not recompiled) or of "
                    "MODEL (compiled now) and print each output's name, type and a "
                    "summary, and the time per iteration.",
        epilog=PARALLEL_HELP, formatter_class=HelpFormatter)
    run.add_argument("model", metavar="FILE.purine|MODEL",
                     help="an artifact from `purinec compile`, or " + MODEL_HELP)
    run.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                     help="feed input NAME from a .npy file (repeat for more inputs); "
                          "inputs not given get random values of their declared type, and "
                          "the output says so")
    run.add_argument("--output", metavar="OUT.npz",
                     help="write the outputs of the last iteration to OUT.npz (atomically)")
    run.add_argument("--iterations", type=positive, default=1, metavar="N",
                     help="run N times and report the first and the median time (default 1)")
    run.add_argument("--timeline", metavar="FILE.png|FILE.svg",
                     help="draw every task on its device's compute, copy and communication "
                          "lanes into FILE, with how much communication compute hid")
    run.add_argument("--trace", metavar="FILE",
                     help="record every task as Chrome trace event JSON (Perfetto) into "
                          "FILE, on targets that record traces")
    run.add_argument("--target",
                     help=f"target to run on: {TARGETS_HELP} (default: the artifact's own, "
                          f"or {DEFAULT_TARGET} for a MODEL)")
    run.add_argument("--batch", type=positive,
                     help="batch size of MODEL (default: the model's; fixed in an artifact)")
    add_parallel_args(run)
    run.add_argument("--seed", type=seed_value, default=0,
                     help="seed of the random inputs and of MODEL's weights (default 0)")
    run.set_defaults(func=cmd_run, parser=run)


def cmd_run(args) -> int:
    from purinec.compiler import compile, load
    from purinec.targets import get_target

    check_writable(args, ("output", "trace", "timeline"))
    trace = None
    if args.trace or args.timeline:
        from purinec.runtime.trace import Trace

        trace = Trace()
    if is_artifact(args.model):
        refuse_options(vars(args), ("batch", "devices", "parallel", "micro_batches"),
                       f"{args.model} was compiled with a fixed batch and devices")
        program = load(args.model, args.target, trace=trace)
        check_spans_the_job(program, args.model)
        get_target(program.target).check_runnable()
    else:
        get_target(args.target or DEFAULT_TARGET).check_runnable()
        program = compile(args.model, target=args.target or DEFAULT_TARGET, batch=args.batch,
                          seed=args.seed, trace=trace, **parallel_kwargs(args))
    wait_for_every_rank()  # else the first iteration's time would include the wait
    try:
        feeds = _feeds(program.eval_ir, args.input, args.seed)
        times, outputs = [], {}
        for _ in range(args.iterations):
            start = time.perf_counter()
            outputs = program.run(feeds)
            times.append(time.perf_counter() - start)
    finally:
        program.close()
    for name, value in outputs.items():
        print(_summary(name, value))
    print(_timing(times, program))
    if args.output:
        from purinec.artifact import write_npz
        from purinec.fileio import write_atomically

        write_atomically(args.output, lambda f: write_npz(f, outputs))
        print(f"wrote {args.output} ({', '.join(outputs)})")
    if trace is not None:
        write_traces(trace, args.trace, args.timeline)
    return 0


def _feeds(graph, specs: list[str], seed: int) -> dict[str, np.ndarray]:
    """Arrays from --input NAME=FILE.npy; random arrays of the declared types for the
    inputs not given (said on stdout, so nobody mistakes them for real results)."""
    feeds = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise PurinecError(f"--input {spec}: write NAME=FILE.npy")
        if name in feeds:
            raise PurinecError(f"--input {name} is given twice")
        feeds[name] = _load_npy(path, f"--input {spec}")
    inputs = [v.name for v in graph.inputs_with_role("data")]
    unknown = [name for name in feeds if name not in inputs]
    if unknown:
        raise PurinecError(f"--input {unknown[0]}: graph {graph.name} has no input of that "
                           f"name; it takes {', '.join(inputs)}")
    rng = np.random.default_rng(seed)
    classes = num_classes(graph) or 10
    for v in graph.inputs_with_role("data"):
        if v.name in feeds:
            continue
        dtype = v.type.dtype.numpy
        if dtype.kind == "f":
            feeds[v.name] = rng.random(v.type.shape).astype(dtype)
            what = "uniform in [0, 1)"
        elif dtype.kind == "b":
            feeds[v.name] = rng.random(v.type.shape) < 0.5
            what = "true or false"
        else:
            feeds[v.name] = rng.integers(0, classes, v.type.shape).astype(dtype)
            what = f"integers in [0, {classes})"
        print(f"input {v.name}: no --input given, using random {v.type} ({what})")
    return feeds


def _load_npy(path: str, what: str) -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False)
    except OSError as err:
        raise PurinecError(f"{what}: cannot read {path}: {err.strerror or err}") from None
    except ValueError:
        # (NumPy's own message suggests unpickling, which no input should need)
        raise PurinecError(f"{what}: {path} is not a .npy file of numbers (as numpy.save "
                           "writes them)") from None
    if not isinstance(array, np.ndarray):
        array.close()
        raise PurinecError(f"{what}: {path} is an .npz archive; give one .npy file per input")
    return array


def _summary(name: str, value: np.ndarray) -> str:
    from purinec.ir.types import DType

    try:
        type_text = f"{DType.from_numpy(value.dtype)}{list(value.shape)}".replace(" ", "")
    except ValueError:
        type_text = f"{value.dtype}{list(value.shape)}"
    if value.size == 1:
        return f"{name}: {type_text} = {value.reshape(()).item()}"
    if value.size == 0:
        return f"{name}: {type_text} (empty)"
    numbers = value.astype(np.float64)
    return (f"{name}: {type_text}  min {numbers.min():.6g}  mean {numbers.mean():.6g}  "
            f"max {numbers.max():.6g}")


def _timing(times: list[float], program) -> str:
    ms = [t * 1e3 for t in times]
    where = f"on target {program.target}{on_devices(program)}"
    if len(ms) == 1:
        return f"1 iteration {where}: {ms[0]:.3f} ms"
    return (f"{len(ms)} iterations {where}: first {ms[0]:.3f} ms, then median "
            f"{float(np.median(ms[1:])):.3f} ms per iteration")
