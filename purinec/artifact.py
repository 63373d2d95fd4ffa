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

Loading trusts nothing in the file. It never unpickles (``allow_pickle=False``) and never
imports or executes a member: the IR is parsed and verified, every member is checked
against its hash (the manifest against manifest.sha256, written since format version 2;
version 1 files, which have none, still load), the weights against the IR's declared
types, and the target then builds the program from the IR, regenerating its kernels (the
kernel files are not read back).
Saving is all or nothing: a temporary file beside the target, fsync, rename.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import os
import re
import weakref
import zipfile
import zlib
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from purinec.errors import ArtifactError, PurinecError, VerifyError
from purinec.fileio import write_atomically
from purinec.ir.graph import Graph
from purinec.ir.parser import parse
from purinec.layout import is_distributed, layout_ranks, onto_ranks
from purinec.runtime import comm
from purinec.targets import TARGETS
from purinec.version import __version__
from purinec.weights import check_weights

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
# and from NumPy ValueError (bad header, object array) or MemoryError (a huge shape).
_DAMAGED = (zipfile.BadZipFile, zlib.error, EOFError, OSError, RuntimeError,
            NotImplementedError, ValueError, MemoryError)


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
    manifest, members, graph, eval_graph = _read(path)
    weights = _read_weights(path, members[WEIGHTS])
    graphs = [graph] if eval_graph is None else [graph, eval_graph]
    try:
        for role in ROLES:
            check_weights(graphs, role, weights[role])
    except PurinecError as err:
        raise ArtifactError(f"{path}: {WEIGHTS} does not match the IR: {err}") from None
    target = target or manifest["target"]
    if target not in TARGETS:
        raise ArtifactError(f"{path}: unknown target {target!r}; this purinec has "
                            f"{', '.join(TARGETS)}")
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
    _, _, graph, eval_graph = _read(os.fspath(path))
    return graph, eval_graph


def _read(path: str) -> tuple[dict, dict[str, bytes], Graph, Graph | None]:
    with _open_zip(path) as zf:
        manifest = _read_manifest(path, zf)
        members = _read_members(path, zf, manifest)
    graph = _read_graph(path, members, PROGRAM, manifest["graphs"]["main"])
    eval_graph = None
    if EVAL in members:
        eval_graph = _read_graph(path, members, EVAL, manifest["graphs"].get("eval"))
    return manifest, members, graph, eval_graph


# A zip ends with its end-of-central-directory record: a signature and 18 more bytes, the
# last two the length of a comment, which purinec never writes.
_END_OF_ZIP = re.compile(rb"PK\x05\x06.{16}\x00\x00\Z", re.S)


def _open_zip(path: str) -> zipfile.ZipFile:
    try:
        with open(path, "rb") as f:
            head = f.read(4)
            f.seek(max(0, os.fstat(f.fileno()).st_size - 22))
            tail = f.read()
        if head != b"PK\x03\x04":
            raise ArtifactError(f"{path} is not a purinec artifact (not a zip file); write "
                                "one with `purinec compile MODEL -o FILE.purine`")
        # Checked here because zipfile searches backwards for the record, and in a file
        # cut short it may find the one of the weights.npz zip inside instead.
        if not _END_OF_ZIP.match(tail):
            raise zipfile.BadZipFile("no end record")
        return zipfile.ZipFile(path)
    except OSError as err:
        raise ArtifactError(f"cannot read {path}: {err.strerror or err}") from None
    except (zipfile.BadZipFile, NotImplementedError, ValueError, EOFError):
        raise ArtifactError(f"{path} is truncated or damaged: its zip directory is missing "
                            "or broken; save or copy it again") from None


def _read_member(path: str, zf: zipfile.ZipFile, name: str) -> bytes:
    try:
        return zf.read(name)
    except KeyError:
        raise ArtifactError(f"{path}: member {name} is missing") from None
    except _DAMAGED as err:
        raise ArtifactError(f"{path}: member {name} is damaged ({err})") from None


def _read_manifest(path: str, zf: zipfile.ZipFile) -> dict[str, Any]:
    names = zf.namelist()
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ArtifactError(f"{path}: member {duplicates[0]} appears more than once")
    raw = _read_member(path, zf, MANIFEST)
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ArtifactError(f"{path}: {MANIFEST} is not valid JSON: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path}: {MANIFEST} does not describe a purinec artifact "
                            f"(no \"format\": \"{FORMAT}\")")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ArtifactError(f"{path}: {MANIFEST} has no valid format_version (got "
                            f"{version!r})")
    if version > FORMAT_VERSION:
        raise ArtifactError(
            f"{path} has artifact format version {version}, newer than the version "
            f"{FORMAT_VERSION} this purinec ({__version__}) reads; it was "
            f"written by purinec {manifest.get('purinec_version', '?')}: upgrade purinec")
    if version >= HASHED_MANIFEST_SINCE:
        digest = _read_member(path, zf, MANIFEST_HASH).decode("ascii", "replace").strip()
        if digest != _sha256(raw):
            raise ArtifactError(f"{path}: {MANIFEST} does not match its sha256 in "
                                f"{MANIFEST_HASH}: the file was changed after it was written")
    _check_manifest_fields(path, manifest)
    return manifest


def _check_manifest_fields(path: str, manifest: dict[str, Any]) -> None:
    """The fields loading relies on, with their types (the rest is for people)."""
    def bad(field: str, want: str) -> ArtifactError:
        return ArtifactError(f"{path}: {MANIFEST} field {field!r} must be {want}, got "
                             f"{manifest.get(field)!r}")

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


def _read_members(path: str, zf: zipfile.ZipFile, manifest: dict) -> dict[str, bytes]:
    """Every member but the manifest, each checked against the manifest's sha256."""
    listed: dict[str, str] = manifest["members"]
    own = ({MANIFEST, MANIFEST_HASH} if manifest["format_version"] >= HASHED_MANIFEST_SINCE
           else {MANIFEST})
    present = [n for n in zf.namelist() if n not in own]
    unlisted = sorted(set(present) - set(listed))
    if unlisted:
        raise ArtifactError(f"{path}: member {unlisted[0]} is not listed in {MANIFEST} "
                            "(the file was changed after it was written)")
    for required in (PROGRAM, WEIGHTS):
        if required not in listed:
            raise ArtifactError(f"{path}: member {required} is missing")
    members = {}
    for name, digest in listed.items():
        data = _read_member(path, zf, name)
        if _sha256(data) != digest:
            raise ArtifactError(f"{path}: member {name} does not match its sha256 in "
                                f"{MANIFEST}: the file was changed after it was written")
        members[name] = data
    return members


def _read_graph(path: str, members: dict[str, bytes], member: str,
                expected_name: str | None) -> Graph:
    try:
        graph = parse(members[member].decode("utf-8"), source=member, verify=True)
    except UnicodeDecodeError as err:
        raise ArtifactError(f"{path}: {member} is not UTF-8 text: {err}") from None
    except VerifyError as err:
        raise ArtifactError(f"{path}: {member} fails verification: {err}") from None
    except PurinecError as err:
        raise ArtifactError(f"{path}: {member} is not valid purinec IR: {err}") from None
    if graph.name != expected_name:
        raise ArtifactError(f"{path}: {member} holds graph {graph.name}, but {MANIFEST} "
                            f"names {expected_name}")
    return graph


def _read_weights(path: str, data: bytes) -> dict[str, dict[str, np.ndarray]]:
    weights: dict[str, dict[str, np.ndarray]] = {role: {} for role in ROLES}
    try:
        npz = np.load(io.BytesIO(data), allow_pickle=False)
    except _DAMAGED as err:
        raise ArtifactError(f"{path}: {WEIGHTS} is not a NumPy .npz archive: {err}") from None
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise ArtifactError(f"{path}: {WEIGHTS} is a single array, not a .npz archive")
    with npz:
        for key in npz.files:
            role, _, name = key.partition("/")
            if role not in ROLES or not name:
                raise ArtifactError(f"{path}: {WEIGHTS} holds an array named {key!r}; "
                                    "names are param/<name> or state/<name>")
            try:
                weights[role][name] = npz[key]
            except _DAMAGED as err:
                raise ArtifactError(f"{path}: {WEIGHTS}: array {key} cannot be read without "
                                    f"unpickling or is damaged: {err}") from None
    return weights
