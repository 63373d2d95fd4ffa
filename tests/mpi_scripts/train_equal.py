"""Training over every rank of the job against one device, in each rank:
``train_equal.py MODEL BATCH TARGET OUT_DIR [DEVICES_PER_RANK [STRATEGY]]``, or
``train_equal.py random:SEED:COUNT - TARGET OUT_DIR`` for COUNT random small networks
(`common.random_net`, the strategies in turn, on one or two devices a rank). Each
rank gathers the weights, saves the losses, both programs' inference outputs before and
after training (the one device's with the weights the ranks trained, `adopt_weights`)
and their parameters after two iterations to OUT_DIR/rank<R>.npz (a
random network's to OUT_DIR/<case>/rank<R>.npz), and checks that saving before
gathering is refused when the strategy splits weights over the ranks."""

import os
import sys

import numpy as np
from common import STRATEGIES, adopt_weights, random_net, weight_scales

import purinec
from purinec.ir.types import Device
from purinec.runtime import comm

SGD = purinec.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4)


def train_and_save(model, batch, target, out, devices, strategy, classes=10,
                   alone=None) -> bool:
    """Returns whether the program's weights were split over the ranks after a step.
    One device runs ``alone`` if given (``model`` without its placement); a placed
    model runs where it says."""
    world = comm.world()
    placed = strategy == "placement"
    many = purinec.compile(model, target=target, train=SGD, batch=batch, seed=7,
                           devices=None if placed else devices,
                           parallel=None if placed else strategy)
    one = purinec.compile(alone or model, target="reference", train=SGD, batch=batch,
                          seed=7)
    rng = np.random.default_rng(1)

    def random_feeds(graph):  # images in [0, 1), as the zoo's models take them
        return {v.name: (rng.random(v.type.shape).astype(np.float32)
                         if v.type.dtype.is_float else
                         rng.integers(0, classes, v.type.shape).astype(v.type.dtype.numpy))
                for v in graph.inputs_with_role("data")}

    def named(when, one_outputs, many_outputs):
        return {f"{program}_{when}/{name}": value for program, outputs in
                (("one", one_outputs), ("many", many_outputs))
                for name, value in outputs.items()}

    inputs = random_feeds(one.eval_ir)
    outputs = named("before", one.run(inputs), many.run(inputs))
    losses, scales = [], weight_scales(one.params)
    for _ in range(2):
        feeds = random_feeds(one.ir)
        losses.append((one.step(feeds), many.step(feeds)))
        scales = weight_scales(one.params, scales)
    many_after = many.run(inputs)  # with the weights where the steps left them
    spans = many._run_main.spans_ranks
    if spans:
        try:
            many.save(f"{out}/early{world.rank}.purine")
            raise SystemExit("saved weights split over ranks without gathering them")
        except purinec.PurinecError as err:
            assert "gather_weights() on every rank" in str(err), err
    many.gather_weights()
    trained = {**{f"one/{k}": v for k, v in one.params.items()},
               **{f"scale/{k}": v for k, v in scales.items()},
               **{f"many/{k}": v for k, v in many.params.items()},
               **{f"many_state/{k}": v for k, v in many.state.items()}}
    adopt_weights(one, many)
    outputs.update(named("after", one.run(inputs), many_after))
    np.savez(f"{out}/rank{world.rank}.npz", losses=np.array(losses), **outputs, **trained)
    many.close()
    one.close()
    return spans


def main() -> int:
    model, batch, target, out = sys.argv[1:5]
    world = comm.world()
    if model.startswith("random:"):
        _, seed, count = model.split(":")
        for case in range(int(count)):
            rng = np.random.default_rng([int(seed), case])
            per_rank = int(rng.integers(1, 3))
            devices = [Device("cpu", i, r) for r in range(world.size) for i in range(per_rank)]
            net, alone, strategy, classes = random_net(
                lambda options: options[int(rng.integers(len(options)))], devices,
                STRATEGIES[case % len(STRATEGIES)])
            folder = f"{out}/{case}"
            os.makedirs(folder, exist_ok=True)
            train_and_save(net, None, target, folder, ",".join(map(str, devices)), strategy,
                           classes, alone)
        return 0
    per_rank = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    strategy = sys.argv[6] if len(sys.argv) > 6 else "data"
    devices = ",".join(f"r{r}/cpu:{i}" for r in range(world.size) for i in range(per_rank))
    spans = train_and_save(model, int(batch), target, out, devices, strategy)
    assert spans == (strategy != "data"), (strategy, spans)  # only data replicates all
    return 0


if __name__ == "__main__":
    sys.exit(comm.run_guarded(main))
