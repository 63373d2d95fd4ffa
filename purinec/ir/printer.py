"""The IR's text form, written for people first; `purinec.ir.parser` reads it back.

One graph prints as::

    graph lenet.train(
        %data: f32[64,1,28,28] @cpu:0,
        %c1.w: f32[20,1,5,5] @cpu:0 {param, init="xavier"}
    ) {
      %c1 = conv2d(%data, %c1.w) {stride=[1,1], pad=[0,0], groups=1, dilation=[1,1]} : f32[64,20,24,24] @cpu:0
      %s0, %s1 = split(%c1) {axis=1, sections=[10,10]} : f32[64,10,24,24] @cpu:0, ...
      return %s0, loss=%s1
    }

Every value is typed and placed (``TYPE @DEVICE``, plus ``~ DIST`` when distributed);
every attribute is printed, defaults included, in the op's schema order; a node's
source location ends its line as ``  # file.py:12``; a graph output is ``%v`` when its
name is the value's, else ``name=%v``. Data inputs print no role unless they carry an
init (``{data, init="..."}``). The text has no trailing newline.

A fused node prints as its header line, which names the outputs it exports, ending in
``{``, then its members two spaces further in, then ``}``::

      %r = fused(%x, %w, %b) {kernel="fused_conv2d_bias_add_relu"} : f32[2,20,24,24] @cpu:0 {
        %c = conv2d(%x, %w) {stride=[1,1], pad=[0,0], groups=1, dilation=[1,1]} : f32[2,20,24,24] @cpu:0
        %cb = bias_add(%c, %b) {axis=1} : f32[2,20,24,24] @cpu:0  # lenet.py:18
        %r = relu(%cb) : f32[2,20,24,24] @cpu:0  # lenet.py:23
      }

Members keep their names (``%cb`` above is a value of the graph, internal to the fused
node); the header's outputs are the members' values that the rest of the graph reads.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from purinec.ir.ops import REGISTRY

if TYPE_CHECKING:
    from purinec.ir.graph import Graph, Node, Value


def print_graph(graph: Graph) -> str:
    """The text form of ``graph``; ``parse(print_graph(g))`` rebuilds it exactly."""
    lines = []
    if graph.inputs:
        lines.append(f"graph {graph.name}(")
        lines.append(",\n".join("    " + format_input(v) for v in graph.inputs))
        lines.append(") {")
    else:
        lines.append(f"graph {graph.name}() {{")
    for node in graph.nodes:
        lines.extend(format_node_lines(node, "  "))
    lines.append("  " + format_return(graph.outputs))
    lines.append("}")
    return "\n".join(lines)


def format_placement(value: Value) -> str:
    """``TYPE @DEVICE`` or ``TYPE @DEVICE ~ DIST``."""
    text = f"{value.type} @{value.device}"
    if value.dist is not None:
        text += f" ~ {value.dist}"
    return text


def format_input(value: Value) -> str:
    """A graph input: ``%w: f32[3] @cpu:0 {param, init="xavier"}``."""
    text = f"%{value.name}: {format_placement(value)}"
    role = value.role or "data"
    if role != "data" or value.init is not None:
        text += " {" + role
        if value.init is not None:
            text += ", init=" + format_string(value.init)
        text += "}"
    return text


def format_node_lines(node: Node, indent: str) -> list[str]:
    """A node's lines at ``indent``: one, or for a fused node its header, its members
    two spaces further in and the closing brace."""
    if node.body is None:
        return [indent + format_node(node)]
    lines = [indent + format_node(node)]
    for member in node.body:
        lines.extend(format_node_lines(member, indent + "  "))
    lines.append(indent + "}")
    return lines


def format_node(node: Node) -> str:
    """One node line, without its indentation; for a fused node the header line, which
    ends in the ``{`` opening its body."""
    outs = ", ".join("%" + v.name for v in node.outputs)
    ins = ", ".join("%" + v.name for v in node.inputs)
    text = f"{outs} = {node.op}({ins})"
    attrs = _ordered_attrs(node)
    if attrs:
        text += " {" + ", ".join(f"{k}={format_attr(v)}" for k, v in attrs) + "}"
    text += " : " + ", ".join(format_placement(v) for v in node.outputs)
    if node.body is not None:
        text += " {"
    if node.loc is not None:
        text += f"  # {node.loc}"
    return text


def format_return(outputs) -> str:
    parts = []
    for name, value in outputs:
        parts.append(f"%{value.name}" if name == value.name else f"{name}=%{value.name}")
    return "return " + ", ".join(parts) if parts else "return"


def _ordered_attrs(node: Node) -> list[tuple[str, Any]]:
    """Attributes in the op's schema order; any the schema does not know come last."""
    opdef = REGISTRY.get(node.op)
    order = list(opdef.attrs) if opdef is not None else []
    known = [(k, node.attrs[k]) for k in order if k in node.attrs]
    rest = [(k, v) for k, v in node.attrs.items() if k not in order]
    return known + rest


def format_attr(value: Any) -> str:
    """``3``, ``1.0``, ``1e-05``, ``inf``, ``-inf``, ``nan``, ``true``, ``"s"``, ``[1,2]``."""
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return format_float(float(value))
    if isinstance(value, str):
        return format_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_attr(v) for v in value) + "]"
    raise TypeError(f"cannot print attribute value {value!r} of type {type(value).__name__}")


def format_float(value: float) -> str:
    """Python's shortest round-tripping spelling; always reads back as a float."""
    if math.isnan(value):
        return "nan"
    return repr(value)  # '1.0', '1e-05', '1e+16', 'inf', '-inf', '-0.0'


def format_string(value: str) -> str:
    """A JSON string literal (double quotes, backslash escapes), non-ASCII kept as is."""
    return json.dumps(value, ensure_ascii=False)
