"""What a target is: the one interface between the compiler and a kind of hardware.

The compiler, `Program`, artifacts and the command line know targets only through this
class and the registry below; nothing outside a target's own module names one. A target
says:

* ``name``, ``doc``: how users pick it (``target=``, ``--target``) and one line on what
  it is; ``device_kinds``: the devices its kernels run on (``cpu``, ``gpu``);
* `missing()`: what it needs that this machine lacks to compile for it (a package),
  or None; `cannot_run()`: why its programs, which compile, cannot run here (no GPU),
  or None, which `check_runnable` turns into an error before a run starts;
* `lay_out(spread)`: the devices it runs a layout of several devices on (the cuda
  target moves one of cpu devices only to gpus);
* `passes()`: the passes it adds at the end of the pipeline (the cpu target fuses), and
  so `pipeline(train, parallel, rank)`, the whole `passes.pipeline.Pipeline` that
  `compile()` runs and ``purinec dump`` shows;
* `kernels(graph)`: a compute kernel ``fn(*inputs, *outputs)`` for every node it runs
  (the host's copies and collectives come from the runtime, `runtime.host`), and
  `generated(graph)`: the kernels it generates code for, each with its ``name``,
  readable ``source`` and ``fn`` (`codegen.kernel.Kernel`; for dumps and artifacts),
  when ``generates_code``;
* ``arenas``: the memory of the planner's arenas (``allocate(sizes)``: each device's
  bytes, and ``release()``); a target whose memory is not the host's also copies its
  inputs in and its results out inside its executable;
* `worker_setup(graph)`: what each device's worker thread does as it starts (a share of
  the cores, a GPU made current); `hold()`: takes what its kernels share with other
  programs (a thread pool) for an executable, returning how to let go of it, so a
  closed program leaves nothing running;
* ``records_traces``: whether its executables record a `runtime.trace.Trace`;
  ``keeps_variables``: whether they keep params and state on their devices between
  calls (``keep_variables()``), which a `Program` tracks from the start; one of a
  target that does not builds its inference executable only when first run;
* `executable(graph, trace)`: the runnable program of one graph, ``exe(env) ->
  outputs`` (the contract is in docs/architecture.md). Completion is the runtime's
  dependency counting: a kernel is done when its call returns (a target with
  asynchronous devices makes its kernels wait on their completion events there).

The default `executable` runs `kernels` and the host kernels under the counting runtime
(`runtime.executor.Executable`), which is what a target built from kernels wants.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from purinec.errors import PurinecError
from purinec.ir.graph import Graph, Node
from purinec.ir.types import DEVICE_KINDS
from purinec.passes.optimizer import SGD
from purinec.passes.parallel import Parallel
from purinec.passes.pipeline import Pass, Pipeline
from purinec.runtime.devices import Lane
from purinec.runtime.host import host_kernels
from purinec.runtime.plan import FreshArenas

Runnable = Callable[[Mapping[str, np.ndarray]], dict]


class Target:
    """A kind of hardware the compiler emits kernels for; see the module doc. Subclasses
    set the class attributes and override what differs."""

    name: str = ""
    doc: str = ""
    device_kinds: tuple[str, ...] = ("cpu",)
    records_traces: bool = False
    generates_code: bool = False
    keeps_variables: bool = False  # its executables keep params and state on devices
    arenas: Any = FreshArenas

    def missing(self) -> str | None:
        return None

    def cannot_run(self) -> str | None:
        return None

    def check_runnable(self) -> None:
        """Refuse, before any work, to run a program of this target where it cannot."""
        reason = self.cannot_run()
        if reason:
            raise PurinecError(f"target {self.name} cannot run programs here: {reason}")

    def lay_out(self, spread: Parallel | None) -> Parallel | None:
        return spread

    def passes(self, training: bool) -> list[Pass]:
        """This target's own passes, after the others, for a training iteration or an
        inference graph."""
        return []

    def pipeline(self, train: SGD | None = None, parallel: Parallel | None = None,
                 rank: int = 0) -> Pipeline:
        """The passes to what this target runs, for a training (``train``) or inference
        graph laid out by ``parallel``; `Pipeline.physical` gives ``rank``'s graph."""
        return Pipeline(train, parallel, tuple(self.passes(train is not None)), rank)

    def check_devices(self, devices, what: str) -> None:
        """Refuse devices this target has no kernels for, rather than run them on the
        host under another name."""
        foreign = sorted(str(d) for d in devices if d.kind not in self.device_kinds)
        if not foreign:
            return
        kinds = sorted({d.kind for d in devices if d.kind not in self.device_kinds
                        and d.kind in DEVICE_KINDS})
        runners = {kind: [name for name, target in TARGETS.items()
                          if kind in target.device_kinds] for kind in kinds}
        hint = "".join(f"; {kind} devices run on target {' or '.join(names)}" if names else
                       f"; no target runs {kind} devices yet" for kind, names in runners.items())
        raise PurinecError(f"target {self.name} runs on {' or '.join(self.device_kinds)} "
                           f"devices, not on {', '.join(foreign)} ({what}){hint}")

    def check_records_traces(self) -> None:
        """Refuse a trace (--trace, --timeline) on a target that records none, naming the
        targets that do."""
        if not self.records_traces:
            recorders = [name for name, target in TARGETS.items() if target.records_traces]
            raise PurinecError(f"target {self.name} records no traces, which --trace and "
                               f"--timeline (trace=) need; run without them, or on a target "
                               f"that records them: {', '.join(recorders) or 'none here'}")

    def kernels(self, graph: Graph) -> dict[Node, Callable]:
        raise NotImplementedError(f"target {self.name} defines no kernels")

    def generated(self, graph: Graph) -> dict:
        return {}

    def worker_setup(self, graph: Graph) -> Callable[[Lane], None] | None:
        return None

    def hold(self) -> Callable[[], None]:
        return lambda: None

    def executable(self, graph: Graph, trace: Any = None) -> Runnable:
        from purinec.runtime.executor import Executable

        kernels = {**self.kernels(graph), **host_kernels(graph)}
        return Executable(graph, kernels, trace=trace, worker_init=self.worker_setup(graph),
                          arenas=self.arenas, hold=self.hold)

    def __repr__(self) -> str:
        return f"<target {self.name}: {self.doc}>"


TARGETS: dict[str, Target] = {}


def register_target(target: Target) -> Target:
    """Make ``target`` available by its name."""
    if not target.name:
        raise PurinecError(f"{target!r} has no name")
    TARGETS[target.name] = target
    return target


def get_target(name: str) -> Target:
    """The target named ``name``, ready to run here (or a PurinecError saying what is
    missing and how to get it)."""
    try:
        target = TARGETS[name]
    except KeyError:
        raise PurinecError(f"unknown target {name!r}; available: {', '.join(TARGETS)}") from None
    missing = target.missing()
    if missing:
        raise PurinecError(f"target {name} cannot run here: {missing}")
    return target
