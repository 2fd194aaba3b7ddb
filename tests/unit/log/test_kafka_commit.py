"""log.kafka_backend: a kafka-python member's commit the group does not answer returns after
``COMMIT_WAIT_S`` and its offsets go with the next commit (only those of partitions still assigned).

kafka-python bounds a commit by its request timeout (305 s), then raises into the caller: a worker
waiting there polls nothing meanwhile. The consumer here answers or times out as the test says; the
real broker's side is tests/integration/test_kafka_membership.py.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from kafka.errors import KafkaTimeoutError
from kafka.structs import TopicPartition

from log.kafka_backend import COMMIT_WAIT_S, KafkaBackend, KafkaSubscription

pytestmark = pytest.mark.unit

TOPIC = "agent.actions"


class Consumer:
    """Assigned partitions 0 and 1 of the namespaced topic; a commit times out while ``answering`` is False."""

    def __init__(self) -> None:
        self.partitions = {0, 1}
        self.answering = True
        self.asked: list[tuple[dict[int, int], int]] = []  # partition -> offset, and the timeout, per commit

    def assignment(self) -> set[TopicPartition]:
        return {TopicPartition(f"ns.{TOPIC}", p) for p in self.partitions}

    def commit(self, offsets: dict[Any, Any], timeout_ms: int) -> None:
        self.asked.append(({tp.partition: meta.offset for tp, meta in offsets.items()}, timeout_ms))
        if not self.answering:
            raise KafkaTimeoutError("Timeout attempting to commit offsets")


def member() -> tuple[KafkaSubscription, Consumer]:
    subscription = KafkaSubscription(KafkaBackend("localhost:1", namespace="ns"), "g", [TOPIC], from_beginning=True)
    consumer = Consumer()
    subscription._consumer = consumer
    return subscription, consumer


def test_an_unanswered_commit_returns_and_its_offsets_go_with_the_next(caplog: pytest.LogCaptureFixture) -> None:
    subscription, consumer = member()

    async def scenario() -> None:
        await subscription.commit({(TOPIC, 0): 4})
        assert consumer.asked == [({0: 4}, int(COMMIT_WAIT_S * 1000))]  # bounded, not kafka-python's 305 s
        consumer.answering = False
        with caplog.at_level(logging.WARNING, logger="log.kafka_backend"):
            await subscription.commit({(TOPIC, 0): 7, (TOPIC, 1): 2})
        assert "a commit had no answer in 10 s" in caplog.text and "go with the next commit" in caplog.text
        await subscription.commit({(TOPIC, 0): 9})  # unanswered too: the newer offset wins, the rest held
        assert consumer.asked[-1][0] == {0: 9, 1: 2}
        consumer.answering = True
        consumer.partitions = {0}  # partition 1 moved to another member: its new owner commits it
        await subscription.commit({})
        assert consumer.asked[-1][0] == {0: 9}
        asked = len(consumer.asked)
        await subscription.commit({})  # nothing held any more: nothing asked
        assert len(consumer.asked) == asked

    asyncio.run(scenario())


def test_a_commit_of_partitions_no_longer_assigned_asks_nothing() -> None:
    subscription, consumer = member()
    consumer.partitions = set()
    asyncio.run(subscription.commit({(TOPIC, 0): 4}))
    assert consumer.asked == []
