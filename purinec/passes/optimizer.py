"""The solver as IR: SGD with momentum and weight decay, as Purine had it.

For each parameter ``p`` with a gradient output ``grad.p`` (from autodiff) the pass adds
a state input ``p.history`` (zeros at first) and one ``sgd`` node computing

    update = momentum * history + lr * (grad + weight_decay * p)
    p      = p - update

The new weight is returned under the name ``p`` and the update under ``p.history``, so
the program carries both into the next iteration. The gradient outputs are dropped:
the memory planner can then free each gradient as soon as its update has run.
"""

from __future__ import annotations

import math
import numbers

from dataclasses import dataclass

from purinec.errors import PurinecError
from purinec.ir.graph import Graph

GRAD_PREFIX = "grad."


@dataclass(frozen=True)
class SGD:
    """Stochastic gradient descent with momentum and L2 weight decay. (``purinec
    train`` has defaults of its own, tuned for the zoo: lr 0.05, weight decay 5e-4.)"""

    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0

    def __post_init__(self):
        for field in ("lr", "momentum", "weight_decay"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise PurinecError(f"SGD: {field} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise PurinecError(f"SGD: {field} must be finite, got {value}")
        if not self.lr > 0:
            raise PurinecError(f"SGD: learning rate must be positive, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise PurinecError(f"SGD: momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise PurinecError(f"SGD: weight decay must be >= 0, got {self.weight_decay}")

    def apply(self, graph: Graph) -> Graph:
        new = graph.clone()
        grads = {name[len(GRAD_PREFIX):]: v for name, v in new.outputs
                 if name.startswith(GRAD_PREFIX)}
        if not grads:
            raise PurinecError(f"graph {new.name} has no gradient outputs to apply SGD to; "
                               "run autodiff first")
        outputs = [(name, v) for name, v in new.outputs if not name.startswith(GRAD_PREFIX)]
        histories = []
        for name, grad in grads.items():
            weight = new.input(name)
            history = new.add_input(f"{name}.history", weight.type, weight.device,
                                    role="state", init="constant(0)")
            node = new.add_node("sgd", [weight, history, grad],
                                {"lr": self.lr, "momentum": self.momentum,
                                 "weight_decay": self.weight_decay},
                                names=[new.fresh_name(f"{name}.next"),
                                       new.fresh_name(f"{name}.history.next")],
                                device=weight.device)
            outputs.append((name, node.outputs[0]))
            histories.append((history.name, node.outputs[1]))
        new.set_outputs(outputs + histories)
        return new
