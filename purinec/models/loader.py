"""``load_model``: a zoo name or a Python file defining ``build(batch, ...)``."""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import sys
import traceback
import types
from typing import Callable

from purinec.bigraph import Net
from purinec.errors import ModelError, PurinecError
from purinec.models.zoo import ZOO

def load_model(spec: str, batch: int | None = None, **kwargs) -> Net:
    """Build a `Net` from ``spec``: a name in `ZOO` or a path to a ``.py`` file that
    defines ``build(batch, ...)``. ``batch`` None means the builder's default;
    every keyword must be one the builder takes (see `offered_args`)."""
    if not isinstance(spec, str) or not spec:
        raise ModelError(f"a model is a zoo name or a .py file, got {spec!r}")
    if spec in ZOO:
        return _call(ZOO[spec], batch, kwargs, f"model {spec}", None)
    if spec.endswith(".py") or "/" in spec or os.sep in spec or os.path.exists(spec):
        build = _load_file(spec)
        return _call(build, batch, kwargs, f"build() in {spec}", spec)
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
    return ZOO[spec] if spec in ZOO else _load_file(spec)


def _load_file(spec: str) -> Callable:
    path = os.path.abspath(spec)
    if not os.path.exists(path):
        raise ModelError(f"model file {spec} does not exist")
    if not os.path.isfile(path):
        raise ModelError(f"model file {spec} is not a file")
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ModelError(f"cannot read model file {spec}: {e}") from None
    return _executed(path, spec, source)


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
