"""``CacheControl``: one mapping from a cache decision to the paged cache's verbs (the sim server's
``/kv_control`` and the engine models' ``carry_out``), and the pressure valve."""

from __future__ import annotations

import pytest

from schemas.events import CacheAction, CacheDecisionMade
from services.engine.control import CacheControl, Relieved
from services.engine.cost import CostModel
from services.engine.kv_cache import OutOfBlocks, PagedKVCache
from services.engine.serial import Sim, SimManager
from services.traces.model import Trace, TraceSession, TraceTurn
from tests.unit.services.engine.helpers import A, B, C, turn


def _cache(host: int = 8) -> PagedKVCache:
    cache = PagedKVCache(4, 8, host)
    turn(cache, A, list(range(8)))  # 2 full blocks each
    turn(cache, B, list(range(100, 108)))
    return cache


def test_each_action_is_its_verb() -> None:
    cache = _cache()
    control = CacheControl(cache)
    assert control.apply(A, CacheAction.PRESERVE, now=1.0, ttl_s=2.0, score=5.0) == 2
    assert cache.blocks_of(A).pinned and cache.blocks_of(A).pin_until == 3.0
    assert control.apply(A, CacheAction.RELEASE, now=1.5, ttl_s=None, score=0.0) == 2
    assert not cache.blocks_of(A).pinned
    assert control.apply(A, CacheAction.SWAP, now=2.0, ttl_s=10.0, score=1.0) == 2
    assert cache.num_free_host_blocks == 6
    # PREFETCH: back to GPU, then pinned with its TTL like a PRESERVE.
    assert control.apply(A, CacheAction.PREFETCH, now=3.0, ttl_s=4.0, score=7.0) == 2
    assert cache.blocks_of(A).pinned and cache.blocks_of(A).pin_until == 7.0
    assert cache.num_free_host_blocks == 8 and control.pin_scores[A] == 7.0
    assert control.apply(A, CacheAction.DISCARD, now=4.0, ttl_s=None, score=0.0) == 2
    assert A not in cache.session_ids() and A not in control.pin_scores
    cache.check_invariants()


def test_a_refused_swap_raises_and_changes_nothing() -> None:
    cache = _cache(host=1)
    control = CacheControl(cache)
    control.apply(A, CacheAction.PRESERVE, now=0.0, ttl_s=None, score=1.0)
    with pytest.raises(OutOfBlocks):
        control.apply(A, CacheAction.SWAP, now=0.0, ttl_s=None, score=1.0)
    assert cache.blocks_of(A).pinned and cache.num_free_host_blocks == 1


def test_the_valve_takes_the_lowest_score_then_the_earliest_expiry_to_the_host() -> None:
    cache = _cache()
    turn(cache, C, list(range(200, 208)))
    control = CacheControl(cache)
    control.apply(A, CacheAction.PRESERVE, now=0.0, ttl_s=9.0, score=2.0)
    control.apply(B, CacheAction.PRESERVE, now=0.0, ttl_s=5.0, score=2.0)
    control.apply(C, CacheAction.PRESERVE, now=0.0, ttl_s=1.0, score=3.0)
    assert control.relieve(exclude=C) == Relieved(B, 2.0, 2)
    assert (cache.blocks_of(B).num_host_blocks, cache.blocks_of(B).pinned) == (2, False)
    assert control.relieve(exclude=C) == Relieved(A, 2.0, 2)
    assert control.relieve(exclude=C) is None
    assert cache.blocks_of(C).pinned and cache.num_free_host_blocks == 4
    cache.check_invariants()


def test_without_host_room_the_valve_releases_the_pin() -> None:
    cache = _cache(host=1)
    control = CacheControl(cache)
    control.apply(A, CacheAction.PRESERVE, now=0.0, ttl_s=None, score=1.0)
    control.apply(B, CacheAction.PRESERVE, now=0.0, ttl_s=None, score=2.0)
    assert control.relieve(exclude=B) == Relieved(A, 1.0, 0)
    a = cache.blocks_of(A)
    assert not a.pinned and a.num_host_blocks == 0 and a.num_reusable_blocks == 2  # cached, LRU-evictable
    assert cache.num_free_host_blocks == 1 and A not in control.pin_scores
    cache.check_invariants()


def test_ranked_pins_go_in_the_programs_order_and_a_waiting_call_takes_none_ranked_ahead() -> None:
    cache = _cache()
    turn(cache, C, list(range(200, 208)))
    control = CacheControl(cache, ranked=True)
    for sid, rank, score in ((A, 1.0, 1.0), (B, 3.0, 9.0), (C, 2.0, 5.0)):
        control.rank(sid, rank)
        control.apply(sid, CacheAction.PRESERVE, now=0.0, ttl_s=None, score=score)
    # A call ranked 2.5 may take only B's (ranked after it), whatever the scores say; it waits
    # for A's and C's.
    assert control.held_ahead(C, 2.5) and not control.held_ahead(A, 1.0)
    assert control.relieve(exclude=C, rank=2.5) == Relieved(B, 9.0, 2)
    assert control.relieve(exclude=C, rank=2.5) is None
    # A running call's growth (no rank) takes any: the program ranked last first.
    assert control.relieve(exclude=B, rank=None) == Relieved(C, 5.0, 2)
    assert control.relieve(exclude=B, rank=None) == Relieved(A, 1.0, 2)
    cache.check_invariants()


def test_unranked_pins_go_first_and_a_finished_session_loses_its_rank() -> None:
    cache = _cache()
    turn(cache, C, list(range(200, 208)))
    control = CacheControl(cache, ranked=True)
    control.rank(A, 5.0)
    control.rank(C, 1.0)
    for sid in (A, B, C):
        control.apply(sid, CacheAction.PRESERVE, now=0.0, ttl_s=None, score=1.0)
    assert control.relieve(exclude=C, rank=1.0) == Relieved(B, 1.0, 2)  # B never sent a call here: unranked
    control.forget(C)
    assert C not in control.ranks and not control.held_ahead(A, 5.0)  # C's pin is unranked now


def test_without_ranked_pins_ranks_are_ignored() -> None:
    cache = _cache()
    control = CacheControl(cache)
    control.rank(A, 1.0)  # not recorded
    control.apply(A, CacheAction.PRESERVE, now=0.0, ttl_s=None, score=1.0)
    control.apply(B, CacheAction.PRESERVE, now=0.0, ttl_s=None, score=2.0)
    assert control.ranks == {} and not control.held_ahead(B, 0.0)
    assert control.relieve(exclude=B, rank=0.0) == Relieved(A, 1.0, 2)  # by score, as before


def test_the_engine_model_charges_a_carried_out_swap_and_prefetch_like_any_transfer() -> None:
    cost = CostModel()
    trace = Trace((TraceSession("a", "test", 0.0, (TraceTurn(32, 1, "t", 10.0, 0), TraceTurn(16, 1))),))
    sim = Sim(trace, SimManager(), gpu_blocks=8, host_blocks=8, cost=cost)
    turn(sim.cache, A, list(range(32)))  # 2 blocks cached: the engine model's cache, driven by hand

    def decision(action: CacheAction, ttl_ms: int | None) -> CacheDecisionMade:
        return CacheDecisionMade(engine_id="sim-0", action=action, ttl_ms=ttl_ms, score=1.0, num_blocks=2, reason="")

    assert sim.carry_out(decision(CacheAction.SWAP, 5000), A, 0.0) == 2
    assert sim.on_host == {A: 2} and sim.m.transfer_s == pytest.approx(cost.swap_ms(2) / 1000)
    assert sim.carry_out(decision(CacheAction.PREFETCH, 2000), A, 1.0) == 2
    assert sim.on_host == {} and (sim.m.prefetches, sim.m.prefetched_blocks, sim.m.swapped_in_blocks) == (1, 2, 2)
    assert sim.m.transfer_s == pytest.approx(2 * cost.swap_ms(2) / 1000)
    assert sim.cache.blocks_of(A).pin_until == 3.0  # 2000 ms of TTL from 1.0
    # A decision the cache refuses (a swap of a session in a call: the sim server's 409) changes
    # nothing and is counted.
    sim.cache.begin_call(B, [], num_prompt_tokens=1, now=2.0)
    assert sim.carry_out(decision(CacheAction.SWAP, None), B, 2.0) == 0
    assert sim.m.refused == 1
