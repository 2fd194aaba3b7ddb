"""Open the log named by a URL.

- ``kafka://host:port[,host:port...]``: the Kafka backend (production), on librdkafka
  (``log.rdkafka_backend``), or on kafka-python when ``AGENTLOG_KAFKA_CLIENT=python``;
- ``postgresql://...``: a Postgres server of your own;
- nothing (or ``embedded``): the embedded Postgres default, started on demand;
- ``memory:NAME`` (or ``memory``, the store named ``default``): an in-memory log that only
  this process sees (``log.memory_backend``), shared by every backend opened on that name.
"""

from __future__ import annotations

import os
from typing import Any

from log.backend import Backend
from log.errors import UnsupportedLogUrl
from log.redact import redact
from log.shared_log import SharedLog
from log.types import Clock, system_clock

ENV_URL = "AGENTLOG_LOG_URL"
COMPOSE_KAFKA_URL = "kafka://localhost:9092"
"""The broker of docker-compose.yml, as seen from the host (SASL: each principal's password is in .env)."""
COMPOSE_PG_URL = "postgresql://agentlog@localhost:5432/agentlog"
"""The Postgres of docker-compose.yml, as seen from the host (its password: AGENTLOG_POSTGRES_PASSWORD of .env)."""
ENV_NAMESPACE = "AGENTLOG_NAMESPACE"
ENV_KAFKA_CLIENT = "AGENTLOG_KAFKA_CLIENT"
KAFKA_CLIENTS = ("python", "rdkafka")
DEFAULT_KAFKA_CLIENT = "rdkafka"
LIBRDKAFKA_LOGGER = "agentlog.rdkafka.client"
"""The logger librdkafka's own lines go to (``log.rdkafka_backend``'s go to ``agentlog.rdkafka``):
``logctl`` quiets it, as it quiets kafka-python's, since an unreachable broker reaches the
operator as one line."""


def kafka_backend(
    bootstrap: str,
    *,
    namespace: str = "",
    client_config: dict[str, Any] | None = None,
    linger_ms: int | None = None,
    bounded_delivery: bool = False,
) -> Backend:
    """The Kafka backend on the client ``AGENTLOG_KAFKA_CLIENT`` names (librdkafka by default:
    faster on every measure, docs/benchmarks.md; kafka-python with ``python``).

    ``linger_ms``: how long the producer waits to fill a batch (None: the backend's default).
    ``bounded_delivery``: each record lands or fails within 1.5 s (the session workers' fence,
    ``log.kafka_backend.BOUNDED_DELIVERY_TIMEOUT_MS``), not the client's 120 s."""
    client = os.environ.get(ENV_KAFKA_CLIENT) or DEFAULT_KAFKA_CLIENT
    options: dict[str, Any] = {"bounded_delivery": bounded_delivery}
    if linger_ms is not None:
        options["linger_ms"] = linger_ms
    if client == "python":
        from log.kafka_backend import KafkaBackend

        return KafkaBackend(bootstrap, namespace=namespace, client_config=client_config, **options)
    if client == "rdkafka":
        try:
            from log.rdkafka_backend import RdKafkaBackend
        except ModuleNotFoundError as e:
            if e.name != "confluent_kafka":
                raise
            msg = (
                "the Kafka log needs librdkafka's client, a dependency of agentlog: pip install confluent-kafka "
                f"(or {ENV_KAFKA_CLIENT}=python for kafka-python)"
            )
            raise ValueError(msg) from None

        return RdKafkaBackend(bootstrap, namespace=namespace, client_config=client_config, **options)
    raise ValueError(f"{ENV_KAFKA_CLIENT}={client!r}: use one of {', '.join(KAFKA_CLIENTS)}")


def backend_for(
    url: str | None,
    *,
    namespace: str | None = None,
    linger_ms: int | None = None,
    bounded_delivery: bool = False,
) -> Backend:
    """The backend a URL names (see the module docstring).

    ``namespace`` (or ``AGENTLOG_NAMESPACE``) keeps several logs apart on one
    server: a topic prefix on Kafka, a schema on Postgres, a store of its own in memory.
    ``linger_ms`` and ``bounded_delivery`` are the Kafka producer's (see ``kafka_backend``);
    other backends have neither.
    """
    url = url or os.environ.get(ENV_URL) or "embedded"
    namespace = namespace if namespace is not None else os.environ.get(ENV_NAMESPACE, "")
    if url.startswith("kafka://"):
        return kafka_backend(
            url.removeprefix("kafka://"), namespace=namespace, linger_ms=linger_ms, bounded_delivery=bounded_delivery
        )
    if url.startswith(("postgresql://", "postgres://")):
        from log.postgres_backend import PostgresBackend

        return PostgresBackend(url, namespace=namespace)
    if url == "embedded":
        from log.embedded import start_embedded
        from log.postgres_backend import PostgresBackend

        return PostgresBackend(start_embedded(), namespace=namespace)
    if url == "memory" or (url.startswith("memory:") and not url.startswith("memory://")):
        from log.memory_backend import MemoryBackend, named_store

        return MemoryBackend(named_store(url.removeprefix("memory").removeprefix(":") or "default", namespace))
    raise UnsupportedLogUrl(
        f"unsupported log URL {redact(url)!r}: use kafka://host:port, postgresql://..., embedded or memory:NAME"
    )


def open_log(
    url: str | None,
    *,
    actor: str,
    clock: Clock = system_clock,
    namespace: str | None = None,
    linger_ms: int | None = None,
    bounded_delivery: bool = False,
) -> SharedLog:
    """A SharedLog for ``actor`` on the log at ``url`` (call ``await log.start()`` or use ``async with``)."""
    backend = backend_for(url, namespace=namespace, linger_ms=linger_ms, bounded_delivery=bounded_delivery)
    return SharedLog(backend, actor=actor, clock=clock)
