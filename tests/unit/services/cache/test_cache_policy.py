from __future__ import annotations

import math
import random

import pytest

from schemas.events import (
    CacheAction,
    EffectClass,
    KVBlocksRemoved,
    KVBlocksStored,
    KVTier,
    LLMCallCompleted,
    LLMCallStarted,
    SessionFinished,
    SessionId,
    ToolCallCompleted,
    ToolCallProposed,
    ToolCallStarted,
)
from services.cache import (
    CachePolicy,
    CacheViewBuilder,
    Delays,
    MemoryState,
    Phase,
    PolicyConfig,
    SessionView,
    ToolLatencyModel,
)

S = SessionId


# ------------------------------------------------------------------ latency model


def test_unseen_tool_answers_the_prior() -> None:
    model = ToolLatencyModel(prior_mean_s=5.0)
    assert model.mean("x") == 5.0
    assert model.mean_residual_life("x", 100.0) == 5.0
    assert model.cdf("x", 5.0) == pytest.approx(1 - math.exp(-1))


def test_mean_residual_life_blends_samples_and_prior() -> None:
    model = ToolLatencyModel(prior_mean_s=5.0, prior_weight=1.0)
    for d in (3.0, 1.0, 2.0):
        model.observe("search", d)
    assert model.mean("search") == pytest.approx((6.0 + 5.0) / 4)
    prior_mass = math.exp(-2.5 / 5.0)
    assert model.mean_residual_life("search", 2.5) == pytest.approx((0.5 + prior_mass * 5.0) / (1 + prior_mass))
    # Past every sample, only the prior answers.
    assert model.mean_residual_life("search", 10.0) == pytest.approx(5.0)
    assert model.cdf("search", 2.0) == pytest.approx((2 + (1 - math.exp(-0.4))) / 4)
    assert model.quantiles("search") == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError):
        model.observe("search", -1.0)


def test_many_samples_match_a_brute_force_distribution() -> None:
    # Enough samples, in random order with duplicates, to split the sorted chunks many times.
    rng = random.Random(7)
    values = [round(rng.lognormvariate(1.0, 1.0), 2) for _ in range(3000)]
    model = ToolLatencyModel(prior_mean_s=5.0, prior_weight=1.0)
    for v in values:
        model.observe("t", v)
    assert model.num_samples("t") == 3000 and model.quantiles("t") == sorted(values)
    for x in (0.0, 0.5, 2.72, 10.0, 55.0, 200.0):
        above = [v for v in values if v > x]
        prior_mass = math.exp(-x / 5.0)
        brute = (sum(v - x for v in above) + prior_mass * 5.0) / (len(above) + prior_mass)
        assert model.mean_residual_life("t", x) == pytest.approx(brute, rel=1e-9)
        below = sum(1 for v in values if v <= x)
        assert model.cdf("t", x) == pytest.approx((below + 1 - math.exp(-x / 5.0)) / 3001, rel=1e-12)


# ------------------------------------------------------------------ view builder


def test_builder_folds_a_turn() -> None:
    b = CacheViewBuilder(latency=ToolLatencyModel())
    sid = S("s")
    b.apply(sid, LLMCallStarted(call_id="l0", turn=0, engine_id="e", prompt_tokens=100, max_output_tokens=50,
                                prompt_digest="d"), 1.0)  # fmt: skip
    assert b.view(sid).phase is Phase.LLM and b.view(sid).turns == 1
    b.apply(sid, KVBlocksStored(engine_id="e", block_hashes=["a", "b", "c"], num_tokens=48, block_size=16,
                                tier=KVTier.GPU), 1.5)  # fmt: skip
    b.apply(sid, LLMCallCompleted(call_id="l0", engine_id="e", prompt_tokens=100, cached_tokens=0, output_tokens=20,
                                  output_text="", finish_reason="stop", queue_ms=500.0, prefill_ms=100.0,
                                  decode_ms=900.0), 2.0)  # fmt: skip
    v = b.view(sid)
    assert (v.phase, v.context_tokens, v.gpu_blocks, v.attained_service_s) == (Phase.IDLE, 120, 3, 1.0)
    assert b.queue_delay_s == pytest.approx(0.1)
    b.apply(sid, ToolCallProposed(call_id="t0", tool="search", arguments_json="{}", effect_class=EffectClass.PURE,
                                  idempotency_key="k"), 2.0)  # fmt: skip
    assert b.view(sid).phase is Phase.TOOL and b.view(sid).tool == "search"
    b.apply(sid, ToolCallStarted(call_id="t0", tool="search", idempotency_key="k", attempt=1), 2.5)
    assert b.view(sid).tool_started_at == 2.5
    assert b.verdict_delay_s == pytest.approx(0.1)
    b.apply(sid, KVBlocksRemoved(engine_id="e", block_hashes=["c"], tier=KVTier.GPU), 3.0)
    b.apply(sid, KVBlocksStored(engine_id="e", block_hashes=["c"], num_tokens=16, block_size=16, tier=KVTier.CPU), 3.0)
    assert (b.view(sid).gpu_blocks, b.view(sid).host_blocks) == (2, 1)
    b.apply(sid, ToolCallCompleted(call_id="t0", result_json="{}", result_tokens=30, duration_ms=4000.0), 6.5)
    v = b.view(sid)
    assert (v.phase, v.context_tokens, v.tool) == (Phase.IDLE, 150, None)
    assert b.latency.quantiles("search") == [4.0]
    b.apply(sid, ToolCallProposed(call_id="t1", tool="human", arguments_json="{}", effect_class=EffectClass.PURE,
                                  idempotency_key="k1"), 7.0)  # fmt: skip
    assert b.view(sid).phase is Phase.HUMAN
    b.apply(sid, SessionFinished(output_json="{}", num_llm_calls=1, num_tool_calls=1), 8.0)
    assert b.view(sid).phase is Phase.FINISHED


# ------------------------------------------------------------------ policy


def _views() -> list[SessionView]:
    return [
        SessionView(S("a"), Phase.TOOL, since=0.0, tool="search", tool_started_at=0.0, gpu_blocks=10),
        SessionView(S("b"), Phase.HUMAN, since=0.0, tool="human", tool_started_at=0.0, gpu_blocks=10),
        SessionView(S("c"), Phase.FINISHED, since=0.0, gpu_blocks=4),
        SessionView(S("d"), Phase.LLM, since=0.0, gpu_blocks=8),
        SessionView(S("e"), Phase.IDLE, since=0.0, gpu_blocks=2),
    ]


def _policy() -> CachePolicy:
    return CachePolicy(latency=ToolLatencyModel(prior_mean_s=5.0))


def test_next_reference_distance() -> None:
    p = _policy()
    a, b, c, d, e = _views()
    delays = Delays(queue_s=0.5, verdict_s=1.0)
    assert p.next_reference_s(a, 1.0, delays) == pytest.approx(5.5)
    assert p.next_reference_s(b, 1.0, delays) == pytest.approx(60.5)  # a human is slow
    assert p.next_reference_s(c, 1.0, delays) == math.inf
    assert p.next_reference_s(d, 1.0, delays) == 0.0
    assert p.next_reference_s(e, 1.0, delays) == 0.5
    proposed = SessionView(S("f"), Phase.TOOL, since=0.0, tool="search")  # verdict pending, 0.25 s in
    assert p.next_reference_s(proposed, 0.25, delays) == pytest.approx(0.75 + 5.0 + 0.5)


def test_score_is_benefit_per_byte_second() -> None:
    p = _policy()
    a, b, c, _, _ = _views()
    gb = 10 * p.cost.block_bytes / 1e9
    assert p.score(a, 1.0, 0) == pytest.approx(p.cost.recompute_ms(160) / (gb * 5.0))
    # With host room the cost of not keeping it is the swap round trip (out now, in on return).
    assert p.score(a, 1.0, 100) == pytest.approx(2 * p.cost.swap_ms(10) / (gb * 5.0))
    assert p.score(b, 1.0, 0) == pytest.approx(0.9 * p.cost.recompute_ms(160) / (gb * 60.0))
    assert p.score(c, 1.0, 0) == 0.0


def test_decide_evicts_lowest_score_first_and_preserves_the_rest() -> None:
    p = _policy()
    memory = MemoryState(gpu_total_blocks=100, gpu_free_blocks=10, host_free_blocks=0, needed_blocks=25)
    got = [(d.session_id, d.action, d.ttl_s) for d in p.decide(_views(), 1.0, memory)]
    assert got == [
        ("c", CacheAction.DISCARD, None),  # finished
        ("b", CacheAction.RELEASE, None),  # human: lowest score, no host room: to the LRU
        ("a", CacheAction.RELEASE, None),  # deficit 15 - 4 - 10 = 1 left
        ("e", CacheAction.PRESERVE, 1.0),  # next call imminent: min TTL
    ]


def test_decide_swaps_when_the_host_has_room() -> None:
    p = _policy()
    memory = MemoryState(gpu_total_blocks=100, gpu_free_blocks=10, host_free_blocks=15, needed_blocks=25)
    got = [(d.session_id, d.action) for d in p.decide(_views(), 1.0, memory)]
    # b takes 10 of the 15 host slots; a (10 blocks) no longer fits: released to the LRU.
    assert got == [
        ("c", CacheAction.DISCARD),
        ("b", CacheAction.SWAP),
        ("a", CacheAction.RELEASE),
        ("e", CacheAction.PRESERVE),
    ]


def test_decide_without_deficit_adapts_the_horizon_to_pressure() -> None:
    p = CachePolicy(latency=ToolLatencyModel(prior_mean_s=5.0), config=PolicyConfig(max_horizon_s=100.0))
    low = MemoryState(gpu_total_blocks=100, gpu_free_blocks=90)  # horizon 90 s: the human's 60 s fits
    got = [(d.session_id, d.action, d.ttl_s) for d in p.decide(_views(), 1.0, low)]
    assert got == [
        ("c", CacheAction.DISCARD, None),
        ("b", CacheAction.PRESERVE, 120.0),
        ("a", CacheAction.PRESERVE, 10.0),
        ("e", CacheAction.PRESERVE, 1.0),
    ]
    high = MemoryState(gpu_total_blocks=100, gpu_free_blocks=30)  # horizon 30 s
    kept = [(d.session_id, d.action, d.ttl_s) for d in p.decide(_views(), 1.0, high)]
    # b is beyond the horizon but the host has no room: it stays pinned (a deficit evicts in score
    # order, the LRU would not).
    assert kept == [
        ("c", CacheAction.DISCARD, None),
        ("b", CacheAction.PRESERVE, 120.0),
        ("a", CacheAction.PRESERVE, 10.0),
        ("e", CacheAction.PRESERVE, 1.0),
    ]
    offload = MemoryState(gpu_total_blocks=100, gpu_free_blocks=30, host_free_blocks=10)  # room for b on the host
    offloaded = [(d.session_id, d.action) for d in p.decide(_views(), 1.0, offload)]
    assert offloaded == [
        ("c", CacheAction.DISCARD),
        ("b", CacheAction.SWAP),
        ("a", CacheAction.PRESERVE),
        ("e", CacheAction.PRESERVE),
    ]


def test_decide_counts_only_reclaimable_blocks_and_breaks_ties_by_id() -> None:
    p = _policy()
    views = [
        SessionView(S("y"), Phase.TOOL, tool="t", tool_started_at=0.0, gpu_blocks=5),
        SessionView(S("x"), Phase.TOOL, tool="t", tool_started_at=0.0, gpu_blocks=5),
    ]
    memory = MemoryState(gpu_total_blocks=20, gpu_free_blocks=0, needed_blocks=5, reclaimable={S("y"): 5})
    got = [(d.session_id, d.action) for d in p.decide(views, 0.0, memory)]
    # x first (tie on score), but its blocks are already evictable: y must go too.
    assert got == [("x", CacheAction.RELEASE), ("y", CacheAction.RELEASE)]


def test_decision_event() -> None:
    p = _policy()
    memory = MemoryState(gpu_total_blocks=100, gpu_free_blocks=90)
    decisions = p.decide(_views(), 1.0, memory)
    finished = decisions[0].to_event("e0")
    assert finished.action is CacheAction.DISCARD and finished.next_reference_ms is None
    kept = decisions[-1].to_event("e0")
    assert kept.ttl_ms == 1000 and kept.num_blocks == 2


def _memories() -> list[MemoryState]:
    return [
        MemoryState(gpu_total_blocks=100, gpu_free_blocks=90),
        MemoryState(gpu_total_blocks=100, gpu_free_blocks=30),
        MemoryState(gpu_total_blocks=100, gpu_free_blocks=30, host_free_blocks=10),
        MemoryState(gpu_total_blocks=100, gpu_free_blocks=30, host_free_blocks=10, queued_calls=3),
        MemoryState(gpu_total_blocks=100, gpu_free_blocks=5, host_free_blocks=50, needed_blocks=5),
    ]


def test_decide_session_is_decide_of_one_view_without_deficit() -> None:
    p = CachePolicy(latency=ToolLatencyModel(prior_mean_s=5.0), config=PolicyConfig(max_horizon_s=100.0))
    views = [
        *_views(),
        SessionView(S("h"), Phase.FINISHED, host_blocks=6),  # finished, only on the host: discarded
        SessionView(S("r"), Phase.TOOL, tool="search", tool_started_at=0.0, host_blocks=6),  # a host resident
    ]
    for memory in _memories():
        for v in views:
            decided = p.decide([v], 1.0, memory)
            assert p.decide_session(v, 1.0, memory) == (decided[0] if decided else None)
    low = _memories()[0]
    assert p.decide_session(views[3], 1.0, low) is None  # in an LLM call
    assert p.decide_session(views[6], 1.0, low) is None  # nothing on GPU to decide about
    finished = p.decide_session(views[5], 1.0, low)
    assert finished is not None and finished.action is CacheAction.DISCARD


def test_offloads_wait_while_calls_are_queued() -> None:
    p = CachePolicy(latency=ToolLatencyModel(prior_mean_s=5.0), config=PolicyConfig(max_horizon_s=100.0))
    _, b, _, _, _ = _views()  # the human: 60 s away, beyond the 30 s horizon
    idle = MemoryState(gpu_total_blocks=100, gpu_free_blocks=30, host_free_blocks=10)
    busy = MemoryState(gpu_total_blocks=100, gpu_free_blocks=30, host_free_blocks=10, queued_calls=2)
    now = p.decide_session(b, 1.0, idle)
    # Its re-look time: in the middle of its prefetch lead (the swap-in plus the 1 s margin).
    assert now is not None and now.action is CacheAction.SWAP
    assert now.ttl_s == pytest.approx(60.0 - p.cost.swap_ms(10) / 1000 - 0.5)
    later = p.decide_session(b, 1.0, busy)
    assert later is not None and (later.action, later.ttl_s) == (CacheAction.PRESERVE, 1.0)
    assert "deferred: 2 calls wait" in later.reason
    # With the engine idle but no host room: kept pinned until needed, re-scored at its usual TTL.
    full = MemoryState(gpu_total_blocks=100, gpu_free_blocks=30, host_free_blocks=0)
    kept = p.decide_session(b, 1.0, full)
    assert kept is not None and (kept.action, kept.ttl_s) == (CacheAction.PRESERVE, 120.0)
    assert "no host room" in kept.reason


def _resident(name: str, phase: Phase, host_blocks: int) -> SessionView:
    tool = "human" if phase is Phase.HUMAN else "search"
    return SessionView(S(name), phase, tool=tool, tool_started_at=0.0, host_blocks=host_blocks)


def test_a_near_return_displaces_far_host_residents() -> None:
    p = _policy()
    x = SessionView(S("x"), Phase.TOOL, tool="search", tool_started_at=0.0, gpu_blocks=10)  # back in ~5 s
    far = _resident("far", Phase.HUMAN, 4)  # >= 60 s away: lowest host score
    farther = _resident("farther", Phase.HUMAN, 4)  # same score: ties by id, "far" first
    soon = SessionView(S("soon"), Phase.IDLE, host_blocks=8)  # its call is next: highest host score
    memory = MemoryState(gpu_total_blocks=100, gpu_free_blocks=0, host_free_blocks=3, needed_blocks=10)
    got = [(d.session_id, d.action, d.num_blocks) for d in p.decide([soon, farther, x, far], 1.0, memory)]
    assert got == [
        ("far", CacheAction.DISCARD, 4),
        ("farther", CacheAction.DISCARD, 4),  # 3 + 4 + 4 = 11 >= 10: room for x
        ("x", CacheAction.SWAP, 10),
    ]
    # When only residents that return sooner than x could make room, x is released instead.
    alone = [(d.session_id, d.action) for d in p.decide([soon, x], 1.0, memory)]
    assert alone == [("x", CacheAction.RELEASE)]


def test_displacing_residents_must_cost_less_than_the_release() -> None:
    p = _policy()
    x = SessionView(S("x"), Phase.TOOL, tool="search", tool_started_at=0.0, gpu_blocks=10)
    # A big far resident: its host score is lower, but recomputing its 200 blocks later costs
    # more than recomputing x's 10 now, so it stays and x is released.
    big = _resident("big", Phase.HUMAN, 200)
    memory = MemoryState(gpu_total_blocks=100, gpu_free_blocks=0, host_free_blocks=3, needed_blocks=10)
    assert p.host_score(big, 200, 1.0) < p.host_score(x, 10, 1.0)
    got = [(d.session_id, d.action) for d in p.decide([big, x], 1.0, memory)]
    assert got == [("x", CacheAction.RELEASE)]
    assert p.release_loss_ms(x) == pytest.approx(p.cost.recompute_ms(160))


# ------------------------------------------------------------------ prefetch


def _waiting(name: str, host_blocks: int, tool: str | None = "search") -> SessionView:
    """A host resident: waiting on a tool (about 5 s away with the prior) or, without a tool, idle."""
    if tool is None:
        return SessionView(S(name), Phase.IDLE, host_blocks=host_blocks)
    return SessionView(S(name), Phase.TOOL, tool=tool, tool_started_at=0.0, host_blocks=host_blocks)


def test_a_host_resident_whose_call_is_within_the_lead_is_prefetched_and_held() -> None:
    p = _policy()
    delays = Delays(queue_s=0.5)
    memory = MemoryState(gpu_total_blocks=100, gpu_free_blocks=50, host_free_blocks=10)
    idle = _waiting("r", 6, tool=None)  # its call is next: D = 0.5 s, within the 1 s + swap lead
    got = [(d.session_id, d.action, d.num_blocks, d.ttl_s) for d in p.decide([idle], 1.0, memory, delays)]
    assert got == [("r", CacheAction.PREFETCH, 6, 1.0)]  # held like a PRESERVE: TTL 2 * 0.5 s, at least 1 s
    assert p.lead_s(6) == pytest.approx(p.cost.swap_ms(6) / 1000 + 1.0)
    # A tool 5.5 s away is beyond the lead: it stays on the host (nothing decided).
    assert p.decide([_waiting("t", 6)], 1.0, memory, delays) == []
    # With a 5 s margin it is within (when queueing takes no time: D = 5 s): held for 2 * 5 s.
    wide = CachePolicy(latency=ToolLatencyModel(prior_mean_s=5.0), config=PolicyConfig(prefetch_margin_s=5.0))
    assert wide.decide([_waiting("t", 6)], 1.0, memory, delays) == []
    got = [(d.action, d.ttl_s) for d in wide.decide([_waiting("t", 6)], 1.0, memory)]
    assert got == [(CacheAction.PREFETCH, pytest.approx(10.0))]


def test_no_prefetch_while_calls_wait_under_a_deficit_or_without_room() -> None:
    p = _policy()
    idle = _waiting("r", 6, tool=None)
    assert p.decide([idle], 1.0, MemoryState(gpu_total_blocks=100, gpu_free_blocks=50, queued_calls=1)) == []
    # The room must be beyond what the engine needs now: 10 - 5 = 5 < 6.
    assert p.decide([idle], 1.0, MemoryState(gpu_total_blocks=100, gpu_free_blocks=10, needed_blocks=5)) == []
    assert p.decide([idle], 1.0, MemoryState(gpu_total_blocks=100, gpu_free_blocks=10, needed_blocks=4)) != []
    # Under a deficit the resident is not brought back (and here it is displaced for x instead).
    x = SessionView(S("x"), Phase.TOOL, tool="search", tool_started_at=0.0, gpu_blocks=10)
    deficit = MemoryState(gpu_total_blocks=100, gpu_free_blocks=0, host_free_blocks=0, needed_blocks=10)
    assert [d.action for d in p.decide([idle, x], 1.0, deficit)] == [CacheAction.RELEASE]


def test_prefetch_only_what_would_be_kept_soonest_first() -> None:
    wide = CachePolicy(latency=ToolLatencyModel(prior_mean_s=5.0), config=PolicyConfig(prefetch_margin_s=5.0))
    soon, later, tie = _waiting("soon", 6, tool=None), _waiting("later", 6), _waiting("alsolater", 6)
    # Room for one: the soonest (D = 0) goes first; the others no longer fit.
    small = MemoryState(gpu_total_blocks=100, gpu_free_blocks=10)
    assert [(d.session_id, d.action) for d in wide.decide([later, soon], 1.0, small)] == [
        ("soon", CacheAction.PREFETCH)
    ]
    # Room for two of the same distance: ties by session id. With 12 free the second would leave
    # none: its horizon would be 0 s, so only the first goes.
    room = MemoryState(gpu_total_blocks=100, gpu_free_blocks=20)
    assert [d.session_id for d in wide.decide([later, tie], 1.0, room)] == ["alsolater", "later"]
    full = MemoryState(gpu_total_blocks=100, gpu_free_blocks=12)
    assert [d.session_id for d in wide.decide([later, tie], 1.0, full)] == ["alsolater"]
    # The pressure after the prefetch sets the horizon: 300 s * (7 - 6) / 100 = 3 s. The idle
    # session (D = 0) would be kept; the tool (D = 5 s) would be swapped straight back: not fetched.
    tight = MemoryState(gpu_total_blocks=100, gpu_free_blocks=7)
    assert [d.session_id for d in wide.decide([soon], 1.0, tight)] == ["soon"]
    assert wide.decide([later], 1.0, tight) == []


def test_prefetches_come_after_the_gpu_candidates_and_decide_session_agrees() -> None:
    p = _policy()
    memory = MemoryState(gpu_total_blocks=100, gpu_free_blocks=50, host_free_blocks=10)
    views = [_waiting("r", 6, tool=None), *_views()]
    got = [(d.session_id, d.action) for d in p.decide(views, 1.0, memory)]
    assert got == [
        ("c", CacheAction.DISCARD),
        ("b", CacheAction.PRESERVE),
        ("a", CacheAction.PRESERVE),
        ("e", CacheAction.PRESERVE),
        ("r", CacheAction.PREFETCH),
    ]
    residents = [_waiting("r", 6, tool=None), _waiting("t", 6), _waiting("big", 80, tool=None)]
    for m in [*_memories(), memory]:
        for v in residents:
            decided = p.decide([v], 1.0, m)
            assert p.decide_session(v, 1.0, m) == (decided[0] if decided else None)


def test_a_swap_says_when_to_look_again_for_a_prefetch() -> None:
    p = _policy()
    memory = MemoryState(gpu_total_blocks=100, gpu_free_blocks=10, host_free_blocks=15, needed_blocks=25)
    swapped = [d for d in p.decide(_views(), 1.0, memory) if d.action is CacheAction.SWAP]
    # b (the human, 60 s away) swapped under the deficit: looked at again when its call is half a
    # margin inside the lead.
    relook = 60.0 - p.lead_s(10) + 0.5
    assert [(d.session_id, d.ttl_s) for d in swapped] == [("b", pytest.approx(relook))]
    assert swapped[0].to_event("e0").ttl_ms == round(relook * 1000)
    # A session that returns within half a margin of the lead is looked at again at once.
    assert p.relook_s(10, 0.5) == 0.0 and p.relook_s(10, math.inf) is None
