"""Arbitrary JSON to the trace importers: a trace, or a ``TraceFormatError`` that says where.

Each importer gets arbitrary JSON values and objects shaped like its format with arbitrary
values in the fields (the Continuum, InferCept and Mooncake importers, and the trace
format's own JSON lines). Whatever it gets, it returns a ``Trace`` or raises
``TraceFormatError`` (a ``ValueError``) with a message; never another exception.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.traces.continuum import from_continuum
from services.traces.infercept import from_infercept
from services.traces.model import Trace, TraceFormatError
from services.traces.mooncake import from_mooncake
from tests.unit.fuzz.profile import FUZZ

pytestmark = pytest.mark.unit

SCALARS = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=12)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=16,
)


def _shaped(keys: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """Objects with (some of) a format's own keys and arbitrary values."""
    return st.fixed_dictionaries({}, optional={k: JSON for k in keys})


MESSAGE = _shaped(["role", "content", "tool_calls", "name", "function", "arguments", "duration", "tokens"])
CONTINUUM = st.lists(
    _shaped(["messages", "trajectory", "id", "tools"])
    | st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=4)}),
    max_size=3,
)
CALL = _shaped(["prompt", "prompt_tokens", "output_tokens", "returned_text", "api", "duration", "tool"])
INFERCEPT = st.dictionaries(st.text(max_size=6), st.lists(CALL, max_size=3) | JSON, max_size=3)
MOONCAKE_LINE = st.builds(json.dumps, _shaped(["timestamp", "input_length", "output_length", "hash_ids"])) | st.text(
    max_size=40
)
TRACE_LINE = st.builds(json.dumps, _shaped(["session_id", "turns", "arrival_s", "shared_prefix", "tags"]) | JSON)


def _refused_or_trace(load: Callable[[], Trace]) -> None:
    try:
        trace = load()
    except TraceFormatError as error:
        assert str(error), "a format error says where and why"
        return
    assert isinstance(trace, Trace)


@FUZZ
@given(JSON | CONTINUUM)
def test_the_continuum_importer_takes_any_json(obj: Any) -> None:
    _refused_or_trace(lambda: from_continuum(obj, arrival_rate_per_s=1.0, rng=random.Random(0)))


@FUZZ
@given(JSON | INFERCEPT)
def test_the_infercept_importer_takes_any_json(obj: Any) -> None:
    _refused_or_trace(lambda: from_infercept(obj, arrival_rate_per_s=1.0, rng=random.Random(0)))


@FUZZ
@given(st.lists(MOONCAKE_LINE, max_size=4))
def test_the_mooncake_importer_takes_any_lines(lines: list[str]) -> None:
    _refused_or_trace(lambda: from_mooncake(lines))


@FUZZ
@given(st.lists(TRACE_LINE, max_size=3))
def test_the_trace_format_takes_any_json_lines(lines: list[str]) -> None:
    _refused_or_trace(lambda: Trace.from_json_lines(lines))
