"""A secure Kafka broker (SASL/PLAIN + StandardAuthorizer) of the integration tests' own.

Not ``KAFKA_BOOTSTRAP_SERVERS``: that broker is plaintext, and these tests need to
know every principal's password. Started once per session from the same Maven jars
as ``log.local_kafka``'s plaintext broker (a few seconds, ~0.5 GiB of heap).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from log.local_kafka import KafkaCredentials, LocalKafkaBroker


@dataclass(frozen=True)
class SecureKafka:
    """A running secure broker: where it listens and how each principal logs in."""

    bootstrap: str
    credentials: KafkaCredentials
    broker: LocalKafkaBroker


@pytest.fixture(scope="session")
def secure_kafka() -> Iterator[SecureKafka]:
    with LocalKafkaBroker(secure=True) as broker:
        yield SecureKafka(broker.bootstrap_servers, broker.credentials, broker)
