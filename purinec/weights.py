"""A program's variables (params and state) and the arrays given for them."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from purinec.errors import PurinecError
from purinec.ir.graph import Graph, Value
from purinec.ir.types import DType


def variables(*graphs: Graph | None) -> dict[str, Value]:
    """The param and state inputs of ``graphs`` by name; a name the graphs declare
    differently (type or role) is an error, since a program holds one array per name."""
    found: dict[str, Value] = {}
    for graph in graphs:
        if graph is None:
            continue
        for v in graph.inputs_with_role("param", "state"):
            seen = found.setdefault(v.name, v)
            if (seen.role, seen.type) != (v.role, v.type):
                raise PurinecError(f"{v.role} {v.name} is {v.type} in graph {graph.name} but "
                                   f"{seen.role} {seen.type} in another graph of the program")
    return found


def _describe_array(array: np.ndarray) -> str:
    """The array's type as the IR spells it, or NumPy's spelling (e.g. '>f4', '<U3') for
    what the IR cannot hold."""
    try:
        dtype = DType.from_numpy(array.dtype)
        name = str(dtype) if dtype.numpy == array.dtype else array.dtype.str
    except ValueError:
        name = array.dtype.str
    return f"{name}[{','.join(str(d) for d in array.shape)}]"


def check_weights(graphs: list[Graph], role: str, arrays: Mapping[str, np.ndarray]) -> None:
    """Raise unless ``arrays`` holds exactly the graphs' inputs of ``role`` (param or
    state), each with the declared shape and dtype."""
    wanted = {name: v for name, v in variables(*graphs).items() if v.role == role}
    missing = sorted(set(wanted) - set(arrays))
    extra = sorted(set(arrays) - set(wanted))
    if missing or extra:
        raise PurinecError(
            f"the {role} arrays do not match the IR's {role} inputs"
            + (f"; missing {', '.join(missing)}" if missing else "")
            + (f"; not in the IR: {', '.join(extra)}" if extra else ""))
    for name, v in wanted.items():
        array = arrays[name]
        if array.shape != v.type.shape or array.dtype != v.type.dtype.numpy:
            raise PurinecError(f"{role} {name}: the IR declares {v.type}, the array is "
                               f"{_describe_array(array)}")
