"""PyTorch and JAX builds of purinec's zoo networks `mlp`, `lenet`, `cifar_quick` and
`inception`.

Each network is written out once, layer by layer, in `NETS` (a transcription of
`purinec.models`, not derived from purinec's IR, so that the peers are an independent
check of purinec's numerics), and built from that description for each framework:

* parameters carry purinec's names and layouts: ``<layer>.weight`` and ``<layer>.bias``,
  convolution weights (out, in, kh, kw), inner-product weights (out, in); an inception
  module's are nested, ``<module>.<branch conv>.weight`` (``inc3a.3x3.weight``);
* an inner product flattens its input first, as purinec's does;
* pooling uses Caffe's ceil-mode output size (cifar_quick's 3/2 pools take 32 -> 16 ->
  8 -> 4, where floor mode would give 15, 7, 3): PyTorch with ``ceil_mode=True``, JAX with
  explicit padding, -inf for max and zeros for average, the average divided by the
  number of real input elements in the window, which is Caffe's divisor when the pool
  has no padding (no average pool here pads; the inception module's max pool 3/1 pads 1,
  and padding is never a window's maximum);
* an inception module (`inception_branches`) runs four branches of ordinary layers on
  its input and concatenates their outputs along channels, in the order 1x1, 3x3, 5x5,
  pool projection;
* LRN is Caffe's across channels: ``x * (k + alpha/size * sum of x^2 over the channels
  within (size-1)/2)^-beta``, the window clipped at the first and last channel
  (PyTorch's ``F.local_response_norm`` computes exactly that for an odd size; JAX sums
  the squares with ``lax.reduce_window`` over zero-padded channels);
* dropout multiplies by a mask given with the batch (``prepare(x, y, masks)``), not
  drawn: the peers cannot draw purinec's counter-hash masks, so the numerics check feeds
  them the masks purinec drew, and timing multiplies by a fixed mask
  (`fixed_dropout_masks`);
* a global average pool is the mean over height and width;
* the loss is the batch mean of softmax cross-entropy.

A trainer runs one SGD iteration (momentum, weight decay on every parameter, as purinec's
solver): `TorchTrainer` with ``torch.optim.SGD`` (eager, or the loss and the optimizer step
through ``torch.compile``), `JaxTrainer` with one ``jax.jit``-compiled function. PyTorch's
SGD keeps ``buf = m*buf + g + wd*w`` and steps ``w -= lr*buf``; purinec keeps the update
``h = m*h + lr*(g + wd*w)`` and steps ``w -= h``: with a constant learning rate the two
give the same weights (``h = lr*buf``). JAX uses purinec's form.

Every trainer has the same methods: ``prepare(x, y, masks=None)`` turns a NumPy batch
(and the dropout masks by layer name, for a network with dropout; left out, the fixed
ones) into its own inputs once (outside any timing), ``step(batch) -> float`` runs one
iteration and returns the loss, ``params() -> dict`` gives the weights as NumPy arrays
by purinec's names, and ``layer_shapes(batch_size) -> dict`` the shape of every layer's
output by purinec's value names (`output_shapes`). torch and jax are imported only when
a trainer needs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

PEERS = ("torch", "torch.compile", "jax")


@dataclass(frozen=True)
class Layer:
    """One layer. ``name`` is purinec's layer name (its parameters are ``name.weight``
    and ``name.bias``; an inception module's are its branches' layers', see
    `inception_branches`), ``out`` the IR value holding its output (the blob's name)."""

    # conv, ip, relu, maxpool, avgpool, global_avgpool, scale, lrn, dropout, inception
    kind: str
    name: str
    size: int = 0      # conv: output channels; ip: output features; lrn: channel window
    kernel: int = 0
    stride: int = 1
    pad: int = 0
    out: str = ""
    factor: float = 1.0  # scale
    alpha: float = 0.0   # lrn (Caffe's: alpha is divided by size)
    beta: float = 0.0    # lrn
    k: float = 1.0       # lrn
    p: float = 0.0       # dropout: the probability of dropping
    widths: tuple[int, ...] = ()  # inception: 1x1, 3x3_reduce, 3x3, 5x5_reduce, 5x5, pool_proj

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


def _pool(kind, name, kernel, stride, pad=0):
    return Layer(kind, name, kernel=kernel, stride=stride, pad=pad)


def _scale(name, factor):
    return Layer("scale", name, factor=factor)


def _lrn(name, size, alpha, beta, k=1.0):
    return Layer("lrn", name, size, alpha=alpha, beta=beta, k=k)


def _inception(name, n1x1, n3x3_reduce, n3x3, n5x5_reduce, n5x5, pool_proj):
    return Layer("inception", name,
                 widths=(n1x1, n3x3_reduce, n3x3, n5x5_reduce, n5x5, pool_proj))


def _dropout(name, p):
    return Layer("dropout", name, p=p)


def inception_branches(layer: Layer) -> tuple[tuple[Layer, ...], ...]:
    """An inception module's four branches, each a list of ordinary layers named inside
    the module (purinec/models/inception.py's `InceptionModule`): ``1x1``;
    ``3x3_reduce`` then ``3x3`` (pad 1); ``5x5_reduce`` then ``5x5`` (pad 2); ``pool``
    (max 3/1 pad 1) then ``pool_proj``; every conv followed by a ReLU. The module's
    output is their concatenation along channels, in this order."""
    n1x1, n3x3_reduce, n3x3, n5x5_reduce, n5x5, pool_proj = layer.widths

    def n(local):
        return f"{layer.name}.{local}"

    return ((_conv(n("1x1"), n1x1, 1), _relu(n("relu_1x1"))),
            (_conv(n("3x3_reduce"), n3x3_reduce, 1), _relu(n("relu_3x3_reduce")),
             _conv(n("3x3"), n3x3, 3, pad=1), _relu(n("relu_3x3"))),
            (_conv(n("5x5_reduce"), n5x5_reduce, 1), _relu(n("relu_5x5_reduce")),
             _conv(n("5x5"), n5x5, 5, pad=2), _relu(n("relu_5x5"))),
            (_pool("maxpool", n("pool"), 3, 1, pad=1),
             _conv(n("pool_proj"), pool_proj, 1), _relu(n("relu_pool_proj"))))


# purinec/models/{mlp,lenet,cifar,inception}.py, transcribed (num_classes 10, default
# inputs).
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
    "inception": NetSpec((3, 32, 32), (
        _conv("conv1", 32, 3, pad=1), _relu("relu1"), _pool("maxpool", "pool1", 3, 2),
        _lrn("norm1", 5, 1e-4, 0.75),
        _conv("conv2", 64, 3, pad=1), _relu("relu2"), _lrn("norm2", 5, 1e-4, 0.75),
        _pool("maxpool", "pool2", 3, 2),
        _inception("inc3a", 16, 24, 32, 4, 8, 8),
        _inception("inc3b", 32, 32, 48, 8, 24, 16),
        _pool("maxpool", "pool3", 3, 2),
        _inception("inc4a", 48, 24, 52, 4, 12, 16),
        Layer("global_avgpool", "pool4"), _dropout("drop", 0.4),
        _ip("ip", 10, out="logits"))),
}


def spec(model: str) -> NetSpec:
    try:
        return NETS[model]
    except KeyError:
        raise ValueError(f"no peer build of model {model!r}; peers exist for "
                         f"{', '.join(NETS)}") from None


def caffe_pool_size(size: int, kernel: int, stride: int, pad: int = 0) -> int:
    """Caffe's ceil-mode pooled size: the last window may hang over the far edge but
    must start inside the input or its leading pad."""
    out = -(-(size + 2 * pad - kernel) // stride) + 1
    return out - 1 if (out - 1) * stride >= size + pad else out


def _walk(layers, shape, params: dict, outputs: dict) -> tuple[int, ...]:
    """Follow ``layers`` from an input of ``shape`` (channels, height, width; less the
    batch): record each parameter's shape in ``params`` and each layer's output shape,
    less the batch, by its value name (branches' layers included) in ``outputs``;
    returns the last output's shape ((features,) after an inner product)."""
    for layer in layers:
        if layer.kind == "conv":
            c, h, w = shape
            params[f"{layer.name}.weight"] = (layer.size, c, layer.kernel, layer.kernel)
            shape = (layer.size, h + 2 * layer.pad - layer.kernel + 1,
                     w + 2 * layer.pad - layer.kernel + 1)
        elif layer.kind == "ip":
            params[f"{layer.name}.weight"] = (layer.size, int(np.prod(shape)))
            shape = (layer.size,)
        elif layer.kind in ("maxpool", "avgpool"):
            if layer.kind == "avgpool" and layer.pad:
                raise ValueError(f"{layer.name}: padded average pools are not built "
                                 f"(Caffe's divisor would count the padding)")
            c, h, w = shape
            shape = (c, caffe_pool_size(h, layer.kernel, layer.stride, layer.pad),
                     caffe_pool_size(w, layer.kernel, layer.stride, layer.pad))
        elif layer.kind == "global_avgpool":
            shape = (shape[0], 1, 1)
        elif layer.kind == "inception":
            ends = [_walk(branch, shape, params, outputs)
                    for branch in inception_branches(layer)]
            shape = (sum(end[0] for end in ends), *ends[0][1:])
        if layer.has_params:
            params[f"{layer.name}.bias"] = (layer.size,)
        outputs[layer.output] = shape
    return shape


def _shapes(model: str) -> tuple[dict, dict]:
    net = spec(model)
    params: dict[str, tuple[int, ...]] = {}
    outputs: dict[str, tuple[int, ...]] = {}
    _walk(net.layers, net.input_shape, params, outputs)
    return params, outputs


def param_shapes(model: str) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape by purinec's name, from the layer list alone."""
    return _shapes(model)[0]


def output_shapes(model: str, batch: int) -> dict[str, tuple[int, ...]]:
    """Every layer's output shape by its value name (an inception module's branch
    layers included), from the layer list alone: the values whose shapes the peers
    record (`TorchTrainer.layer_shapes`)."""
    return {name: (batch, *shape) for name, shape in _shapes(model)[1].items()}


def dropout_layers(model: str) -> list[Layer]:
    """The network's dropout layers, in order (none in mlp, lenet, cifar_quick)."""
    return [layer for layer in spec(model).layers if layer.kind == "dropout"]


def fixed_dropout_masks(model: str, batch: int) -> dict[str, np.ndarray]:
    """A fixed dropout mask per dropout layer, of its input's shape, as purinec's are
    made: 0 with probability p, else 1/(1-p). What the peers multiply by when they are
    timed (prepare without masks): the multiply is all that dropout costs them then,
    a [batch, 128] product in inception, negligible next to the convolutions; drawing
    fresh masks would add a few thousand random numbers a step."""
    shapes = output_shapes(model, batch)
    rng = np.random.default_rng(0)
    return {layer.name: np.where(rng.random(shapes[layer.output]) < layer.p, 0.0,
                                 1.0 / (1.0 - layer.p)).astype(np.float32)
            for layer in dropout_layers(model)}


def _with_branches(layers):
    """Every layer, an inception module's branch layers after the module itself."""
    for layer in layers:
        yield layer
        if layer.kind == "inception":
            for branch in inception_branches(layer):
                yield from _with_branches(branch)


def _masks(model: str, batch: int, masks: Mapping[str, np.ndarray] | None):
    """The dropout masks a batch carries: ``masks`` (checked against the network's
    dropout layers), or the fixed ones."""
    if masks is None:
        return fixed_dropout_masks(model, batch)
    want = {layer.name for layer in dropout_layers(model)}
    if set(masks) != want:
        raise ValueError(f"{model}: dropout masks for {sorted(masks)}, the network's "
                         f"dropout layers are {sorted(want)}")
    return {k: np.asarray(v, dtype=np.float32) for k, v in masks.items()}


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
            for layer in _with_branches(net.layers):
                weight = shapes.get(f"{layer.name}.weight")
                if layer.kind == "conv":
                    self._add(layer.name, torch.nn.Conv2d(
                        weight[1], layer.size, layer.kernel, layer.stride, layer.pad))
                elif layer.kind == "ip":
                    self._add(layer.name, torch.nn.Linear(weight[1], layer.size))

        def _add(self, name: str, module) -> None:
            """Add ``module`` at a dotted name (``inc3a.3x3``), through plain modules
            for the scopes, so that its parameters get purinec's nested names."""
            *scopes, last = name.split(".")
            parent = self
            for scope in scopes:
                if scope not in parent._modules:
                    parent.add_module(scope, torch.nn.Module())
                parent = parent._modules[scope]
            parent.add_module(last, module)

        def forward(self, x, masks: Mapping | None = None, record: dict | None = None):
            return self._run(net.layers, x, masks or {}, record)

        def _run(self, layers, x, masks, record):
            for layer in layers:
                if layer.kind == "conv":
                    x = self.get_submodule(layer.name)(x)
                elif layer.kind == "ip":
                    x = self.get_submodule(layer.name)(x.flatten(1))
                elif layer.kind == "relu":
                    x = F.relu(x)
                elif layer.kind == "scale":
                    x = x * layer.factor
                elif layer.kind == "maxpool":
                    x = F.max_pool2d(x, layer.kernel, layer.stride, layer.pad,
                                     ceil_mode=True)
                elif layer.kind == "avgpool" and explicit_ceil_padding:
                    x = avg_pool_padded(x, layer)
                elif layer.kind == "avgpool":
                    x = F.avg_pool2d(x, layer.kernel, layer.stride, ceil_mode=True)
                elif layer.kind == "global_avgpool":
                    x = x.mean((2, 3), keepdim=True)
                elif layer.kind == "lrn":
                    # (k + alpha/size * window sum of x^2)^beta, the window zero-padded
                    # by size//2 on each side: Caffe's for an odd size.
                    x = F.local_response_norm(x, layer.size, layer.alpha, layer.beta,
                                              layer.k)
                elif layer.kind == "dropout":
                    x = x * masks[layer.name]
                elif layer.kind == "inception":
                    x = torch.cat([self._run(branch, x, masks, record)
                                   for branch in inception_branches(layer)], 1)
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

        def loss(x, y, masks):
            return F.cross_entropy(self.model(x, masks), y)

        self._loss = torch.compile(loss) if compiled else loss
        self._update = torch.compile(self.optimizer.step) if compiled else self.optimizer.step

    def prepare(self, x: np.ndarray, y: np.ndarray,
                masks: Mapping[str, np.ndarray] | None = None):
        torch = self._torch

        def tensor(a):
            return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

        return (tensor(x), tensor(y.astype(np.int64)),
                {k: tensor(v) for k, v in _masks(self._model_name, len(x), masks).items()})

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
        x, _, masks = self.prepare(
            np.zeros((batch_size, *spec(self._model_name).input_shape), np.float32),
            np.zeros(batch_size, np.int64))
        with self._torch.no_grad():
            self.model(x, masks, record)
        return record


# ---------------------------------------------------------------------------------------
# JAX.


def jax_forward(model: str):
    """``forward(params, x, masks=None, record=None) -> logits`` in JAX, params by
    purinec's names, ``masks`` the dropout masks by layer name."""
    import jax.numpy as jnp
    from jax import lax

    net = spec(model)

    def pool(x, layer: Layer, init, op):
        h, w = x.shape[2:]
        k, s, p = layer.kernel, layer.stride, layer.pad
        oh = caffe_pool_size(h, k, s, p)
        ow = caffe_pool_size(w, k, s, p)
        # The pool's own padding before, and after it what the last (ceil-mode) window
        # needs to fit.
        padding = ((0, 0), (0, 0), (p, (oh - 1) * s + k - h - p),
                   (p, (ow - 1) * s + k - w - p))
        return lax.reduce_window(x, init, op, (1, 1, k, k), (1, 1, s, s), padding)

    def lrn(x, layer: Layer):
        # Caffe's across channels: the squares summed over the channels within
        # (size-1)/2 of each, those beyond the first and last counting as zeros.
        half = (layer.size - 1) // 2
        sums = lax.reduce_window(x * x, 0.0, lax.add, (1, layer.size, 1, 1), (1, 1, 1, 1),
                                 ((0, 0), (half, half), (0, 0), (0, 0)))
        return x * (layer.k + layer.alpha / layer.size * sums) ** -layer.beta

    def forward(params, x, masks=None, record: dict | None = None):
        return run(net.layers, params, x, masks or {}, record)

    def run(layers, params, x, masks, record):
        for layer in layers:
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
            elif layer.kind == "global_avgpool":
                x = jnp.mean(x, axis=(2, 3), keepdims=True)
            elif layer.kind == "lrn":
                x = lrn(x, layer)
            elif layer.kind == "dropout":
                x = x * masks[layer.name]
            elif layer.kind == "inception":
                x = jnp.concatenate([run(branch, params, x, masks, record)
                                     for branch in inception_branches(layer)], axis=1)
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

        def loss_fn(weights, x, y, masks):
            logp = jax.nn.log_softmax(self._forward(weights, x, masks))
            return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

        def train_step(weights, history, x, y, masks):
            loss, grads = jax.value_and_grad(loss_fn)(weights, x, y, masks)
            update = {k: momentum * history[k] + lr * (grads[k] + weight_decay * weights[k])
                      for k in weights}
            return {k: weights[k] - update[k] for k in weights}, update, loss

        # Donating the weights and history lets XLA update them in place.
        self._step = jax.jit(train_step, donate_argnums=(0, 1))

    def prepare(self, x: np.ndarray, y: np.ndarray,
                masks: Mapping[str, np.ndarray] | None = None):
        jnp = self._jax.numpy
        return (jnp.asarray(x), jnp.asarray(y.astype(np.int32)),
                {k: jnp.asarray(v) for k, v in _masks(self._model_name, len(x), masks).items()})

    def step(self, batch) -> float:
        self.weights, self.history, loss = self._step(self.weights, self.history, *batch)
        return float(loss)

    def params(self) -> dict[str, np.ndarray]:
        return {k: np.array(v) for k, v in self.weights.items()}

    def layer_shapes(self, batch_size: int) -> dict[str, tuple[int, ...]]:
        record: dict[str, tuple[int, ...]] = {}
        x = self._jax.ShapeDtypeStruct((batch_size, *spec(self._model_name).input_shape),
                                       np.float32)
        masks = fixed_dropout_masks(self._model_name, batch_size)
        self._jax.eval_shape(lambda w, x, m: self._forward(w, x, m, record), self.weights, x,
                             masks)
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
