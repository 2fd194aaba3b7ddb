"""The typed consumer: decoded, verified events with explicit commits.

Consumers trust nothing. Each record is decoded and checked against the chain
of its (topic, session); a record that fails goes to ``agent.dlq`` with the
reason, is counted, is never handed to the caller, and consumption continues.

When a partition is first read from an offset other than 0 (resuming from a
committed offset, or taking a partition over from another member), the chain
state of that partition is rebuilt by replaying it from offset 0 up to there:
the records before the cut are checked again, not trusted.

**Starting late** (``start_at``): a reader that knows what it needs of a
partition (a role worker with a mark, docs/branches.md) says, when the
partition is first read, where to start (``StartAt``) instead of offset 0:

- the records before ``offset`` are not read (or, when the backend cannot
  seek, read and dropped undecoded);
- below ``known_to``, only the records of the ``sessions`` it names are
  handed out; the others' are skipped undecoded;
- a session with a ``ChainSeed`` has its records below the seed's offset
  skipped (the caller holds them, e.g. in a snapshot) and its next record is
  checked against the seed's tail;
- no chain is rebuilt from offset 0 up front. A record whose chain has no tail
  and whose seq is not 0 (its session began below the start) gets that one
  chain rebuilt, from that session's records before it, then; so does a
  seeded chain whose next record does not follow the seed (a wrong seed costs
  a rebuild, never a false dead-letter). ``rebuilt`` names those chains.

So every record handed out is verified against its whole chain as seen from
offset 0 or from a seed; what a wrong start can cost is records never handed
out, which is what the caller vouches for (like a committed offset).

A consumer reads through a ``ConsumedLog``: the backend, the codec, the
partitioner and the dead-letter writer. The ``SharedLog`` is one (its
``consumer()`` makes consumers on itself); this module does not import it, so
the writer side depends on the consumer and not the other way round.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from log import topics as topic_table
from log.backend import Backend, Membership, Subscription
from log.chain import ChainVerifier
from log.codec import Codec
from log.errors import RecordError
from log.types import ConsumerStats, LoggedEvent, Position, RawRecord, new_tuple
from schemas.envelope import Envelope
from schemas.events import KVAllBlocksCleared


class ConsumedLog(Protocol):
    """What a consumer needs of the log it reads (``SharedLog`` is one)."""

    @property
    def backend(self) -> Backend:
        """Where records are read (and consumer groups live)."""

    @property
    def codec(self) -> Codec:
        """Decodes records."""

    def partition_for(self, session_id: str) -> int:
        """The partition of a session (to tell which chains a partition holds)."""

    async def dead_letter(self, record: RawRecord, error: RecordError, group: str) -> Position | None:
        """Set a bad record aside with the reason (None: this reader may not write the DLQ)."""

    def partitions_moved(self, partitions: set[int]) -> None:
        """The group rebalanced: another member may own, or have owned, these partitions since
        this reader's process last looked (what it knows of their chains as a writer is stale)."""


@dataclass(frozen=True)
class ChainSeed:
    """One session's chain in a partition read from late: its records below ``offset`` are
    the caller's already; the next one must follow ``seq`` and ``hash`` (``seq`` None: it
    had no record below ``offset``, its next one is its first)."""

    offset: int
    seq: int | None = None
    hash: bytes = b""


@dataclass(frozen=True)
class StartAt:
    """Where to start reading one (topic, partition), and what to skip (module docstring)."""

    offset: int
    known_to: int = 0
    sessions: frozenset[str] = frozenset()
    seeds: Mapping[str, ChainSeed] = field(default_factory=dict)


@dataclass
class ReadCounts:
    """What this consumer read, by what it did with each record."""

    decoded: int = 0
    """Decoded and checked (handed out or dead-lettered)."""
    skipped: int = 0
    """Read and skipped undecoded (below ``known_to``, or below a seed's offset)."""
    dropped: int = 0
    """Read where the backend was before it was sought to our position (a start, offset 0, or
    where we were before a rebalance), or of a partition that moved away, dropped undecoded."""
    rebuilt: int = 0
    """Read again to rebuild chains (from offset 0 or for one session)."""


StartHook = Callable[[str, int], Awaitable[StartAt | None]]


@dataclass
class _Started:
    known_to: int
    sessions: frozenset[bytes]
    seeds: dict[bytes, ChainSeed]


def seed_envelope(session_id: str, seq: int, hash_: bytes) -> Envelope:
    """A stand-in for a chain's last record: only session_id, seq and hash matter to a verifier."""
    return Envelope.model_construct(
        event_id="",
        session_id=session_id,
        seq=seq,
        actor="",
        occurred_at=datetime.fromtimestamp(0, UTC),
        causation_id=None,
        prev_hash=b"",
        body=KVAllBlocksCleared(engine_id=""),
        hash=hash_,
    )


class EventConsumer:
    """A member of a consumer group that yields ``LoggedEvent``s.

    Offsets are committed only when you call ``commit()``: commit after the
    effect of an event is durable, and a restart resumes right after it.
    """

    def __init__(
        self,
        log: ConsumedLog,
        group: str,
        topics: Sequence[str],
        *,
        from_beginning: bool,
        instance_id: str | None = None,
        start_at: StartHook | None = None,
    ) -> None:
        for name in topics:
            topic_table.topic(name)  # fail early on a typo
        self.log = log
        self.group = group
        self.topics = tuple(topics)
        self.from_beginning = from_beginning
        self.instance_id = instance_id
        self.stats = ConsumerStats()
        self._subscription: Subscription | None = None
        self._verifier = ChainVerifier()
        self._next: dict[tuple[str, int], int] = {}  # next offset expected per partition
        self._assigned: set[tuple[str, int]] = set()  # and the group's assignment count, at the last poll
        self._assignments = 0
        self._uncommitted: dict[tuple[str, int], int] = {}
        self._start_at = start_at
        self._started: dict[tuple[str, int], _Started] = {}  # partitions read from a StartAt
        self._pending_seeds: dict[tuple[str, int], dict[bytes, ChainSeed]] = {}
        self._at_backend: set[tuple[str, int]] = set()
        """Partitions begun where the backend reads them (a committed offset): their first record sets
        the position."""
        self._placing: set[tuple[str, int]] = set()
        """Partitions whose backend may be reading elsewhere than ``_next``: sought there at the
        end of each poll, their records at any other offset dropped until it is there."""
        self.reads = ReadCounts()
        self.rebuilt: set[tuple[str, str]] = set()
        """(topic, session) chains rebuilt one by one in partitions read from a StartAt."""

    async def start(self) -> EventConsumer:
        self._subscription = await self.log.backend.subscribe(
            self.group, self.topics, from_beginning=self.from_beginning, instance_id=self.instance_id
        )
        # A backend that assigns at once (Postgres) reads nothing before a start.
        await self._begin_assigned(self._subscription.assignment())
        self._place()
        return self

    async def close(self) -> None:
        if self._subscription is not None:
            await self._subscription.close()
            self._subscription = None

    async def __aenter__(self) -> EventConsumer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def assignment(self) -> set[tuple[str, int]]:
        """The (topic, partition) pairs this member owns now."""
        return self._subscription.assignment() if self._subscription else set()

    def assignment_at_poll(self) -> set[tuple[str, int]]:
        """The (topic, partition) pairs this member owned when its last poll returned: the ones
        ``position`` counts in. ``assignment()`` is the group's view now, which a rebalance still
        in flight after a poll (kafka-python runs it on its own thread) may change before the next."""
        return set(self._assigned)

    def membership(self) -> Membership:
        """Whether this member's partitions are surely still its own (``Subscription.membership``)."""
        return self._subscription.membership() if self._subscription else Membership.CONFIRMED

    async def refresh_membership(self) -> None:
        """Hear the group's latest word on this member now (``Subscription.refresh``)."""
        if self._subscription is not None:
            await self._subscription.refresh()

    def assignment_seen(self) -> bool:
        """Whether ``poll`` has told the log of this member's latest assignment. A rebalance
        completes inside the subscription's poll, on its thread: until that poll returns here,
        the log may hold the tails of a partition that another member wrote meanwhile."""
        return self._subscription is None or self._subscription.assignments == self._assignments

    def writing(self) -> AbstractContextManager[object]:
        """Held while a fenced writer hands records over (``Subscription.writing``)."""
        return self._subscription.writing() if self._subscription else nullcontext()

    def position(self, topic: str, partition: int) -> int:
        """The offset of the next record this consumer will hand out (or dead-letter) in a partition."""
        return self._next.get((topic, partition), 0)

    async def poll(self, timeout_s: float = 1.0, max_records: int = 500) -> list[LoggedEvent]:
        """The next verified events (possibly none after ``timeout_s``)."""
        if self._subscription is None:
            raise RuntimeError("call await consumer.start() first")
        records = await self._subscription.poll(timeout_s, max_records)
        assigned = self._subscription.assignment()
        if assigned != self._assigned or self._subscription.assignments != self._assignments:
            # Every partition this member held or holds: a kept one too, since a member dropped
            # from the group and back (same partitions, new assignment) may have had a successor.
            self.log.partitions_moved({p for _, p in assigned | self._assigned})
            self._assigned, self._assignments = assigned, self._subscription.assignments
            # A kept partition goes on from our position. The backend's may be elsewhere: a
            # kafka-python member the group dropped lost its positions, and reads the partitions
            # it gets back from their committed offsets.
            self._placing.update(tp for tp in assigned if tp in self._next)
        for tp in [tp for tp in self._next.keys() | self._at_backend if tp not in assigned]:
            # Moved to another member; if it comes back, it is read afresh. Nothing of it is
            # committed from here on: the new owner commits it.
            self._next.pop(tp, None)
            self._uncommitted.pop(tp, None)
            self._started.pop(tp, None)
            self._pending_seeds.pop(tp, None)
            self._placing.discard(tp)
            self._at_backend.discard(tp)
        decode = self.log.codec.decode
        verify = self._verifier.verify
        reads = self.reads
        delivered: list[LoggedEvent] = []
        deliver = delivered.append
        # Begin every partition new to us now, not at its first record: the backend is then sought
        # to where each begins before it fetches it (and a partition with nothing more to read
        # still gets its position).
        await self._begin_assigned(assigned)
        # Backends hand out runs of records of one partition: its topic is looked up once per run.
        # The next record of a run that needs nothing special takes the common path, which keeps
        # the partition's position in locals (``expected``, ``run``) and writes it back before
        # anything awaits (a commit() or position() meanwhile sees every step) and at the end.
        tp = ("", -1)  # the (topic, partition) of the current run; none yet
        topic = topic_table.AGENT_DLQ  # the Topic of the current run (set with the first record)
        started: _Started | None = None
        owned = False
        common = False  # whether tp's next record may take the common path: owned, placed, not started
        expected = -1  # tp's next offset on the common path
        run = 0  # records the common path took since tp's position was last written back
        placing = self._placing  # usually empty (it holds partitions just assigned): no lookup then
        try:
            for record in records:
                position, key, value = record
                name, partition, offset = position
                if common and offset == expected and partition == tp[1] and name == tp[0]:
                    expected = offset + 1
                    run += 1
                    try:
                        envelope = decode(value)
                        verify(topic, key, envelope, position)
                    except RecordError as error:
                        self._advance(tp, expected, run)
                        run = 0
                        await self._set_aside(record, error)
                        continue
                    deliver(new_tuple(LoggedEvent, (position, envelope)))
                    continue
                if run:
                    self._advance(tp, expected, run)
                    run = 0
                if partition != tp[1] or name != tp[0]:
                    tp = (name, partition)
                    topic = topic_table.topic(name)
                    started = self._started.get(tp)
                    owned = tp in assigned
                    common = False
                if not owned:
                    reads.dropped += 1  # fetched before the partition moved away: its owner reads it
                    continue
                next_offset = self._next.get(tp)
                if next_offset is None:
                    self._at_backend.discard(tp)
                    next_offset = self._next[tp] = 0  # its chains are rebuilt up to its first record's offset
                if placing and tp in placing:
                    if offset != next_offset:
                        reads.dropped += 1  # fetched from where the backend was: it is sought to ours below
                        continue
                    placing.discard(tp)  # it reads from our position
                elif offset != next_offset:
                    if started is None:
                        await self._rebuild_chains(tp, offset)
                    elif offset < next_offset:
                        reads.dropped += 1  # before our start: the backend could not seek there
                        continue
                    # (after a start, a gap is the backend's: compacted or aborted records)
                self._next[tp] = self._uncommitted[tp] = expected = offset + 1
                common = started is None
                if started is not None:
                    session = key or b""
                    seed = started.seeds.get(session)
                    if (offset < started.known_to and session not in started.sessions) or (
                        seed is not None and offset < seed.offset
                    ):
                        reads.skipped += 1  # a session the caller needs nothing of here, or holds already
                        continue
                reads.decoded += 1
                try:
                    envelope = decode(value)
                    if started is not None:
                        await self._late_verify(tp, topic, key, envelope, position, started)
                    else:
                        verify(topic, key, envelope, position)
                except RecordError as error:
                    await self._set_aside(record, error)
                    continue
                deliver(new_tuple(LoggedEvent, (position, envelope)))
        finally:
            if run:
                self._advance(tp, expected, run)
        self._place()
        self.stats.num_delivered += len(delivered)
        return delivered

    def _advance(self, tp: tuple[str, int], next_offset: int, decoded: int) -> None:
        """Write back where ``poll``'s common path got to in ``tp``, after ``decoded`` records."""
        self._next[tp] = self._uncommitted[tp] = next_offset
        self.reads.decoded += decoded

    async def _set_aside(self, record: RawRecord, error: RecordError) -> None:
        """Dead-letter a record that failed its checks, and count it."""
        await self.log.dead_letter(record, error, self.group)
        self.stats.num_dead_lettered += 1
        name = type(error).__name__
        self.stats.dead_lettered_by_error[name] = self.stats.dead_lettered_by_error.get(name, 0) + 1

    def _place(self) -> None:
        """Seek the backend to our position in each partition it may be reading elsewhere (one
        that cannot seek yet is asked again after the next poll, its records dropped till then)."""
        assert self._subscription is not None
        for tp in sorted(self._placing):
            if self._subscription.seek(tp[0], tp[1], self._next[tp]):
                self._placing.discard(tp)

    def seed(self, topic: str, partition: int, session_id: str, seed: ChainSeed) -> None:
        """The caller read a session's records of a partition below ``seed.offset`` itself (and
        verified them): skip them here, and check its next record against ``seed``'s tail.
        Only for partitions read from a ``StartAt`` (or not read yet)."""
        tp = (topic, partition)
        key = session_id.encode()
        started = self._started.get(tp)
        if started is None:
            if tp in self._next:
                raise ValueError(f"{topic}[{partition}] is read from offset 0: nothing to seed")
            self._pending_seeds.setdefault(tp, {})[key] = seed  # for when it begins
            return
        started.seeds[key] = seed
        if seed.seq is not None:
            self._verifier.forget(topic, lambda session: session == session_id)
            self._verifier.accept(topic_table.topic(topic), seed_envelope(session_id, seed.seq, seed.hash))

    async def _begin_assigned(self, assigned: set[tuple[str, int]]) -> None:
        """``_begin`` every assigned partition not begun yet."""
        for tp in sorted(tp for tp in assigned if tp not in self._next and tp not in self._at_backend):
            await self._begin(tp, topic_table.topic(tp[0]))

    async def _begin(self, tp: tuple[str, int], topic: topic_table.Topic) -> None:
        """A partition new to this member: where to read it from: the caller's start, else 0
        (``from_beginning``), else where the backend reads it (a committed offset; its first
        record sets the position). At a start or 0 the backend is sought there: it may be reading
        from elsewhere (a committed offset), which would skip records or read them twice."""
        start = await self._start_at(*tp) if self._start_at is not None else None
        name, partition = tp
        # Its chains are read anew (this member may have read them before it moved away).
        self._verifier.forget(name, lambda session: self.log.partition_for(session) == partition)
        if start is None:
            if self.from_beginning:
                self._next[tp] = 0
                self._placing.add(tp)
            else:
                self._at_backend.add(tp)
            return
        seeds = {s.encode(): seed for s, seed in start.seeds.items()}
        seeds.update(self._pending_seeds.pop(tp, {}))  # given since: newer
        for key, seed in seeds.items():
            if seed.seq is not None:
                self._verifier.accept(topic, seed_envelope(key.decode(), seed.seq, seed.hash))
        self._started[tp] = _Started(start.known_to, frozenset(s.encode() for s in start.sessions), seeds)
        self._next[tp] = self._uncommitted[tp] = start.offset
        self._placing.add(tp)

    async def _late_verify(
        self,
        tp: tuple[str, int],
        topic: topic_table.Topic,
        key: bytes | None,
        envelope: Envelope,
        position: Position,
        started: _Started,
    ) -> None:
        """``verify`` in a partition read from a start: a chain that began below the start, or a
        seed the record does not follow, is rebuilt from the session's own records first."""
        session_id = envelope.session_id
        seeded = started.seeds.pop(session_id.encode(), None) is not None  # checked once, on its next record
        if envelope.seq > 0 and self._verifier.tail(topic.name, session_id) is None:
            await self._rebuild_chain(tp, session_id, position.offset)
            seeded = False
        try:
            self._verifier.verify(topic, key, envelope, position)
        except RecordError:
            if not seeded:
                raise
            await self._rebuild_chain(tp, session_id, position.offset)  # the seed was wrong, not the record?
            self._verifier.verify(topic, key, envelope, position)

    async def _rebuild_chain(self, tp: tuple[str, int], session_id: str, offset: int) -> None:
        """Re-derive one session's chain tail in one partition from its records before ``offset``."""
        name, partition = tp
        topic = topic_table.topic(name)
        self._verifier.forget(name, lambda session: session == session_id)
        for record in await self.log.backend.read_key(name, partition, session_id.encode()):
            if record.position.offset >= offset:
                break
            self._reverify(topic, record)
        self.rebuilt.add((name, session_id))

    async def commit(self, through: LoggedEvent | None = None) -> None:
        """Commit everything polled so far, or only up to and including ``through`` in its partition."""
        if self._subscription is None:
            raise RuntimeError("call await consumer.start() first")
        if through is None:
            offsets, self._uncommitted = self._uncommitted, {}
        else:
            tp = (through.position.topic, through.position.partition)
            offsets = {tp: through.position.offset + 1}
            if self._uncommitted.get(tp) == through.position.offset + 1:
                del self._uncommitted[tp]
        if offsets:
            await self._subscription.commit(offsets)

    async def __aiter__(self) -> AsyncIterator[LoggedEvent]:
        """Events forever (until the task is cancelled); commit as you go."""
        while True:
            for event in await self.poll():
                yield event

    async def _rebuild_chains(self, tp: tuple[str, int], offset: int) -> None:
        """Re-derive chain tails of one partition from its records before ``offset``."""
        name, partition = tp
        topic = topic_table.topic(name)
        self._verifier.forget(name, lambda session: self.log.partition_for(session) == partition)
        async for record in self.log.backend.scan(name, partition, 0, offset):
            self._reverify(topic, record)

    def _reverify(self, topic: topic_table.Topic, record: RawRecord) -> None:
        """Check a record read again to rebuild a chain (it advances the chain's tail)."""
        self.reads.rebuilt += 1
        try:
            envelope = self.log.codec.decode(record.value)
            self._verifier.verify(topic, record.key, envelope, record.position)
        except RecordError:
            pass  # it was dead-lettered when it was first read
