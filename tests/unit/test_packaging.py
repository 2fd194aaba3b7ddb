"""What the installed package needs beside its code, and the optional parts' errors."""

from __future__ import annotations

import importlib.metadata
import sys
import tomllib

import pytest
from typer.testing import CliRunner

from cli.main import app
from log import local_kafka, urls
from log.embedded import user_cache_dir

pytestmark = pytest.mark.unit


def test_logctl_version_is_the_package_version() -> None:
    done = CliRunner().invoke(app, ["--version"])
    assert done.exit_code == 0
    assert done.output.strip() == f"logctl (agentlog) {importlib.metadata.version('agentlog')}"


def test_the_broker_files_ship_inside_the_package_and_jars_go_to_the_user_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    assert local_kafka.POM_FILE.is_file() and local_kafka.LOG4J_CONFIG.is_file()
    package_data = tomllib.loads((local_kafka.BROKER_FILES.parents[1] / "pyproject.toml").read_text())["tool"][
        "setuptools"
    ]["package-data"]["log"]
    assert {"broker/pom.xml", "broker/log4j2.properties"} <= set(package_data)
    assert local_kafka.DEFAULT_CACHE_DIR.parent == user_cache_dir()
    monkeypatch.setenv("AGENTLOG_CACHE_DIR", str(tmp_path))
    assert str(user_cache_dir()) == str(tmp_path)


def test_the_librdkafka_client_missing_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(urls.ENV_KAFKA_CLIENT, raising=False)  # the default client
    monkeypatch.delitem(sys.modules, "log.rdkafka_backend", raising=False)
    monkeypatch.setitem(sys.modules, "confluent_kafka", None)  # as if it had been uninstalled
    with pytest.raises(ValueError, match=r"pip install confluent-kafka \(or AGENTLOG_KAFKA_CLIENT=python"):
        urls.kafka_backend("127.0.0.1:1")


def test_kafka_logs_default_to_librdkafka_and_kafka_python_is_one_setting_away(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from log.kafka_backend import KafkaBackend
    from log.rdkafka_backend import RdKafkaBackend

    monkeypatch.delenv(urls.ENV_KAFKA_CLIENT, raising=False)
    assert isinstance(urls.kafka_backend("127.0.0.1:1"), RdKafkaBackend)
    monkeypatch.setenv(urls.ENV_KAFKA_CLIENT, "python")
    assert isinstance(urls.kafka_backend("127.0.0.1:1"), KafkaBackend)
