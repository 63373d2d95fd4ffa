"""Errors a user can cause.

Every error raised on purpose by purinec is a `PurinecError`. Its message says what
was wrong and where (node, IR line and column, file), so the command line can print
it as one paragraph and exit non-zero without a traceback.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping


class PurinecError(Exception):
    """Base class of every error purinec raises on purpose."""


class PurinecWarning(UserWarning):
    """Something purinec did that the caller may not have meant; the work still ran.
    The command line prints it as ``purinec: warning: ...``."""


class IRSyntaxError(PurinecError):
    """Malformed IR text; carries the 1-based line and column."""

    def __init__(self, message: str, line: int, column: int, source: str = "<ir>"):
        self.line = line
        self.column = column
        self.source = source
        super().__init__(f"{source}:{line}:{column}: {message}")


class VerifyError(PurinecError):
    """A graph breaks an IR invariant (types, SSA, order, attributes). What breaks it,
    where something does, so that a parser can add its line: ``node``, a node; else
    ``value``, a graph input; else ``output``, the name of a graph output."""

    def __init__(self, message: str, node: Any = None, *, value: Any = None,
                 output: str | None = None):
        self.node = node
        self.value = value
        self.output = output
        super().__init__(message)


class ShapeError(PurinecError):
    """Operand shapes or dtypes an op cannot accept."""


class UnknownOpError(PurinecError):
    """An op name that is not in the registry."""


class MemoryLimitError(PurinecError):
    """Tensors that would take more memory than the limit (the machine's memory, or
    PURINEC_MEMORY_LIMIT): refused before anything is allocated."""


class ModelError(PurinecError):
    """A model (bi-graph, zoo name, Python file) that cannot be built or lowered."""


class AutodiffError(PurinecError):
    """A graph that cannot be differentiated as asked."""


class ExecutionError(PurinecError):
    """A failure while running a compiled program."""


class DataError(PurinecError):
    """A data set that cannot be found or read."""


class TrainingError(PurinecError):
    """Training cannot go on: the loss stopped being a finite number."""


class ArtifactError(PurinecError):
    """A `.purine` artifact (or an output file) that cannot be written, or a file that is
    not a whole, untampered artifact this purinec can read."""


class ExportError(PurinecError):
    """A graph or program that cannot be written as an ONNX model (an op ONNX has no
    spelling for, a distributed program)."""


class UnknownNameError(PurinecError, KeyError):
    """A name a program has no tensor of (a KeyError too, as mappings raise)."""

    def __str__(self) -> str:  # KeyError's would show the message quoted
        return str(self.args[0])


def refuse_options(options: Mapping[str, Any], names: Iterable[str], why: str) -> None:
    """Fail if any option in ``names`` was given (is not None in ``options``), named as
    the command line names it: it cannot apply, and ignoring it would silently do
    something other than what was asked."""
    given = [n for n in names if options.get(n) is not None]
    if given:
        flags = ", ".join("--" + n.replace("_", "-") for n in given)
        raise PurinecError(f"{flags}: {why}")
