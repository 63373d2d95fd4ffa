"""ONNX's official node tests of every op purinec claims pass on the reference and
cpu targets (or are refused at import, as docs/onnx.md lists), and the documented
table is what the run gives."""

from __future__ import annotations

import functools
import os
import re

import pytest

pytest.importorskip("onnx", reason="the ONNX front end is the onnx extra")

from purinec.onnx_backend import TABLE_BEGIN, TABLE_END, conformance, table  # noqa: E402

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "onnx.md")


@functools.cache
def outcomes(target: str) -> dict:
    return conformance([target])


def rows(text: str) -> dict[str, list[str]]:
    """A conformance table's rows: op -> its other cells."""
    cells = [re.split(r"\s*\|\s*", line.strip().strip("|")) for line in text.splitlines()
             if line.startswith("| ") and not line.startswith("| op ")]
    return {row[0]: row[1:] for row in cells}


def documented() -> dict[str, list[str]]:
    with open(DOCS, encoding="utf-8") as f:
        text = f.read()
    return rows(text[text.index(TABLE_BEGIN) + len(TABLE_BEGIN):text.index(TABLE_END)])


TARGETS = [("reference", 0), pytest.param("cpu", 1, marks=pytest.mark.slow)]


@pytest.mark.parametrize("target, column", TARGETS)
def test_no_node_test_fails(target, column):
    failed = [f"{o.test}: {o.detail}" for o in outcomes(target)[target]
              if o.status == "failed"]
    assert failed == []
    assert sum(o.status == "passed" for o in outcomes(target)[target]) > 250


@pytest.mark.parametrize("target, column", TARGETS)
def test_the_documented_table_is_what_the_run_gives(target, column):
    docs = documented()
    ran = rows(table(outcomes(target)))  # op -> [passed of run, refused]
    assert sorted(docs) == sorted(ran)
    for op, (passed, refused) in ran.items():
        assert (docs[op][column], docs[op][-1]) == (passed, refused), op
