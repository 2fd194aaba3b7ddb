"""Continuum importer: exact turns from a small trajectory, and the published sample."""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import pytest

from services.traces import SharedPrefix, TraceFormatError, TraceTurn, from_continuum, trace_stats
from services.traces.continuum import message_text
from tests.unit.services.traces import real_trace

pytestmark = pytest.mark.unit


def words(text: str) -> int:
    """A tokenizer whose counts can be checked by eye."""
    return len(text.split())


SYSTEM = "You are an agent"
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": [{"type": "text", "text": "fix the bug please"}]},
    {
        "role": "assistant",
        "content": "Let me look",
        # As in the published file: a Python literal, not JSON.
        "tool_calls": "[{'index': 1, 'function': {'arguments': '{\"command\": \"ls\"}', 'name': 'bash'}, "
        "'id': 'a', 'type': 'function', 'execution_time_seconds': 0.5}]",
    },
    {"role": "tool", "content": "[{'type': 'text', 'text': 'a.py b.py'}]"},
    {
        "role": "assistant",
        "content": "Two calls",
        "tool_calls": [
            {"function": {"name": "str_replace_editor", "arguments": "view a.py"}, "execution_time_seconds": 0.25},
            {"function": {"name": "bash", "arguments": "cat b.py"}, "execution_time_seconds": 1.0},
        ],
    },
    {"role": "tool", "content": "x = 1"},
    {"role": "tool", "content": "y = 2"},
    {"role": "user", "content": "also add a test"},
    {
        "role": "assistant",
        "content": "Done",
        "tool_calls": "[{'function': {'name': 'submit', 'arguments': ''}, 'execution_time_seconds': 2e-05}]",
    },
]


def trajectory(traj_id: str, messages: list[dict[str, Any]] = MESSAGES) -> dict[str, Any]:
    return {"messages": json.dumps(messages), "traj_id": traj_id, "instance_id": "i", "resolved": True}


def test_a_trajectory_gives_the_exact_turns() -> None:
    trace = from_continuum([trajectory("t1")], tokenizer=words, arrival_rate_per_s=1.0, rng=random.Random(0))
    (session,) = trace.sessions
    assert session.session_id == "t1"
    assert session.source == "continuum"
    assert session.turns == (
        # system (4) + user (4); output: text (3) + "bash" (1) + its arguments (2); then 2 tokens of result
        TraceTurn(8, 6, "bash", 0.5, 2),
        # no new prompt (tool messages are results); two calls, durations summed, first one named
        TraceTurn(0, 8, "str_replace_editor", 1.25, 6),
        # the user's message is this turn's prompt; submit ends the episode, so no tool
        TraceTurn(4, 2),
    )
    assert trace.notes[0] == "continuum: 1 trajectories, 3 LLM turns, 2 tool gaps"


def test_trajectories_with_the_same_system_prompt_share_it() -> None:
    trace = from_continuum(
        [trajectory("t1"), trajectory("t2")], tokenizer=words, arrival_rate_per_s=1.0, rng=random.Random(0)
    )
    prefix = SharedPrefix("continuum:" + hashlib.sha256(SYSTEM.encode()).hexdigest()[:16], 4)
    assert [s.turns[0].shared_prefix for s in trace] == [prefix, prefix]
    assert trace.sessions[0].arrival_s < trace.sessions[1].arrival_s


def test_an_assistant_reply_without_tool_calls_waits_on_the_user() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello, what now?", "tool_calls": []},
        {"role": "user", "content": "write a test"},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "content": "never read"},
    ]
    trace = from_continuum([trajectory("t", messages)], tokenizer=words, arrival_rate_per_s=1.0, rng=random.Random(0))
    assert trace.sessions[0].turns == (TraceTurn(2, 3, "user", 0.0, 0), TraceTurn(3, 1))


def test_message_text_reads_strings_parts_and_literal_parts() -> None:
    assert message_text("plain") == "plain"
    assert (
        message_text([{"type": "text", "text": "a"}, {"type": "image", "url": "x"}, {"type": "text", "text": "b"}])
        == "ab"
    )
    assert message_text("[{'type': 'text', 'text': 'lit'}]") == "lit"
    assert message_text("[{'type': broken") == "[{'type': broken"
    assert message_text(None) == ""


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"messages": "[]"}, "Continuum trace must be a JSON list of trajectories, got dict"),
        ([{"traj_id": "t", "messages": "{not json"}], "trajectory 't': messages is not JSON"),
        ([{"traj_id": "t", "messages": "[{}]"}], "trajectory 't': messages must be a list of objects with a role"),
        ([{"traj_id": "t", "messages": '[{"role": "user", "content": "hi"}]'}], "trajectory 't': no assistant"),
        (
            [
                trajectory(
                    "t",
                    [MESSAGES[0], {**MESSAGES[2], "tool_calls": "[{'function': {'name': 'bash'}}]"}, *MESSAGES[3:5]],
                )
            ],
            "tool call 'bash' has no execution_time_seconds",
        ),
        (
            [trajectory("t", [MESSAGES[0], {**MESSAGES[2], "tool_calls": "[oops"}, MESSAGES[3], MESSAGES[4]])],
            "tool_calls is not a Python literal",
        ),
        ([trajectory("t", MESSAGES[2:])], "trajectory 't': nothing precedes the first assistant message"),
    ],
)
def test_malformed_trajectories_are_rejected_with_the_place(obj: Any, message: str) -> None:
    with pytest.raises(TraceFormatError) as error:
        from_continuum(obj, tokenizer=words, arrival_rate_per_s=1.0, rng=random.Random(0))
    assert message in str(error.value)


def test_the_published_sample_matches_its_readme() -> None:
    with real_trace("continuum_swe_test5_with_timings.json").open() as f:
        obj = json.load(f)
    trace = from_continuum(obj, arrival_rate_per_s=1.0, rng=random.Random(0))
    stats = trace_stats(trace)
    # README: 5 SWE-bench trajectories, 125 LLM turns; 5 of the 125 are final (submit, no tool).
    assert (stats.sessions, stats.turns, stats.tool_gaps) == (5, 125, 120)
    assert {t.tool for t in stats.tools} == {"bash", "str_replace_editor", "submit"}
    assert all(s.turns[-1].tool is None for s in trace)
    assert stats.sessions_with_shared_prefix == 5  # one SWE-agent system prompt for every task
    assert 0 < stats.gap_median_s < stats.gap_p90_s < 1.0  # shell and editor calls take well under a second
    assert all(s.turns[0].prompt_tokens > 100 for s in trace)  # the task statement
