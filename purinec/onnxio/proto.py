"""What the ONNX front end shares: the onnx package, ONNX's element types and how
messages name a node."""

from __future__ import annotations

from typing import Any

from purinec.errors import ModelError
from purinec.ir.types import DType

# ONNX's element types that the IR has (TensorProto.DataType values).
ONNX_DTYPES = {1: DType.f32, 11: DType.f64, 6: DType.i32, 7: DType.i64, 9: DType.bool}


def onnx_package():
    """The onnx module, or a ModelError saying how to install it."""
    try:
        import onnx
        import onnx.reference  # noqa: F401  (folding evaluates nodes with it)
    except ImportError:
        raise ModelError("reading and writing ONNX files needs the onnx package: "
                         "pip install 'purinec[onnx]'") from None
    return onnx


def describe(node) -> str:
    """``/layer1/Conv (Conv)``: how messages name a node."""
    name = node.name or (node.output[0] if node.output else "?")
    domain = f"{node.domain}." if node.domain not in ("", "ai.onnx") else ""
    return f"{name} ({domain}{node.op_type})"


def ir_dtype(elem_type: int, what: str) -> DType:
    """The IR dtype of ONNX element type ``elem_type``, or a ModelError naming ``what``."""
    if elem_type not in ONNX_DTYPES:
        from onnx import TensorProto

        try:
            name = TensorProto.DataType.Name(elem_type).lower()
        except ValueError:  # a number this onnx does not know
            name = str(elem_type)
        raise ModelError(f"{what} is of ONNX type {name}; purinec computes in "
                         f"float, double, int32, int64 and bool")
    return ONNX_DTYPES[elem_type]


def attributes(node) -> dict[str, Any]:
    """The node's attributes as Python values (lists for repeated fields, arrays for
    tensors)."""
    from onnx import helper, numpy_helper

    result = {}
    for attribute in node.attribute:
        value = helper.get_attribute_value(attribute)
        if attribute.type == attribute.TENSOR:
            value = numpy_helper.to_array(value)
        elif isinstance(value, bytes):
            value = value.decode()
        elif isinstance(value, (list, tuple)):
            value = [v.decode() if isinstance(v, bytes) else v for v in value]
        result[attribute.name] = value
    return result


def array_dtype(array: Any, what: str) -> DType:
    """The IR dtype of a NumPy array read from a file, or a ModelError naming ``what``."""
    from onnx import helper

    try:
        elem_type = helper.np_dtype_to_tensor_dtype(array.dtype)
    except (KeyError, TypeError, ValueError):
        elem_type = 0
    return ir_dtype(elem_type, what)
