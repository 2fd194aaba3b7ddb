"""What the cache manager decided about sessions' KV, as the planner reads it for routing.

The router sends a session's call to the engine that holds its prefix; the log says where its
last call ran, and ``kv.decisions`` says whether the cache manager dropped it there since
(a ``DISCARD`` after that call: the prefix is gone, recomputing it costs the same anywhere).
``CacheDecisions`` reads the new records of one ``kv.decisions`` partition when a session of it
is routed (at most every ``refresh_s``; the planner owns the session's partition of every topic,
co-partitioned), with ``SharedLog.scan``: no consumer group, no commits, only the planner's
READ on the topic. Bad records are the consumers' business (the DLQ): skipped here. It keeps the
latest decision per session and engine (one small entry each, for every session routed here),
and per session until when its latest decision preserves its KV: the warm credit of the planner's
priorities (``services.scheduling``), read the same way.

``KVEvents`` reads ``kv.events`` the same way (scan, no group, the planner's READ on the topic)
into ``services.holdings.KVHoldings``: what each engine still holds of each session's context,
whatever the cache manager decided (an engine evicts under pressure on its own). Unlike
decisions, it reads **every** partition, each up to its end at most every ``refresh_s``: the
topic is keyed by session, but an engine's blocks are the engine's, and the events about them
are not all in the routed session's partition (the sim engine reports an evicted block for the
session that last held it, which may be a fork in another partition; a reused prefix is
reported for the session that stored it; ``KVAllBlocksCleared`` is the engine's own session,
``engine/<id>``). Its memory follows what the engines hold (``KVHoldings``); reading costs each
planner the whole topic once, as the cache manager reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import datetime

from log import SharedLog
from log.topics import KV_DECISIONS, KV_EVENTS
from schemas.events import CacheAction, CacheDecisionMade
from services.holdings import KVHoldings
from services.placement import Holding
from services.scheduling import preserved_until

__all__ = ["CacheDecisions", "KVEvents"]

_log = logging.getLogger(__name__)


class CacheDecisions:
    def __init__(self, log: SharedLog, *, refresh_s: float = 0.5) -> None:
        self.log = log
        self.refresh_s = refresh_s
        self._next: dict[int, int] = {}  # partition -> next offset to read
        self._read_at: dict[int, float] = {}
        self._latest: dict[tuple[str, str], tuple[CacheAction, datetime]] = {}  # (session, engine) -> last decision
        self._preserved: dict[str, float] = {}  # session -> until when (log s) its latest decision preserves its KV

    async def refresh(self, partition: int) -> None:
        now = time.monotonic()
        if now - self._read_at.get(partition, -1e9) < self.refresh_s:
            return
        self._read_at[partition] = now
        end = (await self.log.end_offsets(KV_DECISIONS.name)).get(partition, 0)
        start = self._next.get(partition, 0)
        async for record in self.log.scan(KV_DECISIONS.name, partition, start, end):
            try:
                envelope = self.log.decode(record)
            except Exception:  # a bad record goes to the DLQ, by the consumers that own it
                continue
            body = envelope.body
            if isinstance(body, CacheDecisionMade):
                self._latest[(envelope.session_id, body.engine_id)] = (body.action, envelope.occurred_at)
                until = preserved_until(body, envelope.occurred_at.timestamp())
                if until is None:
                    self._preserved.pop(envelope.session_id, None)
                else:
                    self._preserved[envelope.session_id] = until
        self._next[partition] = max(start, end)

    def preserved(self, session_id: str, now_s: float) -> bool:
        """Whether the manager's latest decision for the session keeps its KV now (a ``PRESERVE``
        or ``PREFETCH`` whose TTL runs): the warm credit of its priority (services/scheduling.py)."""
        return self._preserved.get(session_id, float("-inf")) > now_s

    def dropped(self, session_id: str, engine_id: str, since: datetime | None) -> bool:
        """Whether the manager's latest decision for the session on that engine, made after
        ``since`` (its last call's completion), discarded its blocks there."""
        latest = self._latest.get((session_id, engine_id))
        if latest is None:
            return False
        action, at = latest
        return action is CacheAction.DISCARD and (since is None or at >= since)


class KVEvents:
    """The engines' ``kv.events``, folded into ``KVHoldings`` as the planner routes (module docstring).

    The first ``refresh`` reads the topic's whole history, which on a long-running stack is long
    (infinite retention): it runs in the background, and until it has reached the ends the topic
    had when it started, ``holding`` answers nothing, so routes go by the log alone, as without
    kv.events, instead of waiting. Later refreshes read what is new, inline, one at a time (a lock:
    two routes reading the same records at once would fold them out of order).
    """

    def __init__(self, log: SharedLog, *, refresh_s: float = 0.5) -> None:
        self.log = log
        self.refresh_s = refresh_s
        self.holdings = KVHoldings()
        self.num_events = 0
        self._next: dict[int, int] = {}  # partition -> next offset to read
        self._read_at = -1e9
        self._lock = asyncio.Lock()
        self._catch_up: asyncio.Task[None] | None = None

    @property
    def caught_up(self) -> bool:
        return self._catch_up is not None and self._catch_up.done() and not self._catch_up.cancelled()

    async def refresh(self) -> None:
        """Read what is new (module docstring). A read that fails (the broker away, no READ on the
        topic) is logged and tried again after ``refresh_s``: routing never fails for kv.events, it
        goes by what has been read (the log alone, before the catch-up)."""
        now = time.monotonic()
        if self._catch_up is None:
            if now - self._read_at < self.refresh_s:
                return
            self._read_at = now
            self._catch_up = asyncio.create_task(self._read(), name="kv-events-catch-up")
        if not self._catch_up.done():
            return
        if self._catch_up.cancelled() or self._catch_up.exception() is not None:
            error = None if self._catch_up.cancelled() else self._catch_up.exception()
            _log.error("reading kv.events failed (%s); routing by the log alone until it is read", error)
            self._catch_up = None  # started again by a refresh after refresh_s
            return
        if now - self._read_at < self.refresh_s:
            return
        self._read_at = now
        try:
            await self._read()
        except Exception as e:  # routing goes on with what was read; the next refresh continues
            _log.error("reading kv.events failed (%s); routing by what was read so far", e)

    async def wait_caught_up(self) -> None:
        """Start the first read if needed and wait for it (tests; a planner does not wait)."""
        await self.refresh()
        if self._catch_up is not None:
            await asyncio.wait([self._catch_up])

    async def _read(self) -> None:
        async with self._lock:
            for partition, end in sorted((await self.log.end_offsets(KV_EVENTS.name)).items()):
                start = self._next.get(partition, 0)
                if start >= end:
                    continue  # nothing new there
                async for record in self.log.scan(KV_EVENTS.name, partition, start, end):
                    try:
                        envelope = self.log.decode(record)
                    except Exception:  # a bad record goes to the DLQ, by the consumers that own it
                        continue
                    self.holdings.apply(envelope.session_id, envelope.body)
                    self.num_events += 1
                self._next[partition] = end

    def holding(self, session_id: str, engine_ids: list[str]) -> dict[str, Holding]:
        """Per engine whose events named the session: what it holds of it (nothing before the catch-up)."""
        if not self.caught_up:
            return {}
        h = self.holdings
        return {
            e: Holding(h.held_tokens(e, session_id), h.reported(e, session_id))
            for e in engine_ids
            if h.knows(e, session_id)
        }

    async def aclose(self) -> None:
        if self._catch_up is not None and not self._catch_up.done():
            self._catch_up.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._catch_up
