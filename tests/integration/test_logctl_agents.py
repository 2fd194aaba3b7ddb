"""logctl run, sessions, replay --check and graceful shutdown, with real workers on Postgres."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.common import ensure_topics
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
    ensure_topics(pg_url)
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


def test_approve_and_deny_decide_held_payments_and_name_their_author(
    pg_url: str, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTLOG_NAMESPACE", namespace)
    ensure_topics(pg_url)
    pay = {"steps": [{"tool": "payment", "arguments": {"account": "acme", "amount_cents": 100}}]}
    runner = CliRunner()
    with Stack(pg_url, tmp_path, extra_env={"AGENTLOG_LEDGER_URL": pg_url}):
        started = runner.invoke(
            app,
            [
                "run",
                "script",
                "--log-url",
                pg_url,
                "-n",
                "2",
                "--args",
                json.dumps(pay),
                "--prefix",
                "held",
                "--no-wait",
            ],
        )
        assert started.exit_code == 0, started.output
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            rows = {
                r["session_id"]: r
                for r in json.loads(runner.invoke(app, ["sessions", "--log-url", pg_url, "--json"]).output)
            }
            if all(rows.get(f"held-{i:04d}", {}).get("tool_calls") == 1 for i in range(2)):
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"the held tool calls were never proposed: {rows}")
        ok = runner.invoke(
            app, ["approve", "held-0000", "tool-0", "--log-url", pg_url, "--author", "ana", "--reason", "fine"]
        )
        no = runner.invoke(
            app, ["deny", "held-0001", "tool-0", "--log-url", pg_url, "--author", "bo", "--reason", "no"]
        )
        assert ok.exit_code == 0 and no.exit_code == 0, (ok.output, no.output)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            audit = json.loads(runner.invoke(app, ["audit", "--log-url", pg_url, "--json"]).output)
            by_session = {r["session_id"]: r for r in audit}
            if {by_session.get(f"held-{i:04d}", {}).get("status") for i in range(2)} == {"completed", "aborted"}:
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"the verdicts never took effect: {audit}")
    assert by_session["held-0000"]["status"] == "completed"
    assert by_session["held-0000"]["approvals"] == [{"author": "ana", "decision": "APPROVE", "reason": "fine"}]
    assert (
        by_session["held-0001"]["status"] == "aborted" and "denied by bo" in by_session["held-0001"]["verdict_reason"]
    )
