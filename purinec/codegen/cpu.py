"""The CPU code generator: IR nodes to Numba kernels.

    kernels = compile_kernels(graph)       # {node: Kernel}, compiled (or loaded) now
    kernels[node].fn(*inputs, *outputs)     # fills the preallocated outputs (checked)
    calls = kernel_calls(graph)            # {node: callable}, what the runtime runs
    print(render(node))                     # the generated module for one node

Each node becomes one module of Python source for Numba (`render`; a horizontal group,
one module per member: `render_parts`), specialised to its shapes and attributes, which
the kernel cache (`purinec.codegen.cache`) stores by the hash of its code (its text
without the comments that quote the IR) and imports; the kernel is compiled for its
exact argument types right away, or loaded from Numba's disk cache when a previous
process compiled it (`kernel_calls`, the runtime's view, defers loading each kernel of a
warm cache to its first call). Nodes rendering to the same code
share the compiled function: in one `compile_kernels` call each gets its own `Kernel`
(its own source, comments included, and its own block count) around the same Numba
function.

Renderers live in `purinec.codegen.cpu_ops`, `cpu_conv`, `cpu_pool` and `cpu_fused`, and
are found through `RENDERERS` (op name -> function, ``fused`` included). Elementwise ops
go through the element expressions and loop emitter of `purinec.codegen.elementwise`, which
fused nodes reuse for their loops and epilogues; a fused node's kernel is one module
named after it (``fused_conv2d_relu``) whose comments quote each member. Big kernels run
in blocks on several threads (`purinec.codegen.cpu_runtime`); `set_threads(n)` bounds
them for the calling thread.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
from numba.core.dispatcher import Dispatcher

from purinec import jitcache
from purinec.codegen import cache
from purinec.codegen.compile_helpers import (Job, compiling_elsewhere, helping,
                                              start_numba_without_scipy, uncompiled)
from purinec.codegen import cpu_conv, cpu_fused, cpu_ops, cpu_pool  # noqa: F401  (renderers)
from purinec.codegen.cpu_gemm import linked
from purinec.codegen.cpu_runtime import (SMALL_GEMM_MACS, Blocked, limit_blas_threads,
                                         set_threads, tiled_gemm_wanted)
from purinec.codegen.cpu_module import RENDERERS, CpuOptions, KernelModule
from purinec.codegen.kernel import ArgumentCheck, CodegenError, Kernel
from purinec.codegen.progress import kernel_counter
from purinec.ir.graph import Graph, Node, Value

__all__ = ["compile_kernels", "kernel_calls", "compile_node", "render", "RENDERERS",
           "CpuOptions", "set_threads"]

log = logging.getLogger(__name__)

# The options that suit the BLAS this process runs, the default of every function here.
DEFAULT_OPTIONS = CpuOptions(small_gemm_macs=SMALL_GEMM_MACS, tiled_gemm=tiled_gemm_wanted())


def render_module(node: Node, options: CpuOptions = DEFAULT_OPTIONS) -> KernelModule:
    """The generated module for ``node``, before it is turned into text."""
    renderer = RENDERERS.get(node.op)
    if renderer is None:
        where = f" ({node.loc})" if node.loc else ""
        raise CodegenError(f"the cpu target has no kernel for op {node.op!r} (node "
                           f"{node!r}{where}); add a renderer for it to "
                           f"purinec.codegen.cpu_ops")
    name = node.attrs["kernel"] if node.body is not None else node.op
    # Fused nodes are named uniquely in a graph by a suffix (_1, _2...), which the code
    # leaves out: it would keep identical fused nodes from sharing their kernel.
    function = re.sub(r"_\d+$", "", name)
    module = KernelModule(name, [node], node.inputs, node.outputs, options, function)
    with module.body.origin(node):
        renderer(node, module)
    return module


@dataclass(frozen=True)
class Part:
    """One module of a node's kernel and what it is called with: ``takes``, the indices
    of the node's arrays (its inputs, then its outputs) it reads and writes, each viewed
    as 1-D when ``flat``. A node is one part taking all its arrays as they are, except a
    horizontal group (`cpu_fused.members_apart`): a part per member."""

    module: KernelModule
    source: str
    takes: tuple[int, ...]
    flat: bool = False


def render_parts(node: Node, options: CpuOptions = DEFAULT_OPTIONS) -> list[Part]:
    """The modules computing ``node``, in the order they run."""
    if not cpu_fused.members_apart(node):
        module = render_module(node, options)
        return [Part(module, module.text(), tuple(range(len(module.params))))]
    arrays = [*node.inputs, *node.outputs]
    parts = []
    for member in node.body:
        values = [*dict.fromkeys(member.inputs), *member.outputs]
        flat = len({v.type.shape for v in values}) == 1
        if flat:  # the member over 1-D views, so that it shares code with any size
            member = replace(member, inputs=[_flattened(v) for v in member.inputs],
                             outputs=[_flattened(v) for v in member.outputs])
        module = render_module(member, options)
        parts.append(Part(module, module.text(), tuple(arrays.index(v) for v in values), flat))
    return parts


def _flattened(value: Value) -> Value:
    return replace(value, type=value.type.with_shape((value.type.size,)), producer=None)


def render(node: Node, options: CpuOptions = DEFAULT_OPTIONS) -> str:
    """The source of the kernel module for ``node``; for a horizontal group, of each
    member's module, in turn."""
    return _joined(node, render_parts(node, options))


def _joined(node: Node, parts: list[Part], paths: list | None = None) -> str:
    """One text for the parts of ``node``: the part's own for a single part."""
    if len(parts) == 1:
        return parts[0].source
    names = [*node.inputs, *node.outputs]
    lines = [f"# Kernel `{node.attrs['kernel']}` for %{node.name}: {len(parts)} modules, run "
             f"one after another, each with some of the node's arrays"]
    for k, part in enumerate(parts):
        taken = ", ".join(f"%{names[i].name}" for i in part.takes)
        lines.append(f"\n# ---- module {k + 1} of {len(parts)}: called with ({taken})"
                     + (", each viewed as 1-D" if part.flat else "")
                     + (f", cached as {paths[k]}" if paths else ""))
        lines.append(part.source)
    return "\n".join(lines)


def _rendered(graph: Graph, options: CpuOptions
              ) -> tuple[dict[Node, list[Part]], list[Job]]:
    """Every node's parts, and the distinct compile jobs among them."""
    parts = {node: render_parts(node, options) for node in graph.nodes}
    jobs = {cache.code_of(part.source): _job(part.module, part.source)
            for node_parts in parts.values() for part in node_parts}
    return parts, list(jobs.values())


def compile_kernels(graph: Graph, options: CpuOptions = DEFAULT_OPTIONS
                    ) -> dict[Node, Kernel]:
    """A compiled kernel for every node of ``graph``; nodes whose code is the same
    share its compiled function. Kernels that other processes are compiling (compile
    helpers, other ranks) are taken last, loaded from Numba's cache once they are done."""
    parts, jobs = _rendered(graph, options)
    return _compile_all(graph, parts, jobs, uncompiled(jobs))


def kernel_calls(graph: Graph, options: CpuOptions = DEFAULT_OPTIONS
                 ) -> dict[Node, Callable]:
    """What the runtime calls for every node of ``graph``. When Numba's disk cache
    holds every kernel (a warm start), each loads when first called: a program loaded
    to run inference never loads its training step's kernels, each a few milliseconds.
    Otherwise all are compiled now, as `compile_kernels` does, so that a cold compile
    uses its helper processes and reports a kernel that fails before anything runs."""
    parts, jobs = _rendered(graph, options)
    todo = uncompiled(jobs)
    if todo:
        kernels = _compile_all(graph, parts, jobs, todo)
        return {node: kernel.run for node, kernel in kernels.items()}
    limit_blas_threads()
    shared = _SharedLoads()
    return {node: _in_turn([(LoadOnFirstCall(p.module, p.source, shared), p)
                            for p in node_parts])
            for node, node_parts in parts.items()}


class _SharedLoads:
    """What the deferred kernels of one graph share: the kernels loaded so far (nodes
    with the same code share one) and a lock, since devices' threads may call their
    first kernels at once."""

    def __init__(self) -> None:
        self.compiled: dict[tuple, Kernel] = {}
        self.lock = threading.Lock()


class LoadOnFirstCall:
    """A kernel in Numba's disk cache, loaded (`compile_module`) when first called."""

    __slots__ = ("module", "source", "shared", "fn")

    def __init__(self, module: KernelModule, source: str, shared: _SharedLoads):
        self.module, self.source, self.shared = module, source, shared
        self.fn: Callable | None = None

    def __call__(self, *arrays):
        fn = self.fn or self._load()
        return fn(*arrays)

    def _load(self) -> Callable:
        with self.shared.lock:
            if self.fn is None:
                self.fn = compile_module(self.module, self.shared.compiled,
                                         source=self.source).run
        return self.fn

    def __repr__(self) -> str:
        state = "loaded" if self.fn is not None else "not loaded yet"
        return f"<kernel {self.module.name}, {state}>"


def _compile_all(graph: Graph, parts: dict[Node, list[Part]], jobs: list[Job],
                 todo: list[Job]) -> dict[Node, Kernel]:
    """Compile (or load) every node's kernel; ``todo``: the ``jobs`` Numba's disk cache
    does not hold, which helper processes start on."""
    cached = len(jobs) - len(todo)
    compiled: dict[tuple, Kernel] = {}
    kernels: dict[Part, Kernel] = {}
    # Longest first, in every process: a long kernel taken last would be compiled alone
    # while the other processes wait. Code length is a fair guess of Numba's time; among
    # equals, graph order (the first node writes the file).
    length = {part.source: len(cache.code_of(part.source))
              for node_parts in parts.values() for part in node_parts}
    todo = sorted(todo, key=lambda job: -length[job.source])
    order = sorted((part for node_parts in parts.values() for part in node_parts),
                   key=lambda part: -length[part.source])
    links = {source: linked(source) for source in length}
    with kernel_counter(len(order), graph.name, len(jobs), cached) as bar, helping(todo):
        for wait in (False, True):
            for part in order:
                if part not in kernels and (wait or not compiling_elsewhere(
                        links[part.source])):
                    kernel = compile_module(part.module, compiled, wait, part.source)
                    if kernel is not None:
                        kernels[part] = kernel
                        bar.update()
    return {node: _combined(node, node_parts, [kernels[p] for p in node_parts])
            for node, node_parts in parts.items()}


def compile_node(node: Node, options: CpuOptions = DEFAULT_OPTIONS,
                 compiled: dict[tuple, Kernel] | None = None) -> Kernel:
    """The compiled kernel of one node (a fused node included). ``compiled`` (code and
    signature -> kernel) collects the kernels made so far, whose ``run`` it reuses."""
    compiled = {} if compiled is None else compiled
    parts = render_parts(node, options)
    return _combined(node, parts, [compile_module(p.module, compiled, source=p.source)
                                   for p in parts])


def _combined(node: Node, parts: list[Part], kernels: list[Kernel]) -> Kernel:
    """The kernel of ``node`` from its parts' kernels: the one part's own, or one that
    runs each in turn."""
    if len(parts) == 1:
        return kernels[0]
    arrays = [*node.inputs, *node.outputs]
    check = ArgumentCheck(node.attrs["kernel"],
                          tuple((tuple(v.type.shape), v.type.dtype.numpy) for v in arrays),
                          ", ".join(f"%{v.name} {v.type}" for v in arrays))
    return Kernel(node.attrs["kernel"], _joined(node, parts, [k.path for k in kernels]),
                  None, tuple(node.body),
                  _in_turn([(kernel.run, part) for kernel, part in zip(kernels, parts)]),
                  check, None, None, tuple(kernels))


def _in_turn(calls: list[tuple[Callable, Part]]) -> Callable:
    """What runs a node's parts: the one part's own call, or `InTurn`."""
    if len(calls) == 1:
        return calls[0][0]
    return InTurn(tuple((run, part.takes, part.flat) for run, part in calls))


class InTurn:
    """Runs a horizontal group's members one after another, each called with its own
    arrays of the node's (1-D views of them where its code is flat)."""

    __slots__ = ("calls",)

    def __init__(self, calls: tuple[tuple[Callable, tuple[int, ...], bool], ...]):
        self.calls = calls

    def __call__(self, *arrays) -> None:
        for run, takes, flat in self.calls:
            # The runtime's arrays are C-contiguous, so reshape makes views, never copies.
            run(*[arrays[i].reshape(-1) if flat else arrays[i] for i in takes])

    def __repr__(self) -> str:
        return f"InTurn({', '.join(repr(run) for run, _, _ in self.calls)})"


def compile_module(module: KernelModule, compiled: dict[tuple, Kernel] | None = None,
                   wait: bool = True, source: str | None = None) -> Kernel | None:
    """Store ``module`` in the kernel cache, import it and compile its entry function
    for the exact types of its arguments (or load it from Numba's disk cache); or, if
    ``compiled`` holds a kernel with its code, share that kernel's function. Without
    ``wait``, None if another process is compiling it now. ``source``: the module's
    text, when the caller has it already (turning a module into text takes a while)."""
    source = source or module.text()
    job = _job(module, source)
    signature = job.signature()
    nodes = tuple(member for node in module.nodes for member in (node.body or [node]))
    key = (cache.code_of(source), signature)
    if compiled is not None and key in compiled:
        # The same function; the block count and the shapes are this node's own (a
        # flat loop's code fits any size).
        dispatcher = compiled[key].dispatcher
        return replace(compiled[key], name=module.name, source=source, nodes=nodes,
                       run=_runner(dispatcher, module), check=module.argument_check())
    limit_blas_threads()
    where = ", ".join(repr(n) for n in module.nodes)
    try:
        dispatcher = getattr(cache.load_module(source), module.function)
        if signature not in dispatcher.overloads:
            loaded = jitcache.load(dispatcher, signature)
            if not loaded:
                start_numba_without_scipy()
                with cache.one_compiler(source, wait=wait) as mine:
                    if not mine:
                        return None
                    dispatcher.compile(signature)  # loads what another process just saved
                loaded = bool(dispatcher.stats.cache_hits.get(signature))
            if loaded:
                cache.STATS.loads += 1
                log.debug("kernel %s: loaded from Numba's cache", module.name)
            else:
                cache.STATS.compiles += 1
                log.debug("kernel %s: compiled", module.name)
    except cache.CacheError:
        raise
    except Exception as err:  # a bug in a renderer: say which node and which file
        path = cache.kernel_path(source)
        raise CodegenError(f"compiling the cpu kernel for {where} failed ({path}): "
                           f"{type(err).__name__}: {err}") from err
    kernel = Kernel(module.name, source, cache.kernel_path(source), nodes,
                    _runner(dispatcher, module), module.argument_check(), dispatcher,
                    signature)
    if compiled is not None:
        compiled[key] = kernel
    return kernel


def _runner(dispatcher: Dispatcher, module: KernelModule) -> Callable:
    """What runs ``module``'s kernel: its function, its blocks on threads, or all its
    items as one block (a `functools.partial`: a third cheaper a call than a class);
    given new scratch arrays for its blocks to share, if it has any."""
    if module.blocks is None:
        run = dispatcher
    elif module.parallel:
        run = Blocked(dispatcher, module.blocks)
    else:
        run = functools.partial(dispatcher, 0, module.blocks, 0, 1)  # no team, one thread
    if module.shared:
        return WithScratch(run, tuple((shape, dtype.numpy) for _, shape, dtype in module.shared))
    return run


class WithScratch:
    """Runs a kernel whose blocks share scratch arrays (`KernelModule.share`), made new
    for each call: calls on several threads at once each have their own."""

    __slots__ = ("run", "scratch")

    def __init__(self, run: Callable, scratch: tuple[tuple[tuple[int, ...], np.dtype], ...]):
        self.run, self.scratch = run, scratch

    def __call__(self, *arrays) -> None:
        self.run(*arrays, *[np.empty(shape, dtype) for shape, dtype in self.scratch])

    def __repr__(self) -> str:
        return f"WithScratch({self.run!r})"


def _job(module: KernelModule, source: str | None = None) -> Job:
    """What compiling ``module``'s entry function takes, in a form a helper can read."""
    source = source or module.text()
    return Job(source, module.function, module.argument_types(), module.blocks is not None,
               linked(source))
