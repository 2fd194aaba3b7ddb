"""Start one worker process: ``python -m workers.<role> [--log-url URL] [role options]``.

Credentials and URLs come from options or the environment (``AGENTLOG_LOG_URL``);
SIGTERM or SIGINT drain in-flight work and exit cleanly; SIGKILL is what the
recovery tests use. ``--metrics-port`` (``AGENTLOG_METRICS_PORT``) serves the process's
Prometheus metrics and ``/health`` (docs/metrics.md); ``--log-format json``
(``AGENTLOG_LOG_FORMAT``) logs one JSON object per line (``workers/logs.py``).

Every role is a ``workers.worker.Worker``: ``create`` builds it from the options,
``run`` returns once it is drained, ``close`` releases what ``create`` opened.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Protocol

from log import SharedLog, open_log, tune_gc
from workers.logs import LOG_FORMAT_ENV, LOG_FORMATS, configure_logging
from workers.metrics import METRICS_PORT_ENV, MetricsPortInUse, WorkerMetrics
from workers.plugins import add_plugin_arguments, registry_from_args
from workers.worker import Worker


class WorkerClass(Protocol):
    """What ``run_worker`` needs of a role: a ``Worker`` subclass has all of it."""

    role: str
    linger_ms: int | None
    bounded_delivery: bool

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None: ...

    async def create(self, log: SharedLog, args: argparse.Namespace) -> Worker: ...


def _port(value: str) -> int | None:
    """A port number for ``--metrics-port`` (argparse also applies it to the environment's default)."""
    if value == "":
        return None
    if not value.isdigit() or int(value) > 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number ({METRICS_PORT_ENV} or the option)")
    return int(value)


def run_worker(worker_class: WorkerClass, argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m workers.{worker_class.role.replace('-', '_')}")
    parser.add_argument("--log-url", default=os.environ.get("AGENTLOG_LOG_URL"), help="default: embedded Postgres")
    parser.add_argument("--group", default=None, help=f"consumer group (default: {worker_class.role})")
    parser.add_argument(
        "--instance-id",
        default=os.environ.get("AGENTLOG_INSTANCE_ID"),
        help="stable name of this member across restarts (its replacement takes its partitions back at once)",
    )
    parser.add_argument("--log-level", default=os.environ.get("AGENTLOG_LOG_LEVEL", "INFO"))
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=os.environ.get(LOG_FORMAT_ENV) or "text")
    parser.add_argument(
        "--metrics-port",
        type=_port,
        default=os.environ.get(METRICS_PORT_ENV),
        help="serve /metrics and /health on this port (0: any free port; default: no metrics)",
    )
    parser.add_argument(
        "--metrics-host",
        default=os.environ.get("AGENTLOG_METRICS_HOST", "127.0.0.1"),
        help="address the metrics port listens on (default 127.0.0.1; 0.0.0.0 in a container)",
    )
    add_plugin_arguments(parser)
    worker_class.add_arguments(parser)
    args = parser.parse_args(argv)
    args.registry = registry_from_args(parser, args)  # every role sees the same programs, tools, voters
    configure_logging(worker_class.role, args.log_level, args.log_format)
    tune_gc()  # every role consumes the log in polls of hundreds of events (log/gc_tuning.py)
    try:
        asyncio.run(_main(worker_class, args))
    except MetricsPortInUse as e:
        print(f"{parser.prog}: error: {e.strerror}", file=sys.stderr)
        raise SystemExit(2) from None


async def _main(worker_class: WorkerClass, args: argparse.Namespace) -> None:
    _log = logging.getLogger(__name__)
    metrics: WorkerMetrics | None = None
    if args.metrics_port is not None:
        # Served before the log is opened: a taken port fails at once, and /health says
        # "starting" (503) while the broker is still being reached.
        metrics = WorkerMetrics(worker_class.role)
        port = await metrics.serve(args.metrics_host, args.metrics_port)
        _log.info("%s serves /metrics and /health on %s:%d", worker_class.role, args.metrics_host, port)
    try:
        async with open_log(
            args.log_url,
            actor=worker_class.role,
            linger_ms=worker_class.linger_ms,
            bounded_delivery=worker_class.bounded_delivery,
        ) as log:
            worker = await worker_class.create(log, args)
            if metrics is not None:
                worker.metrics = metrics
                log.on_appended = metrics.appended
            worker.install_signal_handlers()
            _log.info("%s started (group %s)", worker_class.role, worker.group)
            try:
                await worker.run()
            finally:
                await worker.close()
    finally:
        if metrics is not None:
            await metrics.close()
