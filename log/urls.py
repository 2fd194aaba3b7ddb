"""Open the log named by a URL.

- ``kafka://host:port[,host:port...]``: the Kafka backend (production);
- ``postgresql://...``: a Postgres server of your own;
- nothing (or ``embedded``): the embedded Postgres default, started on demand.
"""

from __future__ import annotations

import os

from log.backend import Backend
from log.shared_log import SharedLog
from log.types import Clock, system_clock

ENV_URL = "AGENTLOG_LOG_URL"


def backend_for(url: str | None) -> Backend:
    """The backend a URL names (see the module docstring)."""
    url = url or os.environ.get(ENV_URL) or "embedded"
    if url.startswith("kafka://"):
        from log.kafka_backend import KafkaBackend

        return KafkaBackend(url.removeprefix("kafka://"))
    if url.startswith(("postgresql://", "postgres://")):
        from log.postgres_backend import PostgresBackend

        return PostgresBackend(url)
    if url == "embedded":
        from log.embedded import start_embedded
        from log.postgres_backend import PostgresBackend

        return PostgresBackend(start_embedded())
    raise ValueError(f"unsupported log URL {url!r}: use kafka://host:port, postgresql://... or embedded")


def open_log(url: str | None, *, actor: str, clock: Clock = system_clock) -> SharedLog:
    """A SharedLog for ``actor`` on the log at ``url`` (call ``await log.start()`` or use ``async with``)."""
    return SharedLog(backend_for(url), actor=actor, clock=clock)
