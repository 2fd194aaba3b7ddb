"""A kafka-python group member knows its topics' partitions before it first joins its group.

kafka-python joins a group with the metadata it holds at the first poll. Right after
``subscribe()`` that is the bootstrap's, without the topics: the leader assigns nothing,
and the rejoin the next metadata update asks for sometimes never completes on a busy
machine (the member stops heartbeating and is never assigned a partition, with no error).
That is how a watcher in tests/e2e/test_recovery.py once saw no event in 150 s. The
member must therefore hold the topics' partitions before its first poll.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from cli.common import ensure_topics
from log.kafka_backend import KafkaBackend, KafkaSubscription
from log.topics import AGENT_ACTIONS, AGENT_EFFECTS, AGENT_VERDICTS, OPS_COMMANDS

pytestmark = pytest.mark.integration

TOPICS = [AGENT_ACTIONS.name, AGENT_VERDICTS.name, AGENT_EFFECTS.name, OPS_COMMANDS.name]


def test_a_member_holds_every_topics_partitions_before_its_first_join(kafka_bootstrap: str, namespace: str) -> None:
    ensure_topics(f"kafka://{kafka_bootstrap}", namespace=namespace)

    async def scenario() -> None:
        backend = KafkaBackend(kafka_bootstrap, namespace=namespace)
        await backend.start()
        try:
            num_partitions = await backend.num_partitions()
            subscription = await backend.subscribe(f"join-{uuid.uuid4().hex[:6]}", TOPICS, from_beginning=True)
            assert isinstance(subscription, KafkaSubscription)
            try:
                # What the first poll's JoinGroup will assign from (no poll has run yet).
                cluster = subscription._consumer._cluster
                known = {t: cluster.partitions_for_topic(backend.physical(t)) for t in TOPICS}
                assert known == {t: set(range(num_partitions)) for t in TOPICS}
                # And the first join then assigns them all.
                for _ in range(100):
                    await subscription.poll(0.3, 10)
                    if subscription.assignment():
                        break
                assert subscription.assignment() == {(t, p) for t in TOPICS for p in range(num_partitions)}
            finally:
                await subscription.close()
        finally:
            await backend.close()

    asyncio.run(scenario())
