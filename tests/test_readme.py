"""The README's Python examples run as written."""

import pathlib
import re

import numpy as np

import purinec

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_quick_start_example_runs():
    namespace: dict = {}
    exec(python_blocks()[0], namespace)
    assert np.isfinite(namespace["loss"])
    assert namespace["logits"].shape == (64, 10)
    np.testing.assert_array_equal(namespace["program"].params["ip2.bias"], np.zeros(10))


def test_bigraph_example_builds_a_trainable_model(tmp_path):
    path = tmp_path / "mynet.py"
    path.write_text(python_blocks()[1])
    program = purinec.compile(str(path), train=purinec.SGD(lr=0.1), batch=4,
                              input_shape=(1, 8, 8), num_classes=3)
    assert program.ir.name == "mynet.train"
    assert set(program.params) == {"conv1.weight", "conv1.bias", "ip1.weight", "ip1.bias"}
    rng = np.random.default_rng(0)
    feeds = {"data": rng.normal(size=(4, 1, 8, 8)), "label": np.array([0, 1, 2, 0])}
    first = program.step(feeds)
    for _ in range(20):
        last = program.step(feeds)
    assert last < first  # it learns the four examples
