"""Artifacts fuzzed: byte flips, truncations, member and array edits, bombs, forged
manifests. Loading either refuses with an ArtifactError, or gives a program that runs as
the saved one did (or, where a forger fixed the hashes, one that runs or refuses with a
PurinecError); never another exception, a file written, or memory out of all proportion
to the file. Each property has a small budget here; `test_everything_at_once_slow`
tries hundreds of mutations of every kind (CI runs it; -m 'not slow' leaves it out)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import tracemalloc
import zipfile
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import purinec
from purinec.bigraph import Blob, InnerProduct, Net, ReLU, SoftmaxWithLoss
from purinec.errors import ArtifactError, PurinecError
from tests.artifact_forging import (OWN, entry, forged, gib_of_zeros, npy, read_members,
                                    with_manifest, zip_bytes)

MEMBERS = ("manifest.json", "manifest.sha256", "program.pir", "eval.pir", "weights.npz")
ARRAYS = tuple(f"{role}/{name}{suffix}.npy" for name in ("ip1.weight", "ip1.bias",
                                                         "ip2.weight", "ip2.bias")
               for role, suffix in (("param", ""), ("state", ".history")))
INPUT = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 1, 2, 2)

# What a mutated artifact may do: be refused; load and run exactly as the saved program
# did; or (forged, its hashes fixed) load and run, or refuse at any point.
REFUSED, SAME, ANY = "refused", "same", "any"

SMALL = settings(max_examples=30, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])
LARGE = settings(max_examples=600, deadline=None,  # 25-40 s here
                 suppress_health_check=[HealthCheck.too_slow])


def tiny_net() -> Net:
    with Net("tiny") as net:
        data = Blob("data", INPUT.shape)
        label = Blob("label", (2,), "i32")
        logits = (data >> InnerProduct("ip1", 4) >> ReLU("relu1") >> InnerProduct("ip2", 3)
                  >> Blob("logits"))
        loss = [logits, label] >> SoftmaxWithLoss("loss")
        net.outputs = [logits, loss]
    return net


class Saved:
    """The saved program, and where fuzzed files are written (one at a time)."""

    def __init__(self, raw: bytes, logits: np.ndarray, directory):
        self.raw = raw
        self.members = read_members(raw)
        self.arrays = read_members(self.members["weights.npz"])
        self.logits = logits  # of INPUT
        self.directory = directory

    def __repr__(self) -> str:  # what hypothesis shows of a failing example
        return f"Saved({self.directory})"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Saved:
    program = purinec.compile(tiny_net(), target="reference", seed=1,
                              train=purinec.SGD(lr=0.1, momentum=0.9))
    program.step({"data": INPUT, "label": np.array([0, 2], np.int32)})  # momentum too
    directory = tmp_path_factory.mktemp("fuzz")
    path = directory / "saved.purine"
    program.save(path)
    raw = path.read_bytes()
    path.unlink()
    saved = Saved(raw, program.run({"data": INPUT})["logits"], directory)
    assert set(saved.members) == set(MEMBERS) and set(saved.arrays) == set(ARRAYS)
    return saved


def check_loads_or_refuses(saved: Saved, raw: bytes, expect: str) -> None:
    path = saved.directory / "fuzzed.purine"
    path.write_bytes(raw)
    listing = sorted(os.listdir(saved.directory))
    start = time.monotonic()
    tracemalloc.start()
    try:
        outcome = _load_and_run(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - start < 20  # a load takes ~20 ms: nothing that could hang
    assert peak < 32 * 2**20 + 4 * len(raw)  # nothing a declared size or a header claims
    assert sorted(os.listdir(saved.directory)) == listing  # nothing written
    what, result = outcome
    if expect == REFUSED:
        assert what == "refused", outcome
    elif expect == SAME and what != "refused":
        assert what == "ran" and result.tobytes() == saved.logits.tobytes(), outcome
    path.unlink()


def _load_and_run(path) -> tuple[str, Any]:
    """("refused", the ArtifactError loading raised), ("ran", the logits of INPUT), or
    ("failed", the PurinecError running raised: a forged program may want other inputs)."""
    try:
        program = purinec.load(path, target="reference")
    except ArtifactError as err:
        return "refused", err
    with program:
        try:
            return "ran", program.run({"data": INPUT})["logits"]
        except PurinecError as err:
            return "failed", err


# -- mutations: each says how to make the mutated file, and what loading it may do -------

@dataclass(frozen=True)
class ByteFlips:
    flips: tuple[tuple[int, int], ...]  # (offset, bits to flip), offsets modulo the size
    expect: ClassVar[str] = SAME

    def apply(self, saved: Saved) -> bytes:
        raw = bytearray(saved.raw)
        for offset, bits in self.flips:
            raw[offset % len(raw)] ^= bits
        return bytes(raw)


@dataclass(frozen=True)
class Truncation:
    keep: int  # modulo the size
    expect: ClassVar[str] = REFUSED

    def apply(self, saved: Saved) -> bytes:
        return saved.raw[:self.keep % len(saved.raw)]


@dataclass(frozen=True)
class MemberEdit:
    """A member removed, repeated, added, replaced, or its content changed; the zip
    rewritten, with its hashes fixed or not."""

    op: str
    member: str
    data: bytes  # what is added or replaces; for "flip", the offsets to flip
    fix_hashes: bool

    @property
    def expect(self) -> str:
        return ANY if self.fix_hashes else SAME

    def apply(self, saved: Saved) -> bytes:
        pairs = list(saved.members.items())
        if self.op == "add" or self.member not in saved.members:
            return _rewritten([*pairs, (self.member, self.data)], self.fix_hashes)
        index = [n for n, _ in pairs].index(self.member)
        name, content = pairs[index]
        if self.op == "remove":
            del pairs[index]
        elif self.op == "repeat":
            pairs.append((name, content))
        elif self.op == "replace":
            pairs[index] = (name, self.data)
        elif self.op == "cut":
            pairs[index] = (name, content[:len(self.data) % (len(content) + 1)])
        elif self.op == "flip":
            pairs[index] = (name, _flipped(content, self.data))
        return _rewritten(pairs, self.fix_hashes)


def _flipped(content: bytes, offsets: bytes) -> bytes:
    changed = bytearray(content)
    for i, offset in enumerate(offsets):
        if changed:
            changed[(offset * 251 + i * 65_537) % len(changed)] ^= 1 << (offset % 8)
    return bytes(changed)


def _rewritten(pairs: list[tuple[str, Any]], fix_hashes: bool) -> bytes:
    """The zip of ``pairs``; with ``fix_hashes``, every hash made to agree that can be
    (a manifest that is no longer JSON gets only its own hash fixed)."""
    members = dict(pairs)
    try:
        manifest_is_json = isinstance(json.loads(members.get("manifest.json", b"")), dict)
    except ValueError:
        manifest_is_json = False
    if fix_hashes and manifest_is_json:
        return forged(pairs)
    if fix_hashes and "manifest.json" in members:
        fixed = with_manifest({}, members["manifest.json"])
        pairs = [(n, fixed.get(n, c)) for n, c in pairs]
    return forged(pairs, fix_hashes=False)


@dataclass(frozen=True)
class ArrayEdit:
    """An array of weights.npz removed, repeated, renamed without .npy, its header
    forged or its bytes changed; the hashes fixed, so that the arrays are read."""

    op: str
    array: str
    header: tuple[str, tuple[int, ...], bool, tuple[int, int]]  # descr, shape, F, version
    data: bytes
    expect: ClassVar[str] = ANY

    def apply(self, saved: Saved) -> bytes:
        arrays = list(saved.arrays.items())
        index = next(i for i, (n, _) in enumerate(arrays) if n == self.array)
        name, content = arrays[index]
        if self.op == "remove":
            del arrays[index]
        elif self.op == "repeat":
            arrays.append((name, content))
        elif self.op == "unsuffix":
            arrays[index] = (name[:-len(".npy")], content)
        elif self.op == "header":
            descr, shape, fortran_order, version = self.header
            arrays[index] = (name, npy(descr, shape, self.data, fortran_order, version))
        elif self.op == "flip":
            arrays[index] = (name, _flipped(content, self.data))
        npz = zip_bytes(entry(n, c, zipfile.ZIP_STORED) for n, c in arrays)
        return forged({**saved.members, "weights.npz": npz})


@dataclass(frozen=True)
class Bomb:
    """A member (or an array inside weights.npz) declaring ``declared`` bytes and
    holding a GiB of zeros, deflated, or 512 bytes; listed with its real hash."""

    member: str
    declared: int
    holds_a_gib: bool
    expect: ClassVar[str] = REFUSED

    def apply(self, saved: Saved) -> bytes:
        if self.member in ARRAYS:
            inner = [entry(n, c, zipfile.ZIP_STORED) for n, c in saved.arrays.items()
                     if n != self.member]
            npz = zip_bytes([self._bomb(self.member), *inner])
            return forged({**saved.members, "weights.npz": npz})
        # The manifest itself a bomb: nothing left to fix.
        return forged({**saved.members, self.member: self._bomb(self.member)},
                      fix_hashes=self.member not in OWN)

    def _bomb(self, name: str):
        if self.holds_a_gib:
            return gib_of_zeros(name, self.declared)
        return dataclasses.replace(entry(name, bytes(512)), size=self.declared)


@dataclass(frozen=True)
class ManifestEdit:
    """A manifest field set to any JSON text (a value, deep nesting, a long number),
    with the manifest's hash fixed or not; the members untouched."""

    field: str
    value: str  # JSON text
    fix_hash: bool
    expect: ClassVar[str] = SAME

    def apply(self, saved: Saved) -> bytes:
        manifest = json.loads(saved.members["manifest.json"])
        manifest[self.field] = "@value@"
        text = json.dumps(manifest).replace('"@value@"', self.value).encode()
        members = {**saved.members, "manifest.json": text}
        if self.fix_hash:
            members = with_manifest(members, text)
        return forged(members, fix_hashes=False)


# -- strategies ---------------------------------------------------------------------------

offsets = st.integers(min_value=0, max_value=2**20)
byte_flips = st.builds(ByteFlips, st.lists(st.tuples(offsets, st.integers(1, 255)),
                                           min_size=1, max_size=8).map(tuple))
truncations = st.builds(Truncation, offsets)
names = st.sampled_from(MEMBERS) | st.sampled_from(["kernels/tiny/k.py", "extra", "",
                                                    "../x", "weights.npz/"])
member_edits = st.builds(
    MemberEdit, st.sampled_from(["remove", "repeat", "add", "replace", "cut", "flip"]),
    names, st.binary(max_size=64), st.booleans())
dims = st.integers(0, 20) | st.integers(0, 2**63 - 1) | st.integers(-5, -1)
headers = st.tuples(
    st.sampled_from(["<f4", ">f4", "<f8", "<i4", "|b1", "<f2", "|O", "|V1000000000",
                     "<U3", "[('a', '<f4')]"]),
    st.lists(dims, max_size=3).map(tuple), st.booleans(), st.sampled_from([(1, 0), (2, 0)]))
array_edits = st.builds(
    ArrayEdit, st.sampled_from(["remove", "repeat", "unsuffix", "header", "flip"]),
    st.sampled_from(ARRAYS), headers, st.binary(max_size=64))
bombs = st.builds(Bomb, st.sampled_from([*MEMBERS, "kernels/tiny/k.py", *ARRAYS]),
                  st.sampled_from([100, 2**24, 2**30, 2**32 - 1]), st.booleans())
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4), max_leaves=12)
json_texts = (json_values.map(json.dumps)
              | st.integers(900, 200_000).map(lambda depth: "[" * depth + "]" * depth)
              | st.integers(4000, 6000).map(lambda digits: "-" + "9" * digits)
              | st.sampled_from(["1e999999", "NaN", "-Infinity", "2.0", "true", '"2"']))
manifest_edits = st.builds(
    ManifestEdit, st.sampled_from(["format", "format_version", "members", "graphs",
                                   "target", "metadata", "created", "purinec_version"]),
    json_texts, st.booleans())


MUTATIONS = {"byte flips": byte_flips, "truncations": truncations,
             "member edits": member_edits, "array edits": array_edits, "bombs": bombs,
             "manifest edits": manifest_edits}


@pytest.mark.parametrize("kind", MUTATIONS)
def test_each_kind_of_mutation(saved, kind):
    @SMALL
    @given(MUTATIONS[kind])
    def check(mutation):
        check_loads_or_refuses(saved, mutation.apply(saved), mutation.expect)

    check()


@pytest.mark.slow
@LARGE
@given(st.one_of(*MUTATIONS.values()))
def test_everything_at_once_slow(saved, mutation):
    check_loads_or_refuses(saved, mutation.apply(saved), mutation.expect)
