"""purinec.bigraph: the >> forms, names, locations, source lines, errors, lowering."""

from __future__ import annotations

import sys
import zlib

import pytest

from purinec.bigraph import (LRN, Accuracy, AvgPool, Bias, Blob, Blobs, Concat, Conv, Dropout,
                             Eltwise, Flatten, GlobalAvgPool, Graph, InnerProduct, Layer,
                             LayerShapeError, Lazy, Location, MaxPool, Net, Op, ReLU, Scale,
                             Sigmoid, Softmax, SoftmaxWithLoss, Split, TanH)
from purinec.errors import ModelError, ShapeError
from purinec.ir.types import Device, DType, TensorType
from purinec.models import load_model
from purinec.models.loader import offered_args
from purinec.bigraph.lower import lower

HERE = "test_bigraph.py"


def line() -> int:
    """The caller's line number."""
    return sys._getframe(1).f_lineno


def ops_of(graph):
    return [n.op for n in graph.nodes]


def node(graph, name):
    for n in graph.nodes:
        if any(v.name == name for v in n.outputs):
            return n
    raise KeyError(name)


def small_net(name="n", dropout=False):
    with Net(name) as net:
        data = Blob("data", (4, 3, 8, 8))
        label = Blob("label", (4,), "i32")
        x = data >> Conv("conv1", 6, 3, pad=1) >> ReLU("relu1") >> MaxPool("pool1", 2, 2)
        if dropout:
            x = x >> Dropout("drop1", 0.5)
        logits = x >> InnerProduct("ip1", 5) >> Blob("logits")
        loss = [logits, label] >> SoftmaxWithLoss("loss")
        acc = [logits, label] >> Accuracy("accuracy")
        net.outputs = [logits, loss, acc]
    return net


# ---------------------------------------------------------------------------------------
# >> forms


def test_blob_into_op_returns_auto_output_named_after_op():
    with Net("n") as net:
        a = Blob("data", (2, 3))
        relu = Op("relu")
        y = a >> relu
        assert isinstance(y, Blob) and y.name == "relu" and y.producer is relu
        z = y >> Op("relu")  # the second unnamed relu gets a fresh name
        assert z.name == "relu_1"
        net.outputs = [z]
    g = lower(net)
    assert [n.op for n in g.nodes] == ["relu", "relu"]
    assert [v.name for n in g.nodes for v in n.outputs] == ["relu", "relu_1"]
    assert g.outputs[0][0] == "relu_1"


def test_list_into_op_then_bind_outputs():
    with Net("n") as net:
        a = Blob("a", (8, 100))
        w = Blob("w", (10, 100), role="param", init="gaussian(0.01)")
        mm = Op("matmul", "mm", trans_b=True)
        b = Blob("b")
        out = [a, w] >> mm >> [b]
        assert out == [b] and mm.outputs == [b] and b.producer is mm
        assert mm.inputs == [a, w]
        net.outputs = [b]
    g = lower(net)
    (n,) = g.nodes
    assert n.op == "matmul" and n.attrs["trans_b"] is True
    assert [v.name for v in n.inputs] == ["a", "w"] and n.outputs[0].name == "b"
    assert n.outputs[0].type == TensorType((8, 10), DType.f32)
    assert g.input("w").role == "param" and g.input("w").init == "gaussian(0.01)"
    # the auto-created blob "mm" was replaced by b, so its name is free
    assert "mm" not in [v.name for v in g.values()]


def test_bind_outputs_before_inputs_and_single_blob_targets():
    with Net("n") as net:
        a = Blob("a", (2, 3))
        op = Op("sigmoid", "sig")
        out = Blob("out")
        assert (op >> out) is out
        assert (a >> op) is out
        net.outputs = [out]
    g = lower(net)
    assert g.nodes[0].outputs[0].name == "out"


def test_ops_chain_and_ops_inside_input_lists():
    with Net("n") as net:
        a = Blob("a", (2, 3))
        b = Blob("b", (2, 3))
        t = a >> Op("tanh", "t")
        s = Op("sigmoid", "s")
        b >> s
        y = [t, s] >> Op("add", "sum")  # an op in a list stands for its output
        net.outputs = [y]
    g = lower(net)
    assert [v.name for v in node(g, "sum").inputs] == ["t", "s"]


def test_layers_connect_in_any_order():
    with Net("n") as net:
        data = Blob("data", (2, 3))
        l1, l2 = ReLU("l1"), Sigmoid("l2")
        top = l1 >> l2           # before l1 has any input
        assert top.name == "l2"
        data >> l1
        net.outputs = [top]
    g = lower(net)
    assert ops_of(g) == ["relu", "sigmoid"]
    assert [v.name for v in node(g, "l2").inputs] == ["l1"]


def test_layer_tops_named_before_connection():
    with Net("n") as net:
        data = Blob("data", (2, 3))
        r = ReLU("r")
        r >> Blob("named")
        out = data >> r
        assert out.name == "named"
        net.outputs = [out]
    assert lower(net).outputs[0][0] == "named"


def test_split_returns_blobs_that_bind_and_feed():
    with Net("n") as net:
        data = Blob("data", (2, 5))
        parts = data >> Split("s", [2, 3])
        assert isinstance(parts, Blobs) and [p.name for p in parts] == ["s_0", "s_1"]
        a, b = parts >> [Blob("a"), Blob("b")]
        both = [b, a] >> Concat("cat")
        net.outputs = [both]
    g = lower(net)
    assert ops_of(g) == ["split", "concat"]
    assert [v.name for v in g.nodes[0].outputs] == ["a", "b"]
    assert g.output("cat").type.shape == (2, 5)


def test_blobs_from_split_feed_a_layer_directly():
    with Net("n") as net:
        data = Blob("data", (2, 4))
        y = data >> Split("s", [2, 2]) >> Eltwise("prod", op="mul")
        net.outputs = [y]
    g = lower(net)
    assert ops_of(g) == ["split", "mul"]
    assert g.output("prod").type.shape == (2, 2)


def test_each_layer_lowers_to_its_ops():
    with Net("n") as net:
        data = Blob("data", (2, 4, 6, 6))
        x = data >> Bias("bias") >> TanH("tanh") >> Scale("scale", 0.5)
        x = x >> LRN("lrn", size=3) >> AvgPool("avg", 3, 2, pad=1) >> GlobalAvgPool("gap")
        x = x >> Flatten("flat") >> Softmax("prob")
        e = [x, x, x] >> Eltwise("sum3")
        net.outputs = [e]
    g = lower(net)
    assert ops_of(g) == ["bias_add", "tanh", "scale", "lrn", "avg_pool2d", "global_avg_pool",
                         "reshape", "softmax", "add", "add"]
    assert g.input("bias.bias").type.shape == (4,)
    assert node(g, "lrn").attrs == {"size": 3, "alpha": 1e-4, "beta": 0.75, "k": 1.0}
    assert node(g, "avg").attrs == {"kernel": [3, 3], "stride": [2, 2], "pad": [1, 1],
                                    "dilation": [1, 1], "ceil_mode": True,
                                    "count_include_pad": True}
    assert g.output("sum3").type.shape == (2, 4)


def test_conv_and_inner_product_parameters():
    with Net("n") as net:
        data = Blob("data", (2, 4, 9, 9))
        conv = Conv("conv", 6, (3, 5), stride=2, pad=(1, 2), groups=2, weight_init="msra")
        x = data >> conv >> InnerProduct("ip", 7, bias=False, weight_init="gaussian(0.1)")
        net.outputs = [x]
    assert conv.weight.path == "conv.weight" and conv.bias.path == "conv.bias"
    g = lower(net)
    assert [(v.name, v.type.shape, v.init) for v in g.inputs] == [
        ("data", (2, 4, 9, 9), None),
        ("conv.weight", (6, 2, 3, 5), "msra"),
        ("conv.bias", (6,), "constant(0)"),
        ("ip.weight", (7, 6 * 5 * 5), "gaussian(0.1)"),
    ]
    c = node(g, "conv.conv")
    assert c.attrs == {"stride": [2, 2], "pad": [1, 2], "groups": 2, "dilation": [1, 1]}
    assert node(g, "conv").op == "bias_add" and node(g, "conv").attrs == {"axis": 1}
    assert ops_of(g) == ["conv2d", "bias_add", "reshape", "matmul"]
    assert node(g, "ip").attrs == {"trans_a": False, "trans_b": True}


def test_inner_product_on_2d_input_does_not_reshape():
    with Net("n") as net:
        x = Blob("data", (3, 11)) >> InnerProduct("ip", 4)
        net.outputs = [x]
    g = lower(net)
    assert ops_of(g) == ["matmul", "bias_add"]
    assert g.input("ip.weight").type.shape == (4, 11)


def test_shared_weights():
    with Net("n") as net:
        a = Blob("a", (2, 3))
        b = Blob("b", (2, 3))
        ip1 = InnerProduct("ip1", 4)
        ya = a >> ip1
        yb = b >> InnerProduct("ip2", 4, weight=ip1.weight, bias=ip1.bias)
        net.outputs = [ya, yb]
    g = lower(net)
    assert [v.name for v in g.inputs_with_role("param")] == ["ip1.weight", "ip1.bias"]
    assert node(g, "ip2.matmul").inputs[1].name == "ip1.weight"


# ---------------------------------------------------------------------------------------
# Names


class Block(Layer):
    """A user composite: conv then relu, nested."""

    def __init__(self, name, width):
        super().__init__(name)
        self.width = width

    def build(self, x):
        return x >> Conv("conv", self.width, 1) >> ReLU("relu")


class Tower(Layer):
    def build(self, x):
        return x >> Block("1x1", 4) >> Block("b2", 5)


def test_hierarchical_names_and_net_name_not_prefixed():
    with Net("mynet") as net:
        data = Blob("data", (2, 3, 4, 4))
        out = data >> Tower("tower") >> ReLU("final")
        net.outputs = [out]
    g = lower(net)
    assert g.name == "mynet"
    assert [v.name for v in g.inputs] == [
        "data", "tower.1x1.conv.weight", "tower.1x1.conv.bias", "tower.b2.conv.weight",
        "tower.b2.conv.bias"]
    names = [v.name for n in g.nodes for v in n.outputs]
    assert names == ["tower.1x1.conv.conv", "tower.1x1.conv", "tower.1x1",
                     "tower.b2.conv.conv", "tower.b2.conv", "tower", "final"]
    assert not any(n.startswith("mynet") for n in names)
    assert net.find("tower.1x1.conv").kind == "layer"
    assert net.blob("tower.1x1.conv.weight").role == "param"


def test_graph_scope_is_a_namespace():
    with Net("n") as net:
        data = Blob("data", (2, 3))
        with Graph("branch"):
            y = data >> ReLU("relu")
            w = Blob("w", (2, 3), role="state", init="constant(1)")
            z = [y, w] >> Op("mul", "m")
        net.outputs = [z]
    g = lower(net)
    assert [v.name for n in g.nodes for v in n.outputs] == ["branch.relu", "branch.m"]
    assert g.input("branch.w").role == "state"


def test_objects_created_outside_a_scope_are_adopted():
    data = Blob("data", (2, 3))
    y = data >> Op("relu") >> Op("relu")
    net = Net("loose", outputs=[y])
    g = lower(net)
    assert [v.name for n in g.nodes for v in n.outputs] == ["relu", "relu_1"]
    assert g.outputs[0][0] == "relu_1"


def test_default_outputs():
    with Net("n") as net:
        data = Blob("data", (2, 3))
        data >> ReLU("a") >> Sigmoid("b")
    assert [name for name, _ in lower(net).outputs] == ["b"]


# ---------------------------------------------------------------------------------------
# Locations


def test_location_maps_to_device():
    assert Location().device == Device("cpu", 0, 0)
    assert Location(rank=2, kind="gpu", index=1).device == Device("gpu", 1, 2)
    assert Location.of(Device("gpu", 3, 1)) == Location(1, "gpu", 3)


def test_location_inheritance():
    gpu0 = Location(kind="gpu", index=0)
    gpu1 = Location(kind="gpu", index=1)
    r1 = Location(rank=1)
    with Net("n", location=gpu0) as net:
        data = Blob("data", (2, 3, 4, 4))
        a = data >> Conv("conv1", 4, 3, pad=1)                    # inherits the net's
        with Graph("tower").at(gpu1):
            b = a >> Conv("conv2", 4, 3, pad=1) >> ReLU("relu2").at(r1)
        c = b >> Op("sigmoid", "sig", location=Location(kind="cpu", index=3))
        net.outputs = [c]
    g = lower(net)
    dev = {v.name: v.device for v in g.values()}
    assert dev["data"] == Device("gpu", 0)
    assert dev["conv1.weight"] == dev["conv1"] == dev["conv1.conv"] == Device("gpu", 0)
    assert dev["tower.conv2.weight"] == dev["tower.conv2"] == Device("gpu", 1)
    assert dev["tower.relu2"] == Device("cpu", 0, 1)
    assert dev["sig"] == Device("cpu", 3)
    assert node(g, "tower.conv2").device == Device("gpu", 1)


def test_layer_at_applies_to_subtree_set_later():
    with Net("n") as net:
        data = Blob("data", (2, 3, 4, 4))
        t = Tower("t")
        y = data >> t
        net.outputs = [y]
    t.at(Location(kind="gpu", index=2))
    g = lower(net)
    assert g.input("t.b2.conv.weight").device == Device("gpu", 2)
    assert g.output("t").device == Device("gpu", 2)
    assert g.input("data").device == Device("cpu", 0)


def test_produced_blob_placed_elsewhere_is_an_error():
    with Net("n") as net:
        data = Blob("data", (2, 3))
        data >> ReLU("r") >> Blob("out", location=Location(kind="gpu"))
    with pytest.raises(ModelError, match="blob out .* placed at gpu:0 but layer r .* runs at "
                                         "cpu:0"):
        lower(net)


# ---------------------------------------------------------------------------------------
# Source lines


def test_source_lines_reach_ir_nodes():
    with Net("n") as net:
        data = Blob("data", (2, 3, 4, 4))
        conv = Conv("conv1", 4, 3); l_conv = line()
        relu = Op("relu", "r"); l_relu = line()
        y = data >> conv
        z = y >> relu
        net.outputs = [z]
    assert conv.loc == f"{HERE}:{l_conv}"
    assert conv.weight.loc == f"{HERE}:{l_conv}"
    g = lower(net)
    # the ops a built-in layer builds carry the layer's line
    assert node(g, "conv1.conv").loc == node(g, "conv1").loc == f"{HERE}:{l_conv}"
    assert node(g, "r").loc == f"{HERE}:{l_relu}"


def test_source_lines_inside_user_composites():
    with Net("n") as net:
        out = Blob("data", (2, 3, 4, 4)) >> Block("blk", 3); l_blk = line()
        net.outputs = [out]
    g = lower(net)
    # Block.build runs at the >> line; the layers it makes report their own lines in it
    loc = node(g, "blk.conv").loc
    assert loc.startswith(f"{HERE}:") and loc != f"{HERE}:{l_blk}"
    assert net.find("blk").loc == f"{HERE}:{l_blk}"


# ---------------------------------------------------------------------------------------
# Errors


def test_wrong_number_of_inputs_to_a_layer():
    with Net("n"):
        data = Blob("data", (2, 3))
        loss = SoftmaxWithLoss("loss"); l = line()
        with pytest.raises(ModelError, match=rf"layer loss \({HERE}:{l}\) takes 2 input\(s\), "
                                             r"got 1 \(data\)"):
            data >> loss


def test_wrong_number_of_inputs_to_an_op():
    with Net("n"):
        data = Blob("data", (2, 3))
        mm = Op("matmul", "mm"); l = line()
        with pytest.raises(ModelError, match=rf"op mm \({HERE}:{l}\): matmul takes 2 "
                                             r"input\(s\) \(a, b\), got 1"):
            data >> mm
        with pytest.raises(ModelError, match="takes at least 1"):
            [] >> Concat("c")


def test_layer_connected_twice():
    with Net("n"):
        data = Blob("data", (2, 3))
        r = ReLU("r")
        data >> r
        with pytest.raises(ModelError, match=r"layer r .* is already connected \(to data\)"):
            data >> r


def test_unconnected_layer():
    with Net("n") as net:
        Blob("data", (2, 3))
        r = ReLU("r"); l = line()
        out = r >> Sigmoid("s")
        net.outputs = [out]
    with pytest.raises(ModelError, match=rf"layer r \({HERE}:{l}\) is not connected"):
        lower(net)


def test_unconnected_input_blob():
    with Net("n") as net:
        h = Blob("h"); l = line()
        h >> Sigmoid("s")
    with pytest.raises(ModelError, match=rf"blob h \({HERE}:{l}\) is used by layer s .* but "
                                         r"nothing produces it and it has no shape"):
        lower(net)


def test_op_without_inputs():
    with Net("n") as net:
        op = Op("relu", "r")
        net.outputs = [op]
    with pytest.raises(ModelError, match="op r has no inputs connected"):
        lower(net)


def test_duplicate_names():
    with Net("n"):
        data = Blob("data", (2, 3))
        data >> ReLU("r"); l1 = line()
        with pytest.raises(ModelError, match=rf"duplicate name 'r': layer r .* clashes with "
                                             rf"layer r \({HERE}:{l1}\)"):
            ReLU("r")
        with pytest.raises(ModelError, match="duplicate name 'data': blob data"):
            Blob("data")
        with pytest.raises(ModelError, match="duplicate name 'r'"):
            Blob("r")  # the layer's top is a blob named r


def test_duplicate_names_across_scopes_found_at_lowering():
    a = Blob("data", (2, 3))
    b = Blob("data", (2, 3))
    net = Net("n", outputs=[[a, b] >> Op("add")])
    with pytest.raises(ModelError, match="duplicate name 'data'"):
        lower(net)


def test_blob_produced_twice():
    with Net("n"):
        data = Blob("data", (2, 3))
        b = Blob("b")
        data >> ReLU("r1") >> b; l1 = line()
        with pytest.raises(ModelError, match=rf"blob b .* is produced twice: by layer r1 "
                                             rf"\({HERE}:{l1}\) and by layer r2"):
            data >> ReLU("r2") >> b
        with pytest.raises(ModelError, match="produced twice"):
            Op("relu", "x") >> [b]


def test_inputs_cannot_be_outputs():
    with Net("n"):
        data = Blob("data", (2, 3))
        w = Blob("w", (2, 3), role="param")
        with pytest.raises(ModelError, match="blob w .* is a param blob"):
            data >> ReLU("r") >> w


def test_bad_names():
    with Net("n"):
        with pytest.raises(ModelError, match=r"bad layer name 'conv 1' \(test_bigraph"):
            ReLU("conv 1")
        with pytest.raises(ModelError, match="no '.'"):
            Blob("a.b")
        with pytest.raises(ModelError, match="bad layer name '1x1'.*must start with a letter"):
            ReLU("1x1")
        with pytest.raises(ModelError, match="bad blob name ''"):
            Blob("")
    with pytest.raises(ModelError, match="bad net name"):
        Net("2net")


def test_a_negative_axis_counts_from_the_end():
    def graph(axis):
        with Net("axes") as net:
            a, b = Blob("a", (2, 3)), Blob("b", (2, 4))
            both = [a, b] >> Concat("c", axis=axis)
            net.outputs = [both >> Softmax("s", axis=axis), *(both >> Split("p", [3, 4], axis))]
        return str(lower(net))

    assert graph(-1) == graph(1)
    assert "axis=1" in graph(-1) and "axis=-1" not in graph(-1)


def test_concat_of_different_dtypes_says_so():
    with Net("mixed") as net:
        net.outputs = [[Blob("a", (2, 3)), Blob("b", (2, 3), "i32")] >> Concat("c")]
    with pytest.raises(ShapeError, match=r"concat: operands are of different dtypes: "
                                         r"f32\[2,3\], i32\[2,3\]"):
        lower(net)


def test_an_output_no_op_makes_or_reads_is_refused():
    with Net("g") as net:
        logits = Blob("data", (2, 3)) >> ReLU("r") >> Blob("logits")
        net.outputs = [logits, Blob("ghost", (3,))]
    with pytest.raises(ModelError, match=r"blob ghost \(.*\) is in the net's outputs, but no "
                                         r"op makes or reads it"):
        lower(net)


def test_bad_arguments():
    with pytest.raises(ModelError, match="unknown op 'relux'; did you mean relu"):
        Op("relux")
    with pytest.raises(ModelError, match="op relu has no attribute.* alpha"):
        Op("relu", alpha=2.0)
    with pytest.raises(ModelError, match="unknown dtype 'f16'"):
        Blob("x", dtype="f16")
    with pytest.raises(ModelError, match="role must be"):
        Blob("x", role="weights")
    with pytest.raises(ModelError, match=r"^layer s \(.*\): alpha must be a finite number, "
                                         r"got 'two'"):
        Scale("s", "two")
    with pytest.raises(ModelError, match="layer n .*: beta must be a finite number, got nan"):
        LRN("n", beta=float("nan"))
    with pytest.raises(ModelError, match=r"^blob w \(.*test_bigraph.py:\d+\): unknown "
                                         r"initializer 'xavir'; use one of"):
        Blob("w", (2, 2), role="param", init="xavir")
    with pytest.raises(ModelError, match=r"^blob fc\.weight .*'gaussian\(x\)': 'x' is not a "
                                         r"number"):
        Blob("data", (2, 3)) >> InnerProduct("fc", 4, weight_init="gaussian(x)")
    with pytest.raises(ModelError, match="unknown device kind 'tpu'"):
        Location(kind="tpu")
    assert Op("relu", location="r1/cpu:2")._location == Location(1, "cpu", 2)
    with pytest.raises(ModelError, match="location 'cpu1' is not a device; write KIND:INDEX"):
        Op("relu", location="cpu1")
    with pytest.raises(ModelError, match="expected a location: a Location, a Device, or a "
                                         "device name"):
        Op("relu", location=1)
    with pytest.raises(ModelError, match="num_output .* not divisible by groups"):
        Conv("c", 5, 3, groups=2)
    with pytest.raises(ModelError, match="kernel must be"):
        MaxPool("p", 0)
    with pytest.raises(ModelError, match=r"p must be in \[0, 1\)"):
        Dropout("d", 1.0)
    with pytest.raises(ModelError, match="op must be 'add' or 'mul'"):
        Eltwise("e", op="max")
    with pytest.raises(ModelError, match="right side must be"):
        Blob("x", (1,)) >> 3


@pytest.mark.parametrize("kwargs, words", [
    ({"weight_init": "uniform(-1)"}, ["conv1.weight", "half-width must be >= 0"]),
    ({"weight_init": "gaussian(-1)"}, ["conv1.weight", "standard deviation must be >= 0"]),
    ({"weight_init": "uniform(inf)"}, ["conv1.weight", "must be a finite number"]),
    ({"bias_init": "constant(1e400)"}, ["conv1.bias", "must be a finite number"]),
    ({"bias_init": "gaussian(nan)"}, ["conv1.bias", "must be a finite number"]),
    ({"bias_init": "constant(1e39)"}, ["conv1.bias", "1e+39 is not a value of f32"]),
])
def test_a_model_files_fillers_are_checked_when_it_is_built(tmp_path, kwargs, words):
    """The same checks as the IR's, at the line of the model file that gives them."""
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    (tmp_path / "mynet.py").write_text(f"""
from purinec.bigraph import Blob, Conv, Net

def build(batch=2):
    with Net("mynet") as net:
        net.outputs = [Blob("data", (batch, 1, 8, 8)) >> Conv("conv1", 4, 3, {args})]
    return net
""")
    with pytest.raises(ModelError) as info:
        load_model(str(tmp_path / "mynet.py"))
    assert str(info.value).startswith("blob conv1."), str(info.value)
    for word in [*words, "mynet.py:6"]:
        assert word in str(info.value), (word, str(info.value))


def test_blob_into_blob_is_refused():
    with Net("n"):
        data = Blob("data", (2, 3))
        with pytest.raises(ModelError, match="cannot connect blob data .* to blob x"):
            data >> Blob("x")


def test_shape_error_names_layer_line_and_inputs():
    with Net("mynet") as net:
        data = Blob("data", (8, 100))
        w = Blob("w", (10, 99), role="param", init="xavier")
        ip1 = InnerProduct("ip1", 10, weight=w); l = line()
        net.outputs = [data >> ip1]
    with pytest.raises(LayerShapeError) as info:
        lower(net)
    msg = str(info.value)
    assert msg.startswith(f"layer ip1 ({HERE}:{l}): matmul: cannot multiply f32[8,100] by "
                          f"f32[10,99]^T")
    assert "%data: f32[8,100]" in msg and "%w: f32[10,99]" in msg
    assert isinstance(info.value, ModelError) and isinstance(info.value, ShapeError)


def test_shape_error_in_a_parameter_shape():
    with Net("n") as net:
        conv = Conv("conv1", 4, 3); l = line()
        net.outputs = [Blob("data", (8, 100)) >> conv]
    with pytest.raises(ShapeError, match=rf"layer conv1 \({HERE}:{l}\): conv2d: input must "
                                         r"have rank 4 .*got \[8,100\] \(inputs: %data: "
                                         r"f32\[8,100\]\)"):
        lower(net)


def test_shape_error_from_the_registry_in_a_nested_layer():
    with Net("n") as net:
        net.outputs = [Blob("data", (2, 3, 4, 4)) >> Tower("tower") >> MaxPool("p", 7)]
    with pytest.raises(ModelError, match=r"layer p \(.*\): max_pool2d: window 7x7 does not "
                                         r"fit input f32\[2,5,4,4\]"):
        lower(net)
    with Net("n2") as net2:
        a = Blob("a", (2, 3))
        b = Blob("b", (2, 4))
        net2.outputs = [[a, b] >> Eltwise("sum")]
    with pytest.raises(ModelError, match=r"layer sum .*: add: operands must have the same type"):
        lower(net2)


def test_declared_output_shape_is_checked():
    with Net("n") as net:
        data = Blob("data", (2, 3))
        net.outputs = [data >> ReLU("r") >> Blob("x", (2, 4))]
    with pytest.raises(ModelError, match=r"blob x .* is declared f32\[2,4\] but layer r .* "
                                         r"produces f32\[2,3\]"):
        lower(net)


def test_input_without_shape():
    with Net("n") as net:
        net.outputs = [Blob("w", role="param") >> ReLU("r")]
    with pytest.raises(ModelError, match=r"blob w .* is an input \(param\) without a shape"):
        lower(net)


def test_cycle():
    with Net("n") as net:
        a, b = Blob("a"), Blob("b")
        a >> Op("relu", "r1") >> b
        b >> Op("relu", "r2") >> a
    with pytest.raises(ModelError, match="cycle through op r1 .*, op r2"):
        lower(net)


def test_elements_of_another_net():
    with Net("one"):
        data = Blob("data", (2, 3))
    with Net("two") as two:
        two.outputs = [data >> ReLU("r")]
    with pytest.raises(ModelError, match="blob data .* belongs to net one"):
        lower(two)


def test_lowering_arguments():
    net = small_net()
    with pytest.raises(ModelError, match="unknown lowering mode 'eval'"):
        lower(net, "eval")
    with pytest.raises(ModelError, match="takes a purinec.bigraph.Net"):
        lower("lenet")
    with Net("noloss") as n2:
        Blob("data", (2, 3)) >> ReLU("r")
    with pytest.raises(ModelError, match="has no blob named 'loss'"):
        lower(n2, "train")


# ---------------------------------------------------------------------------------------
# Lowering modes


def test_inference_leaves_out_label_dependent_layers():
    g = lower(small_net(), "inference")
    assert [v.name for v in g.inputs_with_role("data")] == ["data"]
    assert "softmax_xent" not in ops_of(g) and "accuracy" not in ops_of(g)
    assert [name for name, _ in g.outputs] == ["logits"]
    assert g.output("logits").type == TensorType((4, 5), DType.f32)


def test_train_outputs_and_inputs_order():
    g = lower(small_net(), "train")
    assert [name for name, _ in g.outputs] == ["loss", "accuracy", "logits"]
    assert [name for name, v in g.outputs] == [v.name for _, v in g.outputs]
    assert [(v.name, v.role) for v in g.inputs] == [
        ("data", "data"), ("label", "data"), ("conv1.weight", "param"),
        ("conv1.bias", "param"), ("ip1.weight", "param"), ("ip1.bias", "param")]
    assert g.input("label").type == TensorType((4,), DType.i32)
    assert g.output("loss").type == TensorType((), DType.f32)
    assert "iteration" not in [v.name for v in g.inputs]


def test_dropout_train_and_inference():
    net = small_net(dropout=True)
    inf = lower(net, "inference")
    assert "dropout_mask" not in ops_of(inf) and "mul" not in ops_of(inf)
    assert node(inf, "ip1.flatten").inputs[0].name == "pool1"
    g = lower(net, "train")
    it = g.input("iteration")
    assert it.role == "state" and it.type == TensorType((), DType.i64)
    assert it.init == "constant(0)" and g.inputs[-1] is it
    mask = node(g, "drop1.mask")
    assert mask.op == "dropout_mask" and mask.inputs == [it]
    assert mask.attrs == {"shape": [4, 6, 4, 4], "p": 0.5, "dtype": "f32",
                          "seed": zlib.crc32(b"drop1") & 0x7FFFFFFF}
    drop = node(g, "drop1")
    assert drop.op == "mul" and [v.name for v in drop.inputs] == ["pool1", "drop1.mask"]
    assert [name for name, _ in g.outputs] == ["loss", "accuracy", "logits", "iteration"]
    nxt = g.output("iteration")
    assert nxt.producer.op == "add_scalar" and nxt.producer.attrs == {"value": 1.0}
    assert nxt.producer.inputs == [it] and nxt.type == it.type


def test_dropout_seeds_distinct_and_one_counter():
    with Net("n") as net:
        data = Blob("data", (2, 3))
        label = Blob("label", (2,), "i32")
        x = data >> Dropout("d1") >> Dropout("d2", 0.2) >> Blob("logits")
        net.outputs = [x, [x, label] >> SoftmaxWithLoss("loss")]
    g = lower(net, "train")
    masks = [n for n in g.nodes if n.op == "dropout_mask"]
    assert len(masks) == 2 and masks[0].attrs["seed"] != masks[1].attrs["seed"]
    assert masks[1].attrs["p"] == pytest.approx(0.2)
    assert len([v for v in g.inputs if v.name == "iteration"]) == 1
    # dropout's output is the net's logits: in inference it is an identity, named logits
    inf = lower(net, "inference")
    assert inf.outputs[0][0] == "logits" == inf.outputs[0][1].name
    assert ops_of(inf) == ["reshape"]


def test_lowering_is_repeatable():
    net = small_net(dropout=True)
    a, b = lower(net, "train"), lower(net, "train")
    assert [repr(n) for n in a.nodes] == [repr(n) for n in b.nodes]
    assert [repr(v) for v in a.inputs] == [repr(v) for v in b.inputs]
    assert lower(net, "inference").name == "n"


def test_lazy_user_parameter_shape():
    class Affine(Layer):
        def __init__(self, name, axis=0):
            super().__init__(name)
            self.scale = self.param("scale", Lazy(lambda shape: shape(self.bottom[0])[axis:]),
                                    init="constant(1)")

        def build(self, x):
            return [x, self.scale] >> Op("mul")

    with Net("n") as net:
        net.outputs = [Blob("data", (2, 7)) >> Affine("aff")]
    g = lower(net)
    assert g.input("aff.scale").type.shape == (2, 7)
    assert g.input("aff.scale").init == "constant(1)"
    with Net("m") as net2:
        net2.outputs = [Blob("data", (2, 7)) >> Affine("aff", axis=1)]
    with pytest.raises(ShapeError, match=r"layer aff .*: mul: operands must have the same "
                                         r"type, got f32\[2,7\], f32\[7\]"):
        lower(net2)

    class Broken(Affine):
        def __init__(self, name):
            Layer.__init__(self, name)
            self.scale = self.param("scale", Lazy(lambda shape: shape(self.bottom[0])[9]))

    with Net("k") as net3:
        net3.outputs = [Blob("data", (2, 7)) >> Broken("brk")]
    with pytest.raises(ModelError, match="layer brk .*: computing the shape of brk.scale "
                                         "failed: IndexError"):
        lower(net3)


# ---------------------------------------------------------------------------------------
# User model files


MODEL_FILE = '''\
from purinec.bigraph import Net, Blob, InnerProduct, ReLU, SoftmaxWithLoss

def build(batch, num_classes=3):
    with Net("tiny") as net:
        data = Blob("data", (batch, 6))
        label = Blob("label", (batch,), "i32")
        logits = data >> InnerProduct("ip1", 8) >> ReLU("relu1") \\
            >> InnerProduct("ip2", num_classes) >> Blob("logits")
        loss = [logits, label] >> SoftmaxWithLoss("loss")
        net.outputs = [logits, loss]
    return net
'''


def test_user_model_file(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(MODEL_FILE)
    net = load_model(str(path), batch=5, num_classes=4)
    assert isinstance(net, Net) and net.name == "tiny"
    g = lower(net, "train")
    assert g.output("logits").type.shape == (5, 4)
    assert g.input("ip1.weight").type.shape == (8, 6)
    assert node(g, "ip1").loc == "tiny.py:7"
    assert node(g, "logits").loc == "tiny.py:8"
    assert node(g, "loss").loc == "tiny.py:9"


def test_user_model_file_default_batch_and_optional_args(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from purinec.bigraph import Net, Blob, ReLU\n"
                    "def build(batch=3):\n"
                    "    with Net('m') as net:\n"
                    "        net.outputs = [Blob('data', (batch, 2)) >> ReLU('r')]\n"
                    "    return net\n")
    net = load_model(str(path))
    assert lower(net).output("r").type.shape == (3, 2)
    # asked for, an argument build() does not take is refused; offered (as train offers
    # the data set's shape and classes), it is passed only where build() takes it
    with pytest.raises(ModelError, match="takes no argument 'num_classes'; it takes batch"):
        load_model(str(path), num_classes=7)
    assert offered_args(str(path), {"num_classes": 7, "input_shape": (1, 2)}) == {}
    assert offered_args("lenet", {"num_classes": 7}) == {"num_classes": 7}


def test_user_model_file_errors(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(ModelError, match="model file .*nope.py does not exist"):
        load_model(str(missing))
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\ndef build(batch:\n    pass\n")
    with pytest.raises(ModelError, match=r"bad.py:2: syntax error"):
        load_model(str(bad))
    nobuild = tmp_path / "nobuild.py"
    nobuild.write_text("x = 1\n")
    with pytest.raises(ModelError, match="nobuild.py defines no build"):
        load_model(str(nobuild))
    raises = tmp_path / "raises.py"
    raises.write_text("def build(batch):\n    x = 1\n    return {}['k']\n")
    with pytest.raises(ModelError, match=r"build\(\) in .*raises.py failed at .*raises.py:3: "
                                         r"KeyError"):
        load_model(str(raises), batch=2)
    importerr = tmp_path / "importerr.py"
    importerr.write_text("import os\nraise RuntimeError('boom')\n")
    with pytest.raises(ModelError, match=r"importerr.py:2: loading model file .* RuntimeError"
                                         r": boom"):
        load_model(str(importerr))
    notnet = tmp_path / "notnet.py"
    notnet.write_text("def build(batch):\n    return 42\n")
    with pytest.raises(ModelError, match=r"returned int, not a purinec.bigraph.Net"):
        load_model(str(notnet), batch=2)
    needs = tmp_path / "needs.py"
    needs.write_text("def build(batch):\n    return None\n")
    with pytest.raises(ModelError, match=r"cannot be called: missing a required argument: "
                                         r"'batch'; give a batch size \(--batch N"):
        load_model(str(needs))
    modelerr = tmp_path / "modelerr.py"
    modelerr.write_text("from purinec.bigraph import ReLU\n"
                        "def build(batch):\n    return ReLU('bad name')\n")
    with pytest.raises(ModelError, match=r"bad layer name 'bad name' \(modelerr.py:3\)"):
        load_model(str(modelerr), batch=1)


def test_unknown_model_name_lists_the_zoo():
    with pytest.raises(ModelError, match="unknown model 'resnet'; the zoo has cifar_quick, convnet, "
                                         "inception, lenet, mlp, nin"):
        load_model("resnet")


USER_MODELS = {
    "shape": ('''
from purinec.bigraph import Blob, Net, Op, SoftmaxWithLoss

def build(batch=8):
    with Net("mynet") as net:
        data = Blob("data", (batch, 100))
        label = Blob("label", (batch,), "i32")
        w = Blob("w", (10, 99), role="param", init="xavier")
        logits = [data, w] >> Op("matmul", trans_b=True) >> Blob("logits")
        net.outputs = [logits, [logits, label] >> SoftmaxWithLoss("loss")]
    return net
''', ["mynet.py:9", "cannot multiply f32[8,100] by f32[10,99]^T"]),
    "cycle": ('''
from purinec.bigraph import Blob, Eltwise, Net, ReLU

def build(batch=8):
    with Net("cyc") as net:
        a = Blob("a")
        data = Blob("data", (batch, 4))
        b = [data, a] >> Eltwise("e1", "add")
        b >> ReLU("r") >> a
        net.outputs = [b]
    return net
''', ["cycle", "layer e1 (mynet.py:8)", "layer r (mynet.py:9)"]),
}


@pytest.mark.parametrize("kind", sorted(USER_MODELS))
def test_user_model_errors_from_the_command_line(kind, tmp_path):
    """A user's model with a shape mismatch or a cycle: one paragraph naming the layer
    and its line, exit status 1, no traceback."""
    from tests.cli.test_cli import assert_clean_error, purinec

    source, fragments = USER_MODELS[kind]
    (tmp_path / "mynet.py").write_text(source)
    result = purinec("dump", "mynet.py", cwd=tmp_path)
    assert result.returncode == 1
    assert_clean_error(result, *fragments)
