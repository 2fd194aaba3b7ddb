"""log.rdkafka_backend: what a librdkafka member's poll makes of the errors librdkafka hands it."""

from __future__ import annotations

import asyncio
import json
import logging
import time
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


class Made(Consumer):
    """A consumer as ``join`` makes it: its settings (the statistics callback among them)."""

    def __init__(self, **config: Any) -> None:
        super().__init__()
        self.config = config

    def subscribe(self, topics: list[str], *, on_assign: Any, on_revoke: Any) -> None:
        pass


def stats(state: str, state_age_s: float) -> str:
    return json.dumps({"ts": 10**6, "brokers": {}, "cgrp": {"state": state, "stateage": int(state_age_s * 1000)}})


def test_a_member_says_when_it_has_been_without_a_coordinator_for_long(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """librdkafka 2.16 can leave a member looking for its coordinator for good, its connections
    idle (docs/reliability.md): one without a coordinator for 30 s warns (then once a minute)
    instead of going silent."""
    made: list[Made] = []
    backend = RdKafkaBackend("127.0.0.1:1")
    monkeypatch.setattr(backend, "_consumer", lambda **config: made.append(Made(**config)) or made[-1])
    subscription = RdKafkaSubscription(backend, "decider", ["agent.actions"], from_beginning=True)
    subscription.join()
    (consumer,) = made
    report = consumer.config["stats_cb"]
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])

    def warnings_after_poll() -> int:
        asyncio.run(subscription.poll(0.1, 10))
        return sum("no group coordinator" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="agentlog.rdkafka"):
        report(stats("query-coord", 12.0))  # a broker restart's worth: it may still find it
        assert warnings_after_poll() == 0
        report(stats("query-coord", 52.0))  # as the stuck member reported itself
        assert warnings_after_poll() == 1
        clock[0] += 30
        assert warnings_after_poll() == 1  # once a minute
        clock[0] += 31
        assert warnings_after_poll() == 2
        report(stats("up", 1.0))
        assert warnings_after_poll() == 2
        report(stats("query-coord", 31.0))  # lost again: said at once
        assert warnings_after_poll() == 3
    assert "no group coordinator for 31 s" in caplog.records[-1].getMessage()
