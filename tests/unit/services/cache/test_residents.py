"""The host residents' index: the same residents, scores and order as the full listing.

``HostResidentIndex.ascending`` must hand out exactly what ``CachePolicy.host_residents``
lists (ascending host score, then session id) over the same residents, however little of
it is read; and a manager that searches its index must decide exactly what one that lists
and scores every swapped session decides. Both are checked against brute force on random
residents and random workloads.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import events as ev
from schemas.events import KVTier, SessionId
from services.cache.latency import ToolLatencyModel
from services.cache.manager import CacheManager, Decided, Hold, ManagerConfig
from services.cache.policy import CachePolicy, Delays, HostResident, ListedResidents, RankedResidents
from services.cache.residents import HostResidentIndex
from services.cache.view import Phase, SessionView
from services.engine.cost import CostModel

pytestmark = pytest.mark.unit

TOOLS = ["fast", "slow", "human", "unseen"]


def as_tuples(residents: object) -> list[tuple[float, str, SessionView]]:
    assert not isinstance(residents, str)
    return [(r.host_score, r.session_id, r.view) for r in residents]  # type: ignore[attr-defined]


# ------------------------------------------------------------------ the index alone

durations = st.lists(st.floats(0.0, 60.0, allow_nan=False), max_size=40)
resident = st.tuples(
    st.sampled_from([Phase.IDLE, Phase.TOOL, Phase.HUMAN]),
    st.sampled_from([*TOOLS, None]),
    st.floats(0.0, 100.0),  # since
    st.one_of(st.none(), st.floats(0.0, 100.0)),  # tool started at
    st.integers(1, 600),  # host blocks
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    samples=st.fixed_dictionaries({t: durations for t in TOOLS[:3]}),
    residents=st.lists(resident, max_size=60),
    removed=st.sets(st.integers(0, 59), max_size=20),
    now=st.floats(0.0, 200.0),
    queue=st.floats(0.0, 2.0),
    verdict=st.floats(0.0, 5.0),
    swap_overhead_ms=st.sampled_from([0.2, 40.0]),  # 40: small contexts save less than they cost (negative values)
    cutoffs=st.lists(st.floats(-1e5, 1e5), max_size=4),
)
def test_ascending_is_the_full_listing(
    samples: dict[str, list[float]],
    residents: list[tuple[Phase, str | None, float, float | None, int]],
    removed: set[int],
    now: float,
    queue: float,
    verdict: float,
    swap_overhead_ms: float,
    cutoffs: list[float],
) -> None:
    latency = ToolLatencyModel(prior_means_s={"slow": 20.0})
    for tool, values in samples.items():
        for d in values:
            latency.observe(tool, d)
    policy = CachePolicy(cost=CostModel(swap_overhead_ms=swap_overhead_ms), latency=latency)
    index = HostResidentIndex(policy)
    views = []
    for i, (phase, tool, since, started, blocks) in enumerate(residents):
        if phase is not Phase.IDLE and tool is None:
            tool = "fast"
        view = SessionView(SessionId(f"s{i:03d}"), phase, since, tool, started, 10 * blocks, 7, 0)
        index.put(view, blocks)
        index.put(view, blocks)  # unchanged: nothing to do
        if i in removed:
            index.discard(view.session_id)
        else:
            views.append(SessionView(view.session_id, phase, since, tool, started, 10 * blocks, 0, blocks))
    assert len(index) == len(views)
    delays = Delays(queue_s=queue, verdict_s=verdict)
    expected = as_tuples(policy.host_residents(views, now, delays))
    found = index.ascending(now, delays)
    for cutoff in cutoffs:  # partial reads first, from the start each time, then the whole
        assert as_tuples(found.below(cutoff)) == [e for e in expected if e[0] < cutoff]
    assert as_tuples(found) == expected
    index.thaw()


step = st.tuples(
    st.floats(0.0, 3.0),  # time to the next search
    st.one_of(st.none(), st.tuples(st.sampled_from(TOOLS[:3]), st.floats(0.0, 60.0))),  # a tool observed
    st.one_of(st.none(), st.tuples(st.integers(0, 29), resident)),  # a resident replaced
    st.floats(-1e5, 1e5),  # a cutoff read first
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    samples=st.fixed_dictionaries({t: durations for t in TOOLS[:3]}),
    residents=st.lists(resident, min_size=1, max_size=30),
    steps=st.lists(step, min_size=1, max_size=12),
)
def test_searches_over_time_match_the_listing(
    samples: dict[str, list[float]],
    residents: list[tuple[Phase, str | None, float, float | None, int]],
    steps: list[
        tuple[
            float,
            tuple[str, float] | None,
            tuple[int, tuple[Phase, str | None, float, float | None, int]] | None,
            float,
        ]
    ],
) -> None:
    """One index searched again and again as time passes, tools are observed and residents
    change: what a search keeps for the next (its bounds of running tools' residual lives) never
    makes the order differ from the listing."""
    latency = ToolLatencyModel(prior_means_s={"slow": 20.0})
    for tool, values in samples.items():
        for d in values:
            latency.observe(tool, d)
    policy = CachePolicy(latency=latency)
    index = HostResidentIndex(policy)
    views: dict[int, SessionView] = {}

    def put(i: int, phase: Phase, tool: str | None, since: float, started: float | None, blocks: int) -> None:
        if phase is not Phase.IDLE and tool is None:
            tool = "fast"
        view = SessionView(SessionId(f"s{i:03d}"), phase, since, tool, started, 10 * blocks, 7, 0)
        index.put(view, blocks)
        views[i] = SessionView(view.session_id, phase, since, tool, started, 10 * blocks, 0, blocks)

    for i, r in enumerate(residents):
        put(i, *r)
    now = 100.0
    for dt, observed, replaced, cutoff in steps:
        now += dt
        if observed is not None:
            latency.observe(*observed)
        if replaced is not None:
            put(replaced[0], *replaced[1])
        expected = as_tuples(policy.host_residents(list(views.values()), now, Delays()))
        found = index.ascending(now, Delays())
        assert as_tuples(found.below(cutoff)) == [e for e in expected if e[0] < cutoff]
        assert as_tuples(found) == expected
        index.thaw()


def test_a_tool_observed_between_searches_is_in_the_next_one() -> None:
    """A long call of a tool raises its residual life: a running resident's score falls below a
    pending one's, at the same time, and the next search sees it (not the last search's bound)."""
    latency = ToolLatencyModel(prior_weight=0.01)
    for _ in range(20):
        latency.observe("t", 0.5)
    policy = CachePolicy(latency=latency)
    index = HostResidentIndex(policy)
    running = SessionView(SessionId("running"), Phase.TOOL, 9.0, "t", 9.0, 1600, 0, 100)
    pending = SessionView(SessionId("pending"), Phase.TOOL, 9.0, "other", None, 1600, 0, 100)
    for view in (running, pending):
        index.put(view, 100)

    def order() -> list[str]:
        expected = as_tuples(policy.host_residents([running, pending], 10.0, Delays()))
        found = index.ascending(10.0, Delays())
        cutoff = 10.0  # between the two scores after the long calls: a stale bound would prune there
        assert as_tuples(found.below(cutoff)) == [e for e in expected if e[0] < cutoff]
        assert as_tuples(found) == expected
        index.thaw()
        return [sid for _, sid, _ in expected]

    before = order()
    for _ in range(20):
        latency.observe("t", 500.0)
    assert order() == list(reversed(before))


def test_changes_while_frozen_wait_for_thaw() -> None:
    policy = CachePolicy()
    index = HostResidentIndex(policy)
    a = SessionView(SessionId("a"), Phase.TOOL, 0.0, "search", 0.0)
    b = SessionView(SessionId("b"), Phase.TOOL, 0.0, "search", 0.5)
    index.put(a, 10)
    found = index.ascending(1.0, Delays())
    index.put(b, 20)  # a session swapped out during the eviction run: not in this run's listing
    index.discard(SessionId("a"))  # displaced during the run: still listed (the policy marks it)
    assert [r.session_id for r in found] == ["a"]
    index.thaw()
    assert "b" in index and "a" not in index
    assert [r.session_id for r in index.ascending(1.0, Delays())] == ["b"]


def test_listed_residents_below_stops_at_the_cutoff() -> None:
    v = SessionView(SessionId("a"))
    listed = ListedResidents([HostResident(1.0, SessionId("a"), v), HostResident(2.0, SessionId("b"), v)])
    assert [r.session_id for r in listed.below(2.0)] == ["a"]
    assert [r.session_id for r in listed.below(math.inf)] == ["a", "b"]


# --------------------------------------------------------------- the whole manager


class ListingManager(CacheManager):
    """The manager as it was: every swapped session listed and scored at each eviction run
    that finds the host short of room. It also checks the index against that listing."""

    num_listings = 0

    def _host_residents(self, now: float, delays: Delays) -> RankedResidents:
        views = []
        for sid, s in self._sessions.items():
            if s.hold is not Hold.SWAPPED or s.host_charged <= 0:
                continue
            v = self.view(sid)
            views.append(
                SessionView(sid, v.phase, v.since, v.tool, v.tool_started_at, v.context_tokens, 0, s.host_charged,
                            v.turns, v.attained_service_s)
            )  # fmt: skip
        listed = self.policy.host_residents(views, now, delays)
        searched = CacheManager._host_residents(self, now, delays)  # frozen; _evict thaws it
        assert as_tuples(searched) == as_tuples(listed)
        self.num_listings += 1
        return listed


step = st.tuples(
    st.integers(0, 11),  # session
    st.sampled_from(["turn"] * 4 + ["propose"] * 4 + ["start"] * 2 + ["complete", "fail", "swap", "evicted", "finish"]),
    st.floats(0.0, 1.0),  # time advance
    st.integers(1, 40),  # size (blocks, or result tokens)
    st.sampled_from(TOOLS[:3]),
)


def events(steps: list[tuple[int, str, float, int, str]]) -> list[tuple[str, SessionId, ev.Event, float]]:
    """A random agent workload: turns that store blocks, tools (a human one too), engine
    swaps (GPU blocks moved to the host tier) and evictions, finishes."""
    out: list[tuple[str, SessionId, ev.Event, float]] = []
    at = 0.0
    blocks: dict[int, int] = {}
    calls = itertools.count()
    open_tool: dict[int, str] = {}

    def emit(i: int, body: ev.Event) -> None:
        out.append((f"e{len(out)}", SessionId(f"s{i:02d}"), body, at))

    for i, what, dt, size, tool in steps:
        at += dt
        n = blocks.get(i, 0)
        if what == "turn":
            call = f"c{next(calls)}"
            emit(i, ev.LLMCallStarted(call_id=call, turn=0, engine_id="e", prompt_tokens=16 * n + 16 * size,
                                      max_output_tokens=32, prompt_digest="d"))  # fmt: skip
            hashes = [f"s{i}/{k}" for k in range(n, n + size)]
            emit(i, ev.KVBlocksStored(engine_id="e", block_hashes=hashes, num_tokens=16 * size, block_size=16,
                                      tier=KVTier.GPU))  # fmt: skip
            emit(i, ev.LLMCallCompleted(call_id=call, engine_id="e", prompt_tokens=16 * n + 16 * size,
                                        cached_tokens=0, output_tokens=16, output_text="", finish_reason="stop",
                                        queue_ms=10.0 * size, prefill_ms=1.0, decode_ms=1.0))  # fmt: skip
            blocks[i] = n + size
        elif what == "propose":
            call = f"t{next(calls)}"
            open_tool[i] = call
            emit(i, ev.ToolCallProposed(call_id=call, tool=tool, arguments_json="{}",
                                        effect_class=ev.EffectClass.PURE, idempotency_key=call))  # fmt: skip
        elif what in ("start", "complete", "fail") and i in open_tool:
            call = open_tool[i]
            if what == "start":
                emit(i, ev.ToolCallStarted(call_id=call, tool=tool, attempt=1, idempotency_key=call))
            elif what == "complete":
                del open_tool[i]
                emit(i, ev.ToolCallCompleted(call_id=call, result_json="{}", result_tokens=size,
                                             duration_ms=1000.0 * dt * size))  # fmt: skip
            else:
                del open_tool[i]
                emit(
                    i,
                    ev.ToolCallFailed(
                        call_id=call, error="x", error_type="timeout", retryable=False, duration_ms=500.0 * size
                    ),
                )
        elif what == "swap" and n:
            hashes = [f"s{i}/{k}" for k in range(n)]
            emit(i, ev.KVBlocksStored(engine_id="e", block_hashes=hashes, num_tokens=16 * n, block_size=16,
                                      tier=KVTier.CPU))  # fmt: skip
            emit(i, ev.KVBlocksRemoved(engine_id="e", block_hashes=hashes, tier=KVTier.GPU))
        elif what == "evicted" and n:
            cut = max(0, n - size)
            emit(i, ev.KVBlocksRemoved(engine_id="e", block_hashes=[f"s{i}/{k}" for k in range(cut, n)],
                                       tier=KVTier.GPU))  # fmt: skip
            blocks[i] = cut
        elif what == "finish":
            emit(i, ev.SessionFinished(output_json="{}", num_llm_calls=1, num_tool_calls=0))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(step, min_size=50, max_size=200),
    gpu=st.integers(60, 200),
    host=st.integers(20, 150),
    headroom=st.sampled_from([None, 0, 30]),
)
def test_manager_decides_as_with_the_full_listing(
    steps: list[tuple[int, str, float, int, str]], gpu: int, host: int, headroom: int | None
) -> None:
    config = ManagerConfig(gpu_total_blocks=gpu, host_total_blocks=host, headroom_blocks=headroom)
    searching = CacheManager(config, CachePolicy())
    listing = ListingManager(config, CachePolicy())
    decided: list[list[Decided]] = []
    for event_id, sid, body, at in events(steps):
        mine = searching.apply(event_id, sid, body, at)
        assert mine == listing.apply(event_id, sid, body, at)
        decided.append(mine)
    assert (searching.gpu_used, searching.host_used) == (listing.gpu_used, listing.host_used)


def test_manager_equivalence_at_scale() -> None:
    """The scale benchmark's workload (thousands of host residents, displacements at every
    other eviction), a slice of it: the same decisions, and the index checked at each listing."""
    from bench.cache_manager_scale import config_for, workload

    evs, mean_blocks = workload(8000, 600, seed=3)
    config = config_for(600, mean_blocks)
    searching = CacheManager(config, CachePolicy())
    listing = ListingManager(config, CachePolicy())
    for e in evs:
        assert searching.apply(e.event_id, e.session_id, e.body, e.at) == listing.apply(
            e.event_id, e.session_id, e.body, e.at
        )
    assert listing.num_listings > 50
    assert searching.num_decisions == listing.num_decisions > 0
