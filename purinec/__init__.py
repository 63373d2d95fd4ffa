"""purinec: a Purine-style bi-graph compiler for deep networks.

    import purinec
    program = purinec.compile("mlp", train=purinec.SGD(lr=0.05, momentum=0.9))
    loss = program.step({"data": x, "label": y})
    program.save("mlp.purine")           # later, in any process: purinec.load("mlp.purine")
"""

from purinec.compiler import compile, load
from purinec.errors import ArtifactError, IRSyntaxError, PurinecError, PurinecWarning
from purinec.passes.optimizer import SGD
from purinec.passes.pipeline import STAGES
from purinec.program import Program
from purinec.version import __version__

__all__ = ["compile", "load", "Program", "SGD", "STAGES", "PurinecError", "PurinecWarning",
           "IRSyntaxError", "ArtifactError", "__version__"]
