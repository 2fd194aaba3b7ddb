"""What the console shows, derived from read-model rows (services/console_views.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from services import console_views as views

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)
Row = dict[str, Any]


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_session_status_follows_the_columns_set() -> None:
    assert views.session_status({}) == "requested"
    assert views.session_status({"started_at": T0}) == "running"
    assert views.session_status({"started_at": T0, "cancel_requested_at": T0}) == "cancelling"
    assert views.session_status({"started_at": T0, "finished_at": T0, "cancel_requested_at": T0}) == "finished"
    assert views.session_status({"finished_at": T0, "failed_at": T0}) == "failed"


def test_tool_status() -> None:
    assert views.tool_status({"proposed_at": T0}) == "awaiting verdict"
    assert views.tool_status({"verdict": "committed"}) == "committed"
    assert views.tool_status({"verdict": "aborted"}) == "aborted"
    assert views.tool_status({"verdict": "committed", "first_started_at": T0}) == "running"
    assert views.tool_status({"first_started_at": T0, "in_doubt_at": T0}) == "in doubt"
    assert views.tool_status({"in_doubt_at": T0, "completed_at": T0}) == "completed"
    assert views.tool_status({"failed_at": T0}) == "failed"


def test_summary_counts_computed_and_cached_tokens_and_job_time() -> None:
    row = {"session_id": "s", "requested_program": "trace", "requested_at": at(0), "started_at": at(1),
           "finished_at": at(9), "turns": 3, "num_tools": 2, "prompt_tokens": 1000, "cached_tokens": 600}  # fmt: skip
    s = views.summarize(row, at(100))
    assert (s.program, s.status, s.turns, s.num_tool_calls) == ("trace", "finished", 3, 2)
    assert (s.job_s, s.computed_tokens, s.cached_tokens) == (9.0, 400, 600)
    running = views.summarize({"session_id": "r", "started_at": at(0)}, at(5))
    assert running.job_s == 5.0 and running.computed_tokens == 0 and running.program == ""


@pytest.mark.parametrize("text", ["s-1", "run-abc.0001", "a:b@c+d", "x" * 200])
def test_valid_ids(text: str) -> None:
    assert views.valid_id(text)


@pytest.mark.parametrize("text", [None, "", "-x", "a b", "../etc", "a/b", "<script>", "x" * 201, "é"])
def test_malformed_ids(text: str | None) -> None:
    assert not views.valid_id(text)


def _llm(call: str, turn: int, start: float, end: float | None, cached: int = 0) -> dict[str, Any]:
    done = at(end) if end is not None else None
    return {"call_id": call, "turn": turn, "started_at": at(start), "completed_at": done,
            "prompt_tokens": 100, "cached_tokens": cached}  # fmt: skip


def test_timeline_orders_calls_finds_the_gaps_and_cuts_ttls_at_the_end() -> None:
    llm = [_llm("llm-2", 1, 3.0, 4.0, 80), _llm("llm-0", 0, 0.0, 1.0)]
    tools = [{"call_id": "tool-1", "tool": "search", "proposed_at": at(1.0), "verdict": "committed",
              "verdict_policy": "unanimous", "completed_at": at(2.5)}]  # fmt: skip
    votes = [{"call_id": "tool-1", "voter": "allow_list", "decision": "APPROVE", "reason": "ok"}]
    approvals = [{"event_id": "a1", "call_id": "tool-1", "decision": "APPROVE", "author": "ops", "at": at(1.5)}]
    kv = [{"event_id": "k1", "action": "PRESERVE", "ttl_ms": 60_000, "at": at(1.0), "engine_id": "sim-0",
           "num_blocks": 4, "reason": "gap"}]  # fmt: skip
    t = views.timeline({"requested_at": at(0)}, llm, tools, votes, approvals, kv, at(10))
    lanes = {lane: [b for b in t.bars if b.lane == lane] for lane in ("llm", "gap", "tool", "approval", "kv")}
    assert [b.ref for b in lanes["llm"]] == ["llm-0", "llm-2"]
    assert [(b.start_ms, b.end_ms) for b in lanes["gap"]] == [(1000.0, 3000.0)]
    assert "allow_list: APPROVE (ok)" in lanes["tool"][0].detail and lanes["tool"][0].end_ms == 2500.0
    assert lanes["approval"][0].start_ms == 1500.0
    assert t.span_ms == 4000.0 and lanes["kv"][0].end_ms == 4000.0, "a TTL past the end is cut at it"
    assert [(x.call_id, x.cached_tokens) for x in t.turns] == [("llm-0", 0), ("llm-2", 80)]
    running = views.timeline(None, [_llm("llm-0", 0, 0.0, None)], [], [], [], [], at(2))
    assert running.bars[0].end_ms == 2000.0, "a call still running lasts until now"
    assert views.timeline(None, [], [], [], [], [], at(0)).bars == []


def test_waiting_lists_held_and_in_doubt_calls_until_answered() -> None:
    sessions = {"s": {"started_at": at(0)}, "done": {"started_at": at(0), "finished_at": at(1)}}
    tools = [
        {"session_id": "s", "call_id": "tool-1", "tool": "payment", "proposed_at": at(1)},
        {"session_id": "s", "call_id": "tool-2", "tool": "payment", "proposed_at": at(2), "verdict": "committed",
         "first_started_at": at(3), "in_doubt_at": at(4)},
        {"session_id": "s", "call_id": "tool-3", "proposed_at": at(2), "verdict": "committed"},
        {"session_id": "done", "call_id": "tool-1", "proposed_at": at(1)},
        {"session_id": "ghost", "call_id": "tool-1", "proposed_at": at(1)},
    ]  # fmt: skip
    found = views.waiting(tools, [], sessions)
    assert [(w.call_id, w.kind, w.actions) for w in found] == [
        ("tool-1", "approval", ("APPROVE", "DENY")),
        ("tool-2", "in doubt", ("RETRY", "MARK_DONE")),
    ]
    old = {"session_id": "s", "call_id": "tool-2", "decision": "RETRY", "at": at(3.5)}  # answered an earlier doubt
    answers = [{"session_id": "s", "call_id": "tool-1", "decision": "APPROVE", "at": at(5)}, old]
    assert [w.call_id for w in views.waiting(tools, answers, sessions)] == ["tool-2"]
    answers.append({"session_id": "s", "call_id": "tool-2", "decision": "MARK_DONE", "at": at(6)})
    assert views.waiting(tools, answers, sessions) == []


def test_fork_tree_from_the_root_with_checkpoints_and_merges() -> None:
    forks = [
        {"session_id": "b1", "parent_session_id": "root", "checkpoint_id": "c1", "at": at(1)},
        {"session_id": "b2", "parent_session_id": "root", "checkpoint_id": "c1", "at": at(2)},
        {"session_id": "b1x", "parent_session_id": "b1", "checkpoint_id": "c2", "at": at(3)},
        {"session_id": "loop", "parent_session_id": "loop", "checkpoint_id": "c", "at": at(4)},
    ]
    checkpoints = [{"session_id": "root", "checkpoint_id": "c1", "taken_at": at(0)}]
    merges = [{"session_id": "root", "outcome": "applied", "branch_session_ids": '["b1"]'}]
    tree = views.fork_tree("b1x", forks, checkpoints, merges)
    assert tree.session_id == "root" and tree.checkpoints == ["c1"] and tree.merges == ['applied: ["b1"]']
    assert [c.session_id for c in tree.children] == ["b1", "b2"]
    assert tree.children[0].children[0].session_id == "b1x" and tree.children[0].children[0].checkpoint_id == "c2"
    assert views.fork_tree("loop", forks, [], []).session_id == "loop", "a cycle in bad data does not loop forever"


def test_cache_view_pins_the_latest_keeping_decision_until_its_ttl() -> None:
    def decision(event: str, session: str, engine: str, action: str, ttl: int | None, blocks: int, t: float) -> Row:
        return {"event_id": event, "session_id": session, "engine_id": engine, "action": action, "ttl_ms": ttl,
                "num_blocks": blocks, "at": at(t)}  # fmt: skip

    d = [
        decision("1", "a", "e0", "PRESERVE", 10_000, 4, 0),
        decision("2", "b", "e0", "PRESERVE", 1_000, 2, 0),
        decision("3", "c", "e1", "PRESERVE", None, 8, 0),
        decision("4", "c", "e1", "DISCARD", None, 8, 3),
        decision("5", "d", "e1", "PREFETCH", None, 3, 4),
    ]
    view = views.cache_view(d, [{"cached_tokens": 30, "prompt_tokens": 100}], at(5), num_buckets=4)
    assert [(p.session_id, p.num_blocks) for p in view.pinned] == [("a", 4), ("d", 3)]
    assert view.blocks_by_engine == {"e0": 4, "e1": 3}
    assert [sum(c.values()) for _, c in view.buckets] == [3, 0, 0, 2] and view.buckets[3][1] == {
        "DISCARD": 1,
        "PREFETCH": 1,
    }
    assert (view.hit_tokens, view.prompt_tokens) == (30, 100)
    assert views.cache_view([], [], at(0)).buckets == []
