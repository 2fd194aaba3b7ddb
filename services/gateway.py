"""The OpenAI-compatible gateway's rules (pure): digests, steps, adoption, votes, responses.

The gateway process (``workers/gateway``) proxies an external agent's chat completions
to the engine and writes only ``agent.gateway`` (docs/architecture.md, "The gateway"):

- ``GatewayLLMCallServed``: one per completion, recorded before the client sees it, with
  the model's tool calls; the planner *adopts* it (``adopt``) into the session's
  ``LLMCallStarted`` / ``LLMCallCompleted`` / ``ToolCallProposed`` on agent.actions, so the
  decider votes on the tool calls and every reader sees an ordinary session;
- ``GatewayToolResultReported``: one per ``tool`` message the client sends back for a call
  the gateway released to it; the executor records it as the call's ``ToolCallCompleted``
  (``adopt_results``) and never runs the call;
- ``GatewaySessionEnded``: the session is over (no request for the idle timeout,
  ``idle_sessions``, or the client finished it); the planner records its ``SessionFinished``
  after adopting every call (``adopt``), and the gateway refuses later requests.

With several engines the gateway routes each completion (``services.routing``, the planner's
router): ``locate_served`` says where the session's prefix is (the planner's
``services.placement`` rules: its last recorded call's engine, corrected by the engines'
``kv.events`` and the cache manager's ``kv.decisions``), ``size_for_model``
which model size the client's model is, and each decision is recorded as
``GatewayEngineRouted`` (``route_claim``) in the same append as the call's
``GatewayLLMCallServed``; ``adopt`` copies it onto agent.actions as the session's
``EngineRouted``, before the call's ``LLMCallStarted``, so ``logctl audit --routes`` and every
other reader of routes see a gateway session's routes as a planner session's.

Steps follow ``services.session``: an LLM call is step k (``llm-<k>``), its n tool calls are
steps k+1..k+n (``tool-<k+i>``), the next LLM call is step k+n+1.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas import events as ev
from schemas.events import EffectClass
from services.decide import Append
from services.placement import Holding, Located, locate_context
from services.routing import SIZES, SizeChoice
from services.session import GATEWAY_PROGRAM, SessionState, SessionStatus, ToolStatus, llm_call_id, step_of
from services.tools import ToolSpec, idempotency_key

__all__ = [
    "DIGESTED_OPTIONS",
    "GatewayToolCall",
    "RateLimiter",
    "adopt",
    "adopt_results",
    "adoption_problems",
    "estimate_tokens",
    "context_of",
    "last_served",
    "locate_served",
    "prompt_estimate",
    "route_claim",
    "size_for_model",
    "forgettable",
    "idle_sessions",
    "next_step",
    "prompt_digest",
    "refusal_text",
    "request_digest",
    "result_json",
    "tool_calls_of",
]

DIGESTED_OPTIONS = (
    "model",
    "messages",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "n",
    "response_format",
)
"""The request fields that make two requests the same request (``stream`` does not: a
client that re-sends a streamed request without streaming gets the same answer)."""


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def request_digest(body: Mapping[str, Any]) -> str:
    """SHA-256 hex of the request's ``DIGESTED_OPTIONS``: equal for a re-sent request."""
    return _digest({k: body[k] for k in DIGESTED_OPTIONS if k in body})


def prompt_digest(body: Mapping[str, Any]) -> str:
    """SHA-256 hex of the messages and tools (what the engine prefills)."""
    return _digest({"messages": body.get("messages"), "tools": body.get("tools")})


@dataclass(frozen=True)
class GatewayToolCall:
    """One tool call a model returned, as ``GatewayLLMCallServed.tool_calls_json`` holds it."""

    call_id: str
    """``tool-<step>``: the session's id of the call (proposal, verdict, result)."""
    id: str
    """The id the client sees (the engine's, e.g. ``call_...``)."""
    name: str
    arguments: str
    """The arguments exactly as the model wrote them (JSON text, possibly malformed)."""

    def as_json(self) -> dict[str, str]:
        return {"call_id": self.call_id, "id": self.id, "name": self.name, "arguments": self.arguments}

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


def tool_calls_of(served: ev.GatewayLLMCallServed) -> list[GatewayToolCall]:
    return [GatewayToolCall(**t) for t in json.loads(served.tool_calls_json)]


def next_step(state: SessionState) -> int:
    """The step of the session's next LLM call: after every recorded call and its tool calls."""
    end = 0
    for served in state.gateway_calls.values():
        end = max(end, step_of(served.call_id) + 1 + len(json.loads(served.tool_calls_json)))
    return end


def llm_step_id(step: int) -> str:
    return str(llm_call_id(step))


def estimate_tokens(text: str) -> int:
    """Tokens a text adds to a context when no tokenizer is at hand: characters / 4, rounded up."""
    return math.ceil(len(text) / 4)


def result_json(content: Any) -> str:
    """A tool message's content as JSON: kept as is when it is JSON text, else a JSON string."""
    if isinstance(content, str):
        try:
            json.loads(content)
        except ValueError:
            return json.dumps(content)
        return content
    return json.dumps(content, sort_keys=True)


def refusal_text(call: GatewayToolCall, reason: str) -> str:
    """What the client reads instead of a tool call the decider aborted."""
    return f"[agentlog] the tool call {call.name} ({call.id}) was refused and not returned: {reason}"


def adopt(state: SessionState, tools: Mapping[str, ToolSpec]) -> list[Append]:
    """What the planner appends for a gateway session that agent.actions does not hold yet:
    ``SessionStarted`` first, then for each recorded call in step order its ``LLMCallStarted``,
    ``LLMCallCompleted`` and one ``ToolCallProposed`` per tool call, and last, once the gateway
    ended the session, its ``SessionFinished`` (output: the cause and the reason). Each has the
    deterministic key of what it adopts, so adopting again after a crash appends nothing twice.

    A tool the stack does not know is proposed as irreversible (the conservative guess: the
    client's tool may do anything); the decider's ``arg_schema`` voter aborts unknown tools."""
    sid = state.session_id
    out: list[Append] = []
    if state.program != GATEWAY_PROGRAM:
        return out
    if state.status is SessionStatus.REQUESTED:
        if not state.gateway_calls:
            return out  # its first route read, not its record yet (appended together): start with the record
        model = next(iter(state.gateway_calls.values())).model if state.gateway_calls else ""
        args = json.dumps({"model": model, "via": "gateway"}, sort_keys=True)
        out.append(Append(sid, ev.SessionStarted(program=GATEWAY_PROGRAM, args_json=args), "start"))
    adopted = {(r.call_id, r.attempt) for r in state.route_history}
    for served in sorted(state.gateway_calls.values(), key=lambda s: step_of(s.call_id)):
        # The call's routes first (the gateway appended them with it): EngineRouted precedes its
        # LLMCallStarted, as on a session the planner routes.
        for key, claim in sorted(state.gateway_routes.items()):
            if key[0] == served.call_id and key not in adopted:
                route = ev.EngineRouted(**claim.model_dump())
                out.append(Append(sid, route, "routed", f"{claim.call_id}/{claim.attempt}"))
        call = state.llm_calls.get(served.call_id)
        if call is None:
            started = ev.LLMCallStarted(
                call_id=served.call_id,
                turn=served.turn,
                engine_id=served.engine_id,
                prompt_tokens=served.prompt_tokens,
                max_output_tokens=served.max_output_tokens,
                prompt_digest=served.prompt_digest,
                priority=served.priority,
                priority_attained_ms=served.priority_attained_ms,
                priority_age_ms=served.priority_age_ms,
                priority_warm=served.priority_warm,
            )
            out.append(Append(sid, started, "llm-started", served.call_id))
        if call is None or call.completed is None:
            calls = [{"id": t.id, "name": t.name, "arguments": t.arguments} for t in tool_calls_of(served)]
            completed = ev.LLMCallCompleted(
                call_id=served.call_id,
                engine_id=served.engine_id,
                prompt_tokens=served.prompt_tokens,
                cached_tokens=served.cached_tokens,
                output_tokens=served.output_tokens,
                output_text=served.output_text,
                finish_reason=served.finish_reason,
                queue_ms=served.queue_ms,
                prefill_ms=served.prefill_ms,
                decode_ms=served.decode_ms,
                tool_calls_json=json.dumps(calls) if calls else None,
            )
            out.append(Append(sid, completed, "llm-completed", served.call_id))
        for tool in tool_calls_of(served):
            if tool.call_id in state.tool_calls:
                continue
            spec = tools.get(tool.name)
            proposed = ev.ToolCallProposed(
                call_id=tool.call_id,
                tool=tool.name,
                arguments_json=tool.arguments,
                effect_class=spec.effect_class if spec is not None else EffectClass.IRREVERSIBLE,
                idempotency_key=idempotency_key(sid, tool.call_id),
                compensation_tool=spec.compensation if spec is not None else None,
            )
            out.append(Append(sid, proposed, "proposed", tool.call_id))
    ended = state.gateway_ended
    if ended is not None and state.status is not SessionStatus.FINISHED:
        output = {"ended": ended.cause, "reason": ended.reason}
        finished = ev.SessionFinished(
            output_json=json.dumps(output, sort_keys=True),
            num_llm_calls=len(state.gateway_calls),
            num_tool_calls=sum(len(tool_calls_of(s)) for s in state.gateway_calls.values()),
        )
        out.append(Append(sid, finished, "finished"))
    return out


def last_served(calls: Iterable[ev.GatewayLLMCallServed]) -> ev.GatewayLLMCallServed | None:
    """The session's last recorded call (by step); None before its first."""
    return max(calls, key=lambda s: step_of(s.call_id), default=None)


def context_of(served: ev.GatewayLLMCallServed | None) -> int:
    """Tokens of context a recorded call leaves on its engine: its prompt and its output (0: none)."""
    return 0 if served is None else served.prompt_tokens + served.output_tokens


def locate_served(
    calls: Iterable[ev.GatewayLLMCallServed],
    dropped: Iterable[str] = (),
    holdings: Mapping[str, Holding] | None = None,
) -> Located:
    """Where a gateway session's prefix is: ``services.placement.locate``'s rules (the planner's),
    fed by the gateway's own records instead of a ``SessionState``: the engine of the session's
    last recorded call holds that call's context, unless the engines' ``kv.events``
    (``holdings``) say what it kept and what other engines still hold, or the cache manager
    discarded it there since (``dropped``). Empty before the session's first call."""
    last = last_served(calls)
    if last is None:
        return Located({})
    return locate_context(last.call_id, last.engine_id, context_of(last), dropped, holdings)


def prompt_estimate(messages: Sequence[Mapping[str, Any]], context: int) -> int:
    """The prompt tokens of a request before any engine has counted them (the gateway has no
    tokenizer): characters / 4 of its messages, and at least the context the session's last call
    left (``context_of``: a conversation only grows, and the prefix held must not look larger
    than the prompt)."""
    text = json.dumps([m.get("content") for m in messages], separators=(",", ":"), default=str)
    return max(estimate_tokens(text), context)


def size_for_model(model: str, served_by: Mapping[str, Iterable[str]], available: Iterable[str]) -> SizeChoice:
    """The model size of a call that asks for ``model`` (``served_by``: model -> the sizes of the
    engines configured to serve it): the one size of its engines when they all have one, else the
    large model if a healthy engine has it (``available``), else what there is. The client chose
    the model, so the gateway does not choose a size for it (``choose_size`` is the planner's,
    per program step)."""
    sizes = sorted(set(served_by.get(model, ())))
    if len(sizes) == 1:
        return SizeChoice(sizes[0], f"the client asked for {model}, served by {sizes[0]} engines")
    have = [s for s in reversed(SIZES) if s in set(available)] or ["large"]
    return SizeChoice(have[0], "default")


def route_claim(route: ev.EngineRouted) -> ev.GatewayEngineRouted:
    """The gateway's record of a routing decision (built by ``services.placement.routed``, as the
    planner's): the same fields, on the gateway's own topic."""
    return ev.GatewayEngineRouted(**route.model_dump())


def idle_sessions(last_seen: Mapping[str, float], busy: Iterable[str], now: float, idle_timeout_s: float) -> list[str]:
    """The sessions to end for idleness: no request for ``idle_timeout_s`` (``last_seen``: when each
    open session's last request arrived or was answered, in seconds) and none in flight (``busy``:
    a request waiting for its engine or a held verdict is not idleness). Oldest first, then by id;
    a timeout of 0 or less ends nothing."""
    if idle_timeout_s <= 0:
        return []
    skip = set(busy)
    due = [(t, sid) for sid, t in last_seen.items() if sid not in skip and now - t >= idle_timeout_s]
    return [sid for _, sid in sorted(due)]


def forgettable(since: Mapping[str, float], busy: Iterable[str], now: float, retain_s: float) -> list[str]:
    """The sessions whose state the gateway may drop: ``since`` (seconds) maps each candidate to when
    it ended (or, for a session that recorded nothing, when a request of it was last seen), and
    ``retain_s`` has passed since; none with a request in flight (``busy``). Oldest first, then by id;
    a ``retain_s`` below 0 forgets nothing."""
    if retain_s < 0:
        return []
    skip = set(busy)
    due = [(t, sid) for sid, t in since.items() if sid not in skip and now - t >= retain_s]
    return [sid for _, sid in sorted(due)]


def adopt_results(state: SessionState) -> list[Append]:
    """What the executor appends for a gateway session: a ``ToolCallCompleted`` (duration = the
    gap the client took) for each reported result of a committed call without an outcome."""
    out: list[Append] = []
    if state.program != GATEWAY_PROGRAM:
        return out
    for call_id, reported in state.gateway_results.items():
        tool = state.tool_calls.get(call_id)
        if tool is None or tool.status is not ToolStatus.COMMITTED:
            continue  # not proposed yet (the planner adopts it first), aborted, or recorded already
        completed = ev.ToolCallCompleted(
            call_id=call_id,
            result_json=reported.result_json,
            result_tokens=reported.result_tokens,
            duration_ms=reported.gap_ms,
        )
        out.append(Append(state.session_id, completed, "completed", call_id))
    return out


@dataclass
class RateLimiter:
    """At most ``max_requests`` per session in any ``window_s`` (a sliding window; time is passed in).

    A refused request does not count: a client that backs off gets through again."""

    max_requests: int
    window_s: float = 60.0
    _seen: dict[str, deque[float]] = field(default_factory=dict)

    def allow(self, session_id: str, now: float) -> bool:
        times = self._seen.setdefault(session_id, deque())
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if len(times) >= self.max_requests:
            return False
        times.append(now)
        return True

    def retry_after_s(self, session_id: str, now: float) -> float:
        times = self._seen.get(session_id)
        return max(0.0, times[0] + self.window_s - now) if times else 0.0


def reported_tool_results(
    messages: Sequence[Mapping[str, Any]], released: Iterable[GatewayToolCall]
) -> list[tuple[GatewayToolCall, Any]]:
    """The ``tool`` messages of a request that answer calls the gateway released, with their content."""
    by_id = {c.id: c for c in released}
    out: list[tuple[GatewayToolCall, Any]] = []
    for message in messages:
        if message.get("role") == "tool" and (call := by_id.get(str(message.get("tool_call_id")))) is not None:
            out.append((call, message.get("content", "")))
    return out


def adoption_problems(state: SessionState) -> list[str]:
    """``logctl replay --check`` for a gateway session (it has no program to re-run): every
    disagreement, in words, between the gateway's records and the session's adopted events."""
    problems: list[str] = []
    for served in sorted(state.gateway_calls.values(), key=lambda s: step_of(s.call_id)):
        call = state.llm_calls.get(served.call_id)
        if call is None or call.completed is None:
            problems.append(f"{served.call_id}: recorded by the gateway, not adopted (yet)")
        elif call.started.prompt_digest != served.prompt_digest or call.completed.output_text != served.output_text:
            problems.append(f"{served.call_id}: the adopted LLM call differs from the gateway's record")
        for tool in tool_calls_of(served):
            proposed = state.tool_calls.get(tool.call_id)
            if proposed is None:
                problems.append(f"{tool.call_id}: returned by the model, never proposed")
            elif (proposed.proposed.tool, proposed.proposed.arguments_json) != (tool.name, tool.arguments):
                problems.append(f"{tool.call_id}: the proposal differs from the model's tool call")
    for call_id, reported in state.gateway_results.items():
        outcome = state.tool_calls[call_id].completed if call_id in state.tool_calls else None
        if outcome is None or outcome.result_json != reported.result_json:
            problems.append(f"{call_id}: the client's reported result is not the call's recorded outcome")
    if state.gateway_ended is not None and state.status is not SessionStatus.FINISHED:
        problems.append(f"ended by the gateway ({state.gateway_ended.cause}), not finished (yet)")
    return problems
