"""The web console over a real read model (Postgres) and a real log: every page, and every bad input.

A log with a finished session, a payment held for approval, an in-doubt call and KV decisions is
projected (``workers.projector.rebuild``), then the console (``workers.console.serve``) answers
an HTTP client on a free port. Each bad input gets its page and status (never a 500), no
password or secret appears in a response, and only an operator's login with its CSRF token
appends an ``ApprovalGiven`` (counted in the log).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from pydantic import BaseModel

from cli.common import init_log
from log import open_log
from schemas import events as ev
from services import console_views as views
from services.console_auth import COOKIE, csrf_token, verify
from tests.unit.services.analysis_samples import completed, proposed, started
from workers.console import ConsoleConfig, serve
from workers.projector import ReadModel, rebuild

pytestmark = pytest.mark.integration

PASSWORD = "op-" + uuid.uuid4().hex
AUDITOR = "au-" + uuid.uuid4().hex
SECRET = uuid.uuid4().bytes


def _payment() -> ev.ToolCallProposed:
    return ev.ToolCallProposed(
        call_id="tool-1", tool="payment", arguments_json='{"account": "x", "amount_cents": 9}',
        effect_class=ev.EffectClass.IRREVERSIBLE, idempotency_key="pay",
    )  # fmt: skip


LOG: dict[str, list[tuple[str, BaseModel]]] = {
    "done": [
        ("operator", ev.SessionRequested(program="trace", args_json="{}", author="t")),
        ("planner", ev.SessionStarted(program="trace", args_json="{}")),
        ("planner", started("llm-0", 0, 512)),
        ("planner", completed("llm-0", 512, 0, 0.0, 5.0, 5.0)),
        ("planner", proposed("tool-1", "search")),
        (
            "decider",
            ev.ToolCallCommitted(
                call_id="tool-1",
                votes=[ev.Vote(voter="allow_list", decision=ev.VoteDecision.APPROVE, reason="allowed")],
                policy="unanimous",
            ),
        ),
        ("executor", ev.ToolCallStarted(call_id="tool-1", tool="search", idempotency_key="k", attempt=1)),
        ("executor", ev.ToolCallCompleted(call_id="tool-1", result_json="{}", result_tokens=8, duration_ms=3.0)),
        (
            "cache-manager",
            ev.CacheDecisionMade(
                engine_id="sim-0", action=ev.CacheAction.PRESERVE, ttl_ms=600_000, score=1.0, num_blocks=4, reason="gap"
            ),
        ),
        ("planner", started("llm-2", 1, 1536)),
        ("planner", completed("llm-2", 1536, 512, 0.0, 5.0, 5.0)),
        ("planner", ev.SessionFinished(output_json="{}", num_llm_calls=2, num_tool_calls=1)),
    ],
    "held": [
        ("operator", ev.SessionRequested(program="script", args_json="{}", author="t")),
        ("planner", ev.SessionStarted(program="script", args_json="{}")),
        ("planner", _payment()),
    ],
    "doubt": [
        ("operator", ev.SessionRequested(program="script", args_json="{}", author="t")),
        ("planner", ev.SessionStarted(program="script", args_json="{}")),
        ("planner", _payment()),
        ("decider", ev.ToolCallCommitted(call_id="tool-1", votes=[], policy="unanimous")),
        ("executor", ev.ToolCallStarted(call_id="tool-1", tool="payment", idempotency_key="pay", attempt=1)),
        (
            "executor",
            ev.ToolCallInDoubt(
                call_id="tool-1", tool="payment", effect_class=ev.EffectClass.IRREVERSIBLE, reason="died mid-call"
            ),
        ),
    ],
}


@dataclass
class Site:
    base: str
    namespace: str
    log_url: str

    def client(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(self.base, cookie_jar=aiohttp.CookieJar(unsafe=True))

    async def login(self, client: aiohttp.ClientSession, password: str = PASSWORD) -> None:
        async with client.post("/login", data={"user": "ops", "password": password}, allow_redirects=False) as r:
            assert r.status == 303, await r.text()

    async def approvals(self, session_id: str) -> list[ev.ApprovalGiven]:
        async with open_log(self.log_url, actor="auditor", namespace=self.namespace) as log:
            return [e.body for e in await log.history(session_id) if isinstance(e.body, ev.ApprovalGiven)]


async def _write(url: str, namespace: str) -> None:
    await init_log(url, 2, namespace=namespace)
    actors = {actor for events in LOG.values() for actor, _ in events}
    logs = {a: open_log(url, actor=a, namespace=namespace) for a in actors}
    for log in logs.values():
        await log.start()
    try:
        for session, events in LOG.items():
            for actor, body in events:
                await logs[actor].append(session, body)  # type: ignore[arg-type]
    finally:
        for log in logs.values():
            await log.close()


@asynccontextmanager
async def _console(pg_url: str, namespace: str, *, read_only: bool = False) -> AsyncIterator[Site]:
    import os

    os.environ["AGENTLOG_NAMESPACE"] = namespace
    try:
        await _write(pg_url, namespace)
        async with open_log(pg_url, actor="projector", namespace=namespace) as log:
            await rebuild(log, pg_url, group=f"projector-{namespace}")
        stop, bound = asyncio.Event(), asyncio.get_running_loop().create_future()
        config = ConsoleConfig(PASSWORD, AUDITOR, SECRET, read_only=read_only)
        task = asyncio.create_task(serve(config, pg_url, pg_url, "127.0.0.1", 0, ready=bound.set_result, stop=stop))
        port = await asyncio.wait_for(bound, 30)
        try:
            yield Site(f"http://127.0.0.1:{port}", namespace, pg_url)
        finally:
            stop.set()
            await task
    finally:
        del os.environ["AGENTLOG_NAMESPACE"]


def _csrf(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found, page
    return found.group(1)


async def _scenario(pg_url: str, namespace: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with _console(pg_url, namespace) as site, site.client() as anon, site.client() as ops:
        # No login: pages redirect to the login form, a post is refused and appends nothing.
        async with anon.get("/", allow_redirects=False) as r:
            out["anon_get"] = (r.status, r.headers.get("Location"))
        async with anon.post("/decide", data={"session_id": "held", "call_id": "tool-1", "decision": "APPROVE"}) as r:
            out["anon_post"] = (r.status, await r.text())
        async with anon.post("/login", data={"password": "wrong"}) as r:
            out["wrong_password"] = (r.status, await r.text())
        async with anon.get("/health") as r:
            out["health"] = r.status
        async with anon.get("/", cookies={"agentlog_console": "forged.cookie"}, allow_redirects=False) as r:
            out["forged_cookie"] = r.status

        await site.login(ops)
        for path in ("/", "/?status=finished", "/?program=script", "/sessions/done", "/waiting", "/cache"):
            async with ops.get(path) as r:
                out[path] = (r.status, await r.text())
        for path in ("/sessions/ghost", "/sessions/bad%20id!", "/?status=bogus", "/nope"):
            async with ops.get(path) as r:
                out[path] = (r.status, await r.text())
        waiting = out["/waiting"][1]
        token = _csrf(waiting)
        form = {"session_id": "held", "call_id": "tool-1", "decision": "APPROVE", "csrf": token}
        async with ops.post("/decide", data={**form, "csrf": "forged"}) as r:
            out["forged_csrf"] = r.status
        async with ops.post("/decide", data={k: v for k, v in form.items() if k != "csrf"}) as r:
            out["missing_csrf"] = r.status
        async with ops.post("/decide", data={**form, "decision": "MAYBE"}) as r:
            out["bad_decision"] = r.status
        async with ops.post("/decide", data={**form, "session_id": "../etc"}) as r:
            out["bad_id"] = r.status
        async with ops.post("/decide", data={**form, "session_id": "ghost"}) as r:
            out["ghost"] = (r.status, await r.text())
        out["approvals_before"] = len(await site.approvals("held"))
        async with ops.post("/decide", data={**form, "back": "//evil.example/"}, allow_redirects=False) as r:
            out["approve"] = (r.status, r.headers.get("Location"))
        async with ops.post("/decide", data={**form, "session_id": "doubt", "decision": "MARK_DONE"}) as r:
            out["mark_done"] = r.status
        out["approvals_held"] = await site.approvals("held")
        out["approvals_doubt"] = await site.approvals("doubt")

        async with site.client() as auditor:
            await site.login(auditor, AUDITOR)
            async with auditor.get("/waiting") as r:
                page = await r.text()
                out["auditor_waiting"] = (r.status, page)
            # An auditor's page has no form; even with its own valid token the post is refused.
            cookie = next(c.value for c in auditor.cookie_jar if c.key == COOKIE)
            login = verify(SECRET, cookie, time.time())
            assert login is not None
            async with auditor.post("/decide", data={**form, "csrf": csrf_token(SECRET, login)}) as r:
                out["auditor_post"] = r.status

        # The status the list filters on in SQL is the one the views derive in Python.
        model = await ReadModel(pg_url, namespace).start()
        try:
            rows = await model.conn.fetch(f'SELECT s.*, {views.STATUS_SQL} AS st FROM "{model.schema}".sessions s')
            out["statuses"] = {r["session_id"]: (r["st"], views.session_status(dict(r))) for r in rows}
        finally:
            await model.close()
    return out


def test_the_console_pages_bad_input_and_the_one_write(pg_url: str, namespace: str) -> None:
    out = asyncio.run(_scenario(pg_url, namespace))
    assert out["anon_get"] == (303, "/login?next=/")
    assert out["anon_post"][0] == 401 and "log in first" in out["anon_post"][1]
    assert out["wrong_password"][0] == 401 and "wrong password" in out["wrong_password"][1]
    assert out["health"] == 200 and out["forged_cookie"] == 303

    status, page = out["/"]
    assert status == 200 and all(f"data-session='{s}'" in page for s in LOG)
    assert (
        "data-session='done'" in out["/?status=finished"][1]
        and "data-session='held'" not in out["/?status=finished"][1]
    )
    assert (
        "data-session='held'" in out["/?program=script"][1] and "data-session='done'" not in out["/?program=script"][1]
    )
    status, page = out["/sessions/done"]
    assert status == 200
    order = re.findall(r'data-lane="llm" data-ref="([^"]+)"', page)
    assert order == ["llm-0", "llm-2"], order
    assert 'data-lane="gap"' in page and 'data-lane="kv"' in page and "allow_list: APPROVE" in page
    assert "agent.actions/" in page and "SessionFinished" in page  # raw events with their chain position
    assert "PRESERVE" in out["/cache"][1] and "sim-0" in out["/cache"][1]
    waiting = out["/waiting"][1]
    assert "data-waiting='held/tool-1'" in waiting and "data-waiting='doubt/tool-1'" in waiting

    assert out["/sessions/ghost"][0] == 404 and "no session" in out["/sessions/ghost"][1]
    assert out["/sessions/bad%20id!"][0] == 400 and out["/?status=bogus"][0] == 400 and out["/nope"][0] == 404
    assert out["forged_csrf"] == out["missing_csrf"] == 403
    assert out["bad_decision"] == out["bad_id"] == 400 and out["ghost"][0] == 404
    assert out["approvals_before"] == 0
    status, location = out["approve"]
    assert status == 303 and location.startswith("/?done=APPROVE+held+tool-1+appended+at+"), "never another site"
    assert out["mark_done"] == 200
    assert [(a.decision, a.author) for a in out["approvals_held"]] == [(ev.ApprovalDecision.APPROVE, "ops (console)")]
    assert [a.decision for a in out["approvals_doubt"]] == [ev.ApprovalDecision.MARK_DONE]
    assert out["auditor_waiting"][0] == 200 and 'name="csrf"' not in out["auditor_waiting"][1]
    assert out["auditor_post"] == 403

    assert {s: pair[0] for s, pair in out["statuses"].items()} == {
        "done": "finished",
        "held": "running",
        "doubt": "running",
    }
    assert all(sql == py for sql, py in out["statuses"].values())
    everything = "".join(str(v) for v in out.values())
    assert PASSWORD not in everything and AUDITOR not in everything and SECRET.hex() not in everything
    assert "Traceback" not in everything
