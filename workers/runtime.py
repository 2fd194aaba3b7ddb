"""The loop every role runs: consume -> fold -> act, over the sessions of its partitions.

A worker is a member of its role's consumer group. For each partition it is
assigned, it first *replays* the partition of every topic it reads, from
offset 0 up to the end offsets seen at assignment time, folding the events
into per-session state without acting. Once a partition has caught up, the
worker *resumes* each of its sessions (the residual work: what the log says
was started and never finished) and from then on acts on each new event.
That is the whole recovery story: a restarted or replacement worker rebuilds
its state from the log and continues; every append it makes uses a
deterministic event id, so redoing an append is a no-op.

Subclasses implement ``resume(state)`` and ``on_event(state, event)``; both
run in the worker's task and may append. ``run()`` returns after
``shutdown()`` once in-flight work is drained.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from collections.abc import Coroutine, Sequence
from datetime import UTC, datetime
from typing import Any

from log import DuplicateVerdict, LoggedEvent, RecordError, SharedLog, UnknownSession
from schemas.envelope import Envelope
from schemas.events import Event, SessionRequested
from services.session import SessionState

_log = logging.getLogger(__name__)

EVENT_ID_NAMESPACE = uuid.UUID("6f1c2d4e-8a57-4d0b-9a33-5b1e0c7f2a10")


def event_id(session_id: str, kind: str, key: str = "") -> str:
    """A deterministic event id: the same logical event always gets the same id."""
    return str(uuid.uuid5(EVENT_ID_NAMESPACE, f"{session_id}/{kind}/{key}"))


class SessionWorker:
    """Base class of the role workers (planner, decider, executor)."""

    role = "worker"
    topics: Sequence[str] = ()
    reports_duplicate_verdicts = False
    """Dead-letter a second verdict for a call (the role that acts on verdicts does it, once)."""
    reports_unknown_sessions = False
    """Dead-letter events of sessions nobody requested (the role that starts sessions does it)."""
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
        await self.log.append(session_id, body, event_id=eid, causation_id=cause)
        # Fold our own write now; reading it back later is a no-op (same event id).
        self.state(session_id).apply(
            Envelope.model_construct(
                event_id=eid,
                session_id=session_id,
                seq=-1,
                actor=self.log.actor,
                occurred_at=datetime.now(UTC),
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
        consumer = await self.log.consumer(
            self.group, list(self.topics), from_beginning=True, instance_id=self.instance_id
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
        finally:
            await consumer.close()

    async def _track_assignment(self, assignment: set[tuple[str, int]]) -> None:
        owned = {p for _, p in assignment}
        for partition in sorted(owned - self._owned):
            for topic in self.topics:
                self._boundary[(topic, partition)] = (await self.log.end_offsets(topic)).get(partition, 0)
        for partition in sorted(self._owned - owned):
            self._ready.discard(partition)
            for key in [k for k in self._boundary if k[1] == partition]:
                del self._boundary[key]
            for session_id in [s for s in self.sessions if self.log.partition_for(s) == partition]:
                del self.sessions[session_id]
            await self.on_partition_lost(partition)
            _log.info("%s: partition %d moved away", self.role, partition)
        self._owned = owned

    async def _handle(self, event: LoggedEvent) -> None:
        self.num_events += 1
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
                self._ready.add(partition)
                sessions = [s for s in self.sessions.values() if self.log.partition_for(s.session_id) == partition]
                _log.info("%s: partition %d caught up (%d sessions)", self.role, partition, len(sessions))
                for state in sessions:
                    if state.session_id in self._orphans:
                        await self._report_orphans(state)
                    if state.status is not None:
                        await self.resume(state)
