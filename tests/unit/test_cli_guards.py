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


def _said(output: str) -> str:
    return " ".join(output.replace("│", "").split())


def test_up_console_needs_the_projector_and_a_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTLOG_CONSOLE_PASSWORD", raising=False)
    monkeypatch.delenv("AGENTLOG_CONSOLE_AUDITOR_PASSWORD", raising=False)
    url = "postgresql://nobody@127.0.0.1:1/x"
    alone = CliRunner().invoke(app, ["up", "--log-url", url, "--console"])
    assert alone.exit_code == 2 and "pass --projector too" in _said(alone.output)
    no_password = CliRunner().invoke(app, ["up", "--log-url", url, "--projector", "--console"])
    assert no_password.exit_code == 2 and "AGENTLOG_CONSOLE_PASSWORD" in _said(no_password.output)


def test_up_projector_needs_a_postgres_for_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("AGENTLOG_READ_MODEL_URL", "AGENTLOG_PG_URL", "AGENTLOG_LOG_URL"):
        monkeypatch.delenv(variable, raising=False)
    result = CliRunner().invoke(app, ["up", "--log-url", "kafka://127.0.0.1:1", "--insecure", "--projector"])
    assert result.exit_code == 2 and "AGENTLOG_READ_MODEL_URL" in _said(result.output)


def test_ui_without_a_password_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTLOG_CONSOLE_PASSWORD", raising=False)
    monkeypatch.delenv("AGENTLOG_CONSOLE_AUDITOR_PASSWORD", raising=False)
    result = CliRunner().invoke(app, ["ui", "--log-url", "kafka://127.0.0.1:1"])
    assert result.exit_code != 0 and "no anonymous access" in _said(result.output)
    assert "Traceback" not in result.output


def test_the_console_logs_in_as_the_operator() -> None:
    from cli.stack import _principal

    assert _principal("console") == "operator" and _principal("projector") == "projector"


def test_pin_model_takes_small_large_or_none() -> None:
    result = CliRunner().invoke(app, ["pin-model", "s", "huge", "--log-url", "kafka://127.0.0.1:1"])
    assert result.exit_code == 2 and "size must be small, large or none, got 'huge'" in _said(result.output)


def test_up_engine_sizes_name_at_most_one_size_per_engine() -> None:
    url = "postgresql://nobody@127.0.0.1:1/x"
    bad = CliRunner().invoke(app, ["up", "--log-url", url, "--engines", "2", "--engine-sizes", "large,tiny"])
    assert bad.exit_code == 2 and "--engine-sizes" in _said(bad.output)
    more = CliRunner().invoke(app, ["up", "--log-url", url, "--engine-sizes", "large,small"])
    assert more.exit_code == 2 and "at most 1" in _said(more.output)
