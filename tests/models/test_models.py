"""The model zoo: every builder lowers in both modes with the specified parameters."""

from __future__ import annotations

from collections import Counter

import pytest

from purinec.bigraph import Net
from purinec.errors import ModelError
from purinec.ir.types import CPU0, DType, TensorType
from purinec.models import ZOO, InceptionModule, load_model
from purinec.bigraph.lower import lower

DEFAULT_BATCH = {"mlp": 64, "lenet": 64, "convnet": 32, "cifar_quick": 100, "nin": 128,
                 "inception": 64}
MODEL_FILE = {"mlp": "mlp.py", "lenet": "lenet.py", "convnet": "convnet.py",
              "cifar_quick": "cifar.py", "nin": "cifar.py", "inception": "inception.py"}


def params(graph) -> dict[str, tuple]:
    return {v.name: v.type.shape for v in graph.inputs_with_role("param")}


def inits(graph) -> dict[str, str]:
    return {v.name: v.init for v in graph.inputs_with_role("param")}


def histogram(graph) -> Counter:
    return Counter(n.op for n in graph.nodes)


def shape_of(graph, name):
    return graph.value(name).type.shape


@pytest.fixture(scope="module")
def lowered():
    cache = {}

    def get(name, mode, **kwargs):
        key = (name, mode, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = lower(ZOO[name](**kwargs), mode)
        return cache[key]
    return get


def test_zoo_names():
    assert sorted(ZOO) == ["cifar_quick", "convnet", "inception", "lenet", "mlp", "nin"]


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.parametrize("mode", ["inference", "train"])
def test_every_model_lowers(lowered, name, mode):
    g = lowered(name, mode)
    batch = DEFAULT_BATCH[name]
    assert g.name == (name if mode == "inference" else f"{name}.train")
    data = g.input("data")
    assert data.role == "data" and data.type.dtype is DType.f32 and data.type.shape[0] == batch
    assert g.output("logits").type == TensorType((batch, 10), DType.f32)
    names = [name for name, _ in g.outputs]
    if mode == "inference":
        assert [v.name for v in g.inputs_with_role("data")] == ["data"]
        assert names == ["logits"]
        assert not {"softmax_xent", "accuracy", "dropout_mask"} & set(histogram(g))
    else:
        assert g.input("label").type == TensorType((batch,), DType.i32)
        assert names[:3] == ["loss", "accuracy", "logits"]
        assert g.output("loss").type == TensorType((), DType.f32)
        assert g.output("accuracy").type == TensorType((), DType.f32)
        assert histogram(g)["softmax_xent"] == 1 and histogram(g)["accuracy"] == 1
    for out_name, value in g.outputs:
        assert value.name == (out_name if out_name != "iteration" else "iteration.next")
    # parameters: <layer>.weight / <layer>.bias, initialised, in creation order
    for v in g.inputs_with_role("param"):
        assert v.name.endswith((".weight", ".bias")) and v.init
        assert v.init == "constant(0)" if v.name.endswith(".bias") else v.init != "constant(0)"
    roles = [v.role for v in g.inputs]
    assert roles == sorted(roles, key=["data", "param", "state"].index)
    # topological order, unique names, every node placed and carrying its source line
    defined = {v.name for v in g.inputs}
    for n in g.nodes:
        assert all(v.name in defined for v in n.inputs), n
        for v in n.outputs:
            assert v.name not in defined
            defined.add(v.name)
            assert v.device == CPU0
        if n.op != "add_scalar":
            assert n.loc and n.loc.startswith(MODEL_FILE[name] + ":"), (n, n.loc)


def test_mlp(lowered):
    g = lowered("mlp", "train")
    assert params(g) == {"ip1.weight": (512, 784), "ip1.bias": (512,),
                         "ip2.weight": (512, 512), "ip2.bias": (512,),
                         "ip3.weight": (10, 512), "ip3.bias": (10,)}
    assert set(inits(g).values()) == {"xavier", "constant(0)"}
    assert shape_of(g, "ip1.flatten") == (64, 784)
    assert histogram(g) == Counter(matmul=3, bias_add=3, relu=2, reshape=1, softmax_xent=1,
                                   accuracy=1)
    assert len(lowered("mlp", "inference").nodes) == 9


def test_mlp_input_shape_and_classes(lowered):
    g = lowered("mlp", "inference", batch=8, input_shape=(3, 32, 32), num_classes=100)
    assert params(g)["ip1.weight"] == (512, 3072)
    assert params(g)["ip3.weight"] == (100, 512)
    assert g.output("logits").type.shape == (8, 100)


def test_convnet_fits_8x8_digits(lowered):
    g = lowered("convnet", "train")
    assert params(g) == {"conv1.weight": (16, 1, 3, 3), "conv1.bias": (16,),
                         "conv2.weight": (32, 16, 3, 3), "conv2.bias": (32,),
                         "ip1.weight": (64, 128), "ip1.bias": (64,),
                         "ip2.weight": (10, 64), "ip2.bias": (10,)}
    assert shape_of(g, "pool1") == (32, 16, 4, 4)
    assert shape_of(g, "pool2") == (32, 32, 2, 2)


def test_lenet(lowered):
    g = lowered("lenet", "train")
    assert params(g) == {"conv1.weight": (20, 1, 5, 5), "conv1.bias": (20,),
                         "conv2.weight": (50, 20, 5, 5), "conv2.bias": (50,),
                         "ip1.weight": (500, 800), "ip1.bias": (500,),
                         "ip2.weight": (10, 500), "ip2.bias": (10,)}
    assert list(params(g)) == ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                               "ip1.weight", "ip1.bias", "ip2.weight", "ip2.bias"]
    assert inits(g)["conv1.weight"] == "xavier" and inits(g)["ip2.bias"] == "constant(0)"
    assert shape_of(g, "conv1") == (64, 20, 24, 24)
    assert shape_of(g, "pool1") == (64, 20, 12, 12)
    assert shape_of(g, "conv2") == (64, 50, 8, 8)
    assert shape_of(g, "pool2") == (64, 50, 4, 4)
    assert shape_of(g, "ip1") == shape_of(g, "relu1") == (64, 500)
    pool = g.value("pool1").producer
    assert pool.op == "max_pool2d" and pool.attrs == {"kernel": [2, 2], "stride": [2, 2],
                                                      "pad": [0, 0], "dilation": [1, 1],
                                                      "ceil_mode": True}
    assert histogram(g) == Counter(conv2d=2, bias_add=4, max_pool2d=2, reshape=1, matmul=2,
                                   relu=1, softmax_xent=1, accuracy=1)
    assert len(lowered("lenet", "inference").nodes) == 12


def test_lenet_other_input_size(lowered):
    g = lowered("lenet", "inference", batch=2, input_shape=(1, 32, 32), num_classes=5)
    assert params(g)["ip1.weight"] == (500, 50 * 5 * 5)
    assert g.output("logits").type.shape == (2, 5)


def test_cifar_quick(lowered):
    g = lowered("cifar_quick", "train")
    assert params(g) == {"conv1.weight": (32, 3, 5, 5), "conv1.bias": (32,),
                         "conv2.weight": (32, 32, 5, 5), "conv2.bias": (32,),
                         "conv3.weight": (64, 32, 5, 5), "conv3.bias": (64,),
                         "ip1.weight": (64, 1024), "ip1.bias": (64,),
                         "ip2.weight": (10, 64), "ip2.bias": (10,)}
    assert inits(g) == {"conv1.weight": "gaussian(0.0001)", "conv1.bias": "constant(0)",
                        "conv2.weight": "gaussian(0.01)", "conv2.bias": "constant(0)",
                        "conv3.weight": "gaussian(0.01)", "conv3.bias": "constant(0)",
                        "ip1.weight": "gaussian(0.1)", "ip1.bias": "constant(0)",
                        "ip2.weight": "gaussian(0.1)", "ip2.bias": "constant(0)"}
    assert shape_of(g, "conv1") == (100, 32, 32, 32)
    assert shape_of(g, "pool1") == (100, 32, 16, 16)   # Caffe's ceil mode
    assert shape_of(g, "pool2") == (100, 32, 8, 8)
    assert shape_of(g, "pool3") == (100, 64, 4, 4)
    assert g.value("conv1.conv").producer.attrs["pad"] == [2, 2]
    # Caffe's order: pool1 before relu1; relu2 before pool2
    order = [n.outputs[0].name for n in g.nodes]
    assert order.index("pool1") < order.index("relu1")
    assert order.index("relu2") < order.index("pool2")
    assert g.value("pool2").producer.op == "avg_pool2d"
    assert g.value("pool3").producer.op == "avg_pool2d"
    assert histogram(g) == Counter(conv2d=3, bias_add=5, max_pool2d=1, avg_pool2d=2, relu=3,
                                   reshape=1, matmul=2, softmax_xent=1, accuracy=1, scale=1)
    # Images in [0, 1] become Caffe's 0-255 before conv1.
    assert g.value("pixels").producer.attrs["alpha"] == 255
    assert g.value("conv1.conv").producer.inputs[0].name == "pixels"


def test_nin(lowered):
    g = lowered("nin", "train")
    shapes = params(g)
    expected = {"conv1": (192, 3, 5, 5), "cccp1": (160, 192, 1, 1), "cccp2": (96, 160, 1, 1),
                "conv2": (192, 96, 5, 5), "cccp3": (192, 192, 1, 1), "cccp4": (192, 192, 1, 1),
                "conv3": (192, 192, 3, 3), "cccp5": (192, 192, 1, 1), "cccp6": (10, 192, 1, 1)}
    assert {k: v for k, v in shapes.items() if k.endswith(".weight")} == {
        f"{k}.weight": v for k, v in expected.items()}
    assert shape_of(g, "pool1") == (128, 96, 16, 16)
    assert shape_of(g, "pool2") == (128, 192, 8, 8)
    assert shape_of(g, "pool3") == (128, 10, 1, 1)
    assert g.value("pool3").producer.op == "global_avg_pool"
    assert g.value("logits").producer.op == "reshape"
    h = histogram(g)
    assert h["conv2d"] == 9 and h["relu"] == 9 and h["dropout_mask"] == 2 and h["mul"] == 2
    it = g.input("iteration")
    assert it.role == "state" and it.type == TensorType((), DType.i64)
    assert it.init == "constant(0)"
    assert [name for name, _ in g.outputs] == ["loss", "accuracy", "logits", "iteration"]
    seeds = [n.attrs["seed"] for n in g.nodes if n.op == "dropout_mask"]
    assert len(set(seeds)) == 2
    inf = lowered("nin", "inference")
    assert "iteration" not in [v.name for v in inf.inputs]
    assert histogram(inf)["mul"] == 0
    assert len(inf.nodes) == len(g.nodes) - 4 - 2 - 1  # masks+muls, loss+acc, counter


def test_inception(lowered):
    g = lowered("inception", "train")
    shapes = params(g)
    assert shapes["inc3a.1x1.weight"] == (16, 64, 1, 1)
    assert shapes["inc3a.3x3_reduce.weight"] == (24, 64, 1, 1)
    assert shapes["inc3a.3x3.weight"] == (32, 24, 3, 3)
    assert shapes["inc3a.5x5.weight"] == (8, 4, 5, 5)
    assert shapes["inc3a.pool_proj.weight"] == (8, 64, 1, 1)
    assert shapes["inc3b.1x1.weight"] == (32, 64, 1, 1)
    assert shapes["ip.weight"] == (10, 128)
    assert shape_of(g, "inc3a") == (64, 64, 8, 8)
    assert shape_of(g, "inc3b") == (64, 120, 8, 8)
    assert shape_of(g, "inc4a") == (64, 128, 4, 4)
    assert g.value("inc3a").producer.op == "concat"
    assert [v.name for v in g.value("inc3a").producer.inputs] == [
        "inc3a.relu_1x1", "inc3a.relu_3x3", "inc3a.relu_5x5", "inc3a.relu_pool_proj"]
    assert g.value("inc3a.pool").producer.attrs == {"kernel": [3, 3], "stride": [1, 1],
                                                     "pad": [1, 1], "dilation": [1, 1],
                                                     "ceil_mode": True}
    h = histogram(g)
    assert h["concat"] == 3 and h["lrn"] == 2 and h["global_avg_pool"] == 1
    assert h["dropout_mask"] == 1 and h["conv2d"] == 2 + 3 * 6
    assert g.value("drop.mask").producer.attrs["p"] == pytest.approx(0.4)


def test_inception_module_standalone():
    from purinec.bigraph import Blob

    with Net("one") as net:
        mod = InceptionModule("mix", 1, 2, 3, 4, 5, 6)
        net.outputs = [Blob("data", (2, 8, 5, 5)) >> mod]
    assert mod.num_output == 1 + 3 + 5 + 6
    g = lower(net)
    assert g.output("mix").type.shape == (2, 15, 5, 5)
    with pytest.raises(ModelError, match="branch widths must be positive"):
        InceptionModule("bad", 1, 2, 3, 4, 0, 6)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_builders_take_batch_shape_and_classes(name):
    shape = (3, 32, 32) if name in ("cifar_quick", "nin", "inception") else (1, 28, 28)
    net = ZOO[name](batch=3, input_shape=shape, num_classes=4)
    assert isinstance(net, Net) and net.name == name
    g = lower(net, "train")
    assert g.input("data").type.shape == (3, *shape)
    assert g.output("logits").type.shape == (3, 4)


def test_load_model_by_name():
    net = load_model("lenet", batch=16)
    g = lower(net)
    assert g.input("data").type.shape == (16, 1, 28, 28)
    assert lower(load_model("cifar_quick")).input("data").type.shape[0] == 100
    g = lower(load_model("mlp", batch=4, num_classes=3))
    assert g.output("logits").type.shape == (4, 3)
    with pytest.raises(ModelError, match="model mlp takes no argument 'width'"):
        load_model("mlp", width=3)
    with pytest.raises(ModelError, match="lenet: batch must be a positive int"):
        load_model("lenet", batch=0)
    with pytest.raises(ModelError, match="input_shape must be"):
        load_model("lenet", input_shape=(28, 28))
    with pytest.raises(ModelError, match="num_classes must be"):
        load_model("nin", num_classes=1)


def test_too_small_input_is_a_shape_error():
    net = ZOO["lenet"](batch=2, input_shape=(1, 8, 8))
    with pytest.raises(ModelError, match=r"layer conv2 \(lenet.py:\d+\): conv2d: kernel 5x5 "
                                         r"does not fit input"):
        lower(net)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_lowered_graphs_verify_and_round_trip(lowered, name):
    from purinec.ir import parse, print_graph, verify

    for mode in ("inference", "train"):
        g = lowered(name, mode)
        verify(g)
        text = print_graph(g)
        assert print_graph(parse(text)) == text


def test_net_queries():
    net = ZOO["lenet"](batch=2)
    assert [b.path for b in net.params()] == [
        "conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "ip1.weight", "ip1.bias",
        "ip2.weight", "ip2.bias"]
    assert [b.path for b in net.bottom] == ["data", "label"]
    assert [b.path for b in net.top] == ["logits", "loss", "accuracy"]
    assert net.find("conv1").kind == "layer" and net.blob("conv1").producer is not None
    structure = net.structure()
    assert [op.path for op in structure.ops][:2] == ["conv1.conv", "conv1.bias_add"]
