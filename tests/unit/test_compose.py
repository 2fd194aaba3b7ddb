"""docker-compose.yml agrees with the project's code and defaults (no Docker needed to check that)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from log import topics as topic_table
from log.acls import BY_PRINCIPAL, PRINCIPALS
from log.topics import DEFAULT_PARTITIONS
from log.urls import COMPOSE_KAFKA_URL, COMPOSE_PG_URL

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
ROLES = {
    "engine", "planner", "decider", "executor", "cache-manager", "engine-bridge", "gateway", "projector", "console",
    "logctl",
}  # fmt: skip


def password_variable(principal: str) -> str:
    return "AGENTLOG_PASSWORD_" + principal.upper().replace("-", "_")


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data["services"]  # type: ignore[no-any-return]


def agentlog_services(services: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services that run the project's image as a Kafka principal."""
    return {
        name: s
        for name, s in services.items()
        if s["image"].startswith("${AGENTLOG_IMAGE") and "AGENTLOG_KAFKA_USERNAME" in s.get("environment", {})
    }


def test_kafka_is_the_pinned_kraft_single_node(services: dict[str, Any]) -> None:
    kafka = services["kafka"]
    env = kafka["environment"]
    assert kafka["image"] == "${AGENTLOG_KAFKA_IMAGE:-apache/kafka:4.1.1}"
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false", "topics come from logctl init only"
    assert int(env["KAFKA_NUM_PARTITIONS"]) == DEFAULT_PARTITIONS
    for key in ("KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR", "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"):
        assert int(env[key]) == 1, f"{key} must be 1 on a single broker, or groups/idempotence hang"
    assert "healthcheck" in kafka


def test_kafka_is_secure_by_default_with_every_principal(services: dict[str, Any]) -> None:
    env = services["kafka"]["environment"]
    assert "profiles" not in services["kafka"]
    assert env["KAFKA_AUTHORIZER_CLASS_NAME"] == "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
    assert env["KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND"] == "false" and env["KAFKA_SUPER_USERS"] == "User:admin"
    protocols = dict(p.split(":") for p in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    assert set(protocols.values()) == {"SASL_PLAINTEXT"}, "no plaintext listener in the default stack"
    for listener in protocols:
        jaas = env[f"KAFKA_LISTENER_NAME_{listener}_PLAIN_SASL_JAAS_CONFIG"]
        for principal in ("admin",) if listener == "CONTROLLER" else PRINCIPALS:
            # every password is a mandatory variable: a missing one stops compose, never an empty login
            assert re.search(rf'user_{principal}="\$\{{{password_variable(principal)}:\?[^}}]+\}}"', jaas), principal


def test_kafka_port_matches_the_default_url(services: dict[str, Any]) -> None:
    url = urlsplit(COMPOSE_KAFKA_URL.replace("kafka://", "http://"))
    env = services["kafka"]["environment"]
    port = f"${{AGENTLOG_KAFKA_PORT:-{url.port}}}"
    assert services["kafka"]["ports"] == [f"{port}:{port}"]
    assert f"HOST://{url.hostname}:{port}" in env["KAFKA_ADVERTISED_LISTENERS"]
    assert f"HOST://:{port}" in env["KAFKA_LISTENERS"]


def test_postgres_matches_the_default_url_and_its_password_is_a_variable(services: dict[str, Any]) -> None:
    url = urlsplit(COMPOSE_PG_URL)
    postgres = services["postgres"]
    env = postgres["environment"]
    assert postgres["ports"] == [f"${{AGENTLOG_POSTGRES_PORT:-{url.port}}}:5432"]
    assert (env["POSTGRES_USER"], env["POSTGRES_DB"]) == (url.username, url.path.lstrip("/"))
    assert env["POSTGRES_PASSWORD"].startswith("${AGENTLOG_POSTGRES_PASSWORD:?")
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])


def test_each_process_is_its_own_principal_and_writes_only_its_topic(services: dict[str, Any]) -> None:
    processes = agentlog_services(services)
    expected = {
        "init": "admin",
        "planner": "planner",
        "decider": "decider",
        "executor": "executor",
        "cache-manager": "cache-manager",
        "engine-bridge": "engine-bridge",
        "engine-bridge-1": "engine-bridge",
        "vllm-bridge": "engine-bridge",
        "gateway": "gateway",
        "projector": "projector",
        "console": "operator",
        "logctl": "operator",
    }
    assert {name: s["environment"]["AGENTLOG_KAFKA_USERNAME"] for name, s in processes.items()} == expected
    for name, s in processes.items():
        principal = s["environment"]["AGENTLOG_KAFKA_USERNAME"]
        assert s["environment"]["AGENTLOG_KAFKA_PASSWORD"].startswith(f"${{{password_variable(principal)}:?"), name
        if principal in BY_PRINCIPAL and name not in ("logctl", "console", "projector"):
            owned = [t.name for t in topic_table.TOPICS if t.owner == principal]
            assert len(owned) == 1, f"{principal} owns {owned}"


def test_workers_restart_and_wait_for_init_and_their_dependencies(services: dict[str, Any]) -> None:
    for name in ("planner", "decider", "executor", "cache-manager", "engine-bridge", "projector", "console"):
        s = services[name]
        assert s["restart"] == "unless-stopped", name
        assert s["depends_on"]["init"] == {"condition": "service_completed_successfully"}, name
        assert s["depends_on"]["postgres"] == {"condition": "service_healthy"}, name
        assert s["command"][0] in ROLES, f"{name}: {s['command'][0]} is not a role of docker/entrypoint.sh"
    for name in ("planner", "engine-bridge"):
        assert services[name]["depends_on"]["engine"] == {"condition": "service_healthy"}
    assert services["init"]["restart"] == "no" and services["init"]["command"][:2] == ["logctl", "init"]
    assert "--secure" in services["init"]["command"]
    assert "healthcheck" in services["engine"]


def test_the_entrypoint_knows_every_role_the_file_uses(services: dict[str, Any]) -> None:
    entrypoint = (ROOT / "docker" / "entrypoint.sh").read_text()
    for role in ROLES:
        assert re.search(rf"^\s+{re.escape(role)}\)", entrypoint, re.M), role


def test_compose_env_writes_every_password_the_file_needs() -> None:
    needed = set(re.findall(r"\$\{(AGENTLOG_[A-Z_]+(?:PASSWORD|TOKEN)[A-Z_]*)", COMPOSE.read_text()))
    script = (ROOT / "scripts" / "compose_env.sh").read_text()
    principals = set(re.search(r"for principal in ([A-Z_ ]+);", script).group(1).split())  # type: ignore[union-attr]
    written = {f"AGENTLOG_PASSWORD_{p}" for p in principals} | {
        "AGENTLOG_POSTGRES_PASSWORD",
        "AGENTLOG_VLLM_CONTROL_TOKEN",
        "AGENTLOG_GRAFANA_PASSWORD",
        "AGENTLOG_CONSOLE_PASSWORD",
        "AGENTLOG_CONSOLE_AUDITOR_PASSWORD",
    }
    assert needed <= written
    assert {password_variable(p) for p in PRINCIPALS} <= written


def test_prometheus_scrapes_every_process_that_serves_metrics(services: dict[str, Any]) -> None:
    config = yaml.safe_load((ROOT / "docker" / "observability" / "prometheus.yml").read_text())
    targets = set(config["scrape_configs"][0]["static_configs"][0]["targets"])
    serving = {
        f"{name}:{s['environment']['AGENTLOG_METRICS_PORT']}"
        for name, s in services.items()
        if "AGENTLOG_METRICS_PORT" in s.get("environment", {})
        and "profiles" not in s
        and name not in ("init", "console")  # the console is no worker: its /health is its own
    }
    assert serving and targets == serving


def test_the_dashboard_queries_only_documented_metrics() -> None:
    import json

    dashboard = json.loads((ROOT / "docker" / "observability" / "grafana" / "dashboards" / "agentlog.json").read_text())
    documented = set(re.findall(r"^\| `(agentlog_[a-z_]+)`", (ROOT / "docs" / "metrics.md").read_text(), re.M))
    used = {
        name.removesuffix("_bucket")
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"agentlog_[a-z_]+", target["expr"])
    }
    assert used and used <= documented, used - documented


def test_the_projector_and_the_console_run_in_the_stack(services: dict[str, Any]) -> None:
    projector, console = services["projector"], services["console"]
    assert projector["command"] == ["projector"] and "healthcheck" in projector  # the worker's /health
    assert console["depends_on"]["projector"] == {"condition": "service_healthy"}
    assert "8300/health" in " ".join(console["healthcheck"]["test"])
    assert console["command"][:1] == ["console"] and "8300" in console["command"]
    for variable in ("AGENTLOG_CONSOLE_PASSWORD", "AGENTLOG_CONSOLE_AUDITOR_PASSWORD", "AGENTLOG_CONSOLE_SECRET"):
        assert console["environment"][variable].startswith(f"${{{variable}:?"), "from .env, never in the file"


def test_a_second_engine_and_its_bridge_run_under_the_engines_profile(services: dict[str, Any]) -> None:
    from workers.engines.pool import parse_engines

    engine, bridge = services["engine-1"], services["engine-bridge-1"]
    assert engine["profiles"] == bridge["profiles"] == ["engines"]
    assert "profiles" not in services["engine"] and "profiles" not in services["engine-bridge"]
    assert engine["command"][0] == "engine" and "healthcheck" in engine
    assert engine["volumes"] != services["engine"]["volumes"], "each engine keeps its own record of served requests"
    assert bridge["depends_on"]["engine-1"] == {"condition": "service_healthy"}
    assert bridge["restart"] == "unless-stopped"

    def option(command: list[str], name: str) -> str:
        return command[command.index(name) + 1]

    assert option(engine["command"], "--engine-id") == option(bridge["command"], "--engine-id") == "sim-1"
    assert option(bridge["command"], "--engine-url") == "http://engine-1:8100"
    # The planner, the cache manager and the gateway take the engines from AGENTLOG_ENGINES (empty: one
    # engine); the example the file documents names each engine as its bridge does, at its service's URL.
    for name in ("planner", "cache-manager", "gateway"):
        assert services[name]["environment"]["AGENTLOG_ENGINES"] == "${AGENTLOG_ENGINES:-}", name
    example = re.search(r'"(sim-0=[^"]+)"', COMPOSE.read_text()).group(1)  # type: ignore[union-attr]
    specs = parse_engines(example)
    bridges = {option(services[b]["command"], "--engine-id"): option(services[b]["command"], "--engine-url")
               for b in ("engine-bridge", "engine-bridge-1")}  # fmt: skip
    assert {s.engine_id: s.url for s in specs} == bridges
    assert [s.size for s in specs] == ["large", "small"]
