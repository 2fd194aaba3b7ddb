"""logctl run, sessions, replay --check and graceful shutdown, with real workers on Postgres."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.agents import _ensure_topics
from cli.main import app
from cli.stack import Stack

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = {
    "steps": [
        {"llm": {"prompt_tokens": 64, "output_tokens": 8}},
        {"tool": "echo", "arguments": {"text": "hello"}},
        {"llm": {"prompt_tokens": 16, "output_tokens": 4}},
    ]
}


def test_run_sessions_replay_and_a_clean_stop(
    pg_url: str, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTLOG_NAMESPACE", namespace)
    _ensure_topics(pg_url)
    runner = CliRunner()
    stack = Stack(pg_url, tmp_path, time_scale=0.1).start()
    try:
        ran = runner.invoke(
            app,
            ["run", "script", "--log-url", pg_url, "-n", "3", "--args", json.dumps(STEPS), "--prefix", "cli", "--json"],
        )
        assert ran.exit_code == 0, ran.output
        summary = json.loads(ran.output.strip().splitlines()[-1])
        assert summary["finished"] == 3 and summary["llm_calls"] == 6 and summary["tool_calls"] == 3
        # The second call of each session extends the first one's context: its prefix is cached.
        assert summary["cached_tokens"] > 0

        listed = runner.invoke(app, ["sessions", "--log-url", pg_url, "--json"])
        rows = {row["session_id"]: row for row in json.loads(listed.output)}
        assert {rows[f"cli-{i:04d}"]["status"] for i in range(3)} == {"finished"}

        table = runner.invoke(app, ["sessions", "--log-url", pg_url])
        assert "cli-0000" in table.output and "finished" in table.output

        replay = runner.invoke(app, ["replay", "cli-0001", "--log-url", pg_url, "--check"])
        assert replay.exit_code == 0, replay.output
        assert "ToolCallCommitted" in replay.output and "deterministic, matches the log" in replay.output
    finally:
        codes = stack.stop()
    # SIGTERM: every worker drained and exited cleanly (the engine too).
    assert codes == {"decider": 0, "executor": 0, "planner-0": 0, "engine": 0}, codes
