"""The topic table: every body type has exactly one topic, every topic one owner."""

from __future__ import annotations

import pytest

from log import topics
from log.errors import UnknownTopic
from log.partitioner import partition_for
from schemas import events

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("model", events.EVENT_TYPES, ids=lambda m: m.__name__)
def test_each_body_type_belongs_on_exactly_one_topic(model: type[events.Model]) -> None:
    assert sum(model in t.bodies for t in topics.TOPICS) == 1


def test_owners_match_the_design() -> None:
    assert {t.name: t.owner for t in topics.TOPICS} == {
        "agent.actions": "planner",
        "agent.verdicts": "decider",
        "agent.effects": "executor",
        "kv.events": "engine-bridge",
        "kv.decisions": "cache-manager",
        "ops.commands": "operator",
        "agent.gateway": "gateway",
        "agent.dlq": "*",
    }


def test_a_topic_cannot_be_owned_by_a_read_only_actor() -> None:
    # ChainVerifier.verify lets a record of the topic's owner pass without asking allows_actor.
    with pytest.raises(ValueError, match="writes nothing"):
        topics.Topic("x", "auditor", (events.SessionStarted,))


def test_unknown_topic_names_the_known_ones() -> None:
    with pytest.raises(UnknownTopic, match="agent.actions"):
        topics.topic("agent.action")


def test_partitioner_spreads_sessions() -> None:
    # Agreement with a real producer's partitioner is checked in tests/integration/test_plain_consumer.py.
    assert partition_for("", 1) == 0
    assert {partition_for(f"session-{i}", 4) for i in range(100)} == {0, 1, 2, 3}
