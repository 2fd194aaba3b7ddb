"""The simulated engine: one ``PagedKVCache`` plus a ``CostModel``, serving one call at a time.

It behaves like vLLM with prefix caching and no cache policy: a call reuses the
cached prefix of its prompt, prefills the rest, decodes, caches the full blocks of
what it computed (generated tokens included), and on ``end_call`` its blocks go back
to the LRU free queue. A cache manager changes that only through the cache's verbs
(``engine.cache.pin(...)``, ``swap_out``, ...), never through flags here.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b

from schemas.events import SessionId
from services.engine.blocks import encode_tokens, hash_blocks
from services.engine.cost import CostModel
from services.engine.kv_cache import KVEvent, PagedKVCache

__all__ = ["SimEngine", "SimResult"]

_MS_PER_S = 1000.0
_OUTPUT_PERSON = b"agentlog-sim-out"
_TOKENS_PER_DIGEST = 16  # a 64-byte blake2b digest read as 16 unsigned 32-bit integers
_DIGEST_FORMAT = "<16I"


@dataclass(frozen=True, slots=True)
class SimResult:
    """One finished call: its output, what the cache saved, and where the time went.

    Times are milliseconds, except ``started_at`` and ``finished_at``: seconds on the
    caller's clock, like ``now``.
    """

    session_id: SessionId
    output_token_ids: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int  # prompt tokens found on GPU
    swapped_in_blocks: int  # prompt blocks brought back from the host tier
    computed_tokens: int  # prompt tokens prefilled
    queue_ms: float  # waiting for the previous call to finish
    swap_ms: float
    prefill_ms: float  # includes the cost model's per-call overhead
    decode_ms: float
    started_at: float
    finished_at: float
    events: tuple[KVEvent, ...]  # drained from the cache at the end of the call

    @property
    def total_ms(self) -> float:
        """From arrival (``now``) to the last output token."""
        return self.queue_ms + self.swap_ms + self.prefill_ms + self.decode_ms


class SimEngine:
    """Serves calls one at a time against a paged KV cache, charging the cost model.

    A call that arrives while the previous one still runs waits for it (``queue_ms``):
    a single server, first come first served. Output tokens are a deterministic
    function of the prompt (a blake2b stream seeded by its canonical bytes), so two
    sessions with the same prompt get the same output and share its cached blocks.

    Batching would go in ``call``: a scheduler step that admits waiting requests under
    a token budget (prefills chunked), runs one decode step for every running request,
    and queues (or preempts) a request on ``OutOfBlocks`` instead of raising. The cache
    already supports several concurrent calls (one per session); only this loop is
    sequential.
    """

    def __init__(self, cache: PagedKVCache, cost: CostModel | None = None, *, vocab_size: int = 128_256) -> None:
        if cost is None:
            cost = CostModel(block_size=cache.block_size)
        if cost.block_size != cache.block_size:
            raise ValueError(
                f"the cost model's block size {cost.block_size} differs from the cache's {cache.block_size}; "
                f"build it with CostModel(block_size={cache.block_size})"
            )
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.cache = cache
        self.cost = cost
        self.vocab_size = vocab_size  # Llama-3's by default
        self._busy_until = -math.inf  # seconds: when the running call finishes

    def call(
        self,
        session_id: SessionId,
        prompt_token_ids: Sequence[int],
        max_output_tokens: int,
        now: float,
        *,
        output_token_ids: Sequence[int] | None = None,
    ) -> SimResult:
        """Run one LLM call of ``session_id`` arriving at ``now`` (seconds).

        Generates exactly ``max_output_tokens`` tokens (no stop tokens): the given
        ``output_token_ids`` when the caller decides what the model "says" (a trace
        replay whose next prompt must contain exactly these tokens), else a
        deterministic function of the prompt. Raises the cache's ``OutOfBlocks`` when
        the call does not fit, with nothing changed.
        """
        if output_token_ids is not None and len(output_token_ids) != max_output_tokens:
            raise ValueError(f"{len(output_token_ids)} output tokens given for max_output_tokens={max_output_tokens}")
        if not prompt_token_ids:
            raise ValueError(f"session {session_id}'s prompt is empty; a call needs at least one token")
        if max_output_tokens < 0:
            raise ValueError(f"max_output_tokens must not be negative, got {max_output_tokens}")
        block_size = self.cache.block_size
        num_prompt_tokens = len(prompt_token_ids)
        started_at = max(now, self._busy_until)
        block_hashes = hash_blocks(prompt_token_ids, block_size)
        # The last sampled token is never fed back, so its KV is never computed.
        num_decode_tokens = max(0, max_output_tokens - 1)
        allocation = self.cache.begin_call(
            session_id,
            block_hashes,
            num_prompt_tokens=num_prompt_tokens,
            num_decode_tokens=num_decode_tokens,
            now=started_at,
        )
        num_reused = allocation.num_reused_tokens
        swap_ms = self.cost.swap_ms(allocation.num_swapped_in_blocks)
        prefill_ms = self.cost.prefill_ms(allocation.num_computed_tokens, num_reused)
        output = (
            tuple(output_token_ids)
            if output_token_ids is not None
            else self._generate(prompt_token_ids, max_output_tokens)
        )
        decode_ms = self.cost.decode_ms(max_output_tokens, num_prompt_tokens)

        # Like vLLM, cache the full blocks of everything whose KV was computed: the
        # prompt and all but the last generated token.
        tail = [*prompt_token_ids[len(block_hashes) * block_size :], *output[:num_decode_tokens]]
        new_hashes = hash_blocks(tail, block_size, parent=block_hashes[-1] if block_hashes else None)
        if new_hashes:
            self.cache.cache_blocks(session_id, [*block_hashes, *new_hashes])
        finished_at = started_at + (swap_ms + prefill_ms + decode_ms) / _MS_PER_S
        self.cache.end_call(session_id, finished_at)
        self._busy_until = finished_at
        return SimResult(
            session_id=session_id,
            output_token_ids=output,
            prompt_tokens=num_prompt_tokens,
            cached_tokens=allocation.num_cached_tokens,
            swapped_in_blocks=allocation.num_swapped_in_blocks,
            computed_tokens=allocation.num_computed_tokens,
            queue_ms=(started_at - now) * _MS_PER_S,
            swap_ms=swap_ms,
            prefill_ms=prefill_ms,
            decode_ms=decode_ms,
            started_at=started_at,
            finished_at=finished_at,
            events=tuple(self.cache.drain_events()),
        )

    def _generate(self, prompt_token_ids: Sequence[int], num_tokens: int) -> tuple[int, ...]:
        seed = blake2b(encode_tokens(prompt_token_ids), digest_size=32, person=_OUTPUT_PERSON).digest()
        tokens: list[int] = []
        for counter in range(-(-num_tokens // _TOKENS_PER_DIGEST)):
            digest = blake2b(seed + counter.to_bytes(8, "little"), digest_size=64, person=_OUTPUT_PERSON).digest()
            tokens.extend(value % self.vocab_size for value in struct.unpack(_DIGEST_FORMAT, digest))
        return tuple(tokens[:num_tokens])
