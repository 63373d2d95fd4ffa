"""A model that puts its second layer on rank 1 (``placed_equal.py MODEL_FILE OUT_DIR``):
two training iterations on two ranks against one device; each rank gathers the weights
and saves the losses and parameters of both to OUT_DIR/rank<R>.npz."""

import sys

import numpy as np

import purinec
from purinec.bigraph import Location
from purinec.runtime import comm


def main() -> int:
    path, out = sys.argv[1], sys.argv[2]
    world = comm.world()
    sgd = purinec.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4)
    one = purinec.compile(path, train=sgd, seed=4)
    placed = purinec.compile(path, train=sgd, seed=4, second=Location(1, "cpu", 0))
    assert any(n.op == "recv" for n in placed.physical_ir.nodes)
    rng = np.random.default_rng(5)
    losses = []
    for _ in range(2):
        feeds = {"data": rng.standard_normal((16, 1, 8, 8)).astype(np.float32),
                 "label": rng.integers(0, 10, 16).astype(np.int32)}
        losses.append((one.step(feeds), placed.step(feeds)))
    placed.gather_weights()
    np.savez(f"{out}/rank{world.rank}.npz", losses=np.array(losses),
             **{f"one/{k}": v for k, v in one.params.items()},
             **{f"many/{k}": v for k, v in placed.params.items()})
    return 0


if __name__ == "__main__":
    sys.exit(comm.run_guarded(main))
