"""What the web console shows, computed from read-model rows (pure: rows in, view data out).

The rows are the projector's tables (``services.projection.TABLES``) as mappings of column to
value; ``workers/console.py`` reads them from Postgres and renders what these functions return
with ``services.console_html``. A status is never stored in the model: it is derived here from
which columns are set, the same way for the list, the session page and the waiting calls.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from itertools import pairwise
from typing import Any

__all__ = [
    "ID_PATTERN",
    "Bar",
    "CacheView",
    "SessionSummary",
    "Timeline",
    "TreeNode",
    "Waiting",
    "cache_view",
    "fork_tree",
    "session_status",
    "summarize",
    "timeline",
    "tool_status",
    "valid_id",
    "waiting",
]

Row = Mapping[str, Any]

ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+\-]{0,199}")
"""Session and call ids the console accepts in a URL or a form (anything else is a 400)."""

STATUSES = ("requested", "running", "cancelling", "finished", "failed")


def valid_id(text: str | None) -> bool:
    return text is not None and ID_PATTERN.fullmatch(text) is not None


def session_status(row: Row) -> str:
    if row.get("failed_at") is not None:
        return "failed"
    if row.get("finished_at") is not None:
        return "finished"
    if row.get("cancel_requested_at") is not None:
        return "cancelling"
    if row.get("started_at") is not None:
        return "running"
    return "requested"


def tool_status(row: Row) -> str:
    """One tool call's state, latest first: done, failed, in doubt, running, committed, aborted, held."""
    if row.get("completed_at") is not None:
        return "completed"
    if row.get("failed_at") is not None:
        return "failed"
    if row.get("in_doubt_at") is not None:
        return "in doubt"
    if row.get("verdict") == "aborted":
        return "aborted"
    if row.get("first_started_at") is not None:
        return "running"
    if row.get("verdict") == "committed":
        return "committed"
    return "awaiting verdict"


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    return (end - start).total_seconds() if start is not None and end is not None else None


@dataclass(frozen=True, slots=True)
class SessionSummary:
    session_id: str
    program: str
    status: str
    turns: int
    num_tool_calls: int
    job_s: float | None
    """Request (or start) to finish; to ``now`` while it runs."""
    computed_tokens: int
    """Prompt tokens the engine computed (prompt minus cached)."""
    cached_tokens: int
    """Prompt tokens served from the KV cache."""
    requested_at: datetime | None
    parent_session_id: str | None


def summarize(row: Row, now: datetime) -> SessionSummary:
    """A sessions-list row: the ``sessions`` columns plus ``turns``, ``num_tools``,
    ``prompt_tokens`` and ``cached_tokens`` aggregated over its calls."""
    status = session_status(row)
    start = row.get("requested_at") or row.get("started_at")
    end = row.get("finished_at") or row.get("failed_at") or (now if status in ("running", "cancelling") else None)
    prompt = int(row.get("prompt_tokens") or 0)
    cached = int(row.get("cached_tokens") or 0)
    return SessionSummary(
        session_id=row["session_id"],
        program=row.get("program") or row.get("requested_program") or "",
        status=status,
        turns=int(row.get("turns") or 0),
        num_tool_calls=int(row.get("num_tools") or 0),
        job_s=_seconds(start, end),
        computed_tokens=max(0, prompt - cached),
        cached_tokens=cached,
        requested_at=row.get("requested_at"),
        parent_session_id=row.get("parent_session_id"),
    )


@dataclass(frozen=True, slots=True)
class Bar:
    """One span or instant of the session's timeline, in ms from its start."""

    lane: str
    """``llm``, ``tool``, ``gap`` (between an LLM call's end and the next one's start), ``kv``, ``approval``."""
    start_ms: float
    end_ms: float
    label: str
    detail: str
    ref: str
    """The call or event it stands for (``data-ref`` in the SVG: what the browser test reads)."""


@dataclass(frozen=True, slots=True)
class Turn:
    call_id: str
    turn: int
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Timeline:
    origin: datetime | None
    span_ms: float
    bars: list[Bar]
    turns: list[Turn]


def _ms(origin: datetime, at: datetime | None) -> float | None:
    return (at - origin).total_seconds() * 1000 if at is not None else None


def timeline(
    session: Row | None,
    llm_calls: Sequence[Row],
    tool_calls: Sequence[Row],
    votes: Sequence[Row],
    approvals: Sequence[Row],
    kv_decisions: Sequence[Row],
    now: datetime,
) -> Timeline:
    """The session's Gantt: LLM calls, the tool gaps between them, tool runs with their verdicts and
    votes, approvals and KV decisions as instants; and the cached tokens of each turn."""
    times = [
        t
        for t in [
            *(r.get("started_at") for r in llm_calls),
            *(r.get("proposed_at") for r in tool_calls),
            (session or {}).get("requested_at"),
            (session or {}).get("started_at"),
        ]
        if t is not None
    ]
    if not times:
        return Timeline(None, 0.0, [], [])
    origin = min(times)
    bars: list[Bar] = []
    ordered = sorted(llm_calls, key=lambda r: (r.get("started_at") or now, r["call_id"]))
    for r in ordered:
        start = _ms(origin, r.get("started_at")) or 0.0
        end = _ms(origin, r.get("completed_at") or now) or start
        cached = int(r.get("cached_tokens") or 0)
        bars.append(
            Bar(
                "llm",
                start,
                end,
                f"{r['call_id']} (turn {r.get('turn')})",
                f"prompt {r.get('prompt_tokens') or 0}, cached {cached}, output {r.get('output_tokens') or 0}; "
                f"queue {r.get('queue_ms') or 0:.0f} ms, prefill {r.get('prefill_ms') or 0:.0f} ms, "
                f"decode {r.get('decode_ms') or 0:.0f} ms",
                r["call_id"],
            )
        )
    for before, after in pairwise(ordered):
        gap_start = _ms(origin, before.get("completed_at"))
        gap_end = _ms(origin, after.get("started_at"))
        if gap_start is not None and gap_end is not None and gap_end > gap_start:
            bars.append(
                Bar(
                    "gap",
                    gap_start,
                    gap_end,
                    f"tool gap {gap_end - gap_start:.0f} ms",
                    "",
                    f"gap-{before['call_id']}",
                )
            )
    by_call: dict[str, list[str]] = {}
    for v in votes:
        by_call.setdefault(v["call_id"], []).append(f"{v['voter']}: {v['decision']} ({v.get('reason') or ''})")
    for r in sorted(tool_calls, key=lambda r: (r.get("proposed_at") or now, r["call_id"])):
        start = _ms(origin, r.get("proposed_at")) or 0.0
        end_at = r.get("completed_at") or r.get("failed_at") or r.get("in_doubt_at") or r.get("verdict_at")
        end = _ms(origin, end_at or now) or start
        verdict = r.get("verdict") or "no verdict yet"
        detail = f"{tool_status(r)}; verdict {verdict}"
        if r.get("verdict_policy"):
            detail += f" by {r['verdict_policy']}"
        if by_call.get(r["call_id"]):
            detail += "; votes: " + "; ".join(by_call[r["call_id"]])
        bars.append(Bar("tool", start, end, f"{r['call_id']} {r.get('tool') or ''}", detail, r["call_id"]))
    for a in approvals:
        at = _ms(origin, a.get("at")) or 0.0
        bars.append(
            Bar("approval", at, at, f"{a['decision']} {a.get('call_id')}", f"by {a.get('author')}", a["event_id"])
        )
    for k in kv_decisions:
        at = _ms(origin, k.get("at")) or 0.0
        ttl = f", ttl {k['ttl_ms']} ms" if k.get("ttl_ms") else ""
        bars.append(
            Bar(
                "kv",
                at,
                at + float(k.get("ttl_ms") or 0),
                f"{k['action']}{ttl}",
                f"{k.get('engine_id')}: {k.get('num_blocks') or 0} blocks; {k.get('reason') or ''}",
                k["event_id"],
            )
        )
    # A TTL reaches past the session's end: the span is the session's own, a KV bar is cut at it.
    span = max([1.0, *(b.end_ms for b in bars if b.lane != "kv"), *(b.start_ms for b in bars)])
    bars = [Bar(b.lane, b.start_ms, min(b.end_ms, span), b.label, b.detail, b.ref) for b in bars]
    turns = [
        Turn(r["call_id"], int(r.get("turn") or 0), int(r.get("prompt_tokens") or 0), int(r.get("cached_tokens") or 0))
        for r in ordered
    ]
    return Timeline(origin, span, bars, turns)


@dataclass(frozen=True, slots=True)
class Waiting:
    """A tool call an operator has to answer."""

    session_id: str
    call_id: str
    tool: str
    arguments_json: str
    kind: str
    """``approval`` (proposed, no verdict: the decider holds it) or ``in doubt`` (it may have run)."""
    since: datetime | None
    actions: tuple[str, ...]
    """The ``ApprovalDecision`` values that answer it."""


_FOR_APPROVAL = ("APPROVE", "DENY")
_FOR_DOUBT = ("RETRY", "MARK_DONE")


def waiting(tool_calls: Iterable[Row], approvals: Iterable[Row], sessions: Mapping[str, Row]) -> list[Waiting]:
    """Held and in-doubt calls of sessions still running, that no operator answered yet (an
    answer given after the call went in doubt answers the doubt)."""
    answered: dict[tuple[str, str], list[Row]] = {}
    for a in approvals:
        answered.setdefault((a["session_id"], a["call_id"]), []).append(a)
    out = []
    for r in tool_calls:
        session = sessions.get(r["session_id"])
        if session is None or session_status(session) in ("finished", "failed"):
            continue
        status = tool_status(r)
        answers = answered.get((r["session_id"], r["call_id"]), [])
        if status == "awaiting verdict":
            if any(a["decision"] in _FOR_APPROVAL for a in answers):
                continue
            kind, since, actions = "approval", r.get("proposed_at"), _FOR_APPROVAL
        elif status == "in doubt":
            doubt = r["in_doubt_at"]
            if any(a["decision"] in _FOR_DOUBT and (a.get("at") is None or a["at"] >= doubt) for a in answers):
                continue
            kind, since, actions = "in doubt", doubt, _FOR_DOUBT
        else:
            continue
        out.append(
            Waiting(
                r["session_id"], r["call_id"], r.get("tool") or "", r.get("arguments_json") or "", kind, since, actions
            )
        )
    return sorted(out, key=lambda w: (w.since is None, w.since, w.session_id, w.call_id))


@dataclass
class TreeNode:
    session_id: str
    checkpoint_id: str | None
    """The checkpoint of its parent it was forked at (None for the root)."""
    checkpoints: list[str] = field(default_factory=list)
    merges: list[str] = field(default_factory=list)
    children: list[TreeNode] = field(default_factory=list)


def fork_tree(
    session_id: str, forks: Sequence[Row], checkpoints: Sequence[Row], merges: Sequence[Row], *, max_nodes: int = 500
) -> TreeNode:
    """The tree of forks ``session_id`` belongs to, from its root: each session's checkpoints,
    its branches (``ForkCreated``) and the merges it applied or refused."""
    parent: dict[str, str | None] = {f["session_id"]: f.get("parent_session_id") for f in forks}
    root, seen = session_id, {session_id}
    while parent.get(root) and parent[root] not in seen:
        root = str(parent[root])
        seen.add(root)
    children: dict[str, list[Row]] = {}
    for f in sorted(forks, key=lambda f: (f.get("at") is None, f.get("at"), f["session_id"])):
        children.setdefault(f.get("parent_session_id") or "", []).append(f)
    by_session: dict[str, list[str]] = {}
    for c in sorted(checkpoints, key=lambda c: (c.get("taken_at") is None, c.get("taken_at"), c["checkpoint_id"])):
        by_session.setdefault(c["session_id"], []).append(c["checkpoint_id"])
    merged: dict[str, list[str]] = {}
    for m in merges:
        merged.setdefault(m["session_id"], []).append(f"{m['outcome']}: {m.get('branch_session_ids')}")
    budget = [max_nodes]

    def node(sid: str, checkpoint: str | None) -> TreeNode:
        budget[0] -= 1
        n = TreeNode(sid, checkpoint, by_session.get(sid, []), merged.get(sid, []))
        for f in children.get(sid, []):
            if budget[0] > 0 and f["session_id"] != sid:
                n.children.append(node(f["session_id"], f.get("checkpoint_id")))
        return n

    return node(root, None)


@dataclass(frozen=True, slots=True)
class Pinned:
    session_id: str
    engine_id: str
    num_blocks: int
    ttl_ms: int | None
    expires_at: datetime | None
    action: str


@dataclass(frozen=True, slots=True)
class CacheView:
    pinned: list[Pinned]
    blocks_by_engine: dict[str, int]
    """Blocks held for pinned sessions per engine."""
    buckets: list[tuple[datetime, dict[str, int]]]
    """Decisions per action in each time bucket, oldest first."""
    hit_tokens: int
    prompt_tokens: int


def cache_view(decisions: Sequence[Row], hits: Sequence[Row], now: datetime, *, num_buckets: int = 24) -> CacheView:
    """Sessions whose KV the cache manager keeps (the latest decision per session and engine is a
    PRESERVE or PREFETCH, and its TTL, if any, has not run out), the blocks they hold per engine,
    and the decisions over time."""
    latest: dict[tuple[str, str], Row] = {}
    for d in sorted(decisions, key=lambda d: (d["at"], d["event_id"])):
        latest[(d["session_id"], d.get("engine_id") or "")] = d
    pinned = []
    for (session, engine), d in sorted(latest.items()):
        if d["action"] not in ("PRESERVE", "PREFETCH"):
            continue
        ttl = d.get("ttl_ms")
        expires = d["at"] + _timedelta_ms(ttl) if ttl else None
        if expires is not None and expires <= now:
            continue
        pinned.append(Pinned(session, engine, int(d.get("num_blocks") or 0), ttl, expires, d["action"]))
    blocks: dict[str, int] = {}
    for p in pinned:
        blocks[p.engine_id] = blocks.get(p.engine_id, 0) + p.num_blocks
    buckets: list[tuple[datetime, dict[str, int]]] = []
    if decisions:
        first = min(d["at"] for d in decisions)
        last = max(d["at"] for d in decisions)
        width = max((last - first).total_seconds() / num_buckets, 1e-3)
        counts: list[dict[str, int]] = [{} for _ in range(num_buckets)]
        for d in decisions:
            i = min(int((d["at"] - first).total_seconds() / width), num_buckets - 1)
            counts[i][d["action"]] = counts[i].get(d["action"], 0) + 1
        buckets = [(first + _timedelta_ms(i * width * 1000), c) for i, c in enumerate(counts)]
    return CacheView(
        pinned,
        blocks,
        buckets,
        sum(int(h.get("cached_tokens") or 0) for h in hits),
        sum(int(h.get("prompt_tokens") or 0) for h in hits),
    )


def _timedelta_ms(ms: float) -> Any:
    from datetime import timedelta

    return timedelta(milliseconds=ms)


STATUS_SQL = (
    "(CASE WHEN s.failed_at IS NOT NULL THEN 'failed' WHEN s.finished_at IS NOT NULL THEN 'finished' "
    "WHEN s.cancel_requested_at IS NOT NULL THEN 'cancelling' WHEN s.started_at IS NOT NULL THEN 'running' "
    "ELSE 'requested' END)"
)
"""``session_status`` in SQL over the ``sessions`` table aliased ``s`` (the list filters with it;
tests/integration/test_console.py checks the two agree)."""
