"""A model of vLLM v1's paged KV cache with prefix caching, plus a host (CPU) tier.

This is the mechanism: it allocates, frees, caches, pins, swaps and discards blocks
when told to. Which session to keep, swap or discard is policy and lives above it
(``decide(view, now) -> list[CacheDecision]``); the policy calls the verbs here.

Mirrored from vLLM v1 (``vllm/v1/core/block_pool.py``, ``kv_cache_manager.py``,
``kv_cache_utils.py``): the doubly linked free queue, touch on a prefix hit, LRU
eviction from the head of the free queue, freeing a request's blocks in reverse
order, uncached blocks prepended and cached ones appended on free, the
``num_tokens - 1`` cap on a prefix hit, and the BlockStored / BlockRemoved /
AllBlocksCleared events. The deliberate differences are listed on ``PagedKVCache``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from schemas.events import KVTier, SessionId
from services.engine.blocks import BlockHash

__all__ = [
    "BlockCounts",
    "BlockState",
    "CacheStats",
    "CallAllocation",
    "KVCacheError",
    "KVEvent",
    "KVEventKind",
    "OutOfBlocks",
    "PagedKVCache",
    "SessionBlocks",
    "SessionStateError",
]


# ------------------------------------------------------------------ errors


class KVCacheError(Exception):
    """Base of the KV cache's errors."""


class OutOfBlocks(KVCacheError):
    """Retryable: a tier has too few free blocks for the operation, and nothing changed.

    Free memory first (``discard``, ``swap_out``, ``release`` another session, or
    wait for a running call to end) and try again.
    """

    def __init__(self, *, tier: KVTier, num_needed: int, num_available: int, session_id: SessionId) -> None:
        self.tier = tier
        self.num_needed = num_needed
        self.num_available = num_available
        self.session_id = session_id
        free = "free or evictable" if tier is KVTier.GPU else "free"
        super().__init__(
            f"session {session_id} needs {num_needed} free {tier} blocks but only {num_available} are {free}; "
            f"nothing was changed: discard, swap out or release another session's blocks and retry"
        )


class SessionStateError(KVCacheError):
    """Fatal: a verb was called in the wrong phase of a session (a caller's bug)."""


# ------------------------------------------------------------------ values

KVEventKind = Literal["stored", "removed", "cleared"]


@dataclass(frozen=True, slots=True)
class KVEvent:
    """A change of the set of cached block hashes of one tier.

    Mirrors vLLM's ``BlockStored`` (kind "stored", with ``parent_block_hash``),
    ``BlockRemoved`` ("removed") and ``AllBlocksCleared`` ("cleared": every hash of
    ``tier`` is gone; ``block_hashes`` is empty). Folding the events in order gives
    exactly the set of hashes cached per tier. ``session_id`` is the session the change
    happened for (for an LRU eviction: the session that last held the block).
    """

    kind: KVEventKind
    tier: KVTier
    block_hashes: tuple[BlockHash, ...] = ()
    session_id: SessionId | None = None
    num_tokens: int = 0
    parent_block_hash: BlockHash | None = None


class BlockState(StrEnum):
    """The state a block is in; every block is in exactly one."""

    FREE_UNCACHED = "free-uncached"  # GPU, in the free queue, no hash: reused first
    FREE_CACHED = "free-cached"  # GPU, in the free queue, has a hash: evictable, LRU order
    IN_USE = "in-use"  # GPU, held by at least one running call (ref_cnt > 0)
    PINNED = "pinned"  # GPU, held only by pins (ref_cnt == 0, pin_cnt > 0)
    ON_HOST = "on-host"  # a host (CPU) tier slot holding a swapped-out hash


@dataclass(frozen=True, slots=True)
class CallAllocation:
    """What ``begin_call`` found and reserved for one call."""

    session_id: SessionId
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens whose KV was already on GPU (prefix hit)
    num_swapped_in_blocks: int  # prefix blocks brought back from the host tier
    num_computed_tokens: int  # prompt tokens to prefill
    num_evicted_blocks: int  # free-cached blocks whose hash this call evicted
    block_ids: tuple[int, ...]  # the call's block table, in token order

    @property
    def num_reused_tokens(self) -> int:
        """Prompt tokens not recomputed: GPU hits plus swapped-in blocks."""
        return self.num_prompt_tokens - self.num_computed_tokens


@dataclass(frozen=True, slots=True)
class BlockCounts:
    """Blocks per tier affected by a verb."""

    gpu: int
    host: int


@dataclass(frozen=True, slots=True)
class SessionBlocks:
    """What the cache holds of one session's context."""

    session_id: SessionId
    num_context_blocks: int  # full blocks of the session's context (its hash chain)
    gpu_block_ids: tuple[int, ...]  # chain blocks on GPU, in chain order
    num_host_blocks: int  # chain blocks on the host tier
    num_reusable_blocks: int  # longest chain prefix on GPU or host (what the next call can reuse)
    running: bool
    pinned: bool
    pin_until: float | None
    last_active_at: float | None


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counters since the cache was created."""

    num_calls: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # GPU prefix hits
    num_swapped_in_blocks: int = 0  # by calls and by swap_in
    num_swapped_out_blocks: int = 0
    num_evicted_blocks: int = 0  # LRU evictions of free-cached blocks
    num_discarded_blocks: int = 0  # both tiers

    @property
    def hit_rate(self) -> float:
        """GPU prefix-hit tokens over prompt tokens (0.0 before the first call)."""
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


# ------------------------------------------------------------------ internals


class _Block:
    """One GPU block. ``prev_free``/``next_free`` are only touched by ``_FreeBlockQueue``."""

    __slots__ = ("block_hash", "block_id", "last_session", "next_free", "pin_cnt", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.block_hash: BlockHash | None = None
        self.ref_cnt = 0  # running calls holding the block
        self.pin_cnt = 0  # pinned sessions holding the block
        self.last_session: SessionId | None = None
        self.prev_free: _Block | None = None
        self.next_free: _Block | None = None

    @property
    def is_free(self) -> bool:
        return self.ref_cnt == 0 and self.pin_cnt == 0

    @property
    def in_free_queue(self) -> bool:
        return self.prev_free is not None


class _FreeBlockQueue:
    """Free blocks in eviction order: the head is reused (and, if cached, evicted) first.

    Like vLLM's ``FreeKVCacheBlockQueue``, we implement this instead of a deque to
    remove a block from the middle in O(1) when a prefix hit touches it. The links
    live on the blocks themselves (no node objects), and two sentinels remove every
    edge case: a block is in the queue exactly when its ``prev_free`` is set.
    """

    def __init__(self, blocks: Sequence[_Block]) -> None:
        self._head = _Block(-1)
        self._tail = _Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> _Block:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise KVCacheError("the free queue is empty (callers check num_free_blocks first)")
        self.remove(first)
        return first

    def remove(self, block: _Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise KVCacheError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append_n(self, blocks: Iterable[_Block]) -> None:
        """Put blocks at the tail, in order: the last one is evicted last."""
        last = self._tail.prev_free
        assert last is not None
        for block in blocks:
            block.prev_free = last
            last.next_free = block
            last = block
            self.num_free_blocks += 1
        last.next_free = self._tail
        self._tail.prev_free = last

    def prepend_n(self, blocks: Iterable[_Block]) -> None:
        """Put blocks at the head, in order: the first one is reused first."""
        first = self._head.next_free
        assert first is not None
        prev = self._head
        for block in blocks:
            block.prev_free = prev
            prev.next_free = block
            prev = block
            self.num_free_blocks += 1
        prev.next_free = first
        first.prev_free = prev

    def __iter__(self) -> Iterator[_Block]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def check(self) -> list[_Block]:
        """Walk the list both ways and return its blocks (for check_invariants)."""
        forward = list(self)
        backward: list[_Block] = []
        block = self._tail.prev_free
        while block is not None and block is not self._head:
            backward.append(block)
            block = block.prev_free
        if forward != backward[::-1]:
            raise AssertionError("free queue links disagree between the two directions")
        if len(forward) != self.num_free_blocks:
            raise AssertionError(f"free queue holds {len(forward)} blocks but counts {self.num_free_blocks}")
        return forward


@dataclass(slots=True)
class _Counters:
    num_calls: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_swapped_in_blocks: int = 0
    num_swapped_out_blocks: int = 0
    num_evicted_blocks: int = 0
    num_discarded_blocks: int = 0


class _Session:
    __slots__ = (
        "call_blocks",
        "chain",
        "last_active_at",
        "num_call_tokens",
        "pin_until",
        "pinned",
        "pinned_blocks",
        "session_id",
    )

    def __init__(self, session_id: SessionId) -> None:
        self.session_id = session_id
        self.chain: list[BlockHash] = []  # hashes of the full blocks of the session's context
        self.call_blocks: list[_Block] | None = None  # the running call's block table, or None
        self.num_call_tokens = 0  # token slots the running call reserved
        self.pinned = False
        self.pin_until: float | None = None
        self.pinned_blocks: list[_Block] = []  # in chain order
        self.last_active_at: float | None = None


# ------------------------------------------------------------------ the cache


class PagedKVCache:
    """Paged KV cache of one engine: ``num_gpu_blocks`` GPU blocks of ``block_size``
    tokens with prefix caching, and ``num_host_blocks`` host (CPU) slots.

    **States.** Every GPU block is free-uncached, free-cached, in-use or pinned
    (``BlockState``); every host slot is empty or holds one hash. A block is *free*
    (in the free queue) exactly when no running call (``ref_cnt``) and no pinned
    session (``pin_cnt``) holds it. A hash is in at most one place: one GPU block or
    the host tier.

    **Sessions.** A session's context is the hash chain of the full blocks of its
    latest call (prompt, then the generated blocks passed to ``cache_blocks``). Two
    sessions with a common prefix share its blocks. A pinned session holds a pin on
    every block of its chain that is on GPU, taken at ``pin`` and refreshed at
    ``end_call`` and ``swap_in``.

    **Eviction order** (the free queue, head first; exact, and asserted by tests):
      1. Initially the queue is in block-id order.
      2. Allocation pops the head. A popped block that has a hash is evicted: its hash
         is removed (a "removed" GPU event for the session that last held it).
      3. When blocks become free (``end_call``, ``release``, ``expire``), they are
         taken in reverse block-table (chain) order, like vLLM's ``free``; of those,
         the uncached ones are prepended to the head (reused before any cached block)
         and the cached ones appended to the tail (evicted last). So the least recently
         freed cached block goes first, and within one call the tail of the context
         goes before its head (a prefix outlives its continuations).
      4. A prefix hit touches its blocks: they leave the queue and re-enter at the
         tail when freed again.
      5. ``end_call`` of a pinned session frees the blocks that left its chain before
         the call's own blocks.
      6. ``discard`` and ``swap_out`` uncache the blocks they free and prepend them to
         the head in chain order. Blocks that ``discard`` unpins but keeps cached (another
         session's context holds them) are appended as in rule 3.
      7. ``swap_in`` appends the whole reusable prefix (the blocks already on GPU and
         the ones brought in) to the tail in reverse chain order: a prefetched prefix is
         the most recently used (unless the session is pinned: then it is held).
      8. ``expire`` releases due pins in (expiry time, session id) order.
    Pinned and in-use blocks are never in the queue, hence never evicted.

    **Differences from vLLM v1**, on purpose: no null block (vLLM reserves block 0);
    no duplicate cached blocks: when a block becomes full with a hash that is already
    cached on GPU, it stays uncached (vLLM caches both copies; we keep "a hash maps to
    at most one block" so that events and the policy's view are exact); one attention
    group; a call reserves its decode slots up front (``num_decode_tokens``) instead of
    one step at a time, so a running call is never preempted (an engine model that grows
    calls step by step uses ``extend_call`` and preempts with ``end_call``). Pins, the
    host tier and the per-session bookkeeping are ours (vLLM knows requests, not sessions).

    **Verbs per cache decision** (``schemas.events.CacheAction``): PRESERVE ->
    ``pin(session, until)``, SWAP -> ``swap_out``, DISCARD -> ``discard``, PREFETCH ->
    ``swap_in``, RELEASE -> ``release``; ``expire(now)`` ends the TTLs of PRESERVE.

    ``now`` is the caller's clock in seconds; it is only recorded (and compared with
    pin expiry times): the cache never reads a clock.
    """

    def __init__(self, block_size: int, num_gpu_blocks: int, num_host_blocks: int = 0) -> None:
        if block_size <= 0 or num_gpu_blocks <= 0 or num_host_blocks < 0:
            raise ValueError(
                f"need block_size > 0, num_gpu_blocks > 0 and num_host_blocks >= 0, "
                f"got {block_size}, {num_gpu_blocks}, {num_host_blocks}"
            )
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_host_blocks = num_host_blocks
        self._blocks = [_Block(i) for i in range(num_gpu_blocks)]
        self._free = _FreeBlockQueue(self._blocks)
        self._gpu: dict[BlockHash, _Block] = {}
        self._host: dict[BlockHash, SessionId | None] = {}  # hash -> session that put it there
        self._sessions: dict[SessionId, _Session] = {}
        self._num_owners: Counter[BlockHash] = Counter()  # sessions whose chain holds the hash
        self._events: list[KVEvent] = []
        self._counters = _Counters()

    # -------------------------------------------------------------- calls

    def begin_call(
        self,
        session_id: SessionId,
        block_hashes: Sequence[BlockHash],
        *,
        num_prompt_tokens: int,
        num_decode_tokens: int = 0,
        now: float,
    ) -> CallAllocation:
        """Find the prompt's cached prefix and reserve blocks for the rest of the call.

        ``block_hashes`` are the hashes of the prompt's full blocks
        (``num_prompt_tokens // block_size`` of them); ``num_decode_tokens`` are the
        slots to reserve for generated tokens whose KV will be computed (n - 1 for n
        output tokens: the last sampled token is never fed back).

        Like vLLM's ``get_computed_blocks`` + ``allocate_slots``: the longest prefix of
        ``block_hashes`` (at most ``(num_prompt_tokens - 1) // block_size`` blocks, since
        the last prompt token is always recomputed to get logits) whose blocks are on
        GPU (hits, touched) or on the host tier (swapped in), then new blocks from the
        head of the free queue (evicting cached ones). The prompt's computed full
        blocks are cached at once, as vLLM does when it schedules them.

        Raises ``OutOfBlocks`` (nothing changed) when the free queue, less this call's
        own free hits, is too short; ``SessionStateError`` if the session is in a call.
        """
        session = self._sessions.get(session_id)
        if session is not None and session.call_blocks is not None:
            raise SessionStateError(f"session {session_id} is already in a call; end_call it before the next one")
        if num_prompt_tokens < 1 or num_decode_tokens < 0:
            raise ValueError(
                f"need num_prompt_tokens >= 1 and num_decode_tokens >= 0, "
                f"got {num_prompt_tokens} and {num_decode_tokens}"
            )
        if len(block_hashes) != num_prompt_tokens // self.block_size:
            raise ValueError(
                f"{num_prompt_tokens} prompt tokens make {num_prompt_tokens // self.block_size} full blocks of "
                f"{self.block_size}, but {len(block_hashes)} block hashes were given"
            )

        max_hit_blocks = (num_prompt_tokens - 1) // self.block_size
        prefix = self._lookup_prefix(block_hashes[:max_hit_blocks])
        gpu_hits = [block for block in prefix if block is not None]
        num_total = -(-(num_prompt_tokens + num_decode_tokens) // self.block_size)
        num_new = num_total - len(gpu_hits)
        # Touching a free hit takes it out of the free queue, so it cannot also be allocated.
        num_available = self._free.num_free_blocks - sum(1 for block in gpu_hits if block.is_free)
        if num_new > num_available:
            raise OutOfBlocks(tier=KVTier.GPU, num_needed=num_new, num_available=num_available, session_id=session_id)

        # Every check is done: from here on nothing fails.
        session = self._session(session_id)
        for block in gpu_hits:
            if block.in_free_queue:
                self._free.remove(block)
            block.ref_cnt += 1
            block.last_session = session_id
        new_blocks, num_evicted = self._allocate(num_new, session_id)
        for block in new_blocks:
            block.ref_cnt = 1

        table: list[_Block] = []
        fresh = iter(new_blocks)
        swapped_in: list[BlockHash] = []
        stored: list[int] = []  # chain indexes newly cached on GPU
        for index, hit in enumerate(prefix):
            if hit is None:  # on the host tier: copy it into a new block
                block = next(fresh)
                block_hash = block_hashes[index]
                del self._host[block_hash]
                self._cache(block, block_hash)
                swapped_in.append(block_hash)
                stored.append(index)
                table.append(block)
            else:
                table.append(hit)
        table.extend(fresh)
        self._emit_removed(KVTier.CPU, [(block_hash, session_id) for block_hash in swapped_in])
        removed_from_host = self._cache_computed(table, block_hashes, len(prefix), stored)
        self._emit_removed(KVTier.CPU, [(block_hash, session_id) for block_hash in removed_from_host])
        self._emit_stored(KVTier.GPU, block_hashes, stored, session_id)

        self._set_chain(session, list(block_hashes))
        session.call_blocks = table
        session.num_call_tokens = num_prompt_tokens + num_decode_tokens
        session.last_active_at = now

        num_cached_tokens = len(gpu_hits) * self.block_size
        num_computed_tokens = num_prompt_tokens - len(prefix) * self.block_size
        counters = self._counters
        counters.num_calls += 1
        counters.num_prompt_tokens += num_prompt_tokens
        counters.num_cached_tokens += num_cached_tokens
        counters.num_swapped_in_blocks += len(swapped_in)
        return CallAllocation(
            session_id=session_id,
            num_prompt_tokens=num_prompt_tokens,
            num_cached_tokens=num_cached_tokens,
            num_swapped_in_blocks=len(swapped_in),
            num_computed_tokens=num_computed_tokens,
            num_evicted_blocks=num_evicted,
            block_ids=tuple(block.block_id for block in table),
        )

    def num_prefix_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """Blocks of the longest prefix of ``block_hashes`` this cache holds, on GPU or on the host tier
        (what a call with this prompt would not recompute; no touch, no event). What a router in front of
        several engines reads, as the real one knows it from each engine's KV events."""
        return len(self._lookup_prefix(block_hashes))

    def blocks_to_begin(
        self, block_hashes: Sequence[BlockHash], *, num_prompt_tokens: int, num_decode_tokens: int = 0
    ) -> tuple[int, int]:
        """What ``begin_call`` with these arguments would need, without changing anything (no
        touch, no event): ``(new blocks it would allocate, blocks it could allocate)``. It raises
        ``OutOfBlocks`` exactly when the first exceeds the second. For an engine that admits a
        call only if its whole reservation fits but allocates it step by step (``extend_call``)."""
        max_hit_blocks = (num_prompt_tokens - 1) // self.block_size
        gpu_hits = [block for block in self._lookup_prefix(block_hashes[:max_hit_blocks]) if block is not None]
        num_total = -(-(num_prompt_tokens + num_decode_tokens) // self.block_size)
        num_available = self._free.num_free_blocks - sum(1 for block in gpu_hits if block.is_free)
        return num_total - len(gpu_hits), num_available

    def extend_call(self, session_id: SessionId, num_tokens: int) -> int:
        """Reserve ``num_tokens`` more token slots for the running call, as vLLM's
        ``allocate_slots`` does for each decode step: the blocks the call's reservation now
        spans beyond its block table come from the head of the free queue (evicting cached
        ones). Returns how many blocks were allocated. Raises ``OutOfBlocks`` (nothing changed)
        when the free queue is too short: free memory, or preempt a call (``end_call``).

        Additive: ``begin_call(num_decode_tokens=n)`` still reserves everything up front; an
        engine that grows calls step by step passes 0 there and extends as it decodes.
        """
        session = self._running(session_id)
        assert session.call_blocks is not None
        if num_tokens < 0:
            raise ValueError(f"need num_tokens >= 0, got {num_tokens}")
        total = session.num_call_tokens + num_tokens
        num_new = max(0, -(-total // self.block_size) - len(session.call_blocks))
        if num_new > self._free.num_free_blocks:
            raise OutOfBlocks(
                tier=KVTier.GPU, num_needed=num_new, num_available=self._free.num_free_blocks, session_id=session_id
            )
        new_blocks, _ = self._allocate(num_new, session_id)
        for block in new_blocks:
            block.ref_cnt = 1
        session.call_blocks.extend(new_blocks)
        session.num_call_tokens = total
        return num_new

    def cache_blocks(self, session_id: SessionId, block_hashes: Sequence[BlockHash]) -> None:
        """Cache the running call's blocks that became full (like vLLM's ``cache_blocks``).

        ``block_hashes`` is the whole chain of the call's full blocks so far: it extends
        the prompt's chain (checked through its last common hash, since hashes are
        chained) and fits in the call's reserved slots. Blocks whose hash is already
        cached on GPU stay uncached (no duplicates).
        """
        session = self._running(session_id)
        assert session.call_blocks is not None
        chain = session.chain
        if len(block_hashes) < len(chain) or (chain and block_hashes[len(chain) - 1] != chain[-1]):
            raise ValueError(
                f"the {len(block_hashes)} block hashes for session {session_id} do not extend its chain of "
                f"{len(chain)} (the call's prompt); pass the whole chain of the call's full blocks"
            )
        if len(block_hashes) * self.block_size > session.num_call_tokens:
            raise ValueError(
                f"{len(block_hashes)} full blocks of {self.block_size} do not fit in the "
                f"{session.num_call_tokens} token slots session {session_id}'s call reserved"
            )
        stored: list[int] = []
        removed_from_host = self._cache_computed(session.call_blocks, block_hashes, len(chain), stored)
        self._emit_removed(KVTier.CPU, [(block_hash, session_id) for block_hash in removed_from_host])
        self._emit_stored(KVTier.GPU, block_hashes, stored, session_id)
        self._set_chain(session, list(block_hashes))

    def end_call(self, session_id: SessionId, now: float) -> None:
        """The running call finished: its blocks are freed (see eviction order, rule 3),
        except those a pin of the session holds."""
        session = self._running(session_id)
        assert session.call_blocks is not None
        table, session.call_blocks = session.call_blocks, None
        session.num_call_tokens = 0
        session.last_active_at = now
        unpinned = self._refresh_pins(session) if session.pinned else []
        freed: list[_Block] = []
        for block in reversed(table):
            block.ref_cnt -= 1
            if block.is_free:
                freed.append(block)
        self._free_blocks(unpinned + freed)

    # -------------------------------------------------------------- verbs for the cache manager

    def pin(self, session_id: SessionId, until: float | None = None) -> int:
        """Keep the session's GPU blocks out of the free queue until ``release`` or ``until``.

        Pins every block of its chain now on GPU, and the ones its next calls cache.
        Pinning again updates ``until``. Returns the number of blocks pinned.
        """
        session = self._session(session_id)
        session.pinned = True
        session.pin_until = until
        self._free_blocks(self._refresh_pins(session))
        return len(session.pinned_blocks)

    def release(self, session_id: SessionId) -> int:
        """Unpin the session: its blocks that nothing else holds become free-cached,
        appended to the tail in reverse chain order. Returns how many became free."""
        session = self._sessions.get(session_id)
        if session is None or not session.pinned:
            return 0
        freed = self._unpin(session)
        self._free_blocks(freed)
        return len(freed)

    def expire(self, now: float) -> list[SessionId]:
        """Release every pin whose expiry time is ``<= now``, in (expiry, session id) order."""
        due = sorted(
            (session.pin_until, session.session_id)
            for session in self._sessions.values()
            if session.pinned and session.pin_until is not None and session.pin_until <= now
        )
        for _, session_id in due:
            self.release(session_id)
        return [session_id for _, session_id in due]

    def discard(self, session_id: SessionId) -> BlockCounts:
        """Drop the session: uncache its blocks on both tiers now and forget it.

        Its pin is released. Blocks that a running call, another session's pin, or
        another session's context also holds stay cached (they are not the session's
        alone); the others are uncached ("removed" events) and their GPU blocks
        prepended to the free queue. Returns how many blocks were removed per tier.
        """
        session = self._sessions.get(session_id)
        if session is None:
            return BlockCounts(gpu=0, host=0)
        if session.call_blocks is not None:
            raise SessionStateError(f"session {session_id} is in a call; end_call it before discarding it")
        unpinned = self._unpin(session)
        dropped: list[_Block] = []
        removed_gpu: list[tuple[BlockHash, SessionId | None]] = []
        removed_host: list[tuple[BlockHash, SessionId | None]] = []
        for block_hash in session.chain:
            if self._num_owners[block_hash] > 1:
                continue  # another session's context holds it too
            block = self._gpu.get(block_hash)
            if block is not None:
                if block.is_free:
                    if block.in_free_queue:
                        self._free.remove(block)
                    self._uncache(block)
                    dropped.append(block)
                    removed_gpu.append((block_hash, session_id))
            elif block_hash in self._host:
                del self._host[block_hash]
                removed_host.append((block_hash, session_id))
        self._free_blocks(block for block in unpinned if block.block_hash is not None)
        self._free.prepend_n(dropped)
        self._emit_removed(KVTier.GPU, removed_gpu)
        self._emit_removed(KVTier.CPU, removed_host)
        self._set_chain(session, [])
        del self._sessions[session_id]
        self._counters.num_discarded_blocks += len(removed_gpu) + len(removed_host)
        return BlockCounts(gpu=len(removed_gpu), host=len(removed_host))

    def swap_out(self, session_id: SessionId) -> int:
        """Move the session's GPU blocks to the host tier and free them on GPU.

        Moves every block of its chain on GPU that no running call and no other
        session's pin holds (shared free blocks move too: they stay reusable by all),
        and releases the session's pin. Raises ``OutOfBlocks`` (tier CPU, nothing
        changed) when the host tier lacks room. Returns the number of blocks moved.
        """
        session = self._sessions.get(session_id)
        if session is None:
            return 0
        if session.call_blocks is not None:
            raise SessionStateError(f"session {session_id} is in a call; end_call it before swapping it out")
        own_pins = {block.block_id for block in session.pinned_blocks}
        moved: list[int] = []  # chain indexes
        for index, block_hash in enumerate(session.chain):
            block = self._gpu.get(block_hash)
            if block is None or block.ref_cnt > 0:
                continue
            if block.pin_cnt - (block.block_id in own_pins) > 0:
                continue  # another session's pin holds it
            moved.append(index)
        num_available = self.num_host_blocks - len(self._host)
        if len(moved) > num_available:
            raise OutOfBlocks(
                tier=KVTier.CPU, num_needed=len(moved), num_available=num_available, session_id=session_id
            )
        blocks = [self._gpu[session.chain[index]] for index in moved]
        moved_ids = {block.block_id for block in blocks}
        # The pin held only chain blocks: each one it frees is moved now; the others stay
        # held by a running call or another session's pin.
        unpinned = self._unpin(session)
        assert all(block.block_id in moved_ids for block in unpinned)
        for index, block in zip(moved, blocks, strict=True):
            if block.in_free_queue:
                self._free.remove(block)
            self._uncache(block)
            self._host[session.chain[index]] = session_id
        self._free.prepend_n(blocks)
        self._emit_removed(KVTier.GPU, [(session.chain[index], session_id) for index in moved])
        self._emit_stored(KVTier.CPU, session.chain, moved, session_id)
        self._counters.num_swapped_out_blocks += len(moved)
        return len(moved)

    def swap_in(self, session_id: SessionId, now: float | None = None) -> int:
        """Bring the host blocks of the session's reusable prefix back to GPU (prefetch).

        The reusable prefix is the longest prefix of its chain that is on GPU or on the
        host tier; its host blocks get new GPU blocks (evicting LRU cached ones). The
        whole prefix then becomes the most recently used (eviction order, rule 7), or
        pinned if the session is. Raises ``OutOfBlocks`` (nothing changed) when the free
        queue, less the prefix's own free blocks, is too short. Returns blocks moved.
        """
        session = self._sessions.get(session_id)
        if session is None:
            return 0
        if session.call_blocks is not None:
            raise SessionStateError(f"session {session_id} is in a call; its call already swapped its prefix in")
        prefix = self._lookup_prefix(session.chain)
        missing = [index for index, block in enumerate(prefix) if block is None]
        if not missing:
            return 0
        present = [block for block in prefix if block is not None]
        num_available = self._free.num_free_blocks - sum(1 for block in present if block.is_free)
        if len(missing) > num_available:
            raise OutOfBlocks(
                tier=KVTier.GPU, num_needed=len(missing), num_available=num_available, session_id=session_id
            )
        for block in present:  # keep the allocation below from evicting the prefix itself
            if block.in_free_queue:
                self._free.remove(block)
        new_blocks, _ = self._allocate(len(missing), session_id)
        for index, block in zip(missing, new_blocks, strict=True):
            block_hash = session.chain[index]
            del self._host[block_hash]
            self._cache(block, block_hash)
        self._emit_removed(KVTier.CPU, [(session.chain[index], session_id) for index in missing])
        self._emit_stored(KVTier.GPU, session.chain, missing, session_id)
        if now is not None:
            session.last_active_at = now
        unpinned = self._refresh_pins(session) if session.pinned else []
        in_chain_order = self._lookup_gpu(session.chain[: len(prefix)])
        requeue = [block for block in reversed(in_chain_order) if block.is_free and not block.in_free_queue]
        self._free_blocks(unpinned + requeue)
        self._counters.num_swapped_in_blocks += len(missing)
        return len(missing)

    def reset_prefix_cache(self) -> bool:
        """Uncache every block on both tiers (vLLM's ``reset_prefix_cache``).

        Refused (returns False, nothing changed) while any call runs or any block is
        pinned. Emits one "cleared" event per tier.
        """
        if any(not block.is_free for block in self._blocks):
            return False
        for block in self._gpu.values():
            block.block_hash = None
        self._gpu.clear()
        self._host.clear()
        self._events.append(KVEvent(kind="cleared", tier=KVTier.GPU))
        if self.num_host_blocks:
            self._events.append(KVEvent(kind="cleared", tier=KVTier.CPU))
        return True

    def drain_events(self) -> list[KVEvent]:
        """The events since the last drain, oldest first."""
        events, self._events = self._events, []
        return events

    # -------------------------------------------------------------- observability

    @property
    def num_free_blocks(self) -> int:
        """GPU blocks in the free queue, cached ones included (like vLLM's get_num_free_blocks)."""
        return self._free.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """GPU blocks that hold a hash, in any state."""
        return len(self._gpu)

    @property
    def num_host_cached_blocks(self) -> int:
        return len(self._host)

    @property
    def num_free_host_blocks(self) -> int:
        return self.num_host_blocks - len(self._host)

    @property
    def gpu_usage(self) -> float:
        """Fraction of GPU blocks not in the free queue (in use or pinned), as vLLM reports it."""
        return 1.0 - self._free.num_free_blocks / self.num_gpu_blocks

    @property
    def host_usage(self) -> float:
        return len(self._host) / self.num_host_blocks if self.num_host_blocks else 0.0

    @property
    def stats(self) -> CacheStats:
        """A snapshot of the counters."""
        counters = self._counters
        return CacheStats(
            num_calls=counters.num_calls,
            num_prompt_tokens=counters.num_prompt_tokens,
            num_cached_tokens=counters.num_cached_tokens,
            num_swapped_in_blocks=counters.num_swapped_in_blocks,
            num_swapped_out_blocks=counters.num_swapped_out_blocks,
            num_evicted_blocks=counters.num_evicted_blocks,
            num_discarded_blocks=counters.num_discarded_blocks,
        )

    def num_blocks_by_state(self) -> dict[BlockState, int]:
        """Blocks per state (O(num_gpu_blocks)); ON_HOST counts occupied host slots."""
        counts = dict.fromkeys(BlockState, 0)
        for block in self._blocks:
            counts[self._state(block)] += 1
        counts[BlockState.ON_HOST] = len(self._host)
        return counts

    def eviction_order(self) -> list[int]:
        """Block ids of the free queue, the next one to be reused (or evicted) first."""
        return [block.block_id for block in self._free]

    def block_hash_of(self, block_id: int) -> BlockHash | None:
        return self._blocks[block_id].block_hash

    def is_on_host(self, block_hash: BlockHash) -> bool:
        return block_hash in self._host

    def cached_block_hashes(self, tier: KVTier) -> frozenset[BlockHash]:
        """Every hash cached on ``tier`` (what folding the events gives)."""
        if tier is KVTier.GPU:
            return frozenset(self._gpu)
        if tier is KVTier.CPU:
            return frozenset(self._host)
        return frozenset()

    def session_ids(self) -> list[SessionId]:
        """Sessions the cache knows (those that called, or were pinned, and are not discarded)."""
        return list(self._sessions)

    def blocks_of(self, session_id: SessionId) -> SessionBlocks:
        """What the cache holds of the session's context (empty for an unknown session)."""
        session = self._sessions.get(session_id)
        if session is None:
            return SessionBlocks(
                session_id=session_id,
                num_context_blocks=0,
                gpu_block_ids=(),
                num_host_blocks=0,
                num_reusable_blocks=0,
                running=False,
                pinned=False,
                pin_until=None,
                last_active_at=None,
            )
        return SessionBlocks(
            session_id=session_id,
            num_context_blocks=len(session.chain),
            gpu_block_ids=tuple(block.block_id for block in self._lookup_gpu(session.chain)),
            num_host_blocks=sum(1 for block_hash in session.chain if block_hash in self._host),
            num_reusable_blocks=len(self._lookup_prefix(session.chain)),
            running=session.call_blocks is not None,
            pinned=session.pinned,
            pin_until=session.pin_until,
            last_active_at=session.last_active_at,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if the internal state is inconsistent (for tests)."""
        queued = self._free.check()
        queued_ids = {block.block_id for block in queued}
        if len(queued_ids) != len(queued):
            raise AssertionError("a block is in the free queue twice")
        refs: Counter[int] = Counter()
        pins: Counter[int] = Counter()
        owners: Counter[BlockHash] = Counter()
        for session in self._sessions.values():
            owners.update(session.chain)
            if session.call_blocks is not None:
                ids = [block.block_id for block in session.call_blocks]
                if len(set(ids)) != len(ids):
                    raise AssertionError(f"session {session.session_id}'s block table holds a block twice")
                refs.update(ids)
            if not session.pinned and session.pinned_blocks:
                raise AssertionError(f"session {session.session_id} holds pins but is not pinned")
            pins.update(block.block_id for block in session.pinned_blocks)
        counts = dict.fromkeys(BlockState, 0)
        num_hashed = 0
        for block in self._blocks:
            if block.ref_cnt < 0 or block.pin_cnt < 0:
                raise AssertionError(f"block {block.block_id} has ref_cnt {block.ref_cnt}, pin_cnt {block.pin_cnt}")
            if block.ref_cnt != refs[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} but {refs[block.block_id]} calls hold it"
                )
            if block.pin_cnt != pins[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id} has pin_cnt {block.pin_cnt} but {pins[block.block_id]} sessions pin it"
                )
            if block.pin_cnt and block.block_hash is None:
                raise AssertionError(f"block {block.block_id} is pinned but holds no hash")
            if block.is_free != (block.block_id in queued_ids):
                raise AssertionError(
                    f"block {block.block_id} (ref_cnt {block.ref_cnt}, pin_cnt {block.pin_cnt}) "
                    f"{'is not' if block.is_free else 'is'} in the free queue"
                )
            if block.block_hash is not None:
                num_hashed += 1
                if self._gpu.get(block.block_hash) is not block:
                    raise AssertionError(f"block {block.block_id}'s hash {block.block_hash} maps to another block")
            counts[self._state(block)] += 1
        if num_hashed != len(self._gpu):
            raise AssertionError(f"{len(self._gpu)} cached hashes but {num_hashed} blocks hold a hash")
        if sum(counts.values()) != self.num_gpu_blocks:
            raise AssertionError(f"block states add up to {sum(counts.values())}, not {self.num_gpu_blocks}")
        if counts[BlockState.FREE_UNCACHED] + counts[BlockState.FREE_CACHED] != self._free.num_free_blocks:
            raise AssertionError("free blocks by state disagree with the free queue")
        if len(self._host) > self.num_host_blocks:
            raise AssertionError(f"{len(self._host)} hashes on a host tier of {self.num_host_blocks} blocks")
        if both := self._gpu.keys() & self._host.keys():
            raise AssertionError(f"hashes on both tiers: {sorted(both)[:3]}")
        if owners != +self._num_owners:
            raise AssertionError("the owner counts disagree with the sessions' chains")

    # -------------------------------------------------------------- internals

    def _session(self, session_id: SessionId) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            session = self._sessions[session_id] = _Session(session_id)
        return session

    def _running(self, session_id: SessionId) -> _Session:
        session = self._sessions.get(session_id)
        if session is None or session.call_blocks is None:
            raise SessionStateError(f"session {session_id} has no running call; begin_call first")
        return session

    @staticmethod
    def _state(block: _Block) -> BlockState:
        if block.ref_cnt:
            return BlockState.IN_USE
        if block.pin_cnt:
            return BlockState.PINNED
        return BlockState.FREE_UNCACHED if block.block_hash is None else BlockState.FREE_CACHED

    def _lookup_prefix(self, block_hashes: Sequence[BlockHash]) -> list[_Block | None]:
        """The longest prefix on GPU (the block) or on the host tier (None)."""
        prefix: list[_Block | None] = []
        for block_hash in block_hashes:
            block = self._gpu.get(block_hash)
            if block is None and block_hash not in self._host:
                break
            prefix.append(block)
        return prefix

    def _lookup_gpu(self, block_hashes: Iterable[BlockHash]) -> list[_Block]:
        """The blocks of these hashes that are on GPU, in order (gaps skipped)."""
        return [block for block_hash in block_hashes if (block := self._gpu.get(block_hash)) is not None]

    def _allocate(self, num_blocks: int, session_id: SessionId) -> tuple[list[_Block], int]:
        """Pop blocks from the head of the free queue, evicting cached ones; return them
        and how many were evicted."""
        evicted: list[tuple[BlockHash, SessionId | None]] = []
        blocks: list[_Block] = []
        for _ in range(num_blocks):
            block = self._free.popleft()
            if block.block_hash is not None:
                evicted.append((block.block_hash, block.last_session))
                self._uncache(block)
            block.last_session = session_id
            blocks.append(block)
        self._emit_removed(KVTier.GPU, evicted)
        self._counters.num_evicted_blocks += len(evicted)
        return blocks, len(evicted)

    def _cache(self, block: _Block, block_hash: BlockHash) -> None:
        block.block_hash = block_hash
        self._gpu[block_hash] = block

    def _uncache(self, block: _Block) -> None:
        assert block.block_hash is not None
        del self._gpu[block.block_hash]
        block.block_hash = None

    def _cache_computed(
        self, table: Sequence[_Block], block_hashes: Sequence[BlockHash], start: int, stored: list[int]
    ) -> list[BlockHash]:
        """Cache ``table[i]`` under ``block_hashes[i]`` for i >= start, skipping hashes
        already cached on GPU; a stale host copy of a hash is dropped. Appends the
        cached indexes to ``stored`` and returns the hashes dropped from the host."""
        dropped: list[BlockHash] = []
        for index in range(start, len(block_hashes)):
            block_hash = block_hashes[index]
            block = table[index]
            if block.block_hash is not None or block_hash in self._gpu:
                continue
            if block_hash in self._host:
                del self._host[block_hash]
                dropped.append(block_hash)
            self._cache(block, block_hash)
            stored.append(index)
        return dropped

    def _free_blocks(self, ordered: Iterable[_Block]) -> None:
        """Return free blocks to the queue, given in eviction priority (rule 3):
        uncached ones to the head, cached ones to the tail, each group in order."""
        uncached: list[_Block] = []
        cached: list[_Block] = []
        for block in ordered:
            assert block.is_free and not block.in_free_queue
            (uncached if block.block_hash is None else cached).append(block)
        self._free.prepend_n(uncached)
        self._free.append_n(cached)

    def _refresh_pins(self, session: _Session) -> list[_Block]:
        """Pin the chain's GPU blocks and unpin the others; return the unpinned blocks that
        became free (not yet queued), in reverse chain order."""
        wanted = self._lookup_gpu(session.chain)
        wanted_ids = {block.block_id for block in wanted}
        held_ids = {block.block_id for block in session.pinned_blocks}
        unpinned: list[_Block] = []
        for block in reversed(session.pinned_blocks):
            if block.block_id not in wanted_ids:
                block.pin_cnt -= 1
                if block.is_free:
                    unpinned.append(block)
        for block in wanted:
            if block.block_id not in held_ids:
                if block.in_free_queue:
                    self._free.remove(block)
                block.pin_cnt += 1
        session.pinned_blocks = wanted
        return unpinned

    def _unpin(self, session: _Session) -> list[_Block]:
        """Drop the session's pin; return the blocks that became free, in reverse chain order."""
        freed: list[_Block] = []
        for block in reversed(session.pinned_blocks):
            block.pin_cnt -= 1
            if block.is_free:
                freed.append(block)
        session.pinned = False
        session.pin_until = None
        session.pinned_blocks = []
        return freed

    def _set_chain(self, session: _Session, chain: list[BlockHash]) -> None:
        """Replace the session's chain, keeping the owner counts (O(changed blocks))."""
        old = session.chain
        common = _common_prefix(old, chain)
        for block_hash in old[common:]:
            self._num_owners[block_hash] -= 1
            if not self._num_owners[block_hash]:
                del self._num_owners[block_hash]
        for block_hash in chain[common:]:
            self._num_owners[block_hash] += 1
        session.chain = chain

    def _emit_stored(
        self, tier: KVTier, chain: Sequence[BlockHash], indexes: Sequence[int], session_id: SessionId
    ) -> None:
        """One "stored" event per run of consecutive chain indexes, with its parent hash."""
        start = 0
        while start < len(indexes):
            end = start + 1
            while end < len(indexes) and indexes[end] == indexes[end - 1] + 1:
                end += 1
            first, last = indexes[start], indexes[end - 1]
            self._events.append(
                KVEvent(
                    kind="stored",
                    tier=tier,
                    block_hashes=tuple(chain[first : last + 1]),
                    session_id=session_id,
                    num_tokens=(last + 1 - first) * self.block_size,
                    parent_block_hash=chain[first - 1] if first else None,
                )
            )
            start = end

    def _emit_removed(self, tier: KVTier, removed: Sequence[tuple[BlockHash, SessionId | None]]) -> None:
        """One "removed" event per run of hashes of the same session."""
        start = 0
        while start < len(removed):
            session_id = removed[start][1]
            end = start + 1
            while end < len(removed) and removed[end][1] == session_id:
                end += 1
            self._events.append(
                KVEvent(
                    kind="removed",
                    tier=tier,
                    block_hashes=tuple(block_hash for block_hash, _ in removed[start:end]),
                    session_id=session_id,
                    num_tokens=(end - start) * self.block_size,
                )
            )
            start = end


def _common_prefix(old: Sequence[BlockHash], new: Sequence[BlockHash]) -> int:
    """Length of the common prefix of two hash chains, by binary search: chained hashes
    are equal at index i only if they are equal at every index before it."""
    low, high = 0, min(len(old), len(new))
    while low < high:
        middle = (low + high + 1) // 2
        if old[middle - 1] == new[middle - 1]:
            low = middle
        else:
            high = middle - 1
    return low
