"""Purine's bi-graph front end: blobs and ops joined with ``>>``, composites with
hierarchical names and locations, Caffe-style layers, and `Net`.

    from purinec.bigraph import Net, Blob, Conv, MaxPool, InnerProduct, ReLU, \\
        SoftmaxWithLoss, Accuracy

    with Net("lenet") as net:
        data = Blob("data", (64, 1, 28, 28))
        label = Blob("label", (64,), "i32")
        logits = (data >> Conv("conv1", 20, 5) >> MaxPool("pool1", 2, 2)
                  >> InnerProduct("ip1", 10) >> Blob("logits"))
        loss = [logits, label] >> SoftmaxWithLoss("loss")
        net.outputs = [logits, loss]
    graph = lower(net, "train")     # a purinec.ir.Graph
"""

from purinec.bigraph.core import (Blob, Blobs, Element, Graph, Layer, LayerShapeError, Lazy,
                                  Location, Net, NetStructure, Op, analyze, connect,
                                  current_scope, resolve)
from purinec.bigraph.layers import (LRN, Accuracy, AvgPool, Bias, Concat, Conv, Dropout,
                                    DropoutOp, Eltwise, Flatten, FlattenOp, GlobalAvgPool,
                                    InnerProduct, MaxPool, ReLU, Scale, Sigmoid, Softmax,
                                    SoftmaxWithLoss, Split, TanH)
from purinec.bigraph.lower import lower

__all__ = ["Blob", "Blobs", "Element", "Graph", "Layer", "LayerShapeError", "Lazy", "Location",
           "Net", "NetStructure", "Op", "analyze", "connect", "current_scope", "resolve",
           "LRN", "Accuracy", "AvgPool", "Bias", "Concat", "Conv", "Dropout", "DropoutOp",
           "Eltwise", "Flatten", "FlattenOp", "GlobalAvgPool", "InnerProduct", "MaxPool",
           "ReLU", "Scale", "Sigmoid", "Softmax", "SoftmaxWithLoss", "Split", "TanH", "lower"]
