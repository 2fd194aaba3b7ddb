"""logctl init and tail against real servers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient
from typer.testing import CliRunner

from cli.main import app
from log import open_log
from schemas.events import SessionStarted

pytestmark = pytest.mark.integration


def test_init_creates_topics_with_infinite_retention_on_kafka(
    kafka_bootstrap: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTLOG_NAMESPACE", namespace)
    result = CliRunner().invoke(app, ["init", "--log-url", f"kafka://{kafka_bootstrap}", "--partitions", "3", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["topics"]["agent.actions"] == 0
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        for topic, retention in [("agent.actions", "-1"), ("kv.decisions", "-1"), ("agent.dlq", "604800000")]:
            name = f"{namespace}.{topic}"
            (described,) = admin.describe_topics([name])
            assert len(described["partitions"]) == 3
            configs = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, name, None)])["topic"][name]
            assert configs["retention.ms"]["value"] == retention
            assert configs["cleanup.policy"]["value"] == "delete"
    finally:
        admin.close()
    # Idempotent: a second init changes nothing.
    again = CliRunner().invoke(app, ["init", "--log-url", f"kafka://{kafka_bootstrap}", "--partitions", "3"])
    assert again.exit_code == 0, again.output


def test_tail_shows_events_readably_and_as_json(pg_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTLOG_NAMESPACE", namespace)
    assert CliRunner().invoke(app, ["init", "--log-url", pg_url]).exit_code == 0

    async def write() -> None:
        async with open_log(pg_url, actor="planner") as log:
            await log.append("s-tail", SessionStarted(program="trace", args_json="{}"))

    asyncio.run(write())
    table = CliRunner().invoke(app, ["tail", "--log-url", pg_url, "--from-beginning", "--limit", "1"])
    assert table.exit_code == 0, table.output
    assert "agent.actions" in table.output and "SessionStarted" in table.output and "program=trace" in table.output
    lines = CliRunner().invoke(app, ["tail", "--log-url", pg_url, "--from-beginning", "--limit", "1", "--json"])
    record = json.loads(lines.output.splitlines()[0])
    assert record["type"] == "SessionStarted" and record["session_id"] == "s-tail" and record["seq"] == 0


def test_init_secure_creates_the_acls(secure_kafka: Any, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from log.acls import admin_client, missing_acls

    for key, value in secure_kafka.credentials.env("admin").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AGENTLOG_NAMESPACE", namespace)
    url = f"kafka://{secure_kafka.bootstrap}"
    result = CliRunner().invoke(app, ["init", "--log-url", url, "--secure", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["secure"] is True
    admin = admin_client(secure_kafka.bootstrap, secure_kafka.credentials.client_configs("admin"))
    try:
        assert missing_acls(admin, namespace) == []
    finally:
        admin.close()
    # Without admin rights, --secure is refused by the broker.
    for key, value in secure_kafka.credentials.env("planner").items():
        monkeypatch.setenv(key, value)
    refused = CliRunner().invoke(app, ["init", "--log-url", url, "--secure"])
    assert refused.exit_code != 0
