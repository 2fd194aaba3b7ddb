"""logctl analyze's fold and report, on workloads whose numbers are known by construction.

Every time and token count is chosen so that the shares are exact binary fractions: the
report must give them exactly, not approximately.
"""

from __future__ import annotations

import math
import random

import pytest

from schemas import events as ev
from services.analysis import (
    CallSpan,
    GapSpan,
    SessionEnd,
    Timeline,
    TimelineFold,
    VerdictAnswer,
    analyze,
    fold_timelines,
    from_trace,
)
from services.engine.cost import CostModel
from services.traces import Trace, TraceSession, TraceTurn
from tests.unit.services.analysis_samples import completed, proposed, started, workload


def test_the_report_gives_the_constructed_gap_share_and_hit_rate_exactly() -> None:
    report = analyze(fold_timelines(workload()), "synthetic")
    assert (report.sessions, report.unfinished, report.llm_calls, report.tool_gaps) == (2, 0, 4, 2)
    assert report.job_s == 16.0 and report.gap_s == 8.0 and report.gap_share == 0.5
    assert [(t.tool, t.gap_s, t.gap_share, t.gaps.count) for t in report.tools] == [
        ("search", 6.0, 0.375, 1),
        ("sleep", 2.0, 0.125, 1),
    ]
    assert (report.gaps.p50, report.gaps.max, report.gaps.mean) == (4.0, 6.0, 4.0)
    assert (report.prompt_tokens, report.cached_tokens, report.computed_tokens) == (4096, 1152, 2944)
    assert report.hit_rate == 1152 / 4096 == 0.28125
    assert report.recomputed_tokens == 128 and report.oracle_hit_rate == 1280 / 4096 == 0.3125
    assert (report.queue_s, report.queue_share, report.calls_queued) == (1.0, 0.0625, 1)
    assert report.queue_ms_recorded == 1000.0  # b's first call, in the engine's clock
    assert report.oracle_saved_s == 0.0625 and report.oracle_share == 0.0625 / 16
    assert report.oracle_upper_s == 1.0625
    by_session = {s.session_id: s for s in report.session_reports}
    assert (by_session["a"].gap_share, by_session["a"].hit_rate, by_session["a"].recomputed_tokens) == (0.75, 0.25, 128)
    assert (by_session["b"].gap_share, by_session["b"].hit_rate, by_session["b"].queue_s) == (0.25, 0.3125, 1.0)
    assert [(u.turn, u.calls, u.prompt_tokens, u.cached_tokens, u.recomputed_tokens) for u in report.turns] == [
        (0, 2, 1024, 0, 0),
        (1, 2, 3072, 1152, 128),
    ]
    assert report.turns[1].hit_rate == 0.375 and report.turns[1].oracle_hit_rate == 1280 / 3072


def test_the_fold_ignores_event_order_and_duplicates() -> None:
    events = workload()
    shuffled = events + events[3:9]  # redelivered events: same ids
    random.Random(7).shuffle(shuffled)
    assert analyze(fold_timelines(shuffled), "synthetic") == analyze(fold_timelines(events), "synthetic")


def test_an_unfinished_session_ends_at_its_last_event_and_an_open_call_is_not_counted() -> None:
    fold = TimelineFold()
    fold.observe("u", "1", ev.SessionStarted(program="p", args_json="{}"), 10.0)
    fold.observe("u", "2", started("llm-0", 0, 100), 10.0)
    fold.observe("u", "3", completed("llm-0", 100, 0, 0.0, 1.0, 1.0), 11.0)
    fold.observe("u", "4", proposed("tool-1", "human"), 11.0)
    fold.observe("u", "5", ev.ToolCallStarted(call_id="tool-1", tool="human", idempotency_key="k", attempt=1), 12.0)
    fold.observe("u", "6", started("llm-2", 1, 300), 14.0)
    fold.observe("orphan", "7", ev.ToolCallStarted(call_id="x", tool="t", idempotency_key="k", attempt=1), 1.0)
    (timeline,) = fold.timelines()  # a session never requested nor started is not a session
    assert timeline.end is SessionEnd.UNFINISHED and timeline.job_s == 4.0
    assert [c.call_id for c in timeline.calls] == ["llm-0"]
    assert [(g.tool, g.duration_s) for g in timeline.gaps] == [("human", 3.0)]
    assert analyze([timeline], "x").unfinished == 1


def test_a_trace_is_laid_out_alone_on_the_cost_model_clock() -> None:
    # 1 ms per prefilled token, 10 ms per output token, nothing else: every duration is exact.
    cost = CostModel(
        call_overhead_ms=0.0, prefill_attention_ms_per_token_pair=0.0, prefill_ms_per_token=1.0,
        decode_ms_per_token=10.0, hbm_bytes_per_s=float("inf"),
    )  # fmt: skip
    turns = (
        TraceTurn(500, 50, "search", 6.0, 450),  # call: 0.5 + 0.5 s
        TraceTurn(0, 100, None, None, None),  # call: prompt 1000 (all reusable but the 450 result) = 1 + 1 s
    )
    trace = Trace((TraceSession("s", "test", 2.0, turns),))
    (timeline,) = from_trace(trace, cost)
    assert (timeline.began_at, timeline.ended_at, timeline.job_s) == (2.0, 11.0, 9.0)
    assert [(c.prompt_tokens, c.cached_tokens, c.reusable_tokens, c.duration_s) for c in timeline.calls] == [
        (500, 0, 0, 1.0),
        (1000, 0, 550, 2.0),
    ]
    report = analyze([timeline], "trace")
    assert report.gap_share == 6.0 / 9.0 and report.hit_rate == 0.0 and report.recomputed_tokens == 550
    assert report.oracle_saved_s == 0.55 and report.queue_s == 0.0


def _timeline(job_s: float, gap_s: float, prefill_s: float, recomputed: int, queue_s: float = 0.0) -> Timeline:
    # One call that prefilled 1000 tokens, ``recomputed`` of which the session had computed before.
    call = CallSpan("llm-1", 1, 0.0, prefill_s + queue_s, 1000, 0, 10, recomputed, queue_s, prefill_s)
    return Timeline("s", "p", SessionEnd.FINISHED, 0.0, job_s, (call,), (GapSpan("tool-0", "t", 0.0, gap_s),))


@pytest.mark.parametrize(
    ("timeline", "answer"),
    [
        (_timeline(10.0, 8.0, 2.0, 500), VerdictAnswer.WORTH_IT),  # saves 1 s of 10: 10%
        (_timeline(10.0, 8.0, 2.0, 400), VerdictAnswer.MARGINAL),  # 0.8 s: 8%
        (_timeline(100.0, 97.0, 1.0, 100, queue_s=2.0), VerdictAnswer.MARGINAL),  # 0.1 s, 2.1 s with the queue
        (_timeline(100.0, 99.0, 1.0, 100), VerdictAnswer.NOT_WORTH_IT),  # 0.1 s of 100: 0.1%
    ],
)
def test_the_verdict_follows_the_documented_thresholds(timeline: Timeline, answer: VerdictAnswer) -> None:
    verdict = analyze([timeline], "x").verdict
    assert verdict.answer is answer
    assert answer.value.upper() in verdict.line and "of job time" in verdict.line


def test_no_job_time_is_not_worth_a_policy_and_says_why() -> None:
    empty = Timeline("s", "p", SessionEnd.FINISHED, 5.0, 5.0, (), ())
    report = analyze([empty], "x")
    assert report.verdict.answer is VerdictAnswer.NOT_WORTH_IT and math.isnan(report.gap_share)
