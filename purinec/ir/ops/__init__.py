"""The op registry: every IR op is defined once, with every fact about it, in the module
of its family. `registry` says what an op definition holds; adding an op is one
`register(OpDef(...))` in its family's module (and, for an op whose kernel is not
printed from its element expression, one renderer per target).
"""

from purinec.ir.nnref import conv_output_size, pool_output_size
from purinec.ir.ops import (communication, elementwise, fused, linalg, losses,  # noqa: F401
                            normalization, pooling, shape, solvers)
from purinec.ir.ops.communication import broadcast_types, spans_ranks
from purinec.ir.ops.registry import (REGISTRY, Attr, FusionKind, OpDef, SplitSignature, Trait,
                                     by_name, coerce_attr, get_op, missing_facets, op_has,
                                     ops_with, register, unknown_op_message)

__all__ = ["REGISTRY", "Attr", "FusionKind", "OpDef", "SplitSignature", "Trait",
           "broadcast_types", "by_name", "coerce_attr", "conv_output_size", "get_op",
           "missing_facets", "op_has", "ops_with", "pool_output_size", "register",
           "spans_ranks", "unknown_op_message"]
