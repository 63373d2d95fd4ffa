"""How pytest-xdist shares the tests out (``pytest -n auto``, as the README runs them).

Each test module runs whole on one worker, so a module's fixtures (some compile whole
models, or run the CUDA simulator for minutes) are built once. The modules that start
MPI jobs (`MPI_MODULES`) all run on one worker, one after another: some check the
jobs' shared memory (``/dev/shm``), and two jobs at once would see each other's.

Memory is overwritten as it is freed (`perturb_freed_memory`), in every test process.
"""

from __future__ import annotations

import ctypes
import os
import sys

import pytest

PERTURB = 0xA5  # the byte glibc fills freed memory with (its M_PERTURB option)
M_PERTURB = -6


def perturb_freed_memory() -> None:
    """Freed memory overwritten with `PERTURB` (glibc's ``M_PERTURB``), in this process
    and in those the tests start (mpiexec's ranks, the command's runs): code reading
    memory it freed fails in every run, where otherwise it fails now and then, when
    another thread has reused the memory (a generated kernel whose scratch array Numba
    freed before a call read it crashed a CI run)."""
    os.environ.setdefault("MALLOC_PERTURB_", str(PERTURB))
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None) if sys.platform == "linux" else None
    if mallopt is not None:
        mallopt(M_PERTURB, PERTURB)


perturb_freed_memory()

# Every module with a test marked ``mpi``; collection refuses one that is not listed.
MPI_MODULES = ("tests/on_cuda/test_simulator.py", "tests/runtime/test_mpi.py",
               "tests/test_benchmarks.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    unlisted = sorted({item.nodeid.split("::")[0] for item in items
                       if item.get_closest_marker("mpi")} - set(MPI_MODULES))
    if unlisted:
        raise pytest.UsageError(f"tests/conftest.py: add {', '.join(unlisted)} to "
                                f"MPI_MODULES (its tests start MPI jobs)")


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # without pytest-xdist the tests run in this one process
    pass
else:
    class ModuleScheduling(LoadScopeScheduling):
        """Work units of whole modules; the MPI modules are one unit."""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "MPI jobs" if module in MPI_MODULES else module

    def pytest_xdist_make_scheduler(config, log):
        return ModuleScheduling(config, log)
