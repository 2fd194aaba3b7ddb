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
import collections
import contextlib
import heapq
import logging
import time
from datetime import datetime

from log import SharedLog
from log.topics import KV_DECISIONS, KV_EVENTS
from schemas.envelope import Envelope
from schemas.events import CacheAction, CacheDecisionMade
from services.holdings import KVHoldings
from services.placement import Holding
from services.scheduling import preserved_until

__all__ = ["CacheDecisions", "KVEvents"]

_log = logging.getLogger(__name__)

_PAGE = 1000
"""kv.events records read from a partition at a time while merging the partitions."""


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

    async def dropped_on(self, session_id: str, engine_ids: list[str], since: datetime | None) -> list[str]:
        """The engines where the manager discarded the session's blocks after ``since``, read fresh
        (``refresh`` of its partition). A read that fails (the broker away, no READ on the topic)
        is logged and leaves what was read so far: routing never fails for kv.decisions."""
        try:
            await self.refresh(self.log.partition_for(session_id))
        except Exception as e:  # tried again after refresh_s
            _log.error("reading kv.decisions failed (%s); routing by what was read so far", e)
        return [e for e in engine_ids if self.dropped(session_id, e, since)]

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
        task = self._catch_up
        return task is not None and task.done() and not task.cancelled() and task.exception() is None

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
        """Fold what is new in every partition, merged in the order the engines reported it.

        One engine's events are spread over partitions (a block evicted is reported for the
        fork that held it last, a clear for ``engine/<id>``), and ``KVHoldings`` is not
        commutative: a removal or a clear folded before the store it follows is lost, and the
        store then counts blocks the engine no longer has. So the partitions are merged by
        ``occurred_at`` (the bridge stamps each record with its engine batch's time), a page of
        each at a time (memory: a page per partition, not the topic's history). Records of one
        batch share a time and keep their partition's order."""
        async with self._lock:
            pages: dict[int, collections.deque[Envelope]] = {}
            ends = {
                p: end for p, end in (await self.log.end_offsets(KV_EVENTS.name)).items() if end > self._next.get(p, 0)
            }
            heads: list[tuple[datetime, int]] = []  # (time of the partition's next record, partition)
            for partition in sorted(ends):
                if await self._next_page(partition, ends[partition], pages):
                    heads.append((pages[partition][0].occurred_at, partition))
            heapq.heapify(heads)
            while heads:
                _, partition = heapq.heappop(heads)
                envelope = pages[partition].popleft()
                self.holdings.apply(envelope.session_id, envelope.body)
                self.num_events += 1
                if pages[partition] or await self._next_page(partition, ends[partition], pages):
                    heapq.heappush(heads, (pages[partition][0].occurred_at, partition))

    async def _next_page(self, partition: int, end: int, pages: dict[int, collections.deque[Envelope]]) -> bool:
        """Read the partition's next page (``_next`` moves past it); False once it is read to ``end``."""
        page = pages.setdefault(partition, collections.deque())
        while not page and self._next.get(partition, 0) < end:
            start = self._next.get(partition, 0)
            stop = min(end, start + _PAGE)
            async for record in self.log.scan(KV_EVENTS.name, partition, start, stop):
                try:
                    page.append(self.log.decode(record))
                except Exception:  # a bad record goes to the DLQ, by the consumers that own it
                    continue
            self._next[partition] = stop
        return bool(page)

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
