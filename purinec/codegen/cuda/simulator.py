"""What the generated CUDA modules need of Numba's CUDA simulator, which runs them on the
CPU (``NUMBA_ENABLE_CUDASIM=1`` before Numba is first imported) where no GPU is.

The simulator runs each CUDA thread of a block as a Python thread. It hands a block's
threads their shared arrays (``cuda.shared.array``) by looking the call site up in a
dict and creating the array when it is missing, without a lock: two threads that start
together can both miss and each create one, and a thread then works in an array no
other thread of its block sees. A correct reduction then loses a thread's share (2 in
7,300 launches of a 32-thread block with Python switching threads every microsecond;
about once in 20 runs of a small data-parallel training test: the first bias element
of a layer missing one row). `atomic_shared_arrays` makes the look-up and the creation one
step, without changing how arrays are found, so every thread of a block gets the same
array.
"""

from __future__ import annotations

import threading


def simulated() -> bool:
    """Whether Numba's CUDA simulator stands in for a GPU in this process."""
    from numba import config

    return bool(config.ENABLE_CUDASIM)


class SharedAllocations(dict):
    """A block's shared arrays by call site, as the simulator keeps them, where a thread
    that misses (``get`` finds nothing) holds a lock until it has stored the array it
    then creates (``__setitem__``): another thread missing the same array meanwhile
    waits for it, and finds it. The simulator creates an array (``np.empty``) only after
    a miss."""

    def __init__(self):
        super().__init__()
        self._creating = threading.Lock()

    def get(self, key, default=None):
        found = super().get(key)
        if found is not None:
            return found
        self._creating.acquire()
        found = super().get(key)
        if found is not None:
            self._creating.release()
            return found
        return default  # (still holding the lock: the caller stores the array next)

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self._creating.release()


def atomic_shared_arrays() -> None:
    """Give every shared-memory manager the simulator makes (one per launch) a
    `SharedAllocations` (see the module's docstring). Once per process; only under the
    simulator."""
    from numba.cuda.simulator import kernelapi

    manager = kernelapi.FakeCUDAShared
    if getattr(manager, "purinec_atomic", False):
        return
    make = manager.__init__

    def __init__(self, *args, **kwargs):
        make(self, *args, **kwargs)
        self._allocations = SharedAllocations()

    manager.__init__ = __init__
    manager.purinec_atomic = True
