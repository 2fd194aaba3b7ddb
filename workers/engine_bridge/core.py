"""The engine bridge: one per engine instance, as the ``engine-bridge`` principal.

A ``workers.worker.Worker`` with two inputs, side by side:

- **events in** (a task running ``alongside`` the loop): the engine's KV event batches
  (``KVSource``) become ``kv.events`` records, keyed by the agent session they belong
  to. Each record's event id is ``uuid5(engine_id/epoch/seq/index)`` in the bridge's
  namespace (``event_ids``), and ``SharedLog`` ignores an event id it already
  holds, so a bridge that restarts simply reads the engine's replay buffer again from
  its oldest batch: what it had appended is skipped, what it had not is appended,
  nothing twice. Batches that the engine no longer has (``KVEventsLost``) are counted
  and logged, never invented.
- **decisions out** (the worker's loop): ``kv.decisions`` records for this engine
  (``engine_id`` matches) are carried out by the ``Actuator``, then committed after each
  poll in the bridge's consumer group
  ``engine-bridge.<engine id>``; a crash between the two applies a decision again,
  which every actuator verb tolerates (pin again, release again, ...). A decision is
  about one tool-call gap, so a *stale* one is skipped: a PRESERVE whose TTL had
  already run out when the bridge reads it, and any decision for a session the engine
  served a call to after the decision was made (the gap is over; a bridge catching up
  after an outage must not swap out a session that is back at work; the bridge reads
  the engine's buffered batches before its first decision, so that it knows). A SWAP the engine
  refuses (no host room; no host tier at all) falls back to RELEASE: both free the
  GPU blocks for others, a release keeps them cached until the LRU needs them.

On SIGTERM the loop finishes the decisions of its current poll and commits them, the
events-in task is cancelled (a batch cut short is appended again, under the same ids,
by the next run), and the bridge exits; an error in either input stops it.

Engines plug in as modules ``workers.engine_bridge.<kind>`` with two functions,
``add_arguments(parser)`` and ``create(args) -> (KVSource, Actuator)``;
``python -m workers.engine_bridge --engine <kind>`` loads one.

Crash points (``workers.crash``): ``bridge.before_append``, ``bridge.after_append``,
``bridge.after_apply``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from log import LoggedEvent, SharedLog
from log.topics import KV_DECISIONS
from log.types import Draft
from schemas.events import CacheAction, CacheDecisionMade, KVCacheHit, SessionId
from workers.crash import crash_point
from workers.engine_bridge.base import ActuationRefused, Actuator, EngineBatch, KVEventsLost, KVSource
from workers.worker import EventIds, Worker

__all__ = ["BridgeStats", "EngineBridge", "kv_event_id"]

_log = logging.getLogger(__name__)

KV_EVENT_IDS = EventIds(uuid.UUID("6f1c2a8e-4b0d-5c3e-9a7f-2d8e1b4c6a90"))
"""The bridge's: ``(engine id, epoch, batch seq, index in the batch)``."""


def kv_event_id(engine_id: str, epoch: str, seq: int, index: int) -> str:
    """The event id of the ``index``-th event of batch ``seq`` of an engine run."""
    return KV_EVENT_IDS(engine_id, epoch, seq, index)


@dataclass
class BridgeStats:
    num_batches: int = 0
    num_events: int = 0
    num_lost_batches: int = 0
    num_decisions_applied: int = 0
    num_decisions_refused: int = 0
    num_decisions_skipped: int = 0
    num_decisions_for_others: int = 0  # addressed to another engine id (check --engine-id if it grows)
    cursor: tuple[str, int] | None = None


class EngineBridge(Worker):
    role = "engine-bridge"
    topics = (KV_DECISIONS.name,)
    event_ids = KV_EVENT_IDS

    def __init__(
        self,
        log: SharedLog,
        source: KVSource,
        actuator: Actuator,
        *,
        engine_id: str,
        group: str | None = None,
        instance_id: str | None = None,
    ) -> None:
        super().__init__(log, group=group or f"engine-bridge.{engine_id}", instance_id=instance_id)
        self.source = source
        self.actuator = actuator
        self.engine_id = engine_id
        self.stats = BridgeStats()
        self._last_call_at: dict[str, float] = {}  # session -> engine time of its latest call

    # ------------------------------------------------------------ lifecycle

    async def prepare(self) -> None:
        """Start reading the engine's events, and read its buffered batches before the first
        decision (see ``_wait_for_backlog``)."""
        self.alongside(self._events_in(), name="kv-events-in")
        await self.until(self._wait_for_backlog())

    async def close(self) -> None:
        await self.source.aclose()
        await self.actuator.aclose()

    # ------------------------------------------------------------ events in

    async def _events_in(self) -> None:
        after: tuple[str, int] | None = None  # from the oldest batch the engine still has
        while True:
            try:
                async for batch in self.source.batches(after):
                    await self.append_batch(batch)
                    after = (batch.epoch, batch.seq)
                return
            except KVEventsLost as lost:
                self.stats.num_lost_batches += lost.first_available - lost.first_missing
                _log.error("%s: %s; continuing from batch %d", self.engine_id, lost, lost.first_available)
                after = (lost.epoch, lost.first_available - 1)

    async def append_batch(self, batch: EngineBatch) -> None:
        occurred_at = datetime.fromtimestamp(batch.at, UTC)
        drafts = [
            Draft(
                event.session_id,
                event.body,
                event_id=kv_event_id(self.engine_id, batch.epoch, batch.seq, index),
                occurred_at=occurred_at,
            )
            for index, event in enumerate(batch.events)
        ]
        crash_point("bridge.before_append")
        await self.log.append_many(drafts)
        crash_point("bridge.after_append")  # appended, the cursor not advanced: the restart re-reads it
        for event in batch.events:
            if isinstance(event.body, KVCacheHit):  # every call reports one, hit or not
                self._last_call_at[event.session_id] = batch.at
        self.stats.num_batches += 1
        self.stats.num_events += len(drafts)
        self.stats.cursor = (batch.epoch, batch.seq)

    # ------------------------------------------------------------ decisions out

    async def _wait_for_backlog(self) -> None:
        """Read the engine's buffered batches before judging any decision stale: after a
        restart, ``_last_call_at`` is rebuilt from them. A source that cannot tell (no
        ``caught_up`` event) is taken as caught up."""
        caught_up: asyncio.Event | None = getattr(self.source, "caught_up", None)
        if caught_up is not None:
            await caught_up.wait()

    async def handle(self, events: list[LoggedEvent]) -> None:
        for event in events:
            body = event.body
            if not isinstance(body, CacheDecisionMade):
                continue
            if body.engine_id == self.engine_id:
                await self.apply(SessionId(event.session_id), body, event.envelope.occurred_at)
            else:
                self.stats.num_decisions_for_others += 1

    def is_stale(self, session_id: SessionId, decision: CacheDecisionMade, decided_at: datetime) -> bool:
        if self._last_call_at.get(session_id, float("-inf")) > decided_at.timestamp():
            return True
        if decision.action is CacheAction.PRESERVE and decision.ttl_ms is not None:
            return decided_at + timedelta(milliseconds=decision.ttl_ms) <= datetime.now(UTC)
        return False

    async def apply(self, session_id: SessionId, decision: CacheDecisionMade, decided_at: datetime) -> None:
        if self.is_stale(session_id, decision, decided_at):
            self.stats.num_decisions_skipped += 1
            _log.info("%s: stale %s for %s skipped", self.engine_id, decision.action, session_id)
            return
        try:
            await self.actuator.apply(session_id, decision)
            crash_point("bridge.after_apply")  # applied, not committed: the restart applies it again
        except ActuationRefused as refused:
            self.stats.num_decisions_refused += 1
            _log.warning("%s refused %s for %s: %s", self.engine_id, decision.action, session_id, refused)
            if decision.action is not CacheAction.SWAP:
                return
            # A swap frees GPU memory for others; when the engine cannot swap (no host room,
            # no host tier at all as on vLLM's CPU platform), releasing to its LRU still does.
            fallback = decision.model_copy(update={"action": CacheAction.RELEASE})
            try:
                await self.actuator.apply(session_id, fallback)
            except ActuationRefused:
                return
            _log.info("%s released %s instead", self.engine_id, session_id)
        self.stats.num_decisions_applied += 1
