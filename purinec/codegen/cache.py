"""The kernel cache: generated sources on disk, importable, so Numba's cache is reused.

Numba can cache compiled code only for functions defined in a real file (not for
source that was ``exec``'d), and it keys its cache on that file. So every generated
kernel module is written to ``<cache dir>/<target>/k_<sha256 of its code and of what it
imports from purinec (`runtime_stamp`), 20 hex digits>.py`` and imported from there as a
module registered in ``sys.modules``; its functions use ``cache=True``, and Numba keeps
their machine code in ``__pycache__`` beside it, where a later process finds it.

A module's *code* is its text without comment lines (`code_of`). Generated modules
quote the IR they were made for in comments, so two nodes that render to the same code
(the same layer twice, one layer on several devices) differ only there: they share one
file, one import and one Numba compile, in a process and across processes. The file
keeps the comments of the text that first wrote it.

The cache directory is ``$PURINEC_CACHE_DIR``, else ``~/.cache/purinec``, read at every
use. A file is trusted only if its code equals the code we would write (and it declares
no source encoding of its own): anything else (truncated, edited, unreadable) is
rewritten before it is imported. Files are written to a temporary name and then linked
or renamed into place, so concurrent writers of the same kernel never expose a partial
file, and a process compiles a kernel holding its lock file (`one_compiler`), so
processes compiling the same kernels at once take turns rather than all compile them.
Hits and misses are logged at DEBUG on ``purinec.codegen.cache`` and counted in
`STATS`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import re
import sys
import tempfile
import threading
import types
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator

from purinec.errors import PurinecError

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None

log = logging.getLogger(__name__)

ENV_VAR = "PURINEC_CACHE_DIR"
_HASH_CHARS = 20
# PEP 263: a comment in the first two lines that declares how Python decodes the file.
_ENCODING_DECLARATION = re.compile(r"^[ \t\f]*#.*?coding[:=]")


class CacheError(PurinecError):
    """The kernel cache directory cannot be used."""


@dataclass
class CacheStats:
    """Counters since the process started (or since `reset`).

    hits: the source file was already there and correct; misses: it had to be written;
    rewrites: a file that was there was wrong and got replaced (also a miss);
    compiles: Numba compiled a kernel; loads: Numba loaded a kernel from its disk cache.
    """

    hits: int = 0
    misses: int = 0
    rewrites: int = 0
    compiles: int = 0
    loads: int = 0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


STATS = CacheStats()

_lock = threading.Lock()
_modules: dict[Path, types.ModuleType] = {}


def cache_dir() -> Path:
    """The kernel cache root: ``$PURINEC_CACHE_DIR`` or ``~/.cache/purinec``."""
    configured = os.environ.get(ENV_VAR)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "purinec"


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()[:_HASH_CHARS]


def code_of(source: str) -> str:
    """``source`` without its comment lines: what the cache keys and compares."""
    return "".join(line for line in source.splitlines(keepends=True)
                   if not line.lstrip().startswith("#"))


# What a target's kernels import from purinec: Numba's cache checks a kernel's own file
# only, so the text of these is part of every kernel's key, lest a changed helper leave
# machine code compiled against the old one in use.
RUNTIMES = {"cpu": (Path(__file__).with_name("cpu_runtime.py"),
                    Path(__file__).with_name("cpu_gemm.py"),
                    Path(__file__).with_name("cpu_window.py"))}


@functools.cache
def runtime_stamp(target: str) -> str:
    """A hash of what ``target``'s kernels import from purinec (empty: nothing)."""
    return source_hash("".join(path.read_text(encoding="utf-8")
                               for path in RUNTIMES.get(target, ())))


def kernel_path(source: str, target: str = "cpu") -> Path:
    """Where the module with this code lives in the cache: named by the hash of its
    code and of its target's runtime (`runtime_stamp`)."""
    return cache_dir() / target / f"k_{source_hash(code_of(source) + runtime_stamp(target))}.py"


def load_module(source: str, target: str = "cpu") -> types.ModuleType:
    """The module with the code of ``source``, written to the cache (as ``source``) if
    needed and imported.

    Importing runs the generated module, so it happens only after its file was checked
    to hold the code of ``source``. Within a process each file is imported once.
    """
    path = kernel_path(source, target)
    with _lock:
        _ensure_file(path, source)
        module = _modules.get(path)
        if module is None:
            module = _import(path)
            _modules[path] = module
        return module


@contextlib.contextmanager
def one_compiler(source: str, target: str = "cpu", wait: bool = True) -> Iterator[bool]:
    """Hold the kernel's lock file (``k_<hash>.lock``) while compiling it: processes
    that compile the same kernels at once (the ranks of a data-parallel job, compile
    helpers) then never compile one twice: the others load its machine code from
    Numba's cache (lenet over 4 ranks on two cores, cold cache: the job took 43 s to its
    first epoch, 25 s not compiling twice). Yields whether this process holds the lock:
    with ``wait`` always (once the holder is done), without only if nobody held it, so
    the caller can compile another kernel meanwhile. The operating system releases the
    lock of a process that dies. ``source`` may also name a function the kernels link
    (`purinec.codegen.cpu_gemm`'s): its lock is keyed by the name and the runtime."""
    if fcntl is None:  # not POSIX: every process compiles
        yield True
        return
    lock_path = kernel_path(source, target).with_suffix(".lock")
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(lock_path, "a")
    except OSError:  # a read-only cache: compile without taking turns
        yield True
        return
    with lock:  # (closing the file releases the lock)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def compiled_on_disk(source: str, function: str, target: str = "cpu") -> bool:
    """Whether Numba's disk cache holds machine code of ``function`` in the module with
    the code of ``source`` (it keeps an index file per function). False where that
    cannot be told."""
    return (kernel_path(source, target).stem, function) in compiled_functions(target)


def compiled_functions(target: str = "cpu") -> set[tuple[str, str]]:
    """(module file stem, function) of every kernel function Numba's disk cache holds
    for ``target``, from one listing of its folder (which holds every kernel's index:
    thousands of files in a well-used cache, too many to search once per kernel)."""
    folder = _numba_cache_of(cache_dir() / target / "k.py")
    try:
        names = os.listdir(folder) if folder is not None else []
    except OSError:  # not made yet
        names = []
    # <stem>.<function>-<first line>.py<version>.nbi
    return {(stem, rest.rsplit("-", 1)[0]) for name in names if name.endswith(".nbi")
            for stem, _, rest in [name.partition(".")]}


def _numba_cache_of(path: Path) -> Path | None:
    """Where Numba caches the functions of the module at ``path``: ``__pycache__``
    beside it, or under ``$NUMBA_CACHE_DIR`` in a folder named as Numba names it (by a
    helper of Numba's own, private: None if a Numba release has moved it)."""
    from numba.core import caching, config

    if not config.CACHE_DIR:
        return path.parent / "__pycache__"
    name_of = getattr(getattr(caching, "_CacheLocator", None), "get_suitable_cache_subpath",
                      None)
    return Path(config.CACHE_DIR) / name_of(str(path)) if name_of else None


def _ensure_file(path: Path, source: str) -> None:
    try:
        found = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        found = None
    except (OSError, UnicodeDecodeError) as err:
        log.debug("kernel cache: cannot read %s (%s); rewriting it", path, err)
        found = ""
    if found == source or (found and _same_code(found, source)):
        STATS.hits += 1
        log.debug("kernel cache hit: %s", path)
        return
    STATS.misses += 1
    if found is None:
        log.debug("kernel cache miss: writing %s", path)
    else:
        STATS.rewrites += 1
        log.debug("kernel cache: %s does not hold the expected source; rewriting it", path)
    _write_atomically(path, source, replace=found is not None)


def _same_code(found: str, source: str) -> bool:
    """Whether ``found`` is ``source`` with other comments. A comment declaring the
    file's encoding is not just a comment (it changes how Python reads the rest), so
    the first two lines must declare none unless ``source`` does too."""
    head = found.splitlines()[:2]
    return (code_of(found) == code_of(source)
            and (head == source.splitlines()[:2]
                 or not any(_ENCODING_DECLARATION.match(line) for line in head)))


def _write_atomically(path: Path, source: str, replace: bool) -> None:
    """Write ``source`` to a temporary file beside ``path``, then move it into place.

    A new file is *linked* into place, which fails instead of overwriting when another
    process got there first (its file then holds the same code: the name is its hash),
    so a kernel's file keeps its first timestamp and Numba's cache index stays valid. A
    wrong file is replaced by rename, which is atomic too."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise CacheError(f"cannot write to the kernel cache {path.parent}: {err}; set "
                         f"{ENV_VAR} to a writable directory") from err
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(source)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            except OSError:  # a file system without hard links
                os.replace(tmp, path)
    except OSError as err:
        raise CacheError(f"cannot write kernel {path}: {err}") from err
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _import(path: Path) -> types.ModuleType:
    name = f"purinec_kernel_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
