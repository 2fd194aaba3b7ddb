"""What every logctl command shares: the log URL and --json options, and creating the topics."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated

import typer

from cli.errors import CliError
from log import TOPICS, LoggedEvent, SharedLog, open_log
from log.backend import Backend
from log.topics import DEFAULT_PARTITIONS
from services.session import SessionState

# The namespace is read from AGENTLOG_NAMESPACE by log.urls (a topic prefix on Kafka, a schema on Postgres).
LogUrl = Annotated[
    str | None,
    typer.Option(
        "--log-url", envvar="AGENTLOG_LOG_URL", help="kafka://host:port, postgresql://..., or empty for embedded"
    ),
]
Json = Annotated[bool, typer.Option("--json", help="JSON for scripts instead of a table")]
Plugins = Annotated[
    str | None,
    typer.Option(
        "--plugins",
        envvar="AGENTLOG_PLUGINS",
        help="Comma-separated modules with your programs, tools and voters (docs/sdk.md)",
    ),
]

if TYPE_CHECKING:
    from services.registry import Registry


def load_plugins(plugins: str | None) -> Registry:
    """The built-ins and the plugins, or exit with the plugin's one-line error (status 2)."""
    from workers.plugins import PluginError, load_registry

    try:
        return load_registry(plugins)
    except PluginError as e:
        typer.echo(f"logctl: error: {e}", err=True)
        raise typer.Exit(2) from None


async def require_session(log: SharedLog, session_id: str) -> tuple[SessionState, list[LoggedEvent]]:
    """The session's folded state and history; refuses (before anything is appended) a session
    that was never requested or started: an operator command for it would stay in the log forever."""
    from workers.operator import UnknownSession, known_session

    try:
        return await known_session(log, session_id)
    except UnknownSession as e:
        raise CliError(f"{e} (logctl sessions lists them)") from None


async def init_log(
    log_url: str | None,
    partitions: int = DEFAULT_PARTITIONS,
    *,
    secure: bool = False,
    namespace: str | None = None,
) -> dict[str, dict[int, int]]:
    """Create the log's topics (idempotent), and with ``secure`` its Kafka ACLs; end offsets per topic."""
    log = open_log(log_url, actor="admin", namespace=namespace)
    await log.backend.start()
    try:
        await log.backend.create_topics(partitions)
        if secure:
            await _apply_acls(log.backend)
        return {t.name: await log.backend.end_offsets(t.name) for t in TOPICS}
    finally:
        await log.backend.close()


def ensure_topics(log_url: str | None, partitions: int = DEFAULT_PARTITIONS, *, namespace: str | None = None) -> None:
    """``init_log`` for callers outside an event loop (``logctl up``, the demo, tests)."""
    asyncio.run(init_log(log_url, partitions, namespace=namespace))


async def _apply_acls(backend: Backend) -> None:
    from log.acls import admin_client, apply_acls
    from log.kafka_backend import KafkaCluster

    if not isinstance(backend, KafkaCluster):
        raise typer.BadParameter("--secure needs a kafka:// log URL (on Postgres, see log/pg_roles.py)")

    def apply() -> None:
        admin = admin_client(backend.bootstrap, backend.client_config)
        try:
            apply_acls(admin, backend.namespace)
        finally:
            admin.close()

    await asyncio.to_thread(apply)
