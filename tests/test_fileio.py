"""Files written all or nothing, with the permissions new files normally get."""

from __future__ import annotations

import os
import stat

import pytest

from purinec.errors import ArtifactError
from purinec.fileio import atomic_write_text, replacing, write_atomically


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
