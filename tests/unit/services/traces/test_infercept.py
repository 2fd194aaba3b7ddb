"""InferCept importer: exact turns from small samples of both call forms, and the published file."""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import pytest

from services.traces import SharedPrefix, TraceFormatError, TraceTurn, from_infercept, trace_stats
from services.traces.arrivals import poisson_arrivals
from tests.unit.services.traces import real_trace

pytestmark = pytest.mark.unit


def words(text: str) -> int:
    """A tokenizer whose counts can be checked by eye."""
    return len(text.split())


COUNTS: dict[str, Any] = {
    "b": [
        {"prompt_tokens": 100, "completion_tokens": 20, "api_time": 0.5, "api_token_length": 10},
        {"prompt_tokens": 130, "completion_tokens": 15, "api_time": 2.0, "api_token_length": 5},
        {"prompt_tokens": 150, "completion_tokens": 7},
    ],
    "a": [
        {"prompt_tokens": 50, "completion_tokens": 5, "api_time": 1.0, "api_token_length": 3},
        # 2 tokens more than the running sum (50 + 5 + 3); a trailing tool with a -2 result, as in the file.
        {"prompt_tokens": 60, "completion_tokens": 4, "api_time": 3.0, "api_token_length": -2},
    ],
}

FIRST = "tell me a joke"
TEXT: dict[str, Any] = {
    "0": [
        {"prompt": FIRST, "completion": " why did the chicken", "api_token": " another one", "api_time": 12.5},
        {
            "prompt": FIRST + " why did the chicken another one",
            "completion": " knock knock",
            "api_token": "Generate an image about this. ",
            "api_time": 11.0,
        },
        {
            "prompt": FIRST + " why did the chicken another one knock knock" + "Generate an image about this. ",
            "completion": " here it is",
        },
    ],
    "0_1": [
        {"prompt": FIRST, "completion": " a pun", "api_token": "Convert this to text to speech. ", "api_time": 6.0},
        {"prompt": FIRST + " a pun" + "Convert this to text to speech. ", "completion": " done"},
    ],
}


def test_count_form_sessions_give_the_exact_turns() -> None:
    trace = from_infercept(COUNTS, arrival_rate_per_s=2.0, rng=random.Random(7))
    a, b = trace.sessions
    assert (a.session_id, b.session_id) == ("a", "b")  # sorted id order
    assert a.turns == (
        TraceTurn(50, 5, "api", 1.0, 3),
        TraceTurn(2, 4, "api", 3.0, 0),  # -2 result tokens clamped
        TraceTurn(0, 1),  # closing turn after the trailing tool
    )
    assert b.turns == (TraceTurn(100, 20, "api", 0.5, 10), TraceTurn(0, 15, "api", 2.0, 5), TraceTurn(0, 7))
    assert all(s.source == "infercept" for s in trace)
    assert "infercept: 2 sessions, 5 recorded calls, 4 tool gaps (1 after a session's last call" in trace.notes[0]
    assert "infercept: 1 negative api_token_length values clamped to 0" in trace.notes


def test_arrivals_are_poisson_in_sorted_id_order_from_the_given_rng() -> None:
    trace = from_infercept(COUNTS, arrival_rate_per_s=2.0, rng=random.Random(7))
    assert [s.arrival_s for s in trace] == poisson_arrivals(2, 2.0, random.Random(7))
    again = from_infercept(COUNTS, arrival_rate_per_s=2.0, rng=random.Random(7))
    assert again.to_json_lines() == trace.to_json_lines()


def test_a_trailing_tool_can_be_dropped_instead() -> None:
    a = from_infercept(COUNTS, arrival_rate_per_s=1.0, rng=random.Random(0), trailing_tool="drop").sessions[0]
    assert a.turns == (TraceTurn(50, 5, "api", 1.0, 3), TraceTurn(2, 4))


def test_a_context_smaller_than_the_running_sum_is_clamped_and_counted() -> None:
    calls = [
        {"prompt_tokens": 100, "completion_tokens": 20, "api_time": 1.0, "api_token_length": 10},
        {"prompt_tokens": 120, "completion_tokens": 5},  # 10 fewer than 100 + 20 + 10
    ]
    trace = from_infercept({"s": calls}, arrival_rate_per_s=1.0, rng=random.Random(0))
    assert trace.sessions[0].turns[1] == TraceTurn(0, 5)
    assert any("1 calls recorded a context smaller than the running sum (by 10 tokens" in n for n in trace.notes)


def test_text_sessions_are_tokenized_and_tools_named_from_the_returned_text() -> None:
    trace = from_infercept(TEXT, arrival_rate_per_s=1.0, rng=random.Random(0), tokenizer=words)
    chat, tts = trace.sessions
    prefix = SharedPrefix("infercept:" + hashlib.sha256(FIRST.encode()).hexdigest()[:16], 4)
    assert chat.turns == (
        TraceTurn(4, 4, "human", 12.5, 2, prefix),
        TraceTurn(0, 2, "image_generation", 11.0, 5),  # the prompt only appends what the last turn produced
        TraceTurn(0, 3),
    )
    assert tts.turns == (TraceTurn(4, 2, "tts", 6.0, 6, prefix), TraceTurn(0, 1))


def test_a_text_prompt_that_does_not_extend_the_context_falls_back_to_counts() -> None:
    calls = [
        {"prompt": "one two three", "completion": "four", "api_token": "five", "api_time": 1.0},
        {"prompt": "something else entirely with seven words here", "completion": "x"},
    ]
    trace = from_infercept({"s": calls}, arrival_rate_per_s=1.0, rng=random.Random(0), tokenizer=words)
    assert trace.sessions[0].turns == (TraceTurn(3, 1, "human", 1.0, 1), TraceTurn(2, 1))  # 7 - (3 + 1 + 1)


def test_a_unique_first_prompt_gets_no_shared_prefix() -> None:
    trace = from_infercept({"0": TEXT["0"]}, arrival_rate_per_s=1.0, rng=random.Random(0), tokenizer=words)
    assert trace.sessions[0].turns[0].shared_prefix is None


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ([], "InferCept workload must be a JSON object of sessions, got list"),
        ({"s": []}, "session 's': expected a non-empty list of calls"),
        ({"s": [{"completion_tokens": 3}]}, "session 's' call 0: missing prompt"),
        ({"s": [{"prompt_tokens": 3}]}, "session 's' call 0: missing completion_tokens"),
        ({"s": [{"prompt_tokens": "3", "completion_tokens": 1}]}, "call 0: prompt_tokens must be an integer"),
        (
            {"s": [{"prompt_tokens": 3, "completion_tokens": 1, "api_time": 1.0}, {"prompt_tokens": 4}]},
            "session 's' call 0: api_time without api_token_length",
        ),
        (
            {"s": [{"prompt_tokens": 3, "completion_tokens": 1, "api_time": -1.0, "api_token_length": 1}]},
            "session 's' call 0: tool_duration_s must be finite and >= 0",
        ),
    ],
)
def test_malformed_workloads_are_rejected_with_the_place(obj: Any, message: str) -> None:
    with pytest.raises(TraceFormatError) as error:
        from_infercept(obj, arrival_rate_per_s=1.0, rng=random.Random(0))
    assert message in str(error.value)


def test_the_arrival_rate_must_be_positive() -> None:
    with pytest.raises(ValueError, match="arrival rate must be a finite number > 0"):
        from_infercept(COUNTS, arrival_rate_per_s=0.0, rng=random.Random(0))


def test_the_published_workload_matches_its_readme() -> None:
    with real_trace("infercept_merged_exp_uniform.json").open() as f:
        obj = json.load(f)
    trace = from_infercept(obj, arrival_rate_per_s=1.0, rng=random.Random(0))
    stats = trace_stats(trace)
    # README: 397 sessions, 2,054 calls, 1,841 tool gaps; gap median 7.4 s, p90 36.6 s, capped at 60 s.
    assert stats.sessions == 397
    assert stats.tool_gaps == 1841
    assert stats.turns == 2054 + 184  # every recorded call, plus a closing turn after 184 trailing tools
    assert stats.gap_median_s == pytest.approx(7.43, abs=0.01)
    assert stats.gap_p90_s == pytest.approx(36.6, abs=0.05)
    assert stats.gap_max_s == 60.0
    assert {t.tool for t in stats.tools} == {"api", "human", "tts", "image_generation"}
    # The file's contexts always equal the running sum, so nothing had to be clamped but 4 results of -2.
    assert not any("smaller than the running sum" in n for n in trace.notes)
    assert "infercept: 4 negative api_token_length values clamped to 0" in trace.notes

    dropped = from_infercept(obj, arrival_rate_per_s=1.0, rng=random.Random(0), trailing_tool="drop")
    assert (trace_stats(dropped).turns, trace_stats(dropped).tool_gaps) == (2054, 1841 - 184)
