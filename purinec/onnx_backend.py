"""purinec as an ONNX backend (`onnx.backend.base.Backend`), and the conformance run of
ONNX's official node tests that `docs/onnx.md` reports.

    from purinec.onnx_backend import backend
    outputs = backend("cpu").run_model(model_proto, [x])

The node tests come from the onnx package's own case generators
(`onnx.backend.test.case.node`), the cases and tolerances its test runner checks; the
wheel ships those generators but not their data files. Run the whole set with
``python -m purinec.onnx_backend [--target cpu] [--table docs/onnx.md]``.
"""

from __future__ import annotations

import argparse
import collections
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from purinec.compiler import compile
from purinec.errors import ModelError, PurinecError
from purinec.onnxio import SUPPORTED_OPS, read_onnx
from purinec.onnxio.lowering import ConstantNeeded
from purinec.onnxio.model import onnx_package

onnx_package()  # this module is the ONNX backend: without onnx it cannot be imported

from onnx.backend.base import Backend, BackendRep  # noqa: E402


class PurinecRep(BackendRep):
    """A model as the ONNX backend API runs it: inputs in the graph's order (or by
    name), outputs as a tuple in the graph's order.

    purinec compiles static shapes and attributes, so a model that uses graph inputs
    as attributes (a Reshape's shape, a Slice's starts) is compiled when it is first
    run, with the values given then, and again whenever they change."""

    def __init__(self, model, target: str, batch: int | None = None):
        self.model, self.target, self.batch = model, target, batch
        self.attribute_inputs: list[str] = []
        self.compiled: dict[bytes, tuple] = {}
        self._compile({})  # refused now, when refused for any values

    def _compile(self, known: dict[str, np.ndarray]) -> tuple:
        """(program, imported model) for these values of the attribute inputs; ()
        when compiling needs the value of another input (added to those known)."""
        key = b"".join(np.ascontiguousarray(known[n]).tobytes() + b"|" for n in sorted(known))
        if key not in self.compiled:
            try:
                imported = read_onnx(self.model, self.batch, known)
                self.compiled[key] = (compile(imported, target=self.target), imported)
            except ConstantNeeded as err:
                if err.input in known:
                    raise
                self.attribute_inputs.append(err.input)
                return ()
        return self.compiled[key]

    def run(self, inputs: Any, **kwargs) -> tuple:
        names = [v.name for v in self.model.graph.input
                 if v.name not in {t.name for t in self.model.graph.initializer}]
        if isinstance(inputs, dict):
            given = dict(inputs)
        else:
            inputs = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
            given = dict(zip(names, inputs))
        compiled = ()
        while not compiled:
            missing = [name for name in self.attribute_inputs if name not in given]
            if missing:
                raise ModelError(f"input {missing[0]} is used as an attribute: give its "
                                 f"value")
            known = {name: np.asarray(given[name]) for name in self.attribute_inputs}
            compiled = self._compile(known)
        program, imported = compiled
        given = {name: array for name, array in given.items() if name not in known}
        feeds = {imported.names[name]: array for name, array in given.items()}
        results = program.run(feeds)
        return tuple(results[imported.names[v.name]] for v in imported.proto.graph.output)

    def close(self) -> None:
        for program, _ in self.compiled.values():
            program.close()
        self.compiled.clear()


class PurinecBackend(Backend):
    """The ONNX backend of one purinec target (`backend` makes one per target)."""

    target = "reference"

    @classmethod
    def prepare(cls, model, device: str = "CPU", **kwargs) -> PurinecRep:
        super().prepare(model, device, **kwargs)
        return PurinecRep(model, cls.target, kwargs.get("batch"))

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device == "CPU"


def backend(target: str = "reference") -> type[PurinecBackend]:
    """The ONNX backend that compiles for ``target``."""
    return type(f"PurinecBackend_{target}", (PurinecBackend,), {"target": target})


# -- conformance ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    test: str
    ops: tuple[str, ...]
    status: str  # passed, failed or refused
    detail: str = ""


def node_tests() -> list:
    """ONNX's node test cases whose ops purinec claims (each case: name, model, data
    sets of (inputs, outputs), rtol, atol)."""
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")  # the generators' own NumPy warnings
        cases = collect_testcases(None)
    return [case for case in cases
            if {n.op_type for n in case.model.graph.node} <= SUPPORTED_OPS]


def run_test(case, target: str) -> Outcome:
    """One node test on ``target``: refused (a PurinecError while compiling: a type or
    attribute purinec does not take), passed, or failed (any other error, or outputs
    beyond the test's tolerances)."""
    ops = tuple(sorted({n.op_type for n in case.model.graph.node}))
    try:
        rep = backend(target).prepare(case.model)
    except PurinecError as err:
        return Outcome(case.name, ops, "refused", str(err).splitlines()[0])
    except Exception as err:  # noqa: BLE001 (a crash is a failure, reported as one)
        return Outcome(case.name, ops, "failed", f"compiling: {type(err).__name__}: {err}")
    try:
        for inputs, outputs in case.data_sets:
            _check(rep.run([_array(x) for x in inputs]), [_array(y) for y in outputs],
                   case.rtol, case.atol)
    except PurinecError as err:
        if not isinstance(err, ModelError):
            return Outcome(case.name, ops, "failed", f"{type(err).__name__}: {err}")
        return Outcome(case.name, ops, "refused", str(err).splitlines()[0])
    except Exception as err:  # noqa: BLE001
        return Outcome(case.name, ops, "failed", f"{type(err).__name__}: {err}".splitlines()[0])
    finally:
        rep.close()
    return Outcome(case.name, ops, "passed")


def _array(value: Any) -> np.ndarray:
    """A test's input or output as an array (some cases give TensorProtos)."""
    from onnx import TensorProto, numpy_helper

    return numpy_helper.to_array(value) if isinstance(value, TensorProto) else np.asarray(value)


def _check(got: Sequence[np.ndarray], want: Sequence[np.ndarray], rtol: float,
           atol: float) -> None:
    """What ONNX's runner checks: as many outputs, each of the expected dtype and
    shape, equal within the tolerances (NaN where NaN is expected)."""
    if len(got) != len(want):
        raise AssertionError(f"{len(got)} outputs, expected {len(want)}")
    for k, (a, b) in enumerate(zip(got, want)):
        b = np.asarray(b)
        if a.dtype != b.dtype:
            raise AssertionError(f"output {k} is {a.dtype}, expected {b.dtype}")
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"output {k}")


def conformance(targets: Iterable[str], progress=None) -> dict[str, list[Outcome]]:
    """Every claimed node test on each of ``targets``."""
    cases = node_tests()
    results = {}
    for target in targets:
        results[target] = []
        for k, case in enumerate(cases):
            results[target].append(run_test(case, target))
            if progress is not None:
                progress(target, k + 1, len(cases), results[target][-1])
    return results


def table(results: dict[str, list[Outcome]]) -> str:
    """The Markdown table of `docs/onnx.md`: per op, node tests passed of those run on
    each target, and the tests refused (the same on every target)."""
    targets = list(results)
    rows = collections.defaultdict(lambda: {t: [0, 0] for t in targets})
    refused = collections.defaultdict(set)
    for target, outcomes in results.items():
        for outcome in outcomes:
            for op in outcome.ops:
                counts = rows[op][target]
                if outcome.status == "refused":
                    refused[op].add(outcome.test)
                    continue
                counts[1] += 1
                counts[0] += outcome.status == "passed"
    head = ["op"] + [f"{t}: passed of run" for t in targets] + ["refused"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for op in sorted(rows):
        cells = [f"{p} of {n}" for p, n in (rows[op][t] for t in targets)]
        shown = ", ".join(f"`{t.removeprefix('test_')}`" for t in sorted(refused[op]))
        lines.append(f"| {op} | " + " | ".join(cells) + f" | {shown or '-'} |")
    return "\n".join(lines) + "\n"


TABLE_BEGIN = "<!-- conformance table: python -m purinec.onnx_backend --table docs/onnx.md -->"
TABLE_END = "<!-- end of conformance table -->"


def write_table(path: str, results: dict[str, list[Outcome]]) -> None:
    """Replace the table between the markers in ``path`` (atomically)."""
    from purinec.fileio import replacing

    with open(path, encoding="utf-8") as f:
        text = f.read()
    begin, end = text.index(TABLE_BEGIN) + len(TABLE_BEGIN), text.index(TABLE_END)
    with replacing(path) as temporary, open(temporary, "w", encoding="utf-8") as f:
        f.write(text[:begin] + "\n\n" + table(results) + "\n" + text[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m purinec.onnx_backend",
        description="Run ONNX's official node tests of every op purinec claims, and "
                    "print (or write into docs/onnx.md) the table of outcomes.")
    parser.add_argument("--target", action="append", dest="targets",
                        help="target to run on (repeat for several; default: reference "
                             "and cpu)")
    parser.add_argument("--table", metavar="FILE",
                        help="write the table between the conformance markers of FILE")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print every test's outcome, not only failures")
    args = parser.parse_args(argv)

    def progress(target, done, total, outcome):
        if args.verbose or outcome.status == "failed":
            print(f"[{target} {done}/{total}] {outcome.test}: {outcome.status} "
                  f"{outcome.detail}", file=sys.stderr, flush=True)

    results = conformance(args.targets or ["reference", "cpu"], progress)
    if args.table:
        write_table(args.table, results)
    print(table(results), end="")
    failed = sum(o.status == "failed" for outcomes in results.values() for o in outcomes)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
