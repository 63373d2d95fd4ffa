"""Every strategy over MPI ranks that each drive a GPU, in Numba's CUDA simulator:
``NUMBA_ENABLE_CUDASIM=1 mpiexec -n 2 python tests/on_cuda/mpi_train.py OUT_DIR
STRATEGY...``. For each strategy, each rank trains the small mlp of `cases_programs`
over r0/gpu:0 and r1/gpu:0 and one device of the reference target alongside, from the
same weights and batches, and writes OUT_DIR/STRATEGY.rank<R>.txt: "ok", or what
differed. ``lazy-STRATEGY`` trains on streams that run only when waited for
(`tests.on_cuda.lazy_gpu`)."""

import sys
import traceback
from contextlib import nullcontext

import numpy as np

import purinec
from purinec.runtime import comm
from tests.on_cuda.cases_programs import feeds_for, tiny_mlp
from tests.on_cuda.lazy_gpu import lazy_gpu
from tests.on_cuda.simulate import quicker_threads


def main(out: str, strategies: list[str]) -> None:
    for strategy in strategies:
        # lazy-: on streams that run only when waited for
        with lazy_gpu() if strategy.startswith(LAZY) else nullcontext():
            result = trained_alike(strategy.removeprefix(LAZY))
        with open(f"{out}/{strategy}.rank{comm.world().rank}.txt", "w") as f:
            f.write(result)


LAZY = "lazy-"


def trained_alike(strategy: str) -> str:
    try:
        sgd = purinec.SGD(lr=0.1, momentum=0.9, weight_decay=1e-3)
        many = purinec.compile(tiny_mlp(), target="cuda", train=sgd,
                               devices="r0/gpu:0,r1/gpu:0", parallel=strategy)
        one = purinec.compile(tiny_mlp(), target="reference", train=sgd)
        for name in one.params:
            many.params[name] = one.params[name].copy()
        rng = np.random.default_rng(3)
        for step in range(2):
            feeds = feeds_for(one.ir, rng, classes=3)
            want, got = one.step(feeds), many.step(feeds)
            assert np.isclose(got, want, rtol=2e-4), f"step {step}: {got} vs {want}"
        many.gather_weights()
        for name in one.params:
            np.testing.assert_allclose(many.params[name], one.params[name], rtol=2e-4,
                                       atol=1e-5, err_msg=name)
        many.close()
        return "ok"
    except Exception:
        return traceback.format_exc()


if __name__ == "__main__":
    quicker_threads()
    main(sys.argv[1], sys.argv[2:])
