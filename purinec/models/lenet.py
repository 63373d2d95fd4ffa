"""Caffe's LeNet for MNIST (examples/mnist/lenet_train_test.prototxt)."""

from __future__ import annotations

from purinec.bigraph import (Accuracy, Blob, Conv, InnerProduct, MaxPool, Net, ReLU,
                             SoftmaxWithLoss)
from purinec.models._common import check_args


def lenet(batch: int = 64, input_shape=(1, 28, 28), num_classes: int = 10) -> Net:
    """conv1 20x5x5, pool1 max 2/2, conv2 50x5x5, pool2 max 2/2, ip1 500, relu1,
    ip2 num_classes; xavier weights, zero biases (Caffe's fillers)."""
    batch, input_shape, num_classes = check_args("lenet", batch, input_shape, num_classes)
    with Net("lenet") as net:
        data = Blob("data", (batch, *input_shape), "f32")
        label = Blob("label", (batch,), "i32")
        logits = (data
                  >> Conv("conv1", 20, 5)
                  >> MaxPool("pool1", 2, 2)
                  >> Conv("conv2", 50, 5)
                  >> MaxPool("pool2", 2, 2)
                  >> InnerProduct("ip1", 500)
                  >> ReLU("relu1")
                  >> InnerProduct("ip2", num_classes)
                  >> Blob("logits"))
        loss = [logits, label] >> SoftmaxWithLoss("loss")
        accuracy = [logits, label] >> Accuracy("accuracy")
        net.outputs = [logits, loss, accuracy]
    return net
