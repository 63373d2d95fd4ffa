"""`purinec compile`: a model compiled ahead of time into a .purine artifact."""

from __future__ import annotations

import time

from purinec.cli.common import (MODEL_HELP, PARALLEL_HELP, TARGETS_HELP, HelpFormatter,
                                add_model_args, add_parallel_args, add_solver_args,
                                model_kwargs, parallel_kwargs, positive, seed_value, sgd)
from purinec.errors import PurinecError, refuse_options
from purinec.job import on_devices, wait_for_every_rank
from purinec.train import DEFAULT_TARGET, SOLVER_OPTIONS


def add_parser(subparsers) -> None:
    comp = subparsers.add_parser(
        "compile", help="compile a model ahead of time into a .purine artifact",
        description="Compile MODEL (the inference graph, or with --train the training "
                    "iteration too) for a target and write it, with freshly initialized "
                    "weights, to one .purine file that `purinec run` and `purinec train` "
                    "load without compiling again.",
        epilog=PARALLEL_HELP, formatter_class=HelpFormatter)
    comp.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    comp.add_argument("-o", "--output", metavar="FILE.purine", required=True,
                      help="the artifact to write (atomically: a failed write leaves an "
                           "existing file as it was)")
    comp.add_argument("--train", action="store_true",
                      help="also compile the training iteration (backward and SGD)")
    comp.add_argument("--batch", type=positive, help="batch size (default: the model's)")
    comp.add_argument("--target", default=DEFAULT_TARGET,
                      help=f"code generation target: {TARGETS_HELP} (default: "
                           f"{DEFAULT_TARGET})")
    add_parallel_args(comp)
    comp.add_argument("--seed", type=seed_value, default=0,
                      help="seed of the initial weights (default 0)")
    add_model_args(comp)
    add_solver_args(comp)
    comp.set_defaults(func=cmd_compile, parser=comp)


def cmd_compile(args) -> int:
    from purinec.compiler import compile

    if not args.output.endswith(".purine"):
        raise PurinecError(f"-o {args.output}: name the artifact FILE.purine (run and train "
                           "recognize artifacts by that suffix)")
    if not args.train:
        refuse_options(vars(args), SOLVER_OPTIONS, "solver options apply only with --train")
    options = model_kwargs(args)
    start = time.perf_counter()
    program = compile(args.model, target=args.target, train=sgd(args) if args.train else None,
                      batch=args.batch, seed=args.seed,
                      **parallel_kwargs(args, **options), **options)
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
