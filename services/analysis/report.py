"""What a workload's timelines say about caching: ``analyze(timelines) -> WorkloadReport``.

Pure arithmetic over :class:`~services.analysis.timeline.Timeline` s (no I/O, no clock). Times
are sums over sessions, so a share is "of all the job time the sessions spent", and every
number is one of these:

- **gap share**: tool-gap seconds / job seconds, for the workload, each session and each tool
  (a tool's share is its gaps over all job time); the gap distribution is given as
  percentiles (linear interpolation, :func:`services.traces.stats.percentile`);
- **hits**: cached / prompt tokens, overall and per turn; **recomputed** tokens: prompt
  tokens the session had already computed (its previous prompt and output) and prefilled
  again; the **oracle hit rate** is what the hit rate would be if none were recomputed;
- **head-of-line blocking**: the engine's ``queue_ms`` (converted to log time), its share of
  job time, and how many calls waited at all;
- **oracle bound**: a perfect cache keeps every token a session computed for as long as the
  session lives, so it saves each call's prefill time on its recomputed tokens (``saved``,
  a share of job time). It can also shorten other sessions' waits, by at most all of the
  queueing there was: ``saved + queue`` is the upper bound.

**The verdict** (docs/analyze.md explains it): a serving-layer cache policy can win no more
than the oracle bound, so

- ``worth it`` when the oracle saves at least :data:`WORTH_IT_SHARE` of job time on its own
  prefill savings alone;
- ``not worth it`` when even the upper bound (every recomputation and every wait gone) is
  below :data:`NOT_WORTH_IT_SHARE` of job time;
- ``marginal`` in between: the gain depends on how much of the queueing the recomputation
  causes, which only a run with a policy measures.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from services.analysis.timeline import SessionEnd, Timeline
from services.traces.stats import percentile

__all__ = [
    "NOT_WORTH_IT_SHARE",
    "PERCENTILES",
    "WORTH_IT_SHARE",
    "Distribution",
    "SessionReport",
    "ToolReport",
    "TurnReport",
    "Verdict",
    "VerdictAnswer",
    "WorkloadReport",
    "analyze",
]

WORTH_IT_SHARE = 0.10
"""The oracle's own prefill savings, as a share of job time, from which a cache policy is worth it."""
NOT_WORTH_IT_SHARE = 0.02
"""Below this share of job time, even the oracle's upper bound is not worth a cache policy."""
PERCENTILES = (0.5, 0.9, 0.99)


class VerdictAnswer(StrEnum):
    WORTH_IT = "worth it"
    MARGINAL = "marginal"
    NOT_WORTH_IT = "not worth it"


@dataclass(frozen=True, slots=True)
class Distribution:
    """Count, mean, percentiles (p50, p90, p99) and max of some seconds; NaN when empty."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
        return cls(len(values), sum(values) / len(values), p50, p90, p99, max(values))


@dataclass(frozen=True, slots=True)
class ToolReport:
    tool: str
    gaps: Distribution
    gap_s: float
    gap_share: float
    """This tool's gap seconds over all job seconds."""


@dataclass(frozen=True, slots=True)
class TurnReport:
    turn: int
    calls: int
    prompt_tokens: int
    cached_tokens: int
    recomputed_tokens: int
    hit_rate: float
    oracle_hit_rate: float


@dataclass(frozen=True, slots=True)
class SessionReport:
    session_id: str
    program: str
    end: str
    job_s: float
    llm_s: float
    gap_s: float
    gap_share: float
    queue_s: float
    calls: int
    prompt_tokens: int
    cached_tokens: int
    recomputed_tokens: int
    hit_rate: float
    oracle_saved_s: float


@dataclass(frozen=True, slots=True)
class Verdict:
    answer: VerdictAnswer
    line: str
    """The answer and the numbers that decide it, in one line."""


@dataclass(frozen=True, slots=True)
class WorkloadReport:
    source: str
    sessions: int
    unfinished: int
    llm_calls: int
    tool_gaps: int
    job_s: float
    llm_s: float
    gap_s: float
    gap_share: float
    other_s: float
    """Job time in neither an LLM call nor a tool gap: waiting to start, the planner's own steps."""
    gaps: Distribution
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    recomputed_tokens: int
    hit_rate: float
    oracle_hit_rate: float
    prefill_s: float
    queue_s: float
    queue_share: float
    queue_ms_recorded: float
    """The engines' ``queue_ms`` summed as recorded (their own clock; ``queue_s`` is it in log time)."""
    calls_queued: int
    queue_waits: Distribution
    """Seconds each call that waited at all waited."""
    oracle_saved_s: float
    oracle_share: float
    oracle_upper_s: float
    oracle_upper_share: float
    verdict: Verdict
    tools: tuple[ToolReport, ...]
    turns: tuple[TurnReport, ...]
    session_reports: tuple[SessionReport, ...]


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else math.nan


def _session(t: Timeline) -> SessionReport:
    job = t.job_s
    gap = sum(g.duration_s for g in t.gaps)
    prompt = sum(c.prompt_tokens for c in t.calls)
    cached = sum(c.cached_tokens for c in t.calls)
    return SessionReport(
        session_id=t.session_id,
        program=t.program,
        end=t.end.value,
        job_s=job,
        llm_s=sum(c.duration_s for c in t.calls),
        gap_s=gap,
        gap_share=_share(gap, job),
        queue_s=sum(c.queue_s for c in t.calls),
        calls=len(t.calls),
        prompt_tokens=prompt,
        cached_tokens=cached,
        recomputed_tokens=sum(c.recomputed_tokens for c in t.calls),
        hit_rate=_share(cached, prompt),
        oracle_saved_s=sum(c.saved_s for c in t.calls),
    )


def _verdict(oracle_share: float, upper_share: float, gap_share: float, queue_share: float) -> Verdict:
    if math.isnan(oracle_share):
        return Verdict(VerdictAnswer.NOT_WORTH_IT, "no job time to save: the sessions have no LLM calls or no duration")
    if oracle_share >= WORTH_IT_SHARE:
        answer = VerdictAnswer.WORTH_IT
    elif upper_share < NOT_WORTH_IT_SHARE:
        answer = VerdictAnswer.NOT_WORTH_IT
    else:
        answer = VerdictAnswer.MARGINAL
    line = (
        f"a serving-layer cache policy is {answer.value.upper()} for this workload: a perfect cache saves "
        f"{oracle_share:.1%} of job time in recomputed prefill, at most {upper_share:.1%} with every queue wait "
        f"gone (worth it from {WORTH_IT_SHARE:.0%}, not below {NOT_WORTH_IT_SHARE:.0%}); tool gaps are "
        f"{gap_share:.1%} of job time, head-of-line blocking {queue_share:.1%}"
    )
    return Verdict(answer, line)


def analyze(timelines: Sequence[Timeline], source: str) -> WorkloadReport:
    """The report of ``timelines`` (module docstring); ``source`` says where they came from."""
    sessions = [_session(t) for t in timelines]
    calls = [c for t in timelines for c in t.calls]
    gaps = [g for t in timelines for g in t.gaps]
    job = sum(s.job_s for s in sessions)
    gap = sum(g.duration_s for g in gaps)
    llm = sum(c.duration_s for c in calls)
    queue = sum(c.queue_s for c in calls)
    saved = sum(c.saved_s for c in calls)
    prompt = sum(c.prompt_tokens for c in calls)
    cached = sum(c.cached_tokens for c in calls)
    recomputed = sum(c.recomputed_tokens for c in calls)

    by_tool: dict[str, list[float]] = defaultdict(list)
    for g in gaps:
        by_tool[g.tool].append(g.duration_s)
    tools = tuple(
        ToolReport(name, Distribution.of(durations), sum(durations), _share(sum(durations), job))
        for name, durations in sorted(by_tool.items(), key=lambda item: (-sum(item[1]), item[0]))
    )
    by_turn: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for c in calls:
        by_turn[c.turn].append((c.prompt_tokens, c.cached_tokens, c.recomputed_tokens))
    turns = []
    for turn, rows in sorted(by_turn.items()):
        p, h, r = (sum(column) for column in zip(*rows, strict=True))
        turns.append(TurnReport(turn, len(rows), p, h, r, _share(h, p), _share(h + r, p)))

    gap_share, queue_share = _share(gap, job), _share(queue, job)
    oracle_share, upper_share = _share(saved, job), _share(saved + queue, job)
    waits = [c.queue_s for c in calls if c.queue_s > 0]
    return WorkloadReport(
        source=source,
        sessions=len(sessions),
        unfinished=sum(t.end is SessionEnd.UNFINISHED for t in timelines),
        llm_calls=len(calls),
        tool_gaps=len(gaps),
        job_s=job,
        llm_s=llm,
        gap_s=gap,
        gap_share=gap_share,
        other_s=max(0.0, job - llm - gap),
        gaps=Distribution.of([g.duration_s for g in gaps]),
        prompt_tokens=prompt,
        cached_tokens=cached,
        computed_tokens=prompt - cached,
        recomputed_tokens=recomputed,
        hit_rate=_share(cached, prompt),
        oracle_hit_rate=_share(cached + recomputed, prompt),
        prefill_s=sum(c.prefill_s for c in calls),
        queue_s=queue,
        queue_share=queue_share,
        queue_ms_recorded=sum(c.queue_ms_recorded for c in calls),
        calls_queued=len(waits),
        queue_waits=Distribution.of(waits),
        oracle_saved_s=saved,
        oracle_share=oracle_share,
        oracle_upper_s=saved + queue,
        oracle_upper_share=upper_share,
        verdict=_verdict(oracle_share, upper_share, gap_share, queue_share),
        tools=tools,
        turns=tuple(turns),
        session_reports=tuple(sessions),
    )
