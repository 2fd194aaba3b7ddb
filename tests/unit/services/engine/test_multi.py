"""The multi-engine model (``services.engine.multi``): calls are conserved and each is served by exactly one
engine, locality keeps a session where its KV is, a failed small-model call is retried on the large engine,
and one engine behind the driver is the single-engine model."""

from __future__ import annotations

import random

import pytest

from bench.ours import Ours
from schemas.events import SessionId
from services.engine.batching import BatchSim
from services.engine.cost import CostModel
from services.engine.multi import EngineSpec, MultiSim, SizePolicy, SmallModelSkill
from services.engine.serial import Sess, SimManager
from services.routing import SizeStats, make_router
from services.traces.model import Trace, TraceSession, TraceTurn

pytestmark = pytest.mark.unit

COST = CostModel()


class Recorder(SimManager):
    """No cache policy (blocks go to the LRU after each call); records which calls it saw start."""

    def __init__(self, seen: list[tuple[str, SessionId, int]], engine_id: str) -> None:
        self.seen, self.engine_id = seen, engine_id

    def on_ready(self, s: Sess, now: float) -> None:
        self.seen.append((self.engine_id, s.sid, s.turn))


def trace(num_sessions: int, num_turns: int, *, seed: int = 0, gap_s: float = 2.0) -> Trace:
    rng = random.Random(seed)
    sessions = []
    for i in range(num_sessions):
        turns = [TraceTurn(rng.randint(200, 600), rng.randint(5, 30), "search", gap_s * rng.random(), 100)
                 for _ in range(num_turns - 1)]  # fmt: skip
        turns.append(TraceTurn(rng.randint(100, 300), 10))
        sessions.append(TraceSession(f"s{i}", "test", 0.3 * i, tuple(turns)))
    return Trace(tuple(sessions))


def specs(n: int, seen: list[tuple[str, SessionId, int]], blocks: int = 4000) -> list[EngineSpec]:
    return [EngineSpec(f"e{i}", Recorder(seen, f"e{i}"), blocks, blocks, COST) for i in range(n)]


@pytest.mark.parametrize("router", ["round_robin", "least_loaded", "locality"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_calls_are_conserved_and_each_is_served_by_exactly_one_engine(router: str, n: int) -> None:
    t = trace(12, 5, seed=n)
    seen: list[tuple[str, SessionId, int]] = []
    m = MultiSim(t, specs(n, seen), make_router(router)).run()
    expected = {(SessionId(s.session_id), k) for s in t for k in range(len(s.turns))}
    served = [(sid, turn) for _, sid, turn in seen]
    assert len(served) == len(set(served)) == len(expected) == m.calls == sum(m.calls_by_engine.values())
    assert set(served) == expected
    assert len(m.jct) == len(t)
    per_engine = {e: sum(1 for x in seen if x[0] == e) for e in m.calls_by_engine}
    assert per_engine == m.calls_by_engine


def test_one_engine_behind_the_driver_is_the_single_engine_model() -> None:
    t = trace(10, 4, seed=3)
    alone = BatchSim(t, Ours(), 600, 600, COST).run()
    multi = MultiSim(t, [EngineSpec("e0", Ours(), 600, 600, COST)], make_router("locality")).run()
    assert sorted(multi.jct) == pytest.approx(sorted(alone.jct))
    assert multi.computed_tokens == alone.computed_tokens


def test_locality_keeps_a_session_on_its_engine_after_a_gap_when_queues_are_equal() -> None:
    """Two sessions far apart in time, so queues are equal (empty) at every call: locality sends each call
    back to the engine holding the session's blocks after its tool gap; round robin moves it."""
    turns = (*(TraceTurn(400, 10, "search", 5.0, 50) for _ in range(4)), TraceTurn(100, 10))
    t = Trace((TraceSession("a", "test", 0.0, turns), TraceSession("b", "test", 1000.0, turns)))
    seen: list[tuple[str, SessionId, int]] = []
    m = MultiSim(t, specs(2, seen), make_router("locality")).run()
    for sid in ("a", "b"):
        assert len({e for e, s, _ in seen if s == sid}) == 1
    assert m.moves == 0
    assert m.reasons == {"least_loaded": 2, "locality": 8}  # first calls: nobody holds anything yet
    seen_rr: list[tuple[str, SessionId, int]] = []
    rr = MultiSim(t, specs(2, seen_rr), make_router("round_robin")).run()
    assert rr.moves > 0
    assert rr.computed_tokens > m.computed_tokens


def test_a_failed_small_call_is_retried_on_the_large_engine() -> None:
    t = trace(6, 4, seed=5)
    seen: list[tuple[str, SessionId, int]] = []
    small = CostModel(prefill_ms_per_token=0.025, decode_ms_per_token=2.5)
    engines = [EngineSpec("small", Recorder(seen, "small"), 4000, 4000, small, size="small"),
               EngineSpec("large", Recorder(seen, "large"), 4000, 4000, COST)]  # fmt: skip
    always_fails = SmallModelSkill(hard_share=1.0, fail_hard=1.0)
    policy = SizePolicy("p", always_fails, SizeStats(explore_trials=3))
    m = MultiSim(t, engines, make_router("locality"), size_policy=policy).run()
    num_calls = sum(len(s.turns) for s in t)
    assert len(m.jct) == len(t)
    assert m.retries == m.small_calls > 0
    assert m.calls == num_calls + m.retries
    assert {(sid, turn) for e, sid, turn in seen if e == "large"} == {
        (SessionId(s.session_id), k) for s in t for k in range(len(s.turns))
    }
    # the small model was tried 3 times per step, then never again
    steps = {turn.tool or "final" for s in t for turn in s.turns}
    assert m.small_calls == 3 * len(steps)


def test_engine_ids_must_be_unique_and_the_block_size_shared() -> None:
    seen: list[tuple[str, SessionId, int]] = []
    with pytest.raises(ValueError, match="unique"):
        MultiSim(trace(1, 1), [*specs(1, seen), *specs(1, seen)], make_router("locality"))
    other = EngineSpec("x", Recorder(seen, "x"), 100, 100, CostModel(block_size=32))
    with pytest.raises(ValueError, match="same block size"):
        MultiSim(trace(1, 1), [*specs(1, seen), other], make_router("locality"))
