"""Writing files that matter: all or nothing.

Every file purinec writes for a user (artifacts and checkpoints, traces, timelines,
graph pictures, IR dumps, outputs) goes through `replacing`: written beside its path
under a temporary name, then renamed over it, so a crash or an error at any point leaves
the old file (or none) as it was. The new file gets the permissions any new file gets
(0666 less the umask), not the owner-only 0600 of `tempfile.mkstemp`.
"""

from __future__ import annotations

import contextlib
import os
from typing import BinaryIO, Callable, Iterator

from purinec.errors import ArtifactError


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[str]:
    """A temporary path beside ``path`` for the block to write; renamed over ``path``
    once the block ends without an error, removed otherwise. A place that cannot be
    written is an `ArtifactError` naming ``path``."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}."
                                  f"{os.urandom(4).hex()}.tmp")
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as err:
        raise ArtifactError(f"cannot write {path}: {err.strerror}") from None
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise ArtifactError(f"cannot write {path}: {err.strerror or err}") from None
        raise
    _fsync_directory(directory)


def write_atomically(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(f)`` on a new binary file and, once it is complete and on disk, put
    it at ``path`` (see `replacing`)."""
    with replacing(path) as tmp:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path``, all or nothing."""
    write_atomically(path, lambda f: f.write(text.encode("utf-8")))


def _fsync_directory(directory: str) -> None:
    """Make the rename itself durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
