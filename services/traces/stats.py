"""Summary numbers of a trace: what ``logctl trace stats`` prints and the tests compare to sources."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from services.traces.model import Trace


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between order statistics (NumPy's default).

    NaN for no values. Linear interpolation is what the sources' published medians and p90s use.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class ToolStats:
    """One tool: how often it ran and how long it took (seconds)."""

    tool: str
    calls: int
    median_s: float
    p90_s: float
    max_s: float
    mean_result_tokens: float


@dataclass(frozen=True, slots=True)
class TraceStats:
    """Counts, token totals and tool-gap quantiles of a trace."""

    sessions: int
    turns: int
    tool_gaps: int
    prompt_tokens: int
    output_tokens: int
    tool_result_tokens: int
    max_context_tokens: int
    mean_turns: float
    gap_median_s: float
    gap_p90_s: float
    gap_max_s: float
    span_s: float
    sessions_with_shared_prefix: int
    tools: tuple[ToolStats, ...]


def trace_stats(trace: Trace) -> TraceStats:
    """Summarise ``trace``; quantiles are NaN when there is no tool gap."""
    gaps: list[float] = []
    per_tool: dict[str, list[tuple[float, int]]] = defaultdict(list)
    prompt = output = result = 0
    for s in trace:
        for t in s.turns:
            prompt += t.prompt_tokens
            output += t.output_tokens
            if t.tool is not None and t.tool_duration_s is not None and t.tool_result_tokens is not None:
                gaps.append(t.tool_duration_s)
                result += t.tool_result_tokens
                per_tool[t.tool].append((t.tool_duration_s, t.tool_result_tokens))
    tools = tuple(
        ToolStats(
            tool=name,
            calls=len(calls),
            median_s=percentile([d for d, _ in calls], 0.5),
            p90_s=percentile([d for d, _ in calls], 0.9),
            max_s=max(d for d, _ in calls),
            mean_result_tokens=sum(r for _, r in calls) / len(calls),
        )
        for name, calls in sorted(per_tool.items(), key=lambda item: (-len(item[1]), item[0]))
    )
    turns = sum(len(s.turns) for s in trace)
    arrivals = [s.arrival_s for s in trace]
    return TraceStats(
        sessions=len(trace),
        turns=turns,
        tool_gaps=len(gaps),
        prompt_tokens=prompt,
        output_tokens=output,
        tool_result_tokens=result,
        max_context_tokens=max((s.final_context_tokens for s in trace), default=0),
        mean_turns=turns / len(trace) if len(trace) else 0.0,
        gap_median_s=percentile(gaps, 0.5),
        gap_p90_s=percentile(gaps, 0.9),
        gap_max_s=max(gaps, default=math.nan),
        span_s=(arrivals[-1] - arrivals[0]) if arrivals else 0.0,
        sessions_with_shared_prefix=sum(1 for s in trace if any(t.shared_prefix for t in s.turns)),
        tools=tools,
    )
