"""PagedKVCache on small exact scenarios (block size 4): hits, sharing, eviction order,
pins, discard, swap, expiry, and events that replay to the cached state."""

from __future__ import annotations

import pytest

from schemas.events import KVTier
from services.engine.blocks import hash_blocks
from services.engine.kv_cache import (
    BlockCounts,
    BlockState,
    KVEvent,
    OutOfBlocks,
    PagedKVCache,
    SessionStateError,
)
from tests.unit.services.engine.helpers import A, B, C, D, E, begin, cached, hashes, replay, turn

pytestmark = pytest.mark.unit

GPU, CPU = KVTier.GPU, KVTier.CPU
SYSTEM = list(range(8))  # two full blocks shared by several sessions


def states(cache: PagedKVCache) -> dict[BlockState, int]:
    return {state: count for state, count in cache.num_blocks_by_state().items() if count}


# ------------------------------------------------------------------ prefix hits


def test_a_session_hits_its_prefix_on_the_next_turn() -> None:
    cache = PagedKVCache(block_size=4, num_gpu_blocks=16)
    first = list(range(10))  # 2 full blocks and 2 tokens
    h = hashes(first)

    allocation = turn(cache, A, first)
    assert (allocation.num_cached_tokens, allocation.num_computed_tokens) == (0, 10)
    assert allocation.block_ids == (0, 1, 2)
    assert cache.drain_events() == [
        KVEvent(kind="stored", tier=GPU, block_hashes=(h[0], h[1]), session_id=A, num_tokens=8)
    ]
    # Freed in reverse: the partial block 2 goes to the head, the cached ones to the tail.
    assert cache.eviction_order() == [2, *range(3, 16), 1, 0]

    second = list(range(16))
    h2 = hashes(second)
    allocation = turn(cache, A, second)
    assert (allocation.num_cached_tokens, allocation.num_computed_tokens) == (8, 8)
    assert allocation.block_ids == (0, 1, 2, 3)
    assert cache.drain_events() == [
        KVEvent(
            kind="stored", tier=GPU, block_hashes=(h2[2], h2[3]), session_id=A, num_tokens=8, parent_block_hash=h2[1]
        )
    ]
    assert cache.eviction_order() == [*range(4, 16), 3, 2, 1, 0]
    assert cache.stats.num_cached_tokens == 8
    assert cache.stats.hit_rate == 8 / 26
    cache.check_invariants()


def test_a_fully_cached_prompt_recomputes_its_last_block_without_a_duplicate() -> None:
    cache = PagedKVCache(block_size=4, num_gpu_blocks=16)
    prompt = list(range(16))
    turn(cache, A, prompt)
    cache.drain_events()

    # Like vLLM, the hit stops at (16 - 1) // 4 = 3 blocks: the last token needs logits.
    allocation = turn(cache, A, prompt)
    assert (allocation.num_cached_tokens, allocation.num_computed_tokens) == (12, 4)
    assert allocation.block_ids == (0, 1, 2, 4)  # block 3 keeps the hash; block 4 stays uncached
    assert cache.drain_events() == []
    assert cache.block_hash_of(3) == hashes(prompt)[3]
    assert cache.block_hash_of(4) is None
    assert cache.num_cached_blocks == 4
    assert cache.eviction_order() == [4, *range(5, 16), 3, 2, 1, 0]
    cache.check_invariants()


def test_two_sessions_with_a_common_prefix_share_its_blocks() -> None:
    cache = PagedKVCache(block_size=4, num_gpu_blocks=16)
    begin(cache, A, [*SYSTEM, 100, 101, 102, 103, 104])
    second = begin(cache, B, [*SYSTEM, 200, 201, 202, 203, 204])

    assert second.block_ids == (0, 1, 4, 5)
    assert (second.num_cached_tokens, second.num_computed_tokens) == (8, 5)
    assert cache.blocks_of(A).gpu_block_ids == (0, 1, 2)
    assert cache.blocks_of(B).gpu_block_ids == (0, 1, 4)
    assert states(cache) == {BlockState.IN_USE: 6, BlockState.FREE_UNCACHED: 10}

    cache.end_call(A, 1.0)  # blocks 0 and 1 are still in use by b
    assert cache.eviction_order() == [3, *range(6, 16), 2]
    cache.end_call(B, 2.0)
    assert cache.eviction_order() == [5, 3, *range(6, 16), 2, 4, 1, 0]
    cache.check_invariants()


# ------------------------------------------------------------------ eviction order


def test_lru_eviction_takes_the_least_recently_freed_and_a_prefix_tail_first() -> None:
    cache = PagedKVCache(block_size=4, num_gpu_blocks=8)
    prompts = {session: [base + i for i in range(9)] for session, base in ((A, 0), (B, 100), (C, 200))}
    for session, prompt in prompts.items():
        turn(cache, session, prompt)
    assert cache.eviction_order() == [6, 7, 1, 0, 3, 2, 5, 4]
    a, b, c = (hashes(prompt) for prompt in prompts.values())
    cache.drain_events()

    # d needs 4 blocks: the two uncached ones, then a's prefix, its tail first.
    begin(cache, D, [300 + i for i in range(13)])
    assert cache.drain_events()[0] == KVEvent(
        kind="removed", tier=GPU, block_hashes=(a[1], a[0]), session_id=A, num_tokens=8
    )
    # e needs 3 more: b's whole prefix (tail first), then the tail of c's.
    begin(cache, E, [400 + i for i in range(9)])
    events = cache.drain_events()
    assert events[:2] == [
        KVEvent(kind="removed", tier=GPU, block_hashes=(b[1], b[0]), session_id=B, num_tokens=8),
        KVEvent(kind="removed", tier=GPU, block_hashes=(c[1],), session_id=C, num_tokens=4),
    ]
    assert [cache.blocks_of(s).num_reusable_blocks for s in (A, B, C)] == [0, 0, 1]
    assert cache.eviction_order() == [4]
    assert cache.stats.num_evicted_blocks == 5
    cache.check_invariants()


# ------------------------------------------------------------------ pins and OutOfBlocks


def test_pinned_blocks_are_never_evicted_and_out_of_blocks_changes_nothing() -> None:
    cache = PagedKVCache(block_size=4, num_gpu_blocks=8)
    turn(cache, A, list(range(9)))
    assert cache.pin(A) == 2
    assert states(cache) == {BlockState.PINNED: 2, BlockState.FREE_UNCACHED: 6}
    cache.drain_events()

    before = (cache.eviction_order(), states(cache), cache.stats, cache.blocks_of(A), cache.session_ids())
    with pytest.raises(OutOfBlocks) as raised:
        begin(cache, B, list(range(100, 125)))  # 7 blocks, 6 free
    assert (raised.value.tier, raised.value.num_needed, raised.value.num_available) == (GPU, 7, 6)
    assert "needs 7 free GPU blocks but only 6" in str(raised.value)
    assert (cache.eviction_order(), states(cache), cache.stats, cache.blocks_of(A), cache.session_ids()) == before
    assert cache.drain_events() == []
    cache.check_invariants()

    begin(cache, B, list(range(100, 124)))  # 6 blocks: everything but the pin
    assert cache.blocks_of(A).gpu_block_ids == (0, 1)
    assert cache.gpu_usage == 1.0
    cache.end_call(B, 1.0)
    assert cache.release(A) == 2
    assert cache.eviction_order()[-2:] == [1, 0]
    cache.check_invariants()


def test_a_call_cannot_allocate_its_own_free_hits() -> None:
    cache = PagedKVCache(block_size=4, num_gpu_blocks=8)
    turn(cache, A, list(range(9)))  # a's prefix: 2 free-cached blocks; 8 free in all
    with pytest.raises(OutOfBlocks) as raised:
        begin(cache, A, list(range(33)))  # 9 blocks: 2 hits + 7 new, but only 8 - 2 are left
    assert (raised.value.num_needed, raised.value.num_available) == (7, 6)
    allocation = begin(cache, A, list(range(32)))  # 8 blocks: 2 hits + 6 new
    assert allocation.num_cached_tokens == 8
    assert cache.num_free_blocks == 0
    cache.check_invariants()


def test_a_pinned_session_keeps_its_context_across_calls() -> None:
    cache = PagedKVCache(block_size=4, num_gpu_blocks=16)
    cache.pin(A, until=100.0)
    turn(cache, A, list(range(9)))
    assert states(cache)[BlockState.PINNED] == 2
    turn(cache, A, list(range(13)))
    assert cache.blocks_of(A).gpu_block_ids == (0, 1, 2)
    assert states(cache)[BlockState.PINNED] == 3

    # A new context (say, summarized) moves the pin; the old blocks are freed first.
    turn(cache, A, [50, 51, 52, 53, 54])
    assert cache.blocks_of(A).gpu_block_ids == (3,)
    assert states(cache)[BlockState.PINNED] == 1
    assert cache.eviction_order()[-3:] == [2, 1, 0]
    assert cache.blocks_of(A).pin_until == 100.0
    cache.check_invariants()


def test_pins_expire_in_expiry_then_session_order() -> None:
    cache = PagedKVCache(block_size=4, num_gpu_blocks=16)
    for session, base in ((A, 0), (B, 100), (C, 200), (D, 300)):
        turn(cache, session, [base + i for i in range(5)])
    cache.pin(A, until=10.0)
    cache.pin(B, until=5.0)
    cache.pin(C)  # no expiry
    cache.pin(D, until=5.0)

    assert cache.expire(4.9) == []
    assert cache.expire(10.0) == [B, D, A]
    assert [cache.blocks_of(s).pinned for s in (A, B, C, D)] == [False, False, True, False]
    blocks = {s: cache.blocks_of(s).gpu_block_ids[0] for s in (A, B, C, D)}
    assert cache.eviction_order()[-3:] == [blocks[B], blocks[D], blocks[A]]
    assert cache.expire(1000.0) == []
    cache.check_invariants()


# ------------------------------------------------------------------ discard


def test_discard_uncaches_the_session_and_frees_its_blocks_first() -> None:
    cache = PagedKVCache(block_size=4, num_gpu_blocks=8)
    turn(cache, A, list(range(9)))
    h = hashes(list(range(9)))
    cache.pin(A)
    cache.drain_events()

    assert cache.discard(A) == BlockCounts(gpu=2, host=0)
    assert cache.drain_events() == [
        KVEvent(kind="removed", tier=GPU, block_hashes=(h[0], h[1]), session_id=A, num_tokens=8)
    ]
    assert cache.eviction_order() == [0, 1, *range(2, 8)]
    assert cache.num_cached_blocks == 0
    assert cache.session_ids() == []
    assert cache.discard(A) == BlockCounts(gpu=0, host=0)
    assert cache.stats.num_discarded_blocks == 2
    cache.check_invariants()


def test_discard_keeps_what_another_session_still_holds() -> None:
    cache = PagedKVCache(block_size=4, num_gpu_blocks=16)
    turn(cache, A, [*SYSTEM, 100, 101, 102, 103, 104])
    turn(cache, B, [*SYSTEM, 200, 201, 202, 203, 204])
    a = hashes([*SYSTEM, 100, 101, 102, 103])
    cache.drain_events()

    assert cache.discard(A) == BlockCounts(gpu=1, host=0)
    assert cache.drain_events() == [KVEvent(kind="removed", tier=GPU, block_hashes=(a[2],), session_id=A, num_tokens=4)]
    assert cache.blocks_of(B).num_reusable_blocks == 3

    begin(cache, C, [*SYSTEM, 300, 301, 302])  # running on the shared prefix
    assert cache.discard(B).gpu == 1  # only b's own block
    assert cache.blocks_of(C).gpu_block_ids == (0, 1)
    with pytest.raises(SessionStateError, match="is in a call"):
        cache.discard(C)
    cache.check_invariants()


def test_discarding_a_pinned_session_returns_the_shared_prefix_to_the_lru() -> None:
    cache = PagedKVCache(block_size=4, num_gpu_blocks=16)
    turn(cache, A, [*SYSTEM, 100, 101, 102, 103, 104])
    turn(cache, B, [*SYSTEM, 200, 201, 202, 203, 204])
    cache.pin(A)
    assert states(cache)[BlockState.PINNED] == 3

    assert cache.discard(A) == BlockCounts(gpu=1, host=0)
    # b's context still holds the system prompt: unpinned, it is free-cached again.
    assert states(cache) == {BlockState.FREE_CACHED: 3, BlockState.FREE_UNCACHED: 13}
    assert cache.eviction_order()[0] == 2  # a's own block, uncached, is reused first
    assert cache.eviction_order()[-2:] == [1, 0]
    cache.check_invariants()


# ------------------------------------------------------------------ swap


def test_swap_out_then_a_call_swaps_the_prefix_back_in() -> None:
    cache = PagedKVCache(block_size=4, num_gpu_blocks=8, num_host_blocks=4)
    first = list(range(9))
    h = hashes(list(range(13)))
    turn(cache, A, first)
    cache.pin(A)
    cache.drain_events()

    assert cache.swap_out(A) == 2
    assert cache.drain_events() == [
        KVEvent(kind="removed", tier=GPU, block_hashes=(h[0], h[1]), session_id=A, num_tokens=8),
        KVEvent(kind="stored", tier=CPU, block_hashes=(h[0], h[1]), session_id=A, num_tokens=8),
    ]
    assert cache.eviction_order() == list(range(8))
    assert (cache.host_usage, cache.num_free_host_blocks) == (0.5, 2)
    assert cache.blocks_of(A).pinned is False
    assert cache.blocks_of(A).num_reusable_blocks == 2

    allocation = begin(cache, A, list(range(13)))
    assert (allocation.num_cached_tokens, allocation.num_swapped_in_blocks, allocation.num_computed_tokens) == (
        0,
        2,
        5,
    )
    assert allocation.num_reused_tokens == 8
    assert cache.drain_events() == [
        KVEvent(kind="removed", tier=CPU, block_hashes=(h[0], h[1]), session_id=A, num_tokens=8),
        KVEvent(kind="stored", tier=GPU, block_hashes=(h[0], h[1], h[2]), session_id=A, num_tokens=12),
    ]
    assert cache.num_host_cached_blocks == 0
    cache.check_invariants()


def test_swap_out_needs_room_on_the_host() -> None:
    cache = PagedKVCache(block_size=4, num_gpu_blocks=8, num_host_blocks=1)
    turn(cache, A, list(range(9)))
    cache.pin(A)
    cache.drain_events()
    with pytest.raises(OutOfBlocks) as raised:
        cache.swap_out(A)
    assert (raised.value.tier, raised.value.num_needed, raised.value.num_available) == (CPU, 2, 1)
    assert cache.blocks_of(A).pinned
    assert cache.drain_events() == []
    cache.check_invariants()


def test_swap_in_prefetches_to_the_most_recently_used_end() -> None:
    cache = PagedKVCache(block_size=4, num_gpu_blocks=8, num_host_blocks=4)
    turn(cache, A, list(range(9)))
    cache.swap_out(A)
    h = hashes(list(range(9)))
    cache.drain_events()

    assert cache.swap_in(A, now=5.0) == 2
    assert cache.drain_events() == [
        KVEvent(kind="removed", tier=CPU, block_hashes=(h[0], h[1]), session_id=A, num_tokens=8),
        KVEvent(kind="stored", tier=GPU, block_hashes=(h[0], h[1]), session_id=A, num_tokens=8),
    ]
    assert cache.eviction_order() == [*range(2, 8), 1, 0]
    assert cache.swap_in(A) == 0
    assert cache.stats.num_swapped_in_blocks == 2

    cache.swap_out(A)
    cache.pin(A)
    assert cache.swap_in(A) == 2
    assert cache.blocks_of(A).gpu_block_ids == (0, 1)
    assert states(cache)[BlockState.PINNED] == 2
    cache.check_invariants()


def test_swap_out_leaves_blocks_that_another_session_pins() -> None:
    cache = PagedKVCache(block_size=4, num_gpu_blocks=16, num_host_blocks=8)
    turn(cache, A, [*SYSTEM, 100, 101, 102, 103, 104])
    turn(cache, B, [*SYSTEM, 200, 201, 202, 203, 204])
    cache.pin(A)
    assert cache.swap_out(B) == 1
    assert cache.blocks_of(A).gpu_block_ids == (0, 1, 2)
    assert cache.blocks_of(B).gpu_block_ids == (0, 1)
    cache.check_invariants()


def test_swap_out_leaves_blocks_that_others_hold() -> None:
    cache = PagedKVCache(block_size=4, num_gpu_blocks=16, num_host_blocks=8)
    turn(cache, A, [*SYSTEM, 100, 101, 102, 103, 104])
    turn(cache, B, [*SYSTEM, 200, 201, 202, 203, 204])
    cache.pin(A)
    cache.pin(B)
    assert cache.swap_out(B) == 1  # the shared prefix is also pinned by a
    assert cache.blocks_of(B).gpu_block_ids == (0, 1)
    assert cache.blocks_of(B).num_host_blocks == 1
    assert cache.blocks_of(B).num_reusable_blocks == 3
    cache.check_invariants()


# ------------------------------------------------------------------ events, reset, misuse


def test_events_replay_to_the_cached_hashes_of_each_tier() -> None:
    cache = PagedKVCache(block_size=4, num_gpu_blocks=8, num_host_blocks=4)
    turn(cache, A, list(range(9)))
    turn(cache, B, [*SYSTEM, 9, 9, 9, 9, 9])
    cache.swap_out(A)
    turn(cache, C, list(range(100, 117)))
    cache.swap_in(A)
    cache.pin(C)
    turn(cache, D, list(range(200, 209)))
    cache.discard(B)
    assert replay(cache.drain_events()) == cached(cache)
    cache.check_invariants()


def test_reset_clears_both_tiers_unless_something_is_held() -> None:
    cache = PagedKVCache(block_size=4, num_gpu_blocks=8, num_host_blocks=4)
    turn(cache, A, list(range(9)))
    turn(cache, B, list(range(100, 109)))
    cache.swap_out(A)
    cache.pin(B)
    assert cache.reset_prefix_cache() is False
    cache.release(B)
    events = cache.drain_events()
    assert cache.reset_prefix_cache() is True
    cleared = cache.drain_events()
    assert cleared == [KVEvent(kind="cleared", tier=GPU), KVEvent(kind="cleared", tier=CPU)]
    assert replay(events + cleared) == cached(cache) == {GPU: set(), CPU: set()}
    cache.check_invariants()


def test_cache_blocks_caches_generated_blocks_within_the_reservation() -> None:
    cache = PagedKVCache(block_size=4, num_gpu_blocks=8)
    prompt = list(range(6))
    allocation = begin(cache, A, prompt, decode=5)  # 11 slots: 3 blocks
    assert allocation.block_ids == (0, 1, 2)
    context = [*prompt, 50, 51, 52, 53, 54]
    with pytest.raises(ValueError, match="do not extend"):
        cache.cache_blocks(A, hashes([9, *context[1:]]))
    cache.cache_blocks(A, hashes(context))
    assert cache.drain_events()[-1] == KVEvent(
        kind="stored",
        tier=GPU,
        block_hashes=(hashes(context)[1],),
        session_id=A,
        num_tokens=4,
        parent_block_hash=hashes(context)[0],
    )
    with pytest.raises(ValueError, match="do not fit"):
        cache.cache_blocks(A, hashes([*context, 55, 56, 57, 58, 59]))
    cache.end_call(A, 1.0)
    assert cache.blocks_of(A).num_context_blocks == 2
    cache.check_invariants()


def test_verbs_called_out_of_phase_are_refused() -> None:
    cache = PagedKVCache(block_size=4, num_gpu_blocks=8, num_host_blocks=2)
    with pytest.raises(SessionStateError, match="no running call"):
        cache.end_call(A, 0.0)
    with pytest.raises(SessionStateError, match="no running call"):
        cache.cache_blocks(A, [])
    begin(cache, A, list(range(5)))
    with pytest.raises(SessionStateError, match="already in a call"):
        begin(cache, A, list(range(5)))
    with pytest.raises(SessionStateError):
        cache.swap_out(A)
    with pytest.raises(SessionStateError):
        cache.swap_in(A)
    with pytest.raises(ValueError, match="block hashes were given"):
        cache.begin_call(B, hash_blocks(list(range(8)), 4), num_prompt_tokens=12, now=0.0)
    with pytest.raises(ValueError):
        PagedKVCache(block_size=0, num_gpu_blocks=8)
    assert cache.swap_out(B) == 0
    assert cache.release(B) == 0
    assert cache.blocks_of(B).num_context_blocks == 0
    cache.check_invariants()
