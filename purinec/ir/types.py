"""Types of IR values: element types, tensor types, devices and distributions."""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

import numpy as np


class DType(enum.Enum):
    """Element types. The value is the spelling used in IR text."""

    f32 = "f32"
    f64 = "f64"
    i32 = "i32"
    i64 = "i64"
    bool = "bool"

    @property
    def numpy(self) -> np.dtype:
        return np.dtype(_NUMPY_NAMES[self])

    @property
    def is_float(self) -> bool:
        return self in (DType.f32, DType.f64)

    @staticmethod
    def from_numpy(dtype) -> "DType":
        name = np.dtype(dtype).name
        for dt, np_name in _NUMPY_NAMES.items():
            if np_name == name:
                return dt
        raise ValueError(f"no IR dtype for numpy dtype {name}")

    def __str__(self) -> str:
        return self.value


_NUMPY_NAMES = {
    DType.f32: "float32",
    DType.f64: "float64",
    DType.i32: "int32",
    DType.i64: "int64",
    DType.bool: "bool",
}


# The largest tensors the IR describes. NumPy and the generated kernels index with int64,
# so a tensor's element count, byte size and every offset into it must stay well inside
# it: 2**56 elements (512 PiB of float64) leaves room for byte sizes, sums of sizes and
# products with small factors. A machine's memory is the tighter bound in practice; the
# runtime checks that when it allocates. NumPy 1.x arrays have at most 32 dimensions.
MAX_ELEMENTS = 2**56
MAX_RANK = 32
# The integers the IR holds (dimensions, indices, integer attributes): int64.
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


def shape_problem(shape: tuple[int, ...]) -> str | None:
    """Why no tensor can have ``shape`` (negative sizes, too many dimensions or
    elements), or None."""
    if any(d < 0 for d in shape):
        return "negative dimension(s)"
    if len(shape) > MAX_RANK:
        return f"{len(shape)} dimensions; a tensor has at most {MAX_RANK}"
    if math.prod(shape) > MAX_ELEMENTS:
        return (f"more than 2**{MAX_ELEMENTS.bit_length() - 1} elements, the most a tensor "
                f"may have")
    return None


@dataclass(frozen=True)
class TensorType:
    """A dense tensor's shape and element type, printed as ``f32[64,1,28,28]``."""

    shape: tuple[int, ...]
    dtype: DType

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)  # exact: a Python int never wraps

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.numpy.itemsize

    def with_shape(self, shape) -> "TensorType":
        return TensorType(tuple(shape), self.dtype)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"


@dataclass(frozen=True, order=True)
class Device:
    """Where a value lives and a node runs: a rank (process) and a device on it.

    Printed as ``cpu:0`` on rank 0 and ``r1/cpu:0`` on other ranks.
    """

    kind: str = "cpu"
    index: int = 0
    rank: int = 0

    def __str__(self) -> str:
        local = f"{self.kind}:{self.index}"
        return local if self.rank == 0 else f"r{self.rank}/{local}"

    @classmethod
    def parse(cls, text: str) -> "Device":
        """The inverse of ``str``: ``cpu:1``, ``r2/cpu:0``. Raises ValueError."""
        m = _DEVICE_RE.fullmatch(text.strip())
        if not m:
            raise ValueError(f"{text!r} is not a device; write KIND:INDEX or rRANK/KIND:INDEX, "
                             f"e.g. cpu:1 or r1/cpu:0")
        rank, kind, index = m.groups()
        if kind not in DEVICE_KINDS:
            raise ValueError(f"{text!r}: no device kind {kind}; the kinds are "
                             f"{', '.join(DEVICE_KINDS)}")
        return cls(kind, int(index), int(rank or 0))


# (Ranks and indices of at most 18 digits: int() stays cheap and the numbers int64.)
_DEVICE_RE = re.compile(r"(?:r([0-9]{1,18})/)?([a-z]+):([0-9]{1,18})")


CPU0 = Device("cpu", 0, 0)

DEVICE_KINDS = ("cpu", "gpu")


class DistKind(enum.Enum):
    replicated = "replicated"
    split = "split"
    partial = "partial"


@dataclass(frozen=True)
class Distribution:
    """How a logical value is laid out over a group of devices.

    ``replicated``: every device holds the whole tensor; ``split``: each holds a slice
    along ``axis``; ``partial``: each holds a summand of the tensor. Printed as
    ``split(0)[cpu:0,cpu:1]``. Values without one live whole on their single device.
    """

    kind: DistKind
    group: tuple[Device, ...]
    axis: int | None = None

    def __post_init__(self):
        if (self.kind is DistKind.split) != (self.axis is not None):
            raise ValueError("a split distribution needs an axis, others must not have one")
        if not self.group:
            raise ValueError("a distribution needs at least one device")

    def pieces(self, extent: int) -> list[int]:
        """How a split axis of ``extent`` is cut over the group: as evenly as possible,
        the first pieces one larger (numpy.array_split's rule)."""
        base, extra = divmod(extent, len(self.group))
        return [base + (1 if k < extra else 0) for k in range(len(self.group))]

    def local_type(self, type: TensorType, member: int) -> TensorType:
        """The piece of a logical tensor of ``type`` that group member ``member`` holds."""
        if self.kind is not DistKind.split:
            return type
        shape = list(type.shape)
        shape[self.axis] = self.pieces(shape[self.axis])[member]
        return type.with_shape(shape)

    def members_on(self, rank: int) -> list[tuple[int, Device]]:
        """(position in the group, device) of the members that live on ``rank``."""
        return [(k, d) for k, d in enumerate(self.group) if d.rank == rank]

    def __str__(self) -> str:
        head = f"split({self.axis})" if self.kind is DistKind.split else self.kind.value
        return f"{head}[{','.join(str(d) for d in self.group)}]"
