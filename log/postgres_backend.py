"""The Postgres backend: one append-only table per topic, offsets in a table.

Layout (created by ``create_topics``):

- ``log_<topic>`` (dots become underscores): ``(partition, record_offset)`` is
  the primary key; ``(record_key, seq)`` and ``event_id`` are unique, so a
  second writer of the same chain or the same event is refused by the
  database. A trigger rejects every UPDATE, DELETE and TRUNCATE.
- ``log_heads``: the next offset of each (topic, partition). Producers take
  offsets with ``UPDATE ... RETURNING``; the row lock serializes producers of
  one partition until commit, so offsets are gapless and a reader never sees
  offset n+1 before offset n is committed.
- ``log_group_offsets``: committed offsets of consumer groups.
- ``log_group_members``: members of consumer groups. A member owns partition p
  while it holds the advisory lock (group, p) on its own connection: when the
  process dies, its connection closes and the lock is released at once.

Tailing uses LISTEN/NOTIFY on channel ``agentlog``: producers notify
``<topic>:<partition>`` in the same transaction as the insert.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import asyncpg

from log import topics as topic_table
from log.backend import Backend, OutRecord, Subscription
from log.errors import BackendUnavailable, ConcurrentWriter
from log.redact import redact
from log.types import Position, RawRecord

_log = logging.getLogger(__name__)

CHANNEL = "agentlog"
_SCAN_PAGE = 5000
_REBALANCE_EVERY_S = 1.0


def table_name(topic: str) -> str:
    """``agent.actions`` -> ``log_agent_actions``."""
    return "log_" + topic.replace(".", "_")


_DDL_COMMON = """
CREATE TABLE IF NOT EXISTS log_meta (key text PRIMARY KEY, value text NOT NULL);
CREATE TABLE IF NOT EXISTS log_heads (
    topic text NOT NULL, partition int NOT NULL, next_offset bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (topic, partition));
CREATE TABLE IF NOT EXISTS log_group_offsets (
    group_id text NOT NULL, topic text NOT NULL, partition int NOT NULL, next_offset bigint NOT NULL,
    PRIMARY KEY (group_id, topic, partition));
CREATE TABLE IF NOT EXISTS log_group_members (
    group_id text NOT NULL, member_id text NOT NULL, joined_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (group_id, member_id));
CREATE OR REPLACE FUNCTION log_reject_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'the log is append-only: % on % is not allowed', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'insufficient_privilege';
END $$;
"""

_DDL_TOPIC = """
CREATE TABLE IF NOT EXISTS {table} (
    partition int NOT NULL,
    record_offset bigint NOT NULL,
    record_key bytea,
    seq bigint,
    event_id text,
    value bytea NOT NULL,
    appended_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (partition, record_offset),
    UNIQUE (record_key, seq),
    UNIQUE (event_id));
CREATE INDEX IF NOT EXISTS {table}_key ON {table} (record_key, record_offset);
CREATE OR REPLACE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table}
    FOR EACH ROW EXECUTE FUNCTION log_reject_change();
CREATE OR REPLACE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table}
    FOR EACH STATEMENT EXECUTE FUNCTION log_reject_change();
"""


class PostgresBackend(Backend):
    """Topics as Postgres tables; see the module docstring for the layout."""

    name = "postgres"

    def __init__(self, dsn: str, *, namespace: str = "") -> None:
        self.dsn = dsn
        # A namespace is a Postgres schema of its own (tests use one each); "" is "public".
        self.namespace = namespace or "public"
        self._pool: asyncpg.Pool | None = None
        self._num_partitions: int | None = None

    @property
    def server_settings(self) -> dict[str, str]:
        return {"search_path": f'"{self.namespace}"'}

    @property
    def channel(self) -> str:
        """LISTEN/NOTIFY channel of this namespace."""
        return CHANNEL if self.namespace == "public" else f"{CHANNEL}_{self.namespace}"

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError("backend not started")
        return self._pool

    async def start(self) -> None:
        try:
            if self.namespace != "public":
                conn = await asyncpg.connect(self.dsn)
                try:
                    # Only when missing: a role of one principal may use a schema but not create one.
                    if not await conn.fetchval("SELECT 1 FROM pg_namespace WHERE nspname = $1", self.namespace):
                        await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{self.namespace}"')
                finally:
                    await conn.close()
            self._pool = await asyncpg.create_pool(
                self.dsn, min_size=1, max_size=4, server_settings=self.server_settings
            )
        except (OSError, asyncpg.PostgresError) as e:
            raise BackendUnavailable(f"cannot connect to Postgres at {redact(self.dsn)}: {redact(str(e))}") from e

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def create_topics(self, num_partitions: int) -> None:
        async with self.pool.acquire() as conn, conn.transaction():
            # One initializer at a time: CREATE ... IF NOT EXISTS still races on the catalog.
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('agentlog:init:' || current_schema()))")
            await conn.execute(_DDL_COMMON)
            existing = await conn.fetchval("SELECT value FROM log_meta WHERE key = 'num_partitions'")
            if existing is None:
                await conn.execute("INSERT INTO log_meta VALUES ('num_partitions', $1)", str(num_partitions))
            else:
                num_partitions = int(existing)
            for t in topic_table.TOPICS:
                await conn.execute(_DDL_TOPIC.format(table=table_name(t.name)))
                await conn.executemany(
                    "INSERT INTO log_heads (topic, partition) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                    [(t.name, p) for p in range(num_partitions)],
                )
        self._num_partitions = num_partitions

    async def num_partitions(self) -> int:
        if self._num_partitions is None:
            try:
                value = await self.pool.fetchval("SELECT value FROM log_meta WHERE key = 'num_partitions'")
            except asyncpg.UndefinedTableError:
                value = None
            if value is None:
                raise BackendUnavailable("the log has no topics yet: run `logctl init` first")
            self._num_partitions = int(value)
        return self._num_partitions

    async def produce(self, topic: str, records: Sequence[OutRecord]) -> asyncio.Future[list[Position]]:
        table = table_name(topic)
        by_partition: dict[int, list[int]] = {}
        for i, record in enumerate(records):
            by_partition.setdefault(record.partition, []).append(i)
        offsets = [0] * len(records)
        if len(by_partition) == 1:
            return await self._produce_one_partition(topic, records)
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                for partition in sorted(by_partition):  # fixed lock order: no deadlocks
                    indexes = by_partition[partition]
                    first = await conn.fetchval(
                        "UPDATE log_heads SET next_offset = next_offset + $3 WHERE topic = $1 AND partition = $2 "
                        "RETURNING next_offset - $3",
                        topic,
                        partition,
                        len(indexes),
                    )
                    if first is None:
                        raise BackendUnavailable(f"{topic}[{partition}] does not exist: run `logctl init`")
                    for n, i in enumerate(indexes):
                        offsets[i] = first + n
                await conn.execute(
                    f"INSERT INTO {table} (partition, record_offset, record_key, seq, event_id, value) "
                    "SELECT * FROM unnest($1::int[], $2::bigint[], $3::bytea[], $4::bigint[], $5::text[], $6::bytea[])",
                    [r.partition for r in records],
                    offsets,
                    [r.key for r in records],
                    [r.seq for r in records],
                    [r.event_id for r in records],
                    [r.value for r in records],
                )
                for partition in by_partition:
                    await conn.execute("SELECT pg_notify($1, $2)", self.channel, f"{topic}:{partition}")
        except asyncpg.UniqueViolationError as e:
            raise ConcurrentWriter(f"another writer appended to {topic} first ({e.detail}); reload and retry") from e
        future: asyncio.Future[list[Position]] = asyncio.get_running_loop().create_future()
        future.set_result([Position(topic, r.partition, o) for r, o in zip(records, offsets, strict=True)])
        return future

    async def _produce_one_partition(self, topic: str, records: Sequence[OutRecord]) -> asyncio.Future[list[Position]]:
        """The common batch (one partition: one session, or a gateway's single record) as one
        statement, so one round trip and one implicit transaction instead of five (BEGIN, UPDATE,
        INSERT, NOTIFY, COMMIT); the commit's WAL flush is what is left. Same effects as the
        multi-partition path: the head's row lock serializes producers, NOTIFY goes out at commit,
        and a missing head inserts nothing (the INSERT selects from the UPDATE's empty result)."""
        partition = records[0].partition
        sql = (
            "WITH head AS (UPDATE log_heads SET next_offset = next_offset + $3 "
            "WHERE topic = $1 AND partition = $2 RETURNING next_offset - $3 AS first), "
            f"ins AS (INSERT INTO {table_name(topic)} (partition, record_offset, record_key, seq, event_id, value) "
            "SELECT $2, head.first + r.n - 1, r.k, r.s, r.e, r.v FROM head, "
            "unnest($4::bytea[], $5::bigint[], $6::text[], $7::bytea[]) WITH ORDINALITY AS r(k, s, e, v, n)) "
            "SELECT first, pg_notify($8, $9) FROM head"
        )
        try:
            row = await self.pool.fetchrow(
                sql,
                topic,
                partition,
                len(records),
                [r.key for r in records],
                [r.seq for r in records],
                [r.event_id for r in records],
                [r.value for r in records],
                self.channel,
                f"{topic}:{partition}",
            )
        except asyncpg.UniqueViolationError as e:
            raise ConcurrentWriter(f"another writer appended to {topic} first ({e.detail}); reload and retry") from e
        if row is None:
            raise BackendUnavailable(f"{topic}[{partition}] does not exist: run `logctl init`")
        first = int(row[0])
        future: asyncio.Future[list[Position]] = asyncio.get_running_loop().create_future()
        future.set_result([Position(topic, partition, first + n) for n in range(len(records))])
        return future

    async def scan(
        self, topic: str, partition: int, start: int = 0, end: int | None = None
    ) -> AsyncIterator[RawRecord]:
        table = table_name(topic)
        stop = end if end is not None else 2**62
        while start < stop:
            rows = await self.pool.fetch(
                f"SELECT record_offset, record_key, value FROM {table} "
                "WHERE partition = $1 AND record_offset >= $2 AND record_offset < $3 "
                "ORDER BY record_offset LIMIT $4",
                partition,
                start,
                stop,
                _SCAN_PAGE,
            )
            for row in rows:
                yield RawRecord(Position(topic, partition, row[0]), row[1], row[2])
            if len(rows) < _SCAN_PAGE:
                return
            start = rows[-1][0] + 1

    async def read_key(self, topic: str, partition: int, key: bytes) -> list[RawRecord]:
        rows = await self.pool.fetch(
            f"SELECT partition, record_offset, record_key, value FROM {table_name(topic)} "
            "WHERE record_key = $1 ORDER BY record_offset",
            key,
        )
        return [RawRecord(Position(topic, row[0], row[1]), row[2], row[3]) for row in rows]

    async def end_offsets(self, topic: str) -> dict[int, int]:
        rows = await self.pool.fetch("SELECT partition, next_offset FROM log_heads WHERE topic = $1", topic)
        return {row[0]: row[1] for row in rows}

    async def subscribe(
        self, group: str, topics: Sequence[str], *, from_beginning: bool, instance_id: str | None = None
    ) -> Subscription:
        # A dead member's advisory locks go with its connection, so a restart needs no
        # static identity here; the instance id only names the member.
        subscription = PostgresSubscription(self, group, topics, from_beginning=from_beginning)
        if instance_id:
            subscription.member_id = f"{instance_id}-{subscription.member_id}"
        await subscription.join()
        return subscription


class PostgresSubscription(Subscription):
    """A consumer group member: partitions are split round-robin over live members.

    Member i of n (members sorted by id) targets partitions p with p % n == i,
    and owns one once it holds that partition's advisory lock. Liveness is an
    advisory lock too: a member whose lock can be taken is dead, and is removed.
    """

    def __init__(self, backend: PostgresBackend, group: str, topics: Sequence[str], *, from_beginning: bool) -> None:
        self.backend = backend
        self.group = group
        self.topics = tuple(topics)
        self.from_beginning = from_beginning
        self.member_id = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"
        self._conn: asyncpg.Connection | None = None
        self._owned: set[int] = set()
        self._positions: dict[tuple[str, int], int] = {}
        self._wakeup = asyncio.Event()
        self._last_rebalance = 0.0

    @property
    def conn(self) -> asyncpg.Connection:
        if self._conn is None:
            raise RuntimeError("subscription is closed")
        return self._conn

    async def join(self) -> None:
        self._conn = await asyncpg.connect(self.backend.dsn, server_settings=self.backend.server_settings)
        try:
            await self.conn.add_listener(self.backend.channel, self._on_notify)
            await self.conn.execute(
                "SELECT pg_advisory_lock(hashtext($1), hashtext($2))", self._members_key, self.member_id
            )
            await self.conn.execute(
                "INSERT INTO log_group_members (group_id, member_id) VALUES ($1, $2)", self.group, self.member_id
            )
            await self._rebalance()
        except BaseException:
            await self._conn.close()  # e.g. a role that may not use this group: leave nothing open
            self._conn = None
            raise

    @property
    def _members_key(self) -> str:
        return f"agentlog-members:{self.backend.namespace}:{self.group}"

    @property
    def _group_key(self) -> str:
        """Advisory lock namespace of this group's partitions."""
        return f"{self.backend.namespace}:{self.group}"

    def _on_notify(self, _conn: object, _pid: int, _channel: str, payload: object) -> None:
        assert isinstance(payload, str)
        topic, _, _partition = payload.rpartition(":")
        if topic in self.topics:
            self._wakeup.set()

    async def _rebalance(self) -> None:
        self._last_rebalance = time.monotonic()
        num_partitions = await self.backend.num_partitions()
        members = [
            r[0]
            for r in await self.conn.fetch(
                "SELECT member_id FROM log_group_members WHERE group_id = $1 ORDER BY member_id", self.group
            )
        ]
        live = []
        for member in members:
            if member == self.member_id:
                live.append(member)
                continue
            # If we can take its liveness lock, its connection (and process) is gone.
            if await self.conn.fetchval(
                "SELECT pg_try_advisory_lock(hashtext($1), hashtext($2))", self._members_key, member
            ):
                await self.conn.execute(
                    "SELECT pg_advisory_unlock(hashtext($1), hashtext($2))", self._members_key, member
                )
                await self.conn.execute(
                    "DELETE FROM log_group_members WHERE group_id = $1 AND member_id = $2", self.group, member
                )
            else:
                live.append(member)
        index = live.index(self.member_id)
        target = {p for p in range(num_partitions) if p % len(live) == index}
        for partition in sorted(self._owned - target):
            await self.conn.execute("SELECT pg_advisory_unlock(hashtext($1), $2)", self._group_key, partition)
            self._owned.discard(partition)
            for topic in self.topics:
                self._positions.pop((topic, partition), None)
        for partition in sorted(target - self._owned):
            if await self.conn.fetchval("SELECT pg_try_advisory_lock(hashtext($1), $2)", self._group_key, partition):
                # A partition taken (perhaps given up and taken back within one poll) is new.
                self.assignments += 1
                self._owned.add(partition)
                for topic in self.topics:
                    self._positions[(topic, partition)] = (
                        0 if self.from_beginning else await self._committed(topic, partition)
                    )

    async def _committed(self, topic: str, partition: int) -> int:
        value = await self.conn.fetchval(
            "SELECT next_offset FROM log_group_offsets WHERE group_id = $1 AND topic = $2 AND partition = $3",
            self.group,
            topic,
            partition,
        )
        return int(value) if value is not None else 0

    async def poll(self, timeout_s: float, max_records: int) -> list[RawRecord]:
        deadline = time.monotonic() + timeout_s
        while True:
            if time.monotonic() - self._last_rebalance >= _REBALANCE_EVERY_S:
                await self._rebalance()
            self._wakeup.clear()
            records = await self._fetch(max_records)
            remaining = deadline - time.monotonic()
            if records or remaining <= 0:
                return records
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout=min(remaining, _REBALANCE_EVERY_S))

    async def _fetch(self, max_records: int) -> list[RawRecord]:
        records: list[RawRecord] = []
        for (topic, partition), position in sorted(self._positions.items()):
            if len(records) >= max_records:
                break
            rows = await self.conn.fetch(
                f"SELECT record_offset, record_key, value FROM {table_name(topic)} "
                "WHERE partition = $1 AND record_offset >= $2 ORDER BY record_offset LIMIT $3",
                partition,
                position,
                max_records - len(records),
            )
            for row in rows:
                records.append(RawRecord(Position(topic, partition, row[0]), row[1], row[2]))
            if rows:
                self._positions[(topic, partition)] = rows[-1][0] + 1
        return records

    async def commit(self, offsets: dict[tuple[str, int], int]) -> None:
        await self.conn.executemany(
            "INSERT INTO log_group_offsets (group_id, topic, partition, next_offset) VALUES ($1, $2, $3, $4) "
            "ON CONFLICT (group_id, topic, partition) DO UPDATE SET next_offset = EXCLUDED.next_offset",
            [(self.group, topic, partition, offset) for (topic, partition), offset in offsets.items()],
        )

    def assignment(self) -> set[tuple[str, int]]:
        return set(self._positions)

    def seek(self, topic: str, partition: int, offset: int) -> bool:
        if (topic, partition) not in self._positions:
            return False
        self._positions[(topic, partition)] = offset
        return True

    async def close(self) -> None:
        if self._conn is None:
            return
        try:
            await self.conn.execute(
                "DELETE FROM log_group_members WHERE group_id = $1 AND member_id = $2", self.group, self.member_id
            )
        finally:
            await self.conn.close()  # releases every advisory lock this member held
            self._conn = None
