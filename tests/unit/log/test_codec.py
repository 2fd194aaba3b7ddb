"""Single-object encoding, the hash, and a typed error for every kind of bad bytes."""

from __future__ import annotations

import hashlib
import io
from datetime import UTC, datetime

import pytest
from fastavro import parse_schema, schemaless_writer

from log.codec import HEADER_LEN, MAGIC, ZERO_HASH, Codec
from log.errors import BadMagic, HashMismatch, SchemaMismatch, TruncatedRecord, UnknownFingerprint
from schemas import events, registry
from tests.samples import sample

pytestmark = pytest.mark.unit

CODEC = Codec()
WHEN = datetime(2026, 11, 29, 12, 0, 0, 123456, tzinfo=UTC)


def encode(body: events.Model, **overrides: object) -> tuple[bytes, bytes]:
    fields: dict[str, object] = {
        "event_id": "e-1",
        "session_id": "s-1",
        "seq": 0,
        "actor": "planner",
        "occurred_at": WHEN,
        "causation_id": None,
        "prev_hash": ZERO_HASH,
        "body": body,
    }
    fields.update(overrides)
    return CODEC.encode(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("model", events.EVENT_TYPES, ids=lambda m: m.__name__)
def test_every_event_type_round_trips(model: type[events.Model]) -> None:
    body = sample(model)
    record, digest = encode(body, causation_id="cause-1")
    envelope = CODEC.decode(record)
    assert envelope.body == body
    assert type(envelope.body) is model
    assert (envelope.event_id, envelope.session_id, envelope.seq, envelope.actor) == ("e-1", "s-1", 0, "planner")
    assert envelope.occurred_at == WHEN
    assert envelope.causation_id == "cause-1"
    assert envelope.hash == digest


def test_wire_format_is_single_object_encoding() -> None:
    record, digest = encode(events.SessionFailed(reason="r", error_type="E"))
    assert record[:2] == b"\xc3\x01"
    assert record[2:10] == registry.current_fingerprint()
    assert record[-33:] == b"\x40" + digest
    # The hash covers every byte of the body except the hash itself, prev_hash included.
    assert digest == hashlib.sha256(record[HEADER_LEN:-33]).digest()


def test_prev_hash_is_part_of_the_hash() -> None:
    _, first = encode(events.SessionFailed(reason="r", error_type="E"))
    _, second = encode(events.SessionFailed(reason="r", error_type="E"), prev_hash=b"\x01" * 32)
    assert first != second


def test_bad_magic() -> None:
    record, _ = encode(events.SessionFailed(reason="r", error_type="E"))
    with pytest.raises(BadMagic, match="not c301"):
        CODEC.decode(b"\x00\x01" + record[2:])
    with pytest.raises(BadMagic):
        CODEC.decode(b'{"json": true}')


def test_unknown_fingerprint() -> None:
    record, _ = encode(events.SessionFailed(reason="r", error_type="E"))
    with pytest.raises(UnknownFingerprint, match="0102030405060708"):
        CODEC.decode(MAGIC + bytes(range(1, 9)) + record[HEADER_LEN:])


@pytest.mark.parametrize("cut", [1, 5, 9, 20, 60])
def test_truncated(cut: int) -> None:
    record, _ = encode(events.SessionFailed(reason="a reason of some length", error_type="E"))
    with pytest.raises((TruncatedRecord, SchemaMismatch)):
        CODEC.decode(record[: len(record) - cut] if cut > 9 else record[:cut])
    with pytest.raises(TruncatedRecord):
        CODEC.decode(record[:cut] if cut < HEADER_LEN else record[: HEADER_LEN + 3])


def test_schema_mismatch_on_garbage_body() -> None:
    with pytest.raises(SchemaMismatch):
        CODEC.decode(MAGIC + registry.current_fingerprint() + b"\x02\xff" + b"\xff" * 40)


def test_schema_mismatch_on_trailing_bytes() -> None:
    record, _ = encode(events.SessionFailed(reason="r", error_type="E"))
    with pytest.raises(SchemaMismatch, match="follow the end"):
        CODEC.decode(record + b"\x00")


def test_schema_mismatch_on_short_hash() -> None:
    # A well-formed Avro envelope whose hash field is 3 bytes long.
    schema = parse_schema(registry.expanded_envelope(), named_schemas={})
    buf = io.BytesIO()
    schemaless_writer(
        buf,
        schema,
        {
            "event_id": "e",
            "session_id": "s",
            "seq": 0,
            "actor": "planner",
            "occurred_at": 0,
            "causation_id": None,
            "prev_hash": ZERO_HASH,
            "body": ("agentlog.SessionFailed", {"reason": "r", "error_type": "E"}),
            "hash": b"abc",
        },
    )
    with pytest.raises(SchemaMismatch, match="hash field is 3 bytes"):
        CODEC.decode(MAGIC + registry.current_fingerprint() + buf.getvalue())


def test_tampered_body_fails_its_hash() -> None:
    record, _ = encode(events.SessionFailed(reason="paid 10 EUR", error_type="E"))
    tampered = record.replace(b"paid 10 EUR", b"paid 99 EUR")
    with pytest.raises(HashMismatch, match="altered after writing"):
        CODEC.decode(tampered)


def test_old_release_records_decode() -> None:
    """A record written with release v1 decodes (the writer schema is found by fingerprint)."""
    v1 = registry.releases()[0]
    schema = parse_schema(v1.schema, named_schemas={})
    buf = io.BytesIO()
    schemaless_writer(
        buf,
        {**v1.schema, "fields": v1.schema["fields"][:-1]},
        {
            "event_id": "e",
            "session_id": "s",
            "seq": 0,
            "actor": "planner",
            "occurred_at": 0,
            "causation_id": None,
            "prev_hash": ZERO_HASH,
            "body": ("agentlog.SessionFailed", {"reason": "r", "error_type": "E"}),
        },
    )
    assert schema  # parsed fine
    unhashed = buf.getvalue()
    record = MAGIC + v1.fingerprint + unhashed + b"\x40" + hashlib.sha256(unhashed).digest()
    assert CODEC.decode(record).body == events.SessionFailed(reason="r", error_type="E")


def test_a_timestamp_no_datetime_holds_is_a_schema_mismatch() -> None:
    """A forged record with a valid hash but an absurd occurred_at goes to the DLQ, not up the stack."""
    schema = parse_schema({**registry.expanded_envelope(), "fields": registry.expanded_envelope()["fields"][:-1]})
    buf = io.BytesIO()
    schemaless_writer(
        buf,
        schema,
        {
            "event_id": "e",
            "session_id": "s",
            "seq": 0,
            "actor": "planner",
            "occurred_at": 2**62,
            "causation_id": None,
            "prev_hash": ZERO_HASH,
            "body": ("agentlog.SessionFailed", {"reason": "r", "error_type": "E"}),
        },
    )
    unhashed = buf.getvalue()
    record = MAGIC + registry.current_fingerprint() + unhashed + b"\x40" + hashlib.sha256(unhashed).digest()
    with pytest.raises(SchemaMismatch):
        CODEC.decode(record)
