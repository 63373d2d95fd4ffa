"""A multi-layer perceptron: 784-512-512-10 on MNIST-sized inputs."""

from __future__ import annotations

from purinec.bigraph import (Accuracy, Blob, InnerProduct, Net, ReLU, SoftmaxWithLoss)
from purinec.models._common import check_args


def mlp(batch: int = 64, input_shape=(1, 28, 28), num_classes: int = 10) -> Net:
    """ip1 512, relu1, ip2 512, relu2, ip3 num_classes; the input is flattened by ip1."""
    batch, input_shape, num_classes = check_args("mlp", batch, input_shape, num_classes)
    with Net("mlp") as net:
        data = Blob("data", (batch, *input_shape), "f32")
        label = Blob("label", (batch,), "i32")
        logits = (data
                  >> InnerProduct("ip1", 512) >> ReLU("relu1")
                  >> InnerProduct("ip2", 512) >> ReLU("relu2")
                  >> InnerProduct("ip3", num_classes) >> Blob("logits"))
        loss = [logits, label] >> SoftmaxWithLoss("loss")
        accuracy = [logits, label] >> Accuracy("accuracy")
        net.outputs = [logits, loss, accuracy]
    return net
