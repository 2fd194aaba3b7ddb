"""Random sequences of every verb keep PagedKVCache consistent.

After every step: ``check_invariants()`` holds, the events replay to exactly the
cached hashes of each tier, and an ``OutOfBlocks`` left the cache as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from schemas.events import KVTier, SessionId
from services.engine.blocks import BlockHash, hash_blocks
from services.engine.kv_cache import BlockState, OutOfBlocks, PagedKVCache, SessionStateError
from tests.unit.services.engine.helpers import cached, replay

pytestmark = pytest.mark.unit

BLOCK_SIZE = 4
SESSIONS = [SessionId(f"s{i}") for i in range(3)]
SYSTEM = [7, 7, 7, 7, 8, 8, 8, 8]

tokens = st.lists(st.integers(0, 20), min_size=0, max_size=24)
session_index = st.integers(0, len(SESSIONS) - 1)
prompt_kind = st.sampled_from(["continue", "continue", "system", "fresh"])
turns = st.tuples(st.just("turn"), session_index, prompt_kind, tokens, st.integers(0, 12))
swap_outs = st.tuples(st.just("swap_out"), session_index)
operations = st.one_of(
    turns,  # begin, generate and end in one step: sessions that come back hit their prefix
    turns,
    turns,
    st.tuples(st.just("begin"), session_index, prompt_kind, tokens, st.integers(0, 12)),
    st.tuples(st.just("generate"), session_index, st.integers(1, 6)),
    st.tuples(st.just("end"), session_index),
    st.tuples(st.just("pin"), session_index, st.one_of(st.none(), st.integers(0, 20))),
    st.tuples(st.just("pin"), session_index, st.one_of(st.none(), st.integers(0, 20))),
    st.tuples(st.just("release"), session_index),
    st.tuples(st.just("expire"), st.integers(0, 20)),
    st.tuples(st.just("discard"), session_index),
    swap_outs,
    swap_outs,
    st.tuples(st.just("swap_in"), session_index),
    st.tuples(st.just("swap_in"), session_index),
    st.tuples(st.just("reset")),
)


@dataclass
class Model:
    """What the test remembers of each session: its context tokens and its running call."""

    context: dict[SessionId, list[int]] = field(default_factory=dict)
    running: dict[SessionId, tuple[list[int], int]] = field(default_factory=dict)  # tokens so far, slots


def snapshot(cache: PagedKVCache) -> object:
    return (
        cache.eviction_order(),
        cache.num_blocks_by_state(),
        cached(cache),
        cache.stats,
        [cache.blocks_of(session) for session in SESSIONS],
    )


def apply(cache: PagedKVCache, model: Model, op: tuple[Any, ...]) -> None:
    name = op[0]
    if name == "turn":
        apply(cache, model, ("begin", *op[1:]))
        apply(cache, model, ("generate", op[1], op[4]))
        apply(cache, model, ("end", op[1]))
        return
    session = SESSIONS[op[1]] if len(op) > 1 and name != "expire" else SESSIONS[0]
    running = session in model.running
    if name == "begin":
        _, _, kind, extra, decode = op
        base = {"continue": model.context.get(session, []), "system": SYSTEM, "fresh": []}[kind]
        prompt = [*base, *extra] or [1]
        if running:
            with pytest.raises(SessionStateError):
                cache.begin_call(session, hash_blocks(prompt, BLOCK_SIZE), num_prompt_tokens=len(prompt), now=0.0)
            return
        allocation = cache.begin_call(
            session,
            hash_blocks(prompt, BLOCK_SIZE),
            num_prompt_tokens=len(prompt),
            num_decode_tokens=decode,
            now=0.0,
        )
        if allocation.num_cached_tokens:
            event("begin hit on GPU")
        if allocation.num_swapped_in_blocks:
            event("begin swapped in")
        model.running[session] = (prompt, len(prompt) + decode)
    elif name == "generate":
        if not running:
            return
        so_far, slots = model.running[session]
        grown = [*so_far, *(len(so_far) + i for i in range(op[2]))][:slots]
        model.running[session] = (grown, slots)
        cache.cache_blocks(session, hash_blocks(grown, BLOCK_SIZE))
    elif name == "end":
        if not running:
            with pytest.raises(SessionStateError):
                cache.end_call(session, 0.0)
            return
        model.context[session] = model.running.pop(session)[0]
        cache.end_call(session, 1.0)
    elif name == "pin":
        cache.pin(session, until=op[2])
    elif name == "release":
        cache.release(session)
    elif name == "expire":
        due = cache.expire(op[1])
        assert not any(cache.blocks_of(s).pinned for s in due)
    elif name in ("discard", "swap_out", "swap_in"):
        if running:
            with pytest.raises(SessionStateError):
                getattr(cache, name)(session)
            return
        if cache.blocks_of(session).pinned:
            event(f"{name} of a pinned session")
        result = getattr(cache, name)(session)
        if result if isinstance(result, int) else result.gpu + result.host:
            event(f"{name} moved blocks")
        if name == "discard":
            model.context.pop(session, None)
            assert cache.blocks_of(session).num_context_blocks == 0
    elif name == "reset":
        states = cache.num_blocks_by_state()
        held = bool(states[BlockState.IN_USE] or states[BlockState.PINNED])
        assert cache.reset_prefix_cache() is not held


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_gpu_blocks=st.integers(8, 16),
    num_host_blocks=st.integers(0, 12),
    ops=st.lists(operations, min_size=20, max_size=60),
)
def test_random_operations_keep_the_invariants(
    num_gpu_blocks: int, num_host_blocks: int, ops: list[tuple[Any, ...]]
) -> None:
    cache = PagedKVCache(BLOCK_SIZE, num_gpu_blocks, num_host_blocks)
    model = Model()
    folded: dict[KVTier, set[BlockHash]] = {KVTier.GPU: set(), KVTier.CPU: set()}
    for op in ops:
        before = snapshot(cache) if op[0] in ("begin", "turn", "swap_out", "swap_in") else None
        try:
            apply(cache, model, op)
        except OutOfBlocks:
            event(f"OutOfBlocks on {op[0]}")
            assert snapshot(cache) == before
            assert cache.drain_events() == []
        cache.check_invariants()
        replay(cache.drain_events(), folded)
        assert folded == cached(cache)
