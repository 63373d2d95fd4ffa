"""The `purinec` command, run as a user runs it: in a separate process."""

import subprocess
import sys

import pytest

from purinec.ir import parse


def purinec(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "purinec", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


def assert_clean_error(result, *fragments):
    """Exit non-zero, one paragraph on stderr naming what and where, no traceback."""
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("purinec: error: ")
    assert result.stderr.strip().count("\n") == 0, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_help_lists_commands_and_stages():
    top = purinec("--help")
    assert top.returncode == 0 and "dump" in top.stdout and "train" in top.stdout
    dump = purinec("dump", "--help")
    for stage in ("lower", "infer_shapes", "verify", "autodiff", "optimizer", "dce", "cse"):
        assert stage in dump.stdout


def test_dump_prints_parsable_ir():
    result = purinec("dump", "lenet", "--batch", "2")
    assert result.returncode == 0, result.stderr
    graph = parse(result.stdout)
    assert graph.name == "lenet"
    assert [name for name, _ in graph.outputs] == ["logits"]


def test_dump_all_stages_to_files(tmp_path):
    result = purinec("dump", "mlp", "--train", "--batch", "2", "--stage", "all", "-o",
                     str(tmp_path))
    assert result.returncode == 0, result.stderr
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == [
        "mlp.train.00-lower.pir", "mlp.train.01-infer_shapes.pir", "mlp.train.02-verify.pir",
        "mlp.train.03-autodiff.pir", "mlp.train.04-optimizer.pir", "mlp.train.05-dce.pir",
        "mlp.train.06-cse.pir"]
    for f in files:
        assert f"wrote {f}" in result.stdout
        text = f.read_text()
        assert str(parse(text)) == text
    assert "sgd(" in files[-1].read_text()


def test_dump_one_stage():
    result = purinec("dump", "mlp", "--train", "--batch", "2", "--stage", "autodiff")
    assert result.returncode == 0, result.stderr
    assert "grad.ip1.weight" in result.stdout and "sgd(" not in result.stdout


def test_unknown_stage_and_model_are_clear_errors():
    assert_clean_error(purinec("dump", "mlp", "--stage", "fuse"), "unknown stage 'fuse'")
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


def test_train_reports_loss_and_accuracy():
    result = purinec("train", "mlp", "--data", "synthetic", "--epochs", "2", "--batch", "32")
    assert result.returncode == 0, result.stderr
    assert "epoch   2" in result.stdout
    assert "test accuracy" in result.stdout
    accuracy = float(result.stdout.strip().rsplit(" ", 1)[-1])
    assert accuracy > 0.5  # separable synthetic data: far above the 0.1 of guessing


@pytest.mark.parametrize("args, fragment", [
    (("train", "mlp", "--data", "imagenet"), "unknown data set 'imagenet'"),
    (("train", "mlp", "--data", "synthetic", "--lr", "-1"), "learning rate"),
    (("train", "mlp", "--data", "synthetic", "--target", "tpu"), "unknown target 'tpu'"),
])
def test_train_bad_options(args, fragment):
    assert_clean_error(purinec(*args), fragment)
