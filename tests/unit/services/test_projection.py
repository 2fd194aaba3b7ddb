"""The projector's rows: the same read model whatever order the topics interleave in."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import BaseModel

from log.topics import topic_of
from schemas import events as ev
from services.projection import KEYS, TABLES, Merge, Upsert, rows
from tests.unit.services.analysis_samples import workload

Model = dict[str, dict[tuple[Any, ...], dict[str, Any]]]


def _apply(model: Model, u: Upsert) -> None:
    """What the projector's INSERT ... ON CONFLICT does, on dicts."""
    assert set(u.key) == set(KEYS[u.table]) and set(u.values) <= set(TABLES[u.table])
    row = model.setdefault(u.table, {}).setdefault(tuple(u.key.values()), {})
    for column, value in u.values.items():
        old = row.get(column)
        if u.merge.get(column, Merge.FIRST) is Merge.MAX:
            row[column] = value if old is None else max(old, value)
        elif old is None:
            row[column] = value


def _events() -> list[tuple[str, str, BaseModel, datetime]]:
    base = datetime(2026, 1, 1, tzinfo=UTC)
    extra: list[tuple[str, str, BaseModel, float]] = [
        ("a", "v1", ev.ToolCallCommitted(call_id="tool-1", policy="unanimous", votes=[
            ev.Vote(voter="allow_list", decision=ev.VoteDecision.APPROVE, reason="ok")]), 1.5),
        ("a", "s1", ev.ToolCallStarted(call_id="tool-1", tool="search", idempotency_key="k", attempt=1), 2.0),
        ("a", "s2", ev.ToolCallStarted(call_id="tool-1", tool="search", idempotency_key="k", attempt=2), 3.0),
        ("a", "d1", ev.CacheDecisionMade(engine_id="e", action=ev.CacheAction.SWAP, score=0.1, num_blocks=2,
                                         reason="long gap"), 1.2),
    ]  # fmt: skip
    return [(s, i, body, base + timedelta(seconds=at)) for s, i, body, at in [*workload(), *extra]]


def _project(events: list[tuple[str, str, BaseModel, datetime]]) -> Model:
    model: Model = {}
    for session_id, event_id, body, at in events:
        for u in rows(session_id, event_id, body, at):
            _apply(model, u)
    return model


def _interleave(events: list[tuple[str, str, BaseModel, datetime]], seed: int) -> list[Any]:
    """A random merge of the per-topic sequences, each kept in its own order (as a consumer reads)."""
    by_topic: dict[str, list[Any]] = {}
    for e in events:
        by_topic.setdefault(topic_of(e[2]).name, []).append(e)
    rng, out = random.Random(seed), []
    while any(by_topic.values()):
        out.append(by_topic[rng.choice([t for t, q in by_topic.items() if q])].pop(0))
    return out


def test_every_interleaving_of_the_topics_gives_the_same_model() -> None:
    events = _events()
    expected = _project(events)
    for seed in range(20):
        assert _project(_interleave(events, seed)) == expected


def test_projecting_twice_changes_nothing_and_the_rows_are_the_logs() -> None:
    events = _events()
    model = _project(events)
    assert _project(events + events) == model
    call = model["tool_calls"][("a", "tool-1")]
    assert (call["tool"], call["verdict"], call["attempts"]) == ("search", "committed", 2)
    assert model["votes"][("a", "tool-1", "allow_list")]["decision"] == "APPROVE"
    assert model["sessions"][("a",)]["program"] == "trace" and model["sessions"][("b",)]["num_llm_calls"] == 2
    assert model["kv_decisions"][("d1",)]["action"] == "SWAP"
    assert len(model["llm_calls"]) == 4


def test_events_the_model_does_not_hold_write_nothing() -> None:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    stored = ev.KVBlocksStored(engine_id="e", block_hashes=["aa"], num_tokens=16, block_size=16, tier=ev.KVTier.GPU)
    assert rows("s", "x", stored, at) == []
