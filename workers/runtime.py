"""The loop every role runs: consume -> fold -> act, over the sessions of its partitions.

A worker is a member of its role's consumer group. For each partition it is
assigned, it first *replays* the partition of every topic it reads, from
offset 0 (or from its mark, below) up to the end offsets seen at assignment time, folding the events
into per-session state without acting. Once a partition has caught up, the
worker *resumes* each of its sessions (the residual work: what the log says
was started and never finished) and from then on acts on each new event.
That is the whole recovery story: a restarted or replacement worker rebuilds
its state from the log and continues; every append it makes uses a
deterministic event id, so redoing an append is a no-op.

**Marks** (with a snapshot store; docs/branches.md, "Worker recovery"). A
caught-up worker saves, per partition, a mark (``services/marks.py``): every
``mark_every`` events it folds there, when the partition catches up, and on a
clean shutdown. A member that is assigned a partition with a mark (after a
restart, or taking it over) reads each topic from the mark's start instead
of 0 (``log.consumer.StartAt``), and:

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

Subclasses implement ``resume(state)`` and ``on_event(state, event)``; both
run in the worker's task and may append. ``run()`` returns after
``shutdown()`` once in-flight work is drained.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import uuid
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from log import Draft, DuplicateVerdict, LoggedEvent, RecordError, SharedLog, UnknownSession
from log.consumer import ChainSeed, EventConsumer, StartAt
from log.snapshots import Snapshot, SnapshotStore
from log.types import PartitionMark
from schemas.envelope import Envelope
from schemas.events import Event, SessionRequested, SessionStarted
from services.checkpoint import fold_events, state_from_json
from services.marks import IN_FLIGHT, SessionLow, make_mark, needs_work
from services.replay import cut_events, distrust, history_order, without_parent_history
from services.session import SessionState, ToolStatus
from workers.replay import load_session

_log = logging.getLogger(__name__)

EVENT_ID_NAMESPACE = uuid.UUID("6f1c2d4e-8a57-4d0b-9a33-5b1e0c7f2a10")


def event_id(session_id: str, kind: str, key: str = "") -> str:
    """A deterministic event id: the same logical event always gets the same id."""
    return str(uuid.uuid5(EVENT_ID_NAMESPACE, f"{session_id}/{kind}/{key}"))


def log_namespace(log: SharedLog) -> str:
    return str(getattr(log.backend, "namespace", "") or "")


def snapshot_url(explicit: str | None, log_url: str | None) -> str | None:
    """Where snapshots (and marks) go: an explicit URL, else the ledger's or the test Postgres,
    else a Postgres log itself."""
    for candidate in (
        explicit,
        os.environ.get("AGENTLOG_SNAPSHOT_URL"),
        os.environ.get("AGENTLOG_LEDGER_URL"),
        os.environ.get("AGENTLOG_PG_URL"),
    ):
        if candidate:
            return candidate
    url = log_url or os.environ.get("AGENTLOG_LOG_URL") or ""
    return url if url.startswith(("postgresql://", "postgres://")) else None


def add_snapshot_arguments(parser: Any) -> None:
    """``--snapshot-url`` for roles that only read snapshots (the planner has its own, same meaning)."""
    parser.add_argument(
        "--snapshot-url",
        default=None,
        help="Postgres of snapshots and partition marks (default: AGENTLOG_SNAPSHOT_URL, AGENTLOG_LEDGER_URL, "
        "AGENTLOG_PG_URL, or the log itself when it is Postgres; none: replay partitions from offset 0)",
    )


async def open_snapshot_store(log: SharedLog, args: Any) -> SnapshotStore | None:
    """The store of snapshots and marks for a role that only reads snapshots and keeps marks; None
    (replay from offset 0) when there is none or it cannot be opened: marks only save time."""
    url = snapshot_url(getattr(args, "snapshot_url", None), getattr(args, "log_url", None))
    if not url:
        return None
    try:
        return await SnapshotStore(url, log_namespace(log)).start()
    except (OSError, asyncpg.PostgresError) as e:
        _log.warning("no snapshot store (%s): partitions are replayed from offset 0", e)
        return None


def _opens(event: LoggedEvent) -> bool:
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
class _Recovery:
    """One partition being read from a mark, until it catches up."""

    mark: PartitionMark
    snapshots: dict[str, Snapshot]
    buffered: dict[str, list[LoggedEvent]] = field(default_factory=dict)
    """The records after the cut of each session starting from a snapshot, folded at catch-up."""
    fresh: set[str] = field(default_factory=set)
    """Sessions begun from scratch during this catch-up."""
    opened: set[str] = field(default_factory=set)


class SessionWorker:
    """Base class of the role workers (planner, decider, executor)."""

    role = "worker"
    topics: Sequence[str] = ()
    reports_duplicate_verdicts = False
    """Dead-letter a second verdict for a call (the role that acts on verdicts does it, once)."""
    reports_unknown_sessions = False
    """Dead-letter events of sessions nobody requested (the role that starts sessions does it)."""
    acts_on: frozenset[ToolStatus] = IN_FLIGHT
    """The tool call states this role acts on, even in a finished session (what a mark keeps)."""
    reconcile_every_s: float | None = None
    """Look at every session again this often (``reconcile``): a level-triggered safety net for
    roles whose work is idempotent, so that a lost wake-up delays a session instead of stalling it."""

    def __init__(
        self,
        log: SharedLog,
        *,
        group: str | None = None,
        instance_id: str | None = None,
        poll_timeout_s: float = 0.5,
        snapshots: SnapshotStore | None = None,
        mark_every: int | None = None,
    ) -> None:
        self.log = log
        self.group = group or self.role
        self.instance_id = instance_id
        self.poll_timeout_s = poll_timeout_s
        self.sessions: dict[str, SessionState] = {}
        self._boundary: dict[tuple[str, int], int] = {}  # replay target per (topic, partition)
        self._ready: set[int] = set()  # partitions caught up and acted on
        self._owned: set[int] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = asyncio.Event()
        self._orphans: dict[str, list[LoggedEvent]] = {}  # events of sessions not (yet) requested
        self.num_events = 0
        self.snapshots = snapshots
        """Snapshots and partition marks; None: every partition is replayed from offset 0."""
        self.mark_every = mark_every if mark_every is not None else int(os.environ.get("AGENTLOG_MARK_EVERY", "500"))
        self.recovery = RecoveryCounts()
        self.consumer: EventConsumer | None = None
        self._low: dict[str, dict[str, int]] = {}  # session -> topic -> lowest offset its fold holds
        self._marks: dict[int, _Recovery | None] = {}  # mark looked up per partition (None: none)
        self._recovering: dict[int, _Recovery] = {}  # partitions read from a mark, not caught up yet
        self._marked: set[int] = set()  # partitions read from a mark: sessions below it may be met late
        self._since_mark: dict[int, int] = {}  # events folded per partition since its last mark
        self._caught_up = asyncio.Event()  # set after each promotion

    @property
    def caught_up(self) -> bool:
        """Every partition this member owns has been replayed (and is acted on)."""
        return bool(self._owned) and self._owned <= self._ready

    async def wait_caught_up(self) -> None:
        """Until ``caught_up`` (for tests and benchmarks)."""
        while not self.caught_up:
            self._caught_up.clear()
            await self._caught_up.wait()

    # ------------------------------------------------------------- for roles

    async def resume(self, state: SessionState) -> None:
        """Called once per session when its partition has caught up (after a start or a takeover)."""

    async def on_event(self, state: SessionState, event: LoggedEvent) -> None:
        """Called for each new event of a session in a caught-up partition (after it was folded)."""

    async def on_partition_lost(self, partition: int) -> None:
        """Called when a partition moves to another member; its sessions are forgotten."""

    async def reconcile(self, state: SessionState) -> None:
        """Called every ``reconcile_every_s`` for each unfinished session of a caught-up partition."""

    # ------------------------------------------------------ process plumbing

    @staticmethod
    def add_arguments(parser: Any) -> None:
        """Role-specific command line options (see workers/main.py)."""

    @classmethod
    async def create(cls, log: SharedLog, args: Any) -> SessionWorker:
        """Build the worker from parsed options."""
        return cls(log, group=args.group, instance_id=args.instance_id)

    async def close(self) -> None:
        """Release what ``create`` opened."""

    # ---------------------------------------------------------------- helpers

    def state(self, session_id: str) -> SessionState:
        state = self.sessions.get(session_id)
        if state is None:
            state = self.sessions[session_id] = SessionState(session_id)
        return state

    async def append(self, session_id: str, body: Event, *, kind: str, key: str = "", cause: str | None = None) -> None:
        """Append with a deterministic event id and fold the event into our state at once."""
        eid = event_id(session_id, kind, key)
        # The time is read from the log's clock here and stamped on the record, so that our
        # fold and every reader's fold of this event see the same occurred_at.
        occurred_at = self.log.clock()
        await self.log.append_many([Draft(session_id, body, eid, cause, occurred_at)])
        # Fold our own write now; reading it back later is a no-op (same event id).
        self.state(session_id).apply(
            Envelope.model_construct(
                event_id=eid,
                session_id=session_id,
                seq=-1,
                actor=self.log.actor,
                occurred_at=occurred_at,
                causation_id=cause,
                prev_hash=b"",
                body=body,
                hash=b"",
            )
        )

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` in the background; ``run()`` waits for it before returning."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            _log.error("%s task failed", self.role, exc_info=task.exception())

    # -------------------------------------------------------------------- loop

    def shutdown(self) -> None:
        """Ask ``run()`` to stop polling, drain in-flight work and return."""
        self._stopping.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.shutdown)

    async def run(self) -> None:
        consumer = self.consumer = await EventConsumer(
            self.log,
            self.group,
            list(self.topics),
            from_beginning=True,
            instance_id=self.instance_id,
            start_at=self._start_at if self.snapshots is not None else None,
        ).start()
        loop = asyncio.get_running_loop()
        next_reconcile = loop.time() + (self.reconcile_every_s or 0)
        try:
            while not self._stopping.is_set():
                events = await consumer.poll(timeout_s=self.poll_timeout_s)
                await self._track_assignment(consumer.assignment())
                for event in events:
                    await self._handle(event)
                await self._promote_caught_up(consumer)
                await self._save_marks(due_only=True)
                await consumer.commit()
                if self.reconcile_every_s is not None and loop.time() >= next_reconcile:
                    next_reconcile = loop.time() + self.reconcile_every_s
                    for state in list(self.sessions.values()):
                        ready = self.log.partition_for(state.session_id) in self._ready
                        # A finished session may still have an operator command to carry out (a restore).
                        unfinished = not state.finished or bool(state.pending_commands)
                        if ready and state.status is not None and unfinished:
                            await self.reconcile(state)
            if self._tasks:
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
            await self._save_marks(due_only=False)  # a clean stop: the next start reads the least
        finally:
            await consumer.close()

    async def _track_assignment(self, assignment: set[tuple[str, int]]) -> None:
        owned = {p for _, p in assignment}
        new = sorted(owned - self._owned)
        ends = {topic: await self.log.end_offsets(topic) for topic in self.topics} if new else {}
        for partition in new:
            for topic in self.topics:
                self._boundary[(topic, partition)] = ends[topic].get(partition, 0)
        for partition in sorted(self._owned - owned):
            self._ready.discard(partition)
            self._marks.pop(partition, None)
            self._recovering.pop(partition, None)
            self._marked.discard(partition)
            self._since_mark.pop(partition, None)
            for key in [k for k in self._boundary if k[1] == partition]:
                del self._boundary[key]
            for session_id in [s for s in self.sessions if self.log.partition_for(s) == partition]:
                del self.sessions[session_id]
                self._low.pop(session_id, None)
            await self.on_partition_lost(partition)
            _log.info("%s: partition %d moved away", self.role, partition)
        self._owned = owned

    async def _handle(self, event: LoggedEvent) -> None:
        self.num_events += 1
        partition = event.position.partition
        session_id = event.session_id
        self._since_mark[partition] = self._since_mark.get(partition, 0) + 1
        if partition in self._marked:
            recovery = self._recovering.get(partition)
            if recovery is not None and session_id in recovery.buffered:
                recovery.buffered[session_id].append(event)  # folded onto its snapshot at catch-up
                return
            if session_id not in self.sessions:
                if event.seq > 0 or (
                    recovery is None and not isinstance(event.body, SessionStarted | SessionRequested)
                ):
                    await self._load(session_id, partition, event)  # it began below where we started
                elif recovery is not None:
                    recovery.fresh.add(session_id)
            if recovery is not None and _opens(event):
                recovery.opened.add(session_id)
        self._low.setdefault(session_id, {}).setdefault(event.topic, event.position.offset)
        state = self.state(event.session_id)
        num_anomalies = len(state.anomalies)
        if not state.apply(event.envelope):
            return  # our own append, already folded
        if self.reports_duplicate_verdicts and len(state.anomalies) > num_anomalies:
            await self.dead_letter(event, DuplicateVerdict(f"{event.position}: {state.anomalies[-1]}"))
            return
        if self.reports_unknown_sessions and state.status is None and not isinstance(event.body, SessionRequested):
            # While replaying, the request may still come on another topic: judge at catch-up.
            self._orphans.setdefault(state.session_id, []).append(event)
            if event.position.partition in self._ready:
                await self._report_orphans(state)
            return
        if event.position.partition in self._ready:
            await self.on_event(state, event)

    async def _report_orphans(self, state: SessionState) -> None:
        """Everything about a session follows its request: events of a session that was never
        requested, once the partition is read, are dead-lettered and forgotten."""
        events = self._orphans.pop(state.session_id, [])
        if state.status is not None:
            return
        for event in events:
            await self.dead_letter(
                event, UnknownSession(f"{event.position}: no session {state.session_id} was requested")
            )
        self.sessions.pop(state.session_id, None)

    async def dead_letter(self, event: LoggedEvent, error: RecordError) -> None:
        """Set aside an event that breaks the protocol: it goes to agent.dlq with the reason."""
        position = event.position
        async for record in self.log.scan(position.topic, position.partition, position.offset, position.offset + 1):
            await self.log.dead_letter(record, error, self.group)
        _log.warning("%s dead-lettered %s: %s", self.role, position, error)

    async def _promote_caught_up(self, consumer: Any) -> None:
        for partition in sorted(self._owned - self._ready):
            if all(consumer.position(t, partition) >= self._boundary.get((t, partition), 0) for t in self.topics):
                if (recovery := self._recovering.pop(partition, None)) is not None:
                    await self._finish_recovery(partition, recovery)
                self._ready.add(partition)
                self._since_mark[partition] = self.mark_every  # mark it now: a restart reads from here
                sessions = [s for s in self.sessions.values() if self.log.partition_for(s.session_id) == partition]
                _log.info("%s: partition %d caught up (%d sessions)", self.role, partition, len(sessions))
                for state in sessions:
                    if state.session_id in self._orphans:
                        await self._report_orphans(state)
                    if state.status is not None:
                        await self.resume(state)
                self._caught_up.set()

    # ------------------------------------------------------------------- marks

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
                    recovery = _Recovery(mark, found, {s: [] for s in found})
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

    async def _finish_recovery(self, partition: int, recovery: _Recovery) -> None:
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
