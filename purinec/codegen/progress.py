"""How compiling kernels shows its progress. A cold compile of a big model takes minutes
(a few hundred kernels) and a warm one about a second, so the command line asks for it
(`kernel_progress`): on a terminal, a bar that shows after a second; in a log (stderr
not a terminal: CI, ``setup.sh > log``), a line once compiling has taken a few seconds,
saying what is compiled, and a summary at its end. A warm compile writes no line."""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
import time
from typing import Iterator

BAR, LINES = "bar", "lines"  # the styles of `kernel_progress`
LINE_AFTER_S = 3.0  # a log hears of a compile that has taken this long

_style = contextvars.ContextVar("purinec_kernel_progress", default=None)


@contextlib.contextmanager
def kernel_progress(style: str | None = BAR) -> Iterator[None]:
    """Within this block, `compile_kernels` shows its progress on stderr: as a bar
    (`BAR`), as lines for a log (`LINES`), or not at all (None)."""
    token = _style.set(style)
    try:
        yield
    finally:
        _style.reset(token)


def kernel_counter(total: int, name: str, kernels: int, cached: int):
    """What counts (``update()``) the ``total`` kernel modules of graph ``name`` (one a
    node, or one a member of a horizontal group) as they are ready, shown as a
    `kernel_progress` block asks: ``kernels`` distinct kernels, ``cached`` of which are
    in Numba's disk cache (loaded, not compiled)."""
    if _style.get() == LINES:
        return _LogLines(name, kernels, cached)
    from tqdm import tqdm

    return tqdm(total=total, desc=f"kernels of {name}", unit="kernel", delay=1.0,
                leave=False, disable=_style.get() != BAR)


class _LogLines:
    """Progress for a log: a line once compiling has taken `LINE_AFTER_S` seconds (from
    a timer: one kernel alone can take that long), and a summary at the end when that
    line was written."""

    def __init__(self, name: str, kernels: int, cached: int):
        self._name, self._kernels, self._cached = name, kernels, cached
        self._lock = threading.Lock()  # the timer's line comes before the summary, or not
        self._said = self._done = False
        self._timer = threading.Timer(LINE_AFTER_S, self._say_started)
        self._timer.daemon = True

    def __enter__(self) -> "_LogLines":
        self._began = time.perf_counter()
        self._timer.start()
        return self

    def update(self, n: int = 1) -> None:
        """(Counted by nobody: a log gets two lines, not one per kernel.)"""

    def _say_started(self) -> None:
        cache = ("cold kernel cache" if self._cached == 0
                 else f"{self._cached} in the kernel cache")
        with self._lock:
            if not self._done:
                self._said = True
                _say(f"compiling {self._kernels} kernels of {self._name} ({cache}) ...")

    def __exit__(self, failed, *exc) -> None:
        self._timer.cancel()
        with self._lock:
            self._done = True
            if self._said and failed is None:
                _say(f"compiled {self._kernels} kernels of {self._name} in "
                     f"{time.perf_counter() - self._began:.1f} s ({self._cached} cached)")


def _say(line: str) -> None:
    print(f"purinec: {line}", file=sys.stderr, flush=True)
