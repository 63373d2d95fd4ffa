"""Rank 1 fails in the way argv[2] names (``raise``: a bug; ``return``: main returns 3;
``interrupt``: Ctrl-C reaches it; ``terminate``: SIGTERM does; ``die``: the process is killed) while rank 0 waits for it
in a barrier that never completes; run_guarded (or, for a killed rank, the launcher) must
end the whole job. ``everyone``: both ranks meet the same mistake at once."""

from __future__ import annotations

import os
import signal
import sys

from purinec.errors import PurinecError
from purinec.runtime import comm


def main() -> int:
    world = comm.world()
    if sys.argv[2] == "everyone":
        world.comm.Barrier()
        raise PurinecError("the same mistake on every rank")
    if world.rank == 1:
        if sys.argv[2] == "raise":
            raise ValueError("a bug on rank 1")
        if sys.argv[2] == "interrupt":
            os.kill(os.getpid(), signal.SIGINT)  # Python raises KeyboardInterrupt
        if sys.argv[2] == "terminate":
            os.kill(os.getpid(), signal.SIGTERM)
        if sys.argv[2] == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        return 3
    world.comm.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(comm.run_guarded(main))
