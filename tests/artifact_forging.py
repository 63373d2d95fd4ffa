"""Forged `.purine` artifacts for tests: zips written byte by byte, as a forger's tool
would write them, so that a member can declare any size and compression, hold a deflate
bomb, or appear twice; with the manifest's hashes made to agree, so that the checks
behind them are reached."""

from __future__ import annotations

import hashlib
import io
import json
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import Iterable, Union

import numpy as np

OWN = ("manifest.json", "manifest.sha256")  # the manifest and its hash

# 2**30 zero bytes (a bomb's content): its hashes, computed once, so that a test lists a
# bomb with its real hash without spending seconds hashing a gigabyte.
GIB = 2**30
GIB_OF_ZEROS_SHA256 = "49bc20df15e412a64472421e13fe86ff1c5165e18b2afccf160d4dc19fe68a14"
GIB_OF_ZEROS_CRC32 = 0x5B64C2B0


@dataclass
class Entry:
    """A zip member as the file holds it: ``stored`` is deflated for ZIP_DEFLATED;
    ``size``, ``crc`` and ``sha256`` describe the content it claims to inflate to."""

    name: str
    stored: bytes
    size: int
    crc: int
    sha256: str
    method: int = zipfile.ZIP_DEFLATED


Content = Union[bytes, Entry]


def entry(name: str, content: bytes, method: int = zipfile.ZIP_DEFLATED) -> Entry:
    """An honest member holding ``content``."""
    stored = content
    if method == zipfile.ZIP_DEFLATED:
        compressor = zlib.compressobj(6, zlib.DEFLATED, -15)
        stored = compressor.compress(content) + compressor.flush()
    return Entry(name, stored, len(content), zlib.crc32(content),
                 hashlib.sha256(content).hexdigest(), method)


def gib_of_zeros(name: str, declared: int = GIB) -> Entry:
    """A deflate bomb: a megabyte that inflates to a GiB of zeros, declaring
    ``declared`` bytes. Made of one compressed MiB repeated: a full flush resets the
    compressor, so every MiB of zeros after it compresses to the same bytes."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    mib = compressor.compress(bytes(2**20)) + compressor.flush(zlib.Z_FULL_FLUSH)
    stored = mib * (GIB // 2**20) + compressor.flush()
    return Entry(name, stored, declared, GIB_OF_ZEROS_CRC32, GIB_OF_ZEROS_SHA256)


def zip_bytes(entries: Iterable[Entry], claimed_count: int | None = None) -> bytes:
    """A zip of ``entries`` in order (a name may repeat); its end record claims
    ``claimed_count`` members (default: the true count)."""
    entries = list(entries)
    out, directory = bytearray(), bytearray()
    for e in entries:
        name = e.name.encode()
        flags, date = 0x800, 0x21  # UTF-8 name; 1 January 1980
        directory += struct.pack("<4s4B4HL2L5H2L", b"PK\x01\x02", 20, 3, 20, 0, flags,
                                 e.method, 0, date, e.crc, len(e.stored), e.size, len(name),
                                 0, 0, 0, 0, 0, len(out)) + name
        out += struct.pack("<4s2B4HL2L2H", b"PK\x03\x04", 20, 0, flags, e.method, 0, date,
                           e.crc, len(e.stored), e.size, len(name), 0) + name + e.stored
    count = len(entries) if claimed_count is None else claimed_count
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, len(directory),
                      len(out), 0)
    return bytes(out + directory + end)


def read_members(raw: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def forged(members: dict[str, Content] | list[tuple[str, Content]], fix_hashes: bool = True,
           method: int = zipfile.ZIP_DEFLATED) -> bytes:
    """An artifact of ``members`` (a list of pairs to repeat a name). With
    ``fix_hashes`` the manifest lists each member's sha256 and manifest.sha256 is the
    manifest's: the forger knows the format."""
    pairs = list(members.items()) if isinstance(members, dict) else list(members)
    entries = [c if isinstance(c, Entry) else entry(n, c, method) for n, c in pairs]
    if fix_hashes:
        entries = _with_hashes(entries, dict(pairs)["manifest.json"])
    return zip_bytes(entries)


def _with_hashes(entries: list[Entry], manifest_json: bytes) -> list[Entry]:
    manifest = json.loads(manifest_json)
    manifest["members"] = {e.name: e.sha256 for e in entries if e.name not in OWN}
    manifest_json = json.dumps(manifest).encode()
    fixed = {"manifest.json": manifest_json,
             "manifest.sha256": hashlib.sha256(manifest_json).hexdigest().encode()}
    return [entry(e.name, fixed[e.name]) if e.name in fixed else e for e in entries]


def with_manifest(members: dict[str, bytes], manifest_json: bytes) -> dict[str, bytes]:
    """``members`` with this manifest, which need not be JSON, and its true hash."""
    return {**members, "manifest.json": manifest_json,
            "manifest.sha256": hashlib.sha256(manifest_json).hexdigest().encode()}


def npy(descr: str, shape: tuple, data: bytes = b"", fortran_order: bool = False,
        version: tuple[int, int] = (1, 0)) -> bytes:
    """An .npy file whose header says anything, followed by ``data``."""
    f = io.BytesIO()
    header = {"descr": descr, "fortran_order": fortran_order, "shape": shape}
    if version == (1, 0):
        np.lib.format.write_array_header_1_0(f, header)
    else:
        np.lib.format.write_array_header_2_0(f, header)
    return f.getvalue() + data


def npz(arrays: dict[str, np.ndarray]) -> bytes:
    """What np.savez writes for ``arrays`` (names as given, ``.npy`` added)."""
    f = io.BytesIO()
    np.savez(f, **arrays)
    return f.getvalue()
