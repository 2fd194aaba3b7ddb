"""Mooncake importer: session recovery from hash-id prefixes on small samples, and the published trace."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.traces import SharedPrefix, TraceFormatError, TraceTurn, from_mooncake, trace_stats
from tests.unit.services.traces import real_trace

pytestmark = pytest.mark.unit

BLOCK = 4  # tokens per hash id in the samples, to keep them small


def line(timestamp_ms: int, input_length: int, output_length: int, hash_ids: list[int]) -> str:
    obj: dict[str, Any] = {
        "timestamp": timestamp_ms,
        "input_length": input_length,
        "output_length": output_length,
        "hash_ids": hash_ids,
    }
    return json.dumps(obj)


SAMPLE = [
    line(0, 10, 3, [0, 1, 2]),  # A starts: 2 full blocks + a partial one
    line(1000, 9, 2, [0, 5, 6]),  # B: shares only block 0 (the common system prompt) with A
    line(5000, 17, 2, [0, 1, 7, 8, 9]),  # A's second turn: keeps A's full blocks 0, 1; 17 - (10 + 3) = 4 new
    line(6000, 13, 2, [0, 1, 10, 11]),  # C: shares 0, 1 with A but drops A's latest blocks 7, 8: a branch
    "",
    line(7000, 12, 1, [0, 5, 12]),  # B's second turn: 12 - (9 + 2) = 1 new
    line(8000, 16, 1, [0, 1, 7, 8]),  # D: re-sends A's second turn's first 4 blocks: shorter, so a new session
]


def test_sessions_are_recovered_from_hash_id_prefixes() -> None:
    trace = from_mooncake(SAMPLE, block_tokens=BLOCK)
    a, b, c, d = trace.sessions
    assert [(s.session_id, s.arrival_s) for s in trace] == [
        ("mooncake-00000", 0.0),
        ("mooncake-00001", 1.0),
        ("mooncake-00002", 6.0),
        ("mooncake-00003", 8.0),
    ]
    assert a.turns == (
        # the gap to the next request is human think time; the user's message is its result
        TraceTurn(10, 3, "human", 5.0, 4, SharedPrefix("mooncake:1", 8)),  # blocks 0, 1 also in C and D
        TraceTurn(0, 2, shared_prefix=SharedPrefix("mooncake:8", 16)),  # blocks 0, 1, 7, 8 also in D
    )
    assert b.turns == (TraceTurn(9, 2, "human", 6.0, 1, SharedPrefix("mooncake:0", 4)), TraceTurn(0, 1))
    assert c.turns == (TraceTurn(13, 2, shared_prefix=SharedPrefix("mooncake:1", 8)),)
    assert d.turns == (TraceTurn(16, 1, shared_prefix=SharedPrefix("mooncake:8", 16)),)
    assert trace.notes[0] == (
        "mooncake: 6 requests -> 4 sessions (2 multi-turn), 6 turns, 2 human gaps (max_gap_s=1800)"
    )
    assert trace.notes[1] == "mooncake: 3 sessions share more than the first block with another session"


def test_the_first_block_alone_does_not_continue_a_session() -> None:
    trace = from_mooncake([line(0, 6, 1, [0, 1]), line(1000, 9, 1, [0, 2, 3])], block_tokens=BLOCK)
    assert len(trace) == 2


def test_a_continuation_after_max_gap_starts_a_new_session() -> None:
    lines = [line(0, 10, 3, [0, 1, 2]), line(61_000, 17, 2, [0, 1, 7, 8, 9])]
    assert len(from_mooncake(lines, block_tokens=BLOCK, max_gap_s=120)) == 1
    split = from_mooncake(lines, block_tokens=BLOCK, max_gap_s=60)
    assert len(split) == 2
    # The later session still re-uses the earlier one's blocks, as a shared prefix.
    assert split.sessions[1].turns[0].shared_prefix == SharedPrefix("mooncake:1", 8)


def test_a_retry_of_the_same_request_is_not_a_continuation() -> None:
    lines = [line(0, 10, 3, [0, 1, 2]), line(2000, 10, 3, [0, 1, 2])]
    trace = from_mooncake(lines, block_tokens=BLOCK)
    assert len(trace) == 2
    assert trace.sessions[1].turns[0].shared_prefix == SharedPrefix("mooncake:2", 10)  # the whole prompt


def test_a_shorter_re_sent_context_is_clamped_and_counted() -> None:
    lines = [line(0, 10, 5, [0, 1, 2]), line(3000, 12, 1, [0, 1, 3])]  # 12 < 10 + 5
    trace = from_mooncake(lines, block_tokens=BLOCK)
    assert trace.sessions[0].turns == (
        TraceTurn(10, 5, "human", 3.0, 0),  # one session alone shares nothing
        TraceTurn(0, 1),
    )
    assert "mooncake: 1 continuations re-sent less than the previous context (3 tokens in all)" in trace.notes[2]


def test_requests_are_taken_in_timestamp_order() -> None:
    trace = from_mooncake([SAMPLE[2], SAMPLE[0]], block_tokens=BLOCK)
    assert [len(s.turns) for s in trace] == [2]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{oops", "line 1: not JSON"),
        ("[1]", "line 1: expected an object"),
        ('{"timestamp": 0, "input_length": 4}', "line 1: missing output_length, hash_ids"),
        (line(-5, 4, 1, [0]), "line 1: timestamp must be >= 0"),
        (line(0, 0, 1, []), "line 1: input_length must be >= 1"),
        (line(0, 4, -1, [0]), "line 1: output_length must be an integer >= 0"),
        (line(0, 9, 1, [0, 1]), "line 1: 2 hash_ids for 9 input tokens; expected 3 blocks of 4 tokens"),
        ('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": ["a"]}', "hash_ids must be a list of"),
    ],
)
def test_malformed_lines_are_rejected_with_their_line_number(text: str, message: str) -> None:
    with pytest.raises(TraceFormatError) as error:
        from_mooncake([text], block_tokens=BLOCK)
    assert message in str(error.value)


def test_the_published_trace_recovers_sessions() -> None:
    with real_trace("mooncake_conversation_trace.jsonl").open() as f:
        trace = from_mooncake(f)
    stats = trace_stats(trace)
    # README: 12,031 requests over one hour; every request is one LLM call.
    assert stats.turns == 12031
    assert stats.sessions + stats.tool_gaps == 12031
    # What the recovery rule finds (pinned: a change to the rule must show up here).
    assert (stats.sessions, stats.tool_gaps) == (8213, 3818)
    assert [t.tool for t in stats.tools] == ["human"]
    assert (stats.gap_median_s, stats.gap_p90_s) == (123.0, 468.0)
    assert stats.gap_max_s <= 1800.0
    assert stats.span_s <= 3600.0
    assert stats.sessions_with_shared_prefix == stats.sessions  # block 0 is everyone's system prompt
    assert all(s.turns[0].shared_prefix is not None and s.turns[0].shared_prefix.tokens >= 512 for s in trace)
