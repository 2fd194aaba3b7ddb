"""logctl verify and logctl audit: is the log intact, and who did what.

``verify`` re-reads partitions from offset 0 and checks every record exactly as
a consumer does (decodes, its own hash, actor owns the topic, body belongs on
the topic, key is the session, seq gapless, prev_hash chains), and reports each
broken link with its topic, partition and offset. It exits 1 when anything is
wrong.

``audit`` folds the sessions and shows each tool call's proposal, votes,
verdict, approvals and execution side by side, filtered by session, actor,
tool, effect class, verdict and time range. ``audit --routes`` shows where each
LLM call went on a stack with several engines: the engine, why (locality, load,
failover, ...), the recompute the router expected, the model size chosen and why,
the operator pins, and the tokens the engine said it had cached. ``audit --resources`` shows what
tools acquired through the executor instead (services/resources.py): who
acquired what, when, for which call, and who released it, why; a resource
that could not be released is listed as ``stuck`` with its error and its
next retry until it is released (``--stuck`` lists only those).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, Any

import typer

from cli.common import Json, LogUrl
from cli.render import to_json
from cli.sessions import SessionBook, read_sessions
from log import TOPICS, RecordError, SharedLog, open_log
from log.chain import ChainVerifier
from log.topics import AGENT_DLQ
from log.topics import topic as topic_named
from services.resources import Resource
from services.session import SessionState, ToolCall


@dataclass
class VerifyReport:
    num_records: int = 0
    num_sessions: int = 0
    problems: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


async def verify_log(log: SharedLog, *, topics: list[str], session: str | None) -> VerifyReport:
    """Check every record of ``topics`` (of one session, if given) from offset 0."""
    report = VerifyReport()
    began = time.perf_counter()
    key = session.encode() if session is not None else None
    sessions: set[str] = set()
    for name in topics:
        topic = topic_named(name)
        verifier = ChainVerifier()
        partitions = [log.partition_for(session)] if session is not None else range(log.num_partitions)
        for partition in partitions:
            records = (
                await log.backend.read_key(name, partition, key)
                if key is not None
                else [r async for r in log.scan(name, partition)]
            )
            for record in records:
                report.num_records += 1
                try:
                    envelope = log.decode(record)
                    verifier.verify(topic, record.key, envelope, record.position)
                    sessions.add(envelope.session_id)
                except RecordError as error:
                    report.problems.append(
                        {
                            "topic": name,
                            "partition": record.position.partition,
                            "offset": record.position.offset,
                            "session_id": record.key.decode(errors="replace") if record.key else None,
                            "error": type(error).__name__,
                            "reason": str(error),
                        }
                    )
    report.num_sessions = len(sessions)
    report.seconds = time.perf_counter() - began
    return report


def verify(
    log_url: LogUrl = None,
    session: Annotated[str | None, typer.Option(help="Only this session's chains")] = None,
    topic: Annotated[list[str] | None, typer.Option("--topic", "-t", help="Only these topics (repeatable)")] = None,
    as_json: Json = False,
) -> None:
    """Check every hash chain and seq of the log; exit 1 and name each broken link if any."""
    topics = topic or [t.name for t in TOPICS if t is not AGENT_DLQ]

    async def run() -> VerifyReport:
        async with open_log(log_url, actor="auditor") as log:
            return await verify_log(log, topics=topics, session=session)

    report = asyncio.run(run())
    rate = report.num_records / report.seconds if report.seconds else 0.0
    if as_json:
        typer.echo(
            to_json(
                {
                    "ok": report.ok,
                    "records": report.num_records,
                    "sessions": report.num_sessions,
                    "seconds": round(report.seconds, 3),
                    "records_per_s": round(rate),
                    "problems": report.problems,
                }
            )
        )
    else:
        for problem in report.problems:
            typer.echo(
                f"BROKEN {problem['topic']}[{problem['partition']}]@{problem['offset']}  {problem['error']}: "
                f"{problem['reason']}"
            )
        verdict = "OK" if report.ok else f"{len(report.problems)} broken"
        typer.echo(
            f"{verdict}: {report.num_records:,} records of {report.num_sessions:,} sessions on {len(topics)} topics "
            f"checked in {report.seconds:.2f} s ({rate:,.0f} records/s)"
        )
    if not report.ok:
        raise typer.Exit(1)


# ------------------------------------------------------------------------- audit


def tool_row(session_id: str, tool: ToolCall) -> dict[str, Any]:
    """One tool call, everything about it side by side."""
    verdict = tool.verdict
    return {
        "session_id": session_id,
        "call_id": tool.call_id,
        "tool": tool.proposed.tool,
        "effect_class": tool.proposed.effect_class.value,
        "arguments": tool.proposed.arguments_json,
        "proposed_at": tool.proposed_at.isoformat() if tool.proposed_at else None,
        "votes": [{"voter": v.voter, "decision": v.decision.value, "reason": v.reason} for v in verdict.votes]
        if verdict
        else [],
        "verdict": ("committed" if type(verdict).__name__ == "ToolCallCommitted" else "aborted") if verdict else None,
        "verdict_reason": getattr(verdict, "reason", None),
        "approvals": [{"author": a.author, "decision": a.decision.value, "reason": a.reason} for a in tool.approvals],
        "status": tool.status.value,
        "attempts": tool.attempts,
        "duration_ms": tool.completed.duration_ms
        if tool.completed
        else tool.failure.duration_ms
        if tool.failure
        else None,
        "error": tool.failure.error if tool.failure else None,
    }


def audit(
    log_url: LogUrl = None,
    session: Annotated[str | None, typer.Option(help="Only this session")] = None,
    actor: Annotated[str | None, typer.Option(help="Only sessions with an event written by this principal")] = None,
    tool: Annotated[str | None, typer.Option(help="Only calls of this tool")] = None,
    effect_class: Annotated[str | None, typer.Option(help="pure, idempotent, compensatable or irreversible")] = None,
    verdict: Annotated[str | None, typer.Option(help="committed, aborted or pending")] = None,
    since: Annotated[datetime | None, typer.Option(help="Only calls proposed at or after (ISO time, UTC)")] = None,
    until: Annotated[datetime | None, typer.Option(help="Only calls proposed before (ISO time, UTC)")] = None,
    resources: Annotated[
        bool, typer.Option("--resources", help="The resources tools acquired and who released them, instead")
    ] = False,
    stuck: Annotated[bool, typer.Option("--stuck", help="With --resources: only those not released yet")] = False,
    routes: Annotated[
        bool, typer.Option("--routes", help="Where each LLM call was routed (engine, model size, why), instead")
    ] = False,
    as_json: Json = False,
) -> None:
    """Who did what: each tool call's proposal, votes, verdict, approvals and execution."""

    async def read() -> SessionBook:
        async with open_log(log_url, actor="auditor") as log:
            return await read_sessions(log, group=f"logctl-audit-{uuid.uuid4().hex[:8]}")

    if stuck and not resources:
        raise typer.BadParameter("--stuck goes with --resources")
    book = asyncio.run(read())
    if resources:
        _audit_resources(book, session=session, tool=tool, only_live=stuck, as_json=as_json)
        return
    if routes:
        _audit_routes(book, session=session, as_json=as_json)
        return
    rows = []
    for record in book.records.values():
        state = record.state
        if session and state.session_id != session:
            continue
        if actor and actor not in state.actors:
            continue
        for call in state.tool_calls.values():
            row = tool_row(state.session_id, call)
            if tool and row["tool"] != tool:
                continue
            if effect_class and row["effect_class"] != effect_class.upper():
                continue
            if verdict and (row["verdict"] or "pending") != verdict:
                continue
            proposed = call.proposed_at
            if since and (proposed is None or proposed < _aware(since)):
                continue
            if until and (proposed is None or proposed >= _aware(until)):
                continue
            rows.append(row)
    rows.sort(key=lambda r: (r["proposed_at"] or "", r["session_id"], r["call_id"]))
    if as_json:
        typer.echo(to_json(rows))
        return
    typer.echo(
        f"{'session':<28} {'call':<8} {'tool':<12} {'effect':<13} {'votes':<34} {'verdict':<10} {'status':<10} who"
    )
    for row in rows:
        votes = " ".join(f"{v['voter'][:8]}:{v['decision'][:3]}" for v in row["votes"])
        who = ", ".join(f"{a['decision'].lower()} by {a['author']}" for a in row["approvals"])
        typer.echo(
            f"{row['session_id'][:28]:<28} {row['call_id']:<8} {row['tool'][:12]:<12} {row['effect_class'][:13]:<13} "
            f"{votes[:34]:<34} {(row['verdict'] or 'pending'):<10} {row['status']:<10} {who}"
        )
    typer.echo(f"{len(rows)} tool calls")


def resource_row(session_id: str, r: Resource) -> dict[str, Any]:
    """One resource: acquired by which call, where, and its release (or why it is not released)."""

    def at(moment: datetime | None) -> str | None:
        return moment.isoformat() if moment else None

    return {
        "session_id": session_id,
        "resource_id": r.resource_id,
        "call_id": r.call_id,
        "tool": r.tool,
        "kind": r.kind.value.lower(),
        "location": r.location,
        "handle": r.handle,
        "status": r.status.value,
        "acquiring_at": at(r.acquiring_at),
        "acquired_at": at(r.acquired_at),
        "released_at": at(r.released_at),
        "reason": r.reason,
        "detail": r.detail,
        "failed_attempts": r.num_failures,
        "error": r.error,
        "retry_at": at(r.retry_at),
    }


def _audit_resources(
    book: SessionBook, *, session: str | None, tool: str | None, only_live: bool, as_json: bool
) -> None:
    rows = [
        resource_row(record.state.session_id, r)
        for record in book.records.values()
        if not session or record.state.session_id == session
        for r in record.state.resources.values()
        if (not tool or r.tool == tool) and (not only_live or r.live)
    ]
    rows.sort(key=lambda r: (r["acquiring_at"] or "", r["session_id"], r["resource_id"]))
    if as_json:
        typer.echo(to_json(rows))
        return
    typer.echo(f"{'session':<24} {'resource':<14} {'tool':<12} {'kind':<9} {'status':<9} {'handle':<8} why")
    for row in rows:
        why = row["reason"] or ""
        if row["status"] == "stuck":
            why = f"{row['failed_attempts']} failed release(s), next at {row['retry_at']}: {row['error']} ({why})"
        elif row["status"] == "released":
            why = f"{why}: {row['detail']}"
        handle = (row["handle"] or "")[-8:]
        typer.echo(
            f"{row['session_id'][:24]:<24} {row['resource_id'][:14]:<14} {row['tool'][:12]:<12} {row['kind']:<9} "
            f"{row['status']:<9} {handle:<8} {why}"
        )
    num_live = sum(1 for r in rows if r["status"] != "released")
    num_stuck = sum(1 for r in rows if r["status"] == "stuck")
    typer.echo(f"{len(rows)} resources, {num_live} not released ({num_stuck} stuck)")


def route_rows(state: SessionState) -> list[dict[str, Any]]:
    """Every routing decision of a session (failovers included), with what the engine then said."""
    rows = []
    for r in state.route_history:
        call = state.llm_calls.get(r.call_id)
        completed = call.completed if call is not None else None
        served = completed is not None and completed.engine_id == r.engine_id
        rows.append(
            {
                "session_id": state.session_id,
                "call_id": r.call_id,
                "attempt": r.attempt,
                "engine_id": r.engine_id,
                "reason": r.reason,
                "detail": r.detail,
                "router": r.router,
                "prompt_tokens": r.prompt_tokens,
                "expected_cached_tokens": r.expected_cached_tokens,
                "expected_recompute_tokens": r.expected_recompute_tokens,
                "model_size": r.model_size,
                "size_reason": r.size_reason,
                "failed_engine_id": r.failed_engine_id,
                "cached_tokens": completed.cached_tokens if served and completed else None,
                "pin": None,
            }
        )
    for pin in state.pins:
        rows.append(
            {"session_id": state.session_id, "pin": pin.size or "none", "author": pin.author, "reason": pin.reason}
        )
    return rows


def _audit_routes(book: SessionBook, *, session: str | None, as_json: bool) -> None:
    rows = [
        row
        for record in book.records.values()
        if not session or record.state.session_id == session
        for row in route_rows(record.state)
    ]
    if as_json:
        typer.echo(to_json(rows))
        return
    typer.echo(
        f"{'session':<24} {'call':<8} {'engine':<10} {'why':<20} {'recompute':>9} {'cached':>7} {'size':<6} size why"
    )
    for row in rows:
        if row.get("pin") is not None:
            typer.echo(f"{row['session_id'][:24]:<24} pinned to {row['pin']} by {row['author']}: {row['reason']}")
            continue
        cached = "" if row["cached_tokens"] is None else str(row["cached_tokens"])
        why = row["reason"] if not row["failed_engine_id"] else f"failover from {row['failed_engine_id']}"
        typer.echo(
            f"{row['session_id'][:24]:<24} {row['call_id'][:8]:<8} {row['engine_id'][:10]:<10} {why[:20]:<20} "
            f"{row['expected_recompute_tokens']:>9} {cached:>7} {row['model_size']:<6} {row['size_reason']}"
        )
    num_routes = sum(1 for r in rows if r.get("pin") is None)
    typer.echo(f"{num_routes} routes, {len(rows) - num_routes} pins")


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
