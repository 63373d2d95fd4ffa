"""The `purinec` command: one module per subcommand (dump, compile, run, train, export), each
with its ``add_parser(subparsers)`` and ``cmd_*`` function; what they share is in
`purinec.cli.common`. The training session itself is `purinec.train`'s."""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import signal
import sys
import warnings

from purinec import __version__
from purinec.cli import compile, dump, export, run, train
from purinec.cli.common import progress_style, warning_printer
from purinec.codegen.progress import kernel_progress
from purinec.errors import PurinecError
from purinec.runtime.signals import interruption, terminating

COMMANDS = (dump, compile, run, train, export)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="purinec",
        description="A Purine-style bi-graph compiler for deep networks: lower a model to "
                    "typed IR, derive its backward graph and solver, compile it ahead of "
                    "time into a .purine artifact, and run or train it.")
    parser.add_argument("--version", action="version", version=f"purinec {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def command() -> int:
    """The ``purinec`` program: `main`, then an exit without the garbage collector's
    last passes over every object the process made (Numba's and LLVM's above all: a
    quarter of a second, a quarter of a warm ``purinec run``). Objects are still freed
    and atexit handlers run; the system takes back what cycles hold."""
    # A crash in machine code (a generated kernel, the BLAS) prints every thread's Python
    # stack (where each was), not only "Segmentation fault".
    faulthandler.enable()
    status = main()
    gc.freeze()
    return status


def main(argv: list[str] | None = None) -> int:
    from purinec.runtime import comm

    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # said by the command's parser, with its usage (the top one's says less)
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    here = comm.world()
    if here.rank > 0:  # under mpiexec every rank runs the command; rank 0 reports
        sys.stdout = open(os.devnull, "w")
    try:
        with terminating(), warnings.catch_warnings(), \
                kernel_progress(progress_style(args)):
            warnings.showwarning = warning_printer(here.rank, warnings.showwarning)
            # Under mpiexec, a rank that fails prints its error and ends the whole job.
            return comm.run_guarded(lambda: args.func(args))
    except PurinecError as err:
        print(f"purinec: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM (see purinec.runtime.signals)
        what, status = interruption(err)
        print(f"purinec: {what}", file=sys.stderr)
        return status
    except BrokenPipeError:  # the reader stopped reading (purinec dump ... | head)
        # Python would fail again flushing stdout at exit: point it at nothing first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
