"""The gateway's pure rules: what the planner and the executor adopt, the digests, the rate limit."""

from __future__ import annotations

import itertools
import json
from datetime import UTC, datetime

import pytest

from schemas import events as ev
from schemas.envelope import Envelope
from schemas.events import EffectClass
from services.gateway import (
    GatewayToolCall,
    RateLimiter,
    adopt,
    adopt_results,
    adoption_problems,
    context_of,
    forgettable,
    idle_sessions,
    last_served,
    locate_served,
    next_step,
    prompt_estimate,
    refusal_text,
    reported_tool_results,
    request_digest,
    result_json,
    route_claim,
    size_for_model,
)
from services.placement import Holding, Located, locate_context, routed
from services.routing import Route, SizeChoice
from services.session import GATEWAY_PROGRAM, SessionState, SessionStatus, ToolStatus
from services.tools import TOOLS

pytestmark = pytest.mark.unit

SID = "agent-1"
_EVENT_NUMBERS = itertools.count()


def served(step: int, tools: tuple[tuple[str, str], ...] = (), **fields: object) -> ev.GatewayLLMCallServed:
    calls = [
        GatewayToolCall(f"tool-{step + 1 + i}", f"call_{step}_{i}", name, args).as_json()
        for i, (name, args) in enumerate(tools)
    ]
    values: dict[str, object] = {
        "call_id": f"llm-{step}",
        "turn": step,
        "model": "sim",
        "engine_id": "sim-0",
        "request_digest": f"r{step}",
        "prompt_digest": f"p{step}",
        "prompt_tokens": 10,
        "cached_tokens": 4,
        "output_tokens": 3,
        "max_output_tokens": 0,
        "output_text": f"text {step}",
        "tool_calls_json": json.dumps(calls),
        "finish_reason": "tool_calls" if tools else "stop",
        "response_id": f"chatcmpl-{step}",
        "created": 1,
        "queue_ms": 0.0,
        "prefill_ms": 1.0,
        "decode_ms": 2.0,
        "engine_ms": 3.0,
        "stream": False,
    }
    return ev.GatewayLLMCallServed(**{**values, **fields})  # type: ignore[arg-type]


def apply(state: SessionState, body: ev.Event, actor: str) -> None:
    state.apply(
        Envelope.model_construct(
            event_id=f"e{next(_EVENT_NUMBERS)}",
            session_id=state.session_id,
            seq=0,
            actor=actor,
            occurred_at=datetime(2026, 1, 1, tzinfo=UTC),
            causation_id=None,
            prev_hash=b"",
            body=body,
            hash=b"",
        )
    )


def adopted(state: SessionState) -> None:
    for a in adopt(state, TOOLS):
        apply(state, a.body, "planner")


def test_the_first_record_requests_the_session_and_the_planner_adopts_it_in_step_order() -> None:
    state = SessionState(SID)
    apply(state, served(0, (("echo", '{"text": "a"}'), ("wipe_disk", "{}"))), "gateway")
    assert (state.status, state.program) == (SessionStatus.REQUESTED, GATEWAY_PROGRAM)
    appends = adopt(state, TOOLS)
    assert [(type(a.body).__name__, a.kind, a.key) for a in appends] == [
        ("SessionStarted", "start", ""),
        ("LLMCallStarted", "llm-started", "llm-0"),
        ("LLMCallCompleted", "llm-completed", "llm-0"),
        ("ToolCallProposed", "proposed", "tool-1"),
        ("ToolCallProposed", "proposed", "tool-2"),
    ]
    echo, wipe = appends[3].body, appends[4].body
    assert isinstance(echo, ev.ToolCallProposed) and isinstance(wipe, ev.ToolCallProposed)
    assert echo.effect_class is EffectClass.PURE and echo.arguments_json == '{"text": "a"}'
    assert wipe.effect_class is EffectClass.IRREVERSIBLE, "a tool the stack does not know may do anything"
    completed = appends[2].body
    assert isinstance(completed, ev.LLMCallCompleted) and (completed.prompt_tokens, completed.cached_tokens) == (10, 4)
    assert [c["id"] for c in json.loads(completed.tool_calls_json or "[]")] == ["call_0_0", "call_0_1"]

    adopted(state)
    assert state.status is SessionStatus.RUNNING and adopt(state, TOOLS) == [], "adopting twice appends nothing"
    assert next_step(state) == 3 and adoption_problems(state) == []
    apply(state, served(3), "gateway")
    assert [a.key for a in adopt(state, TOOLS)] == ["llm-3", "llm-3"]


def test_a_session_the_planner_runs_is_never_adopted() -> None:
    state = SessionState(SID)
    apply(state, ev.SessionRequested(program="react", args_json="{}", author="op"), "operator")
    apply(state, served(0), "gateway")
    assert state.program == "react" and adopt(state, TOOLS) == [] and adopt_results(state) == []


def test_the_executor_records_reported_results_of_committed_calls_only() -> None:
    state = SessionState(SID)
    apply(state, served(0, (("echo", '{"text": "a"}'), ("echo", '{"text": "b"}'))), "gateway")
    adopted(state)
    report = ev.GatewayToolResultReported(
        call_id="tool-1", tool_call_id="call_0_0", result_json='"a"', result_tokens=1, gap_ms=250.0
    )
    apply(state, report, "gateway")
    assert adopt_results(state) == [], "no verdict yet"
    apply(state, ev.ToolCallCommitted(call_id="tool-1", votes=[], policy="unanimous"), "decider")
    apply(state, ev.ToolCallAborted(call_id="tool-2", votes=[], policy="unanimous", reason="no"), "decider")
    (append,) = adopt_results(state)
    assert isinstance(append.body, ev.ToolCallCompleted) and (append.kind, append.key) == ("completed", "tool-1")
    assert append.body.duration_ms == 250.0 and append.body.result_json == '"a"'
    apply(state, append.body, "executor")
    assert state.tool_calls["tool-1"].status is ToolStatus.COMPLETED and adopt_results(state) == []
    assert adoption_problems(state) == []


def test_adoption_problems_name_what_differs() -> None:
    state = SessionState(SID)
    apply(state, served(0, (("echo", "{}"),)), "gateway")
    assert adoption_problems(state) == [
        "llm-0: recorded by the gateway, not adopted (yet)",
        "tool-1: returned by the model, never proposed",
    ]


def test_request_digest_ignores_streaming_and_headers_but_not_messages() -> None:
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}
    assert request_digest(body) == request_digest({**body, "stream": True, "stream_options": {"include_usage": True}})
    assert request_digest(body) != request_digest({**body, "messages": [{"role": "user", "content": "ho"}]})
    assert request_digest(body) != request_digest({**body, "temperature": 0.5})


def test_reported_results_are_the_tool_messages_of_released_calls() -> None:
    call = GatewayToolCall("tool-1", "call_x", "echo", "{}")
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "tool", "tool_call_id": "call_x", "content": '{"ok": true}'},
        {"role": "tool", "tool_call_id": "call_unknown", "content": "?"},
    ]
    assert reported_tool_results(messages, [call]) == [(call, '{"ok": true}')]
    assert result_json('{"ok": true}') == '{"ok": true}' and result_json("plain words") == '"plain words"'
    assert "echo" in refusal_text(call, "not allowed") and "not allowed" in refusal_text(call, "not allowed")


def test_rate_limit_is_a_sliding_window_per_session_and_refusals_do_not_count() -> None:
    limiter = RateLimiter(max_requests=2, window_s=60)
    assert limiter.allow("a", 0.0) and limiter.allow("a", 10.0)
    assert not limiter.allow("a", 20.0) and limiter.allow("b", 20.0)
    assert limiter.retry_after_s("a", 20.0) == 40.0
    assert not limiter.allow("a", 59.0)
    assert limiter.allow("a", 60.5) and not limiter.allow("a", 61.0)


def test_an_ended_session_is_finished_after_its_last_call_once() -> None:
    state = SessionState(SID)
    apply(state, served(0, (("echo", '{"text": "a"}'),)), "gateway")
    apply(state, served(2), "gateway")
    ended = ev.GatewaySessionEnded(reason="no request for 301 s (idle timeout 300 s)", cause="idle", num_llm_calls=2)
    apply(state, ended, "gateway")
    assert state.gateway_ended == ended
    assert adoption_problems(state)[-1] == "ended by the gateway (idle), not finished (yet)"
    appends = adopt(state, TOOLS)
    assert [(type(a.body).__name__, a.key) for a in appends][-2:] == [
        ("LLMCallCompleted", "llm-2"),
        ("SessionFinished", ""),
    ]
    finished = appends[-1].body
    assert isinstance(finished, ev.SessionFinished) and appends[-1].kind == "finished"
    assert json.loads(finished.output_json) == {"ended": "idle", "reason": ended.reason}
    assert (finished.num_llm_calls, finished.num_tool_calls) == (2, 1)
    adopted(state)
    assert state.status is SessionStatus.FINISHED and state.finished
    assert adopt(state, TOOLS) == [] and adoption_problems(state) == [], "finished once"
    # A second end (a re-append after a crash under another id) changes nothing: the first stands.
    apply(state, ev.GatewaySessionEnded(reason="finished by the client", cause="client", num_llm_calls=2), "gateway")
    assert state.gateway_ended == ended and adopt(state, TOOLS) == []


def test_idle_sessions_are_those_without_a_request_for_the_timeout_and_none_in_flight() -> None:
    last_seen = {"a": 100.0, "b": 50.0, "c": 140.0, "d": 10.0}
    # d is busy (a held tool call keeps its request in flight): not idle however old.
    assert idle_sessions(last_seen, busy={"d"}, now=160.0, idle_timeout_s=60.0) == ["b", "a"]  # oldest first
    assert idle_sessions(last_seen, busy=(), now=160.0, idle_timeout_s=60.0) == ["d", "b", "a"]
    assert idle_sessions({"x": 100.0, "w": 100.0}, busy=(), now=160.0, idle_timeout_s=60.0) == ["w", "x"]
    assert idle_sessions(last_seen, busy=(), now=160.0, idle_timeout_s=0) == [], "0: never"
    assert idle_sessions(last_seen, busy=(), now=160.0, idle_timeout_s=-1) == []
    assert idle_sessions({}, busy=(), now=160.0, idle_timeout_s=60.0) == []


def test_forgettable_sessions_are_those_past_the_retention_and_none_in_flight() -> None:
    since = {"a": 100.0, "b": 50.0, "c": 140.0, "d": 10.0}  # when each ended (or was last seen)
    assert forgettable(since, busy={"d"}, now=160.0, retain_s=60.0) == ["b", "a"]  # oldest first
    assert forgettable(since, busy=(), now=160.0, retain_s=60.0) == ["d", "b", "a"]
    assert forgettable({"x": 100.0, "w": 100.0}, busy=(), now=160.0, retain_s=60.0) == ["w", "x"]
    assert forgettable(since, busy=(), now=160.0, retain_s=0) == ["d", "b", "a", "c"], "0: at once"
    assert forgettable(since, busy=(), now=160.0, retain_s=-1) == [], "below 0: never"


def test_adoption_copies_the_recorded_priority_onto_the_calls_start() -> None:
    """The gateway records the priority it gave the engine request; the planner's LLMCallStarted
    for that call carries it too (null both ways for a record without one)."""
    state = SessionState(SID)
    ranked = {"priority": 1_234, "priority_attained_ms": 5.0, "priority_age_ms": 9.0, "priority_warm": False}
    apply(state, served(0, **ranked), "gateway")
    apply(state, served(1), "gateway")
    started = [a.body for a in adopt(state, TOOLS) if isinstance(a.body, ev.LLMCallStarted)]
    assert [(s.priority, s.priority_attained_ms, s.priority_age_ms, s.priority_warm) for s in started] == [
        (1_234, 5.0, 9.0, False),
        (None, None, None, None),
    ]


def _claim(call_id: str, attempt: int, engine: str, reason: str, failed: str | None = None) -> ev.GatewayEngineRouted:
    route = Route(engine, reason, 10, "why")
    return route_claim(
        routed(
            call_id=call_id,
            request_id=f"{SID}/{call_id}",
            attempt=attempt,
            route=route,
            router="locality",
            prompt_tokens=20,
            cached={engine: 10},
            size=SizeChoice("large", "default"),
            failed_engine_id=failed,
            reason=reason,
        )
    )


def test_the_gateways_routes_are_adopted_as_engine_routed_before_the_calls_llm_call_started() -> None:
    state = SessionState(SID)
    # The gateway appends a call's routes with its record, routes first (a failover: two).
    apply(state, _claim("llm-0", 0, "sim-0", "least_loaded"), "gateway")
    apply(state, _claim("llm-0", 1, "sim-1", "failover", failed="sim-0"), "gateway")
    assert (state.status, state.program) == (SessionStatus.REQUESTED, GATEWAY_PROGRAM), "a route is a request too"
    assert adopt(state, TOOLS) == [], "nothing is adopted before the call's record"
    apply(state, served(0, engine_id="sim-1"), "gateway")
    appends = adopt(state, TOOLS)
    assert [(type(a.body).__name__, a.kind, a.key) for a in appends] == [
        ("SessionStarted", "start", ""),
        ("EngineRouted", "routed", "llm-0/0"),
        ("EngineRouted", "routed", "llm-0/1"),
        ("LLMCallStarted", "llm-started", "llm-0"),
        ("LLMCallCompleted", "llm-completed", "llm-0"),
    ]
    failover = appends[2].body
    assert isinstance(failover, ev.EngineRouted)
    assert (failover.engine_id, failover.reason, failover.failed_engine_id, failover.attempt) == (
        "sim-1",
        "failover",
        "sim-0",
        1,
    )
    assert failover.model_dump() == state.gateway_routes[("llm-0", 1)].model_dump(), "the same fields, copied"
    adopted(state)
    assert [r.engine_id for r in state.route_history] == ["sim-0", "sim-1"] and state.routes["llm-0"].attempt == 1
    assert adopt(state, TOOLS) == [], "adopting twice appends nothing"
    apply(state, _claim("llm-1", 0, "sim-1", "locality"), "gateway")
    apply(state, served(1, engine_id="sim-1"), "gateway")
    assert [(a.kind, a.key) for a in adopt(state, TOOLS)] == [
        ("routed", "llm-1/0"),
        ("llm-started", "llm-1"),
        ("llm-completed", "llm-1"),
    ]


def test_the_prefix_is_held_where_the_sessions_last_recorded_call_ran() -> None:
    assert locate_served([]) == Located({})
    calls = [served(2, engine_id="sim-0"), served(0, engine_id="sim-1", prompt_tokens=5, output_tokens=1)]
    assert last_served(calls) == calls[0] and context_of(calls[0]) == 13 and context_of(None) == 0
    assert locate_served(calls) == Located({"sim-0": 13}), "the latest step's engine, its prompt and output"


def test_a_gateway_sessions_prefix_follows_the_planners_rules_for_kv_events_and_decisions() -> None:
    calls = [served(0, prompt_tokens=300, output_tokens=20), served(2, prompt_tokens=400, output_tokens=8)]
    # The engine evicted part of it under pressure (its events include the last call): what it kept.
    kept = locate_served(calls, holdings={"sim-0": Holding(240, "llm-2")})
    assert kept == Located({"sim-0": 240}, ("kv.events: sim-0 kept 240 of its 408 context tokens",))
    # Evicted all of it: nothing held anywhere, said so.
    gone = locate_served(calls, holdings={"sim-0": Holding(0, "llm-2")})
    assert gone == Located({}, ("kv.events: sim-0 kept 0 of its 408 context tokens",))
    # The engine's events of the last call are not in yet: the records' belief stands.
    assert locate_served(calls, holdings={"sim-0": Holding(96, "llm-0")}).cached == {"sim-0": 408}
    # Another engine still holds an older prefix; the cache manager discarded it on the last one.
    moved = locate_served(calls, dropped=["sim-0"], holdings={"sim-1": Holding(160, "llm-0")})
    assert moved.cached == {"sim-1": 160}
    assert moved.notes == ("kv.events: sim-1 still holds 160 tokens of its context", "kv.decisions: discarded on sim-0")
    # Exactly what the planner's locate says of the same last call (one set of rules).
    holdings = {"sim-0": Holding(240, "llm-2"), "sim-1": Holding(160, "llm-0")}
    assert locate_served(calls, ["sim-1"], holdings) == locate_context("llm-2", "sim-0", 408, ["sim-1"], holdings)


def test_a_prompt_is_estimated_and_never_smaller_than_the_context_held() -> None:
    messages = [{"role": "user", "content": "x" * 400}]
    assert prompt_estimate(messages, 0) == 101  # ["xxx..."]: 404 characters / 4, rounded up
    assert prompt_estimate(messages, 500) == 500


def test_the_size_is_the_one_of_the_engines_serving_the_clients_model_else_large() -> None:
    served_by = {"tiny": {"small"}, "big": {"large"}, "mixed": {"small", "large"}}
    assert size_for_model("tiny", served_by, ["small", "large"]) == SizeChoice(
        "small", "the client asked for tiny, served by small engines"
    )
    assert size_for_model("sim", served_by, ["small", "large"]) == SizeChoice("large", "default")
    assert size_for_model("mixed", served_by, ["small"]) == SizeChoice("small", "default")
