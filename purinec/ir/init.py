"""Initial values of params and state, from the ``init`` string a graph input carries.

The spellings follow Caffe's fillers, so a ``.pir`` file alone says how to start
training it:

- ``constant(v)``: every element v.
- ``gaussian(std)``: normal with mean 0.
- ``uniform(a)``: uniform in [-a, a].
- ``xavier``: uniform in [-s, s] with s = sqrt(3 / fan_in) (Caffe's XavierFiller).
- ``msra``: normal with std sqrt(2 / fan_in) (He et al.).

fan_in is the number of elements per output unit: size / shape[0].
"""

from __future__ import annotations

import re

import numpy as np

from purinec.errors import PurinecError
from purinec.ir.types import TensorType

_INIT_RE = re.compile(r"^(?P<kind>[a-z]+)(?:\((?P<arg>[^()]*)\))?$")
_KINDS_WITH_ARG = {"constant", "gaussian", "uniform"}
_KINDS = _KINDS_WITH_ARG | {"xavier", "msra"}


def parse_init(spec: str) -> tuple[str, float | None]:
    """Split ``gaussian(0.01)`` into ("gaussian", 0.01); raise on anything else."""
    if not isinstance(spec, str):
        raise PurinecError(f"initializer {spec!r} is not a string such as 'xavier'")
    m = _INIT_RE.match(spec.strip())
    kind = m and m["kind"]
    if not m or kind not in _KINDS or (kind in _KINDS_WITH_ARG) != (m["arg"] is not None):
        raise PurinecError(f"unknown initializer {spec!r}; use one of constant(v), "
                           f"gaussian(std), uniform(a), xavier, msra")
    if m["arg"] is None:
        return kind, None
    try:
        return kind, float(m["arg"])
    except ValueError:
        raise PurinecError(f"initializer {spec!r}: {m['arg']!r} is not a number") from None


def initial_value(spec: str | None, type: TensorType, rng: np.random.Generator) -> np.ndarray:
    """A fresh array of ``type`` filled as ``spec`` says (zeros when spec is None)."""
    kind, arg = parse_init(spec) if spec else ("constant", 0.0)
    dtype = type.dtype.numpy
    shape = type.shape
    fan_in = max(1, type.size // shape[0]) if shape else 1
    if kind == "constant":
        return np.full(shape, arg, dtype=dtype)
    if kind == "gaussian":
        return rng.normal(0.0, arg, shape).astype(dtype)
    if kind == "uniform":
        return rng.uniform(-arg, arg, shape).astype(dtype)
    if kind == "xavier":
        scale = np.sqrt(3.0 / fan_in)
        return rng.uniform(-scale, scale, shape).astype(dtype)
    return rng.normal(0.0, np.sqrt(2.0 / fan_in), shape).astype(dtype)  # msra
