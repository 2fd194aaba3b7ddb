"""log.rdkafka_backend: what a librdkafka member's poll makes of the errors librdkafka hands it."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from log.backend import Membership
from log.errors import BackendUnavailable
from log.rdkafka_backend import RdKafkaBackend, RdKafkaSubscription

pytestmark = pytest.mark.unit


class ErrorEvent:
    """What librdkafka's poll returns for an error: a message whose ``error()`` is set."""

    def __init__(self, error: KafkaError) -> None:
        self._error = error

    def error(self) -> KafkaError:
        return self._error


class Consumer:
    """Hands out the given events once, then nothing."""

    def __init__(self, *events: Any) -> None:
        self.events = list(events)

    def poll(self, timeout: float) -> Any:
        return self.events.pop(0) if self.events else None

    def consume(self, num_messages: int, timeout: float) -> list[Any]:
        taken, self.events = self.events[:num_messages], self.events[num_messages:]
        return taken


def member(*events: Any) -> RdKafkaSubscription:
    subscription = RdKafkaSubscription(RdKafkaBackend("127.0.0.1:1"), "decider", ["agent.actions"], from_beginning=True)
    subscription._consumer = Consumer(*events)
    return subscription


def test_a_fatal_consumer_error_fails_the_poll_even_when_it_is_not_flagged_fatal() -> None:
    # As librdkafka reported a static member fenced by another with its group.instance.id.
    fenced = KafkaError(KafkaError._FATAL, "Fatal error: Broker: Static consumer fenced", fatal=False)
    with pytest.raises(BackendUnavailable, match="consumer of decider failed: _FATAL: Fatal error"):
        asyncio.run(member(ErrorEvent(fenced)).poll(0.1, 10))


def test_a_transient_error_is_logged_and_the_poll_goes_on() -> None:
    down = KafkaError(KafkaError._TRANSPORT, "broker down")
    assert asyncio.run(member(ErrorEvent(down)).poll(0.1, 10)) == []


def test_records_around_a_transient_error_are_handed_out_in_order_under_their_logical_topic() -> None:
    down = KafkaError(KafkaError._TRANSPORT, "broker down")
    subscription = RdKafkaSubscription(
        RdKafkaBackend("127.0.0.1:1", namespace="ns"), "decider", ["agent.actions"], from_beginning=True
    )
    for events in (
        [Message("ns.agent.actions", 0, 5), Message("ns.agent.actions", 1, 7)],  # no error: the common path
        [Message("ns.agent.actions", 0, 5), ErrorEvent(down), Message("ns.agent.actions", 1, 7)],
    ):
        subscription._consumer = Consumer(*events)
        records = asyncio.run(subscription.poll(0.1, 10))
        assert [r.position for r in records] == [("agent.actions", 0, 5), ("agent.actions", 1, 7)]
        assert [r.value for r in records] == [b"ns.agent.actions[0]@5", b"ns.agent.actions[1]@7"]


class Made(Consumer):
    """A consumer as ``join`` makes it: its settings (the statistics callback among them), its
    rebalance callbacks, whether it was closed."""

    def __init__(self, **config: Any) -> None:
        super().__init__()
        self.config = config
        self.closed = False
        self.callbacks: dict[str, Any] = {}

    def subscribe(self, topics: list[str], *, on_assign: Any, on_revoke: Any) -> None:
        self.callbacks = {"assign": on_assign, "revoke": on_revoke}

    def assign(self, partitions: list[Any]) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def stats(state: str, state_age_s: float) -> str:
    return json.dumps({"ts": 10**6, "brokers": {}, "cgrp": {"state": state, "stateage": int(state_age_s * 1000)}})


class Backend(RdKafkaBackend):
    """Makes ``Made`` consumers; the cluster answers a probe as ``answers`` says."""

    def __init__(self) -> None:
        super().__init__("127.0.0.1:1")
        self.made: list[Made] = []
        self.answers = True
        self.probes = 0

    def _consumer(self, **config: Any) -> Made:
        self.made.append(Made(**config))
        return self.made[-1]

    def cluster_answers(self, timeout_s: float = 5.0) -> bool:
        self.probes += 1
        return self.answers


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    return now


def test_a_member_librdkafka_left_without_brokers_joins_again_with_a_new_consumer(clock: list[float]) -> None:
    """librdkafka 2.16 drops every broker it knew when a broker back from a pause answers with
    none (its issue #5301), and never looks again (docs/reliability.md). A member without a
    coordinator for 20 s while a new client reaches the cluster joins again: the stuck consumer
    closed, its partitions given up, its callbacks no longer the member's."""
    backend = Backend()
    subscription = RdKafkaSubscription(backend, "decider", ["agent.actions"], from_beginning=True)
    subscription.join()
    (stuck,) = backend.made
    stuck.callbacks["assign"](stuck, [TopicPartition("agent.actions", 2)])
    assert subscription.assignment() == {("agent.actions", 2)}

    report = stuck.config["stats_cb"]
    report(stats("query-coord", 12.0))  # a broker restart's worth: it may still find it
    asyncio.run(subscription.poll(0.1, 10))
    assert (len(backend.made), backend.probes) == (1, 0)
    report(stats("query-coord", 21.0))
    asyncio.run(subscription.poll(0.1, 10))
    assert (len(backend.made), backend.probes, subscription.rejoins) == (2, 1, 1)
    assert stuck.closed and not backend.made[1].closed
    assert subscription.assignment() == set()
    assert subscription.membership() is Membership.LOST

    # The stuck consumer's reports and rebalances, as it closes, are not the member's.
    report(stats("query-coord", 60.0))
    stuck.callbacks["assign"](stuck, [TopicPartition("agent.actions", 0)])
    assert subscription.assignment() == set()
    asyncio.run(subscription.poll(0.1, 10))
    assert (len(backend.made), subscription.rejoins) == (2, 1)
    # The new one's are.
    fresh = backend.made[1]
    fresh.callbacks["assign"](fresh, [TopicPartition("agent.actions", 2)])
    assert subscription.assignment() == {("agent.actions", 2)}


def test_a_member_whose_cluster_is_down_waits_for_it_and_says_so(
    clock: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    """While a new client cannot reach the cluster either, the broker is down: the member keeps
    its consumer, asks again every 10 s, and warns after 30 s (then once a minute)."""
    backend = Backend()
    backend.answers = False
    subscription = RdKafkaSubscription(backend, "decider", ["agent.actions"], from_beginning=True)
    subscription.join()
    report = backend.made[0].config["stats_cb"]

    def poll() -> tuple[int, int]:
        asyncio.run(subscription.poll(0.1, 10))
        return backend.probes, sum("no group coordinator" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="agentlog.rdkafka"):
        report(stats("query-coord", 21.0))
        assert poll() == (1, 0)
        clock[0] += 5
        assert poll() == (1, 0)  # asked 5 s ago
        report(stats("query-coord", 31.0))
        clock[0] += 5
        assert poll() == (2, 1)
        clock[0] += 30
        assert poll() == (3, 1)  # a warning a minute
        clock[0] += 31
        assert poll() == (4, 2)
        report(stats("up", 1.0))
        clock[0] += 31
        assert poll() == (4, 2)
        report(stats("query-coord", 31.0))  # lost again: said at once
        assert poll() == (5, 3)
    assert "no group coordinator for 31 s; the cluster does not answer" in caplog.records[-1].getMessage()
    assert len(backend.made) == 1 and subscription.rejoins == 0


class Scanner:
    """A scanner whose reads of a partition's end fail as ``fails`` says."""

    def __init__(self, fails: bool) -> None:
        self.fails = fails
        self.closed = False

    def get_watermark_offsets(self, partition: Any, timeout: float) -> tuple[int, int]:
        if self.fails:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "no broker"))
        return 0, 7

    def close(self) -> None:
        self.closed = True


def test_a_scanner_whose_read_failed_is_closed_not_pooled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client librdkafka left without brokers stays so (ORPHANED_AFTER_S): pooled again, it
    would fail every later read; a new one bootstraps afresh."""
    monkeypatch.setattr("log.rdkafka_backend._TIMEOUT_S", 0.0)  # no retries of the transient error
    backend = RdKafkaBackend("127.0.0.1:1")
    backend._num_partitions = 1
    healthy, failing = Scanner(fails=False), Scanner(fails=True)
    backend._scanners = [healthy]
    assert asyncio.run(backend.end_offsets("agent.actions")) == {0: 7}
    assert backend._scanners == [healthy] and not healthy.closed
    backend._scanners = [failing]
    with pytest.raises(BackendUnavailable, match="cannot read the end of agent.actions"):
        asyncio.run(backend.end_offsets("agent.actions"))
    assert backend._scanners == [] and failing.closed


class Message:
    def __init__(self, topic: str, partition: int, offset: int) -> None:
        self._topic, self._partition, self._offset = topic, partition, offset

    def error(self) -> None:
        return None

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes:
        return b"s"

    def value(self) -> bytes:
        return f"{self._topic}[{self._partition}]@{self._offset}".encode()


class PartitionScanner(Scanner):
    """Reads partition 0 of agent.actions (offsets 0-6), with a record of partition 1 at offset 9
    handed out first."""

    def __init__(self) -> None:
        super().__init__(fails=False)
        self.batches = [[Message("agent.actions", 1, 9), Message("agent.actions", 0, 0)]]
        self.batches += [[Message("agent.actions", 0, n)] for n in range(1, 7)]

    def assign(self, partitions: list[Any]) -> None:
        pass

    def unassign(self) -> None:
        pass

    def consume(self, num_messages: int, timeout: float) -> list[Any]:
        return self.batches.pop(0) if self.batches else []


def test_a_scan_hands_out_only_its_partition_and_reads_it_to_the_end(caplog: pytest.LogCaptureFixture) -> None:
    """A record of another partition neither comes out nor ends the scan at its offset: a chain
    rebuilt from a scan cut short would repeat seqs."""
    backend = RdKafkaBackend("127.0.0.1:1")
    backend._scanners = [PartitionScanner()]

    async def scan() -> list[bytes | None]:
        return [record.value async for record in backend.scan("agent.actions", 0)]

    with caplog.at_level(logging.WARNING, logger="log.rdkafka_backend"):
        values = asyncio.run(scan())
    assert values == [f"agent.actions[0]@{n}".encode() for n in range(7)]
    assert "scan of agent.actions[0] got a record of agent.actions[1]: skipped" in caplog.text
