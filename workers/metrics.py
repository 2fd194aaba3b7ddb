"""Prometheus metrics and a health endpoint for a long-running process.

``WorkerMetrics(role)`` owns a registry of its own: the log-level series a worker feeds
(``consumed``, ``appended``, ``lag``) and, read at scrape time from ``services.observed``,
what the events it saw say (sessions, LLM and tool calls, verdicts waiting, in-doubt calls,
cache decisions, KV hit rate, blocks pinned, dead letters). ``serve(host, port)`` answers

- ``GET /metrics``: the Prometheus text format;
- ``GET /health``: ``{"role", "status", "uptime_s", ...}``, 200 while the process reports
  itself healthy (``set_health``), else 503, so compose and Kubernetes can probe it.

Every metric is documented in docs/metrics.md (name, type, labels); a test checks that page
against this registry. Port 0 picks a free port; a port already in use is one clear error.
"""

from __future__ import annotations

import errno
import json
import time
from collections.abc import Iterable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from log.types import LoggedEvent
from services.observed import Observed

PREFIX = "agentlog"
METRICS_PORT_ENV = "AGENTLOG_METRICS_PORT"
APPEND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class MetricsPortInUse(OSError):
    """The metrics port is taken by another process."""


class WorkerMetrics:
    """The metrics of one process (see the module docstring)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.registry = CollectorRegistry(auto_describe=True)
        self.observed = Observed()
        self.reads: frozenset[str] = frozenset()
        """The topics the process consumes (``Worker.run`` sets them): see ``appended``."""
        self.started = time.time()
        self._health: dict[str, Any] = {"status": "starting"}
        self._healthy = False
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        r = self.registry
        self.consumed_total = Counter(
            f"{PREFIX}_events_consumed", "Events read from the log and decoded.", ["topic"], registry=r
        )
        self.appended_total = Counter(
            f"{PREFIX}_events_appended", "Events this process appended.", ["topic"], registry=r
        )
        self.append_seconds = Histogram(
            f"{PREFIX}_append_seconds",
            "Seconds from an append call until its records were durable.",
            ["topic"],
            buckets=APPEND_BUCKETS,
            registry=r,
        )
        self.consumer_lag = Gauge(
            f"{PREFIX}_consumer_lag",
            "Records between this process's position and the end of a partition it owns.",
            ["topic", "partition"],
            registry=r,
        )
        r.register(_ObservedCollector(self.observed))

    # -- what the worker feeds --------------------------------------------------------------

    def consumed(self, topic: str, session_id: str, body: BaseModel, at: float) -> None:
        self.consumed_total.labels(topic).inc()
        self.observed.observe(topic, session_id, body, at)

    def consumed_events(self, events: Iterable[LoggedEvent]) -> None:
        """One poll's events (``Worker.run`` calls this). The counters move once per topic and
        poll: a labelled counter's lookup costs more than the rest of the fold of an event."""
        per_topic: dict[str, int] = {}
        observe = self.observed.observe_at
        for event in events:
            envelope = event.envelope
            topic = event.position.topic
            per_topic[topic] = per_topic.get(topic, 0) + 1
            observe(topic, envelope.session_id, envelope.body, envelope.occurred_at)
        for topic, n in per_topic.items():
            self.consumed_total.labels(topic).inc(n)

    def appended(self, topic: str, events: Iterable[tuple[str, BaseModel, float]], seconds: float) -> None:
        """``events``: (session id, body, occurred_at seconds) of one durable append call.

        An event on a topic the process also reads comes back through its consumer, and is
        observed then (once, and again after a restart's replay, as the log holds it); only
        the others are observed here."""
        n = 0
        observe = topic not in self.reads
        for session_id, body, at in events:
            if observe:
                self.observed.observe(topic, session_id, body, at)
            n += 1
        if n:
            self.appended_total.labels(topic).inc(n)
            self.append_seconds.labels(topic).observe(seconds)

    def lag(self, topic: str, partition: int, records: int) -> None:
        self.consumer_lag.labels(topic, str(partition)).set(records)

    @property
    def healthy(self) -> bool:
        return self._healthy

    def set_health(self, healthy: bool, **details: Any) -> None:
        """What ``/health`` answers (``status`` and anything else worth showing)."""
        self._healthy = healthy
        self._health = details

    # -- serving ----------------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def health(self) -> tuple[int, dict[str, Any]]:
        body = {"role": self.role, **self._health, "uptime_s": round(time.time() - self.started, 3)}
        return (200 if self._healthy else 503), body

    async def serve(self, host: str = "0.0.0.0", port: int = 0) -> int:
        """Start answering ``/metrics`` and ``/health``; returns the port."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics_handler)
        app.router.add_get("/health", self._health_handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            if e.errno == errno.EADDRINUSE:
                raise MetricsPortInUse(
                    e.errno, f"metrics port {host}:{port} is already in use: choose another with --metrics-port"
                ) from None
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        return self.port

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics_handler(self, request: web.Request) -> web.Response:
        response = web.Response(body=self.render())
        response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return response

    async def _health_handler(self, request: web.Request) -> web.Response:
        status, body = self.health()
        return web.Response(status=status, text=json.dumps(body), content_type="application/json")


class _ObservedCollector:
    """Reads ``Observed`` at scrape time (the per-event cost stays a few dict operations)."""

    def __init__(self, observed: Observed) -> None:
        self.observed = observed

    def describe(self) -> list[Metric]:
        return list(self._metrics(0.0))

    def collect(self) -> Iterator[Metric]:
        yield from self._metrics(time.time())

    def _metrics(self, now: float) -> Iterator[Metric]:
        o = self.observed
        sessions = GaugeMetricFamily(f"{PREFIX}_sessions", "Sessions seen, by their latest status.", labels=["status"])
        for status in ("requested", "running", "finished", "failed"):
            sessions.add_metric([status], o.sessions_by_status().get(status, 0))
        yield sessions
        yield CounterMetricFamily(f"{PREFIX}_llm_calls", "LLM calls completed.", value=o.llm_calls)
        tokens = CounterMetricFamily(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of completed LLM calls.", labels=["source"]
        )
        tokens.add_metric(["computed"], o.prompt_tokens - o.cached_tokens)
        tokens.add_metric(["cached"], o.cached_tokens)
        yield tokens
        yield GaugeMetricFamily(
            f"{PREFIX}_kv_hit_rate",
            "Prompt tokens served from the KV cache over all prompt tokens.",
            value=o.hit_rate(),
        )
        engine = CounterMetricFamily(
            f"{PREFIX}_engine_seconds", "Engine time of completed LLM calls, by phase.", labels=["phase"]
        )
        for phase, ms in o.engine_ms.items():
            engine.add_metric([phase], ms / 1000)
        yield engine
        tools = CounterMetricFamily(f"{PREFIX}_tool_calls", "Tool call outcomes seen.", labels=["outcome"])
        for outcome in ("committed", "aborted", "completed", "failed", "in_doubt"):
            tools.add_metric([outcome], o.tool_calls.get(outcome, 0))
        yield tools
        for name, (count, age), doc in (
            ("awaiting_verdict", o.awaiting_verdict(now), "Tool calls proposed and not yet committed or aborted"),
            ("in_doubt", o.in_doubt(now), "Tool calls in doubt, not yet resolved by an operator"),
        ):
            yield GaugeMetricFamily(f"{PREFIX}_tool_calls_{name}", f"{doc}.", value=count)
            yield GaugeMetricFamily(
                f"{PREFIX}_tool_calls_{name}_oldest_seconds", f"{doc}: the oldest's wait.", value=age
            )
        decisions = CounterMetricFamily(
            f"{PREFIX}_cache_decisions", "Cache decisions seen, by action.", labels=["action"]
        )
        for action in ("PRESERVE", "SWAP", "PREFETCH", "RELEASE", "DISCARD"):
            decisions.add_metric([action], o.cache_decisions.get(action, 0))
        yield decisions
        yield GaugeMetricFamily(
            f"{PREFIX}_kv_blocks_pinned",
            "KV blocks pinned by PRESERVE/PREFETCH decisions now.",
            value=o.blocks_pinned(now),
        )
        dlq = CounterMetricFamily(f"{PREFIX}_dead_letters", "Records dead-lettered, by error type.", labels=["reason"])
        for reason, n in sorted(o.dead_letters.items()):
            dlq.add_metric([reason], n)
        yield dlq
