"""Export torchvision's resnet18, mobilenet_v2, squeezenet1_1 and googlenet to the
weightless ONNX files that the ONNX importer's tests read (tests/onnx/models/).

    python3 -m venv /tmp/tv-venv
    /tmp/tv-venv/bin/pip install torch torchvision onnx  # the files: 2.14.1, 0.29.1
    /tmp/tv-venv/bin/python -m benchmarks.export_torchvision [--out tests/onnx/models]

Run it from the repository's root, in a venv of its own: it needs torch, like
``purinec[bench]``, and torchvision besides, whose wheels pull a CUDA build of torch
of several GB; purinec, its tests and CI need neither, which is why the files it writes
are committed. Only their weights' random values are left out (see
tests/onnx/torchvision_models.py for the format and for `load`, which fills them).

Each model is built with random weights, in eval mode, and exported at opset 17 with
input ``input`` [batch, 3, 224, 224] and output ``logits`` [batch, 1000], the batch
symbolic. How, and why so:

* by the TorchScript exporter (``dynamo=False``): the torch.export-based one runs an
  optimizer that folds every BatchNormalization into the Conv before it, and cannot
  convert down to opset 17;
* without constant folding: in eval mode the TorchScript exporter's folding fuses
  BatchNormalization into Conv too, and the tests train these graphs;
* from distinct random values in every parameter and buffer: the exporter merges
  initializers of equal value (torchvision sets every BatchNormalization's scale to
  ones, and so on) into one, read through Identity nodes, and the tests want each
  layer's parameters of their own;
* in eval mode, so that Dropout (in mobilenet_v2, squeezenet1_1 and googlenet) is left
  out of the graph, and googlenet without its auxiliary classifiers, which eval mode
  does not run either.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import onnx
import torch
import torchvision

from tests.onnx.torchvision_models import MODELS_DIR, NAMES, strip_weights

OPSET = 17
OPTIONS = {"googlenet": {"aux_logits": False, "init_weights": True}}


def build(name: str) -> torch.nn.Module:
    """Model ``name`` in eval mode, every float parameter and buffer drawn at random."""
    model = getattr(torchvision.models, name)(weights=None, **OPTIONS.get(name, {}))
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.rand_like(tensor) + 0.5)  # positive: running_var too
    return model.eval()


def export(model: torch.nn.Module) -> onnx.ModelProto:
    buffer = io.BytesIO()
    torch.onnx.export(model, (torch.randn(2, 3, 224, 224),), buffer, dynamo=False,
                      opset_version=OPSET, do_constant_folding=False,
                      input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
    return onnx.load_from_string(buffer.getvalue())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=MODELS_DIR)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    for name in NAMES:
        model = export(build(name))
        onnx.checker.check_model(model)  # weightless, it no longer passes
        strip_weights(model)
        target = args.out / f"{name}.onnx"
        onnx.save(model, target)
        print(f"{target}: {target.stat().st_size} bytes")


if __name__ == "__main__":
    main()
