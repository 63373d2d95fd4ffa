"""Targets: where a program runs, each a plug-in behind one interface (`base.Target`).
``reference`` (NumPy, the oracle) and ``cpu`` (Numba) are built in; `register_target`
adds another."""

from purinec.targets.base import TARGETS, Target, get_target, register_target
from purinec.targets.cpu import CpuTarget
from purinec.targets.reference import ReferenceTarget

register_target(ReferenceTarget())
register_target(CpuTarget())

__all__ = ["TARGETS", "Target", "get_target", "register_target"]
