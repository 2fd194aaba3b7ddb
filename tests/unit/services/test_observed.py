"""services.observed: the fold behind /metrics gives exact counts and ages."""

from __future__ import annotations

import pytest

from schemas import events as ev
from services.observed import Observed

pytestmark = pytest.mark.unit


def proposed(call: str) -> ev.ToolCallProposed:
    return ev.ToolCallProposed(
        call_id=call, tool="payment", arguments_json="{}", effect_class=ev.EffectClass.IRREVERSIBLE,
        idempotency_key=f"k-{call}",
    )  # fmt: skip


def completed_llm(prompt: int, cached: int) -> ev.LLMCallCompleted:
    return ev.LLMCallCompleted(
        call_id="llm-0", engine_id="sim-0", prompt_tokens=prompt, cached_tokens=cached, output_tokens=4,
        output_text="", finish_reason="length", queue_ms=5.0, prefill_ms=20.0, decode_ms=40.0,
    )  # fmt: skip


def test_sessions_keep_their_latest_status_and_a_late_request_does_not_move_them_back() -> None:
    o = Observed()
    o.observe("agent.actions", "a", ev.SessionStarted(program="script", args_json="{}"), 1.0)
    o.observe("ops.commands", "a", ev.SessionRequested(program="script", args_json="{}", author="me"), 0.5)
    o.observe("ops.commands", "b", ev.SessionRequested(program="script", args_json="{}", author="me"), 2.0)
    o.observe("agent.actions", "c", ev.SessionStarted(program="script", args_json="{}"), 2.0)
    o.observe("agent.actions", "c", ev.SessionFinished(output_json="{}", num_llm_calls=0, num_tool_calls=0), 3.0)
    assert o.sessions_by_status() == {"running": 1, "requested": 1, "finished": 1}


def test_llm_tokens_hit_rate_and_engine_time() -> None:
    o = Observed()
    assert o.hit_rate() == 0.0
    o.observe("agent.actions", "a", completed_llm(100, 0), 1.0)
    o.observe("agent.actions", "a", completed_llm(300, 200), 2.0)
    assert (o.llm_calls, o.prompt_tokens, o.cached_tokens) == (2, 400, 200)
    assert o.hit_rate() == 0.5
    assert o.engine_ms == {"queue": 10.0, "prefill": 40.0, "decode": 80.0}


def test_calls_wait_for_a_verdict_until_committed_and_in_doubt_until_resolved() -> None:
    o = Observed()
    o.observe("agent.actions", "a", proposed("tool-1"), 10.0)
    o.observe("agent.actions", "b", proposed("tool-1"), 12.0)
    assert o.awaiting_verdict(now=15.0) == (2, 5.0)
    o.observe("agent.verdicts", "a", ev.ToolCallCommitted(call_id="tool-1", votes=[], policy="unanimous"), 16.0)
    assert o.awaiting_verdict(now=20.0) == (1, 8.0)
    o.observe("agent.effects", "a", ev.ToolCallInDoubt(
        call_id="tool-1", tool="payment", effect_class=ev.EffectClass.IRREVERSIBLE, reason="crash"), 30.0)  # fmt: skip
    assert o.in_doubt(now=40.0) == (1, 10.0)
    o.observe("ops.commands", "a", ev.ApprovalGiven(
        call_id="tool-1", decision=ev.ApprovalDecision.APPROVE, author="me", reason=""), 41.0)  # fmt: skip
    assert o.in_doubt(now=42.0) == (1, 12.0), "an approval does not resolve an in-doubt call"
    o.observe("ops.commands", "a", ev.ApprovalGiven(
        call_id="tool-1", decision=ev.ApprovalDecision.MARK_DONE, author="me", reason=""), 43.0)  # fmt: skip
    assert o.in_doubt(now=44.0) == (0, 0.0)
    assert o.tool_calls == {"committed": 1, "in_doubt": 1}


def test_pins_count_until_their_ttl_or_a_later_decision() -> None:
    o = Observed()

    def decide(session: str, action: ev.CacheAction, blocks: int, ttl_ms: int | None, at: float) -> None:
        body = ev.CacheDecisionMade(
            engine_id="sim-0", action=action, ttl_ms=ttl_ms, score=1.0, num_blocks=blocks, reason="test"
        )  # fmt: skip
        o.observe("kv.decisions", session, body, at)

    decide("a", ev.CacheAction.PRESERVE, 10, 5_000, 0.0)
    decide("b", ev.CacheAction.PREFETCH, 4, 20_000, 1.0)
    assert o.blocks_pinned(now=2.0) == 14
    assert o.blocks_pinned(now=6.0) == 4  # a's TTL ended
    decide("b", ev.CacheAction.RELEASE, 4, None, 7.0)
    assert o.blocks_pinned(now=8.0) == 0
    assert o.cache_decisions == {"PRESERVE": 1, "PREFETCH": 1, "RELEASE": 1}


def test_observe_at_folds_what_observe_folds_with_the_envelope_time() -> None:
    from datetime import UTC, datetime

    a, b = Observed(), Observed()
    proposed = ev.ToolCallProposed(
        call_id="t-1",
        tool="payment",
        arguments_json="{}",
        effect_class=ev.EffectClass.IRREVERSIBLE,
        idempotency_key="k",
    )
    a.observe("agent.actions", "s", proposed, 100.0)
    b.observe_at("agent.actions", "s", proposed, datetime.fromtimestamp(100.0, UTC))
    b.observe_at(
        "kv.events", "s", ev.KVBlocksRemoved(engine_id="e", block_hashes=["ab"], tier=ev.KVTier.GPU), datetime.now(UTC)
    )
    assert a == b and a.awaiting_verdict(160.0) == (1, 60.0)
