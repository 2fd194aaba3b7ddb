"""Cache decisions carried out on a ``PagedKVCache``: one mapping from a decision to the cache's verbs.

``CacheControl.apply`` is what an engine does with a ``CacheDecisionMade``; the sim
server (``workers.engines.sim_server``, its ``/kv_control``) and the benchmark's engine
models (``services.engine.serial``) both call it, so the benchmark measures what the
engine does. Pure: ``now`` and the TTL come in already on the cache's clock.

- ``PRESERVE``: pin the session's GPU blocks until ``now + ttl_s`` (no TTL: until released);
- ``RELEASE``: unpin them (they stay cached, LRU-evictable);
- ``DISCARD``: uncache them on both tiers (blocks other sessions also hold stay);
- ``SWAP``: move them to the host tier (the pin goes with them);
- ``PREFETCH``: bring the host blocks back to GPU, then pin like a ``PRESERVE``.

The decision's score is kept for every pin: the **pressure valve** (``relieve``) takes,
for a call that does not fit, the pin the cache manager ranked lowest (its score; then the
earliest expiry; then the session id), so a pin never makes a call fail. It moves that
session's blocks to the host tier when the host has room for them (its next call swaps them
back in instead of recomputing them; the engine pays the transfer), and releases the pin
otherwise (the blocks stay cached, LRU-evictable, and are usually lost). Moving only when a
call needs the room, and only the lowest-ranked pin, is what lets the cache manager leave no
room ahead of calls on an engine with a host tier (``ManagerConfig.headroom_blocks``).

**Ranked pins** (``ranked=True``, as vLLM's ``--ranked-pins``, ``workers.engines.vllm.pins``):
each session also has a rank, the priority of its newest call (``rank``; lower is served
first). A waiting call of rank ``r`` may take only the unranked pins and those ranked ``r`` or
later (``relieve(..., rank=r)``), and waits while a program ranked ahead of it holds what it
needs (``held_ahead``) instead of taking its context; a running call's growth may take any.
Pins go in the programs' order: unranked first, then the program ranked last, the score
breaking ties. The cache manager then leaves memory pressure to this valve
(``ManagerConfig.ranked_pins``): a program's context is given up when a call needs the room,
by the program served last, not ahead of time by a score that does not know the order.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

from schemas.events import CacheAction, SessionId
from services.engine.kv_cache import OutOfBlocks, PagedKVCache

__all__ = ["CacheControl", "Relieved"]


@dataclass(frozen=True, slots=True)
class Relieved:
    """What the pressure valve did: whose pin went, its score, and the blocks it moved to the
    host tier (0: the pin was released instead; the blocks stay cached until evicted)."""

    session_id: SessionId
    score: float
    swapped_blocks: int


class CacheControl:
    """Carries cache decisions out on ``cache`` and keeps the score of every pin it made (and,
    with ``ranked``, every session's rank)."""

    def __init__(self, cache: PagedKVCache, *, ranked: bool = False) -> None:
        self.cache = cache
        self.ranked = ranked
        self.pin_scores: dict[SessionId, float] = {}  # session -> the score of the decision that pinned it
        self.ranks: dict[SessionId, float] = {}  # session -> its newest call's priority (ranked pins only)

    def rank(self, session_id: SessionId, priority: float) -> None:
        """A call of the session arrived with ``priority``: its pins rank there from now on."""
        if self.ranked:
            self.ranks[session_id] = priority

    def forget(self, session_id: SessionId) -> None:
        """The session ended: no rank, no score."""
        self.ranks.pop(session_id, None)
        self.pin_scores.pop(session_id, None)

    def held_ahead(self, exclude: SessionId, rank: float) -> bool:
        """A pin of a program ranked ahead of ``rank`` is held (by a session other than
        ``exclude``): on an engine with ranked pins, a call that does not fit waits for it."""
        if not self.ranked:
            return False
        cache, ranks = self.cache, self.ranks
        return any(
            sid != exclude and cache.blocks_of(sid).pinned and ranks.get(sid, math.inf) < rank
            for sid in cache.session_ids()
        )

    def apply(
        self, session_id: SessionId, action: CacheAction, *, now: float, ttl_s: float | None, score: float
    ) -> int:
        """Carry out one decision; the blocks it pinned, freed, removed or moved. Raises the
        cache's ``KVCacheError`` (no host or GPU room, the session is in a call) with the
        cache unchanged by the failing verb."""
        cache = self.cache
        until = None if ttl_s is None else now + ttl_s
        if action is CacheAction.PRESERVE:
            blocks = cache.pin(session_id, until)
            self.pin_scores[session_id] = score
        elif action is CacheAction.RELEASE:
            blocks = cache.release(session_id)
            self.pin_scores.pop(session_id, None)
        elif action is CacheAction.DISCARD:
            self.pin_scores.pop(session_id, None)
            counts = cache.discard(session_id)
            blocks = counts.gpu + counts.host
        elif action is CacheAction.SWAP:
            blocks = cache.swap_out(session_id)
        else:  # PREFETCH: back to GPU, then held like a PRESERVE (the manager counts it pinned)
            blocks = cache.swap_in(session_id, now)
            cache.pin(session_id, until)
            self.pin_scores[session_id] = score
        return blocks

    def relieve(self, exclude: SessionId, *, rank: float | None = None) -> Relieved | None:
        """The pressure valve: take the pin ranked lowest (module docstring) of a session other
        than ``exclude``, moving its blocks to the host tier when they fit there, else releasing
        it; None when no other session's pin may be taken. ``rank``: the waiting call's, on an
        engine with ranked pins (None: a running call's growth, or no ranks)."""
        cache, ranks = self.cache, self.ranks
        pinned = [(sid, cache.blocks_of(sid)) for sid in cache.session_ids() if sid != exclude]
        order = sorted(
            (
                # The programs' order first on a ranked engine: unranked, then the one ranked last.
                -ranks.get(sid, math.inf) if self.ranked else 0.0,
                self.pin_scores.get(sid, 0.0),
                blocks.pin_until if blocks.pin_until is not None else math.inf,
                sid,
                blocks,
            )
            for sid, blocks in pinned
            if blocks.pinned and (rank is None or not self.ranked or ranks.get(sid, math.inf) >= rank)
        )
        if not order:
            return None
        _, score, _, victim, blocks = order[0]
        swapped = 0
        # A running call's blocks stay where the call needs them; without host room for them
        # (OutOfBlocks, nothing changed) the pin is released instead.
        with contextlib.suppress(OutOfBlocks):
            swapped = 0 if blocks.running else cache.swap_out(victim)  # the pin goes with the blocks
        if swapped == 0:
            cache.release(victim)
        self.pin_scores.pop(victim, None)
        return Relieved(victim, score, swapped)
