"""logctl: create the log, watch it, run, audit and steer agents.

Every command takes ``--log-url`` (or ``AGENTLOG_LOG_URL``): ``kafka://host:port``,
``postgresql://...``, or nothing for the embedded Postgres default.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import sys
import uuid
from pathlib import Path
from typing import Annotated

import typer

from cli import agents, analyze, audit, branches
from cli.common import Json, LogUrl, init_log
from cli.console import ui
from cli.errors import OneLineErrors
from cli.projector import app as projector_app
from cli.render import event_line, event_to_json, to_json
from cli.traces import app as trace_app
from log import TOPICS, open_log
from log.redact import redact
from log.topics import DEFAULT_PARTITIONS
from log.urls import LIBRDKAFKA_LOGGER

app = typer.Typer(
    cls=OneLineErrors,
    help="Operate agentlog: the event-sourced control plane for LLM agents.",
    no_args_is_help=True,
)
logging.basicConfig(level=logging.WARNING, format="logctl: %(levelname)s: %(message)s")
# kafka-python and librdkafka narrate every failed connection attempt; an unreachable broker reaches
# the operator as one line (cli/errors.py) instead.
logging.getLogger("kafka").setLevel(logging.CRITICAL)
logging.getLogger(LIBRDKAFKA_LOGGER).setLevel(logging.CRITICAL)
agents.register(app)
branches.register(app)
analyze.register(app)
app.command()(audit.verify)
app.command()(audit.audit)
app.command()(ui)
app.add_typer(trace_app, name="trace", help="Import, generate and describe agent traces (docs/trace-format.md).")
app.add_typer(projector_app, name="projector", help="The projector's Postgres read model (docs/projector.md).")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"logctl (agentlog) {importlib.metadata.version('agentlog')}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit")
    ] = False,
) -> None:
    """Operate agentlog: the event-sourced control plane for LLM agents."""


@app.command()
def init(
    log_url: LogUrl = None,
    partitions: Annotated[int, typer.Option(help="Partitions per topic (all topics get the same count)")] = (
        DEFAULT_PARTITIONS
    ),
    secure: Annotated[
        bool,
        typer.Option(
            "--secure",
            help="Kafka: also create the ACLs of log/acls.py (as the admin principal: AGENTLOG_KAFKA_USERNAME=admin)",
        ),
    ] = False,
    as_json: Json = False,
) -> None:
    """Create the log's topics (idempotent): infinite retention, delete policy, co-partitioned."""
    ends = asyncio.run(init_log(log_url, partitions, secure=secure))
    if as_json:
        typer.echo(to_json({"topics": {name: sum(e.values()) for name, e in ends.items()}, "secure": secure}))
        return
    typer.echo(f"{'topic':<16} {'partitions':>10} {'records':>10}")
    for name, e in ends.items():
        typer.echo(f"{name:<16} {len(e):>10} {sum(e.values()):>10}")
    if secure:
        typer.echo("ACLs applied: each principal writes only its own topics (python -m log.acls show lists them)")


@app.command()
def tail(
    log_url: LogUrl = None,
    topic: Annotated[
        list[str] | None, typer.Option("--topic", "-t", help="Topic to follow (repeatable); default all")
    ] = None,
    from_beginning: Annotated[bool, typer.Option("--from-beginning", help="Start at the first record")] = False,
    limit: Annotated[int, typer.Option(help="Stop after this many events (0: follow forever)")] = 0,
    idle_exit: Annotated[float, typer.Option(help="Stop after this many idle seconds (0: never)")] = 0.0,
    group: Annotated[str, typer.Option(help="Consumer group (commits are not made: tail never moves a group)")] = "",
    as_json: Json = False,
) -> None:
    """Follow the log: one readable line per verified event (bad records go to agent.dlq)."""
    topics = topic or [t.name for t in TOPICS]
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how people stop following
        asyncio.run(_tail(log_url, topics, from_beginning, limit, idle_exit, group, as_json))


async def _tail(
    log_url: str | None,
    topics: list[str],
    from_beginning: bool,
    limit: int,
    idle_exit: float,
    group: str,
    as_json: bool,
) -> None:
    group = group or f"logctl-tail-{uuid.uuid4().hex[:8]}"
    shown = 0
    idle = 0.0
    async with (
        open_log(log_url, actor="auditor") as log,
        log.consumer(group, topics, from_beginning=from_beginning) as consumer,
    ):
        while limit == 0 or shown < limit:
            events = await consumer.poll(timeout_s=0.5)
            idle = 0.0 if events else idle + 0.5
            if idle_exit and idle >= idle_exit:
                break
            for event in events[: (limit - shown) if limit else None]:
                typer.echo(to_json(event_to_json(event)) if as_json else event_line(event))
                shown += 1
            sys.stdout.flush()
        if consumer.stats.num_dead_lettered:
            typer.echo(f"{consumer.stats.num_dead_lettered} bad records sent to agent.dlq", err=True)


@app.command()
def demo(
    log_url: LogUrl = None,
    sessions: Annotated[int, typer.Option(help="InferCept sessions to run")] = 50,
    time_scale: Annotated[float, typer.Option(help="Compress tool and engine time (0.01 = 100x faster)")] = 0.01,
    arrival_rate: Annotated[float, typer.Option(help="Session arrivals per second of trace time")] = 0.2,
    seed: Annotated[int, typer.Option(help="Which sessions, which arrivals")] = 0,
    trace: Annotated[
        Path | None,
        typer.Option(help="InferCept trace file (default: traces/infercept_merged_exp_uniform.json, shipped)"),
    ] = None,
    as_json: Json = False,
) -> None:
    """The main job: InferCept trace sessions through the planner, decider, executor and sim engine."""
    from cli.demo import print_report, run_demo
    from log.embedded import data_dir

    where = redact(log_url) if log_url else "the embedded log"
    typer.echo(f"agentlog demo: {sessions} InferCept sessions, time x{time_scale:g}, on {where}")
    result = run_demo(log_url, sessions, time_scale, arrival_rate, seed, data_dir() / "runs", trace)
    if as_json:
        typer.echo(to_json({**result, "summary": result["summary"].__dict__}))
    else:
        print_report(result)


if __name__ == "__main__":
    app()
