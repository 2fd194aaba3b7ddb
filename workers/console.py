"""The web console (``python -m workers.console``, ``logctl ui``): server-rendered pages over the
projector's read model and the log (docs/console.md).

Pages: ``/`` the sessions (filters ``?status=`` and ``?program=``), ``/sessions/<id>`` one
session (its timeline, cached tokens per turn, verdicts and votes, approvals, KV decisions,
its fork tree and its raw events with their chain position), ``/waiting`` the held and
in-doubt calls with their buttons, ``/cache`` the KV cache. ``POST /decide`` appends an
operator's answer through ``workers.operator.decide``, the same call as ``logctl approve``.

**Who may do what.** Every page needs a login (``POST /login`` with the operator's or the
auditor's password; a cookie signed with HMAC, ``services.console_auth``). Only an operator
login may post ``/decide``, and only with the CSRF token of its own pages; ``--read-only``
makes every login an auditor's and opens the log as the read-only ``auditor`` principal.
Without an operator or auditor password configured the console does not start: there is no
anonymous access.

**Bad input** gets a page and a status, never a traceback: 400 for a malformed id or form,
401 for a post without a login, 403 for a forged or missing CSRF token or an auditor's post,
404 for an unknown session or page, 503 while the read model is unreachable. The passwords and
the secret are never logged nor shown.

The rows come from the read model (``workers.projector``); what to show is computed by
``services.console_views`` and rendered by ``services.console_html`` (both pure).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import asyncpg
from aiohttp import web

from log import SharedLog, open_log
from schemas import events as ev
from services import console_html as pages
from services import console_views as views
from services.console_auth import COOKIE, DEFAULT_TTL_S, Login, Role, check_csrf, check_password, csrf_token, issue
from services.console_auth import verify as verify_cookie
from workers.config import log_namespace
from workers.operator import UnknownSession, decide
from workers.projector import ReadModel, model_url

__all__ = ["Console", "ConsoleConfig", "main", "serve"]

_log = logging.getLogger(__name__)

PASSWORD_ENV = "AGENTLOG_CONSOLE_PASSWORD"
AUDITOR_PASSWORD_ENV = "AGENTLOG_CONSOLE_AUDITOR_PASSWORD"
SECRET_ENV = "AGENTLOG_CONSOLE_SECRET"
MAX_RAW_EVENTS = 500
"""The raw events shown on a session page (the latest ones): a long session stays one page."""
SESSIONS_LIMIT = 200
DECISIONS_LIMIT = 5000
"""KV decisions the cache page reads (the latest)."""


@dataclass(frozen=True)
class ConsoleConfig:
    operator_password: str | None
    auditor_password: str | None
    secret: bytes
    read_only: bool = False
    login_ttl_s: float = DEFAULT_TTL_S


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _html(text: str, status: int = 200) -> web.Response:
    return web.Response(text=text, status=status, content_type="text/html", charset="utf-8")


class Console:
    """The console's HTTP handlers over one read model and one log."""

    def __init__(
        self,
        config: ConsoleConfig,
        log: SharedLog,
        pool: asyncpg.Pool,
        schema: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.log = log
        self.pool = pool
        self.schema = schema
        self.clock = clock

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=64 * 1024)
        app.router.add_get("/health", self.health)
        app.router.add_get("/login", self.login_form)
        app.router.add_post("/login", self.login)
        app.router.add_post("/logout", self.logout)
        app.router.add_get("/", self.sessions)
        app.router.add_get("/sessions/{session_id}", self.session)
        app.router.add_get("/waiting", self.waiting)
        app.router.add_get("/cache", self.cache)
        app.router.add_post("/decide", self.decide)
        return app

    # -- plumbing --------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPRedirection:
            raise
        except web.HTTPException as e:
            return _html(pages.error_page(e.status, e.text or e.reason, self._login(request)), e.status)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as e:
            _log.warning(
                "console: %s %s: the read model or the log failed: %s", request.method, request.path, type(e).__name__
            )
            return _html(pages.error_page(503, "the read model or the log is unreachable; try again"), 503)
        except Exception:
            _log.exception("console: %s %s failed", request.method, request.path)
            return _html(pages.error_page(500, "internal error (the console's log has the details)"), 500)

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self.clock(), UTC)

    def _login(self, request: web.Request) -> Login | None:
        login = verify_cookie(self.config.secret, request.cookies.get(COOKIE), self.clock())
        if login is not None and self.config.read_only and login.can_write:
            login = Login(login.user, Role.AUDITOR, login.expires_at, login.nonce)
        return login

    def _require(self, request: web.Request) -> Login:
        login = self._login(request)
        if login is None:
            raise web.HTTPSeeOther(f"/login?next={request.path_qs if request.path != '/login' else '/'}")
        return login

    def _t(self, table: str) -> str:
        return f'"{self.schema}".{table}'

    async def _rows(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        return [dict(r) for r in await self.pool.fetch(sql, *args)]

    # -- login -----------------------------------------------------------------------------

    async def health(self, _request: web.Request) -> web.Response:
        try:
            await self.pool.fetchval("SELECT 1")
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            return web.json_response({"status": "read model unreachable"}, status=503)
        return web.json_response({"status": "ok", "read_only": self.config.read_only})

    async def login_form(self, request: web.Request) -> web.Response:
        return _html(pages.login_page(next_path=_local(request.query.get("next"))))

    async def login(self, request: web.Request) -> web.Response:
        form = await request.post()
        password, user = str(form.get("password", "")), str(form.get("user", "")).strip()[:64] or "operator"
        next_path = _local(str(form.get("next", "/")))
        if check_password(password, self.config.operator_password):
            role = Role.AUDITOR if self.config.read_only else Role.OPERATOR
        elif check_password(password, self.config.auditor_password):
            role = Role.AUDITOR
        else:
            _log.info("console: a failed login for %r", user)
            return _html(pages.login_page("wrong password", next_path), 401)
        login = Login(user, role, self.clock() + self.config.login_ttl_s, secrets.token_urlsafe(16))
        response = web.HTTPSeeOther(next_path)
        response.set_cookie(
            COOKIE, issue(self.config.secret, login), httponly=True, samesite="Strict", path="/",
            max_age=int(self.config.login_ttl_s),
        )  # fmt: skip
        raise response

    async def logout(self, _request: web.Request) -> web.Response:
        response = web.HTTPSeeOther("/login")
        response.del_cookie(COOKIE, path="/")
        raise response

    # -- pages -----------------------------------------------------------------------------

    _SUMMARY = """
        SELECT s.*, l.turns, l.prompt_tokens, l.cached_tokens, t.num_tools FROM {sessions} s
        LEFT JOIN LATERAL (SELECT count(*) AS turns, sum(prompt_tokens) AS prompt_tokens,
                                  sum(cached_tokens) AS cached_tokens
                           FROM {llm} c WHERE c.session_id = s.session_id) l ON true
        LEFT JOIN LATERAL (SELECT count(*) AS num_tools FROM {tools} c WHERE c.session_id = s.session_id) t ON true
    """

    def _summary_sql(self) -> str:
        return self._SUMMARY.format(sessions=self._t("sessions"), llm=self._t("llm_calls"), tools=self._t("tool_calls"))

    async def sessions(self, request: web.Request) -> web.Response:
        login = self._require(request)
        status = request.query.get("status", "")
        program = request.query.get("program", "")
        if status and status not in views.STATUSES:
            raise web.HTTPBadRequest(text=f"unknown status {status[:40]!r}: one of {', '.join(views.STATUSES)}")
        if len(program) > 200:
            raise web.HTTPBadRequest(text="program name too long")
        sql = (
            f"{self._summary_sql()} WHERE ($1 = '' OR COALESCE(s.program, s.requested_program) = $1) "
            f"AND ($2 = '' OR {views.STATUS_SQL} = $2) "
            "ORDER BY COALESCE(s.requested_at, s.started_at) DESC NULLS LAST, s.session_id LIMIT $3"
        )
        rows = await self._rows(sql, program, status, SESSIONS_LIMIT)
        programs = [
            r["p"]
            for r in await self.pool.fetch(
                f"SELECT DISTINCT COALESCE(program, requested_program) AS p FROM {self._t('sessions')} "
                "WHERE COALESCE(program, requested_program) IS NOT NULL ORDER BY 1 LIMIT 100"
            )
        ]
        now = self._now()
        summaries = [views.summarize(r, now) for r in rows]
        return _html(
            pages.sessions_page(
                summaries, status=status, program=program, programs=programs, login=login, limit=SESSIONS_LIMIT
            )
        )

    async def session(self, request: web.Request) -> web.Response:
        login = self._require(request)
        session_id = request.match_info["session_id"]
        if not views.valid_id(session_id):
            raise web.HTTPBadRequest(text="malformed session id")
        found = await self._rows(f"{self._summary_sql()} WHERE s.session_id = $1", session_id)
        if not found:
            raise web.HTTPNotFound(text=f"no session {session_id!r} in the read model (it may not be projected yet)")
        session = found[0]
        by_session = "WHERE session_id = $1"
        llm = await self._rows(f"SELECT * FROM {self._t('llm_calls')} {by_session}", session_id)
        tools = await self._rows(f"SELECT * FROM {self._t('tool_calls')} {by_session}", session_id)
        votes = await self._rows(f"SELECT * FROM {self._t('votes')} {by_session}", session_id)
        approvals = await self._rows(f"SELECT * FROM {self._t('approvals')} {by_session} ORDER BY at", session_id)
        kv = await self._rows(f"SELECT * FROM {self._t('kv_decisions')} {by_session} ORDER BY at", session_id)
        forks = await self._rows(f"SELECT * FROM {self._t('forks')}")
        family = _family(session_id, forks, session.get("parent_session_id"))
        checkpoints = await self._rows(
            f"SELECT * FROM {self._t('checkpoints')} WHERE session_id = ANY($1::text[])", list(family)
        )
        merges = await self._rows(f"SELECT * FROM {self._t('merges')} WHERE session_id = ANY($1::text[])", list(family))
        history = await self.log.history(session_id)
        now = self._now()
        events = [
            pages.RawEvent(
                e.position.topic,
                e.position.partition,
                e.position.offset,
                e.seq,
                type(e.body).__name__,
                e.envelope.actor,
                e.envelope.occurred_at,
                e.envelope.prev_hash.hex(),
                e.envelope.hash.hex(),
                e.envelope.event_id,
                pages.body_json(e.body),
            )
            for e in history[-MAX_RAW_EVENTS:]
        ]
        here = views.waiting(tools, approvals, {session_id: session})
        return _html(
            pages.session_page(
                views.summarize(session, now),
                views.timeline(session, llm, tools, votes, approvals, kv, now),
                views.fork_tree(session_id, forks, checkpoints, merges),
                events,
                here,
                login=login,
                csrf=csrf_token(self.config.secret, login),
                num_events=len(history),
            )
        )

    async def _waiting(self) -> list[views.Waiting]:
        tools = await self._rows(
            f"SELECT c.* FROM {self._t('tool_calls')} c JOIN {self._t('sessions')} s USING (session_id) "
            "WHERE s.finished_at IS NULL AND s.failed_at IS NULL AND "
            "((c.verdict IS NULL) OR (c.in_doubt_at IS NOT NULL AND c.completed_at IS NULL AND c.failed_at IS NULL))"
        )
        ids = sorted({t["session_id"] for t in tools})
        sessions = {
            r["session_id"]: r
            for r in await self._rows(f"SELECT * FROM {self._t('sessions')} WHERE session_id = ANY($1::text[])", ids)
        }
        approvals = await self._rows(f"SELECT * FROM {self._t('approvals')} WHERE session_id = ANY($1::text[])", ids)
        return views.waiting(tools, approvals, sessions)

    async def waiting(self, request: web.Request) -> web.Response:
        login = self._require(request)
        notice = request.query.get("done", "")[:200]
        return _html(
            pages.waiting_page(
                await self._waiting(), login=login, csrf=csrf_token(self.config.secret, login), notice=notice
            )
        )

    async def cache(self, request: web.Request) -> web.Response:
        login = self._require(request)
        decisions = await self._rows(
            f"SELECT * FROM {self._t('kv_decisions')} ORDER BY at DESC LIMIT $1", DECISIONS_LIMIT
        )
        hits = await self._rows(
            "SELECT COALESCE(sum(cached_tokens), 0) AS cached_tokens, "
            "COALESCE(sum(prompt_tokens), 0) AS prompt_tokens "
            f"FROM {self._t('cache_hits')}"
        )
        return _html(pages.cache_page(views.cache_view(decisions, hits, self._now()), login=login))

    # -- the one write ---------------------------------------------------------------------

    async def decide(self, request: web.Request) -> web.Response:
        login = self._login(request)
        if login is None:
            raise web.HTTPUnauthorized(text="log in first: a decision needs an operator's login")
        form = await request.post()
        if not check_csrf(self.config.secret, login, str(form.get("csrf", "")) or None):
            raise web.HTTPForbidden(text="this form is not one the console gave you (missing or wrong CSRF token)")
        if not login.can_write:
            raise web.HTTPForbidden(text="read-only: an auditor cannot approve or resolve calls")
        session_id, call_id = str(form.get("session_id", "")), str(form.get("call_id", ""))
        if not views.valid_id(session_id) or not views.valid_id(call_id):
            raise web.HTTPBadRequest(text="malformed session or call id")
        try:
            decision = ev.ApprovalDecision(str(form.get("decision", "")))
        except ValueError:
            raise web.HTTPBadRequest(text="unknown decision: one of APPROVE, DENY, RETRY, MARK_DONE") from None
        reason = str(form.get("reason", ""))[:500] or f"from the console by {login.user}"
        try:
            _, position = await decide(
                self.log, session_id, call_id, decision, author=f"{login.user} (console)", reason=reason
            )
        except UnknownSession as e:
            raise web.HTTPNotFound(text=str(e)) from None
        _log.info("console: %s %s %s by %s at %s", decision.value, session_id, call_id, login.user, position)
        back = _local(str(form.get("back", "/waiting")))
        done = f"{decision.value} {session_id} {call_id} appended at {position} (the lists show it once projected)"
        raise web.HTTPSeeOther(back + ("?" if "?" not in back else "&") + urlencode({"done": done}))


def _local(path: str | None) -> str:
    """A path of this site to go back to (never another site's: no open redirect)."""
    if not path or not path.startswith("/") or path.startswith("//") or "\\" in path:
        return "/"
    return path[:500]


def _family(session_id: str, forks: list[dict[str, Any]], parent: str | None) -> set[str]:
    tree = views.fork_tree(session_id, forks, [], [])
    out: set[str] = set()
    stack = [tree]
    while stack:
        n = stack.pop()
        out.add(n.session_id)
        stack.extend(n.children)
    return out | {session_id} | ({parent} if parent else set())


def _password(file: Path | None, env: str) -> str | None:
    if file is not None:
        try:
            return file.read_text().strip() or None
        except OSError as e:
            raise SystemExit(f"console: cannot read the password file {file}: {e.strerror}") from None
    return os.environ.get(env) or None


def config_from(args: argparse.Namespace) -> ConsoleConfig:
    operator = _password(args.password_file, PASSWORD_ENV)
    auditor = _password(args.auditor_password_file, AUDITOR_PASSWORD_ENV)
    if not operator and not auditor:
        raise SystemExit(
            f"console: no password: set {PASSWORD_ENV} (operator) or {AUDITOR_PASSWORD_ENV} (read-only), "
            "or pass --password-file; the console has no anonymous access"
        )
    secret = os.environ.get(SECRET_ENV)
    # Without a configured secret, logins last as long as this process.
    return ConsoleConfig(
        operator, auditor, secret.encode() if secret else secrets.token_bytes(32), read_only=args.read_only
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-url", default=os.environ.get("AGENTLOG_LOG_URL"), help="default: embedded Postgres")
    parser.add_argument("--model-url", default=None, help="Postgres of the read model (as the projector's)")
    parser.add_argument("--host", default=os.environ.get("AGENTLOG_CONSOLE_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("AGENTLOG_CONSOLE_PORT") or 8300))
    parser.add_argument("--read-only", action="store_true", help="every login reads only (auditors)")
    parser.add_argument(
        "--password-file", type=Path, default=None, help=f"operator password (default: ${PASSWORD_ENV})"
    )
    parser.add_argument(
        "--auditor-password-file",
        type=Path,
        default=None,
        help=f"read-only password (default: ${AUDITOR_PASSWORD_ENV})",
    )


async def serve(
    config: ConsoleConfig,
    log_url: str | None,
    model: str | None,
    host: str,
    port: int,
    *,
    ready: Callable[[int], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve the console until ``stop`` is set (or SIGTERM / SIGINT)."""
    url = model_url(model, log_url)
    if url is None:
        raise SystemExit("console: no Postgres for the read model: pass --model-url or AGENTLOG_READ_MODEL_URL")
    stop = stop or asyncio.Event()
    async with open_log(log_url, actor="auditor" if config.read_only else "operator") as log:
        schema = ReadModel(url, log_namespace(log)).schema
        pool = await asyncpg.create_pool(url, min_size=1, max_size=4)
        try:
            runner = web.AppRunner(Console(config, log, pool, schema).app(), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, host, port)
            try:
                await site.start()
            except OSError as e:
                raise SystemExit(f"console: cannot listen on {host}:{port}: {e.strerror}") from None
            bound = int(runner.addresses[0][1])
            _log.info(
                "console: serving http://%s:%d/ (schema %s%s)",
                host,
                bound,
                schema,
                ", read-only" if config.read_only else "",
            )
            if ready is not None:
                ready(bound)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            await runner.cleanup()
        finally:
            await pool.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workers.console", description="agentlog's web console")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("AGENTLOG_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = config_from(args)
    asyncio.run(
        serve(
            config,
            args.log_url,
            args.model_url,
            args.host,
            args.port,
            ready=lambda p: print(f"console on http://{args.host}:{p}/", flush=True),
        )
    )


if __name__ == "__main__":
    main()
