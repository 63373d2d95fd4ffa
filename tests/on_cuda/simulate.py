"""Runs CUDA kernels in Numba's CUDA simulator, in a process of its own.

The simulator must be chosen before Numba is first imported, and the test process has
imported it long before, so tests run their cases here: ``python -m tests.on_cuda.simulate
CASE...`` sets ``NUMBA_ENABLE_CUDASIM=1`` (it must be set when this starts) and prints
one JSON line per case, ``{"case": name, "error": null or what went wrong}``.

A case is a function of a NumPy random generator, found by name in the ``CASES`` of the
``cases_*`` modules beside this one; it returns ``(op, inputs, attrs)``: one node is
built with those inputs, its CUDA kernel runs on device arrays whose outputs start as
garbage, and every output must equal the NumPy reference (floats within a tolerance
scaled to the values, the rest exactly). A case may instead return a graph (fused, say):
each of its nodes is checked so on random inputs. A case of ``PROGRAMS`` compiles and
runs whole programs itself, and raises on a mismatch (it returns None).

A case named ``NAME@FORM`` renders its products in another form (`FORMS`): through
cuBLAS's calls (`purinec.codegen.cuda.blas`, whose simulated stand-in keeps cuBLAS's
contract), and so in chunks of images too.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import sys
import traceback
from contextlib import contextmanager
from unittest import mock

import numpy as np

HERE = "tests.on_cuda"
# A case's form (the suffix of its name) -> (products, bytes of scratch per chunk of
# images: small enough here that every convolution of two images runs in two chunks).
FORMS = {"": (None, None), "cublas": ("cublas", None), "cublas-chunked": ("cublas", 512)}


def form_of(name: str) -> tuple[str | None, int | None]:
    return FORMS[name.partition("@")[2]]


@contextmanager
def rendering(name: str):
    """Render products in the form case ``name`` asks for; yields the products form."""
    from purinec.codegen.cuda import blas, gemm

    products, chunk_bytes = form_of(name)
    # (whole programs compile through the target, which reads the variable)
    with mock.patch.object(gemm, "CHUNK_BYTES", chunk_bytes or gemm.CHUNK_BYTES), \
            mock.patch.dict(os.environ, {blas.PRODUCTS_VAR: products} if products else {}):
        yield products


def all_cases(kinds=("CASES", "PROGRAMS")) -> dict:
    """Every case of every ``cases_*`` module, by name (importing no Numba): node and
    graph cases (``CASES``), and whole programs that check themselves (``PROGRAMS``)."""
    cases = {}
    package = importlib.import_module(HERE)
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("cases_"):
            module = importlib.import_module(f"{HERE}.{info.name}")
            for name, case in (item for kind in kinds
                               for item in getattr(module, kind, {}).items()):
                assert name not in cases, f"two cases named {name}"
                cases[name] = case
    return cases


def random_array(rng, shape, dtype, low=-2.0, high=2.0) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return rng.uniform(low, high, shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    return rng.integers(-50, 50, shape).astype(dtype)


def one_node(op: str, inputs, attrs=None, device: str = "gpu:0"):
    from purinec.ir.graph import Graph
    from purinec.ir.types import Device, DType, TensorType

    graph = Graph("t")
    where = Device.parse(device)
    values = [graph.add_input(f"in{i}", TensorType(a.shape, DType.from_numpy(a.dtype)),
                              device=where)
              for i, a in enumerate(inputs)]
    return graph.add_node(op, values, attrs or {})


def run_on_device(kernel, node, inputs) -> list[np.ndarray]:
    """Launch ``kernel`` on device copies of ``inputs`` and outputs full of garbage."""
    from numba import cuda

    stream = cuda.stream()
    args = [cuda.to_device(np.require(a, requirements="C"), stream=stream) for a in inputs]
    outs = []
    for value in node.outputs:
        garbage = np.full(value.type.shape, 7, value.type.dtype.numpy)
        if garbage.dtype.kind == "f":
            garbage[...] = np.nan
        outs.append(cuda.to_device(garbage, stream=stream))
    kernel.launch(stream, *args, *outs)
    stream.synchronize()
    return [out.copy_to_host() for out in outs]


def compare(got, want, what: str, tolerance: float | None = None) -> None:
    for k, (g, w) in enumerate(zip(got, want)):
        w = np.asarray(w)
        if g.shape != w.shape or g.dtype != w.dtype:
            raise AssertionError(f"{what} output {k}: got {g.dtype}{list(g.shape)}, "
                                 f"want {w.dtype}{list(w.shape)}")
        if g.dtype.kind != "f":
            np.testing.assert_array_equal(g, w, err_msg=f"{what} output {k}")
            continue
        tol = tolerance or (2e-5 if g.dtype == np.float32 else 1e-12)
        scale = max(1.0, float(np.abs(w).max(initial=0)))
        np.testing.assert_allclose(g, w, rtol=tol * 10, atol=tol * scale * 10,
                                   err_msg=f"{what} output {k}")


def check_node(op: str, inputs, attrs=None, tolerance: float | None = None,
               products: str | None = None) -> None:
    """One node's CUDA kernel against its NumPy reference."""
    from purinec.codegen.cuda import compile_module, render_module
    from purinec.ir.ops import REGISTRY

    node = one_node(op, inputs, attrs)
    kernel = compile_module(render_module(node, products))
    got = run_on_device(kernel, node, inputs)
    want = REGISTRY[op].reference(*inputs, **node.attrs)
    compare(got, want, op, tolerance)


def check_fused(graph, rng, tolerance: float | None = None,
                products: str | None = None) -> None:
    """Each node of ``graph`` (fused ones included) against the NumPy references of
    its members, on random inputs."""
    from purinec.codegen.cuda import compile_module, render_module
    from purinec.runtime.plan import reference_results

    for node in graph.nodes:
        inputs = [random_array(rng, v.type.shape, v.type.dtype.numpy) for v in node.inputs]
        got = run_on_device(compile_module(render_module(node, products)), node, inputs)
        compare(got, reference_results(node, inputs), node.op, tolerance)


def run_case(name: str, case) -> None:
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    from purinec.ir.graph import Graph

    with rendering(name) as products:
        spec = case(rng)
        if isinstance(spec, tuple):
            check_node(*spec, products=products)
        elif isinstance(spec, Graph):
            check_fused(spec, rng, products=products)
        elif spec is not None:
            raise TypeError(f"case {name} returned a {type(spec).__name__}: a case returns "
                            f"(op, inputs, attrs), a Graph, or None (a program checks "
                            f"itself)")


SWITCH_INTERVAL = 5e-4  # seconds


def quicker_threads() -> None:
    """Let the simulator's threads take turns every SWITCH_INTERVAL rather than Python's
    5 ms: it runs each CUDA thread of a block as a Python thread, which a barrier makes
    wait for all the others, while its launching thread polls them holding the lock.
    Launches with barriers (reductions) run 3-4 times faster."""
    sys.setswitchinterval(SWITCH_INTERVAL)


def main(names: list[str]) -> int:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1" or "numba" in sys.modules:
        print("set NUMBA_ENABLE_CUDASIM=1 before starting this", file=sys.stderr)
        return 2
    quicker_threads()
    cases = all_cases()
    for name in names or list(cases):
        try:
            run_case(name, cases[name])
            error = None
        except Exception:
            error = traceback.format_exc(limit=-4)
        print(json.dumps({"case": name, "error": error}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
