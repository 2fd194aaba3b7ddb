"""What each engine still holds of each session's prefix, folded from kv.events (services/holdings.py)."""

from __future__ import annotations

import pytest

from schemas.events import KVAllBlocksCleared, KVBlocksRemoved, KVBlocksStored, KVCacheHit, KVTier
from services.holdings import KVHoldings

pytestmark = pytest.mark.unit

BS = 16


def stored(engine: str, hashes: str, parent: str | None = None, tier: KVTier = KVTier.GPU) -> KVBlocksStored:
    """Blocks named by single letters: ``stored("e0", "abc")`` stores a, b, c in that order."""
    return KVBlocksStored(
        engine_id=engine, block_hashes=list(hashes), parent_block_hash=parent, num_tokens=len(hashes) * BS,
        block_size=BS, tier=tier,
    )  # fmt: skip


def removed(engine: str, hashes: str, tier: KVTier = KVTier.GPU) -> KVBlocksRemoved:
    return KVBlocksRemoved(engine_id=engine, block_hashes=list(hashes), tier=tier)


def hit(engine: str, call: str) -> KVCacheHit:
    return KVCacheHit(engine_id=engine, call_id=call, cached_tokens=0, prompt_tokens=1, tier=KVTier.GPU)


def fold(*events: tuple[str, object]) -> KVHoldings:
    h = KVHoldings()
    for session, body in events:
        h.apply(session, body)  # type: ignore[arg-type]
    return h


def test_a_session_holds_its_stored_blocks_on_that_engine_only() -> None:
    h = fold(("s", stored("e0", "abc")), ("s", stored("e0", "de", parent="c")), ("s", hit("e0", "llm-0")))
    assert h.held_blocks("e0", "s") == (5, 5) and h.held_tokens("e0", "s") == 5 * BS
    assert h.held_tokens("e1", "s") == 0 and not h.knows("e1", "s")
    assert h.knows("e0", "s") and h.reported("e0", "s") == "llm-0" and h.reported("e1", "s") is None
    assert h.engines() == ["e0"]


def test_an_eviction_of_the_tail_leaves_the_head_and_one_of_the_head_leaves_nothing_usable() -> None:
    h = fold(("s", stored("e0", "abcde")), ("s", removed("e0", "ed")))
    assert h.held_blocks("e0", "s") == (3, 5)
    # Prefix caching serves a prefix: with b gone, c is of no use.
    h.apply("s", removed("e0", "b"))
    assert h.held_blocks("e0", "s") == (1, 5)


def test_a_removal_reported_for_another_session_removes_the_block_for_every_session() -> None:
    # The sim engine names the session that last held an evicted block: here a fork sharing it.
    h = fold(("p", stored("e0", "abc")), ("f", stored("e0", "xy", parent="c")), ("f", removed("e0", "b")))
    assert h.held_blocks("e0", "p") == (1, 3)
    assert h.held_blocks("e0", "f") == (1, 5)  # a, b, c of its parent, then its own x, y


def test_a_forks_context_resolves_through_its_parents_blocks_whatever_order_they_are_read_in() -> None:
    # The fork's partition read before the parent's: its base is resolved when asked.
    h = fold(("f", stored("e0", "xy", parent="c")), ("p", stored("e0", "abc")), ("p", stored("e0", "d", parent="c")))
    assert h.held_blocks("e0", "f") == (5, 5)
    assert h.held_blocks("e0", "p") == (4, 4)
    # A base nobody is known to have stored counts as not held.
    lone = fold(("f", stored("e0", "xy", parent="q")))
    assert lone.held_blocks("e0", "f") == (0, 3)


def test_a_host_copy_counts_until_both_tiers_lost_the_block() -> None:
    h = fold(("s", stored("e0", "abc")), ("s", stored("e0", "abc", tier=KVTier.CPU)), ("s", removed("e0", "abc")))
    assert h.held_blocks("e0", "s") == (3, 3)  # swapped out: on the host, swapped back in on a hit
    h.apply("s", removed("e0", "c", tier=KVTier.CPU))
    assert h.held_blocks("e0", "s") == (2, 3)


def test_a_store_repeating_part_of_the_chain_keeps_it_and_a_different_continuation_replaces_the_rest() -> None:
    h = fold(("s", stored("e0", "abcd")), ("s", stored("e0", "b", parent="a", tier=KVTier.CPU)))
    assert h.held_blocks("e0", "s") == (4, 4)
    h.apply("s", stored("e0", "xy", parent="b"))  # rewound to b (a restore), then a new context
    assert h.held_blocks("e0", "s") == (4, 4)
    h.apply("s", stored("e0", "pq"))  # recomputed from scratch: a new chain
    assert h.held_blocks("e0", "s") == (2, 2)


def test_an_engine_that_cleared_its_cache_holds_nothing_but_remembers_whom_it_reported() -> None:
    h = fold(("s", stored("e0", "abc")), ("s", hit("e0", "llm-2")), ("s", stored("e1", "abc")))
    h.apply("engine/e0", KVAllBlocksCleared(engine_id="e0"))
    assert h.held_blocks("e0", "s") == (0, 0) and h.knows("e0", "s") and h.reported("e0", "s") == "llm-2"
    assert h.held_blocks("e1", "s") == (3, 3)


def test_chains_holding_none_of_their_blocks_are_swept_as_the_engine_gains_chains() -> None:
    h = KVHoldings()
    for i in range(64):
        sid = f"s{i}"
        h.apply(sid, stored("e0", chr(0x100 + 2 * i) + chr(0x101 + 2 * i)))
        h.apply(sid, hit("e0", "llm-0"))
        if i < 60:
            h.apply(sid, removed("e0", chr(0x100 + 2 * i) + chr(0x101 + 2 * i)))
    engine = h._engines["e0"]
    assert sorted(engine.chains) == sorted(f"s{i}" for i in range(60, 64))  # the 64th chain swept the evicted
    assert h.knows("e0", "s0") and h.held_tokens("e0", "s0") == 0  # known to hold nothing, not unknown
    assert h.held_blocks("e0", "s63") == (2, 2)


def test_other_bodies_and_unknown_engines_change_nothing() -> None:
    h = fold(("s", removed("e9", "a")), ("s", stored("e0", "")))
    assert h.held_blocks("e9", "s") == (0, 0) and h.held_blocks("e0", "s") == (0, 0)
    assert h.held_tokens("nowhere", "s") == 0
