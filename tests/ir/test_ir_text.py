"""The IR text form: exact printing, parsing back, and errors at the right place."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from purinec.errors import IRSyntaxError, VerifyError
from purinec.ir.graph import Graph
from purinec.ir.parser import parse
from purinec.ir.printer import format_attr, print_graph
from purinec.ir.types import CPU0, Device, DistKind, Distribution, DType, TensorType
from purinec.ir.verify import verify

F32, F64, I32, I64 = DType.f32, DType.f64, DType.i32, DType.i64


def T(dtype, *shape):
    return TensorType(tuple(shape), dtype)


# -- structural equality ----------------------------------------------------------------


def same_attr(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same_attr(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return a == b


def assert_same_value(a, b, where):
    assert a.name == b.name, where
    assert a.type == b.type, (where, a.type, b.type)
    assert a.device == b.device, (where, a.device, b.device)
    assert a.dist == b.dist, (where, a.dist, b.dist)
    assert a.role == b.role, (where, a.role, b.role)
    assert a.init == b.init, (where, a.init, b.init)


def assert_same_graph(a: Graph, b: Graph) -> None:
    """Names, types, placements, roles, inits, ops, attrs (with their Python types),
    locs, wiring and outputs all equal."""
    assert a.name == b.name
    assert len(a.inputs) == len(b.inputs)
    for x, y in zip(a.inputs, b.inputs):
        assert_same_value(x, y, f"input %{x.name}")
        assert y.producer is None
    assert len(a.nodes) == len(b.nodes)
    for m, n in zip(a.nodes, b.nodes):
        assert_same_node(m, n, b)
    assert [(k, v.name) for k, v in a.outputs] == [(k, v.name) for k, v in b.outputs]
    for _, v in b.outputs:
        assert b.value(v.name) is v


def assert_same_node(m, n, b: Graph) -> None:
    where = repr(m)
    assert m.op == n.op, where
    assert m.loc == n.loc, (where, m.loc, n.loc)
    assert list(m.attrs) == list(n.attrs) or set(m.attrs) == set(n.attrs), where
    for key in m.attrs:
        assert same_attr(m.attrs[key], n.attrs[key]), (where, key, m.attrs[key],
                                                      n.attrs[key])
    assert [v.name for v in m.inputs] == [v.name for v in n.inputs], where
    for v in n.inputs:  # inputs are the very values defined earlier in b
        assert b.value(v.name) is v
    assert len(m.outputs) == len(n.outputs), where
    assert (m.body is None) == (n.body is None), where
    if n.body is not None:  # a fused node exports its members' very values
        assert len(m.body) == len(n.body), where
        for x, y in zip(m.body, n.body):
            assert_same_node(x, y, b)
        for x, y in zip(m.outputs, n.outputs):
            assert x.name == y.name and b.value(y.name) is y, where
        return
    for x, y in zip(m.outputs, n.outputs):
        assert_same_value(x, y, f"output %{x.name} of {where}")
        assert y.producer is n


def assert_round_trips(g: Graph) -> Graph:
    text = print_graph(g)
    assert str(g) == text
    back = parse(text)
    assert print_graph(back) == text
    assert_same_graph(g, back)
    return back


# -- golden -----------------------------------------------------------------------------


def golden_graph() -> Graph:
    g = Graph("lenet.train")
    data = g.add_input("data", T(F32, 64, 1, 28, 28))
    label = g.add_input("label", T(I32, 64))
    w = g.add_input("fc.weight", T(F32, 10, 784), role="param", init="xavier")
    hist = g.add_input("fc.weight.hist", T(F32, 10, 784), role="state",
                       init="constant(0)",
                       dist=Distribution(DistKind.split, (CPU0, Device("cpu", 0, 1)), 0))
    it = g.add_input("iteration", T(I64), role="state", init="constant(0)")
    flat = g.add_node("reshape", [data], {"shape": [64, 784]}, names=["flat"],
                      loc="lenet.py:10").outputs[0]
    fc = g.add_node("matmul", [flat, w], {"trans_b": True}, names=["fc"],
                    loc="lenet.py:12").outputs[0]
    s0, s1 = g.add_node("split", [fc], {"axis": 1, "sections": [4, 6]},
                        names=["s0", "s1"]).outputs
    s1.device = Device("gpu", 1, 2)
    s1.dist = Distribution(DistKind.partial, (Device("gpu", 1, 2), Device("gpu", 0, 0)))
    loss = g.add_node("softmax_xent", [fc, label], names=["loss"], loc="lenet.py:20").outputs[0]
    g.add_node("fill", [], {"shape": [], "value": 1.0}, names=["one"])
    gw = g.add_node("scale", [w], {"alpha": 1e-05}, names=["g.fc.weight"]).outputs[0]
    w2, h2 = g.add_node("sgd", [w, hist, gw], {"lr": 0.01, "momentum": 0.9,
                                                "weight_decay": 0.0005},
                        names=["fc.weight.next", "fc.weight.hist.next"]).outputs
    w2.dist = Distribution(DistKind.replicated, (CPU0, Device("cpu", 0, 1)))
    it2 = g.add_node("add_scalar", [it], {"value": 1}, names=["iteration.next"]).outputs[0]
    g.set_outputs([("loss", loss), ("fc.weight", w2), ("fc.weight.hist", h2),
                   ("iteration", it2)])
    return g


GOLDEN = """\
graph lenet.train(
    %data: f32[64,1,28,28] @cpu:0,
    %label: i32[64] @cpu:0,
    %fc.weight: f32[10,784] @cpu:0 {param, init="xavier"},
    %fc.weight.hist: f32[10,784] @cpu:0 ~ split(0)[cpu:0,r1/cpu:0] {state, init="constant(0)"},
    %iteration: i64[] @cpu:0 {state, init="constant(0)"}
) {
  %flat = reshape(%data) {shape=[64,784]} : f32[64,784] @cpu:0  # lenet.py:10
  %fc = matmul(%flat, %fc.weight) {trans_a=false, trans_b=true} : f32[64,10] @cpu:0  # lenet.py:12
  %s0, %s1 = split(%fc) {axis=1, sections=[4,6]} : f32[64,4] @cpu:0, f32[64,6] @r2/gpu:1 ~ partial[r2/gpu:1,gpu:0]
  %loss = softmax_xent(%fc, %label) : f32[] @cpu:0  # lenet.py:20
  %one = fill() {shape=[], dtype="f32", value=1.0} : f32[] @cpu:0
  %g.fc.weight = scale(%fc.weight) {alpha=1e-05} : f32[10,784] @cpu:0
  %fc.weight.next, %fc.weight.hist.next = sgd(%fc.weight, %fc.weight.hist, %g.fc.weight) \
{lr=0.01, momentum=0.9, weight_decay=0.0005} : f32[10,784] @cpu:0 ~ replicated[cpu:0,r1/cpu:0], \
f32[10,784] @cpu:0
  %iteration.next = add_scalar(%iteration) {value=1.0} : i64[] @cpu:0
  return %loss, fc.weight=%fc.weight.next, fc.weight.hist=%fc.weight.hist.next, \
iteration=%iteration.next
}"""


def test_golden_text():
    g = golden_graph()
    assert print_graph(g) == GOLDEN
    assert str(g) == GOLDEN
    verify(g)


def test_golden_parses_back():
    back = assert_round_trips(golden_graph())
    verify(back)
    s1 = back.value("s1")
    assert s1.device == Device("gpu", 1, 2) and s1.dist.kind is DistKind.partial
    assert back.nodes[0].loc == "lenet.py:10"
    assert back.nodes[2].loc is None
    assert back.input("fc.weight").role == "param"
    assert back.input("fc.weight").init == "xavier"
    assert back.input("data").role == "data" and back.input("data").init is None
    assert back.nodes[-1].attrs == {"value": 1.0}
    assert type(back.nodes[-1].attrs["value"]) is float


def test_empty_graph():
    g = Graph("empty")
    assert print_graph(g) == "graph empty() {\n  return\n}"
    assert_round_trips(g)


def test_graph_without_inputs_and_no_attr_braces():
    g = Graph("g")
    one = g.add_node("fill", [], {"shape": [2], "dtype": "i64", "value": -3},
                     names=["one"]).outputs[0]
    r = g.add_node("relu", [g.add_node("cast", [one], {"dtype": "f64"}).outputs[0]])
    g.set_outputs([("out", r.outputs[0])])
    text = print_graph(g)
    assert text == ("graph g() {\n"
                    "  %one = fill() {shape=[2], dtype=\"i64\", value=-3.0} : i64[2] @cpu:0\n"
                    "  %cast = cast(%one) {dtype=\"f64\"} : f64[2] @cpu:0\n"
                    "  %relu = relu(%cast) : f64[2] @cpu:0\n"
                    "  return out=%relu\n"
                    "}")
    assert_round_trips(g)


@pytest.mark.parametrize("value, text", [
    (3, "3"), (-7, "-7"), (1.0, "1.0"), (0.0001, "0.0001"), (1e-05, "1e-05"),
    (1e16, "1e+16"), (-0.0, "-0.0"), (math.inf, "inf"), (-math.inf, "-inf"),
    (math.nan, "nan"), (True, "true"), (False, "false"), ("a\"b\\c\n", '"a\\"b\\\\c\\n"'),
    ([1, 2], "[1,2]"), ([0.5, 1.0], "[0.5,1.0]"), ([], "[]"),
])
def test_attr_spelling(value, text):
    assert format_attr(value) == text


@pytest.mark.parametrize("value", [0.0, -0.0, 5e-324, 1.7976931348623157e308, -1e-300,
                                   math.inf, -math.inf, math.nan, 0.1, 123456789.125])
def test_float_attrs_round_trip(value):
    g = Graph("f")
    x = g.add_input("x", T(F32, 2))
    y = g.add_node("scale", [x], {"alpha": value}).outputs[0]
    g.set_outputs([("y", y)])
    back = assert_round_trips(g)
    assert same_attr(back.nodes[0].attrs["alpha"], value)


def test_strings_and_locs_round_trip():
    g = Graph("s")
    x = g.add_input("x", T(F32, 2), init='uniform("a\\b")\n\ttab é ∑ \x01')  # free text
    y = g.add_input("y", T(F32, 2), init="from-file")  # a data input with an init
    z = g.add_node("add", [x, y], loc=' leading space, "#" and # inside é').outputs[0]
    g.set_outputs([("z", z)])
    text = print_graph(g)
    assert '%y: f32[2] @cpu:0 {data, init="from-file"}' in text
    assert_round_trips(g)


def test_tolerant_whitespace_and_comments():
    text = """
    # a comment line alone

    graph   w (  %x :f32[ 2 , 3 ]@cpu:0 {param},%b:f32[3]  @ r1/gpu:2 ) {
       # another
       %y=bias_add( %x,%b ){ axis = 1 }:f32[2,3]@cpu:0 ~split( 1 )[ cpu:0 , gpu:1 ]   # here.py:3   
       %z = relu(%y) : f32[2,3] @cpu:0
       # not a loc of %z
       return   out = %z , %y
    }
    """
    g = parse(text)
    assert g.name == "w"
    assert g.input("b").device == Device("gpu", 2, 1)
    assert g.nodes[0].loc == "here.py:3"
    assert g.nodes[1].loc is None
    assert g.value("y").dist == Distribution(DistKind.split, (CPU0, Device("gpu", 1)), 1)
    assert [(k, v.name) for k, v in g.outputs] == [("out", "z"), ("y", "y")]
    assert g.nodes[0].attrs == {"axis": 1}
    assert_round_trips(g)


def test_attrs_completed_in_schema_order_and_coerced():
    g = parse("graph g(%a: f32[2,3] @cpu:0, %b: f32[4,3] @cpu:0) {\n"
              "  %c = matmul(%a, %b) {trans_b=true} : f32[2,4] @cpu:0\n"
              "  %d = fill() {value=2, shape=[1]} : f32[1] @cpu:0\n"
              "  return %c\n}")
    assert list(g.nodes[0].attrs.items()) == [("trans_a", False), ("trans_b", True)]
    assert list(g.nodes[1].attrs) == ["shape", "dtype", "value"]
    assert type(g.nodes[1].attrs["value"]) is float
    verify(g)


def test_parser_does_not_check_types():
    g = parse("graph g(%a: f32[2] @cpu:0) {\n"
              "  %b = relu(%a) : i32[7,7] @gpu:0\n"
              "  return %b\n}")
    assert g.value("b").type == T(I32, 7, 7)


def test_parse_with_verify_reports_the_line_of_the_node_that_breaks_an_invariant():
    text = ("graph g(%a: f32[2] @cpu:0) {\n"
            "  %b = relu(%a) : f32[2] @cpu:0\n"
            "  %c = relu(%b) : f32[3] @cpu:0  # net.py:9\n"
            "  return %c\n}")
    parse(text)  # the parser alone takes the declared type
    with pytest.raises(VerifyError, match=r"^net\.pir:3: node %c = relu\(%b\) \(at net\.py:9\): "
                                          r"output %c is declared f32\[3\] but op relu "
                                          r"gives f32\[2\]"):
        parse(text, source="net.pir", verify=True)


def test_parse_with_verify_names_the_line_of_a_fused_member():
    text = FUSED_TEXT.replace("trans_b=true} : f32[2,4]", "trans_b=true} : f32[2,5]")
    line = next(i for i, row in enumerate(text.splitlines(), 1) if "f32[2,5]" in row)
    with pytest.raises(VerifyError, match=rf"^net\.pir:{line}: node %fc = matmul\(%x, %w\) "
                                          r".*\(at net\.py:3\) in the body of fused node"):
        parse(text, source="net.pir", verify=True)
    verify(parse(FUSED_TEXT, verify=True))  # and a well-formed graph passes


def test_parse_with_verify_names_the_line_of_a_graph_input():
    text = GOOD.replace("%w: f32[3] @cpu:0", "%w: f32[3] @cpu:0 ~ split(1)[cpu:0,cpu:1]")
    with pytest.raises(VerifyError, match=r"^net\.pir:3: graph input %w is split along axis 1, "
                                          r"which f32\[3\] does not have"):
        parse(text, source="net.pir", verify=True)


TRAIN_TEXT = """\
graph t(
    %x: f32[2,3] @cpu:0,
    %w: f32[3] @cpu:0 {param, init="xavier"},
    %h: f32[3] @cpu:0 {state, init="constant(0)"}
) {
  %y = bias_add(%x, %w) {axis=1} : f32[2,3] @cpu:0
  %loss = reduce_sum(%y) {axes=[0,1], keepdims=false} : f32[] @cpu:0
  %w.next, %h.next = sgd(%w, %h, %w) {lr=0.1} : f32[3] @cpu:0, f32[3] @cpu:0
  return loss=%loss,
    w=%w.next,
    h=%h.next
}"""


@pytest.mark.parametrize("old, new, line, words", [
    ("w=%w.next", "w=%y", 10, ["graph output w=%y", "next value", "its type f32[3], not "
                                                                  "f32[2,3]"]),
    ("h=%h.next", "h=%loss", 11, ["graph output h=%loss", "state h", "f32[3], not f32[]"]),
    ("loss=%loss,", "", 10, ["returns the next value of param w", "returns no loss"]),
    ("loss=%loss,", "loss=%y,", 9, ["loss=%y is f32[2,3]", "float scalar"]),
])
def test_parse_with_verify_names_the_line_of_what_a_training_step_needs(old, new, line,
                                                                        words):
    """A step keeps every output named after a variable as its next value, and reports
    the loss: wrong types and a missing loss are refused where the .pir file says so."""
    parse(TRAIN_TEXT, verify=True)
    with pytest.raises(VerifyError) as info:
        parse(TRAIN_TEXT.replace(old, new), source="t.pir", verify=True)
    assert str(info.value).startswith(f"t.pir:{line}: "), str(info.value)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_parse_with_verify_refuses_a_fused_graph_over_several_devices():
    text = FUSED_TEXT.replace("%b: f32[4] @cpu:0", "%b: f32[4] @gpu:0")
    line = next(i for i, row in enumerate(text.splitlines(), 1) if "= fused(" in row)
    parse(text)  # valid IR: a rank's physical graph may span its devices
    with pytest.raises(VerifyError, match=rf"^net\.pir:{line}: fused node %fc.b, %act = fused.*"
                                          r"places values on cpu:0, gpu:0.*before fusion"):
        parse(text, source="net.pir", verify=True)


def test_outputs_placed_as_declared():
    g = parse("graph g(%a: f32[4] @cpu:0) {\n"
              "  %b, %c = split(%a) {axis=0, sections=[1,3]} : f32[1] @gpu:0, "
              "f32[3] @r3/cpu:1 ~ replicated[cpu:1]\n"
              "  return %b, %c\n}")
    b, c = g.nodes[0].outputs
    assert b.device == Device("gpu", 0) and b.dist is None
    assert c.device == Device("cpu", 1, 3)
    assert c.dist == Distribution(DistKind.replicated, (Device("cpu", 1),))
    assert b.producer is g.nodes[0] and c.producer is g.nodes[0]


# -- random graphs ----------------------------------------------------------------------

KEYWORD_NAMES = ["graph", "return", "inf", "nan", "true", "false", "f32", "cpu", "r1",
                 "split", "init", "param", "x-1", "a.b.c", "_", "A", "e5"]
names = st.one_of(st.sampled_from(KEYWORD_NAMES),
                  st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,12}", fullmatch=True))
devices = st.builds(Device, st.sampled_from(["cpu", "gpu"]), st.integers(0, 3),
                    st.integers(0, 3))
any_floats = st.one_of(st.floats(), st.sampled_from([1e-300, -1e300, 5e-324, 1e-05, -0.0,
                                                     0.1, 3.0]))
locs = st.one_of(st.none(), st.text(
    st.characters(blacklist_characters="\n\r", blacklist_categories=("Cs",)),
    max_size=24).filter(lambda s: s == s.rstrip(" \t")))
inits = st.one_of(st.none(), st.text(max_size=16))  # a data input's: free text
float_fillers = st.one_of(st.none(), st.sampled_from(["xavier", "msra"]),
                          st.builds("constant({})".format, st.floats(-2, 2)),
                          st.builds("gaussian({})".format, st.floats(0, 1)))
int_fillers = st.one_of(st.none(), st.builds("constant({})".format, st.integers(-2, 2)))
bool_fillers = st.sampled_from([None, "constant(0)", "constant(1)"])


def fillers(dtype):
    """The fillers a tensor of ``dtype`` takes: random ones for floats only, constants
    that the dtype holds."""
    return (float_fillers if dtype.is_float else bool_fillers if dtype is DType.bool
            else int_fillers)

float_dtypes = st.sampled_from([F32, F64])


def dists_for(rank):
    groups = st.lists(devices, min_size=1, max_size=3, unique=True).map(tuple)
    options = [st.none(), st.none(),
               st.builds(Distribution, st.sampled_from([DistKind.replicated,
                                                        DistKind.partial]), groups)]
    if rank:
        options.append(st.builds(Distribution, st.just(DistKind.split), groups,
                                 st.integers(0, rank - 1)))
    return st.one_of(options)


class _Builder:
    def __init__(self, draw):
        self.draw = draw
        self.g = Graph(self.draw(names))

    def fresh(self, taken=()):
        base = self.draw(names)
        name = self.g.fresh_name(base)
        i = 1
        while name in taken:
            name = self.g.fresh_name(f"{base}.x{i}")
            i += 1
        return name

    def shape(self, min_rank=0, max_rank=3):
        return tuple(self.draw(st.lists(st.integers(1, 4), min_size=min_rank,
                                        max_size=max_rank)))

    def new_input(self, ty):
        draw = self.draw
        role = draw(st.sampled_from(["data", "param", "state"]))
        return self.g.add_input(self.fresh(), ty, draw(devices), role,
                                draw(dists_for(ty.rank)),
                                draw(fillers(ty.dtype)) if role != "data"
                                else draw(inits) if draw(st.booleans()) else None)

    def value(self, pred=lambda t: t.dtype.is_float, make=None):
        """An existing value whose type satisfies pred, or a new input."""
        pool = [v for v in self.g.values() if pred(v.type)]
        if pool and self.draw(st.integers(0, 3)):
            return self.draw(st.sampled_from(pool))
        ty = make() if make else TensorType(self.shape(), self.draw(float_dtypes))
        return self.new_input(ty)

    def of_type(self, ty):
        return self.value(lambda t: t == ty, lambda: ty)

    def ranked(self, lo, hi=3):
        return self.value(lambda t: t.dtype.is_float and lo <= t.rank <= hi,
                          lambda: TensorType(self.shape(lo, hi), self.draw(float_dtypes)))

    def step(self):
        draw = self.draw
        op = draw(st.sampled_from(OPS))
        inputs, attrs = BUILDERS[op](self, draw)
        n_out = len(attrs["sections"]) if op == "split" else 2 if op == "sgd" else 1
        taken: list[str] = []
        for _ in range(n_out):
            taken.append(self.fresh(taken))
        node = self.g.add_node(op, inputs, attrs, names=taken, device=draw(devices),
                               loc=draw(locs))
        for v in node.outputs:
            if draw(st.integers(0, 3)) == 0:
                v.device = draw(devices)
            v.dist = draw(dists_for(v.type.rank))


def _unary(b, draw):
    return [b.value()], {}


def _binary(b, draw):
    x = b.value()
    return [x, b.of_type(x.type)], {}


def _scale(b, draw):
    return [b.value()], {"alpha": draw(any_floats)}


def _add_scalar(b, draw):
    return [b.value(lambda t: True)], {"value": draw(any_floats)}


def _cast(b, draw):
    return [b.value(lambda t: True)], {"dtype": draw(st.sampled_from([d.value for d in DType]))}


def _bias_add(b, draw):
    x = b.ranked(1)
    axis = draw(st.integers(0, x.type.rank - 1))
    return [x, b.of_type(TensorType((x.type.shape[axis],), x.type.dtype))], {"axis": axis}


def _matmul(b, draw):
    a = b.ranked(2, 2)
    ta, tb = draw(st.booleans()), draw(st.booleans())
    k = a.type.shape[0] if ta else a.type.shape[1]
    n = draw(st.integers(1, 4))
    w = b.of_type(TensorType((n, k) if tb else (k, n), a.type.dtype))
    return [a, w], {"trans_a": ta, "trans_b": tb}


def _reshape(b, draw):
    x = b.value(lambda t: True)
    shape = list(x.type.shape)
    options = [shape[::-1], [x.type.size], [1] + shape, shape + [1]]
    return [x], {"shape": draw(st.sampled_from(options))}


def _concat(b, draw):
    x = b.ranked(1)
    axis = draw(st.integers(0, x.type.rank - 1))
    xs = [x]
    for _ in range(draw(st.integers(0, 2))):
        shape = list(x.type.shape)
        shape[axis] = draw(st.integers(1, 4))
        xs.append(b.of_type(x.type.with_shape(shape)))
    return xs, {"axis": axis}


def _split(b, draw):
    x = b.ranked(1)
    axis = draw(st.integers(0, x.type.rank - 1))
    left, sections = x.type.shape[axis], []
    while left:
        s = draw(st.integers(1, left))
        sections.append(s)
        left -= s
    return [x], {"axis": axis, "sections": sections}


def _reduce_sum(b, draw):
    x = b.value()
    axes = draw(st.permutations(range(x.type.rank)))
    axes = axes[:draw(st.integers(0, len(axes)))]
    return [x], {"axes": list(axes), "keepdims": draw(st.booleans())}


def _softmax(b, draw):
    x = b.ranked(1)
    return [x], {"axis": draw(st.integers(0, x.type.rank - 1))}


def _softmax_xent(b, draw):
    logits = b.ranked(2, 2)
    label = b.of_type(TensorType(logits.type.shape[:1], draw(st.sampled_from([I32, I64]))))
    return [logits, label], {}


def _fill(b, draw):
    return [], {"shape": list(b.shape()), "dtype": draw(st.sampled_from([d.value for d in DType])),
                "value": draw(any_floats)}


def _sgd(b, draw):
    w = b.value()
    finite = any_floats.filter(math.isfinite)  # (its hyperparameters are bounded)
    return [w, b.of_type(w.type), b.of_type(w.type)], {
        "lr": draw(finite), "momentum": draw(finite), "weight_decay": draw(finite)}


BUILDERS = {"relu": _unary, "sigmoid": _unary, "tanh": _unary, "add": _binary,
            "sub": _binary, "mul": _binary, "scale": _scale, "add_scalar": _add_scalar,
            "cast": _cast, "bias_add": _bias_add, "matmul": _matmul, "reshape": _reshape,
            "concat": _concat, "split": _split, "reduce_sum": _reduce_sum,
            "softmax": _softmax, "log_softmax": _softmax, "softmax_xent": _softmax_xent,
            "fill": _fill, "sgd": _sgd}
OPS = sorted(BUILDERS)


@st.composite
def graphs(draw):
    b = _Builder(draw)
    for _ in range(draw(st.integers(0, 3))):
        b.new_input(TensorType(b.shape(), draw(st.sampled_from(list(DType)))))
    for _ in range(draw(st.integers(0, 8))):
        b.step()
    values = list(b.g.values())
    chosen = draw(st.lists(st.sampled_from(values), max_size=4)) if values else []
    outputs, used = [], set()
    # An output named after a param or state is its next value, of its type.
    variables = {v.name: v.type for v in b.g.inputs_with_role("param", "state")}
    for v in chosen:
        name = v.name if draw(st.booleans()) else draw(names)
        if name not in used and variables.get(name, v.type) == v.type:
            used.add(name)
            outputs.append((name, v))
    b.g.set_outputs(outputs)
    return b.g


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs())
def test_random_graphs_round_trip(g):
    verify(g)
    back = assert_round_trips(g)
    verify(back)


# -- malformed text ---------------------------------------------------------------------

GOOD = """\
graph g(
    %x: f32[2,3] @cpu:0,
    %w: f32[3] @cpu:0 {param, init="xavier"}
) {
  %y = bias_add(%x, %w) {axis=1} : f32[2,3] @cpu:0  # m.py:1
  %s0, %s1 = split(%y) {axis=1, sections=[1,2]} : f32[2,1] @cpu:0, f32[2,2] @cpu:0
  return %y, s=%s1
}"""


def test_good_text_parses():
    assert print_graph(parse(GOOD)) == GOOD


def at(text, needle, start=0):
    """The 1-based line and column of the first occurrence of needle in text[start:]."""
    pos = text.index(needle, start)
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


# (old, new, the text at the error, words the message must contain); the error's text is
# searched for from the start of the line where the change was made.
BAD = [
    # unexpected tokens
    ("bias_add(%x, %w)", "bias_add(%x %w)", "%w)", ["expected ')'", "value %w"]),
    ("{axis=1}", "{axis 1}", "1}", ["expected '='", "'1'"]),
    ("  return %y, s=%s1", "  retrun %y", "retrun", ["expected 'return'", "'retrun'"]),
    ("graph g(", "grap g(", "grap", ["expected 'graph'"]),
    (": f32[2,3] @cpu:0  #", ": f32[2,3]  #", "%s0", ["expected '@'", "value %s0"]),
    ("@cpu:0,\n    %w", "@cpu0,\n    %w", "cpu0", ["unknown device kind 'cpu0'"]),
    ("@cpu:0,\n    %w", "@tpu:0,\n    %w", "tpu", ["unknown device kind 'tpu'"]),
    ("f32[2,3] @cpu:0,", "f32[2,-3] @cpu:0,", "-3", ["a dimension", "-3"]),
    ("{param, init", "{weights, init", "weights", ["unknown input role 'weights'"]),
    ('init="xavier"', 'init="xavir"', '"xavir"', ["unknown initializer 'xavir'", "msra"]),
    # fillers no tensor can be filled with, or not this one
    ('init="xavier"', 'init="uniform(-1)"', '"uniform', ["half-width must be >= 0"]),
    ('init="xavier"', 'init="gaussian(-1)"', '"gaussian', ["standard deviation must be >= 0"]),
    ('init="xavier"', 'init="uniform(inf)"', '"uniform', ["must be a finite number"]),
    ('init="xavier"', 'init="constant(1e400)"', '"constant', ["must be a finite number"]),
    ('init="xavier"', 'init="gaussian(nan)"', '"gaussian', ["must be a finite number"]),
    ('%w: f32[3] @cpu:0 {param, init="xavier"}', '%w: i32[3] @cpu:0 {param, init="xavier"}',
     '"xavier"', ["draws random floats; a i32 tensor takes constant(v)"]),
    ("f32[2,1] @cpu:0,", "f32[2,1] @cpu:0 ~ sharded[cpu:0],", "sharded",
     ["unknown distribution 'sharded'"]),
    ("%x: f32", "x: f32", "x: f32", ["expected a graph input", "'x'"]),
    ("%x: f32", "% x: f32", "% x", ["value name after '%'"]),
    ("{axis=1}", "{axis=1} $", "$", ["unexpected character '$'"]),
    ("sections=[1,2]", "sections=[[1],2]", "[1]", ["nested list"]),
    ("{axis=1}", "{axis=}", "}", ["expected an attribute value", "'}'"]),
    # unterminated string, bad string
    ('init="xavier"', 'init="xavier', '"xavier', ["unterminated string"]),
    ('init="xavier"', 'init="xa\\q"', '"xa', ["bad string literal"]),
    # bad numbers
    ("f32[2,3] @cpu:0,", "f32[2,3x] @cpu:0,", "3x", ["bad number '3x'"]),
    ("{axis=1}", "{axis=1.2.3}", "1.2.3", ["bad number '1.2.3'"]),
    ("{axis=1}", "{axis=1e}", "1e", ["bad number '1e'"]),
    # numbers an int64 or float64 cannot hold, or too long to read
    ("f32[2,3] @cpu:0,", "f32[2," + "1" * 5000 + "] @cpu:0,", "1111",
     ["has 5000 characters", "int64 or float64"]),
    ("f32[2,3] @cpu:0,", "f32[2,9223372036854775808] @cpu:0,", "9223",
     ["integer 9223372036854775808 does not fit int64"]),
    ("{axis=1}", "{axis=-9223372036854775809}", "-9223", ["does not fit int64"]),
    ("{axis=1}", "{axis=1e400}", "1e400", ["1e400 is beyond the float64 range", "inf"]),
    ("sections=[1,2]", "sections=[1,-1e999]", "-1e999", ["beyond the float64 range"]),
    ("@cpu:0,\n    %w", "@r" + "9" * 5000 + "/cpu:0,\n    %w", "r999",
     ["rank", "5000 characters"]),
    # shapes no tensor can have
    ("%x: f32[2,3]", "%x: f32[4294967296,4294967296]", "f32[4294967296",
     ["more than 2**56 elements"]),
    ("%x: f32[2,3]", "%x: f32[" + ",".join(["1"] * 33) + "]", "f32[1,",
     ["33 dimensions", "at most 32"]),
    # unknown dtype
    ("%x: f32[2,3]", "%x: f33[2,3]", "f33", ["unknown dtype 'f33'", "f32"]),
    # unknown values (use before definition)
    ("bias_add(%x, %w)", "bias_add(%x, %v)", "%v", ["unknown value %v"]),
    ("split(%y)", "split(%s1)", "%s1)", ["unknown value %s1"]),
    ("return %y,", "return %nope,", "%nope", ["unknown value %nope"]),
    # values defined twice
    ("  %y = bias_add", "  %x = bias_add", "%x = ", ["%x is defined twice"]),
    ("%s0, %s1 = split", "%s0, %s0 = split", "%s0 =", ["%s0 is defined twice"]),
    ("    %w: f32[3]", "    %x: f32[3]", "%x: f32[3]", ["%x is defined twice"]),
    # unknown op
    ("bias_add(", "bias_ad(", "bias_ad", ["unknown op 'bias_ad'", "bias_add"]),
    ("bias_add(", "frobnicate(", "frobnicate", ["unknown op 'frobnicate'"]),
    # attributes
    ("{axis=1}", "{axes=1}", "axes", ["no attribute axes", "axis"]),
    ("{axis=1}", "{axis=1.5}", "1.5", ["attribute axis must be int", "1.5"]),
    ("{axis=1}", '{axis="1"}', '"1"', ["attribute axis must be int"]),
    ("{axis=1}", "{axis=1, axis=1}", "axis=1}", ["axis is given twice"]),
    ("{axis=1, sections=[1,2]}", "{axis=1}", "split(", ["needs attribute sections"]),
    ("sections=[1,2]", "sections=[1,true]", "[1,true]", ["attribute sections must be int", "True"]),
    # arity
    ("bias_add(%x, %w)", "bias_add(%x)", "bias_add", ["takes 2 input(s)", "got 1"]),
    # output types vs names
    ("f32[2,1] @cpu:0, f32[2,2] @cpu:0", "f32[2,1] @cpu:0", "%s1 =",
     ["output %s1 has no type", "2 output names but 1 output types"]),
    ("f32[2,3] @cpu:0  #", "f32[2,3] @cpu:0, f32[2] @cpu:0  #", "f32[2] @",
     ["2 output types for 1 output names"]),
    # graph outputs
    ("return %y, s=%s1", "return %y, y=%s1", "y=%s1", ["output y is returned twice"]),
    ("return %y, s=%s1", "return %y s=%s1", "s=%s1", ["expected '}'", "'s'"]),
    ("return %y, s=%s1", "return %y, 5", "5", ["expected a graph output"]),
    # trailing garbage
    ("%s1\n}", "%s1\n}\n\n  extra", "extra", ["expected end of input", "'extra'"]),
    ("%s1\n}", "%s1\n}}", "}}", ["expected end of input"]),
    # truncated text
    ("%s1\n}", "%s1\n", None, ["expected '}'", "end of input"]),
]


@pytest.mark.parametrize("old, new, needle, words", BAD, ids=[b[1][:48] for b in BAD])
def test_syntax_errors(old, new, needle, words):
    assert GOOD.count(old) == 1, old
    text = GOOD.replace(old, new)
    with pytest.raises(IRSyntaxError) as info:
        parse(text, source="bad.ir")
    err = info.value
    if needle is None:
        expect = (text.count("\n") + 1, len(text) - text.rfind("\n"))
    else:
        expect = at(text, needle, text.rfind("\n", 0, text.index(new)) + 1)
        if needle == "}}":
            expect = (expect[0], expect[1] + 1)  # the second brace
    assert (err.line, err.column) == expect, (str(err), expect)
    assert err.source == "bad.ir"
    assert str(err).startswith(f"bad.ir:{err.line}:{err.column}: ")
    for word in words:
        assert word in str(err), (word, str(err))


def test_syntax_error_positions_spelled_out():
    # a few positions counted by hand rather than found by text search
    with pytest.raises(IRSyntaxError) as info:
        parse("graph g(%x: f32[2] @cpu:0) {\n  %y = relu(%z) : f32[2] @cpu:0\n  return %y\n}")
    assert (info.value.line, info.value.column) == (2, 13)
    assert "%z" in str(info.value)
    with pytest.raises(IRSyntaxError) as info:
        parse("graph g() {\n  %y = rleu() : f32[2] @cpu:0\n  return %y\n}")
    assert (info.value.line, info.value.column) == (2, 8)
    assert "rleu" in str(info.value) and "relu" in str(info.value)
    with pytest.raises(IRSyntaxError) as info:
        parse("")
    assert (info.value.line, info.value.column) == (1, 1)
    assert "expected 'graph'" in str(info.value) and "end of input" in str(info.value)
    with pytest.raises(IRSyntaxError) as info:
        parse('graph g(%x: f32[2] @cpu:0 {param, init="abc\n}) {\n  return\n}')
    assert (info.value.line, info.value.column) == (1, 40)
    assert "unterminated" in str(info.value)


# -- fused nodes ------------------------------------------------------------------------


def fused_graph() -> Graph:
    """matmul -> bias_add -> relu as one fused node exporting two values, then softmax."""
    g = Graph("net")
    x = g.add_input("x", T(F32, 2, 3))
    w = g.add_input("w", T(F32, 4, 3), role="param", init="xavier")
    b = g.add_input("b", T(F32, 4), role="param")
    fc = g.make_node("matmul", [x, w], {"trans_b": True}, names=["fc"], loc="net.py:3")
    biased = g.make_node("bias_add", [fc.outputs[0], b], names=["fc.b"], loc="net.py:3")
    act = g.make_node("relu", biased.outputs, names=["act"], loc="net.py:4")
    g.add_fused([fc, biased, act], [x, w, b], [biased.outputs[0], act.outputs[0]],
                "fused_matmul_bias_add_relu")
    prob = g.add_node("softmax", act.outputs, names=["prob"])
    g.set_outputs([("prob", prob.outputs[0]), ("pre", biased.outputs[0])])
    return g


FUSED_TEXT = """\
graph net(
    %x: f32[2,3] @cpu:0,
    %w: f32[4,3] @cpu:0 {param, init="xavier"},
    %b: f32[4] @cpu:0 {param}
) {
  %fc.b, %act = fused(%x, %w, %b) {kernel="fused_matmul_bias_add_relu"} : \
f32[2,4] @cpu:0, f32[2,4] @cpu:0 {
    %fc = matmul(%x, %w) {trans_a=false, trans_b=true} : f32[2,4] @cpu:0  # net.py:3
    %fc.b = bias_add(%fc, %b) {axis=1} : f32[2,4] @cpu:0  # net.py:3
    %act = relu(%fc.b) : f32[2,4] @cpu:0  # net.py:4
  }
  %prob = softmax(%act) {axis=1} : f32[2,4] @cpu:0
  return %prob, pre=%fc.b
}"""


def test_fused_node_text():
    g = fused_graph()
    verify(g)
    assert print_graph(g) == FUSED_TEXT


def test_fused_node_parses_back():
    back = assert_round_trips(fused_graph())
    verify(back)
    fused = back.nodes[0]
    assert [m.name for m in fused.body] == ["fc", "fc.b", "act"]
    assert fused.outputs == [fused.body[1].outputs[0], fused.body[2].outputs[0]]
    assert fused.inputs == back.inputs
    assert back.value("fc").producer is fused.body[0]
    assert fused.body[2].loc == "net.py:4" and fused.loc is None
    assert [v.name for v in back.values()] == ["x", "w", "b", "fc.b", "act", "prob"]
    assert [n.name for n in back.flat_nodes()] == ["fc", "fc.b", "act", "prob"]


def test_fused_node_with_a_location_and_clone():
    g = fused_graph()
    g.nodes[0].loc = "net.py:2"
    text = print_graph(g)
    assert '{kernel="fused_matmul_bias_add_relu"} : f32[2,4] @cpu:0, f32[2,4] @cpu:0 {  # ' \
           'net.py:2\n' in text
    assert_round_trips(g)
    copy = g.clone()
    assert print_graph(copy) == text
    assert copy.nodes[0].body[0] is not g.nodes[0].body[0]
    assert copy.nodes[0].outputs[1] is copy.nodes[0].body[2].outputs[0]


FUSED_BAD = [
    # a member reads a value the fused node does not take
    ("fused(%x, %w, %b)", "fused(%x, %w)", "%b)", ["a member of fused node %fc.b reads %b",
                                                   "not an input of the fused node"]),
    # the header exports a value no member defines
    ("%fc.b, %act = fused", "%fc.b, %zz = fused", "%zz", ["exports %zz", "no member"]),
    ("%fc.b, %act = fused", "%x, %act = fused", "%x", ["exports %x", "no member"]),
    # the header's types disagree with the member's
    ("f32[2,4] @cpu:0, f32[2,4] @cpu:0 {", "f32[2,4] @cpu:0, f32[2,5] @cpu:0 {", "f32[2,5]",
     ["declares output %act as f32[2,5] @cpu:0", "defines it as f32[2,4] @cpu:0"]),
    ("f32[2,4] @cpu:0, f32[2,4] @cpu:0 {", "f32[2,4] @cpu:0, f32[2,4] @cpu:1 {", "f32[2,4] @cpu:1",
     ["declares output %act as f32[2,4] @cpu:1"]),
    # nesting, bodies where none belong, a missing body
    ("    %act = relu(%fc.b)", "    %act = fused(%fc.b)", "fused(%fc.b)", ["do not nest"]),
    ("%prob = softmax(%act) {axis=1} : f32[2,4] @cpu:0", "%prob = softmax(%act) {axis=1} : "
     "f32[2,4] @cpu:0 {  # m.py:1", "{  #", ["op softmax takes no body"]),
    ("    %act = relu(%fc.b) : f32[2,4] @cpu:0  #", "    %act = relu(%fc.b) : f32[2,4] @cpu:0 {"
     "  #", "{", ["op relu takes no body"]),
    ("f32[2,4] @cpu:0, f32[2,4] @cpu:0 {\n", "f32[2,4] @cpu:0, f32[2,4] @cpu:0\n", "%fc =",
     ["expected '{' to open the body of fused node %fc.b"]),
    ("  }\n", "", "return", ["expected '}' to close the body of fused node %fc.b"]),
    # names: defined twice, members out of order, internal values read outside
    ("    %fc = matmul", "    %x = matmul", "%x = ", ["%x is defined twice"]),
    ("    %fc.b = bias_add(%fc, %b)", "    %fc.b = bias_add(%act, %b)", "%act, %b",
     ["unknown value %act", "defined later"]),
    ("return %prob, pre=%fc.b", "return %prob, pre=%fc", "%fc\n", ["%fc is internal to fused "
                                                                  "node %fc.b"]),
    ("softmax(%act)", "softmax(%fc)", "%fc)", ["%fc is internal to fused node %fc.b"]),
    # the kernel attribute
    ('{kernel="fused_matmul_bias_add_relu"}', "", "fused(", ["needs attribute kernel"]),
    ('kernel="fused_matmul_bias_add_relu"', "kernel=3", "3}", ["attribute kernel must be str"]),
]


@pytest.mark.parametrize("old, new, needle, words", FUSED_BAD, ids=[b[1] for b in FUSED_BAD])
def test_syntax_errors_in_fused_nodes(old, new, needle, words):
    assert FUSED_TEXT.count(old) == 1, old
    text = FUSED_TEXT.replace(old, new)
    with pytest.raises(IRSyntaxError) as info:
        parse(text, source="bad.ir")
    err = info.value
    line_start = text.rfind("\n", 0, text.index(new)) + 1 if new else 0
    expect = at(text, needle, line_start)
    assert (err.line, err.column) == expect, (str(err), expect)
    for word in words:
        assert word in str(err), (word, str(err))


def test_empty_fused_body_is_refused():
    text = FUSED_TEXT.split("{\n    %fc = ")[0] + "{\n  }\n  return\n}"
    with pytest.raises(IRSyntaxError) as info:
        parse(text)
    assert "fused node %fc.b has an empty body" in str(info.value)
    assert (info.value.line, info.value.column) == (7, 3)
