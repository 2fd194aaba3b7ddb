"""log.rdkafka_backend: what a librdkafka member's poll makes of the errors librdkafka hands it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from confluent_kafka import KafkaError

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
