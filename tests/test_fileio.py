"""Files written all or nothing, with the permissions new files normally get."""

from __future__ import annotations

import os
import pathlib
import re
import stat
import subprocess
import sys
import time

import pytest

from purinec.errors import ArtifactError
from purinec.fileio import STALE_AFTER_S, atomic_write_text, replacing, write_atomically

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_new_files_get_the_umask_permissions_not_owner_only(tmp_path, umask_027):
    atomic_write_text(tmp_path / "a.txt", "text")
    write_atomically(tmp_path / "b.bin", lambda f: f.write(b"\x00\x01"))
    with replacing(tmp_path / "c.png") as tmp:  # a writer that wants a path
        with open(tmp, "wb") as f:
            f.write(b"png")
    for name in ("a.txt", "b.bin", "c.png"):
        assert mode(tmp_path / name) == 0o640, name  # 0666 less the umask (mkstemp: 0600)
    assert (tmp_path / "a.txt").read_text() == "text"
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "trace.json"
    atomic_write_text(path, "old")

    def fail_halfway(f):
        f.write(b"new, half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        write_atomically(path, fail_halfway)
    with pytest.raises(KeyboardInterrupt):
        with replacing(path) as tmp:
            open(tmp, "w").write("half")
            raise KeyboardInterrupt
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["trace.json"]


def test_an_unwritable_place_is_an_error_naming_the_file(tmp_path):
    with pytest.raises(ArtifactError, match="cannot write .*nowhere.*out.npz"):
        atomic_write_text(tmp_path / "nowhere" / "out.npz", "x")
    # A writer whose own file operation fails (here: the rename onto a directory).
    (tmp_path / "taken").mkdir()
    with pytest.raises(ArtifactError, match="cannot write .*taken"):
        atomic_write_text(tmp_path / "taken", "x")
    assert sorted(os.listdir(tmp_path)) == ["taken"]


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


def backdate(path, seconds=2 * STALE_AFTER_S):
    past = time.time() - seconds
    os.utime(path, (past, past))


def test_stale_temporaries_of_dead_writers_are_removed_by_the_next_write(tmp_path):
    dead, alive = dead_pid(), os.getpid()
    stale = tmp_path / f".trace.json.{dead}.0badf00d.tmp"
    fresh = tmp_path / f".trace.json.{dead}.00c0ffee.tmp"  # a writer elsewhere, writing
    live = tmp_path / f".trace.json.{alive}.cafebabe.tmp"  # this process's, another thread
    other = tmp_path / f".other.json.{dead}.deadbeef.tmp"  # another path's
    for path in (stale, fresh, live, other):
        path.write_bytes(b"half")
    for path in (stale, live, other):
        backdate(path)
    atomic_write_text(tmp_path / "trace.json", "new")
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["trace.json", fresh.name, live.name, other.name])


KILLED_MID_WRITE = """
import sys, time
from purinec.fileio import write_atomically

def write_slowly(f):
    f.write(b"half a checkpoint")
    f.flush()
    print("writing", flush=True)
    time.sleep(60)

write_atomically(sys.argv[1], write_slowly)
"""


def test_a_writer_killed_mid_write_leaves_a_temporary_the_next_write_removes(tmp_path):
    path = tmp_path / "ck.purine"
    atomic_write_text(path, "old")
    writer = subprocess.Popen([sys.executable, "-c", KILLED_MID_WRITE, str(path)],
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert writer.stdout.readline() == "writing\n"
    finally:
        writer.kill()  # SIGKILL: no handler, no finally, nothing cleaned up
        writer.wait()
    left = [name for name in os.listdir(tmp_path) if name != "ck.purine"]
    assert len(left) == 1, left
    assert re.fullmatch(rf"\.ck\.purine\.{writer.pid}\.[0-9a-f]{{8}}\.tmp", left[0])
    assert path.read_text() == "old"
    atomic_write_text(path, "new")  # too soon: the writer might be on another machine
    assert len(os.listdir(tmp_path)) == 2
    backdate(tmp_path / left[0])
    atomic_write_text(path, "newer")
    assert os.listdir(tmp_path) == ["ck.purine"] and path.read_text() == "newer"
