"""The pure parts of bench/recovery.py: kill points, copy ids, the numbers and the table."""

from __future__ import annotations

import math
import random
import re
from itertools import count, pairwise

import pytest

from bench.recovery import (
    KillPoint,
    ModeResult,
    Observed,
    copy_id,
    format_table,
    kill_thresholds,
    measure,
    ratio,
)
from log import LoggedEvent
from log.types import Position
from schemas import events as ev
from schemas.events import EffectClass
from tests.unit.services.helpers import envelope

pytestmark = pytest.mark.unit

_offsets = count()


def logged(session: str, body: ev.Event, at_s: float, topic: str = "agent.actions") -> LoggedEvent:
    return LoggedEvent(Position(topic, 0, next(_offsets)), envelope(body, session=session, at_s=at_s))


def llm(session: str, step: int, at_s: float, prompt: int, cached: int, *, done: bool = True) -> list[LoggedEvent]:
    call = f"llm-{step}"
    started = ev.LLMCallStarted(
        call_id=call, turn=step, engine_id="sim", prompt_tokens=prompt, max_output_tokens=4, prompt_digest="d"
    )
    events = [logged(session, started, at_s)]
    if done:
        completed = ev.LLMCallCompleted(
            call_id=call,
            engine_id="sim",
            prompt_tokens=prompt,
            cached_tokens=cached,
            output_tokens=4,
            output_text="x",
            finish_reason="length",
            queue_ms=0,
            prefill_ms=1,
            decode_ms=1,
        )
        events.append(logged(session, completed, at_s + 0.1))
    return events


def tool(session: str, step: int, at_s: float, attempts: int = 1) -> list[LoggedEvent]:
    call = f"tool-{step}"
    proposed = ev.ToolCallProposed(
        call_id=call, tool="trace_tool", arguments_json="{}", effect_class=EffectClass.PURE, idempotency_key=call
    )
    events = [logged(session, proposed, at_s)]
    for attempt in range(1, attempts + 1):
        started = ev.ToolCallStarted(call_id=call, tool="trace_tool", idempotency_key=call, attempt=attempt)
        events.append(logged(session, started, at_s + 0.1, "agent.effects"))
    return events


def requested(session: str, at_s: float) -> LoggedEvent:
    return logged(session, ev.SessionRequested(program="trace", args_json="{}", author="t"), at_s, "ops.commands")


def finished(session: str, at_s: float) -> LoggedEvent:
    return logged(session, ev.SessionFinished(output_json="{}", num_llm_calls=2, num_tool_calls=1), at_s)


def cancelled(session: str, at_s: float) -> LoggedEvent:
    return logged(session, ev.SessionFailed(reason="cancelled", error_type="Cancelled"), at_s)


def whole_session(session: str, at_s: float, end_s: float) -> list[LoggedEvent]:
    """LLM (100 prompt, 0 cached), tool, LLM (130 prompt, 100 cached), finished."""
    return [
        requested(session, at_s),
        *llm(session, 0, at_s + 1, 100, 0),
        *tool(session, 1, at_s + 2),
        *llm(session, 2, at_s + 3, 130, 100),
        finished(session, end_s),
    ]


def observe(events: list[LoggedEvent], latest: dict[str, str]) -> Observed:
    observed = Observed(latest=latest)
    for event in events:
        observed.add(event)
    return observed


def test_kill_thresholds_fall_one_per_slice_of_the_middle_of_the_run() -> None:
    thresholds = kill_thresholds(1000, 3, random.Random(7))
    assert thresholds == sorted(set(thresholds))
    for i, at in enumerate(thresholds):
        assert 50 + 300 * i <= at <= 50 + 300 * (i + 1)
    assert kill_thresholds(1000, 3, random.Random(7)) == thresholds  # the seed decides


def test_kill_thresholds_stay_strictly_increasing_when_slices_are_narrow() -> None:
    thresholds = kill_thresholds(6, 4, random.Random(1))
    assert len(thresholds) == 4
    assert all(b > a for a, b in pairwise(thresholds))
    assert thresholds[0] >= 1
    assert kill_thresholds(10, 0, random.Random(1)) == []


def test_copy_ids() -> None:
    assert copy_id("rec-001-ab", 0) == "rec-001-ab"
    assert copy_id("rec-001-ab", 2) == "rec-001-ab-r2"


def test_ratio() -> None:
    assert ratio(6, 3) == 2
    assert ratio(0, 0) is None
    assert ratio(5, 0) == math.inf


def test_residual_run_counts_nothing_twice_and_a_retried_tool_once() -> None:
    events = whole_session("a", 0, 5) + whole_session("b", 1, 8)
    events.append(logged("b", ev.ToolCallStarted(call_id="tool-1", tool="t", idempotency_key="k", attempt=2), 6))
    observed = observe(events, {"a": "a", "b": "b"})
    served = {"a/llm-0": (100, 0), "a/llm-2": (130, 100), "b/llm-0": (100, 0), "b/llm-2": (130, 100)}
    kills = [KillPoint(2, 2, 1.0, 0.0, back_after_s=0.5), KillPoint(3, 3, 2.0, 0.0, back_after_s=1.5)]
    result = measure(
        "residual", observed.book.records, observed.latest, observed.tool_starts, served, {"num_served": 4}, kills
    )
    assert (result.num_finished, result.num_failed, result.num_kills) == (2, 0, 2)
    assert (result.llm_calls_needed, result.llm_calls_computed, result.llm_calls_issued_again) == (4, 4, 0)
    assert result.prefill_tokens_computed == 2 * (100 + 30)
    assert result.prefill_tokens_recomputed == 0
    assert (result.tool_calls_needed, result.tool_calls_started, result.tool_calls_executed_again) == (2, 3, 1)
    assert result.wall_s == pytest.approx(8.0)
    assert result.mean_job_s == pytest.approx((5 + 7) / 2)
    assert result.planner_back_after_s == pytest.approx(1.0)


def test_scratch_run_counts_the_abandoned_copy_and_a_served_call_nobody_logged() -> None:
    # "a" got one LLM call and one tool started, then was abandoned at a kill while its
    # second call was at the engine (served, never logged); "a-r1" ran it all again.
    events = [
        requested("a", 0),
        *llm("a", 0, 1, 100, 0),
        *tool("a", 1, 2),
        *llm("a", 2, 3, 130, 100, done=False),
        logged("a", ev.CancelRequested(author="bench", reason="r"), 4, "ops.commands"),
        cancelled("a", 4.5),
        *whole_session("a-r1", 4, 10),
    ]
    observed = observe(events, {"a": "a-r1"})
    served = {
        "a/llm-0": (100, 0),
        "a/llm-2": (130, 100),
        "a-r1/llm-0": (100, 0),
        "a-r1/llm-2": (130, 100),
    }
    result = measure("scratch", observed.book.records, observed.latest, observed.tool_starts, served, {"num_served": 4})
    assert (result.num_sessions, result.num_finished) == (1, 1)
    assert (result.llm_calls_needed, result.llm_calls_issued_again) == (2, 2)
    assert (result.prefill_recomputed_logged, result.prefill_recomputed_unlogged) == (100, 30)
    assert result.prefill_tokens_recomputed == 130
    assert (result.tool_calls_needed, result.tool_calls_executed_again) == (1, 1)
    assert result.wall_s == pytest.approx(10.0)
    assert result.mean_job_s == pytest.approx(10.0)  # from the first copy's request
    assert math.isnan(result.planner_back_after_s)


def test_unfinished_follows_the_latest_copy() -> None:
    observed = observe([*whole_session("a", 0, 5), requested("b", 1)], {"a": "a", "b": "b", "c": "c"})
    assert observed.unfinished() == ["b", "c"]
    observed.latest["a"] = "a-r1"
    assert observed.unfinished() == ["a", "b", "c"]


def test_planner_back_after_is_the_first_action_after_the_kill() -> None:
    observed = Observed()
    base = envelope(ev.SessionStarted(program="trace", args_json="{}"), session="s", at_s=10).occurred_at.timestamp()
    observed.kills.append(KillPoint(1, 1, 0.0, base - 0.5))
    observed.add(logged("s", ev.CancelRequested(author="b", reason="r"), 9, "ops.commands"))
    observed.add(logged("s", ev.SessionStarted(program="trace", args_json="{}"), 9))  # before the kill
    assert observed.kills[0].back_after_s is None
    observed.add(logged("s", ev.SessionStarted(program="trace", args_json="{}"), 12))
    assert observed.kills[0].back_after_s == pytest.approx(2.5)


def test_table_shows_both_modes_and_the_ratio() -> None:
    lists = ("mode", "kill_points", "failures", "anomalies")
    numbers = {name: 0 for name in ModeResult.__dataclass_fields__ if name not in lists}
    residual = ModeResult(mode="residual", **{**numbers, "llm_calls_computed": 10, "wall_s": 2.0, "mean_job_s": 1.0})
    scratch = ModeResult(
        mode="scratch",
        **{**numbers, "llm_calls_computed": 15, "llm_calls_issued_again": 5, "wall_s": 3.0, "mean_job_s": math.nan},
    )
    lines = format_table(residual, scratch).splitlines()
    assert lines[0].split() == ["residual", "scratch", "scratch/residual"]
    row = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in lines[1:])}
    assert row["LLM calls computed by the engine"] == ["10", "15", "1.50x"]
    assert row["LLM calls issued again"] == ["0", "5", "inf"]
    assert row["sessions finished"] == ["0", "0", "-"]
    assert row["mean job time (s)"] == ["1.00", "-", "-"]
    assert row["wall time (s)"] == ["2.00", "3.00", "1.50x"]
