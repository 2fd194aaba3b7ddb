"""Schemas evolve compatibly: every release stays readable, and a breaking change is rejected."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.read import SchemaResolutionError

from schemas import events, registry

pytestmark = pytest.mark.unit


def crc64_avro(data: bytes) -> bytes:
    """CRC-64-AVRO straight from the Avro specification, as little-endian bytes."""
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    fp = empty
    for byte in data:
        fp = (fp >> 8) ^ table[(fp ^ byte) & 0xFF]
    return fp.to_bytes(8, "little")


def test_fingerprint_is_the_spec_crc64() -> None:
    assert registry.canonical_fingerprint("null") == crc64_avro(b'"null"')
    assert registry.canonical_fingerprint("null") == (7195948357588979594).to_bytes(8, "little")  # the spec's value


def test_current_envelope_is_released() -> None:
    """Changing an .avsc without releasing a new envelope version fails here.

    Fix: ``python -m schemas.registry release <next version>``, after checking
    that the change is compatible (the tests below run on every release).
    """
    latest = registry.releases()[-1]
    assert registry.expanded_envelope() == latest.schema, (
        f"schemas/avro changed since release v{latest.version}: add release v{latest.version + 1}"
    )
    assert registry.current_fingerprint() == latest.fingerprint


def sample_datum(schema: Any, names: dict[str, Any]) -> Any:
    """A value of any Avro schema (first union branch, one array element)."""
    if isinstance(schema, str):
        if schema in names:
            return sample_datum(names[schema], names)
        return {"null": None, "string": "s", "long": 7, "int": 7, "double": 1.5, "boolean": True, "bytes": b"b"}[schema]
    if isinstance(schema, list):
        # The first branch: new event types are appended to the body union, so an old reader
        # knows the first ones (it cannot know a type added after it; that is Avro's rule too).
        return sample_datum(schema[0], names)
    kind = schema["type"]
    if kind == "record":
        names[f"{schema.get('namespace', registry.NAMESPACE)}.{schema['name']}"] = schema
        return {f["name"]: sample_datum(f["type"], names) for f in schema["fields"]}
    if kind == "enum":
        names[f"{schema.get('namespace', registry.NAMESPACE)}.{schema['name']}"] = schema
        return schema["symbols"][0]
    if kind == "array":
        return [sample_datum(schema["items"], names)]
    if kind == "map":
        return {"k": sample_datum(schema["values"], names)}
    return sample_datum(kind, names)


def resolves(writer: dict[str, Any], reader: dict[str, Any]) -> bool:
    """Whether a record written with ``writer`` can be read with ``reader``."""
    datum = sample_datum(writer, {})
    buf = io.BytesIO()
    schemaless_writer(buf, parse_schema(writer, named_schemas={}), datum)
    buf.seek(0)
    try:
        schemaless_reader(buf, parse_schema(writer, named_schemas={}), parse_schema(reader, named_schemas={}))
    except SchemaResolutionError:
        return False
    return True


@pytest.mark.parametrize("release", registry.releases(), ids=lambda r: f"v{r.version}")
def test_old_records_resolve_to_the_current_reader(release: registry.Release) -> None:
    assert resolves(release.schema, registry.expanded_envelope())


@pytest.mark.parametrize("release", registry.releases(), ids=lambda r: f"v{r.version}")
def test_old_readers_resolve_current_records(release: registry.Release) -> None:
    assert resolves(registry.expanded_envelope(), release.schema)


def test_a_breaking_change_is_rejected() -> None:
    current = registry.expanded_envelope()
    # A new required field: records written before it have no value for it.
    added = json.loads(json.dumps(current))
    added["fields"].insert(1, {"name": "tenant", "type": "string", "doc": "new, no default"})
    assert not resolves(current, added)
    # A field whose type changes incompatibly.
    retyped = json.loads(json.dumps(current))
    retyped["fields"][2]["type"] = "boolean"  # seq: long -> boolean
    assert not resolves(current, retyped)


def test_a_compatible_change_is_accepted() -> None:
    current = registry.expanded_envelope()
    extended = json.loads(json.dumps(current))
    extended["fields"].insert(1, {"name": "tenant", "type": ["null", "string"], "default": None, "doc": "new"})
    assert resolves(current, extended)
    assert resolves(extended, current)


def test_an_llm_call_completed_of_release_2_reads_without_tool_calls() -> None:
    """Release 3 added ``LLMCallCompleted.tool_calls_json`` (null by default): every older record still
    decodes, and reads as a reply without tool calls."""
    old = registry.releases()[1]
    assert old.version == 2
    body = next(f for f in old.schema["fields"] if f["name"] == "body")
    written = next(s for s in body["type"] if isinstance(s, dict) and s.get("name") == "LLMCallCompleted")
    assert "tool_calls_json" not in {f["name"] for f in written["fields"]}
    datum = sample_datum(old.schema, {})
    datum["body"] = ("agentlog.LLMCallCompleted", sample_datum(written, {}))
    buf = io.BytesIO()
    schemaless_writer(buf, parse_schema(old.schema, named_schemas={}), datum)
    buf.seek(0)
    current = parse_schema(registry.expanded_envelope(), named_schemas={})
    read = schemaless_reader(buf, parse_schema(old.schema, named_schemas={}), current, return_record_name=True)
    name, record = read["body"]
    assert name == "agentlog.LLMCallCompleted" and record["tool_calls_json"] is None
    assert record["output_text"] == "s"


def _llm_call_started(schema: dict[str, Any]) -> dict[str, Any]:
    body = next(f for f in schema["fields"] if f["name"] == "body")
    return next(s for s in body["type"] if isinstance(s, dict) and s.get("name") == "LLMCallStarted")


def _write_read(writer: dict[str, Any], reader: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    datum = sample_datum(writer, {})
    datum["body"] = ("agentlog.LLMCallStarted", record)
    buf = io.BytesIO()
    schemaless_writer(buf, parse_schema(writer, named_schemas={}), datum)
    buf.seek(0)
    read = schemaless_reader(
        buf, parse_schema(writer, named_schemas={}), parse_schema(reader, named_schemas={}), return_record_name=True
    )
    name, body = read["body"]
    assert name == "agentlog.LLMCallStarted"
    return dict(body)


PRIORITY_FIELDS = ("priority", "priority_attained_ms", "priority_age_ms", "priority_warm")


def test_an_llm_call_started_of_release_7_reads_without_a_priority() -> None:
    """Release 8 added the call's priority and what it was computed from to ``LLMCallStarted``
    (each null by default): a record written before reads as a call sent without one."""
    old = next(r for r in registry.releases() if r.version == 7)
    written = _llm_call_started(old.schema)
    assert not set(PRIORITY_FIELDS) & {f["name"] for f in written["fields"]}
    body = _write_read(old.schema, registry.expanded_envelope(), sample_datum(written, {}))
    assert all(body[name] is None for name in PRIORITY_FIELDS)
    assert body["prompt_digest"] == "s"
    assert events.LLMCallStarted.model_validate(body).priority is None


def test_a_reader_of_release_7_reads_an_llm_call_started_with_a_priority() -> None:
    """An older reader (a process not yet upgraded) reads a new record and skips the new fields."""
    old = next(r for r in registry.releases() if r.version == 7)
    current = registry.expanded_envelope()
    record = {
        **sample_datum(_llm_call_started(current), {}),
        "priority": -1_234_567,
        "priority_attained_ms": 812.5,
        "priority_age_ms": 40_000.0,
        "priority_warm": True,
    }
    assert _write_read(current, current, record)["priority"] == -1_234_567
    body = _write_read(current, old.schema, record)
    assert not set(PRIORITY_FIELDS) & set(body)
    assert body["prompt_digest"] == "s" and body["turn"] == 7
