"""Shared helpers for the engine tests: calls by token list, and replaying events."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from schemas.events import KVTier, SessionId
from services.engine.blocks import BlockHash, hash_blocks
from services.engine.kv_cache import CallAllocation, KVEvent, PagedKVCache

A, B, C, D, E = (SessionId(name) for name in "abcde")


def begin(cache: PagedKVCache, session: SessionId, tokens: Sequence[int], *, decode: int = 0) -> CallAllocation:
    return cache.begin_call(
        session,
        hash_blocks(tokens, cache.block_size),
        num_prompt_tokens=len(tokens),
        num_decode_tokens=decode,
        now=0.0,
    )


def turn(cache: PagedKVCache, session: SessionId, tokens: Sequence[int], now: float = 0.0) -> CallAllocation:
    allocation = begin(cache, session, tokens)
    cache.end_call(session, now)
    return allocation


def hashes(tokens: Sequence[int], block_size: int = 4) -> list[BlockHash]:
    return hash_blocks(tokens, block_size)


def replay(
    events: Iterable[KVEvent], state: dict[KVTier, set[BlockHash]] | None = None
) -> dict[KVTier, set[BlockHash]]:
    """Fold events into the set of cached hashes per tier, checking each one applies."""
    state = state if state is not None else {KVTier.GPU: set(), KVTier.CPU: set()}
    for event in events:
        tier = state[event.tier]
        if event.kind == "stored":
            assert not tier & set(event.block_hashes), f"stored twice: {event}"
            assert event.num_tokens > 0
            tier.update(event.block_hashes)
        elif event.kind == "removed":
            assert set(event.block_hashes) <= tier, f"removed but not stored: {event}"
            tier.difference_update(event.block_hashes)
        else:
            tier.clear()
    return state


def cached(cache: PagedKVCache) -> dict[KVTier, set[BlockHash]]:
    return {tier: set(cache.cached_block_hashes(tier)) for tier in (KVTier.GPU, KVTier.CPU)}
