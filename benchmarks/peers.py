"""PyTorch and JAX builds of purinec's zoo networks `mlp`, `lenet` and `cifar_quick`.

Each network is written out once, layer by layer, in `NETS` (a transcription of
`purinec.models`, not derived from purinec's IR, so that the peers are an independent
check of purinec's numerics), and built from that description for each framework:

* parameters carry purinec's names and layouts: ``<layer>.weight`` and ``<layer>.bias``,
  convolution weights (out, in, kh, kw), inner-product weights (out, in);
* an inner product flattens its input first, as purinec's does;
* pooling uses Caffe's ceil-mode output size (cifar_quick's 3/2 pools take 32 -> 16 ->
  8 -> 4, where floor mode would give 15, 7, 3): PyTorch with ``ceil_mode=True``, JAX with
  explicit padding at the bottom and right edges, -inf for max and zeros for average, the
  average divided by the number of real input elements in the window, which is Caffe's
  divisor when the pool has no padding (none of these networks pads a pool);
* the loss is the batch mean of softmax cross-entropy.

A trainer runs one SGD iteration (momentum, weight decay on every parameter, as purinec's
solver): `TorchTrainer` with ``torch.optim.SGD`` (eager, or the loss and the optimizer step
through ``torch.compile``), `JaxTrainer` with one ``jax.jit``-compiled function. PyTorch's
SGD keeps ``buf = m*buf + g + wd*w`` and steps ``w -= lr*buf``; purinec keeps the update
``h = m*h + lr*(g + wd*w)`` and steps ``w -= h``: with a constant learning rate the two
give the same weights (``h = lr*buf``). JAX uses purinec's form.

Every trainer has the same methods: ``prepare(x, y)`` turns a NumPy batch into its own
inputs once (outside any timing), ``step(batch) -> float`` runs one iteration and returns
the loss, ``params() -> dict`` gives the weights as NumPy arrays by purinec's names, and
``layer_shapes(batch_size) -> dict`` the shape of every layer's output by purinec's
value names. torch and jax are imported only when a trainer needs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

PEERS = ("torch", "torch.compile", "jax")


@dataclass(frozen=True)
class Layer:
    """One layer. ``name`` is purinec's layer name (its parameters are ``name.weight``
    and ``name.bias``), ``out`` the IR value holding its output (the blob's name)."""

    kind: str          # conv, ip, relu, maxpool, avgpool, scale
    name: str
    size: int = 0      # conv: output channels; ip: output features
    kernel: int = 0
    stride: int = 1
    pad: int = 0
    out: str = ""
    factor: float = 1.0  # scale

    @property
    def output(self) -> str:
        return self.out or self.name

    @property
    def has_params(self) -> bool:
        return self.kind in ("conv", "ip")


@dataclass(frozen=True)
class NetSpec:
    input_shape: tuple[int, int, int]
    layers: tuple[Layer, ...]


def _conv(name, size, kernel, pad=0):
    return Layer("conv", name, size, kernel, 1, pad)


def _ip(name, size, out=""):
    return Layer("ip", name, size, out=out)


def _relu(name):
    return Layer("relu", name)


def _pool(kind, name, kernel, stride):
    return Layer(kind, name, kernel=kernel, stride=stride)


def _scale(name, factor):
    return Layer("scale", name, factor=factor)


# purinec/models/{mlp,lenet,cifar}.py, transcribed (num_classes 10, default inputs).
NETS: dict[str, NetSpec] = {
    "mlp": NetSpec((1, 28, 28), (
        _ip("ip1", 512), _relu("relu1"),
        _ip("ip2", 512), _relu("relu2"),
        _ip("ip3", 10, out="logits"))),
    "lenet": NetSpec((1, 28, 28), (
        _conv("conv1", 20, 5), _pool("maxpool", "pool1", 2, 2),
        _conv("conv2", 50, 5), _pool("maxpool", "pool2", 2, 2),
        _ip("ip1", 500), _relu("relu1"),
        _ip("ip2", 10, out="logits"))),
    "cifar_quick": NetSpec((3, 32, 32), (
        _scale("pixels", 255),
        _conv("conv1", 32, 5, pad=2), _pool("maxpool", "pool1", 3, 2), _relu("relu1"),
        _conv("conv2", 32, 5, pad=2), _relu("relu2"), _pool("avgpool", "pool2", 3, 2),
        _conv("conv3", 64, 5, pad=2), _relu("relu3"), _pool("avgpool", "pool3", 3, 2),
        _ip("ip1", 64),
        _ip("ip2", 10, out="logits"))),
}


def spec(model: str) -> NetSpec:
    try:
        return NETS[model]
    except KeyError:
        raise ValueError(f"no peer build of model {model!r}; peers exist for "
                         f"{', '.join(NETS)}") from None


def caffe_pool_size(size: int, kernel: int, stride: int) -> int:
    """Caffe's ceil-mode pooled size for an unpadded pool (the last window may hang
    over the edge but always starts inside the input)."""
    return -(-(size - kernel) // stride) + 1


def param_shapes(model: str) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape by purinec's name, from the layer list alone."""
    net = spec(model)
    c, h, w = net.input_shape
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in net.layers:
        if layer.kind == "conv":
            shapes[f"{layer.name}.weight"] = (layer.size, c, layer.kernel, layer.kernel)
            c = layer.size
            h = h + 2 * layer.pad - layer.kernel + 1
            w = w + 2 * layer.pad - layer.kernel + 1
        elif layer.kind == "ip":
            shapes[f"{layer.name}.weight"] = (layer.size, c * h * w)
            c, h, w = layer.size, 1, 1
        elif layer.kind in ("maxpool", "avgpool"):
            h = caffe_pool_size(h, layer.kernel, layer.stride)
            w = caffe_pool_size(w, layer.kernel, layer.stride)
        if layer.has_params:
            shapes[f"{layer.name}.bias"] = (layer.size,)
    return shapes


def _check_params(model: str, params: Mapping[str, np.ndarray]) -> None:
    want = param_shapes(model)
    got = {k: tuple(np.shape(v)) for k, v in params.items()}
    if got != want:
        raise ValueError(f"{model}: parameters {got} do not match the peer network's {want}")


# ---------------------------------------------------------------------------------------
# PyTorch.


def torch_module(model: str, explicit_ceil_padding: bool = False):
    """A ``torch.nn.Module`` of ``model`` whose parameters are named as purinec's.

    Pools use ``ceil_mode=True``; with ``explicit_ceil_padding`` an average pool pads
    the far edges with zeros itself and divides each window's sum by its real
    elements, which computes the same thing. torch.compile needs that: Inductor's
    avg_pool2d backward divides a ceil-mode window that overhangs the input by the
    whole kernel size (pytorch/pytorch#198119, open; seen here with torch 2.13.0, reported
    for 2.14 and nightly), a silently wrong gradient that the benchmark's numerics check
    catches on cifar_quick.
    """
    import torch
    import torch.nn.functional as F

    net = spec(model)

    def avg_pool_padded(x, layer: Layer):
        h, w = x.shape[2:]
        k, s = layer.kernel, layer.stride
        pad_h = (caffe_pool_size(h, k, s) - 1) * s + k - h
        pad_w = (caffe_pool_size(w, k, s) - 1) * s + k - w

        def window_sums(t):
            return F.avg_pool2d(F.pad(t, (0, pad_w, 0, pad_h)), k, s) * (k * k)

        return window_sums(x) / window_sums(torch.ones((1, 1, h, w), dtype=x.dtype))

    class PeerNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            shapes = param_shapes(model)
            for layer in net.layers:
                weight = shapes.get(f"{layer.name}.weight")
                if layer.kind == "conv":
                    self.add_module(layer.name, torch.nn.Conv2d(
                        weight[1], layer.size, layer.kernel, layer.stride, layer.pad))
                elif layer.kind == "ip":
                    self.add_module(layer.name, torch.nn.Linear(weight[1], layer.size))

        def forward(self, x, record: dict | None = None):
            for layer in net.layers:
                if layer.kind == "conv":
                    x = getattr(self, layer.name)(x)
                elif layer.kind == "ip":
                    x = getattr(self, layer.name)(x.flatten(1))
                elif layer.kind == "relu":
                    x = F.relu(x)
                elif layer.kind == "scale":
                    x = x * layer.factor
                elif layer.kind == "maxpool":
                    x = F.max_pool2d(x, layer.kernel, layer.stride, ceil_mode=True)
                elif layer.kind == "avgpool" and explicit_ceil_padding:
                    x = avg_pool_padded(x, layer)
                elif layer.kind == "avgpool":
                    x = F.avg_pool2d(x, layer.kernel, layer.stride, ceil_mode=True)
                if record is not None:
                    record[layer.output] = tuple(x.shape)
            return x

    return PeerNet()


class TorchTrainer:
    """PyTorch eager, or with ``compiled=True`` the loss (forward and, through
    AOTAutograd, backward) and the optimizer step compiled by ``torch.compile``, the
    average pools then padded explicitly (see `torch_module`); on ``device`` ("cpu",
    or "cuda" for the GPU)."""

    def __init__(self, model: str, params: Mapping[str, np.ndarray], lr: float,
                 momentum: float, weight_decay: float, compiled: bool = False,
                 device: str = "cpu"):
        import torch
        import torch.nn.functional as F

        _check_params(model, params)
        self._torch = torch
        self._model_name = model
        self.device = device
        self.model = torch_module(model, explicit_ceil_padding=compiled).to(device)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(torch.from_numpy(np.asarray(params[name], dtype=np.float32)))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=momentum,
                                         weight_decay=weight_decay)

        def loss(x, y):
            return F.cross_entropy(self.model(x), y)

        self._loss = torch.compile(loss) if compiled else loss
        self._update = torch.compile(self.optimizer.step) if compiled else self.optimizer.step

    def prepare(self, x: np.ndarray, y: np.ndarray):
        torch = self._torch
        return (torch.from_numpy(np.ascontiguousarray(x)).to(self.device),
                torch.from_numpy(y.astype(np.int64)).to(self.device))

    def step(self, batch) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._loss(*batch)
        loss.backward()
        self._update()
        return loss.item()

    def params(self) -> dict[str, np.ndarray]:
        return {name: p.detach().cpu().numpy().copy()
                for name, p in self.model.named_parameters()}

    def layer_shapes(self, batch_size: int) -> dict[str, tuple[int, ...]]:
        record: dict[str, tuple[int, ...]] = {}
        x = self._torch.zeros((batch_size, *spec(self._model_name).input_shape),
                              device=self.device)
        with self._torch.no_grad():
            self.model(x, record)
        return record


# ---------------------------------------------------------------------------------------
# JAX.


def jax_forward(model: str):
    """``forward(params, x, record=None) -> logits`` in JAX, params by purinec's names."""
    import jax.numpy as jnp
    from jax import lax

    net = spec(model)

    def pool(x, layer: Layer, init, op):
        h, w = x.shape[2:]
        oh = caffe_pool_size(h, layer.kernel, layer.stride)
        ow = caffe_pool_size(w, layer.kernel, layer.stride)
        # Pad the far edges so that the last (ceil-mode) window fits.
        pad_h = (oh - 1) * layer.stride + layer.kernel - h
        pad_w = (ow - 1) * layer.stride + layer.kernel - w
        window = (1, 1, layer.kernel, layer.kernel)
        strides = (1, 1, layer.stride, layer.stride)
        padding = ((0, 0), (0, 0), (0, pad_h), (0, pad_w))
        return lax.reduce_window(x, init, op, window, strides, padding)

    def forward(params, x, record: dict | None = None):
        for layer in net.layers:
            if layer.kind == "conv":
                p = layer.pad
                x = lax.conv_general_dilated(
                    x, params[f"{layer.name}.weight"], (layer.stride, layer.stride),
                    ((p, p), (p, p)), dimension_numbers=("NCHW", "OIHW", "NCHW"))
                x = x + params[f"{layer.name}.bias"][None, :, None, None]
            elif layer.kind == "ip":
                x = (x.reshape(x.shape[0], -1) @ params[f"{layer.name}.weight"].T
                     + params[f"{layer.name}.bias"])
            elif layer.kind == "relu":
                x = jnp.maximum(x, 0)
            elif layer.kind == "scale":
                x = x * layer.factor
            elif layer.kind == "maxpool":
                x = pool(x, layer, -jnp.inf, lax.max)
            elif layer.kind == "avgpool":
                # Divide each window's sum by how many real elements it covers.
                count = pool(jnp.ones((1, 1, *x.shape[2:]), x.dtype), layer, 0.0, lax.add)
                x = pool(x, layer, 0.0, lax.add) / count
            if record is not None:
                record[layer.output] = tuple(x.shape)
        return x

    return forward


class JaxTrainer:
    """One ``jax.jit``-compiled function: loss, gradients and purinec's SGD update."""

    def __init__(self, model: str, params: Mapping[str, np.ndarray], lr: float,
                 momentum: float, weight_decay: float):
        import jax
        import jax.numpy as jnp

        _check_params(model, params)
        self._jax = jax
        self._model_name = model
        self._forward = jax_forward(model)
        self.weights = {k: jnp.asarray(v, dtype=jnp.float32) for k, v in params.items()}
        self.history = {k: jnp.zeros_like(v) for k, v in self.weights.items()}

        def loss_fn(weights, x, y):
            logp = jax.nn.log_softmax(self._forward(weights, x))
            return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

        def train_step(weights, history, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(weights, x, y)
            update = {k: momentum * history[k] + lr * (grads[k] + weight_decay * weights[k])
                      for k in weights}
            return {k: weights[k] - update[k] for k in weights}, update, loss

        # Donating the weights and history lets XLA update them in place.
        self._step = jax.jit(train_step, donate_argnums=(0, 1))

    def prepare(self, x: np.ndarray, y: np.ndarray):
        jnp = self._jax.numpy
        return jnp.asarray(x), jnp.asarray(y.astype(np.int32))

    def step(self, batch) -> float:
        self.weights, self.history, loss = self._step(self.weights, self.history, *batch)
        return float(loss)

    def params(self) -> dict[str, np.ndarray]:
        return {k: np.array(v) for k, v in self.weights.items()}

    def layer_shapes(self, batch_size: int) -> dict[str, tuple[int, ...]]:
        record: dict[str, tuple[int, ...]] = {}
        x = self._jax.ShapeDtypeStruct((batch_size, *spec(self._model_name).input_shape),
                                       np.float32)
        self._jax.eval_shape(lambda w, x: self._forward(w, x, record), self.weights, x)
        return record


def make_trainer(peer: str, model: str, params: Mapping[str, np.ndarray], lr: float,
                 momentum: float, weight_decay: float, device: str = "cpu"):
    """A trainer for ``peer`` (one of `PEERS`) starting from ``params``, on ``device``
    (PyTorch's: "cpu" or "cuda")."""
    if peer in ("torch", "torch.compile"):
        return TorchTrainer(model, params, lr, momentum, weight_decay,
                            compiled=peer == "torch.compile", device=device)
    if peer == "jax":
        return JaxTrainer(model, params, lr, momentum, weight_decay)
    raise ValueError(f"unknown peer {peer!r}; peers are {', '.join(PEERS)}")
