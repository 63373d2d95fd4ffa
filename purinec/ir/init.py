"""Initial values of params and state, from the ``init`` string a graph input carries.

The spellings follow Caffe's fillers, so a ``.pir`` file alone says how to start
training it:

- ``constant(v)``: every element v (any finite value the tensor's dtype holds).
- ``gaussian(std)``: normal with mean 0 (std >= 0).
- ``uniform(a)``: uniform in [-a, a] (a >= 0).
- ``xavier``: uniform in [-s, s] with s = sqrt(3 / fan_in) (Caffe's XavierFiller).
- ``msra``: normal with std sqrt(2 / fan_in) (He et al.).

fan_in is the number of elements per output unit: size / shape[0]. The random fillers
fill float tensors only, and draw in the tensor's own dtype: a float32 weight costs its
own memory, not twice as much in float64 first.
"""

from __future__ import annotations

import math
import re

import numpy as np

from purinec.errors import PurinecError
from purinec.ir.types import DType, TensorType

_INIT_RE = re.compile(r"^(?P<kind>[a-z]+)(?:\((?P<arg>[^()]*)\))?$")
_KINDS_WITH_ARG = {"constant", "gaussian", "uniform"}
_KINDS = _KINDS_WITH_ARG | {"xavier", "msra"}
# What each argument is, for the fillers whose argument is a scale (never negative).
_SCALES = {"gaussian": "standard deviation", "uniform": "half-width"}


def parse_init(spec: str) -> tuple[str, float | None]:
    """Split ``gaussian(0.01)`` into ("gaussian", 0.01); raise on anything else,
    including an argument no filler can use (not finite, a negative scale)."""
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
        arg = float(m["arg"])
    except ValueError:
        raise PurinecError(f"initializer {spec!r}: {m['arg']!r} is not a number") from None
    if not math.isfinite(arg):
        raise PurinecError(f"initializer {spec!r}: the argument must be a finite number")
    if kind in _SCALES and arg < 0:
        raise PurinecError(f"initializer {spec!r}: the {_SCALES[kind]} must be >= 0")
    return kind, arg


def check_init(spec: str, dtype: DType) -> tuple[str, float | None]:
    """`parse_init`, and raise unless ``spec`` is a filler for a tensor of ``dtype``:
    random fillers for float tensors only, and a constant or scale the dtype holds (no
    overflow to inf, no rounding of an integer's value)."""
    kind, arg = parse_init(spec)
    if kind != "constant" and not dtype.is_float:
        raise PurinecError(f"initializer {spec!r} draws random floats; a {dtype} tensor "
                           f"takes constant(v)")
    if arg is not None and not _holds(dtype, arg):
        raise PurinecError(f"initializer {spec!r}: {arg:g} is not a value of {dtype}")
    return kind, arg


def _holds(dtype: DType, number: float) -> bool:
    if dtype is DType.bool:
        return number in (0.0, 1.0)
    if dtype.is_float:
        return abs(number) <= float(np.finfo(dtype.numpy).max)
    limits = np.iinfo(dtype.numpy)
    return number.is_integer() and limits.min <= number <= limits.max


def initial_value(spec: str | None, type: TensorType, rng: np.random.Generator) -> np.ndarray:
    """A fresh array of ``type`` filled as ``spec`` says (zeros when spec is None)."""
    kind, arg = check_init(spec, type.dtype) if spec else ("constant", 0.0)
    dtype = type.dtype.numpy
    shape = type.shape
    fan_in = max(1, type.size // shape[0]) if shape else 1
    if kind == "constant":
        return np.full(shape, arg, dtype=dtype)
    if kind == "xavier":
        kind, arg = "uniform", math.sqrt(3.0 / fan_in)
    elif kind == "msra":
        kind, arg = "gaussian", math.sqrt(2.0 / fan_in)
    scale = dtype.type(arg)
    if kind == "gaussian":
        values = rng.standard_normal(shape, dtype=dtype)
    else:  # uniform in [-1, 1), scaled without an overflowing 2 * a
        values = rng.random(shape, dtype=dtype)
        values *= 2
        values -= 1
    with np.errstate(over="ignore"):  # a huge std: the few draws beyond the dtype are inf
        values *= scale
    return values
