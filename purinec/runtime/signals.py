"""Stopping cleanly on a signal.

Ctrl-C raises KeyboardInterrupt in the main thread, so every ``finally`` runs: temporary
files are removed, worker threads joined, an MPI job ended as one (`comm.run_guarded`).
SIGTERM, which schedulers and ``kill`` send, would end the process on the spot and leave
all of that behind; inside `terminating` it raises `Terminated` instead, a
KeyboardInterrupt that says which signal it was, so it is cleaned up after the same way.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


class Terminated(KeyboardInterrupt):
    """The process was asked to stop (SIGTERM)."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated("terminated")


@contextlib.contextmanager
def terminating() -> Iterator[None]:
    """Within the block, SIGTERM raises `Terminated` in the main thread (Python runs
    signal handlers there only; elsewhere this does nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interruption(err: KeyboardInterrupt) -> tuple[str, int]:
    """What stopped the process, in a word, and the exit status a shell expects for it
    (128 + the signal's number)."""
    if isinstance(err, Terminated):
        return "terminated", 128 + signal.SIGTERM
    return "interrupted", 128 + signal.SIGINT
