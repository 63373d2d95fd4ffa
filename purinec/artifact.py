"""Ahead-of-time artifacts: a compiled program as one `.purine` file, and back.

The file is one zip:

    manifest.json   format name and version, purinec/NumPy/Numba versions, target, graph
                    names, devices, creation time, the sha256 of every other member, and
                    free metadata (a checkpoint's epoch and data seed)
    manifest.sha256 the sha256 of manifest.json (hex), so an edit to it is noticed too
    program.pir     the final IR of the main graph (the training iteration, if trained)
    eval.pir        the inference graph, when the program has a separate one
    weights.npz     params as ``param/<name>``, state as ``state/<name>``; no pickle
    kernels/<graph>/<kernel>.py   the generated kernel sources, for people to read

Loading trusts nothing in the file. It never unpickles and never imports or executes a
member: the IR is parsed and verified, every member is checked against its hash, the
weights against the IR's declared types, and the target then builds the program from
the IR, regenerating its kernels (the kernel files are hashed, not used).
Nothing is read before it is bounded (the limits are the MAX_* constants below):
- the zip's end record, before zipfile parses its directory: the member count and the
  directory's size; then no name twice, only stored or deflated members, no encryption;
- each member's declared (uncompressed) size: the manifest, its hash, each IR text or
  kernel source and all of them together by fixed limits, weights.npz by what the IR's
  params and state take, and every member (the arrays in weights.npz too) by 64 times
  its compressed size, since a forger writes the IR too; reading stops at the declared
  size and checks it was reached, so neither a forged size nor a deflate bomb costs
  more than the directory;
- the manifest: checked against manifest.sha256 before the JSON is parsed (every format
  from version 2 on keeps that file the sha256 of manifest.json, so that a newer file is
  still told apart from a changed one; version 1 files, which have none, are parsed
  unchecked), with numbers past 4,300 digits and too deep a nesting refused;
- weights.npz, read without np.load: each array's zip entry and .npy header are checked
  against its declared type before its data is allocated, its data read in chunks.
Every failure is an ArtifactError naming the file, the member and what is wrong.
Saving is all or nothing: a temporary file beside the target, fsync, rename.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import io
import json
import math
import os
import re
import reprlib
import struct
import weakref
import zipfile
import zlib
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, BinaryIO, Iterator, NamedTuple

import numpy as np

from purinec.errors import ArtifactError, PurinecError, VerifyError
from purinec.fileio import write_atomically
from purinec.ir.graph import Graph, Value
from purinec.ir.parser import parse
from purinec.layout import is_distributed, layout_ranks, onto_ranks
from purinec.runtime import comm
from purinec.runtime.memory import check_values_fit
from purinec.targets import TARGETS
from purinec.version import __version__
from purinec.weights import check_weights, variables

if TYPE_CHECKING:
    from purinec.program import Program

FORMAT = "purinec-artifact"
# Bump when a reader of the old version could misread the new layout. 2: manifest.sha256.
FORMAT_VERSION = 2
HASHED_MANIFEST_SINCE = 2

MANIFEST = "manifest.json"
MANIFEST_HASH = "manifest.sha256"
PROGRAM = "program.pir"
EVAL = "eval.pir"
WEIGHTS = "weights.npz"
KERNELS = "kernels/"
ROLES = ("param", "state")

# What reading a damaged or forged zip member can raise: zipfile's own errors, zlib's,
# RuntimeError for an "encrypted" member, NotImplementedError for an unknown compression,
# ValueError from NumPy's .npy header parser (and for a name that is not UTF-8).
_DAMAGED = (zipfile.BadZipFile, zlib.error, EOFError, OSError, RuntimeError,
            NotImplementedError, ValueError)


@dataclass
class Saved:
    """What `save` wrote."""

    path: str
    size: int  # bytes
    target: str
    kernels: int  # kernel source files included for reading
    parameters: int  # number of parameter elements

    def __str__(self) -> str:
        return (f"wrote {self.path} ({self.size:,} bytes): target {self.target}, "
                f"{self.kernels} kernel(s), {self.parameters:,} parameters")


# -- saving -----------------------------------------------------------------------------

def save(program: Program, path: str | os.PathLike, metadata: dict | None = None) -> Saved:
    """Write ``program`` to ``path`` atomically, with ``metadata`` (default: the
    program's own) in its manifest; see the module docstring for the layout."""
    path = os.fspath(path)
    members = {PROGRAM: str(program.ir).encode()}
    if program.eval_ir is not program.ir:
        members[EVAL] = str(program.eval_ir).encode()
    members[WEIGHTS] = _weights_bytes(program)
    kernels = _kernel_sources(program)
    members.update(kernels)
    try:
        manifest = _manifest(program, members, program.metadata if metadata is None
                             else metadata)
        manifest = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    except (TypeError, ValueError) as err:
        raise ArtifactError(f"cannot write {path}: the program's metadata is not JSON: "
                            f"{err}") from None
    write_atomically(path, lambda f: _write_zip(f, manifest, members))
    return Saved(path, os.path.getsize(path), program.target, len(kernels),
                 sum(int(a.size) for a in program.params.values()))


def _weights_bytes(program: Program) -> bytes:
    arrays = {f"param/{name}": a for name, a in program.params.items()}
    arrays.update({f"state/{name}": a for name, a in program.state.items()})
    buffer = io.BytesIO()
    write_npz(buffer, arrays)
    return buffer.getvalue()


def write_npz(f: BinaryIO, arrays: dict[str, np.ndarray]) -> None:
    """What np.savez writes, spelled out: never pickling (its allow_pickle keyword is
    recent, NumPy 2.1) and taking any name (np.savez's ``file=`` would clash)."""
    with zipfile.ZipFile(f, "w") as zf:
        for key, array in arrays.items():
            with zf.open(f"{key}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asarray(array), allow_pickle=False)


# A program's IR never changes, so neither do its kernel sources: a checkpoint written
# every epoch asks the code generator once, not once per epoch.
_kernel_sources_of: weakref.WeakKeyDictionary[Program, dict[str, bytes]] = \
    weakref.WeakKeyDictionary()


def _kernel_sources(program: Program) -> dict[str, bytes]:
    """The generated kernel sources of every graph, by member name: none for a target
    that generates no code, or that cannot run here."""
    target = TARGETS[program.target]
    if not target.generates_code or target.missing():
        return {}
    if program not in _kernel_sources_of:
        _kernel_sources_of[program] = _generate_kernel_sources(program)
    return _kernel_sources_of[program]


def _generate_kernel_sources(program: Program) -> dict[str, bytes]:
    sources: dict[str, bytes] = {}
    for graph in program.executed_graphs():
        for kernel in TARGETS[program.target].generated(graph).values():
            stem = f"{KERNELS}{_file_name(graph.name)}/{_file_name(kernel.name)}"
            source = kernel.source.encode()
            name, n = f"{stem}.py", 1
            while name in sources and sources[name] != source:
                n += 1
                name = f"{stem}.{n}.py"
            sources[name] = source
    return sources


def _file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".") or "_"


def _manifest(program: Program, members: dict[str, bytes], metadata: dict
              ) -> dict[str, Any]:
    graphs = {"main": program.ir.name}
    if EVAL in members:
        graphs["eval"] = program.eval_ir.name
    devices = {str(d) for d in program.devices}
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "purinec_version": __version__,
        "numpy_version": np.__version__,
        "numba_version": _installed_version("numba"),
        "target": program.target,
        "graphs": graphs,
        "devices": sorted(devices),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "members": {name: _sha256(data) for name, data in members.items()},
        "metadata": metadata,
    }


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _write_zip(f: BinaryIO, manifest: str, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(f, "w") as zf:
        zf.writestr(MANIFEST, manifest, zipfile.ZIP_DEFLATED)
        zf.writestr(MANIFEST_HASH, _sha256(manifest.encode()) + "\n")
        for name, data in members.items():
            # The weights are an npz (a zip) of mostly incompressible floats: stored as is.
            method = zipfile.ZIP_STORED if name == WEIGHTS else zipfile.ZIP_DEFLATED
            zf.writestr(name, data, method)


# -- loading ----------------------------------------------------------------------------

# What loading reads at most. Every member's declared (uncompressed) size is checked
# against its limit before any of it is inflated, and no more than it declares is read,
# so a forged size or a deflate bomb is refused for the price of reading the zip directory.
MAX_MEMBERS = 10_000  # kernel sources: at most a graph's nodes (trained inception: ~300)
MAX_DIRECTORY = 3 * 2**20  # the zip directory, which zipfile parses whole: ~300 B a member
MAX_MANIFEST = 16 * 2**20  # a hash (~100 bytes) per member and the free metadata
MAX_MANIFEST_HASH = 1024  # 64 hex digits and a newline
# An IR text or a kernel source: 90 times trained inception's IR (45 kB, parsed and
# verified in 70 ms here); an IR of one-line nodes takes ~4 s and ~130 MB a MiB.
MAX_TEXT = 4 * 2**20
MAX_TEXTS = 128 * 2**20  # every member but the weights, together
NPY_OVERHEAD = 16 * 2**10  # an array's .npy header (NumPy reads 10,000 B), zip records
# Python's default limit on int(): a manifest number is refused past it even where the
# interpreter's limit is lifted (set_int_max_str_digits(0)), since int() is then quadratic.
MAX_INT_DIGITS = 4300
# How many times its compressed size a member may inflate to, past its first MiB. purinec
# stores the weights; deflate gains ~1.1x on floats and ~10x on IR text, ~1000x on zeros
# (a fresh momentum: half a training program's weights, so ~2x for the whole).
MAX_INFLATION = 64
_INFLATION_ALLOWED = 2**20
_CHUNK = 2**20  # bytes inflated at a time
_TEXT_LIMITS = {MANIFEST: MAX_MANIFEST, MANIFEST_HASH: MAX_MANIFEST_HASH}  # else MAX_TEXT

# Zip compression methods purinec writes: others (bzip2, lzma) inflate a whole block
# at a time in zipfile, past any size limit, and are refused unread.
_METHODS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
_CHANGED = "the file was changed after it was written"
_SUSPECT = "is it an artifact, or was it changed after it was written?"


@dataclass
class Loaded:
    """What a program is rebuilt from (`purinec.load` makes the `Program`)."""

    graph: Graph
    eval_graph: Graph | None
    target: str
    params: dict[str, np.ndarray]
    state: dict[str, np.ndarray]
    metadata: dict


def read_program(path: str | os.PathLike, target: str | None = None) -> Loaded:
    """Read and check the program saved at ``path``. ``target`` overrides the target it
    was compiled for (the IR is the same for every target)."""
    path = os.fspath(path)
    manifest, graphs, weights_npz = _read(path)
    weights = _read_weights(path, weights_npz, graphs)
    target = target or manifest["target"]
    if target not in TARGETS:
        raise ArtifactError(f"{path}: unknown target {_brief(target)!r}; this purinec has "
                            f"{', '.join(TARGETS)}")
    graph, eval_graph = graphs if len(graphs) == 2 else (graphs[0], None)
    ranks = comm.world().size
    if is_distributed(graph) and layout_ranks(graph) != ranks:
        # Saved by a job of another size (or without mpiexec): the same layout, its
        # devices dealt out over this job's ranks (a checkpoint resumes anywhere).
        graph, eval_graph = (onto_ranks(ranks, graph) + [None] if eval_graph is None
                             else onto_ranks(ranks, graph, eval_graph))
    return Loaded(graph, eval_graph, target, weights["param"], weights["state"],
                  manifest["metadata"])


def read_ir(path: str | os.PathLike) -> tuple[Graph, Graph | None]:
    """The final IR saved at ``path`` (checked as `load` checks it), and its inference
    graph when it has one, without building the program."""
    _, graphs, _ = _read(os.fspath(path))
    return graphs[0], graphs[1] if len(graphs) == 2 else None


def _read(path: str) -> tuple[dict, list[Graph], bytes]:
    """The manifest, the graphs (main first) and the weights' npz, every member checked
    against its hash; the graphs are read first, since they bound the weights' size."""
    with _open_zip(path) as zf:
        _check_members(path, zf)
        manifest = _read_manifest(path, zf)
        listed = _listed_members(path, zf, manifest)
        graphs = [_read_graph(path, zf, listed, PROGRAM, manifest["graphs"]["main"])]
        if EVAL in listed:
            graphs.append(_read_graph(path, zf, listed, EVAL,
                                      manifest["graphs"].get("eval")))
        for name in sorted(set(listed) - {PROGRAM, EVAL, WEIGHTS}):  # the kernel sources
            _check_sha256(path, name, _member_sha256(path, zf, name, MAX_TEXT),
                          listed[name])
        weights_npz = _read_hashed(path, zf, WEIGHTS, listed[WEIGHTS],
                                   _weights_limit(path, graphs))
    return manifest, graphs, weights_npz


# -- loading: the zip --------------------------------------------------------------------

# A zip ends with its end-of-central-directory record: a signature and 18 more bytes, the
# last two the length of a comment, which purinec never writes. Before it, in a zip64
# file, come the zip64 end record (56 bytes) and its locator (20), as zipfile reads them.
_END_OF_ZIP = re.compile(rb"PK\x05\x06.{16}\x00\x00\Z", re.S)
_END_RECORDS = 22 + 20 + 56


def _open_zip(path: str) -> zipfile.ZipFile:
    try:
        with open(path, "rb") as f:
            head = f.read(4)
            f.seek(max(0, os.fstat(f.fileno()).st_size - _END_RECORDS))
            tail = f.read()
        if head != b"PK\x03\x04":
            raise ArtifactError(f"{path} is not a purinec artifact (not a zip file); write "
                                "one with `purinec compile MODEL -o FILE.purine`")
        _check_directory_size(path, tail)
        return zipfile.ZipFile(path)
    except OSError as err:
        raise ArtifactError(f"cannot read {path}: {err.strerror or err}") from None
    except (zipfile.BadZipFile, NotImplementedError, ValueError, EOFError):
        raise ArtifactError(f"{path} is truncated or damaged: its zip directory is missing "
                            "or broken; save or copy it again") from None


def _check_directory_size(where: str, tail: bytes) -> None:
    """Refuse a zip whose end records declare more members or a bigger directory than an
    artifact has, before zipfile parses the directory into an object per member.
    ``tail``: the zip's last `_END_RECORDS` bytes. BadZipFile: no end record at the end
    (checked because zipfile searches backwards for one, and in a file cut short it may
    find the one of the weights.npz zip inside instead)."""
    if not _END_OF_ZIP.search(tail):
        raise zipfile.BadZipFile("no end record")
    members, size = struct.unpack_from("<HL", tail, len(tail) - 12)
    zip64 = tail[-_END_RECORDS:-42]
    if (len(tail) >= _END_RECORDS and tail[-42:-38] == b"PK\x06\x07"
            and zip64[:4] == b"PK\x06\x06"):
        members, size = struct.unpack_from("<QQ", zip64, 32)
    if members > MAX_MEMBERS:
        raise ArtifactError(f"{where} has {members:,} members; an artifact has at most "
                            f"{MAX_MEMBERS:,} ({_SUSPECT})")
    if size > MAX_DIRECTORY:
        raise ArtifactError(f"{where} has a zip directory of {size:,} bytes; an artifact's "
                            f"takes at most {MAX_DIRECTORY:,} ({_SUSPECT})")


def _check_members(path: str, zf: zipfile.ZipFile) -> None:
    """What the zip directory says about the members, before any is read: count,
    names, compression, inflation and, but for the weights (bounded by the IR), size."""
    _check_entries(path, zf.infolist())
    texts = [info for info in zf.infolist() if info.filename != WEIGHTS]
    for info in texts:
        _check_size(path, info, _TEXT_LIMITS.get(info.filename, MAX_TEXT))
    total = sum(info.file_size for info in texts)
    if total > MAX_TEXTS:
        raise ArtifactError(f"{path}: its members other than {WEIGHTS} take {total:,} "
                            f"bytes uncompressed; purinec reads at most {MAX_TEXTS:,} "
                            f"({_SUSPECT})")
    _check_inflation(path, zf.infolist())


def _check_entries(where: str, infos: list[zipfile.ZipInfo]) -> None:
    """A zip's (the artifact's, or the weights' npz) entries: not too many, no name
    twice, each stored or deflated."""
    if len(infos) > MAX_MEMBERS:  # more than the end record said
        raise ArtifactError(f"{where} has {len(infos):,} members; an artifact has at most "
                            f"{MAX_MEMBERS:,} ({_SUSPECT})")
    counts = Counter(info.filename for info in infos)
    duplicates = sorted(name for name, count in counts.items() if count > 1)
    if duplicates:
        raise ArtifactError(f"{where}: member {_brief(duplicates[0])} appears more than "
                            "once")
    for info in infos:
        if info.flag_bits & 1:
            raise ArtifactError(f"{where}: member {_brief(info.filename)} is encrypted; "
                                "purinec writes no encrypted members")
        if info.compress_type not in _METHODS:
            raise ArtifactError(f"{where}: member {_brief(info.filename)} uses zip "
                                f"compression method {info.compress_type}; purinec reads "
                                "stored and deflated members only")


def _check_inflation(where: str, infos: list[zipfile.ZipInfo]) -> None:
    """Refuse a member that would inflate to far more than the file holds: the weights'
    limit comes from the IR, which a forger writes too, and only this keeps the memory
    a small file can ask for in proportion to it."""
    for info in infos:
        if info.file_size > MAX_INFLATION * info.compress_size + _INFLATION_ALLOWED:
            raise ArtifactError(f"{where}: member {_brief(info.filename)} would inflate "
                                f"{info.compress_size:,} bytes to {info.file_size:,}, more "
                                f"than {MAX_INFLATION} times over ({_SUSPECT})")


def _check_size(path: str, info: zipfile.ZipInfo, limit: int) -> None:
    if info.file_size > limit:
        raise ArtifactError(f"{path}: member {_brief(info.filename)} is {info.file_size:,} "
                            f"bytes uncompressed; purinec reads at most {limit:,} for it "
                            f"({_SUSPECT})")


def _member_chunks(path: str, zf: zipfile.ZipFile, name: str, limit: int
                   ) -> Iterator[bytes]:
    """Member ``name``'s bytes, a chunk at a time: refused unread if it declares more
    than ``limit`` bytes, and as damaged if it holds other than it declares (reading
    stops one byte past that)."""
    try:
        info = zf.getinfo(name)
    except KeyError:
        raise ArtifactError(f"{path}: member {_brief(name)} is missing") from None
    _check_size(path, info, limit)
    try:
        with zf.open(info) as member:
            read = 0
            while chunk := member.read(min(_CHUNK, info.file_size - read + 1)):
                read += len(chunk)
                if read > info.file_size:
                    break
                yield chunk
    except _DAMAGED as err:
        raise ArtifactError(f"{path}: member {_brief(name)} is damaged ({err})") from None
    if read != info.file_size:  # zipfile checks the CRC of what it read, not the size
        held = f"{read:,} bytes" if read < info.file_size else "more"
        raise ArtifactError(f"{path}: member {_brief(name)} is damaged: it declares "
                            f"{info.file_size:,} bytes and holds {held}")


def _read_member(path: str, zf: zipfile.ZipFile, name: str, limit: int) -> bytes:
    return b"".join(_member_chunks(path, zf, name, limit))


def _member_sha256(path: str, zf: zipfile.ZipFile, name: str, limit: int) -> str:
    digest = hashlib.sha256()
    for chunk in _member_chunks(path, zf, name, limit):
        digest.update(chunk)
    return digest.hexdigest()


def _read_hashed(path: str, zf: zipfile.ZipFile, name: str, listed: str, limit: int
                 ) -> bytes:
    data = _read_member(path, zf, name, limit)
    _check_sha256(path, name, _sha256(data), listed)
    return data


def _check_sha256(path: str, name: str, digest: str, listed: str) -> None:
    if digest != listed:
        raise ArtifactError(f"{path}: member {_brief(name)} does not match its sha256 in "
                            f"{MANIFEST}: {_CHANGED}")


# -- loading: the manifest ---------------------------------------------------------------

def _read_manifest(path: str, zf: zipfile.ZipFile) -> dict[str, Any]:
    raw = _read_member(path, zf, MANIFEST, MAX_MANIFEST)
    hashed = MANIFEST_HASH in zf.namelist()
    if hashed:  # checked first, so that the JSON parser sees only what save wrote
        digest = _read_member(path, zf, MANIFEST_HASH, MAX_MANIFEST_HASH)
        if digest.decode("ascii", "replace").strip() != _sha256(raw):
            raise ArtifactError(f"{path}: {MANIFEST} does not match its sha256 in "
                                f"{MANIFEST_HASH}: {_CHANGED}")
    manifest = _parse_manifest(path, raw)
    version = _format_version(path, manifest)
    if version >= HASHED_MANIFEST_SINCE and not hashed:
        raise ArtifactError(f"{path}: member {MANIFEST_HASH} is missing")
    _check_manifest_fields(path, manifest)
    return manifest


def _parse_manifest(path: str, raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8"), parse_int=_bounded_int)
    except ValueError as err:  # not UTF-8, not JSON, or a number too long
        raise ArtifactError(f"{path}: {MANIFEST} is not valid JSON: {err}") from None
    except RecursionError:
        raise ArtifactError(f"{path}: {MANIFEST} nests arrays or objects too deeply to be "
                            f"read ({_CHANGED}?)") from None


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"a number of {len(digits.lstrip('-')):,} digits (at most "
                         f"{MAX_INT_DIGITS:,})")
    return int(digits)


def _format_version(path: str, manifest: Any) -> int:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path}: {MANIFEST} does not describe a purinec artifact "
                            f"(no \"format\": \"{FORMAT}\")")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ArtifactError(f"{path}: {MANIFEST} has no valid format_version (got "
                            f"{reprlib.repr(version)})")
    if version > FORMAT_VERSION:
        raise ArtifactError(
            f"{path} has artifact format version {_brief(version)}, newer than the version "
            f"{FORMAT_VERSION} this purinec ({__version__}) reads; it was written by "
            f"purinec {_brief(manifest.get('purinec_version', '?'))}: upgrade purinec")
    return version


def _brief(value: Any) -> str:
    """``value`` for a message, cut short: a forged manifest's strings, numbers and
    objects can be megabytes."""
    if isinstance(value, str):
        return value if len(value) <= 80 else value[:77] + "..."
    return reprlib.repr(value)


def _check_manifest_fields(path: str, manifest: dict[str, Any]) -> None:
    """The fields loading relies on, with their types (the rest is for people)."""
    def bad(field: str, want: str) -> ArtifactError:
        return ArtifactError(f"{path}: {MANIFEST} field {field!r} must be {want}, got "
                             f"{reprlib.repr(manifest.get(field))}")

    members = manifest.get("members")
    if not isinstance(members, dict) or not all(
            isinstance(n, str) and isinstance(h, str) for n, h in members.items()):
        raise bad("members", "an object mapping member names to sha256 digests")
    graphs = manifest.get("graphs")
    if not isinstance(graphs, dict) or not isinstance(graphs.get("main"), str):
        raise bad("graphs", "an object with the main graph's name")
    if not isinstance(manifest.get("target"), str):
        raise bad("target", "a target name")
    if not isinstance(manifest.setdefault("metadata", {}), dict):
        raise bad("metadata", "an object")


def _listed_members(path: str, zf: zipfile.ZipFile, manifest: dict) -> dict[str, str]:
    """The manifest's member hashes by name, once the zip holds exactly those members
    (and the manifest's own)."""
    listed: dict[str, str] = manifest["members"]
    own = ({MANIFEST, MANIFEST_HASH} if manifest["format_version"] >= HASHED_MANIFEST_SINCE
           else {MANIFEST})
    present = set(zf.namelist())
    unlisted = sorted(present - own - set(listed))
    if unlisted:
        raise ArtifactError(f"{path}: member {unlisted[0]} is not listed in {MANIFEST} "
                            f"({_CHANGED})")
    for required in (PROGRAM, WEIGHTS):
        if required not in listed:
            raise ArtifactError(f"{path}: member {required} is missing")
    absent = next((name for name in listed if name not in present), None)
    if absent is not None:
        raise ArtifactError(f"{path}: member {_brief(absent)} is missing")
    return listed


# -- loading: the IR and the weights -----------------------------------------------------

def _read_graph(path: str, zf: zipfile.ZipFile, listed: dict[str, str], member: str,
                expected_name: str | None) -> Graph:
    text = _read_hashed(path, zf, member, listed[member], MAX_TEXT)
    try:
        graph = parse(text.decode("utf-8"), source=member, verify=True)
    except UnicodeDecodeError as err:
        raise ArtifactError(f"{path}: {member} is not UTF-8 text: {err}") from None
    except VerifyError as err:
        raise ArtifactError(f"{path}: {member} fails verification: {err}") from None
    except PurinecError as err:
        raise ArtifactError(f"{path}: {member} is not valid purinec IR: {err}") from None
    if graph.name != expected_name:
        raise ArtifactError(f"{path}: {member} holds graph {graph.name}, but {MANIFEST} "
                            f"names {_brief(expected_name)}")
    return graph


def _declared(path: str, graphs: list[Graph]) -> dict[str, Value]:
    """The params and state the graphs declare, by name."""
    try:
        return variables(*graphs)
    except PurinecError as err:
        raise ArtifactError(f"{path}: the graphs of {PROGRAM} and {EVAL} disagree: "
                            f"{err}") from None


def _weights_limit(path: str, graphs: list[Graph]) -> int:
    """The most bytes weights.npz can hold for the params and state the IR declares:
    their data and, per array, its .npy header and zip records (the name twice). Weights
    beyond the memory limit are refused here, before any is read."""
    declared = _declared(path, graphs)
    check_values_fit(declared.values(), f"the parameters and state of {path}")
    return NPY_OVERHEAD + sum(v.type.nbytes + NPY_OVERHEAD + 2 * len(name.encode())
                              for name, v in declared.items())


class _ArrayHeader(NamedTuple):
    """An .npy member's shape and dtype, read before its data: what `check_weights`
    looks at (only ``shape`` and ``dtype``) without allocating the array it describes."""

    shape: tuple
    dtype: np.dtype


def _read_weights(path: str, data: bytes, graphs: list[Graph]
                  ) -> dict[str, dict[str, np.ndarray]]:
    """The params and state in weights.npz, each checked against the IR's type by its
    .npy header before its data is read, so that a forged header allocates nothing."""
    where = f"{path}: {WEIGHTS}"
    declared = _declared(path, graphs)
    with _open_npz(where, data) as npz:
        entries: dict[str, dict[str, zipfile.ZipInfo]] = {role: {} for role in ROLES}
        for info in npz.infolist():
            role, name = _array_role_and_name(where, info.filename)
            entries[role][name] = info
        for role in ROLES:
            headers = {name: _header_if_declared(where, npz, info, declared.get(name), role)
                       for name, info in entries[role].items()}
            try:
                check_weights(graphs, role, headers)
            except PurinecError as err:
                raise ArtifactError(f"{where} does not match the IR: {err}") from None
        return {role: {name: _read_array(where, npz, info)
                       for name, info in entries[role].items()} for role in ROLES}


def _open_npz(where: str, data: bytes) -> zipfile.ZipFile:
    if data.startswith(b"\x93NUMPY"):
        raise ArtifactError(f"{where} is a single array, not a .npz archive")
    try:
        _check_directory_size(where, data[-_END_RECORDS:])
        npz = zipfile.ZipFile(io.BytesIO(data))
    except _DAMAGED as err:
        raise ArtifactError(f"{where} is not a NumPy .npz archive: {err}") from None
    _check_entries(where, npz.infolist())
    _check_inflation(where, npz.infolist())
    return npz


def _array_role_and_name(where: str, member: str) -> tuple[str, str]:
    if not member.endswith(".npy"):
        raise ArtifactError(f"{where} holds a member named {_brief(member)!r}, not an "
                            "array: arrays are stored as param/<name>.npy or "
                            "state/<name>.npy")
    role, _, name = member[:-len(".npy")].partition("/")
    if role not in ROLES or not name:
        raise ArtifactError(f"{where} holds an array named {_brief(member[:-4])!r}; names "
                            "are param/<name> or state/<name>")
    return role, name


def _header_if_declared(where: str, npz: zipfile.ZipFile, info: zipfile.ZipInfo,
                        value: Value | None, role: str) -> _ArrayHeader:
    """The array's header, read once its size fits its declared type; an array the IR
    does not declare is not read (`check_weights` names it)."""
    if value is None or value.role != role:
        return _ArrayHeader((0,), np.dtype("V0"))
    limit = value.type.nbytes + NPY_OVERHEAD
    if info.file_size > limit:
        raise ArtifactError(f"{where}: array {info.filename[:-4]} is {info.file_size:,} "
                            f"bytes, more than its type in the IR, {value.type}, takes "
                            f"({_CHANGED}?)")
    with _open_array(where, npz, info) as f:
        shape, _, dtype = _npy_header(where, info, f)
    return _ArrayHeader(shape, dtype)


@contextlib.contextmanager
def _open_array(where: str, npz: zipfile.ZipFile, info: zipfile.ZipInfo
                ) -> Iterator[BinaryIO]:
    try:
        with npz.open(info) as f:
            yield f
    except _DAMAGED as err:
        raise ArtifactError(f"{where}: array {info.filename[:-4]} is damaged: "
                            f"{err}") from None


def _npy_header(where: str, info: zipfile.ZipInfo, f: BinaryIO
                ) -> tuple[tuple, bool, np.dtype]:
    """(shape, Fortran order, dtype) from the .npy header at ``f``, leaving ``f`` at
    the data. NumPy parses it without evaluating code and refuses more than 10,000 bytes."""
    version = np.lib.format.read_magic(f)
    readers = {(1, 0): np.lib.format.read_array_header_1_0,
               (2, 0): np.lib.format.read_array_header_2_0}
    if version not in readers:
        raise ValueError(f".npy format version {version}; NumPy writes 1.0 or 2.0 here")
    try:
        shape, fortran_order, dtype = readers[version](f)
    except _DAMAGED:
        raise  # a damaged member, or NumPy's own ValueError: reported as they are
    except Exception as err:  # noqa: BLE001  (whatever else NumPy's parser lets through)
        # For a forged header, NumPy's parser (ast.literal_eval, tokenize, np.dtype)
        # also raises SyntaxError, TokenError, TypeError, OverflowError, RecursionError.
        raise ValueError(f"its .npy header cannot be parsed ({type(err).__name__}: "
                         f"{err})") from None
    if dtype.hasobject:
        raise ArtifactError(f"{where}: array {info.filename[:-4]} cannot be read without "
                            "unpickling (it holds Python objects)")
    return shape, fortran_order, dtype


def _read_array(where: str, npz: zipfile.ZipFile, info: zipfile.ZipInfo) -> np.ndarray:
    """The array, its header already checked against its declared type."""
    key = info.filename[:-4]
    with _open_array(where, npz, info) as f:
        shape, fortran_order, dtype = _npy_header(where, info, f)
        array = _empty(where, key, shape, dtype, fortran_order)
        if info.file_size - f.tell() != array.nbytes:
            raise ArtifactError(f"{where}: array {key} holds {info.file_size - f.tell():,} "
                                f"bytes of data; its shape and dtype take {array.nbytes:,}")
        into = memoryview(array.reshape(-1, order="A")).cast("B")
        filled = 0
        while filled < array.nbytes:
            chunk = f.read(min(_CHUNK, array.nbytes - filled))
            if not chunk:
                raise EOFError("its data ends early")
            into[filled:filled + len(chunk)] = chunk
            filled += len(chunk)
    return array


def _empty(where: str, key: str, shape: tuple, dtype: np.dtype, fortran_order: bool
           ) -> np.ndarray:
    try:
        return np.empty(shape, dtype, order="F" if fortran_order else "C")
    except MemoryError:
        size = math.prod(shape) * dtype.itemsize
        raise ArtifactError(f"{where}: array {key} ({size:,} bytes) does not fit in "
                            "memory") from None
