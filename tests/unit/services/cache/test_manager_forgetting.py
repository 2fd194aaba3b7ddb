"""The cache manager forgets finished sessions that hold nothing, and their late events stay harmless."""

from __future__ import annotations

import pytest

from schemas import events as ev
from schemas.events import CacheAction, KVTier, SessionId
from services.cache.manager import CacheManager, Hold, ManagerConfig
from tests.unit.services.cache.test_manager import Feed, actions

pytestmark = pytest.mark.unit

FINISHED = ev.SessionFinished(output_json="{}", num_llm_calls=1, num_tool_calls=1)


def stored(hashes: list[str], tier: KVTier = KVTier.GPU) -> ev.KVBlocksStored:
    return ev.KVBlocksStored(engine_id="e", block_hashes=hashes, num_tokens=16 * len(hashes), block_size=16, tier=tier)


def removed(hashes: list[str], tier: KVTier = KVTier.GPU) -> ev.KVBlocksRemoved:
    return ev.KVBlocksRemoved(engine_id="e", block_hashes=hashes, tier=tier)


def sizes(manager: CacheManager) -> tuple[int, int]:
    return manager.num_sessions, len(manager.builder)


@pytest.mark.parametrize("with_kv_events", [False, True])
def test_only_live_sessions_are_kept_after_many_finished_ones(with_kv_events: bool) -> None:
    feed = Feed(gpu=100_000)
    live = [f"live{i}" for i in range(5)]
    for i, sid in enumerate(live):
        feed.pinned(sid, i * 0.01, 100)
    at = 1.0
    for n in range(300):
        sid = f"s{n}"
        hashes = [f"{sid}/{b}" for b in range(8)]
        feed.turn(sid, at, 100)
        if with_kv_events:
            feed.send(sid, stored(hashes), at + 0.1)
        gaps = [d for d in feed.propose(sid, at + 0.2) if d.kind == "gap"]  # TTL ends of the live ones too
        assert [(d.session_id, d.decision.action) for d in gaps] == [(sid, CacheAction.PRESERVE)]
        assert (sid, CacheAction.DISCARD, "end") in actions(feed.send(sid, FINISHED, at + 0.3))
        if with_kv_events:
            assert feed.manager.num_sessions == len(live) + 1  # its blocks are still reported held
            feed.send(sid, removed(hashes), at + 0.4)  # the engine carries out the DISCARD
        at += 0.5
    assert sizes(feed.manager) == (len(live), len(live))
    assert feed.manager.num_forgotten == 300
    assert feed.manager.gpu_used == sum(feed.manager.view(SessionId(s)).gpu_blocks for s in live)
    assert feed.manager.hold(SessionId("s7")) is Hold.DISCARDED  # a forgotten session reads as discarded
    assert all(feed.manager.hold(SessionId(s)) is not Hold.DISCARDED for s in live)


def test_late_events_of_a_forgotten_session_do_not_bring_it_back() -> None:
    feed = Feed(gpu=1000)
    feed.pinned("a", 0.0, 304)
    feed.send("a", FINISHED, 1.0)
    assert feed.manager.forgotten(SessionId("a")) and sizes(feed.manager) == (0, 0)
    late = [
        removed(["x"]),  # the engine removing what it no longer reports held
        ev.KVCacheHit(engine_id="e", call_id="c", cached_tokens=0, prompt_tokens=304, tier=KVTier.GPU),
        ev.ToolCallStarted(call_id="t9", tool="search", idempotency_key="k", attempt=1),
        ev.ToolCallCompleted(call_id="t9", result_json="{}", result_tokens=5, duration_ms=10.0),
        ev.CheckpointTaken(checkpoint_id="x", cut={}, state_digest="d", effects=[], num_events=3),
    ]
    for i, body in enumerate(late):
        assert feed.send("a", body, 1.1 + i) == []
    assert sizes(feed.manager) == (0, 0)
    assert (feed.manager.gpu_used, feed.manager.host_used) == (0, 0)
    assert feed.manager.hold(SessionId("a")) is Hold.DISCARDED


def test_a_late_host_store_is_charged_until_removed_then_forgotten_again() -> None:
    feed = Feed(gpu=1000, host=100)
    feed.send("a", stored(["g0", "g1"]), 0.0)
    feed.turn("a", 0.1, 16)
    feed.send("a", FINISHED, 0.5)
    feed.send("a", removed(["g0", "g1"]), 0.6)  # the GPU copy goes first ...
    assert feed.manager.forgotten(SessionId("a"))
    feed.send("a", stored(["h0", "h1", "h2"], KVTier.CPU), 0.7)  # ... the host copy is reported after
    assert feed.manager.host_used == 3
    assert feed.manager.hold(SessionId("a")) is Hold.DISCARDED
    assert feed.manager.view(SessionId("a")).phase.value == "finished"
    assert sizes(feed.manager) == (1, 1)
    feed.send("a", removed(["h0", "h1", "h2"], KVTier.CPU), 0.8)
    assert feed.manager.host_used == 0 and sizes(feed.manager) == (0, 0)
    assert feed.manager.num_forgotten == 2


def test_a_session_with_a_tool_running_is_kept_until_the_tool_ends() -> None:
    feed = Feed(gpu=1000)
    feed.turn("a", 0.0, 16)
    feed.propose("a", 0.2, tool="slow")
    feed.send("a", ev.ToolCallStarted(call_id="t0.2", tool="slow", idempotency_key="k", attempt=1), 0.3)
    feed.send("a", ev.SessionFailed(reason="cancelled", error_type="Cancelled"), 0.4)
    assert not feed.manager.forgotten(SessionId("a"))
    before = feed.manager.policy.latency.num_samples("slow")
    feed.send("a", ev.ToolCallCompleted(call_id="t0.2", result_json="{}", result_tokens=1, duration_ms=7000.0), 7.3)
    assert feed.manager.policy.latency.num_samples("slow") == before + 1  # its duration still teaches the model
    assert feed.manager.forgotten(SessionId("a")) and sizes(feed.manager) == (0, 0)


def test_stale_pins_of_forgotten_sessions_are_skipped_by_pressure_and_ttl_ends() -> None:
    feed = Feed(gpu=40)
    feed.pinned("a", 0.0, 304)  # 20 blocks, TTL ends at 10.2
    feed.send("a", FINISHED, 1.0)
    assert feed.manager.forgotten(SessionId("a"))
    feed.pinned("b", 2.0, 304)
    decided = feed.llm("c", 3.0, 400)  # over-commits: only b is a live pin
    assert [(d.session_id, d.kind) for d in decided] == [("b", "pressure")]
    assert feed.llm("d", 20.0, 10) == []  # a's TTL end passes: its entry is stale, nothing is decided


def test_a_forgotten_session_running_again_starts_afresh() -> None:
    feed = Feed(gpu=1000)
    feed.pinned("a", 0.0, 304)
    feed.send("a", FINISHED, 1.0)
    assert feed.manager.forgotten(SessionId("a"))
    feed.turn("a", 2.0, 304)  # e.g. rewound by a restore
    assert not feed.manager.forgotten(SessionId("a"))
    assert feed.manager.view(SessionId("a")).turns == 1
    (gap,) = feed.propose("a", 2.5)
    assert gap.decision.action is CacheAction.PRESERVE


def test_tombstones_are_dropped_after_forget_after_s() -> None:
    manager = CacheManager(ManagerConfig(gpu_total_blocks=100, forget_after_s=60.0))
    for i in range(10):
        manager.apply(f"f{i}", SessionId(f"s{i}"), FINISHED, float(i))
    assert manager.num_forgotten == 10 and len(manager._forgotten) == 10
    manager.apply("new", SessionId("n"), FINISHED, 65.5)  # an unknown session's event prunes old tombstones
    assert sorted(manager._forgotten) == ["n", "s6", "s7", "s8", "s9"]


def test_adopting_a_release_of_a_forgotten_session_keeps_it_forgotten() -> None:
    feed = Feed(gpu=1000)
    feed.pinned("a", 0.0, 304)
    (end,) = feed.send("a", FINISHED, 1.0)
    feed.manager.adopt(end)  # a restarted worker adopting the logged DISCARD (or a RELEASE) of that end
    assert feed.manager.forgotten(SessionId("a")) and sizes(feed.manager) == (0, 0)
