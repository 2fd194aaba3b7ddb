"""The codec's fast path is the generic Avro path, byte for byte and value for value.

``reference_encode`` and ``reference_decode`` below are the codec as it was before
the fast path: fastavro writing and reading the whole envelope with the generic
writer and reader, then pydantic validating the body. The fast path must produce
the same record bytes, decode them to equal envelopes with the same Python types
throughout (an enum member is not its string, 1.0 is not 1), and reject the bad
records the reference rejects, with the same error where the reference's is well
defined.
"""

from __future__ import annotations

import hashlib
import io
import types
import typing
from datetime import UTC, datetime, timedelta
from enum import Enum
from typing import Any

import pytest
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from log.codec import HEADER_LEN, MAGIC, ZERO_HASH, Codec, _check_layout, to_micros
from log.errors import DecodeError, HashMismatch, RecordError, SchemaMismatch, TruncatedRecord
from schemas import events, registry
from schemas.envelope import Envelope
from tests.samples import sample

pytestmark = pytest.mark.unit

CODEC = Codec()
EXPANDED = registry.expanded_envelope()
FULL_SCHEMA = parse_schema(EXPANDED, named_schemas={})
UNHASHED_SCHEMA = parse_schema({**EXPANDED, "fields": EXPANDED["fields"][:-1]}, named_schemas={})
HEADER = MAGIC + registry.current_fingerprint()
WHEN = datetime(2026, 11, 29, 12, 0, 0, 123456, tzinfo=UTC)
LONGS = st.integers(min_value=-(2**63), max_value=2**63 - 1)


# ------------------------------------------------------------------ the reference (the path before the fast one)


def reference_encode(
    *,
    event_id: str,
    session_id: str,
    seq: int,
    actor: str,
    occurred_at: datetime,
    causation_id: str | None,
    prev_hash: bytes,
    body: events.Model,
) -> tuple[bytes, bytes]:
    fields = {
        "event_id": event_id,
        "session_id": session_id,
        "seq": seq,
        "actor": actor,
        "occurred_at": to_micros(occurred_at),
        "causation_id": causation_id,
        "prev_hash": prev_hash,
        "body": (registry.full_name(type(body)), body.model_dump()),
    }
    buf = io.BytesIO()
    buf.write(HEADER)
    schemaless_writer(buf, UNHASHED_SCHEMA, fields)
    digest = hashlib.sha256(buf.getbuffer()[HEADER_LEN:]).digest()
    buf.write(b"\x40" + digest)
    return buf.getvalue(), digest


def reference_decode(data: bytes) -> Envelope:
    """The generic decode of a record of the current schema (header already known good)."""
    assert data[:HEADER_LEN] == HEADER
    payload = memoryview(data)[HEADER_LEN:]
    buf = io.BytesIO(payload)
    try:
        raw = schemaless_reader(buf, FULL_SCHEMA, None, return_record_name=True, return_record_name_override=True)
    except (EOFError, StopIteration) as e:
        raise TruncatedRecord(str(e)) from e
    except (ValueError, IndexError, UnicodeDecodeError, TypeError, KeyError) as e:
        raise SchemaMismatch(str(e)) from e
    assert isinstance(raw, dict)
    if buf.tell() != len(payload):
        raise SchemaMismatch("bytes follow the end of the record body")
    if len(raw["hash"]) != 32 or payload[-33] != 0x40:
        raise SchemaMismatch("hash field is not 32 bytes")
    if hashlib.sha256(payload[:-33]).digest() != raw["hash"]:
        raise HashMismatch("altered after writing")
    name, body = raw["body"]
    try:
        raw["body"] = registry.MODEL_BY_NAME[name].model_validate(body)
    except ValidationError as e:
        raise SchemaMismatch(str(e)) from e
    return Envelope.model_construct(**raw)


def shape(value: Any) -> Any:
    """``value`` with the exact type of every part spelled out, pydantic's bookkeeping included."""
    if isinstance(value, BaseModel):
        return (
            type(value),
            sorted(value.model_fields_set),
            [(k, shape(v)) for k, v in value.__dict__.items()],
            value.__pydantic_extra__,
            value.__pydantic_private__,
        )
    if isinstance(value, list):
        return (list, [shape(v) for v in value])
    if isinstance(value, dict):
        return (dict, [(k, shape(v)) for k, v in value.items()])
    if isinstance(value, datetime):
        return (datetime, value, value.tzinfo)
    return (type(value), value)


def assert_same_envelope(fast: Envelope, reference: Envelope) -> None:
    assert fast == reference
    assert shape(fast) == shape(reference)
    assert fast.model_dump() == reference.model_dump()


def fields_of(body: events.Model, **overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
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
    return fields


def assert_equivalent(fields: dict[str, Any]) -> bytes:
    """Fast and reference encode to the same bytes, which both decode to the same envelope."""
    record, digest = CODEC.encode(**fields)
    assert (record, digest) == reference_encode(**fields)
    assert_same_envelope(CODEC.decode(record), reference_decode(record))
    return record


# ------------------------------------------------------------------ sample bodies of every type


def without_optionals(model: type[events.Model], salt: int) -> events.Model:
    """A sample with every optional field left at its default (None)."""
    full = sample(model, salt)
    return model(**{name: getattr(full, name) for name, f in model.model_fields.items() if f.is_required()})


def empty_collections(model: type[events.Model], salt: int) -> events.Model:
    """A sample whose lists and maps are empty and whose strings are empty."""
    full = sample(model, salt)
    values = {}
    for name in model.model_fields:
        value = getattr(full, name)
        values[name] = type(value)() if type(value) in (list, dict, str) else value
    return model(**values)


SAMPLES = [
    pytest.param(make(model, salt), id=f"{model.__name__}-{make.__name__}-{salt}")
    for model in events.EVENT_TYPES
    for make in (sample, without_optionals, empty_collections)
    for salt in range(3)
]


@pytest.mark.parametrize("body", SAMPLES)
def test_every_event_type_encodes_and_decodes_as_the_generic_path(body: events.Model) -> None:
    assert_equivalent(fields_of(body))
    assert_equivalent(fields_of(body, causation_id="cause-é", seq=2**40, prev_hash=b"\x01" * 32))


def test_the_bench_mix_is_equivalent() -> None:
    from bench.log_throughput import build_drafts

    for i, draft in enumerate(build_drafts(300)):
        assert_equivalent(fields_of(draft.body, event_id=draft.event_id, session_id=draft.session_id, seq=i))


def test_flat_bodies_are_read_without_fastavro(monkeypatch: pytest.MonkeyPatch) -> None:
    """log.body_reader reads every body without nested records: if it stopped applying, decoding
    would still be right but twice as slow, and no other test would notice."""
    flat = [model for model in events.EVENT_TYPES if CODEC._body_of[model].flat]
    assert len(flat) >= len(events.EVENT_TYPES) - 4
    records = [CODEC.encode(**fields_of(sample(model, 0)))[0] for model in flat]

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("fastavro read a flat body")

    monkeypatch.setattr("log.codec.schemaless_reader", refuse)
    for model, record in zip(flat, records, strict=True):
        body_type = CODEC._body_of[model]
        assert body_type.read is not None and body_type.construct, model.__name__
        assert type(CODEC.decode(record).body) is model


def test_a_usual_record_is_read_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """log.head_reader.read_envelope reads a record whose body is built as read; if it stopped
    applying, decoding would still be right but slower, and no other test would notice."""
    as_read = [model for model in events.EVENT_TYPES if CODEC._body_of[model].construct]
    assert len(as_read) >= len(events.EVENT_TYPES) - 6
    records = [CODEC.encode(**fields_of(sample(model, 0)))[0] for model in as_read]

    def refuse(data: bytes) -> Envelope:
        raise AssertionError("read step by step")

    monkeypatch.setattr(CODEC, "_decode_current", refuse)
    for model, record in zip(as_read, records, strict=True):
        assert type(CODEC.decode(record).body) is model


def test_an_altered_record_is_refused_by_the_step_by_step_reading() -> None:
    record, _ = CODEC.encode(**fields_of(events.SessionStarted(program="pay 10", args_json="{}")))
    altered = record.replace(b"pay 10", b"pay 99")
    assert CODEC._read_envelope(altered, CODEC._header, CODEC._as_read, CODEC._built, CODEC._envelope_built) is None
    with pytest.raises(HashMismatch, match="does not match its own hash"):
        CODEC.decode(altered)


def test_decoded_models_share_their_fields_set_and_copies_do_not() -> None:
    """``_construct`` gives every decoded instance of a model one set of its field names; a
    copy with changes gets its own, so no instance sees another's (the models are frozen)."""
    first, second = (CODEC.decode(CODEC.encode(**fields_of(sample(events.SessionStarted, salt)))[0]) for salt in (0, 1))
    assert first.model_fields_set == set(Envelope.model_fields)
    assert first.body.model_fields_set == set(events.SessionStarted.model_fields)
    changed = first.model_copy(update={"seq": 7})
    assert changed.seq == 7 and changed.model_fields_set == set(Envelope.model_fields)
    assert changed.__pydantic_fields_set__ is not first.__pydantic_fields_set__
    assert first.__pydantic_fields_set__ is second.__pydantic_fields_set__ == set(Envelope.model_fields)


def test_a_model_that_is_not_frozen_is_not_built_as_read() -> None:
    from log.codec import _plain

    class Loose(BaseModel):
        name: str

    class Frozen(Loose, frozen=True):
        pass

    assert not _plain(Loose)
    assert _plain(Frozen)


def test_decoded_enums_and_nested_records_have_their_model_types() -> None:
    committed = events.ToolCallCommitted(
        call_id="t", votes=[events.Vote(voter="v", decision=events.VoteDecision.HOLD, reason="r")], policy="p"
    )
    decoded = CODEC.decode(assert_equivalent(fields_of(committed))).body
    assert isinstance(decoded, events.ToolCallCommitted)
    assert type(decoded.votes[0]) is events.Vote
    assert type(decoded.votes[0].decision) is events.VoteDecision
    swap = events.KVSwapCompleted(
        engine_id="e", from_tier=events.KVTier.GPU, to_tier=events.KVTier.DISK, num_blocks=3, duration_ms=1.0
    )
    decoded_swap = CODEC.decode(assert_equivalent(fields_of(swap))).body
    assert isinstance(decoded_swap, events.KVSwapCompleted)
    assert type(decoded_swap.to_tier) is events.KVTier


# ------------------------------------------------------------------ generated values


def values_of(annotation: Any) -> st.SearchStrategy[Any]:
    """Any value of a model field's type (no NaN: it is not equal to itself)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return st.none() | values_of(inner)
    if origin is list:
        return st.lists(values_of(typing.get_args(annotation)[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), values_of(typing.get_args(annotation)[1]), max_size=3)
    if annotation is str:
        return st.text()
    if annotation is int:
        return LONGS
    if annotation is float:
        return st.floats(allow_nan=False)
    if annotation is bool:
        return st.booleans()
    if annotation is bytes:
        return st.binary(max_size=40)
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return st.sampled_from(list(annotation))
    if isinstance(annotation, type) and issubclass(annotation, events.Model):
        return bodies_of(annotation)
    raise TypeError(annotation)


def bodies_of(model: type[events.Model]) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(model)
    return st.builds(model, **{name: values_of(hints[name]) for name in model.model_fields})


ANY_BODY = st.sampled_from(events.EVENT_TYPES).flatmap(bodies_of)
MOMENTS = st.datetimes(
    min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30), timezones=st.just(UTC)
)  # one day off each end: to_micros and back must stay inside datetime's range


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    event_id=st.text(),
    session_id=st.text(),
    seq=LONGS,
    actor=st.text(),
    occurred_at=MOMENTS,
    causation_id=st.none() | st.text(),
    prev_hash=st.binary(max_size=70),
    body=ANY_BODY,
)
def test_generated_envelopes_are_equivalent(
    event_id: str,
    session_id: str,
    seq: int,
    actor: str,
    occurred_at: datetime,
    causation_id: str | None,
    prev_hash: bytes,
    body: events.Model,
) -> None:
    assert_equivalent(
        {
            "event_id": event_id,
            "session_id": session_id,
            "seq": seq,
            "actor": actor,
            "occurred_at": occurred_at,
            "causation_id": causation_id,
            "prev_hash": prev_hash,
            "body": body,
        }
    )


VARINT_EDGES = [
    0,
    1,
    -1,
    63,
    64,
    -64,
    -65,
    127,
    128,
    8191,
    8192,
    2**31,
    -(2**31),
    2**53 + 1,
    2**62,
    2**63 - 1,
    -(2**63),
]


@pytest.mark.parametrize("value", VARINT_EDGES)
def test_longs_at_varint_boundaries(value: int) -> None:
    assert_equivalent(fields_of(events.SessionFailed(reason="r", error_type="E"), seq=value))
    assert_equivalent(fields_of(events.SessionFinished(output_json="{}", num_llm_calls=value, num_tool_calls=~value)))
    if abs(value) < 6 * 10**16:  # within datetime's range (years 1 to 9999) either side of 1970
        moment = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=value)
        assert_equivalent(fields_of(events.SessionFailed(reason="r", error_type="E"), occurred_at=moment))


@pytest.mark.parametrize(
    "overrides",
    [
        {"seq": 2**63},
        {"seq": -(2**63) - 1},
        {"causation_id": b"bytes"},
        {"causation_id": 5},
        {"event_id": "lone \ud800 surrogate"},
        {"actor": 7},
    ],
    ids=["seq-too-large", "seq-too-small", "causation-bytes", "causation-int", "surrogate", "actor-int"],
)
def test_values_the_generic_writer_refuses_are_refused(overrides: dict[str, Any]) -> None:
    fields = fields_of(events.SessionFailed(reason="r", error_type="E"), **overrides)
    with pytest.raises(Exception) as reference:
        reference_encode(**fields)
    with pytest.raises(Exception) as fast:
        CODEC.encode(**fields)
    # The same kind of error (the messages are each writer's own).
    assert isinstance(fast.value, (ValueError, TypeError, OverflowError))
    assert isinstance(reference.value, (ValueError, TypeError, OverflowError))
    assert isinstance(fast.value, type(reference.value)) or isinstance(reference.value, type(fast.value))


@pytest.mark.parametrize(
    "overrides",
    [{"queue_ms": 1}, {"prompt_tokens": True}, {"tool_calls_json": 5}, {"output_text": "lone \ud800"}],
    ids=["int-for-double", "bool-for-long", "int-for-optional-string", "surrogate"],
)
def test_body_values_its_own_writer_does_not_expect_are_left_to_fastavro(overrides: dict[str, Any]) -> None:
    # Built without validation, as a buggy caller could: log.body_writer refuses these values,
    # and the body is written (or refused) by fastavro, exactly as by the generic path.
    # The reference is the codec with fastavro writing every body (reference_encode dumps the
    # model first, which warns about such values instead).
    fastavro_only = Codec()
    for body_type in fastavro_only._bodies:
        body_type.write = None
    valid = sample(events.LLMCallCompleted, 0)
    body = events.LLMCallCompleted.model_construct(**{**valid.__dict__, **overrides})
    fields = fields_of(body)
    try:
        expected: Any = fastavro_only.encode(**fields)
    except Exception as e:  # whatever fastavro raises, the codec must raise the same kind
        with pytest.raises(type(e)):
            CODEC.encode(**fields)
    else:
        assert CODEC.encode(**fields) == expected


def test_a_body_of_no_event_type_is_refused() -> None:
    with pytest.raises(ValueError, match="not an event body"):
        CODEC.encode(**fields_of(events.Vote(voter="v", decision=events.VoteDecision.HOLD, reason="r")))


# ------------------------------------------------------------------ bad records


def outcome(decode: Any, data: bytes) -> Any:
    try:
        return ("ok", shape(decode(data)))
    except RecordError as e:
        return ("error", type(e).__name__)


RECORD = CODEC.encode(
    **fields_of(
        events.ToolCallProposed(
            call_id="c",
            tool="write_file",
            arguments_json='{"path": "a.py"}',
            effect_class=events.EffectClass.COMPENSATABLE,
            idempotency_key="s:c",
            compensation_tool="revert_file",
        ),
        causation_id="cause",
    )
)[0]


@pytest.mark.parametrize("cut", range(HEADER_LEN, len(RECORD)))
def test_truncated_records_fail_as_in_the_generic_path(cut: int) -> None:
    assert outcome(CODEC.decode, RECORD[:cut]) == outcome(reference_decode, RECORD[:cut])


def rehash(unhashed: bytes) -> bytes:
    """A record of these Avro bytes with a hash that matches them (what a forger with write access does)."""
    return HEADER + unhashed + b"\x40" + hashlib.sha256(unhashed).digest()


# Records whose bodies hold every kind of field log.body_reader reads: strings, an enum and
# optional strings (RECORD); an array of strings; optional longs, doubles and booleans; a map.
FORGEABLE = [
    RECORD,
    CODEC.encode(**fields_of(sample(events.KVBlocksStored, 1)))[0],
    CODEC.encode(**fields_of(sample(events.LLMCallStarted, 2)))[0],
    CODEC.encode(**fields_of(sample(events.ForkCreated, 3)))[0],
]


@settings(max_examples=600, deadline=None)
@given(data=st.data())
def test_forged_records_get_the_generic_verdict(data: st.DataObject) -> None:
    """Edit the hashed bytes anywhere and fix the hash: both paths accept the same envelope, or both
    reject the record with the same error (union branch indexes included: fastavro reads a negative
    one from the end of the union, and so does the fast path)."""
    unhashed = bytearray(data.draw(st.sampled_from(FORGEABLE))[HEADER_LEN:-33])
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(unhashed) - 1))
        edit = data.draw(st.sampled_from(["set", "insert", "delete"]))
        if edit == "set":
            unhashed[at] = data.draw(st.integers(0, 255))
        elif edit == "insert":
            unhashed.insert(at, data.draw(st.integers(0, 255)))
        elif len(unhashed) > 1:
            del unhashed[at]
    record = rehash(bytes(unhashed))
    try:
        expected = outcome(reference_decode, record)
    except OverflowError:  # a timestamp past datetime's range: the codec calls it a SchemaMismatch (DLQ)
        with pytest.raises(SchemaMismatch):
            CODEC.decode(record)
        return
    assert outcome(CODEC.decode, record) == expected


@pytest.mark.parametrize("index", [b"\x01", b"\x03", b"\x05", b"\x04"], ids=["-1", "-2", "-3", "2"])
def test_causation_union_indexes_out_of_range_read_as_in_the_generic_path(index: bytes) -> None:
    unhashed = RECORD[HEADER_LEN:-33]
    at = unhashed.index(b"\x02\x0acause")  # the causation_id branch index, then the string
    record = rehash(unhashed[:at] + index + unhashed[at + 1 :])
    assert outcome(CODEC.decode, record) == outcome(reference_decode, record)


@pytest.mark.parametrize("index", [-1, -32, -33, 32, 33])
def test_body_union_indexes_out_of_range_read_as_in_the_generic_path(index: int) -> None:
    from log.body_writer import varint

    unhashed = RECORD[HEADER_LEN:-33]
    at = unhashed.index(b"\x0a\x02c")  # ToolCallProposed is branch 5 (zig-zag 0x0a), then call_id "c"
    record = rehash(unhashed[:at] + varint(index) + unhashed[at + 1 :])
    assert outcome(CODEC.decode, record) == outcome(reference_decode, record)


def test_garbage_after_the_header_is_a_schema_mismatch() -> None:
    for garbage in (b"\xff" * 30, b"\xff" * 5, b"\x81", b"\x02\xff", b"\xff" * 11):
        assert outcome(CODEC.decode, HEADER + garbage) == outcome(reference_decode, HEADER + garbage)
    with pytest.raises(SchemaMismatch, match="varint longer than 10 bytes"):
        CODEC.decode(rehash(b"\x80" * 11 + b"\x00"))


def test_older_releases_still_take_the_generic_path() -> None:
    v1 = registry.releases()[0]
    assert v1.fingerprint != CODEC.fingerprint
    buf = io.BytesIO()
    schemaless_writer(
        buf,
        parse_schema({**v1.schema, "fields": v1.schema["fields"][:-1]}, named_schemas={}),
        {
            "event_id": "e",
            "session_id": "s",
            "seq": 3,
            "actor": "planner",
            "occurred_at": 0,
            "causation_id": None,
            "prev_hash": ZERO_HASH,
            "body": ("agentlog.ToolCallProposed", sample(events.ToolCallProposed).model_dump()),
        },
    )
    unhashed = buf.getvalue()
    envelope = CODEC.decode(MAGIC + v1.fingerprint + unhashed + b"\x40" + hashlib.sha256(unhashed).digest())
    assert envelope.body == sample(events.ToolCallProposed)
    assert type(envelope.body.effect_class) is events.EffectClass  # type: ignore[union-attr]


def test_a_schema_the_fast_path_does_not_know_is_refused() -> None:
    with_extra_field = {
        **EXPANDED,
        "fields": [*EXPANDED["fields"][:3], {"name": "x", "type": "long"}, *EXPANDED["fields"][3:]],
    }
    with pytest.raises(RuntimeError, match="update its fast path"):
        _check_layout(with_extra_field)
    body = EXPANDED["fields"][7]
    reordered = {**body, "type": [body["type"][1], body["type"][0], *body["type"][2:]]}
    swapped = {**EXPANDED, "fields": [*EXPANDED["fields"][:7], reordered, EXPANDED["fields"][8]]}
    with pytest.raises(RuntimeError, match="update its fast path"):
        _check_layout(swapped)


def test_decode_errors_are_decode_errors() -> None:
    with pytest.raises(DecodeError):
        CODEC.decode(RECORD[:-1])
