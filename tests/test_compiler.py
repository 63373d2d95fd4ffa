"""compile(), Program and the reference target, end to end."""

import re

import numpy as np
import pytest

import purinec
from purinec.compiler import build_graph, load_source
from purinec.passes.pipeline import STAGES
from purinec.data import load_dataset
from purinec.errors import ExecutionError, PurinecError
from purinec.ir import parse
from purinec.models import ZOO
from purinec.bigraph.lower import lower
from purinec.train import evaluate, train


def _softmax_xent_numpy(logits, label):
    shifted = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    n = len(label)
    loss = -np.log(p[np.arange(n), label]).mean()
    dlogits = p.copy()
    dlogits[np.arange(n), label] -= 1
    return loss, dlogits / n


def _mlp_step_numpy(params, history, x, y, lr, momentum, wd):
    """One SGD step of flatten-ip1-relu-ip2-relu-ip3-softmax_xent, written out by hand."""
    h0 = x.reshape(len(x), -1)
    a1 = h0 @ params["ip1.weight"].T + params["ip1.bias"]
    h1 = np.maximum(a1, 0)
    a2 = h1 @ params["ip2.weight"].T + params["ip2.bias"]
    h2 = np.maximum(a2, 0)
    logits = h2 @ params["ip3.weight"].T + params["ip3.bias"]
    loss, d3 = _softmax_xent_numpy(logits, y)
    grads = {"ip3.weight": d3.T @ h2, "ip3.bias": d3.sum(0)}
    d2 = (d3 @ params["ip3.weight"]) * (a2 > 0)
    grads.update({"ip2.weight": d2.T @ h1, "ip2.bias": d2.sum(0)})
    d1 = (d2 @ params["ip2.weight"]) * (a1 > 0)
    grads.update({"ip1.weight": d1.T @ h0, "ip1.bias": d1.sum(0)})
    new_params, new_history = {}, {}
    for name, w in params.items():
        update = momentum * history[name] + lr * (grads[name] + wd * w)
        new_params[name] = w - update
        new_history[name] = update
    return loss, new_params, new_history


def test_training_step_matches_handwritten_numpy():
    lr, momentum, wd = 0.1, 0.9, 0.01
    program = purinec.compile("mlp", train=purinec.SGD(lr, momentum, wd), batch=6,
                              input_shape=(1, 3, 3), num_classes=4, seed=3)
    rng = np.random.default_rng(7)
    params = {k: v.astype(np.float64) for k, v in program.params.items()}
    # Random (not zero) biases so every term of the step is exercised.
    for name in params:
        if name.endswith(".bias"):
            params[name] = rng.normal(0, 0.1, params[name].shape)
            program.params[name] = params[name]
    history = {k: np.zeros_like(v) for k, v in params.items()}
    for _ in range(3):  # several steps, so momentum history matters
        x = rng.normal(0, 1, (6, 1, 3, 3)).astype(np.float32)
        y = rng.integers(0, 4, 6).astype(np.int32)
        want_loss, params, history = _mlp_step_numpy(params, history, x.astype(np.float64),
                                                     y, lr, momentum, wd)
        loss = program.step({"data": x, "label": y})
        assert loss == pytest.approx(want_loss, rel=1e-5)
        for name in params:
            np.testing.assert_allclose(program.params[name], params[name], rtol=2e-4,
                                       atol=2e-6, err_msg=name)
            np.testing.assert_allclose(program.state[f"{name}.history"], history[name],
                                       rtol=2e-4, atol=2e-6, err_msg=name)


@pytest.mark.slow  # trains to an accuracy
def test_mlp_reaches_90_percent_on_digits():
    data = load_dataset("digits")
    program = purinec.compile("mlp", train=purinec.SGD(lr=0.05, momentum=0.9,
                                                       weight_decay=5e-4),
                              batch=64, input_shape=data.input_shape, num_classes=10)
    result = train(program, data, epochs=10, batch=64, progress=False)
    assert result.final.test_accuracy >= 0.90, result.epochs
    assert result.epochs[-1].loss < result.epochs[0].loss


def test_training_stops_when_the_loss_is_no_longer_a_number():
    from purinec.data import Dataset
    from purinec.errors import TrainingError

    rng = np.random.default_rng(6)
    x, y = rng.normal(size=(40, 1, 2, 2)), rng.integers(0, 3, 40)
    ended = []
    for lr, dirty, why in [(1e30, False, "training diverged: try a smaller --lr"),
                           (0.1, True, "the batch holds non-finite inputs")]:
        train_x = x.copy()
        if dirty:
            train_x[7, 0, 1, 1] = np.nan
        data = Dataset("tiny", train_x, y, x[:8], y[:8], 3)
        program = purinec.compile("mlp", train=purinec.SGD(lr=lr), batch=8,
                                  input_shape=(1, 2, 2), num_classes=3)
        with pytest.raises(TrainingError, match=r"the training loss is (nan|inf) at epoch 1, "
                                                r"step \d of 5; " + re.escape(why)), \
                np.errstate(all="ignore"):  # (NumPy's overflow warnings on the way there)
            train(program, data, epochs=3, batch=8, progress=False, on_epoch_end=ended.append)
    assert ended == []  # no epoch ended: a checkpoint would have held broken weights


def _round_trip_check(name: str, seen: list[str]):
    """A stage hook: the IR of every stage parses back to the same text; the stages
    are noted in ``seen``."""
    def check(stage, graph):
        text = str(graph)
        assert str(parse(text)) == text, f"{name} at {stage}"
        seen.append(stage)
    return check


CUDA_ONLY = ("on_gpus", "local_collectives")  # the cuda target's own stages


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.parametrize("training", [False, True])
def test_every_stage_of_every_zoo_model_round_trips(name, training):
    seen = []
    check = _round_trip_check(name, seen)
    sgd = purinec.SGD(lr=0.01, momentum=0.9, weight_decay=1e-4) if training else None
    build_graph(load_source(name, batch=2), sgd, check, target="cpu")  # cpu: fuse runs too
    parallel_only = ("stages", "microbatch", "parallel", "partition")
    training_only, inference_only = ("autodiff", "optimizer"), ("slices", "panels")
    expected = [s for s in STAGES if s not in (inference_only if training else training_only)
                and s not in parallel_only and s not in CUDA_ONLY]
    assert seen == expected


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.parametrize("strategy", ["data", "ps", "pipeline"])
def test_every_parallel_stage_of_every_zoo_model_round_trips(name, strategy):
    from purinec.targets import get_target
    from purinec.passes.parallel import Parallel, parse_devices

    seen = []
    check = _round_trip_check(name, seen)
    spread = Parallel(parse_devices("2"), strategy)
    logical = build_graph(load_source(name, batch=4), purinec.SGD(lr=0.01), check, "cpu",
                          spread)
    get_target("cpu").pipeline().run_physical(logical, check)
    expected = [s for s in STAGES if (strategy == "pipeline" or
                                      s not in ("stages", "microbatch")) and s not in CUDA_ONLY]
    assert seen == expected


def test_run_returns_logits_and_keeps_params():
    program = purinec.compile("mlp", train=purinec.SGD(lr=0.1), batch=4,
                              input_shape=(1, 2, 2), num_classes=3)
    before = {k: v.copy() for k, v in program.params.items()}
    x = np.random.default_rng(0).normal(size=(4, 1, 2, 2))
    out = program.run({"data": x})
    assert set(out) == {"logits"} and out["logits"].shape == (4, 3)
    for k, v in program.params.items():
        np.testing.assert_array_equal(v, before[k])


@pytest.mark.parametrize("target", ["reference", "cpu"])
def test_views_of_params_and_state_follow_training(target):
    program = purinec.compile("mlp", train=purinec.SGD(lr=0.1), batch=4, target=target,
                              input_shape=(1, 2, 2), num_classes=3)
    names = list(program.params) + list(program.state)
    views = {name: (program.params if name in program.params else program.state)[name]
             for name in names}
    first = {name: view.copy() for name, view in views.items()}
    rng = np.random.default_rng(3)
    for _ in range(2):
        program.step({"data": rng.normal(size=(4, 1, 2, 2)), "label": rng.integers(0, 3, 4)})
    for name, view in views.items():
        store = program.params if name in program.params else program.state
        np.testing.assert_array_equal(view, store[name], err_msg=name)
        assert not np.array_equal(view, first[name]), name  # it did change


def test_running_a_training_graph_leaves_params_alone(tmp_path):
    """A training graph run as it is (a .pir of the fused stage, compiled without
    train=) computes updates: run drops them, and in-place kernels must not apply them."""
    stages = {}
    purinec.compile("mlp", target="cpu", train=purinec.SGD(lr=0.1), batch=4,
                    input_shape=(1, 2, 2), num_classes=3,
                    after=lambda stage, graph: stages.setdefault(stage, str(graph)))
    path = tmp_path / "mlp.fuse.pir"
    path.write_text(stages["fuse"])
    program = purinec.compile(str(path), target="cpu")
    before = {name: array.copy() for name, array in program.params.items()}
    rng = np.random.default_rng(4)
    feeds = {"data": rng.normal(size=(4, 1, 2, 2)), "label": rng.integers(0, 3, 4)}
    assert program.run(feeds)["loss"] == program.run(feeds)["loss"]
    for name, array in program.params.items():
        np.testing.assert_array_equal(array, before[name], err_msg=name)


def test_feeds_are_checked():
    program = purinec.compile("mlp", batch=4, input_shape=(1, 2, 2), num_classes=3)
    with pytest.raises(ExecutionError, match="missing data"):
        program.run({})
    with pytest.raises(ExecutionError, match=r"expected f32\[4,1,2,2\]"):
        program.run({"data": np.zeros((5, 1, 2, 2))})
    with pytest.raises(ExecutionError, match="unknown extra"):
        program.run({"data": np.zeros((4, 1, 2, 2)), "extra": 1})
    with pytest.raises(PurinecError, match="compiled for inference"):
        program.step({"data": np.zeros((4, 1, 2, 2)), "label": np.zeros(4, np.int32)})
    trainable = purinec.compile("mlp", train=purinec.SGD(), batch=4, input_shape=(1, 2, 2),
                                num_classes=3)
    x = np.random.default_rng(5).normal(size=(4, 1, 2, 2))
    with pytest.raises(ExecutionError, match=r"input label: values from 0 to 4294967299 do "
                                             r"not fit i32\[4\]"):
        trainable.step({"data": x, "label": np.array([0, 1, 2, 2**32 + 3])})
    assert np.isfinite(trainable.step({"data": x, "label": np.array([0, 1, 2, 1], np.int64)}))


def test_params_can_be_set_and_are_checked():
    program = purinec.compile("mlp", batch=2, input_shape=(1, 2, 2), num_classes=3)
    w = np.arange(3 * 512, dtype=np.float64).reshape(3, 512)
    program.params["ip3.weight"] = w
    assert program.params["ip3.weight"].dtype == np.float32
    np.testing.assert_array_equal(program.params["ip3.weight"], w.astype(np.float32))
    with pytest.raises(PurinecError, match="has shape"):
        program.params["ip3.weight"] = np.zeros((2, 2))
    with pytest.raises(PurinecError, match="no parameter named"):
        program.params["nope"] = np.zeros(1)
    # Reading a misspelt name says what there is; it is still a mapping's KeyError.
    with pytest.raises(KeyError) as raised:
        program.params["ip3.wieght"]
    assert isinstance(raised.value, PurinecError)
    assert str(raised.value).startswith("no parameter named 'ip3.wieght'; the program has "
                                        "ip1.weight, ip1.bias")
    assert program.params.get("ip3.wieght") is None and "ip3.wieght" not in program.params


def test_arguments_of_the_wrong_kind_get_errors_that_say_what_to_give(tmp_path):
    from purinec.bigraph import Blob, InnerProduct, Net

    for kwargs, message in [
            ({"train": True}, "train=True: give purinec.SGD"),
            ({"devices": 2.0}, "devices=2.0: give a count"),
            ({"devices": ["cpu:0", 1]}, "a list of Device objects or device names"),
            ({"trace": 3, "target": "cpu"}, "trace=3: give a purinec.runtime.trace.Trace")]:
        with pytest.raises(PurinecError, match=re.escape(message)):
            purinec.compile("mlp", batch=2, **kwargs)
    two = purinec.compile("mlp", batch=2, devices=["cpu:0", "cpu:1"])
    assert [str(d) for d in two.devices] == ["cpu:0", "cpu:1"]
    with pytest.raises(PurinecError, match="SGD: lr must be a number, got '0.1'"):
        purinec.SGD(lr="0.1")
    program = purinec.compile("mlp", batch=2, input_shape=(1, 2, 2), num_classes=3)
    with pytest.raises(ExecutionError, match="feeds: give a dict of input name -> array "
                                             r"\(graph mlp takes data\), got a ndarray"):
        program.run(np.zeros((2, 1, 2, 2)))
    for bad in (np.array(["a"] * 3), np.ones(3, complex)):
        with pytest.raises(PurinecError, match=f"parameter ip3.bias is float32, got an array "
                                               f"of {bad.dtype}"):
            program.params["ip3.bias"] = bad
    program.params["ip3.bias"] = [1, 2, 3]  # integers become floats
    assert program.params["ip3.bias"].tolist() == [1.0, 2.0, 3.0]
    with Net("tiny") as net:
        net.outputs = [Blob("data", (2, 3)) >> InnerProduct("ip", 4) >> Blob("out")]
    with pytest.raises(PurinecError, match="a Net has fixed shapes; batch and model options"):
        purinec.compile(net, batch=8)
    latin = tmp_path / "latin.pir"
    latin.write_bytes(b"graph g() {\n  return  # caf\xe9\n}\n")
    with pytest.raises(PurinecError, match=r"latin\.pir is not IR text \(byte 27 is not "
                                           r"UTF-8\)"):
        purinec.compile(str(latin))
    with pytest.raises(PurinecError, match="a.purine is a compiled artifact: load it with "
                                           "purinec.load"):
        purinec.compile(str(tmp_path / "a.purine"))


def test_programs_and_their_arrays_say_what_they_are():
    program = purinec.compile("mlp", train=purinec.SGD(), batch=4, input_shape=(1, 2, 2),
                              num_classes=3)
    assert repr(program) == ("<Program mlp.train and mlp, target reference, on cpu:0, "
                             "6 parameter(s)>")
    assert repr(program.params).startswith("<parameter arrays: ip1.weight f32[512,4], "
                                           "ip1.bias f32[512], ")
    assert repr(program.state).startswith("<state arrays: ip1.weight.history f32[512,4]")


def test_a_batch_that_build_ignores_is_refused(tmp_path):
    path = tmp_path / "fixed.py"
    path.write_text("from purinec.bigraph import Blob, Net, ReLU\n"
                    "def build(batch=4):\n"
                    "    with Net('fixed') as net:\n"
                    "        net.outputs = [Blob('data', (16, 3)) >> ReLU('r')]\n"
                    "    return net\n")
    with pytest.raises(PurinecError, match=r"batch 64 \(--batch\) was asked for, but .*fixed.py "
                                           r"makes input data f32\[16,3\]"):
        purinec.compile(str(path), batch=64)
    assert purinec.compile(str(path)).ir.input("data").type.shape == (16, 3)


def test_unknown_target_is_refused():
    with pytest.raises(PurinecError, match="unknown target 'tpu'"):
        purinec.compile("mlp", target="tpu")


def test_pir_file_compiles_and_trains_like_the_model(tmp_path):
    # The train-mode forward graph: the inference graph has no loss to differentiate.
    forward = lower(load_source("mlp", batch=4, input_shape=(1, 2, 2), num_classes=3),
                    mode="train")
    path = tmp_path / "mlp.pir"
    path.write_text(str(forward))
    sgd = purinec.SGD(lr=0.1, momentum=0.5)
    from_file = purinec.compile(str(path), train=sgd, seed=1)
    from_zoo = purinec.compile("mlp", train=sgd, batch=4, input_shape=(1, 2, 2),
                               num_classes=3, seed=1)
    rng = np.random.default_rng(1)
    feeds = {"data": rng.normal(size=(4, 1, 2, 2)), "label": np.array([0, 1, 2, 1])}
    assert from_file.step(feeds) == from_zoo.step(feeds)
    for name in from_zoo.params:
        np.testing.assert_array_equal(from_file.params[name], from_zoo.params[name])
    # Its inference graph is that forward pass, labels and all: evaluating feeds them.
    x, y = rng.normal(size=(10, 1, 2, 2)), rng.integers(0, 3, 10)
    assert evaluate(from_file, x, y, batch=4) == evaluate(from_zoo, x, y, batch=4)


def test_a_training_pir_that_leaves_a_parameter_out_says_so(tmp_path):
    stages = {}
    purinec.compile("mlp", train=purinec.SGD(), batch=4, input_shape=(1, 2, 2),
                    num_classes=3, after=lambda stage, graph: stages.setdefault(stage, graph))
    text = str(stages["optimizer"])
    assert "ip1.weight=%ip1.weight.next" in text
    path = tmp_path / "misspelt.pir"
    path.write_text(text.replace("ip1.weight=%ip1.weight.next", "ip1.wieght=%ip1.weight.next"))
    with pytest.warns(purinec.PurinecWarning) as warned:
        program = purinec.compile(str(path))
    assert str(warned[0].message) == (
        "graph mlp.train updates some parameters but leaves ip1.weight as it is: no output "
        "has its name (did you mean output ip1.wieght for ip1.weight?)")
    assert program.trainable


def test_a_trace_goes_to_targets_that_record_them(monkeypatch):
    """A target that records traces gets the trace; Program.close (or leaving a with
    block) lets it finish. Others refuse a trace instead of ignoring it."""
    from purinec.runtime.reference import execute
    from purinec.targets import TARGETS, Target

    events = []

    class TracingExecutable:
        def __init__(self, graph, trace):
            self.graph, self.trace = graph, trace
            events.append(("build", graph.name, trace))

        def __call__(self, env):
            return execute(self.graph, env)

        def close(self):
            events.append(("close", self.graph.name, self.trace))

    class Traced(Target):
        name = "traced"
        records_traces = True

        def executable(self, graph, trace=None):
            return TracingExecutable(graph, trace)

    monkeypatch.setitem(TARGETS, "traced", Traced())
    options = dict(batch=2, input_shape=(1, 2, 2), num_classes=3)
    recorder = object()  # what the target records into; Program passes it through
    with purinec.compile("mlp", target="traced", trace=recorder, **options) as program:
        program.run({"data": np.zeros((2, 1, 2, 2))})
    # An inference program's main graph is its inference graph: one executable.
    assert events == [("build", "mlp", recorder), ("close", "mlp", recorder)]
    # The message names the targets that record traces, from the registry.
    with pytest.raises(PurinecError, match=r"target reference records no traces, which "
                                           r"--trace and --timeline \(trace=\) need; .* "
                                           r"that records them: cpu, traced$"):
        purinec.compile("mlp", trace=recorder, **options)


@pytest.mark.slow
def test_convnet_reaches_97_percent_on_digits_with_the_cpu_target():
    """The README's main job, asserted: compiled CPU kernels train the convnet."""
    data = load_dataset("digits")
    program = purinec.compile("convnet", target="cpu",
                              train=purinec.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4),
                              batch=32, input_shape=data.input_shape, num_classes=10)
    result = train(program, data, epochs=15, batch=32, progress=False)
    assert result.final.test_accuracy >= 0.97, result.epochs


@pytest.mark.parametrize("target", ["reference", "cpu"])
def test_what_reads_the_weights_alone_is_kept_between_runs_and_outputs_stay_the_callers(
        target):
    """``sqrt(w)`` reads a parameter alone: it is computed once and kept until ``w``
    changes. Outputs that are kept values, or views of one, are copies: changing them
    changes no later run."""
    graph = parse("""graph kept(
    %x: f32[2,3] @cpu:0,
    %w: f32[3] @cpu:0 {param, init="constant(4)"}
) {
  %s = sqrt(%w) : f32[3] @cpu:0
  %r = reshape(%s) {shape=[1,3]} : f32[1,3] @cpu:0
  %y = bias_add(%x, %s) {axis=1} : f32[2,3] @cpu:0
  return %y, %s, %r
}""")
    x = np.ones((2, 3), np.float32)
    with purinec.compile(graph, target=target) as program:
        first = program.run({"x": x})
        for array in first.values():
            array[...] = -1
        again = program.run({"x": x})
        np.testing.assert_array_equal(again["s"], [2, 2, 2])
        np.testing.assert_array_equal(again["r"], [[2, 2, 2]])
        np.testing.assert_array_equal(again["y"], np.full((2, 3), 3))
        program.params["w"] = np.array([1, 9, 16])
        changed = program.run({"x": x})
        np.testing.assert_array_equal(changed["s"], [1, 3, 4])
        np.testing.assert_array_equal(changed["y"], [[2, 4, 5], [2, 4, 5]])
