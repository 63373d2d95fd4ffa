"""The CPU code generator: IR nodes to Numba kernels.

    kernels = compile_kernels(graph)       # {node: Kernel}, compiled (or loaded) now
    kernels[node].fn(*inputs, *outputs)     # fills the preallocated outputs
    print(render(node))                     # the generated module for one node

Each node becomes one module of Python source for Numba (`render`), specialised to its
shapes and attributes, which the kernel cache (`purinec.codegen.cache`) stores by the
hash of its text and imports; the kernel is compiled for its exact argument types right
away, or loaded from Numba's disk cache when a previous process compiled it.

Renderers live in `purinec.codegen.cpu_ops`, `cpu_conv`, `cpu_pool` and `cpu_fused`, and
are found through `RENDERERS` (op name -> function, ``fused`` included). Elementwise ops
go through the scalar rules and loop emitter of `purinec.codegen.elementwise`, which
fused nodes reuse for their loops and epilogues; a fused node's kernel is one module
named after it (``fused_conv2d_relu``) whose comments quote each member. Big kernels run
in blocks on several threads (`purinec.codegen.cpu_runtime`); `set_threads(n)` bounds
them for the calling thread.
"""

from __future__ import annotations

import logging

from numba import types
from numba.np.numpy_support import from_dtype

from purinec.codegen import cache
from purinec.codegen import cpu_conv, cpu_fused, cpu_ops, cpu_pool  # noqa: F401  (renderers)
from purinec.codegen.cpu_runtime import Blocked, limit_blas_threads, set_threads
from purinec.codegen.cpu_module import DEFAULT_OPTIONS, RENDERERS, CpuOptions, KernelModule
from purinec.codegen.elementwise import SCALAR_RULES
from purinec.codegen.kernel import CodegenError, Kernel
from purinec.ir.graph import Graph, Node, Value

__all__ = ["compile_kernels", "compile_node", "render", "RENDERERS", "SCALAR_RULES",
           "CpuOptions", "set_threads"]

log = logging.getLogger(__name__)


def render_module(node: Node, options: CpuOptions = DEFAULT_OPTIONS) -> KernelModule:
    """The generated module for ``node``, before it is turned into text."""
    renderer = RENDERERS.get(node.op)
    if renderer is None:
        where = f" ({node.loc})" if node.loc else ""
        raise CodegenError(f"the cpu target has no kernel for op {node.op!r} (node "
                           f"{node!r}{where}); add a renderer for it to "
                           f"purinec.codegen.cpu_ops")
    name = node.attrs["kernel"] if node.body is not None else node.op
    module = KernelModule(name, [node], node.inputs, node.outputs, options)
    with module.body.origin(node):
        renderer(node, module)
    return module


def render(node: Node, options: CpuOptions = DEFAULT_OPTIONS) -> str:
    """The source of the kernel module for ``node``."""
    return render_module(node, options).text()


def compile_kernels(graph: Graph, options: CpuOptions = DEFAULT_OPTIONS
                    ) -> dict[Node, Kernel]:
    """A compiled kernel for every node of ``graph``."""
    return {node: compile_node(node, options) for node in graph.nodes}


def compile_node(node: Node, options: CpuOptions = DEFAULT_OPTIONS) -> Kernel:
    """The compiled kernel of one node (a fused node included)."""
    return compile_module(render_module(node, options))


def compile_module(module: KernelModule) -> Kernel:
    """Store ``module`` in the kernel cache, import it and compile its entry function
    for the exact types of its arguments (or load it from Numba's disk cache)."""
    limit_blas_threads()
    source = module.text()
    where = ", ".join(repr(n) for n in module.nodes)
    try:
        dispatcher = getattr(cache.load_module(source), module.name)
        signature = tuple(_numba_type(value) for _, value in module.params)
        if module.blocks is not None:
            signature = (types.intp, types.intp) + signature
        if signature not in dispatcher.overloads:
            dispatcher.compile(signature)
            if dispatcher.stats.cache_hits.get(signature):
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
    fn = dispatcher if module.blocks is None else Blocked(dispatcher, module.blocks)
    nodes = tuple(member for node in module.nodes for member in (node.body or [node]))
    return Kernel(module.name, source, cache.kernel_path(source), nodes, fn, dispatcher,
                  signature)


def _numba_type(value: Value):
    return types.Array(from_dtype(value.type.dtype.numpy), value.type.rank, "C")
