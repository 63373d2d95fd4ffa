"""The training loop behind `purinec train`: epochs of SGD steps, then test accuracy;
and checkpoints, which are `.purine` artifacts that also say where training stands."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from purinec.compiler import load
from purinec.program import Program
from purinec.data import Dataset, batches
from purinec.errors import ArtifactError, DataError, TrainingError


@dataclass
class EpochResult:
    epoch: int
    loss: float  # mean training loss over the epoch's steps
    train_accuracy: float  # mean over the epoch's batches, as the graph computed it
    test_accuracy: float


@dataclass
class TrainResult:
    epochs: list[EpochResult] = field(default_factory=list)

    @property
    def final(self) -> EpochResult:
        return self.epochs[-1]


def evaluate(program: Program, x: np.ndarray, y: np.ndarray, batch: int) -> float:
    """Fraction of ``x`` whose largest logit is the label (padded rows not counted). An
    inference graph that takes the labels too (one written as a training graph's
    forward pass, in a .pir file) gets them."""
    takes_labels = "label" in {v.name for v in program.eval_ir.inputs_with_role("data")}
    correct = 0
    for start, (bx, by) in zip(range(0, len(x), batch), batches(x, y, batch, None)):
        real = min(batch, len(x) - start)
        logits = program.run({"data": bx, **({"label": by} if takes_labels else {})})["logits"]
        correct += int((logits[:real].argmax(axis=1) == by[:real]).sum())
    return correct / len(x)


def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    """The shuffle of one epoch depends on (seed, epoch) only, so a run resumed at any
    epoch sees exactly the batches an uninterrupted run would have seen."""
    return np.random.default_rng([seed, epoch])


def check_batch(data: Dataset, batch: int) -> None:
    """Training needs at least one whole batch of training images."""
    if len(data.train_x) < batch:
        raise DataError(f"{data.name} has {len(data.train_x)} training images, fewer than "
                        f"one batch of {batch}; use a smaller --batch")


def train(program: Program, data: Dataset, epochs: int, batch: int, seed: int = 0,
          progress: bool = True, start_epoch: int = 0,
          on_epoch_end: Callable[[EpochResult], None] | None = None) -> TrainResult:
    """Train ``program`` on ``data`` from epoch ``start_epoch + 1`` to ``epochs``; returns
    per-epoch loss and accuracy. ``on_epoch_end`` sees each epoch's result (after the
    test accuracy), e.g. to write a checkpoint."""
    from tqdm import tqdm

    check_batch(data, batch)
    steps = len(data.train_x) // batch
    result = TrainResult()
    for epoch in range(start_epoch + 1, epochs + 1):
        losses, accuracies = [], []
        rng = epoch_rng(seed, epoch)
        # Updated by hand: a bar wrapping the iterable counts its steps lazily, and the
        # loss shown with each step would redraw the stale count.
        bar = tqdm(total=steps, desc=f"epoch {epoch}/{epochs}", unit="step",
                   disable=not progress, leave=False)
        for step, (bx, by) in enumerate(batches(data.train_x, data.train_y, batch, rng), 1):
            losses.append(program.step({"data": bx, "label": by}))
            if not np.isfinite(losses[-1]):
                bar.close()
                raise _diverged(losses[-1], bx, f"epoch {epoch}, step {step} of {steps}")
            if "accuracy" in program.last_outputs:
                accuracies.append(float(program.last_outputs["accuracy"]))
            bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
            bar.update()
        bar.close()
        test_accuracy = evaluate(program, data.test_x, data.test_y, batch)
        result.epochs.append(EpochResult(epoch, float(np.mean(losses)),
                                         float(np.mean(accuracies)) if accuracies else
                                         float("nan"), test_accuracy))
        if on_epoch_end is not None:
            on_epoch_end(result.epochs[-1])
    return result


def _diverged(loss: float, inputs: np.ndarray, where: str) -> TrainingError:
    """Why the loss is not a number, where the inputs can tell; said before the epoch
    ends, so no checkpoint of the broken weights is written."""
    why = ("the batch holds non-finite inputs: clean the data" if not np.isfinite(inputs).all()
           else "training diverged: try a smaller --lr (learning rate)")
    return TrainingError(f"the training loss is {loss} at {where}; {why}. Stopped before "
                         f"the epoch's end, so no checkpoint holds these weights")


@dataclass(frozen=True)
class Checkpoint:
    """Where training stands, kept in a checkpoint artifact's manifest next to the
    training program, its weights and its momentum state."""

    epoch: int  # epochs completed
    seed: int  # seed of the data split and of every epoch's shuffle
    data: str  # the data set, as given to --data

    def save(self, program: Program, path: str | os.PathLike):
        """Write ``program`` with this position to ``path`` (atomically)."""
        return program.save(path, metadata={"checkpoint": asdict(self)})

    @staticmethod
    def load(path: str | os.PathLike, target: str | None = None
             ) -> tuple[Program, "Checkpoint"]:
        """The training program saved at ``path`` and where its training stands."""
        program = load(path, target)
        saved = program.metadata.get("checkpoint")
        if not isinstance(saved, dict):
            raise ArtifactError(f"{os.fspath(path)} is an artifact but not a checkpoint (its "
                                "manifest has no epoch); to train from its weights, give it "
                                "to purinec train as the MODEL (not --resume), or use "
                                "purinec.load")
        fields = {"epoch": int, "seed": int, "data": str}
        if set(saved) != set(fields) or any(type(saved[k]) is not t for k, t in fields.items()):
            raise ArtifactError(f"{os.fspath(path)}: the checkpoint entry of its manifest is "
                                f"malformed: {saved!r}")
        if not program.trainable:
            raise ArtifactError(f"{os.fspath(path)}: the checkpoint holds no training graph")
        return program, Checkpoint(**saved)
