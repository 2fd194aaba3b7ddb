"""The in-memory backend: the log's topics as lists in this process, for unit tests and tools.

A real adapter, not a mock: it passes the same contract suite as Kafka and
Postgres (``tests/contract/test_memory.py``). What lives where:

- ``MemoryStore`` holds one log: per (topic, partition) an append-only list of
  records (a record's offset is its index), an index of each key's records,
  and the consumer groups (members, who owns which partition, committed
  offsets). Every ``MemoryBackend`` on the same store sees the same log, as
  every client of one broker does.
- Like the Postgres backend, a record that repeats the ``(key, seq)`` or the
  ``event_id`` of a record of its topic is refused (``ConcurrentWriter``), for
  the whole batch, so a second writer of one chain in this process fails the
  same way it does on the embedded default.
- Consumer groups: member i of the n members subscribed to a topic (in the
  order they joined) targets that topic's partitions p with p % n == i, and
  owns one once no other member does. A member gives up partitions and takes
  free ones when it polls (as a Kafka member rebalances inside ``poll``), so a
  partition never has two owners. A partition newly owned starts at 0 with
  ``from_beginning``, else at the group's committed offset (0 if none).
- A member leaves the group when it is closed. A static member (an
  ``instance_id``) replaced by a new member of the same id hands it its place
  and its partitions at once; the old one is closed (its next call raises), as
  Kafka fences the older instance.

``memory:NAME`` (``log.urls``) opens the store NAME of this process (created on
first use; the namespace keeps several logs apart, as on a server). It lives as
long as the process and is seen by nothing outside it: for tests, benches and
one-process tools, not for a stack of processes. The store is used from one
event loop's thread at a time (it takes no locks).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from log import topics as topic_table
from log.backend import Backend, OutRecord, Subscription
from log.errors import BackendUnavailable, ConcurrentWriter
from log.types import Position, RawRecord

_TopicPartition = tuple[str, int]


@dataclass
class _Group:
    """A consumer group: its live members in join order, who owns what, and what was committed."""

    members: list[MemorySubscription] = field(default_factory=list)
    owners: dict[_TopicPartition, MemorySubscription] = field(default_factory=dict)
    committed: dict[_TopicPartition, int] = field(default_factory=dict)


class MemoryStore:
    """One log in memory: records per (topic, partition), key indexes, consumer groups."""

    def __init__(self) -> None:
        self.num_partitions: int | None = None
        self._records: dict[_TopicPartition, list[RawRecord]] = {}
        self._by_key: dict[tuple[str, int, bytes | None], list[RawRecord]] = {}
        # What the Postgres backend's unique constraints hold, per topic.
        self._seqs: dict[str, set[tuple[bytes, int]]] = {}
        self._event_ids: dict[str, set[str]] = {}
        self.groups: dict[str, _Group] = {}
        self._waiters: set[asyncio.Future[None]] = set()

    # ------------------------------------------------------------------ topics

    def create_topics(self, num_partitions: int) -> None:
        """Every topic of ``log.topics``, if missing; an existing log keeps its partition count."""
        if self.num_partitions is None:
            self.num_partitions = num_partitions
        for t in topic_table.TOPICS:
            self._seqs.setdefault(t.name, set())
            self._event_ids.setdefault(t.name, set())
            for p in range(self.num_partitions):
                self._records.setdefault((t.name, p), [])

    def partitions(self) -> int:
        if self.num_partitions is None:
            raise BackendUnavailable("the log has no topics yet: run `logctl init` first")
        return self.num_partitions

    def records(self, topic: str, partition: int) -> Sequence[RawRecord]:
        """The records of one partition, in offset order (a view: append only through ``append``)."""
        return self._partition(topic, partition)

    def _partition(self, topic: str, partition: int) -> list[RawRecord]:
        tp = (topic, partition)
        if tp not in self._records:
            raise BackendUnavailable(f"{topic}[{partition}] does not exist: run `logctl init`")
        return self._records[tp]

    def records_of_key(self, topic: str, partition: int, key: bytes) -> list[RawRecord]:
        self.records(topic, partition)  # the partition must exist
        return list(self._by_key.get((topic, partition, key), ()))

    # ------------------------------------------------------------------ append

    def append(self, topic: str, records: Sequence[OutRecord]) -> list[Position]:
        """Append records in order, all or none; their positions."""
        if not records:
            return []
        logs = [self._partition(topic, r.partition) for r in records]  # every partition exists
        seqs, event_ids = self._seqs[topic], self._event_ids[topic]
        new_seqs: set[tuple[bytes, int]] = set()
        new_ids: set[str] = set()
        for r in records:
            if r.seq is not None:
                chain = (r.key, r.seq)
                if chain in seqs or chain in new_seqs:
                    raise ConcurrentWriter(
                        f"another writer appended seq {r.seq} of {r.key.decode(errors='replace')} to {topic} first; "
                        "reload and retry"
                    )
                new_seqs.add(chain)
            if r.event_id is not None:
                if r.event_id in event_ids or r.event_id in new_ids:
                    raise ConcurrentWriter(f"event {r.event_id} is in {topic} already; reload and retry")
                new_ids.add(r.event_id)
        positions = []
        for r, log in zip(records, logs, strict=True):
            position = Position(topic, r.partition, len(log))
            record = RawRecord(position, r.key, r.value)
            log.append(record)
            self._by_key.setdefault((topic, r.partition, r.key), []).append(record)
            positions.append(position)
        seqs |= new_seqs
        event_ids |= new_ids
        self.wake()
        return positions

    # ------------------------------------------------------------------ waiting

    def wake(self) -> None:
        """Something changed (records, members, owners): every waiting poll looks again."""
        waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self, timeout_s: float) -> None:
        """Until the next ``wake()``, or ``timeout_s``."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter, timeout_s)
        finally:
            self._waiters.discard(waiter)


_named: dict[tuple[str, str], MemoryStore] = {}


def named_store(name: str, namespace: str = "") -> MemoryStore:
    """The store ``memory:NAME`` opens in this process (created on first use)."""
    return _named.setdefault((name, namespace), MemoryStore())


class MemoryBackend(Backend):
    """A client of a ``MemoryStore`` (a fresh one by default). ``start`` and ``close`` connect
    nothing, but the backend is only usable in between, like the others."""

    name = "memory"

    def __init__(self, store: MemoryStore | None = None) -> None:
        self.store = store if store is not None else MemoryStore()
        self._started = False

    def _check(self) -> MemoryStore:
        if not self._started:
            raise RuntimeError("backend not started")
        return self.store

    async def start(self) -> None:
        self._started = True

    async def close(self) -> None:
        self._started = False

    async def create_topics(self, num_partitions: int) -> None:
        self._check().create_topics(num_partitions)

    async def num_partitions(self) -> int:
        return self._check().partitions()

    async def produce(self, topic: str, records: Sequence[OutRecord]) -> asyncio.Future[list[Position]]:
        positions = self._check().append(topic, records)
        future: asyncio.Future[list[Position]] = asyncio.get_running_loop().create_future()
        future.set_result(positions)  # in memory, landed is durable
        return future

    async def scan(
        self, topic: str, partition: int, start: int = 0, end: int | None = None
    ) -> AsyncIterator[RawRecord]:
        log = self._check().records(topic, partition)
        stop = len(log) if end is None else min(end, len(log))  # the end as of now, as Kafka's scan
        for offset in range(start, stop):
            yield log[offset]

    async def read_key(self, topic: str, partition: int, key: bytes) -> list[RawRecord]:
        return self._check().records_of_key(topic, partition, key)

    async def end_offsets(self, topic: str) -> dict[int, int]:
        store = self._check()
        return {p: len(store.records(topic, p)) for p in range(store.partitions())}

    async def subscribe(
        self, group: str, topics: Sequence[str], *, from_beginning: bool, instance_id: str | None = None
    ) -> Subscription:
        store = self._check()
        num_partitions = store.partitions()
        for name in topics:
            store.records(name, 0)  # the topic must exist
        subscription = MemorySubscription(store, group, topics, from_beginning=from_beginning, instance_id=instance_id)
        subscription.join(num_partitions)
        return subscription


class MemorySubscription(Subscription):
    """A member of a consumer group of a ``MemoryStore`` (module docstring: how partitions move)."""

    def __init__(
        self,
        store: MemoryStore,
        group: str,
        topics: Sequence[str],
        *,
        from_beginning: bool,
        instance_id: str | None = None,
    ) -> None:
        self.store = store
        self.group = group
        self.topics = tuple(topics)
        self.from_beginning = from_beginning
        self.instance_id = instance_id
        self._group = store.groups.setdefault(group, _Group())
        self._num_partitions = 0
        self._positions: dict[_TopicPartition, int] = {}  # owned partitions: the next offset to read
        self._closed = False
        self._replaced = False

    def join(self, num_partitions: int) -> None:
        self._num_partitions = num_partitions
        members = self._group.members
        old = next((m for m in members if self.instance_id and m.instance_id == self.instance_id), None)
        if old is not None:
            members[members.index(old)] = self  # a static member back: its place, and its partitions
            old._leave(replaced=True)
        else:
            members.append(self)
        self._rebalance()
        self.store.wake()  # the other members' targets changed

    def _target(self) -> set[_TopicPartition]:
        target: set[_TopicPartition] = set()
        for topic in self.topics:
            subscribed = [m for m in self._group.members if topic in m.topics]
            index, n = subscribed.index(self), len(subscribed)
            target.update((topic, p) for p in range(self._num_partitions) if p % n == index)
        return target

    def _rebalance(self) -> None:
        """Give up what is no longer ours, take what is ours and free."""
        owners, target = self._group.owners, self._target()
        released = False
        for tp in [tp for tp in self._positions if tp not in target]:
            del self._positions[tp], owners[tp]
            released = True
        for tp in sorted(target - self._positions.keys()):
            if tp not in owners:
                self.assignments += 1  # a partition taken (perhaps given up and back within one poll) is new
                owners[tp] = self
                self._positions[tp] = 0 if self.from_beginning else self._group.committed.get(tp, 0)
        if released:
            self.store.wake()  # the members that target them take them at their next look

    def _check(self) -> None:
        if self._replaced:
            raise RuntimeError(
                f"member {self.instance_id!r} of group {self.group!r} was replaced by a newer member "
                "with the same instance id; it is closed"
            )
        if self._closed:
            raise RuntimeError("subscription is closed")

    async def poll(self, timeout_s: float, max_records: int) -> list[RawRecord]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            self._check()
            self._rebalance()
            records = self._fetch(max_records)
            remaining = deadline - loop.time()
            if records or remaining <= 0:
                return records
            await self.store.wait(remaining)

    def _fetch(self, max_records: int) -> list[RawRecord]:
        records: list[RawRecord] = []
        for tp, position in sorted(self._positions.items()):
            room = max_records - len(records)
            if room <= 0:
                break
            run = self.store.records(*tp)[position : position + room]
            if run:
                records.extend(run)
                self._positions[tp] = run[-1].position.offset + 1
        return records

    async def commit(self, offsets: dict[tuple[str, int], int]) -> None:
        self._check()
        self._group.committed.update(offsets)

    def assignment(self) -> set[tuple[str, int]]:
        return set(self._positions)

    def seek(self, topic: str, partition: int, offset: int) -> bool:
        if (topic, partition) not in self._positions:
            return False
        self._positions[(topic, partition)] = offset
        return True

    async def close(self) -> None:
        if not self._closed:
            self._group.members.remove(self)
            self._leave(replaced=False)

    def _leave(self, *, replaced: bool) -> None:
        """Out of the group (already removed from its members): free every partition owned."""
        self._closed = True
        self._replaced = replaced
        for tp in self._positions:
            del self._group.owners[tp]
        self._positions.clear()
        self.store.wake()
