"""The zoo's builders by name."""

from purinec.models.cifar import cifar_quick, nin
from purinec.models.convnet import convnet
from purinec.models.inception import inception
from purinec.models.lenet import lenet
from purinec.models.mlp import mlp

ZOO = {
    "mlp": mlp,
    "lenet": lenet,
    "convnet": convnet,
    "cifar_quick": cifar_quick,
    "nin": nin,
    "inception": inception,
}
