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
through it: a fifth of a warm ``purinec run``, a third of a second of every rank; and
so do `purinec.codegen.cpu_gemm`'s C functions (`ready_cfunc`): loaded the ordinary
way, the GEMM readied Numba for the first kernel that multiplied (0.3 s of a warm
lenet run).

It uses Numba's private ``Cache._load_overload``; where a Numba release lacks it,
`load` says False and callers compile, which loads too.
"""

from __future__ import annotations

from typing import Callable

from numba.core.ccallback import CFunc
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


def ready_cfunc(function: CFunc, compile_fresh: Callable[[], None]) -> None:
    """Give the C callback ``function`` its machine code from Numba's disk cache, as
    ``CFunc.compile`` does on a cache hit but without readying Numba to compile; where
    the cache does not hold it, ``compile_fresh()`` (which compiles and caches it)."""
    cached = getattr(function._cache, "_load_overload", None)  # NullCache has none
    context = function._targetdescr.target_context
    with global_compiler_lock:
        result = cached(function._sig, context) if cached is not None else None
        if result is None:
            compile_fresh()
            return
        function._cache_hits += 1
        function._library = result.library
        function._wrapper_name = result.fndesc.llvm_cfunc_wrapper_name
        function._wrapper_address = result.library.get_pointer_to_function(
            function._wrapper_name)
