"""Loading Numba's disk-cached machine code without readying Numba to compile.

Numba loads a ``cache=True`` function's machine code when the function is first
compiled for a signature (``Dispatcher.compile``), but first readies its target context
for compiling (``refresh``: every typing and lowering registry, 0.1-0.15 s once a
process, and with Numba's array math SciPy's linear algebra, 0.3 s more, unless
`purinec.codegen.compile_helpers.start_numba_without_scipy` came first). Running cached
code needs only the runtime's (NRT) symbols. `load` does the rest of what
``Dispatcher.compile`` does on a cache hit. The CPU target's kernels
(`purinec.codegen.cpu`), the runtime's atomics (`purinec.runtime.atomics`) and the
CPU team's functions (`purinec.codegen.cpu_runtime`) load
through it: a fifth of a warm ``purinec run``, a third of a second of every rank.

It uses Numba's private ``Cache._load_overload``; where a Numba release lacks it,
`load` says False and callers compile, which loads too.
"""

from __future__ import annotations

from numba.core.compiler_lock import global_compiler_lock
from numba.core.dispatcher import Dispatcher
from numba.core.runtime import rtsys


def load(dispatcher: Dispatcher, signature: tuple) -> bool:
    """Load ``dispatcher``'s machine code for ``signature`` from Numba's disk cache into
    it; False if the cache does not hold it or is off (``NUMBA_DISABLE_CACHE``)."""
    cached = getattr(dispatcher._cache, "_load_overload", None)  # NullCache has none
    if cached is None:
        return False
    context = dispatcher.targetctx
    with global_compiler_lock:
        rtsys.initialize(context)  # without it, loaded code that allocates crashes
        result = cached(signature, context)
        if result is None:
            return False
        dispatcher._cache_hits[signature] += 1
        context.insert_user_function(result.entry_point, result.fndesc, [result.library])
        dispatcher.add_overload(result)
    return True


def ready(dispatcher: Dispatcher, signature: tuple) -> None:
    """Make ``dispatcher`` callable with ``signature`` at no cost on its first call: from
    Numba's disk cache where it holds the code, else compiled (and so cached)."""
    if signature not in dispatcher.overloads and not load(dispatcher, signature):
        dispatcher.compile(signature)
