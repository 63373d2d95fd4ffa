"""Bad input to the command line: a clear error before any work, nothing run that was not
asked for, nothing left behind. Run in this process on the reference target (no kernels
to compile), so quick enough for every test run."""

import json
import os
import time
import zipfile

import numpy as np
import pytest

import purinec
from purinec.cli import build_parser
from purinec.cli.common import progress_style
from purinec.codegen import progress
from purinec.errors import ArtifactError, ModelError, PurinecError
from purinec.models import load_model
from purinec.targets import TARGETS, Target
from purinec.train import MAX_EPOCHS, MAX_SEED, Checkpoint, resume_training, train_model
from tests.cli.test_cli import assert_clean_error, purinec_here

BROKEN = "def build(batch=8:\n    pass\n"
FAILS_IN_BUILD = "def build(batch=8):\n    return undefined_layer(batch)\n"


@pytest.fixture
def no_data(monkeypatch):
    """Loading a data set fails the test: train must refuse what it can before."""
    def load_dataset(*args, **kwargs):
        raise AssertionError("the data set was loaded before the error")

    monkeypatch.setattr("purinec.train.load_dataset", load_dataset)


@pytest.mark.parametrize("args, fragment", [
    (["lenett"], "unknown model 'lenett'; the zoo has cifar_quick, convnet, inception"),
    (["{tmp}/broken.py"], "broken.py:1: syntax error in model file"),
    (["{tmp}/fails.py"], "fails.py:2: NameError: name 'undefined_layer' is not defined"),
    (["{tmp}/absent.py"], "model file {tmp}/absent.py does not exist"),
    (["mlp", "--devices", "cpu:0,cpu:0"], "devices must be distinct"),
    (["mlp", "--devices", "tpu:0"], "no device kind tpu"),
    (["mlp", "--devices", "gpu:0"], "target cpu runs on cpu devices, not on gpu:0"),
    (["mlp", "--target", "gpu"], "unknown target 'gpu'; available: reference, cpu"),
    (["mlp", "--parallel", "pipeline"], "parallel pipeline needs several devices"),
    (["mlp", "--target", "reference", "--timeline", "{tmp}/t.svg"],
     "target reference records no traces"),
    (["mlp", "--checkpoint", "{tmp}/no/ck.purine"], "directory {tmp}/no does not exist"),
    (["mlp", "--timeline", "{tmp}/no/t.svg"], "directory {tmp}/no does not exist"),
    (["mlp", "--lr", "nan"], "SGD: lr must be finite"),
    (["mlp", "--micro-batches", "2"], "micro-batches (2) go with the pipeline strategy"),
])
def test_train_refuses_before_loading_data(capsys, tmp_path, no_data, args, fragment):
    (tmp_path / "broken.py").write_text(BROKEN)
    (tmp_path / "fails.py").write_text(FAILS_IN_BUILD)
    args = [a.format(tmp=tmp_path) for a in args]
    result = purinec_here(capsys, "train", *args)
    assert_clean_error(result, fragment.format(tmp=tmp_path))
    assert result.stdout == ""  # not even the data set's line


def test_train_dump_and_compile_say_the_same_of_an_unknown_model(capsys, tmp_path, no_data):
    said = {purinec_here(capsys, *command, "lenett").stderr
            for command in (["train"], ["dump"], ["compile", "-o", tmp_path / "x.purine"])}
    assert len(said) == 1 and "unknown model 'lenett'; the zoo has" in said.pop()


def test_a_build_that_needs_the_data_sets_shape_is_built_with_it(capsys, tmp_path):
    """Checked before the data, such a build() is looked up but not called."""
    (tmp_path / "needs.py").write_text(
        "from purinec.models import mlp\n"
        "def build(input_shape, batch=16, num_classes=10):\n"
        "    return mlp(batch=batch, input_shape=input_shape, num_classes=num_classes)\n")
    result = purinec_here(capsys, "train", tmp_path / "needs.py", "--data", "synthetic",
                          "--target", "reference", "--epochs", "1", "--quiet")
    assert result.returncode == 0, result.stderr
    assert "epoch   1" in result.stdout


# -- what a model argument is ----------------------------------------------------------

WRITES_AND_PRINTS = "print('RAN')\nopen('ran.txt', 'w').write('ran')\n"


@pytest.mark.parametrize("name, content, fragment", [
    ("notes.txt", WRITES_AND_PRINTS, "notes.txt is not a model, and was not run: a model is "
                                     "a zoo name (cifar_quick"),
    ("README.md", "# model\n\n" + WRITES_AND_PRINTS, "README.md is not a model, and was not run"),
    ("model", WRITES_AND_PRINTS, "model is not a model, and was not run"),
    ("x.npy", None, "x.npy is a NumPy array, not a model (an input: purinec run MODEL "
                    "--input NAME=FILE.npy)"),
    ("weights.bin", None, "weights.bin is a NumPy array, not a model"),
    ("y.npz", None, "y.npz is a NumPy archive, not a model"),
    ("ck.zip", None, "ck.zip is a zip archive, not a model (a compiled artifact must be "
                     "named FILE.purine)"),
])
@pytest.mark.parametrize("command", [["run"], ["train"], ["dump"],
                                     ["compile", "-o", "out.purine"]])
def test_only_a_py_file_is_run_as_a_model(capsys, tmp_path, monkeypatch, no_data, command,
                                          name, content, fragment):
    monkeypatch.chdir(tmp_path)
    if content is not None:
        (tmp_path / name).write_text(content)
    elif name.endswith(".npz"):
        np.savez(tmp_path / name, a=np.ones(3))
    elif name.endswith(".zip"):
        with zipfile.ZipFile(tmp_path / name, "w") as zf:
            zf.writestr("manifest.json", "{}")
    else:
        with open(tmp_path / name, "wb") as f:  # (np.save would add .npy to weights.bin)
            np.save(f, np.ones(3))
    result = purinec_here(capsys, *command, name)
    assert_clean_error(result, fragment)
    assert "RAN" not in result.stdout and not (tmp_path / "ran.txt").exists()
    assert sorted(os.listdir(tmp_path)) == [name]


def test_from_python_too_a_file_other_than_py_is_not_run(tmp_path):
    (tmp_path / "notes.txt").write_text(WRITES_AND_PRINTS)
    for call in (purinec.compile, load_model):
        with pytest.raises(ModelError, match="notes.txt is not a model, and was not run"):
            call(str(tmp_path / "notes.txt"))
    assert not (tmp_path / "ran.txt").exists()


# -- dumps of a training pipeline ------------------------------------------------------

def dumped(capsys, tmp_path, stage):
    path = tmp_path / f"mlp.{stage}.pir"
    result = purinec_here(capsys, "dump", "mlp", "--train", "--stage", stage, "--batch", "8",
                          "--input-shape", "1,8,8", "--target", "reference", "-o", path)
    assert result.returncode == 0, result.stderr
    return path


def test_an_autodiff_stage_dump_says_which_dump_trains(capsys, tmp_path, no_data):
    path = dumped(capsys, tmp_path, "autodiff")
    for command in (["train", path], ["compile", path, "--train", "-o", tmp_path / "x.purine"],
                    ["dump", path, "--train"]):
        result = purinec_here(capsys, *command)
        assert_clean_error(result, f"{path}: graph mlp.train is differentiated already (it "
                                   "returns grad.ip1.weight, grad.ip1.bias, grad.ip2.weight, "
                                   "...) but has no solver: a dump at --stage autodiff",
                           "Dump the model at --stage optimizer or a later stage",
                           "which purinec train trains as it is")
        assert result.stdout == ""
    assert not (tmp_path / "x.purine").exists()


@pytest.mark.parametrize("stage", ["optimizer", "cse"])
def test_a_dump_at_the_optimizer_stage_or_later_trains_as_it_is(capsys, tmp_path, stage):
    result = purinec_here(capsys, "train", dumped(capsys, tmp_path, stage), "--data",
                          "synthetic", "--target", "reference", "--epochs", "1", "--quiet")
    assert result.returncode == 0, result.stderr
    assert "epoch   1  loss" in result.stdout


# -- traces ----------------------------------------------------------------------------

def test_a_target_without_traces_names_those_with(capsys, tmp_path, monkeypatch, no_data):
    class Recording(Target):
        name = "recording"
        records_traces = True

    monkeypatch.setitem(TARGETS, "recording", Recording())
    for command in (["train", "mlp", "--timeline", tmp_path / "t.svg"],
                    ["run", "mlp", "--trace", tmp_path / "t.json"],
                    ["run", "mlp", "--timeline", tmp_path / "t.png"]):
        result = purinec_here(capsys, *command, "--target", "reference")
        assert_clean_error(result, "target reference records no traces, which --trace and "
                                   "--timeline (trace=) need; run without them, or on a "
                                   "target that records them: cpu, recording")
        assert result.stdout == ""
    assert not list(tmp_path.iterdir())


# -- checkpoints -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def training_program():
    program = purinec.compile("mlp", train=purinec.SGD(), batch=8, input_shape=(1, 8, 8))
    yield program
    program.close()


@pytest.mark.parametrize("position, fragment", [
    ({"epoch": -1}, "its epoch is -1, not a whole number from 0 to 1000000000"),
    ({"seed": -5}, f"its seed is -5, not a whole number from 0 to {MAX_SEED}"),
    ({"seed": MAX_SEED + 1}, f"its seed is {MAX_SEED + 1}, not a whole number"),
    ({"epoch": MAX_EPOCHS + 1}, f"its epoch is {MAX_EPOCHS + 1}, not a whole number"),
    ({"epoch": 1.5}, "its epoch is 1.5, not a whole number"),
    ({"epoch": True}, "its epoch is True, not a whole number"),
    ({"seed": "0"}, "its seed is '0', not a whole number"),
    ({"seed": 10 ** 4000}, "its seed is 1000"),  # (shortened, not all 4001 digits)
    ({"data": ""}, "its data '' is not the name of a data set"),
    ({"data": "x" * 5000}, "its data 'xxxxxx"),
    ({"data": None}, "its data None is not the name of a data set"),
])
def test_a_checkpoint_out_of_bounds_is_refused_on_resume(capsys, tmp_path, training_program,
                                                       no_data, position, fragment):
    path = tmp_path / "ck.purine"
    saved = {"epoch": 1, "seed": 0, "data": "synthetic", **position}
    training_program.save(path, metadata={"checkpoint": saved})
    result = purinec_here(capsys, "train", "--resume", path, "--epochs", "3")
    assert_clean_error(result, f"{path}: the checkpoint entry of its manifest is malformed: "
                               f"{fragment}", "resume from another one")
    assert len(result.stderr) < 1000 and result.stdout == ""
    with pytest.raises(ArtifactError, match="malformed"):
        resume_training(path, epochs=3)


def test_a_checkpoint_with_other_fields_is_refused(capsys, tmp_path, training_program):
    path = tmp_path / "ck.purine"
    training_program.save(path, metadata={"checkpoint": {"epoch": 1, "seed": 0}})
    assert_clean_error(purinec_here(capsys, "train", "--resume", path),
                       "its fields are ['epoch', 'seed'], not epoch, seed, data")


def test_a_checkpoint_within_bounds_resumes(tmp_path, training_program):
    path = tmp_path / "ck.purine"
    Checkpoint(epoch=1, seed=MAX_SEED, data="synthetic").save(training_program, path)
    manifest = json.loads(zipfile.ZipFile(path).read("manifest.json"))
    assert manifest["metadata"]["checkpoint"]["seed"] == MAX_SEED
    result = resume_training(path, epochs=2)
    assert [e.epoch for e in result.epochs] == [2]


@pytest.mark.parametrize("args, fragment", [
    (["--seed", "-1"], "'-1' is not an integer from 0 to"),
    (["--seed", str(MAX_SEED + 1)], "is not an integer from 0 to"),
    (["--epochs", "0"], f"'0' is not an integer from 1 to {MAX_EPOCHS}"),
])
def test_seeds_and_epochs_are_what_a_checkpoint_can_hold(capsys, args, fragment):
    with pytest.raises(SystemExit):
        purinec_here(capsys, "train", "mlp", *args)
    assert fragment in capsys.readouterr().err
    for option, value in (("seed", -1), ("seed", MAX_SEED + 1), ("epochs", 0)):
        with pytest.raises(PurinecError, match=f"{option}={value}: give a whole number"):
            train_model("mlp", **{option: value})


# -- progress in a log -----------------------------------------------------------------

def test_progress_is_a_bar_on_a_terminal_and_lines_in_a_log(monkeypatch):
    parser = build_parser()
    for tty, options, style in ((True, [], progress.BAR), (False, [], progress.LINES),
                                (False, ["--progress"], progress.BAR),
                                (True, ["--quiet"], None), (False, ["--quiet"], None)):
        monkeypatch.setattr("sys.stderr.isatty", lambda: tty)
        assert progress_style(parser.parse_args(["train", "mlp", *options])) == style
    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    assert progress_style(parser.parse_args(["compile", "mlp", "-o", "x.purine"])) == \
        progress.LINES


def counted(capsys, seconds, kernels=37, cached=12):
    """What a log shows of a compile that takes ``seconds``."""
    with progress.kernel_progress(progress.LINES):
        with progress.kernel_counter(kernels + 3, "lenet.train", kernels, cached) as counter:
            time.sleep(seconds)
            counter.update()
    return capsys.readouterr().err.splitlines()


def test_a_log_hears_of_a_long_compile_and_its_end(capsys, monkeypatch):
    monkeypatch.setattr(progress, "LINE_AFTER_S", 0.05)
    lines = counted(capsys, 0.3)
    assert lines[0] == "purinec: compiling 37 kernels of lenet.train (12 in the kernel cache) ..."
    assert lines[1].startswith("purinec: compiled 37 kernels of lenet.train in 0.")
    assert lines[1].endswith(" s (12 cached)") and len(lines) == 2
    assert counted(capsys, 0.3, cached=0)[0].endswith("(cold kernel cache) ...")


def test_a_quick_compile_writes_no_line(capsys, monkeypatch):
    monkeypatch.setattr(progress, "LINE_AFTER_S", 5)
    assert counted(capsys, 0.01) == []


def test_a_failed_compile_writes_no_summary(capsys, monkeypatch):
    monkeypatch.setattr(progress, "LINE_AFTER_S", 0.01)
    with pytest.raises(RuntimeError):
        with progress.kernel_progress(progress.LINES):
            with progress.kernel_counter(2, "g", 2, 0):
                time.sleep(0.2)
                raise RuntimeError("kernel failed")
    assert capsys.readouterr().err.splitlines() == [
        "purinec: compiling 2 kernels of g (cold kernel cache) ..."]


# -- folders left behind ---------------------------------------------------------------

@pytest.fixture
def failing_graphviz(tmp_path, monkeypatch):
    dot = tmp_path / "dot"
    dot.write_text("#!/bin/sh\necho 'dot: cannot draw' >&2\nexit 3\n")
    dot.chmod(0o755)
    monkeypatch.setattr("purinec.viz.shutil.which", lambda name: str(dot))


def test_a_failed_dump_leaves_no_folder_it_made(capsys, tmp_path, monkeypatch,
                                                failing_graphviz):
    monkeypatch.chdir(tmp_path)
    for output in ("pics/", "pics/a/b"):
        result = purinec_here(capsys, "dump", "mlp", "--target", "reference", "--format",
                              "svg", "-o", output)
        assert_clean_error(result, "Graphviz", "failed with exit status 3")
        assert not (tmp_path / "pics").exists()
    (tmp_path / "mine").mkdir()  # a folder it did not make stays
    assert purinec_here(capsys, "dump", "mlp", "--target", "reference", "--format", "svg",
                        "-o", "mine/pics").returncode == 1
    assert sorted(os.listdir(tmp_path)) == ["dot", "mine"] and not os.listdir("mine")


def test_a_folder_that_cannot_be_made_is_a_clear_error(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    result = purinec_here(capsys, "dump", "mlp", "--target", "reference", "--stage", "all",
                          "-o", tmp_path / "file" / "pics")
    assert_clean_error(result, f"cannot make folder {tmp_path / 'file' / 'pics'}: Not a "
                               f"directory")


def test_missing_graphviz_is_said_before_any_folder_is_made(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("purinec.viz.shutil.which", lambda name: None)
    result = purinec_here(capsys, "dump", "mlp", "--format", "png", "-o", tmp_path / "pics")
    assert_clean_error(result, "drawing png needs Graphviz's `dot` program")
    assert not list(tmp_path.iterdir())
