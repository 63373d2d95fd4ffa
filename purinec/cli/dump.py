"""`purinec dump`: the IR of a model after any pipeline stage, its kernels, or the IR an
artifact holds; as text, Graphviz DOT or pictures."""

from __future__ import annotations

import functools
import os
from typing import Callable

from purinec.cli.common import (MODEL_HELP, TARGETS_HELP, HelpFormatter, add_model_args,
                                add_parallel_args, add_solver_args, check_writable,
                                model_kwargs, non_negative, output_directories, positive,
                                sgd)
from purinec.errors import PurinecError
from purinec.fileio import atomic_write_text
from purinec.job import default_strategy, placement_of
from purinec.targets import TARGETS, get_target
from purinec.train import DEFAULT_TARGET

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
  on_gpus       --target cuda: a graph placed on cpu devices only moved to the gpu
                devices of the same numbers
  local_collectives
                --target cuda: collectives and slices among the GPUs of one process
                as copies between them and kernels on them (sums, concats)
  fuse          nodes grouped into fused kernels (cpu and cuda targets; the final IR)
  kernels       the generated Numba source of every kernel (cpu and cuda targets)
"""

# What the op kinds in fusion's reasons mean (TVM's pattern kinds, purinec/ir/ops.py).
FUSION_KINDS_LEGEND = (
    "# kernels: elementwise and broadcast ops fuse into one loop, which may start with an\n"
    "# out_elementwise_fusable op (matmul, conv2d: the loop is its epilogue); injective,\n"
    "# reduction and opaque ops take no producer into their kernel and pass nothing on")

# The suffix of the file a dump writes per stage, by --format.
DUMP_SUFFIXES = {"text": ".pir", "dot": ".dot", "svg": ".svg", "png": ".png"}


def add_parser(subparsers) -> None:
    dump = subparsers.add_parser(
        "dump", help="print or write the IR at any pipeline stage",
        description="Print the IR of MODEL after a pipeline stage, or write one .pir file "
                    "per stage with -o.",
        epilog=STAGE_HELP, formatter_class=HelpFormatter)
    dump.add_argument("model", metavar="MODEL",
                      help=MODEL_HELP + ", or a .purine artifact (the final IR it holds)")
    dump.add_argument("--train", action="store_true",
                      help="compile the training iteration (backward and SGD)")
    dump.add_argument("--batch", type=positive, help="batch size (default: the model's)")
    add_model_args(dump)
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
    add_parallel_args(dump)
    dump.add_argument("--rank", type=non_negative, default=0,
                      help="with --devices over several ranks: whose physical graph to show")
    machine_code = dump.add_mutually_exclusive_group()
    machine_code.add_argument("--llvm", action="store_true",
                              help="with --stage kernels: the LLVM IR Numba produced")
    machine_code.add_argument("--asm", action="store_true",
                              help="with --stage kernels: the machine code, as assembly")
    machine_code.add_argument("--ptx", action="store_true",
                              help="with --stage kernels and --target cuda: the PTX of each "
                                   "CUDA kernel for sm_90 (Hopper), compiled here: no GPU "
                                   "needed")
    add_solver_args(dump)
    dump.set_defaults(func=cmd_dump, parser=dump)


def cmd_dump(args) -> int:
    with output_directories() as makedirs:
        if args.model.endswith(".purine"):
            return _dump_artifact(args, makedirs)
        return _dump_model(args, makedirs)


def _dump_model(args, makedirs: Callable[[str], None]) -> int:
    """The IR of a model after the stages asked for, and its kernels."""
    from purinec.compiler import build_graph, check_differentiable, load_source
    from purinec.layout import parallel_plan, warn_if_idle
    from purinec.program import step_graph

    train = sgd(args) if args.train else None
    source = load_source(args.model, args.batch, **model_kwargs(args))
    check_differentiable(source, train, args.model)
    placed = functools.cache(lambda: placement_of(source))  # lowered once, if at all
    strategy = default_strategy(args.parallel, args.devices, placed)
    spread = get_target(args.target).lay_out(
        parallel_plan(args.devices, strategy, args.micro_batches) or placed())
    if spread is None:
        if args.rank:
            raise PurinecError(f"--rank {args.rank}: the program runs on one device of "
                               "rank 0; --rank goes with --devices over several ranks")
    elif args.rank >= spread.ranks:
        raise PurinecError(f"--rank {args.rank}: the devices span {spread.ranks} rank(s)")
    pipeline = get_target(args.target).pipeline(train, spread, args.rank)
    runs = pipeline.stages()
    wanted = _wanted_stages(args, runs)
    if args.format in ("svg", "png"):
        if not args.output:
            raise PurinecError(f"--format {args.format} writes picture files; give -o DIR "
                               f"or -o FILE.{args.format}")
        from purinec.viz import graphviz_dot

        graphviz_dot(args.format)  # before any work
    if args.format != "text" and "kernels" in wanted:
        raise PurinecError("--stage kernels is source code, not a graph; use --format text")
    if (args.llvm or args.asm or args.ptx) and wanted != ["kernels"]:
        raise PurinecError("--llvm, --asm and --ptx go with --stage kernels")
    if args.explain and not {"fuse", "parallel"} & set(wanted):
        raise PurinecError("--explain goes with --stage fuse or parallel (or all)")
    single = _single_output_file(args, several=len(wanted) > 1 or "kernels" in wanted
                                 or args.explain)
    if args.output and not single:
        makedirs(args.output)
    written: list[str] = []
    before_fuse: list = []

    def emit(name: str, text: str) -> None:
        if args.output:
            path = single or os.path.join(args.output, name)
            makedirs(os.path.dirname(path) or ".")
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
            emit(f"{base}.pir", _onnx_names(source, stage) + str(graph))
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
        steps = step_graph(graph) if train is not None else graph  # as `Program` runs it
        graph = pipeline.run_physical(steps, _fuse_input(show, before_fuse))
    if "kernels" in wanted:
        _dump_kernels(graph, args, emit)
    for path in written:
        print(f"wrote {path}")
    return 0


def _onnx_names(source, stage: str) -> str:
    """Comment lines heading an ONNX model's first stage: the ONNX names of its inputs,
    initializers and outputs that the IR spells differently."""
    from purinec.onnxio import OnnxModel

    if not isinstance(source, OnnxModel) or stage != "lower":
        return ""
    return "".join(f"# ONNX {name!r} is %{ir}\n" for name, ir in source.mapping())


def _dump_artifact(args, makedirs: Callable[[str], None]) -> int:
    """The final IR an artifact holds (and its inference graph), as text."""
    from purinec.artifact import read_ir

    given = [option for option, value in (
        ("--stage", args.stage), ("--train", args.train), ("--batch", args.batch),
        ("--input-shape", args.input_shape), ("--num-classes", args.num_classes),
        ("--devices", args.devices), ("--parallel", args.parallel),
        ("--micro-batches", args.micro_batches), ("--explain", args.explain),
        ("--llvm", args.llvm), ("--asm", args.asm), ("--ptx", args.ptx),
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
            makedirs(os.path.dirname(path) or ".")
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
    check_writable(args, ("output",))
    return args.output


def _wanted_stages(args, runs: list[str]) -> list[str]:
    """The stages to show: the named one (checked against what runs for this target and
    mode, with the reason when it does not run), all that run, or the final IR."""
    from purinec.passes.pipeline import STAGES

    generates = get_target(args.target).generates_code
    if args.stage is None:
        return [runs[-1]]
    if args.stage == "all":
        return runs + (["kernels"] if generates else [])
    if args.stage == "kernels":
        if not generates:
            coders = ", ".join(name for name, t in TARGETS.items() if t.generates_code)
            raise PurinecError(f"target {args.target} generates no kernels; use --target "
                               f"{coders}")
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
               else f"runs only without --train (inference graphs) for target {args.target}"
               if args.train and args.stage in [p.name for p in
                                                get_target(args.target).passes(False)]
               else f"does not run for target {args.target}")
        raise PurinecError(f"stage {args.stage} {why}")
    return [args.stage]


# --llvm, --asm, --ptx: the suffix of the file each kernel's code goes to, and the
# kernel's method that makes it.
_MACHINE_CODE = {"llvm": (".ll", "llvm"), "asm": (".s", "asm"), "ptx": (".ptx", "ptx")}


def _text_of(code) -> str:
    """Machine code as text: a CUDA module's PTX comes per kernel."""
    if isinstance(code, dict):
        return "\n".join(f"// ---- kernel {name} ----\n{text}" for name, text in code.items())
    return code


def _dump_kernels(graph, args, emit) -> None:
    """The generated source of every kernel (or what Numba made of it: --llvm, --asm)."""
    folder = f"{graph.name}.kernels"
    for node, kernel in get_target(args.target).generated(graph).items():
        stem = os.path.join(folder, f"{kernel.name}.{node.name}")  # node names are unique
        if args.llvm or args.asm or args.ptx:
            suffix, show = _MACHINE_CODE["llvm" if args.llvm else "asm" if args.asm else "ptx"]
            if not hasattr(kernel, show):
                raise PurinecError(f"kernel {kernel.name} (node %{node.name}, target "
                                   f"{args.target}) has no {suffix[1:]} to show: --llvm and "
                                   f"--asm show cpu kernels, --ptx cuda kernels")
            emit(f"{stem}{suffix}", _text_of(getattr(kernel, show)()))
        else:
            # (a kernel of several modules says where each is cached in its source)
            cached = f"# cached as {kernel.path}\n" if kernel.path is not None else ""
            emit(f"{stem}.py", cached + kernel.source)
