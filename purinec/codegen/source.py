"""A builder for generated Python source that remembers where each line came from.

Inductor's ``IndentedBuffer`` idea: renderers append lines at an indentation level; every
line also records the IR node(s) it was generated for. `SourceBuilder.text` writes the
result with a comment quoting a node's IR line (``%out = op(%in) {attrs} : type  #
loc``) wherever the lines switch to code from other nodes, so a reader of any generated
kernel, fused or not, sees which IR produced it. `SourceBuilder.origins` maps output line
numbers back to nodes, for error messages that point into generated code.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

from purinec.ir.graph import Node
from purinec.ir.printer import format_node

INDENT = "    "


def node_comment(node: Node) -> str:
    """The IR line of ``node`` as one comment line (its ``# loc`` included); for a
    fused node its head line, without the members (they get comments of their own)."""
    line = format_node(node).splitlines()[0]
    if node.body is not None:
        line = line.removesuffix(" {")
    return "# " + line


def ir_header(kernel: str, nodes) -> list[str]:
    """The comment lines opening a generated module: the IR of ``nodes`` (a fused
    node's members indented under it) that kernel ``kernel`` was written for."""
    lines = [f"# Written for kernel `{kernel}`, from this IR:"]
    for node in nodes:
        lines.append("#   " + node_comment(node)[2:])
        lines.extend("#     " + node_comment(member)[2:] for member in node.body or ())
    return lines


class SourceBuilder:
    """Lines of Python source, each with its indentation and its originating nodes."""

    def __init__(self) -> None:
        self._lines: list[tuple[int, str, tuple[Node, ...]]] = []
        self._depth = 0
        self._origin: tuple[Node, ...] = ()

    # -- writing --------------------------------------------------------------------

    def line(self, text: str = "") -> None:
        """Append one line (or several, split on newlines) at the current indentation."""
        for part in text.split("\n"):
            self._lines.append((self._depth if part else 0, part, self._origin))

    def lines(self, texts: Sequence[str]) -> None:
        for text in texts:
            self.line(text)

    def extend(self, other: "SourceBuilder") -> None:
        """Append ``other``'s lines, indented by this builder's current depth."""
        for depth, text, origin in other._lines:
            self._lines.append((depth + self._depth if text else 0, text, origin))

    @contextmanager
    def indent(self, levels: int = 1) -> Iterator[None]:
        self._depth += levels
        try:
            yield
        finally:
            self._depth -= levels

    @contextmanager
    def block(self, header: str) -> Iterator[None]:
        """``header`` (ending in ``:``) followed by an indented body."""
        self.line(header)
        with self.indent():
            yield

    @contextmanager
    def origin(self, *nodes: Node) -> Iterator[None]:
        """Attribute the lines written inside to ``nodes`` (replacing the current origin)."""
        saved = self._origin
        self._origin = tuple(nodes)
        try:
            yield
        finally:
            self._origin = saved

    def rewrite_loops(self, rewrite: Callable[[str, list[str]], str]) -> None:
        """Replace each ``for`` line by ``rewrite(line, inner)``, ``inner`` the ``for``
        lines in its body as already rewritten (inner loops go first)."""
        for index in reversed(range(len(self._lines))):
            depth, text, origin = self._lines[index]
            if text.startswith("for "):
                self._lines[index] = (depth, rewrite(text, self._loops_in(index, depth)),
                                      origin)

    def _loops_in(self, index: int, depth: int) -> list[str]:
        """The ``for`` lines in the body of the block that line ``index`` opens."""
        inner = []
        for inner_depth, text, _ in self._lines[index + 1:]:
            if text and inner_depth <= depth:
                break
            if text.startswith("for "):
                inner.append(text)
        return inner

    # -- reading --------------------------------------------------------------------

    def nodes(self) -> list[Node]:
        """Every node some line came from, in first-use order."""
        seen: dict[int, Node] = {}
        for _, _, origin in self._lines:
            for node in origin:
                seen.setdefault(id(node), node)
        return list(seen.values())

    def _rendered(self) -> list[tuple[str, tuple[Node, ...]]]:
        out: list[tuple[str, tuple[Node, ...]]] = []
        previous: tuple[Node, ...] = ()
        for depth, text, origin in self._lines:
            indent = INDENT * depth
            if text and origin and origin != previous:
                for node in origin:
                    out.append((indent + node_comment(node), origin))
                previous = origin
            out.append((indent + text if text else "", origin))
        return out

    def text(self) -> str:
        """The source, with IR comments where the originating nodes change; ends in a
        newline."""
        return "\n".join(text for text, _ in self._rendered()) + "\n"

    def origins(self) -> dict[int, tuple[Node, ...]]:
        """1-based line number of `text` -> the nodes that line came from."""
        return {number: origin
                for number, (_, origin) in enumerate(self._rendered(), start=1) if origin}
