"""The loop of the session roles (planner, decider, executor): consume -> fold -> act, per session.

A ``SessionWorker`` is a ``workers.worker.Worker`` (lifecycle, offsets, commits,
signals, event ids) that folds every event it reads into the state of its session
(``services.session.SessionState``). For each partition it is assigned, it first
*replays* the partition of every topic it reads, from offset 0 (or from its mark:
``workers/recovery.py``) up to the end offsets seen at assignment time, folding the
events without acting. Once a partition has caught up, the worker *resumes* each of
its sessions (the residual work: what the log says was started and never finished)
and from then on acts on each new event. That is the whole recovery story: a
restarted or replacement worker rebuilds its state from the log and continues;
every append it makes uses a deterministic event id (``event_id``), so redoing an
append is a no-op.

Subclasses implement ``resume(state)`` and ``on_event(state, event)``; both run in
the worker's task and may append. Offsets are committed after every poll, once its
appends are durable (``append`` waits for them); marks are saved before the commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Sequence

from log import Draft, DuplicateVerdict, LoggedEvent, RecordError, SharedLog, UnknownSession
from log.backend import Membership
from log.consumer import EventConsumer
from log.errors import BackendUnavailable
from log.snapshots import SnapshotStore
from log.topics import topic_of
from schemas.envelope import Envelope
from schemas.events import Event, SessionRequested
from services.decide import Append
from services.marks import IN_FLIGHT
from services.session import SessionState, ToolStatus
from workers.config import default_mark_every
from workers.recovery import MarkRecovery, RecoveryCounts
from workers.worker import SESSION_EVENT_IDS, PartitionMoved, Worker

__all__ = ["RecoveryCounts", "SessionWorker", "event_id"]

_log = logging.getLogger(__name__)

MEMBERSHIP_POLL_S = 0.05
"""How often an append waiting for the group's word on this member looks again."""
APPEND_BACKOFF_S = 0.5
APPEND_BACKOFF_MAX_S = 5.0
APPEND_RETRY_S = 120.0
"""An append the log could not deliver is tried again (backoff from 0.5 s to 5 s) for this long,
then the worker fails (and is restarted): the producer's own 120 s before bounded delivery."""
GROUP_WAIT_WARN_S = 30.0
"""An append that has waited this long for the group's word on this member says so, with what it
waits for, and again every ``GROUP_WAIT_WARN_S`` after: the wait has no bound of its own (the
group confirms the member or drops it), and one that never ends would otherwise be silent
(docs/reliability.md, "Two sessions never started on a new seed")."""


class _GroupWait:
    """How long one append has waited for the group's word, and when it last said so."""

    __slots__ = ("said", "since")

    def __init__(self, now: float) -> None:
        self.since = now
        self.said = now

    def due(self, now: float) -> bool:
        """Whether to say so now (then not again for ``GROUP_WAIT_WARN_S``)."""
        if now - self.said < GROUP_WAIT_WARN_S:
            return False
        self.said = now
        return True


class _InDoubt(Exception):
    """The group's word on this member went stale between ``_confirm_owner`` and the hand-over,
    or a new assignment has not reached the log yet (``EventConsumer.assignment_seen``)."""


def _same_run(a: Append, b: Append) -> bool:
    """Whether ``a`` may go in one ``append_many`` with ``b``: the same session, the same topic."""
    return a.session_id == b.session_id and topic_of(a.body) is topic_of(b.body)


def event_id(session_id: str, kind: str, key: str = "") -> str:
    """A deterministic event id: the same logical event always gets the same id."""
    return SESSION_EVENT_IDS(session_id, kind, key)


class SessionWorker(MarkRecovery, Worker):
    """Base class of the role workers (planner, decider, executor)."""

    role = "worker"
    bounded_delivery = True  # the write fence needs it (``_writable``)
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
        super().__init__(log, group=group, instance_id=instance_id, poll_timeout_s=poll_timeout_s)
        self.sessions: dict[str, SessionState] = {}
        self._ready: set[int] = set()  # partitions caught up and acted on
        self._owned: set[int] = set()
        self._moved_away: set[int] = set()  # owned once, then given up (and not taken back since)
        self._orphans: dict[str, list[LoggedEvent]] = {}  # events of sessions not (yet) requested
        self._low: dict[str, dict[str, int]] = {}
        self.num_events = 0
        self._init_recovery(snapshots, mark_every if mark_every is not None else default_mark_every())
        self._caught_up = asyncio.Event()  # set after each promotion
        self._next_reconcile: float | None = None

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

    # ---------------------------------------------------------------- helpers

    def state(self, session_id: str) -> SessionState:
        state = self.sessions.get(session_id)
        if state is None:
            state = self.sessions[session_id] = SessionState(session_id)
        return state

    async def append(
        self,
        session_id: str,
        body: Event,
        *,
        kind: str,
        key: str = "",
        cause: str | None = None,
        for_session: str | None = None,
    ) -> None:
        """Append with a deterministic event id and fold the event into our state at once.

        ``for_session`` (default ``session_id``) is the session whose move this carries out
        (a planner starts a fork for its parent). If that session's partition moved away from
        this member while the move was under way (an engine call retried for seconds, a tool
        run), ``PartitionMoved`` is raised and nothing is appended: the new owner writes the
        session's chain now, and two writers of one chain give it a seq twice (on Kafka, which
        refuses nothing, every reader then sets aside the rest of the chain).
        """
        await self.append_all([Append(session_id, body, kind, key, cause)], for_session=for_session)

    async def append_all(self, appends: Sequence[Append], *, for_session: str | None = None) -> None:
        """``append`` each of ``appends`` in order: the events of one session and topic that follow one
        another go in one ``SharedLog.append_many`` (one hand-over, one durable wait, as for one event), each
        with its deterministic id; then each is folded, in order. A crash between the hand-over and
        the acknowledgement leaves the run landed or not, or a prefix of it (one partition, one
        producer); redoing the move appends what is missing, as for one event."""
        start = 0
        while start < len(appends):
            first, end = appends[start], start + 1
            while end < len(appends) and _same_run(appends[end], first):
                end += 1
            await self._append_run(appends[start:end], for_session or first.session_id)
            start = end

    async def _append_run(self, appends: Sequence[Append], owner: str) -> None:
        # The time is read from the log's clock here and stamped on the records, so that our
        # fold and every reader's fold of these events see the same occurred_at.
        occurred_at = self.log.clock()
        ids = [event_id(a.session_id, a.kind, a.key) for a in appends]
        drafts = [Draft(a.session_id, a.body, eid, a.cause, occurred_at) for a, eid in zip(appends, ids, strict=True)]
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + APPEND_RETRY_S
        backoff = APPEND_BACKOFF_S
        waiting = _GroupWait(loop.time())
        while True:
            await self._confirm_owner(owner, waiting)
            try:
                await self.log.append_many(drafts, guard=self._writable(owner))
                break
            except _InDoubt as doubt:
                self._say_waiting(owner, waiting, str(doubt))
                await asyncio.sleep(MEMBERSHIP_POLL_S)  # then _confirm_owner waits for the group's word
                continue
            except BackendUnavailable:
                # Not delivered within the producer's bound (a broker away): maybe landed, maybe
                # not; the log re-reads the partition before the next try, which is a no-op if it
                # did (same event id). Meanwhile the group may have moved on: asked again first.
                if loop.time() + backoff > give_up_at:
                    raise
                _log.warning("%s: append for %s not delivered, again in %.1f s", self.role, owner, backoff)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, APPEND_BACKOFF_MAX_S)
        # Fold our own writes now; reading them back later is a no-op (same event ids).
        for a, eid in zip(appends, ids, strict=True):
            self.state(a.session_id).apply(
                Envelope.model_construct(
                    event_id=eid,
                    session_id=a.session_id,
                    seq=-1,
                    actor=self.log.actor,
                    occurred_at=occurred_at,
                    causation_id=a.cause,
                    prev_hash=b"",
                    body=a.body,
                    hash=b"",
                )
            )

    async def _confirm_owner(self, session_id: str, waiting: _GroupWait) -> None:
        """``_check_owner``, and that the group still counts this member, whose partitions it
        could otherwise have given away unbeknown to it (a broker outage swallowed its
        heartbeats): the successor would write the same chains (``Subscription.membership``).
        While the group's answer is awaited, the append waits (the heartbeat runs beside this
        loop); a member that must rejoin gives the work up: the rejoin hands every partition
        over again, and whoever then owns the session's replays it and does the work."""
        # Polled: the answer arrives on kafka-python's heartbeat thread, which sets no event, or
        # (librdkafka) with a poll, which this wait may be holding up: refresh serves it.
        while True:
            if (word := self._group_word(session_id)) is Membership.CONFIRMED:
                return
            self._say_waiting(session_id, waiting, f"the group's membership of it is {word.value}")
            if self.consumer is not None:
                await self.consumer.refresh_membership()
            await asyncio.sleep(MEMBERSHIP_POLL_S)

    def _say_waiting(self, session_id: str, waiting: _GroupWait, why: str) -> None:
        now = asyncio.get_running_loop().time()
        if waiting.due(now):
            _log.warning(
                "%s: an append for session %s has waited %.0f s for the group to confirm this member (%s)",
                self.role,
                session_id,
                now - waiting.since,
                why,
            )

    @contextlib.contextmanager
    def _writable(self, session_id: str) -> Iterator[None]:
        """The write fence, held while the log hands our records to the producer: the session is
        still ours and the group still counts us, *now* (the look of ``_confirm_owner`` may be
        a partition load old). Held, the member cannot give its partitions up until the
        records are handed over; it then waits for them to land or fail before it rejoins
        (``KafkaSubscription.on_partitions_revoked``; docs/reliability.md, "The write fence")."""
        consumer = self.consumer
        with consumer.writing() if consumer is not None else contextlib.nullcontext():
            self._check_owner(session_id)
            if (
                consumer is not None
                and self.log.partition_for(session_id) in self._owned
                and not consumer.assignment_seen()
            ):
                # A rebalance ended in the poll in flight: wait for it to return.
                raise _InDoubt("a new assignment has not reached the log yet")
            if self._group_word(session_id) is Membership.IN_DOUBT:
                raise _InDoubt("the group's membership of it went in doubt at the hand-over")
            yield

    def _group_word(self, session_id: str) -> Membership:
        """``_check_owner``, then what the group says of this member now, for a session of a
        partition it owns (CONFIRMED otherwise: nothing to fence); LOST raises PartitionMoved."""
        self._check_owner(session_id)
        partition = self.log.partition_for(session_id)
        if self.consumer is None or partition not in self._owned:
            return Membership.CONFIRMED
        membership = self.consumer.membership()
        if membership is Membership.LOST:
            raise PartitionMoved(f"partition {partition} of session {session_id}: this member must rejoin its group")
        return membership

    def _check_owner(self, session_id: str) -> None:
        partition = self.log.partition_for(session_id)
        moved = partition in self._moved_away
        if not moved and partition in self._owned and self.consumer is not None:
            # Given up inside the poll in flight (a rebalance), before handle() was told.
            moved = all(p != partition for _, p in self.consumer.assignment())
        if moved:
            raise PartitionMoved(f"partition {partition} of session {session_id} moved to another member")

    async def dead_letter(self, event: LoggedEvent, error: RecordError) -> None:
        """Set aside an event that breaks the protocol: it goes to agent.dlq with the reason."""
        position = event.position
        async for record in self.log.scan(position.topic, position.partition, position.offset, position.offset + 1):
            await self.log.dead_letter(record, error, self.group)
        _log.warning("%s dead-lettered %s: %s", self.role, position, error)

    # -------------------------------------------------------------------- loop

    async def open_consumer(self) -> EventConsumer:
        return await EventConsumer(
            self.log,
            self.group,
            list(self.topics),
            from_beginning=True,
            instance_id=self.instance_id,
            start_at=self._start_at if self.snapshots is not None else None,
        ).start()

    async def handle(self, events: list[LoggedEvent]) -> None:
        consumer = self.consumer
        assert consumer is not None
        # As the consumer saw it at this poll (its positions are those partitions'), not as a
        # rebalance still in flight has it now.
        await self._track_assignment(consumer.assignment_at_poll())
        for event in events:
            await self._handle(event)
        await self._promote_caught_up(consumer)
        await self._reconcile_when_due()

    async def flush(self, *, final: bool) -> None:
        # Appends are durable when ``append`` returns; what is left is the marks (all of them
        # on a clean stop: the next start reads the least).
        await self._save_marks(due_only=not final)

    async def _reconcile_when_due(self) -> None:
        if self.reconcile_every_s is None:
            return
        now = asyncio.get_running_loop().time()
        if self._next_reconcile is None:
            self._next_reconcile = now + self.reconcile_every_s
        if now < self._next_reconcile:
            return
        self._next_reconcile = now + self.reconcile_every_s
        for state in list(self.sessions.values()):
            ready = self.log.partition_for(state.session_id) in self._ready
            # A finished session may still have an operator command to carry out (a restore).
            unfinished = not state.finished or bool(state.pending_commands)
            if ready and state.status is not None and unfinished:
                await self.reconcile(state)

    async def _track_assignment(self, assignment: set[tuple[str, int]]) -> None:
        owned = {p for _, p in assignment}
        new = sorted(owned - self._owned)
        if new:
            self.set_boundaries({topic: await self.log.end_offsets(topic) for topic in self.topics}, new)
            self._moved_away -= set(new)
        for partition in sorted(self._owned - owned):
            self._moved_away.add(partition)
            self._ready.discard(partition)
            self._forget_recovery(partition)
            self.forget_boundaries(partition)
            for session_id in [s for s in self.sessions if self.log.partition_for(s) == partition]:
                del self.sessions[session_id]
                self._low.pop(session_id, None)
            await self.on_partition_lost(partition)
            _log.info("%s: partition %d moved away", self.role, partition)
        self._owned = owned

    async def _handle(self, event: LoggedEvent) -> None:
        self.num_events += 1
        if await self._meet(event):
            return  # held for its snapshot's catch-up
        session_id = event.session_id
        self._low.setdefault(session_id, {}).setdefault(event.topic, event.position.offset)
        state = self.state(session_id)
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

    async def _promote_caught_up(self, consumer: EventConsumer) -> None:
        for partition in sorted(self._owned - self._ready):
            if self.replay_done(consumer, ((t, partition) for t in self.topics)):
                await self._caught_up_from_mark(partition)
                self._ready.add(partition)
                sessions = [s for s in self.sessions.values() if self.log.partition_for(s.session_id) == partition]
                _log.info("%s: partition %d caught up (%d sessions)", self.role, partition, len(sessions))
                for state in sessions:
                    if state.session_id in self._orphans:
                        await self._report_orphans(state)
                    if state.status is not None:
                        await self.resume(state)
                self._caught_up.set()
