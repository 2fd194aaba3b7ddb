"""Session timelines: what ``logctl analyze`` measures, folded from the log or built from a trace.

A :class:`Timeline` is one session as spans of time (seconds, one clock per timeline): its LLM
calls and its tool gaps, with the token counts of each call. Two ways to get one, both pure:

- :class:`TimelineFold` folds events from the log (``observe(session_id, event_id, body, at)``,
  ``at`` = the envelope's ``occurred_at`` in seconds) in any order the topics interleave;
  applying an event id twice is a no-op, like the session fold;
- :func:`from_trace` lays out a trace file's sessions on the cost model's clock.

**On the log**

- A session begins at its ``SessionRequested`` (else its ``SessionStarted``, else its first
  event) and ends at ``SessionFinished`` / ``SessionFailed``; a session with neither is
  *unfinished* and ends, for the numbers, at its last event.
- An LLM call spans ``LLMCallStarted`` to ``LLMCallCompleted`` (a call with no completion is
  in flight and not counted). The engine reports ``queue_ms``, ``prefill_ms`` and ``decode_ms``
  in its own clock (the sim engine in trace time, uncompressed; vLLM in real time), so each is
  converted into log time as its share of the call's engine time, applied to the call's span
  on the log. ``queue_ms`` is the time the call waited behind other sessions' calls (a session
  has one call in flight at a time): head-of-line blocking, as recorded.
- A tool gap spans a ``ToolCallProposed`` to the session's next step (its next proposal or
  ``LLMCallStarted``), or to its end: the time its context waits on the tool, verdict and
  execution included. Its KV cache is what a serving-layer cache policy decides about then.
- The tokens a call could have reused are the previous call's prompt and output (the context
  the engine had computed for the session), capped at this call's prompt; a call's
  *recomputed* tokens are those of them it did not get from the cache.

**From a trace** there is no engine record: each session runs alone (no queue), from its
``arrival_s``; a call takes the cost model's prefill of its whole context plus its decode, as
on an engine that keeps nothing between a session's calls (0 cached tokens, every reusable
token recomputed), and a tool gap takes the trace's ``tool_duration_s``. The oracle bound then
says what keeping the context would have saved against that baseline.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from pydantic import BaseModel

from schemas import events as ev
from services.engine.cost import CostModel
from services.traces.model import Trace

__all__ = ["CallSpan", "GapSpan", "SessionEnd", "Timeline", "TimelineFold", "fold_timelines", "from_trace"]

_MS_PER_S = 1000.0


class SessionEnd(StrEnum):
    FINISHED = "finished"
    FAILED = "failed"
    UNFINISHED = "unfinished"


@dataclass(frozen=True, slots=True)
class CallSpan:
    """One completed LLM call, times in the timeline's clock (seconds)."""

    call_id: str
    turn: int
    started_at: float
    duration_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    reusable_tokens: int
    """Prompt tokens the session had computed before this call (previous prompt + output)."""
    queue_s: float
    prefill_s: float
    queue_ms_recorded: float = 0.0
    """The engine's ``queue_ms`` as recorded, in the engine's clock (0 from a trace)."""

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def recomputed_tokens(self) -> int:
        """Tokens the session had computed before that this call prefilled again."""
        return max(0, self.reusable_tokens - self.cached_tokens)

    @property
    def saved_s(self) -> float:
        """What a perfect cache saves on this call: its prefill time's share of recomputed tokens."""
        if self.computed_tokens <= 0:
            return 0.0
        return self.prefill_s * min(self.recomputed_tokens, self.computed_tokens) / self.computed_tokens


@dataclass(frozen=True, slots=True)
class GapSpan:
    """One tool gap: the session waits on ``tool`` from ``started_at`` for ``duration_s``."""

    call_id: str
    tool: str
    started_at: float
    duration_s: float


@dataclass(frozen=True, slots=True)
class Timeline:
    """One session: when it ran, how it ended, its calls and gaps in start order."""

    session_id: str
    program: str
    end: SessionEnd
    began_at: float
    ended_at: float
    calls: tuple[CallSpan, ...]
    gaps: tuple[GapSpan, ...]

    @property
    def job_s(self) -> float:
        return max(0.0, self.ended_at - self.began_at)


@dataclass
class _Call:
    turn: int
    started_at: float
    prompt_tokens: int
    completed: ev.LLMCallCompleted | None = None
    completed_at: float = 0.0


@dataclass
class _Session:
    program: str = ""
    requested_at: float | None = None
    started_at: float | None = None
    ended_at: float | None = None
    end: SessionEnd = SessionEnd.UNFINISHED
    first_at: float = float("inf")
    last_at: float = float("-inf")
    calls: dict[str, _Call] = field(default_factory=dict)
    proposals: dict[str, tuple[str, float]] = field(default_factory=dict)
    """call id -> (tool, proposed at)."""


class TimelineFold:
    """Sessions folded from log events, in any interleaving of the topics (module docstring)."""

    def __init__(self) -> None:
        self._sessions: dict[str, _Session] = {}
        self._seen: set[str] = set()

    def observe(self, session_id: str, event_id: str, body: BaseModel, at: float) -> None:
        if event_id in self._seen:
            return
        self._seen.add(event_id)
        s = self._sessions.setdefault(session_id, _Session())
        s.first_at = min(s.first_at, at)
        s.last_at = max(s.last_at, at)
        if isinstance(body, ev.SessionRequested):
            s.requested_at = at if s.requested_at is None else min(s.requested_at, at)
            s.program = s.program or body.program
        elif isinstance(body, ev.SessionStarted):
            s.started_at = at if s.started_at is None else min(s.started_at, at)
            s.program = body.program
        elif isinstance(body, ev.SessionFinished | ev.SessionFailed):
            s.ended_at = at
            s.end = SessionEnd.FINISHED if isinstance(body, ev.SessionFinished) else SessionEnd.FAILED
        elif isinstance(body, ev.LLMCallStarted):
            call = s.calls.get(body.call_id)
            if call is None:
                s.calls[body.call_id] = _Call(body.turn, at, body.prompt_tokens)
            elif call.turn < 0:  # its completion came first
                call.turn, call.started_at, call.prompt_tokens = body.turn, at, body.prompt_tokens
        elif isinstance(body, ev.LLMCallCompleted):
            call = s.calls.get(body.call_id)
            if call is not None and call.completed is None:
                call.completed, call.completed_at = body, at
            elif call is None:  # read before its start (another partition's order): keep it for then
                s.calls[body.call_id] = _Call(-1, at, body.prompt_tokens, body, at)
        elif isinstance(body, ev.ToolCallProposed):
            s.proposals.setdefault(body.call_id, (body.tool, at))

    def timelines(self) -> list[Timeline]:
        """Every session seen that started or was requested, by begin time then id."""
        out = [
            _timeline(session_id, s)
            for session_id, s in self._sessions.items()
            if s.requested_at is not None or s.started_at is not None
        ]
        return sorted(out, key=lambda t: (t.began_at, t.session_id))


def _timeline(session_id: str, s: _Session) -> Timeline:
    began = next(t for t in (s.requested_at, s.started_at, s.first_at) if t is not None)
    ended = s.ended_at if s.ended_at is not None else s.last_at
    calls: list[CallSpan] = []
    previous: CallSpan | None = None
    for call_id, c in sorted(s.calls.items(), key=lambda item: (item[1].started_at, item[0])):
        done = c.completed
        if done is None or c.turn < 0:
            continue
        duration = max(0.0, c.completed_at - c.started_at)
        engine_ms = done.queue_ms + done.prefill_ms + done.decode_ms

        def to_log(engine: float, duration: float = duration, engine_ms: float = engine_ms) -> float:
            return duration * engine / engine_ms if engine_ms > 0 else 0.0

        reusable = 0 if previous is None else previous.prompt_tokens + previous.output_tokens
        span = CallSpan(
            call_id=call_id,
            turn=c.turn,
            started_at=c.started_at,
            duration_s=duration,
            prompt_tokens=done.prompt_tokens,
            cached_tokens=done.cached_tokens,
            output_tokens=done.output_tokens,
            reusable_tokens=min(reusable, done.prompt_tokens),
            queue_s=to_log(done.queue_ms),
            prefill_s=to_log(done.prefill_ms),
            queue_ms_recorded=done.queue_ms,
        )
        calls.append(span)
        previous = span
    # A gap ends where the session's next step begins: its next proposal or LLM call, else its end.
    starts = sorted([c.started_at for c in s.calls.values() if c.turn >= 0] + [at for _, at in s.proposals.values()])
    gaps: list[GapSpan] = []
    for call_id, (tool, at) in sorted(s.proposals.items(), key=lambda item: (item[1][1], item[0])):
        following = bisect.bisect_right(starts, at)  # the first step that begins after this proposal
        until = starts[following] if following < len(starts) else max(ended, at)
        gaps.append(GapSpan(call_id, tool, at, until - at))
    return Timeline(session_id, s.program, s.end, began, max(ended, began), tuple(calls), tuple(gaps))


def from_trace(trace: Trace, cost: CostModel | None = None) -> list[Timeline]:
    """The trace's sessions laid out alone on ``cost``'s clock (module docstring); seconds."""
    model = cost or CostModel()
    out: list[Timeline] = []
    for session in trace:
        at = session.arrival_s
        context = 0
        calls: list[CallSpan] = []
        gaps: list[GapSpan] = []
        for turn, t in enumerate(session.turns):
            prompt = context + t.prompt_tokens
            prefill_s = model.prefill_ms(prompt) / _MS_PER_S
            decode_s = model.decode_ms(t.output_tokens, prompt) / _MS_PER_S
            reusable = 0 if not calls else calls[-1].prompt_tokens + calls[-1].output_tokens
            calls.append(
                CallSpan(
                    call_id=f"llm-{turn}",
                    turn=turn,
                    started_at=at,
                    duration_s=prefill_s + decode_s,
                    prompt_tokens=prompt,
                    cached_tokens=0,
                    output_tokens=t.output_tokens,
                    reusable_tokens=min(reusable, prompt),
                    queue_s=0.0,
                    prefill_s=prefill_s,
                )
            )
            at += prefill_s + decode_s
            context = prompt + t.output_tokens
            if t.tool is not None and t.tool_duration_s is not None:
                gaps.append(GapSpan(f"tool-{turn}", t.tool, at, t.tool_duration_s))
                at += t.tool_duration_s
                context += t.tool_result_tokens or 0
        out.append(
            Timeline(
                session.session_id,
                session.source,
                SessionEnd.FINISHED,
                session.arrival_s,
                at,
                tuple(calls),
                tuple(gaps),
            )
        )
    return out


def fold_timelines(events: Iterable[tuple[str, str, BaseModel, float]]) -> list[Timeline]:
    """``TimelineFold`` over ``(session_id, event_id, body, at)`` tuples, for callers with a list."""
    fold = TimelineFold()
    for session_id, event_id, body, at in events:
        fold.observe(session_id, event_id, body, at)
    return fold.timelines()
