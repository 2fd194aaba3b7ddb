"""What the router is told about a session, from its folded log (pure).

``services.routing`` decides where an LLM call goes and which model size a step gets; this
module gathers its inputs from a ``SessionState`` and turns its answers into the log's
``EngineRouted``, so the planner only does the I/O:

- **where the session's prefix is** (``locate``, ``prefix_on``): the engine that served its last
  completed LLM call holds its context (that call's prompt and output tokens), unless the cache
  manager let it go there since (``dropped``: the planner reads ``kv.decisions`` for that). With
  the engines' ``kv.events`` (``holdings``: per engine, what ``services.holdings.KVHoldings``
  says the engine still holds of the session's context, and the latest call it reported), the
  events decide instead, for every engine they name: an engine that evicted the session's
  blocks under pressure, with no decision of the cache manager, holds only the prefix it kept,
  and an engine the session left still counts for the prefix it still holds. On the last
  call's engine the events decide only once they include that call (its ``KVCacheHit``, which
  comes after the call's other events): before, the log's belief stands, since nothing the
  engine did after the call is known yet. Either way a count is capped at the last call's
  context (after a restore, blocks past the cut are no prefix of the next prompt). A fork's
  inherited calls are its parent's, so a fork's first call goes where its parent's prefix is
  (the planner passes the parent's holdings).
- **what the log learned about sizes** (``learn``): each finished session's routed LLM calls,
  per program and step, with whether the step needed a retry: the tool call it asked for
  failed or was aborted, or the session failed right after it.
- **the event** (``routed``): the route and the size choice, with what the planner believed.

No I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from schemas import events as ev
from services.session import LLMCall, SessionState, SessionStatus, ToolStatus, step_of

__all__ = [
    "Holding",
    "Located",
    "context_tokens",
    "last_call",
    "learn",
    "locate",
    "locate_context",
    "prefix_on",
    "routed",
]


def last_call(state: SessionState) -> LLMCall | None:
    """The session's latest completed LLM call (by step), inherited ones included."""
    done = [c for c in state.llm_calls.values() if c.completed is not None]
    return max(done, key=lambda c: step_of(c.call_id), default=None)


def context_tokens(call: LLMCall) -> int:
    """Tokens of context a completed call leaves on its engine: its prompt and its output."""
    assert call.completed is not None
    return call.completed.prompt_tokens + call.completed.output_tokens


@dataclass(frozen=True)
class Holding:
    """What one engine's ``kv.events`` say of the session whose context a call continues."""

    held_tokens: int
    """Tokens of that context the engine holds from its start (``KVHoldings.held_tokens``)."""
    reported_call: str | None = None
    """The call id of the session's latest ``KVCacheHit`` there (``KVHoldings.reported``)."""


@dataclass(frozen=True)
class Located:
    """Where the session's prefix is: engine id -> prompt tokens held, and what the events changed, in words."""

    cached: dict[str, int]
    notes: tuple[str, ...] = ()


def _reported(holding: Holding, call_id: str) -> bool:
    """Whether the engine's events include ``call_id`` (a hit for it or for a later step)."""
    if holding.reported_call is None:
        return False
    if holding.reported_call == call_id:
        return True
    try:
        return step_of(holding.reported_call) > step_of(call_id)
    except (IndexError, ValueError):  # an id of another shape: not comparable, so not known to be later
        return False


def locate(state: SessionState, dropped: Iterable[str] = (), holdings: Mapping[str, Holding] | None = None) -> Located:
    """Engine id -> prompt tokens of the session each engine is believed to hold (module docstring).

    ``dropped``: engines where the cache manager's latest decision for the session discarded its
    blocks after its last call (nothing is counted there). ``holdings``: per engine whose
    ``kv.events`` name the session's context, what they say it holds (None or empty: no events,
    the log alone decides)."""
    call = last_call(state)
    if call is None or call.completed is None:
        return Located({})
    return locate_context(call.call_id, call.completed.engine_id, context_tokens(call), dropped, holdings)


def locate_context(
    call_id: str,
    engine_id: str,
    context: int,
    dropped: Iterable[str] = (),
    holdings: Mapping[str, Holding] | None = None,
) -> Located:
    """``locate`` from the last completed call's id, engine and context tokens alone: the rules for
    any reader that knows a session's last call without a ``SessionState`` (the gateway, from its
    own records: ``services.gateway.locate_served``), so that both route by the same rules."""
    cap = context
    last = engine_id
    holdings = holdings or {}
    cached: dict[str, int] = {}
    notes: list[str] = []
    for engine, holding in sorted(holdings.items()):
        if engine == last and not _reported(holding, call_id):
            continue  # the engine's events of the last call are not in yet: the log's belief stands
        tokens = min(max(holding.held_tokens, 0), cap)
        if engine == last and tokens < cap:
            notes.append(f"kv.events: {engine} kept {tokens} of its {cap} context tokens")
        elif engine != last and tokens:
            notes.append(f"kv.events: {engine} still holds {tokens} tokens of its context")
        if tokens:
            cached[engine] = tokens
    if last not in holdings or not _reported(holdings[last], call_id):
        cached[last] = cap
    for engine in dict.fromkeys(dropped):  # in the order given: the notes are the same every run
        if cached.pop(engine, None):
            notes.append(f"kv.decisions: discarded on {engine}")
    return Located(cached, tuple(notes))


def prefix_on(
    state: SessionState, dropped: Iterable[str] = (), holdings: Mapping[str, Holding] | None = None
) -> dict[str, int]:
    """Engine id -> prompt tokens of the session that engine is believed to hold (``locate``'s counts)."""
    return locate(state, dropped, holdings).cached


def learn(state: SessionState, record: Any) -> int:
    """Feed a finished session's routed calls to ``record(program, step, size, retried)``
    (``SizeStats.record``; ``step``: the step's index, as a string); how many were recorded. A
    session not finished records nothing. The size is the call's latest route's (a failover keeps
    the size)."""
    if not state.finished or not state.routes:
        return 0
    steps = sorted(state.steps, key=lambda s: step_of(s.call_id))
    count = 0
    for i, step in enumerate(steps):
        route = state.routes.get(step.call_id)
        if route is None or not isinstance(step, LLMCall) or step.origin is not None:
            continue
        following = steps[i + 1] if i + 1 < len(steps) else None
        if following is None:
            retried = state.status is SessionStatus.FAILED
        else:
            status = getattr(following, "status", None)
            retried = status in (ToolStatus.FAILED, ToolStatus.ABORTED)
        record(state.program, str(step_of(step.call_id)), route.model_size, retried)
        count += 1
    return count


def routed(
    *,
    call_id: str,
    request_id: str,
    attempt: int,
    route: Any,
    router: str,
    prompt_tokens: int,
    cached: Mapping[str, int],
    size: Any,
    failed_engine_id: str | None = None,
    reason: str | None = None,
    notes: Iterable[str] = (),
) -> ev.EngineRouted:
    """The log's record of a routing decision (``route``: a ``services.routing.Route``, ``size``: a
    ``SizeChoice``); ``reason`` overrides the route's (a failover); ``notes`` (``Located.notes``:
    what kv.events and the cache manager changed of the log's belief) follow the route's detail."""
    detail = "; ".join(d for d in (str(getattr(route, "detail", "")), *notes) if d)
    return ev.EngineRouted(
        call_id=call_id,
        request_id=request_id,
        attempt=attempt,
        engine_id=route.engine_id,
        reason=reason or route.reason,
        detail=detail,
        router=router,
        prompt_tokens=prompt_tokens,
        expected_cached_tokens=min(prompt_tokens, int(cached.get(route.engine_id, 0))),
        expected_recompute_tokens=int(route.expected_recompute_tokens),
        model_size=size.size,
        size_reason=size.reason,
        failed_engine_id=failed_engine_id,
    )
