"""logctl at its edges, on the real Postgres log (and an unreachable Kafka): every failure is one
line on stderr with a non-zero exit, nothing is appended for a session that does not exist,
``--json`` is strict JSON, and no password of a log URL ever shows in any output.

The commands run as real ``python -m cli.main`` processes, so everything they print (their own
lines, a library's log lines, a traceback) is in what the tests read.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from typing import Any

import pytest

from cli.common import ensure_topics
from log import open_log
from schemas import events as ev

pytestmark = pytest.mark.integration

PASSWORD = "hunter2-edges-" + uuid.uuid4().hex[:6]
UNREACHABLE_PG = f"postgresql://agentlog:{PASSWORD}@127.0.0.1:1/agentlog"
BAD_URL = f"mysql://agentlog:{PASSWORD}@127.0.0.1/agentlog"


def logctl(*argv: str, namespace: str = "", timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTLOG_LOG_URL")}
    if namespace:
        env["AGENTLOG_NAMESPACE"] = namespace
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *argv], env=env, capture_output=True, text=True, timeout=timeout_s
    )


def one_line_failure(result: subprocess.CompletedProcess[str], code: int | None = None) -> str:
    """The single ``logctl: ...`` line a failed command printed (and nothing else)."""
    assert result.returncode != 0, result
    if code is not None:
        assert result.returncode == code, result
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("logctl: "), lines
    return lines[0]


async def _ops_records(url: str, namespace: str) -> int:
    async with open_log(url, actor="auditor", namespace=namespace) as log:
        return sum((await log.end_offsets("ops.commands")).values())


async def _request(url: str, namespace: str, session_id: str) -> None:
    async with open_log(url, actor="operator", namespace=namespace) as log:
        await log.append(session_id, ev.SessionRequested(program="script", args_json='{"steps": []}', author="t"))


def test_operator_commands_refuse_a_session_that_does_not_exist(pg_url: str, namespace: str) -> None:
    ensure_topics(pg_url, namespace=namespace)
    asyncio.run(_request(pg_url, namespace, "real-session"))
    before = asyncio.run(_ops_records(pg_url, namespace))
    for argv in (
        ["approve", "ghost", "tool-1"],
        ["approve", "ghost", "tool-1", "--retry"],
        ["deny", "ghost", "tool-1"],
        ["cancel", "ghost"],
    ):
        line = one_line_failure(logctl(*argv, "--log-url", pg_url, namespace=namespace), 1)
        assert "no session 'ghost' in the log" in line and "nothing was appended" in line
    assert asyncio.run(_ops_records(pg_url, namespace)) == before, "a refused command appended something"
    listed = logctl("sessions", "--log-url", pg_url, "--json", namespace=namespace)
    assert [s["session_id"] for s in json.loads(listed.stdout)] == ["real-session"]
    # A session that is in the log still takes them.
    done = logctl("cancel", "real-session", "--log-url", pg_url, namespace=namespace)
    assert done.returncode == 0 and "cancel requested for real-session" in done.stdout, done
    assert asyncio.run(_ops_records(pg_url, namespace)) == before + 1


def _strict(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_run_that_times_out_exits_2_and_its_json_is_strict(pg_url: str, namespace: str) -> None:
    ensure_topics(pg_url, namespace=namespace)
    # No planner runs: the sessions are requested and never finish.
    result = logctl("run", "script", "-n", "2", "--args", '{"steps": []}', "--timeout", "1", "--json",
                    "--log-url", pg_url, namespace=namespace)  # fmt: skip
    assert result.returncode == 2, result
    summary = _strict(result.stdout.strip().splitlines()[-1])
    assert summary["sessions"] == 2 and summary["finished"] == 0
    assert summary["mean_job_s"] is None and summary["p95_job_s"] is None  # no job finished: no mean
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("logctl: 2 of 2 sessions did not finish within 1 s"), line


def test_bad_log_url_is_one_line_without_its_password() -> None:
    line = one_line_failure(logctl("sessions", "--log-url", BAD_URL), 2)
    assert "unsupported log URL" in line and "mysql://agentlog:***@127.0.0.1" in line


@pytest.mark.slow
def test_unreachable_kafka_is_one_line() -> None:
    # kafka-python gives up bootstrapping after its bootstrap_timeout_ms (30 s); no logctl option shortens it.
    line = one_line_failure(logctl("sessions", "--log-url", "kafka://127.0.0.1:1"), 1)
    assert "cannot reach Kafka at 127.0.0.1:1" in line and "check --log-url" in line


ERROR_PATHS = [
    ["init"],
    ["init", "--json"],
    ["sessions"],
    ["sessions", "--json"],
    ["tail", "--limit", "1"],
    ["tail", "--limit", "1", "--json"],
    ["run", "script", "--args", '{"steps": []}', "--no-wait"],
    ["run", "script", "--args", '{"steps": []}', "--json"],
    ["run", "script", "--args", "[1]"],
    ["replay", "some-session"],
    ["approve", "some-session", "tool-1"],
    ["cancel", "some-session"],
    ["checkpoint", "some-session", "--json"],
    ["state", "some-session", "--json"],
    ["verify", "--json"],
    ["audit", "--json"],
]


@pytest.mark.parametrize("url", [UNREACHABLE_PG, BAD_URL], ids=["unreachable-postgres", "unsupported-url"])
def test_no_error_path_shows_the_password_of_the_log_url(url: str) -> None:
    for argv in ERROR_PATHS:
        result = logctl(*argv, "--log-url", url)
        everything = result.stdout + result.stderr
        assert PASSWORD not in everything, (argv, everything)
        one_line_failure(result)
