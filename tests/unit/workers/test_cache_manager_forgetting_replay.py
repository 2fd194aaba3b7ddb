"""A restarted worker re-folds a log in which sessions finished and were forgotten, late
events included, and re-decides exactly what the first run decided: nothing is appended
twice, nothing diverges, and the same sessions are forgotten."""

from __future__ import annotations

import pytest

from log import LoggedEvent, Position
from schemas import events as ev
from schemas.events import CacheAction, KVTier
from tests.unit.services.helpers import envelope
from tests.unit.workers.test_cache_manager_replay import decision, gap, worker

pytestmark = pytest.mark.unit

ACTIONS, KV = "agent.actions", "kv.events"


def log_of_finished_sessions(n: int) -> list[LoggedEvent]:
    """``n`` sessions, each: a gap, its blocks stored, its end, its blocks removed (the
    engine carrying out the DISCARD), then a late removal of the same blocks."""
    events: list[LoggedEvent] = []
    kv_offset = 0
    for i in range(n):
        sid, at = f"s{i}", 2.0 * i
        events += gap(sid, 4 * i, at)
        hashes = [f"{sid}/{b}" for b in range(3)]
        finished = ev.SessionFinished(output_json="{}", num_llm_calls=1, num_tool_calls=1)
        kv: list[tuple[ev.Event, float]] = [
            (
                ev.KVBlocksStored(engine_id="e", block_hashes=hashes, num_tokens=48, block_size=16, tier=KVTier.GPU),
                0.25,
            ),
            (ev.KVBlocksRemoved(engine_id="e", block_hashes=hashes, tier=KVTier.GPU), 0.6),
            (ev.KVBlocksRemoved(engine_id="e", block_hashes=hashes, tier=KVTier.GPU), 0.7),
        ]
        events.append(LoggedEvent(Position(ACTIONS, 0, 4 * i + 3), envelope(finished, session=sid, at_s=at + 0.5)))
        for body, dt in kv:
            events.append(LoggedEvent(Position(KV, 0, kv_offset), envelope(body, session=sid, at_s=at + dt)))
            kv_offset += 1
    return events


def test_a_replay_of_forgotten_sessions_decides_the_same_and_appends_nothing() -> None:
    events = log_of_finished_sessions(20)
    first = worker()
    drafts, _ = first.process(events, received=0.0)
    assert [decision(d).action for d in drafts].count(CacheAction.DISCARD) == 20
    assert (first.manager.num_sessions, first.manager.num_forgotten) == (0, 20)

    second = worker()
    second._boundary = {(ACTIONS, 0): 80, (KV, 0): 60}
    second._logged = {str(d.event_id): decision(d) for d in drafts}
    assert second.process(events, received=0.0)[0] == []
    assert second._flush_pending() == []
    stats = second.stats
    assert (stats.num_replayed, stats.num_diverged, stats.num_recovered, stats.num_adopted) == (len(drafts), 0, 0, 0)
    assert (second.manager.num_sessions, second.manager.num_forgotten) == (0, 20)
