"""Purine's bi-graph in Python: blobs, ops, composites and the ``>>`` connector.

A network is a bipartite graph: `Blob` nodes (tensors) and `Op` nodes (registry ops),
joined with ``>>``. Composites (`Graph`, `Layer`, `Net`) own children and give them
hierarchical names (``conv1.weight``) and a `Location` they inherit. Shapes of
intermediate blobs, and of parameters whose shape follows from an input (`Lazy`), are
inferred when the net is lowered to IR (`purinec.bigraph.lower`).

The forms of ``>>`` (a list on the left is an op's inputs, in order)::

    [a, w] >> op              # feeds op; returns its output blob(s), created and named
                              # after op unless bound already
    [a, w] >> op >> [b]       # ... and names the output b (binds it)
    a >> relu >> ip           # chains: outputs of one become inputs of the next
    layer1 >> layer2          # the tops of layer1 become the bottoms of layer2
    x >> ip2 >> Blob("logits")  # names a layer's top

Feeding a computation returns its outputs: a `Blob`, or `Blobs` (a tuple) for several.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

from purinec.errors import ModelError, PurinecError, ShapeError, UnknownOpError
from purinec.ir.graph import NAME_RE, stable_topological_order
from purinec.ir.init import check_init
from purinec.ir.types import DEVICE_KINDS, Device, DType

# One path component: the full hierarchical name (``inc3a.1x1.weight``) must also match
# the IR's NAME_RE, so top-level names start with a letter or '_'.
COMPONENT_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-]*")

ROLES = (None, "data", "param", "state")


class LayerShapeError(ModelError, ShapeError):
    """A shape error found while lowering, naming the layer and its source line.
    Both a `ModelError` and a `ShapeError`."""


# ---------------------------------------------------------------------------------------
# Locations


@dataclass(frozen=True)
class Location:
    """Where an op runs and a blob lives: a process rank and a device on it."""

    rank: int = 0
    kind: str = "cpu"
    index: int = 0

    def __post_init__(self):
        if self.kind not in DEVICE_KINDS:
            raise ModelError(f"unknown device kind {self.kind!r} in Location; "
                             f"use one of {', '.join(DEVICE_KINDS)}")
        for what, v in (("rank", self.rank), ("index", self.index)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ModelError(f"Location {what} must be a non-negative int, got {v!r}")

    @property
    def device(self) -> Device:
        return Device(self.kind, self.index, self.rank)

    @staticmethod
    def of(value) -> "Location | None":
        """``value`` as a Location: None, a Location, a Device, or its name ("r1/cpu:0")."""
        if value is None or isinstance(value, Location):
            return value
        if isinstance(value, str):  # as the command line writes devices
            try:
                value = Device.parse(value)
            except ValueError as err:
                raise ModelError(f"location {err}") from None
        if isinstance(value, Device):
            return Location(value.rank, value.kind, value.index)
        raise ModelError(f"expected a location: a Location, a Device, or a device name such "
                         f"as 'cpu:1' or 'r1/cpu:0'; got {value!r}")

    def __str__(self) -> str:
        return str(self.device)


DEFAULT_LOCATION = Location()


# ---------------------------------------------------------------------------------------
# Shapes known only at lowering


class Lazy:
    """A value (a parameter's shape, an op attribute) computed during lowering from the
    shapes of blobs: ``Lazy(lambda shape: (n, shape(x)[1], 3, 3))``. ``shape(blob)``
    returns the blob's inferred shape as a tuple. Raise `ShapeError` for bad inputs."""

    def __init__(self, fn: Callable[[Callable[["Blob"], tuple]], Any], doc: str = ""):
        self.fn = fn
        self.doc = doc

    def __call__(self, shape_of: Callable[["Blob"], tuple]) -> Any:
        return self.fn(shape_of)

    def __repr__(self) -> str:
        return f"Lazy({self.doc or '...'})"


# ---------------------------------------------------------------------------------------
# Creation scopes, source lines, serial numbers

_SERIAL = itertools.count()
_STATE = threading.local()

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ZOO_DIR = os.path.join(_PKG_DIR, "models")
_INTERNAL_CACHE: dict[str, bool] = {}


def _scopes() -> list:
    if not hasattr(_STATE, "scopes"):
        _STATE.scopes = []
        _STATE.loc_override = []
    return _STATE.scopes


def _loc_overrides() -> list:
    _scopes()
    return _STATE.loc_override


def _internal(filename: str) -> bool:
    """Frames of purinec itself, except the model zoo (whose lines are user-like)."""
    hit = _INTERNAL_CACHE.get(filename)
    if hit is None:
        path = os.path.abspath(filename)
        hit = path.startswith(_PKG_DIR + os.sep) and not path.startswith(_ZOO_DIR + os.sep)
        _INTERNAL_CACHE[filename] = hit
    return hit


def source_loc(element: object = None) -> str | None:
    """``file.py:LINE`` of the first stack frame outside purinec (the zoo counts as
    outside), skipping the constructors of ``element`` (a user's Layer subclass), or the
    source line of the built-in layer now building its body."""
    overrides = _loc_overrides()
    if overrides:
        return overrides[-1]
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _internal(filename) and not (
                element is not None and frame.f_code.co_name == "__init__"
                and frame.f_code.co_argcount > 0
                and frame.f_locals.get(frame.f_code.co_varnames[0]) is element):
            return f"{os.path.basename(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


# ---------------------------------------------------------------------------------------
# Elements


class Element:
    """A node of the bi-graph or a composite: named, placed, with a source line."""

    kind = "element"

    def __init__(self, name: str | None, location=None, *, _auto_name: str | None = None):
        self._serial = next(_SERIAL)
        self.loc: str | None = source_loc(self)
        self.parent: Graph | None = None
        self._location: Location | None = Location.of(location)
        self.auto_named = name is None
        if name is None:
            name = _auto_name
        if not isinstance(name, str):
            raise ModelError(f"{self.kind} name must be a string, got {name!r}"
                             f"{self._at()}")
        self.name = name
        if not self.auto_named:
            self._check_name()
        scope = current_scope()
        if scope is not None and not isinstance(self, Net):
            scope._adopt(self)

    # -- naming ---------------------------------------------------------------------

    @property
    def path(self) -> str:
        """The hierarchical name; the IR name of a blob. The net's name is not part."""
        return self.name if self.parent is None else self.parent._prefix + self.name

    def _at(self) -> str:
        return f" ({self.loc})" if self.loc else ""

    def describe(self) -> str:
        """``layer conv1 (lenet.py:12)``: how error messages name this element."""
        return f"{self.kind} {self.path}{self._at()}"

    def _check_name(self) -> None:
        if not COMPONENT_RE.fullmatch(self.name):
            raise ModelError(f"bad {self.kind} name {self.name!r}{self._at()}: a name is "
                             f"letters, digits, '_' and '-' (no '.', which purinec adds "
                             f"between levels)")

    def root(self) -> "Element":
        el = self
        while el.parent is not None:
            el = el.parent
        return el

    # -- placement ------------------------------------------------------------------

    @property
    def location(self) -> Location:
        """Own location if set, else inherited (from the producer for produced blobs,
        else from the parent), else cpu:0 on rank 0."""
        if self._location is not None:
            return self._location
        source = self._location_source()
        return source.location if source is not None else DEFAULT_LOCATION

    def _location_source(self) -> "Element | None":
        return self.parent

    def at(self, location) -> "Element":
        """Place this element (and, for composites, every child not placed itself)."""
        self._location = Location.of(location)
        return self

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.path}{self._at()}>"

    # -- >> -------------------------------------------------------------------------

    def __rshift__(self, other):
        return connect(self, other)

    def __rrshift__(self, other):
        return connect(other, self)


def _check_path(el: Element) -> None:
    if not NAME_RE.fullmatch(el.path):
        raise ModelError(f"bad {el.kind} name {el.path!r}{el._at()}: a full name must start "
                         f"with a letter or '_' (names like '1x1' are fine inside a layer)")


class Blob(Element):
    """A data tensor node.

    ``role``: ``"data"`` (fed each run), ``"param"`` (learned, filled by ``init``),
    ``"state"`` (kept between runs), or None: an intermediate if an op produces it, else
    a data input. ``shape`` may be `Lazy` (parameters whose shape follows an input).
    """

    kind = "blob"

    def __init__(self, name: str | None = None, shape=None, dtype: str = "f32",
                 role: str | None = None, init: str | None = None, *, location=None,
                 _auto_name: str | None = None):
        super().__init__(name, location, _auto_name=_auto_name)
        if role not in ROLES:
            raise ModelError(f"blob {self.path}{self._at()}: role must be one of "
                             f"'data', 'param', 'state' or None, got {role!r}")
        try:
            self.dtype = DType(str(dtype))
        except ValueError:
            raise ModelError(f"blob {self.path}{self._at()}: unknown dtype {dtype!r}; use "
                             f"one of {', '.join(d.value for d in DType)}") from None
        if shape is not None and not isinstance(shape, Lazy):
            try:
                shape = tuple(int(d) for d in shape)
            except (TypeError, ValueError):
                raise ModelError(f"blob {self.path}{self._at()}: shape must be a tuple of "
                                 f"ints, got {shape!r}") from None
            if any(d < 0 for d in shape):
                raise ModelError(f"blob {self.path}{self._at()}: negative size in shape "
                                 f"{shape}")
        if init is not None and role not in ("param", "state"):
            raise ModelError(f"blob {self.path}{self._at()}: only params and state take an "
                             f"init, not role {role!r}")
        if init is not None:
            try:
                check_init(init, self.dtype)
            except PurinecError as err:
                raise ModelError(f"blob {self.path}{self._at()}: {err}") from None
        self.shape = shape
        self.role = role
        self.init = init
        self.producer: Op | None = None
        self.consumers: list[Op] = []
        self.auto = _auto_name is not None and name is None  # created by >>
        self._top_of: list[Layer] = []
        self._merged_into: Blob | None = None

    def _location_source(self):
        return self.producer if self.producer is not None else self.parent

    @property
    def is_input(self) -> bool:
        """Whether this blob is a graph input (data, param or state) rather than an
        op's output."""
        return self.producer is None

    def describe(self) -> str:
        return f"blob {self.path}{self._at()}"


class Blobs(tuple):
    """Several output blobs, as returned by ``>>``; can itself be used with ``>>``."""

    def __rshift__(self, other):
        return connect(self, other)

    def __rrshift__(self, other):
        return connect(other, self)


def resolve(blob: Blob) -> Blob:
    """Follow the renames made by binding (``x >> op >> Blob("y")``)."""
    while blob._merged_into is not None:
        blob = blob._merged_into
    return blob


def _pack(blobs: Sequence[Blob]):
    return blobs[0] if len(blobs) == 1 else Blobs(blobs)


# Number of outputs of registry ops that do not have exactly one.
def _registry_outputs(op_name: str, attrs: dict) -> int:
    if op_name == "split":
        sections = attrs.get("sections")
        return len(sections) if isinstance(sections, (list, tuple)) else 1
    if op_name == "sgd":
        return 2
    return 1


class Op(Element):
    """An operator node: one op of the registry (`purinec.ir.ops`) with attributes.

    Attribute values may be `Lazy`. Unnamed ops are named after the op (``relu``,
    ``relu_1``, ...); outputs created automatically are named after the op.
    """

    kind = "op"
    virtual = False  # True for ops lowered specially (not in the registry)

    def __init__(self, op_name: str, name: str | None = None, *, location=None, **attrs):
        self.op_name = op_name
        self.attrs = dict(attrs)
        self.inputs: list[Blob] | None = None
        self._outputs: list[Blob] | None = None
        super().__init__(name, location, _auto_name=op_name)
        if not self.virtual:
            try:
                opdef = _get_op(op_name)
            except UnknownOpError as e:
                raise ModelError(f"{self.describe()}: {e}") from None
            unknown = set(attrs) - set(opdef.attrs)
            if unknown:
                raise ModelError(f"{self.describe()}: op {op_name} has no attribute(s) "
                                 f"{', '.join(sorted(unknown))}; it takes: "
                                 f"{', '.join(opdef.attrs) or 'none'}")

    # -- arity ----------------------------------------------------------------------

    def arity(self) -> tuple[int, int | None]:
        """(least, most) number of inputs; most None for variadic ops."""
        opdef = _get_op(self.op_name)
        n = len(opdef.inputs)
        return (n, None) if opdef.variadic else (n, n)

    def n_outputs(self) -> int:
        return _registry_outputs(self.op_name, self.attrs)

    def input_names(self) -> str:
        return ", ".join(_get_op(self.op_name).inputs)

    # -- connecting -----------------------------------------------------------------

    @property
    def outputs(self) -> list[Blob]:
        """The output blobs, created (named after the op) if not bound yet."""
        if self._outputs is None:
            n = self.n_outputs()
            names = [self.name] if n == 1 else [f"{self.name}_{i}" for i in range(n)]
            with _scope_of(self.parent):
                blobs = []
                for nm in names:
                    blob = Blob(None, _auto_name=nm)
                    blob.loc = self.loc
                    blobs.append(blob)
            for b in blobs:
                b.producer = self
            self._outputs = blobs
        return self._outputs

    def connect(self, inputs: Sequence[Blob]) -> list[Blob]:
        """Set this op's inputs (in order); returns its outputs."""
        if self.inputs is not None:
            raise ModelError(f"{self.describe()} already has inputs "
                             f"({', '.join(b.path for b in self.inputs)})")
        inputs = [resolve(b) for b in inputs]
        lo, hi = self.arity()
        if len(inputs) < lo or (hi is not None and len(inputs) > hi):
            want = f"at least {lo}" if hi is None else str(lo) if lo == hi else f"{lo} to {hi}"
            raise ModelError(f"{self.describe()}: {self.op_name} takes {want} input(s) "
                             f"({self.input_names()}), got {len(inputs)}")
        self.inputs = inputs
        for b in inputs:
            b.consumers.append(self)
        return self.outputs

    def bind(self, blobs: Sequence[Blob]) -> None:
        """Name this op's outputs: ``op >> [b]``."""
        blobs = [resolve(b) for b in blobs]
        n = self.n_outputs()
        if len(blobs) != n:
            raise ModelError(f"{self.describe()}: {self.op_name} has {n} output(s), "
                             f"cannot bind {len(blobs)} blob(s)")
        if self._outputs is None:
            for b in blobs:
                _check_bindable(b, self)
            for b in blobs:
                b.producer = self
            self._outputs = list(blobs)
        else:
            for old, new in zip(list(self._outputs), blobs):
                _merge(old, new)

    # -- lowering -------------------------------------------------------------------

    def lower(self, ctx, inputs: list) -> list:
        """Emit IR for this op into the lowering context ``ctx`` (see
        `purinec.bigraph.lower.Lowering`); returns one IR value per output blob."""
        return ctx.emit(self, self.op_name, inputs, ctx.resolve_attrs(self),
                        [b.path for b in self.outputs])

    @property
    def layer(self) -> "Graph | None":
        """The innermost layer this op belongs to, if any."""
        return self.parent if isinstance(self.parent, Layer) else None

    def blame(self) -> str:
        """How errors found in this op name it: its layer (and line), else itself."""
        return self.layer.describe() if self.layer is not None else self.describe()


def _get_op(name: str):
    from purinec.ir.ops import get_op

    return get_op(name)


def _check_bindable(new: Blob, producer: Op) -> None:
    if new.producer is not None and new.producer is not producer:
        raise ModelError(f"{new.describe()} is produced twice: by {new.producer.blame()} "
                         f"and by {producer.blame()}")
    if new.role is not None:
        raise ModelError(f"{new.describe()} is a {new.role} blob and cannot be the output of "
                         f"{producer.blame()}")


def _merge(old: Blob, new: Blob) -> None:
    """Replace ``old`` (an output created automatically, or a layer's result) by
    ``new`` everywhere: as an output, an input, and a layer's top."""
    old, new = resolve(old), resolve(new)
    if old is new:
        return
    if old.producer is not None:
        _check_bindable(new, old.producer)
    elif new.producer is not None:
        raise ModelError(f"{new.describe()} is already produced by {new.producer.blame()}")
    if new.role is not None:
        raise ModelError(f"{new.describe()} is a {new.role} blob; it cannot name an output")
    if old.producer is not None:
        outs = old.producer._outputs
        outs[outs.index(old)] = new
        new.producer = old.producer
    for op in old.consumers:
        op.inputs = [new if b is old else b for b in op.inputs]
        new.consumers.append(op)
    for layer in old._top_of:
        layer._top = [new if b is old else b for b in layer._top]
        new._top_of.append(layer)
    if old.parent is not None:
        old.parent._forget(old)
    old.producer, old.consumers, old._top_of = None, [], []
    old._merged_into = new


# ---------------------------------------------------------------------------------------
# Composites


class Graph(Element):
    """A composite: a namespace of children (blobs, ops, sub-composites) with ``bottom``
    and ``top`` blob lists. Used as a context manager, elements created inside become
    its children: ``with Graph("tower").at(Location(kind="gpu")): ...``."""

    kind = "graph"

    def __init__(self, name: str, *, location=None):
        self.children: list[Element] = []
        self._blobs: dict[str, Blob] = {}
        self._nodes: dict[str, Element] = {}
        self._bottom: list[Blob] = []
        self._top: list[Blob] | None = None
        super().__init__(name, location)

    @property
    def _prefix(self) -> str:
        return self.path + "."

    @property
    def bottom(self) -> list[Blob]:
        return [resolve(b) for b in self._bottom]

    @property
    def top(self) -> list[Blob]:
        return list(self._top or [])

    # -- children -------------------------------------------------------------------

    def __enter__(self):
        _scopes().append(self)
        return self

    def __exit__(self, *exc):
        scopes = _scopes()
        assert scopes and scopes[-1] is self, "unbalanced bigraph scopes"
        scopes.pop()
        return False

    def add(self, *elements: Element) -> None:
        """Make elements created elsewhere children of this composite."""
        for el in elements:
            if el.parent is self:
                continue
            if el.parent is not None:
                raise ModelError(f"{el.describe()} already belongs to {el.parent.describe()}")
            self._adopt(el)

    def _adopt(self, el: Element) -> None:
        table = self._blobs if isinstance(el, Blob) else self._nodes
        if el.auto_named:
            el.name = self._fresh(el.name, isinstance(el, Blob))
            if isinstance(el, Op) and el._outputs is not None:
                for i, b in enumerate(el._outputs):
                    if b.auto and b.parent is None:
                        b.name = el.name if len(el._outputs) == 1 else f"{el.name}_{i}"
        elif el.name in table:
            other = table[el.name]
            raise ModelError(f"duplicate name {self._prefix + el.name!r}: {el.kind} "
                             f"{el.name}{el._at()} clashes with {other.describe()}")
        el.parent = self
        if not el.auto_named:
            _check_path(el)
        table[el.name] = el
        self.children.append(el)

    def _fresh(self, base: str, blob: bool) -> str:
        """``base``, ``base_1``, ...: unused by blobs and (for ops) by ops and layers."""
        def taken(n):
            return n in self._blobs or (not blob and n in self._nodes)
        name, i = base, 0
        while taken(name):
            i += 1
            name = f"{base}_{i}"
        return name

    def _forget(self, el: Element) -> None:
        table = self._blobs if isinstance(el, Blob) else self._nodes
        if table.get(el.name) is el:
            del table[el.name]
        self.children = [c for c in self.children if c is not el]
        el.parent = None

    def descendants(self) -> Iterator[Element]:
        for child in self.children:
            yield child
            if isinstance(child, Graph):
                yield from child.descendants()

    def find(self, path: str) -> Element:
        """The descendant with this full name (ops and layers before blobs)."""
        for el in self.descendants():
            if el.path == path and not isinstance(el, Blob):
                return el
        for el in self.descendants():
            if el.path == path:
                return el
        raise KeyError(path)

    def blob(self, path: str) -> Blob:
        for el in self.descendants():
            if isinstance(el, Blob) and el.path == path:
                return el
        raise KeyError(path)

    def params(self) -> list[Blob]:
        """Parameter blobs among the descendants, in creation order."""
        return sorted((el for el in self.descendants()
                       if isinstance(el, Blob) and el.role == "param"),
                      key=lambda b: b._serial)


class _NullScope:
    def __enter__(self):
        _scopes().append(None)

    def __exit__(self, *exc):
        _scopes().pop()
        return False


def _scope_of(graph: Graph | None):
    return graph if graph is not None else _NullScope()


def current_scope() -> "Graph | None":
    """The composite that elements created now become children of (None: none)."""
    scopes = _scopes()
    return scopes[-1] if scopes else None


class Layer(Graph):
    """A composite that builds its forward ops when its bottoms are connected.

    Subclasses set ``n_bottom`` (an int, or ``(least, most)`` with most None for any
    number) and implement ``build(*bottom)``, creating children (they become this
    layer's) and returning the blob(s) that become the layer's tops. Tops exist
    before the layer is connected and are named after the layer (``conv1``, or
    ``split1_0``, ``split1_1`` for several), in the layer's parent namespace.
    """

    kind = "layer"
    n_bottom: int | tuple[int, int | None] = 1

    def __init__(self, name: str, *, location=None):
        super().__init__(name, location=location)
        self._connected = False

    def n_top(self) -> int:
        return 1

    @property
    def top(self) -> list[Blob]:
        if self._top is None:
            n = self.n_top()
            names = [self.name] if n == 1 else [f"{self.name}_{i}" for i in range(n)]
            with _scope_of(self.parent):
                tops = []
                for nm in names:
                    blob = Blob(None, _auto_name=nm)
                    blob.loc = self.loc
                    blob._top_of.append(self)
                    tops.append(blob)
            self._top = tops
        return list(self._top)

    def param(self, name: str, shape, init: str | None = None, dtype: str = "f32") -> Blob:
        """Create a parameter blob owned by this layer."""
        with self:
            return Blob(name, shape, dtype, role="param", init=init)

    def build(self, *bottom: Blob):
        raise NotImplementedError(f"{type(self).__name__} must implement build()")

    def connect(self, bottoms: Sequence[Blob]) -> list[Blob]:
        """Set the bottoms and build the body; returns the tops."""
        if self._connected:
            raise ModelError(f"{self.describe()} is already connected (to "
                             f"{', '.join(b.path for b in self.bottom)}); "
                             f"create another layer to apply it again")
        bottoms = [resolve(b) for b in bottoms]
        lo, hi = (self.n_bottom, self.n_bottom) if isinstance(self.n_bottom, int) \
            else self.n_bottom
        if len(bottoms) < lo or (hi is not None and len(bottoms) > hi):
            want = (f"at least {lo}" if hi is None else str(lo) if lo == hi
                    else f"{lo} to {hi}")
            raise ModelError(f"{self.describe()} takes {want} input(s), got {len(bottoms)}"
                             f" ({', '.join(b.path for b in bottoms) or 'none'})")
        tops = self.top
        self._bottom = list(bottoms)
        self._connected = True
        builtin = type(self).__module__.startswith("purinec.bigraph")
        overrides = _loc_overrides()
        if builtin:
            overrides.append(self.loc)
        try:
            with self:
                result = self.build(*bottoms)
        finally:
            if builtin:
                overrides.pop()
        if isinstance(result, Blob):
            result = [result]
        result = [resolve(b) for b in _flatten(result, f"{self.describe()}: build()")]
        if len(result) != len(tops):
            raise ModelError(f"{self.describe()}: build() returned {len(result)} blob(s) "
                             f"for {len(tops)} top(s)")
        for res, top in zip(result, self.top):
            if res in bottoms or res.producer is None:
                raise ModelError(f"{self.describe()}: build() must return blobs its ops "
                                 f"produce, not {res.describe()}")
            _merge(res, top)
        return self.top

    @property
    def connected(self) -> bool:
        return self._connected


class Net(Graph):
    """The top-level composite; its name names the IR graph and is not a prefix.

    Inputs follow Caffe's convention: data blobs ``data`` (f32) and ``label`` (i32,
    shape (batch,)); the last layer's output is ``logits``, the training loss
    ``loss``, optionally ``accuracy``. ``outputs`` lists what the net returns; if not
    set, the blobs named ``loss``, ``accuracy`` and ``logits``, else the unused ones.
    """

    kind = "net"

    def __init__(self, name: str, *, location=None, outputs=None):
        super().__init__(name, location=location)
        self._outputs: list[Blob] | None = None
        if outputs is not None:
            self.outputs = outputs

    def _check_name(self) -> None:
        if not isinstance(self.name, str) or not NAME_RE.fullmatch(self.name):
            raise ModelError(f"bad net name {self.name!r}{self._at()}: it must start with a "
                             f"letter or '_' and hold letters, digits, '_', '-' and '.'")

    @property
    def _prefix(self) -> str:
        return ""

    @property
    def path(self) -> str:
        return self.name

    def describe(self) -> str:
        return f"net {self.name}{self._at()}"

    @property
    def outputs(self) -> list[Blob] | None:
        """The declared outputs (None if not declared)."""
        return None if self._outputs is None else [resolve(b) for b in self._outputs]

    @outputs.setter
    def outputs(self, value) -> None:
        self._outputs = _sources(value, f"{self.describe()}: outputs")

    @property
    def top(self) -> list[Blob]:
        return self.outputs or []

    @property
    def bottom(self) -> list[Blob]:
        return [b for b in self.descendants() if isinstance(b, Blob) and b.producer is None
                and b.role in (None, "data") and not b._top_of]

    def structure(self) -> "NetStructure":
        """Validate the net and return its ops in topological order (see `analyze`)."""
        return analyze(self)


# ---------------------------------------------------------------------------------------
# >>


def _flatten(items, what: str) -> list[Blob]:
    out: list[Blob] = []
    for item in items:
        if isinstance(item, (list, tuple)):
            out.extend(_flatten(item, what))
        else:
            out.extend(_sources(item, what))
    return out


def _sources(item, what: str = ">>") -> list[Blob]:
    """The blobs an item stands for on the left of ``>>``."""
    if isinstance(item, Blob):
        return [resolve(item)]
    if isinstance(item, Op):
        return list(item.outputs)
    if isinstance(item, Graph):
        return item.top
    if isinstance(item, (list, tuple)):
        return _flatten(item, what)
    raise ModelError(f"{what}: expected a Blob, an Op, a layer or a list of them, "
                     f"got {type(item).__name__} {item!r}")


def connect(left, right):
    """``left >> right``. Returns the outputs of ``right`` (or ``right`` when it
    names outputs)."""
    if isinstance(right, Op):
        return _pack(right.connect(_sources(left)))
    if isinstance(right, Layer):
        return _pack(right.connect(_sources(left)))
    if isinstance(right, Graph):
        raise ModelError(f"{right.describe()} cannot take inputs with >>; only ops and "
                         f"layers can")
    if isinstance(right, Blob) or (isinstance(right, (list, tuple)) and right
                                   and all(isinstance(b, Blob) for b in right)):
        targets = [right] if isinstance(right, Blob) else list(right)
        if isinstance(left, Op):
            left.bind(targets)
            return right
        sources = _sources(left)
        if len(sources) != len(targets):
            raise ModelError(f"cannot name {len(sources)} output(s) "
                             f"({', '.join(b.path for b in sources)}) with {len(targets)} "
                             f"blob(s) ({', '.join(b.path for b in targets)})")
        for src, dst in zip(sources, targets):
            if not (src.auto or src._top_of) or src.role is not None:
                raise ModelError(
                    f"cannot connect {src.describe()} to {resolve(dst).describe()}: a blob "
                    f"feeds ops and layers; '>> Blob(...)' only names an output that >> "
                    f"created")
            _merge(src, dst)
        return right
    raise ModelError(f">>: cannot connect {type(left).__name__} to "
                     f"{type(right).__name__} {right!r}; the right side must be an Op, a "
                     f"layer, a Blob or a list of Blobs")


# ---------------------------------------------------------------------------------------
# Analysis: collect, validate, order


@dataclass
class NetStructure:
    """A validated net: its ops in topological order and its blobs in creation order."""

    net: Net
    ops: list[Op]
    blobs: list[Blob]
    outputs: list[Blob]

    def inputs(self) -> list[Blob]:
        return [b for b in self.blobs if b.producer is None and b.consumers]


def _collect(net: Net) -> tuple[list[Op], list[Blob], list[Layer]]:
    seen: set[int] = set()
    ops: list[Op] = []
    blobs: list[Blob] = []
    graphs: list[Graph] = []
    stack: list[Element] = list(net.children) + list(net._outputs or [])
    while stack:
        el = stack.pop()
        if isinstance(el, Blob):
            el = resolve(el)
        if id(el) in seen or el is net or isinstance(el, Net):
            continue
        seen.add(id(el))
        if el.parent is not None:
            stack.append(el.parent)
        if isinstance(el, Blob):
            blobs.append(el)
            if el.producer is not None:
                stack.append(el.producer)
            stack.extend(el.consumers)
            stack.extend(el._top_of)
        elif isinstance(el, Op):
            ops.append(el)
            stack.extend(el.inputs or [])
            stack.extend(el._outputs or [])
        elif isinstance(el, Graph):
            graphs.append(el)
            stack.extend(el.children)
            stack.extend(el._bottom)
            stack.extend(el._top or [])
    # Adopt what was created outside any scope; refuse what belongs to another net.
    for el in sorted(itertools.chain(ops, blobs, graphs), key=lambda e: e._serial):
        root = el.root()
        if root is net:
            continue
        if isinstance(root, Net):
            raise ModelError(f"{el.describe()} belongs to {root.describe()}, not to "
                             f"{net.describe()}")
        if el.parent is None:
            net._adopt(el)
    key = lambda e: e._serial  # noqa: E731
    return sorted(ops, key=key), sorted(blobs, key=key), sorted(graphs, key=key)


def _default_outputs(blobs: list[Blob]) -> list[Blob]:
    named = {b.path: b for b in blobs}
    outs = [named[n] for n in ("loss", "accuracy", "logits") if n in named]
    if outs:
        return outs
    return [b for b in blobs if b.producer is not None and not b.consumers]


def analyze(net: Net) -> NetStructure:
    """Collect every element reachable from ``net``, adopt orphans, and check names,
    connections and acyclicity. Raises `ModelError` naming the element and line."""
    ops, blobs, graphs = _collect(net)
    # Names: valid, and unique per kind (blobs are values; ops and layers are nodes).
    for table in (blobs, [*ops, *graphs]):
        by_path: dict[str, Element] = {}
        for el in table:
            _check_path(el)
            other = by_path.get(el.path)
            if other is not None:
                raise ModelError(f"duplicate name {el.path!r}: {other.describe()} and "
                                 f"{el.describe()}")
            by_path[el.path] = el
    for g in graphs:
        if isinstance(g, Layer) and not g.connected and g._top and any(
                resolve(t).consumers for t in g._top):
            raise ModelError(f"{g.describe()} is not connected: its output is used but "
                             f"nothing feeds it (write `x >> layer`)")
    for op in ops:
        if op.inputs is None and op.arity()[0] > 0:
            raise ModelError(f"{op.blame()}: op {op.path} has no inputs connected "
                             f"(write `[a, b] >> op`)")
    for blob in blobs:
        if blob.producer is None and blob.consumers:
            user = blob.consumers[0].blame()
            if blob._top_of:
                layer = blob._top_of[0]
                raise ModelError(f"{layer.describe()} is not connected: its output is used "
                                 f"by {user} but nothing feeds it (write `x >> layer`)")
            if blob.role is None and blob.shape is None:
                raise ModelError(f"{blob.describe()} is used by {user} but nothing produces "
                                 f"it and it has no shape; connect it to an op's output, or "
                                 f"give Blob(..., shape=...) to make it an input")
        if blob.producer is not None:
            if blob.role is not None:
                raise ModelError(f"{blob.describe()} is a {blob.role} blob but "
                                 f"{blob.producer.blame()} produces it")
            if blob._location is not None and blob._location != blob.producer.location:
                raise ModelError(f"{blob.describe()} is placed at {blob._location} but "
                                 f"{blob.producer.blame()}, which produces it, runs at "
                                 f"{blob.producer.location}; place the op instead")
    ordered = _topo_order(ops)
    outputs = net.outputs
    if outputs is None:
        outputs = _default_outputs(blobs)
    known = {id(b) for b in blobs}
    for b in outputs:
        if id(b) not in known:
            raise ModelError(f"{net.describe()}: output {b.describe()} is not part of the "
                             f"net")
    dedup: list[Blob] = []
    for b in outputs:
        if b.producer is None and b._top_of:
            raise ModelError(f"{b._top_of[0].describe()} is not connected, but its output "
                             f"{b.path} is an output of {net.describe()}")
        if b not in dedup:
            dedup.append(b)
    return NetStructure(net, ordered, blobs, dedup)


def _topo_order(ops: list[Op]) -> list[Op]:
    """A topological order, ties broken by creation order; a cycle is a ModelError."""
    index = {id(op): i for i, op in enumerate(ops)}
    succs: list[list[int]] = [[] for _ in ops]
    for i, op in enumerate(ops):
        for b in op.inputs or []:
            if b.producer is not None:
                succs[index[id(b.producer)]].append(i)
    order = [ops[i] for i in stable_topological_order([op._serial for op in ops], succs)]
    if len(order) != len(ops):
        placed = {id(op) for op in order}
        stuck = [op for op in ops if id(op) not in placed]
        raise ModelError("the net has a cycle through "
                         + ", ".join(op.blame() for op in stuck[:4])
                         + (" ..." if len(stuck) > 4 else ""))
    return order


def label_dependent(structure: NetStructure, names: Iterable[str] = ("label",)) -> set[int]:
    """ids of the ops and blobs that depend on a data input named ``label``."""
    names = set(names)
    tainted: set[int] = {id(b) for b in structure.blobs
                         if b.producer is None and b.role in (None, "data") and b.path in names}
    for op in structure.ops:
        if any(id(b) in tainted for b in op.inputs or []):
            tainted.add(id(op))
            tainted.update(id(b) for b in op.outputs)
    return tainted
