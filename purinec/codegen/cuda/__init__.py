"""The CUDA code generator: IR nodes to Numba CUDA kernels.

    kernels = compile_kernels(graph)            # {node: CudaKernel}, modules imported now
    kernels[node].launch(stream, *ins, *outs)   # queues the node's kernels on a stream
    kernels[node].ptx()                         # PTX of each of its kernels (no GPU needed)
    print(render(node))                         # the generated module for one node

Each node becomes one module of Python source (`render`): its ``@cuda.jit`` kernels and
the host function launching them, specialised to its shapes and attributes, stored in
the kernel cache (`purinec.codegen.cache`, under ``cuda/``) by the hash of its code and
imported from there, so Numba's cache (``cache=True``, per compute capability) keeps the
machine code beside it for later processes. Numba compiles a kernel when it is first
launched on a GPU, or for a GPU that is not here by `CudaKernel.ptx`.

Renderers live in `elementwise`, `fused`, `gemm` (matrix products and convolutions),
`pool`, `reduce` (sums, softmax and losses) and `shape` and are found through
`RENDERERS`. The CUDA simulator (``NUMBA_ENABLE_CUDASIM=1`` before Numba is first
imported) runs the same modules on the CPU, slowly: that is how they are tested on
machines without a GPU (`simulator`: what it needs mended).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from purinec.codegen import cache
from purinec.codegen.cuda import (blas, elementwise, fused, gemm, pool,  # noqa: F401
                                  reduce, shape)  # (renderers)
from purinec.codegen.cuda.module import RENDERERS, CudaModule
from purinec.codegen.cuda.simulator import atomic_shared_arrays, simulated
from purinec.codegen.kernel import CodegenError
from purinec.ir.graph import Graph, Node

__all__ = ["compile_kernels", "render", "render_module", "CudaKernel", "RENDERERS",
           "CC_HOPPER"]

# The compute capability PTX is made for when none is given: Hopper (H100, H200).
CC_HOPPER = (9, 0)


@dataclass(eq=False)
class CudaKernel:
    """One node's generated CUDA module.

    ``launch(stream, *inputs, *outputs)`` queues its kernels on ``stream``; ``fn`` does
    so on the default stream (the target's generic kernel convention). ``kernels`` are
    its Numba CUDA dispatchers by name, ``argument_types`` their arguments (dtype name,
    rank), ``source`` the module text for ``nodes``, kept at ``path`` in the cache.
    ``views``: parameter position -> the shape the kernels read it in, for parameters
    read through that one view (handing them over in it saves a reshape per launch).
    """

    name: str
    source: str
    path: Path
    nodes: tuple[Node, ...]
    launch: Any
    kernels: dict[str, Any]
    argument_types: dict[str, tuple[tuple[str, int], ...]]
    views: dict[int, tuple[int, ...]]

    def fn(self, *arrays):
        from numba import cuda

        self.launch(cuda.default_stream(), *arrays)

    def __call__(self, *arrays):
        return self.fn(*arrays)

    def signatures(self) -> dict[str, Any]:
        """Each kernel's Numba signature: void of C-contiguous arrays."""
        import numpy as np
        from numba import from_dtype, types

        return {name: types.void(*(types.Array(from_dtype(np.dtype(dtype)), rank, "C")
                                   for dtype, rank in args))
                for name, args in self.argument_types.items()}

    def ptx(self, cc: tuple[int, int] = CC_HOPPER) -> dict[str, str]:
        """The PTX of each kernel for compute capability ``cc``, compiled now (no GPU
        needed; not under the simulator, which has no compiler)."""
        from numba import cuda

        if simulated():
            raise CodegenError("the CUDA simulator cannot compile to PTX; run without "
                               "NUMBA_ENABLE_CUDASIM")
        result = {}
        for name, signature in self.signatures().items():
            try:
                result[name], _ = cuda.compile_ptx(self.kernels[name].py_func, signature,
                                                   cc=cc)
            except Exception as err:
                raise CodegenError(f"compiling CUDA kernel {name} of "
                                   f"{', '.join(map(repr, self.nodes))} to PTX for "
                                   f"sm_{cc[0]}{cc[1]} failed ({self.path}): "
                                   f"{type(err).__name__}: {err}") from err
        return result

    def __repr__(self) -> str:
        return f"<CudaKernel {self.name} for {', '.join('%' + n.name for n in self.nodes)}>"


def render_module(node: Node, products: str | None = None) -> CudaModule:
    """The generated module for ``node``, before it is turned into text; its products
    in the form ``products`` (default: `blas.products`, the best this process can run)."""
    renderer = RENDERERS.get(node.op)
    if renderer is None:
        where = f" ({node.loc})" if node.loc else ""
        raise CodegenError(f"the cuda target has no kernel for op {node.op!r} (node "
                           f"{node!r}{where}); add a renderer for it to "
                           f"purinec.codegen.cuda")
    name = node.attrs["kernel"] if node.body is not None else node.op
    function = re.sub(r"_\d+$", "", name)  # as on the CPU: identical fused nodes share
    module = CudaModule(name, [node], node.inputs, node.outputs, function,
                        products or blas.products())
    renderer(node, module)
    return module


def render(node: Node, products: str | None = None) -> str:
    """The source of the CUDA module for ``node``."""
    return render_module(node, products).text()


def compile_kernels(graph: Graph, products: str | None = None) -> dict[Node, CudaKernel]:
    """The kernel module of every node of ``graph``, written to the cache and imported;
    nodes whose code is the same share the imported functions."""
    products = products or blas.products()
    return {node: compile_module(render_module(node, products)) for node in graph.nodes}


# Numba warns at each launch of fewer than 128 blocks, to catch a beginner's grid: a
# generated kernel's grid is sized to its data, and a small network's data is small.
OCCUPANCY_WARNINGS_VAR = "NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS"


def quiet_occupancy_warnings() -> None:
    """No warning of small grids in this process, unless
    NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS asks for them. The variable is set too: Numba
    reads its settings again whenever a NUMBA_ variable changes."""
    if OCCUPANCY_WARNINGS_VAR in os.environ:
        return
    from numba.cuda.core import config

    os.environ[OCCUPANCY_WARNINGS_VAR] = "0"
    config.CUDA_LOW_OCCUPANCY_WARNINGS = 0


def compile_module(module: CudaModule) -> CudaKernel:
    quiet_occupancy_warnings()
    if simulated():
        atomic_shared_arrays()
    source = module.text()
    nodes = tuple(member for node in module.nodes for member in (node.body or [node]))
    try:
        loaded = cache.load_module(source, target="cuda")
    except cache.CacheError:
        raise
    except Exception as err:  # a bug in a renderer: say which node and which file
        where = ", ".join(repr(n) for n in module.nodes)
        raise CodegenError(f"loading the CUDA module for {where} failed "
                           f"({cache.kernel_path(source, 'cuda')}): {type(err).__name__}: "
                           f"{err}") from err
    argument_types = module.argument_types()
    return CudaKernel(module.name, source, cache.kernel_path(source, "cuda"), nodes,
                      getattr(loaded, module.function),
                      {name: getattr(loaded, name) for name in argument_types},
                      argument_types, loaded.VIEWS)
