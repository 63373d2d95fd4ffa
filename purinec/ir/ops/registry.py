"""The registry of ops and what an op definition holds.

An `OpDef` keeps every fact about one op: what it takes (inputs and typed attributes),
how its output types follow from its input types (`infer`), what it computes
(`reference`, in NumPy: the oracle every generated kernel is tested against), how it
fuses (`FusionKind`, TVM's lattice), how it may be split across devices (`split`
signatures, OneFlow's SBP idea), its gradient rule, its cost, its element expression
when it is elementwise, and named `Trait`s that passes and the runtime ask for instead
of lists of op names. The ops themselves are defined by family in this package's other
modules; `missing_facets` says what an op still lacks.
"""

from __future__ import annotations

import difflib
import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from purinec.errors import UnknownOpError, VerifyError
from purinec.ir.types import INT64_MAX, INT64_MIN, TensorType

if TYPE_CHECKING:
    from purinec.ir.expr import Expr
    from purinec.ir.graph import Graph, Node, Value


def by_name(what: str) -> tuple[dict[str, Callable], Callable]:
    """A table of functions keyed by op name, and the decorator ``@entry(*names)`` that
    fills it; a name given twice is a bug. Whatever keeps one function per op (a code
    generator's renderers, the ONNX importer's converters and exporter's writers) is
    such a table: supporting an op there is adding one entry. ``what`` names the
    functions, for that bug's message."""
    table: dict[str, Callable] = {}

    def entry(*names: str) -> Callable[[Callable], Callable]:
        def register(fn: Callable) -> Callable:
            for name in names:
                if name in table:
                    raise AssertionError(f"two {what} for {name!r}: {table[name]} and {fn}")
                table[name] = fn
            return fn
        return register
    return table, entry


class FusionKind(enum.IntEnum):
    """TVM's pattern kinds, ordered: a group fuses into a consumer of a higher kind."""

    elementwise = 0
    broadcast = 1
    injective = 2
    reduction = 3
    out_elementwise_fusable = 4
    opaque = 5


class Trait(enum.Enum):
    """What passes, codegen and the runtime may need to know of an op, named once."""

    host = "runs in the runtime on the host, not as a generated kernel"
    communicates = "moves data between devices or ranks: a task of a copy or comm queue"
    bucketable = "several over one group may merge into one multi-tensor bucket"
    epilogue_anchor = "elementwise consumers of its output may fuse into its epilogue"
    solver_update = "an optimizer step: updates one variable (input 0) from its gradient"
    view = "its output is a view of its input: free to compute, no memory of its own"
    in_place = ("each output may be written over the input in the same position (the "
                "kernel is done reading an input before it writes that output)")


REQUIRED = object()

ATTR_KINDS = ("int", "float", "bool", "str", "ints", "floats")


@dataclass(frozen=True)
class Bound:
    """The numbers an attribute (each entry, for a list) may take, beyond its kind:
    checked wherever attributes are (the parser, `OpDef.complete_attrs`, the verifier),
    so a value its op cannot use is refused where it is written."""

    test: Callable[[Any], bool]
    says: str  # what the values are, after "must be": "a finite number"


FINITE = Bound(math.isfinite, "a finite number")

# Integers are int64 everywhere (attributes reach kernels as machine integers).
INT64 = Bound(lambda v: INT64_MIN <= v <= INT64_MAX, "an int64 (-2**63 to 2**63 - 1)")


@dataclass(frozen=True)
class Attr:
    kind: str
    default: Any = REQUIRED
    doc: str = ""
    bound: Bound | None = None


# A split signature: one entry per input then one per output, each "B" (broadcast, i.e.
# replicated), "P" (partial sum) or "S<axis>" (split along axis). For example matmul
# with (S0, B) -> (S0,) is data parallelism; (B, S0) -> (S1,) splits output features.
@dataclass(frozen=True)
class SplitSignature:
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def __str__(self) -> str:
        return f"({', '.join(self.inputs)}) -> ({', '.join(self.outputs)})"


InferFn = Callable[[list[TensorType], dict], list[TensorType]]
SplitFn = Callable[[list[TensorType], dict], list[SplitSignature]]
# rule(graph, node, output_grads, needs) -> one gradient Value (or None) per input; see
# purinec.passes.autodiff, which calls it, and purinec.ir.ops.helpers.emit.
GradientRule = Callable[["Graph", "Node", list, "list[bool] | None"], "list[Value | None]"]
FlopsFn = Callable[["Node"], int]
ExprRule = Callable[["Node", "list[Expr]"], "list[Expr]"]


@dataclass(frozen=True)
class OpDef:
    name: str
    inputs: tuple[str, ...]
    infer: InferFn
    reference: Callable[..., tuple]
    fusion: FusionKind
    attrs: dict[str, Attr] = field(default_factory=dict)
    variadic: bool = False  # the last input may repeat (one or more times)
    split: SplitFn | None = None
    # The backward pass (None: not differentiable, as backward-only and integer ops).
    gradient: GradientRule | None = None
    # Floating-point operations of one run (purinec.passes.cost says the conventions).
    flops: FlopsFn | None = None
    # For an elementwise or broadcast op: one element expression per output from one
    # per input (purinec.ir.expr); every backend prints its loops from these.
    expr: ExprRule | None = None
    # For an input that does not line up with the output by NumPy's right-aligned
    # broadcasting: (attrs, input position) -> the output axes it runs along, or None.
    aligned: Callable[[dict, int], tuple[int, ...] | None] | None = None
    traits: frozenset[Trait] = frozenset()
    # Model parallelism: for a parameter read at input position i, the axis holding
    # the output features or channels, which the model strategy splits (from attrs).
    model_split: dict[int, Callable[[dict], int]] = field(default_factory=dict)
    # A mean over the rows of input 0 (loss, accuracy): on a piece of the rows its
    # result is weighted by the piece's share, at ("output", k) or ("input", k).
    row_mean: tuple[str, int] | None = None
    # The attribute that spells the output's shape; a device's piece gets its own.
    shape_attr: str | None = None
    doc: str = ""

    @property
    def differentiable(self) -> bool:
        return self.gradient is not None

    def has(self, trait: Trait) -> bool:
        return trait in self.traits

    def complete_attrs(self, attrs: dict) -> dict:
        """Check ``attrs`` against the schema, fill defaults, normalise number types."""
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise VerifyError(f"op {self.name} has no attribute(s) {', '.join(sorted(unknown))}"
                              f"; it takes: {', '.join(self.attrs) or 'none'}")
        result = {}
        for key, spec in self.attrs.items():
            if key in attrs:
                result[key] = coerce_attr(self.name, key, spec, attrs[key])
            elif spec.default is REQUIRED:
                raise VerifyError(f"op {self.name} needs attribute {key} ({spec.kind})")
            else:
                result[key] = coerce_attr(self.name, key, spec, spec.default)
        return result

    def check_arity(self, n: int) -> None:
        fixed = len(self.inputs) - (1 if self.variadic else 0)
        ok = n >= fixed + 1 if self.variadic else n == len(self.inputs)
        if not ok:
            want = f"at least {fixed + 1}" if self.variadic else str(len(self.inputs))
            raise VerifyError(f"op {self.name} takes {want} input(s) "
                              f"({', '.join(self.inputs)}), got {n}")

    def signatures(self, types: list[TensorType], attrs: dict) -> list[SplitSignature]:
        return self.split(types, attrs) if self.split else []


def coerce_attr(op: str, key: str, spec: Attr, value: Any) -> Any:
    """``value`` as attribute ``key`` of ``spec``'s kind, within its bound, or a
    VerifyError."""
    result = _coerce_kind(op, key, spec.kind, value)
    bounds = [INT64] if spec.kind in ("int", "ints") else []
    bounds += [spec.bound] if spec.bound is not None else []
    for bound in bounds:
        for number in result if isinstance(result, list) else [result]:
            if not bound.test(number):
                raise VerifyError(f"op {op}: attribute {key} must be {bound.says}, got "
                                  f"{_short(value)}")
    return result


def _short(value: Any) -> str:
    """``repr(value)``, cut short: a 5,000-digit number is not worth repeating."""
    try:
        text = repr(value)
    except ValueError:  # Python will not print an int of more than 4,300 digits
        return f"a {type(value).__name__} holding a number of more than 4,300 digits"
    return text if len(text) <= 60 else f"{text[:40]}...{text[-12:]} ({len(text)} characters)"


def _coerce_kind(op: str, key: str, kind: str, value: Any) -> Any:
    """``value`` as attribute ``key`` of kind ``kind``, or a VerifyError."""
    def bad():
        return VerifyError(f"op {op}: attribute {key} must be {kind}, got {_short(value)}")

    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise bad()
        return int(value)
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise bad()
        try:
            return float(value)
        except OverflowError:  # an int beyond float64
            raise bad() from None
    if kind == "bool":
        if not isinstance(value, (bool, np.bool_)):
            raise bad()
        return bool(value)
    if kind == "str":
        if not isinstance(value, str):
            raise bad()
        return value
    if kind in ("ints", "floats"):
        if not isinstance(value, (list, tuple)):
            raise bad()
        scalar = "int" if kind == "ints" else "float"
        return [_coerce_kind(op, key, scalar, v) for v in value]
    raise AssertionError(kind)


def missing_facets(opdef: OpDef) -> list[str]:
    """What ``opdef`` lacks that its kind of op needs: empty for a complete op."""
    missing = []
    if opdef.flops is None:
        missing.append("flops (its cost)")
    loop_kind = opdef.fusion <= FusionKind.broadcast
    if loop_kind and opdef.expr is None:
        missing.append("expr (elementwise and broadcast ops are printed from one)")
    if opdef.expr is not None and not loop_kind:
        missing.append(f"an elementwise or broadcast fusion kind (it has an expr but is "
                       f"{opdef.fusion.name})")
    if opdef.has(Trait.epilogue_anchor) and opdef.fusion is not FusionKind.out_elementwise_fusable:
        missing.append("fusion kind out_elementwise_fusable (it is an epilogue anchor)")
    if opdef.fusion is FusionKind.out_elementwise_fusable and not opdef.has(Trait.epilogue_anchor):
        missing.append("the epilogue_anchor trait (its kind fuses elementwise consumers)")
    if opdef.has(Trait.communicates) and not opdef.has(Trait.host):
        missing.append("the host trait (communication runs in the runtime)")
    return missing


REGISTRY: dict[str, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    """Add ``opdef`` to the registry; an op lacking a facet it needs is refused here, at
    import, rather than deep inside a pass that asks for it."""
    if opdef.name in REGISTRY:
        raise VerifyError(f"op {opdef.name} is registered twice")
    missing = missing_facets(opdef)
    if missing:
        raise VerifyError(f"op {opdef.name} lacks: {'; '.join(missing)}")
    REGISTRY[opdef.name] = opdef
    return opdef


def get_op(name: str) -> OpDef:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownOpError(unknown_op_message(name)) from None


def unknown_op_message(name: str) -> str:
    """``unknown op 'rleu'; did you mean relu?``, naming close registry entries."""
    close = difflib.get_close_matches(name, list(REGISTRY), n=4, cutoff=0.7)
    close += [n for n in sorted(REGISTRY) if n.startswith(name[:3]) and n not in close]
    hint = f"; did you mean {', '.join(close[:5])}?" if close else ""
    return f"unknown op '{name}'{hint}"


def op_has(op: str, trait: Trait) -> bool:
    """Whether the registered op named ``op`` has ``trait`` (an unknown op has none)."""
    opdef = REGISTRY.get(op)
    return opdef is not None and trait in opdef.traits


def ops_with(trait: Trait) -> frozenset[str]:
    """The names of the registered ops that have ``trait``."""
    return frozenset(name for name, opdef in REGISTRY.items() if opdef.has(trait))
