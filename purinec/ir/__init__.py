"""purinec's IR: typed, placed dataflow graphs whose text form round-trips."""

from purinec.ir.graph import Graph, Node, Value
from purinec.ir.ops import REGISTRY, FusionKind, OpDef, get_op
from purinec.ir.parser import parse
from purinec.ir.printer import print_graph
from purinec.ir.types import CPU0, Device, Distribution, DistKind, DType, TensorType
from purinec.ir.verify import verify

__all__ = ["Graph", "Node", "Value", "REGISTRY", "FusionKind", "OpDef", "get_op", "parse",
           "print_graph", "CPU0", "Device", "Distribution", "DistKind", "DType", "TensorType",
           "verify"]
