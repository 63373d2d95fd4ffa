"""A small convolutional network for small images (scikit-learn's 8x8 digits)."""

from __future__ import annotations

from purinec.bigraph import (Accuracy, Blob, Conv, InnerProduct, MaxPool, Net, ReLU,
                             SoftmaxWithLoss)
from purinec.models._common import check_args


def convnet(batch: int = 32, input_shape=(1, 8, 8), num_classes: int = 10) -> Net:
    """conv1 16x3x3 pad 1, relu1, pool1 max 2/2, conv2 32x3x3 pad 1, relu2, pool2 max 2/2,
    ip1 64, relu3, ip2 num_classes: LeNet's shape, sized for 8x8 inputs."""
    batch, input_shape, num_classes = check_args("convnet", batch, input_shape, num_classes)
    with Net("convnet") as net:
        data = Blob("data", (batch, *input_shape), "f32")
        label = Blob("label", (batch,), "i32")
        logits = (data
                  >> Conv("conv1", 16, 3, pad=1)
                  >> ReLU("relu1")
                  >> MaxPool("pool1", 2, 2)
                  >> Conv("conv2", 32, 3, pad=1)
                  >> ReLU("relu2")
                  >> MaxPool("pool2", 2, 2)
                  >> InnerProduct("ip1", 64)
                  >> ReLU("relu3")
                  >> InnerProduct("ip2", num_classes)
                  >> Blob("logits"))
        loss = [logits, label] >> SoftmaxWithLoss("loss")
        accuracy = [logits, label] >> Accuracy("accuracy")
        net.outputs = [logits, loss, accuracy]
    return net
