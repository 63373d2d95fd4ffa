"""A user's own training script, as the README shows it, with no run_guarded. With
``fail ERRFILE`` as argv[1:], rank 1 raises after its compile while rank 0 takes a step,
so rank 0 waits in the step's collectives. Started as
``mpiexec -n 2 python -m mpi4py unguarded.py fail ERRFILE``, mpi4py aborts the whole job
on the uncaught exception; without ``fail`` both ranks take the step and print its loss.

Rank 1 writes its stderr straight to ERRFILE: the launcher ends the job as soon as the
abort reaches it and may drop what it had not yet forwarded of the rank's last lines."""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import purinec
from purinec.runtime import comm

program = purinec.compile("mlp", target="reference", train=purinec.SGD(lr=0.1), batch=4,
                          devices="r0/cpu:0,r1/cpu:0", parallel="data")
if comm.world().rank == 1 and sys.argv[1:2] == ["fail"]:
    os.dup2(os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    time.sleep(0.5)  # rank 0 is in its step by now
    raise ValueError("a bug in the user's script on rank 1")
rng = np.random.default_rng(0)
loss = program.step({"data": rng.random((4, 1, 28, 28), dtype=np.float32),
                     "label": rng.integers(0, 10, 4).astype(np.int32)})
print(f"rank {comm.world().rank}: loss {loss:.4f}")
