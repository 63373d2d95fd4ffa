"""A network small enough for Numba's CUDA simulator, as a model file: `build(batch)`
(the one `cases_programs.tiny_mlp` trains). `benchmarks/gpu_check.py --smoke` runs
its sections on it."""

from tests.on_cuda.cases_programs import tiny_mlp


def build(batch: int = 4):
    return tiny_mlp(batch)
