"""log.native: a build of the current source, or the module itself; never a stale build."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from log import body_reader, head_reader, native
from log.codec import Codec
from schemas import events
from schemas.envelope import Envelope
from tests.unit.log.test_codec_fast_path import SAMPLES, VARINT_EDGES, fields_of, shape

pytestmark = pytest.mark.unit


def fake_build(monkeypatch: pytest.MonkeyPatch, digest: str) -> types.ModuleType:
    built = types.ModuleType("log._native.body_reader")
    built.SOURCE_DIGEST = digest  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "log._native.body_reader", built)
    return built


def test_a_build_of_the_current_source_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    built = fake_build(monkeypatch, native.source_digest("body_reader"))
    assert native.module("body_reader", compiled=True) is built


def test_a_build_of_another_source_is_not_used(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_build(monkeypatch, "0" * 64)
    monkeypatch.setattr(native, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="log.native"):
        assert native.module("body_reader", compiled=True) is body_reader
    assert "another log/body_reader.py" in caplog.text


def test_builds_are_off_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_build(monkeypatch, native.source_digest("body_reader"))
    assert native.module("body_reader", compiled=False) is body_reader
    monkeypatch.setenv("AGENTLOG_NATIVE", "0")
    assert native.module("body_reader") is body_reader
    assert native.module("head_reader") is head_reader


def test_only_the_compiled_modules_are_asked_for() -> None:
    with pytest.raises(ValueError, match="not one of the compiled modules"):
        native.module("codec")


@pytest.mark.parametrize("body", SAMPLES[::3])
def test_compiled_and_interpreted_readers_decode_alike(body: object) -> None:
    # Without a build both codecs read interpreted and this holds trivially; CI builds them
    # (make install) and checks with scripts/compile_native.py --check that they are current.
    record, _ = COMPILED.encode(**fields_of(body))  # type: ignore[arg-type]
    assert shape(COMPILED.decode(record)) == shape(INTERPRETED.decode(record))


@pytest.mark.parametrize("body", SAMPLES[::3])
def test_compiled_and_interpreted_writers_encode_alike(body: object) -> None:
    for overrides in ({}, {"causation_id": "cause", "seq": 2**40, "prev_hash": b"\x01" * 32}):
        fields = fields_of(body, **overrides)  # type: ignore[arg-type]
        assert COMPILED.encode(**fields) == INTERPRETED.encode(**fields)


@pytest.mark.parametrize("seq", VARINT_EDGES)
def test_compiled_and_interpreted_writers_encode_longs_alike(seq: int) -> None:
    fields = fields_of(events.SessionFinished(output_json="{}", num_llm_calls=seq, num_tool_calls=~seq), seq=seq)
    assert COMPILED.encode(**fields) == INTERPRETED.encode(**fields)


@pytest.mark.parametrize(
    "overrides",
    [{"seq": 2**63}, {"seq": -(2**63) - 1}, {"causation_id": 5}, {"event_id": "lone \ud800"}, {"actor": 7}],
    ids=["seq-too-large", "seq-too-small", "causation-int", "surrogate", "actor-int"],
)
def test_compiled_and_interpreted_writers_refuse_alike(overrides: dict[str, object]) -> None:
    fields = fields_of(events.SessionFailed(reason="r", error_type="E"), **overrides)
    errors = []
    for codec in (COMPILED, INTERPRETED):
        with pytest.raises(Exception) as refused:
            codec.encode(**fields)
        errors.append(type(refused.value))
    assert errors[0] is errors[1]


@pytest.mark.parametrize("body", SAMPLES[::3])
def test_compiled_and_interpreted_record_readers_read_alike(body: object) -> None:
    record, _ = COMPILED.encode(**fields_of(body))  # type: ignore[arg-type]
    tampered = record[:-1] + bytes([record[-1] ^ 1])
    for data in (record, tampered, record[:-5], b"\x00" + record[1:]):
        results = [read_envelope(c, data) for c in (COMPILED, INTERPRETED)]
        assert results[0] == results[1]
        if results[0] is not None:  # built alike too: as the model, sharing its fields set
            assert [type(r.body) for r in results] == [type(body)] * 2
            assert results[0].__pydantic_fields_set__ is results[1].__pydantic_fields_set__
    assert read_envelope(COMPILED, record) in (None, INTERPRETED.decode(record))  # None: read step by step
    assert read_envelope(COMPILED, tampered) is None


def read_envelope(codec: Codec, data: bytes) -> Envelope | None:
    return codec._read_envelope(data, codec._header, codec._as_read, codec._built, codec._envelope_built)  # type: ignore[no-any-return]


COMPILED = Codec(compiled=True)
INTERPRETED = Codec(compiled=False)
