"""log.rdkafka_backend: what a librdkafka member's poll makes of the errors librdkafka hands it."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from confluent_kafka import KafkaError

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

    def close(self) -> None:
        pass


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


class Made(Consumer):
    """A consumer as ``join`` makes it: its settings (the statistics callback) and the rebalance
    callbacks it subscribed with, kept to be called as librdkafka would."""

    def __init__(self, **config: Any) -> None:
        super().__init__()
        self.config = config
        self.closed = threading.Event()
        self.on_assign: Any = None
        self.on_revoke: Any = None

    def subscribe(self, topics: list[str], *, on_assign: Any, on_revoke: Any) -> None:
        self.on_assign, self.on_revoke = on_assign, on_revoke

    def close(self) -> None:
        self.closed.set()


def stats(state: str, state_age_s: float) -> str:
    return json.dumps({"ts": 10**6, "brokers": {}, "cgrp": {"state": state, "stateage": int(state_age_s * 1000)}})


def test_a_member_stuck_without_its_coordinator_joins_again_with_a_new_consumer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """librdkafka 2.16 can stay in ``query-coord`` for good after broker pauses; the poll sees it
    in the statistics and replaces the consumer. The stuck one is closed on a thread of its own
    (its close may wait for the coordinator), and its callbacks, run as it closes, change nothing."""
    made: list[Made] = []
    backend = RdKafkaBackend("127.0.0.1:1")
    monkeypatch.setattr(backend, "_consumer", lambda **config: made.append(Made(**config)) or made[-1])
    subscription = RdKafkaSubscription(backend, "decider", ["agent.actions"], from_beginning=True)
    subscription.join()
    stuck = made[0]
    stuck.config["stats_cb"](stats("up", 1.0))
    subscription._assigned = frozenset({("agent.actions", 0), ("agent.actions", 1)})
    subscription._assigned_at = 1.0
    assert asyncio.run(subscription.poll(0.1, 10)) == [] and subscription.rejoins == 0

    stuck.config["stats_cb"](stats("query-coord", 52.0))  # as a stuck member reported itself
    assert asyncio.run(subscription.poll(0.1, 10)) == []
    assert subscription.rejoins == 1 and len(made) == 2 and subscription._consumer is made[1]
    assert stuck.closed.wait(5), "the stuck consumer is closed"
    assert subscription.membership() is Membership.LOST and subscription.assignment() == set()
    physical = backend.physical("agent.actions")
    assert subscription._held == {(physical, 0), (physical, 1)}  # taken back from their committed offsets

    stuck.config["stats_cb"](stats("query-coord", 99.0))  # the old one, closing: ignored
    stuck.on_revoke(stuck, [])
    assert subscription._word is None and subscription._held == {(physical, 0), (physical, 1)}
    made[1].config["stats_cb"](stats("query-coord", 2.0))  # the new one looking for its coordinator
    assert subscription._word is not None and subscription._word.state_age_s == 2.0
    assert asyncio.run(subscription.poll(0.1, 10)) == [] and subscription.rejoins == 1
