"""Solvers: the update of one variable from its gradient (Purine's SGD with momentum
and weight decay)."""

from __future__ import annotations

from purinec.ir.ops.helpers import (check_float, check_same, constant, elementwise_split,
                                    per_output_element)
from purinec.ir.ops.registry import (FINITE, Attr, FusionKind, OpDef, SplitSignature, Trait,
                                     register)


def _sgd_infer(types, attrs):
    w, h, g = types
    check_float("sgd", w, "weight")
    check_same("sgd", types)
    return [w, h]


def _sgd_ref(w, h, g, lr, momentum, weight_decay):
    t = w.dtype.type
    update = t(momentum) * h + t(lr) * (g + t(weight_decay) * w)
    return (w - update, update)


def _sgd_expr(node, args):
    w, h, g = args
    lr, momentum, decay = (constant(node, node.attrs[k])
                           for k in ("lr", "momentum", "weight_decay"))
    update = momentum * h + lr * (g + decay * w)
    return [w - update, update]


register(OpDef("sgd", ("weight", "history", "grad"), _sgd_infer, _sgd_ref,
               FusionKind.elementwise,
               attrs={"lr": Attr("float", bound=FINITE),
                      "momentum": Attr("float", 0.0, bound=FINITE),
                      "weight_decay": Attr("float", 0.0, bound=FINITE)},
               split=lambda t, a: [SplitSignature(s.inputs, s.outputs * 2)
                                   for s in elementwise_split(t, a)],
               flops=per_output_element(6),  # m*h + lr*(g + wd*w), then w - update
               expr=_sgd_expr, traits=frozenset({Trait.solver_update}),
               doc="Purine's solver: update = momentum*history + lr*(grad + wd*weight); "
                   "returns (weight - update, update)"))
