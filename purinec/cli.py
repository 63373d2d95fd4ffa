"""The `purinec` command. The training session behind `purinec train` is
`purinec.train`'s."""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import tempfile
import time
import warnings
from typing import Callable

import numpy as np

from purinec.codegen.progress import kernel_progress
from purinec import __version__
from purinec.errors import PurinecError, PurinecWarning, refuse_options
from purinec.fileio import atomic_write_text
from purinec.job import (check_spans_the_job, default_strategy, is_reporting_rank, on_devices,
                         placement_of, spread_options, wait_for_every_rank)
from purinec.train import (DEFAULT_TARGET, SOLVER_DEFAULTS, SOLVER_OPTIONS, default_sgd,
                           num_classes, refuse_fixed_options, resume_training, train_model)

STAGE_HELP = """\
stages, in pipeline order (autodiff and optimizer only with --train):
  lower         the graph as the front end built it (a .pir file: as parsed)
  infer_shapes  every output type recomputed from its inputs
  verify        every IR invariant checked (the graph is unchanged)
  stages        with --parallel pipeline: every layer put on a device, in stages of
                about equal work (FLOPs, or memory traffic where that dominates)
  autodiff      the backward graph appended: grad.<param> outputs
  optimizer     SGD's updates appended: new params and momentum histories
  dce           nodes that reach no output removed
  cse           identical nodes merged
  microbatch    with --parallel pipeline: the batch's work copied per micro-batch
  parallel      with --devices: every value's distribution, and the copies and
                collectives the boxing pass inserted (--explain says why each is there)
  partition     with --devices: the physical graph of one rank (--rank), every device's
                nodes on their pieces of the tensors
  fuse          nodes grouped into fused kernels (cpu target; the final IR)
  kernels       the generated Numba source of every kernel (cpu target)
"""

MODEL_HELP = ("a zoo name (mlp, lenet, convnet, cifar_quick, nin, inception), a Python file "
              "defining build(batch), or a .pir IR file")

TARGETS_HELP = "cpu (fused Numba kernels) or reference (NumPy, one op at a time)"

PARALLEL_HELP = """\
parallelism: --devices cpu:0,cpu:1 (or a count: --devices 2) spreads the program over
devices of this process, each with its own worker thread and share of the cores;
`mpiexec -n 2 purinec train lenet --parallel ps` puts one device on each MPI rank
(--devices r0/cpu:0,r0/cpu:1,r1/cpu:0,r1/cpu:1 names several per rank). Under mpiexec
with neither option, a model is spread over the ranks by data parallelism, unless it
places its layers itself.
"""


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps a text written as one paragraph (a command's description) to the terminal,
    as argparse does; keeps a text written in lines (an epilog of examples) as written.
    (RawDescriptionHelpFormatter keeps both, so descriptions ran off the screen.)"""

    def _fill_text(self, text, width, indent):
        if "\n" in text.strip("\n"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    from purinec.passes.parallel import STRATEGIES, USER_STRATEGIES

    p.add_argument("--devices", metavar="LIST|N",
                   help="devices to spread the program over: cpu:0,cpu:1 in this process, "
                        "r1/cpu:0 for a device of MPI rank 1, or a count N for cpu:0..N-1")
    p.add_argument("--parallel", choices=USER_STRATEGIES, metavar="STRATEGY",
                   help="how to spread it (default data): " + "; ".join(
                       f"{name}: {STRATEGIES[name]}" for name in USER_STRATEGIES))
    p.add_argument("--micro-batches", type=_positive, metavar="N",
                   help="with --parallel pipeline: micro-batches per batch (default: twice "
                        "the devices)")


def _parallel_kwargs(args, **model_kwargs) -> dict:
    """compile()'s devices and strategy, as given, or `purinec.job.default_strategy`'s
    default."""
    return spread_options(args.model, args.batch, args.devices, args.parallel,
                          args.micro_batches, **model_kwargs)


def _add_solver_args(p: argparse.ArgumentParser) -> None:
    # Defaults are None so that a command can tell an option given from one left out
    # (an artifact's solver settings are fixed in its IR); `_sgd` fills them in.
    p.add_argument("--lr", type=float,
                   help=f"learning rate (default {SOLVER_DEFAULTS['lr']})")
    p.add_argument("--momentum", type=float,
                   help=f"SGD momentum (default {SOLVER_DEFAULTS['momentum']})")
    p.add_argument("--weight-decay", type=float,
                   help=f"L2 weight decay (default {SOLVER_DEFAULTS['weight_decay']})")


def _sgd(args):
    """The solver the options ask for: the same for dump, compile and train, so that dump
    shows what compile and train build."""
    return default_sgd(args.lr, args.momentum, args.weight_decay)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-shape", type=_parse_shape, metavar="C,H,W",
                        help="shape of one input image, for a zoo model or a build() that "
                             "takes input_shape (default: the model's)")
    parser.add_argument("--num-classes", type=_positive, metavar="N",
                        help="number of classes, for a zoo model or a build() that takes "
                             "num_classes (default: the model's)")


def _model_kwargs(args) -> dict:
    """The model options given on the command line, for the model's builder."""
    options = {"input_shape": args.input_shape, "num_classes": args.num_classes}
    return {name: value for name, value in options.items() if value is not None}


def _is_artifact(spec: str | None) -> bool:
    return bool(spec) and spec.endswith(".purine")


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape like 1,28,28")
    return shape


def _at_least(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= {least}")
        return value
    return parse


_non_negative, _positive = _at_least(0), _at_least(1)


def cmd_dump(args) -> int:
    from purinec.compiler import (build_graph, load_source, parallel_plan, passes_for,
                                  physical_passes, warn_if_idle)
    from purinec.passes.pipeline import run_passes

    if args.model.endswith(".purine"):
        return _dump_artifact(args)
    train = _sgd(args) if args.train else None
    source = load_source(args.model, args.batch, **_model_kwargs(args))
    placed = functools.cache(lambda: placement_of(source))  # lowered once, if at all
    strategy = default_strategy(args.parallel, args.devices, placed)
    spread = parallel_plan(args.devices, strategy, args.micro_batches) or placed()
    if spread is None:
        if args.rank:
            raise PurinecError(f"--rank {args.rank}: the program runs on one device of "
                               "rank 0; --rank goes with --devices over several ranks")
        runs = ["lower"] + [p.name for p in passes_for(train, args.target)]
    else:
        runs = (["lower"] + [p.name for p in passes_for(train, args.target, spread)] +
                [p.name for p in physical_passes(args.rank, args.target)])
        if args.rank >= spread.ranks:
            raise PurinecError(f"--rank {args.rank}: the devices span {spread.ranks} rank(s)")
    wanted = _wanted_stages(args, runs)
    if args.format in ("svg", "png") and not args.output:
        raise PurinecError(f"--format {args.format} writes picture files; give -o DIR or "
                           f"-o FILE.{args.format}")
    if args.format != "text" and "kernels" in wanted:
        raise PurinecError("--stage kernels is source code, not a graph; use --format text")
    if (args.llvm or args.asm) and wanted != ["kernels"]:
        raise PurinecError("--llvm and --asm go with --stage kernels")
    if args.explain and not {"fuse", "parallel"} & set(wanted):
        raise PurinecError("--explain goes with --stage fuse or parallel (or all)")
    single = _single_output_file(args, several=len(wanted) > 1 or "kernels" in wanted
                                 or args.explain)
    if args.output and not single:
        os.makedirs(args.output, exist_ok=True)
    written: list[str] = []
    before_fuse: list = []

    def emit(name: str, text: str) -> None:
        if args.output:
            path = single or os.path.join(args.output, name)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            atomic_write_text(path, text + "\n")
            written.append(path)
        else:
            if len(wanted) > 1:
                print(f"// ---- {name} ----")
            print(text)

    def draw(name: str, graph) -> None:
        from purinec.viz import render_graph, to_dot

        if not args.output:  # dot text only, checked above
            if len(wanted) > 1:
                print(f"// ---- {name} ----")
            print(to_dot(graph))
            return
        path = single or os.path.join(args.output, name)
        render_graph(graph, path, args.format)
        written.append(path)

    def show(stage, graph):
        if stage == "cse":
            before_fuse[:] = [graph]
        if stage not in wanted:
            return
        base = f"{graph.name}.{runs.index(stage):02d}-{stage}"
        if args.format == "text":
            emit(f"{base}.pir", str(graph))
        else:
            draw(f"{base}.{args.format}", graph)
        if stage == "fuse" and args.explain:
            from purinec.passes.fuse import explain

            reasons = "\n".join(f"# {apart}" for apart in explain(before_fuse[0]))
            emit(f"{graph.name}.fuse-explain.txt",
                 f"{FUSION_KINDS_LEGEND}\n{reasons}" if reasons else "# every pair fused")
        if stage == "parallel" and args.explain:
            from purinec.passes.parallel import explain

            reasons = "\n".join(f"# {why}" for why in explain(graph))
            emit(f"{graph.name}.parallel-explain.txt", reasons or "# no communication")

    graph = build_graph(source, train, show, args.target, spread)
    if spread is not None and spread.strategy != "placement":
        warn_if_idle(spread, graph)
    if spread is not None:
        before_fuse[:] = []
        graph = run_passes(graph, physical_passes(args.rank, args.target), _fuse_input(
            show, before_fuse)).graph
    if "kernels" in wanted:
        _dump_kernels(graph, args, emit)
    for path in written:
        print(f"wrote {path}")
    return 0


def _dump_artifact(args) -> int:
    """The final IR an artifact holds (and its inference graph), as text."""
    from purinec.artifact import read_ir

    given = [option for option, value in (
        ("--stage", args.stage), ("--train", args.train), ("--batch", args.batch),
        ("--input-shape", args.input_shape), ("--num-classes", args.num_classes),
        ("--devices", args.devices), ("--parallel", args.parallel),
        ("--micro-batches", args.micro_batches), ("--explain", args.explain),
        ("--llvm", args.llvm), ("--asm", args.asm),
        ("--format", args.format != "text" and args.format)) if value]
    if given:
        raise PurinecError(f"{args.model} is a compiled artifact: dump shows the final IR it "
                           f"holds, as text; {', '.join(given)} "
                           f"{'applies' if len(given) == 1 else 'apply'} to a model (dump the "
                           f"model it was compiled from)")
    graphs = [g for g in read_ir(args.model) if g is not None]
    single = _single_output_file(args, several=len(graphs) > 1)
    for graph in graphs:
        if args.output:
            path = single or os.path.join(args.output, f"{graph.name}.pir")
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            atomic_write_text(path, str(graph) + "\n")
            print(f"wrote {path}")
        else:
            if len(graphs) > 1:
                print(f"// ---- {graph.name} ----")
            print(graph)
    return 0


def _fuse_input(show, before_fuse: list):
    """A stage hook that also keeps the partitioned graph, which fusion explains."""
    def hook(stage, graph):
        if stage == "partition":
            before_fuse[:] = [graph]
        show(stage, graph)
    return hook


# The suffix of the file a dump writes per stage, by --format.
DUMP_SUFFIXES = {"text": ".pir", "dot": ".dot", "svg": ".svg", "png": ".png"}


def _single_output_file(args, several: bool) -> str | None:
    """``-o`` as the one file to write, when it names a file of a dump's kind (a .pir,
    .dot, .svg or .png path that is no directory); None when it names a directory."""
    suffix = os.path.splitext(args.output or "")[1]
    if suffix not in DUMP_SUFFIXES.values() or os.path.isdir(args.output):
        return None
    want = DUMP_SUFFIXES[args.format]
    if suffix != want:
        raise PurinecError(f"-o {args.output}: --format {args.format} writes {want} files")
    if several:
        raise PurinecError(f"-o {args.output} names one file, but this dump writes several "
                           f"(stages, kernels, explanations or graphs); give -o a directory")
    _check_writable(args, ("output",))
    return args.output


def _wanted_stages(args, runs: list[str]) -> list[str]:
    """The stages to show: the named one (checked against what runs for this target and
    mode, with the reason when it does not run), all that run, or the final IR."""
    from purinec.compiler import STAGES

    if args.stage is None:
        return [runs[-1]]
    if args.stage == "all":
        return runs + (["kernels"] if args.target == "cpu" else [])
    if args.stage == "kernels":
        if args.target != "cpu":
            raise PurinecError(f"target {args.target} generates no kernels; use --target cpu")
        return ["kernels"]
    if args.stage not in STAGES:
        raise PurinecError(f"unknown stage {args.stage!r}; stages: {', '.join(STAGES)}, "
                           "kernels, all")
    if args.stage not in runs:
        why = ("runs only with --train" if args.stage in ("autodiff", "optimizer")
               else "runs only with --devices (or a model placed on several devices)"
               if args.stage in ("parallel", "partition")
               else "runs only with --devices and --parallel pipeline"
               if args.stage in ("stages", "microbatch")
               else f"does not run for target {args.target}")
        raise PurinecError(f"stage {args.stage} {why}")
    return [args.stage]


def _dump_kernels(graph, args, emit) -> None:
    """The generated source of every kernel (or what Numba made of it: --llvm, --asm)."""
    from purinec.compiler import generated_kernels

    folder = f"{graph.name}.kernels"
    for node, kernel in generated_kernels(graph).items():
        stem = os.path.join(folder, f"{kernel.name}.{node.name}")  # node names are unique
        if args.llvm:
            emit(f"{stem}.ll", kernel.llvm())
        elif args.asm:
            emit(f"{stem}.s", kernel.asm())
        else:
            emit(f"{stem}.py", f"# cached as {kernel.path}\n{kernel.source}")


def cmd_compile(args) -> int:
    from purinec.compiler import compile

    if not args.output.endswith(".purine"):
        raise PurinecError(f"-o {args.output}: name the artifact FILE.purine (run and train "
                           "recognize artifacts by that suffix)")
    if not args.train:
        refuse_options(vars(args), SOLVER_OPTIONS, "solver options apply only with --train")
    model_kwargs = _model_kwargs(args)
    start = time.perf_counter()
    program = compile(args.model, target=args.target, train=_sgd(args) if args.train else None,
                      batch=args.batch, seed=args.seed,
                      **_parallel_kwargs(args, **model_kwargs), **model_kwargs)
    wait_for_every_rank()
    compiled = time.perf_counter() - start
    try:
        saved = program.save(args.output)
    finally:
        program.close()
    graphs = program.ir.name + ("" if program.eval_ir is program.ir
                                else f" and {program.eval_ir.name}")
    print(f"compiled {graphs}{on_devices(program)} in {compiled:.2f} s")
    print(saved)
    return 0


def _check_writable(args, options: tuple[str, ...]) -> None:
    """Refuse, before any work, files the command could not write at its end: a
    --timeline that names no picture format, or any of ``options`` in a directory that
    does not exist or cannot be written, or that are directories themselves (a long
    training run would be done by then)."""
    if getattr(args, "timeline", None):
        from purinec.viz import timeline_format

        timeline_format(args.timeline)
    for option in options:
        path = getattr(args, option, None)
        if not path:
            continue
        directory = os.path.dirname(os.path.abspath(path))
        flag = "--" + option.replace("_", "-")
        if os.path.isdir(path):
            raise PurinecError(f"{flag} {path}: is a directory; name a file in it")
        if not os.path.isdir(directory):
            raise PurinecError(f"{flag} {path}: directory {directory} does not exist")
        try:  # as the atomic write will: a file of its own next to the target
            with tempfile.TemporaryFile(dir=directory):
                pass
        except OSError as err:
            raise PurinecError(f"{flag} {path}: cannot write in directory {directory}: "
                               f"{err.strerror or err}") from None


def cmd_run(args) -> int:
    from purinec.compiler import compile, load

    _check_writable(args, ("output", "trace", "timeline"))
    trace = None
    if args.trace or args.timeline:
        from purinec.runtime.trace import Trace

        trace = Trace()
    if _is_artifact(args.model):
        refuse_options(vars(args), ("batch", "devices", "parallel", "micro_batches"),
                       f"{args.model} was compiled with a fixed batch and devices")
        program = load(args.model, args.target, trace=trace)
        check_spans_the_job(program, args.model)
    else:
        program = compile(args.model, target=args.target or DEFAULT_TARGET, batch=args.batch,
                          seed=args.seed, trace=trace, **_parallel_kwargs(args))
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
        _write_traces(trace, args.trace, args.timeline)
    return 0


def _write_traces(trace, path: str | None, timeline_path: str | None) -> None:
    """The Chrome trace (``path``) and the timeline picture, of every rank of an MPI job
    (collective: rank 0 gathers the ranks' traces and writes both)."""
    from purinec.runtime import comm
    from purinec.runtime.trace import gather_events, merge_events, write_events
    from purinec.viz import overlap, timeline

    per_rank = gather_events(trace, comm.world())
    if per_rank is None:
        return
    events = merge_events(per_rank)
    ranks = f" on {len(per_rank)} ranks" if len(per_rank) > 1 else ""
    if path:
        write_events(path, events)
        tasks = sum(e["ph"] == "X" for e in events)
        print(f"wrote trace {path}: {tasks} tasks over {trace.calls} iteration(s){ranks}; "
              "open it in https://ui.perfetto.dev")
    if timeline_path:
        stats = overlap(events)
        timeline(events, timeline_path, stats)
        whose = "each rank's own " if ranks else ""
        comm = (f"communication {stats['comm_ms']:.3f} ms ({stats['hidden_fraction']:.0%} "
                f"hidden behind {whose}compute)" if stats["comm_ms"] > 0
                else "no communication")
        print(f"wrote timeline {timeline_path}: {stats['wall_ms']:.3f} ms{ranks}, {comm}")


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


def cmd_train(args) -> int:
    _check_train_options(args)
    trace = None
    if args.timeline:
        from purinec.runtime.trace import Trace

        trace = Trace()
    # Flushed line by line: the epochs of a long run show as they end, in a log too.
    session = {"epochs": args.epochs, "target": args.target, "checkpoint": args.checkpoint,
               "progress": _shows_progress(args),
               "report": functools.partial(print, flush=True)}
    if args.resume:
        resume_training(args.resume, model=args.model, data=args.data, seed=args.seed,
                        **session)
    else:
        train_model(args.model, data=args.data, batch=args.batch, seed=args.seed,
                    lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                    devices=args.devices, parallel=args.parallel,
                    micro_batches=args.micro_batches, trace=trace, **session)
    if trace is not None:
        _write_traces(trace, None, args.timeline)
    return 0


def _check_train_options(args) -> None:
    """Refuse options that contradict each other, or files that could not be written,
    before any work (a long run must not end in an error about one of them)."""
    artifact = args.resume or (args.model if _is_artifact(args.model) else None)
    if artifact:
        refuse_fixed_options(vars(args), artifact)
    elif args.model is None:
        raise PurinecError("give a MODEL to train, or --resume CHECKPOINT")
    if args.resume and args.timeline:
        raise PurinecError("--timeline records a fresh run; it does not go with --resume")
    if args.checkpoint and not _is_artifact(args.checkpoint):
        raise PurinecError(f"--checkpoint {args.checkpoint}: name it FILE.purine (run, train "
                           f"and --resume recognize artifacts by that suffix)")
    _check_writable(args, ("checkpoint", "timeline"))
    _sgd(args)  # solver values and devices checked before any work
    if args.devices is not None:
        from purinec.compiler import as_devices

        as_devices(args.devices)


def _shows_progress(args) -> bool:
    """Whether progress bars (compiling kernels, training) are drawn: on rank 0, when
    stderr is a terminal (unless --quiet) or with --progress."""
    return is_reporting_rank() and (getattr(args, "progress", False) or
                                    sys.stderr.isatty() and not getattr(args, "quiet", False))


def build_parser() -> argparse.ArgumentParser:
    from purinec.data import DATA_HELP

    parser = argparse.ArgumentParser(
        prog="purinec",
        description="A Purine-style bi-graph compiler for deep networks: lower a model to "
                    "typed IR, derive its backward graph and solver, compile it ahead of "
                    "time into a .purine artifact, and run or train it.")
    parser.add_argument("--version", action="version", version=f"purinec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    dump = sub.add_parser("dump", help="print or write the IR at any pipeline stage",
                          description="Print the IR of MODEL after a pipeline stage, or write "
                                      "one .pir file per stage with -o.",
                          epilog=STAGE_HELP, formatter_class=_HelpFormatter)
    dump.add_argument("model", metavar="MODEL",
                      help=MODEL_HELP + ", or a .purine artifact (the final IR it holds)")
    dump.add_argument("--train", action="store_true",
                      help="compile the training iteration (backward and SGD)")
    dump.add_argument("--batch", type=_positive, help="batch size (default: the model's)")
    _add_model_args(dump)
    dump.add_argument("--stage", metavar="NAME|all",
                      help="stage to show (default: the final IR); 'all' shows every stage")
    dump.add_argument("-o", "--output", metavar="DIR|FILE",
                      help="write one file per stage (and kernel) into DIR and print their "
                           "paths; or, for one stage, the file FILE.pir (.dot, .svg, .png "
                           "with --format)")
    dump.add_argument("--target", default=DEFAULT_TARGET,
                      help=f"target whose pipeline to run: {TARGETS_HELP} (default: "
                           f"{DEFAULT_TARGET}; reference does not fuse)")
    dump.add_argument("--explain", action="store_true",
                      help="with --stage fuse: say why each pair of neighbours did not fuse; "
                           "with --stage parallel: why each copy and collective is there")
    dump.add_argument("--format", choices=("text", "dot", "svg", "png"), default="text",
                      help="text: the IR (.pir); dot: Graphviz DOT of the bi-graph, ops and "
                           "tensors coloured by device; svg/png: pictures drawn by Graphviz's "
                           "dot (need -o)")
    _add_parallel_args(dump)
    dump.add_argument("--rank", type=_non_negative, default=0,
                      help="with --devices over several ranks: whose physical graph to show")
    machine_code = dump.add_mutually_exclusive_group()
    machine_code.add_argument("--llvm", action="store_true",
                              help="with --stage kernels: the LLVM IR Numba produced")
    machine_code.add_argument("--asm", action="store_true",
                              help="with --stage kernels: the machine code, as assembly")
    _add_solver_args(dump)
    dump.set_defaults(func=cmd_dump, parser=dump)

    comp = sub.add_parser(
        "compile", help="compile a model ahead of time into a .purine artifact",
        description="Compile MODEL (the inference graph, or with --train the training "
                    "iteration too) for a target and write it, with freshly initialized "
                    "weights, to one .purine file that `purinec run` and `purinec train` "
                    "load without compiling again.",
        epilog=PARALLEL_HELP, formatter_class=_HelpFormatter)
    comp.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    comp.add_argument("-o", "--output", metavar="FILE.purine", required=True,
                      help="the artifact to write (atomically: a failed write leaves an "
                           "existing file as it was)")
    comp.add_argument("--train", action="store_true",
                      help="also compile the training iteration (backward and SGD)")
    comp.add_argument("--batch", type=_positive, help="batch size (default: the model's)")
    comp.add_argument("--target", default=DEFAULT_TARGET,
                      help=f"code generation target: {TARGETS_HELP} (default: "
                           f"{DEFAULT_TARGET})")
    _add_parallel_args(comp)
    comp.add_argument("--seed", type=_non_negative, default=0,
                      help="seed of the initial weights (default 0)")
    _add_model_args(comp)
    _add_solver_args(comp)
    comp.set_defaults(func=cmd_compile, parser=comp)

    run = sub.add_parser(
        "run", help="run a compiled artifact or a model's inference graph",
        description="Run the inference graph of FILE.purine (loaded, not recompiled) or of "
                    "MODEL (compiled now) and print each output's name, type and a "
                    "summary, and the time per iteration.",
        epilog=PARALLEL_HELP, formatter_class=_HelpFormatter)
    run.add_argument("model", metavar="FILE.purine|MODEL",
                     help="an artifact from `purinec compile`, or " + MODEL_HELP)
    run.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                     help="feed input NAME from a .npy file (repeat for more inputs); "
                          "inputs not given get random values of their declared type, and "
                          "the output says so")
    run.add_argument("--output", metavar="OUT.npz",
                     help="write the outputs of the last iteration to OUT.npz (atomically)")
    run.add_argument("--iterations", type=_positive, default=1, metavar="N",
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
    run.add_argument("--batch", type=_positive,
                     help="batch size of MODEL (default: the model's; fixed in an artifact)")
    _add_parallel_args(run)
    run.add_argument("--seed", type=_non_negative, default=0,
                     help="seed of the random inputs and of MODEL's weights (default 0)")
    run.set_defaults(func=cmd_run, parser=run)

    tr = sub.add_parser(
        "train", help="train a model on a data set, with checkpoints",
        description="Train MODEL (compiled now) or FILE.purine (compiled with --train) and "
                    "report loss and test accuracy every epoch; with --checkpoint, save "
                    "the training program, its weights and momentum state and the epoch "
                    "after every epoch, and continue from such a file with --resume.",
        epilog=PARALLEL_HELP, formatter_class=_HelpFormatter)
    tr.add_argument("model", metavar="MODEL|FILE.purine", nargs="?",
                    help=MODEL_HELP + ", or an artifact compiled with --train; optional "
                                      "with --resume")
    tr.add_argument("--target",
                    help=f"code generation target: {TARGETS_HELP} (default: {DEFAULT_TARGET} "
                         "for a MODEL, the artifact's own for a FILE.purine)")
    tr.add_argument("--data", metavar="NAME|DIR",
                    help=f"data set: {DATA_HELP} (default: digits, or the checkpoint's)")
    tr.add_argument("--epochs", type=_positive, default=10,
                    help="train until this many epochs are done, counting those of a "
                         "resumed checkpoint (default 10)")
    tr.add_argument("--batch", type=_positive,
                    help="batch size (default: the model's; fixed in an artifact)")
    tr.add_argument("--seed", type=_non_negative,
                    help="seed of the data split, shuffling and initial weights (default 0, "
                         "or the checkpoint's)")
    tr.add_argument("--checkpoint", metavar="FILE.purine",
                    help="after every epoch, write a checkpoint here atomically (a kill "
                         "during the write leaves the previous one intact); with --resume, "
                         "defaults to the resumed file")
    tr.add_argument("--resume", metavar="FILE.purine",
                    help="continue from a checkpoint: its training program, weights, "
                         "momentum state, epoch, data set and seed; gives the same weights "
                         "as a run that was never interrupted")
    _add_parallel_args(tr)
    tr.add_argument("--timeline", metavar="FILE.png|FILE.svg",
                    help="draw the last epoch's tasks on each device's compute, copy and "
                         "communication lanes into FILE (a target that records traces)")
    tr.add_argument("--quiet", action="store_true",
                    help="no progress bars (compiling kernels, training)")
    tr.add_argument("--progress", action="store_true",
                    help="show the progress bars even when stderr is not a terminal")
    _add_solver_args(tr)
    tr.set_defaults(func=cmd_train, parser=tr)
    return parser


# What the op kinds in fusion's reasons mean (TVM's pattern kinds, purinec/ir/ops.py).
FUSION_KINDS_LEGEND = (
    "# kernels: elementwise and broadcast ops fuse into one loop, which may start with an\n"
    "# out_elementwise_fusable op (matmul, conv2d: the loop is its epilogue); injective,\n"
    "# reduction and opaque ops take no producer into their kernel and pass nothing on")


def _warning_printer(rank: int, default):
    """``warnings.showwarning`` for the command line: purinec's own warnings as one
    line (from rank 0 only: every rank compiles the same program), others as usual."""
    def show(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, PurinecWarning):
            default(message, category, filename, lineno, file, line)
        elif rank == 0:
            print(f"purinec: warning: {message}", file=sys.stderr)
    return show


def main(argv: list[str] | None = None) -> int:
    from purinec.runtime import comm

    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # said by the command's parser, with its usage (the top one's says less)
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    here = comm.world()
    if here.rank > 0:  # under mpiexec every rank runs the command; rank 0 reports
        sys.stdout = open(os.devnull, "w")
    try:
        with warnings.catch_warnings(), kernel_progress(_shows_progress(args)):
            warnings.showwarning = _warning_printer(here.rank, warnings.showwarning)
            # Under mpiexec, a rank that fails prints its error and ends the whole job.
            return comm.run_guarded(lambda: args.func(args))
    except PurinecError as err:
        print(f"purinec: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("purinec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader stopped reading (purinec dump ... | head)
        # Python would fail again flushing stdout at exit: point it at nothing first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
