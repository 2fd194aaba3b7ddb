"""What both Kafka clients' backends share: names, topic settings, the partition count check."""

from __future__ import annotations

import pytest

from log import topics
from log.errors import BackendUnavailable
from log.kafka_backend import DLQ_RETENTION_MS, KafkaCluster, one_partition_count, topic_configs
from log.rdkafka_backend import rdkafka_config

pytestmark = pytest.mark.unit


def test_a_namespace_prefixes_topics_and_is_taken_off_again() -> None:
    cluster = KafkaCluster("b:9092", namespace="ns")
    assert cluster.physical("agent.actions") == "ns.agent.actions"
    assert cluster.logical("ns.agent.actions") == "agent.actions"
    plain = KafkaCluster("b:9092")
    assert plain.physical("agent.actions") == plain.logical("agent.actions") == "agent.actions"


def test_the_log_is_kept_forever_and_the_dead_letters_a_week() -> None:
    assert topic_configs(topics.topic("agent.actions")) == {"cleanup.policy": "delete", "retention.ms": "-1"}
    assert topic_configs(topics.topic("agent.dlq"))["retention.ms"] == str(DLQ_RETENTION_MS)


def test_every_topic_must_exist_with_the_same_partition_count() -> None:
    assert one_partition_count({"agent.actions": 4, "agent.effects": 4}) == 4
    with pytest.raises(BackendUnavailable, match=r"topic agent.effects does not exist: run `logctl init`"):
        one_partition_count({"agent.actions": 4, "agent.effects": 0})
    with pytest.raises(BackendUnavailable, match=r"not co-partitioned \(partition counts \[2, 4\]\)"):
        one_partition_count({"agent.actions": 4, "agent.effects": 2})


def test_kafka_python_setting_names_become_librdkafka_properties() -> None:
    config = {"security_protocol": "SASL_PLAINTEXT", "sasl_plain_password": "p", "socket.keepalive.enable": True}
    assert rdkafka_config(config) == {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.password": "p",
        "socket.keepalive.enable": True,
    }
    with pytest.raises(ValueError, match="no librdkafka equivalent known for .* 'max_poll_records'"):
        rdkafka_config({"max_poll_records": 10})


@pytest.mark.parametrize("client", ["python", "rdkafka"])
def test_a_role_may_set_the_producer_linger_and_others_keep_the_default(
    client: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from log import backend_for
    from workers.gateway import GatewayWorker
    from workers.worker import Worker

    monkeypatch.setenv("AGENTLOG_KAFKA_CLIENT", client)
    assert GatewayWorker.linger_ms == 0  # one record per request, and a client waits for it
    assert Worker.linger_ms is None
    gateway = backend_for("kafka://b:9092", linger_ms=GatewayWorker.linger_ms)
    default = backend_for("kafka://b:9092", linger_ms=Worker.linger_ms)
    assert (gateway.linger_ms, default.linger_ms) == (0, 2)  # type: ignore[attr-defined]
    assert backend_for("memory:linger", linger_ms=0) is not None  # other backends take no linger
