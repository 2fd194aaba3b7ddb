"""The multi-engine model (``services.engine.multi``): calls are conserved and each is served by exactly one
engine, locality keeps a session where its KV is, a failed small-model call is retried on the large engine,
one engine behind the driver is the single-engine model, an engine's queue counts what the planner counts,
and the split of the recomputed tokens by where they come from adds up."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from bench.ours import Ours
from schemas.events import SessionId
from services.engine.batching import BatchSim
from services.engine.cost import CostModel
from services.engine.multi import QUEUE_COUNTS, EngineSpec, MultiSim, SizePolicy, SmallModelSkill
from services.engine.serial import Sess, SimManager
from services.routing import CallRequest, EngineInfo, Route, Router, SizeStats, make_router
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


class Watching:
    """A router that records what it was shown and what it answered, then defers to ``inner``."""

    def __init__(self, inner: Router) -> None:
        self.inner, self.name = inner, inner.name
        self.seen: list[tuple[CallRequest, dict[str, EngineInfo], Route]] = []

    def route(self, call: CallRequest, engines: Sequence[EngineInfo]) -> Route:
        route = self.inner.route(call, engines)
        self.seen.append((call, {e.engine_id: e for e in engines}, route))
        return route


@pytest.mark.parametrize("queue", QUEUE_COUNTS)
def test_an_engines_queue_counts_what_its_calls_in_flight_must_compute_as_the_planner_does(queue: str) -> None:
    """Session a's second call hits its prefix on its engine and decodes for long; b's first call, routed
    meanwhile, sees a's engine queued with what a's call must compute (the planner's count: the route's
    expected recompute), not a's whole prompt; ``queue="prompt"`` counts the whole prompt."""
    a = (TraceTurn(400, 10, "search", 1.0, 50), TraceTurn(100, 2000))
    t = Trace((TraceSession("a", "test", 0.0, a), TraceSession("b", "test", 5.0, (TraceTurn(300, 10),))))
    router = Watching(make_router("locality"))
    seen: list[tuple[str, SessionId, int]] = []
    m = MultiSim(t, specs(2, seen), router, queue=queue).run()
    (a0, _, r0), (a1, _, r1), (b0, infos, _) = router.seen
    assert (a0.session_id, a1.session_id, b0.session_id) == ("a", "a", "b")
    assert r1.engine_id == r0.engine_id and 0 < r1.expected_recompute_tokens < a1.prompt_tokens
    counted = r1.expected_recompute_tokens if queue == "recompute" else a1.prompt_tokens
    assert infos[r1.engine_id].queued_tokens == counted
    assert m.calls == 3


def test_an_unknown_queue_count_is_refused() -> None:
    with pytest.raises(ValueError, match="queue 'tokens' is not one of recompute, prompt"):
        MultiSim(trace(1, 1), specs(1, []), make_router("locality"), queue="tokens")


@pytest.mark.parametrize("router", ["round_robin", "least_loaded", "locality"])
def test_the_recompute_split_adds_up_to_the_tokens_computed(router: str) -> None:
    """Under pressure (small GPUs, the shipped manager): first + new + lost + elsewhere + after routing is
    every token computed."""
    t = trace(12, 5, seed=7)
    engines = [EngineSpec(f"e{i}", Ours(), 260, 260, COST) for i in range(2)]
    m = MultiSim(t, engines, make_router(router)).run()
    parts = (m.recompute_first, m.recompute_new, m.recompute_lost, m.recompute_elsewhere)
    assert min(parts[:3]) > 0 and m.recompute_elsewhere >= 0
    assert sum(parts) + m.recompute_after_routing == m.computed_tokens
    assert m.recompute_floor == m.recompute_first + m.recompute_new


def test_with_room_to_spare_locality_recomputes_the_floor_and_round_robin_what_it_sends_elsewhere() -> None:
    """Two sessions far apart in time and blocks to spare: nothing is lost; locality computes only the
    tokens no engine ever held; round robin also what its alternation leaves on the other engine."""
    turns = (*(TraceTurn(400, 10, "search", 5.0, 50) for _ in range(4)), TraceTurn(100, 10))
    t = Trace((TraceSession("a", "test", 0.0, turns), TraceSession("b", "test", 1000.0, turns)))
    loc = MultiSim(t, specs(2, []), make_router("locality")).run()
    assert loc.recompute_lost == loc.recompute_elsewhere == loc.recompute_after_routing == 0
    assert loc.computed_tokens == loc.recompute_floor
    rr = MultiSim(t, specs(2, []), make_router("round_robin")).run()
    assert rr.recompute_lost == rr.recompute_after_routing == 0
    assert rr.recompute_floor == loc.recompute_floor
    assert rr.computed_tokens == rr.recompute_floor + rr.recompute_elsewhere > loc.computed_tokens


@pytest.mark.parametrize("manager", [SimManager, Ours])
def test_the_engine_a_session_leaves_discards_it_as_the_shipped_managers_do(manager: type[SimManager]) -> None:
    """Round robin on two engines alternates a session between them; each move makes the engine it left
    discard its copy (``EngineCacheManagers``' rule), so at every routing only the engine of the previous
    call holds any of the prompt: the one it returns to holds nothing of two calls ago."""
    turns = (*(TraceTurn(400, 10, "search", 5.0, 50) for _ in range(4)), TraceTurn(100, 10))
    router = Watching(make_router("round_robin"))
    engines = [EngineSpec(f"e{i}", manager(), 4000, 4000, COST) for i in range(2)]
    m = MultiSim(Trace((TraceSession("a", "test", 0.0, turns),)), engines, router).run()
    assert m.moves == 4
    for (_, _, before), (call, _, _) in zip(router.seen, router.seen[1:], strict=False):
        assert {e for e, n in call.cached_tokens.items() if n > 0} == {before.engine_id}
