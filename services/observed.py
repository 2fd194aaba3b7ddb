"""What a process has seen on the log, as numbers: the fold behind every worker's ``/metrics``.

``Observed.observe(topic, session_id, body, at)`` folds one event (``at``: its ``occurred_at``
in seconds); counters only grow, gauges are derived from the folded state when read. Pure and
cheap (a few dict operations per event), so a worker can observe every event it consumes and
every event it appends. Each process reports what *it* reads: the planner sees sessions and LLM
calls, the executor tool calls and in-doubt ones, the cache manager decisions and KV hits; a
dashboard sums or picks per role.

Outcomes counted:

- sessions by status (``requested``, ``running``, ``finished``, ``failed``): a gauge over the
  sessions seen, each in its latest status;
- LLM calls completed, prompt tokens and cached tokens (the KV hit rate is cached / prompt),
  and the engine's queue, prefill and decode milliseconds per call (engine request latency);
- tool calls by outcome (``committed``, ``aborted``, ``completed``, ``failed``, ``in_doubt``);
- tool calls waiting for a verdict (proposed, neither committed nor aborted: held for a human
  or not decided yet) and in doubt (not resolved by a retry or a mark-done), each with the time
  the oldest has waited;
- cache decisions by action, and the blocks pinned now (PRESERVE and PREFETCH until their TTL
  ends or a later decision for the session replaces them);
- dead-lettered records by error type.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from pydantic import BaseModel

from schemas import events as ev

_SESSION_STATUS: dict[type[BaseModel], str] = {
    ev.SessionRequested: "requested",
    ev.SessionStarted: "running",
    ev.SessionFinished: "finished",
    ev.SessionFailed: "failed",
}
_TOOL_OUTCOME: dict[type[BaseModel], str] = {
    ev.ToolCallCommitted: "committed",
    ev.ToolCallAborted: "aborted",
    ev.ToolCallCompleted: "completed",
    ev.ToolCallFailed: "failed",
    ev.ToolCallInDoubt: "in_doubt",
}
_PINS = (ev.CacheAction.PRESERVE, ev.CacheAction.PREFETCH)
_RESOLVES_IN_DOUBT = (ev.ApprovalDecision.RETRY, ev.ApprovalDecision.MARK_DONE)


@dataclass
class Observed:
    """Counters and the little state the gauges need, folded from events."""

    llm_calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    engine_ms: dict[str, float] = field(default_factory=lambda: {"queue": 0.0, "prefill": 0.0, "decode": 0.0})
    tool_calls: Counter[str] = field(default_factory=Counter)
    cache_decisions: Counter[str] = field(default_factory=Counter)
    dead_letters: Counter[str] = field(default_factory=Counter)
    _status: dict[str, str] = field(default_factory=dict)
    _awaiting_verdict: dict[tuple[str, str], float] = field(default_factory=dict)
    _in_doubt: dict[tuple[str, str], float] = field(default_factory=dict)
    _pins: dict[str, tuple[int, float | None]] = field(default_factory=dict)
    """session -> (blocks pinned, when the pin ends; None: no TTL)."""

    def observe(self, topic: str, session_id: str, body: BaseModel, at: float) -> None:
        # One dict lookup per event: most of what a worker reads (KV events, tool starts of
        # other kinds, ...) counts for nothing here and must cost next to nothing.
        fold = _FOLDS.get(type(body))
        if fold is not None:
            fold(self, session_id, body, at)

    def observe_at(self, topic: str, session_id: str, body: BaseModel, occurred_at: datetime) -> None:
        """``observe`` with the envelope's time, converted only for the events that use it."""
        fold = _FOLDS.get(type(body))
        if fold is not None:
            fold(self, session_id, body, occurred_at.timestamp())

    def _session(self, session_id: str, body: BaseModel, at: float) -> None:
        status = _SESSION_STATUS[type(body)]
        # A late SessionRequested (ops is read beside actions) never moves a session back.
        if status != "requested" or session_id not in self._status:
            self._status[session_id] = status

    def _tool_outcome(self, session_id: str, body: BaseModel, at: float) -> None:
        outcome = _TOOL_OUTCOME[type(body)]
        self.tool_calls[outcome] += 1
        call = (session_id, body.call_id)  # type: ignore[attr-defined]
        if outcome in ("committed", "aborted"):
            self._awaiting_verdict.pop(call, None)
        elif outcome == "in_doubt":
            self._in_doubt[call] = at
        else:
            self._in_doubt.pop(call, None)

    def _llm_completed(self, session_id: str, body: BaseModel, at: float) -> None:
        assert isinstance(body, ev.LLMCallCompleted)
        self.llm_calls += 1
        self.prompt_tokens += body.prompt_tokens
        self.cached_tokens += body.cached_tokens
        self.engine_ms["queue"] += body.queue_ms
        self.engine_ms["prefill"] += body.prefill_ms
        self.engine_ms["decode"] += body.decode_ms

    def _proposed(self, session_id: str, body: BaseModel, at: float) -> None:
        assert isinstance(body, ev.ToolCallProposed)
        self._awaiting_verdict.setdefault((session_id, body.call_id), at)

    def _started(self, session_id: str, body: BaseModel, at: float) -> None:
        assert isinstance(body, ev.ToolCallStarted)
        self._in_doubt.pop((session_id, body.call_id), None)  # a retry resolves it

    def _approval(self, session_id: str, body: BaseModel, at: float) -> None:
        assert isinstance(body, ev.ApprovalGiven)
        if body.decision in _RESOLVES_IN_DOUBT:
            self._in_doubt.pop((session_id, body.call_id), None)

    def _cache_decision(self, session_id: str, body: BaseModel, at: float) -> None:
        assert isinstance(body, ev.CacheDecisionMade)
        self.cache_decisions[body.action.value] += 1
        if body.action in _PINS:
            ends = at + body.ttl_ms / 1000 if body.ttl_ms is not None else None
            self._pins[session_id] = (body.num_blocks, ends)
        else:
            self._pins.pop(session_id, None)

    def _dead_letter(self, session_id: str, body: BaseModel, at: float) -> None:
        assert isinstance(body, ev.RecordDeadLettered)
        self.dead_letters[body.error_type] += 1

    def sessions_by_status(self) -> Counter[str]:
        return Counter(self._status.values())

    def awaiting_verdict(self, now: float) -> tuple[int, float]:
        """(calls waiting for a verdict, seconds the oldest has waited)."""
        return _count_and_age(self._awaiting_verdict, now)

    def in_doubt(self, now: float) -> tuple[int, float]:
        """(calls in doubt, seconds the oldest has waited for an operator)."""
        return _count_and_age(self._in_doubt, now)

    def blocks_pinned(self, now: float) -> int:
        return sum(blocks for blocks, ends in self._pins.values() if ends is None or ends > now)

    def hit_rate(self) -> float:
        """Prompt tokens served from the KV cache, over all prompt tokens (0 before any call)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _count_and_age(waiting: dict[tuple[str, str], float], now: float) -> tuple[int, float]:
    if not waiting:
        return 0, 0.0
    return len(waiting), max(0.0, now - min(waiting.values()))


_Fold = Callable[[Observed, str, BaseModel, float], None]
_FOLDS: dict[type[BaseModel], _Fold] = {
    **dict.fromkeys(_SESSION_STATUS, Observed._session),
    **dict.fromkeys(_TOOL_OUTCOME, Observed._tool_outcome),
    ev.LLMCallCompleted: Observed._llm_completed,
    ev.ToolCallProposed: Observed._proposed,
    ev.ToolCallStarted: Observed._started,
    ev.ApprovalGiven: Observed._approval,
    ev.CacheDecisionMade: Observed._cache_decision,
    ev.RecordDeadLettered: Observed._dead_letter,
}
"""What each event type moves (the others move nothing)."""
