"""Trace statistics: quantiles as the sources compute them, and the counts the CLI prints."""

from __future__ import annotations

import math

import pytest

from services.traces import Trace, TraceSession, TraceTurn, percentile, trace_stats

pytestmark = pytest.mark.unit


def test_percentile_interpolates_linearly_between_order_statistics() -> None:
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([0.0, 10.0], 0.9) == 9.0
    assert percentile([5.0], 0.9) == 5.0
    assert math.isnan(percentile([], 0.5))
    with pytest.raises(ValueError, match="quantile must be in"):
        percentile([1.0], 1.5)


def test_stats_count_sessions_turns_tokens_and_gaps() -> None:
    trace = Trace(
        (
            TraceSession("a", "t", 1.0, (TraceTurn(10, 2, "x", 1.0, 5), TraceTurn(0, 3, "y", 3.0, 1), TraceTurn(1, 1))),
            TraceSession("b", "t", 4.0, (TraceTurn(7, 2, "x", 2.0, 0), TraceTurn(2, 2))),
        )
    )
    stats = trace_stats(trace)
    assert (stats.sessions, stats.turns, stats.tool_gaps) == (2, 5, 3)
    assert (stats.prompt_tokens, stats.output_tokens, stats.tool_result_tokens) == (20, 10, 6)
    assert stats.max_context_tokens == 23
    assert stats.mean_turns == 2.5
    assert (stats.gap_median_s, stats.gap_max_s, stats.span_s) == (2.0, 3.0, 3.0)
    assert [(t.tool, t.calls, t.median_s, t.mean_result_tokens) for t in stats.tools] == [
        ("x", 2, 1.5, 2.5),
        ("y", 1, 3.0, 1.0),
    ]


def test_a_trace_without_tools_has_no_gap_quantiles() -> None:
    stats = trace_stats(Trace((TraceSession("a", "t", 0.0, (TraceTurn(1, 1),)),)))
    assert stats.tool_gaps == 0
    assert math.isnan(stats.gap_median_s)
    assert stats.tools == ()
    assert trace_stats(Trace(())).sessions == 0
