"""Printing element expressions (`purinec.ir.expr`) as source text, for any backend.

A backend gives a table from function name to a template (``"{0} + {1}"``,
``"np.exp({0})"``) or to a function of the call and its printed arguments (a cast,
which names its dtype), and how it spells a constant. A template with a space is an
infix operator and is parenthesized where it is an argument of another function. A
subexpression that depends on no per-element operand (nor on the element's index) is
*hoisted*: bound once before the loops; one used more than once is bound to a local in
the loop body; both through the caller's ``bind``.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Sequence, Union

from purinec.ir.expr import Arg, Call, Const, Expr, Index, walk

Template = Union[str, Callable[[Call, list[str]], str]]

# Functions every Python-printing backend spells as Python's own operators.
PYTHON_OPERATORS: dict[str, Template] = {
    "add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}", "div": "{0} / {1}",
    "neg": "-{0}",
    "lt": "{0} < {1}", "le": "{0} <= {1}", "gt": "{0} > {1}", "ne": "{0} != {1}",
    "or": "{0} or {1}", "select": "{1} if {0} else {2}",
    "xor": "{0} ^ {1}", "shr": "{0} >> {1}",
}


def print_exprs(roots: Sequence[Expr], args: Sequence[tuple[str, bool]],
                functions: dict[str, Template], literal: Callable[[Const], str],
                index: str, bind: Callable[[str, bool], str]) -> list[str]:
    """Source text of each of ``roots``. ``args[i]`` is ``(text, invariant)`` for
    ``Arg(i)``: how the element is named and whether it is the same at every element;
    ``index`` spells the flat index; ``bind(text, hoist)`` binds ``text`` to a new local
    (before the loops when ``hoist``) and returns its name."""
    uses = Counter(id(child) for e in walk(list(roots)) for child in getattr(e, "args", ()))
    invariant: dict[int, bool] = {}
    bound: dict[int, str] = {}

    def is_invariant(e: Expr) -> bool:
        if id(e) not in invariant:
            if isinstance(e, Arg):
                invariant[id(e)] = args[e.index][1]
            elif isinstance(e, Index):
                invariant[id(e)] = False
            else:
                invariant[id(e)] = all(map(is_invariant, getattr(e, "args", ())))
        return invariant[id(e)]

    def text(e: Expr) -> tuple[str, bool]:
        """The text of ``e`` and whether it is an infix expression."""
        if isinstance(e, Arg):
            return args[e.index][0], False
        if isinstance(e, Const):
            return literal(e), False
        if isinstance(e, Index):
            return index, False
        if id(e) in bound:
            return bound[id(e)], False
        if e.fn not in functions:
            raise KeyError(f"this backend cannot print expression function {e.fn!r}")
        parts = [f"({t})" if infix else t for t, infix in map(text, e.args)]
        template = functions[e.fn]
        if callable(template):
            source, infix = template(e, parts), False
        else:
            source, infix = template.format(*parts), " " in template
        hoist = is_invariant(e)
        if hoist or uses[id(e)] > 1:
            bound[id(e)] = bind(source, hoist)
            return bound[id(e)], False
        return source, infix

    return [text(root)[0] for root in roots]
