"""PyTorch's own evaluation and training step of an ONNX graph: the reference that
purinec's imported models are compared with, independent of purinec (PyTorch's ops,
autograd and optimizer compute it; only the graph's wiring is read from the file).

`TorchGraph` evaluates the graph node by node with torch.nn.functional, in eval mode
(BatchNormalization with its running statistics) or in training mode, where
BatchNormalization normalizes with the batch's statistics and updates the running ones
in place as torch's BatchNorm does: with momentum ``1 - onnx momentum`` and the unbiased
batch variance. `sgd_step` runs full training iterations with ``torch.optim.SGD``.

Parameters are the float initializers other than BatchNormalization's running
statistics. The ops are those of the torchvision exports in models/ (see
torchvision_models.py): Conv, BatchNormalization, Relu, Clip, MaxPool,
GlobalAveragePool, Add, Concat, Flatten, Gemm and Constant, with the attributes they
use there; any other op, or attribute value, is refused by name rather than guessed.
Eval-mode exports leave Dropout out, so none of these graphs has any.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper

STATS = (3, 4)  # BatchNormalization's inputs that are running statistics, not parameters


class TorchGraph:
    """An ONNX graph with one data input and one output, as a function of torch
    tensors. ``params`` (trainable, by initializer name), ``stats`` (the running
    statistics) and ``constants`` (integer initializers) hold its initializers in
    ``dtype`` (integers as they are)."""

    def __init__(self, model: onnx.ModelProto, dtype: torch.dtype = torch.float32):
        graph = model.graph
        self.dtype = dtype
        self.nodes = list(graph.node)
        names = {t.name for t in graph.initializer}
        (self.input,) = [i.name for i in graph.input if i.name not in names]
        (self.output,) = [o.name for o in graph.output]
        stat_names = {n.input[k] for n in self.nodes if n.op_type == "BatchNormalization"
                      for k in STATS}
        self.params, self.stats, self.constants = {}, {}, {}
        for t in graph.initializer:
            value = self.tensor(numpy_helper.to_array(t))
            if not value.is_floating_point():
                self.constants[t.name] = value
            elif t.name in stat_names:
                self.stats[t.name] = value
            else:
                self.params[t.name] = value.requires_grad_()

    def tensor(self, array: np.ndarray) -> torch.Tensor:
        """``array`` as a torch tensor, in ``dtype`` if it is a float array."""
        value = torch.from_numpy(np.array(array))
        return value.to(self.dtype) if value.is_floating_point() else value

    def __call__(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        env = {**self.constants, **self.params, **self.stats, self.input: x.to(self.dtype)}
        for node in self.nodes:
            if node.op_type not in OPS:
                raise NotImplementedError(f"torch_step has no {node.op_type} ({node.name})")
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            args = [env[name] if name else None for name in node.input]
            env[node.output[0]] = OPS[node.op_type](self, attrs, args, training)
        return env[self.output]

    def weights(self) -> dict[str, np.ndarray]:
        """Every parameter and running statistic, by initializer name."""
        tensors = {**self.params, **self.stats}
        return {name: v.detach().numpy().copy() for name, v in tensors.items()}


def sgd_step(model: onnx.ModelProto, x: np.ndarray, labels: np.ndarray, lr: float,
             momentum: float = 0.0, weight_decay: float = 0.0, steps: int = 1,
             dtype: torch.dtype = torch.float32) -> tuple[list[float], dict[str, np.ndarray]]:
    """``steps`` training iterations of ``model`` from its initializers on the batch
    ``x`` with int ``labels``: forward in training mode, the batch mean of softmax
    cross-entropy, backward, and ``torch.optim.SGD`` (weight decay on every parameter).
    Returns each iteration's loss and then the weights and running statistics, by
    initializer name. One step does not show momentum (PyTorch's first step sets the
    momentum buffer to the gradient); two do.

    ``dtype=torch.float64`` gives the reference to judge a float32 step by: through
    training-mode BatchNormalization at batch 2, float32 gradients come out of float64
    by up to 14% of a tensor's largest entry in googlenet (median 1%), a median 1% in
    mobilenet_v2 and up to 0.5% in resnet18; two float32 implementations differ as
    much. And 17 of mobilenet_v2's BatchNormalization biases have a true gradient of 0
    (a constant shift that the next BatchNormalization removes): they change by weight
    decay and rounding only."""
    net = TorchGraph(model, dtype)
    solver = torch.optim.SGD(net.params.values(), lr=lr, momentum=momentum,
                             weight_decay=weight_decay)
    inputs, targets = net.tensor(x), torch.from_numpy(np.asarray(labels, np.int64))
    losses = []
    for _ in range(steps):
        solver.zero_grad()
        loss = F.cross_entropy(net(inputs, training=True), targets)
        loss.backward()
        solver.step()
        losses.append(loss.item())
    return losses, net.weights()


def _pads(attrs: dict) -> list[int]:
    """A 2-d window's padding as torch's (top, left): ONNX's [top, left, bottom, right]
    when it is symmetric, which torch's conv and pool ops need."""
    if attrs.get("auto_pad", b"NOTSET") != b"NOTSET":
        raise NotImplementedError(f"torch_step has no auto_pad {attrs['auto_pad']!r}")
    pads = list(attrs.get("pads", [0, 0, 0, 0]))
    if len(pads) != 4 or pads[:2] != pads[2:]:
        raise NotImplementedError(f"torch_step has only symmetric 2-d pads, not {pads}")
    return pads[:2]


def _conv(g, a, args, training):
    x, w, b = (args + [None])[:3]
    return F.conv2d(x, w, b, stride=a.get("strides", 1), padding=_pads(a),
                    dilation=a.get("dilations", 1), groups=a.get("group", 1))


def _batch_norm(g, a, args, training):
    x, scale, bias, mean, var = args
    return F.batch_norm(x, mean, var, scale, bias, training=training,
                        momentum=1.0 - a.get("momentum", 0.9), eps=a.get("epsilon", 1e-5))


def _clip(g, a, args, training):
    low, high = (args + [None, None])[1:3]
    return torch.clamp(args[0], min=low, max=high)


def _max_pool(g, a, args, training):
    return F.max_pool2d(args[0], a["kernel_shape"], stride=a.get("strides", 1),
                        padding=_pads(a), dilation=a.get("dilations", 1),
                        ceil_mode=bool(a.get("ceil_mode", 0)))


def _flatten(g, a, args, training):
    x, axis = args[0], a.get("axis", 1)
    return x.reshape(int(np.prod(x.shape[:axis])), -1)


def _gemm(g, a, args, training):
    x, w, c = (args + [None])[:3]
    x = x.T if a.get("transA", 0) else x
    w = w.T if a.get("transB", 0) else w
    y = a.get("alpha", 1.0) * (x @ w)
    return y if c is None else y + a.get("beta", 1.0) * c


OPS: dict[str, Callable] = {
    "Conv": _conv,
    "BatchNormalization": _batch_norm,
    "Relu": lambda g, a, args, training: F.relu(args[0]),
    "Clip": _clip,
    "MaxPool": _max_pool,
    "GlobalAveragePool": lambda g, a, args, training: args[0].mean((2, 3), keepdim=True),
    "Add": lambda g, a, args, training: args[0] + args[1],
    "Concat": lambda g, a, args, training: torch.cat(args, a["axis"]),
    "Flatten": _flatten,
    "Gemm": _gemm,
    "Constant": lambda g, a, args, training: g.tensor(numpy_helper.to_array(a["value"])),
}
