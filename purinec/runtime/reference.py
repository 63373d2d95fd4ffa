"""The reference target: runs any IR graph with each op's NumPy reference.

Simple and obviously correct on purpose. It is the oracle every generated kernel and
every parallel rewrite is tested against, so it does nothing clever: one node at a time,
in graph order, checking each result against the type the IR declares. A fused node runs
its members one at a time, so fusing never changes a result.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from purinec.errors import ExecutionError, PurinecError
from purinec.ir.graph import Graph, Node
from purinec.ir.ops import get_op


def _where(node: Node) -> str:
    shapes = ", ".join(f"%{v.name}: {v.type}" for v in node.inputs)
    loc = f" ({node.loc})" if node.loc else ""
    return f"node {node!r}{loc} with inputs [{shapes}]"


def run_node(node: Node, args: list[np.ndarray]) -> list[np.ndarray]:
    """Evaluate one node; raise ExecutionError naming it if anything goes wrong."""
    if node.body is not None:
        return _run_fused(node, args)
    opdef = get_op(node.op)
    try:
        results = opdef.reference(*args, **node.attrs)
    except PurinecError:
        raise
    except Exception as err:  # a failing kernel: name the node, keep the cause chained
        raise ExecutionError(f"{_where(node)} failed: {type(err).__name__}: {err}") from err
    if len(results) != len(node.outputs):
        raise ExecutionError(f"{_where(node)} returned {len(results)} results, "
                             f"expected {len(node.outputs)}")
    out = []
    for value, result in zip(node.outputs, results):
        array = np.asarray(result)
        if array.shape != value.type.shape or array.dtype != value.type.dtype.numpy:
            raise ExecutionError(f"{_where(node)} produced {array.dtype}{list(array.shape)} "
                                 f"for %{value.name}, declared {value.type}")
        out.append(array)
    return out


def _run_fused(node: Node, args: list[np.ndarray]) -> list[np.ndarray]:
    """A fused node runs its members in order, exactly as they ran before fusion."""
    values = {id(v): a for v, a in zip(node.inputs, args)}
    for member in node.body:
        results = run_node(member, [values[id(v)] for v in member.inputs])
        values.update((id(v), r) for v, r in zip(member.outputs, results))
    return [values[id(v)] for v in node.outputs]


def execute(graph: Graph, env: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run ``graph`` on arrays for all its inputs (by name); return its outputs by name."""
    values: dict[int, np.ndarray] = {}
    for value in graph.inputs:
        if value.name not in env:
            raise ExecutionError(f"no value given for input %{value.name} of graph {graph.name}")
        values[id(value)] = env[value.name]
    for node in graph.nodes:
        results = run_node(node, [values[id(v)] for v in node.inputs])
        for value, result in zip(node.outputs, results):
            values[id(value)] = result
    return {name: values[id(v)] for name, v in graph.outputs}
