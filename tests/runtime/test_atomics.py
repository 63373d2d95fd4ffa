"""The CPU atomics that ranks sharing memory synchronise with (purinec.runtime.atomics),
checked under contention from several processes on one shared mapping."""

import mmap
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from purinec.runtime.atomics import compare_and_swap, fence, fetch_add

PROCESSES, ADDS, ITEMS = 3, 20000, 3000
ROOT = Path(__file__).resolve().parents[2]


def test_single_process_semantics():
    words = np.array([4, 9, 0], np.int64)
    assert compare_and_swap(words, 0, 4, 5) == 4 and words[0] == 5
    assert compare_and_swap(words, 0, 4, 6) == 5 and words[0] == 5  # not expected: kept
    assert fetch_add(words, 1, 3) == 9 and words[1] == 12
    assert fetch_add(words, 2, -2) == 0 and words[2] == -2
    fence()
    with pytest.raises(IndexError):
        fetch_add(words, 3, 1)
    with pytest.raises(IndexError):
        compare_and_swap(words, -1, 0, 1)


def _contend(memory, process: int) -> None:
    words = np.frombuffer(memory, np.int64)
    counter, claims = words[:1], words[1:1 + ITEMS]
    won = words[1 + ITEMS + process * ITEMS:][:ITEMS]
    for i in range(max(ADDS, ITEMS)):
        if i < ADDS:
            fetch_add(counter, 0, 1)
        if i < ITEMS and compare_and_swap(claims, i, 0, process + 1) == 0:
            won[i] = 1


def test_contention_across_processes_is_exact():
    """In a fresh interpreter, which forks the contending processes: forking this one,
    where another module's tests may have started JAX's threads, risks a deadlock."""
    done = subprocess.run([sys.executable, "-c", "from tests.runtime import test_atomics; "
                           "test_atomics.contend()"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def contend() -> None:
    """PROCESSES processes add to one counter and claim items on one shared mapping."""
    memory = mmap.mmap(-1, 8 * (1 + ITEMS + PROCESSES * ITEMS))  # shared with children
    words = np.frombuffer(memory, np.int64)
    fetch_add(words, 0, 0), compare_and_swap(words, 1, 0, 0)  # compiled before forking
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_contend, args=(memory, p)) for p in range(PROCESSES)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    claims = words[1:1 + ITEMS]
    won = words[1 + ITEMS:].reshape(PROCESSES, ITEMS)
    assert words[0] == PROCESSES * ADDS
    # Every item was claimed by exactly one process, the one its word names.
    assert (won.sum(axis=0) == 1).all()
    assert (claims == won.argmax(axis=0) + 1).all()


# A process that readies the atomics, uses them, and says whether Numba got ready to
# compile (its array-math implementations are imported only for that).
READY_CHILD = """
import sys
import numpy as np
from purinec.runtime import atomics
atomics.ready()
words = np.array([4, 9], np.int64)
assert atomics.compare_and_swap(words, 0, 4, 5) == 4 and atomics.fetch_add(words, 1, 3) == 9
atomics.fence()
print(words.tolist(), "numba.np.arraymath" in sys.modules)
"""


def test_a_later_process_loads_the_atomics_without_readying_numba_to_compile(tmp_path):
    """The first process compiles them into Numba's cache (here a fresh one); a later
    one loads them (`purinec.jitcache`), a third of a second sooner."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    runs = [subprocess.run([sys.executable, "-c", READY_CHILD], env=env, text=True,
                           capture_output=True, timeout=300) for _ in range(2)]
    assert [run.returncode for run in runs] == [0, 0], runs[-1].stderr
    assert [run.stdout.split(maxsplit=2)[-1].strip() for run in runs] == ["True", "False"]
    assert all(run.stdout.startswith("[5, 12]") for run in runs)
