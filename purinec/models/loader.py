"""``load_model``: a zoo name or a Python file defining ``build(batch, ...)``."""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import sys
import traceback
import types
from typing import Callable, Iterable

from purinec.bigraph import Net
from purinec.errors import ModelError, PurinecError
from purinec.models.zoo import ZOO


def load_model(spec: str, batch: int | None = None, **kwargs) -> Net:
    """Build a `Net` from ``spec``: a name in `ZOO` or a path to a ``.py`` file that
    defines ``build(batch, ...)``. ``batch`` None means the builder's default;
    every keyword must be one the builder takes (see `offered_args`)."""
    build, where, path = _resolved(spec)
    return _call(build, batch, kwargs, where, path)


def check_model(spec: str, batch: int | None = None, given_later: Iterable[str] = ()) -> None:
    """Build ``spec`` once at its own defaults, so that a broken model is reported before
    slow work (train checks it before loading its data set). A builder that cannot be
    called without one of ``given_later`` (arguments its caller passes once it knows
    them, such as a data set's input_shape) is only looked up, its file run."""
    build, where, path = _resolved(spec)
    try:
        params = inspect.signature(build).parameters
    except (TypeError, ValueError):
        params = {}
    if any(params[name].default is inspect.Parameter.empty
           for name in given_later if name in params):
        return
    _call(build, batch, {}, where, path)


def _resolved(spec: str) -> tuple[Callable, str, str | None]:
    """The builder ``spec`` names, how messages name it, and its file (None for a zoo
    model)."""
    if not isinstance(spec, str) or not spec:
        raise ModelError(f"a model is a zoo name or a .py file, got {spec!r}")
    if spec in ZOO:
        return ZOO[spec], f"model {spec}", None
    if spec.endswith(".py") or "/" in spec or os.sep in spec or os.path.exists(spec):
        return _load_file(spec), f"build() in {spec}", spec
    raise ModelError(f"unknown model {spec!r}; the zoo has {', '.join(sorted(ZOO))}, or give "
                     f"the path of a .py file that defines build(batch, ...)")


def offered_args(spec: str, offered: dict) -> dict:
    """Those of ``offered`` (keyword arguments a caller would pass if wanted, such as the
    data set's input_shape and num_classes) that the builder of ``spec`` takes."""
    try:
        params = inspect.signature(_builder(spec)).parameters
    except (TypeError, ValueError):
        return dict(offered)
    return {key: value for key, value in offered.items() if _takes_keyword(params, key)}


def _takes_keyword(params, key: str) -> bool:
    """Whether a builder with signature ``params`` takes ``key`` as a keyword."""
    return key in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def default_input_shape(spec: str) -> tuple[int, ...] | None:
    """The ``input_shape`` a zoo model or a Python file's build() takes when given none
    (None if it declares no default)."""
    build = _builder(spec)
    try:
        parameter = inspect.signature(build).parameters.get("input_shape")
    except (TypeError, ValueError):
        return None
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return None
    return tuple(parameter.default)


def _builder(spec: str) -> Callable:
    """The zoo builder named ``spec``, or the build() of the Python file at ``spec``."""
    return _resolved(spec)[0]


def _load_file(spec: str) -> Callable:
    path = os.path.abspath(spec)
    if not os.path.exists(path):
        raise ModelError(f"model file {spec} does not exist")
    if not os.path.isfile(path):
        raise ModelError(f"model file {spec} is not a file")
    if not path.endswith(".py"):  # whatever else it holds is never run
        raise _not_a_model_file(spec, path)
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ModelError(f"cannot read model file {spec}: {e}") from None
    return _executed(path, spec, source)


# Files that are not model files, recognized by their first bytes (whatever they are
# named) or else by their suffix: what each is, and what it is for.
NUMPY_MAGIC = b"\x93NUMPY"
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")  # a zip's first member, or an empty zip
NOT_MODEL_FILES = {
    ".npy": ("a NumPy array", "an input: purinec run MODEL --input NAME=FILE.npy"),
    ".npz": ("a NumPy archive", "arrays, such as purinec run --output writes"),
    ".purine": ("a compiled artifact", "load it with purinec.load; purinec run and train "
                                       "take it as it is"),
    ".zip": ("a zip archive", "a compiled artifact must be named FILE.purine"),
    ".pir": ("IR text", "compile it with purinec.compile; load_model builds zoo models "
                        "and .py files"),
}


def _not_a_model_file(spec: str, path: str) -> ModelError:
    """Why the file at ``path`` is not run: only a Python file named .py is a model file
    (running any other file would run whatever it holds); what it is, where that shows."""
    kinds = (f"a model is a zoo name ({', '.join(sorted(ZOO))}), a Python file NAME.py that "
             f"defines build(batch, ...), or a .pir IR file")
    try:
        with open(path, "rb") as f:
            head = f.read(len(NUMPY_MAGIC))
    except OSError:
        head = b""
    suffix = os.path.splitext(path)[1].lower()
    if head.startswith(NUMPY_MAGIC):
        suffix = ".npy"
    elif head.startswith(ZIP_MAGICS) and suffix not in (".npz", ".purine"):
        suffix = ".zip"
    if suffix not in NOT_MODEL_FILES:
        return ModelError(f"{spec} is not a model, and was not run: {kinds}")
    what, use = NOT_MODEL_FILES[suffix]
    return ModelError(f"{spec} is {what}, not a model ({use}); {kinds}")


@functools.lru_cache(maxsize=16)
def _executed(path: str, spec: str, source: str) -> Callable:
    """The build() of model file ``path`` holding ``source``, run once per content: the
    command line asks about a file's build() before building from it (what it takes,
    its default input shape), and the file's own top-level code should not run again."""
    try:
        code = compile(source, path, "exec")
    except SyntaxError as e:
        raise ModelError(f"{spec}:{e.lineno}: syntax error in model file: {e.msg}") from None
    name = "purinec_user_model_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    module = types.ModuleType(name)
    module.__file__ = path
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except PurinecError:
        raise
    except (Exception, SystemExit) as e:
        raise ModelError(f"{_where(e, path, spec)}: loading model file {spec} failed: "
                         f"{type(e).__name__}: {e}") from e
    build = module.__dict__.get("build")
    if build is None:
        raise ModelError(f"model file {spec} defines no build(batch, ...) function")
    if not callable(build):
        raise ModelError(f"model file {spec}: build is a {type(build).__name__}, not a "
                         f"function build(batch, ...)")
    return build


def _where(exc: BaseException, path: str | None, spec: str | None) -> str:
    """file:line of the innermost traceback frame in the model file (else outside
    purinec) that the exception passed through."""
    frames = traceback.extract_tb(exc.__traceback__)
    if path is not None:
        mine = [f for f in frames if os.path.abspath(f.filename) == path]
        if mine:
            return f"{spec}:{mine[-1].lineno}"
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    outside = [f for f in frames if not os.path.abspath(f.filename).startswith(pkg + os.sep)]
    chosen = outside[-1] if outside else (frames[-1] if frames else None)
    return f"{os.path.basename(chosen.filename)}:{chosen.lineno}" if chosen else spec or "?"


def _call(build: Callable, batch, kwargs: dict, where: str, path: str | None) -> Net:
    try:
        sig = inspect.signature(build)
    except (TypeError, ValueError):
        sig = None
    call_args: list = []
    call_kwargs: dict = {}
    if sig is not None:
        params = sig.parameters
        var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        positional = [p for p in params.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if batch is not None:
            if "batch" in params and params["batch"].kind is not params["batch"].POSITIONAL_ONLY:
                call_kwargs["batch"] = batch
            elif positional or any(p.kind is p.VAR_POSITIONAL for p in params.values()):
                call_args.append(batch)
            elif var_kw:
                call_kwargs["batch"] = batch
            else:
                raise ModelError(f"{where} takes no batch argument; define "
                                 f"build(batch, ...)")
        for key, value in kwargs.items():
            if _takes_keyword(params, key):
                call_kwargs[key] = value
            else:
                raise ModelError(f"{where} takes no argument {key!r}; it takes "
                                 f"{', '.join(params) or 'none'}")
        try:
            sig.bind(*call_args, **call_kwargs)
        except TypeError as e:
            hint = ("" if batch is not None else
                    "; give a batch size (--batch N; batch= from Python) or a default "
                    "in build's signature")
            raise ModelError(f"{where} cannot be called: {e}{hint}") from None
    else:
        call_kwargs = dict(kwargs)
        if batch is not None:
            call_kwargs["batch"] = batch
    try:
        net = build(*call_args, **call_kwargs)
    except PurinecError:
        raise
    except Exception as e:
        abspath = os.path.abspath(path) if path is not None else None
        raise ModelError(f"{where} failed at {_where(e, abspath, path)}: "
                         f"{type(e).__name__}: {e}") from e
    if not isinstance(net, Net):
        raise ModelError(f"{where} returned {type(net).__name__}, not a purinec.bigraph.Net")
    return net
