"""The worker skeleton: the one loop every long-running role is built on.

A ``Worker`` is one member of its role's consumer group on the shared log. Every
role (planner, decider, executor: ``workers/runtime.py``; the cache manager; the
engine bridge; the gateway, projector and console to come) subclasses it and fills
in what it does with a poll's events. The skeleton owns the rest, once:

**Lifecycle** (``run()``):

1. *start*: ``prepare()`` reads what the replay needs before the first poll (the
   cache manager: the decisions already logged; the engine bridge: the engine's
   buffered batches), then ``open_consumer()`` joins the group, reading every topic
   from its beginning unless the role says where to start (marks, below).
2. *replay to boundaries*: the end offsets a role records when it meets a partition
   (``_boundary``) split what it reads into the replay (below the boundary: folded,
   the role's past, acted on only by recovery rules) and live records (at or above it).
3. *resume residual work*: when a partition's replay is done (``replay_done``), the
   role carries out what the log says was started and never finished.
4. *live loop*: poll, ``handle(events)``, commit when due, until ``shutdown()``.
5. *drain*: ``drain()`` waits for the work ``spawn()`` started (tool runs, engine calls).
6. *commit*: ``flush(final=True)`` makes the role's own output durable (queued
   appends, partition marks), then the consumer's offsets are committed.
7. *close*: tasks running ``alongside()`` are cancelled and the consumer leaves the
   group. ``close()`` (called by ``workers.main`` after ``run()``) releases what
   ``create`` opened.

``run()`` returns only once drained and committed; ``shutdown()`` (idempotent, safe
from a signal handler) asks it to. ``install_signal_handlers()`` makes SIGTERM and
SIGINT call it, the only place a worker handles signals. ``async with worker:``
runs it in the background and shuts it down (and waits) on exit. An error raised by
``handle`` or by a task running ``alongside()`` stops the worker without draining:
``run()`` closes the consumer and raises it (the restart recovers from the log).

**Offsets.** An offset names a record; ``consumer.position(topic, partition)`` is the
offset of the next record to read, i.e. the last record handed out plus one, and
committing offsets stores those positions (a restart reads from there). A boundary is
a topic's end offset when it was read, the position of the next record to be
written: a record is replayed when ``offset < boundary``, and a partition's replay is
done when its position has reached its boundary in every topic. Offsets are committed
only after ``flush`` (the effects of the records below them are durable): after every
poll (``commit_every_s = 0``) or at most every ``commit_every_s`` seconds, and once
more when the worker stops.

**Event ids.** Every append has a deterministic id (``EventIds``): ``uuid5`` over the
role's namespace and its trigger's parts joined by ``/``. Redoing an append after a
crash gives it the same id, and the log ignores an id it already holds, so recovery
may simply do again whatever it is not sure landed. The session roles share one
namespace (``SESSION_EVENT_IDS``; the kind in their keys keeps them apart), the engine
bridge and the cache manager have their own.

**Marks.** A role that can restart from partition marks (``workers/recovery.py``)
saves them in ``flush``: the ones due while running, every one at the final commit.

**Metrics** (``workers/metrics.py``, docs/metrics.md). With ``metrics`` set (``workers.main``
does it for ``--metrics-port``), the loop feeds it every event it reads, the log tells it of
every append (``SharedLog.on_appended``), a task alongside measures the consumer lag every
``lag_every_s``, and ``/health`` answers 200 from the first poll until the worker stops.
Without it, none of this costs anything.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
import uuid
from collections.abc import Coroutine, Iterable, Sequence
from types import TracebackType
from typing import Any, ClassVar

from log import LoggedEvent, SharedLog
from log.consumer import EventConsumer
from workers.metrics import WorkerMetrics

__all__ = ["SESSION_EVENT_IDS", "EventIds", "PartitionMoved", "Worker"]

_log = logging.getLogger(__name__)


class PartitionMoved(Exception):
    """A role's work for a session was still under way when the session's partition moved to
    another member of the group: its append is refused, the new owner carries the move out
    (it replays the partition and resumes the session)."""


class EventIds:
    """The deterministic event ids of one role: ``uuid5(namespace, "/".join(parts))``.

    The same trigger always gives the same id, so an append done again is a no-op."""

    def __init__(self, namespace: uuid.UUID) -> None:
        self.namespace = namespace

    def __call__(self, *parts: object) -> str:
        return str(uuid.uuid5(self.namespace, "/".join(str(p) for p in parts)))


SESSION_EVENT_IDS = EventIds(uuid.UUID("6f1c2d4e-8a57-4d0b-9a33-5b1e0c7f2a10"))
"""Planner, decider and executor: ``(session id, kind, key)``."""


class Worker:
    """Base class of every role's process loop (see the module docstring for the lifecycle).

    Subclasses set ``role`` and ``topics`` and implement ``handle``; they may override
    ``prepare``, ``open_consumer``, ``flush``, ``drain``, ``closed`` and, for
    ``workers.main``, ``add_arguments``, ``create`` and ``close``. A role that folds
    sessions subclasses ``workers.runtime.SessionWorker`` instead. The smallest role::

        class Tally(Worker):
            role = "auditor"
            topics = ("agent.actions",)

            async def handle(self, events: list[LoggedEvent]) -> None:
                self.num_seen += len(events)  # read-only: committed after every poll

        if __name__ == "__main__":
            run_worker(Tally)  # workers.main: options, signals, run, close
    """

    role = "worker"
    topics: Sequence[str] = ()
    event_ids: EventIds = SESSION_EVENT_IDS
    """How this role names what it appends."""
    commit_every_s = 0.0
    """Commit offsets after every poll (0) or at most this often."""
    max_records = 500
    """Records per poll."""
    lag_every_s = 5.0
    """With metrics: how often the consumer lag is measured (it asks the log for end offsets)."""
    linger_ms: ClassVar[int | None] = None
    """How long the Kafka producer waits to fill a batch (None: the backend's default, 2 ms)."""
    bounded_delivery: ClassVar[bool] = False
    """Each record lands or fails within 1.5 s (``log.urls.kafka_backend``): the session roles'
    appends are fenced by their group membership, which needs it."""

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
        self.consumer: EventConsumer | None = None
        self._boundary: dict[tuple[str, int], int] = {}  # replay end per (topic, partition): see "Offsets"
        self._tasks: set[asyncio.Task[Any]] = set()  # spawned: drained before run() returns
        self._alongside: set[asyncio.Task[Any]] = set()  # run alongside the loop: cancelled when it stops
        self._failure: BaseException | None = None  # a task alongside that failed
        self._stopping = asyncio.Event()
        self._run_task: asyncio.Task[None] | None = None  # run() under ``async with``
        self._ran = False
        self.metrics: WorkerMetrics | None = None
        """Set before ``run()`` to serve this worker's metrics (see "Metrics")."""

    # ------------------------------------------------------------- for roles

    async def prepare(self) -> None:
        """Before the consumer opens: read what the replay needs."""

    async def open_consumer(self) -> EventConsumer:
        """This member of the role's group, reading ``topics`` from their beginning."""
        return await EventConsumer(
            self.log, self.group, list(self.topics), from_beginning=True, instance_id=self.instance_id
        ).start()

    async def handle(self, events: list[LoggedEvent]) -> None:
        """One poll's events (possibly none: the poll timed out)."""
        raise NotImplementedError

    async def flush(self, *, final: bool) -> None:
        """Make this worker's own output durable before its offsets are committed (``final``: it stops)."""

    async def drain(self) -> None:
        """After the loop stopped: wait for the work in flight (by default, what ``spawn`` started)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # ------------------------------------------------------ process plumbing

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Role-specific command line options (see workers/main.py)."""

    @classmethod
    async def create(cls, log: SharedLog, args: argparse.Namespace) -> Worker:
        """Build the worker from parsed options."""
        return cls(log, group=args.group, instance_id=args.instance_id)

    async def close(self) -> None:
        """Release what ``create`` opened."""

    # ---------------------------------------------------------------- helpers

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` in the background; ``run()`` waits for it before returning."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            if isinstance(error, PartitionMoved):
                _log.info("%s: %s", self.role, error)  # the new owner does it: not a failure
            else:
                _log.error("%s task failed", self.role, exc_info=error)

    def alongside(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``coro`` for as long as the loop runs (a second input, like the engine bridge's
        KV events): cancelled when the worker stops; when it fails, the worker stops and
        ``run()`` raises its error; when it returns, the worker shuts down."""
        task = asyncio.create_task(coro, name=name)
        self._alongside.add(task)
        task.add_done_callback(self._alongside_done)
        return task

    def _alongside_done(self, task: asyncio.Task[Any]) -> None:
        self._alongside.discard(task)
        if task.cancelled():
            return
        if (error := task.exception()) is not None and self._failure is None:
            self._failure = error
        self.shutdown()

    async def until(self, awaitable: Coroutine[Any, Any, Any]) -> bool:
        """Wait for ``awaitable`` unless the worker stops first (False then); raises the error of a
        task running alongside that failed meanwhile."""
        waiting = asyncio.ensure_future(awaitable)
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait([waiting, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (waiting, stop):
                task.cancel()
            await asyncio.gather(waiting, stop, return_exceptions=True)
        self._raise_failure()
        return waiting.done() and not waiting.cancelled()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def set_boundaries(self, ends: dict[str, dict[int, int]], partitions: Iterable[int] | None = None) -> None:
        """Record each topic's end offsets (``SharedLog.end_offsets``) as the replay boundaries of
        ``partitions`` (None: of every partition in ``ends``)."""
        for topic, by_partition in ends.items():
            for partition in by_partition if partitions is None else partitions:
                self._boundary[(topic, partition)] = by_partition.get(partition, 0)

    def forget_boundaries(self, partition: int) -> None:
        """A partition moved away: met again, it is replayed to new boundaries."""
        for key in [k for k in self._boundary if k[1] == partition]:
            del self._boundary[key]

    def is_replay(self, event: LoggedEvent) -> bool:
        """Was this record in the log before this worker met its partition?"""
        position = event.position
        return position.offset < self._boundary.get((position.topic, position.partition), 0)

    def replay_done(self, consumer: EventConsumer, pairs: Iterable[tuple[str, int]]) -> bool:
        """Has the consumer read every (topic, partition) of ``pairs`` up to its boundary?"""
        return all(consumer.position(t, p) >= self._boundary.get((t, p), 0) for t, p in pairs)

    # -------------------------------------------------------------------- loop

    def shutdown(self) -> None:
        """Ask ``run()`` to stop polling, drain, commit and return (idempotent)."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT shut the worker down cleanly (SIGKILL is what a crash is)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.shutdown)

    async def run(self) -> None:
        """Start, replay, resume, loop until ``shutdown()``, drain, commit, close (once per worker)."""
        if self._ran:
            raise RuntimeError(f"{self.role}: run() was called already; build a new worker to run again")
        self._ran = True
        consumer: EventConsumer | None = None
        try:
            await self.prepare()
            self._raise_failure()
            if self._stopping.is_set():
                return  # shut down while preparing: nothing read, nothing to commit
            consumer = self.consumer = await self.open_consumer()
            metrics = self.metrics
            if metrics is not None:
                metrics.reads = frozenset(self.topics)
                self.alongside(self._measure_lag(consumer, metrics), name=f"{self.role}.lag")
            last_commit = time.monotonic()
            while not self._stopping.is_set():
                events = await consumer.poll(timeout_s=self.poll_timeout_s, max_records=self.max_records)
                if metrics is not None:
                    metrics.consumed_events(events)
                    if not metrics.healthy:
                        metrics.set_health(True, status="live", group=self.group)
                await self.handle(events)
                if time.monotonic() - last_commit >= self.commit_every_s:
                    await self.flush(final=False)
                    await consumer.commit()
                    last_commit = time.monotonic()
            self._raise_failure()  # a task alongside failed (it stopped the loop): no drain, no commit
            await self.drain()
            await self.flush(final=True)
            await consumer.commit()
        finally:
            if self.metrics is not None:
                self.metrics.set_health(False, status="stopped", group=self.group)
            for task in list(self._alongside):
                task.cancel()
            await asyncio.gather(*self._alongside, return_exceptions=True)
            if consumer is not None:
                await consumer.close()
            await self.closed()

    async def _measure_lag(self, consumer: EventConsumer, metrics: WorkerMetrics) -> None:
        """Every ``lag_every_s``: records between this member's position and each owned partition's end."""
        while await self.until(asyncio.sleep(self.lag_every_s)):
            assigned = consumer.assignment_at_poll()  # the partitions its positions are of
            for topic in sorted({t for t, _ in assigned}):
                try:
                    ends = await self.log.end_offsets(topic)
                except Exception as e:  # a metric must never stop the worker: the next round retries
                    _log.debug("%s: lag of %s not measured (%s)", self.role, topic, type(e).__name__)
                    continue
                for t, partition in assigned:
                    if t == topic:
                        metrics.lag(topic, partition, max(0, ends.get(partition, 0) - consumer.position(t, partition)))

    async def closed(self) -> None:
        """Last in ``run()``, also after an error: forget what only one run holds (tasks not awaited)."""

    async def __aenter__(self) -> Worker:
        self._run_task = asyncio.create_task(self.run(), name=f"{self.role}.run")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()
        if self._run_task is not None:
            running, self._run_task = self._run_task, None
            await running
