"""The trace format: round trips, every validation rule with its message, time_scale and head."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from typing import Any

import pytest

from services.traces import SharedPrefix, Trace, TraceFormatError, TraceSession, TraceTurn, head, time_scale

pytestmark = pytest.mark.unit


def session_obj(session_id: str = "s1", arrival_s: float = 0.0) -> dict[str, Any]:
    return {
        "session_id": session_id,
        "source": "test",
        "arrival_s": arrival_s,
        "turns": [
            {
                "prompt_tokens": 100,
                "output_tokens": 20,
                "tool": "search",
                "tool_duration_s": 1.5,
                "tool_result_tokens": 30,
                "shared_prefix": {"context_id": "sys", "tokens": 64},
            },
            {
                "prompt_tokens": 5,
                "output_tokens": 10,
                "tool": None,
                "tool_duration_s": None,
                "tool_result_tokens": None,
                "shared_prefix": None,
            },
        ],
    }


def test_a_session_round_trips_through_its_json_line() -> None:
    line = json.dumps(session_obj())
    session = TraceSession.from_json_line(line)
    assert session.turns[0] == TraceTurn(100, 20, "search", 1.5, 30, SharedPrefix("sys", 64))
    assert session.turns[1] == TraceTurn(5, 10)
    assert json.loads(session.to_json_line()) == session_obj()
    assert TraceSession.from_json_line(session.to_json_line()) == session


def test_the_json_line_keeps_the_documented_key_order() -> None:
    line = TraceSession.from_dict(session_obj()).to_json_line()
    assert list(json.loads(line)) == ["session_id", "source", "arrival_s", "turns"]
    assert list(json.loads(line)["turns"][0]) == [
        "prompt_tokens",
        "output_tokens",
        "tool",
        "tool_duration_s",
        "tool_result_tokens",
        "shared_prefix",
    ]
    assert "\n" not in line


def test_tool_fields_and_shared_prefix_may_be_omitted_on_a_turn() -> None:
    obj = session_obj()
    del obj["turns"][1]["tool"], obj["turns"][1]["tool_duration_s"], obj["turns"][1]["tool_result_tokens"]
    del obj["turns"][1]["shared_prefix"]
    assert TraceSession.from_dict(obj).turns[1] == TraceTurn(5, 10)


def test_integer_durations_are_read_as_floats() -> None:
    obj = session_obj()
    obj["turns"][0]["tool_duration_s"] = 2
    obj["arrival_s"] = 3
    session = TraceSession.from_dict(obj)
    assert isinstance(session.turns[0].tool_duration_s, float)
    assert isinstance(session.arrival_s, float)


def test_context_grows_by_prompt_output_and_tool_result() -> None:
    session = TraceSession.from_dict(session_obj())
    assert session.turns[0].appended_tokens == 150
    assert session.final_context_tokens == 150 + 15


def test_a_trace_round_trips_through_jsonl_and_skips_blank_lines() -> None:
    lines = [json.dumps(session_obj("a", 0.0)), "", json.dumps(session_obj("b", 2.0)), "  \n"]
    trace = Trace.from_json_lines(lines)
    assert [s.session_id for s in trace] == ["a", "b"]
    assert Trace.from_json_lines(trace.to_json_lines()) == trace


def mutate(change: Callable[[dict[str, Any]], None]) -> str:
    obj = copy.deepcopy(session_obj())
    change(obj)
    return json.dumps(obj)


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(obj: dict[str, Any]) -> None:
        target: Any = obj
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


def _delete(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    def change(obj: dict[str, Any]) -> None:
        target: Any = obj
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return change


def _drop_first_tool(obj: dict[str, Any]) -> None:
    obj["turns"][0].update(tool=None, tool_duration_s=None, tool_result_tokens=None)


def _move_tool_to_last(obj: dict[str, Any]) -> None:
    obj["turns"][1].update(tool="search", tool_duration_s=1.0, tool_result_tokens=3)


INVALID: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("negative prompt tokens", _set(("turns", 0, "prompt_tokens"), -1), "turn 0: prompt_tokens must be >= 0, got -1"),
    ("zero output tokens", _set(("turns", 1, "output_tokens"), 0), "turn 1: output_tokens must be >= 1, got 0"),
    ("fractional tokens", _set(("turns", 0, "output_tokens"), 2.5), "output_tokens must be an integer, got 2.5"),
    ("boolean tokens", _set(("turns", 0, "prompt_tokens"), True), "prompt_tokens must be an integer, got True"),
    ("negative result tokens", _set(("turns", 0, "tool_result_tokens"), -3), "tool_result_tokens must be >= 0"),
    ("missing token count", _delete(("turns", 0, "output_tokens")), "turn 0: turn is missing output_tokens"),
    ("missing session field", _delete(("source",)), "session is missing source"),
    ("unknown turn field", _set(("turns", 0, "tokens"), 3), "turn 0: turn has unknown field(s) tokens"),
    ("unknown session field", _set(("user",), "x"), "session has unknown field(s) user"),
    ("tool on the last turn", _move_tool_to_last, "turn 1: the last turn must have tool null, got 'search'"),
    ("no tool mid-session", _drop_first_tool, "turn 0: every turn but the last needs a tool"),
    ("duration without tool", _set(("turns", 0, "tool"), None), "tool_duration_s and tool_result_tokens must be null"),
    ("tool without duration", _set(("turns", 0, "tool_duration_s"), None), "tool 'search' needs tool_duration_s"),
    ("negative duration", _set(("turns", 0, "tool_duration_s"), -0.5), "tool_duration_s must be finite and >= 0"),
    ("duration as text", _set(("turns", 0, "tool_duration_s"), "1s"), "tool_duration_s must be a number of seconds"),
    ("empty tool name", _set(("turns", 0, "tool"), ""), "tool must be a non-empty string"),
    ("empty first prompt", _set(("turns", 0, "prompt_tokens"), 0), "turn 0: the first LLM call needs prompt_tokens"),
    ("no turns", _set(("turns",), []), "session 's1': turns must not be empty"),
    ("turns not a list", _set(("turns",), {}), "turns must be a list"),
    ("empty session id", _set(("session_id",), ""), "session_id must be a non-empty string"),
    ("negative arrival", _set(("arrival_s",), -1.0), "session 's1': arrival_s must be finite and >= 0"),
    ("prefix beyond context", _set(("turns", 0, "shared_prefix", "tokens"), 101), "exceeds the context (100 tokens)"),
    ("empty prefix", _set(("turns", 0, "shared_prefix", "tokens"), 0), "shared_prefix.tokens must be >= 1"),
    ("prefix without id", _delete(("turns", 0, "shared_prefix", "context_id")), "shared_prefix is missing context_id"),
]


@pytest.mark.parametrize(("change", "message"), [(c, m) for _, c, m in INVALID], ids=[n for n, _, _ in INVALID])
def test_invalid_sessions_are_rejected_with_a_clear_message(
    change: Callable[[dict[str, Any]], None], message: str
) -> None:
    with pytest.raises(TraceFormatError) as error:
        TraceSession.from_json_line(mutate(change))
    assert message in str(error.value)


def test_the_second_turn_may_start_with_no_new_prompt() -> None:
    session = TraceSession.from_json_line(mutate(_set(("turns", 1, "prompt_tokens"), 0)))
    assert session.turns[1] == TraceTurn(0, 10)
    assert session.final_context_tokens == 100 + 20 + 30 + 10  # the second call appends only its output
    with pytest.raises(TraceFormatError, match="turn 0: the first LLM call needs prompt_tokens >= 1"):
        TraceSession.from_json_line(mutate(_set(("turns", 0, "prompt_tokens"), 0)))  # only the first needs one


def test_a_line_that_is_not_json_names_its_line_number() -> None:
    with pytest.raises(TraceFormatError, match=r"^line 2: not JSON"):
        Trace.from_json_lines([json.dumps(session_obj()), "{oops"])


def test_errors_in_a_trace_name_line_session_and_turn() -> None:
    bad = mutate(_set(("turns", 1, "output_tokens"), -4))
    with pytest.raises(TraceFormatError, match=r"^line 3: session 's1' turn 1: output_tokens must be >= 1, got -4$"):
        Trace.from_json_lines(["", json.dumps(session_obj("a")), bad])


def test_a_session_id_may_appear_once() -> None:
    with pytest.raises(TraceFormatError, match="session 'a' appears twice"):
        Trace.from_json_lines([json.dumps(session_obj("a")), json.dumps(session_obj("a"))])


def test_sessions_must_be_in_arrival_order() -> None:
    with pytest.raises(TraceFormatError, match=r"session 'b': sessions must be in arrival order \(1.0 after 5.0\)"):
        Trace.from_json_lines([json.dumps(session_obj("a", 5.0)), json.dumps(session_obj("b", 1.0))])


def test_a_context_id_has_one_token_count_in_a_trace() -> None:
    other = session_obj("b")
    other["turns"][0]["shared_prefix"]["tokens"] = 32
    with pytest.raises(TraceFormatError, match="shared_prefix 'sys' has 32 tokens here but 64 elsewhere"):
        Trace.from_json_lines([json.dumps(session_obj("a")), json.dumps(other)])


def test_constructing_an_invalid_turn_directly_fails_too() -> None:
    with pytest.raises(TraceFormatError, match="output_tokens must be >= 1"):
        TraceTurn(prompt_tokens=3, output_tokens=0)
    with pytest.raises(TraceFormatError, match="needs tool_duration_s and tool_result_tokens"):
        TraceTurn(3, 1, tool="search")


def trace_of(*arrivals: float) -> Trace:
    return Trace(tuple(TraceSession.from_dict(session_obj(f"s{i}", a)) for i, a in enumerate(arrivals)))


def test_time_scale_multiplies_tool_durations_and_arrival_gaps() -> None:
    scaled = time_scale(trace_of(10.0, 20.0, 40.0), 0.01)
    assert [s.arrival_s for s in scaled] == pytest.approx([10.0, 10.1, 10.3])
    assert all(s.turns[0].tool_duration_s == pytest.approx(0.015) for s in scaled)
    assert all(s.turns[1].tool_duration_s is None for s in scaled)
    # Tokens do not change: only waiting time does.
    assert [t.appended_tokens for s in scaled for t in s.turns] == [150, 15] * 3
    assert scaled.notes[-1] == "time scaled by 0.01"


def test_time_scale_can_stretch_and_accepts_an_empty_trace() -> None:
    assert time_scale(trace_of(0.0, 1.0), 3).sessions[1].arrival_s == 3.0
    assert time_scale(Trace(()), 0.5) == Trace(())


@pytest.mark.parametrize("factor", [0, -1.0, math.inf, math.nan])
def test_time_scale_rejects_a_factor_that_is_not_positive_and_finite(factor: float) -> None:
    with pytest.raises(ValueError, match="time scale factor must be a finite number > 0"):
        time_scale(trace_of(0.0), factor)


def test_head_keeps_the_first_sessions() -> None:
    trace = trace_of(0.0, 1.0, 2.0)
    assert [s.session_id for s in head(trace, 2)] == ["s0", "s1"]
    assert head(trace, 10) is trace
    with pytest.raises(ValueError, match="limit must be >= 0"):
        head(trace, -1)
