"""workers.metrics over HTTP on loopback: /metrics in the Prometheus format, /health, a taken port."""

from __future__ import annotations

import asyncio
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from schemas import events as ev
from workers.metrics import MetricsPortInUse, WorkerMetrics

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_and_health_over_http() -> None:
    async def main() -> None:
        metrics = WorkerMetrics("planner")
        port = await metrics.serve("127.0.0.1", 0)
        try:
            metrics.consumed("ops.commands", "s", ev.SessionRequested(program="p", args_json="{}", author="me"), 1.0)
            metrics.appended("agent.actions", [("s", ev.SessionStarted(program="p", args_json="{}"), 2.0)], 0.004)
            metrics.lag("agent.actions", 3, 17)
            status, text = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/metrics")
            assert status == 200
            assert 'agentlog_events_consumed_total{topic="ops.commands"} 1.0' in text
            assert 'agentlog_events_appended_total{topic="agent.actions"} 1.0' in text
            assert 'agentlog_consumer_lag{partition="3",topic="agent.actions"} 17.0' in text
            assert 'agentlog_sessions{status="running"} 1.0' in text
            assert 'agentlog_append_seconds_bucket{le="0.005",topic="agent.actions"} 1.0' in text
            status, text = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/health")
            assert status == 503 and '"status": "starting"' in text
            metrics.set_health(True, status="live")
            status, text = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/health")
            assert status == 200 and '"role": "planner"' in text and '"status": "live"' in text
        finally:
            await metrics.close()

    asyncio.run(main())


def test_a_taken_port_is_one_clear_error() -> None:
    async def main() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with pytest.raises(MetricsPortInUse, match=f"metrics port 127.0.0.1:{port} is already in use"):
                await WorkerMetrics("decider").serve("127.0.0.1", port)

    asyncio.run(main())


def test_every_metric_is_documented() -> None:
    metrics = WorkerMetrics("planner")
    names = {m.name for m in metrics.registry.collect()}
    documented = set(re.findall(r"^\| `(agentlog_[a-z_]+)`", DOC.read_text(), re.M))
    exposed = {n + ("_total" if m.type == "counter" else "") for m in metrics.registry.collect() for n in [m.name]}
    assert names and exposed == documented, (exposed - documented, documented - exposed)
