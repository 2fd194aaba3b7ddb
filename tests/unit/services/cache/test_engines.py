"""One cache manager, several engines: memory per engine, decisions that name their engine."""

from __future__ import annotations

import itertools

import pytest

from schemas import events as ev
from schemas.events import CacheAction, KVTier, SessionId
from services.cache.engines import EngineCacheManagers
from services.cache.manager import CacheManager, Decided, Hold, ManagerConfig, decision_event_id

pytestmark = pytest.mark.unit


class Feed:
    def __init__(self, engines: tuple[str, ...] = ("e0", "e1"), *, gpu: int = 100) -> None:
        configs = [ManagerConfig(gpu_total_blocks=gpu, engine_id=e, headroom_blocks=0) for e in engines]
        self.managers = EngineCacheManagers(configs)
        self.ids = itertools.count()
        self.last_id = ""

    def send(self, sid: str, body: ev.Event, at: float) -> list[Decided]:
        self.last_id = f"x{next(self.ids)}"
        return self.managers.apply(self.last_id, SessionId(sid), body, at)

    def turn(self, sid: str, engine: str, at: float, prompt: int, *, call: str = "c", completed_on: str = "") -> list:
        started = ev.LLMCallStarted(
            call_id=call, turn=0, engine_id=engine, prompt_tokens=prompt, max_output_tokens=16, prompt_digest="d"
        )
        completed = ev.LLMCallCompleted(
            call_id=call, engine_id=completed_on or engine, prompt_tokens=prompt, cached_tokens=0, output_tokens=16,
            output_text="", finish_reason="stop", queue_ms=0, prefill_ms=1, decode_ms=1,
        )  # fmt: skip
        return self.send(sid, started, at) + self.send(sid, completed, at + 0.1)

    def propose(self, sid: str, at: float) -> list[Decided]:
        proposed = ev.ToolCallProposed(
            call_id=f"t{at}", tool="search", arguments_json="{}", effect_class=ev.EffectClass.PURE, idempotency_key="k"
        )
        return self.send(sid, proposed, at)

    def mgr(self, engine: str) -> CacheManager:
        return self.managers.manager(engine)


def test_each_engine_has_its_own_memory_and_the_gap_decision_names_the_engine_of_the_call() -> None:
    feed = Feed()
    assert feed.turn("a", "e0", 0.0, 304) == [] and feed.turn("b", "e1", 0.0, 144) == []
    (da,) = feed.propose("a", 0.2)
    (db,) = feed.propose("b", 0.2)
    assert (da.engine_id, da.decision.action, db.engine_id, db.decision.action) == (
        "e0",
        CacheAction.PRESERVE,
        "e1",
        CacheAction.PRESERVE,
    )
    assert da.to_event(da.engine_id).engine_id == "e0"
    assert (feed.mgr("e0").gpu_used, feed.mgr("e1").gpu_used) == (20, 10)
    assert feed.mgr("e1").hold(SessionId("a")) is Hold.NONE  # e1 never saw a


def test_kv_events_count_on_the_engine_they_name() -> None:
    feed = Feed()
    stored = ev.KVBlocksStored(engine_id="e1", block_hashes=["h1", "h2"], num_tokens=32, block_size=16, tier=KVTier.GPU)
    feed.send("a", stored, 0.0)
    assert feed.mgr("e1").view(SessionId("a")).gpu_blocks == 2
    assert feed.mgr("e0").view(SessionId("a")).gpu_blocks == 0


def test_a_session_that_moves_discards_its_blocks_on_the_engine_it_left() -> None:
    feed = Feed()
    feed.turn("a", "e0", 0.0, 304)
    (pin,) = feed.propose("a", 0.2)
    assert pin.engine_id == "e0" and feed.mgr("e0").gpu_used == 20
    out = feed.turn("a", "e1", 1.0, 400)
    (moved,) = [d for d in out if d.engine_id == "e0"]
    assert moved.decision.action is CacheAction.DISCARD and moved.decision.reason.startswith("moved to e1")
    assert moved.event_id == decision_event_id(moved.trigger_id, "end", "a")
    assert feed.mgr("e0").gpu_used == 0 and feed.managers.engine_of(SessionId("a")) == "e1"
    assert feed.managers.num_moves == 1
    (gap,) = feed.propose("a", 1.3)
    assert gap.engine_id == "e1" and gap.decision.action is CacheAction.PRESERVE


def test_a_failover_moves_the_session_by_its_completion() -> None:
    feed = Feed()
    feed.turn("a", "e0", 0.0, 304)
    feed.propose("a", 0.2)
    out = feed.turn("a", "e0", 1.0, 400, call="c2", completed_on="e1")  # started on e0, answered by e1
    # Nothing to tell e0 (the call was in flight there: no decision for an active session), but its
    # memory there is free again and the session's next gap is e1's.
    assert out == [] and feed.managers.engine_of(SessionId("a")) == "e1"
    assert feed.mgr("e0").gpu_used == 0 and feed.mgr("e0").hold(SessionId("a")) is Hold.DISCARDED
    (gap,) = feed.propose("a", 1.3)
    assert gap.engine_id == "e1"


def test_ttl_ends_fire_on_an_engine_that_gets_no_events() -> None:
    feed = Feed()
    feed.turn("a", "e0", 0.0, 304)
    (pin,) = feed.propose("a", 0.2)
    assert pin.decision.ttl_s is not None
    later = 0.2 + pin.decision.ttl_s + 1
    out = feed.turn("b", "e1", later, 64)  # only e1's events from here on
    assert [(d.engine_id, d.kind, d.session_id) for d in out] == [("e0", "ttl", "a")]


def test_one_engine_behaves_as_the_plain_manager_whatever_id_events_name() -> None:
    one = Feed(("sim-0",))
    plain = CacheManager(ManagerConfig(gpu_total_blocks=100, headroom_blocks=0))
    started = ev.LLMCallStarted(
        call_id="c", turn=0, engine_id="other", prompt_tokens=304, max_output_tokens=16, prompt_digest="d"
    )
    proposed = ev.ToolCallProposed(
        call_id="t", tool="search", arguments_json="{}", effect_class=ev.EffectClass.PURE, idempotency_key="k"
    )
    for i, (body, at) in enumerate([(started, 0.0), (proposed, 0.2)]):
        assert one.managers.apply(f"x{i}", SessionId("a"), body, at) == plain.apply(f"x{i}", SessionId("a"), body, at)
    assert one.managers.gpu_used == plain.gpu_used  # single-engine readers reach the one manager


def test_engine_ids_must_be_unique() -> None:
    with pytest.raises(ValueError, match="unique"):
        Feed(("e0", "e0"))
