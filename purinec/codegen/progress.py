"""Whether compiling kernels draws a progress bar. A cold compile of a big model takes
minutes (a few hundred kernels) and a warm one about a second, so the command line turns
the bar on for a terminal (`kernel_progress`) and the bar shows only after a second."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

_shown = contextvars.ContextVar("purinec_kernel_progress", default=False)


@contextlib.contextmanager
def kernel_progress(show: bool = True) -> Iterator[None]:
    """Within this block, `compile_kernels` draws a progress bar on stderr when ``show``."""
    token = _shown.set(show)
    try:
        yield
    finally:
        _shown.reset(token)


def kernel_bar(total: int, name: str):
    """A tqdm bar over ``total`` kernels of graph ``name``; disabled unless a
    `kernel_progress` block turned bars on."""
    from tqdm import tqdm

    return tqdm(total=total, desc=f"kernels of {name}", unit="kernel", delay=1.0,
                leave=False, disable=not _shown.get())
