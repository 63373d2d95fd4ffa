"""The team of helper threads that run blocked kernels' blocks (`cpu_runtime.run_blocks`),
with kernels written the way `KernelModule.builder` writes them."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time

import numpy as np
import pytest
from numba import njit

from purinec.codegen import cpu_runtime
from purinec.codegen.cpu_runtime import (Blocked, available_cpus, get_threads, hold_team,
                                         run_blocks, set_threads)

pytestmark = pytest.mark.skipif(cpu_runtime.team_address() == 0,
                                reason="no team here: blocked kernels run on their caller")


@njit(nogil=True)
def _cover(lo, hi, team, threads, hits, blocks):
    if run_blocks(team, threads, lo, hi, (hits, blocks)):
        return
    for i in range(lo, hi):
        hits[i] += 1
        blocks[i, 0], blocks[i, 1] = lo, hi


@njit(nogil=True)
def _fail_from(lo, hi, team, threads, first_failing, hits):
    if run_blocks(team, threads, lo, hi, (first_failing, hits)):
        return
    if lo >= first_failing[0]:
        raise ValueError("this block fails")
    for i in range(lo, hi):
        hits[i] += 1


@njit(nogil=True)
def _meet(lo, hi, team, threads, flags, met):
    """Each block raises its flag, then waits (a while, not forever) for every other
    block's: only blocks that run at the same time all meet. (A while: seconds, not the
    tenth of a second a busy machine may take to give a woken helper a core.)"""
    if run_blocks(team, threads, lo, hi, (flags, met)):
        return
    address = flags.ctypes.data
    cpu_runtime._store(address, lo, 1)
    for _ in range(5_000_000_000):
        everyone = 1
        for other in range(flags.size):
            everyone &= cpu_runtime._load(address, other)
        if everyone:
            met[lo] = 1
            break


@contextlib.contextmanager
def _threads(count):
    """Kernels called in the block run on ``count`` threads."""
    before = get_threads()
    set_threads(count)
    try:
        yield
    finally:
        set_threads(before)


def _cover_all(count, threads):
    hits, blocks = np.zeros(count, np.int64), np.zeros((count, 2), np.int64)
    with _threads(threads):
        Blocked(_cover, count)(hits, blocks)
    return hits, sorted(set(map(tuple, blocks.tolist())))


def test_blocks_cover_the_items_once_on_the_threads_allowed():
    hits, blocks = _cover_all(10, 3)  # more blocks than helpers: the caller runs the rest
    assert hits.tolist() == [1] * 10 and blocks == [(0, 3), (3, 6), (6, 10)]
    hits, blocks = _cover_all(10, 1)
    assert hits.tolist() == [1] * 10 and blocks == [(0, 10)]
    hits, blocks = _cover_all(2, 5)  # never more blocks than items
    assert hits.tolist() == [1, 1] and blocks == [(0, 1), (1, 2)]


@pytest.mark.skipif(available_cpus() < 2, reason="needs a helper thread beside the caller")
def test_blocks_run_side_by_side_on_the_helpers():
    flags, met = np.zeros(2, np.int64), np.zeros(2, np.int64)
    # Held, as a program holds it: else collecting a program an earlier test dropped
    # (at any allocation, this call's own included) could stop the team under the call.
    let_go = hold_team()
    try:
        with _threads(2):
            Blocked(_meet, 2)(flags, met)
    finally:
        let_go()
    assert met.tolist() == [1, 1]


def test_each_block_is_claimed_once_whoever_comes_first():
    """The caller and its helpers claim blocks from one counter, and a helper called off
    before it started (every block done) is not waited for: thousands of calls of a few
    items, the helpers often asleep or still waking, each item computed once, none lost,
    every call returning."""
    let_go = hold_team()
    try:
        with _threads(max(2, available_cpus())):
            for count in [2, 3, 7, 64] * 1000:
                hits, blocks = np.zeros(count, np.int64), np.zeros((count, 2), np.int64)
                Blocked(_cover, count)(hits, blocks)
                assert hits.tolist() == [1] * count
    finally:
        let_go()


@pytest.mark.parametrize("first_failing", [0, 3])  # block 0 (on the caller), block 1
def test_a_failed_block_on_any_thread_reaches_the_caller_and_frees_the_helpers(first_failing):
    hits = np.zeros(9, np.int64)
    with _threads(3), pytest.raises(RuntimeError,
                                    match="a block of this kernel failed on another"):
        Blocked(_fail_from, 9)(np.array([first_failing]), hits)
    assert hits.tolist() == [1] * first_failing + [0] * (9 - first_failing)
    hits, blocks = _cover_all(10, 3)  # the helpers are free again
    assert hits.tolist() == [1] * 10


def test_the_last_holder_stops_the_helpers_and_a_later_kernel_starts_them():
    def helpers():
        return {t for t in threading.enumerate() if t.name.startswith("purinec-kernel")}

    gc.collect()  # programs earlier tests in this process dropped let go of the team
    assert cpu_runtime._holders == 0, "a program of an earlier test still holds the team"
    let_go = hold_team()
    _cover_all(4, 2)
    assert len(helpers()) == min(available_cpus(), 64) - 1
    let_go()
    assert not helpers()
    hits, _ = _cover_all(4, 2)
    assert hits.tolist() == [1] * 4 and helpers()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_its_own_helpers():
    _cover_all(4, 2)  # the parent's team is running
    child = os.fork()
    if child == 0:  # the helpers did not come along: waiting for them would hang
        try:
            hits, blocks = _cover_all(10, 2)
            os._exit(0 if hits.tolist() == [1] * 10 and len(blocks) == 2 else 1)
        finally:
            os._exit(2)
    for _ in range(600):  # a child left waiting for the parent's helpers would hang
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        pytest.fail("the forked child hung running a blocked kernel")
    assert os.waitstatus_to_exitcode(status) == 0
