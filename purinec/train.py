"""The training session behind `purinec train`, callable from Python.

`train_model` compiles a model (or loads an artifact compiled with train) for a data set
and trains it; `resume_training` continues from a checkpoint. Both fit the data set to
the program first, write a checkpoint after every epoch when asked, close the program
and return a `TrainResult`; ``report=print`` shows the lines the command prints:

    from purinec.train import resume_training, train_model
    result = train_model("lenet", data="synthetic", epochs=2, checkpoint="ck.purine")
    result = resume_training("ck.purine", epochs=4, report=print)

Underneath: the training loop (`train`: epochs of SGD steps, then test accuracy) and
checkpoints (`Checkpoint`), which are `.purine` artifacts that also say where training
stands.
"""

from __future__ import annotations

import contextlib
import os
import reprlib
import time
import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from purinec.compiler import load
from purinec.data import DATASETS, Dataset, batches, load_dataset, resized
from purinec.errors import (ArtifactError, DataError, PurinecError, ShapeError, TrainingError,
                            refuse_options)
from purinec.job import (check_spans_the_job, is_reporting_rank, on_devices, spread_options,
                         wait_for_every_rank)
from purinec.passes.optimizer import SGD
from purinec.program import Program

# Every command compiles for the fused Numba kernels unless told otherwise, and so does
# train_model: the first compile of a model fills the kernel cache (seconds to minutes,
# with a progress bar on a terminal), later ones load from it.
DEFAULT_TARGET = "cpu"

# The solver of a model that train_model compiles, for the settings not given: livelier
# than `SGD()`'s defaults, for the short runs people start. The command line's dump and
# compile use it too, so that dump shows what train builds.
SOLVER_DEFAULTS = {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4}
SOLVER_OPTIONS = tuple(SOLVER_DEFAULTS)

# What an artifact (and so a checkpoint) has fixed in its IR.
FIXED_IN_ARTIFACTS = SOLVER_OPTIONS + ("batch", "devices", "parallel", "micro_batches")

# The data set to train on when none is named: built in, nothing to read or download.
DEFAULT_DATA = "digits"

# What train passes to a model's build() where it takes them: the data set's.
DATA_ARGUMENTS = ("input_shape", "num_classes")

# Where training can stand: the seeds and epochs a run takes, and so all a checkpoint
# can hold (a seed NumPy's generators take; more epochs than anyone trains).
MAX_SEED = 2**64 - 1
MAX_EPOCHS = 10**9
MAX_DATA_SPEC = 4096  # characters of a data set's name or path, as --data gives it

Report = Callable[[str], None]


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
        feeds = {images_input(program.eval_ir): bx, **({"label": by} if takes_labels else {})}
        logits = program.run(feeds)[scores_output(program.eval_ir)]
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
    images = images_input(program.ir)
    result = TrainResult()
    for epoch in range(start_epoch + 1, epochs + 1):
        losses, accuracies = [], []
        rng = epoch_rng(seed, epoch)
        # Updated by hand: a bar wrapping the iterable counts its steps lazily, and the
        # loss shown with each step would redraw the stale count.
        bar = tqdm(total=steps, desc=f"epoch {epoch}/{epochs}", unit="step",
                   disable=not progress, leave=False)
        for step, (bx, by) in enumerate(batches(data.train_x, data.train_y, batch, rng), 1):
            losses.append(program.step({images: bx, "label": by}))
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
        with _closed_on_failure(program):
            wrong = _malformed(saved)
            if wrong:
                raise ArtifactError(f"{os.fspath(path)}: the checkpoint entry of its manifest "
                                    f"is malformed: {wrong}; purinec train writes no such "
                                    f"checkpoint (was it edited?): resume from another one, "
                                    f"or train again")
            if not program.trainable:
                raise ArtifactError(f"{os.fspath(path)}: the checkpoint holds no training "
                                    f"graph")
        return program, Checkpoint(**saved)


def _malformed(saved: dict) -> str | None:
    """What is wrong with a checkpoint entry as read from a manifest, or None: its
    fields, their types, and the bounds of every number (a seed or epoch out of them,
    or a huge one, would fail deep inside NumPy or run for ever)."""
    names = [f.name for f in fields(Checkpoint)]
    if sorted(saved) != sorted(names):
        return f"its fields are {reprlib.repr(sorted(saved))}, not {', '.join(names)}"
    for name, most in (("epoch", MAX_EPOCHS), ("seed", MAX_SEED)):
        if not _is_count(saved[name], 0, most):
            return (f"its {name} is {reprlib.repr(saved[name])}, not a whole number from 0 "
                    f"to {most}")
    data = saved["data"]
    if type(data) is not str or not 0 < len(data) <= MAX_DATA_SPEC:
        return (f"its data {reprlib.repr(data)} is not the name of a data set (a text of 1 "
                f"to {MAX_DATA_SPEC} characters)")
    return None


def _is_count(value: Any, least: int, most: int) -> bool:
    """Whether ``value`` is a whole number (not a bool) from ``least`` to ``most``."""
    return type(value) is int and least <= value <= most


def _check_position_options(epochs: int, seed: int | None) -> None:
    """The epochs to train until and the seed must be where a checkpoint can stand
    (the command line's --epochs and --seed take no others)."""
    for option, value, least, most in (("epochs", epochs, 1, MAX_EPOCHS),
                                       ("seed", seed, 0, MAX_SEED)):
        if value is not None and not _is_count(value, least, most):
            raise PurinecError(f"{option}={reprlib.repr(value)}: give a whole number from "
                               f"{least} to {most}")


# ---------------------------------------------------------------------------------------
# The session: a program and a data set fitted to each other, trained with checkpoints.


def _quietly(line: str) -> None:
    """The report of a session that nobody watches."""


def train_model(model: str | os.PathLike, *, data: str | None = None, epochs: int = 10,
                batch: int | None = None, seed: int | None = None, target: str | None = None,
                lr: float | None = None, momentum: float | None = None,
                weight_decay: float | None = None, devices: Any = None,
                parallel: str | None = None, micro_batches: int | None = None,
                checkpoint: str | os.PathLike | None = None, trace: Any = None,
                progress: bool = False, report: Report = _quietly) -> TrainResult:
    """Train ``model`` from fresh weights until ``epochs`` epochs are done, as `purinec
    train MODEL` does, and close its program.

    ``model`` is a zoo name, a Python file defining ``build(batch)`` (given the data
    set's ``input_shape`` and ``num_classes`` where it takes them), a ``.pir`` file (a
    whole training iteration trains with the solver in its IR), or a ``.purine``
    artifact compiled with train, whose solver, batch and devices are fixed: ``lr``,
    ``momentum``, ``weight_decay``, ``batch``, ``devices``, ``parallel`` and
    ``micro_batches`` are refused with it. ``data`` is a data set as
    `purinec.data.load_dataset` takes it (default digits); a built-in one comes at the
    size the model takes when its images are too small for it. ``seed`` seeds the data
    split, the shuffles and the initial weights (default 0). ``target`` defaults to
    `DEFAULT_TARGET` for a model, to an artifact's own target for an artifact. The
    solver is SGD, with `SOLVER_DEFAULTS` for the settings not given. ``devices``,
    ``parallel`` and ``micro_batches`` are compile()'s; under mpiexec, with neither
    devices nor parallel, a model is spread over the ranks by data parallelism.

    ``checkpoint``: a ``.purine`` file written (atomically, by rank 0) after every
    epoch, for `resume_training`. ``trace``: a `purinec.runtime.trace.Trace` that ends
    up holding the last epoch's tasks. ``progress``: draw progress bars on stderr.
    ``report`` gets every line the command prints: the data set, what was compiled or
    scaled, each epoch's loss and accuracy, each checkpoint, the time taken.

    What needs no data set is checked before the data set is loaded: ``epochs``,
    ``seed``, the model (an artifact loaded; a model looked up, its file run or parsed,
    and built at its own defaults), the solver, ``target``, ``devices`` and ``trace``.
    """
    model = os.fspath(model)
    _check_position_options(epochs, seed)
    start = Checkpoint(epoch=0, seed=0 if seed is None else seed, data=data or DEFAULT_DATA)
    solver_options = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
    spread = {"devices": devices, "parallel": parallel, "micro_batches": micro_batches}
    # The rest first: reading a data set from files takes a while.
    if _is_artifact(model):
        refuse_fixed_options({**solver_options, **spread, "batch": batch}, model)
        began = time.perf_counter()
        program = _trainable_artifact(model, target, trace)
        loaded = time.perf_counter() - began
        with _closed_on_failure(program):
            dataset = _loaded_data(start, report)
        _report_ready(program, "loaded", loaded, report)
    else:
        solver = _checked_model(model, batch, target or DEFAULT_TARGET, trace,
                                solver_options, spread)
        dataset = _loaded_data(start, report)
        if batch is not None:
            check_batch(dataset, batch)  # before compiling for it
        program, dataset = _training_program(model, dataset, start, report, solver,
                                             target=target or DEFAULT_TARGET, batch=batch,
                                             trace=trace, spread=spread)
    return _trained(program, dataset, start, model, epochs, checkpoint, trace, progress,
                    report)


def resume_training(path: str | os.PathLike, *, epochs: int = 10,
                    model: str | os.PathLike | None = None, data: str | None = None,
                    seed: int | None = None, target: str | None = None,
                    checkpoint: str | os.PathLike | None = None, progress: bool = False,
                    report: Report = _quietly) -> TrainResult:
    """Continue training from the checkpoint at ``path`` until ``epochs`` epochs are done,
    as `purinec train --resume` does: its training program, weights, momentum state,
    epoch, data set and seed, which give the same weights as a run never interrupted.
    Returns no epochs when the checkpoint is at ``epochs`` already.

    ``model``, ``data`` and ``seed`` need not be given; given, they must be the
    checkpoint's (a zoo model's name; a file is not compiled again). ``checkpoint``
    (default: ``path``) is written after every epoch. ``target``, ``progress`` and
    ``report`` are as for `train_model`.
    """
    path = os.fspath(path)
    _check_position_options(epochs, seed)
    program, where = _resumed(path, model and os.fspath(model), data, seed, target, report)
    if where.epoch >= epochs:
        program.close()
        report(f"{path} is at epoch {where.epoch}; nothing to train for --epochs {epochs}")
        return TrainResult()
    with _closed_on_failure(program):
        dataset = _loaded_data(where, report)
    return _trained(program, dataset, where, path, epochs, checkpoint or path, None, progress,
                    report)


def default_sgd(lr: float | None = None, momentum: float | None = None,
                weight_decay: float | None = None) -> SGD:
    """SGD with the settings given, and `SOLVER_DEFAULTS` for those left None."""
    given = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
    return SGD(**{name: default if given[name] is None else given[name]
                  for name, default in SOLVER_DEFAULTS.items()})


def refuse_fixed_options(options: Mapping[str, Any], artifact: str) -> None:
    """Refuse options that ``artifact`` has fixed in its IR (`FIXED_IN_ARTIFACTS`)."""
    refuse_options(options, FIXED_IN_ARTIFACTS,
                   f"{artifact} has its solver, batch and devices fixed in its IR; "
                   "compile the model again to change them")


def images_input(graph) -> str:
    """The data input the images go to: ``data``, or else a graph's only data input
    besides ``label`` (an ONNX model keeps its input's own name)."""
    names = [v.name for v in graph.inputs_with_role("data") if v.name != "label"]
    return "data" if "data" in names or len(names) != 1 else names[0]


def scores_output(graph) -> str:
    """The output of class scores: ``logits``, or else an inference graph's only output
    (an ONNX model's)."""
    names = [name for name, _ in graph.outputs]
    return "logits" if "logits" in names or len(names) != 1 else names[0]


def num_classes(graph) -> int | None:
    """The number of classes, when the graph returns logits."""
    logits = dict(graph.outputs).get(scores_output(graph))
    return logits.type.shape[-1] if logits is not None and logits.type.rank else None


def _is_artifact(path: str | None) -> bool:
    return bool(path) and path.endswith(".purine")


@contextlib.contextmanager
def _closed_on_failure(program: Program) -> Iterator[None]:
    """Close ``program`` (its worker threads) when the block fails: the caller never
    gets it to close."""
    try:
        yield
    except BaseException:
        program.close()
        raise


def _loaded_data(where: Checkpoint, report: Report) -> Dataset:
    data = load_dataset(where.data, seed=where.seed)
    report(str(data))
    return data


def _resumed(path: str, model: str | None, data: str | None, seed: int | None,
             target: str | None, report: Report) -> tuple[Program, Checkpoint]:
    """The checkpoint's program and where it stands; options that would contradict it
    are refused rather than ignored."""
    from purinec.models import ZOO

    program, checkpoint = Checkpoint.load(path, target)
    with _closed_on_failure(program):
        check_spans_the_job(program, path)
        for option, given, saved in (("--data", data, checkpoint.data),
                                     ("--seed", seed, checkpoint.seed)):
            if given is not None and given != saved:
                raise PurinecError(f"{option} {given}: {path} was trained with {option} "
                                   f"{saved}; resuming needs the same (leave {option} out)")
        trained = program.ir.name.removesuffix(".train")
        if model in ZOO and model != trained:
            raise PurinecError(f"{path} holds {trained}, not {model}: leave MODEL out to "
                               f"resume it, or train {model} without --resume")
    note = f" (MODEL {model} is not recompiled)" if model else ""
    report(f"resuming {program.ir.name} from {path} after epoch {checkpoint.epoch}"
           f"{on_devices(program)}{note}")
    return program, checkpoint


def _checked_model(model: str, batch: int | None, target: str, trace: Any,
                   solver_options: dict, spread: dict) -> SGD | None:
    """The solver to compile MODEL's training iteration with, once everything about it
    that needs no data set is checked: the model looked up and built at its own
    defaults (a .pir file parsed, an ONNX file read and lowered for training), the
    solver, the target, the devices and the trace.
    None for a .pir file of a whole training iteration (a dump of the optimizer stage
    or later), which trains as it is, its solver fixed in its IR."""
    from purinec.compiler import check_differentiable, checked_layout, load_source
    from purinec.models.loader import check_model
    from purinec.program import updated_variables
    from purinec.targets import get_target

    with warnings.catch_warnings():  # (compile() warns of what it finds again)
        warnings.simplefilter("ignore")
        checked_layout(target, trace=trace, **spread)
    get_target(target).check_runnable()
    if not model.endswith((".pir", ".onnx")):
        check_model(model, batch, given_later=DATA_ARGUMENTS)
        return default_sgd(**solver_options)
    source = load_source(model, batch)
    if model.endswith(".onnx"):
        source.lower("train")  # a model without one output of class scores cannot train
        return default_sgd(**solver_options)
    if updated_variables(source):
        refuse_options(solver_options, SOLVER_OPTIONS, f"{model} is a training iteration "
                       f"with its solver in its IR; edit the sgd nodes' attributes to "
                       f"change it")
        return None
    solver = default_sgd(**solver_options)
    check_differentiable(source, solver, model)
    return solver


def _training_program(model: str, data: Dataset, start: Checkpoint, report: Report,
                      solver: SGD | None, *, target: str, batch: int | None, trace: Any,
                      spread: dict) -> tuple[Program, Dataset]:
    """MODEL's training iteration compiled for ``data`` with ``solver``, and the data
    it was compiled for (see `_compiled`)."""
    began = time.perf_counter()

    def compiled(data: Dataset) -> Program:
        return _compiled_for(data, model, target, solver, batch, start.seed, trace, spread)

    program, data = _compiled(compiled, model, data, start.data, report)
    wait_for_every_rank()
    _report_ready(program, "compiled", time.perf_counter() - began, report)
    return program, data


def _report_ready(program: Program, how: str, seconds: float, report: Report) -> None:
    report(f"{how} {program.ir.name} for target {program.target}{on_devices(program)} in "
           f"{seconds:.2f} s ({len(program.ir.nodes)} nodes, "
           f"{sum(p.size for p in program.params.values()):,} parameters)")


def _trainable_artifact(path: str, target: str | None, trace: Any) -> Program:
    program = load(path, target, trace=trace)
    with _closed_on_failure(program):
        check_spans_the_job(program, path)
        if not program.trainable:
            raise PurinecError(f"{path} holds an inference program; compile it with "
                               "`purinec compile MODEL --train -o FILE.purine` to train it")
    wait_for_every_rank()
    return program


def _compiled(compiled: Callable[[Dataset], Program], model: str, data: Dataset,
              data_spec: str, report: Report) -> tuple[Program, Dataset]:
    """``compiled(data)``, and the data: a built-in set that a model cannot take at its
    own size (images too small for its layers) comes at the model's default input shape
    instead."""
    try:
        return compiled(data), data
    except ShapeError as err:
        shape = _default_input_shape(model, data_spec)
        if shape is None or shape == data.input_shape:
            raise
        scaled = resized(data, shape)
        try:  # at the model's own input shape, if the size was what it could not take
            program = compiled(scaled)
        except ShapeError:
            raise err from None  # a bug of the model's, whatever the size
        report(f"{data.name}: images scaled to {list(shape)}: {model} cannot take them at "
               f"{list(data.input_shape)} ({err})")
        return program, scaled


def _compiled_for(data: Dataset, model: str, target: str, solver: SGD | None,
                  batch: int | None, seed: int, trace: Any, spread: dict) -> Program:
    """MODEL's training iteration, built for ``data`` where its builder takes the data
    set's input shape and classes."""
    from purinec.compiler import compile
    from purinec.models.loader import offered_args

    model_kwargs = {}
    if not model.endswith((".pir", ".onnx")):  # the data set's, where build() takes them
        model_kwargs = offered_args(model, {name: getattr(data, name)
                                            for name in DATA_ARGUMENTS})
    return compile(model, target=target, train=solver, batch=batch, seed=seed, trace=trace,
                   **spread_options(model, batch, **spread, **model_kwargs), **model_kwargs)


def _default_input_shape(model: str, data_spec: str) -> tuple[int, ...] | None:
    """The input shape to make the built-in data set ``data_spec`` at for ``model``, if
    the model declares one (None for data read from files: those are what they are)."""
    from purinec.models.loader import default_input_shape

    if data_spec not in DATASETS or model.endswith((".pir", ".onnx")):
        return None
    return default_input_shape(model)


def _trained(program: Program, data: Dataset, where: Checkpoint, model: str, epochs: int,
             checkpoint: str | os.PathLike | None, trace: Any, progress: bool,
             report: Report) -> TrainResult:
    """``program`` trained on ``data``, fitted to it first, from ``where`` until
    ``epochs`` epochs are done; the program is closed after."""
    checkpoint = checkpoint and os.fspath(checkpoint)
    with contextlib.closing(program):
        data = _built_in_data_for(program, where.data, data, report)
        _check_fits(program, data, model)
        batch = program.ir.input(images_input(program.ir)).type.shape[0]
        began = time.perf_counter()
        result = train(program, data, epochs, batch, seed=where.seed, progress=progress,
                       start_epoch=where.epoch, on_epoch_end=_end_of_epoch(
                           program, where, epochs, checkpoint, trace, report))
    report(f"trained {len(result.epochs)} epoch(s) in {time.perf_counter() - began:.1f} s: "
           f"test accuracy {result.final.test_accuracy:.4f}")
    return result


def _end_of_epoch(program: Program, where: Checkpoint, epochs: int, checkpoint: str | None,
                  trace: Any, report: Report) -> Callable[[EpochResult], None]:
    """What follows every epoch: its line reported and, with ``checkpoint``, the
    checkpoint written."""
    def end(e: EpochResult) -> None:
        if trace is not None and e.epoch < epochs:
            trace.clear()  # the timeline shows the last epoch: memory stays bounded
        report(_epoch_line(e))
        if checkpoint:
            _save_checkpoint(program, replace(where, epoch=e.epoch), checkpoint, report)
    return end


def _epoch_line(e: EpochResult) -> str:
    train_accuracy = ("" if np.isnan(e.train_accuracy)  # (a model with no accuracy op)
                      else f"  train accuracy {e.train_accuracy:.4f}")
    return (f"epoch {e.epoch:3d}  loss {e.loss:.4f}{train_accuracy}"
            f"  test accuracy {e.test_accuracy:.4f}")


def _save_checkpoint(program: Program, where: Checkpoint, path: str, report: Report) -> None:
    program.gather_weights()  # every rank: weights may be split over ranks
    if is_reporting_rank():  # every rank holds the same weights: one writes them
        where.save(program, path)
        report(f"             checkpoint {path} (epoch {where.epoch})")


def _built_in_data_for(program: Program, data_spec: str, data: Dataset,
                       report: Report) -> Dataset:
    """A built-in data set scaled up to the images ``program`` takes (one loaded or
    resumed from a model that needed larger images than the built-in sets'). Smaller
    is not made: `_check_fits` refuses the program."""
    try:
        shape = tuple(program.ir.input(images_input(program.ir)).type.shape[1:])
    except KeyError:
        return data  # _check_fits says what is wrong
    have = data.input_shape
    if (data_spec not in DATASETS or shape == have or len(shape) != 3 or
            shape[1] < have[1] or shape[2] < have[2]):
        return data
    report(f"{data.name}: images scaled to {list(shape)}: what {program.ir.name} takes")
    return resized(data, shape)


def _check_fits(program: Program, data: Dataset, model: str) -> None:
    """The program's data input and logits must fit the data set's images and classes,
    and its inference graph must give the logits that evaluating reads."""
    try:
        shape = program.ir.input(images_input(program.ir)).type.shape
    except KeyError:
        raise DataError(f"{program.ir.name} has no input named data to feed images to") from None
    if scores_output(program.eval_ir) not in dict(program.eval_ir.outputs):
        raise DataError(f"{model}: its inference graph has no output named logits, which "
                        f"the test accuracy reads (it has "
                        f"{', '.join(n for n, _ in program.eval_ir.outputs) or 'none'}); "
                        f"name the blob of class scores logits")
    if tuple(shape[1:]) != data.input_shape:
        raise DataError(f"{program.ir.name} takes images of shape {list(shape[1:])}, but "
                        f"{data.name} has {list(data.input_shape)}; "
                        + _fit_hint(model, "input_shape", "--input-shape C,H,W"))
    classes = num_classes(program.eval_ir)
    if classes is not None and classes < data.num_classes:
        raise DataError(f"{program.ir.name} predicts {classes} classes, but {data.name} has "
                        f"{data.num_classes}; "
                        + _fit_hint(model, "num_classes", f"--num-classes {data.num_classes}"))


def _fit_hint(model: str, argument: str, option: str) -> str:
    """How to make ``model`` fit a data set: train passes the data set's ``argument``
    to a build() that takes it; a compiled model is compiled again with ``option``."""
    if model.endswith(".py"):
        return (f"let build() in {model} take {argument} (train passes the data set's), "
                f"or fix the model for this data")
    return (f"compile the model for this data set (purinec compile MODEL {option} --train "
            f"-o FILE.purine)")
