"""One generated CPU kernel module, and the registry of CPU renderers.

A renderer writes the body of one Numba function into a `KernelModule`; the module adds
the header (which IR it came from), the imports, any helper functions the body asked
for, the ``@njit`` decorator and argument checks. Shapes and attributes are baked into
the text as constants, so each kernel is specialised to its node.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Sequence

from purinec.codegen.kernel import CodegenError
from purinec.codegen.source import SourceBuilder, node_comment
from purinec.ir.graph import Node, Value
from purinec.ir.types import DType


@dataclass(frozen=True)
class CpuOptions:
    """Code generation choices that are not part of the IR.

    ``parallel_min``: the least work (elements touched, or multiply-adds for products
    and convolutions) for which a kernel is split into blocks that run on several
    threads; below it, handing blocks to threads would cost more than it saves.
    """

    parallel_min: int = 1 << 18


DEFAULT_OPTIONS = CpuOptions()

# Numba-side helper functions a body may ask for by name; emitted once per module.
HELPERS: dict[str, str] = {}


def numpy_name(dtype: DType) -> str:
    """``np.float32`` and friends, as the generated source spells a dtype."""
    return "np.bool_" if dtype is DType.bool else f"np.{dtype.numpy.name}"


def literal(value, dtype: DType) -> str:
    """Source text for ``dtype.numpy.type(value)``: a constant of exactly that type, so
    float32 arithmetic stays float32 (a bare Python float would widen it)."""
    if dtype is DType.bool:
        return repr(bool(value))
    if dtype in (DType.i32, DType.i64):
        return f"{numpy_name(dtype)}({int(value)})"
    value = float(value)
    if math.isnan(value):
        text = "np.nan"
    elif math.isinf(value):
        text = "np.inf" if value > 0 else "-np.inf"
    else:
        text = repr(value)
    return f"{numpy_name(dtype)}({text})"


def identifier(name: str) -> str:
    """A Python identifier made from an IR value or op name."""
    ident = re.sub(r"\W", "_", name)
    return ident if ident and not ident[0].isdigit() else "_" + ident


class KernelModule:
    """The text of one generated module with one entry function.

    ``params`` are the entry function's parameters: the kernel's input values, then its
    output values, each with the name the body uses for it.
    """

    def __init__(self, name: str, nodes: Sequence[Node], inputs: Sequence[Value],
                 outputs: Sequence[Value], options: CpuOptions = DEFAULT_OPTIONS):
        self.name = identifier(name)
        self.nodes = tuple(nodes)
        self.options = options
        self.body = SourceBuilder()
        self.blocks: int | None = None  # the split loop's item count, once split
        self.serial = False  # set by renderers whose loops must not be split
        self._imports: list[str] = []
        self._helpers: list[str] = []
        self._taken: set[str] = {self.name, "np", "njit", "sgemm", "dgemm", "lo", "hi"}
        self.inputs = [self.fresh(v.name) for v in inputs]
        self.outputs = [self.fresh(v.name) for v in outputs]
        self.params = list(zip(self.inputs + self.outputs, list(inputs) + list(outputs)))

    # -- used by renderers ----------------------------------------------------------

    def fresh(self, hint: str) -> str:
        """A local name not used yet in this module, made from ``hint``."""
        base = identifier(hint)
        name, i = base, 1
        while name in self._taken:
            name, i = f"{base}_{i}", i + 1
        self._taken.add(name)
        return name

    def import_line(self, line: str) -> None:
        if line not in self._imports:
            self._imports.append(line)

    def helper(self, name: str) -> str:
        """Ask for the module-level helper ``name`` (see `HELPERS`); returns its name."""
        if name not in HELPERS:
            raise CodegenError(f"no CPU helper named {name}")
        if name not in self._helpers:
            self._helpers.append(name)
        return name

    def split(self, count: int, work: int) -> tuple[str, str]:
        """Bounds of the loop over ``count`` independent items (images, planes, rows)
        that carries the kernel's ``work``. If the work is big enough, the kernel
        becomes *blocked*: its function takes ``lo, hi`` first and computes items
        ``lo:hi`` only, and `purinec.codegen.cpu_runtime.run_blocked` runs blocks on
        several threads; otherwise the bounds are the constants ``0, count``.

        A kernel splits one loop count at most (several loops over the same count may
        share it), and only if no loop before was left whole: every block runs the
        whole function, so a whole loop would run once per block.
        """
        if self.blocks == count or (self.blocks is None and not self.serial and count >= 2
                                    and work >= self.options.parallel_min):
            self.blocks = count
            return "lo", "hi"
        if self.blocks is None:
            self.serial = True
        return "0", str(count)

    # -- the module text ------------------------------------------------------------

    def builder(self) -> SourceBuilder:
        out = SourceBuilder()
        out.line(f"# purinec CPU kernel `{self.name}`, generated by purinec.codegen.cpu "
                 f"from this IR:")
        for node in self.nodes:
            out.line("#   " + node_comment(node)[2:])
            for member in node.body or ():
                out.line("#     " + node_comment(member)[2:])
        out.line("# Cached by the hash of its text: edits make the cache rewrite it.")
        out.line("import numpy as np")
        out.line("from numba import njit")
        out.lines(self._imports)
        for name in self._helpers:
            out.line()
            out.line()
            out.line(HELPERS[name])
        out.line()
        out.line()
        # error_model="numpy": x / 0 gives inf or nan as in NumPy, with no check per division
        out.line('@njit(nogil=True, cache=True, error_model="numpy")')
        params = (["lo", "hi"] if self.blocks is not None else []) + [p for p, _ in self.params]
        with out.block(f"def {self.name}({', '.join(params)}):"):
            with out.origin(*self.nodes):
                self._write_checks(out)
            out.extend(self.body)
        return out

    def text(self) -> str:
        return self.builder().text()

    def _write_checks(self, out: SourceBuilder) -> None:
        """Argument checks: shapes and dtypes are baked into the body, so an array of
        another shape must never reach it (it would read or write out of bounds)."""
        for name, value in self.params:
            ty = value.type
            conditions = [f"{name}.itemsize != {ty.dtype.numpy.itemsize}"]
            if ty.rank:
                conditions.insert(0, f"{name}.shape != {tuple(ty.shape)!r}")
            with out.block(f"if {' or '.join(conditions)}:"):
                out.line(f'raise ValueError("{self.name}: argument {name} must be {ty}")')


Renderer = Callable[[Node, KernelModule], None]

# op name -> the function writing that op's kernel body. Adding an op to the CPU target
# is adding one entry (see `renders`).
RENDERERS: dict[str, Renderer] = {}


def renders(*ops: str) -> Callable[[Renderer], Renderer]:
    """Register the decorated function as the CPU renderer of ``ops``."""
    def register(fn: Renderer) -> Renderer:
        for op in ops:
            assert op not in RENDERERS, op
            RENDERERS[op] = fn
        return fn
    return register
