"""docker-compose.yml agrees with the project's defaults (no Docker needed to check that)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from log.topics import DEFAULT_PARTITIONS
from log.urls import COMPOSE_KAFKA_URL, COMPOSE_PG_URL

pytestmark = pytest.mark.unit

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data["services"]  # type: ignore[no-any-return]


def host_ports(service: dict[str, Any]) -> dict[int, int]:
    """host port -> container port."""
    out = {}
    for mapping in service["ports"]:
        host, container = str(mapping).split(":")[-2:]
        out[int(host)] = int(container)
    return out


def test_kafka_is_the_pinned_kraft_single_node(services: dict[str, Any]) -> None:
    kafka = services["kafka"]
    env = kafka["environment"]
    assert kafka["image"] == "apache/kafka:4.1.1"
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false", "topics come from logctl init only"
    assert int(env["KAFKA_NUM_PARTITIONS"]) == DEFAULT_PARTITIONS
    for key in ("KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR", "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"):
        assert int(env[key]) == 1, f"{key} must be 1 on a single broker, or groups/idempotence hang"
    assert "healthcheck" in kafka


def test_kafka_port_matches_the_default_url(services: dict[str, Any]) -> None:
    url = urlsplit(COMPOSE_KAFKA_URL.replace("kafka://", "http://"))
    kafka = services["kafka"]
    ports = host_ports(kafka)
    assert url.port in ports
    advertised = kafka["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    assert f"//{url.hostname}:{url.port}" in advertised
    listener = next(part for part in advertised.split(",") if f":{url.port}" in part).split(":")[0]
    assert f"{listener}://:{ports[url.port]}" in kafka["environment"]["KAFKA_LISTENERS"]


def test_postgres_matches_the_default_url(services: dict[str, Any]) -> None:
    url = urlsplit(COMPOSE_PG_URL)
    postgres = services["postgres"]
    env = postgres["environment"]
    assert url.port in host_ports(postgres) and host_ports(postgres)[url.port] == 5432
    assert (env["POSTGRES_USER"], env["POSTGRES_PASSWORD"], env["POSTGRES_DB"]) == (
        url.username,
        url.password,
        url.path.lstrip("/"),
    )
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])


def test_secure_kafka_enforces_the_roles(services: dict[str, Any]) -> None:
    from log.acls import PRINCIPALS

    secure = services["kafka-secure"]
    env = secure["environment"]
    assert secure["profiles"] == ["secure"] and secure["image"] == "apache/kafka:4.1.1"
    assert env["KAFKA_AUTHORIZER_CLASS_NAME"] == "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
    assert env["KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND"] == "false" and env["KAFKA_SUPER_USERS"] == "User:admin"
    assert set(env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(",")) == {
        "CLIENT:SASL_PLAINTEXT",
        "CONTROLLER:SASL_PLAINTEXT",
    }
    jaas = env["KAFKA_LISTENER_NAME_CLIENT_PLAIN_SASL_JAAS_CONFIG"]
    for principal in PRINCIPALS:  # every principal of log/acls.py can log in, with a password from the environment
        variable = "AGENTLOG_PASSWORD_" + principal.upper().replace("-", "_")
        assert f'user_{principal}="${{{variable}}}"' in jaas
