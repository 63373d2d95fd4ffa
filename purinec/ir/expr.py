"""Element expressions: what an elementwise op computes for one element, as a tiny tree
that every backend prints.

An op's `expr` rule (`OpDef.expr`) takes one expression per input, standing for that
input's element, and returns one per output. Leaves are operands (`Arg`), typed
constants (`Const`) and the element's flat C-order index (`Index`); an inner node
(`Call`) applies one function of `FUNCTIONS` to its children. A backend prints a tree
through a table from function name to source text (`purinec.codegen.expr_print`), so
the same rules serve the Numba CPU kernels and the CUDA ones. A subexpression used twice
(sgd's update) is one object: printers bind it to a local once.

Arithmetic operators build calls (``gy * y * (one - y)``); constants are always explicit
`Const` nodes of a named dtype, so a backend never guesses a Python number's type.
"""

from __future__ import annotations

from dataclasses import dataclass

# Every function a rule may use, with its number of arguments. The dtype names are the
# IR's (f32, f64, i32, i64, bool) plus u64, the unsigned 64-bit integers of the
# counter-based hash that draws dropout masks.
FUNCTIONS = {
    "add": 2, "sub": 2, "mul": 2, "div": 2, "neg": 1,
    "lt": 2, "le": 2, "gt": 2, "ne": 2,    # comparisons, giving bool
    "or": 2,                               # of bools
    "select": 3,                           # select(cond, a, b): a where cond, else b
    "exp": 1, "tanh": 1, "log": 1, "sqrt": 1, "abs": 1, "erf": 1,
    "pow": 2,                              # pow(a, b): a ** b
    "cast": 1,                             # to Call.dtype
    "u64": 1,                              # an integer's two's complement bits as u64
    "xor": 2, "shr": 2,                    # on u64
    "mix64": 1,                            # splitmix64's finalizer on u64 (nnref.splitmix64)
}

U64 = "u64"


class Expr:
    """A node of an element expression; see the module doc."""

    def __add__(self, other: Expr) -> Call:
        return call("add", self, other)

    def __sub__(self, other: Expr) -> Call:
        return call("sub", self, other)

    def __mul__(self, other: Expr) -> Call:
        return call("mul", self, other)

    def __truediv__(self, other: Expr) -> Call:
        return call("div", self, other)

    def __neg__(self) -> Call:
        return call("neg", self)


@dataclass(frozen=True, eq=False)
class Arg(Expr):
    """The current element of input ``index``."""

    index: int


@dataclass(frozen=True, eq=False)
class Const(Expr):
    """``value`` as a constant of ``dtype`` (an IR dtype name, or ``u64``)."""

    value: float | int | bool
    dtype: str


@dataclass(frozen=True, eq=False)
class Index(Expr):
    """The element's flat C-order index in the loop's shape."""


@dataclass(frozen=True, eq=False)
class Call(Expr):
    fn: str
    args: tuple[Expr, ...]
    dtype: str | None = None  # the target dtype of a cast

    def __post_init__(self):
        if self.fn not in FUNCTIONS:
            raise ValueError(f"unknown expression function {self.fn!r}; "
                             f"known: {', '.join(FUNCTIONS)}")
        if len(self.args) != FUNCTIONS[self.fn]:
            raise ValueError(f"{self.fn} takes {FUNCTIONS[self.fn]} argument(s), "
                             f"got {len(self.args)}")
        if not all(isinstance(a, Expr) for a in self.args):
            raise TypeError(f"{self.fn}: arguments must be expressions (use Const for "
                            f"numbers), got {self.args}")
        if (self.fn == "cast") != (self.dtype is not None):
            raise ValueError("a cast, and only a cast, names its dtype")


def call(fn: str, *args: Expr) -> Call:
    return Call(fn, args)


def select(cond: Expr, a: Expr, b: Expr) -> Call:
    return Call("select", (cond, a, b))


def cast(x: Expr, dtype: str) -> Call:
    return Call("cast", (x,), dtype)


def walk(roots: list[Expr]):
    """Every node reachable from ``roots``, each once, children before parents."""
    seen: set[int] = set()
    order: list[Expr] = []

    def visit(e: Expr) -> None:
        if id(e) in seen:
            return
        seen.add(id(e))
        for child in getattr(e, "args", ()):
            visit(child)
        order.append(e)

    for root in roots:
        visit(root)
    return order
