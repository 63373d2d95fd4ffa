"""Every CUDA kernel compiles to PTX for sm_90 (Hopper), which needs no GPU: each
simulator case's node here; every kernel of every zoo model in `test_cuda_target`."""

from __future__ import annotations

import numpy as np
import pytest

from tests.on_cuda.simulate import all_cases, one_node, rendering

pytest.importorskip("numba_cuda", reason="the [cuda] extra (numba-cuda) is not installed")

CASES = all_cases(kinds=("CASES",))


def test_this_process_is_not_simulating():
    from numba import config

    assert not config.ENABLE_CUDASIM


@pytest.mark.parametrize("case", sorted(CASES))
def test_case_compiles_to_ptx_for_sm90(case, tmp_path, monkeypatch):
    monkeypatch.setenv("PURINEC_CACHE_DIR", str(tmp_path))
    from purinec.codegen.cuda import compile_module, render_module

    with rendering(case) as products:
        spec = CASES[case](np.random.default_rng(0))
        nodes = [one_node(*spec)] if isinstance(spec, tuple) else spec.nodes
        modules = [compile_module(render_module(node, products)) for node in nodes]
    for module in modules:
        ptx = module.ptx()
        # (a product through cuBLAS may need no kernel of its own: a pointwise
        # convolution, a matmul)
        assert ptx or products == "cublas"
        assert all(".target sm_90" in text and ".entry" in text for text in ptx.values())
        # (a reshape in a kernel makes Numba compile and link a helper into it)
        assert not any("nocopy_reshape" in text for text in ptx.values())
