"""The web console's pages as HTML text (pure: view data in, a string out).

Server-rendered, no script and no asset to fetch: one inline style sheet, the timeline and the
cache chart as inline SVG, forms that post back. Every value from the log goes through
``html.escape`` (a tool's arguments or a failure text are an agent's output, not markup).
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import urlencode

from services.console_auth import Login
from services.console_views import STATUSES, Bar, CacheView, SessionSummary, Timeline, TreeNode, Waiting

__all__ = [
    "RawEvent",
    "cache_page",
    "error_page",
    "login_page",
    "session_page",
    "sessions_page",
    "timeline_svg",
    "waiting_page",
]

e = html.escape

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:8px 16px;display:flex;gap:18px;align-items:center}
header a{color:#cfd8ea;text-decoration:none}header a.on{color:#fff;font-weight:600}
header .who{margin-left:auto;color:#9aa6bd}header form{display:inline}
main{padding:16px}h1{font-size:20px;margin:4px 0 12px}h2{font-size:16px;margin:18px 0 8px}
table{border-collapse:collapse;background:#fff;width:100%}
td,th{border-bottom:1px solid #e3e6eb;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#eef0f4;font-weight:600}td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
code,.mono{font:12px ui-monospace,monospace}.muted{color:#6b7488}
.status{padding:1px 6px;border-radius:8px;font-size:12px;background:#e3e6eb}
.s-running{background:#d6e8ff}.s-finished{background:#d7f2dc}.s-failed{background:#ffd9d6}
.s-cancelling,.s-requested{background:#fff1c7}
form.inline{display:inline}button{font:inherit;padding:2px 10px;margin-right:4px;cursor:pointer}
button.approve,button.retry{background:#d7f2dc}button.deny{background:#ffd9d6}
.card{background:#fff;padding:12px;border:1px solid #e3e6eb;margin-bottom:12px}
.err{background:#ffd9d6;padding:8px 12px;border:1px solid #e8a39c}
#events td.mono{max-width:460px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
ul.tree{list-style:none;padding-left:18px;border-left:1px dotted #9aa6bd}
"""

MAX_LISTED = 300
"""Rows of a session's decisions table (a long session's are all in its timeline)."""
_NONE = "<tr><td colspan={} class=muted>none</td></tr>"
_LANE_COLOR = {"llm": "#3b7ddd", "gap": "#f2b84b", "tool": "#5aa469", "approval": "#b5487a", "kv": "#8a63d2"}
_ACTION_COLOR = {
    "PRESERVE": "#3b7ddd",
    "PREFETCH": "#5aa469",
    "SWAP": "#f2b84b",
    "DISCARD": "#d9534f",
    "RELEASE": "#9aa6bd",
}


def _time(at: datetime | None) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] if at is not None else "-"


def _page(title: str, body: str, login: Login | None, active: str = "") -> str:
    nav = ""
    if login is not None:
        links = [("/", "Sessions"), ("/waiting", "Waiting"), ("/cache", "Cache")]
        items = "".join(f'<a href="{h}"{" class=on" if h == active else ""}>{t}</a>' for h, t in links)
        mode = "operator" if login.can_write else "read-only"
        nav = (
            f'{items}<span class="who">{e(login.user)} ({mode})</span>'
            '<form method="post" action="/logout"><button>Log out</button></form>'
        )
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{e(title)} · agentlog</title>'
        f"<style>{_STYLE}</style></head><body><header><b>agentlog</b>{nav}</header><main>{body}</main></body></html>"
    )


def error_page(status: int, message: str, login: Login | None = None) -> str:
    return _page(f"{status}", f'<h1>{status}</h1><p class="err">{e(message)}</p><p><a href="/">Sessions</a></p>', login)


def login_page(error: str = "", next_path: str = "/") -> str:
    err = f'<p class="err">{e(error)}</p>' if error else ""
    body = (
        f'<h1>Log in</h1>{err}<form method="post" action="/login" class="card">'
        f'<input type="hidden" name="next" value="{e(next_path)}">'
        '<p><label>User <input name="user" value="operator" autocomplete="username"></label></p>'
        '<p><label>Password <input type="password" name="password" autocomplete="current-password"></label></p>'
        '<p><button type="submit" id="login">Log in</button></p></form>'
        '<p class="muted">The operator password may approve and resolve calls; the auditor password only reads.</p>'
    )
    return _page("Log in", body, None)


def _status(status: str) -> str:
    return f'<span class="status s-{e(status)}">{e(status)}</span>'


def _session_link(session_id: str) -> str:
    return f'<a href="/sessions/{e(session_id)}">{e(session_id)}</a>'


def sessions_page(
    sessions: Sequence[SessionSummary],
    *,
    status: str,
    program: str,
    programs: Sequence[str],
    login: Login,
    limit: int,
) -> str:
    status_options = "".join(
        f'<option value="{s}"{" selected" if s == status else ""}>{s or "any status"}</option>' for s in ("", *STATUSES)
    )
    program_options = "".join(
        f'<option value="{e(p)}"{" selected" if p == program else ""}>{e(p) or "any program"}</option>'
        for p in ("", *programs)
    )
    rows = "".join(
        f"<tr data-session='{e(s.session_id)}'><td>{_session_link(s.session_id)}</td><td>{e(s.program)}</td>"
        f"<td>{_status(s.status)}</td><td class=n>{s.turns}</td><td class=n>{s.num_tool_calls}</td>"
        f"<td class=n>{'-' if s.job_s is None else f'{s.job_s:.2f}'}</td><td class=n>{s.computed_tokens:,}</td>"
        f"<td class=n>{s.cached_tokens:,}</td><td class=muted>{_time(s.requested_at)}</td></tr>"
        for s in sessions
    )
    body = (
        '<h1>Sessions</h1><form method="get" action="/" class="card">'
        f'<select name="status">{status_options}</select> <select name="program">{program_options}</select> '
        '<button type="submit">Filter</button></form>'
        "<table id=sessions><tr><th>session</th><th>program</th><th>status</th><th class=n>turns</th>"
        "<th class=n>tool calls</th><th class=n>job s</th><th class=n>tokens computed</th>"
        "<th class=n>tokens from cache</th><th>requested</th></tr>"
        f"{rows or '<tr><td colspan=9 class=muted>no sessions</td></tr>'}</table>"
        f'<p class="muted">{len(sessions)} shown (newest first, at most {limit}).</p>'
    )
    return _page("Sessions", body, login, "/")


def timeline_svg(t: Timeline, width: int = 1100) -> str:
    """The Gantt: one lane per kind, each bar a ``rect`` with a tooltip and ``data-ref``."""
    lanes = ["llm", "gap", "tool", "approval", "kv"]
    names = {
        "llm": "LLM calls",
        "gap": "tool gaps",
        "tool": "tool calls",
        "approval": "approvals",
        "kv": "KV decisions",
    }
    left, lane_h, top = 110, 26, 22
    scale = (width - left - 10) / max(t.span_ms, 1.0)
    parts = [
        f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{top + lane_h * len(lanes) + 8}"'
        ' font-family="system-ui,sans-serif" font-size="11">'
    ]
    for i in range(6):
        x = left + (width - left - 10) * i / 5
        parts.append(
            f'<line x1="{x:.1f}" y1="{top - 6}" x2="{x:.1f}" y2="{top + lane_h * len(lanes)}" stroke="#e3e6eb"/>'
            f'<text x="{x:.1f}" y="{top - 9}" text-anchor="middle" fill="#6b7488">'
            f"{t.span_ms * i / 5 / 1000:.2f} s</text>"
        )
    for i, lane in enumerate(lanes):
        y = top + i * lane_h
        parts.append(f'<text x="4" y="{y + 16}" fill="#1d2330">{names[lane]}</text>')
    for b in t.bars:
        parts.append(_bar(b, left, top + lanes.index(b.lane) * lane_h, scale))
    parts.append("</svg>")
    return "".join(parts)


def _bar(b: Bar, left: int, y: int, scale: float) -> str:
    x = left + b.start_ms * scale
    w = max((b.end_ms - b.start_ms) * scale, 3.0)
    color = _LANE_COLOR[b.lane]
    tip = f"<title>{e(b.label)} — {e(b.detail)} [{b.start_ms:.0f} to {b.end_ms:.0f} ms]</title>"
    rect = (
        f'<rect class="bar {b.lane}" data-lane="{b.lane}" data-ref="{e(b.ref)}" data-start="{b.start_ms:.1f}" '
        f'x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="18" rx="2" fill="{color}" fill-opacity="0.85">{tip}</rect>'
    )
    label = b.label.split(" ")[0]
    text = f'<text x="{x + 3:.1f}" y="{y + 16}" fill="#fff">{e(label)}</text>' if w > 7 * len(label) else ""
    return rect + text


def _tree(n: TreeNode, current: str) -> str:
    me = f"<b>{e(n.session_id)}</b>" if n.session_id == current else _session_link(n.session_id)
    at = f' <span class="muted">forked at {e(n.checkpoint_id)}</span>' if n.checkpoint_id else ""
    cps = f' <span class="muted">checkpoints: {e(", ".join(n.checkpoints))}</span>' if n.checkpoints else ""
    merges = "".join(f"<div class=muted>merge {e(m)}</div>" for m in n.merges)
    kids = "".join(_tree(c, current) for c in n.children)
    return f"<li>{me}{at}{cps}{merges}{f'<ul class=tree>{kids}</ul>' if kids else ''}</li>"


@dataclass(frozen=True, slots=True)
class RawEvent:
    """One event as the log holds it, with its place in the session's hash chain."""

    topic: str
    partition: int
    offset: int
    seq: int
    kind: str
    actor: str
    occurred_at: datetime
    prev_hash: str
    hash: str
    event_id: str
    body_json: str


def _actions(w: Waiting, csrf: str, login: Login, back: str) -> str:
    if not login.can_write:
        return '<span class="muted">read-only</span>'
    return "".join(
        f'<form class="inline" method="post" action="/decide">'
        f'<input type="hidden" name="csrf" value="{e(csrf)}">'
        f'<input type="hidden" name="session_id" value="{e(w.session_id)}">'
        f'<input type="hidden" name="call_id" value="{e(w.call_id)}"><input type="hidden" name="decision" value="{a}">'
        f'<input type="hidden" name="back" value="{e(back)}">'
        f'<button class="{a.lower().replace("_", "-")}" data-action="{a}" data-call="{e(w.session_id)}/{e(w.call_id)}">'
        f"{a.replace('_', ' ').lower()}</button></form>"
        for a in w.actions
    )


def _waiting_table(items: Sequence[Waiting], csrf: str, login: Login, back: str) -> str:
    if not items:
        return '<p class="muted">nothing waiting</p>'
    rows = "".join(
        f"<tr data-waiting='{e(w.session_id)}/{e(w.call_id)}'><td>{_session_link(w.session_id)}</td>"
        f"<td>{e(w.call_id)}</td>"
        f"<td>{e(w.tool)}</td><td><code>{e(w.arguments_json[:200])}</code></td><td>{e(w.kind)}</td>"
        f"<td class=muted>{_time(w.since)}</td><td>{_actions(w, csrf, login, back)}</td></tr>"
        for w in items
    )
    return (
        "<table id=waiting><tr><th>session</th><th>call</th><th>tool</th><th>arguments</th><th>waiting for</th>"
        f"<th>since</th><th>answer</th></tr>{rows}</table>"
    )


def session_page(
    summary: SessionSummary,
    t: Timeline,
    tree: TreeNode,
    events: Sequence[RawEvent],
    waiting_here: Sequence[Waiting],
    *,
    login: Login,
    csrf: str,
    num_events: int,
) -> str:
    sid = summary.session_id
    turns = "".join(
        f"<tr><td>{e(x.call_id)}</td><td class=n>{x.turn}</td><td class=n>{x.prompt_tokens:,}</td>"
        f"<td class=n>{x.cached_tokens:,}</td>"
        f"<td class=n>{(x.cached_tokens / x.prompt_tokens if x.prompt_tokens else 0):.0%}</td></tr>"
        for x in t.turns
    )
    listed = [b for b in t.bars if b.lane in ("tool", "approval", "kv")]
    tools = "".join(f"<tr><td>{e(b.label)}</td><td>{e(b.detail)}</td></tr>" for b in listed[-MAX_LISTED:])
    if len(listed) > MAX_LISTED:
        note = f"the last {MAX_LISTED} of {len(listed):,} (all in the timeline)"
        tools = f"<tr><td colspan=2 class=muted>{note}</td></tr>{tools}"
    raw = "".join(
        f"<tr><td class=mono>{e(r.topic)}/{r.partition}@{r.offset}</td><td class=n>{r.seq}</td>"
        f'<td class=mono title="hash {e(r.hash)}">{e(r.prev_hash[:12])}</td>'
        f"<td>{e(r.kind)}</td><td>{e(r.actor)}</td><td class=muted>{_time(r.occurred_at)}</td>"
        f'<td class=mono title="{e(r.body_json)}">{e(r.body_json[:160])}</td></tr>'
        for r in events
    )
    held = ""
    if waiting_here:
        held = "<h2>Waiting for an operator</h2>" + _waiting_table(waiting_here, csrf, login, f"/sessions/{sid}")
    shown = f"the last {len(events):,} of {num_events:,}" if len(events) < num_events else f"{num_events:,}"
    body = (
        f"<h1>Session {e(sid)} {_status(summary.status)}</h1>"
        f'<p class="card">program <b>{e(summary.program)}</b> · {summary.turns} turns'
        f" · {summary.num_tool_calls} tool calls · job {'-' if summary.job_s is None else f'{summary.job_s:.2f} s'}"
        f" · tokens computed {summary.computed_tokens:,}"
        f" · from cache {summary.cached_tokens:,}</p>"
        f"<h2>Timeline</h2><div class=card>{timeline_svg(t)}</div>"
        f"{held}"
        "<h2>Cached tokens per turn</h2><table id=turns><tr><th>call</th><th class=n>turn</th>"
        f"<th class=n>prompt</th><th class=n>cached</th><th class=n>hit</th></tr>{turns}</table>"
        f"<h2>Tool calls, verdicts and votes, approvals, KV decisions</h2><table id=decisions>{tools}</table>"
        f"<h2>Checkpoints, forks and merges</h2><ul class=tree id=tree>{_tree(tree, sid)}</ul>"
        f"<h2>Raw events ({shown}, with their chain position)</h2>"
        "<table id=events><tr><th>topic/partition@offset</th><th class=n>seq</th><th>prev hash</th><th>event</th>"
        f"<th>actor</th><th>occurred</th><th>body</th></tr>{raw}</table>"
    )
    return _page(f"Session {sid}", body, login)


def waiting_page(items: Sequence[Waiting], *, login: Login, csrf: str, notice: str = "") -> str:
    note = f'<p class="card">{e(notice)}</p>' if notice else ""
    body = f"<h1>Approvals and in-doubt calls waiting</h1>{note}{_waiting_table(items, csrf, login, '/waiting')}"
    return _page("Waiting", body, login, "/waiting")


def _decisions_svg(view: CacheView, width: int = 1100, height: int = 160) -> str:
    if not view.buckets:
        return '<p class="muted">no cache decisions yet</p>'
    top = max(1, *(sum(c.values()) for _, c in view.buckets))
    bw = (width - 60) / len(view.buckets)
    parts = [
        f'<svg id="decisions-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height + 40}" font-size="11">'
    ]
    for i, (at, counts) in enumerate(view.buckets):
        y = float(height)
        for action in _ACTION_COLOR:
            n = counts.get(action, 0)
            if not n:
                continue
            h = n / top * (height - 10)
            y -= h
            parts.append(
                f'<rect x="{50 + i * bw:.1f}" y="{y:.1f}" width="{bw - 2:.1f}" height="{h:.1f}" '
                f'fill="{_ACTION_COLOR[action]}"><title>{_time(at)}: {n} {action}</title></rect>'
            )
    parts.append(f'<text x="4" y="14">{top}</text><text x="4" y="{height}">0</text>')
    first, last = view.buckets[0][0], view.buckets[-1][0]
    parts.append(
        f'<text x="50" y="{height + 12}" fill="#6b7488">{_time(first)}</text>'
        f'<text x="{width - 10}" y="{height + 12}" text-anchor="end" fill="#6b7488">{_time(last)}</text>'
    )
    legend = "".join(
        f'<rect x="{50 + i * 110}" y="{height + 22}" width="10" height="10" fill="{c}"/>'
        f'<text x="{64 + i * 110}" y="{height + 31}">{a}</text>'
        for i, (a, c) in enumerate(_ACTION_COLOR.items())
    )
    parts.append(legend + "</svg>")
    return "".join(parts)


def cache_page(view: CacheView, *, login: Login, block_tokens: int = 16) -> str:
    pinned = "".join(
        f"<tr><td>{_session_link(p.session_id)}</td><td>{e(p.engine_id)}</td><td>{e(p.action)}</td>"
        f"<td class=n>{p.num_blocks:,}</td><td class=n>{'-' if p.ttl_ms is None else f'{p.ttl_ms:,}'}</td>"
        f"<td class=muted>{_time(p.expires_at)}</td></tr>"
        for p in view.pinned
    )
    engines = "".join(
        f"<tr><td>{e(engine)}</td><td class=n>{n:,}</td><td class=n>{n * block_tokens:,}</td></tr>"
        for engine, n in sorted(view.blocks_by_engine.items())
    )
    hit = view.hit_tokens / view.prompt_tokens if view.prompt_tokens else 0.0
    body = (
        "<h1>KV cache</h1>"
        f'<p class="card">KV cache hits: {view.hit_tokens:,} of {view.prompt_tokens:,} prompt tokens ({hit:.0%})</p>'
        "<h2>Memory held for pinned sessions, per engine</h2><table id=engines><tr><th>engine</th>"
        f"<th class=n>blocks</th><th class=n>tokens</th></tr>{engines or _NONE.format(3)}</table>"
        "<h2>Sessions pinned</h2><table id=pinned><tr><th>session</th><th>engine</th><th>decision</th>"
        f"<th class=n>blocks</th><th class=n>TTL ms</th><th>expires</th></tr>"
        f"{pinned or '<tr><td colspan=6 class=muted>none</td></tr>'}</table>"
        f"<h2>Decisions over time</h2><div class=card>{_decisions_svg(view)}</div>"
    )
    return _page("Cache", body, login, "/cache")


def filter_query(status: str, program: str) -> str:
    return urlencode({k: v for k, v in (("status", status), ("program", program)) if v})


def body_json(body: object) -> str:
    """An event body as compact JSON (for the raw events table)."""
    dump = getattr(body, "model_dump", None)
    return json.dumps(dump(mode="json") if dump else body, separators=(",", ":"), default=str)
