"""log.body_writer: fastavro's bytes, or a refusal that hands the body back to fastavro."""

from __future__ import annotations

import io
from typing import Any

import pytest
from fastavro import parse_schema, schemaless_writer

from log.body_writer import Unusual, body_writer

pytestmark = pytest.mark.unit

SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "agentlog.Sample",
    "fields": [
        {"name": "s", "type": "string"},
        {"name": "b", "type": "bytes"},
        {"name": "n", "type": "long"},
        {"name": "i", "type": "int"},
        {"name": "d", "type": "double"},
        {"name": "flag", "type": "boolean"},
        {"name": "e", "type": {"type": "enum", "name": "agentlog.E", "symbols": ["A", "B"]}},
        {"name": "o", "type": ["null", "string"]},
        {"name": "o2", "type": ["long", "null"]},
        {"name": "xs", "type": {"type": "array", "items": "string"}},
        {"name": "m", "type": {"type": "map", "values": "long"}},
    ],
}
GOOD: dict[str, Any] = {
    "s": "é" * 70,
    "b": b"\x00\xff",
    "n": -(2**63),
    "i": 2**31 - 1,
    "d": -0.5,
    "flag": True,
    "e": "B",
    "o": None,
    "o2": 7,
    "xs": ["a", ""],
    "m": {"k": 1, "": -1},
}
WRITE = body_writer(SCHEMA)


def fastavro_bytes(values: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    schemaless_writer(buf, parse_schema(SCHEMA, named_schemas={}), values)
    return buf.getvalue()


@pytest.mark.parametrize(
    "overrides",
    [{}, {"o": "x", "o2": None}, {"xs": [], "m": {}}, {"flag": False, "e": "A", "n": 2**63 - 1, "i": -(2**31)}],
    ids=["good", "other-branches", "empty-collections", "edges"],
)
def test_writes_fastavros_bytes(overrides: dict[str, Any]) -> None:
    assert WRITE is not None
    values = {**GOOD, **overrides}
    assert WRITE(values) == fastavro_bytes(values)


@pytest.mark.parametrize(
    "overrides",
    [
        {"s": b"bytes"},
        {"b": "str"},
        {"n": True},
        {"n": 2**63},
        {"i": 2**31},
        {"d": 1},
        {"flag": 1},
        {"e": "C"},
        {"e": 1},
        {"o": 5},
        {"xs": ("a",)},
        {"xs": [1]},
        {"m": {1: 1}},
        {"m": [("k", 1)]},
    ],
    ids=lambda o: f"{next(iter(o))}={next(iter(o.values()))!r}",
)
def test_refuses_values_it_does_not_expect(overrides: dict[str, Any]) -> None:
    assert WRITE is not None
    with pytest.raises(Unusual):
        WRITE({**GOOD, **overrides})


def test_a_missing_field_or_a_lone_surrogate_raises() -> None:
    assert WRITE is not None
    with pytest.raises(KeyError):
        WRITE({k: v for k, v in GOOD.items() if k != "s"})
    with pytest.raises(UnicodeEncodeError):
        WRITE({**GOOD, "s": "\ud800"})


@pytest.mark.parametrize(
    "field_type",
    [
        "agentlog.Named",
        "float",
        {"type": "long", "logicalType": "timestamp-micros"},
        ["null", "string", "long"],
        ["string", "long"],
        {"type": "record", "name": "agentlog.Inner", "fields": []},
        {"type": "array", "items": "float"},
        {"type": "fixed", "name": "agentlog.F", "size": 4},
    ],
    ids=str,
)
def test_types_it_does_not_write_get_no_writer(field_type: Any) -> None:
    assert body_writer({"type": "record", "name": "agentlog.R", "fields": [{"name": "f", "type": field_type}]}) is None


def test_only_records_get_a_writer() -> None:
    assert body_writer({"type": "enum", "name": "agentlog.E", "symbols": ["A"]}) is None
