"""``logctl analyze``: where a workload's job time goes, and whether a cache policy can win it back.

It reads every session of a log (any backend) or a trace file (the project's JSONL, or a
published trace through its importer), folds them into timelines and reports
(:mod:`services.analysis`): a text report, ``--json`` and PNG plots (``--png DIR``). What the
numbers mean and the verdict's rule: docs/analyze.md.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import uuid
from dataclasses import asdict
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from cli.common import Json, LogUrl
from cli.errors import BAD_INPUT, CliError
from cli.render import to_json
from cli.sessions import read_log
from log import LoggedEvent, open_log
from log.redact import redact
from services.analysis import Timeline, TimelineFold, WorkloadReport, analyze, from_trace
from services.traces import Trace, TraceFormatError, from_continuum, from_infercept, from_mooncake


class TraceFormat(StrEnum):
    agentlog = "agentlog"
    infercept = "infercept"
    continuum = "continuum"
    mooncake = "mooncake"


def register(app: typer.Typer) -> None:
    app.command("analyze")(analyze_command)


def analyze_command(
    trace: Annotated[
        Path | None,
        typer.Argument(metavar="[TRACE]", help="A trace file to analyze instead of the log", show_default=False),
    ] = None,
    fmt: Annotated[
        TraceFormat, typer.Option("--format", help="The trace's format: agentlog (JSONL) or a published one")
    ] = TraceFormat.agentlog,
    arrival_rate: Annotated[
        float, typer.Option(help="Poisson session arrivals per second (infercept, continuum traces)")
    ] = 1.0,
    seed: Annotated[int, typer.Option(help="Seed of the arrivals (infercept, continuum traces)")] = 0,
    log_url: LogUrl = None,
    png: Annotated[
        Path | None, typer.Option("--png", help="Write PNG plots into this folder (needs agentlog[plots])")
    ] = None,
    top: Annotated[int, typer.Option(help="Sessions shown in the text report (the longest jobs)")] = 10,
    as_json: Json = False,
) -> None:
    """Tool-gap share of job time, gap percentiles, KV hits per turn, head-of-line blocking, the
    oracle bound, and whether a serving-layer cache policy is worth it (docs/analyze.md)."""
    if trace is not None:
        timelines = from_trace(_read_trace(trace, fmt, arrival_rate, seed))
        source = f"trace {trace.name} ({fmt.value}; times from the cost model, each session alone)"
    else:
        timelines = asyncio.run(_read_log(log_url))
        source = f"the log {redact(log_url)}" if log_url else "the embedded log"
    if not timelines:
        where = f"trace {trace}" if trace is not None else source
        raise CliError(f"no sessions in {where}: nothing to analyze (logctl demo or logctl run makes some)")
    report = analyze(timelines, source)
    if png is not None:
        from cli.analyze_plots import write_plots

        written = write_plots(report, timelines, png)
    if as_json:
        typer.echo(to_json(asdict(report)))
    else:
        for line in text_report(report, top):
            typer.echo(line)
        if png is not None:
            typer.echo(f"\nplots: {', '.join(str(p) for p in written)}")


def _read_trace(path: Path, fmt: TraceFormat, arrival_rate: float, seed: int) -> Trace:
    if not path.is_file():
        raise CliError(f"trace {path} not found (a file in the project's JSONL or a published format)", BAD_INPUT)
    try:
        with path.open(encoding="utf-8") as f:
            if fmt is TraceFormat.agentlog:
                return Trace.from_json_lines(f)
            if fmt is TraceFormat.mooncake:
                return from_mooncake(f)
            data = json.load(f)
        rng = random.Random(seed)
        if fmt is TraceFormat.infercept:
            return from_infercept(data, arrival_rate_per_s=arrival_rate, rng=rng)
        return from_continuum(data, arrival_rate_per_s=arrival_rate, rng=rng)
    except json.JSONDecodeError as e:
        raise CliError(f"{path}: not a valid {fmt.value} trace: not JSON: {e}", BAD_INPUT) from None
    except UnicodeDecodeError:
        raise CliError(f"{path}: not a valid {fmt.value} trace: not UTF-8 text", BAD_INPUT) from None
    except (TraceFormatError, ValueError, KeyError, TypeError) as e:
        raise CliError(f"{path}: not a valid {fmt.value} trace: {e} (--format names the format)", BAD_INPUT) from None


async def _read_log(log_url: str | None) -> list[Timeline]:
    fold = TimelineFold()

    def sink(events: list[LoggedEvent]) -> None:
        for e in events:
            fold.observe(e.session_id, e.envelope.event_id, e.body, e.envelope.occurred_at.timestamp())

    async with open_log(log_url, actor="auditor") as log:
        await read_log(log, sink, group=f"logctl-analyze-{uuid.uuid4().hex[:8]}")
    return fold.timelines()


def _s(value: float) -> str:
    """Seconds for people: three significant digits, thousands separated, '-' for none."""
    if math.isnan(value):
        return "-"
    if abs(value) < 1e-6:  # float residue of a difference (job - calls - gaps), not a duration
        return "0"
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1%}"


def text_report(r: WorkloadReport, top: int = 10) -> list[str]:
    """The report as lines of text: the verdict first, then the numbers behind it, then tables."""
    g, q = r.gaps, r.queue_waits
    lines = [
        f"workload: {r.source}",
        f"  {r.sessions} sessions ({r.unfinished} unfinished), {r.llm_calls} LLM calls, {r.tool_gaps} tool gaps",
        "",
        f"verdict: {r.verdict.line}",
        "",
        f"job time      {_s(r.job_s)} s in all: LLM calls {_s(r.llm_s)} s, tool gaps {_s(r.gap_s)} s "
        f"({_pct(r.gap_share)} of job time), other {_s(r.other_s)} s (waiting to start, planner steps)",
        f"tool gaps     p50 {_s(g.p50)} s, p90 {_s(g.p90)} s, p99 {_s(g.p99)} s, max {_s(g.max)} s",
        f"KV cache      {_pct(r.hit_rate)} of {r.prompt_tokens:,} prompt tokens served from the cache; "
        f"{r.recomputed_tokens:,} recomputed (oracle hit rate {_pct(r.oracle_hit_rate)})",
        f"head-of-line  {_s(r.queue_s)} s queued ({_pct(r.queue_share)} of job time; the engines recorded "
        f"{r.queue_ms_recorded:,.0f} ms in their own clock); {r.calls_queued} of "
        f"{r.llm_calls} calls waited"
        + (f": p50 {_s(q.p50)} s, p90 {_s(q.p90)} s, max {_s(q.max)} s" if q.count else ""),
        f"oracle bound  {_s(r.oracle_saved_s)} s of recomputed prefill ({_pct(r.oracle_share)} of job time); "
        f"{_s(r.oracle_upper_s)} s ({_pct(r.oracle_upper_share)}) with every queue wait gone",
    ]
    if r.tools:
        lines += ["", f"{'tool':<20} {'gaps':>6} {'share':>7} {'p50 s':>8} {'p90 s':>8} {'p99 s':>8} {'max s':>8}"]
        for t in r.tools:
            d = t.gaps
            lines.append(
                f"{t.tool[:20]:<20} {d.count:>6} {_pct(t.gap_share):>7} {_s(d.p50):>8} {_s(d.p90):>8} "
                f"{_s(d.p99):>8} {_s(d.max):>8}"
            )
    lines += [
        "",
        f"{'turn':>4} {'calls':>6} {'prompt tok':>11} {'cached':>10} {'recomputed':>10} {'hit':>7} {'oracle':>7}",
    ]
    for u in r.turns:
        lines.append(
            f"{u.turn:>4} {u.calls:>6} {u.prompt_tokens:>11,} {u.cached_tokens:>10,} {u.recomputed_tokens:>10,} "
            f"{_pct(u.hit_rate):>7} {_pct(u.oracle_hit_rate):>7}"
        )
    longest = sorted(r.session_reports, key=lambda s: (-s.job_s, s.session_id))[: max(top, 0)]
    if longest:
        shown = f"the {len(longest)} longest jobs of {r.sessions}" if len(longest) < r.sessions else "all"
        lines += [
            "",
            f"sessions ({shown}; --json has every one)",
            f"{'session':<28} {'end':<10} {'job s':>8} {'gaps':>7} {'queue s':>8} {'hit':>7} {'recomputed':>10} "
            f"{'oracle s':>8}",
        ]
        for s in longest:
            lines.append(
                f"{s.session_id[:28]:<28} {s.end:<10} {_s(s.job_s):>8} {_pct(s.gap_share):>7} {_s(s.queue_s):>8} "
                f"{_pct(s.hit_rate):>7} {s.recomputed_tokens:>10,} {_s(s.oracle_saved_s):>8}"
            )
    return lines
