""".purine artifacts: what they hold, that they load bitwise, and what they refuse."""

import dataclasses
import hashlib
import io
import json
import os
import pathlib
import re
import struct
import subprocess
import sys
import time
import tracemalloc
import types
import zipfile

import numpy as np
import pytest

import purinec
from purinec import artifact
from purinec.program import Program
from purinec.targets import TARGETS
from purinec.data import synthetic
from purinec.errors import ArtifactError, MemoryLimitError, PurinecError
from purinec.ir.init import initial_value
from purinec.train import Checkpoint, train
from tests.artifact_forging import (entry, forged, gib_of_zeros, npy, read_members,
                                    with_manifest, zip_bytes)

REPO = pathlib.Path(__file__).resolve().parent.parent

# Small on purpose, with dropout so the program also carries non-momentum state.
TINY_MODEL = '''
from purinec.bigraph import Accuracy, Blob, Dropout, InnerProduct, Net, ReLU, SoftmaxWithLoss


def build(batch=4, input_shape=(1, 4, 4), num_classes=3):
    with Net("tiny") as net:
        data = Blob("data", (batch, *input_shape))
        label = Blob("label", (batch,), "i32")
        logits = (data >> InnerProduct("ip1", 8) >> ReLU("relu1") >> Dropout("drop", 0.25)
                  >> InnerProduct("ip2", num_classes) >> Blob("logits"))
        loss = [logits, label] >> SoftmaxWithLoss("loss")
        accuracy = [logits, label] >> Accuracy("accuracy")
        net.outputs = [logits, loss, accuracy]
    return net
'''


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(TINY_MODEL)
    return str(path)


def feeds(seed=0, batch=4, shape=(1, 4, 4), classes=3):
    rng = np.random.default_rng(seed)
    return {"data": rng.normal(size=(batch, *shape)).astype(np.float32),
            "label": rng.integers(0, classes, batch).astype(np.int32)}


@pytest.fixture
def trained(model_file):
    """A training program a few steps in, so weights and momentum are not the initial ones."""
    program = purinec.compile(model_file, train=purinec.SGD(lr=0.1, momentum=0.9,
                                                            weight_decay=1e-3), seed=2)
    for i in range(3):
        program.step(feeds(i))
    return program


@pytest.fixture
def saved(trained, tmp_path):
    path = tmp_path / "tiny.purine"
    trained.save(path)
    return path


def read_zip(path):
    with zipfile.ZipFile(path) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


OWN = ("manifest.json", "manifest.sha256")  # the manifest and its hash


def write_zip(path, members, fix_hashes=True):
    """Rewrite an artifact from ``members``; with ``fix_hashes`` the manifest and its
    hash are made to agree, as a forger who knows the format would."""
    members = dict(members)
    if fix_hashes:
        manifest = json.loads(members["manifest.json"])
        manifest["members"] = {n: hashlib.sha256(d).hexdigest()
                               for n, d in members.items() if n not in OWN}
        members["manifest.json"] = json.dumps(manifest).encode()
        if "manifest.sha256" in members:
            members["manifest.sha256"] = hashlib.sha256(
                members["manifest.json"]).hexdigest().encode()
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)


def edit_manifest(path, fix_hashes=True, **changes):
    members = read_zip(path)
    manifest = json.loads(members["manifest.json"])
    manifest.update(changes)
    members["manifest.json"] = json.dumps(manifest).encode()
    write_zip(path, members, fix_hashes)


def npz_bytes(**arrays):
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def weights_of(program):
    arrays = {f"param/{k}": v for k, v in program.params.items()}
    arrays.update({f"state/{k}": v for k, v in program.state.items()})
    return arrays


# -- what is written ------------------------------------------------------------------

def test_artifact_layout_and_manifest(trained, tmp_path):
    path = tmp_path / "tiny.purine"
    result = trained.save(path)
    assert result.path == str(path) and result.size == path.stat().st_size
    assert result.kernels == 0 and result.target == "reference"
    assert result.parameters == sum(a.size for a in trained.params.values())
    members = read_zip(path)
    assert set(members) == {*OWN, "program.pir", "eval.pir", "weights.npz"}
    assert members["manifest.sha256"].decode() == (
        hashlib.sha256(members["manifest.json"]).hexdigest() + "\n")
    manifest = json.loads(members["manifest.json"])
    assert manifest["format"] == "purinec-artifact"
    assert manifest["format_version"] == artifact.FORMAT_VERSION
    assert manifest["purinec_version"] == purinec.__version__
    assert manifest["numpy_version"] == np.__version__
    assert "numba_version" in manifest and "created" in manifest
    assert manifest["target"] == "reference"
    assert manifest["graphs"] == {"main": "tiny.train", "eval": "tiny"}
    assert manifest["devices"] == ["cpu:0"]
    for name, data in members.items():
        if name not in OWN:
            assert manifest["members"][name] == hashlib.sha256(data).hexdigest()
    assert members["program.pir"].decode() == str(trained.ir)
    assert members["eval.pir"].decode() == str(trained.eval_ir)
    with np.load(io.BytesIO(members["weights.npz"]), allow_pickle=False) as npz:
        assert set(npz.files) == set(weights_of(trained))
        for key, value in weights_of(trained).items():
            np.testing.assert_array_equal(npz[key], value)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_inference_program_has_no_eval_member(model_file, tmp_path):
    program = purinec.compile(model_file)
    program.save(tmp_path / "inference.purine")
    members = read_zip(tmp_path / "inference.purine")
    assert "eval.pir" not in members
    assert json.loads(members["manifest.json"])["graphs"] == {"main": "tiny"}
    loaded = purinec.load(tmp_path / "inference.purine")
    assert loaded.eval_ir is loaded.ir and not loaded.trainable


def test_kernel_sources_come_from_the_targets_code_generator(trained, tmp_path, monkeypatch):
    """The artifact carries the sources a target generated, for reading only: loading
    regenerates kernels from the IR and never reads them."""
    from purinec.targets.reference import ReferenceTarget

    class Printed(ReferenceTarget):  # the reference's results, with sources to show
        name = "printed"
        generates_code = True
        sources = True

        def generated(self, graph):
            if not self.sources:
                raise AssertionError("loading asked for the kernels' source")
            return {node: types.SimpleNamespace(name=f"{node.op}/{node.name}",
                                                source=f"# from %{node.name}\n")
                    for node in graph.nodes}

    target = Printed()
    monkeypatch.setitem(TARGETS, "printed", target)
    program = Program.from_ir(trained.ir, trained.eval_ir, "printed", dict(trained.params),
                              dict(trained.state))
    result = program.save(tmp_path / "printed.purine")
    members = read_zip(tmp_path / "printed.purine")
    kernels = sorted(n for n in members if n.startswith("kernels/"))
    assert result.kernels == len(kernels) == len(trained.ir.nodes) + len(trained.eval_ir.nodes)
    assert "kernels/tiny.train/matmul_ip1.matmul.py" in kernels
    assert members["kernels/tiny.train/matmul_ip1.matmul.py"] == b"# from %ip1.matmul\n"

    target.sources = False  # loading must not need the kernels' source
    loaded = purinec.load(tmp_path / "printed.purine")
    assert loaded.target == "printed"


# -- what is read back -------------------------------------------------------------------

FRESH_PROCESS = """
import sys
import time
import numpy as np
import purinec

program = purinec.load(sys.argv[1])
x = np.load(sys.argv[2])
y = np.load(sys.argv[3])
logits = program.run({"data": x})["logits"]
loss = program.step({"data": x, "label": y})
np.savez(sys.argv[4], logits=logits, loss=np.float32(loss), **dict(program.params),
         **{"state." + k: v for k, v in program.state.items()})
"""


def test_fresh_process_gives_bitwise_identical_results(trained, saved, tmp_path):
    f = feeds(seed=9)
    np.save(tmp_path / "x.npy", f["data"])
    np.save(tmp_path / "y.npy", f["label"])
    result = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(saved),
                             str(tmp_path / "x.npy"), str(tmp_path / "y.npy"),
                             str(tmp_path / "out.npz")], capture_output=True, text=True,
                            cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr
    logits = trained.run({"data": f["data"]})["logits"]
    loss = trained.step(f)
    with np.load(tmp_path / "out.npz") as out:
        assert out["logits"].tobytes() == logits.tobytes()
        assert out["loss"] == np.float32(loss)
        for name, value in trained.params.items():
            assert out[name].tobytes() == value.tobytes(), name
        for name, value in trained.state.items():
            assert out["state." + name].tobytes() == value.tobytes(), name


def test_loaded_program_trains_on_like_the_original(trained, saved):
    loaded = purinec.load(saved)
    assert str(loaded.ir) == str(trained.ir) and str(loaded.eval_ir) == str(trained.eval_ir)
    for i in range(3, 6):
        assert loaded.step(feeds(i)) == trained.step(feeds(i))
    for store in ("params", "state"):
        for name, value in getattr(trained, store).items():
            assert getattr(loaded, store)[name].tobytes() == value.tobytes(), name


def test_target_can_be_overridden_and_must_exist(saved):
    assert purinec.load(saved, target="reference").target == "reference"
    with pytest.raises(ArtifactError, match=r"tiny.purine: unknown target 'tpu'"):
        purinec.load(saved, target="tpu")
    edit_manifest(saved, target="quantum")
    with pytest.raises(ArtifactError, match="unknown target 'quantum'.*reference"):
        purinec.load(saved)


# -- what is refused ----------------------------------------------------------------------

def member_data_offset(path, name):
    """Where ``name``'s (compressed) bytes start in the file."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(name)
    raw = pathlib.Path(path).read_bytes()
    name_len, extra_len = np.frombuffer(raw, "<u2", 2, info.header_offset + 26)
    return info.header_offset + 30 + int(name_len) + int(extra_len), info.compress_size


@pytest.mark.parametrize("member", ["program.pir", "eval.pir", "weights.npz"])
def test_a_changed_byte_is_refused_naming_the_member(saved, member):
    start, size = member_data_offset(saved, member)
    raw = bytearray(saved.read_bytes())
    raw[start + size // 2] ^= 0x01
    saved.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match=f"member {member} "):
        purinec.load(saved)


def test_a_rewritten_member_fails_its_hash(saved):
    members = read_zip(saved)
    members["program.pir"] = members["program.pir"].replace(b"lr=0.1", b"lr=0.2")
    write_zip(saved, members, fix_hashes=False)  # a valid zip; only the hash can tell
    with pytest.raises(ArtifactError, match="member program.pir does not match its sha256"):
        purinec.load(saved)


@pytest.mark.parametrize("keep", [0.5, 0.98])
def test_a_truncated_file_is_refused(saved, keep):
    raw = saved.read_bytes()
    saved.write_bytes(raw[:int(len(raw) * keep)])
    with pytest.raises(ArtifactError, match="tiny.purine is truncated or damaged"):
        purinec.load(saved)


def test_every_truncation_and_many_changed_bytes_give_an_artifact_error(model_file, tmp_path):
    """Whatever happens to the bytes, loading ends in a clear ArtifactError and nothing
    else (no zip, zlib, numpy or JSON exception escapes), or, for a byte that does not
    matter, in the same program."""
    path = tmp_path / "small.purine"
    original = purinec.compile(model_file, batch=1, input_shape=(1, 1, 1), num_classes=2)
    original.save(path)
    raw = path.read_bytes()
    broken = tmp_path / "broken.purine"
    rng = np.random.default_rng(0)
    for cut in sorted(set(rng.integers(0, len(raw), 60)) | {0, 1, 4, len(raw) - 1}):
        broken.write_bytes(raw[:cut])
        with pytest.raises(ArtifactError):
            purinec.load(broken)
    for position in rng.integers(0, len(raw), 150):
        changed = bytearray(raw)
        changed[position] ^= 1 << int(rng.integers(0, 8))
        broken.write_bytes(bytes(changed))
        try:
            loaded = purinec.load(broken)
        except ArtifactError:
            continue
        # a byte the zip ignores (a timestamp): the same IR and weights
        assert str(loaded.ir) == str(original.ir), position
        for name, value in original.params.items():
            np.testing.assert_array_equal(loaded.params[name], value, err_msg=name)


@pytest.mark.parametrize("change", [
    {"metadata": {"note": "edited"}},
    {"target": "reference", "created": "2000-01-01T00:00:00+00:00"},
])
def test_an_edited_manifest_is_refused(saved, change):
    edit_manifest(saved, fix_hashes=False, **change)
    with pytest.raises(ArtifactError, match="manifest.json does not match its sha256 in "
                                            "manifest.sha256: the file was changed"):
        purinec.load(saved)


def test_a_manifest_hash_that_is_not_one_is_refused(saved):
    members = read_zip(saved)
    members["manifest.sha256"] = b"\xff" * 64
    write_zip(saved, members, fix_hashes=False)
    with pytest.raises(ArtifactError, match="manifest.json does not match its sha256"):
        purinec.load(saved)


def test_a_format_1_artifact_without_a_manifest_hash_still_loads(trained, saved):
    members = read_zip(saved)
    del members["manifest.sha256"]
    manifest = json.loads(members["manifest.json"])
    manifest["format_version"] = 1
    members["manifest.json"] = json.dumps(manifest).encode()
    write_zip(saved, members, fix_hashes=False)
    loaded = purinec.load(saved)
    assert loaded.step(feeds(5)) == trained.step(feeds(5))
    members["kernels/extra.py"] = b"print('hello')\n"  # its members are still checked
    write_zip(saved, members, fix_hashes=False)
    with pytest.raises(ArtifactError, match="member kernels/extra.py is not listed"):
        purinec.load(saved)


def test_a_newer_format_is_refused_naming_both_versions(saved):
    # Every format from 2 on keeps manifest.sha256 the hash of manifest.json, which is
    # checked before the JSON is parsed: a newer file gets this message, not "changed".
    edit_manifest(saved, format_version=artifact.FORMAT_VERSION + 1, purinec_version="9.0")
    with pytest.raises(ArtifactError, match=rf"format version {artifact.FORMAT_VERSION + 1}, "
                                            rf"newer than the version "
                                            rf"{artifact.FORMAT_VERSION} .*purinec 9.0"):
        purinec.load(saved)


@pytest.mark.parametrize("content, message", [
    (b"", "not a purinec artifact"),
    (b"graph g() {\n  return\n}\n", "not a purinec artifact"),
    (b"PK\x03\x04" + b"\0" * 40, "truncated or damaged"),
])
def test_not_a_zip_is_refused(tmp_path, content, message):
    path = tmp_path / "x.purine"
    path.write_bytes(content)
    with pytest.raises(ArtifactError, match=message):
        purinec.load(path)


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(ArtifactError, match="cannot read .*nothing.purine"):
        purinec.load(tmp_path / "nothing.purine")


@pytest.mark.parametrize("member", [*OWN, "program.pir", "weights.npz"])
def test_a_missing_member_is_refused(saved, member):
    members = read_zip(saved)
    del members[member]
    write_zip(saved, members, fix_hashes=member not in OWN)
    with pytest.raises(ArtifactError, match=f"member {member} is missing"):
        purinec.load(saved)


def test_a_member_listed_but_absent_is_refused(saved):
    members = read_zip(saved)
    del members["eval.pir"]
    write_zip(saved, members, fix_hashes=False)
    with pytest.raises(ArtifactError, match="member eval.pir is missing"):
        purinec.load(saved)


def test_an_unlisted_member_is_refused(saved):
    members = read_zip(saved)
    members["kernels/extra.py"] = b"print('hello')\n"
    write_zip(saved, members, fix_hashes=False)
    with pytest.raises(ArtifactError, match="member kernels/extra.py is not listed"):
        purinec.load(saved)


@pytest.mark.parametrize("manifest, message", [
    (b"{not json", "manifest.json is not valid JSON"),
    (b"\xff\xfe", "manifest.json is not valid JSON"),
    (b"[1, 2]", "does not describe a purinec artifact"),
    (b'{"format": "purinec-artifact"}', "no valid format_version"),
    (b'{"format": "purinec-artifact", "format_version": 1, "members": []}',
     "field 'members' must be"),
])
def test_a_bad_manifest_is_refused(saved, manifest, message):
    members = read_zip(saved)
    members["manifest.json"] = manifest
    members["manifest.sha256"] = hashlib.sha256(manifest).hexdigest().encode()  # so it is parsed
    write_zip(saved, members, fix_hashes=False)
    with pytest.raises(ArtifactError, match=message):
        purinec.load(saved)


@pytest.mark.parametrize("change, message", [
    (lambda w: w.update({"param/ip1.weight": w["param/ip1.weight"][:4]}),
     r"param ip1.weight: the IR declares f32\[8,16\], the array is f32\[4,16\]"),
    (lambda w: w.update({"param/ip1.bias": w["param/ip1.bias"].astype(np.float64)}),
     r"param ip1.bias: the IR declares f32\[8\], the array is f64\[8\]"),
    (lambda w: w.update({"param/ip1.bias": w["param/ip1.bias"].astype(">f4")}),
     r"param ip1.bias: the IR declares f32\[8\], the array is >f4\[8\]"),
    (lambda w: w.pop("state/ip2.weight.history"), "missing ip2.weight.history"),
    (lambda w: w.update({"param/ip3.weight": np.zeros(2, np.float32)}),
     "not in the IR: ip3.weight"),
    (lambda w: w.update({"extra": np.zeros(2, np.float32)}), "an array named 'extra'"),
])
def test_weights_that_do_not_match_the_ir_are_refused(trained, saved, change, message):
    weights = weights_of(trained)
    change(weights)
    members = read_zip(saved)
    members["weights.npz"] = npz_bytes(**weights)
    write_zip(saved, members)
    with pytest.raises(ArtifactError, match=message):
        purinec.load(saved)


def test_ir_that_fails_verification_is_refused(saved):
    members = read_zip(saved)
    text = members["eval.pir"].decode()
    members["eval.pir"] = text.replace("f32[4,3] @cpu:0", "f32[4,5] @cpu:0", 1).encode()
    write_zip(saved, members)
    with pytest.raises(ArtifactError, match=r"eval\.pir fails verification: eval\.pir:\d+: node "):
        purinec.load(saved)


def test_loading_never_executes_python_from_the_file(saved, tmp_path):
    marker = tmp_path / "pwned"
    members = read_zip(saved)
    members["program.pir"] = f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n".encode()
    write_zip(saved, members)
    with pytest.raises(ArtifactError, match=r"program.pir is not valid purinec IR: "
                                            r"program.pir:\d+:\d+: "):
        purinec.load(saved)
    assert not marker.exists()


class _TouchOnUnpickle:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


def test_loading_never_unpickles_weights(trained, saved, tmp_path):
    marker = tmp_path / "pwned"
    weights = weights_of(trained)
    weights["param/ip1.bias"] = np.array([_TouchOnUnpickle(marker)] * 8, dtype=object)
    members = read_zip(saved)
    members["weights.npz"] = npz_bytes(**weights)
    write_zip(saved, members)
    with pytest.raises(ArtifactError, match="weights.npz: array param/ip1.bias cannot be read "
                                            "without unpickling"):
        purinec.load(saved)
    assert not marker.exists()


# -- writing is all or nothing -------------------------------------------------------------

def test_a_failed_save_leaves_the_previous_file_intact(trained, saved, monkeypatch):
    before = saved.read_bytes()
    trained.step(feeds(7))
    real_write_zip = artifact._write_zip

    def crash_halfway(f, manifest, members):
        real_write_zip(f, manifest, members)
        f.truncate(f.tell() // 2)  # half a file is on disk when the "kill" comes
        raise KeyboardInterrupt

    monkeypatch.setattr(artifact, "_write_zip", crash_halfway)
    with pytest.raises(KeyboardInterrupt):
        trained.save(saved)
    assert saved.read_bytes() == before
    assert sorted(os.listdir(saved.parent)) == ["tiny.purine", "tiny.py"]  # no temp file
    purinec.load(saved)


def test_saving_into_a_missing_directory_is_a_clear_error(trained, tmp_path):
    with pytest.raises(ArtifactError, match="cannot write .*nowhere"):
        trained.save(tmp_path / "nowhere" / "x.purine")
    with pytest.raises(ArtifactError, match="metadata is not JSON"):
        trained.save(tmp_path / "x.purine", metadata={"epoch": np.arange(2)})
    assert not (tmp_path / "x.purine").exists()
    trained.save(tmp_path / "x.purine")  # the failed save left the program as it was


# -- Program from IR, checkpoints -----------------------------------------------------------

def test_program_from_ir_checks_the_weights_it_is_given(trained):
    params = {name: array.copy() for name, array in trained.params.items()}
    program = Program.from_ir(trained.ir, trained.eval_ir, "reference", params,
                              dict(trained.state))
    params["ip1.bias"][:] = 42  # the program holds copies
    assert not (program.params["ip1.bias"] == 42).any()
    del params["ip1.bias"]
    with pytest.raises(PurinecError, match="missing ip1.bias"):
        Program.from_ir(trained.ir, trained.eval_ir, "reference", params)
    fresh = Program.from_ir(trained.ir, trained.eval_ir, seed=5)  # initialized by the IR
    value = fresh.ir.input("ip1.weight")
    np.testing.assert_array_equal(fresh.params["ip1.weight"],
                                  initial_value(value.init, value.type,
                                                np.random.default_rng(5)))


def test_resuming_a_checkpoint_gives_the_uninterrupted_weights(model_file, tmp_path):
    data = synthetic(seed=3, n=64, shape=(1, 4, 4), num_classes=3)
    sgd = purinec.SGD(lr=0.1, momentum=0.9, weight_decay=1e-3)

    def fresh():
        return purinec.compile(model_file, train=sgd, batch=8, seed=1)

    uninterrupted = fresh()
    train(uninterrupted, data, epochs=3, batch=8, seed=3, progress=False)

    first = fresh()
    path = tmp_path / "ck.purine"
    train(first, data, epochs=3, batch=8, seed=3, progress=False,
          on_epoch_end=lambda e: Checkpoint(e.epoch, 3, "synthetic").save(first, path)
          if e.epoch == 1 else None)
    resumed, checkpoint = Checkpoint.load(path)
    assert checkpoint == Checkpoint(epoch=1, seed=3, data="synthetic")
    result = train(resumed, data, epochs=3, batch=8, seed=checkpoint.seed, progress=False,
                   start_epoch=checkpoint.epoch)
    assert [e.epoch for e in result.epochs] == [2, 3]
    for store in ("params", "state"):
        for name, value in getattr(uninterrupted, store).items():
            assert getattr(resumed, store)[name].tobytes() == value.tobytes(), name
    assert resumed.state["iteration"] == 3 * (len(data.train_x) // 8)  # steps taken


def test_an_artifact_that_is_not_a_checkpoint_cannot_be_resumed(saved):
    with pytest.raises(ArtifactError, match="not a checkpoint"):
        Checkpoint.load(saved)
    edit_manifest(saved, metadata={"checkpoint": {"epoch": "two", "seed": 0, "data": "x"}})
    with pytest.raises(ArtifactError, match="checkpoint entry of its manifest is malformed"):
        Checkpoint.load(saved)


def test_the_training_bar_counts_the_steps(model_file, monkeypatch, capsys):
    data = synthetic(seed=3, n=32, shape=(1, 4, 4), num_classes=3)
    program = purinec.compile(model_file, train=purinec.SGD(lr=0.1), batch=8)
    step = program.step

    def slow_step(feeds):  # slower than the bar's redraw interval (0.1 s)
        time.sleep(0.15)
        return step(feeds)

    monkeypatch.setattr(program, "step", slow_step)
    train(program, data, epochs=1, batch=8, progress=True)
    drawn = capsys.readouterr().err.replace("\r", "\n")
    counts = re.findall(r"epoch 1/1: +\d+%\|.*\| (\d)/(\d) \[.*loss=\d\.\d{4}", drawn)
    assert counts and all(total == "3" for _, total in counts), drawn
    # (a loss is shown only after a step; it used to come with a count lagging behind)
    assert all(int(n) >= 1 for n, _ in counts), drawn


# -- bounded: what a forged file cannot make loading do -----------------------------------
# (tests/test_artifact_fuzz.py tries many more: byte flips, truncations, member edits)

def refusal(path):
    """The ArtifactError loading ``path`` raises, and the most memory it took meanwhile."""
    tracemalloc.start()
    try:
        with pytest.raises(ArtifactError) as refused:
            purinec.load(path)
        return str(refused.value), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_manifest_hash_is_checked_before_its_json_is_parsed(saved, monkeypatch):
    members = read_zip(saved)
    members["manifest.json"] = b"[" * 100_000 + b"]" * 100_000
    saved.write_bytes(forged(members, fix_hashes=False))
    monkeypatch.setattr(artifact.json, "loads", lambda *a, **k: pytest.fail("parsed"))
    with pytest.raises(ArtifactError, match="manifest.json does not match its sha256"):
        purinec.load(saved)


@pytest.mark.parametrize("version_1", [False, True])
def test_a_deeply_nested_manifest_is_refused(saved, version_1):
    """Parsed only once its hash matches (or in a format 1 file, which has no hash)."""
    nested = (b'{"format": "purinec-artifact", "format_version": %d, "metadata": %s%s}'
              % (1 if version_1 else 2, b"[" * 100_000, b"]" * 100_000))
    members = with_manifest(read_zip(saved), nested)
    if version_1:
        del members["manifest.sha256"]
    saved.write_bytes(forged(members, fix_hashes=False))
    with pytest.raises(ArtifactError, match="manifest.json nests arrays or objects too "
                                            "deeply to be read"):
        purinec.load(saved)


@pytest.fixture
def int_digits_unlimited():
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # no limit: int() of n digits takes time n**2
    yield
    sys.set_int_max_str_digits(old)


@pytest.mark.parametrize("unlimited", [False, True])
@pytest.mark.parametrize("field", ["format_version", "metadata"])
def test_a_manifest_number_of_5000_digits_is_refused(saved, field, unlimited, request):
    """Refused whatever limit the interpreter sets for int()."""
    if unlimited:
        request.getfixturevalue("int_digits_unlimited")
    number = b"1" * 5000
    manifest = (b'{"format": "purinec-artifact", "format_version": '
                + (number if field == "format_version" else b"2")
                + b', "metadata": {"epoch": ' + number + b"}}")
    saved.write_bytes(forged(with_manifest(read_zip(saved), manifest), fix_hashes=False))
    with pytest.raises(ArtifactError, match=r"manifest.json is not valid JSON: a number "
                                            r"of 5,000 digits \(at most 4,300\)"):
        purinec.load(saved)


def test_a_long_format_version_is_shown_shortened(saved):
    edit_manifest(saved, format_version=int("9" * 4000))
    with pytest.raises(ArtifactError, match=r"format version 9+\.\.\.9+, newer") as refused:
        purinec.load(saved)
    assert len(str(refused.value)) < len(str(saved)) + 300


def test_a_weights_member_without_npy_suffix_is_refused(saved):
    members = read_zip(saved)
    weights = read_members(members["weights.npz"])
    weights["param/ip1.bias"] = weights.pop("param/ip1.bias.npy")  # np.load: bytes
    members["weights.npz"] = zip_bytes(entry(n, d, zipfile.ZIP_STORED)
                                       for n, d in weights.items())
    saved.write_bytes(forged(members))
    with pytest.raises(ArtifactError, match=r"weights.npz holds a member named "
                                            r"'param/ip1.bias', not an array: arrays are "
                                            r"stored as param/<name>.npy"):
        purinec.load(saved)


@pytest.mark.parametrize("member, message", [
    ("kernels/tiny/matmul.py", "is 1,073,741,824 bytes uncompressed; purinec reads at most "
                               "4,194,304 for it"),
    ("program.pir", "is 1,073,741,824 bytes uncompressed; purinec reads at most "
                    "4,194,304 for it"),
    ("weights.npz", r"would inflate 1,06\d,\d\d\d bytes to 1,073,741,824, more than 64 "
                    "times over"),
])
def test_a_gigabyte_bomb_listed_with_its_real_hash_is_refused_unread(saved, member,
                                                                      message):
    """A megabyte inflating to a GiB: refused for the size it declares, before a byte of
    it is inflated (it used to take 12-15 s and 2.2 GB)."""
    members = {**read_zip(saved), member: gib_of_zeros(member)}
    saved.write_bytes(forged(members))
    assert saved.stat().st_size < 4 * 2**20
    refused, peak = refusal(saved)
    assert re.search(f"member {member} {message}", refused), refused
    assert peak < 16 * 2**20


def test_a_bomb_declaring_less_than_it_holds_is_cut_off(saved):
    members = {**read_zip(saved), "program.pir": gib_of_zeros("program.pir", declared=100)}
    saved.write_bytes(forged(members))
    message, peak = refusal(saved)
    assert "member program.pir is damaged (Bad CRC-32" in message
    assert peak < 16 * 2**20


def test_a_member_holding_less_than_it_declares_is_refused(saved):
    """zipfile checks the CRC of what it inflated, not that it inflated all it should."""
    members = read_zip(saved)
    pir = members["program.pir"]
    short = dataclasses.replace(entry("program.pir", pir), size=len(pir) + 1000)
    saved.write_bytes(forged({**members, "program.pir": short}))
    with pytest.raises(ArtifactError, match=rf"member program.pir is damaged: it declares "
                                            rf"{len(pir) + 1000:,} bytes and holds "
                                            rf"{len(pir):,} bytes"):
        purinec.load(saved)


@pytest.mark.parametrize("declared, message", [
    (2**30, r"weights.npz: member param/ip1.weight.npy would inflate [\d,]+ bytes to "
            r"1,073,741,824, more than 64 times over"),
    (600_000, r"weights.npz: array param/ip1.weight is 600,000 bytes, more than its type "
              r"in the IR, f32\[8,16\], takes"),
])
def test_an_array_bomb_inside_the_weights_is_refused_unread(saved, declared, message):
    members = read_zip(saved)
    weights = read_members(members["weights.npz"])
    inner = [entry(n, d, zipfile.ZIP_STORED) for n, d in weights.items()
             if n != "param/ip1.weight.npy"]
    bomb = dataclasses.replace(entry("param/ip1.weight.npy", bytes(512)), size=declared)
    members["weights.npz"] = zip_bytes([bomb, *inner])
    saved.write_bytes(forged(members))
    refused, peak = refusal(saved)
    assert re.search(message, refused), refused
    assert peak < 16 * 2**20


BIG_PARAM = """
from purinec.bigraph import Blob, InnerProduct, Net


def build(batch=1):
    with Net("big") as net:
        net.outputs = [Blob("data", (batch, 1024)) >> InnerProduct("ip", 1024) >> Blob("y")]
    return net
"""


@pytest.mark.parametrize("deflated, refused", [
    ((), None),  # as purinec writes them
    (("weights.npz",), "member weights.npz"),
    (("param/ip.weight.npy",), "weights.npz: member param/ip.weight.npy"),
])
def test_weights_may_not_inflate_64_times_over(tmp_path, deflated, refused):
    """The IR, which bounds the weights, is the forger's too: a few kB of zeros that
    inflate to the 4 MiB it declares are refused. Stored, they load."""
    (tmp_path / "big.py").write_text(BIG_PARAM)
    path = tmp_path / "big.purine"
    purinec.compile(str(tmp_path / "big.py")).save(path)

    def member(name, content):
        return entry(name, content, zipfile.ZIP_DEFLATED if name in deflated
                     else zipfile.ZIP_STORED)

    zeros = {"param/ip.weight.npy": npy("<f4", (1024, 1024), bytes(4 * 2**20)),
             "param/ip.bias.npy": npy("<f4", (1024,), bytes(4096))}
    npz = zip_bytes(member(n, d) for n, d in zeros.items())
    path.write_bytes(forged({**read_zip(path), "weights.npz": member("weights.npz", npz)}))
    if refused is None:
        assert not purinec.load(path).params["ip.weight"].any()
        return
    with pytest.raises(ArtifactError, match=rf"{refused} would inflate [\d,]+ bytes to "
                                            rf"4,19\d,\d\d\d, more than 64 times over"):
        purinec.load(path)


def npy_with_header(text):
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text


@pytest.mark.parametrize("header, message", [
    (npy("<f4", (2**40, 2**40)),
     r"param ip1.weight: the IR declares f32\[8,16\], the array is "
     r"f32\[1099511627776,1099511627776\]"),
    (npy("<f4", (2**40, 2**40), version=(2, 0)), r"the array is f32\[1099511627776,"),
    (npy("|V1000000000", (8, 16)),
     r"the IR declares f32\[8,16\], the array is \|V1000000000"),
    (npy("<f4", (8, 16), bytes(100)), r"array param/ip1.weight holds 100 bytes of data; "
                                      r"its shape and dtype take 512"),
    (npy("<f4", (8, 16))[:20], r"array param/ip1.weight is damaged"),
    (npy("|O", (8, 16)), "array param/ip1.weight cannot be read without unpickling"),
    (b"\x93NUMPY\x03\x00" + bytes(100), r"array param/ip1.weight is damaged: .npy format "
                                        r"version \(3, 0\)"),
    # Unbalanced: NumPy retries with Python 2's tokenizer, which raises TokenError.
    (npy_with_header(b"{'descr': '<f4', 'fortran_order': False, 'shape': (8, }\n"),
     r"array param/ip1.weight is damaged: its .npy header cannot be parsed \(TokenError"),
])
def test_an_npy_header_is_checked_before_its_data_is_allocated(saved, header, message):
    members = read_zip(saved)
    weights = read_members(members["weights.npz"])
    weights["param/ip1.weight.npy"] = header
    members["weights.npz"] = zip_bytes(entry(n, d, zipfile.ZIP_STORED)
                                       for n, d in weights.items())
    saved.write_bytes(forged(members))
    refused, peak = refusal(saved)
    assert re.search(message, refused), refused
    assert peak < 16 * 2**20


def test_members_past_the_limit_are_refused_before_the_directory_is_parsed(saved):
    members = read_zip(saved)
    many = [(f"kernels/{i}.py", b"") for i in range(40_000)]  # used to take 15 s
    saved.write_bytes(forged([*members.items(), *many], method=zipfile.ZIP_STORED))
    with pytest.raises(ArtifactError, match=r"tiny.purine has 40,0\d\d members; an "
                                            r"artifact has at most 10,000"):
        purinec.load(saved)
    # An end record that understates the count: the directory is parsed, then counted.
    raw = zip_bytes((entry(n, d, zipfile.ZIP_STORED) for n, d in [*members.items(), *many]),
                    claimed_count=5)
    saved.write_bytes(raw)
    with pytest.raises(ArtifactError, match=r"has 40,0\d\d members; an artifact has"):
        purinec.load(saved)
    # Past 65,535 members the count is in the zip64 end record (and its locator), which
    # come before the end record: read from them before zipfile reads anything.
    zip64_end = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, 70_000, 70_000,
                            70_000 * 50, 4)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, 4, 1)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF,
                      0xFFFFFFFF, 0)
    saved.write_bytes(b"PK\x03\x04" + zip64_end + locator + end)
    with pytest.raises(ArtifactError, match=r"has 70,000 members; an artifact has"):
        purinec.load(saved)


def test_a_zip_directory_past_the_limit_is_refused(saved):
    members = read_zip(saved)
    long_names = [(f"kernels/{i:040000}.py", b"") for i in range(100)]  # 4 MB directory
    saved.write_bytes(forged([*members.items(), *long_names], method=zipfile.ZIP_STORED))
    with pytest.raises(ArtifactError, match=r"has a zip directory of [\d,]+ bytes; an "
                                            r"artifact's takes at most 3,145,728"):
        purinec.load(saved)


def test_a_name_repeated_thousands_of_times_is_found_in_linear_time(saved):
    members = read_zip(saved)
    repeated = [("kernels/k.py", b"")] * 9_000  # names.count: 81 million comparisons
    saved.write_bytes(forged([*members.items(), *repeated], fix_hashes=False))
    with pytest.raises(ArtifactError, match="member kernels/k.py appears more than once"):
        purinec.load(saved)


@pytest.mark.parametrize("method", [zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA])
def test_a_member_compressed_other_than_purinec_writes_is_refused_unread(saved, method):
    """bzip2 and lzma members inflate a whole block at once in zipfile, past any limit."""
    members = read_zip(saved)
    with zipfile.ZipFile(saved, "w") as zf:
        for member, data in members.items():
            zf.writestr(member, data, method if member == "program.pir" else
                        zipfile.ZIP_DEFLATED)
    with pytest.raises(ArtifactError, match=f"member program.pir uses zip compression "
                                            f"method {method}; purinec reads stored and "
                                            f"deflated"):
        purinec.load(saved)


def test_text_members_past_their_total_are_refused(saved):
    members = read_zip(saved)
    kernels = {f"kernels/{i}.py": gib_of_zeros(f"kernels/{i}.py", declared=4 * 2**20)
               for i in range(33)}  # each as much as a text may take
    saved.write_bytes(forged({**members, **kernels}))
    with pytest.raises(ArtifactError, match=r"its members other than weights.npz take "
                                            r"[\d,]+ bytes uncompressed; purinec reads at "
                                            r"most 134,217,728"):
        purinec.load(saved)


def test_weights_beyond_the_memory_limit_are_refused_before_they_are_read(saved, monkeypatch):
    monkeypatch.setenv("PURINEC_MEMORY_LIMIT", "1K")
    with pytest.raises(MemoryLimitError, match=rf"the parameters and state of {saved}.*1\.0 KiB"):
        purinec.load(saved, target="reference")
