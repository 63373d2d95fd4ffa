"""Argument checks shared by the zoo builders."""

from __future__ import annotations

from purinec.errors import ModelError


def check_args(model: str, batch, input_shape,
               num_classes) -> tuple[int, tuple[int, int, int], int]:
    """Validate a builder's arguments; returns them normalised."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ModelError(f"{model}: batch must be a positive int, got {batch!r}")
    try:
        shape = tuple(int(d) for d in input_shape)
    except (TypeError, ValueError):
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ModelError(f"{model}: input_shape must be (C, H, W) with positive sizes, "
                         f"got {input_shape!r}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ModelError(f"{model}: num_classes must be an int >= 2, got {num_classes!r}")
    return batch, shape, num_classes
