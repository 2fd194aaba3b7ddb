"""``logctl ui``: the web console (``workers.console``, docs/console.md) in this process.

It reads the projector's read model, so a projector must run beside it (``logctl up --projector``,
or the compose stack's ``projector`` service); pages show what the projector has projected.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Annotated

import typer

from cli.common import LogUrl


def ui(
    log_url: LogUrl = None,
    model_url: Annotated[
        str | None,
        typer.Option(
            help="Postgres of the read model (default: AGENTLOG_READ_MODEL_URL, AGENTLOG_PG_URL, a Postgres log)"
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on")] = 8300,
    read_only: Annotated[bool, typer.Option("--read-only", help="Every login only reads (for auditors)")] = False,
    password_file: Annotated[
        Path | None, typer.Option(help="The operator's password (default: $AGENTLOG_CONSOLE_PASSWORD)")
    ] = None,
    auditor_password_file: Annotated[
        Path | None, typer.Option(help="The read-only password (default: $AGENTLOG_CONSOLE_AUDITOR_PASSWORD)")
    ] = None,
) -> None:
    """Serve the web console: sessions, a session's timeline and events, approvals waiting, the KV cache."""
    from workers.console import config_from, serve

    args = argparse.Namespace(
        password_file=password_file, auditor_password_file=auditor_password_file, read_only=read_only
    )
    config = config_from(args)
    asyncio.run(
        serve(
            config, log_url, model_url, host, port,
            ready=lambda bound: typer.echo(f"console on http://{host}:{bound}/ (Ctrl-C to stop)"),
        )
    )  # fmt: skip
