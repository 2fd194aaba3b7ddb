"""Hostile records: arbitrary bytes and mutated valid records never crash the decoder or
a consumer, and every bad record is dead-lettered with a reason.

The valid records are real ones (appended through a ``SharedLog`` on the in-memory
backend); a mutation flips, drops, inserts or truncates bytes, or replays or reorders
whole records. The consumer reads what lands, raw, on ``ops.commands``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from log import Codec, RecordError, SharedLog
from log.backend import OutRecord
from log.memory_backend import MemoryBackend
from log.topics import AGENT_DLQ, OPS_COMMANDS
from schemas import events as ev
from tests.unit.fuzz.profile import FUZZ, FUZZ_SLOW

pytestmark = pytest.mark.unit

NUM_PARTITIONS = 2
SESSIONS = ("fuzz-a", "fuzz-b")
CODEC = Codec()


@dataclass(frozen=True)
class Valid:
    session: str
    partition: int
    value: bytes


async def _valid_records() -> list[Valid]:
    """A few real records of two sessions, in the order they were appended."""
    backend = MemoryBackend()
    await backend.start()
    await backend.create_topics(NUM_PARTITIONS)
    async with SharedLog(backend, actor="operator") as log:
        for n in range(4):
            for session in SESSIONS:
                await log.append(session, ev.SessionRequested(program="script", args_json=f'{{"n": {n}}}', author="t"))
        valid = []
        for partition in range(NUM_PARTITIONS):
            async for record in backend.scan(OPS_COMMANDS.name, partition):
                assert record.key is not None
                valid.append(Valid(record.key.decode(), partition, record.value))
    return valid


VALID = asyncio.run(_valid_records())


def _mutate(value: bytes, data: st.DataObject) -> bytes:
    kind = data.draw(st.sampled_from(["flip", "drop", "insert", "truncate", "extend"]))
    if kind == "truncate":
        return value[: data.draw(st.integers(0, len(value) - 1))]
    if kind == "extend":
        return value + data.draw(st.binary(min_size=1, max_size=16))
    at = data.draw(st.integers(0, len(value) - 1))
    if kind == "flip":
        return value[:at] + bytes([value[at] ^ data.draw(st.integers(1, 255))]) + value[at + 1 :]
    if kind == "drop":
        return value[:at] + value[at + 1 :]
    return value[:at] + data.draw(st.binary(min_size=1, max_size=8)) + value[at:]


@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes_decode_or_raise_a_record_error(data: bytes) -> None:
    try:
        CODEC.decode(data)
    except RecordError as error:
        assert str(error), "a record error says what is wrong"


@FUZZ
@given(st.data())
def test_a_mutated_valid_record_is_refused_with_a_record_error(data: st.DataObject) -> None:
    original = data.draw(st.sampled_from(VALID)).value
    mutated = _mutate(original, data)
    try:
        envelope = CODEC.decode(mutated)
    except RecordError as error:
        assert str(error)
        return
    # A mutation that still decodes must not have changed what the record says (the hash
    # covers every field): only trailing bytes the reader never looks at can differ.
    assert envelope == CODEC.decode(original)


@st.composite
def _streams(draw: st.DrawFn) -> list[tuple[Valid, bytes, bool]]:
    """What lands on the topic: (origin, value, is the original record) in landing order."""
    stream: list[tuple[Valid, bytes, bool]] = []
    for record in VALID:
        action = draw(st.sampled_from(["keep", "keep", "mutate", "garbage", "replay", "skip"]))
        if action == "skip":
            continue
        if action == "mutate":
            mutated = _mutate(record.value, draw(st.data()))
            stream.append((record, mutated, mutated == record.value))
        elif action == "garbage":
            stream.append((record, draw(st.binary(max_size=64)), False))
            stream.append((record, record.value, True))
        else:
            stream.append((record, record.value, True))
            if action == "replay":
                stream.append((record, record.value, True))
    return stream


async def _consume(
    stream: list[tuple[Valid, bytes, bool]],
) -> tuple[list[tuple[str, int]], int, list[ev.RecordDeadLettered]]:
    backend = MemoryBackend()
    await backend.start()
    await backend.create_topics(NUM_PARTITIONS)
    for origin, value, _ in stream:
        await backend.produce(OPS_COMMANDS.name, [OutRecord(origin.partition, origin.session.encode(), value)])
    async with SharedLog(backend, actor="planner") as log:
        delivered: list[tuple[str, int]] = []
        async with log.consumer("fuzz", [OPS_COMMANDS.name], from_beginning=True) as consumer:
            while sum(consumer.position(OPS_COMMANDS.name, p) for p in range(NUM_PARTITIONS)) < len(stream):
                delivered += [(e.session_id, e.envelope.seq) for e in await consumer.poll(timeout_s=0.0)]
            dead = consumer.stats.num_dead_lettered
        letters = []
        async with log.consumer("dlq-reader", [AGENT_DLQ.name], from_beginning=True) as reader:
            while len(letters) < dead and (events := await reader.poll(timeout_s=0.0)):
                letters += [e.body for e in events if isinstance(e.body, ev.RecordDeadLettered)]
    return delivered, dead, letters


@FUZZ_SLOW
@given(_streams())
def test_the_consumer_hands_out_each_chain_in_order_and_dead_letters_the_rest(
    stream: list[tuple[Valid, bytes, bool]],
) -> None:
    delivered, dead, letters = asyncio.run(_consume(stream))
    assert len(delivered) + dead == len(stream), "every record is either handed out or dead-lettered"
    assert len(letters) == dead
    assert all(letter.reason and letter.error_type for letter in letters), letters
    assert all(letter.source_topic == OPS_COMMANDS.name for letter in letters)
    for session in SESSIONS:
        seqs = [seq for s, seq in delivered if s == session]
        assert seqs == list(range(len(seqs))), f"{session}: a chain is handed out gap-free from seq 0: {seqs}"
    # The originals of a session before its first lost record are all handed out.
    for session in SESSIONS:
        originals = [
            seq for origin, value, ok in stream if ok and origin.session == session for seq in [CODEC.decode(value).seq]
        ]
        expected = 0
        for seq in originals:
            if seq == expected:
                expected += 1
        assert len([s for s, _ in delivered if s == session]) == expected
