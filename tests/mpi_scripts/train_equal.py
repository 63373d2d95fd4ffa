"""Data-parallel training over every rank of the job against one device, in each rank:
``train_equal.py MODEL BATCH TARGET OUT_DIR [DEVICES_PER_RANK [STRATEGY]]``. Each rank
gathers the weights, saves the losses, both programs' inference outputs before and after
training and their parameters after two iterations to OUT_DIR/rank<R>.npz, and checks
that saving before gathering is refused when the strategy splits weights over the
ranks."""

import sys

import numpy as np

import purinec
from purinec.runtime import comm

model, batch, target, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
per_rank = int(sys.argv[5]) if len(sys.argv) > 5 else 1
strategy = sys.argv[6] if len(sys.argv) > 6 else "data"
world = comm.world()
sgd = purinec.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4)
devices = ",".join(f"r{r}/cpu:{i}" for r in range(world.size) for i in range(per_rank))
many = purinec.compile(model, target=target, train=sgd, batch=batch, seed=7, devices=devices,
                       parallel=strategy)
one = purinec.compile(model, target="reference", train=sgd, batch=batch, seed=7)
rng = np.random.default_rng(1)


def random_feeds(graph):
    return {v.name: (rng.standard_normal(v.type.shape).astype(np.float32)
                     if v.type.dtype.is_float else
                     rng.integers(0, 10, v.type.shape).astype(v.type.dtype.numpy))
            for v in graph.inputs_with_role("data")}


def inference(when, inputs):
    return {f"{program}_{when}/{name}": value for program, outputs in
            (("one", one.run(inputs)), ("many", many.run(inputs)))
            for name, value in outputs.items()}


inputs = random_feeds(one.eval_ir)
outputs = inference("before", inputs)
losses = []
for _ in range(2):
    feeds = random_feeds(one.ir)
    losses.append((one.step(feeds), many.step(feeds)))
outputs.update(inference("after", inputs))
if strategy != "data":
    try:
        many.save(f"{out}/early{world.rank}.purine")
        raise SystemExit("saved weights split over ranks without gathering them")
    except purinec.PurinecError as err:
        assert "gather_weights() on every rank" in str(err), err
many.gather_weights()
np.savez(f"{out}/rank{world.rank}.npz", losses=np.array(losses), **outputs,
         **{f"one/{k}": v for k, v in one.params.items()},
         **{f"many/{k}": v for k, v in many.params.items()},
         **{f"many_state/{k}": v for k, v in many.state.items()})
many.close()
