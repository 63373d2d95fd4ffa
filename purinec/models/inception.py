"""A small GoogLeNet-style network for 32x32 inputs, built from `InceptionModule`s."""

from __future__ import annotations

from purinec.bigraph import (LRN, Accuracy, Blob, Concat, Conv, Dropout, GlobalAvgPool,
                             InnerProduct, Layer, MaxPool, Net, ReLU, SoftmaxWithLoss)
from purinec.errors import ModelError
from purinec.models._common import check_args


class InceptionModule(Layer):
    """GoogLeNet's inception module: four branches concatenated along channels,

    * ``1x1``: conv 1x1;
    * ``3x3_reduce`` then ``3x3``: conv 1x1, conv 3x3 pad 1;
    * ``5x5_reduce`` then ``5x5``: conv 1x1, conv 5x5 pad 2;
    * ``pool`` then ``pool_proj``: max pool 3/1 pad 1, conv 1x1;

    each conv followed by a ReLU (``relu_1x1``, ...), joined by ``output`` (Concat).
    Parameters are nested: ``inc3a.3x3.weight``. Output channels:
    n1x1 + n3x3 + n5x5 + pool_proj.
    """

    def __init__(self, name: str, n1x1: int, n3x3_reduce: int, n3x3: int, n5x5_reduce: int,
                 n5x5: int, pool_proj: int, *, location=None):
        super().__init__(name, location=location)
        sizes = (n1x1, n3x3_reduce, n3x3, n5x5_reduce, n5x5, pool_proj)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
            raise ModelError(f"{self.describe()}: branch widths must be positive ints, "
                             f"got {sizes}")
        self.sizes = sizes

    @property
    def num_output(self) -> int:
        n1x1, _, n3x3, _, n5x5, pool_proj = self.sizes
        return n1x1 + n3x3 + n5x5 + pool_proj

    def build(self, x):
        n1x1, n3x3_reduce, n3x3, n5x5_reduce, n5x5, pool_proj = self.sizes
        b1 = x >> Conv("1x1", n1x1, 1) >> ReLU("relu_1x1")
        b2 = (x >> Conv("3x3_reduce", n3x3_reduce, 1) >> ReLU("relu_3x3_reduce")
              >> Conv("3x3", n3x3, 3, pad=1) >> ReLU("relu_3x3"))
        b3 = (x >> Conv("5x5_reduce", n5x5_reduce, 1) >> ReLU("relu_5x5_reduce")
              >> Conv("5x5", n5x5, 5, pad=2) >> ReLU("relu_5x5"))
        b4 = (x >> MaxPool("pool", 3, 1, pad=1)
              >> Conv("pool_proj", pool_proj, 1) >> ReLU("relu_pool_proj"))
        return [b1, b2, b3, b4] >> Concat("output", axis=1)


def inception(batch: int = 64, input_shape=(3, 32, 32), num_classes: int = 10) -> Net:
    """Stem (conv1 3x3/32, pool1 max 3/2, norm1 LRN, conv2 3x3/64, norm2 LRN, pool2 max
    3/2, as GoogLeNet's stem), inc3a, inc3b, pool3 max 3/2, inc4a, global average pool,
    dropout 0.4 and the classifier ip num_classes. Widths are GoogLeNet's halved (or
    less) to suit 32x32 images."""
    batch, input_shape, num_classes = check_args("inception", batch, input_shape,
                                                 num_classes)
    with Net("inception") as net:
        data = Blob("data", (batch, *input_shape), "f32")
        label = Blob("label", (batch,), "i32")
        x = (data
             >> Conv("conv1", 32, 3, pad=1) >> ReLU("relu1")
             >> MaxPool("pool1", 3, 2)
             >> LRN("norm1", 5, 1e-4, 0.75)
             >> Conv("conv2", 64, 3, pad=1) >> ReLU("relu2")
             >> LRN("norm2", 5, 1e-4, 0.75)
             >> MaxPool("pool2", 3, 2))
        x = (x
             >> InceptionModule("inc3a", 16, 24, 32, 4, 8, 8)
             >> InceptionModule("inc3b", 32, 32, 48, 8, 24, 16)
             >> MaxPool("pool3", 3, 2)
             >> InceptionModule("inc4a", 48, 24, 52, 4, 12, 16))
        logits = (x
                  >> GlobalAvgPool("pool4")
                  >> Dropout("drop", 0.4)
                  >> InnerProduct("ip", num_classes)
                  >> Blob("logits"))
        loss = [logits, label] >> SoftmaxWithLoss("loss")
        accuracy = [logits, label] >> Accuracy("accuracy")
        net.outputs = [logits, loss, accuracy]
    return net
