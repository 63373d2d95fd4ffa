"""The target interface, kept honest by a toy target defined here: NumPy kernels printed
from the ops' element expressions (the references for the rest), its own arena memory
and worker set-up, trained end to end through compile() and Program."""

import types

import numpy as np
import pytest

import purinec
from purinec.codegen.expr_print import print_exprs
from purinec.errors import PurinecError
from purinec.ir.expr import U64, Arg
from purinec.ir.ops import get_op
from purinec.ir.types import DType
from purinec.runtime.plan import FreshArenas, reference_kernels
from purinec.targets import TARGETS, Target, get_target

NUMPY_FUNCTIONS = {
    "add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}", "div": "{0} / {1}",
    "neg": "-{0}", "lt": "{0} < {1}", "le": "{0} <= {1}", "gt": "{0} > {1}",
    "ne": "{0} != {1}", "or": "np.logical_or({0}, {1})", "select": "np.where({0}, {1}, {2})",
    "exp": "np.exp({0})", "tanh": "np.tanh({0})",
    "cast": lambda call, args: f"{args[0]}.astype(np.{DType(call.dtype).numpy.name})",
}


def _literal(const):
    assert const.dtype != U64, "the toy prints no dropout masks"
    return f"np.{DType(const.dtype).numpy.name}({const.value!r})"


def printed_kernel(node):
    """A whole-array NumPy kernel printed from ``node``'s element expression."""
    lines = []

    def bind(source, hoist):
        lines.append(f"    t{len(lines)} = {source}")
        return f"t{len(lines) - 1}"

    names = [f"in{i}" for i in range(len(node.inputs))]
    exprs = get_op(node.op).expr(node, [Arg(i) for i in range(len(names))])
    texts = print_exprs(exprs, [(n, False) for n in names], NUMPY_FUNCTIONS, _literal,
                        "index", bind)
    outs = [f"out{k}" for k in range(len(texts))]
    source = "\n".join([f"def kernel({', '.join(names + outs)}):", *lines,
                        *(f"    {o}[...] = {t}" for o, t in zip(outs, texts))])
    namespace = {"np": np}
    exec(source, namespace)
    return types.SimpleNamespace(name=f"printed_{node.op}", source=source,
                                 fn=namespace["kernel"])


class ToyArenas:
    """Arena memory of the toy's own, which counts what it hands out."""

    allocated: list = []

    @classmethod
    def allocate(cls, sizes):
        cls.allocated.append(dict(sizes))
        return FreshArenas.allocate(sizes)

    @staticmethod
    def release():
        pass


class Toy(Target):
    name = "toy"
    doc = "NumPy kernels printed from element expressions"
    generates_code = True
    arenas = ToyArenas

    def __init__(self):
        self.printed, self.lanes = [], []

    def _printable(self, node):
        same = all(v.type.shape == node.outputs[0].type.shape for v in node.inputs)
        return get_op(node.op).expr is not None and node.inputs and same

    def generated(self, graph):
        return {node: printed_kernel(node) for node in graph.nodes if self._printable(node)}

    def kernels(self, graph):
        kernels = reference_kernels(graph)
        for node, kernel in self.generated(graph).items():
            kernels[node] = kernel.fn
            self.printed.append(node.op)
        return kernels

    def worker_setup(self, graph):
        return self.lanes.append


@pytest.fixture
def toy(monkeypatch):
    target = Toy()
    monkeypatch.setitem(TARGETS, "toy", target)
    ToyArenas.allocated.clear()
    return target


def test_a_toy_target_trains_mlp_as_the_reference_does(toy):
    options = dict(batch=8, input_shape=(1, 4, 4), num_classes=3, seed=1)
    solver = purinec.SGD(lr=0.1, momentum=0.9)
    ours = purinec.compile("mlp", target="toy", train=solver, **options)
    oracle = purinec.compile("mlp", target="reference", train=solver, **options)
    rng = np.random.default_rng(0)
    x = rng.random((8, 1, 4, 4)).astype(np.float32)
    y = rng.integers(0, 3, 8).astype(np.int32)
    losses = []
    for _ in range(5):
        losses.append(ours.step({"data": x, "label": y}))
        np.testing.assert_allclose(losses[-1], oracle.step({"data": x, "label": y}),
                                   rtol=1e-5)
    assert losses[-1] < losses[0]  # it learns
    for name in oracle.params:
        np.testing.assert_allclose(ours.params[name], oracle.params[name], rtol=1e-4,
                                   atol=1e-6)
    np.testing.assert_allclose(ours.run({"data": x})["logits"],
                               oracle.run({"data": x})["logits"], rtol=1e-4, atol=1e-6)
    # Its own parts were used: printed kernels, its arenas, its worker set-up.
    assert {"relu", "relu_grad", "sgd"} <= set(toy.printed)
    assert ToyArenas.allocated and toy.lanes
    ours.close()


def test_a_toy_target_artifact_carries_its_printed_sources(toy, tmp_path):
    program = purinec.compile("mlp", target="toy", batch=2, input_shape=(1, 2, 2),
                              num_classes=3)
    saved = program.save(tmp_path / "toy.purine")
    assert saved.kernels >= 1  # relu, printed
    assert purinec.load(tmp_path / "toy.purine").target == "toy"


def test_a_target_that_cannot_run_here_says_what_is_missing(monkeypatch):
    class Absent(Target):
        name = "absent"

        def missing(self):
            return "it needs the absent package: pip install 'purinec[absent]'"

    monkeypatch.setitem(TARGETS, "absent", Absent())
    with pytest.raises(PurinecError, match=r"target absent cannot run here: it needs the "
                                           r"absent package: pip install"):
        purinec.compile("mlp", target="absent", batch=2)
    with pytest.raises(PurinecError, match="unknown target 'nope'; available: reference, cpu"):
        get_target("nope")


def test_nothing_outside_a_targets_own_modules_names_a_target():
    """Targets are looked up by name; no module compares a target's name (the command
    line's default is a name, not a comparison)."""
    import pathlib
    import re

    root = pathlib.Path(purinec.__file__).parent
    compares = re.compile(r"""target\w*\s*[!=]=\s*["'](cpu|reference|cuda)["']""")
    offenders = [f"{path.relative_to(root)}:{n}" for path in root.rglob("*.py")
                 if "targets" not in path.parts
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if compares.search(line)]
    assert offenders == []
