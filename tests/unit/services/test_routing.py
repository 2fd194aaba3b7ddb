"""Routing across engines (``services.routing``): the rules every router keeps, locality's cost rule
and its anti-thrash margin, and the model-size choice."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.routing import (
    ROUTERS,
    CallRequest,
    EngineInfo,
    LeastLoaded,
    Locality,
    RoundRobin,
    SizeStats,
    choose_size,
    make_router,
)

pytestmark = pytest.mark.unit


def eng(
    engine_id: str, *, size: str = "large", healthy: bool = True, queued: int = 0, rate: float = 1000.0
) -> EngineInfo:
    return EngineInfo(engine_id, model=f"m-{size}", size=size, healthy=healthy, queued_tokens=queued,
                      prefill_tokens_per_s=rate)  # fmt: skip


def call(prompt: int = 1000, cached: dict[str, int] | None = None, size: str = "large") -> CallRequest:
    return CallRequest("s1", prompt, cached or {}, size=size)


# -- rules every router keeps ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_no_engine_is_a_clear_error(name: str) -> None:
    with pytest.raises(ValueError, match="no engine"):
        make_router(name).route(call(), [])
    with pytest.raises(ValueError, match="all unhealthy: a, b"):
        make_router(name).route(call(), [eng("a", healthy=False), eng("b", healthy=False)])


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_duplicate_engine_ids_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="unique, got a more than once"):
        make_router(name).route(call(), [eng("a"), eng("a")])


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_size_without_healthy_engine_falls_back_and_says_so(name: str) -> None:
    engines = [eng("big", size="large"), eng("tiny", size="small", healthy=False)]
    route = make_router(name).route(call(size="small"), engines)
    assert (route.engine_id, route.reason) == ("big", "failover")
    assert "no healthy small engine, fell back to large" in route.detail


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_only_engines_of_the_calls_size(name: str) -> None:
    engines = [eng("a", size="large"), eng("b", size="small"), eng("c", size="large", queued=10**6)]
    router = make_router(name)
    for _ in range(5):
        assert router.route(call(size="small"), engines).engine_id == "b"
        assert router.route(call(size="small"), engines).reason == "only"


def test_unknown_router_names_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match="unknown router 'nearest'; known routers: least_loaded, locality, round_robin"
    ):
        make_router("nearest")


def test_engine_info_checks_size_and_rate() -> None:
    with pytest.raises(ValueError, match="size 'medium'"):
        EngineInfo("a", "m", size="medium")
    with pytest.raises(ValueError, match="prefill_tokens_per_s must be > 0"):
        EngineInfo("a", "m", prefill_tokens_per_s=0)


engines_st = st.lists(
    st.builds(
        EngineInfo,
        engine_id=st.sampled_from(["e0", "e1", "e2", "e3", "e4"]),
        model=st.just("m"),
        size=st.sampled_from(["small", "large"]),
        healthy=st.booleans(),
        queued_tokens=st.integers(0, 50_000),
        prefill_tokens_per_s=st.floats(100, 10_000),
    ),
    min_size=1,
    max_size=5,
    unique_by=lambda e: e.engine_id,
)


@settings(max_examples=200, deadline=None)
@given(engines=engines_st, prompt=st.integers(0, 20_000), size=st.sampled_from(["small", "large"]),
       cached=st.dictionaries(st.sampled_from(["e0", "e1", "e2", "e3", "e4"]), st.integers(0, 30_000)))  # fmt: skip
def test_properties_of_every_router(engines: list[EngineInfo], prompt: int, size: str, cached: dict[str, int]) -> None:
    """Never an unhealthy engine, the call's size when it has a healthy one, recompute within the prompt,
    and the same route for the same inputs (fresh routers)."""
    c = CallRequest("s", prompt, cached, size=size)
    for name in ROUTERS:
        if not any(e.healthy for e in engines):
            with pytest.raises(ValueError):
                make_router(name).route(c, engines)
            continue
        route = make_router(name).route(c, engines)
        chosen = next(e for e in engines if e.engine_id == route.engine_id)
        assert chosen.healthy
        if any(e.healthy and e.size == size for e in engines):
            assert chosen.size == size
        else:
            assert route.reason == "failover"
        assert 0 <= route.expected_recompute_tokens <= prompt
        assert route.expected_recompute_tokens == prompt - min(cached.get(chosen.engine_id, 0), prompt)
        assert make_router(name).route(c, engines) == route


# -- baselines ------------------------------------------------------------------------------------


def test_round_robin_rotates_in_id_order_and_skips_the_unhealthy() -> None:
    rr = RoundRobin()
    engines = [eng("b"), eng("a"), eng("c")]
    assert [rr.route(call(), engines).engine_id for _ in range(4)] == ["a", "b", "c", "a"]
    engines = [eng("a"), eng("b", healthy=False), eng("c")]
    assert [rr.route(call(), engines).engine_id for _ in range(3)] == ["c", "a", "c"]
    assert rr.route(call(cached={"a": 1000}), engines).reason == "round_robin"


def test_least_loaded_is_queue_wait_not_tokens_and_ties_by_id() -> None:
    ll = LeastLoaded()
    assert ll.route(call(), [eng("b"), eng("a")]).engine_id == "a"
    # b has more tokens queued but prefills 4x faster: its wait is shorter.
    route = ll.route(call(cached={"a": 1000}), [eng("a", queued=1000), eng("b", queued=2000, rate=4000)])
    assert (route.engine_id, route.reason, route.expected_recompute_tokens) == ("b", "least_loaded", 1000)


# -- locality -------------------------------------------------------------------------------------


def test_locality_goes_back_to_the_holder_when_queues_are_equal() -> None:
    route = Locality().route(call(1200, {"b": 1000}), [eng("a"), eng("b"), eng("c")])
    assert (route.engine_id, route.reason, route.expected_recompute_tokens) == ("b", "locality", 200)


def test_locality_holder_unless_its_wait_exceeds_recompute_plus_wait_elsewhere() -> None:
    """The brief's rule with no margin: holder wait 1.0 s vs recompute 1.0 s + 0.5 s wait elsewhere: stay;
    holder wait 2.0 s > 1.5 s: move."""
    loc = Locality(switch_margin=0.0)
    stay = loc.route(call(1000, {"h": 1000}), [eng("h", queued=1000), eng("o", queued=500)])
    assert (stay.engine_id, stay.reason) == ("h", "locality")
    move = loc.route(call(1000, {"h": 1000}), [eng("h", queued=2000), eng("o", queued=500)])
    assert (move.engine_id, move.reason, move.expected_recompute_tokens) == ("o", "load", 1000)
    assert "h holds 1000 tokens" in move.detail


def test_locality_margin_keeps_the_holder_on_a_small_gain() -> None:
    """Anti-thrash: holder costs 2.0 s, elsewhere 1.8 s: 11% better is under the 25% margin, stay."""
    engines = [eng("h", queued=2000), eng("o", queued=800)]
    assert Locality().route(call(1000, {"h": 1000}), engines).engine_id == "h"
    assert Locality(switch_margin=0.0).route(call(1000, {"h": 1000}), engines).engine_id == "o"


def test_locality_a_holder_busy_with_cache_hits_keeps_its_session_when_queued_counts_prefill() -> None:
    """``queued_tokens`` is what the calls in flight must compute: the holder runs three calls of 4000-token
    prompts that each hit 3800 of them (600 to compute: 0.6 s), the other engine one cold 1000-token call
    (1.0 s); the session's 5000-token call, 4800 held, stays (0.8 s there vs 6.0 s). Counted as whole
    prompts (12,000 tokens, 12 s) the holder would look busier than recomputing elsewhere, and it moves."""
    session = call(5000, {"h": 4800})
    assert Locality().route(session, [eng("h", queued=3 * 200), eng("o", queued=1000)]).reason == "locality"
    assert Locality().route(session, [eng("h", queued=3 * 4000), eng("o", queued=1000)]).reason == "load"


def test_locality_without_a_holder_is_least_cost_and_ties_by_id() -> None:
    route = Locality().route(call(1000), [eng("b"), eng("a"), eng("c", queued=10)])
    assert (route.engine_id, route.reason) == ("a", "least_loaded")


def test_locality_prefers_the_bigger_holder_and_partial_holders_count() -> None:
    route = Locality().route(call(1000, {"a": 300, "b": 900}), [eng("a"), eng("b")])
    assert (route.engine_id, route.expected_recompute_tokens) == ("b", 100)


def test_locality_a_fork_goes_where_its_parents_prefix_is() -> None:
    fork = CallRequest("child", 1500, {"b": 1200}, parent_session_id="parent")
    assert Locality().route(fork, [eng("a"), eng("b")]).engine_id == "b"


def test_locality_a_dead_holders_session_moves_and_says_failover() -> None:
    route = Locality().route(call(1000, {"a": 1000}), [eng("a", healthy=False), eng("b", queued=5), eng("c")])
    assert (route.engine_id, route.reason, route.expected_recompute_tokens) == ("c", "failover", 1000)
    assert "a holding its prefix is unhealthy" in route.detail


def test_locality_stale_cached_count_is_clamped_to_the_prompt() -> None:
    route = Locality().route(call(100, {"a": 5000}), [eng("a"), eng("b")])
    assert (route.engine_id, route.expected_recompute_tokens) == ("a", 0)


@settings(max_examples=200, deadline=None)
@given(engines=engines_st, prompt=st.integers(1, 20_000),
       cached=st.dictionaries(st.sampled_from(["e0", "e1", "e2", "e3", "e4"]), st.integers(0, 30_000)))  # fmt: skip
def test_locality_is_never_much_worse_than_the_best_engine(
    engines: list[EngineInfo], prompt: int, cached: dict[str, int]
) -> None:
    """Its choice costs at most (1 + margin) x the cheapest candidate's cost."""
    if not any(e.healthy for e in engines):
        return
    loc = Locality()
    c = CallRequest("s", prompt, cached, size="large")
    route = loc.route(c, engines)
    pool = [e for e in engines if e.healthy and e.size == "large"] or [e for e in engines if e.healthy]
    chosen = next(e for e in pool if e.engine_id == route.engine_id)
    best = min(loc.cost_s(c, e) for e in pool)
    assert loc.cost_s(c, chosen) <= best * (1 + loc.switch_margin) + 1e-9


# -- model size -----------------------------------------------------------------------------------


def test_size_precedence_pin_retry_declaration() -> None:
    stats = SizeStats()
    assert (
        choose_size("p", "s", declared="small", pinned="large", stats=stats, retry=False).reason == "pinned by operator"
    )
    retry = choose_size("p", "s", declared="small", pinned=None, stats=stats, retry=True)
    assert (retry.size, retry.reason) == ("large", "retry after small failed")
    declared = choose_size("p", "s", declared="small", pinned=None, stats=stats)
    assert (declared.size, declared.reason) == ("small", "declared by program")


def test_size_learns_from_the_log() -> None:
    stats = SizeStats(min_samples=3, min_success=0.9, explore_trials=3)
    first = choose_size("p", "plan", declared=None, pinned=None, stats=stats)
    assert (first.size, first.reason) == ("small", "trying the small model on this step (1 of 3)")
    for _ in range(3):
        stats.record("p", "plan", "small", retried=False)
        stats.record("p", "edit", "small", retried=True)
    good = choose_size("p", "plan", declared=None, pinned=None, stats=stats)
    assert (good.size, good.reason) == ("small", "small model completed this step 3/3 times")
    bad = choose_size("p", "edit", declared=None, pinned=None, stats=stats)
    assert (bad.size, bad.reason) == ("large", "small model completed this step only 0/3 times")
    assert stats.tally("p", "edit") == (0, 3)
    assert choose_size("other", "plan", declared=None, pinned=None, stats=stats).reason.startswith("trying")


def test_size_default_is_large_without_trials() -> None:
    choice = choose_size("p", "s", declared=None, pinned=None, stats=SizeStats(explore_trials=0))
    assert (choice.size, choice.reason) == ("large", "default")


def test_size_unavailable_is_replaced_and_said() -> None:
    choice = choose_size("p", "s", declared=None, pinned="small", stats=SizeStats(), available=("large",))
    assert choice.size == "large"
    assert choice.reason == "pinned by operator, but no small engine is available: large"
    with pytest.raises(ValueError, match="no model size available"):
        choose_size("p", "s", declared=None, pinned=None, stats=SizeStats(), available=())


def test_size_bad_names_are_refused() -> None:
    with pytest.raises(ValueError, match="pinned size 'xl'"):
        choose_size("p", "s", declared=None, pinned="xl", stats=SizeStats())
    with pytest.raises(ValueError, match="size 'xl'"):
        SizeStats().record("p", "s", "xl", retried=False)


def test_each_router_is_named_as_registered() -> None:
    assert {name: make_router(name).name for name in ROUTERS} == {n: n for n in ROUTERS}
