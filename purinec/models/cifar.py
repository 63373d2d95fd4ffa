"""CIFAR-10 networks: Caffe's cifar10_quick and Network in Network (Purine's example)."""

from __future__ import annotations

from purinec.bigraph import (Accuracy, AvgPool, Blob, Conv, Dropout, Flatten, GlobalAvgPool,
                             InnerProduct, MaxPool, Net, ReLU, Scale, SoftmaxWithLoss)
from purinec.models._common import check_args


def cifar_quick(batch: int = 100, input_shape=(3, 32, 32), num_classes: int = 10) -> Net:
    """Caffe's examples/cifar10/cifar10_quick_train_test.prototxt: conv1 32x5x5 pad 2,
    pool1 max 3/2, relu1, conv2 32x5x5 pad 2, relu2, pool2 avg 3/2, conv3 64x5x5 pad 2,
    relu3, pool3 avg 3/2, ip1 64, ip2 num_classes. Fillers as there: gaussian std
    0.0001 (conv1), 0.01 (conv2, conv3), 0.1 (ip1, ip2); biases constant 0.

    It takes images in [0, 1], as purinec's data sets give them, and scales them to
    Caffe's 0-255 ("pixels") first: with these fillers, inputs in [0, 1] make signals
    too small to learn from (trained on digits, the loss stays at ln 10), and folding the
    255 into conv1's filler does not train either, since conv1 then learns 255² times
    more slowly."""
    batch, input_shape, num_classes = check_args("cifar_quick", batch, input_shape,
                                                 num_classes)
    with Net("cifar_quick") as net:
        data = Blob("data", (batch, *input_shape), "f32")
        label = Blob("label", (batch,), "i32")
        logits = (data
                  >> Scale("pixels", 255)
                  >> Conv("conv1", 32, 5, pad=2, weight_init="gaussian(0.0001)")
                  >> MaxPool("pool1", 3, 2)
                  >> ReLU("relu1")
                  >> Conv("conv2", 32, 5, pad=2, weight_init="gaussian(0.01)")
                  >> ReLU("relu2")
                  >> AvgPool("pool2", 3, 2)
                  >> Conv("conv3", 64, 5, pad=2, weight_init="gaussian(0.01)")
                  >> ReLU("relu3")
                  >> AvgPool("pool3", 3, 2)
                  >> InnerProduct("ip1", 64, weight_init="gaussian(0.1)")
                  >> InnerProduct("ip2", num_classes, weight_init="gaussian(0.1)")
                  >> Blob("logits"))
        loss = [logits, label] >> SoftmaxWithLoss("loss")
        accuracy = [logits, label] >> Accuracy("accuracy")
        net.outputs = [logits, loss, accuracy]
    return net


def nin(batch: int = 128, input_shape=(3, 32, 32), num_classes: int = 10) -> Net:
    """Network in Network for CIFAR-10 (Lin, Chen, Yan 2013; Purine's example): three
    mlpconv blocks (a spatial conv and two 1x1 "cccp" convs, each followed by a ReLU),
    max pool 3/2 and dropout, avg pool 3/2 and dropout, then global average pooling of
    num_classes maps, flattened to the logits. Weights gaussian(0.05) as in the
    authors' Caffe model, which trained on whitened images: from images in [0, 1] these
    fillers make signals too small to learn from (on digits the loss stays at ln 10 for
    20 epochs, and so does PyTorch's transcription of this network)."""
    batch, input_shape, num_classes = check_args("nin", batch, input_shape, num_classes)
    init = "gaussian(0.05)"
    with Net("nin") as net:
        data = Blob("data", (batch, *input_shape), "f32")
        label = Blob("label", (batch,), "i32")
        x = (data
             >> Conv("conv1", 192, 5, pad=2, weight_init=init) >> ReLU("relu1")
             >> Conv("cccp1", 160, 1, weight_init=init) >> ReLU("relu_cccp1")
             >> Conv("cccp2", 96, 1, weight_init=init) >> ReLU("relu_cccp2")
             >> MaxPool("pool1", 3, 2)
             >> Dropout("drop1", 0.5))
        x = (x
             >> Conv("conv2", 192, 5, pad=2, weight_init=init) >> ReLU("relu2")
             >> Conv("cccp3", 192, 1, weight_init=init) >> ReLU("relu_cccp3")
             >> Conv("cccp4", 192, 1, weight_init=init) >> ReLU("relu_cccp4")
             >> AvgPool("pool2", 3, 2)
             >> Dropout("drop2", 0.5))
        logits = (x
                  >> Conv("conv3", 192, 3, pad=1, weight_init=init) >> ReLU("relu3")
                  >> Conv("cccp5", 192, 1, weight_init=init) >> ReLU("relu_cccp5")
                  >> Conv("cccp6", num_classes, 1, weight_init=init) >> ReLU("relu_cccp6")
                  >> GlobalAvgPool("pool3")
                  >> Flatten("flatten")
                  >> Blob("logits"))
        loss = [logits, label] >> SoftmaxWithLoss("loss")
        accuracy = [logits, label] >> Accuracy("accuracy")
        net.outputs = [logits, loss, accuracy]
    return net
