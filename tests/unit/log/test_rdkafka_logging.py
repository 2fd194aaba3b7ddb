"""log.rdkafka_backend.RepeatsSuppressed: librdkafka's repeated lines, held back and counted."""

from __future__ import annotations

import logging
import time

import pytest
from confluent_kafka import Producer

from log.rdkafka_backend import RepeatsSuppressed

pytestmark = pytest.mark.unit

REFUSED = "[thrd:127.0.0.1:1/bootstrap]: 127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def line(text: str, client: str = "rdkafka#consumer-1", facility: str = "FAIL") -> logging.LogRecord:
    """A record as confluent-kafka logs one of librdkafka's lines."""
    args = (facility, client, text)
    return logging.LogRecord("agentlog.rdkafka", logging.ERROR, __file__, 1, "%s [%s] %s", args, None)


def test_a_repeated_line_passes_once_a_window_and_then_says_how_many_were_held_back() -> None:
    clock = Clock()
    repeats = RepeatsSuppressed(window_s=10.0, clock=clock)
    assert repeats.filter(line(f"{REFUSED} (after 0ms in state CONNECT)"))
    held = []
    for i in range(25):
        clock.now += 0.1
        held.append(repeats.filter(line(f"{REFUSED} (after {i}ms in state CONNECT, 3 identical error(s) suppressed)")))
    assert not any(held)  # the tail that varies does not make a line new
    clock.now += 10.0
    record = line(f"{REFUSED} (after 0ms in state CONNECT)")
    assert repeats.filter(record)
    assert record.getMessage().endswith("(and 25 like it since the last one shown)")
    clock.now += 10.0
    record = line(f"{REFUSED} (after 0ms in state CONNECT)")
    assert repeats.filter(record)
    assert "like it" not in record.getMessage()  # none held back since


def test_other_clients_facilities_and_texts_pass_and_our_own_lines_are_untouched() -> None:
    repeats = RepeatsSuppressed(window_s=10.0, clock=Clock())
    assert repeats.filter(line(REFUSED))
    assert repeats.filter(line(REFUSED, client="rdkafka#producer-2"))
    assert repeats.filter(line(REFUSED, facility="ERROR"))
    assert repeats.filter(line("[thrd:main]: 1/1 brokers are down"))
    own = logging.LogRecord("agentlog.rdkafka", logging.INFO, __file__, 1, "connected to %s", ("x",), None)
    for _ in range(3):
        assert repeats.filter(own)


def test_a_real_client_without_a_broker_logs_each_failure_once() -> None:
    """librdkafka itself, with nothing listening at its bootstrap address: every line it logs
    in two seconds of retrying is a first of its kind."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger("agentlog.rdkafka.test-repeats")
    logger.propagate = False
    logger.addHandler(Collect())
    logger.addFilter(RepeatsSuppressed())
    producer = Producer({"bootstrap.servers": "127.0.0.1:1", "logger": logger, "reconnect.backoff.max.ms": 100})
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        producer.poll(0.1)
    assert seen, "librdkafka logged nothing: the test no longer shows anything"
    texts = [RepeatsSuppressed._TAIL.sub("", s) for s in seen]
    assert len(texts) == len(set(texts)), seen
