"""What the engine bridge needs from an engine: a KV event source and an actuator.

The bridge (``workers.engine_bridge.core``) is engine-agnostic. Each engine kind
(the simulated engine, vLLM) provides two things:

- a ``KVSource``: the engine's KV cache events as numbered batches, **gapless** in
  ``seq`` within one ``epoch`` (one run of the engine process). Filling a gap (vLLM:
  from its replay socket) is the source's job; when the engine no longer has the
  missing batches the source raises ``KVEventsLost`` rather than skipping silently.
  Events are already attributed to sessions (vLLM's ``BlockRemoved`` carries no
  session: the source keeps the hash -> sessions map from ``BlockStored``).
- an ``Actuator``: carries out one ``CacheDecisionMade`` for one session inside the
  engine (pin with TTL, release, discard, swap, prefetch).

The bridge appends each event under a deterministic event id derived from
``(engine_id, epoch, seq, index)``, so re-reading batches after a restart of either
side is a no-op in the log (``SharedLog`` ignores a re-appended event id).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from schemas.events import (
    CacheDecisionMade,
    KVAllBlocksCleared,
    KVBlocksRemoved,
    KVBlocksStored,
    KVCacheHit,
    KVSwapCompleted,
    SessionId,
)

__all__ = [
    "ActuationRefused",
    "Actuator",
    "EngineBatch",
    "EngineKVEvent",
    "KVBody",
    "KVEventsLost",
    "KVSource",
    "engine_session_id",
]

KVBody = KVBlocksStored | KVBlocksRemoved | KVAllBlocksCleared | KVCacheHit | KVSwapCompleted
"""Everything ``kv.events`` holds: block changes, and the engine's hit and swap reports."""


def engine_session_id(engine_id: str) -> SessionId:
    """The log session for events that belong to the engine, not to one agent session
    (e.g. ``KVAllBlocksCleared``)."""
    return SessionId(f"engine/{engine_id}")


class KVEventsLost(Exception):
    """The engine no longer has batches the bridge has not seen (its replay buffer
    moved past them, or it restarted and lost them). The bridge reports how many."""

    def __init__(self, epoch: str, first_missing: int, first_available: int) -> None:
        super().__init__(
            f"engine epoch {epoch}: batches {first_missing}..{first_available - 1} are no longer available"
        )
        self.epoch = epoch
        self.first_missing = first_missing
        self.first_available = first_available


class ActuationRefused(Exception):
    """The engine could not carry out a decision (no host room, the session is in a
    call). Actuators raise it; the bridge logs and counts it and goes on: the cache
    manager sees the cache's real state in ``kv.events``."""


@dataclass(frozen=True, slots=True)
class EngineKVEvent:
    """One KV event, attributed to the session it happened for."""

    session_id: SessionId
    body: KVBody


@dataclass(frozen=True, slots=True)
class EngineBatch:
    """One engine step's KV events. ``seq`` is gapless within ``epoch``; ``at`` is the
    engine's timestamp (seconds since the Unix epoch)."""

    epoch: str
    seq: int
    at: float
    events: tuple[EngineKVEvent, ...]


class KVSource(Protocol):
    def batches(self, after: tuple[str, int] | None) -> AsyncIterator[EngineBatch]:
        """Batches in order, forever (until closed). ``after`` is the last ``(epoch, seq)``
        the bridge has appended, or None for "from the oldest batch the engine still has".
        A new epoch (the engine restarted) starts again from its first batch."""
        ...

    async def aclose(self) -> None: ...

    # Optional: ``caught_up: asyncio.Event``, set once the source has handed out every batch
    # the engine had buffered when it started; the bridge waits for it before its first decision.


class Actuator(Protocol):
    async def apply(self, session_id: SessionId, decision: CacheDecisionMade) -> None:
        """Carry out ``decision`` for ``session_id`` in the engine. Idempotent: the bridge
        may apply a decision again after a restart."""
        ...

    async def aclose(self) -> None: ...
