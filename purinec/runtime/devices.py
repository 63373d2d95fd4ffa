"""Devices as the runtime sees them: each device has several queues.

As in Purine, a device has a compute queue and separate copy queues (inbound and
outbound), so transfers overlap compute. A task names the queue it runs on; the executor
serves every queue that has tasks with its own worker thread(s): kernels go to compute
queues, copies to copy queues, collectives to the comm queue, all counted alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from purinec.ir.types import Device

COMPUTE = "compute"
COPY_IN = "copy_in"
COPY_OUT = "copy_out"
COMM = "comm"  # collectives (in process, and MPI across ranks)

# The queues of one device, in the order traces list them.
QUEUE_KINDS = (COMPUTE, COPY_IN, COPY_OUT, COMM)


@dataclass(frozen=True, order=True)
class QueueId:
    """One queue of one device, printed ``cpu:0/compute``."""

    device: Device
    kind: str = COMPUTE

    def __post_init__(self):
        if self.kind not in QUEUE_KINDS:
            raise ValueError(f"unknown queue kind {self.kind!r}; one of {', '.join(QUEUE_KINDS)}")

    def __str__(self) -> str:
        return f"{self.device}/{self.kind}"


@dataclass(frozen=True, order=True)
class Lane:
    """One worker serving a queue: where a trace draws the tasks it ran.

    A compute queue may have several workers (``worker`` 0, 1, ...); copy queues have one.
    """

    queue: QueueId
    worker: int = 0

    def __str__(self) -> str:
        return str(self.queue) if self.worker == 0 else f"{self.queue}#{self.worker}"
