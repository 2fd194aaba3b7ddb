"""What the router is told about a session, from its folded log (pure).

``services.routing`` decides where an LLM call goes and which model size a step gets; this
module gathers its inputs from a ``SessionState`` and turns its answers into the log's
``EngineRouted``, so the planner only does the I/O:

- **where the session's prefix is** (``prefix_on``): the engine that served its last completed
  LLM call holds its context (that call's prompt and output tokens), unless the cache manager
  let it go there since (``dropped``: the planner reads ``kv.decisions`` for that). A fork's
  inherited calls are its parent's, so a fork's first call goes where its parent ran. Only the
  last engine counts: a session that moved left stale blocks behind, which the cache manager
  discards (``services.cache.engines``).
- **what the log learned about sizes** (``learn``): each finished session's routed LLM calls,
  per program and step, with whether the step needed a retry: the tool call it asked for
  failed or was aborted, or the session failed right after it.
- **the event** (``routed``): the route and the size choice, with what the planner believed.

No I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from schemas import events as ev
from services.session import LLMCall, SessionState, SessionStatus, ToolStatus, step_of

__all__ = ["context_tokens", "last_call", "learn", "prefix_on", "routed"]


def last_call(state: SessionState) -> LLMCall | None:
    """The session's latest completed LLM call (by step), inherited ones included."""
    done = [c for c in state.llm_calls.values() if c.completed is not None]
    return max(done, key=lambda c: step_of(c.call_id), default=None)


def context_tokens(call: LLMCall) -> int:
    """Tokens of context a completed call leaves on its engine: its prompt and its output."""
    assert call.completed is not None
    return call.completed.prompt_tokens + call.completed.output_tokens


def prefix_on(state: SessionState, dropped: Iterable[str] = ()) -> dict[str, int]:
    """Engine id -> prompt tokens of the session that engine is believed to hold.

    ``dropped``: engines where the cache manager's latest decision for the session released
    or discarded its blocks after that call (then nothing is counted there)."""
    call = last_call(state)
    if call is None or call.completed is None:
        return {}
    engine = call.completed.engine_id
    if engine in set(dropped):
        return {}
    return {engine: context_tokens(call)}


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
) -> ev.EngineRouted:
    """The log's record of a routing decision (``route``: a ``services.routing.Route``, ``size``: a
    ``SizeChoice``); ``reason`` overrides the route's (a failover)."""
    return ev.EngineRouted(
        call_id=call_id,
        request_id=request_id,
        attempt=attempt,
        engine_id=route.engine_id,
        reason=reason or route.reason,
        detail=str(getattr(route, "detail", "")),
        router=router,
        prompt_tokens=prompt_tokens,
        expected_cached_tokens=min(prompt_tokens, int(cached.get(route.engine_id, 0))),
        expected_recompute_tokens=int(route.expected_recompute_tokens),
        model_size=size.size,
        size_reason=size.reason,
        failed_engine_id=failed_engine_id,
    )
