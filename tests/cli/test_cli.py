"""The `purinec` command, run as a user runs it: in a separate process."""

import argparse
import json
import pathlib
import re
import signal
import subprocess
import sys
import types
import zipfile

import numpy as np
import pytest

import purinec as purinec_api
from purinec.cli import build_parser, main
from purinec.cli.dump import FUSION_KINDS_LEGEND
from purinec.ir import parse
from purinec.runtime.memory import is_view
from purinec.train import Checkpoint, resume_training, train_model

REPO = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # runs the command end to end, mostly in subprocesses

SMALL_MODEL = """
from purinec.bigraph import Accuracy, Blob, InnerProduct, Net, ReLU, SoftmaxWithLoss


def build(batch=16, input_shape=(1, 8, 8), num_classes=10):
    with Net("small") as net:
        data = Blob("data", (batch, *input_shape))
        label = Blob("label", (batch,), "i32")
        logits = (data >> InnerProduct("ip1", 16) >> ReLU("relu1")
                  >> InnerProduct("ip2", num_classes) >> Blob("logits"))
        loss = [logits, label] >> SoftmaxWithLoss("loss")
        accuracy = [logits, label] >> Accuracy("accuracy")
        net.outputs = [logits, loss, accuracy]
    return net
"""


def purinec(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "purinec", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


def purinec_here(capsys, *args):
    """The command run in this process (quicker than a new one: for the error cases)."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return types.SimpleNamespace(returncode=code, stdout=out, stderr=err)


# What a command may write to stderr before an error: a compile's progress in a log,
# once it has taken a few seconds (`purinec.codegen.progress`, a busy machine's).
PROGRESS = ("purinec: compiling ", "purinec: compiled ")


def assert_clean_error(result, *fragments):
    """Exit non-zero, one paragraph on stderr naming what and where (after progress
    lines, if any), no traceback."""
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    *before, error = result.stderr.strip().splitlines() or [""]
    assert all(line.startswith(PROGRESS) for line in before), result.stderr
    assert error.startswith("purinec: error: "), result.stderr
    for fragment in fragments:
        assert fragment in error, result.stderr


def test_help_lists_commands_and_stages():
    top = purinec("--help")
    assert top.returncode == 0
    for command in ("dump", "compile", "run", "train", "export"):
        assert command in top.stdout
    version = purinec("--version")
    assert version.returncode == 0 and version.stdout == f"purinec {purinec_api.__version__}\n"
    dump = purinec("dump", "--help")
    for stage in ("lower", "infer_shapes", "verify", "autodiff", "optimizer", "dce", "cse"):
        assert stage in dump.stdout


def test_an_option_the_command_lacks_is_named_with_the_commands_usage(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["train", "mlp", "--trace", "t.json"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: purinec train ")
    assert err.endswith("purinec train: error: unrecognized arguments: --trace t.json\n")


def test_a_reader_that_stops_early_ends_the_command_quietly():
    """``purinec dump ... | head``: no traceback when head has read enough. (The dump,
    200 kB, is more than a pipe holds: the writer is still writing when it closes.)"""
    dump = subprocess.Popen([sys.executable, "-m", "purinec", "dump", "inception", "--train",
                             "--stage", "all", "--target", "reference"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert dump.stdout.readline().startswith("// ---- inception.train.00-lower.pir")
    dump.stdout.close()
    assert dump.wait(timeout=300) == 128 + signal.SIGPIPE
    assert dump.stderr.read() == ""
    dump.stderr.close()


CRASH = """
import ctypes
from purinec import cli
def crashing_kernel():
    ctypes.string_at(0)  # as a kernel reading an address it must not
cli.main = lambda: crashing_kernel()
cli.command()
"""


def test_a_crash_in_machine_code_prints_where_each_thread_was():
    crash = subprocess.run([sys.executable, "-c", CRASH], cwd=REPO, capture_output=True,
                           text=True, timeout=120)
    assert crash.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in crash.stderr
    assert "in crashing_kernel" in crash.stderr


def test_dump_prints_parsable_ir():
    result = purinec("dump", "lenet", "--batch", "2")
    assert result.returncode == 0, result.stderr
    graph = parse(result.stdout)
    assert graph.name == "lenet"
    assert [name for name, _ in graph.outputs] == ["logits"]


def test_dump_all_stages_to_files(tmp_path):
    result = purinec("dump", "mlp", "--train", "--batch", "2", "--stage", "all", "-o",
                     str(tmp_path), "--target", "reference")
    assert result.returncode == 0, result.stderr
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == [
        "mlp.train.00-lower.pir", "mlp.train.01-infer_shapes.pir", "mlp.train.02-verify.pir",
        "mlp.train.03-autodiff.pir", "mlp.train.04-optimizer.pir", "mlp.train.05-dce.pir",
        "mlp.train.06-cse.pir"]
    for f in files:
        assert f"wrote {f}" in result.stdout
        text = f.read_text()
        assert str(parse(text)) + "\n" == text
    assert "sgd(" in files[-1].read_text()


def test_dump_of_one_stage_writes_the_file_o_names(tmp_path, capsys):
    pir, dot = tmp_path / "mlp.pir", tmp_path / "mlp.dot"
    result = purinec_here(capsys, "dump", "mlp", "--target", "reference", "-o", pir)
    assert result.returncode == 0 and result.stdout == f"wrote {pir}\n"
    assert parse(pir.read_text()).name == "mlp"
    assert purinec_here(capsys, "dump", "mlp", "--target", "reference", "--format", "dot",
                        "-o", dot).returncode == 0
    assert dot.read_text().startswith('digraph "mlp"')
    (tmp_path / "folder.pir").mkdir()  # a directory keeps its meaning, whatever its name
    assert purinec_here(capsys, "dump", "mlp", "--target", "reference", "-o",
                        tmp_path / "folder.pir").returncode == 0
    assert [p.name for p in (tmp_path / "folder.pir").iterdir()] == ["mlp.04-cse.pir"]
    for args, fragment in [
            (("--stage", "all", "-o", pir), "names one file, but this dump writes several"),
            (("--stage", "fuse", "--explain", "-o", pir), "give -o a directory"),
            (("--format", "dot", "-o", pir), "--format dot writes .dot files"),
            (("-o", tmp_path / "missing" / "x.pir"), "does not exist")]:
        assert_clean_error(purinec_here(capsys, "dump", "mlp", *args), fragment)


def test_dump_cpu_pipeline_fuses_and_writes_kernels(tmp_path):
    result = purinec("dump", "mlp", "--train", "--batch", "2", "--stage", "all", "-o",
                     str(tmp_path), "--explain")
    assert result.returncode == 0, result.stderr
    fused = (tmp_path / "mlp.train.07-fuse.pir").read_text()
    assert str(parse(fused)) + "\n" == fused
    assert "fused(" in fused and "kernel=\"fused_matmul_bias_add_relu\"" in fused
    explained = (tmp_path / "mlp.train.fuse-explain.txt").read_text()
    assert "%ip1.flatten -> %ip1.matmul" in explained or "reshape" in explained
    assert explained.startswith(FUSION_KINDS_LEGEND + "\n# %")  # what the kinds mean
    kernels = sorted((tmp_path / "mlp.train.kernels").iterdir())
    graph = parse(fused)
    # one kernel per node, fused ones included, but views (the flatten), which run none
    assert len(kernels) == len([node for node in graph.nodes if not is_view(node)])
    source = (tmp_path / "mlp.train.kernels" /
              "fused_matmul_bias_add_relu.ip1.py").read_text()
    assert "@njit" in source or "njit(" in source
    assert "%ip1.matmul = matmul(" in source  # says which IR nodes it came from
    for path in kernels:
        assert f"wrote {path}" in result.stdout


def test_dump_kernel_llvm_and_stage_errors():
    llvm = purinec("dump", "mlp", "--batch", "2", "--stage", "kernels", "--llvm")
    assert llvm.returncode == 0, llvm.stderr
    assert "define " in llvm.stdout
    assert_clean_error(purinec("dump", "mlp", "--stage", "fuse", "--target", "reference"),
                       "stage fuse does not run for target reference")
    assert_clean_error(purinec("dump", "mlp", "--stage", "autodiff"),
                       "stage autodiff runs only with --train")
    assert_clean_error(purinec("dump", "mlp", "--train", "--stage", "panels"),
                       "stage panels runs only without --train (inference graphs)")
    assert_clean_error(purinec("dump", "mlp", "--llvm"), "--llvm, --asm and --ptx go with")


def test_dump_one_stage():
    result = purinec("dump", "mlp", "--train", "--batch", "2", "--stage", "autodiff")
    assert result.returncode == 0, result.stderr
    assert "grad.ip1.weight" in result.stdout and "sgd(" not in result.stdout


def test_dump_builds_the_model_for_the_input_shape_and_classes_given(capsys):
    """As train does for its data set: mlp for digits' 8x8 images and 4 classes."""
    result = purinec_here(capsys, "dump", "mlp", "--train", "--batch", "2", "--stage",
                          "autodiff", "--input-shape", "1,8,8", "--num-classes", "4")
    assert result.returncode == 0, result.stderr
    assert "%data: f32[2,1,8,8]" in result.stdout
    assert "%ip1.weight: f32[512,64]" in result.stdout
    assert "%ip3.weight: f32[4,512]" in result.stdout
    assert_clean_error(purinec_here(capsys, "dump", "lenet", "--input-shape", "1,8,8"),
                       "layer conv2", "does not fit input f32[64,20,2,2]")


def test_unknown_stage_and_model_are_clear_errors():
    assert_clean_error(purinec("dump", "mlp", "--stage", "fission"), "unknown stage 'fission'")
    assert_clean_error(purinec("dump", "resnet9000"), "resnet9000", "lenet")


def test_malformed_pir_names_line_and_column(tmp_path):
    path = tmp_path / "bad.pir"
    path.write_text("graph g(%x: f32[2] @cpu:0) {\n  %y = relu(%x : f32[2] @cpu:0\n"
                    "  return %y\n}\n")
    assert_clean_error(purinec("dump", str(path)), f"{path}:2:")


def test_unknown_op_in_pir(tmp_path):
    path = tmp_path / "unknown.pir"
    path.write_text("graph g(%x: f32[2] @cpu:0) {\n  %y = frobnicate(%x) : f32[2] @cpu:0\n"
                    "  return %y\n}\n")
    assert_clean_error(purinec("dump", str(path)), "frobnicate", f"{path}:2:")


def test_cycle_in_pir(tmp_path):
    path = tmp_path / "cycle.pir"
    path.write_text("graph g(%x: f32[2] @cpu:0) {\n"
                    "  %a = add(%x, %b) : f32[2] @cpu:0\n"
                    "  %b = relu(%a) : f32[2] @cpu:0\n"
                    "  return %b\n}\n")
    assert_clean_error(purinec("dump", str(path)), "%b", f"{path}:2:",
                       "defined later, at line 3", "cycle")


def test_type_error_in_pir_names_the_node(tmp_path):
    path = tmp_path / "types.pir"
    path.write_text("graph g(%x: f32[2,3] @cpu:0, %w: f32[4,2] @cpu:0) {\n"
                    "  %y = matmul(%x, %w) {trans_a=false, trans_b=true} : f32[2,4] @cpu:0\n"
                    "  return %y\n}\n")
    assert_clean_error(purinec("dump", str(path)), "matmul")


def test_a_declared_type_its_op_does_not_give_is_refused_not_replaced(tmp_path):
    path = tmp_path / "declared.pir"
    path.write_text("graph g(%x: f32[2,3] @cpu:0) {\n  %y = relu(%x) : f32[2,4] @cpu:0\n"
                    "  return %y\n}\n")
    for command in ("dump", "run"):
        assert_clean_error(purinec(command, str(path)), f"{path}:2: node %y = relu(%x)",
                           "output %y is declared f32[2,4] but op relu gives f32[2,3]")


def test_train_reports_loss_and_accuracy():
    result = purinec("train", "mlp", "--data", "synthetic", "--epochs", "2", "--batch", "32")
    assert result.returncode == 0, result.stderr
    assert "epoch   2" in result.stdout
    assert "test accuracy" in result.stdout
    accuracy = float(result.stdout.strip().rsplit(" ", 1)[-1])
    assert accuracy > 0.5  # separable synthetic data: far above the 0.1 of guessing


def test_cifar_quick_learns_from_images_in_0_to_1():
    """Caffe's fillers for cifar_quick expect pixels of 0-255: without its own scaling
    first, the loss stayed at ln 10 and test accuracy at chance however long it trained."""
    result = purinec("train", "cifar_quick", "--epochs", "8", "--lr", "0.01", "--quiet")
    assert result.returncode == 0, result.stderr
    accuracy = float(result.stdout.strip().rsplit(" ", 1)[-1])
    assert accuracy > 0.5, result.stdout  # digits: 0.77 measured, 0.08-0.11 before


def test_a_built_in_data_set_comes_at_the_size_a_model_needs(tmp_path):
    # lenet's convolutions need more than the 8x8 of the built-in sets: they are scaled
    # to its 28x28 input, for training and when its checkpoint resumes.
    common = ("--data", "synthetic", "--target", "cpu", "--quiet")
    first = purinec("train", "lenet", *common, "--epochs", "1",
                    "--checkpoint", tmp_path / "lenet.purine")
    assert first.returncode == 0, first.stderr
    assert "synthetic: images scaled to [1, 28, 28]: lenet cannot take them" in first.stdout
    assert "epoch   1" in first.stdout
    rest = purinec("train", "--resume", tmp_path / "lenet.purine", "--epochs", "2")
    assert rest.returncode == 0, rest.stderr
    assert "scaled to [1, 28, 28]: what lenet.train takes" in rest.stdout
    assert "epoch   2" in rest.stdout
    from tests.test_data import write_mnist

    mnist = tmp_path / "mnist"  # read from files: the data is what it is
    mnist.mkdir()
    write_mnist(mnist, size=8)
    assert_clean_error(purinec("train", "lenet", "--data", f"mnist:{mnist}"),
                       "kernel 5x5 does not fit")


@pytest.mark.parametrize("args, fragment", [
    (("train", "mlp", "--data", "imagenet"), "unknown data set 'imagenet'"),
    (("train", "mlp", "--data", "synthetic", "--lr", "-1"), "learning rate"),
    (("train", "mlp", "--data", "synthetic", "--target", "tpu"), "unknown target 'tpu'"),
])
def test_train_bad_options(args, fragment):
    assert_clean_error(purinec(*args), fragment)


def test_every_option_of_every_command_is_explained():
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    for name, parser in commands.choices.items():
        for action in parser._actions:
            assert action.help, f"purinec {name} {action.option_strings or action.dest}"
        text = parser.format_help()
        for action in parser._actions:
            for flag in action.option_strings:
                assert flag in text, (name, flag)


def test_help_fits_an_80_column_terminal(monkeypatch):
    """Descriptions and options wrap to the terminal; epilogs keep their lines as
    written (under 90 columns)."""
    monkeypatch.setenv("COLUMNS", "80")
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    for name, parser in commands.choices.items():
        text = parser.format_help()
        epilog = parser.epilog.strip().splitlines() if parser.epilog else []
        wrapped = [line for line in text.splitlines() if line not in epilog]
        assert max(map(len, wrapped)) <= 80, name
        assert max(map(len, epilog), default=0) <= 90, name
        if epilog:
            assert epilog[0] in text, name  # kept as written


# -- compile, run ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """mlp compiled once, with its training iteration, for 8x8 images in batches of 32."""
    path = tmp_path_factory.mktemp("artifact") / "mlp.purine"
    result = purinec("compile", "mlp", "--train", "--batch", "32", "--input-shape", "1,8,8",
                     "--num-classes", "10", "-o", path)
    assert result.returncode == 0, result.stderr
    return path, result.stdout


def test_compile_says_what_it_wrote(artifact):
    path, stdout = artifact
    program = purinec_api.load(path)
    parameters = sum(a.size for a in program.params.values())
    assert f"wrote {path} ({path.stat().st_size:,} bytes)" in stdout
    with zipfile.ZipFile(path) as archive:  # the cpu target's, the default
        kernels = [name for name in archive.namelist() if name.startswith("kernels/")]
    assert kernels and f"target cpu, {len(kernels)} kernel(s)" in stdout
    assert f"{parameters:,} parameters" in stdout
    assert "compiled mlp.train and mlp" in stdout
    assert program.ir.name == "mlp.train" and program.ir.input("data").type.shape == (32, 1, 8, 8)


def test_dump_an_artifact_shows_the_ir_it_holds(artifact, tmp_path):
    path, _ = artifact
    program = purinec_api.load(path)
    result = purinec("dump", path, "-o", tmp_path / "ir")
    assert result.returncode == 0, result.stderr
    for graph in (program.ir, program.eval_ir):
        written = tmp_path / "ir" / f"{graph.name}.pir"
        assert f"wrote {written}" in result.stdout
        assert written.read_text() == str(graph) + "\n"
    shown = purinec("dump", path)
    assert shown.returncode == 0 and str(program.ir) in shown.stdout
    assert "names one file" in purinec("dump", path, "-o", tmp_path / "one.pir").stderr
    refused = purinec("dump", path, "--stage", "autodiff", "--devices", "2")
    assert refused.returncode != 0
    assert ("is a compiled artifact" in refused.stderr and "--stage, --devices apply to a "
            "model" in refused.stderr), refused.stderr
    refused = purinec("dump", path, "--stage", "fuse")
    assert "--stage applies to a model" in refused.stderr, refused.stderr
    refused = purinec("dump", path, "--input-shape", "1,8,8")
    assert "--input-shape applies to a model" in refused.stderr, refused.stderr


def test_compile_then_run_in_another_process_gives_the_same_outputs(artifact, tmp_path):
    path, _ = artifact
    x = np.random.default_rng(0).random((32, 1, 8, 8), dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    result = purinec("run", path, "--input", f"data={tmp_path / 'x.npy'}", "--output",
                     tmp_path / "out.npz", "--iterations", "3")
    assert result.returncode == 0, result.stderr
    assert "random" not in result.stdout
    assert "logits: f32[32,10]  min " in result.stdout
    assert "3 iterations on target cpu: first " in result.stdout
    assert f"wrote {tmp_path / 'out.npz'} (logits)" in result.stdout
    with np.load(tmp_path / "out.npz", allow_pickle=False) as out:
        assert out.files == ["logits"]
        expected = purinec_api.load(path).run({"data": x})["logits"]
        assert out["logits"].tobytes() == expected.tobytes()


def test_run_without_inputs_uses_random_ones_and_says_so():
    result = purinec("run", "mlp", "--batch", "2")
    assert result.returncode == 0, result.stderr
    assert "input data: no --input given, using random f32[2,1,28,28]" in result.stdout
    assert "logits: f32[2,10]" in result.stdout
    assert "1 iteration on target cpu" in result.stdout


@pytest.mark.parametrize("args, fragments", [
    (("run", "{artifact}", "--target", "reference", "--trace", "t.json"),
     ["target reference records no traces", "records them: cpu"]),
    (("run", "{artifact}", "--batch", "8"), ["--batch", "fixed batch"]),
    (("run", "{artifact}", "--input", "data"), ["--input data: write NAME=FILE.npy"]),
    (("run", "{artifact}", "--input", "data=nothing.npy"), ["cannot read nothing.npy"]),
    (("run", "{artifact}", "--input", "dat={tmp}/x.npy"),
     ["--input dat: graph mlp has no input of that name; it takes data"]),
    (("run", "{artifact}", "--input", "data={tmp}/text.npy"),
     ["text.npy is not a .npy file of numbers (as numpy.save writes them)"]),
    (("run", "{tmp}/absent.purine"), ["cannot read", "absent.purine"]),
    (("run", "{tmp}/tampered.purine"), ["member weights.npz", "sha256"]),
    (("compile", "mlp", "-o", "{tmp}/mlp.zip"), ["name the artifact FILE.purine"]),
    (("compile", "mlp", "--lr", "0.1", "-o", "{tmp}/mlp.purine"),
     ["--lr: solver options apply only with --train"]),
])
def test_run_and_compile_errors(artifact, tmp_path, capsys, monkeypatch, args, fragments):
    path, _ = artifact
    monkeypatch.chdir(tmp_path)  # a relative path in args, written by mistake, lands here
    members = {}
    with zipfile.ZipFile(path) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    members["weights.npz"] = members["weights.npz"].replace(b"param/ip1.bias", b"param/ip1.bIas")
    with zipfile.ZipFile(tmp_path / "tampered.purine", "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    np.save(tmp_path / "x.npy", np.ones((2, 1, 28, 28), np.float32))
    (tmp_path / "text.npy").write_text("not numbers\n")
    args = [a.format(artifact=path, tmp=tmp_path) for a in args]
    result = purinec_here(capsys, *args)
    assert_clean_error(result, *fragments)
    assert "using random" not in result.stdout  # (said only once the inputs are good)
    assert not (tmp_path / "mlp.purine").exists()


# -- train, checkpoints -----------------------------------------------------------------

def test_train_a_compiled_artifact(tmp_path):
    (tmp_path / "small.py").write_text(SMALL_MODEL)
    purinec_api.compile(str(tmp_path / "small.py"), train=purinec_api.SGD(lr=0.05)).save(
        tmp_path / "small.purine")
    result = purinec("train", tmp_path / "small.purine", "--data", "synthetic", "--epochs", "1")
    assert result.returncode == 0, result.stderr
    assert "loaded small.train for target reference" in result.stdout
    assert re.search(r"epoch   1  loss \d\.\d{4}  train accuracy \d\.\d{4}  test accuracy",
                     result.stdout), result.stdout


def test_a_model_without_an_accuracy_output_reports_test_accuracy_alone(tmp_path):
    without = (SMALL_MODEL
               .replace('        accuracy = [logits, label] >> Accuracy("accuracy")\n', "")
               .replace("net.outputs = [logits, loss, accuracy]", "net.outputs = [logits, loss]"))
    assert "Accuracy(" not in without
    (tmp_path / "small.py").write_text(without)
    result = purinec("train", tmp_path / "small.py", "--data", "synthetic", "--epochs", "1")
    assert result.returncode == 0, result.stderr
    assert re.search(r"epoch   1  loss \d\.\d{4}  test accuracy \d\.\d{4}\n",
                     result.stdout), result.stdout


def weights(path):
    program = purinec_api.load(path)
    return {**dict(program.params), **{f"state.{k}": v for k, v in program.state.items()}}


def test_checkpoint_and_resume_give_the_uninterrupted_weights(tmp_path):
    model = tmp_path / "small.py"
    model.write_text(SMALL_MODEL)
    common = ("--data", "synthetic", "--seed", "5", "--lr", "0.02")
    whole = purinec("train", model, *common, "--epochs", "3",
                    "--checkpoint", tmp_path / "whole.purine")
    assert whole.returncode == 0, whole.stderr
    assert whole.stdout.count("checkpoint ") == 3
    part = purinec("train", model, *common, "--epochs", "1",
                   "--checkpoint", tmp_path / "part.purine")
    assert part.returncode == 0, part.stderr
    manifest = json.loads(zipfile.ZipFile(tmp_path / "part.purine").read("manifest.json"))
    assert manifest["metadata"]["checkpoint"] == {"epoch": 1, "seed": 5, "data": "synthetic"}

    other = purinec("train", "lenet", "--resume", tmp_path / "part.purine", "--epochs", "3")
    assert_clean_error(other, f"{tmp_path / 'part.purine'} holds small, not lenet")
    rest = purinec("train", "--resume", tmp_path / "part.purine", "--epochs", "3")
    assert rest.returncode == 0, rest.stderr
    assert f"from {tmp_path / 'part.purine'} after epoch 1" in rest.stdout
    assert "epoch   1 " not in rest.stdout and "epoch   3" in rest.stdout
    resumed, uninterrupted = weights(tmp_path / "part.purine"), weights(tmp_path / "whole.purine")
    assert resumed.keys() == uninterrupted.keys()
    for name, value in uninterrupted.items():
        assert resumed[name].tobytes() == value.tobytes(), name

    done = purinec("train", "--resume", tmp_path / "part.purine", "--epochs", "3")
    assert done.returncode == 0 and "nothing to train" in done.stdout


def saved_position(path):
    program, position = Checkpoint.load(path)
    program.close()
    return position


def test_train_model_and_resume_training_from_python(tmp_path):
    """The session behind `purinec train`, called from Python: it says what the command
    prints, and its checkpoint resumes where it stopped."""
    model = tmp_path / "small.py"
    model.write_text(SMALL_MODEL)
    checkpoint = tmp_path / "small.purine"
    said = []
    first = train_model(model, data="synthetic", epochs=1, target="reference",
                        checkpoint=checkpoint, report=said.append)
    assert [e.epoch for e in first.epochs] == [1]
    assert np.isfinite(first.final.loss) and first.final.test_accuracy > 0.5
    assert said[0].startswith("synthetic: 819 training and 205 test images")
    assert said[1].startswith("compiled small.train for target reference in ")
    assert said[2].startswith("epoch   1  loss ")
    assert said[3] == f"             checkpoint {checkpoint} (epoch 1)"
    assert said[4].startswith("trained 1 epoch(s) in ")
    assert saved_position(checkpoint) == Checkpoint(epoch=1, seed=0, data="synthetic")

    rest = resume_training(checkpoint, epochs=2)
    assert [e.epoch for e in rest.epochs] == [2] and np.isfinite(rest.final.loss)
    assert saved_position(checkpoint).epoch == 2
    assert resume_training(checkpoint, epochs=2).epochs == []  # nothing left to train
    with pytest.raises(purinec_api.PurinecError, match="was trained with --seed 0"):
        resume_training(checkpoint, epochs=3, seed=1)


@pytest.mark.parametrize("args, fragments", [
    (("train", "--resume", "{artifact}"), ["not a checkpoint"]),
    (("train", "{tmp}/inference.purine", "--data", "synthetic"), ["inference program"]),
    (("train", "{tmp}/small.purine", "--data", "synthetic"),
     ["takes images of shape [1, 4, 4], but synthetic has [1, 8, 8]", "--input-shape"]),
    (("train", "{artifact}", "--lr", "0.5", "--batch", "2"),
     ["--lr, --batch: ", "mlp.purine has its solver, batch and devices fixed in its IR"]),
    (("train", "--resume", "{artifact}", "--momentum", "0.5"), ["--momentum: "]),
    (("train", "--data", "synthetic"), ["give a MODEL to train, or --resume"]),
    (("train", "mlp", "--data", "mnist:{tmp}"), ["train-images-idx3-ubyte not found"]),
])
def test_train_errors(artifact, tmp_path, capsys, args, fragments):
    path, _ = artifact
    purinec_api.compile("mlp", batch=2, input_shape=(1, 8, 8)).save(tmp_path / "inference.purine")
    purinec_api.compile("mlp", train=purinec_api.SGD(), batch=2,
                        input_shape=(1, 4, 4)).save(tmp_path / "small.purine")
    np.save(tmp_path / "x.npy", np.ones((2, 1, 28, 28), np.float32))
    (tmp_path / "text.npy").write_text("not numbers\n")
    args = [a.format(artifact=path, tmp=tmp_path) for a in args]
    result = purinec_here(capsys, *args)
    assert_clean_error(result, *fragments)
    assert "using random" not in result.stdout  # (said only once the inputs are good)


def test_a_pipeline_longer_than_the_model_warns_in_one_line(tmp_path, capsys):
    result = purinec_here(capsys, "compile", "mlp", "--train", "--batch", "8", "--devices",
                          "6", "--parallel", "pipeline", "-o", tmp_path / "mlp.purine")
    assert result.returncode == 0, result.stderr
    used = re.search(r"on (\d) devices \((\S+)\)", result.stdout)
    idle = [f"cpu:{i}" for i in range(6) if f"cpu:{i}" not in used[2].split(",")]
    warning = (f"purinec: warning: pipeline parallelism puts mlp.train on {used[1]} of the "
               f"6 devices given; {', '.join(idle)} get no work: its layers' work cuts into "
               f"fewer stages of about equal work (a layer is never split)\n")
    # (a compile that takes a while says so on lines of its own, not the warning's)
    said = [line for line in result.stderr.splitlines(keepends=True)
            if not line.startswith(("purinec: compiling", "purinec: compiled"))]
    assert "".join(said) == warning
    dumped = purinec_here(capsys, "dump", "mlp", "--train", "--batch", "8", "--devices", "6",
                          "--parallel", "pipeline", "--stage", "parallel")
    assert dumped.returncode == 0 and dumped.stderr == warning  # dump says it too


def test_dump_parallel_stages_explain_each_collective(capsys):
    result = purinec_here(capsys, "dump", "lenet", "--train", "--batch", "8", "--target",
                          "reference", "--devices", "cpu:0,cpu:1", "--stage", "parallel",
                          "--explain")
    assert result.returncode == 0, result.stderr
    assert "~ split(0)[cpu:0,cpu:1]" in result.stdout
    reasons = [line for line in result.stdout.splitlines() if line.startswith("# allreduce")]
    assert any("sgd %conv1.weight.next needs replicated" in r for r in reasons)
    physical = purinec_here(capsys, "dump", "lenet", "--batch", "8", "--target", "reference",
                            "--devices", "2", "--stage", "partition")
    assert physical.returncode == 0, physical.stderr
    parsed = parse(physical.stdout)
    assert {str(n.device) for n in parsed.nodes} == {"cpu:0", "cpu:1"}
    assert any(n.op == "allgather" and len(n.inputs) == 2 for n in parsed.nodes)
    # What a training step runs: the inference graph gives the logits, a step does not
    # gather them.
    step = purinec_here(capsys, "dump", "lenet", "--train", "--batch", "8", "--target",
                        "reference", "--devices", "2", "--stage", "partition")
    assert step.returncode == 0, step.stderr
    parsed = parse(step.stdout)
    assert not any(n.op == "allgather" for n in parsed.nodes)
    assert not any(name.startswith("logits") for name, _ in parsed.outputs)


def test_dump_parameter_servers_explains_each_reduce_and_broadcast(capsys):
    result = purinec_here(capsys, "dump", "lenet", "--train", "--batch", "8", "--target",
                          "reference", "--devices", "2", "--parallel", "ps", "--stage",
                          "parallel", "--explain")
    assert result.returncode == 0, result.stderr
    graph = parse(result.stdout)  # the reasons are comments
    ops = [n.op for n in graph.nodes]
    assert ops.count("sgd") == 8
    for op in ("reduce", "broadcast"):  # small ones bucketed per server
        nodes = [n for n in graph.nodes if n.op == op]
        assert sum(len(n.outputs) for n in nodes) == 8 and len(nodes) < 8
    reasons = result.stdout.splitlines()
    assert ("# reduce %grad.ip1.weight.sum: %grad.ip1.weight is partial[cpu:0,cpu:1], "
            "sgd %ip1.weight.next needs replicated[cpu:0]") in reasons
    assert ("# broadcast %conv1.weight.next.all (bucket of 4): %conv1.weight.next is "
            "replicated[cpu:1], output conv1.weight needs replicated[cpu:0,cpu:1]") in reasons
    assert ("# copy %conv1.weight.server: %conv1.weight is replicated[cpu:0,cpu:1], sgd "
            "%conv1.weight.next needs replicated[cpu:1]") in reasons


def test_dump_parallel_stage_needs_devices(capsys):
    assert_clean_error(purinec_here(capsys, "dump", "mlp", "--stage", "parallel"),
                       "stage parallel runs only with --devices")
    assert_clean_error(purinec_here(capsys, "dump", "mlp", "--devices", "2", "--rank", "1"),
                       "--rank 1: the devices span 1 rank(s)")
    assert_clean_error(purinec_here(capsys, "dump", "mlp", "--rank", "1"),
                       "--rank 1: the program runs on one device of rank 0")
    assert_clean_error(purinec_here(capsys, "dump", "mlp", "--stage", "stages"),
                       "stage stages runs only with --devices and --parallel pipeline")


def test_dump_draws_the_bigraph(capsys, tmp_path):
    dot = purinec_here(capsys, "dump", "mlp", "--target", "reference", "--format", "dot")
    assert dot.returncode == 0, dot.stderr
    assert dot.stdout.startswith("digraph ") and "%ip1" in dot.stdout
    assert_clean_error(purinec_here(capsys, "dump", "mlp", "--format", "svg"),
                       "--format svg writes picture files; give -o DIR")


def test_train_on_two_devices_draws_its_timeline(tmp_path):
    picture = tmp_path / "timeline.png"
    result = purinec("train", "mlp", "--target", "cpu", "--devices", "2", "--epochs", "1",
                     "--timeline", picture, "--quiet")
    assert result.returncode == 0, result.stderr
    assert "hidden behind compute" in result.stdout
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    accuracy = float(result.stdout.split("test accuracy")[-1].splitlines()[0])
    assert accuracy > 0.8


def test_files_a_command_could_not_write_at_its_end_are_refused_first(capsys, tmp_path):
    """A long training run must not end in an error about a file it was told to write."""
    missing = tmp_path / "no" / "such"
    cases = [(["train", "mlp", "--timeline", tmp_path / "t.txt"],
              "cannot tell the format of timeline"),
             (["train", "mlp", "--checkpoint", missing / "ck.purine"],
              f"--checkpoint {missing / 'ck.purine'}: directory {missing} does not exist"),
             (["run", "mlp", "--trace", missing / "t.json"], "--trace"),
             (["run", "mlp", "--output", missing / "out.npz"], "--output"),
             (["run", "mlp", "--timeline", missing / "t.png"], "--timeline"),
             (["train", "mlp", "--checkpoint", tmp_path / "ck.bin"], "name it FILE.purine"),
             (["run", "mlp", "--output", tmp_path], "is a directory; name a file"),
             (["train", "mlp", "--lr", "inf"], "SGD: lr must be finite, got inf"),
             (["train", "mlp", "--devices", "0"], "devices 0: give at least one device"),
             (["run", "mlp", "--output", "/proc/out.npz"],  # (root may write most places)
              "--output /proc/out.npz: cannot write in directory /proc")]
    for args, fragment in cases:
        result = purinec_here(capsys, *args)
        assert_clean_error(result, fragment)
        assert result.stdout == ""  # nothing compiled, trained or run
    assert not list(tmp_path.iterdir())


def test_run_on_two_devices_gives_the_one_device_outputs(tmp_path):
    args = ["run", "lenet", "--batch", "6", "--target", "cpu", "--seed", "3"]
    one = purinec(*args, "--output", tmp_path / "one.npz", "--timeline", tmp_path / "1.svg")
    two = purinec(*args, "--devices", "cpu:0,cpu:1", "--output", tmp_path / "two.npz",
                  "--timeline", tmp_path / "t.svg")
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert re.search(r"wrote timeline \S+1.svg: [\d.]+ ms, no communication\n", one.stdout)
    assert "1 iteration on target cpu: " in one.stdout
    assert "1 iteration on target cpu on 2 devices (cpu:0,cpu:1): " in two.stdout
    with np.load(tmp_path / "one.npz") as a, np.load(tmp_path / "two.npz") as b:
        np.testing.assert_allclose(b["logits"], a["logits"], rtol=1e-5, atol=1e-6)
    assert (tmp_path / "t.svg").read_text().lstrip().startswith("<?xml")


def test_dump_kernels_of_a_distributed_graph_leaves_communication_to_the_runtime(capsys):
    result = purinec_here(capsys, "dump", "mlp", "--batch", "4", "--devices", "2",
                          "--stage", "kernels")
    assert result.returncode == 0, result.stderr
    assert "def fused_" in result.stdout and "allgather" not in result.stdout


def test_a_batch_larger_than_the_training_set_is_refused_before_compiling(capsys):
    result = purinec_here(capsys, "train", "convnet", "--batch", "5000")
    assert_clean_error(result, "digits has 1438 training images, fewer than one batch of "
                               "5000; use a smaller --batch")
    assert "compiled" not in result.stdout


FIVE_CLASSES = """
from purinec.bigraph import Blob, InnerProduct, Net, SoftmaxWithLoss

def build(batch=32, input_shape=(1, 8, 8)):
    with Net("five") as net:
        data = Blob("data", (batch, *input_shape))
        label = Blob("label", (batch,), "i32")
        logits = data >> InnerProduct("ip", 5) >> Blob("logits")
        net.outputs = [logits, [logits, label] >> SoftmaxWithLoss("loss")]
    return net
"""


def test_a_model_that_cannot_fit_the_data_says_what_would(tmp_path, capsys):
    path = tmp_path / "five.py"
    path.write_text(FIVE_CLASSES)
    assert_clean_error(purinec_here(capsys, "train", path, "--data", "synthetic"),
                       "five.train predicts 5 classes, but synthetic has 10; let build() in "
                       f"{path} take num_classes (train passes the data set's)")
    # asked for explicitly, an option build() does not take is refused, not dropped
    assert_clean_error(purinec_here(capsys, "compile", path, "--num-classes", "10", "-o",
                                    tmp_path / "five.purine"),
                       f"build() in {path} takes no argument 'num_classes'")
    scores = FIVE_CLASSES.replace('"logits"', '"scores"').replace("5)", "10)")
    path.write_text(scores)  # the only output is the scores, whatever its name
    assert purinec_here(capsys, "train", path, "--data", "synthetic", "--epochs", "1",
                        "--quiet").returncode == 0
    path.write_text(scores.replace("net.outputs = [logits,",
                                   "net.outputs = [logits, data >> InnerProduct('aux', 2),"))
    result = purinec_here(capsys, "train", path, "--data", "synthetic")
    assert_clean_error(result, "its inference graph has no output named logits, which the "
                               "test accuracy reads (it has scores, aux)")
    assert "epoch" not in result.stdout  # refused before training, not after an epoch


def test_a_training_iteration_pir_trains_as_it_is(tmp_path, capsys):
    pir = tmp_path / "mlp.train.pir"
    assert purinec_here(capsys, "dump", "mlp", "--train", "--stage", "optimizer", "--batch",
                        "32", "-o", pir).returncode == 0
    result = purinec_here(capsys, "train", pir, "--data", "synthetic", "--epochs", "2",
                          "--quiet")
    assert result.returncode == 0, result.stderr
    losses = [float(line.split("loss ")[1].split()[0]) for line in result.stdout.splitlines()
              if line.startswith("epoch")]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert_clean_error(purinec_here(capsys, "train", pir, "--lr", "0.1"),
                       "solver in its IR")
    assert_clean_error(purinec_here(capsys, "compile", pir, "--train", "-o",
                                    tmp_path / "x.purine"),
                       "graph mlp.train is a training iteration already")
