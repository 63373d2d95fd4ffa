"""Fuzzing the IR reader: real `.pir` dumps of zoo models, mutated token by token and line
by line, either are refused with a `PurinecError` or parse into a graph that, built and
run once on the reference target, either is refused with a `PurinecError` or runs. No
other exception, no hang, no file written, and no tensor the memory limit does not allow.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import purinec
from purinec.compiler import build_graph, load_source
from purinec.errors import PurinecError
from purinec.ir.parser import parse
from purinec.layout import as_devices, parallel_plan
from purinec.passes.optimizer import SGD
from purinec.program import updated_variables
from purinec.runtime.memory import LIMIT_VARIABLE

# Small models, so a run takes milliseconds: (zoo name, batch, one input's shape). No
# other dimension is 7, so a shape's leading 7 is the batch.
BATCH = 7
MODELS = [("mlp", BATCH, (1, 4, 4)), ("lenet", BATCH, (1, 16, 16))]
# The stages dumped, for training and inference: (target, devices, stage), on the
# reference target (one op at a time), the cpu target (whose final IR is fused), and
# over two devices (distributions, boxing).
STAGES = [("reference", None, "lower"), ("reference", None, "cse"), ("cpu", None, "fuse"),
          ("reference", "cpu:0,cpu:1", "parallel")]
# Mutated dims can ask for any size: the limit refuses large ones before allocating.
MEMORY_LIMIT = "64M"
SECONDS_PER_EXAMPLE = 30


@functools.lru_cache(maxsize=None)
def dumps() -> tuple[str, ...]:
    """The text of every model at every stage, training and inference."""
    texts = []
    for name, batch, shape in MODELS:
        source = load_source(name, batch, input_shape=shape, num_classes=3)
        for train in (None, SGD(lr=0.1, momentum=0.9)):
            for target, devices, stage in STAGES:
                seen = {}
                build_graph(source, train, lambda s, g: seen.setdefault(s, str(g)), target,
                            devices and parallel_plan(as_devices(devices), "data"))
                texts.append(seen[stage])
    return tuple(texts)


# -- mutations --------------------------------------------------------------------------

# Tokens as the IR spells them, whitespace and comments included, so that joining them
# gives the text back.
_TOKEN_RE = re.compile(r'"(?:\\.|[^"\\\n])*"|%?[A-Za-z_][A-Za-z0-9_.\-]*|-?[0-9][0-9.eE+\-]*'
                       r"|#[^\n]*|\s+|.")

NUMBERS = ["0", "1", "-1", "2", "3", "7", "64", "65536", "4294967296", "-4294967296",
           "9223372036854775807", "9223372036854775808", "-9223372036854775809",
           "72057594037927936", "1e400", "-1e400", "1e-400", "1.5", "-0.0", "0.5", "1e308",
           "nan", "inf", "-inf", "1" * 5000, "0." + "0" * 5000 + "1"]
TYPES = ["f32", "f64", "i32", "i64", "bool", "f16"]
DEVICES = ["cpu", "gpu", "tpu", "r1/cpu", "r0/cpu"]
WORDS = ["param", "state", "data", "init", "return", "graph", "fused", "split",
         "replicated", "partial", "true", "false", "~", "@", "{", "}", "[", "]", "(", ")",
         ",", "=", ":", "loss", "relu", "reshape", "sgd", "fill", "matmul", "dropout_mask"]
STRINGS = ['"uniform(-1)"', '"gaussian(-1)"', '"uniform(inf)"', '"constant(1e400)"',
           '"gaussian(nan)"', '"constant(3)"', '"xavier"', '"msra"', '"cpu:0,cpu:1"',
           '"f16"', '"i64"', '""']


_PUNCTUATION = "(){}[],:=@~/"


def _tokens(text: str) -> list[str]:
    return _TOKEN_RE.findall(text)


def _like(token: str, tokens: list[str]) -> list[str]:
    """Tokens of the same class as ``token``: what a replacement that still parses
    often, and so reaches the verifier and the runtime, draws from."""
    if re.fullmatch(r"-?[0-9]{1,9}", token):  # a nearby integer, as often as an odd one
        n = int(token)
        return [str(m) for m in (0, 1, n - 1, n + 1, 2 * n, n // 2, -n)] + NUMBERS
    if token[0].isdigit() or token[0] == "-" or token in ("inf", "nan"):
        return NUMBERS
    if token[0] == '"':
        return STRINGS
    if token in TYPES:
        return TYPES
    if token in ("cpu", "gpu"):
        return DEVICES
    kind = "%" if token[0] == "%" else "a"
    same = sorted({t for t in tokens if t[0] == kind or (kind == "a" and t[0].isalpha())})
    return same or WORDS


@st.composite
def mutated(draw) -> str:
    """A dump with one to three mutations of its tokens or lines, or cut short. Places
    and choices come from a `random.Random` Hypothesis draws: uniform over the text
    (Hypothesis's own integers favour the start, and a text cut there)."""
    rnd = draw(st.randoms(use_true_random=False))
    text = rnd.choice(dumps())
    if rnd.random() < 0.5:  # gentle: one word for another of its kind
        return _token_edit(rnd, text, "like")
    edits = [_token_edit] * 8 + [_line_edit] * 2 + [_truncate, _batch_edit]
    for _ in range(rnd.choice([1, 1, 1, 2, 3])):
        text = rnd.choice(edits)(rnd, text)
    return text


def _token_edit(rnd, text: str, how: str | None = None) -> str:
    tokens = _tokens(text)
    solid = [i for i, t in enumerate(tokens) if not t.isspace() and t[0] != "#"]
    if not solid:  # cut short to nothing already
        return text
    # Mostly a token that holds something (a number, name, string): mutating punctuation
    # is refused at once, and a graph that still parses tests more.
    words = [k for k, i in enumerate(solid) if tokens[i][0] not in _PUNCTUATION]
    k = (rnd.choice(words) if words and (how or rnd.random() < 0.85)
         else rnd.randrange(len(solid)))
    i = solid[k]
    how = how or rnd.choice(["delete", "duplicate", "swap", "any"] + ["like"] * 6)
    if how == "delete":
        tokens[i] = ""
    elif how == "duplicate":
        tokens[i] = tokens[i] + " " + tokens[i]
    elif how == "swap":  # with a neighbour, a few tokens away
        j = solid[min(len(solid) - 1, k + rnd.randint(1, 4))]
        tokens[i], tokens[j] = tokens[j], tokens[i]
    elif how == "like":
        tokens[i] = rnd.choice(_like(tokens[i], tokens))
    else:
        tokens[i] = rnd.choice(NUMBERS + TYPES + DEVICES + WORDS + STRINGS)
    return "".join(tokens)


def _line_edit(rnd, text: str) -> str:
    lines = text.split("\n")
    i = rnd.randrange(len(lines))
    how = rnd.choice(["delete", "duplicate", "swap"])
    if how == "delete":
        del lines[i]
    elif how == "duplicate":
        lines.insert(i, lines[i])
    else:
        j = rnd.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
    return "\n".join(lines)


def _batch_edit(rnd, text: str) -> str:
    """Another batch size throughout: types stay consistent, sizes grow past the limit."""
    batch = rnd.choice([0, 1, 1000, 65536, 2**32, 2**40, 2**62])
    return re.sub(rf"\[{BATCH}([,\]])", rf"[{batch}\1", text)


def _truncate(rnd, text: str) -> str:
    return text[:rnd.randrange(len(text) + 1)]


# -- the property -----------------------------------------------------------------------


def _random_feeds(graph, rng) -> dict[str, np.ndarray]:
    feeds = {}
    for v in graph.inputs_with_role("data"):
        dtype, shape = v.type.dtype.numpy, v.type.shape
        if dtype.kind == "f":
            feeds[v.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[v.name] = rng.random(shape) < 0.5
        else:  # labels: small classes
            feeds[v.name] = rng.integers(0, 2, shape).astype(dtype)
    return feeds


def run_once(text: str) -> None:
    """Parse ``text`` as a .pir file is read, build it on the reference target and run
    it once: a step, for a training iteration."""
    graph = parse(text, source="fuzz.pir", verify=True)
    with purinec.compile(graph, target="reference") as program:
        feeds = _random_feeds(program.ir, np.random.default_rng(0))
        if updated_variables(program.ir):
            program.step(feeds)
        else:
            program.run(feeds)


@contextlib.contextmanager
def _time_limit(seconds: int):
    def hang(signum, frame):
        raise TimeoutError(f"an example ran for more than {seconds} s")
    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """An empty working directory and a small memory limit for the whole module."""
    directory = tmp_path_factory.mktemp("fuzz")
    before, limit = os.getcwd(), os.environ.get(LIMIT_VARIABLE)
    os.chdir(directory)
    os.environ[LIMIT_VARIABLE] = MEMORY_LIMIT
    yield directory
    os.chdir(before)
    if limit is None:
        del os.environ[LIMIT_VARIABLE]
    else:
        os.environ[LIMIT_VARIABLE] = limit


def check(text: str, sandbox) -> None:
    """The property: a clean refusal (a PurinecError, which names what and where) or a
    run; in time, and writing nothing."""
    with warnings.catch_warnings(), _time_limit(SECONDS_PER_EXAMPLE):
        warnings.simplefilter("ignore")  # (a mutated graph may well overflow)
        try:
            run_once(text)
        except PurinecError:
            pass
    assert not list(sandbox.iterdir()), "an example wrote files"


def test_the_dumps_themselves_run(sandbox):
    assert len(dumps()) == len(MODELS) * 2 * len(STAGES)
    for text in dumps():
        run_once(text)


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutated_dumps_are_refused_cleanly_or_run(sandbox, text):
    check(text, sandbox)


@pytest.mark.slow
@settings(max_examples=6000, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_many_mutated_dumps_are_refused_cleanly_or_run(sandbox, text):
    check(text, sandbox)


@pytest.mark.parametrize("group", ["[cpu:0]", "[cpu:1]", "[cpu:1,cpu:0]"])
def test_every_distribution_changed_in_turn_is_refused_cleanly_or_runs(sandbox, group):
    """Each value of mlp's data-parallel training iteration laid out over another group
    (random edits rarely pick these): partitioning such a graph once defined a value
    twice, a ValueError."""
    [text] = [t for t in dumps() if t.startswith("graph mlp.train") and "~ split" in t]
    spans = [m.start() for m in re.finditer(re.escape("[cpu:0,cpu:1]"), text)]
    for start in spans:
        check(text[:start] + group + text[start + len("[cpu:0,cpu:1]"):], sandbox)
