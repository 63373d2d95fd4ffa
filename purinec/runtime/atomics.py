"""The CPU's own atomic operations and fences on int64 words in memory that processes
share (`purinec.runtime.shm`'s windows), as Numba-compiled functions.

MPI's one-sided atomics on a shared window (``Compare_and_swap``, ``Fetch_and_op``,
each with a ``Flush``) cost 10-20 microseconds each inside a training step (cold
caches, mpi4py's argument handling), and a lenet step over two ranks makes about
fifteen; these cost well under one. The shared window's memory is coherent
cache memory, so one instruction on the word does the same, and every process that
touches the words does so through these or through aligned 64-bit loads and stores,
which x86-64 and AArch64 perform whole: a rank that reads a flag or counter with a
plain load and then `fence`s sees everything written before the matching store or
atomic (all are sequentially consistent, so each also orders the stores before it).
"""

from __future__ import annotations

from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from purinec import jitcache

ORDER = "seq_cst"


def _word(context, builder, array_type, array, index):
    """A pointer to ``array[index]`` (the caller checked the index)."""
    made = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer(context, builder, array_type, made, [index])


@intrinsic
def _compare_and_swap(typingctx, words, index, expected, desired):
    def codegen(context, builder, signature, args):
        word = _word(context, builder, signature.args[0], args[0], args[1])
        swapped = builder.cmpxchg(word, args[2], args[3], ORDER, ORDER)
        return builder.extract_value(swapped, 0)

    return types.int64(words, index, expected, desired), codegen


@intrinsic
def _fetch_add(typingctx, words, index, value):
    def codegen(context, builder, signature, args):
        word = _word(context, builder, signature.args[0], args[0], args[1])
        return builder.atomic_rmw("add", word, args[2], ORDER)

    return types.int64(words, index, value), codegen


@intrinsic
def _fence(typingctx):
    def codegen(context, builder, signature, args):
        builder.fence(ORDER)
        return context.get_dummy_value()

    return types.void(), codegen


@njit(cache=True, nogil=True)
def compare_and_swap(words, index, expected, desired):
    """Atomically: if ``words[index]`` (int64) is ``expected``, make it ``desired``; the
    value it held either way."""
    if not 0 <= index < words.size:
        raise IndexError("atomic word index out of range")
    return _compare_and_swap(words, index, expected, desired)


@njit(cache=True, nogil=True)
def fetch_add(words, index, value):
    """Atomically add ``value`` to ``words[index]`` (int64); the value it held."""
    if not 0 <= index < words.size:
        raise IndexError("atomic word index out of range")
    return _fetch_add(words, index, value)


@njit(cache=True, nogil=True)
def fence():
    """A full memory fence: no load or store moves across it."""
    _fence()


_WORDS = types.Array(types.int64, 1, "C")
# What the runtime calls them with: an int64 array and Python ints.
_SIGNATURES = ((compare_and_swap, (_WORDS, types.int64, types.int64, types.int64)),
               (fetch_add, (_WORDS, types.int64, types.int64)),
               (fence, ()))


def ready() -> None:
    """Load the atomics from Numba's disk cache before their first call, without
    readying Numba to compile (`purinec.jitcache`: a third of a second of every rank
    that shares memory); compile them where the cache does not hold them."""
    for function, signature in _SIGNATURES:
        jitcache.ready(function, signature)
