"""Every worker of ``logctl up --metrics-port`` serves /metrics and /health, with the numbers the
log holds after a run; a worker whose metrics port is taken stops with one line."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.common import ensure_topics
from cli.main import app
from tests.logctl_up import logctl_up

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = {
    "steps": [
        {"llm": {"prompt_tokens": 64, "output_tokens": 4}},
        {"tool": "sleep", "arguments": {"seconds": 1}},
        {"llm": {"prompt_tokens": 16, "output_tokens": 4}},
    ]
}
WORKERS = ("decider", "executor", "planner-0", "engine-bridge", "cache-manager")


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive ports that are free now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + n > 65535:
            continue
        sockets = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one series in Prometheus' text format (None: not exposed)."""
    for line in text.splitlines():
        if not line.startswith(name + ("{" if labels else " ")):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if found == labels:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_every_worker_serves_what_the_log_holds(pg_url: str, namespace: str, tmp_path: Path) -> None:
    env = {**os.environ, "AGENTLOG_NAMESPACE": namespace, "AGENTLOG_LEDGER_URL": pg_url}
    env.pop("AGENTLOG_METRICS_PORT", None)
    ensure_topics(pg_url, namespace=namespace)
    base = free_ports(len(WORKERS))
    flags = ["--time-scale", "0.05", "--work-dir", str(tmp_path), "--cache-manager", "--gpu-blocks", "256",
             "--host-blocks", "64", "--metrics-port", str(base)]  # fmt: skip
    with logctl_up(pg_url, *flags, env=env) as stack:
        urls = {line.split()[0]: m.group(1) for line in stack.started
                if (m := re.search(r"metrics (http://\S+)/metrics", line)) is not None}  # fmt: skip
        assert set(urls) == set(WORKERS), urls  # the engine is not a worker: it has /stats

        ran = CliRunner().invoke(
            app,
            ["run", "script", "--log-url", pg_url, "-n", "3", "--args", json.dumps(STEPS), "--json"],
            env={"AGENTLOG_NAMESPACE": namespace},
        )
        assert ran.exit_code == 0, ran.output
        assert json.loads(ran.output.strip().splitlines()[-1])["finished"] == 3

        # What each process read and wrote, as the log holds it. The decisions and the lag may
        # trail the sessions by a poll or a lag round, so wait for the log's numbers to show.
        def scrape(name: str) -> str:
            status, text = get(urls[name] + "/metrics")
            assert status == 200
            return text

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            planner, executor, cache = scrape("planner-0"), scrape("executor"), scrape("cache-manager")
            if (
                sample(planner, "agentlog_sessions", status="finished") == 3
                and sample(executor, "agentlog_tool_calls_total", outcome="completed") == 3
                and (sample(cache, "agentlog_cache_decisions_total", action="PRESERVE") or 0) >= 3
                and sample(planner, "agentlog_consumer_lag", topic="agent.actions", partition="0") is not None
            ):
                break
            time.sleep(0.5)
        assert sample(planner, "agentlog_sessions", status="finished") == 3
        assert sample(planner, "agentlog_llm_calls_total") == 6
        assert (sample(planner, "agentlog_events_appended_total", topic="agent.actions") or 0) >= 3 * 6
        assert (sample(planner, "agentlog_append_seconds_count", topic="agent.actions") or 0) > 0
        assert sample(executor, "agentlog_tool_calls_total", outcome="completed") == 3
        assert sample(executor, "agentlog_tool_calls_in_doubt") == 0
        assert (sample(cache, "agentlog_cache_decisions_total", action="PRESERVE") or 0) >= 3
        assert (sample(cache, "agentlog_events_appended_total", topic="kv.decisions") or 0) >= 3
        assert sample(planner, "agentlog_consumer_lag", topic="agent.actions", partition="0") is not None
        for name, url in urls.items():
            status, body = get(url + "/health")
            assert status == 200, (name, body)
            health = json.loads(body)
            assert health["status"] == "live" and health["role"] == name.split("-0")[0], health


def test_a_worker_whose_metrics_port_is_taken_stops_with_one_line(pg_url: str, namespace: str) -> None:
    env = {**os.environ, "AGENTLOG_NAMESPACE": namespace, "AGENTLOG_LOG_URL": pg_url}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "workers.decider", "--metrics-port", str(port)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"python -m workers.decider: error: metrics port 127.0.0.1:{port} is already in use:"
        " choose another with --metrics-port"
    ), done.stderr
    assert "Traceback" not in done.stderr

    bad = subprocess.run(
        [sys.executable, "-m", "workers.decider", "--metrics-port", "nine"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "'nine' is not a port number" in bad.stderr and "Traceback" not in bad.stderr
