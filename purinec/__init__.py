"""purinec: a Purine-style bi-graph compiler for deep networks.

    import purinec
    program = purinec.compile("mlp", train=purinec.SGD(lr=0.05, momentum=0.9))
    loss = program.step({"data": x, "label": y})
"""

from purinec.compiler import STAGES, Program, compile
from purinec.errors import IRSyntaxError, PurinecError
from purinec.passes.optimizer import SGD

__version__ = "0.1.0"

__all__ = ["compile", "Program", "SGD", "STAGES", "PurinecError", "IRSyntaxError",
           "__version__"]
