"""Compile helpers: other processes that compile a graph's kernels alongside this one.

Numba compiles one function at a time per process (it holds a global compiler lock),
and a cold compile of a model is mostly Numba: lenet's training iteration, 27 kernels,
takes 11.5 s in one process on a 2-core machine, 6.7 s with a helper. So
`compile_kernels` starts helper processes (``python -m purinec.codegen.compile_helpers``)
when several kernels are not in Numba's disk cache yet, and hands them the list. Every
process walks the list in order and takes the next kernel nobody is compiling
(`cache.one_compiler` without waiting); a helper compiles it into Numba's disk cache,
the compiling process for its own use. A kernel that links a C function another
process is compiling now (`compiling_elsewhere`) would wait for it: it is taken after
the others. The compiling process then waits for the kernels a helper held
and loads them from the cache.

Helpers only ever save time: one that fails, dies or is slow to start leaves its
kernels to the compiling process (the operating system releases a dead process's
lock), and every helper is gone when `compile_kernels` returns. The ranks of an MPI job
on one machine share their kernels the same way without helpers of their own, unless
each rank has cores to spare. Without POSIX file locks (`fcntl`) there are no helpers.
A process imports Numba's compiler parts with SciPy's linear algebra hidden
(`start_numba_without_scipy`) before it compiles.

``$PURINEC_COMPILE_JOBS`` bounds the processes that compile at once (this one
included; 1: no helpers); the default is the cores this process may use, at most
`MAX_JOBS`.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from numba import types
from numba.np.numpy_support import from_dtype

from purinec.codegen import cache
from purinec.codegen.cpu_runtime import NUMPY_BLAS, process_cpus

log = logging.getLogger(__name__)

JOBS_VAR = "PURINEC_COMPILE_JOBS"
MAX_JOBS = 8  # each helper holds its own Numba and LLVM, ~150 MB
# Fewer kernels to compile than this and a helper's start (~0.5 s of a core) costs
# about what it saves.
MIN_KERNELS = 3


@dataclass(frozen=True)
class Job:
    """One kernel to compile: its module's source and entry function, and the
    function's arguments as (NumPy dtype name, rank) of C-contiguous arrays, after two
    ``intp`` block bounds when ``blocked``."""

    source: str
    function: str
    arrays: tuple[tuple[str, int], ...]
    blocked: bool
    links: tuple[str, ...] = ()  # the C functions it links (`cpu_gemm.linked`)

    def signature(self) -> tuple:
        arrays = tuple(types.Array(from_dtype(np.dtype(dtype)), rank, "C")
                       for dtype, rank in self.arrays)
        return (types.intp,) * 4 + arrays if self.blocked else arrays  # lo, hi, team, threads

    def compiled_on_disk(self) -> bool:
        return cache.compiled_on_disk(self.source, self.function)

    def key(self) -> tuple[str, str]:
        """As `cache.compiled_functions` names it."""
        return cache.kernel_path(self.source).stem, self.function


def compile_jobs() -> int:
    """How many processes may compile kernels at once, this one included."""
    configured = os.environ.get(JOBS_VAR)
    if configured:
        try:
            return max(1, int(configured))
        except ValueError:
            log.warning("%s=%r is not a count; compiling without helpers", JOBS_VAR,
                        configured)
            return 1
    return min(MAX_JOBS, process_cpus())


@contextlib.contextmanager
def helping(todo: Sequence[Job]) -> Iterator[None]:
    """Within this block, helper processes compile ``todo`` (jobs not in Numba's disk
    cache: `uncompiled`) alongside this process, when there are enough of them and
    cores to spare."""
    # Processes share the work through the kernels' lock files (POSIX only).
    worth_it = len(todo) >= MIN_KERNELS and cache.fcntl is not None
    count = min(compile_jobs(), len(todo)) - 1 if worth_it else 0
    if count <= 0:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="purinec-compile-") as folder:
        listing = Path(folder) / "jobs.json"
        listing.write_text(json.dumps([[job.source, job.function, job.arrays, job.blocked,
                                        job.links] for job in todo]))
        helpers = [helper for helper in (_start(listing) for _ in range(count)) if helper]
        log.debug("%d compile helper(s) for %d kernels", len(helpers), len(todo))
        try:
            yield
        finally:
            # This process holds every kernel it needed by now (or is failing): what a
            # helper still does is skip kernels that are done.
            for helper in helpers:
                helper.kill()
                helper.wait()


def uncompiled(jobs: Sequence[Job]) -> list[Job]:
    """Those of ``jobs`` that Numba's disk cache does not hold yet."""
    compiled = cache.compiled_functions()
    return [job for job in jobs if job.key() not in compiled]


def _start(listing: Path) -> subprocess.Popen | None:
    """A helper process working through the jobs ``listing`` names, or None if it
    cannot start."""
    # Helpers use the cache this process uses, wherever that is now.
    env = {**os.environ, cache.ENV_VAR: str(cache.cache_dir())}
    try:
        return subprocess.Popen([sys.executable, "-m", __name__, str(listing)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env)
    except OSError as err:
        log.debug("no compile helper: %s", err)
        return None


def compiling_elsewhere(links: Sequence[str]) -> bool:
    """Whether another process is compiling one of the C functions ``links`` names
    (holding its lock: `purinec.codegen.cpu_gemm`'s): a kernel that links it would wait
    for it. Compiling processes take such kernels after the others: a cold compile's
    helper had sat out the GEMM's 1.8 s."""
    for symbol in links:
        with cache.one_compiler(symbol, wait=False) as free:
            if not free:
                return True
    return False


def work_through(jobs: Sequence[Job]) -> None:
    """A helper's work: compile, into Numba's disk cache, each job nobody else has
    compiled or is compiling; those that link a C function another process is
    compiling now (`compiling_elsewhere`) after the others."""
    later = []
    for job in jobs:
        if compiling_elsewhere(job.links):
            later.append(job)
        else:
            _take(job)
    for job in later:
        _take(job)


def _take(job: Job) -> None:
    """Compile ``job`` into Numba's disk cache unless it is there or another process is
    compiling it. A job that fails is left to the compiling process, which reports it."""
    if job.compiled_on_disk():
        return
    with cache.one_compiler(job.source, wait=False) as mine:
        if not mine or job.compiled_on_disk():
            return
        try:
            getattr(cache.load_module(job.source), job.function).compile(job.signature())
        except Exception as err:  # noqa: BLE001  (the compiling process reports it)
            log.debug("helper: %s failed: %s", job.function, err)


class _HideSciPyLinalg(importlib.abc.MetaPathFinder):
    """Makes ``scipy.linalg`` unimportable for one thread, while it is on sys.meta_path."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()

    def find_spec(self, name, path, target=None):
        if name.startswith("scipy.linalg") and threading.get_ident() == self.thread:
            raise ModuleNotFoundError(f"{name} is hidden while Numba starts", name=name)
        return None


def start_numba_without_scipy() -> None:
    """Import Numba's array-math implementations now, with SciPy's linear algebra hidden.

    Numba imports them before it compiles its first function, and with them SciPy's
    BLAS, only to tell whether ``np.correlate`` may use it: a third of a second. Kernels
    call BLAS through `cpu_runtime` instead, and ``np.dot`` and ``np.linalg`` keep
    working (Numba imports SciPy when it compiles them). Nothing is hidden when SciPy's
    BLAS is needed anyway (``NUMPY_BLAS`` is None) or was imported already. Loading
    cached kernels (`purinec.jitcache`) needs none of this."""
    started = "numba.np.arraymath" in sys.modules
    if started or NUMPY_BLAS is None or "scipy.linalg" in sys.modules:
        return
    finder = _HideSciPyLinalg()
    sys.meta_path.insert(0, finder)
    try:
        import numba.np.arraymath  # noqa: F401
    finally:
        sys.meta_path.remove(finder)


def main(listing: str) -> None:
    start_numba_without_scipy()  # as the compiling process does: 0.3 s sooner at work
    jobs = [Job(source, function, tuple(map(tuple, arrays)), blocked, tuple(links))
            for source, function, arrays, blocked, links
            in json.loads(Path(listing).read_text())]
    work_through(jobs)


if __name__ == "__main__":
    main(sys.argv[1])
