"""What several commands share: the options for models, solvers and parallelism, help
that fits the terminal, checks that files can be written, progress bars, warnings,
and writing traces."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from typing import Callable, Iterator

from purinec.errors import PurinecError, PurinecWarning
from purinec.job import is_reporting_rank, spread_options
from purinec.train import MAX_EPOCHS, MAX_SEED, SOLVER_DEFAULTS, default_sgd

MODEL_HELP = ("a zoo name (mlp, lenet, convnet, cifar_quick, nin, inception), a Python file "
              "NAME.py defining build(batch) (no other file is run), or a .pir IR file")

TARGETS_HELP = ("cpu (fused Numba kernels), cuda (Numba CUDA kernels on a GPU; the [cuda] "
                "extra) or reference (NumPy, one op at a time)")

PARALLEL_HELP = """\
parallelism: --devices cpu:0,cpu:1 (or a count: --devices 2) spreads the program over
devices of this process, each with its own worker thread and share of the cores;
`mpiexec -n 2 purinec train lenet --parallel ps` puts one device on each MPI rank
(--devices r0/cpu:0,r0/cpu:1,r1/cpu:0,r1/cpu:1 names several per rank). Under mpiexec
with neither option, a model is spread over the ranks by data parallelism, unless it
places its layers itself.
"""


class HelpFormatter(argparse.HelpFormatter):
    """Wraps a text written as one paragraph (a command's description) to the terminal,
    as argparse does; keeps a text written in lines (an epilog of examples) as written.
    (RawDescriptionHelpFormatter keeps both, so descriptions ran off the screen.)"""

    def _fill_text(self, text, width, indent):
        if "\n" in text.strip("\n"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape like 1,28,28")
    return shape


def _whole_number(least: int, most: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least or most is not None and value > most:
            bounds = f">= {least}" if most is None else f"from {least} to {most}"
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer {bounds}")
        return value
    return parse


non_negative, positive = _whole_number(0), _whole_number(1)
# Seeds and epochs as a checkpoint can hold them.
seed_value, epoch_count = _whole_number(0, MAX_SEED), _whole_number(1, MAX_EPOCHS)


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    from purinec.passes.parallel import STRATEGIES, USER_STRATEGIES

    p.add_argument("--devices", metavar="LIST|N",
                   help="devices to spread the program over: cpu:0,cpu:1 in this process, "
                        "r1/cpu:0 for a device of MPI rank 1, or a count N for cpu:0..N-1")
    p.add_argument("--parallel", choices=USER_STRATEGIES, metavar="STRATEGY",
                   help="how to spread it (default data): " + "; ".join(
                       f"{name}: {STRATEGIES[name]}" for name in USER_STRATEGIES))
    p.add_argument("--micro-batches", type=positive, metavar="N",
                   help="with --parallel pipeline: micro-batches per batch (default: twice "
                        "the devices)")


def parallel_kwargs(args, **model_kwargs) -> dict:
    """compile()'s devices and strategy, as given, or `purinec.job.default_strategy`'s
    default."""
    return spread_options(args.model, args.batch, args.devices, args.parallel,
                          args.micro_batches, **model_kwargs)


def add_solver_args(p: argparse.ArgumentParser) -> None:
    # Defaults are None so that a command can tell an option given from one left out
    # (an artifact's solver settings are fixed in its IR); `sgd` fills them in.
    p.add_argument("--lr", type=float,
                   help=f"learning rate (default {SOLVER_DEFAULTS['lr']})")
    p.add_argument("--momentum", type=float,
                   help=f"SGD momentum (default {SOLVER_DEFAULTS['momentum']})")
    p.add_argument("--weight-decay", type=float,
                   help=f"L2 weight decay (default {SOLVER_DEFAULTS['weight_decay']})")


def sgd(args):
    """The solver the options ask for: the same for dump, compile and train, so that dump
    shows what compile and train build."""
    return default_sgd(args.lr, args.momentum, args.weight_decay)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-shape", type=_parse_shape, metavar="C,H,W",
                        help="shape of one input image, for a zoo model or a build() that "
                             "takes input_shape (default: the model's)")
    parser.add_argument("--num-classes", type=positive, metavar="N",
                        help="number of classes, for a zoo model or a build() that takes "
                             "num_classes (default: the model's)")


def model_kwargs(args) -> dict:
    """The model options given on the command line, for the model's builder."""
    options = {"input_shape": args.input_shape, "num_classes": args.num_classes}
    return {name: value for name, value in options.items() if value is not None}


def is_artifact(spec: str | None) -> bool:
    return bool(spec) and spec.endswith(".purine")


def check_writable(args, options: tuple[str, ...]) -> None:
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


@contextlib.contextmanager
def output_directories() -> Iterator[Callable[[str], None]]:
    """A ``makedirs(path)`` for the folders a command writes into. When the command
    fails, the folders it made are removed again where they are still empty: a failed
    command leaves no empty folder behind (and no folder it did not make is touched)."""
    made: list[str] = []

    def makedirs(path: str) -> None:
        missing = []
        folder = os.path.abspath(path)
        while not os.path.lexists(folder):
            missing.append(folder)
            folder = os.path.dirname(folder)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as err:
            raise PurinecError(f"cannot make folder {path}: {err.strerror or err}") from None
        made.extend(reversed(missing))  # outermost first

    try:
        yield makedirs
    except BaseException:
        for folder in reversed(made):
            with contextlib.suppress(OSError):  # (not empty: something was written in it)
                os.rmdir(folder)
        raise


def progress_style(args) -> str | None:
    """How long work (compiling kernels, training) shows its progress on stderr, on rank
    0: bars on a terminal or with --progress; in a log (stderr not a terminal), a line
    when compiling kernels takes a while and a summary after it; nothing with --quiet."""
    from purinec.codegen.progress import BAR, LINES

    if not is_reporting_rank() or getattr(args, "quiet", False):
        return None
    return BAR if getattr(args, "progress", False) or sys.stderr.isatty() else LINES


def shows_progress(args) -> bool:
    """Whether progress bars (compiling kernels, training) are drawn."""
    from purinec.codegen.progress import BAR

    return progress_style(args) == BAR


def warning_printer(rank: int, default):
    """``warnings.showwarning`` for the command line: purinec's own warnings as one
    line (from rank 0 only: every rank compiles the same program), others as usual."""
    def show(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, PurinecWarning):
            default(message, category, filename, lineno, file, line)
        elif rank == 0:
            print(f"purinec: warning: {message}", file=sys.stderr)
    return show


def write_traces(trace, path: str | None, timeline_path: str | None) -> None:
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
