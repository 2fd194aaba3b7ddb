"""The Kafka backend on librdkafka (confluent-kafka): the default client of ``kafka://`` logs.

``kafka://`` logs use this backend unless ``AGENTLOG_KAFKA_CLIENT=python`` picks
``log.kafka_backend`` (kafka-python; see ``log.urls``). Both write the same records to the
same topics and pass the same contract suite; this one parses fetched batches, checks their
CRCs and batches sends in C threads that do not hold the GIL, which is most of what a busy
worker spends in kafka-python (``docs/cache-manager.md``, Scale).

- Producer: idempotent, ``acks=all``, made at the first append (a role that may not write
  never asks for a producer id); the partition is computed by ``log.partitioner``
  (Kafka's murmur2 of the session id) as with kafka-python. librdkafka reports deliveries
  only from ``poll``: a daemon thread polls and counts them down into one asyncio future
  per batch (``_Batch``), like ``kafka_backend._BatchWaiter``.
- Consumers: calls run in a worker thread (``asyncio.to_thread``), one at a time per
  consumer. librdkafka fetches ahead in its own threads; a ``seek`` drops what it fetched
  from the old position.
- Client settings: ``log.kafka_backend.security_config`` (and ``client_config``) use
  kafka-python's names; ``rdkafka_config`` translates the few we use.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
    libversion,
)
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from log import topics as topic_table
from log.backend import Backend, Membership, OutRecord, Subscription
from log.errors import BackendUnavailable
from log.kafka_backend import (
    BOUNDED_DELIVERY_TIMEOUT_MS,
    BOUNDED_REQUEST_TIMEOUT_MS,
    COMMIT_WAIT_S,
    CONFIRMED_FOR_S,
    SCAN_GROUP,
    SESSION_TIMEOUT_MS,
    KafkaCluster,
    KafkaGroupMember,
    one_partition_count,
    topic_configs,
)
from log.types import Position, RawRecord, new_tuple
from log.urls import LIBRDKAFKA_LOGGER

__all__ = [
    "COMMIT_HELD_WARN_S",
    "COMMIT_WAIT_S",
    "COORDINATOR_LOST_WARN_S",
    "ORPHANED_AFTER_S",
    "PROBE_EVERY_S",
    "GroupWord",
    "RdKafkaBackend",
    "RepeatsSuppressed",
    "coordinator_lost",
    "group_word",
    "membership_of",
    "rdkafka_config",
]

_log = logging.getLogger("agentlog.rdkafka")
_TIMEOUT_S = 30.0
REPEAT_WINDOW_S = 10.0
"""librdkafka logs a line again at most once in this long (``RepeatsSuppressed``)."""
_SCAN_BATCH = 2000

# kafka-python setting -> librdkafka property (the settings this project passes).
_NAMES = {
    "security_protocol": "security.protocol",
    "sasl_mechanism": "sasl.mechanisms",
    "sasl_plain_username": "sasl.username",
    "sasl_plain_password": "sasl.password",
    "request_timeout_ms": "socket.timeout.ms",
    "client_id": "client.id",
}


class RepeatsSuppressed(logging.Filter):
    """Lets a librdkafka log line through at most once per ``window_s`` for each client,
    facility and text (the text without its "(after N ms in state S)" tail), and says how many
    like it were held back when it next lets one through.

    While its broker is down every client logs each failed connection attempt at ERROR, about
    ten a second (librdkafka's backoff starts again whenever it re-bootstraps with no broker
    up): a minute's outage was 600 lines per client in each worker's log and on ``logctl``'s
    stderr, burying the lines that say something new. Other lines pass untouched."""

    _TAIL = re.compile(r"\s*\(after \d+ms in state \w+(, \d+ identical error\(s\) suppressed)?\)$")

    def __init__(self, window_s: float = REPEAT_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str, str], tuple[float, int]] = {}  # key -> (let through at, held back since)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if record.msg != "%s [%s] %s" or not isinstance(args, tuple) or len(args) != 3:
            return True  # not a line of librdkafka's
        facility, client, text = (str(a) for a in args)
        key = (facility, client, self._TAIL.sub("", text))
        now = self._clock()
        with self._lock:
            seen = self._seen.get(key)
            if seen is not None and now - seen[0] < self.window_s:
                self._seen[key] = (seen[0], seen[1] + 1)
                return False
            if len(self._seen) > 1000:  # forget what is past its window
                self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.window_s}
            self._seen[key] = (now, 0)
        if seen is not None and seen[1]:
            record.args = (facility, client, f"{text} (and {seen[1]} like it since the last one shown)")
        return True


_client_log = logging.getLogger(LIBRDKAFKA_LOGGER)
_client_log.addFilter(RepeatsSuppressed())


def rdkafka_config(client_config: dict[str, Any]) -> dict[str, Any]:
    """librdkafka properties for settings given with kafka-python's names (or librdkafka's own,
    which contain a dot and pass as they are)."""
    out: dict[str, Any] = {}
    for name, value in client_config.items():
        if "." in name:
            out[name] = value
        elif name in _NAMES:
            out[_NAMES[name]] = value
        else:
            raise ValueError(f"no librdkafka equivalent known for the Kafka client setting {name!r}")
    return out


def _error(e: BaseException) -> str:
    if isinstance(e, KafkaException) and e.args and isinstance(e.args[0], KafkaError):
        err = e.args[0]
        return f"{err.name()}: {err.str()}"
    return str(e)


# Answers right after a topic is created, or while leadership moves: ask again.
_TRANSIENT = frozenset(
    {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_TOPIC_OR_PART}
)


# Errors librdkafka reports and retries on its own, which must reach the caller instead: a
# consumer the broker refuses would otherwise wait forever, silently. And _FATAL: librdkafka
# hands a fatal consumer error over as an event of that code whose fatal() is False (seen: a
# static member fenced by another with its group.instance.id after a broker restart, in a
# chaos run on librdkafka); the consumer is dead all the same, and a worker that went on
# polling it read nothing more, for good (25 of 60 sessions stuck behind that decider).
_REFUSED = frozenset(
    {
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.GROUP_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError.SASL_AUTHENTICATION_FAILED,
        KafkaError._AUTHENTICATION,
        KafkaError._FATAL,
    }
)


def _retrying(call: Any, *args: Any) -> Any:
    """``call(*args)``, asked again for up to ``_TIMEOUT_S`` while the broker answers with a
    transient or retriable error (a blocking call: run it in a thread)."""
    deadline = time.monotonic() + _TIMEOUT_S
    while True:
        try:
            return call(*args)
        except KafkaException as e:
            err = e.args[0] if e.args and isinstance(e.args[0], KafkaError) else None
            if err is None or not (err.retriable() or err.code() in _TRANSIENT) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class _Producing:
    """The producer and the fatal error that took it, if one did: made together, so a batch
    names the error of the producer its records went to, never another's."""

    __slots__ = ("fatal", "producer")

    def __init__(self, producer: Any) -> None:
        self.producer = producer
        self.fatal: str | None = None
        """Set once by the delivery thread; the cause of every failure after it."""


class _Batch:
    """One ``produce`` call's records: their delivery reports, counted down into one future.

    Reports arrive on the delivery thread (``RdKafkaBackend._deliver``) in any order; the
    last one wakes the event loop once for the whole batch.
    """

    __slots__ = ("error", "future", "lock", "loop", "offsets", "partitions", "producing", "remaining", "topic")

    def __init__(self, loop: asyncio.AbstractEventLoop, topic: str, n: int, producing: _Producing) -> None:
        self.loop = loop
        self.producing = producing
        self.topic = topic
        self.future: asyncio.Future[list[Position]] = loop.create_future()
        self.partitions = [0] * n
        self.offsets = [0] * n
        self.remaining = n
        self.error: str | None = None
        self.lock = threading.Lock()  # reports of one batch may come from produce() too (queue full)

    def report(self, index: int, err: Any, msg: Any) -> None:
        with self.lock:
            if err is not None:
                if self.error is None:
                    self.error = f"{err.name()}: {err.str()}"
            else:
                self.partitions[index] = msg.partition()
                self.offsets[index] = msg.offset()
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            self.loop.call_soon_threadsafe(self._finish)

    def _finish(self) -> None:
        if self.future.done():
            return
        if self.error is not None:
            why = self.producing.fatal or self.error
            self.future.set_exception(BackendUnavailable(f"producing to {self.topic} failed: {why}"))
            return
        topic = self.topic
        self.future.set_result([Position(topic, p, o) for p, o in zip(self.partitions, self.offsets, strict=True)])


class RdKafkaBackend(KafkaCluster, Backend):
    """Topics on a Kafka cluster at ``bootstrap`` (``host:port[,host:port]``), via librdkafka."""

    name = "kafka"

    def __init__(
        self,
        bootstrap: str,
        *,
        namespace: str = "",
        client_config: dict[str, Any] | None = None,
        linger_ms: int = 2,
        bounded_delivery: bool = False,
    ) -> None:
        super().__init__(
            bootstrap,
            namespace=namespace,
            client_config=client_config,
            linger_ms=linger_ms,
            bounded_delivery=bounded_delivery,
        )
        self._common = {"bootstrap.servers": bootstrap, "logger": _client_log, **rdkafka_config(self.client_config)}
        self._started = False
        self._producing_now: _Producing | None = None  # made at the first append (_producing)
        self._delivering = False
        self._delivery: threading.Thread | None = None
        self._in_order = asyncio.Lock()

    def _delivery_config(self) -> dict[str, int]:
        if not self.bounded_delivery:
            return {}
        return {"request.timeout.ms": BOUNDED_REQUEST_TIMEOUT_MS, "delivery.timeout.ms": BOUNDED_DELIVERY_TIMEOUT_MS}

    def _consumer(self, **config: Any) -> Any:
        return Consumer({**self._common, "enable.auto.commit": False, "enable.partition.eof": False, **config})

    async def start(self) -> None:
        # librdkafka connects lazily: ask for metadata once so that an unreachable broker or a
        # refused login fails here, as kafka-python's producer does, not at the first append.
        scanner = await self._take_scanner()
        try:
            await asyncio.to_thread(scanner.list_topics, None, 10.0)
        except KafkaException as e:
            await asyncio.to_thread(scanner.close)
            raise BackendUnavailable(f"cannot reach Kafka at {self.bootstrap}: {_error(e)}") from e
        self._scanners.append(scanner)
        self._started = True
        _log.info("connected to %s with librdkafka %s", self.bootstrap, libversion()[0])

    def _producing(self) -> _Producing:
        """The producer, made at the first append. An idempotent producer asks the cluster for a
        producer id as soon as it exists, and a role that may not write (the auditor) is refused
        that with an error fatal to the client: made at ``start`` it would fail every read-only
        ``logctl`` command's log with a critical line."""
        if self._producing_now is None:
            producing = _Producing(
                Producer(
                    {
                        "linger.ms": self.linger_ms,
                        "queue.buffering.max.messages": 1_000_000,
                        **self._delivery_config(),
                        **self._common,  # the caller's settings may change the two above, not the two below
                        "acks": "all",
                        "enable.idempotence": True,
                    }
                )
            )
            self._producing_now = producing
            self._delivering = True
            self._delivery = threading.Thread(
                target=self._deliver, args=(producing,), name="agentlog-rdkafka-delivery", daemon=True
            )
            self._delivery.start()
        return self._producing_now

    def settle_sends(self) -> None:
        """Block until every record handed to the producer landed or failed (bounded delivery
        only: it is what lets a member give its partitions up safely; see RdKafkaSubscription)."""
        producing = self._producing_now
        if not self.bounded_delivery or producing is None:
            return
        if remaining := producing.producer.flush(2 * BOUNDED_DELIVERY_TIMEOUT_MS / 1000):
            _log.warning("%d records in flight when partitions were revoked", remaining)

    def _deliver(self, producing: _Producing) -> None:
        """Serve delivery reports (they run inside ``poll``) until ``close``."""
        while self._delivering:
            try:
                producing.producer.poll(0.05)
            except KafkaException as e:
                # A fatal error (the cluster refused this client a producer id: a role that may
                # not write) is raised here once. librdkafka fails every record it held with
                # it, and the next polls serve those reports: the appends fail, none hangs.
                if producing.fatal is None:
                    producing.fatal = _error(e)
                _log.error("the producer failed: %s", producing.fatal)

    async def close(self) -> None:
        self._started = False
        if (producing := self._producing_now) is not None:
            remaining = await asyncio.to_thread(producing.producer.flush, _TIMEOUT_S)
            self._delivering = False
            if self._delivery is not None:
                await asyncio.to_thread(self._delivery.join)
            if remaining:
                _log.warning("closed with %d records not acknowledged", remaining)
            self._producing_now = None
        for consumer in self._scanners:
            await asyncio.to_thread(consumer.close)
        self._scanners.clear()

    async def create_topics(self, num_partitions: int) -> None:
        def create() -> None:
            admin = AdminClient(self._common)
            existing = set(admin.list_topics(timeout=_TIMEOUT_S).topics)
            wanted = [
                NewTopic(
                    self.physical(t.name),
                    num_partitions=num_partitions,
                    replication_factor=1,
                    config=topic_configs(t),
                )
                for t in topic_table.TOPICS
                if self.physical(t.name) not in existing
            ]
            if not wanted:
                return
            for future in admin.create_topics(wanted, operation_timeout=_TIMEOUT_S).values():
                try:
                    future.result()
                except KafkaException as e:  # another initializer may create them at the same moment
                    if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                        raise BackendUnavailable(f"cannot create topics: {_error(e)}") from e
            names = {topic.topic for topic in wanted}
            deadline = time.monotonic() + _TIMEOUT_S
            while not _led(admin.list_topics(timeout=_TIMEOUT_S), names):  # until every partition has a leader
                if time.monotonic() > deadline:
                    raise BackendUnavailable(f"created topics have no leaders after {_TIMEOUT_S} s")
                time.sleep(0.1)

        await asyncio.to_thread(create)

    async def num_partitions(self) -> int:
        if self._num_partitions is None:
            scanner = await self._take_scanner()
            healthy = True
            try:
                counts = {}
                for t in topic_table.TOPICS:
                    metadata = await asyncio.to_thread(scanner.list_topics, self.physical(t.name), _TIMEOUT_S)
                    topic = metadata.topics.get(self.physical(t.name))
                    counts[t.name] = len(topic.partitions) if topic is not None and topic.error is None else 0
            except Exception:
                healthy = False
                raise
            finally:
                await self._put_back(scanner, healthy)
            self._num_partitions = one_partition_count(counts)
        return self._num_partitions

    async def produce(self, topic: str, records: Sequence[OutRecord]) -> asyncio.Future[list[Position]]:
        if not self._started:
            raise RuntimeError("backend not started")
        producing = self._producing()
        produce = producing.producer.produce
        batch = _Batch(asyncio.get_running_loop(), topic, len(records), producing)
        physical = self.physical(topic)
        # One call at a time: a call that waits for room in the local queue must not let a
        # later call's records in between its own.
        async with self._in_order:
            for index, record in enumerate(records):
                report = _reporter(batch, index)
                while True:
                    try:
                        produce(physical, record.value, record.key, record.partition, on_delivery=report)
                        break
                    except BufferError:  # the local queue is full: let the broker catch up
                        await asyncio.sleep(0.01)
                    except KafkaException as e:  # a fatal error took the producer (see _deliver)
                        raise BackendUnavailable(f"producing to {topic} failed: {_error(e)}") from e
        return batch.future

    async def _take_scanner(self) -> Any:
        if self._scanners:
            return self._scanners.pop()
        # A group id is required by the client (SCAN_GROUP), though a scanner assigns partitions
        # itself and never commits. It reads up to an end it knows: a fetch that finds nothing
        # must not wait on the broker (500 ms by default), because the next scan's partition
        # waits behind it.
        config = {"group.id": self.physical(SCAN_GROUP), "fetch.wait.max.ms": 5}
        return await asyncio.to_thread(self._consumer, **config)

    async def scan(
        self, topic: str, partition: int, start: int = 0, end: int | None = None
    ) -> AsyncIterator[RawRecord]:
        physical = self.physical(topic)
        scanner = await self._take_scanner()
        healthy = True
        try:
            if end is None:
                end = await self._end_offset(scanner, physical, partition)
            if start >= end:
                return
            await asyncio.to_thread(scanner.assign, [TopicPartition(physical, partition, start)])
            position = start
            while position < end:
                # consume() waits until it has as many as asked for, or for the timeout.
                batch = await asyncio.to_thread(scanner.consume, min(_SCAN_BATCH, end - position), 1.0)
                for message in batch:
                    if message.error() is not None:
                        raise BackendUnavailable(f"reading {topic}[{partition}] failed: {message.error().str()}")
                    if message.partition() != partition or message.topic() != physical:
                        # Never seen; a pooled scanner's record of an earlier scan, if librdkafka
                        # ever handed one out, would end this scan early at its offset, and a
                        # chain rebuilt from a short scan repeats seqs. Skipped, and said.
                        _log.warning(
                            "scan of %s[%d] got a record of %s[%d]: skipped",
                            topic, partition, message.topic(), message.partition(),
                        )  # fmt: skip
                        continue
                    offset = message.offset()
                    if offset >= end:
                        return
                    position = offset + 1
                    yield RawRecord(Position(topic, partition, offset), message.key(), message.value())
                if not batch:
                    # Nothing came back: the records may be compacted or aborted; the consumer
                    # position tells how far the log really goes.
                    (tp,) = await asyncio.to_thread(scanner.position, [TopicPartition(physical, partition)])
                    position = max(position, tp.offset)
        except Exception:
            healthy = False
            raise
        finally:
            await asyncio.to_thread(scanner.unassign)
            await self._put_back(scanner, healthy)

    async def _put_back(self, scanner: Any, healthy: bool) -> None:
        """Pool a scanner again, or close it if its call failed: the failure may be librdkafka's
        having dropped every broker it knew (``ORPHANED_AFTER_S``), for good, where a new client
        bootstraps afresh."""
        if healthy:
            self._scanners.append(scanner)
        else:
            await asyncio.to_thread(scanner.close)

    @staticmethod
    async def _end_offset(consumer: Any, physical: str, partition: int) -> int:
        try:
            _, high = await asyncio.to_thread(
                _retrying, consumer.get_watermark_offsets, TopicPartition(physical, partition), _TIMEOUT_S
            )
        except KafkaException as e:
            raise BackendUnavailable(f"cannot read the end of {physical}[{partition}]: {_error(e)}") from e
        return int(high)

    async def end_offsets(self, topic: str) -> dict[int, int]:
        n = await self.num_partitions()
        scanner = await self._take_scanner()
        healthy = True
        try:
            physical = self.physical(topic)
            return {p: await self._end_offset(scanner, physical, p) for p in range(n)}
        except Exception:
            healthy = False
            raise
        finally:
            await self._put_back(scanner, healthy)

    def cluster_answers(self, timeout_s: float = 5.0) -> bool:
        """Whether a new client, bootstrapping afresh, hears of a broker within ``timeout_s``
        (blocking: run it in a thread). A member without a coordinator asks this to tell a
        cluster that is down from a client librdkafka left without brokers (``ORPHANED_AFTER_S``)."""
        probe = self._consumer(**{"group.id": self.physical(SCAN_GROUP)})
        try:
            return len(probe.list_topics(None, timeout_s).brokers) > 0
        except KafkaException:
            return False
        finally:
            probe.close()

    async def subscribe(
        self, group: str, topics: Sequence[str], *, from_beginning: bool, instance_id: str | None = None
    ) -> Subscription:
        subscription = RdKafkaSubscription(self, group, topics, from_beginning=from_beginning, instance_id=instance_id)
        await asyncio.to_thread(subscription.join)
        return subscription


def _led(metadata: Any, names: set[str]) -> bool:
    """Whether every partition of every topic in ``names`` has a leader in ``metadata``."""
    for name in names:
        topic = metadata.topics.get(name)
        if topic is None or topic.error is not None or not topic.partitions:
            return False
        if any(p.leader < 0 or p.error is not None for p in topic.partitions.values()):
            return False
    return True


def _reporter(batch: _Batch, index: int) -> Any:
    return lambda err, msg: batch.report(index, err, msg)


STATS_INTERVAL_MS = 250
"""How often librdkafka reports its group's state to a member (``RdKafkaSubscription.membership``)."""


@dataclass(frozen=True, slots=True)
class GroupWord:
    """What one librdkafka statistics report says of its consumer group (``group_word``).

    librdkafka exposes no heartbeat; its statistics do carry what the write fence needs
    (docs/reliability.md, "The write fence"): the group handler's state, its join state and,
    for the connection to the group coordinator, how long ago anything was received on it.
    That connection carries the member's heartbeats (one a second), so its last answer is at
    least as recent as the last heartbeat answered.
    """

    at: float
    """When librdkafka made the report, on ``time.monotonic``'s clock (both are CLOCK_MONOTONIC)."""
    up: bool
    """The coordinator is known and connected (state ``up``)."""
    steady: bool
    """No rebalance under way (join state ``steady``)."""
    answered: float | None
    """When the coordinator last answered anything (None: never yet)."""
    state_age_s: float = 0.0
    """How long the group handler has been in its state (``stateage``), at ``at``."""


def group_word(stats: str) -> GroupWord | None:
    """The group's part of a librdkafka statistics report (None when it has no group)."""
    report = json.loads(stats)
    group = report.get("cgrp")
    if group is None:
        return None
    at = report["ts"] / 1e6
    idle_us = report.get("brokers", {}).get("GroupCoordinator", {}).get("rxidle", -1)
    return GroupWord(
        at=at,
        up=group.get("state") == "up",
        steady=group.get("join_state") == "steady",
        answered=None if idle_us < 0 else at - idle_us / 1e6,
        state_age_s=group.get("stateage", 0) / 1000,
    )


COORDINATOR_LOST_WARN_S = 30.0
"""A member whose group handler has looked for its coordinator this long while the cluster does
not answer either says so (a warning, then one a minute): the broker is down."""

ORPHANED_AFTER_S = 20.0
"""A member whose group handler has looked for its coordinator this long while a new client
reaches the cluster joins again with a new consumer (``RdKafkaSubscription``): librdkafka has given
up on the cluster. A broker restart or pause takes about 15 s to come back from; a member that
can still find its coordinator finds it within seconds of the broker answering.

The cause (librdkafka 2.16, its issue #5301, not fixed upstream): a KRaft broker that comes back
from a pause fences itself until it registers again, and a Metadata request answered in that
window lists no broker. librdkafka then decommissions every broker it knew, and its re-bootstrap
timer only starts with a Metadata request it sends, which it now has no broker to send to. The
member reads nothing more, without an error, for good (an EventConsumer was stuck for an hour
in a 1,000-session chaos run; docs/reliability.md)."""

PROBE_EVERY_S = 10.0
"""How often a member without a coordinator asks a new client whether the cluster answers."""

# COMMIT_WAIT_S (log.kafka_backend) on librdkafka: it bounds no commit: it waits for a group
# coordinator, which a broker paused for 150 s held back for 150 s (measured), and which a consumer
# librdkafka left without brokers (ORPHANED_AFTER_S) never finds again. A synchronous commit also
# holds the consumer's handle: every other call into it, the poll among them, waits behind it
# (confluent-kafka serializes them). A worker waiting in such a commit never polls again, and its
# poll is where the member notices it was left without brokers and joins again: a planner stalled
# so, silently, in a 300-session chaos run (docs/reliability.md, "A commit that never returned").
# So a commit is asynchronous in librdkafka, its answer served by polls; unanswered after
# COMMIT_WAIT_S, the caller goes on, and the member's later offsets are held for the commit after
# it is answered.

COMMIT_POLL_FIRST_S = 0.001
COMMIT_POLL_MAX_S = 0.05
"""A commit looks for its answer after 1 ms, then after twice as long each time, up to 50 ms: an
answer takes a round trip to the coordinator (a commit took 6.5 ms median, synchronous, on this
machine's broker)."""

COMMIT_HELD_WARN_S = 60.0
"""While offsets are held behind a commit without an answer, a commit says so this often."""


def coordinator_lost(word: GroupWord | None, bound_s: float = COORDINATOR_LOST_WARN_S) -> bool:
    """Whether the group handler has been without a coordinator for longer than ``bound_s``."""
    return word is not None and not word.up and word.state_age_s > bound_s


def membership_of(word: GroupWord | None, assigned_at: float | None, now: float) -> Membership:
    """What a librdkafka member knows of its membership at ``now`` (``Subscription.membership``),
    as kafka-python's heartbeat tells it: CONFIRMED while the coordinator answered within
    ``CONFIRMED_FOR_S``, IN_DOUBT once it has not (or cannot be reached), LOST while a rebalance
    is under way or the partitions were revoked.

    ``assigned_at``: when the last assignment arrived (None: revoked, or none yet). The
    assignment is itself an answer of the coordinator; a report made before it speaks of the
    group as it was before (a rebalance that has ended since).
    """
    if assigned_at is None:
        return Membership.LOST
    answered = assigned_at
    if word is not None and word.at >= assigned_at:
        if not word.steady:
            return Membership.LOST
        if not word.up or word.answered is None:
            return Membership.IN_DOUBT
        answered = max(answered, word.answered)
    return Membership.IN_DOUBT if now - answered > CONFIRMED_FOR_S else Membership.CONFIRMED


@dataclass(slots=True)
class _Commit:
    """One asynchronous commit of a member, until librdkafka answers it (``on_commit``)."""

    asked_at: float
    """When it was asked (``time.monotonic``)."""
    said_at: float = 0.0
    """When a commit held behind it last said so (``time.monotonic``)."""
    answered: bool = False
    error: KafkaError | None = None
    abandoned: bool = False
    """Its caller stopped waiting (``COMMIT_WAIT_S``): the answer is only logged."""


class RdKafkaSubscription(KafkaGroupMember):
    """A librdkafka group consumer; the broker's group coordinator assigns partitions.

    The write fence (docs/reliability.md) as on kafka-python: ``writing()`` is held while
    records are handed to the producer; a revocation takes it, makes the member LOST and waits
    for what was handed over to land or fail before the member rejoins; ``membership()`` reads
    the group's state from librdkafka's statistics (``group_word``), which it reports every
    ``STATS_INTERVAL_MS`` to the polling thread.
    """

    backend: RdKafkaBackend
    _word: GroupWord | None = None
    _assigned_at: float | None = None
    """When the last assignment arrived (``time.monotonic``); None while there is none."""
    _assigned: frozenset[tuple[str, int]] = frozenset()
    """(logical topic, partition) as the last rebalance callback left it: ``assignment()`` reads
    this, not librdkafka's ``assignment()``, which waits for librdkafka's own thread and, called
    from the event loop while another thread polls, stalls it for milliseconds (or for good)."""

    _lost_warned_at: float | None = None
    """When the member last warned that it has no coordinator (``time.monotonic``)."""
    _probed_at: float | None = None
    """When the member last asked whether the cluster answers (``time.monotonic``)."""
    rejoins = 0
    """How often the member joined again with a new consumer (``ORPHANED_AFTER_S``)."""
    orphaned_after_s = ORPHANED_AFTER_S
    """``ORPHANED_AFTER_S`` for this member (``bench/rdkafka_orphans.py`` turns it off in a
    member that shows what happens without it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._generation = 0  # of the librdkafka consumer: the callbacks of a replaced one do nothing
        self._writing = threading.Lock()
        self._polling = asyncio.Lock()  # one call into the consumer at a time: poll or refresh
        self._early: list[Any] = []  # messages a refresh took, handed out first by the next poll
        self._unsent: dict[tuple[str, int], int] = {}  # offsets to commit, held while a commit is unanswered
        self._commit: _Commit | None = None  # the commit asked last, until its answer (``_on_commit``)
        self._names = {self.backend.physical(t): t for t in self.topics}  # a message's topic, as the log names it

    def assignment(self) -> set[tuple[str, int]]:
        return set(self._assigned)

    def writing(self) -> AbstractContextManager[object]:
        return self._writing

    def membership(self) -> Membership:
        return membership_of(self._word, self._assigned_at, time.monotonic())

    async def refresh(self) -> None:
        # A poll that waits for nothing serves what librdkafka queued (statistics, rebalances,
        # commit answers); it may take a message too, kept for the next poll, in order.
        async with self._polling:
            if self._consumer is None:
                return  # closed
            message = await asyncio.to_thread(self._consumer.poll, 0)
            if message is not None:
                self._early.append(message)

    def _on_stats(self, stats: str) -> None:
        # On the polling thread, inside poll: one assignment, read by the event loop's thread.
        if (word := group_word(stats)) is not None:
            self._word = word

    def join(self) -> None:
        # As in kafka_backend: a new group starts at the beginning, a dead member's partitions
        # move after 6 s, groups live in the namespace, a static member takes its partitions back.
        config: dict[str, Any] = {
            "group.id": self.backend.physical(self.group),
            "auto.offset.reset": "earliest",
            "session.timeout.ms": SESSION_TIMEOUT_MS,
            "heartbeat.interval.ms": 1000,
            "statistics.interval.ms": STATS_INTERVAL_MS,
        }
        if self.instance_id:
            config["group.instance.id"] = self.instance_id
        generation = self._generation = self._generation + 1

        def current(callback: Callable[..., None]) -> Callable[..., None]:
            # A replaced consumer runs its callbacks as it closes: they must not touch the member.
            return lambda *args: callback(*args) if generation == self._generation else None

        self._consumer = self.backend._consumer(
            **config, stats_cb=current(self._on_stats), on_commit=current(self._on_commit)
        )
        self._consumer.subscribe(
            [self.backend.physical(t) for t in self.topics],
            on_assign=current(self._on_assign),
            on_revoke=current(self._on_revoke),
        )

    async def _rejoin_if_orphaned(self) -> None:
        """Join again with a new consumer if librdkafka has given up on the cluster
        (``ORPHANED_AFTER_S``); while the cluster does not answer either, say so once a minute."""
        word = self._word
        if not coordinator_lost(word, min(self.orphaned_after_s, COORDINATOR_LOST_WARN_S)):
            self._lost_warned_at = None
            return
        now = time.monotonic()
        if self._probed_at is not None and now - self._probed_at < PROBE_EVERY_S:
            return
        self._probed_at = now
        answers = await asyncio.to_thread(self.backend.cluster_answers)
        if answers and coordinator_lost(word, self.orphaned_after_s):
            await asyncio.to_thread(self._rejoin)
        elif coordinator_lost(word) and (self._lost_warned_at is None or now - self._lost_warned_at >= 60):
            self._lost_warned_at = now
            _log.warning(
                "consumer of %s: no group coordinator for %.0f s; the cluster %s",
                self.group,
                word.state_age_s if word else 0.0,
                "answers" if answers else "does not answer",
            )

    def _rejoin(self) -> None:
        """Close the consumer librdkafka left without brokers and join again with a new one. The
        partitions are given up as a revocation gives them up (the write fence: no record is
        handed over from here on, and what was lands or fails first); the new consumer takes
        back the ones it gets from their committed offsets, as after a rebalance."""
        _log.warning(
            "consumer of %s: no group coordinator for %.0f s while the cluster answers (librdkafka "
            "dropped every broker it knew: its issue #5301); joining again with a new consumer",
            self.group,
            self._word.state_age_s if self._word else 0.0,
        )
        with self._writing:
            self._assigned_at = None
        self.backend.settle_sends()
        if self._assigned:
            self._held = {(self.backend.physical(t), p) for t, p in self._assigned}
        self._assigned = frozenset()
        self._early = []  # from partitions it has given up
        stuck, self._word = self._consumer, None
        self.join()  # the stuck consumer's callbacks are off from here on
        unanswered, self._commit = self._commit is not None, None  # the stuck consumer's: never answered
        self._close_consumer(stuck, unanswered)
        self.rejoins += 1

    def _close_consumer(self, consumer: Any, unanswered: bool) -> None:
        """Close ``consumer``; one with a commit ``unanswered`` in a thread of its own, not waited
        for: librdkafka's close waits for that answer, which a broker that never answers never gives
        (with the broker SIGSTOPped, such a close waited 30 s and more, one without 5 s)."""
        if unanswered:
            threading.Thread(target=consumer.close, name=f"close-{self.group}", daemon=True).start()
        else:
            consumer.close()

    async def close(self) -> None:
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            unanswered, self._commit = self._commit is not None, None
            await asyncio.to_thread(self._close_consumer, consumer, unanswered)

    # Rebalance callbacks run inside consume, on the polling thread. The default (eager)
    # assignors revoke everything, then assign the new set.
    def _on_revoke(self, consumer: Any, revoked: list[Any]) -> None:
        # The member rejoins when this returns: from here on no writer hands a record over
        # (membership() is LOST), and what was handed over lands or fails (bounded delivery)
        # before the group can give the partitions to another member.
        with self._writing:
            self._assigned_at = None
        self.backend.settle_sends()
        self._held = {(tp.topic, tp.partition) for tp in revoked}
        self._assigned = frozenset()
        consumer.unassign()

    def _on_assign(self, consumer: Any, assigned: list[Any]) -> None:
        self.assignments += 1
        if self.from_beginning:
            # Partitions new to this member start at 0; partitions it kept continue where it was
            # (their committed offset: every poll's records are committed before the next rebalance
            # can complete, as with kafka-python's eager protocol).
            for tp in assigned:
                if (tp.topic, tp.partition) not in self._held:
                    tp.offset = OFFSET_BEGINNING
        consumer.assign(assigned)
        self._held = {(tp.topic, tp.partition) for tp in assigned}
        self._assigned = frozenset((self.backend.logical(tp.topic), tp.partition) for tp in assigned)
        self._assigned_at = time.monotonic()

    async def poll(self, timeout_s: float, max_records: int) -> list[RawRecord]:
        async with self._polling:
            await self._rejoin_if_orphaned()
            early, self._early = self._early[:max_records], self._early[max_records:]
            if early:  # something to hand out already: wait for nothing more
                more = max_records - len(early)
                messages = [*early, *(await asyncio.to_thread(self._consumer.consume, more, 0) if more else [])]
            else:
                messages = await asyncio.to_thread(_take, self._consumer, timeout_s, max_records)
        names = self._names
        try:
            # One expression per message: a loop of statements cost a tenth of a microsecond a
            # record more. A message with an error is passed over here and handled below.
            records = [
                new_tuple(
                    RawRecord, (new_tuple(Position, (names[m.topic()], m.partition(), m.offset())), m.key(), m.value())
                )
                for m in messages
                if m.error() is None
            ]
        except KeyError:  # a topic this member did not subscribe to: never seen
            records = []
        if len(records) != len(messages):
            records = self._records_around_errors(messages)
        # In offset order per partition, as librdkafka hands them out; partitions come in runs
        # of a fetched batch each, which is all the contract asks (a sort cost 0.3 us a record).
        return records

    def _records_around_errors(self, messages: list[Any]) -> list[RawRecord]:
        """``poll``'s records of messages some of which carry an error: a fatal one raises, any
        other is logged and skipped."""
        logical = self.backend.logical
        records: list[RawRecord] = []
        for m in messages:
            if (err := m.error()) is not None:
                if err.fatal() or err.code() in _REFUSED:
                    raise BackendUnavailable(f"consumer of {self.group} failed: {err.name()}: {err.str()}")
                _log.warning("consumer of %s: %s: %s", self.group, err.name(), err.str())
                continue
            position = new_tuple(Position, (logical(m.topic()), m.partition(), m.offset()))
            records.append(new_tuple(RawRecord, (position, m.key(), m.value())))
        return records

    async def commit(self, offsets: dict[tuple[str, int], int]) -> None:
        """Commit ``offsets`` (with those held back before) and wait up to ``COMMIT_WAIT_S`` for the
        group's answer, serving polls meanwhile (a message they take is kept for the next poll).
        Unanswered by then, the commit stays asked and this returns, with a warning; until it is
        answered, later offsets are held for the commit after it. Offsets of partitions no longer
        assigned are not committed: their new owner commits them."""
        self._unsent.update(offsets)
        if (waiting := self._commit) is not None:
            # The commit before has no answer yet: these go with the next one (said once a minute).
            now = time.monotonic()
            if min(now - waiting.asked_at, now - waiting.said_at) >= COMMIT_HELD_WARN_S:
                waiting.said_at = now
                _log.warning(
                    "consumer of %s: offsets held for %.0f s behind a commit without an answer",
                    self.group,
                    now - waiting.asked_at,
                )
            return
        assigned = self._assigned
        unsent, self._unsent = {tp: o for tp, o in self._unsent.items() if tp in assigned}, {}
        if not unsent:
            return
        physical = self.backend.physical
        payload = [TopicPartition(physical(t), p, o) for (t, p), o in unsent.items()]
        commit = _Commit(asked_at=time.monotonic())
        async with self._polling:
            if self._consumer is None:
                return  # closed
            self._commit = commit
            try:
                await asyncio.to_thread(self._consumer.commit, offsets=payload, asynchronous=True)
            except KafkaException as e:  # refused at once
                self._commit = None
                raise BackendUnavailable(f"commit of {self.group} failed: {_error(e)}") from e
        deadline = time.monotonic() + COMMIT_WAIT_S
        pause = COMMIT_POLL_FIRST_S
        while True:
            # A poll that waits serves the answer and waits on regardless (to its timeout, for a
            # message): polls that wait for nothing, looking again sooner at first.
            await self.refresh()
            if commit.answered:
                break
            if time.monotonic() >= deadline:
                commit.abandoned = True
                _log.warning(
                    "consumer of %s: a commit has had no answer for %.0f s (no group coordinator); polling "
                    "goes on, and the offsets after it are committed once it is answered",
                    self.group,
                    COMMIT_WAIT_S,
                )
                return
            await asyncio.sleep(pause)
            pause = min(2 * pause, COMMIT_POLL_MAX_S)
        if commit.error is not None:
            raise BackendUnavailable(f"commit of {self.group} failed: {commit.error.name()}: {commit.error.str()}")

    def _on_commit(self, error: KafkaError | None, partitions: list[Any]) -> None:
        # On the polling thread, inside a poll: the answer to the commit asked last.
        commit, self._commit = self._commit, None
        if commit is None:
            return
        commit.error, commit.answered = error, True
        if commit.abandoned:
            _log.warning(
                "consumer of %s: the commit that had no answer was answered: %s",
                self.group,
                "committed" if error is None else f"{error.name()}: {error.str()}",
            )

    def seek(self, topic: str, partition: int, offset: int) -> bool:
        # Called between polls. A partition assigned but not fetched yet cannot seek ("erroneous
        # state"): then the caller skips the records before ``offset`` itself.
        tp = TopicPartition(self.backend.physical(topic), partition, offset)
        if (topic, partition) not in self.assignment():
            return False
        try:
            self._consumer.seek(tp)
        except KafkaException as e:
            _log.debug("cannot seek %s[%d] to %d yet: %s", topic, partition, offset, _error(e))
            return False
        return True


def _take(consumer: Any, timeout_s: float, max_records: int) -> list[Any]:
    """Up to ``max_records`` messages, waiting up to ``timeout_s`` for the first one only.

    librdkafka's ``consume(n, timeout)`` waits until it has ``n`` messages (or the timeout
    passed), which would hold back a poll's first record behind a full timeout; the
    log's poll returns as soon as anything is there (kafka-python's semantics)."""
    first = consumer.poll(timeout_s)
    if first is None:
        return []
    return [first, *consumer.consume(max_records - 1, 0)] if max_records > 1 else [first]
