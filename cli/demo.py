"""``logctl demo``: the main job. Agents from a real trace run through the log, end to end.

It starts the embedded log (or uses ``--log-url``), the simulated engine, a
planner, a decider and an executor as separate processes, imports sessions of
the InferCept trace (shipped in ``traces/``) with tool time compressed, requests
them with Poisson arrivals, shows progress, and prints what happened: sessions,
LLM and tool calls, job times, and prefill tokens computed vs served from the
KV cache. Everything it reports is read back from the log.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import typer

from cli.data import INFERCEPT, trace_file
from cli.sessions import summarize
from cli.stack import Stack


def load_infercept(
    num_sessions: int, arrival_rate: float, seed: int, trace: Path | None = None
) -> list[dict[str, Any]]:
    """``num_sessions`` InferCept sessions in the project trace format, in trace time.

    ``trace`` is the InferCept file (default: the one in ``cli.data.traces_dir()``).

    Time is compressed by the processes (``--time-scale``: the executor's waits, the
    engine's compute), not here, so the log records trace-time durations.
    """
    from services.traces.infercept import from_infercept

    try:
        path = trace if trace is not None else trace_file(INFERCEPT)
    except FileNotFoundError as e:
        raise typer.BadParameter(str(e)) from None
    if not path.is_file():
        raise typer.BadParameter(f"trace {path} not found")
    loaded = from_infercept(json.loads(path.read_text()), arrival_rate_per_s=arrival_rate, rng=random.Random(seed))
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(len(loaded.sessions)), min(num_sessions, len(loaded.sessions))))
    return [loaded.sessions[i].to_dict() for i in chosen]


def run_demo(
    log_url: str | None,
    num_sessions: int,
    time_scale: float,
    arrival_rate: float,
    seed: int,
    work_dir: Path,
    trace: Path | None = None,
) -> dict[str, Any]:
    from cli.agents import _run
    from cli.common import ensure_topics

    sessions = load_infercept(num_sessions, arrival_rate, seed, trace)
    ensure_topics(log_url)
    run_id = uuid.uuid4().hex[:6]
    requests = [(f"demo-{run_id}-{s['session_id'][:8]}", "trace", {"session": s}) for s in sessions]
    first = sessions[0]["arrival_s"]
    arrivals = [(s["arrival_s"] - first) * time_scale for s in sessions]  # real seconds
    began = time.monotonic()
    with Stack(log_url, work_dir / f"demo-{run_id}", time_scale=time_scale) as stack:
        typer.echo(
            f"stack up: engine {stack.engine_url}, planner, decider, executor ({time.monotonic() - began:.1f} s)"
        )
        book = asyncio.run(_run(log_url, requests, True, 600, arrivals=arrivals))
        with urllib.request.urlopen(f"{stack.engine_url}/stats", timeout=5) as response:
            engine_stats = json.loads(response.read())
    summary = summarize(book.records.values())
    return {
        "run_id": run_id,
        "summary": summary,
        "engine": engine_stats,
        "wall_s": time.monotonic() - began,
        "first_session": requests[0][0],
        "time_scale": time_scale,
    }


def print_report(result: dict[str, Any]) -> None:
    s = result["summary"]
    served_from_cache = s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
    scale = result["time_scale"]
    typer.echo("")
    typer.echo(f"sessions            {s.sessions} ({s.finished} finished, {s.failed} failed, {s.running} unfinished)")
    typer.echo(f"LLM calls           {s.llm_calls} (engine served {result['engine']['num_served']})")
    typer.echo(f"tool calls          {s.tool_calls}")
    typer.echo(
        f"job time            mean {s.mean_job_s:.2f} s, p95 {s.p95_job_s:.2f} s "
        f"(x{1 / scale:g} = mean {s.mean_job_s / scale:.0f} s, p95 {s.p95_job_s / scale:.0f} s in trace time)"
    )
    typer.echo(
        f"prefill tokens      {s.computed_tokens:,} computed, {s.cached_tokens:,} served from the KV cache "
        f"({served_from_cache:.0%} of {s.prompt_tokens:,})"
    )
    typer.echo(f"wall time           {result['wall_s']:.1f} s")
    typer.echo("")
    typer.echo("Inspect the log:")
    typer.echo("  logctl sessions")
    typer.echo(f"  logctl replay {result['first_session']} --check")
    typer.echo("  logctl tail --from-beginning --idle-exit 2")
