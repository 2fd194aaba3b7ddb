"""The simulated inference engine: a paged KV cache with prefix caching and a host
tier (a model of vLLM v1's), a cost model, and an engine that ties them together.

Pure mechanism, no I/O and no clock: the cache manager's policy decides, and calls
the verbs of ``PagedKVCache`` (pin, release, discard, swap_out, swap_in, expire).
"""

from services.engine.blocks import BlockHash, hash_blocks, num_full_blocks
from services.engine.cost import CostModel, ReloadMethod
from services.engine.kv_cache import (
    BlockCounts,
    BlockState,
    CacheStats,
    CallAllocation,
    KVCacheError,
    KVEvent,
    KVEventKind,
    OutOfBlocks,
    PagedKVCache,
    SessionBlocks,
    SessionStateError,
)
from services.engine.sim import SimEngine, SimResult

__all__ = [
    "BlockCounts",
    "BlockHash",
    "BlockState",
    "CacheStats",
    "CallAllocation",
    "CostModel",
    "KVCacheError",
    "KVEvent",
    "KVEventKind",
    "OutOfBlocks",
    "PagedKVCache",
    "ReloadMethod",
    "SessionBlocks",
    "SessionStateError",
    "SimEngine",
    "SimResult",
    "hash_blocks",
    "num_full_blocks",
]
