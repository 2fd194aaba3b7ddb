"""The Kafka backend (kafka-python): the production log.

- Topics of ``log.topics`` with a fixed partition count, ``retention.ms=-1``
  and ``cleanup.policy=delete`` (the DLQ keeps 7 days).
- One idempotent producer with ``acks=all``. The partition is computed here
  with Kafka's own murmur2 of the session id, so it is the partition any other
  Kafka client would pick for that key.
- kafka-python is synchronous and thread-based: sends are queued without
  blocking and completed by its sender thread; consumer calls run in a worker
  thread (``asyncio.to_thread``), one at a time per consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from kafka import KafkaConsumer, KafkaProducer
from kafka import __version__ as kafka_python_version
from kafka.admin import KafkaAdminClient
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.errors import KafkaError, KafkaTimeoutError, TopicAlreadyExistsError
from kafka.structs import OffsetAndMetadata, TopicPartition

from log import topics as topic_table
from log.backend import Backend, Membership, OutRecord, Subscription
from log.errors import BackendUnavailable
from log.types import Position, RawRecord

_log = logging.getLogger(__name__)

DLQ_RETENTION_MS = 7 * 24 * 3600 * 1000
RECONNECT_BACKOFF_MAX_MS = 1000
"""kafka-python's default is 30 s (the Java client's, 1 s): the backoff doubles while the broker
is down, so a broker back after a 10 s restart was reached again only up to 30 s later (the
chaos bench measured a median recovery of 36-76 s)."""
_POLL_BATCH = 2000

SCAN_GROUP = "agentlog-scan"
"""The consumer group librdkafka's partition scanners name (namespaced like every group): the
client requires one, and librdkafka looks its coordinator up (FindCoordinator, which needs
DESCRIBE on the group: ``log.acls`` grants it to every role), though a scanner never joins
it or commits to it."""
COMMIT_WAIT_S = 10.0
"""How long a member's commit waits for the group's answer before its caller goes on, on both
clients (``Subscription.commit``): a worker waiting in a commit does not poll, and a broker paused
or gone answers no commit (kafka-python's own bound is its request timeout, 305 s, then an error;
librdkafka has none: ``log.rdkafka_backend``). Unanswered, the offsets go with the next commit."""
SESSION_TIMEOUT_MS = 6000
"""A group member that stops heartbeating loses its partitions after this (the broker's minimum)."""
CONFIRMED_FOR_S = SESSION_TIMEOUT_MS / 3000
"""A member whose last heartbeat was answered this long ago is IN_DOUBT (``membership``)."""
BOUNDED_REQUEST_TIMEOUT_MS = 1000
BOUNDED_DELIVERY_TIMEOUT_MS = 1500
"""A producer with bounded delivery (the session workers': ``bounded_delivery``) reports every
record landed or failed within this, and never sends it again after: a record handed over
while its member was CONFIRMED lands, if ever, before the group can have given the partition
to another member. The group drops a member no sooner than SESSION_TIMEOUT_MS after it last
heard from it, which was at most CONFIRMED_FOR_S before the record was handed over:
1.5 s + 2 s < 6 s, with 2.5 s to spare for a heartbeat answer read late on a busy machine
(docs/reliability.md, "The write fence")."""


def security_config() -> dict[str, Any]:
    """SASL/PLAIN client settings from the environment (empty for a plaintext broker).

    Credentials come from ``AGENTLOG_KAFKA_USERNAME`` and ``AGENTLOG_KAFKA_PASSWORD``
    (or ``AGENTLOG_KAFKA_PASSWORD_FILE``), never from the command line or the log.
    """
    username = os.environ.get("AGENTLOG_KAFKA_USERNAME")
    if not username:
        return {}
    password = os.environ.get("AGENTLOG_KAFKA_PASSWORD")
    if password is None and (path := os.environ.get("AGENTLOG_KAFKA_PASSWORD_FILE")):
        with open(path) as f:
            password = f.read().strip()
    return {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "PLAIN",
        "sasl_plain_username": username,
        "sasl_plain_password": password or "",
    }


class _BatchWaiter:
    """Turns N kafka-python send futures into one asyncio future.

    kafka-python completes each send future on its sender thread. The callback
    there only counts down (and keeps the first error); the last one wakes the
    event loop once for the whole batch, and the loop reads the partition and
    offset of every record from the futures themselves. Every future is
    counted, so nothing is assumed about the order in which they complete.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, topic: str, n: int, on_failed: Callable[[], None] = lambda: None
    ) -> None:
        self.loop = loop
        self.topic = topic
        self.on_failed = on_failed
        """Called (on the sender's thread) when the first of the records fails."""
        self.future: asyncio.Future[list[Position]] = loop.create_future()
        self.sends: list[Any] = []  # kafka-python FutureRecordMetadata, in record order
        self.remaining = n
        self.error: BaseException | None = None
        # A callback added to a future that is already done runs at once, on the event
        # loop's thread, so the count is shared by two threads.
        self.lock = threading.Lock()

    def add(self, send: Any) -> None:
        self.sends.append(send)
        send.add_both(self._count_down)  # called with the RecordMetadata or the exception

    def _count_down(self, outcome: Any) -> None:
        failed = False
        with self.lock:
            if self.error is None and isinstance(outcome, BaseException):
                self.error = outcome
                failed = True
            self.remaining -= 1
            last = self.remaining == 0
        if failed:
            self.on_failed()
        if last:
            self.loop.call_soon_threadsafe(self._finish)

    def _finish(self) -> None:
        if self.future.done():
            return
        if self.error is not None:
            self.future.set_exception(BackendUnavailable(f"producing to {self.topic} failed: {self.error}"))
            return
        topic = self.topic
        positions = []
        for send in self.sends:
            metadata = send.value
            positions.append(Position(topic, metadata.partition, metadata.offset))
        self.future.set_result(positions)


_Built = TypeVar("_Built")


async def built_in_thread(build: Callable[[], _Built], close: Callable[[_Built], None]) -> _Built:
    """``build()`` (a kafka-python client: it connects, so it blocks) in a worker thread.

    A caller cancelled meanwhile (a ``wait_for`` that gave up on a paused broker) cannot stop
    the thread, which finishes building: what it built is then closed, from a thread of its
    own, instead of leaking its sockets and its I/O thread."""
    future = asyncio.get_running_loop().run_in_executor(None, build)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:

        def close_when_built(done: asyncio.Future[_Built]) -> None:
            if not done.cancelled() and done.exception() is None:
                threading.Thread(target=close, args=(done.result(),), daemon=True).start()

        future.add_done_callback(close_when_built)
        raise


def topic_configs(topic: topic_table.Topic) -> dict[str, str]:
    """The Kafka topic settings of one of the log's topics."""
    retention = "-1" if topic.infinite_retention else str(DLQ_RETENTION_MS)
    return {"cleanup.policy": "delete", "retention.ms": retention}


def one_partition_count(counts: dict[str, int]) -> int:
    """The partition count every topic of the log shares (logical topic -> its count; 0:
    the topic is missing)."""
    for topic, count in counts.items():
        if not count:
            raise BackendUnavailable(f"topic {topic} does not exist: run `logctl init`")
    if len(set(counts.values())) != 1:
        raise BackendUnavailable(f"topics are not co-partitioned (partition counts {sorted(set(counts.values()))})")
    return next(iter(counts.values()))


class KafkaCluster:
    """What both Kafka clients' backends share: the cluster, the client settings, and where a
    namespace's topics and groups live on it."""

    def __init__(
        self,
        bootstrap: str,
        *,
        namespace: str = "",
        client_config: dict[str, Any] | None = None,
        linger_ms: int = 2,
        bounded_delivery: bool = False,
    ) -> None:
        self.bootstrap = bootstrap
        self.namespace = namespace
        self.client_config = {**security_config(), **(client_config or {})}
        self.linger_ms = linger_ms
        self.bounded_delivery = bounded_delivery
        """Report each record landed or failed within BOUNDED_DELIVERY_TIMEOUT_MS (the session
        workers', whose appends are fenced by their group membership), not the client's 120 s."""
        self._scanners: list[Any] = []  # idle scan consumers, reused
        self._num_partitions: int | None = None

    def physical(self, topic: str) -> str:
        """The Kafka topic that holds logical ``topic`` (prefixed by the namespace, if any)."""
        return f"{self.namespace}.{topic}" if self.namespace else topic

    def logical(self, physical: str) -> str:
        return physical.removeprefix(f"{self.namespace}.") if self.namespace else physical


class KafkaBackend(KafkaCluster, Backend):
    """Topics on a Kafka cluster at ``bootstrap`` (``host:port[,host:port]``).

    A producer that failed a record is replaced, never used again. kafka-python's idempotent
    producer (3.0.12) cannot be trusted after a failure: a batch that expired after it was sent
    resets the producer id without asking for a new one, and it then sends nothing, ever (the
    bounded-delivery test hung there); asked to bump its epoch instead, it holds every later
    record, unexpired, until the broker answers, which breaks the bound the write fence rests
    on. So the failed producer is force-closed (whatever it still holds fails now and is never
    sent) and a new one, with a new producer id, takes over; until it is built, ``produce``
    raises BackendUnavailable, which the session workers retry.
    """

    name = "kafka"
    _producer: Any = None
    _closed = False
    _replacing: threading.Thread | None = None
    """Closes the producer that failed a record and builds the next one."""
    _discarded: Any = None
    """The last producer that failed a record (force-closed)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._swap = threading.Lock()

    def _delivery_config(self) -> dict[str, int]:
        if not self.bounded_delivery:
            return {}
        return {"request_timeout_ms": BOUNDED_REQUEST_TIMEOUT_MS, "delivery_timeout_ms": BOUNDED_DELIVERY_TIMEOUT_MS}

    def settle_sends(self) -> None:
        """Block until every record handed to the producer landed or failed (bounded delivery
        only: it is what lets a member give its partitions up safely; see KafkaSubscription)."""
        if not self.bounded_delivery:
            return
        if (discarded := self._discarded) is not None:
            # Its sender thread fails every record it holds on its way out.
            discarded._sender.join(timeout=2 * BOUNDED_DELIVERY_TIMEOUT_MS / 1000)
        producer = self._producer
        if producer is None:
            return
        try:
            producer.flush(timeout=2 * BOUNDED_DELIVERY_TIMEOUT_MS / 1000)
        except KafkaError as e:  # expired: it will not be sent again either
            _log.warning("records in flight when partitions were revoked: %s", e)

    def _new_producer(self) -> Any:
        return KafkaProducer(
            bootstrap_servers=self.bootstrap,
            reconnect_backoff_max_ms=RECONNECT_BACKOFF_MAX_MS,
            acks="all",
            enable_idempotence=True,
            linger_ms=self.linger_ms,
            batch_size=256 * 1024,
            **self._delivery_config(),
            **self.client_config,
        )

    def _send_failed(self, producer: Any) -> None:
        """A record sent with ``producer`` failed (called on its sender thread): replace it."""
        with self._swap:
            if self._producer is not producer or self._closed:
                return  # replaced already, or closing
            self._producer = None
            # Force-closed, its sender fails every record it holds when this callback returns,
            # instead of sending them after the broker's return (kafka-python's close() flushes
            # first, and a producer without a producer id never finishes a flush).
            producer._sender.force_close()
            self._discarded = producer
            self._replacing = threading.Thread(target=self._replace, args=(producer,), daemon=True)
            self._replacing.start()

    def _replace(self, failed: Any) -> None:
        with contextlib.suppress(KafkaError):
            failed.close(timeout=BOUNDED_DELIVERY_TIMEOUT_MS / 1000)
        _log.warning("replacing the Kafka producer after a failed send")
        while not self._closed:
            try:
                producer = self._new_producer()
            except KafkaError as e:
                _log.warning("cannot build a Kafka producer yet: %s", e)
                time.sleep(RECONNECT_BACKOFF_MAX_MS / 1000)
                continue
            with self._swap:
                if not self._closed:
                    self._producer, producer = producer, None
                    self._replacing = None
            if producer is not None:  # closed meanwhile
                producer.close(timeout=0)
            return

    def _consumer(self, **config: Any) -> Any:
        return KafkaConsumer(
            bootstrap_servers=self.bootstrap,
            reconnect_backoff_max_ms=RECONNECT_BACKOFF_MAX_MS,
            enable_auto_commit=False,
            key_deserializer=None,
            value_deserializer=None,
            **self.client_config,
            **config,
        )

    async def start(self) -> None:
        self._closed = False
        try:
            self._producer = await built_in_thread(self._new_producer, lambda producer: producer.close())
        except KafkaError as e:
            raise BackendUnavailable(f"cannot reach Kafka at {self.bootstrap}: {e}") from e
        _log.info("producing to %s with kafka-python %s", self.bootstrap, kafka_python_version)

    async def close(self) -> None:
        """Close the producer and every scan consumer, all of them even if the caller gives up.

        A chaos run's operator gives a round 30 s (``wait_for``) while the broker may be paused,
        when the producer's close waits for its sends in flight: cancelled between two awaits,
        the scan consumers after it were never closed (pytest failed a run on their socket
        pairs). One thread closes everything, shielded: a cancelled caller leaves it running."""
        with self._swap:
            self._closed = True
            producer, self._producer = self._producer, None
        scanners, self._scanners = self._scanners, []
        replacing = self._replacing

        def close_all() -> None:
            if replacing is not None:
                replacing.join()
            if producer is not None:
                producer.close()
            for scanner in scanners:
                scanner.close()

        await asyncio.shield(asyncio.to_thread(close_all))

    def _give_back(self, scanner: Any) -> None:
        """Pool a scan consumer for the next scan; closed if the backend closed meanwhile (a scan
        whose generator is finalized late, after its log was closed, hands it back then)."""
        if self._closed:
            threading.Thread(target=scanner.close, daemon=True).start()
        else:
            self._scanners.append(scanner)

    async def create_topics(self, num_partitions: int) -> None:
        def create() -> None:
            admin = KafkaAdminClient(bootstrap_servers=self.bootstrap, **self.client_config)
            try:
                existing = set(admin.list_topics())
                wanted = {
                    self.physical(t.name): {
                        "num_partitions": num_partitions,
                        "replication_factor": 1,
                        "configs": topic_configs(t),
                    }
                    for t in topic_table.TOPICS
                    if self.physical(t.name) not in existing
                }
                if wanted:
                    # Another initializer may create them at the same moment.
                    with contextlib.suppress(TopicAlreadyExistsError):
                        admin.create_topics(wanted, wait_for_metadata=True)
            finally:
                admin.close()

        await asyncio.to_thread(create)

    async def num_partitions(self) -> int:
        if self._num_partitions is None:
            scanner = await self._take_scanner()
            try:
                counts = {
                    t.name: len(await asyncio.to_thread(scanner.partitions_for_topic, self.physical(t.name)) or ())
                    for t in topic_table.TOPICS
                }
            finally:
                self._give_back(scanner)
            self._num_partitions = one_partition_count(counts)
        return self._num_partitions

    async def produce(self, topic: str, records: Sequence[OutRecord]) -> asyncio.Future[list[Position]]:
        producer = self._producer
        if producer is None:
            if self._replacing is not None:
                raise BackendUnavailable(f"producing to {topic}: the producer is being replaced after a failed send")
            raise RuntimeError("backend not started")
        waiter = _BatchWaiter(
            asyncio.get_running_loop(), topic, len(records), on_failed=lambda: self._send_failed(producer)
        )
        physical = self.physical(topic)
        send = producer.send
        for record in records:
            waiter.add(send(physical, value=record.value, key=record.key, partition=record.partition))
        return waiter.future

    async def _take_scanner(self) -> Any:
        if self._scanners:
            return self._scanners.pop()
        return await built_in_thread(lambda: self._consumer(group_id=None), lambda scanner: scanner.close())

    async def scan(
        self, topic: str, partition: int, start: int = 0, end: int | None = None
    ) -> AsyncIterator[RawRecord]:
        tp = TopicPartition(self.physical(topic), partition)
        scanner = await self._take_scanner()
        try:
            if end is None:
                end = (await asyncio.to_thread(scanner.end_offsets, [tp]))[tp]
            if start >= end:
                return
            scanner.assign([tp])
            scanner.seek(tp, start)
            position = start
            while position < end:
                batch = await asyncio.to_thread(scanner.poll, 1000, _POLL_BATCH)
                for message in batch.get(tp, []):
                    if message.offset >= end:
                        return
                    position = message.offset + 1
                    yield RawRecord(Position(topic, partition, message.offset), message.key, message.value)
                if not batch:
                    # Nothing came back: the records may be compacted or aborted; the consumer
                    # position tells how far the log really goes.
                    position = max(position, await asyncio.to_thread(scanner.position, tp))
        finally:
            scanner.assign([])
            self._give_back(scanner)

    async def end_offsets(self, topic: str) -> dict[int, int]:
        n = await self.num_partitions()
        scanner = await self._take_scanner()
        try:
            tps = [TopicPartition(self.physical(topic), p) for p in range(n)]
            ends = await asyncio.to_thread(scanner.end_offsets, tps)
        finally:
            self._give_back(scanner)
        return {tp.partition: offset for tp, offset in ends.items()}

    async def subscribe(
        self, group: str, topics: Sequence[str], *, from_beginning: bool, instance_id: str | None = None
    ) -> Subscription:
        subscription = KafkaSubscription(self, group, topics, from_beginning=from_beginning, instance_id=instance_id)

        def join() -> KafkaSubscription:
            subscription.join()
            return subscription

        return await built_in_thread(join, _leave)


def _leave(subscription: KafkaSubscription) -> None:
    if subscription._consumer is not None:
        subscription._consumer.close()


class KafkaGroupMember(Subscription):
    """What both clients' group consumers share: the group, its topics, the partitions held.

    Subclasses make ``_consumer`` in ``join`` (called in a thread); its ``assignment()``
    lists objects with ``topic`` and ``partition``, and its ``close()`` leaves the group.
    """

    def __init__(
        self,
        backend: KafkaCluster,
        group: str,
        topics: Sequence[str],
        *,
        from_beginning: bool,
        instance_id: str | None = None,
    ) -> None:
        self.backend = backend
        self.group = group
        self.instance_id = instance_id
        self.topics = tuple(topics)
        self.from_beginning = from_beginning
        self._held: set[tuple[str, int]] = set()  # (physical topic, partition) before a rebalance
        self._consumer: Any = None

    def assignment(self) -> set[tuple[str, int]]:
        return {(self.backend.logical(tp.topic), tp.partition) for tp in self._consumer.assignment()}

    async def close(self) -> None:
        if self._consumer is not None:
            await asyncio.to_thread(self._consumer.close)
            self._consumer = None


class KafkaSubscription(KafkaGroupMember, ConsumerRebalanceListener):  # type: ignore[misc]
    """A kafka-python group consumer; the broker's group coordinator assigns partitions."""

    backend: KafkaBackend
    _revoking = False
    """Partitions are being revoked: no record may be handed over until the next assignment."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._writing = threading.Lock()
        self._unsent: dict[tuple[str, int], int] = {}  # offsets of a commit that had no answer, for the next

    def join(self) -> None:
        # A new group with no committed offset starts at the beginning: an event log is read whole.
        # A member that dies (kill -9) keeps its partitions until its session times out:
        # kafka-python's default is 45 s; 6 s (the broker's minimum) hands them over sooner.
        # Groups live in the namespace, like topics: logs sharing a cluster never share a group.
        # A static member (instance id) that restarts takes its partitions back at once.
        self._consumer = self.backend._consumer(
            group_id=self.backend.physical(self.group),
            group_instance_id=self.instance_id,
            auto_offset_reset="earliest",
            session_timeout_ms=SESSION_TIMEOUT_MS,
            heartbeat_interval_ms=1000,
        )
        physical = [self.backend.physical(t) for t in self.topics]
        self._consumer.subscribe(physical, listener=self)
        # Know every topic's partitions before the first poll joins the group. kafka-python
        # joins with whatever metadata it holds, and right after subscribe() that is the
        # bootstrap's (no topics): the leader then assigns nothing, and the rejoin that the
        # next metadata update asks for can hang for good on a busy machine (no heartbeat,
        # no partitions, no error: tests/integration/test_kafka_group_join.py). Fetched
        # here (it waits for any refresh in flight first), the first join assigns them all.
        for topic in physical:
            self._consumer.partitions_for_topic(topic)

    # ConsumerRebalanceListener (called inside poll, on the polling thread). kafka-python
    # rebalances eagerly: every rebalance revokes everything, then assigns the new set.
    def on_partitions_revoked(self, revoked: Any) -> None:
        # The member rejoins when this returns, and the group hands the partitions to anyone
        # only once every member rejoined (or was dropped): records of this member still in
        # flight would land after its successor read the partition's tails, a second writer of
        # those chains. From here on no writer hands over a record (membership() is LOST), and
        # what was handed over lands or fails (bounded delivery) before the rejoin.
        with self._writing:
            self._revoking = True
        self.backend.settle_sends()
        self._held = {(tp.topic, tp.partition) for tp in revoked}

    def on_partitions_lost(self, lost: Any) -> None:
        # The group dropped this member: as for a revocation, and kafka-python forgets the
        # partitions' positions too. Any of them given back is new to it: read from the
        # beginning (its committed offset is not where this member was).
        self.on_partitions_revoked(lost)
        self._held = set()

    def on_partitions_assigned(self, assigned: Any) -> None:
        self.assignments += 1
        if self.from_beginning:
            # Partitions new to this member start at 0; partitions it kept continue where it was.
            new = [tp for tp in assigned if (tp.topic, tp.partition) not in self._held]
            if new:
                self._consumer.seek_to_beginning(*new)
        self._held = {(tp.topic, tp.partition) for tp in assigned}
        self._revoking = False

    def writing(self) -> AbstractContextManager[object]:
        return self._writing

    def membership(self) -> Membership:
        # Read from kafka-python's coordinator, whose heartbeat runs beside the polling thread:
        # a heartbeat answered within CONFIRMED_FOR_S means the broker cannot expire this member
        # for SESSION_TIMEOUT_MS minus that (its timer started before that answer); an answer
        # that asks for a rejoin (rebalance, unknown member, fenced) sets ``need_rejoin``.
        if self._revoking:
            return Membership.LOST
        coordinator = getattr(self._consumer, "_coordinator", None)
        if coordinator is None:
            return Membership.CONFIRMED
        if coordinator.need_rejoin() or not coordinator.stable():
            return Membership.LOST
        heartbeat = coordinator.heartbeat
        answered = max(heartbeat.last_receive, heartbeat.last_reset)
        if time.monotonic() - answered > CONFIRMED_FOR_S:
            return Membership.IN_DOUBT
        return Membership.CONFIRMED

    async def poll(self, timeout_s: float, max_records: int) -> list[RawRecord]:
        batch = await asyncio.to_thread(self._consumer.poll, int(timeout_s * 1000), max_records)
        records: list[RawRecord] = []
        for tp in sorted(batch, key=lambda tp: (tp.topic, tp.partition)):
            topic = self.backend.logical(tp.topic)
            partition = tp.partition
            records.extend(RawRecord(Position(topic, partition, m.offset), m.key, m.value) for m in batch[tp])
        return records

    async def commit(self, offsets: dict[tuple[str, int], int]) -> None:
        """Commit ``offsets`` (with those of a commit that had no answer before), waiting up to
        ``COMMIT_WAIT_S``; unanswered by then, this returns with a warning and they go with the next
        commit. Offsets of partitions no longer assigned are not committed: their new owner commits them."""
        self._unsent.update(offsets)
        assigned = self.assignment()
        unsent, self._unsent = {tp: o for tp, o in self._unsent.items() if tp in assigned}, {}
        if not unsent:
            return
        payload = {
            TopicPartition(self.backend.physical(t), p): OffsetAndMetadata(o, "", -1) for (t, p), o in unsent.items()
        }
        try:
            await asyncio.to_thread(self._consumer.commit, payload, int(COMMIT_WAIT_S * 1000))
        except KafkaTimeoutError:
            self._unsent = unsent | self._unsent
            _log.warning(
                "consumer of %s: a commit had no answer in %.0f s (no group coordinator); polling goes on, "
                "and its offsets go with the next commit",
                self.group,
                COMMIT_WAIT_S,
            )

    def seek(self, topic: str, partition: int, offset: int) -> bool:
        # Called between polls (kafka-python's consumer is not thread-safe, and poll runs in a
        # thread); records fetched earlier from the old position are discarded by its fetcher.
        tp = TopicPartition(self.backend.physical(topic), partition)
        if tp not in self._consumer.assignment():
            return False
        self._consumer.seek(tp, offset)
        return True
