"""`purinec train`: the command line of `purinec.train.train_model` and
`purinec.train.resume_training`. What is checked here is what is about the options
themselves, before any work (a long run must not end in an error about one of them);
the session prints through ``report``."""

from __future__ import annotations

import functools

from purinec.cli.common import (MODEL_HELP, PARALLEL_HELP, TARGETS_HELP, HelpFormatter,
                                add_parallel_args, add_solver_args, check_writable,
                                epoch_count, is_artifact, positive, seed_value,
                                shows_progress, write_traces)
from purinec.errors import PurinecError
from purinec.train import DEFAULT_TARGET, refuse_fixed_options, resume_training, train_model


def add_parser(subparsers) -> None:
    from purinec.data import DATA_HELP

    tr = subparsers.add_parser(
        "train", help="train a model on a data set, with checkpoints",
        description="Train MODEL (compiled now) or FILE.purine (compiled with --train) and "
                    "report loss and test accuracy every epoch; with --checkpoint, save "
                    "the training program, its weights and momentum state and the epoch "
                    "after every epoch, and continue from such a file with --resume.",
        epilog=PARALLEL_HELP, formatter_class=HelpFormatter)
    tr.add_argument("model", metavar="MODEL|FILE.purine", nargs="?",
                    help=MODEL_HELP + ", or an artifact compiled with --train; optional "
                                      "with --resume")
    tr.add_argument("--target",
                    help=f"code generation target: {TARGETS_HELP} (default: {DEFAULT_TARGET} "
                         "for a MODEL, the artifact's own for a FILE.purine)")
    tr.add_argument("--data", metavar="NAME|DIR",
                    help=f"data set: {DATA_HELP} (default: digits, or the checkpoint's)")
    tr.add_argument("--epochs", type=epoch_count, default=10,
                    help="train until this many epochs are done, counting those of a "
                         "resumed checkpoint (default 10)")
    tr.add_argument("--batch", type=positive,
                    help="batch size (default: the model's; fixed in an artifact)")
    tr.add_argument("--seed", type=seed_value,
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
    add_parallel_args(tr)
    tr.add_argument("--timeline", metavar="FILE.png|FILE.svg",
                    help="draw the last epoch's tasks on each device's compute, copy and "
                         "communication lanes into FILE (a target that records traces)")
    shown = tr.add_mutually_exclusive_group()
    shown.add_argument("--quiet", action="store_true",
                       help="no progress on stderr: neither bars (compiling kernels, "
                            "training) nor, in a log, the lines on a long kernel compile")
    shown.add_argument("--progress", action="store_true",
                       help="draw the progress bars even when stderr is not a terminal "
                            "(instead of a log's lines)")
    add_solver_args(tr)
    tr.set_defaults(func=cmd_train, parser=tr)


def cmd_train(args) -> int:
    _check_options(args)
    trace = None
    if args.timeline:
        from purinec.runtime.trace import Trace

        trace = Trace()
    # Flushed line by line: the epochs of a long run show as they end, in a log too.
    session = {"epochs": args.epochs, "target": args.target, "checkpoint": args.checkpoint,
               "progress": shows_progress(args),
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
        write_traces(trace, None, args.timeline)
    return 0


def _check_options(args) -> None:
    """Refuse options that contradict each other, or files that could not be written,
    before any work. (train_model and resume_training check the model, the target, the
    devices and the solver before they load the data set.)"""
    artifact = args.resume or (args.model if is_artifact(args.model) else None)
    if artifact:
        refuse_fixed_options(vars(args), artifact)
    elif args.model is None:
        raise PurinecError("give a MODEL to train, or --resume CHECKPOINT")
    if args.resume and args.timeline:
        raise PurinecError("--timeline records a fresh run; it does not go with --resume")
    if args.checkpoint and not is_artifact(args.checkpoint):
        raise PurinecError(f"--checkpoint {args.checkpoint}: name it FILE.purine (run, train "
                           f"and --resume recognize artifacts by that suffix)")
    check_writable(args, ("checkpoint", "timeline"))
