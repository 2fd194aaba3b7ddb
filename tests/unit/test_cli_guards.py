"""logctl refuses what it must refuse before it touches anything."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cli.main import app

pytestmark = pytest.mark.unit


def test_up_on_kafka_is_secure_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTLOG_KAFKA_CREDENTIALS", raising=False)
    result = CliRunner().invoke(app, ["up", "--log-url", "kafka://127.0.0.1:1"])
    assert result.exit_code == 2
    assert "secure by default" in result.output.replace("\n", " ").replace("│", "")


def test_approve_takes_one_decision() -> None:
    result = CliRunner().invoke(
        app, ["approve", "s", "tool-1", "--deny", "--retry", "--log-url", "kafka://127.0.0.1:1"]
    )
    assert result.exit_code == 2 and "choose one" in result.output


def test_run_refuses_an_unknown_program() -> None:
    result = CliRunner().invoke(app, ["run", "nope", "--log-url", "kafka://127.0.0.1:1", "--no-wait"])
    assert result.exit_code == 2 and "unknown program" in result.output
