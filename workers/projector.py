"""The projector: a Postgres read model of the log (``python -m workers.projector``).

It reads every topic (its own principal, ``projector``: read-only on the log but for the
DLQ) and keeps the tables of ``services.projection.TABLES`` up to date in the schema
``agentlog_read`` (``agentlog_read_<namespace>`` in a namespace) of ``--model-url``.

**Exactly once, by one transaction.** For each poll the projector writes the rows its
events imply *and* the offsets after them (``offsets``: the next record to read per topic
and partition, ``offset + 1`` of the last one projected) in one transaction. So a crash
anywhere (``projector.mid_transaction``: SIGKILL with the rows written and not committed;
``projector.after_commit``) leaves the model and its offsets together: a restart reads
each partition from the offsets in the model, never from the consumer group's (which it
also commits, for lag metrics only). Nothing is counted twice or skipped.

**What it cannot project** (a value Postgres refuses, e.g. a NUL character in a text) is
rolled back to a savepoint, dead-lettered (``Unprojectable``, with Postgres's reason) and
skipped; the rest of the poll is kept. The dead letter is appended before the
transaction commits, so a crash between them may set the record aside twice, never lose it.

``--until-caught-up`` stops once every partition is projected up to the end offsets seen at
start (what ``logctl projector rebuild`` runs after dropping the schema).

Crash points: ``projector.mid_transaction``, ``projector.after_commit``.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import asyncpg

from log import TOPICS, LoggedEvent, SharedLog
from log.consumer import EventConsumer, StartAt
from log.errors import RecordError
from log.topics import AGENT_DLQ
from log.types import RawRecord
from services.projection import KEYS, TABLES, Merge, Upsert, rows
from workers.config import log_namespace
from workers.crash import crash_point
from workers.main import run_worker
from workers.worker import Worker

__all__ = ["Projector", "ReadModel", "Unprojectable", "model_url", "rebuild"]

_log = logging.getLogger(__name__)

PROJECTED_TOPICS = tuple(t.name for t in TOPICS if t is not AGENT_DLQ)


Refused = tuple[LoggedEvent, str]
"""An event the read model refused, and Postgres's reason."""
DeadLetter = Callable[[list[Refused]], Awaitable[None]]


_REFUSALS = (asyncpg.DataError, asyncpg.IntegrityConstraintViolationError)
"""What Postgres answers to a value it will not store: the record is dead-lettered, not retried."""


class Unprojectable(RecordError):
    """A verified record the read model refuses (the reason is Postgres's)."""


def model_url(explicit: str | None, log_url: str | None) -> str | None:
    """Where the read model lives: an explicit URL, ``AGENTLOG_READ_MODEL_URL``, ``AGENTLOG_PG_URL``,
    or a Postgres log itself."""
    for candidate in (explicit, os.environ.get("AGENTLOG_READ_MODEL_URL"), os.environ.get("AGENTLOG_PG_URL")):
        if candidate:
            return candidate
    url = log_url or os.environ.get("AGENTLOG_LOG_URL") or ""
    return url if url.startswith(("postgresql://", "postgres://")) else None


def _sql(schema: str, u: Upsert) -> tuple[str, list[Any]]:
    columns = [*u.key, *u.values]
    placeholders = ", ".join(f"${i}" for i in range(1, len(columns) + 1))
    table = f'"{schema}".{u.table}'
    sets = []
    for c in u.values:
        if u.merge.get(c, Merge.FIRST) is Merge.MAX:
            sets.append(f"{c} = GREATEST({u.table}.{c}, EXCLUDED.{c})")
        else:
            sets.append(f"{c} = COALESCE({u.table}.{c}, EXCLUDED.{c})")
    conflict = f"DO UPDATE SET {', '.join(sets)}" if sets else "DO NOTHING"
    sql = (
        f"INSERT INTO {table} AS {u.table} ({', '.join(columns)}) VALUES ({placeholders}) "
        f"ON CONFLICT ({', '.join(KEYS[u.table])}) {conflict}"
    )
    return sql, [*u.key.values(), *u.values.values()]


class ReadModel:
    """The read model's schema in Postgres: create, drop, read offsets, apply a poll."""

    def __init__(self, url: str, namespace: str = "") -> None:
        self.url = url
        self.schema = f"agentlog_read_{namespace}" if namespace else "agentlog_read"
        self._conn: asyncpg.Connection | None = None

    @property
    def conn(self) -> asyncpg.Connection:
        if self._conn is None:
            raise RuntimeError("call await model.start() first")
        return self._conn

    async def start(self) -> ReadModel:
        self._conn = await asyncpg.connect(self.url)
        await self.create()
        return self

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def create(self) -> None:
        statements = [f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"']
        for table, columns in TABLES.items():
            cols = ", ".join(f"{name} {kind}" for name, kind in columns.items())
            statements.append(
                f'CREATE TABLE IF NOT EXISTS "{self.schema}".{table} ({cols}, PRIMARY KEY ({", ".join(KEYS[table])}))'
            )
        # The console reads these tables one session at a time (their keys are event ids).
        for table in ("approvals", "kv_decisions", "cache_hits", "merges"):
            statements.append(f'CREATE INDEX IF NOT EXISTS {table}_by_session ON "{self.schema}".{table} (session_id)')
        statements.append(
            f'CREATE TABLE IF NOT EXISTS "{self.schema}".offsets '
            "(topic text, partition integer, next_offset bigint NOT NULL, PRIMARY KEY (topic, partition))"
        )
        async with self.conn.transaction():
            for statement in statements:
                await self.conn.execute(statement)

    async def drop(self) -> None:
        await self.conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')

    async def offsets(self) -> dict[tuple[str, int], int]:
        """The next offset to project per (topic, partition)."""
        found = await self.conn.fetch(f'SELECT topic, partition, next_offset FROM "{self.schema}".offsets')
        return {(r["topic"], r["partition"]): r["next_offset"] for r in found}

    async def dump(self) -> dict[str, list[tuple[Any, ...]]]:
        """Every table's rows in key order (offsets included): what the contract test compares."""
        out: dict[str, list[tuple[Any, ...]]] = {}
        for table in [*TABLES, "offsets"]:
            keys = ", ".join(KEYS.get(table, ("topic", "partition")))
            found = await self.conn.fetch(f'SELECT * FROM "{self.schema}".{table} ORDER BY {keys}')
            out[table] = [tuple(r.values()) for r in found]
        return out

    async def apply(self, events: Sequence[LoggedEvent], dead_letter: DeadLetter | None = None) -> list[Refused]:
        """Project ``events`` and move the offsets past them, in one transaction; the events it could
        not project, each with Postgres's reason (rolled back alone, the rest kept), are handed to
        ``dead_letter`` before the transaction commits.

        Fast path first: the poll's rows as one ``executemany`` per statement. Grouping keeps each
        statement's rows in log order, and no column is written by two statements (an event type
        writes its own columns), so it is the same model as one event after another. When Postgres
        refuses a row, that transaction is rolled back and the poll is done again event by event,
        each in a savepoint, to find and skip what it refuses."""
        after: dict[tuple[str, int], int] = {}
        for event in events:
            p = event.position
            after[(p.topic, p.partition)] = max(after.get((p.topic, p.partition), 0), p.offset + 1)
        planned = [(e, rows(e.session_id, e.envelope.event_id, e.body, e.envelope.occurred_at)) for e in events]
        try:
            return await self._apply(planned, after, dead_letter, one_by_one=False)
        except _REFUSALS:
            return await self._apply(planned, after, dead_letter, one_by_one=True)

    async def _apply(
        self,
        planned: list[tuple[LoggedEvent, list[Upsert]]],
        after: dict[tuple[str, int], int],
        dead_letter: DeadLetter | None,
        *,
        one_by_one: bool,
    ) -> list[Refused]:
        refused: list[Refused] = []
        async with self.conn.transaction():
            if one_by_one:
                for event, upserts in planned:
                    try:
                        async with self.conn.transaction():  # a savepoint: one event's rows, or none
                            for u in upserts:
                                sql, args = _sql(self.schema, u)
                                await self.conn.execute(sql, *args)
                    except _REFUSALS as e:
                        refused.append((event, f"{type(e).__name__}: {e}"))
            else:
                by_statement: dict[str, list[list[Any]]] = {}
                for _, upserts in planned:
                    for u in upserts:
                        sql, args = _sql(self.schema, u)
                        by_statement.setdefault(sql, []).append(args)
                for sql, many in by_statement.items():
                    await self.conn.executemany(sql, many)
            await self.conn.executemany(
                f'INSERT INTO "{self.schema}".offsets (topic, partition, next_offset) VALUES ($1, $2, $3) '
                "ON CONFLICT (topic, partition) DO UPDATE SET next_offset = EXCLUDED.next_offset",
                [(t, partition, offset) for (t, partition), offset in sorted(after.items())],
            )
            for event, reason in refused:
                _log.warning("cannot project %s (%s): %s", event.position, type(event.body).__name__, reason)
            if refused and dead_letter is not None:
                await dead_letter(refused)
            crash_point("projector.mid_transaction")
        crash_point("projector.after_commit")
        return refused


class Projector(Worker):
    role = "projector"
    topics = PROJECTED_TOPICS

    def __init__(
        self,
        log: SharedLog,
        model: ReadModel,
        *,
        until_caught_up: bool = False,
        group: str | None = None,
        instance_id: str | None = None,
        poll_timeout_s: float = 0.5,
        max_records: int = 500,
    ) -> None:
        super().__init__(log, group=group, instance_id=instance_id, poll_timeout_s=poll_timeout_s)
        self.model = model
        self.max_records = max_records
        self.until_caught_up = until_caught_up
        self.num_projected = 0
        self.num_refused = 0
        self._ends: dict[tuple[str, int], int] = {}

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--model-url",
            default=None,
            help="Postgres of the read model (default: AGENTLOG_READ_MODEL_URL, AGENTLOG_PG_URL, or a Postgres log)",
        )
        parser.add_argument("--until-caught-up", action="store_true", help="stop at the end offsets seen at start")
        parser.add_argument("--max-records", type=int, default=500, help="records per poll, one transaction each")

    @classmethod
    async def create(cls, log: SharedLog, args: argparse.Namespace) -> Worker:
        url = model_url(args.model_url, args.log_url)
        if url is None:
            raise SystemExit("projector: no Postgres for the read model: pass --model-url or AGENTLOG_READ_MODEL_URL")
        model = await ReadModel(url, log_namespace(log)).start()
        return cls(
            log,
            model,
            until_caught_up=args.until_caught_up,
            group=args.group,
            instance_id=args.instance_id,
            max_records=args.max_records,
        )

    async def close(self) -> None:
        await self.model.close()

    async def open_consumer(self) -> EventConsumer:
        stored = await self.model.offsets()
        if self.until_caught_up:
            for topic in self.topics:
                for partition, end in (await self.log.end_offsets(topic)).items():
                    self._ends[(topic, partition)] = end

        async def start_at(topic: str, partition: int) -> StartAt:
            # The model's offsets are the truth: every partition starts there (0 when new), never at
            # the group's committed offset.
            return StartAt(stored.get((topic, partition), 0))

        return await EventConsumer(
            self.log, self.group, list(self.topics), from_beginning=True, instance_id=self.instance_id,
            start_at=start_at,
        ).start()  # fmt: skip

    async def handle(self, events: list[LoggedEvent]) -> None:
        if events:
            refused = await self.model.apply(events, self._dead_letter)
            self.num_projected += len(events) - len(refused)
            self.num_refused += len(refused)
        if self.until_caught_up and self.consumer is not None and self._caught_up(self.consumer):
            self.shutdown()

    def _caught_up(self, consumer: EventConsumer) -> bool:
        return all(consumer.position(t, p) >= end for (t, p), end in self._ends.items())

    async def _dead_letter(self, refused: list[Refused]) -> None:
        for event, reason in refused:
            e = event.envelope
            value, _ = self.log.codec.encode(
                event_id=e.event_id, session_id=e.session_id, seq=e.seq, actor=e.actor, occurred_at=e.occurred_at,
                causation_id=e.causation_id, prev_hash=e.prev_hash, body=e.body,
            )  # fmt: skip
            raw = RawRecord(event.position, e.session_id.encode(), value)
            await self.log.dead_letter(raw, Unprojectable(reason), self.group)


async def rebuild(log: SharedLog, url: str, *, group: str) -> Projector:
    """Drop the read model and project the log again from offset 0 up to its end now."""
    model = await ReadModel(url, log_namespace(log)).start()
    try:
        await model.drop()
        await model.create()
        projector = Projector(log, model, until_caught_up=True, group=group)
        await projector.run()
        return projector
    finally:
        await model.close()


if __name__ == "__main__":
    run_worker(Projector)
