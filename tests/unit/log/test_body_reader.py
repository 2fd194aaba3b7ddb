"""log.body_reader: fastavro's values, or a refusal that hands the bytes back to fastavro."""

from __future__ import annotations

import io
import types
from enum import StrEnum
from typing import Any, NewType

import pytest
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from log import native
from log.body_reader import constructible
from log.body_writer import Unusual

pytestmark = pytest.mark.unit


class E(StrEnum):
    A = "A"
    B = "B"


Name = NewType("Name", str)

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
        {"name": "ns", "type": {"type": "array", "items": "long"}},
        {"name": "m", "type": {"type": "map", "values": "long"}},
    ],
}
HINTS: dict[str, Any] = {
    "s": Name,
    "b": bytes,
    "n": int,
    "i": int,
    "d": float,
    "flag": bool,
    "e": E,
    "o": str | None,
    "o2": int | None,
    "xs": list[str],
    "ns": list[int],
    "m": dict[str, int],
}
GOOD: dict[str, Any] = {
    "s": "é" * 70,  # a two-byte length
    "b": b"\x00\xff",
    "n": -(2**62),
    "i": 2**31 - 1,
    "d": -0.5,
    "flag": True,
    "e": "B",
    "o": None,
    "o2": 7,
    "xs": ["a", "", "ü" * 40],
    "ns": [0, -1, 2**40],
    "m": {"k": 1, "": -1},
}
PARSED = parse_schema(SCHEMA, named_schemas={})
# The module as it is and, where make install built it, its mypyc build (log.native): both read alike.
MODULES = list({m.__name__: m for m in (native.module("body_reader", compiled=c) for c in (False, True))}.values())


@pytest.fixture(params=MODULES, ids=lambda m: m.__name__)
def readers(request: pytest.FixtureRequest) -> types.ModuleType:
    module: types.ModuleType = request.param
    return module


def encoded(values: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    schemaless_writer(buf, PARSED, values)
    return buf.getvalue()


def fastavro_values(data: bytes, pos: int = 0) -> tuple[dict[str, Any], int]:
    buf = io.BytesIO(data)
    buf.seek(pos)
    values = schemaless_reader(buf, PARSED, None)
    assert isinstance(values, dict)
    return values, buf.tell()


def typed(values: dict[str, Any]) -> list[tuple[str, type, Any]]:
    return [(name, type(value), value) for name, value in values.items()]


@pytest.mark.parametrize(
    "overrides",
    [{}, {"o": "x", "o2": None}, {"xs": [], "ns": [], "m": {}}, {"flag": False, "e": "A", "i": -(2**31)}],
    ids=["good", "other-branches", "empty-collections", "edges"],
)
def test_reads_fastavros_values_with_the_models_enum(readers: types.ModuleType, overrides: dict[str, Any]) -> None:
    read_body = readers.body_reader(SCHEMA, HINTS)
    assert read_body is not None
    data = b"head" + encoded({**GOOD, **overrides}) + b"tail"
    values, end = read_body(data, 4)
    expected, expected_end = fastavro_values(data, 4)
    assert end == expected_end == len(data) - 4
    assert type(values["e"]) is E  # the member, not its symbol: the body needs no validation
    assert typed({**values, "e": values["e"].value}) == typed(expected)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.fixed_dictionaries(
        {
            "s": st.text(),
            "b": st.binary(),
            "n": st.integers(-(2**63), 2**63 - 1),
            "i": st.integers(-(2**31), 2**31 - 1),
            "d": st.floats(allow_nan=False),
            "flag": st.booleans(),
            "e": st.sampled_from(["A", "B"]),
            "o": st.none() | st.text(),
            "o2": st.none() | st.integers(-(2**63), 2**63 - 1),
            "xs": st.lists(st.text()),
            "ns": st.lists(st.integers(-(2**63), 2**63 - 1)),
            "m": st.dictionaries(st.text(), st.integers(-(2**63), 2**63 - 1)),
        }
    )
)
def test_generated_values_read_as_fastavro_reads_them_or_are_left_to_it(
    readers: types.ModuleType, values: dict[str, Any]
) -> None:
    read_body = readers.body_reader(SCHEMA, HINTS)
    assert read_body is not None
    data = encoded(values)
    expected, expected_end = fastavro_values(data)
    try:
        read, end = read_body(data, 0)
    except Unusual:
        # Only longs of ten bytes go back to fastavro (valid bytes of every other kind are read).
        assert any(abs(n) >= 2**62 for n in [values["n"], values["o2"] or 0, *values["ns"], *values["m"].values()])
        return
    assert end == expected_end
    assert typed({**read, "e": read["e"].value}) == typed(expected)


@pytest.mark.parametrize(
    "data",
    [
        b"\x80",  # a string length with nothing after it
        b"\x0a",  # a five-byte string, no bytes
        b"\x04\xff\xfe",  # bad UTF-8
        b"\x03",  # a negative length
    ],
    ids=["cut-varint", "past-the-end", "bad-utf8", "negative-length"],
)
def test_bad_bytes_are_left_to_fastavro(readers: types.ModuleType, data: bytes) -> None:
    read_body = readers.body_reader(SCHEMA, HINTS)
    assert read_body is not None
    with pytest.raises(Unusual):
        read_body(data, 0)


def at_field(name: str, replacement: bytes) -> bytes:
    """GOOD's bytes with the encoding of field ``name`` replaced."""
    out = b""
    for field in SCHEMA["fields"]:
        single = parse_schema({**SCHEMA, "fields": [field]}, named_schemas={})
        buf = io.BytesIO()
        schemaless_writer(buf, single, {field["name"]: GOOD[field["name"]]})
        out += replacement if field["name"] == name else buf.getvalue()
    return out


@pytest.mark.parametrize(
    ("name", "replacement"),
    [
        ("flag", b"\x02"),  # a boolean byte other than 0 or 1
        ("e", b"\x04"),  # enum index 2 of 2 symbols
        ("e", b"\x01"),  # enum index -1
        ("o", b"\x04"),  # union branch 2 of 2
        ("xs", b"\x01\x02\x00\x00"),  # a block of -1 item with its byte size
        ("m", b"\x01\x04\x00\x00\x00"),
        ("n", b"\xff" * 9 + b"\x01"),  # a ten-byte long
        ("d", b"\x00" * 3),  # a double cut short (the record ends there)
    ],
    ids=[
        "bool-2",
        "enum-2",
        "enum-minus-1",
        "branch-2",
        "array-sized-block",
        "map-sized-block",
        "ten-byte-long",
        "cut-double",
    ],
)
def test_unusual_encodings_are_left_to_fastavro(readers: types.ModuleType, name: str, replacement: bytes) -> None:
    read_body = readers.body_reader(SCHEMA, HINTS)
    assert read_body is not None
    data = at_field(name, replacement)
    if name == "d":
        data = data[: data.index(replacement) + len(replacement)]
    with pytest.raises(Unusual):
        read_body(data, 0)


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
def test_types_it_does_not_read_get_no_reader(readers: types.ModuleType, field_type: Any) -> None:
    record = {"type": "record", "name": "agentlog.R", "fields": [{"name": "f", "type": field_type}]}
    assert readers.body_reader(record, {}) is None


def test_an_enum_the_model_does_not_type_gets_no_reader(readers: types.ModuleType) -> None:
    body_reader = readers.body_reader
    enum = {"type": "enum", "name": "agentlog.E", "symbols": ["A", "C"]}
    record = {"type": "record", "name": "agentlog.R", "fields": [{"name": "e", "type": enum}]}
    assert body_reader(record, {"e": E}) is None  # the model's enum has B, not C
    assert body_reader(record, {"e": str}) is None


def test_only_records_get_a_reader(readers: types.ModuleType) -> None:
    assert readers.body_reader({"type": "enum", "name": "agentlog.E", "symbols": ["A"]}, {}) is None


def test_constructible_only_where_every_field_is_typed_as_it_reads() -> None:
    assert constructible(SCHEMA, HINTS, set())
    assert not constructible(SCHEMA, HINTS, {"n"})  # a constraint: validation decides
    for name, annotation in [
        ("n", float),  # an int where a float is expected: validation converts it
        ("d", int),
        ("flag", int),
        ("o", str),
        ("o2", int | str | None),
        ("xs", list[Name | int]),
        ("xs", tuple[str, ...]),
        ("m", dict[Name | int, int]),
        ("e", str),
    ]:
        assert not constructible(SCHEMA, {**HINTS, name: annotation}, set()), (name, annotation)


def test_an_enum_named_again_after_its_definition_is_read_as_defined(readers: types.ModuleType) -> None:
    body_reader, constructible = readers.body_reader, readers.constructible
    # As in KVSwapCompleted: from_tier defines the enum, to_tier refers to it by name.
    enum = {"type": "enum", "name": "E", "namespace": "agentlog", "symbols": ["A", "B"]}
    record = {
        "type": "record",
        "name": "agentlog.R",
        "fields": [{"name": "a", "type": enum}, {"name": "b", "type": ["null", "agentlog.E"]}],
    }
    hints = {"a": E, "b": E | None}
    read = body_reader(record, hints)
    assert read is not None and constructible(record, hints, set())
    assert read(b"\x02\x02\x00", 0) == ({"a": E.B, "b": E.A}, 3)
    assert body_reader({**record, "fields": record["fields"][1:]}, hints) is None  # never defined


def test_primitive_fields_and_their_optionals_are_read_directly() -> None:
    """The reader reads these kinds itself (``_kind``); a field typed otherwise goes through its
    own reader. Were a primitive no longer classified, reading would still be right, only
    slower, and no other test would notice."""
    from log.body_reader import _BOOLEAN, _BYTES, _DOUBLE, _LONG, _OTHER, _STRING, _kind

    kinds = {field["name"]: _kind(field["type"]) for field in SCHEMA["fields"]}
    assert kinds == {
        "s": (_STRING, -1),
        "b": (_BYTES, -1),
        "n": (_LONG, -1),
        "i": (_LONG, -1),
        "d": (_DOUBLE, -1),
        "flag": (_BOOLEAN, -1),
        "e": (_OTHER, -1),
        "o": (_STRING, 0),
        "o2": (_LONG, 1),
        "xs": (_OTHER, -1),
        "ns": (_OTHER, -1),
        "m": (_OTHER, -1),
    }
