"""``logctl projector rebuild``: drop the projector's read model and project the log again from offset 0.

The projector itself is a worker (``python -m workers.projector``, docs/projector.md); this
command is what an operator runs when the read model was dropped, damaged, or its schema
changed. It stops once it has projected the log up to its end offsets at the start.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Annotated

import typer

from cli.common import Json, LogUrl
from cli.errors import BAD_INPUT, CliError
from cli.render import to_json
from log import open_log

app = typer.Typer(help="The projector's Postgres read model.", no_args_is_help=True)


@app.command("rebuild")
def rebuild_command(
    log_url: LogUrl = None,
    model_url: Annotated[
        str | None,
        typer.Option(
            "--model-url",
            help="Postgres of the read model (default: AGENTLOG_READ_MODEL_URL, AGENTLOG_PG_URL, or a Postgres log)",
        ),
    ] = None,
    as_json: Json = False,
) -> None:
    """Drop the read model and rebuild it from the whole log (a projector run up to the log's end)."""
    from workers.projector import model_url as find_model_url
    from workers.projector import rebuild

    url = find_model_url(model_url, log_url)
    if url is None:
        raise CliError("no Postgres for the read model: pass --model-url or set AGENTLOG_READ_MODEL_URL", BAD_INPUT)

    async def run() -> tuple[int, int, str]:
        async with open_log(log_url, actor="projector") as log:
            projector = await rebuild(log, url, group=f"projector-rebuild-{uuid.uuid4().hex[:8]}")
            return projector.num_projected, projector.num_refused, projector.model.schema

    projected, refused, schema = asyncio.run(run())
    if as_json:
        typer.echo(to_json({"projected": projected, "dead_lettered": refused, "schema": schema}))
    else:
        typer.echo(f"rebuilt {schema}: {projected:,} events projected, {refused} dead-lettered")
