"""Reads the IR text form back into a `Graph`: the exact inverse of `purinec.ir.printer`.

A hand-written tokenizer and recursive-descent parser. Grammar (whitespace and newlines
are free; ``#`` starts a comment to the end of the line, and a comment that ends a node's
line is that node's source location)::

    graph     := "graph" NAME "(" [input ("," input)*] ")" "{" node* return "}"
    input     := VALUE ":" placed ["{" ROLE ["," "init" "=" STRING] "}"]
    node      := VALUE ("," VALUE)* "=" OP "(" [VALUE ("," VALUE)*] ")"
                 ["{" [attr ("," attr)*] "}"] ":" placed ("," placed)* [body]
    body      := "{" node+ "}"          (op fused only; its members, which do not nest)
    attr      := NAME "=" literal
    literal   := INT | FLOAT | "inf" | "nan" | "true" | "false" | STRING
               | "[" [literal ("," literal)*] "]"
    placed    := DTYPE "[" [INT ("," INT)*] "]" "@" device ["~" dist]
    device    := ["r" INT "/"] KIND ":" INT
    dist      := ("replicated" | "partial" | "split" "(" INT ")") "[" device ("," device)* "]"
    return    := "return" [out ("," out)*]
    out       := VALUE | NAME "=" VALUE

Names are global: a member's values keep their names in the whole graph. A member reads
only its fused node's inputs and earlier members' outputs; a fused node's header names
member outputs, and only those are visible after it.

Every error is an `IRSyntaxError` at the offending token's line and column. The parser
checks what it needs to build the graph (names, scopes, attributes against the op's
schema, arity); it does not check that declared types match the inferred ones, nor that
a fused node's inputs are exactly what its members read, which is
`purinec.ir.verify`'s job: ``parse(..., verify=True)`` runs it and reports a
`VerifyError` at the line of the node, graph input or graph output that breaks an
invariant. Numbers are bounded where they are read: integers fit int64, other numbers
float64, and shapes the sizes a tensor may have (`purinec.ir.types.shape_problem`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from purinec.errors import IRSyntaxError, PurinecError, UnknownOpError, VerifyError
from purinec.ir.graph import FUSED, INPUT_ROLES, NAME_RE, Graph, Node, Value
from purinec.ir.init import check_init
from purinec.ir.ops import coerce_attr, get_op, unknown_op_message
from purinec.ir.types import (DEVICE_KINDS, INT64_MAX, INT64_MIN, Device, Distribution,
                              DistKind, DType, TensorType, shape_problem)
from purinec.ir.verify import verify

# -- tokens -----------------------------------------------------------------------------

IDENT, VALUE, INT, FLOAT, STRING, PUNCT, EOF = (
    "name", "value", "integer", "float", "string", "punctuation", "end of input")

PUNCTUATION = "(){}[],:=@~/"

_NUMBER_RE = re.compile(r"-?(?:inf|[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)")
_INT_RE = re.compile(r"-?[0-9]+")
_WORD_TAIL_RE = re.compile(r"[A-Za-z0-9_.]+")

# Every number the IR holds fits a machine word: integers (dimensions, indices, integer
# attributes) are int64, other numbers float64. The length bound keeps int() and float()
# cheap (and below Python's 4,300-digit limit on int()): the printer writes an int64 in
# at most 20 characters and a float64 in at most 24.
MAX_NUMBER_CHARS = 40
_WHITESPACE = " \t\r\n"


@dataclass
class Token:
    kind: str
    text: str       # the source text (for VALUE, without the %)
    value: Any      # int, float or str for literals
    line: int
    column: int

    def describe(self) -> str:
        if self.kind == EOF:
            return "end of input"
        if self.kind == VALUE:
            return f"value %{self.text}"
        if self.kind == STRING:
            return f"string {self.text}"
        return f"'{self.text}'"


@dataclass
class Comment:
    text: str
    line: int
    column: int


def tokenize(text: str, source: str = "<ir>") -> tuple[list[Token], dict[int, Comment]]:
    """The tokens of ``text`` (ending in EOF) and its comments by line."""
    tokens: list[Token] = []
    comments: dict[int, Comment] = {}
    pos, line, line_start, n = 0, 1, 0, len(text)

    def error(message, at):
        raise IRSyntaxError(message, line, at - line_start + 1, source)

    while pos < n:
        ch = text[pos]
        col = pos - line_start + 1
        if ch == "\n":
            pos += 1
            line += 1
            line_start = pos
        elif ch in _WHITESPACE:
            pos += 1
        elif ch == "#":
            end = text.find("\n", pos)
            end = n if end < 0 else end
            body = text[pos + 1:end]
            if body.startswith(" "):
                body = body[1:]
            comments[line] = Comment(body.rstrip(" \t\r"), line, col)
            pos = end
        elif ch == "%":
            m = NAME_RE.match(text, pos + 1)
            if not m:
                found = repr(text[pos + 1]) if pos + 1 < n else "end of input"
                error(f"expected a value name after '%', found {found}", pos)
            tokens.append(Token(VALUE, m.group(), m.group(), line, col))
            pos = m.end()
        elif ch.isascii() and (ch.isalpha() or ch == "_"):
            m = NAME_RE.match(text, pos)
            tokens.append(Token(IDENT, m.group(), m.group(), line, col))
            pos = m.end()
        elif ch.isdigit() and ch.isascii() or (ch == "-" and pos + 1 < n and
                                              (text[pos + 1].isascii() and
                                               text[pos + 1].isdigit() or
                                               text.startswith("inf", pos + 1))):
            m = _NUMBER_RE.match(text, pos)
            end = m.end()
            tail = _WORD_TAIL_RE.match(text, end)
            if tail:  # '12abc', '1.2.3', '1e', '-infinity'
                end = tail.end()
                error(f"bad number '{text[pos:end]}'", pos)
            spelled = m.group()
            problem = _number_problem(spelled)
            if problem:
                error(problem, pos)
            if _INT_RE.fullmatch(spelled):
                tokens.append(Token(INT, spelled, int(spelled), line, col))
            else:
                tokens.append(Token(FLOAT, spelled, float(spelled), line, col))
            pos = end
        elif ch == '"':
            end = pos + 1
            while True:
                if end >= n or text[end] == "\n":
                    error("unterminated string: expected a closing '\"' before the end of "
                          "the line", pos)
                if text[end] == "\\":
                    end += 2
                elif text[end] == '"':
                    break
                else:
                    end += 1
            raw = text[pos:end + 1]
            try:
                value = json.loads(raw)
            except ValueError as e:
                error(f"bad string literal {raw}: {e.msg}", pos)
            tokens.append(Token(STRING, raw, value, line, col))
            pos = end + 1
        elif ch in PUNCTUATION:
            tokens.append(Token(PUNCT, ch, ch, line, col))
            pos += 1
        else:
            error(f"unexpected character {ch!r}", pos)
    tokens.append(Token(EOF, "", None, line, pos - line_start + 1))
    return tokens, comments


def _number_problem(spelled: str) -> str | None:
    """Why the number token ``spelled`` is not one the IR can hold, or None."""
    if len(spelled) > MAX_NUMBER_CHARS:
        return (f"number {spelled[:12]}...{spelled[-4:]} has {len(spelled)} characters; "
                f"a number in IR text fits int64 or float64 (at most {MAX_NUMBER_CHARS})")
    if _INT_RE.fullmatch(spelled) and not INT64_MIN <= int(spelled) <= INT64_MAX:
        return (f"integer {spelled} does not fit int64 ({INT64_MIN} to {INT64_MAX})")
    if "inf" not in spelled and math.isinf(float(spelled)):
        return (f"number {spelled} is beyond the float64 range (about 1.8e308); write inf "
                f"for infinity")
    return None


# -- parser -----------------------------------------------------------------------------


@dataclass
class _Head:
    """A node line up to its types: ``%outs = op(%ins) {attrs} : types``."""

    name_toks: list[Token]
    opdef: Any
    inputs: list[Value]
    attrs: dict
    placed: list  # (first token, (type, device, dist)) per output


def parse(text: str, source: str = "<ir>", verify: bool = False) -> Graph:
    """Parse one graph in the text form; raises `IRSyntaxError` on malformed text. With
    ``verify``, also check every IR invariant of the graph as written (declared types
    included) and what a `Program` relies on to run it (``verify(graph, program=True)``),
    and raise `VerifyError` at the line of what breaks one."""
    parser = _Parser(text, source)
    graph = parser.parse_graph()
    if verify:
        parser.verify(graph)
    return graph


class _Parser:
    def __init__(self, text: str, source: str):
        self.source = source
        self.tokens, self.comments = tokenize(text, source)
        self.pos = 0
        self.graph: Graph | None = None
        self.defined: dict[str, Value] = {}  # values nodes may read: inputs, node outputs
        self.internal: dict[str, str] = {}  # member values no fused node exports -> its name
        self.taken: set[str] = set()  # every name defined so far, anywhere
        # The line each node and graph input starts on (by id()), and each graph output's.
        self.lines: dict[int, int] = {}
        self.output_lines: dict[str, int] = {}

    def verify(self, graph: Graph) -> None:
        try:
            verify(graph, program=True)
        except VerifyError as err:
            line = (self.lines.get(id(err.node)) or self.lines.get(id(err.value))
                    or self.output_lines.get(err.output))
            where = self.source if line is None else f"{self.source}:{line}"
            raise VerifyError(f"{where}: {err}", err.node, value=err.value,
                              output=err.output) from None

    # -- token helpers

    def peek(self, offset: int = 0) -> Token:
        return self.tokens[min(self.pos + offset, len(self.tokens) - 1)]

    def next(self) -> Token:
        tok = self.tokens[self.pos]
        if tok.kind != EOF:
            self.pos += 1
        return tok

    def error(self, message: str, tok: Token) -> IRSyntaxError:
        return IRSyntaxError(message, tok.line, tok.column, self.source)

    def is_punct(self, ch: str, offset: int = 0) -> bool:
        tok = self.peek(offset)
        return tok.kind == PUNCT and tok.text == ch

    def expect_punct(self, ch: str, context: str = "") -> Token:
        tok = self.peek()
        if tok.kind != PUNCT or tok.text != ch:
            where = f" {context}" if context else ""
            raise self.error(f"expected '{ch}'{where}, found {tok.describe()}", tok)
        return self.next()

    def expect(self, kind: str, what: str) -> Token:
        tok = self.peek()
        if tok.kind != kind:
            raise self.error(f"expected {what}, found {tok.describe()}", tok)
        return self.next()

    def expect_keyword(self, word: str, context: str = "") -> Token:
        tok = self.peek()
        if tok.kind != IDENT or tok.text != word:
            where = f" {context}" if context else ""
            raise self.error(f"expected '{word}'{where}, found {tok.describe()}", tok)
        return self.next()

    def expect_int(self, what: str, minimum: int | None = 0) -> int:
        tok = self.peek()
        if tok.kind != INT:
            raise self.error(f"expected {what} (an integer), found {tok.describe()}", tok)
        if minimum is not None and tok.value < minimum:
            raise self.error(f"expected {what} (an integer >= {minimum}), found {tok.text}", tok)
        return self.next().value

    # -- values

    def define(self, tok: Token) -> str:
        if tok.text in self.taken:
            raise self.error(f"value %{tok.text} is defined twice; every value must have "
                             f"a new name", tok)
        self.taken.add(tok.text)
        return tok.text

    def use(self, tok: Token, scope: dict[str, Value] | None = None,
            fused: str | None = None) -> Value:
        """The value ``tok`` names in ``scope`` (default: the graph's values), for a
        member of fused node %``fused`` when given."""
        value = (self.defined if scope is None else scope).get(tok.text)
        if value is None and fused is not None and tok.text in self.defined:
            raise self.error(f"a member of fused node %{fused} reads %{tok.text}, which is "
                             f"not an input of the fused node; members read only its inputs "
                             f"and earlier members' outputs (add %{tok.text} to its inputs)",
                             tok)
        if value is None and tok.text in self.internal:
            raise self.error(f"%{tok.text} is internal to fused node %"
                             f"{self.internal[tok.text]}: it is not among the outputs the "
                             f"fused node exports, so nothing outside it can read it", tok)
        if value is None:
            later = self.later_definition(tok.text)
            hint = (f"; it is defined later, at line {later.line}: nodes must come after "
                    f"what they read, so the graph has a cycle or is out of order"
                    if later else "")
            raise self.error(f"unknown value %{tok.text}: it is used before any graph input "
                             f"or earlier node defines it{hint}", tok)
        return value

    def later_definition(self, name: str) -> Token | None:
        """The token defining %name further on (a node's output before its '='), if any."""
        for i in range(self.pos, len(self.tokens) - 1):
            tok = self.tokens[i]
            if tok.kind == VALUE and tok.text == name:
                j = i + 1
                while self.tokens[j].kind in (VALUE, PUNCT) and self.tokens[j].text != "=":
                    if self.tokens[j].kind == PUNCT and self.tokens[j].text != ",":
                        break
                    j += 1
                if self.tokens[j].kind == PUNCT and self.tokens[j].text == "=":
                    return tok
        return None

    # -- grammar

    def parse_graph(self) -> Graph:
        self.expect_keyword("graph", "at the start of the graph")
        name = self.expect(IDENT, "the graph's name").text
        self.graph = graph = Graph(name)
        self.expect_punct("(", "after the graph's name")
        if not self.is_punct(")"):
            while True:
                self.parse_input()
                if not self.is_punct(","):
                    break
                self.next()
        self.expect_punct(")", "after the graph's inputs")
        self.expect_punct("{", "to open the graph's body")
        while self.peek().kind == VALUE:
            self.parse_node()
        self.expect_keyword("return", "(a node line starting with %name, or the return line)")
        outputs = self.parse_return()
        graph.set_outputs(outputs)
        self.expect_punct("}", "to close the graph's body after its return")
        tok = self.peek()
        if tok.kind != EOF:
            raise self.error(f"expected end of input after the graph's closing '}}', "
                             f"found {tok.describe()}", tok)
        return graph

    def parse_input(self) -> None:
        tok = self.expect(VALUE, "a graph input (%name)")
        name = self.define(tok)
        self.expect_punct(":", f"after input %{name}")
        ty, device, dist = self.parse_placed()
        role, init = "data", None
        if self.is_punct("{"):
            self.next()
            role_tok = self.expect(IDENT, f"a role ({', '.join(INPUT_ROLES)})")
            if role_tok.text not in INPUT_ROLES:
                raise self.error(f"unknown input role '{role_tok.text}'; expected one of "
                                 f"{', '.join(INPUT_ROLES)}", role_tok)
            role = role_tok.text
            if self.is_punct(","):
                self.next()
                self.expect_keyword("init", "after the role")
                self.expect_punct("=", "after 'init'")
                init_tok = self.expect(STRING, "a quoted init string")
                init = init_tok.value
                try:  # (a data input's init is free text: nothing reads it)
                    if role != "data":
                        check_init(init, ty.dtype)
                except PurinecError as err:
                    raise self.error(str(err), init_tok) from None
            self.expect_punct("}", "to close the input's role")
        value = self.graph.add_input(name, ty, device, role, dist, init)
        self.defined[name] = value
        self.lines[id(value)] = tok.line

    def parse_node(self) -> None:
        """A node line, or a fused node's header with its body."""
        head = self.parse_head(self.defined)
        if head.opdef.name == FUSED:
            self.parse_fused(head)
            return
        self.refuse_body(head)
        node = self.build(head, self.graph.add_node)
        for value in node.outputs:
            self.defined[value.name] = value

    def parse_head(self, scope: dict[str, Value], fused: str | None = None) -> _Head:
        """``%outs = op(%ins) {attrs} : types``, reading inputs from ``scope`` (the
        graph's values, or inside the body of fused node %``fused``, its inputs and the
        earlier members' outputs)."""
        name_toks = [self.next()]
        while self.is_punct(","):
            self.next()
            name_toks.append(self.expect(VALUE, "another output name (%name)"))
        # A fused node's header names values its body defines: they are defined there.
        op = self.peek(1)
        is_fused = self.is_punct("=") and op.kind == IDENT and op.text == FUSED
        seen = set()
        for tok in name_toks:
            if not is_fused:
                self.define(tok)
            if tok.text in seen:
                raise self.error(f"value %{tok.text} is defined twice; every value must "
                                 f"have a new name", tok)
            seen.add(tok.text)
        self.expect_punct("=", "after the node's output names")
        op_tok = self.expect(IDENT, "an op name")
        opdef = self.lookup_op(op_tok)
        if fused is not None and opdef.name == FUSED:
            raise self.error(f"fused node %{fused} holds another fused node; fused nodes "
                             f"do not nest", op_tok)
        self.expect_punct("(", f"after op {op_tok.text}")
        inputs = []
        if not self.is_punct(")"):
            while True:
                inputs.append(self.use(self.expect(VALUE, "an input value (%name)"), scope,
                                       fused))
                if not self.is_punct(","):
                    break
                self.next()
        self.expect_punct(")", "after the node's inputs")
        try:
            opdef.check_arity(len(inputs))
        except VerifyError as e:
            raise self.error(str(e), op_tok) from None
        attrs = self.parse_attrs(opdef, op_tok)
        self.expect_punct(":", "before the node's output types")
        placed = [(self.peek(), self.parse_placed())]
        while self.is_punct(","):
            self.next()
            placed.append((self.peek(), self.parse_placed()))
        if len(placed) != len(name_toks):
            if len(placed) > len(name_toks):
                at = placed[len(name_toks)][0]
                msg = (f"{len(placed)} output types for {len(name_toks)} output names; "
                       f"remove the extra type or name the output")
            else:
                at = name_toks[len(placed)]
                msg = (f"output %{at.text} has no type: {len(name_toks)} output names but "
                       f"{len(placed)} output types after ':'")
            raise self.error(msg, at)
        return _Head(name_toks, opdef, inputs, attrs, placed)

    def refuse_body(self, head: _Head) -> None:
        if self.is_punct("{"):
            raise self.error(f"op {head.opdef.name} takes no body; only fused nodes hold "
                             f"member lines in braces", self.peek())

    def build(self, head: _Head, make) -> Node:
        """The node ``head`` describes, made by ``make`` (`Graph.add_node`, or
        `Graph.make_node` for a member), with the source location ending its line."""
        loc = self.node_loc()
        types = [ty for _, (ty, _, _) in head.placed]
        node = make(head.opdef.name, head.inputs, head.attrs,
                    names=[t.text for t in head.name_toks], types=types,
                    device=head.placed[0][1][1], loc=loc)
        self.lines[id(node)] = head.name_toks[0].line
        for value, (_, (_, device, dist)) in zip(node.outputs, head.placed):
            value.device = device
            value.dist = dist
        return node

    def parse_fused(self, head: _Head) -> None:
        """A fused node's body: member lines between braces, then the header's outputs
        resolved to the member outputs of those names."""
        fused = head.name_toks[0].text
        self.expect_punct("{", f"to open the body of fused node %{fused} (its members)")
        loc = self.node_loc()
        scope = {v.name: v for v in head.inputs}
        body = []
        while self.peek().kind == VALUE:
            member = self.parse_head(scope, fused)
            self.refuse_body(member)
            body.append(self.build(member, self.graph.make_node))
            scope.update((v.name, v) for v in body[-1].outputs)
        close = self.expect_punct("}", f"to close the body of fused node %{fused} (or "
                                       f"another member line)")
        if not body:
            raise self.error(f"fused node %{fused} has an empty body; it needs at least one "
                             f"member", close)
        members = {v.name: v for member in body for v in member.outputs}
        outputs = [self.fused_output(fused, tok, placed, members)
                   for tok, placed in zip(head.name_toks, head.placed)]
        node = self.graph.add_fused(body, head.inputs, outputs, head.attrs["kernel"], loc)
        self.lines[id(node)] = head.name_toks[0].line
        exported = {id(v) for v in outputs}
        for member in body:
            for value in member.outputs:
                if id(value) in exported:
                    self.defined[value.name] = value
                else:
                    self.internal[value.name] = fused

    def fused_output(self, fused: str, tok: Token, placed, members: dict[str, Value]) -> Value:
        """The member output a fused node's header names, placed as the header says."""
        type_tok, (ty, device, dist) = placed
        value = members.get(tok.text)
        if value is None:
            raise self.error(f"fused node %{fused} exports %{tok.text}, which no member of "
                             f"its body defines", tok)
        if (value.type, value.device, value.dist) != (ty, device, dist):
            declared = f"{ty} @{device}" + (f" ~ {dist}" if dist else "")
            defined = f"{value.type} @{value.device}" + (f" ~ {value.dist}" if value.dist
                                                          else "")
            raise self.error(f"fused node %{fused} declares output %{tok.text} as {declared}, "
                             f"but its member defines it as {defined}", type_tok)
        return value

    def node_loc(self) -> str | None:
        """The comment ending the line of the last token, if nothing follows it there."""
        last = self.tokens[self.pos - 1]
        comment = self.comments.get(last.line)
        if comment is None or self.peek().line == last.line:
            return None
        del self.comments[last.line]
        return comment.text

    def lookup_op(self, tok: Token):
        try:
            return get_op(tok.text)
        except UnknownOpError:
            raise self.error(unknown_op_message(tok.text), tok) from None

    def parse_attrs(self, opdef, op_tok: Token) -> dict:
        attrs: dict[str, Any] = {}
        if not self.is_punct("{"):
            return self.complete(opdef, attrs, op_tok)
        self.next()
        if not self.is_punct("}"):
            while True:
                key_tok = self.expect(IDENT, "an attribute name")
                key = key_tok.text
                if key in attrs:
                    raise self.error(f"attribute {key} is given twice", key_tok)
                if key not in opdef.attrs:
                    takes = ", ".join(opdef.attrs) or "none"
                    raise self.error(f"op {opdef.name} has no attribute {key}; it takes: "
                                     f"{takes}", key_tok)
                self.expect_punct("=", f"after attribute name {key}")
                value_tok = self.peek()
                value = self.parse_literal()
                try:
                    attrs[key] = coerce_attr(opdef.name, key, opdef.attrs[key], value)
                except VerifyError as e:
                    raise self.error(str(e), value_tok) from None
                if not self.is_punct(","):
                    break
                self.next()
        self.expect_punct("}", "to close the attributes")
        return self.complete(opdef, attrs, op_tok)

    def complete(self, opdef, attrs: dict, op_tok: Token) -> dict:
        try:
            return opdef.complete_attrs(attrs)
        except VerifyError as e:
            raise self.error(str(e), op_tok) from None

    def parse_literal(self) -> Any:
        tok = self.peek()
        if tok.kind in (INT, FLOAT, STRING):
            return self.next().value
        if tok.kind == IDENT and tok.text in ("true", "false"):
            return self.next().text == "true"
        if tok.kind == IDENT and tok.text in ("inf", "nan"):
            return float(self.next().text)
        if self.is_punct("["):
            self.next()
            items = []
            if not self.is_punct("]"):
                while True:
                    item_tok = self.peek()
                    if item_tok.kind == PUNCT and item_tok.text == "[":
                        raise self.error("expected a number, string or bool in a list "
                                         "attribute, found a nested list", item_tok)
                    items.append(self.parse_literal())
                    if not self.is_punct(","):
                        break
                    self.next()
            self.expect_punct("]", "to close the list")
            return items
        raise self.error(f"expected an attribute value (number, true, false, \"string\" or "
                         f"[list]), found {tok.describe()}", tok)

    def parse_placed(self) -> tuple[TensorType, Device, Distribution | None]:
        """``f32[2,3] @cpu:0`` with an optional ``~ dist``."""
        dtype_tok = self.expect(IDENT, "a tensor type such as f32[2,3]")
        try:
            dtype = DType(dtype_tok.text)
        except ValueError:
            raise self.error(f"unknown dtype '{dtype_tok.text}'; expected one of "
                             f"{', '.join(d.value for d in DType)}", dtype_tok) from None
        self.expect_punct("[", f"after dtype {dtype.value} (a scalar is {dtype.value}[])")
        shape = []
        if not self.is_punct("]"):
            while True:
                shape.append(self.expect_int("a dimension"))
                if not self.is_punct(","):
                    break
                self.next()
        self.expect_punct("]", "to close the shape")
        problem = shape_problem(tuple(shape))
        if problem:
            raise self.error(f"a {dtype.value} tensor of this shape has {problem}", dtype_tok)
        self.expect_punct("@", "and a device after the type (every value is placed)")
        device = self.parse_device()
        dist = None
        if self.is_punct("~"):
            self.next()
            dist = self.parse_dist()
        return TensorType(tuple(shape), dtype), device, dist

    def parse_device(self) -> Device:
        tok = self.expect(IDENT, "a device such as cpu:0 or r1/gpu:0")
        rank = 0
        if self.is_punct("/"):
            m = re.fullmatch(r"r([0-9]+)", tok.text)
            if not m:
                raise self.error(f"expected a rank such as r1 before '/', found '{tok.text}'",
                                 tok)
            problem = _number_problem(m.group(1))
            if problem:
                raise self.error(f"rank of {tok.text[:16]}: {problem}", tok)
            rank = int(m.group(1))
            self.next()
            tok = self.expect(IDENT, "a device kind after the rank (cpu or gpu)")
        if tok.text not in DEVICE_KINDS:
            raise self.error(f"unknown device kind '{tok.text}'; expected one of "
                             f"{', '.join(DEVICE_KINDS)}", tok)
        self.expect_punct(":", f"between device kind {tok.text} and its index")
        index = self.expect_int("a device index")
        return Device(tok.text, index, rank)

    def parse_dist(self) -> Distribution:
        tok = self.expect(IDENT, "a distribution (replicated, partial or split(axis))")
        axis = None
        if tok.text == "split":
            self.expect_punct("(", "after split")
            axis = self.expect_int("a split axis", minimum=None)
            self.expect_punct(")", "after the split axis")
            kind = DistKind.split
        elif tok.text in ("replicated", "partial"):
            kind = DistKind(tok.text)
        else:
            raise self.error(f"unknown distribution '{tok.text}'; expected replicated, "
                             f"partial or split(axis)", tok)
        self.expect_punct("[", "before the distribution's devices")
        group = [self.parse_device()]
        while self.is_punct(","):
            self.next()
            group.append(self.parse_device())
        self.expect_punct("]", "after the distribution's devices")
        return Distribution(kind, tuple(group), axis)

    def parse_return(self) -> list[tuple[str, Value]]:
        outputs: list[tuple[str, Value]] = []
        names: set[str] = set()
        if self.is_punct("}"):
            return outputs
        while True:
            tok = self.peek()
            if tok.kind == IDENT and self.is_punct("=", 1):
                self.next()
                self.next()
                name = tok.text
                value = self.use(self.expect(VALUE, f"a value (%name) for output {name}"))
            elif tok.kind == VALUE:
                value = self.use(self.next())
                name = value.name
            else:
                raise self.error(f"expected a graph output (%value or name=%value), found "
                                 f"{tok.describe()}", tok)
            if name in names:
                raise self.error(f"graph output {name} is returned twice; output names must "
                                 f"be unique", tok)
            names.add(name)
            outputs.append((name, value))
            self.output_lines[name] = tok.line
            if not self.is_punct(","):
                return outputs
            self.next()
