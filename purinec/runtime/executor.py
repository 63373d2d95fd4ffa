"""Execution by counting, as Purine did it.

Each task waits for a number of others. Tasks whose count is zero go to the queue they
name; a worker that finishes a task decrements the counts of its successors and queues
those that reach zero. Counts are reset from the plan at each call; nothing is rebuilt.

Each queue in use gets worker threads (one per copy queue, ``workers`` per compute
queue; Numba kernels release the GIL), started at the first call and kept for the next
ones. With only one lane in use, the calling thread runs the plan's serial order
itself, with no hand-offs between threads; with one compute lane and the comm queue (an
MPI rank with one device), the calling thread counts and runs both (`_OneThread`).

A task's callable either finishes its work and returns None, or (a collective posted to
MPI) returns a `Pending` whose ``test()`` says, without blocking, whether it is done.
Tasks of the ``comm`` queues are posted in plan order, since every rank must issue
collectives in the same order (one worker serves all the comm queues of a plan, so the
order holds across devices too); an MPI post is made by the thread that makes the task
ready. The comm worker polls the pending operations, releasing a task's successors
when its operation completes; it never blocks on one operation while another could be
posted. While operations are pending, compute workers nudge them along between tasks
(MPI progresses only when called), so the comm worker can look up rarely while they
are busy, and is woken as soon as one goes idle. Elsewhere (other queues, the inline
path) a returned Pending is polled until complete before the next task.

A task that raises stops the run: the failure is recorded, no worker takes another task
of that run, the caller wakes at once, closes the workers and joins them (so no thread
is left behind; waits poll with timeouts), and raises an error naming the IR node. The
next call starts new workers.
"""

from __future__ import annotations

import heapq
import itertools
import os
import queue
import random
import threading
import time
import weakref
from time import perf_counter
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from purinec.errors import ExecutionError, PurinecError
from purinec.ir.graph import Graph, Node, Value
from purinec.runtime import comm
from purinec.runtime.devices import COMM, COMPUTE, Lane
from purinec.runtime.memory import may_alias
from purinec.runtime.plan import Plan
from purinec.runtime.trace import Trace

# How often idle workers and the waiting caller look up from their queues, in seconds:
# only a safety net, since finishing or failing wakes the caller at once and closing the
# workers wakes them.
POLL = 0.1

# How pending operations are polled. MPI progresses a collective only while a process
# calls into it, and each takes a few rounds between the ranks, so the first polls only
# yield the core (SPIN of them); then the pause doubles from MIN up to MAX while nothing
# changes, so a long wait does not keep a core busy (these machines have two).
PENDING_SPIN = 50
PENDING_POLL_MIN = 1e-5
PENDING_POLL_MAX = 2e-4
# While every compute worker is busy, the comm worker looks up this rarely: each wake-up
# of a thread costs tens of microseconds of the core compute is using, the compute
# workers nudge MPI's progress between their tasks (`Pending.nudge`), and a compute
# worker about to go idle wakes the comm worker at once (WAKE). The one-thread loop
# likewise tests pending operations between busy tasks only this often: each test
# after a kernel runs with cold caches (tens of microseconds of Python), and an
# operation in shared memory needs no help from a busy rank (`Pending.help`: an idle
# one does the work); lenet over 2 ranks measured 2-5% faster than testing after every
# task.
BUSY_POLL = 2e-3
WAKE = -2  # put in the comm inbox: poll now, and quickly until compute is busy again


def _pauses():
    """The pauses between polls of a pending operation, in seconds."""
    yield from [0.0] * PENDING_SPIN
    pause = PENDING_POLL_MIN
    while True:
        yield pause
        pause = min(2 * pause, PENDING_POLL_MAX)


class Pending(Protocol):
    """An operation a task started and that finishes later (an MPI collective)."""

    def test(self) -> bool:
        """True once the operation is complete and its outputs are written; never blocks."""

    def wait(self) -> None:
        """Block until the operation is complete and its outputs are written."""

    # Optionally, ``nudge``: a thread-safe callable that advances every posted operation
    # of its kind a step without completing any (MPI: a pass of its progress engine), for
    # the compute workers to call between tasks; and ``help()``: `test`, but also doing
    # other processes' share of the work where it can (shared memory), for a runtime
    # with nothing else to do.


def _test(pending: Pending, idle: bool) -> bool:
    """Test ``pending``; one whose runtime is ``idle`` helps where it can."""
    if idle:
        help = getattr(pending, "help", None)
        if help is not None:
            return help()
    return pending.test()


# A comm kernel with a true ``asynchronous`` attribute only posts its operation and
# returns a Pending: the thread that makes its task ready posts it. Any other (an
# in-process sum and its copies) does its work when called, so it runs on the comm
# worker's thread rather than take the time of the compute worker that released it.


def kernel_message(err: BaseException) -> str:
    """What ``err`` says. A generated kernel raises with its values as further arguments
    (Numba cannot format strings): ``ValueError("label", 5, "at row", 2, ...)`` reads
    "label 5 at row 2 ..."."""
    if len(err.args) > 1:
        return " ".join(map(str, err.args))
    return str(err)


class Executable:
    """A graph compiled to tasks: ``exe(env) -> outputs`` (the contract's executable).

    ``kernels`` maps every node to a callable ``fn(*inputs, *outputs)`` (reshape nodes
    are views and need none; see `purinec.runtime.plan.reference_kernels` for a fallback).
    ``schedule`` is the order memory is planned for (default: graph order);
    ``may_alias(node, output, input)`` says whether a kernel may write an output over an
    input (default: elementwise ops, and single elementwise members of fused nodes);
    ``workers`` is the number of threads per compute queue; ``trace`` records every task.
    ``worker_init(lane)`` runs once in each worker thread as it starts (and on the calling
    thread at each inline run), e.g. to give each device its share of cores.
    ``arenas`` allocates the memory planner's arenas (default: the process's memory;
    a target's own, `purinec.targets.base.Target.arenas`).
    ``hold()`` takes what the kernels share with other executables (a target's thread
    pool; `purinec.targets.base.Target.hold`) as a call starts, returning how to let go
    of it, which `close` does.
    ``prepare(plan)`` adapts the plan's tasks to the target's devices before anything
    runs (the cuda target puts them on streams; `purinec.runtime.gpu.order_streams`).
    ``order``, a random.Random, is a test hook: run every task on the calling thread,
    picking each next one at random among those ready, to check the plan is correct under
    any order its counts allow.
    A call keeps no reference to the caller's arrays but those of parameters and state,
    which stay bound (unchecked while the caller passes the same arrays: `Plan.bind`)
    until the next call passes others or `close`.
    """

    def __init__(self, graph: Graph, kernels: Mapping[Node, Callable],
                 schedule: Sequence[Node] | None = None,
                 may_alias: Callable[[Node, Value, Value], bool] = may_alias, workers: int = 1,
                 trace: Trace | None = None, order: random.Random | None = None,
                 worker_init: Callable[[Lane], None] | None = None, arenas=None,
                 hold: Callable[[], Callable[[], None]] | None = None,
                 prepare: Callable[[Plan], None] | None = None):
        if trace is not None and not isinstance(trace, Trace):
            raise PurinecError(f"trace={trace!r}: give a purinec.runtime.trace.Trace, or "
                               f"None")
        self.graph = graph
        self.plan = Plan(graph, kernels, schedule, may_alias, arenas)
        if prepare is not None:
            prepare(self.plan)
        self.executor = CountingExecutor(self.plan, workers, worker_init)
        self.trace = trace
        self.order = order
        # One call at a time (a call owns the plan's memory): calls from other threads
        # wait their turn. A call from inside a call would wait for itself.
        self._busy = threading.Lock()
        self._caller: int | None = None
        self._ran = False
        self._hold = hold
        self._held: weakref.finalize | None = None  # lets go when called, or if dropped

    def __call__(self, env: Mapping[str, np.ndarray],
                 runner: Callable[[Plan], None] | None = None) -> dict[str, np.ndarray]:
        """Run the graph on ``env``; ``runner(plan)``, if given, runs the bound plan's
        tasks instead of the counting executor (a CUDA graph's replay:
        `purinec.runtime.gpu.CapturedStep`)."""
        if self._caller == threading.get_ident():
            raise ExecutionError(f"graph {self.graph.name} is already running on this "
                                 "thread: a kernel cannot run the graph it belongs to")
        with self._busy:
            self._caller = threading.get_ident()
            try:
                return self._call(env, runner)
            finally:
                self._caller = None

    def _call(self, env: Mapping[str, np.ndarray],
              runner: Callable[[Plan], None] | None) -> dict[str, np.ndarray]:
        if not self._ran:
            self._ran = True
            comm.check_injected_failure()
        if self._hold is not None and not (self._held and self._held.alive):
            self._held = weakref.finalize(self, self._hold())
        self.plan.bind(env)
        try:
            if runner is None:
                self.executor.run(self.trace, self.order)
            else:
                runner(self.plan)
            return self.plan.outputs(env)
        finally:
            self.plan.unbind()

    def close(self) -> None:
        """Stop the worker threads now (they also stop when the executable is dropped)
        and give back the memory the plan can (`Plan.release`); a later call still
        works. A call under way on another thread finishes first."""
        with self._busy:
            self.executor.close()
            self.plan.release()
            if self._held is not None:
                self._held()


class CountingExecutor:
    """Runs a plan's tasks by dependency counting; reusable across calls."""

    def __init__(self, plan: Plan, workers: int = 1,
                 worker_init: Callable[[Lane], None] | None = None):
        if workers < 1:
            raise PurinecError(f"workers per compute queue must be at least 1, got {workers}")
        self.tasks = plan.tasks
        self._fns = [task.fn for task in plan.tasks]
        self._args = [task.args for task in plan.tasks]
        self._successors = [task.successors for task in plan.tasks]
        self._initial = list(plan.initial_counts)
        self._counts = list(plan.initial_counts)
        self._roots = plan.roots
        # Which inbox each task goes to: its queue's, except that every comm queue shares
        # the first one's, whose single worker posts all collectives of the plan in plan
        # order (two workers would post collectives on one communicator in either order).
        inbox = list(range(len(plan.queues)))
        comm_queues = [i for i, q in enumerate(plan.queues) if q.kind == COMM]
        for i in comm_queues:
            inbox[i] = comm_queues[0]
        self._queue_of = [inbox[plan.queues.index(task.queue)] for task in plan.tasks]
        self._home_lane = [Lane(task.queue) for task in plan.tasks]
        self._serial = list(zip(self._fns, self._args))
        self._worker_init = worker_init
        # What worker threads need: plain lists, no reference back to this executor.
        self._program = (self.tasks, self._fns, self._args, self._successors,
                         self._queue_of, self._counts)
        self._pool: _Pool | None = None
        self._close_pool_on_collect: weakref.finalize | None = None
        self.queue_workers = [workers if q.kind == COMPUTE else int(inbox[i] == i)
                              for i, q in enumerate(plan.queues)]
        self.lanes = [(Lane(q, w), i) for i, q in enumerate(plan.queues)
                      for w in range(self.queue_workers[i])]
        self.inline = len(self.lanes) <= 1
        # Only a comm queue's tasks may return a Pending: the inline loop checks for one
        # only then, so a plan of kernels keeps its tightest loop.
        self._may_pend = any(q.kind == COMM for q in plan.queues)
        # One compute lane and the comm queue (an MPI rank with one device): the calling
        # thread runs both, with no hand-offs between threads (see _run_one_thread).
        self.one_thread = (sorted(lane.queue.kind for lane, _ in self.lanes) ==
                           sorted([COMPUTE, COMM]))
        self._comm_order = [i for i, q in enumerate(self._queue_of)
                            if comm_queues and q == comm_queues[0]]

    def run(self, trace: Trace | None = None, order: random.Random | None = None) -> None:
        if trace is not None:
            trace.begin_call()
        if order is not None:
            self._run_in_random_order(order, trace)
        elif self.inline:
            self._run_inline(trace)
        elif self.one_thread:
            self._run_one_thread(trace)
        else:
            self._run_threaded(trace)

    def _failure(self, index: int, err: BaseException) -> ExecutionError:
        return ExecutionError(f"{self.tasks[index].describe()} failed: "
                              f"{type(err).__name__}: {kernel_message(err)}")

    def _run_task(self, index: int) -> None:
        """Run a task on the calling thread to completion."""
        pending = self._fns[index](*self._args[index])
        if pending is not None:
            _wait(pending)

    def _run_traced(self, index: int, lane: Lane, trace: Trace) -> None:
        start = perf_counter()
        self._run_task(index)
        trace.record(self.tasks[index], lane, start, perf_counter())

    # -- one lane: the calling thread runs the serial order ---------------------------

    def _run_inline(self, trace: Trace | None) -> None:
        index = 0
        try:
            if self._worker_init is not None and self.lanes:
                self._worker_init(self.lanes[0][0])
            if trace is None and not self._may_pend:
                for index, (fn, args) in enumerate(self._serial):
                    fn(*args)
            elif trace is None:
                for index in range(len(self._serial)):
                    self._run_task(index)
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
                    self._run_task(index)
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

    # -- one compute lane and the comm queue: the calling thread runs both ------------

    def _run_one_thread(self, trace: Trace | None) -> None:
        if self._worker_init is not None:
            self._worker_init(next(lane for lane, _ in self.lanes
                                   if lane.queue.kind == COMPUTE))
        _OneThread(self, trace).run()

    # -- several lanes: a worker thread each ------------------------------------------

    def _run_threaded(self, trace: Trace | None) -> None:
        if self._pool is None:
            self._pool = _Pool(self.lanes, self.queue_workers, self._program,
                               self._worker_init)
            self._close_pool_on_collect = weakref.finalize(self, self._pool.close, False)
        pool = self._pool
        self._counts[:] = self._initial
        run = pool.run = _Run(len(self.tasks), trace)
        for index in self._roots:
            if self._queue_of[index] != pool.comm_q:
                pool.inboxes[self._queue_of[index]].put(index)
        comm_roots = [i for i in self._roots if self._queue_of[i] == pool.comm_q]
        if comm_roots:
            pool.comm.offer(run, comm_roots)
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

    def __init__(self, lanes: list[tuple[Lane, int]], queue_workers: list[int], program,
                 worker_init: Callable[[Lane], None] | None):
        self.inboxes = [queue.SimpleQueue() for _ in queue_workers]
        self.queue_workers = queue_workers
        # Written by the comm worker only: whether operations are pending, and their nudge.
        self.comm_pending = False
        self.nudge: Callable[[], None] | None = None
        # One flag per compute worker, set while it runs a task (written by it alone).
        self.computing = [False] * sum(lane.queue.kind == COMPUTE for lane, _ in lanes)
        self.comm_q = next((q for lane, q in lanes if lane.queue.kind == COMM), None)
        self.comm = None if self.comm_q is None else _CommWorker(self, self.comm_q, program)
        self.run: _Run | None = None
        self.closed = False
        self.init_failures: list[tuple[Lane, BaseException]] = []
        started = threading.Semaphore(0)
        slots = itertools.count()
        self.threads = [threading.Thread(target=_start,
                                         args=(self, lane, q, program, worker_init, started,
                                               next(slots) if lane.queue.kind == COMPUTE
                                               else None),
                                         name=f"purinec {lane}", daemon=True)
                        for lane, q in lanes]
        try:
            for thread in self.threads:
                thread.start()
            for _ in self.threads:
                started.acquire()
        except BaseException:
            self.close(join=True)
            raise
        if self.init_failures:
            self.close(join=True)
            lane, err = self.init_failures[0]
            raise ExecutionError(f"starting the worker of {lane} failed: "
                                 f"{type(err).__name__}: {err}") from err

    def close(self, join: bool) -> None:
        self.closed = True
        for inbox, workers in zip(self.inboxes, self.queue_workers):
            for _ in range(workers):
                inbox.put(None)
        if join:
            for thread in self.threads:
                if thread.ident is not None and thread is not threading.current_thread():
                    thread.join()


class _OneThread:
    """One call of a plan with one compute lane and the comm queue (an MPI rank with one
    device), counted on the calling thread. Ready compute tasks run in schedule order;
    comm tasks are posted in plan order as soon as they are ready, and what is pending
    is tested between tasks every BUSY_POLL seconds (which also moves MPI along); with
    nothing to run, it helps and waits on what is pending (`_idle`). A thread of its own
    for the communication would cost a wake-up (tens of microseconds) at every hand-off,
    and share the rank's one core anyway."""

    def __init__(self, executor: CountingExecutor, trace: Trace | None):
        self.executor, self.trace = executor, trace
        executor._counts[:] = executor._initial
        order = executor._comm_order
        self.comm_q = executor._queue_of[order[0]] if order else None
        self.ready: list[int] = []  # compute tasks, a heap: schedule order
        self.comm_ready: set[int] = set()
        self.pending: list[tuple[int, Pending, float]] = []
        self.posted, self.left = 0, len(executor.tasks)
        self.index = -1  # the task at hand, to name when it fails
        for index in executor._roots:
            self._queue(index)

    def run(self) -> None:
        fns, args = self.executor._fns, self.executor._args
        idle_since = None
        try:
            polled = 0.0
            while self.left:
                self._post()
                if not self.ready or perf_counter() - polled >= BUSY_POLL:
                    self._poll(idle=not self.ready)
                    polled = perf_counter()
                if self.ready:
                    index = self.index = heapq.heappop(self.ready)
                    start = perf_counter()
                    fns[index](*args[index])
                    self._release(index, start)
                    idle_since = None
                elif self.pending:
                    idle_since = _idle(idle_since)
                elif self.left and not self._postable():
                    raise AssertionError("dependency counts never reached zero")
        except Exception as err:
            raise self.executor._failure(self.index, err) from err

    def _postable(self) -> bool:
        order = self.executor._comm_order
        return self.posted < len(order) and order[self.posted] in self.comm_ready

    def _post(self) -> None:
        """Post the ready comm tasks, in plan order, up to the first one not ready."""
        while self._postable():
            index = self.index = self.executor._comm_order[self.posted]
            self.posted += 1
            start = perf_counter()
            operation = self.executor._fns[index](*self.executor._args[index])
            if operation is None:
                self._release(index, start)
            else:
                self.pending.append((index, operation, start))

    def _poll(self, idle: bool) -> None:
        for entry in list(self.pending):
            self.index = entry[0]
            if _test(entry[1], idle):
                self.pending.remove(entry)
                self._release(entry[0], entry[2])

    def _release(self, index: int, start: float) -> None:
        if self.trace is not None:
            self.trace.record(self.executor.tasks[index], self.executor._home_lane[index],
                              start, perf_counter())
        self.left -= 1
        counts = self.executor._counts
        for s in self.executor._successors[index]:
            counts[s] -= 1
            if counts[s] == 0:
                self._queue(s)

    def _queue(self, index: int) -> None:
        if self.executor._queue_of[index] == self.comm_q:
            self.comm_ready.add(index)
        else:
            heapq.heappush(self.ready, index)


# With nothing to run but operations pending, the one-thread loop yields the core for
# this long, testing between yields (no other thread of the process needs the core, and
# sched_yield lets any other runnable thread have it), then sleeps between tests.
ONE_THREAD_SPIN = 2e-3


def _idle(since: float | None) -> float:
    """One pause of the one-thread loop's wait; returns when the wait began."""
    now = perf_counter()
    if since is None or now - since < ONE_THREAD_SPIN:
        os.sched_yield()
        return now if since is None else since
    time.sleep(PENDING_POLL_MAX)
    return since


def _wait(pending: Pending) -> None:
    """Poll until complete, pausing between tests: an MPI wait would spin a core."""
    pauses = _pauses()
    while not _test(pending, idle=True):
        time.sleep(next(pauses))


def _start(pool: _Pool, lane: Lane, q: int, program,
           worker_init: Callable[[Lane], None] | None, started: threading.Semaphore,
           slot: int | None) -> None:
    """A worker thread: set itself up, say so, then serve its queue."""
    try:
        if worker_init is not None:
            worker_init(lane)
    except BaseException as err:  # the pool reports it and closes
        pool.init_failures.append((lane, err))
        return
    finally:
        started.release()
    if lane.queue.kind == COMM:
        pool.comm.serve()
    else:
        _serve(pool, lane, pool.inboxes[q], program, slot)


def _release(pool: _Pool, run: _Run, index: int, program) -> None:
    """Task ``index`` is complete: queue the successors it was the last wait of (comm
    tasks are offered to the comm worker, which posts them on this thread)."""
    _, _, _, successors, queue_of, counts = program
    inboxes = pool.inboxes
    comm_ready = []
    with run.lock:
        for s in successors[index]:
            counts[s] -= 1
            if counts[s] == 0:
                if queue_of[s] == pool.comm_q:
                    comm_ready.append(s)
                else:
                    inboxes[queue_of[s]].put(s)
        run.remaining -= 1
        if run.remaining == 0:
            run.finished.set()
    if comm_ready:
        pool.comm.offer(run, comm_ready)


def _serve(pool: _Pool, lane: Lane, inbox: queue.SimpleQueue, program,
           slot: int | None) -> None:
    """A worker: run tasks from ``inbox``, release their successors, until closed. A
    compute worker (``slot``: its flag in ``pool.computing``) also keeps pending
    communication moving: it nudges it after each task, and wakes the comm worker when
    it is about to go idle."""
    tasks, fns, args = program[:3]
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
        if slot is not None:
            pool.computing[slot] = True
        try:
            start = perf_counter()
            pending = fns[index](*args[index])
            if pending is not None:
                _wait(pending)
            if run.trace is not None:
                run.trace.record(tasks[index], lane, start, perf_counter())
        except BaseException as err:  # any failure stops the run; the caller raises it
            run.fail(index, err)
            continue
        finally:
            if slot is not None:
                pool.computing[slot] = False
        _release(pool, run, index, program)
        if slot is not None and pool.comm_pending:
            _keep_comm_moving(pool, inbox)


def _keep_comm_moving(pool: _Pool, inbox: queue.SimpleQueue) -> None:
    nudge = pool.nudge
    if nudge is not None:
        nudge()
    if inbox.empty():
        pool.comm.inbox.put(WAKE)


class _CommWorker:
    """The comm queues of a plan: ready tasks posted in plan order, pending ones polled.

    Tasks are posted strictly in plan order: a ready task waits until every earlier
    comm task has been posted. The thread that makes an asynchronous task ready posts
    it (`offer`): handing it to this worker's thread instead would wait for that thread
    to be scheduled, which a core busy with a kernel can delay by milliseconds. The
    worker's own thread runs the synchronous ones and polls what is pending (never
    blocking on one operation), sleeping a little longer each time nothing changed
    (BUSY_POLL while every compute worker is busy), and waking at once when a compute
    worker goes idle or the first operation is posted. One lock (re-entrant: completing
    a task may make the next one ready) guards the posting order and the pending
    operations.
    """

    def __init__(self, pool: _Pool, q: int, program):
        self.pool, self.program = pool, program
        self.inbox = pool.inboxes[q]
        self.order = [i for i, home in enumerate(program[4]) if home == q]
        self.lock = threading.RLock()
        self._begin(None)

    def offer(self, run: _Run, indices: list[int]) -> None:
        """Tasks of ``run`` that became ready: post them (and the ready ones after them
        in plan order) now, on the calling thread."""
        with self.lock:
            if run is not self.run:
                self._begin(run)
            if run.stop:
                return
            idle = not self.pending
            self.ready.update(indices)
            if not self._post(inline=True) or idle and self.pending:
                self.inbox.put(WAKE)  # to run a synchronous task, or to start polling
            self.pool.comm_pending = bool(self.pending)

    def _begin(self, run: _Run | None) -> None:
        """Start afresh for ``run``, dropping what a stopped run left."""
        self.run = run
        self.ready: set[int] = set()
        self.pending: list[tuple[int, Pending, float]] = []
        self.pool.comm_pending = False
        self.posted = 0  # how many tasks of self.order have been posted in this run

    def serve(self) -> None:
        pauses = _pauses()
        while not self.pool.closed:
            signal = self._next(self._pause(pauses))
            if signal is None:
                return
            if signal == WAKE:
                pauses = _pauses()
            with self.lock:
                run = self.pool.run
                if run is not self.run:
                    self._begin(run)
                if run is None or run.stop:
                    self._begin(None)  # the run stopped: poll nothing more of it
                    continue
                self._post(inline=False)
                if self._poll():
                    pauses = _pauses()
                self.pool.comm_pending = bool(self.pending)

    def _pause(self, pauses) -> float:
        """How long to wait for a signal before polling again."""
        if not self.pending:
            return POLL
        computing = self.pool.computing
        return BUSY_POLL if computing and all(computing) else next(pauses)

    def _next(self, pause: float) -> int | None:
        """WAKE, or -1 once ``pause`` has passed without it (time to poll), or None when
        the pool closes."""
        try:
            if pause:
                return self.inbox.get(timeout=pause)
            time.sleep(0)  # yield the core, then look
            return self.inbox.get_nowait()
        except queue.Empty:
            return -1

    def _post(self, inline: bool) -> bool:
        """Post ready tasks while the next one in plan order is ready; ``inline`` (off
        the worker's thread), stop at a synchronous one and say so by returning False."""
        fns, args = self.program[1:3]
        order = self.order
        while self.posted < len(order) and order[self.posted] in self.ready:
            index = order[self.posted]
            if inline and not getattr(fns[index], "asynchronous", False):
                return False
            self.posted += 1
            start = perf_counter()
            try:
                pending = fns[index](*args[index])
            except BaseException as err:  # stops the run; the caller raises it
                self.run.fail(index, err)
                break
            if pending is None:
                self._complete(index, start)
            else:
                self.pending.append((index, pending, start))
                self.pool.nudge = getattr(pending, "nudge", None)
        return True

    def _poll(self) -> bool:
        """Test each pending operation once; complete those that are done."""
        progressed = False
        idle = not any(self.pool.computing)
        for entry in list(self.pending):
            index, pending, start = entry
            try:
                done = _test(pending, idle)
            except BaseException as err:  # stops the run; the caller raises it
                self.run.fail(index, err)
                return True
            if done:
                self.pending.remove(entry)
                self._complete(index, start)
                progressed = True
        return progressed

    def _complete(self, index: int, start: float) -> None:
        if self.run.trace is not None:  # drawn on its own queue's lane
            task = self.program[0][index]
            self.run.trace.record(task, Lane(task.queue), start, perf_counter())
        _release(self.pool, self.run, index, self.program)
