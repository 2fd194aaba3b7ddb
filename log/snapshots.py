"""Snapshots of folded session state in Postgres, and reading a session's log from a cut.

A snapshot is what a checkpoint saw: the session's folded state (opaque JSON
here; ``services.checkpoint.state_to_json`` makes it), its cut (per session
topic, the offset of the next record after it), the tail of each of the
session's hash chains at the cut (seq and hash of the last record below it),
and the state's digest (the one the ``CheckpointTaken`` on the log carries).

Replay from a snapshot = the snapshot's state + the session's records at or
after the cut. Those records are verified like any consumer does, with each
chain seeded from the snapshot's tails, so a record that does not link to the
snapshot's last record is left out, as ``SharedLog.history`` would.

Reading the tail: each topic's partition is scanned from the cut only (other
sessions' records there are skipped by key, undecoded), so the cost is the
part of the log written since the snapshot, not the session's whole history.

The table lives in schema ``agentlog_snapshots`` of the given server, keyed by
(namespace, session, checkpoint); writing one twice keeps the first
(checkpoints are immutable, a retried checkpoint writes the same content).

**Partition marks** (``partition_marks``, same schema): where a role worker's
consumer group may start reading one partition again (``PartitionMark``,
computed by ``services/marks.py``), keyed by (namespace, group, partition); the
newest one replaces the last. A mark is trusted like a committed offset: for
nothing but "no record below these offsets is needed beyond the sessions it
lists" (docs/branches.md, "Worker recovery from marks").
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import asyncpg

from log import topics as topic_table
from log.chain import ChainVerifier
from log.errors import RecordError
from log.shared_log import SharedLog
from log.types import LoggedEvent, PartitionMark
from schemas.envelope import Envelope
from schemas.events import KVAllBlocksCleared

DDL = """
CREATE SCHEMA IF NOT EXISTS agentlog_snapshots;
CREATE TABLE IF NOT EXISTS agentlog_snapshots.snapshots (
    id bigserial, namespace text NOT NULL, session_id text NOT NULL, checkpoint_id text NOT NULL,
    cut jsonb NOT NULL, tails jsonb NOT NULL, state jsonb NOT NULL, digest text NOT NULL, num_events int NOT NULL,
    taken_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (namespace, session_id, checkpoint_id));
CREATE TABLE IF NOT EXISTS agentlog_snapshots.partition_marks (
    namespace text NOT NULL, group_id text NOT NULL, partition int NOT NULL,
    start jsonb NOT NULL, read_to jsonb NOT NULL, sessions jsonb NOT NULL,
    saved_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (namespace, group_id, partition));
"""


@dataclass(frozen=True)
class ChainTailAt:
    """The last record of one (topic, session) chain below a cut."""

    seq: int
    hash_hex: str


@dataclass(frozen=True)
class Snapshot:
    session_id: str
    checkpoint_id: str
    cut: dict[str, int]
    tails: dict[str, ChainTailAt]
    state: dict[str, Any]
    digest: str
    num_events: int


class SnapshotStore:
    """Snapshots of one log namespace in a Postgres database."""

    def __init__(self, dsn: str, namespace: str = "") -> None:
        self.dsn = dsn
        self.namespace = namespace
        self._pool: asyncpg.Pool | None = None

    async def start(self) -> SnapshotStore:
        self._pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=2)
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('agentlog:snapshots'))")
            await conn.execute(DDL)
        return self

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def __aenter__(self) -> SnapshotStore:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError("snapshot store not started")
        return self._pool

    async def save(self, snapshot: Snapshot) -> bool:
        """Store a snapshot; False when this checkpoint already has one (the first is kept)."""
        status = await self.pool.execute(
            "INSERT INTO agentlog_snapshots.snapshots "
            "(namespace, session_id, checkpoint_id, cut, tails, state, digest, num_events) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING",
            self.namespace,
            snapshot.session_id,
            snapshot.checkpoint_id,
            json.dumps(snapshot.cut),
            json.dumps({t: [c.seq, c.hash_hex] for t, c in snapshot.tails.items()}),
            json.dumps(snapshot.state),
            snapshot.digest,
            snapshot.num_events,
        )
        return bool(status.endswith(" 1"))

    async def latest(self, session_id: str) -> Snapshot | None:
        """The session's newest snapshot (any snapshot is a valid start: the tail holds the rest)."""
        row = await self.pool.fetchrow(
            "SELECT * FROM agentlog_snapshots.snapshots WHERE namespace = $1 AND session_id = $2 "
            "ORDER BY id DESC LIMIT 1",
            self.namespace,
            session_id,
        )
        return _snapshot(row) if row else None

    async def get(self, session_id: str, checkpoint_id: str) -> Snapshot | None:
        row = await self.pool.fetchrow(
            "SELECT * FROM agentlog_snapshots.snapshots WHERE namespace = $1 AND session_id = $2 "
            "AND checkpoint_id = $3",
            self.namespace,
            session_id,
            checkpoint_id,
        )
        return _snapshot(row) if row else None

    async def get_many(self, wanted: dict[str, str]) -> dict[str, Snapshot]:
        """The snapshots of ``session -> checkpoint`` that exist, in one query (a restart
        loads every snapshot its partition marks name)."""
        if not wanted:
            return {}
        rows = await self.pool.fetch(
            "SELECT s.* FROM agentlog_snapshots.snapshots s "
            "JOIN unnest($2::text[], $3::text[]) AS w(session_id, checkpoint_id) "
            "ON s.session_id = w.session_id AND s.checkpoint_id = w.checkpoint_id WHERE s.namespace = $1",
            self.namespace,
            list(wanted),
            list(wanted.values()),
        )
        return {row["session_id"]: _snapshot(row) for row in rows}

    async def checkpoint_ids(self, session_ids: Iterable[str]) -> dict[str, set[str]]:
        """For each of the sessions, the checkpoints that have a snapshot (one query)."""
        rows = await self.pool.fetch(
            "SELECT session_id, checkpoint_id FROM agentlog_snapshots.snapshots "
            "WHERE namespace = $1 AND session_id = ANY($2::text[])",
            self.namespace,
            list(session_ids),
        )
        found: dict[str, set[str]] = {}
        for row in rows:
            found.setdefault(row["session_id"], set()).add(row["checkpoint_id"])
        return found

    async def save_mark(self, group: str, mark: PartitionMark) -> None:
        await self.pool.execute(
            "INSERT INTO agentlog_snapshots.partition_marks (namespace, group_id, partition, start, read_to, sessions) "
            "VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (namespace, group_id, partition) DO UPDATE "
            "SET start = EXCLUDED.start, read_to = EXCLUDED.read_to, sessions = EXCLUDED.sessions, saved_at = now()",
            self.namespace,
            group,
            mark.partition,
            json.dumps(mark.start),
            json.dumps(mark.read_to),
            json.dumps(mark.sessions),
        )

    async def load_mark(self, group: str, partition: int) -> PartitionMark | None:
        row = await self.pool.fetchrow(
            "SELECT start, read_to, sessions FROM agentlog_snapshots.partition_marks "
            "WHERE namespace = $1 AND group_id = $2 AND partition = $3",
            self.namespace,
            group,
            partition,
        )
        if row is None:
            return None
        return PartitionMark(
            partition,
            {k: int(v) for k, v in json.loads(row["start"]).items()},
            {k: int(v) for k, v in json.loads(row["read_to"]).items()},
            {k: (str(v) if v is not None else None) for k, v in json.loads(row["sessions"]).items()},
        )

    async def count(self, session_id: str) -> int:
        n = await self.pool.fetchval(
            "SELECT count(*) FROM agentlog_snapshots.snapshots WHERE namespace = $1 AND session_id = $2",
            self.namespace,
            session_id,
        )
        return int(n)


def _snapshot(row: Any) -> Snapshot:
    tails = {t: ChainTailAt(int(v[0]), str(v[1])) for t, v in json.loads(row["tails"]).items()}
    return Snapshot(
        row["session_id"],
        row["checkpoint_id"],
        {k: int(v) for k, v in json.loads(row["cut"]).items()},
        tails,
        json.loads(row["state"]),
        row["digest"],
        row["num_events"],
    )


def tails_below(events: Iterable[LoggedEvent], cut: Mapping[str, int]) -> dict[str, ChainTailAt]:
    """Each topic's chain tail among ``events`` (one session's) below ``cut``."""
    tails: dict[str, ChainTailAt] = {}
    for event in events:
        if event.position.offset < cut.get(event.topic, 0):
            last = tails.get(event.topic)
            if last is None or event.seq > last.seq:
                tails[event.topic] = ChainTailAt(event.seq, event.envelope.hash.hex())
    return tails


async def read_tail(
    log: SharedLog, session_id: str, cut: Mapping[str, int], tails: Mapping[str, ChainTailAt]
) -> list[LoggedEvent]:
    """The session's verified records at or after ``cut``, in ``SharedLog.history`` order."""
    partition = log.partition_for(session_id)
    key = session_id.encode()
    found: list[LoggedEvent] = []
    for name, start in cut.items():
        topic = topic_table.topic(name)
        verifier = ChainVerifier()
        if (tail := tails.get(name)) is not None:
            # Only session_id, seq and hash matter to the verifier's tail.
            seed = Envelope.model_construct(
                event_id="",
                session_id=session_id,
                seq=tail.seq,
                actor="",
                occurred_at=datetime.fromtimestamp(0, UTC),
                causation_id=None,
                prev_hash=b"",
                body=KVAllBlocksCleared(engine_id=""),
                hash=bytes.fromhex(tail.hash_hex),
            )
            verifier.accept(topic, seed)
        records = [r async for r in log.backend.scan(name, partition, start) if r.key == key]
        for record in records:
            try:
                envelope = log.codec.decode(record.value)
                verifier.verify(topic, record.key, envelope, record.position)
            except RecordError:
                continue  # consumers dead-letter it
            found.append(LoggedEvent(record.position, envelope))
    found.sort(key=lambda e: (e.envelope.occurred_at, topic_table.TOPIC_ORDER[e.topic], e.seq))
    return found
