"""`Extent`: an array's length along an axis, known to the renderer and read by the
generated code at run time.

A renderer decides with the number (how to block a loop, which algorithm to use) and
writes the local that holds it into the code; arithmetic on extents keeps both, so
``c * 9`` is the number and the text ``(c_in * 9)``. Two nodes whose code comes out the
same then share one compiled kernel though their sizes differ, and that code is right
for each: every expression in it evaluates, with the arrays of either node, to the
number its renderer computed with. A decision the code does not show (the branch a
renderer took) is the same for both, or their code would differ.
"""

from __future__ import annotations

import operator


class Extent(int):
    """An int that prints as the source text computing it at run time."""

    text: str

    def __new__(cls, value: int, text: str) -> "Extent":
        extent = super().__new__(cls, value)
        extent.text = text
        return extent

    def __str__(self) -> str:
        return self.text

    def __format__(self, spec: str) -> str:
        return self.text if not spec else format(int(self), spec)

    def __reduce__(self):  # pickled (a shape in a saved module) as the number
        return int, (int(self),)

    def __neg__(self) -> "Extent":
        return Extent(-int(self), f"(-{self.text})")

    def __pos__(self) -> "Extent":
        return self


def _text(x) -> str:
    return x.text if isinstance(x, Extent) else str(int(x))


def _binary(symbol: str, compute, unit: int | None, absorbing: int | None = None):
    """The operator ``symbol`` on an extent and an int (either side): an `Extent`
    whose text spells the operation, without operations by ``unit`` (``x * 1``) and
    with ``absorbing`` (``x * 0``) a plain int."""

    def forward(a, b, swapped=False):
        if not isinstance(b, int) or isinstance(b, bool):
            return NotImplemented
        left, right = (b, a) if swapped else (a, b)
        value = compute(int(left), int(right))
        if absorbing is not None and (
                (not isinstance(right, Extent) and int(right) == absorbing)
                or (symbol == "*" and not isinstance(left, Extent)
                    and int(left) == absorbing)):
            return value
        if unit is not None and not isinstance(right, Extent) and int(right) == unit:
            return left
        if symbol in "+*" and unit is not None and not isinstance(left, Extent) \
                and int(left) == unit:
            return right
        return Extent(value, f"({_text(left)} {symbol} {_text(right)})")

    def backward(a, b):
        return forward(a, b, swapped=True)

    return forward, backward


for _name, _symbol, _compute, _unit, _absorbing in (
        ("add", "+", operator.add, 0, None),
        ("sub", "-", operator.sub, 0, None),
        ("mul", "*", operator.mul, 1, 0),
        ("floordiv", "//", operator.floordiv, 1, None),
        ("mod", "%", operator.mod, None, None)):
    _forward, _backward = _binary(_symbol, _compute, _unit, _absorbing)
    setattr(Extent, f"__{_name}__", _forward)
    setattr(Extent, f"__r{_name}__", _backward)
