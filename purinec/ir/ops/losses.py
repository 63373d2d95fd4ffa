"""Losses and metrics over a batch of logits: softmax cross-entropy, its gradient, and
accuracy. The mean over rows makes them row means: on a piece of the batch, the
partitioner weights each piece's result by its share of the rows (`OpDef.row_mean`)."""

from __future__ import annotations

import numpy as np

from purinec.ir.ops.helpers import (check_float, check_integer, check_rank, emit1, fail,
                                    only, per_input_element)
from purinec.ir.ops.normalization import softmax_ref
from purinec.ir.ops.registry import FusionKind, OpDef, SplitSignature, register
from purinec.ir.types import TensorType

X = FusionKind.opaque

def _xent_check(op, logits: TensorType, label: TensorType):
    check_float(op, logits, "logits")
    check_rank(op, logits, 2, "logits")
    check_integer(op, label, "label")
    if label.shape != logits.shape[:1]:
        raise fail(op, f"label {label} must hold one class per row of logits {logits}")


def _xent_infer(types, attrs):
    _xent_check("softmax_xent", *types)
    return [TensorType((), types[0].dtype)]


def _check_labels(label: np.ndarray, classes: int) -> None:
    """Labels index the logits' columns: refuse one outside [0, classes) rather than
    wrap it around as NumPy indexing would."""
    bad = np.flatnonzero((label < 0) | (label >= classes))
    if bad.size:
        raise ValueError(f"label {label[bad[0]]} at row {bad[0]} is outside [0, {classes})")


def _xent_ref(logits, label):
    _check_labels(label, logits.shape[1])
    shifted = logits - logits.max(axis=1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return (np.asarray(-logp[np.arange(len(label)), label].mean(), dtype=logits.dtype),)


def _xent_grad_infer(types, attrs):
    logits, label, gy = types
    _xent_check("softmax_xent_grad", logits, label)
    if gy != TensorType((), logits.dtype):
        raise fail("softmax_xent_grad", f"gradient must be a {logits.dtype} scalar, got {gy}")
    return [logits]


def _xent_grad_ref(logits, label, gy):
    _check_labels(label, logits.shape[1])
    (p,) = softmax_ref(logits, 1)
    p[np.arange(len(label)), label] -= 1
    return ((p * (gy / len(label))).astype(logits.dtype),)


def _row_mean_split(types, attrs):
    return [SplitSignature(("S0", "S0"), ("P",)), SplitSignature(("B", "B"), ("B",))]


def _softmax_xent_gradient(g, node, gys, needs=None):
    """glogits = (softmax(logits) - onehot(label)) * gy / batch; labels get none."""
    logits, label = node.inputs
    return only(needs, lambda: emit1(g, node, "softmax_xent_grad", [logits, label, gys[0]]),
                lambda: None)


register(OpDef("softmax_xent", ("logits", "label"), _xent_infer, _xent_ref, X,
               split=_row_mean_split, gradient=_softmax_xent_gradient,
               flops=per_input_element(4),  # max, subtract, exp, sum
               row_mean=("output", 0),
               doc="mean over the batch of -log softmax(logits)[label]"))
register(OpDef("softmax_xent_grad", ("logits", "label", "gy"), _xent_grad_infer,
               _xent_grad_ref, X,
               split=lambda t, a: [SplitSignature(("S0", "S0", "B"), ("S0",)),
                                   SplitSignature(("B", "B", "B"), ("B",))],
               flops=per_input_element(6),  # the softmax again, then scale
               row_mean=("input", 2)))  # its 1/batch: weight the upstream gradient


def _accuracy_infer(types, attrs):
    _xent_check("accuracy", *types)
    return [TensorType((), types[0].dtype)]


register(OpDef("accuracy", ("logits", "label"), _accuracy_infer,
               lambda logits, label: (np.asarray((logits.argmax(axis=1) == label).mean(),
                                                 dtype=logits.dtype),), X,
               split=_row_mean_split, flops=per_input_element(1),  # argmax comparisons
               row_mean=("output", 0),
               doc="fraction of rows whose largest logit is the label (first on ties)"))
