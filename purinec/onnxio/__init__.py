"""ONNX in and out: `read_onnx` imports an ONNX file as a model purinec compiles like
any other; `export_onnx` writes an inference graph and its weights as one.

The `onnx` package is an optional extra (``pip install 'purinec[onnx]'``); nothing
here imports it until a file is read or written.
"""

from purinec.onnxio.export import OPSET, Exported, export_onnx
from purinec.onnxio.model import OnnxModel, read_onnx
from purinec.onnxio.ops import SUPPORTED_OPS

__all__ = ["OPSET", "Exported", "OnnxModel", "SUPPORTED_OPS", "export_onnx", "read_onnx"]
