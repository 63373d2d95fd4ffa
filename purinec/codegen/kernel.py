"""A compiled kernel: the generated source, where it lives, what it came from, and the
Numba function that runs it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from purinec.errors import PurinecError
from purinec.ir.graph import Node


class CodegenError(PurinecError):
    """A node or group that a code generator cannot render."""


@dataclass(frozen=True)
class ArgumentCheck:
    """What a kernel's arguments must be, in order: C-contiguous arrays of these shapes
    and dtypes. Most kernels bake shapes into their body, so an array of another shape
    must never reach them (they would read or write out of bounds). The runtime's plan
    binds only arrays of the declared types (`purinec.runtime.plan`), so it calls
    kernels unchecked; a direct call (`Kernel.fn`) is checked here, in Python: the same
    test inside the kernel cost Numba a tenth to a third of each kernel's compile."""

    function: str
    arrays: tuple[tuple[tuple[int, ...], np.dtype], ...]
    says: str  # the declared types, for the error

    def __call__(self, arrays: tuple) -> None:
        if len(arrays) != len(self.arrays) or not all(
                isinstance(a, np.ndarray) and a.shape == shape and a.dtype == dtype
                and a.flags.c_contiguous for a, (shape, dtype) in zip(arrays, self.arrays)):
            raise ValueError(f"{self.function}: arguments must be {self.says}")


@dataclass(eq=False)
class Kernel:
    """One generated kernel.

    ``fn(*inputs, *outputs)`` runs it: inputs are read, outputs (preallocated,
    C-contiguous, of the declared types) are filled completely; arrays of other types
    are refused (`ArgumentCheck`). ``run`` is the same without the check, for the
    runtime, whose plan binds only arrays of the declared types. ``source`` is the
    module text generated for ``nodes``, the IR nodes it computes (one, or a fused
    node's members); the file at ``path`` in the kernel cache holds the same code, with
    the comments of whichever node wrote it first (nodes with the same code share the
    file, and in one `compile_kernels` call, ``dispatcher``). ``dispatcher`` is the Numba
    function ``run`` calls (directly, or once per block of a blocked kernel), compiled
    for ``signature``, the code `llvm` and `asm` show.

    A kernel of several ``parts`` (a horizontal group: one kernel per member) runs them
    in turn; its ``source`` is theirs, joined, and it has no file, dispatcher or
    signature of its own.
    """

    name: str
    source: str
    path: Path | None
    nodes: tuple[Node, ...]
    run: Any
    check: ArgumentCheck
    dispatcher: Any
    signature: tuple | None
    parts: tuple["Kernel", ...] = ()

    def fn(self, *arrays):
        self.check(arrays)
        return self.run(*arrays)

    def __call__(self, *arrays):
        return self.fn(*arrays)

    def llvm(self) -> str:
        """The optimised LLVM IR Numba produced for this kernel."""
        if self.parts:
            return "\n".join(part.llvm() for part in self.parts)
        return self._inspectable().inspect_llvm(self.signature)

    def asm(self) -> str:
        """The machine code Numba produced for this kernel, as assembly text."""
        if self.parts:
            return "\n".join(part.asm() for part in self.parts)
        return self._inspectable().inspect_asm(self.signature)

    def _inspectable(self):
        """A dispatcher whose compiled code can be inspected. Numba keeps no LLVM IR for
        code it loaded from its disk cache, so such kernels are compiled once more, in
        memory only, with the same options."""
        if not self.dispatcher.stats.cache_hits.get(self.signature):
            return self.dispatcher
        from numba import njit

        # (less nopython: njit sets it itself, and warns when it is given)
        options = {k: v for k, v in self.dispatcher.targetoptions.items() if k != "nopython"}
        fresh = njit(**options)(self.dispatcher.py_func)
        fresh.compile(self.signature)
        return fresh

    def __repr__(self) -> str:
        return f"<Kernel {self.name} for {', '.join('%' + n.name for n in self.nodes)}>"
