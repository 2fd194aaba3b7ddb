"""Recovery of the session roles from partition marks (docs/branches.md, "Worker recovery").

Without a snapshot store a session role (``workers/runtime.py``) replays every
partition it is assigned from offset 0. With one, a caught-up worker saves, per
partition, a mark (``services/marks.py``): every ``mark_every`` events it folds there,
when the partition catches up, and on a clean shutdown. A member that is assigned a
partition with a mark (after a restart, or taking it over) reads each topic from the
mark's start instead of 0 (``log.consumer.StartAt``), and:

- a session the mark lists with a checkpoint starts from that checkpoint's
  snapshot: the consumer skips its records below the cut and checks the next
  ones against the snapshot's chain tails; the records after the cut are
  folded onto the snapshot, in history order, at catch-up, and only if the
  ``CheckpointTaken`` among them vouches for the snapshot (``distrust``, the
  rule ``replay_session`` uses) and no chain of it had to be rebuilt;
  otherwise it is loaded from the log;
- a session met through a record that is not its beginning (its chain began
  below the start: seq > 0; or, once caught up, any record of a session not
  held that is not its start) is loaded from the log (``load_session``: the
  newest trusted snapshot plus the records after it, or every record), all of
  it but that record and what follows it in its topic; the consumer skips the
  records the load read; then the record is folded as usual;
- at catch-up, a listed session not met, or a session begun from scratch
  without its opening record, is loaded from the log too.

``MarkRecovery`` is the part of ``SessionWorker`` that does this; it works on the
worker's session table (``sessions``, ``_low``) and its consumer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from log import LoggedEvent, SharedLog
from log.consumer import ChainSeed, EventConsumer, StartAt
from log.snapshots import Snapshot, SnapshotStore
from log.types import PartitionMark
from schemas.events import SessionRequested, SessionStarted
from services.checkpoint import fold_events, state_from_json
from services.marks import SessionLow, make_mark, needs_work
from services.replay import cut_events, distrust, history_order, without_parent_history
from services.session import SessionState, ToolStatus
from workers.replay import load_session

__all__ = ["MarkRecovery", "RecoveryCounts"]

_log = logging.getLogger(__name__)


def opens(event: LoggedEvent) -> bool:
    """A session's first record: its request, or the start of a fork (which has no request)."""
    body = event.body
    return event.seq == 0 and (
        isinstance(body, SessionRequested) or (isinstance(body, SessionStarted) and body.parent_session_id is not None)
    )


@dataclass
class RecoveryCounts:
    """What recovering from marks did (for tests and benchmarks)."""

    marks_used: int = 0
    marks_saved: int = 0
    from_snapshot: int = 0
    """Sessions started from the snapshot their mark named (the log vouched for it)."""
    distrusted: int = 0
    """Sessions whose snapshot the log did not vouch for: loaded from the log instead."""
    loaded: int = 0
    """Sessions loaded with ``load_below`` (met late, distrusted, or not met)."""
    loaded_records: int = 0
    """Records those loads read."""


@dataclass
class PartitionRecovery:
    """One partition being read from a mark, until it catches up."""

    mark: PartitionMark
    snapshots: dict[str, Snapshot]
    buffered: dict[str, list[LoggedEvent]] = field(default_factory=dict)
    """The records after the cut of each session starting from a snapshot, folded at catch-up."""
    fresh: set[str] = field(default_factory=set)
    """Sessions begun from scratch during this catch-up."""
    opened: set[str] = field(default_factory=set)


class MarkRecovery:
    """Marks of a session role: where a partition new to it starts, what its catch-up folds, saving marks."""

    # The session worker's, which this works on.
    log: SharedLog
    role: str
    group: str
    topics: Sequence[str]
    acts_on: frozenset[ToolStatus]
    consumer: EventConsumer | None
    sessions: dict[str, SessionState]
    _low: dict[str, dict[str, int]]  # session -> topic -> lowest offset its fold holds
    _ready: set[int]

    def _init_recovery(self, snapshots: SnapshotStore | None, mark_every: int) -> None:
        self.snapshots = snapshots
        """Snapshots and partition marks; None: every partition is replayed from offset 0."""
        self.mark_every = mark_every
        self.recovery = RecoveryCounts()
        self._marks: dict[int, PartitionRecovery | None] = {}  # mark looked up per partition (None: none)
        self._recovering: dict[int, PartitionRecovery] = {}  # partitions read from a mark, not caught up yet
        self._marked: set[int] = set()  # partitions read from a mark: sessions below it may be met late
        self._since_mark: dict[int, int] = {}  # events folded per partition since its last mark

    def _forget_recovery(self, partition: int) -> None:
        self._marks.pop(partition, None)
        self._recovering.pop(partition, None)
        self._marked.discard(partition)
        self._since_mark.pop(partition, None)

    async def _meet(self, event: LoggedEvent) -> bool:
        """Before an event is folded: count it towards the next mark and, in a partition read
        from a mark, load its session if the event is not its beginning. True: the event is
        held for its snapshot's catch-up (not folded now)."""
        partition = event.position.partition
        session_id = event.session_id
        self._since_mark[partition] = self._since_mark.get(partition, 0) + 1
        if partition in self._marked:
            recovery = self._recovering.get(partition)
            if recovery is not None and session_id in recovery.buffered:
                recovery.buffered[session_id].append(event)  # folded onto its snapshot at catch-up
                return True
            if session_id not in self.sessions:
                if event.seq > 0 or (
                    recovery is None and not isinstance(event.body, SessionStarted | SessionRequested)
                ):
                    await self._load(session_id, partition, event)  # it began below where we started
                elif recovery is not None:
                    recovery.fresh.add(session_id)
            if recovery is not None and opens(event):
                recovery.opened.add(session_id)
        return False

    async def _caught_up_from_mark(self, partition: int) -> None:
        """A partition's replay is done: finish its recovery, and mark it now (a restart reads from here)."""
        if (recovery := self._recovering.pop(partition, None)) is not None:
            await self._finish_recovery(partition, recovery)
        self._since_mark[partition] = self.mark_every

    async def _start_at(self, topic: str, partition: int) -> StartAt | None:
        """The consumer's question for a partition new to us: where to start reading ``topic``."""
        assert self.snapshots is not None
        if partition not in self._marks:
            self._marks[partition] = None
            try:
                mark = await self.snapshots.load_mark(self.group, partition)
                if mark is not None:
                    found = await self.snapshots.get_many(
                        {session_id: checkpoint for session_id, checkpoint in mark.sessions.items() if checkpoint}
                    )
                    recovery = PartitionRecovery(mark, found, {s: [] for s in found})
                    self._marks[partition] = self._recovering[partition] = recovery
                    self._marked.add(partition)
                    self.recovery.marks_used += 1
                    _log.info(
                        "%s: partition %d starts at its mark %s (%d sessions, %d from snapshots)",
                        self.role,
                        partition,
                        mark.start,
                        len(mark.sessions),
                        len(found),
                    )
            except Exception:
                _log.exception("%s: no mark for partition %d (reading it from offset 0)", self.role, partition)
                return None
        known = self._marks[partition]
        if known is None:
            return None
        mark = known.mark
        seeds = {}
        for session_id, snapshot in known.snapshots.items():
            tail = snapshot.tails.get(topic)
            seeds[session_id] = ChainSeed(
                snapshot.cut.get(topic, 0),
                tail.seq if tail is not None else None,
                bytes.fromhex(tail.hash_hex) if tail is not None else b"",
            )
        # A session listed with a checkpoint whose snapshot is gone is not listed here: its records are
        # skipped, and it is loaded from the log at catch-up.
        listed = frozenset(s for s, c in mark.sessions.items() if c is None or s in known.snapshots)
        return StartAt(mark.start.get(topic, 0), mark.read_to.get(topic, 0), listed, seeds)

    async def _load(self, session_id: str, partition: int, event: LoggedEvent | None) -> None:
        """Fold a session we meet late from the log: every record of it in our topics so far but
        ``event`` and what follows it in its topic (folded as they come); the consumer skips the
        records the load read and checks the next ones against their chains' tails."""
        assert self.consumer is not None
        before = (event.topic, event.position.offset) if event is not None else None
        loaded = await load_session(self.log, self.snapshots, session_id, self.topics, before)
        self.sessions[session_id] = loaded.state
        self._low[session_id] = dict(loaded.low)
        for topic, tail in loaded.tails.items():
            if before is None or topic != before[0]:  # that chain was checked up to the event already
                seed = ChainSeed(loaded.read_to[topic], tail.seq, bytes.fromhex(tail.hash_hex))
                self.consumer.seed(topic, partition, session_id, seed)
        self.recovery.loaded += 1
        self.recovery.loaded_records += loaded.num_records
        _log.info("%s: loaded %s from the %s (%d records)", self.role, session_id, loaded.source, loaded.num_records)

    async def _finish_recovery(self, partition: int, recovery: PartitionRecovery) -> None:
        """Catch-up of a partition read from a mark: fold the snapshot sessions, load the rest."""
        assert self.consumer is not None
        rebuilt = self.consumer.rebuilt
        for session_id, snapshot in recovery.snapshots.items():
            events = recovery.buffered.pop(session_id)
            reason = (
                "a chain of it did not follow the snapshot's tails"
                if any((t, session_id) in rebuilt for t in self.topics)
                else distrust(snapshot.checkpoint_id, snapshot.cut, snapshot.state, events)
            )
            if reason is None:
                start = without_parent_history(state_from_json(snapshot.state))
                self.sessions[session_id] = fold_events(session_id, cut_events(history_order(events)), start)
                self._low[session_id] = {t: snapshot.cut.get(t, 0) for t in self.topics}
                self.recovery.from_snapshot += 1
                continue
            _log.warning("%s: snapshot %s of %s not used (%s)", self.role, snapshot.checkpoint_id, session_id, reason)
            self.recovery.distrusted += 1
            await self._load(session_id, partition, None)
        for session_id in recovery.mark.sessions:
            if session_id not in self.sessions:
                await self._load(session_id, partition, None)  # listed, never met: its records lie below
        for session_id in sorted(recovery.fresh - recovery.opened):
            # Begun "from scratch" without its request: records of it lie below the start after all.
            self.sessions.pop(session_id, None)
            await self._load(session_id, partition, None)

    async def _save_marks(self, *, due_only: bool) -> None:
        if self.snapshots is None or self.consumer is None:
            return
        for partition in sorted(self._ready):
            if due_only and self._since_mark.get(partition, 0) < self.mark_every:
                continue
            try:
                await self._save_mark(partition)
            except Exception:
                _log.exception("%s: could not save the mark of partition %d", self.role, partition)

    async def _save_mark(self, partition: int) -> None:
        assert self.snapshots is not None and self.consumer is not None
        self._since_mark[partition] = 0
        read_to = {t: self.consumer.position(t, partition) for t in self.topics}
        in_partition = [s for s in self.sessions.values() if self.log.partition_for(s.session_id) == partition]
        needed = [s for s in in_partition if needs_work(s, self.acts_on)]
        with_snapshots = await self.snapshots.checkpoint_ids(s.session_id for s in needed) if needed else {}
        lows = []
        for state in needed:
            have = with_snapshots.get(state.session_id, set())
            cuts = [(c, dict(k.taken.cut)) for c, k in state.checkpoints.items() if c in have]
            lows.append(SessionLow(state.session_id, dict(self._low.get(state.session_id, {})), cuts))
        await self.snapshots.save_mark(self.group, make_mark(partition, read_to, lows))
        self.recovery.marks_saved += 1
