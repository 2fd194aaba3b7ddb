"""ChainVerifier: each rule, the exact error, and that rejected records never become the tail."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from log import topics
from log.chain import ChainTail, ChainVerifier
from log.codec import ZERO_HASH, Codec
from log.errors import ActorNotAllowed, BodyNotAllowed, BrokenChain, KeyMismatch, SeqGap, SeqRepeat
from log.types import Position
from schemas.envelope import Envelope
from schemas.events import SessionFailed, SessionStarted, ToolCallCommitted

pytestmark = pytest.mark.unit

CODEC = Codec()
AT = Position("agent.actions", 0, 0)


def envelope(
    seq: int, prev_hash: bytes, *, actor: str = "planner", session: str = "s", body: object = None
) -> Envelope:
    record, _ = CODEC.encode(
        event_id=f"e{seq}",
        session_id=session,
        seq=seq,
        actor=actor,
        occurred_at=datetime(2026, 1, 1, tzinfo=UTC),
        causation_id=None,
        prev_hash=prev_hash,
        body=body or SessionStarted(program="p", args_json="{}"),  # type: ignore[arg-type]
    )
    return CODEC.decode(record)


def chain(n: int) -> list[Envelope]:
    out: list[Envelope] = []
    prev = ZERO_HASH
    for seq in range(n):
        out.append(envelope(seq, prev))
        prev = out[-1].hash
    return out


def test_a_good_chain_verifies() -> None:
    verifier = ChainVerifier()
    for e in chain(5):
        verifier.verify(topics.AGENT_ACTIONS, b"s", e, AT)
    tail = verifier.tail("agent.actions", "s")
    assert tail is not None and tail.seq == 4


def test_first_record_must_be_seq_zero_with_zero_prev_hash() -> None:
    with pytest.raises(SeqGap, match="jumps to seq 1, expected 0"):
        ChainVerifier().verify(topics.AGENT_ACTIONS, b"s", chain(2)[1], AT)
    with pytest.raises(BrokenChain, match="expected 000000000000"):
        ChainVerifier().verify(topics.AGENT_ACTIONS, b"s", envelope(0, b"\x01" * 32), AT)


def test_repeat_gap_and_broken_link() -> None:
    records = chain(3)
    verifier = ChainVerifier()
    verifier.verify(topics.AGENT_ACTIONS, b"s", records[0], AT)
    verifier.verify(topics.AGENT_ACTIONS, b"s", records[1], AT)
    with pytest.raises(SeqRepeat, match="repeats seq 1, expected 2"):
        verifier.verify(topics.AGENT_ACTIONS, b"s", records[1], AT)
    with pytest.raises(SeqGap):
        verifier.verify(topics.AGENT_ACTIONS, b"s", envelope(3, records[1].hash), AT)
    with pytest.raises(BrokenChain, match="run logctl verify"):
        verifier.verify(topics.AGENT_ACTIONS, b"s", envelope(2, records[0].hash), AT)
    # None of the rejected records moved the tail: the genuine seq 2 still links.
    verifier.verify(topics.AGENT_ACTIONS, b"s", records[2], AT)


def test_reordered_pair_is_caught() -> None:
    records = chain(3)
    verifier = ChainVerifier()
    verifier.verify(topics.AGENT_ACTIONS, b"s", records[0], AT)
    with pytest.raises(SeqGap):
        verifier.verify(topics.AGENT_ACTIONS, b"s", records[2], AT)


def test_actor_body_and_key_rules() -> None:
    with pytest.raises(ActorNotAllowed, match="actor 'executor' may not write agent.actions"):
        ChainVerifier().verify(topics.AGENT_ACTIONS, b"s", envelope(0, ZERO_HASH, actor="executor"), AT)
    wrong_body = envelope(0, ZERO_HASH, body=ToolCallCommitted(call_id="c", votes=[], policy="p"))
    with pytest.raises(BodyNotAllowed, match="ToolCallCommitted does not belong on agent.actions"):
        ChainVerifier().verify(topics.AGENT_ACTIONS, b"s", wrong_body, AT)
    with pytest.raises(KeyMismatch):
        ChainVerifier().verify(topics.AGENT_ACTIONS, b"other", envelope(0, ZERO_HASH), AT)


def test_a_subclass_of_an_allowed_body_is_allowed() -> None:
    """The exact-type lookup is a shortcut: a subclass of a body the topic holds still passes."""

    class Started(SessionStarted):
        pass

    subclassed = envelope(0, ZERO_HASH).model_copy(update={"body": Started(program="p", args_json="{}")})
    ChainVerifier().verify(topics.AGENT_ACTIONS, b"s", subclassed, AT)


def test_dlq_accepts_any_actor() -> None:
    from schemas.events import RecordDeadLettered

    body = RecordDeadLettered(
        source_topic="agent.actions",
        source_partition=0,
        source_offset=0,
        error_type="BadMagic",
        reason="r",
        consumer_group="g",
        raw_value=b"",
    )
    dead_letter = envelope(0, ZERO_HASH, actor="executor", body=body)
    verifier = ChainVerifier()
    verifier.verify(topics.AGENT_DLQ, b"s", dead_letter, AT)
    tail = verifier.tail(topics.AGENT_DLQ.name, "s")
    assert tail is not None and (tail.seq, tail.hash) == (0, dead_letter.hash)  # accepted: its chain goes on from it
    with pytest.raises(ActorNotAllowed):  # the same actor on an owned topic is refused
        ChainVerifier().verify(topics.AGENT_ACTIONS, b"s", envelope(0, ZERO_HASH, actor="executor"), AT)


def test_chains_are_per_topic_and_session() -> None:
    verifier = ChainVerifier()
    verifier.verify(topics.AGENT_ACTIONS, b"a", envelope(0, ZERO_HASH, session="a"), AT)
    verifier.verify(topics.AGENT_ACTIONS, b"b", envelope(0, ZERO_HASH, session="b"), AT)
    failed = envelope(0, ZERO_HASH, actor="planner", session="a", body=SessionFailed(reason="r", error_type="E"))
    with pytest.raises(SeqRepeat):
        verifier.verify(topics.AGENT_ACTIONS, b"a", failed, AT)


def test_the_tail_of_a_chain_is_its_last_accepted_record() -> None:
    verifier = ChainVerifier()
    assert verifier.tail("agent.actions", "s") is None
    records = chain(2)
    for record in records:
        verifier.verify(topics.AGENT_ACTIONS, b"s", record, AT)
    assert verifier.tail("agent.actions", "s") == ChainTail(1, records[1].hash)
