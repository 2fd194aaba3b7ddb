"""What the cache manager decided about sessions' KV, as the planner reads it for routing.

The router sends a session's call to the engine that holds its prefix; the log says where its
last call ran, and ``kv.decisions`` says whether the cache manager dropped it there since
(a ``DISCARD`` after that call: the prefix is gone, recomputing it costs the same anywhere).
``CacheDecisions`` reads the new records of one ``kv.decisions`` partition when a session of it
is routed (at most every ``refresh_s``; the planner owns the session's partition of every topic,
co-partitioned), with ``SharedLog.scan``: no consumer group, no commits, only the planner's
READ on the topic. Bad records are the consumers' business (the DLQ): skipped here. It keeps the
latest decision per session and engine (one small entry each, for every session routed here).
"""

from __future__ import annotations

import time
from datetime import datetime

from log import SharedLog
from log.topics import KV_DECISIONS
from schemas.events import CacheAction, CacheDecisionMade

__all__ = ["CacheDecisions"]


class CacheDecisions:
    def __init__(self, log: SharedLog, *, refresh_s: float = 0.5) -> None:
        self.log = log
        self.refresh_s = refresh_s
        self._next: dict[int, int] = {}  # partition -> next offset to read
        self._read_at: dict[int, float] = {}
        self._latest: dict[tuple[str, str], tuple[CacheAction, datetime]] = {}  # (session, engine) -> last decision

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
        self._next[partition] = max(start, end)

    def dropped(self, session_id: str, engine_id: str, since: datetime | None) -> bool:
        """Whether the manager's latest decision for the session on that engine, made after
        ``since`` (its last call's completion), discarded its blocks there."""
        latest = self._latest.get((session_id, engine_id))
        if latest is None:
            return False
        action, at = latest
        return action is CacheAction.DISCARD and (since is None or at >= since)
