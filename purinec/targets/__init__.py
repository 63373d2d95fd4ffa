"""Targets: where a program runs, each a plug-in behind one interface (`base.Target`).
``reference`` (NumPy, the oracle), ``cpu`` (Numba) and ``cuda`` (Numba CUDA) are built
in; `register_target` adds another."""

from purinec.targets.base import TARGETS, Target, get_target, register_target
from purinec.targets.cpu import CpuTarget
from purinec.targets.cuda import CudaTarget
from purinec.targets.reference import ReferenceTarget

register_target(ReferenceTarget())
register_target(CpuTarget())
register_target(CudaTarget())

__all__ = ["TARGETS", "Target", "get_target", "register_target"]
