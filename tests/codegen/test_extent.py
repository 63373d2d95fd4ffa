"""`Extent`: ints a renderer computes with that print as the code reading them."""

from __future__ import annotations

import operator
import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from purinec.codegen.extent import Extent

OPERATORS = [operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod]


@st.composite
def computations(draw):
    """An expression over two extents and small ints, as the renderers build them."""
    values = {"rows": draw(st.integers(1, 300)), "cols": draw(st.integers(1, 300))}
    terms = [Extent(value, name) for name, value in values.items()]
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(OPERATORS))
        left = draw(st.sampled_from(terms))
        right = draw(st.one_of(st.sampled_from(terms), st.integers(-3, 70)))
        if op in (operator.floordiv, operator.mod) and int(right) == 0:
            continue
        if draw(st.booleans()) and not isinstance(right, Extent):
            left, right = right, left  # the int on the left
            if op in (operator.floordiv, operator.mod) and int(right) == 0:
                continue
        terms.append(op(left, right))
    return values, terms[-1]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(computations())
def test_the_text_computes_the_value(computation):
    values, result = computation
    assert isinstance(result, int)
    assert eval(f"{result}", {}, dict(values)) == result  # noqa: S307 (our own text)
    assert eval(str(-result), {}, dict(values)) == -result  # noqa: S307


def test_operations_by_their_unit_or_zero_leave_no_text():
    rows = Extent(12, "rows")
    assert [str(e) for e in (rows * 1, 1 * rows, rows // 1, rows + 0, 0 + rows, rows - 0)] \
        == ["rows"] * 6
    assert rows * 0 == 0 and not isinstance(rows * 0, Extent)
    assert str(rows * 3 + 1) == "((rows * 3) + 1)" and rows * 3 + 1 == 37


def test_an_extent_is_its_number_everywhere_but_in_text():
    rows = Extent(12, "rows")
    assert rows == 12 and hash(rows) == hash(12) and max(rows, 5) is rows
    assert f"{rows}" == "rows" and f"{rows:d}" == "12" and f"{rows:>4}" == "  12"
    assert list(range(rows)) == list(range(12)) and [0] * rows == [0] * 12
    copy = pickle.loads(pickle.dumps(rows))  # a saved shape keeps the number only
    assert copy == 12 and type(copy) is int
