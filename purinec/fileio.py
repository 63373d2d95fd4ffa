"""Writing files that matter: all or nothing.

Every file purinec writes for a user (artifacts and checkpoints, traces, timelines,
graph pictures, IR dumps, outputs) goes through `replacing`: written beside its path
under a temporary name, then renamed over it, so a crash or an error at any point leaves
the old file (or none) as it was. The new file gets the permissions any new file gets
(0666 less the umask), not the owner-only 0600 of `tempfile.mkstemp`.

A writer that is killed outright (SIGKILL, SIGTERM, power loss) cannot remove its
temporary file; the next write of the same path does, once the pid in its name names
no process.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from typing import BinaryIO, Callable, Iterator

from purinec.errors import ArtifactError

# How long a dead writer's temporary file is left: a pid means something on this machine
# only, and a writer on another machine sharing the directory (or in another container)
# has a pid that names no process here; while it writes, its file's mtime stays recent.
STALE_AFTER_S = 60


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[str]:
    """A temporary path beside ``path`` for the block to write; renamed over ``path``
    once the block ends without an error, removed otherwise. A place that cannot be
    written is an `ArtifactError` naming ``path``. Temporary files of ``path`` that
    killed writers left are removed first."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    name = os.path.basename(path)
    _remove_stale_temporaries(directory, name)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
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


def _remove_stale_temporaries(directory: str, name: str) -> None:
    """Remove the temporary files of ``name`` in ``directory`` (as `replacing` names
    them) whose writer's process is gone and which no one touched for `STALE_AFTER_S`."""
    if os.name != "posix":  # os.kill(pid, 0) sends a Ctrl-C on Windows
        return
    pattern = re.compile(rf"\.{re.escape(name)}\.([1-9][0-9]*)\.[0-9a-f]{{8}}\.tmp")
    try:
        entries = os.listdir(directory)
    except OSError:
        return  # creating the new temporary file will say what is wrong
    for entry in entries:
        match = pattern.fullmatch(entry)
        if match and not _process_exists(int(match[1])):
            with contextlib.suppress(OSError):  # gone already, or not ours to remove
                tmp = os.path.join(directory, entry)
                if time.time() - os.stat(tmp).st_mtime > STALE_AFTER_S:
                    os.unlink(tmp)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's; past any pid: left alone
        return True
    return True


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
