"""The cpu target end to end: fused Numba kernels under the runtime, against the
reference target, saved and loaded in a fresh process, traced."""

import concurrent.futures
import gc
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import purinec
from purinec.codegen.cpu_runtime import available_cpus
from purinec.runtime.trace import Trace

pytestmark = pytest.mark.slow  # compiles every zoo model's training step

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SGD = purinec.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4)

# (model, input shape) at batch 2. nin and inception compile ~100 kernels each: about a
# minute together with a cold kernel cache on a 2-core machine.
MODELS = [("mlp", (1, 8, 8)), ("lenet", (1, 28, 28)), ("convnet", (1, 8, 8)),
          ("cifar_quick", (3, 32, 32)), ("nin", (3, 32, 32)), ("inception", (3, 32, 32))]


def feeds(shape, seed, batch=2):
    rng = np.random.default_rng(seed)
    return {"data": rng.normal(size=(batch, *shape)).astype(np.float32),
            "label": rng.integers(0, 10, batch).astype(np.int32)}


def check_iterations_match(model, shape):
    options = dict(train=SGD, batch=2, input_shape=shape, num_classes=10, seed=4)
    cpu = purinec.compile(model, target="cpu", **options)
    ref = purinec.compile(model, target="reference", **options)
    assert any(node.op == "fused" for node in cpu.ir.nodes)
    for step in range(2):  # the second step reads momentum written by the first
        f = feeds(shape, seed=step)
        assert cpu.step(f) == pytest.approx(ref.step(f), rel=1e-5, abs=1e-6)
        for name in ref.params:
            np.testing.assert_allclose(cpu.params[name], ref.params[name], rtol=1e-4,
                                       atol=1e-6, err_msg=f"{model} step {step}: {name}")
        for name in ref.state:
            np.testing.assert_allclose(cpu.state[name], ref.state[name], rtol=1e-4,
                                       atol=1e-6, err_msg=f"{model} step {step}: {name}")
    f = feeds(shape, seed=9)
    np.testing.assert_allclose(cpu.run({"data": f["data"]})["logits"],
                               ref.run({"data": f["data"]})["logits"], rtol=1e-4, atol=1e-5)
    cpu.close()


@pytest.mark.parametrize("model, shape", MODELS, ids=[m for m, _ in MODELS])
def test_compiled_training_iteration_equals_the_reference(model, shape):
    check_iterations_match(model, shape)


FRESH = """
import sys
import numpy as np
import purinec

program = purinec.load(sys.argv[1])
inputs = np.load(sys.argv[2])
logits = program.run({"data": inputs["data"]})["logits"]
loss = program.step({"data": inputs["data"], "label": inputs["label"]})
np.savez(sys.argv[3], logits=logits, loss=np.float32(loss), **dict(program.params))
"""


def test_saved_program_gives_bitwise_the_same_outputs_in_a_fresh_process(tmp_path):
    program = purinec.compile("convnet", target="cpu", train=SGD, batch=4,
                              input_shape=(1, 8, 8), num_classes=10, seed=2)
    program.step(feeds((1, 8, 8), seed=1, batch=4))  # not just initial weights
    program.save(tmp_path / "convnet.purine")
    f = feeds((1, 8, 8), seed=5, batch=4)
    np.savez(tmp_path / "in.npz", **f)
    result = subprocess.run([sys.executable, "-c", FRESH, str(tmp_path / "convnet.purine"),
                             str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                            capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr
    logits = program.run({"data": f["data"]})["logits"]
    loss = program.step(f)
    with np.load(tmp_path / "out.npz") as out:
        assert out["logits"].tobytes() == logits.tobytes()
        assert out["loss"] == np.float32(loss)
        for name, value in program.params.items():
            assert out[name].tobytes() == value.tobytes(), name


def test_trace_has_one_event_per_kernel(tmp_path):
    trace = Trace()
    with purinec.compile("mlp", target="cpu", batch=2, input_shape=(1, 8, 8),
                         num_classes=10, trace=trace) as program:
        program.run({"data": np.ones((2, 1, 8, 8), np.float32)})
        kernels = [n for n in program.ir.nodes if n.op != "reshape"]
    trace.write(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(kernels)
    assert all(e["dur"] >= 0 for e in spans)


@pytest.mark.parametrize("target", ["reference", "cpu"])
def test_a_label_outside_the_classes_is_named_with_its_row(target):
    program = purinec.compile("mlp", target=target, train=purinec.SGD(), batch=4,
                              input_shape=(1, 2, 2), num_classes=3)
    feeds = {"data": np.random.default_rng(7).normal(size=(4, 1, 2, 2)),
             "label": np.array([0, 1, 5, 1])}
    with pytest.raises(purinec.PurinecError, match=r"softmax_xent\(%logits, %label\).* "
                                                   r"failed: ValueError: label 5 at row 2 is "
                                                   r"outside \[0, 3\)"):
        program.step(feeds)


def test_threads_serving_one_program_take_turns_and_closing_leaves_no_thread():
    """Four threads of a server calling run on one lenet program all get the reference's
    answers; once the program is closed, none of the threads it started is left."""
    options = dict(batch=2, input_shape=(1, 28, 28), num_classes=10, seed=4)
    gc.collect()  # programs other tests dropped let go of the team
    before = set(threading.enumerate())
    cpu = purinec.compile("lenet", target="cpu", **options)
    ref = purinec.compile("lenet", target="reference", **options)
    inputs = [feeds((1, 28, 28), seed)["data"] for seed in range(8)]
    expected = [ref.run({"data": x})["logits"] for x in inputs]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(lambda x: cpu.run({"data": x})["logits"], inputs * 5))
    for got, want in zip(outputs, expected * 5):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert team_threads() or available_cpus() == 1  # (else this proves nothing)
    cpu.close()
    assert ours(threading.enumerate()) <= before
    cpu.run({"data": inputs[0]})  # works again after closing, and closes again
    cpu.close()
    assert ours(threading.enumerate()) <= before


def ours(threads) -> set:
    """Threads but tqdm's monitor, which a compile's progress bar may start, and which
    tqdm keeps for the whole process."""
    return {t for t in threads if type(t).__name__ != "TMonitor"}


def team_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("purinec-kernel")]
