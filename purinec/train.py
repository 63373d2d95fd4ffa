"""The training loop behind `purinec train`: epochs of SGD steps, then test accuracy."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from purinec.compiler import Program
from purinec.data import Dataset, batches
from purinec.errors import DataError


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
    """Fraction of ``x`` whose largest logit is the label (padded rows not counted)."""
    correct = 0
    for start, (bx, by) in zip(range(0, len(x), batch), batches(x, y, batch, None)):
        real = min(batch, len(x) - start)
        logits = program.run({"data": bx})["logits"]
        correct += int((logits[:real].argmax(axis=1) == by[:real]).sum())
    return correct / len(x)


def train(program: Program, data: Dataset, epochs: int, batch: int, seed: int = 0,
          progress: bool = True) -> TrainResult:
    """Train ``program`` on ``data`` for ``epochs``; returns per-epoch loss and accuracy."""
    from tqdm import tqdm

    if len(data.train_x) < batch:
        raise DataError(f"{data.name} has {len(data.train_x)} training images, fewer than "
                        f"one batch of {batch}; use a smaller --batch")
    rng = np.random.default_rng(seed)
    steps = len(data.train_x) // batch
    result = TrainResult()
    for epoch in range(1, epochs + 1):
        losses, accuracies = [], []
        bar = tqdm(batches(data.train_x, data.train_y, batch, rng), total=steps,
                   desc=f"epoch {epoch}/{epochs}", unit="step", disable=not progress,
                   leave=False)
        for bx, by in bar:
            losses.append(program.step({"data": bx, "label": by}))
            if "accuracy" in program.last_outputs:
                accuracies.append(float(program.last_outputs["accuracy"]))
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
        test_accuracy = evaluate(program, data.test_x, data.test_y, batch)
        result.epochs.append(EpochResult(epoch, float(np.mean(losses)),
                                         float(np.mean(accuracies)) if accuracies else
                                         float("nan"), test_accuracy))
    return result
