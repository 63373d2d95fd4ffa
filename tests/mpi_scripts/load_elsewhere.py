"""A program saved by a job of another size, loaded and stepped in this job:
``load_elsewhere.py ARTIFACT OUT_DIR``. Each rank loads ARTIFACT, takes two steps on
fixed random batches, gathers the weights and saves its losses and weights to
OUT_DIR/rank<R>.npz."""

import sys

import numpy as np

import purinec
from purinec.runtime import comm


def main() -> int:
    path, out = sys.argv[1], sys.argv[2]
    program = purinec.load(path)
    rng = np.random.default_rng(5)
    losses = []
    for _ in range(2):
        feeds = {v.name: (rng.standard_normal(v.type.shape).astype(np.float32)
                          if v.type.dtype.is_float else
                          rng.integers(0, 10, v.type.shape).astype(v.type.dtype.numpy))
                 for v in program.ir.inputs_with_role("data")}
        losses.append(program.step(feeds))
    program.gather_weights()
    np.savez(f"{out}/rank{comm.world().rank}.npz", losses=np.array(losses),
             devices=np.array([str(d) for d in program.devices]),
             **{f"param/{k}": v for k, v in program.params.items()})
    program.close()
    return 0


if __name__ == "__main__":
    sys.exit(comm.run_guarded(main))
