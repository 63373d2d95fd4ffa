"""The verifier: passes on well-formed graphs, names the node for each kind of problem."""

from __future__ import annotations

import pytest

from purinec.errors import VerifyError
from purinec.ir.graph import Graph, Node, Value
from purinec.ir.parser import parse
from purinec.ir.types import CPU0, Device, DistKind, Distribution, DType, TensorType
from purinec.ir.verify import verify

F32, I32 = DType.f32, DType.i32


def T(dtype, *shape):
    return TensorType(tuple(shape), dtype)


def mlp() -> Graph:
    """x -> matmul(w^T) -> bias_add -> relu -> softmax_xent, plus an sgd step."""
    g = Graph("mlp.train")
    x = g.add_input("x", T(F32, 8, 4))
    label = g.add_input("label", T(I32, 8))
    w = g.add_input("w", T(F32, 3, 4), role="param", init="xavier")
    b = g.add_input("b", T(F32, 3), role="param", init="constant(0)")
    hist = g.add_input("w.hist", T(F32, 3, 4), role="state", init="constant(0)")
    fc = g.add_node("matmul", [x, w], {"trans_b": True}, names=["fc"], loc="mlp.py:7")
    biased = g.add_node("bias_add", [fc.outputs[0], b], names=["fc.b"])
    act = g.add_node("relu", biased.outputs, names=["act"], loc="mlp.py:8")
    loss = g.add_node("softmax_xent", [act.outputs[0], label], names=["loss"])
    step = g.add_node("sgd", [w, hist, w], {"lr": 0.1}, names=["w.next", "w.hist.next"])
    g.set_outputs([("loss", loss.outputs[0]), ("w", step.outputs[0]),
                   ("w.hist", step.outputs[1])])
    return g


def node(g: Graph, name: str) -> Node:
    return next(n for n in g.nodes if n.name == name)


def fails(g: Graph, *words: str, program: bool = False) -> str:
    with pytest.raises(VerifyError) as info:
        verify(g, program=program)
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)
    return message


# -- valid graphs -------------------------------------------------------------------------


def test_valid_graphs_pass():
    g = mlp()
    verify(g)
    verify(g.clone())
    verify(parse(str(g)))
    verify(Graph("empty"))


def test_distributed_graph_passes():
    g = mlp()
    group = (CPU0, Device("cpu", 0, 1))
    g.input("x").dist = Distribution(DistKind.split, group, 0)
    node(g, "fc").outputs[0].dist = Distribution(DistKind.partial, group)
    node(g, "fc").outputs[0].device = Device("gpu", 1, 1)
    verify(g)


# -- ops, arity, attributes -----------------------------------------------------------------


def test_unknown_op():
    g = mlp()
    node(g, "act").op = "rleu"
    msg = fails(g, "%act = rleu(%fc.b)", "unknown op 'rleu'", "mlp.py:8")
    assert "relu" in msg  # a suggestion


def test_wrong_arity():
    g = mlp()
    node(g, "act").inputs.append(g.input("x"))
    fails(g, "%act = relu(%fc.b, %x)", "takes 1 input(s)", "got 2")


def test_missing_attribute_with_default():
    g = mlp()
    del node(g, "fc").attrs["trans_a"]
    fails(g, "%fc = matmul(%x, %w)", "(at mlp.py:7)", "attribute trans_a is missing",
          "complete_attrs")


def test_missing_required_attribute():
    g = mlp()
    del node(g, "w.next").attrs["lr"]
    fails(g, "%w.next, %w.hist.next = sgd(%w, %w.hist, %w)", "needs attribute lr")


def test_unknown_attribute():
    g = mlp()
    node(g, "act").attrs["alpha"] = 0.1
    fails(g, "%act = relu(%fc.b)", "no attribute(s) alpha")


def test_attribute_of_wrong_kind():
    g = mlp()
    node(g, "fc").attrs["trans_b"] = "yes"
    fails(g, "%fc = matmul", "trans_b must be bool")


def test_attribute_not_normalised():
    g = mlp()
    node(g, "w.next").attrs["lr"] = 1  # an int where the schema says float
    fails(g, "%w.next", "lr=1 is not normalised", "1.0")
    g = mlp()
    node(g, "fc.b").attrs["axis"] = True
    fails(g, "%fc.b = bias_add", "axis")


# -- definitions and uses --------------------------------------------------------------------


def test_use_before_definition():
    g = mlp()
    g.nodes[1], g.nodes[2] = g.nodes[2], g.nodes[1]  # relu before bias_add
    fails(g, "%act = relu(%fc.b)", "%fc.b is used before it is defined",
          "%fc.b = bias_add(%fc, %b)", "topological order")


def test_undefined_value():
    g = mlp()
    ghost = Value("ghost", T(F32, 8, 3))
    node(g, "act").inputs[0] = ghost
    fails(g, "%act = relu(%ghost)", "%ghost is not defined in graph mlp.train")


def test_stale_value_object_with_a_defined_name():
    g = mlp()
    twin = Value("fc.b", T(F32, 8, 3))
    node(g, "act").inputs[0] = twin
    fails(g, "%act = relu(%fc.b)", "different Value object")


def test_cycle():
    g = mlp()
    fc, biased = node(g, "fc"), node(g, "fc.b")
    fc.inputs[0] = biased.outputs[0]  # fc reads bias_add's output, which reads fc
    msg = fails(g, "cycle", "%fc = matmul(%fc.b, %w)", "%fc.b = bias_add(%fc, %b)")
    assert "%act" not in msg


def test_self_loop():
    g = mlp()
    act = node(g, "act")
    act.inputs[0] = act.outputs[0]
    fails(g, "cycle", "%act = relu(%act)")


def test_value_name_defined_twice():
    g = mlp()
    node(g, "act").outputs[0].name = "fc"
    fails(g, "output %fc of node %fc = relu(%fc.b)", "%fc is defined twice",
          "output %fc of node %fc = matmul")
    g = mlp()
    g.inputs[1].name = "x"
    fails(g, "graph input %x", "defined twice")


def test_value_object_defined_twice():
    g = mlp()
    g.inputs.append(g.inputs[0])
    fails(g, "graph input %x", "Value object is already defined")


def test_node_listed_twice():
    g = mlp()
    g.nodes.append(g.nodes[2])
    fails(g, "%act = relu(%fc.b)", "appears twice")


def test_producer_links():
    g = mlp()
    node(g, "act").outputs[0].producer = None
    fails(g, "output %act of node %act = relu(%fc.b)", "no producer")
    g = mlp()
    node(g, "act").outputs[0].producer = node(g, "fc")
    fails(g, "output %act", "producer %fc = matmul")
    g = mlp()
    g.input("b").producer = node(g, "fc")
    fails(g, "graph input %b", "must have none")


def test_node_output_with_role():
    g = mlp()
    node(g, "w.next").outputs[0].role = "param"
    fails(g, "output %w.next of node %w.next, %w.hist.next = sgd", "only graph inputs")


def test_node_without_outputs():
    g = mlp()
    node(g, "loss").outputs.clear()
    g.outputs = [o for o in g.outputs if o[0] != "loss"]
    fails(g, "node softmax_xent(%act, %label)", "no outputs")


# -- types --------------------------------------------------------------------------------------


def test_declared_type_differs_from_inferred():
    g = mlp()
    node(g, "act").outputs[0].type = T(F32, 8, 4)
    fails(g, "%act = relu(%fc.b)", "mlp.py:8", "declared f32[8,4]", "gives f32[8,3]")


def test_wrong_number_of_outputs():
    g = mlp()
    step = node(g, "w.next")
    extra = Value("w.extra", T(F32, 3, 4), producer=step)
    step.outputs.append(extra)
    fails(g, "%w.next, %w.hist.next, %w.extra = sgd", "2 output(s)", "declares 3")


def test_shape_error_reported_with_node():
    g = mlp()
    g.input("w").type = T(F32, 3, 5)
    fails(g, "%fc = matmul(%x, %w)", "(at mlp.py:7)", "f32[8,4], f32[3,5]",
          "cannot multiply")


def test_inference_verify_error_reported_with_node():
    g = Graph("g")
    one = g.add_node("fill", [], {"shape": [2]}, names=["one"])
    one.attrs["dtype"] = "f16"
    fails(g, "%one = fill()", "unknown dtype 'f16'")


def test_parsed_ill_typed_graph_fails():
    g = parse("graph g(%a: f32[2] @cpu:0) {\n"
              "  %b = relu(%a) : f32[3] @cpu:0  # here.py:9\n"
              "  return %b\n}")
    fails(g, "%b = relu(%a) (at here.py:9)", "declared f32[3]", "gives f32[2]")


# -- graph inputs and outputs, names, placement ----------------------------------------------


def test_output_of_undefined_value():
    g = mlp()
    g.outputs.append(("ghost", Value("ghost", T(F32))))
    fails(g, "graph output ghost=%ghost", "not a value of graph mlp.train")


def test_output_names_unique():
    g = mlp()
    g.outputs.append(("loss", node(g, "act").outputs[0]))
    fails(g, "graph output loss=%act", "used twice")


def test_output_name_invalid():
    g = mlp()
    g.outputs.append(("bad name", node(g, "act").outputs[0]))
    fails(g, "graph output bad name=%act", "not a valid name")


def test_input_role():
    g = mlp()
    g.input("w").role = "weights"
    fails(g, "graph input %w", "role 'weights'", "data, param, state")
    g = mlp()
    g.input("x").role = None
    fails(g, "graph input %x", "role None")


def test_input_init():
    g = mlp()
    g.input("w").init = "xavir"
    fails(g, "graph input %w", "unknown initializer 'xavir'")
    g.input("w").init = 0.1
    fails(g, "graph input %w", "has init 0.1; it must be a string or None")


@pytest.mark.parametrize("init, dtype, words", [
    ("uniform(-1)", F32, ["half-width must be >= 0"]),
    ("gaussian(-1)", F32, ["standard deviation must be >= 0"]),
    ("uniform(inf)", F32, ["finite"]),
    ("gaussian(nan)", F32, ["finite"]),
    ("constant(1e400)", F32, ["finite"]),
    ("constant(1e39)", F32, ["1e+39 is not a value of f32"]),
    ("xavier", I32, ["draws random floats", "i32", "constant(v)"]),
    ("constant(1.5)", I32, ["1.5 is not a value of i32"]),
    ("constant(3e9)", I32, ["not a value of i32"]),
    ("constant(2)", DType.bool, ["not a value of bool"]),
])
def test_input_init_fits_its_tensor(init, dtype, words):
    g = Graph("g")
    v = g.add_input("v", T(dtype, 2), role="state", init=init)
    g.set_outputs([("y", v)])
    err = fails(g, "graph input %v", init, *words)
    assert "graph input %v" in err
    with pytest.raises(VerifyError) as info:
        verify(g)
    assert info.value.value is v  # blamed, so a parser can give the input's line


def test_an_output_named_after_a_variable_has_its_type():
    g = mlp()
    g.outputs[2] = ("w.hist", node(g, "act").outputs[0])
    with pytest.raises(VerifyError) as info:
        verify(g)
    assert "graph output w.hist=%act" in str(info.value)
    assert "next value, so it must have its type f32[3,4], not f32[8,3]" in str(info.value)
    assert info.value.output == "w.hist"


def test_a_training_iteration_returns_its_loss():
    g = mlp()
    verify(g, program=True)
    del g.outputs[0]
    verify(g)  # one rank's piece of a program may leave the loss to another rank
    fails(g, "returns the next value of param w", "returns no loss", program=True)
    g.outputs.append(("loss", node(g, "act").outputs[0]))
    fails(g, "loss=%act is f32[8,3]", "float scalar", program=True)
    del g.outputs[-3:]  # an inference graph needs none
    verify(g, program=True)


def test_a_programs_fused_graph_lives_on_one_device():
    g = fused_mlp()
    verify(g, program=True)
    g.input("label").device = Device("cpu", 1)
    verify(g)  # a rank's physical graph may span its devices
    fails(g, "fused node %act = fused", "places values on cpu:0, cpu:1",
          "before fusion", program=True)


def test_sizes_are_bounded():
    g = mlp()
    g.input("x").type = T(F32, 2**32, 2**32)
    assert g.input("x").type.size == 2**64  # exact, not wrapped around to 0
    fails(g, "graph input %x", "more than 2**56 elements")
    g = mlp()
    g.input("x").type = T(F32, *[1] * 33)
    fails(g, "graph input %x", "33 dimensions; a tensor has at most 32")


def test_value_names():
    g = mlp()
    node(g, "act").outputs[0].name = "1act"
    fails(g, "'1act' is not a valid name")
    g = mlp()
    g.input("x").name = "x y"
    fails(g, "graph input %x y", "not a valid name")
    g = mlp()
    g.name = "my graph"
    fails(g, "graph name 'my graph'")


def test_devices_and_distributions():
    g = mlp()
    node(g, "act").outputs[0].device = Device("tpu", 0)
    fails(g, "output %act", "tpu:0", "cpu or gpu")
    g = mlp()
    g.input("b").dist = Distribution(DistKind.split, (CPU0, Device("cpu", 1)), 1)
    fails(g, "graph input %b", "split along axis 1", "f32[3]")
    g = mlp()
    g.input("b").device = Device("cpu", -1)
    fails(g, "graph input %b", "non-negative")
    g = mlp()
    g.input("b").dist = Distribution(DistKind.replicated, (CPU0, Device("cpu", 1), CPU0))
    fails(g, "graph input %b", "replicated[cpu:0,cpu:1,cpu:0], which names a device twice")


def test_loc_must_fit_on_one_line():
    g = mlp()
    node(g, "act").loc = "mlp.py:8\nmore"
    fails(g, "%act = relu", "one line")


# -- fused nodes -----------------------------------------------------------------------------


def fused_mlp() -> Graph:
    """mlp() with matmul -> bias_add -> relu as one fused node exporting %act."""
    g = mlp()
    fc, biased, act = g.nodes[:3]
    g.nodes[:3] = []
    g.add_fused([fc, biased, act], [g.input("x"), g.input("w"), g.input("b")],
                [act.outputs[0]], "fused_matmul_bias_add_relu")
    g.nodes.insert(0, g.nodes.pop())
    return g


def fused(g: Graph) -> Node:
    return next(n for n in g.nodes if n.body is not None)


def member(g: Graph, name: str) -> Node:
    return next(m for m in fused(g).body if m.name == name)


def test_fused_graph_passes():
    g = fused_mlp()
    verify(g)
    verify(g.clone())
    verify(parse(str(g)))


def test_member_reading_an_undeclared_outside_value():
    g = fused_mlp()
    fused(g).inputs.remove(g.input("b"))
    fails(g, "%fc.b = bias_add(%fc, %b) in the body of fused node %act",
          "%b is not an input of the fused node", "add %b to the fused node's inputs")
    g = fused_mlp()
    member(g, "act").inputs[0] = Value("ghost", T(F32, 8, 3))
    fails(g, "%act = relu(%ghost)", "not defined before the fused node")


def test_fused_inputs_are_exactly_what_members_read_in_first_use_order():
    g = fused_mlp()
    fused(g).inputs.append(g.input("label"))
    fails(g, "fused node %act = fused(", "%label are read by no member", "(%x, %w, %b)")
    g = fused_mlp()
    fused(g).inputs.reverse()
    fails(g, "not in first-use order", "(%x, %w, %b)")
    g = fused_mlp()
    fused(g).inputs.append(g.input("x"))
    fails(g, "an input is listed twice")


def test_fused_outputs_are_member_outputs():
    g = fused_mlp()
    fused(g).outputs.append(g.input("x"))
    fails(g, "output %x is not defined by any member")
    g = fused_mlp()
    fused(g).outputs.append(fused(g).outputs[0])
    fails(g, "an output is listed twice")
    g = fused_mlp()
    fused(g).outputs.clear()
    fails(g, "exports no outputs")


def test_values_a_fused_node_does_not_export_are_invisible_after_it():
    g = fused_mlp()
    node(g, "loss").inputs[0] = member(g, "fc.b").outputs[0]
    fails(g, "%loss = softmax_xent(%fc.b, %label)", "%fc.b is internal to fused node",
          "add it to them")
    g = fused_mlp()
    g.outputs.append(("pre", member(g, "fc").outputs[0]))
    fails(g, "graph output pre=%fc", "internal to fused node")


def test_members_are_checked_like_any_node():
    g = fused_mlp()
    member(g, "act").outputs[0].type = T(F32, 8, 4)
    fails(g, "%act = relu(%fc.b) (at mlp.py:8) in the body of fused node",
          "declared f32[8,4]", "gives f32[8,3]")
    g = fused_mlp()
    body = fused(g).body
    body[1], body[2] = body[2], body[1]
    fails(g, "%act = relu(%fc.b)", "used before the member that defines it")
    g = fused_mlp()
    member(g, "act").outputs[0].producer = fused(g)
    fails(g, "output %act of node %act = relu(%fc.b)", "its producer must be the node")


def test_no_nested_fused_nodes():
    g = fused_mlp()
    outer = fused(g)
    inner_members = outer.body[1:]
    inner = Node("fused", [outer.body[0].outputs[0], g.input("b")],
                 [inner_members[1].outputs[0]], {"kernel": "inner"}, body=inner_members)
    outer.body[1:] = [inner]
    fails(g, "fused node %act", "fused nodes do not nest")


def test_fused_node_needs_a_body_and_only_it_has_one():
    g = fused_mlp()
    fused(g).body = []
    fails(g, "non-empty list of member nodes")
    g = fused_mlp()
    fused(g).body = None
    fails(g, "non-empty list of member nodes")
    g = mlp()
    node(g, "act").body = [node(g, "fc")]
    fails(g, "op relu has a body", "only op fused")


def test_members_run_on_one_device():
    g = fused_mlp()
    member(g, "act").outputs[0].device = Device("cpu", 1)
    fails(g, "output %act is placed on cpu:1", "the fused node runs on cpu:0")


def test_kernel_names_are_identifiers_and_unique():
    g = fused_mlp()
    fused(g).attrs["kernel"] = "fused.relu"
    fails(g, "kernel name 'fused.relu' must be an identifier")
    g = fused_mlp()
    step = node(g, "w.next")
    g.nodes.remove(step)
    g.add_fused([step], step.inputs, step.outputs, "fused_matmul_bias_add_relu")
    fails(g, "kernel name fused_matmul_bias_add_relu is also the name of")
    g = fused_mlp()
    del fused(g).attrs["kernel"]
    fails(g, "needs attribute kernel")


def test_a_member_cannot_also_be_a_graph_node():
    g = fused_mlp()
    g.nodes.append(member(g, "act"))
    fails(g, "appears twice")
