"""Execution by counting, as Purine did it.

Each task waits for a number of others. Tasks whose count is zero go to the queue they
name; a worker that finishes a task decrements the counts of its successors and queues
those that reach zero. Counts are reset from the plan at each call; nothing is rebuilt.

Each queue in use gets worker threads (one per copy queue, ``workers`` per compute
queue; Numba kernels release the GIL), started at the first call and kept for the next
ones. With only one lane in use, the calling thread runs the plan's serial order
itself, with no hand-offs between threads.

A task that raises stops the run: the failure is recorded, no worker takes another task
of that run, the caller wakes at once, closes the workers and joins them (so no thread
is left behind; waits poll with timeouts), and raises an error naming the IR node. The
next call starts new workers.
"""

from __future__ import annotations

import queue
import random
import threading
import weakref
from time import perf_counter
from typing import Callable, Mapping, Sequence

import numpy as np

from purinec.errors import ExecutionError, PurinecError
from purinec.ir.graph import Graph, Node, Value
from purinec.runtime.devices import COMPUTE, Lane
from purinec.runtime.memory import may_alias
from purinec.runtime.plan import Plan
from purinec.runtime.trace import Trace

# How often idle workers and the waiting caller look up from their queues, in seconds:
# only a safety net, since finishing or failing wakes the caller at once and closing the
# workers wakes them.
POLL = 0.1


class Executable:
    """A graph compiled to tasks: ``exe(env) -> outputs`` (the contract's executable).

    ``kernels`` maps every node to a callable ``fn(*inputs, *outputs)`` (reshape nodes
    are views and need none; see `purinec.runtime.plan.reference_kernels` for a fallback).
    ``schedule`` is the order memory is planned for (default: graph order);
    ``may_alias(node, output, input)`` says whether a kernel may write an output over an
    input (default: elementwise ops, and single elementwise members of fused nodes);
    ``workers`` is the number of threads per compute queue; ``trace`` records every task.
    ``order``, a random.Random, is a test hook: run every task on the calling thread,
    picking each next one at random among those ready, to check the plan is correct under
    any order its counts allow.
    """

    def __init__(self, graph: Graph, kernels: Mapping[Node, Callable],
                 schedule: Sequence[Node] | None = None,
                 may_alias: Callable[[Node, Value, Value], bool] = may_alias, workers: int = 1,
                 trace: Trace | None = None, order: random.Random | None = None):
        self.graph = graph
        self.plan = Plan(graph, kernels, schedule, may_alias)
        self.executor = CountingExecutor(self.plan, workers)
        self.trace = trace
        self.order = order
        self._busy = threading.Lock()

    def __call__(self, env: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self._busy.acquire(blocking=False):
            raise ExecutionError(f"graph {self.graph.name} is already running; an executable "
                                 "runs one call at a time")
        try:
            self.plan.bind(env)
            try:
                self.executor.run(self.trace, self.order)
                return self.plan.outputs(env)
            finally:
                self.plan.unbind()
        finally:
            self._busy.release()

    def close(self) -> None:
        """Stop the worker threads now (they also stop when the executable is dropped)."""
        self.executor.close()


class CountingExecutor:
    """Runs a plan's tasks by dependency counting; reusable across calls."""

    def __init__(self, plan: Plan, workers: int = 1):
        if workers < 1:
            raise PurinecError(f"workers per compute queue must be at least 1, got {workers}")
        self.tasks = plan.tasks
        self._fns = [task.fn for task in plan.tasks]
        self._args = [task.args for task in plan.tasks]
        self._successors = [task.successors for task in plan.tasks]
        self._initial = list(plan.initial_counts)
        self._counts = list(plan.initial_counts)
        self._roots = plan.roots
        self._queue_of = [plan.queues.index(task.queue) for task in plan.tasks]
        self._home_lane = [Lane(task.queue) for task in plan.tasks]
        self._serial = list(zip(self._fns, self._args))
        # What worker threads need: plain lists, no reference back to this executor.
        self._program = (self.tasks, self._fns, self._args, self._successors,
                         self._queue_of, self._counts)
        self._pool: _Pool | None = None
        self._close_pool_on_collect: weakref.finalize | None = None
        self.queue_workers = [workers if q.kind == COMPUTE else 1 for q in plan.queues]
        self.lanes = [(Lane(q, w), i) for i, q in enumerate(plan.queues)
                      for w in range(self.queue_workers[i])]
        self.inline = len(self.lanes) <= 1

    def run(self, trace: Trace | None = None, order: random.Random | None = None) -> None:
        if trace is not None:
            trace.begin_call()
        if order is not None:
            self._run_in_random_order(order, trace)
        elif self.inline:
            self._run_inline(trace)
        else:
            self._run_threaded(trace)

    def _failure(self, index: int, err: BaseException) -> ExecutionError:
        return ExecutionError(f"{self.tasks[index].describe()} failed: "
                              f"{type(err).__name__}: {err}")

    def _run_traced(self, index: int, lane: Lane, trace: Trace) -> None:
        start = perf_counter()
        self._fns[index](*self._args[index])
        trace.record(self.tasks[index], lane, start, perf_counter())

    # -- one lane: the calling thread runs the serial order ---------------------------

    def _run_inline(self, trace: Trace | None) -> None:
        index = 0
        try:
            if trace is None:
                for index, (fn, args) in enumerate(self._serial):
                    fn(*args)
            else:
                for index in range(len(self._serial)):
                    self._run_traced(index, self._home_lane[index], trace)
        except Exception as err:
            raise self._failure(index, err) from err

    def _run_in_random_order(self, rng: random.Random, trace: Trace | None) -> None:
        counts, successors = self._counts, self._successors
        counts[:] = self._initial
        ready = list(self._roots)
        done = 0
        while ready:
            pick = rng.randrange(len(ready))
            ready[pick], ready[-1] = ready[-1], ready[pick]
            index = ready.pop()
            try:
                if trace is None:
                    self._fns[index](*self._args[index])
                else:
                    self._run_traced(index, self._home_lane[index], trace)
            except Exception as err:
                raise self._failure(index, err) from err
            done += 1
            for s in successors[index]:
                counts[s] -= 1
                if counts[s] == 0:
                    ready.append(s)
        assert done == len(self.tasks), "dependency counts never reached zero"

    # -- several lanes: a worker thread each ------------------------------------------

    def _run_threaded(self, trace: Trace | None) -> None:
        if self._pool is None:
            self._pool = _Pool(self.lanes, self.queue_workers, self._program)
            self._close_pool_on_collect = weakref.finalize(self, self._pool.close, False)
        pool = self._pool
        self._counts[:] = self._initial
        run = pool.run = _Run(len(self.tasks), trace)
        for index in self._roots:
            pool.inboxes[self._queue_of[index]].put(index)
        clean = False
        try:
            while not run.finished.wait(POLL):
                if not all(thread.is_alive() for thread in pool.threads):
                    raise ExecutionError("a worker thread of the runtime died")
            clean = run.failure is None
        finally:
            pool.run = None
            if not clean:  # failed or interrupted: stop and join every worker
                run.stop = True
                self.close()
        if run.failure is not None:
            index, err = run.failure
            raise self._failure(index, err) from err

    def close(self) -> None:
        """Stop the worker threads and wait for them; a later call starts new ones."""
        if self._pool is not None:
            self._close_pool_on_collect.detach()
            self._pool.close(join=True)
            self._pool = None


class _Run:
    """What the workers share during one threaded call."""

    def __init__(self, tasks: int, trace: Trace | None):
        self.lock = threading.Lock()
        self.remaining = tasks
        self.trace = trace
        self.stop = False
        self.failure: tuple[int, BaseException] | None = None
        self.finished = threading.Event()

    def fail(self, index: int, err: BaseException) -> None:
        with self.lock:
            if self.failure is None:
                self.failure = (index, err)
            self.stop = True
        self.finished.set()


class _Pool:
    """Worker threads serving a plan's queues, kept between calls. They hold no
    reference to the executor, so dropping it closes them (weakref.finalize)."""

    def __init__(self, lanes: list[tuple[Lane, int]], queue_workers: list[int], program):
        self.inboxes = [queue.SimpleQueue() for _ in queue_workers]
        self.queue_workers = queue_workers
        self.run: _Run | None = None
        self.closed = False
        self.threads = [threading.Thread(target=_serve, args=(self, lane, self.inboxes[q],
                                                              program),
                                         name=f"purinec {lane}", daemon=True)
                        for lane, q in lanes]
        try:
            for thread in self.threads:
                thread.start()
        except BaseException:
            self.close(join=True)
            raise

    def close(self, join: bool) -> None:
        self.closed = True
        for inbox, workers in zip(self.inboxes, self.queue_workers):
            for _ in range(workers):
                inbox.put(None)
        if join:
            for thread in self.threads:
                if thread.ident is not None and thread is not threading.current_thread():
                    thread.join()


def _serve(pool: _Pool, lane: Lane, inbox: queue.SimpleQueue, program) -> None:
    """A worker: run tasks from ``inbox``, release their successors, until closed."""
    tasks, fns, args, successors, queue_of, counts = program
    inboxes = pool.inboxes
    while not pool.closed:
        try:
            index = inbox.get(timeout=POLL)
        except queue.Empty:
            continue
        if index is None:
            return
        run = pool.run
        if run is None or run.stop:
            continue  # the run stopped: take no more of its tasks
        try:
            if run.trace is None:
                fns[index](*args[index])
            else:
                start = perf_counter()
                fns[index](*args[index])
                run.trace.record(tasks[index], lane, start, perf_counter())
        except BaseException as err:  # any failure stops the run; the caller raises it
            run.fail(index, err)
            continue
        with run.lock:
            for s in successors[index]:
                counts[s] -= 1
                if counts[s] == 0:
                    inboxes[queue_of[s]].put(s)
            run.remaining -= 1
            if run.remaining == 0:
                run.finished.set()
