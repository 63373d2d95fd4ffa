"""ONNX in and out: `read_onnx` imports an ONNX file as a model purinec compiles like
any other.

The `onnx` package is an optional extra (``pip install 'purinec[onnx]'``); nothing
here imports it until a file is read.
"""

from purinec.onnxio.model import OnnxModel, read_onnx
from purinec.onnxio.ops import SUPPORTED_OPS

__all__ = ["OnnxModel", "SUPPORTED_OPS", "read_onnx"]
