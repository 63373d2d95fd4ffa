"""The model zoo as bi-graph builders, and `load_model` for zoo names and user files.

Every builder takes ``batch``, ``input_shape`` (C, H, W) and ``num_classes`` keyword
arguments with defaults and returns a `purinec.bigraph.Net` with inputs ``data`` (f32)
and ``label`` (i32), outputs ``logits``, ``loss`` (SoftmaxWithLoss) and ``accuracy``,
and parameters ``<layer>.weight`` and ``<layer>.bias``.
"""

from purinec.models.cifar import cifar_quick, nin
from purinec.models.convnet import convnet
from purinec.models.inception import InceptionModule, inception
from purinec.models.lenet import lenet
from purinec.models.loader import load_model
from purinec.models.mlp import mlp
from purinec.models.zoo import ZOO

__all__ = ["ZOO", "load_model", "mlp", "lenet", "convnet", "cifar_quick", "nin", "inception",
           "InceptionModule"]
