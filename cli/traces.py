"""``logctl trace``: import published agent traces, synthesize traces, summarise a trace file.

The conversions themselves are pure functions in :mod:`services.traces`; this module only reads
and writes files and seeds the random generator. Register it in ``cli/main.py`` with::

    from cli.traces import app as trace_app
    app.add_typer(trace_app, name="trace")
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from cli.common import Json
from cli.render import to_json
from services.traces import (
    Trace,
    TraceFormatError,
    from_continuum,
    from_infercept,
    from_mooncake,
    head,
    synthetic,
    time_scale,
    trace_stats,
)
from services.traces.stats import TraceStats

app = typer.Typer(help="Import, synthesize and summarise agent traces (JSONL, a session a line).", no_args_is_help=True)


class Format(StrEnum):
    infercept = "infercept"
    continuum = "continuum"
    mooncake = "mooncake"


class Durations(StrEnum):
    lognormal = "lognormal"
    pareto = "pareto"


Seed = Annotated[int, typer.Option(help="Seed of the random generator (arrivals, synthetic draws)")]


def _fail(message: str) -> typer.Exit:
    typer.echo(f"logctl trace: {message}", err=True)
    return typer.Exit(code=1)


def _load_json(path: Path) -> Any:
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise _fail(f"{path}: not JSON: {e}") from None


def _write(trace: Trace, output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w", encoding="utf-8") as f:
        for line in trace.to_json_lines():
            f.write(line + "\n")


def _report(trace: Trace, output: Path) -> None:
    for note in trace.notes:
        typer.echo(note)
    typer.echo(f"wrote {len(trace)} sessions, {sum(len(s.turns) for s in trace)} turns to {output}")


@app.command("import")
def import_trace(
    fmt: Annotated[Format, typer.Argument(metavar="FORMAT", help="infercept, continuum or mooncake")],
    input_path: Annotated[Path, typer.Argument(metavar="INPUT", exists=True, dir_okay=False, help="The source file")],
    output: Annotated[Path, typer.Argument(metavar="OUTPUT.jsonl", dir_okay=False, help="The trace to write")],
    time_scale_factor: Annotated[
        float, typer.Option("--time-scale", help="Multiply tool durations and arrival gaps (0.01: 100x faster)")
    ] = 1.0,
    arrival_rate: Annotated[
        float | None,
        typer.Option(help="Poisson session arrivals per second (infercept, continuum; default 1)"),
    ] = None,
    seed: Seed = 0,
    limit: Annotated[int | None, typer.Option(help="Keep only the first N sessions by arrival")] = None,
) -> None:
    """Convert a published trace to the project's trace format."""
    rng = random.Random(seed)
    try:
        if fmt is Format.mooncake:
            if arrival_rate is not None:
                raise _fail("--arrival-rate does not apply to mooncake: its requests carry timestamps")
            with input_path.open(encoding="utf-8") as f:
                trace = from_mooncake(f)
        elif fmt is Format.infercept:
            trace = from_infercept(_load_json(input_path), arrival_rate_per_s=arrival_rate or 1.0, rng=rng)
        else:
            trace = from_continuum(_load_json(input_path), arrival_rate_per_s=arrival_rate or 1.0, rng=rng)
        if limit is not None:
            trace = head(trace, limit)
        if time_scale_factor != 1.0:
            trace = time_scale(trace, time_scale_factor)
    except (TraceFormatError, ValueError) as e:
        raise _fail(f"{input_path}: {e}") from None
    _write(trace, output)
    _report(trace, output)


@app.command("synth")
def synth(
    output: Annotated[Path, typer.Argument(metavar="OUTPUT.jsonl", dir_okay=False, help="The trace to write")],
    sessions: Annotated[int, typer.Option(help="Number of sessions")] = 100,
    tool_duration: Annotated[Durations, typer.Option(help="Tool latency distribution")] = Durations.lognormal,
    mean_turns: Annotated[float, typer.Option(help="Mean LLM calls per session")] = 8.0,
    arrival_rate: Annotated[float, typer.Option(help="Poisson session arrivals per second")] = 1.0,
    seed: Seed = 0,
) -> None:
    """Write a synthetic trace: heavy-tailed tool durations, mixed session lengths, shared prompts."""
    try:
        trace = synthetic(
            sessions,
            rng=random.Random(seed),
            tool_duration=tool_duration.value,
            mean_turns=mean_turns,
            arrival_rate_per_s=arrival_rate,
        )
    except ValueError as e:
        raise _fail(str(e)) from None
    _write(trace, output)
    _report(trace, output)


def _seconds(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.3g}" if value < 10 else f"{value:,.1f}"


def _table(stats: TraceStats) -> list[str]:
    rows = [
        ("sessions", f"{stats.sessions:,}"),
        ("turns (LLM calls)", f"{stats.turns:,}"),
        ("turns per session", f"{stats.mean_turns:.2f}"),
        ("tool gaps", f"{stats.tool_gaps:,}"),
        ("prompt tokens (new)", f"{stats.prompt_tokens:,}"),
        ("output tokens", f"{stats.output_tokens:,}"),
        ("tool result tokens", f"{stats.tool_result_tokens:,}"),
        ("largest context", f"{stats.max_context_tokens:,}"),
        ("tool gap median s", _seconds(stats.gap_median_s)),
        ("tool gap p90 s", _seconds(stats.gap_p90_s)),
        ("tool gap max s", _seconds(stats.gap_max_s)),
        ("arrival span s", _seconds(stats.span_s)),
        ("sessions sharing a prefix", f"{stats.sessions_with_shared_prefix:,}"),
    ]
    lines = [f"{name:<26} {value:>14}" for name, value in rows]
    if stats.tools:
        lines.append("")
        lines.append(f"{'tool':<18} {'calls':>8} {'median s':>10} {'p90 s':>10} {'max s':>10} {'result tok':>11}")
        for t in stats.tools:
            lines.append(
                f"{t.tool:<18} {t.calls:>8,} {_seconds(t.median_s):>10} {_seconds(t.p90_s):>10} "
                f"{_seconds(t.max_s):>10} {t.mean_result_tokens:>11.0f}"
            )
    return lines


@app.command("stats")
def stats(
    input_path: Annotated[Path, typer.Argument(metavar="INPUT.jsonl", exists=True, dir_okay=False)],
    as_json: Json = False,
) -> None:
    """Summarise a trace file: sessions, turns, tokens, tool gap median/p90, per-tool latencies."""
    try:
        with input_path.open(encoding="utf-8") as f:
            trace = Trace.from_json_lines(f)
    except TraceFormatError as e:
        raise _fail(f"{input_path}: {e}") from None
    summary = trace_stats(trace)
    if as_json:
        typer.echo(to_json(asdict(summary)))
        return
    for line in _table(summary):
        typer.echo(line)
