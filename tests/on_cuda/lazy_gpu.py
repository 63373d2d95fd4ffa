"""A GPU as far behind its host as CUDA lets it be, in Numba's CUDA simulator.

The simulator runs every launch and copy when it is made, so the order a real GPU
imposes (each stream in order, streams only as events order them) is never tested
there: a missing wait between streams, or between one call's work and the next's,
goes unseen. `lazy_gpu` makes each stream of a cuda program a queue that runs nothing
until the host waits for it, or for an event recorded on it (`LazyStream`,
`LazyEvent`): then it runs what it must, and only that, in stream order, a wait for an
event first running the recording stream up to the record. Whatever the runtime
forgot to order runs late, on data that has moved on, and the numbers show it.

A copy given a stream (``copy_to_host``, ``copy_to_device``) is queued on it too, to
run when the stream is waited for, as a GPU's copy engine would; one given none runs
at once (the legacy default stream, as it orders nothing here). The host's own work
runs when the host runs it.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import types
from unittest import mock

from purinec.runtime import gpu


# The GPU: one thing runs on it at a time, whichever host thread's wait makes it run
# (the program's workers wait and queue at once); a wait within queued work (an event
# waited for) runs on the same thread.
_GPU = threading.RLock()


class LazyStream:
    """A stream's work, queued; run when something waits for it."""

    def __init__(self, real):
        self.real = real  # the simulator's stream, which the queued work is given
        self.queue: collections.deque = collections.deque()
        self.queued = self.done = 0
        self.running = False

    def enqueue(self, work) -> int:
        with _GPU:
            self.queue.append(work)
            self.queued += 1
            return self.queued

    def drain(self, upto: int) -> None:
        """Run the queued work up to the ``upto``-th item of all this stream was given."""
        with _GPU:
            if self.done >= upto:
                return
            assert not self.running, "two streams wait for each other: a GPU would hang"
            self.running = True
            try:
                while self.done < upto:
                    self.queue.popleft()()
                    self.done += 1
            finally:
                self.running = False

    def synchronize(self) -> None:
        self.drain(self.queued)


class LazyEvent:
    """An event: where a stream's queue stood when it was last recorded on it."""

    def __init__(self):
        self.mark: tuple[LazyStream, int] | None = None

    def record(self, stream: LazyStream) -> None:
        with _GPU:
            self.mark = (stream, stream.enqueue(lambda: None))

    def wait(self, stream: LazyStream) -> None:
        with _GPU:
            mark = self.mark  # (the record this wait is for: the latest, as in CUDA)
            if mark is not None:
                stream.enqueue(lambda: mark[0].drain(mark[1]))

    def synchronize(self) -> None:
        with _GPU:
            if self.mark is not None:
                self.mark[0].drain(self.mark[1])


@contextlib.contextmanager
def lazy_gpu():
    """Meanwhile, every cuda program made gets lazy streams and events."""
    make_gpus, on_stream = gpu.Gpus.__init__, gpu._on_stream

    def lazy_gpus(self, graph):
        make_gpus(self, graph)
        self.devices = {device: gpu.Streams(s.gpu, LazyStream(s.compute),
                                            LazyStream(s.copy_in), LazyStream(s.copy_out))
                        for device, s in self.devices.items()}
        self.event = lambda physical=None: LazyEvent()

    def lazy_on_stream(task, stream, *rest):
        """A kernel's launches queued on its stream (the simulator's launch runs at
        once); a copy's are its own (its arrays queue them)."""
        kernel = task.fn
        if isinstance(kernel, gpu.Transfer):
            return on_stream(task, stream, *rest)

        def deferred(lazy: LazyStream, *arrays):
            lazy.enqueue(lambda: kernel.launch(lazy.real, *arrays))

        proxy = types.SimpleNamespace(launch=deferred, views=getattr(kernel, "views", {}))
        run = on_stream(types.SimpleNamespace(fn=proxy, args=task.args), stream, *rest)
        run.kernel = kernel
        return run

    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    copy_to_host, copy_to_device = FakeCUDAArray.copy_to_host, FakeCUDAArray.copy_to_device

    def queued(copy):
        def on_stream(self, array=None, stream=0):
            if not isinstance(stream, LazyStream):
                return copy(self, array, stream=stream)
            stream.enqueue(lambda: copy(self, array, stream=stream.real))
            return array
        return on_stream

    with mock.patch.object(gpu.Gpus, "__init__", lazy_gpus), \
            mock.patch.object(gpu, "_on_stream", lazy_on_stream), \
            mock.patch.object(FakeCUDAArray, "copy_to_host", queued(copy_to_host)), \
            mock.patch.object(FakeCUDAArray, "copy_to_device", queued(copy_to_device)):
        yield
