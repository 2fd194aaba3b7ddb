"""``logctl analyze`` on real logs: what ``logctl demo`` ran, on the Postgres log and on Kafka.

The demo and the analysis are separate processes, as a user runs them; the analysis must
agree with the demo's own summary (both read the log back) and its numbers must add up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

CHECKOUT = Path(__file__).resolve().parents[2]


def _logctl(args: list[str], env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        cwd=CHECKOUT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _env(namespace: str, tmp_path: Path) -> dict[str, str]:
    # The embedded server's data directory is not needed (a URL is given), but the demo's runs are.
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    return {**os.environ, "AGENTLOG_NAMESPACE": namespace, "AGENTLOG_DATA_DIR": str(data)}


def _demo_then_analyze(url: str, env: dict[str, str], tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    demo = _logctl(["demo", "--log-url", url, "--sessions", "3", "--arrival-rate", "2", "--json"], env)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    summary = json.loads(demo.stdout.strip().splitlines()[-1])["summary"]
    done = _logctl(["analyze", "--log-url", url, "--json", "--png", str(tmp_path / "plots")], env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return summary, json.loads(done.stdout)


def _check(summary: dict[str, Any], report: dict[str, Any], tmp_path: Path) -> None:
    assert summary["finished"] == 3
    assert (report["sessions"], report["unfinished"]) == (3, 0)
    assert report["llm_calls"] == summary["llm_calls"] and report["tool_gaps"] == summary["tool_calls"]
    assert report["prompt_tokens"] == summary["prompt_tokens"] and report["cached_tokens"] == summary["cached_tokens"]
    assert report["job_s"] == pytest.approx(summary["mean_job_s"] * 3)  # the same job time, read the same way
    assert {t["tool"] for t in report["tools"]} == {"trace_tool"}
    # The parts of job time add up, and every share is a share.
    assert report["llm_s"] + report["gap_s"] + report["other_s"] == pytest.approx(report["job_s"])
    assert 0 < report["gap_share"] < 1 and 0 <= report["queue_share"] < 1
    assert report["oracle_upper_s"] == pytest.approx(report["oracle_saved_s"] + report["queue_s"])
    assert report["hit_rate"] <= report["oracle_hit_rate"] <= 1
    assert sum(u["calls"] for u in report["turns"]) == report["llm_calls"]
    assert report["verdict"]["answer"] in ("worth it", "marginal", "not worth it")
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "hits_per_turn.png",
        "job_time.png",
        "tool_gaps.png",
    ]


def test_analyze_a_demo_run_on_the_postgres_log(pg_url: str, namespace: str, tmp_path: Path) -> None:
    env = _env(namespace, tmp_path)
    summary, report = _demo_then_analyze(pg_url, env, tmp_path)
    _check(summary, report, tmp_path)


def test_analyze_a_demo_run_on_kafka(kafka_bootstrap: str, namespace: str, tmp_path: Path) -> None:
    env = _env(namespace, tmp_path)
    summary, report = _demo_then_analyze(f"kafka://{kafka_bootstrap}", env, tmp_path)
    _check(summary, report, tmp_path)


def test_an_empty_log_is_one_line_and_a_non_zero_exit(pg_url: str, namespace: str, tmp_path: Path) -> None:
    env = _env(namespace, tmp_path)
    assert _logctl(["init", "--log-url", pg_url], env).returncode == 0
    done = _logctl(["analyze", "--log-url", pg_url], env)
    assert done.returncode == 1
    assert done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("logctl: no sessions in the log postgresql://")
    assert line.endswith(": nothing to analyze (logctl demo or logctl run makes some)")
