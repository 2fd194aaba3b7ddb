"""The OpenAI-compatible gateway: an existing agent changes its base URL and gets agentlog.

``POST /v1/chat/completions`` (plain and ``stream: true``) and ``GET /v1/models``, in
OpenAI's format, in front of an engine's ``/v1/chat/completions`` (the sim engine or vLLM).
Each request names its session in the ``X-Agentlog-Session`` header; a request without one
is refused (400, ``missing_session``): a session is the unit everything else is about, and
guessing one would merge or split agents silently.

For each completion the gateway

1. refuses a bad request before anything is appended: 401 ``invalid_api_key`` (keys from
   ``AGENTLOG_GATEWAY_API_KEYS``, comma-separated, or ``--api-keys-file``, one per line; with
   none configured the gateway is open and says so at startup; keys are never logged),
   400 ``invalid_request_error`` (not JSON, no messages, no session), 404 ``model_not_found``,
   429 ``rate_limit_exceeded`` (``--max-requests-per-minute`` per session, with Retry-After),
   409 ``session_not_external`` (a session the planner runs);
2. answers a repeated request from the log without calling the engine: the same
   ``Idempotency-Key`` header, or the same session and the same request
   (``services.gateway.request_digest``);
3. records the ``tool`` messages that answer calls it released as
   ``GatewayToolResultReported`` with the gap (release to report);
4. forwards the request to the engine with ``session_id`` and a deterministic ``request_id``
   (so the engine's cache manager sees the session, and a retry after a crash is the
   engine's replay, not a second computation); streamed text passes through chunk by chunk;
5. appends ``GatewayLLMCallServed`` (durable before the client sees the end of the answer);
   the planner adopts it into the session's LLM call and tool proposals, the decider votes;
6. waits for each tool call's verdict (a held call waits for ``logctl approve``): committed
   calls reach the client, an aborted one is replaced by a text the agent can read
   (``services.gateway.refusal_text``).

**Several engines** (``--engine ID=URL[,size=..,model=..]`` repeated, or ``AGENTLOG_ENGINES``, as
for the planner; ``workers/engines/pool.py``): each completion is routed by the planner's router
(``--router``, default ``locality``, ``services.routing``): the session's next call goes to the
engine that holds its prefix unless that engine's queue (the prompt tokens of this gateway's
requests in flight there) makes recomputing elsewhere cheaper. Where the prefix is follows the
planner's rules (``services.gateway.locate_served``, ``services.placement``) with the planner's
views (``workers/cache_view.py``): the engine of its last recorded call, unless the engines'
``kv.events`` say it evicted some or all of it (or another engine still holds some) or the cache
manager's ``kv.decisions`` discarded it there; what they changed is in the route's detail. The
first read of kv.events runs in the background (routes go by the records alone until it has caught
up), and a view that cannot be read never fails a request. The decision is recorded as
``GatewayEngineRouted``, appended with the call's ``GatewayLLMCallServed`` (one durable wait per
request, as before); the planner adopts it as the session's ``EngineRouted``. An engine that
cannot be reached (connection refused or dropped before it answered) is marked down for
``--engine-down-s`` and the same request (same ``request_id``) is routed again (attempt + 1,
reason ``failover``) to another engine, which computes it once; a stream fails over only while
nothing of it has reached the client. With only ``--engine-url`` (the default) nothing is routed
and nothing of this is appended.

A session ends with ``GatewaySessionEnded`` (the planner records its ``SessionFinished``):
when no request of it arrived for ``--idle-timeout-s`` and none is in flight
(``services.gateway.idle_sessions``), or when the client posts
``/v1/sessions/{id}/finish``. A later request of an ended session gets 409
``session_finished`` (nothing appended; a re-sent request it recorded is still answered
from the log): a finished session stays finished, so the client starts another session id.
``--retain-ended-s`` (default an hour) after its end, the gateway forgets the session's calls and
keeps only how it ended (``_forget``): its re-sent requests get 409 ``session_finished`` from then
on, and the gateway's memory follows the sessions still going, not every session it ever served
(verdicts are kept for its own sessions only; the records stay in the log).

The gateway writes only agent.gateway and reads agent.gateway (its journal: steps,
idempotency, released calls), agent.verdicts and agent.actions (only to refuse, with 409
``session_not_external``, a session id the planner runs a program for), and with several engines
kv.events and kv.decisions (by scan, for routing: ``_locate``). It serves once it has read all three to
their end. The journal is read once, at start (``_read_journal``), and not consumed after: the gateway is its
only writer and folds each record it appends itself, once durable (``_append``); a poll would only hand its own
records back (decoded and verified again, about a third of its CPU). Requests of one session are served one at
a time (their steps are numbered in order).

Run: ``python -m workers.gateway [--log-url URL] (--engine-url http://127.0.0.1:8100 |
--engine ID=URL ... [--router locality|least_loaded|round_robin]) [--port 8200] [--models NAMES]
[--api-keys-file FILE] [--max-requests-per-minute N] [--idle-timeout-s S] [--retain-ended-s S]``.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
from aiohttp import web

from log import Draft, LoggedEvent, RecordError, SharedLog
from log import topics as topic_table
from log.chain import ChainVerifier
from log.topics import AGENT_ACTIONS, AGENT_GATEWAY, AGENT_VERDICTS
from schemas import events as ev
from services.gateway import (
    GatewayToolCall,
    RateLimiter,
    context_of,
    estimate_tokens,
    forgettable,
    idle_sessions,
    last_served,
    llm_step_id,
    locate_served,
    prompt_digest,
    prompt_estimate,
    refusal_text,
    reported_tool_results,
    request_digest,
    result_json,
    route_claim,
    size_for_model,
    tool_calls_of,
)
from services.placement import Located, routed
from services.routing import ROUTERS, CallRequest, make_router
from services.scheduling import CallPriority, ProgramProgress, SchedulingConfig, prioritize
from services.session import GATEWAY_PROGRAM, step_of, tool_call_id
from workers.cache_view import CacheDecisions, KVEvents
from workers.config import SCHEDULING_MODES, scheduling_config
from workers.engines.pool import EnginePool, parse_engines
from workers.worker import EventIds, Worker

__all__ = ["GATEWAY_EVENT_IDS", "GatewayWorker", "SESSION_HEADER"]

_log = logging.getLogger(__name__)

SESSION_HEADER = "X-Agentlog-Session"
IDEMPOTENCY_HEADER = "Idempotency-Key"
GATEWAY_EVENT_IDS = EventIds(uuid.UUID("0b6c4f7e-2d1a-4c8e-9f35-7a2e61d0c4b9"))
"""``(session id, kind, call id)``: a record appended again after a crash lands once."""
_SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,199}$")

Verdict = ev.ToolCallCommitted | ev.ToolCallAborted

_UNREACHABLE = (aiohttp.ClientConnectionError, asyncio.TimeoutError)
"""An engine that could not be reached or dropped the connection before it answered: the request
may go to another engine (nothing of it reached the client; the same request id makes a repeat on
the same engine its replay)."""


class RequestError(Exception):
    """A request the gateway refuses, in OpenAI's error format; nothing is appended for it."""

    def __init__(self, status: int, message: str, *, type_: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.code, self.param = status, type_, code, param

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        error = {"message": str(self), "type": self.type, "param": self.param, "code": self.code}
        return web.json_response({"error": error}, status=self.status, headers=headers)


def _bad_request(message: str, param: str | None = None, code: str = "invalid_request_error") -> RequestError:
    return RequestError(400, message, type_="invalid_request_error", code=code, param=param)


@dataclass
class GatewaySession:
    """What the gateway knows of one session, from agent.gateway and agent.verdicts."""

    session_id: str
    calls: dict[str, ev.GatewayLLMCallServed] = field(default_factory=dict)
    served_at: dict[str, datetime] = field(default_factory=dict)
    by_key: dict[str, str] = field(default_factory=dict)
    by_digest: dict[str, str] = field(default_factory=dict)
    reported: set[str] = field(default_factory=set)
    gaps_ms: dict[str, float] = field(default_factory=dict)
    """Each reported tool call's gap (release to report): the program's tool time."""
    released_at: dict[str, datetime] = field(default_factory=dict)
    """When each tool call went out to the client (this process's memory; after a restart the
    time its answer was recorded stands in)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ended: ev.GatewaySessionEnded | None = None
    ended_at: float = 0.0
    """When its end was recorded (epoch seconds of the log's clock): what ``--retain-ended-s`` counts from."""
    last_seen: float = 0.0
    """When a request of it last arrived or was answered (epoch seconds of the log's clock; after a
    restart, its last record's time): what the idle timeout counts from."""
    num_in_flight: int = 0
    """Requests being served or waiting for the lock: a session with one is not idle."""
    ranked: CallPriority | None = None
    """The priority of the call being served (one at a time: the lock), recorded with it."""
    routes: list[ev.GatewayEngineRouted] = field(default_factory=list)
    """The routes of the call being served (a failover adds one), appended with its record."""
    reporting: list[ev.GatewayToolResultReported] = field(default_factory=list)
    """The tool results of the request being served, appended while its engine call runs (folded
    into ``reported`` and ``gaps_ms`` once durable; its priority already counts their gaps)."""
    results_landed: asyncio.Future[None] | None = None
    """That append: the answer's record waits for it."""

    def seen(self, at: float) -> None:
        self.last_seen = max(self.last_seen, at)

    def record(self, served: ev.GatewayLLMCallServed, at: datetime) -> None:
        self.seen(at.timestamp())
        self.calls.setdefault(served.call_id, served)
        self.served_at.setdefault(served.call_id, at)
        if served.idempotency_key is not None:
            self.by_key.setdefault(served.idempotency_key, served.call_id)
        self.by_digest.setdefault(served.request_digest, served.call_id)

    @property
    def next_step(self) -> int:
        return max((step_of(c) + 1 + len(tool_calls_of(s)) for c, s in self.calls.items()), default=0)

    def released(self) -> list[tuple[GatewayToolCall, datetime]]:
        """Every tool call the client may have received, with when it went out."""
        return [
            (t, self.released_at.get(t.call_id, self.served_at[c]))
            for c, s in self.calls.items()
            for t in tool_calls_of(s)
        ]


class GatewayWorker(Worker):
    role = "gateway"
    # agent.actions: only to know the sessions the planner runs, which the gateway must not claim.
    # Not agent.gateway: read at start (``_read_journal``), then known from the gateway's own appends.
    topics = (AGENT_VERDICTS.name, AGENT_ACTIONS.name)
    journal = AGENT_GATEWAY.name
    # Every start reads from the beginning (``from_beginning``): offsets are only for monitoring
    # (lag), not worth a commit, a broker round trip, after every poll.
    commit_every_s = 1.0
    event_ids = GATEWAY_EVENT_IDS
    # A client waits for each append (one record per request): lingering to fill a batch only
    # adds to its latency. Concurrent requests still share batches, formed while one is in flight.
    linger_ms: ClassVar[int | None] = 0

    def __init__(
        self,
        log: SharedLog,
        *,
        engine_url: str,
        engine_id: str = "sim-0",
        models: tuple[str, ...] = (),
        api_keys: frozenset[str] = frozenset(),
        host: str = "127.0.0.1",
        port: int = 8200,
        max_requests_per_minute: int = 600,
        idle_timeout_s: float = 3600.0,
        retain_ended_s: float = 3600.0,
        scheduling: SchedulingConfig | None = None,
        pool: EnginePool | None = None,
        router: str = "locality",
        **kwargs: Any,
    ) -> None:
        super().__init__(log, **kwargs)
        self.pool = pool  # None: the one engine of engine_url, nothing routed
        self.router_name = router
        self.router = make_router(router)
        self.cache_view: CacheDecisions | None = None
        self.kv_view: KVEvents | None = None
        if pool is not None:
            engine_id, engine_url = pool.specs[0].engine_id, pool.specs[0].url
            # Where a session's prefix is, as the planner knows it (workers/cache_view.py).
            self.cache_view = CacheDecisions(log)
            self.kv_view = KVEvents(log)
        self.engine_url = engine_url.rstrip("/")
        self.engine_id = engine_id
        self.served_by: dict[str, set[str]] = {}
        """Model name -> the sizes of the engines configured to serve it (``model=`` of ``--engine``)."""
        for spec in pool.specs if pool is not None else []:
            self.served_by.setdefault(spec.model, set()).add(spec.size)
        self.models = models
        self.api_keys = api_keys
        self.host, self.port = host, port
        self.limiter = RateLimiter(max_requests_per_minute)
        self.idle_timeout_s = idle_timeout_s
        self.retain_ended_s = retain_ended_s
        self.scheduling = scheduling  # None: the engine request keeps whatever priority the client sent
        self.sessions: dict[str, GatewaySession] = {}
        self.forgotten: dict[str, ev.GatewaySessionEnded] = {}
        """Sessions ended more than ``retain_ended_s`` ago: only how they ended is kept (``_forget``)."""
        self.verdicts: dict[tuple[str, str], Verdict] = {}
        self.foreign: set[str] = set()
        """Sessions the planner runs a program for: a client may not drive them (409)."""
        self._waiters: dict[tuple[str, str], list[asyncio.Future[Verdict]]] = {}
        self._http: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.ready = asyncio.Event()
        """Set once the journal is read to its end and the HTTP server listens."""
        self.num_engine_requests = 0
        self.num_replayed = 0

    # ------------------------------------------------------------ process

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        env = os.environ.get
        parser.add_argument("--engine-url", default=env("AGENTLOG_ENGINE_URL", "http://127.0.0.1:8100"))
        parser.add_argument("--engine-id", default=env("AGENTLOG_ENGINE_ID", "sim-0"))
        parser.add_argument(
            "--engine",
            action="append",
            default=None,
            metavar="ID=URL[,size=small|large][,model=M]",
            help="one of several engines (repeat; default: AGENTLOG_ENGINES, ';'-separated); each completion "
            "is routed to one (workers/engines/pool.py), as the planner's calls are. Without any, --engine-url "
            "is the only engine",
        )
        parser.add_argument(
            "--router",
            choices=tuple(ROUTERS),
            default=env("AGENTLOG_ROUTER", "locality"),
            help="how completions are routed between several engines (services.routing)",
        )
        parser.add_argument(
            "--engine-down-s",
            type=float,
            default=float(env("AGENTLOG_ENGINE_DOWN_S", "10")),
            help="how long an engine that could not be reached is left out of routing",
        )
        parser.add_argument("--host", default=env("AGENTLOG_GATEWAY_HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(env("AGENTLOG_GATEWAY_PORT", "8200")))
        parser.add_argument(
            "--models",
            default=env("AGENTLOG_GATEWAY_MODELS", ""),
            help="comma-separated model names served (default: the engine's /v1/models)",
        )
        parser.add_argument(
            "--api-keys-file",
            type=Path,
            default=env("AGENTLOG_GATEWAY_API_KEYS_FILE"),
            help="one API key per line (besides AGENTLOG_GATEWAY_API_KEYS, comma-separated)",
        )
        parser.add_argument(
            "--max-requests-per-minute",
            type=int,
            default=int(env("AGENTLOG_GATEWAY_MAX_RPM", "600")),
            help="per session; more gets 429",
        )
        parser.add_argument(
            "--idle-timeout-s",
            type=float,
            default=float(env("AGENTLOG_GATEWAY_IDLE_TIMEOUT_S", "3600")),
            help="end a session after this many seconds without a request (0: never)",
        )
        parser.add_argument(
            "--retain-ended-s",
            type=float,
            default=float(env("AGENTLOG_GATEWAY_RETAIN_ENDED_S", "3600")),
            help="keep an ended session's calls in memory this long, to answer its re-sent requests from them; "
            "then only its end is kept and they get 409 session_finished (-1: keep every call of every session)",
        )
        parser.add_argument(
            "--scheduling",
            choices=SCHEDULING_MODES,
            default=None,
            help="plas: give each engine request its session's program-level priority, replacing the "
            "client's (services.scheduling); programs: the same without the attained-service term (for "
            "vLLM with --ranked-pins); off: pass the client's (default: AGENTLOG_SCHEDULING, else off: "
            "vLLM refuses a priority unless it runs --scheduling-policy priority)",
        )

    @classmethod
    async def create(cls, log: SharedLog, args: argparse.Namespace) -> GatewayWorker:
        models = tuple(m.strip() for m in args.models.split(",") if m.strip())
        pool = None
        if specs := parse_engines(args.engine or os.environ.get("AGENTLOG_ENGINES", "")):
            pool = EnginePool(specs, clients={}, down_s=args.engine_down_s)  # it forwards OpenAI bodies itself
        return cls(
            log,
            engine_url=args.engine_url,
            engine_id=args.engine_id,
            models=models,
            api_keys=load_api_keys(args.api_keys_file),
            host=args.host,
            port=args.port,
            max_requests_per_minute=args.max_requests_per_minute,
            idle_timeout_s=args.idle_timeout_s,
            retain_ended_s=args.retain_ended_s,
            scheduling=scheduling_config(args.scheduling, default="off"),
            pool=pool,
            router=args.router,
            group=args.group,
            instance_id=args.instance_id,
        )

    async def prepare(self) -> None:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        if not self.models:
            self.models = await self._engine_models()
        if not self.api_keys:
            _log.warning("gateway: no API keys configured, every client is let in")
        await self._read_journal()
        self.set_boundaries({t: await self.log.end_offsets(t) for t in self.topics})
        if self.kv_view is not None:  # the first read of kv.events runs in the background, as the planner's
            await self.kv_view.refresh()

    async def _read_journal(self) -> None:
        """Fold every record of agent.gateway, verified as a consumer verifies it (a record that fails
        is left out: the planner and the executor, which consume the topic, dead-letter it)."""
        topic = topic_table.topic(self.journal)
        verifier = ChainVerifier()
        for partition, end in sorted((await self.log.end_offsets(self.journal)).items()):
            async for record in self.log.scan(self.journal, partition, 0, end):
                try:
                    envelope = self.log.decode(record)
                    verifier.verify(topic, record.key, envelope, record.position)
                except RecordError:
                    continue
                self._fold(envelope.session_id, envelope.body, envelope.occurred_at)
        self._forget(self.log.clock().timestamp())

    async def _engine_models(self) -> tuple[str, ...]:
        """Every model an engine lists (in engine order; an engine that does not answer lists none)."""
        assert self._http is not None
        names: dict[str, None] = {}
        urls = [s.url for s in self.pool.specs] if self.pool is not None else [self.engine_url]
        for url in urls:
            try:
                async with self._http.get(f"{url}/v1/models") as r:
                    if r.status == 200:
                        names.update((str(m["id"]), None) for m in (await r.json()).get("data", []))
            except (aiohttp.ClientError, OSError, ValueError, KeyError):
                pass
        if names:
            return tuple(names)
        _log.warning("gateway: the engine lists no models; serving 'sim' (set --models)")
        return ("sim",)

    async def closed(self) -> None:
        if self.kv_view is not None:
            await self.kv_view.aclose()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._http is not None:
            await self._http.close()
            self._http = None
        for waiters in self._waiters.values():
            for waiter in waiters:
                waiter.cancel()

    # ------------------------------------------------------------ journal

    def session(self, session_id: str) -> GatewaySession:
        if (s := self.sessions.get(session_id)) is None:
            s = self.sessions[session_id] = GatewaySession(session_id)
        return s

    async def handle(self, events: list[LoggedEvent]) -> None:
        for event in events:
            self._fold(event.session_id, event.body, event.envelope.occurred_at)
        consumer = self.consumer
        assert consumer is not None
        if self._runner is None and self.replay_done(consumer, list(self._boundary)):
            await self._serve()

    def _fold(self, session_id: str, body: ev.Event, at: datetime) -> None:
        if session_id in self.forgotten:
            return  # a late verdict of a forgotten session: nothing reads it any more
        match body:
            case ev.SessionStarted() if body.program != GATEWAY_PROGRAM:
                self.foreign.add(session_id)
            case ev.GatewayLLMCallServed():
                self.session(session_id).record(body, at)
            case ev.GatewayToolResultReported():
                self.session(session_id).reported.add(body.call_id)
                self.session(session_id).gaps_ms.setdefault(body.call_id, body.gap_ms)
                self.session(session_id).seen(at.timestamp())
            case ev.GatewaySessionEnded():
                session = self.session(session_id)
                if session.ended is None:
                    session.ended, session.ended_at = body, at.timestamp()
            case ev.ToolCallCommitted() | ev.ToolCallAborted() if session_id in self.sessions:
                # (Only the gateway's own sessions: agent.verdicts carries every planner session's too.)
                key = (session_id, body.call_id)
                self.verdicts.setdefault(key, body)
                for waiter in self._waiters.pop(key, []):
                    if not waiter.done():
                        waiter.set_result(self.verdicts[key])

    async def _append(self, session_id: str, body: ev.Event, kind: str, key: str) -> datetime:
        at = self.log.clock()
        await self.log.append_many([Draft(session_id, body, self.event_ids(session_id, kind, key), None, at)])
        self._fold(session_id, body, at)  # once durable; the only fold of it (the journal is not consumed)
        return at

    async def _verdict(self, session_id: str, call_id: str) -> Verdict:
        key = (session_id, call_id)
        if (verdict := self.verdicts.get(key)) is not None:
            return verdict
        waiter: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, []).append(waiter)
        return await waiter

    # ------------------------------------------------------------ HTTP

    async def _serve(self) -> None:
        app = web.Application(client_max_size=32 * 1024**2)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_post("/v1/sessions/{session_id}/finish", self.finish_session)
        app.router.add_get("/health", self.health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        _log.info("gateway: serving on http://%s:%d (models %s)", self.host, self.port, ", ".join(self.models))
        if self.idle_timeout_s > 0:
            self.alongside(self._end_idle_sessions(), "idle sessions")
        if self.retain_ended_s >= 0:
            self.alongside(self._forget_ended_sessions(), "ended sessions")
        self.ready.set()

    # ------------------------------------------------------------ session ends

    async def _end_idle_sessions(self) -> None:
        """End every session idle for ``idle_timeout_s``, checking a few times per timeout."""
        every = min(5.0, max(0.05, self.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(every)
            open_sessions = {sid: s.last_seen for sid, s in self.sessions.items() if s.ended is None and s.calls}
            busy = [sid for sid, s in self.sessions.items() if s.num_in_flight or s.lock.locked()]
            now = self.log.clock().timestamp()
            for session_id in idle_sessions(open_sessions, busy, now, self.idle_timeout_s):
                session = self.sessions[session_id]
                if session.num_in_flight:
                    continue  # a request arrived since
                async with session.lock:
                    idle_s = self.log.clock().timestamp() - session.last_seen
                    if session.ended is None and idle_s >= self.idle_timeout_s:
                        reason = f"no request for {idle_s:.0f} s (idle timeout {self.idle_timeout_s:g} s)"
                        await self._end(session, "idle", reason)

    async def _forget_ended_sessions(self) -> None:
        """Forget, a few times per ``retain_ended_s``, the sessions it has passed for (``_forget``)."""
        every = min(60.0, max(0.05, self.retain_ended_s / 4))
        while True:
            await asyncio.sleep(every)
            self._forget(self.log.clock().timestamp())

    def _forget(self, now: float) -> None:
        """Drop what the gateway holds of the sessions ended ``retain_ended_s`` ago or more, keeping how
        each ended (a request of it still gets 409 ``session_finished``, a finish still answers), and of
        the sessions that recorded nothing and sent no request for as long (refused requests): so the
        gateway's memory follows the sessions still going, not every session it ever served. Their
        records stay in the log: ``logctl replay`` and ``audit`` read them there."""
        since = {sid: s.ended_at for sid, s in self.sessions.items() if s.ended is not None}
        since.update({sid: s.last_seen for sid, s in self.sessions.items() if s.ended is None and not s.calls})
        busy = [sid for sid, s in self.sessions.items() if s.num_in_flight or s.lock.locked() or s.reporting]
        for session_id in forgettable(since, busy, now, self.retain_ended_s):
            session = self.sessions.pop(session_id)
            for served in session.calls.values():
                for call in tool_calls_of(served):
                    self.verdicts.pop((session_id, call.call_id), None)
            if session.ended is not None:
                self.forgotten[session_id] = session.ended

    async def _end(self, session: GatewaySession, cause: str, reason: str) -> ev.GatewaySessionEnded:
        """Append the session's end (under its lock, so no request is in flight)."""
        if session.results_landed is not None:  # a request that failed at its engine left results landing
            await asyncio.gather(session.results_landed, return_exceptions=True)
        ended = ev.GatewaySessionEnded(reason=reason, cause=cause, num_llm_calls=len(session.calls))
        await self._append(session.session_id, ended, "ended", "")
        _log.info("gateway: session %s ended: %s", session.session_id, reason)
        return session.ended or ended

    async def finish_session(self, request: web.Request) -> web.Response:
        """``POST /v1/sessions/{id}/finish``: the client says the session is over (idempotent)."""
        session_id = request.match_info["session_id"]
        try:
            self._authorize(request)
            if not _SESSION_ID.match(session_id):
                raise _bad_request("Invalid session id: letters, digits and ._:@- only, at most 200.", None)
            if session_id in self.foreign:
                raise _not_external(session_id)
            if (gone := self.forgotten.get(session_id)) is not None:
                return _finished(session_id, gone)
            session = self.sessions.get(session_id)
            if session is None or not session.calls:
                raise RequestError(
                    404,
                    f"No session {session_id} went through this gateway.",
                    type_="invalid_request_error",
                    code="session_not_found",
                )
        except RequestError as e:
            return e.response()
        session.num_in_flight += 1
        try:
            async with session.lock:
                ended = session.ended or await self._end(session, "client", "finished by the client")
        finally:
            session.num_in_flight -= 1
        return _finished(session_id, ended)

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "sessions": len(self.sessions)})

    def _authorize(self, request: web.Request) -> None:
        if not self.api_keys:
            return
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not any(hmac.compare_digest(given.encode(), k.encode()) for k in self.api_keys):
            raise RequestError(
                401, "Incorrect API key provided.", type_="invalid_request_error", code="invalid_api_key"
            )

    async def list_models(self, request: web.Request) -> web.Response:
        try:
            self._authorize(request)
        except RequestError as e:
            return e.response()
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "agentlog"} for m in self.models]
        return web.json_response({"object": "list", "data": data})

    async def _parse(self, request: web.Request) -> tuple[str, dict[str, Any]]:
        self._authorize(request)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise _bad_request("The request body is not valid JSON.") from None
        if not isinstance(body, dict):
            raise _bad_request("The request body must be a JSON object.")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise _bad_request("'messages' must be a non-empty list of message objects.", "messages")
        if not isinstance(body.get("model"), str):
            raise _bad_request("'model' is required and must be a string.", "model")
        if body.get("n", 1) != 1:
            raise _bad_request("Only n=1 is supported.", "n")
        session_id = request.headers.get(SESSION_HEADER, "").strip()
        if not session_id:
            raise _bad_request(
                f"Every request needs a session id: send the {SESSION_HEADER} header.", None, "missing_session"
            )
        if not _SESSION_ID.match(session_id):
            raise _bad_request(f"Invalid {SESSION_HEADER}: letters, digits and ._:@- only, at most 200.", None)
        if body["model"] not in self.models:
            raise RequestError(
                404,
                f"The model '{body['model']}' does not exist; this gateway serves {', '.join(self.models)}.",
                type_="invalid_request_error",
                code="model_not_found",
                param="model",
            )
        return session_id, body

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            session_id, body = await self._parse(request)
        except RequestError as e:
            return e.response()
        if session_id in self.foreign:
            return _not_external(session_id).response()
        if (gone := self.forgotten.get(session_id)) is not None:
            return _session_finished(session_id, gone).response()
        session = self.session(session_id)
        session.num_in_flight += 1
        try:
            return await self._serve_request(request, session, body)
        finally:
            session.seen(self.log.clock().timestamp())
            session.num_in_flight -= 1

    async def _serve_request(
        self, request: web.Request, session: GatewaySession, body: dict[str, Any]
    ) -> web.StreamResponse:
        session_id = session.session_id
        idem = request.headers.get(IDEMPOTENCY_HEADER) or None
        stream = bool(body.get("stream"))
        async with session.lock:
            served = self._lookup(session, idem, request_digest(body))
            if served is not None:
                self.num_replayed += 1
                return await self._respond(request, session_id, served, stream, body, replay=True)
            if session.ended is not None:
                return _session_finished(session_id, session.ended).response()
            now = time.monotonic()
            if not self.limiter.allow(session_id, now):
                retry = max(1, round(self.limiter.retry_after_s(session_id, now)))
                error = RequestError(
                    429,
                    f"Session {session_id} is over its rate limit of {self.limiter.max_requests} requests a minute.",
                    type_="requests",
                    code="rate_limit_exceeded",
                )
                return error.response({"Retry-After": str(retry)})
            await self._report_results(session, body["messages"])
            step = session.next_step
            session.routes = []
            if stream:
                return await self._stream(request, session, body, idem, step)
            try:
                answer = await self._engine_json(session, body, step)
            except RequestError as e:
                return e.response()
            served = await self._record(session, body, idem, step, answer, stream=False)
            return await self._respond(request, session_id, served, False, body, replay=False)

    def _lookup(self, session: GatewaySession, idem: str | None, digest: str) -> ev.GatewayLLMCallServed | None:
        call_id = session.by_key.get(idem) if idem is not None else session.by_digest.get(digest)
        return session.calls.get(call_id) if call_id is not None else None

    async def _report_results(self, session: GatewaySession, messages: list[dict[str, Any]]) -> None:
        """Start appending the request's tool results (one batch), alongside its engine call: the call
        does not depend on them, so their append is off the critical path. The answer's record is
        appended after them (later in the session's partition) and waits for them (``_record``); a
        request answered with an engine error leaves them to land (``spawn``: drained at shutdown)
        and the session's next request waits for them before it looks at what was reported."""
        if (previous := session.results_landed) is not None:
            await asyncio.gather(previous, return_exceptions=True)  # failed: reported again now
        session.results_landed, session.reporting = None, []
        if reports := self._tool_reports(session, messages):
            session.reporting = reports
            session.results_landed = self.spawn(self._record_results(session, reports))

    async def _record_results(self, session: GatewaySession, reports: list[ev.GatewayToolResultReported]) -> None:
        """Append the reports (``session.reporting`` keeps them until they are durable: ``_record``
        appends them again if this fails)."""
        sid, at = session.session_id, self.log.clock()
        await self.log.append_many(
            [Draft(sid, r, self.event_ids(sid, "reported", r.call_id), None, at) for r in reports]
        )
        session.reporting = []
        for reported in reports:
            self._fold(sid, reported, at)  # once durable

    def _tool_reports(
        self, session: GatewaySession, messages: list[dict[str, Any]]
    ) -> list[ev.GatewayToolResultReported]:
        """The request's ``tool`` messages that answer calls released to the client and not recorded yet."""
        now = self.log.clock()
        released = session.released()
        served_at = {t.call_id: at for t, at in released}
        out: dict[str, ev.GatewayToolResultReported] = {}
        for call, content in reported_tool_results(messages, [t for t, _ in released]):
            if call.call_id in session.reported or call.call_id in out:
                continue
            verdict = self.verdicts.get((session.session_id, call.call_id))
            if not isinstance(verdict, ev.ToolCallCommitted):
                continue  # the client never got this call (aborted): nothing it reports about it ran
            text = content if isinstance(content, str) else json.dumps(content)
            reported = ev.GatewayToolResultReported(
                call_id=call.call_id,
                tool_call_id=call.id,
                result_json=result_json(content),
                result_tokens=estimate_tokens(text),
                gap_ms=max(0.0, (now - served_at[call.call_id]).total_seconds() * 1000),
            )
            out[call.call_id] = reported
        return list(out.values())

    # ------------------------------------------------------------ engine

    def _engine_body(self, session_id: str, body: dict[str, Any], step: int) -> dict[str, Any]:
        call_id = llm_step_id(step)
        payload = {**body, "session_id": session_id, "request_id": f"{session_id}/{call_id}"}
        if self.scheduling is not None:
            ranked = self.session(session_id).ranked = self.prioritize(session_id)
            payload["priority"] = ranked.priority
        return payload

    def priority(self, session_id: str) -> int:
        """The program-level priority of the session's next call (``services.scheduling``): now on
        the log's clock, placed by its recorded calls and tool gaps (an external agent is one
        thread as the gateway sees it)."""
        return self.prioritize(session_id).priority

    def prioritize(self, session_id: str) -> CallPriority:
        """``priority`` with what it was computed from (recorded on ``GatewayLLMCallServed``)."""
        assert self.scheduling is not None
        progress = ProgramProgress()
        session = self.session(session_id)
        for served in session.calls.values():
            progress = progress.after_call(served)
        for gap_ms in [*session.gaps_ms.values(), *(r.gap_ms for r in session.reporting)]:
            progress = progress.after_tool(gap_ms)
        return prioritize(self.log.clock().timestamp(), progress, config=self.scheduling)

    async def _route(self, session: GatewaySession, body: dict[str, Any], step: int, failed: str | None = None) -> str:
        """The engine for the call's next attempt: the one engine, or the router's choice over the pool
        (``EnginePool.choose``, as the planner routes), kept in ``session.routes`` to be recorded
        with the call. ``failed``: the engine the previous attempt could not reach (a failover)."""
        if self.pool is None:
            return self.engine_id
        located = await self._locate(session)
        now = time.monotonic()
        size = size_for_model(str(body["model"]), self.served_by, self.pool.sizes(now))
        prompt = prompt_estimate(body["messages"], context_of(last_served(session.calls.values())))
        call = CallRequest(session.session_id, prompt, located.cached, size=size.size)
        chosen, failed = self.pool.choose(self.router, call, now, failed=failed)
        call_id = llm_step_id(step)
        route = routed(
            call_id=call_id,
            request_id=f"{session.session_id}/{call_id}",
            attempt=len(session.routes),
            route=chosen,
            router=self.router_name,
            prompt_tokens=prompt,
            cached=located.cached,
            size=size,
            failed_engine_id=failed,
            reason="failover" if failed else None,
            notes=located.notes,
        )
        session.routes.append(route_claim(route))
        return chosen.engine_id

    async def _locate(self, session: GatewaySession) -> Located:
        """Where the session's prefix is (``services.gateway.locate_served``, the planner's rules): its
        last recorded call's engine, what the engines' ``kv.events`` say each still holds of it (the
        engines name the gateway's session: it forwards ``session_id``), and the engines where the
        cache manager discarded it since that call's record. A view that cannot be read leaves the
        route to what is known: routing never fails because of them."""
        assert self.pool is not None
        if self.kv_view is not None:
            await self.kv_view.refresh()  # logs and goes on when kv.events cannot be read
        last = last_served(session.calls.values())
        if last is None:
            return Located({})
        sid = session.session_id
        engine_ids = [s.engine_id for s in self.pool.specs]
        holdings = {} if self.kv_view is None else self.kv_view.holding(sid, engine_ids)
        dropped = (
            []
            if self.cache_view is None
            else await self.cache_view.dropped_on(sid, engine_ids, session.served_at.get(last.call_id))
        )
        return locate_served(session.calls.values(), dropped, holdings)

    def _url(self, engine_id: str) -> str:
        return self.pool.url(engine_id) if self.pool is not None else self.engine_url

    def _engine_begin(self, session: GatewaySession, engine_id: str) -> int:
        """Count the attempt's expected prefill in the engine's queue (what the router weighs)."""
        if self.pool is None or not session.routes:
            return 0
        tokens = session.routes[-1].expected_recompute_tokens
        self.pool.begin(engine_id, tokens)
        return tokens

    def _engine_end(self, engine_id: str, tokens: int, *, reached: bool) -> None:
        if self.pool is None:
            return
        self.pool.end(engine_id, tokens)
        if reached:
            self.pool.mark_up(engine_id)

    async def _failover(
        self, session: GatewaySession, body: dict[str, Any], step: int, asked: str, error: Exception
    ) -> str:
        """Mark ``asked`` down and route the request again: to an engine not marked down, or, when
        every other one is, to one of them as if up (the marks are only guesses), each engine tried
        at most once per request; a 502 when none is left."""
        if self.pool is not None:
            now = time.monotonic()
            self.pool.mark_down(asked, now)
            others_up = any(i.healthy for i in self.pool.infos(now, exclude=[asked]))
            if others_up or len(session.routes) < len(self.pool.specs):
                _log.warning("gateway: engine %s unreachable (%s); %s fails over", asked, type(error).__name__, step)
                return await self._route(session, body, step, failed=asked)
        raise RequestError(
            502, f"The engine failed: {type(error).__name__}", type_="server_error", code="engine_error"
        ) from None

    async def _engine_json(self, session: GatewaySession, body: dict[str, Any], step: int) -> dict[str, Any]:
        assert self._http is not None
        payload = self._engine_body(session.session_id, {**body, "stream": False}, step)
        began = time.monotonic()
        self.num_engine_requests += 1
        engine_id = await self._route(session, body, step)
        while True:
            asked, tokens, reached = engine_id, self._engine_begin(session, engine_id), False
            try:
                async with self._http.post(f"{self._url(asked)}/v1/chat/completions", json=payload) as r:
                    answer = await r.json(content_type=None)
                    reached = True
                    if r.status != 200:
                        raise _engine_error(r.status, answer)
                break
            except _UNREACHABLE as e:  # nothing reached the client: another engine, the same request id
                engine_id = await self._failover(session, body, step, asked, e)
            except (aiohttp.ClientError, OSError, ValueError) as e:
                raise RequestError(
                    502, f"The engine failed: {type(e).__name__}", type_="server_error", code="engine_error"
                ) from None
            finally:
                self._engine_end(asked, tokens, reached=reached)
        answer["_engine_ms"] = (time.monotonic() - began) * 1000
        answer["_engine_id"] = asked
        return dict(answer)

    async def _record(
        self,
        session: GatewaySession,
        body: dict[str, Any],
        idem: str | None,
        step: int,
        answer: dict[str, Any],
        *,
        stream: bool,
    ) -> ev.GatewayLLMCallServed:
        if (landing := session.results_landed) is not None:
            try:
                await landing  # the request's tool results land first, durable before its answer
            except Exception as e:
                # The engine has answered: append them again now rather than fail the request, whose
                # re-send would have the engine compute the call again. (Event ids are deterministic:
                # a batch that landed after all is not appended twice.)
                _log.warning(
                    "gateway: %s's tool results did not land (%s); appending them again", session.session_id, e
                )
                session.results_landed = None
                await self._record_results(session, session.reporting)
        ranked, session.ranked = session.ranked, None
        choice = (answer.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        usage = answer.get("usage") or {}
        timing = answer.get("agentlog") or {}
        tools = [
            GatewayToolCall(
                call_id=str(tool_call_id(step + 1 + i)),
                id=str(t.get("id") or f"call_{step + 1 + i}"),
                name=str(t.get("function", {}).get("name", "")),
                arguments=str(t.get("function", {}).get("arguments", "")),
            )
            for i, t in enumerate(message.get("tool_calls") or [])
        ]
        served = ev.GatewayLLMCallServed(
            call_id=llm_step_id(step),
            turn=len(session.calls),
            model=str(body["model"]),
            engine_id=str(answer.get("_engine_id") or self.engine_id),
            request_digest=request_digest(body),
            idempotency_key=idem,
            prompt_digest=prompt_digest(body),
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0),
            output_tokens=int(usage.get("completion_tokens", 0)),
            max_output_tokens=int(body.get("max_tokens") or body.get("max_completion_tokens") or 0),
            output_text=str(message.get("content") or ""),
            tool_calls_json=json.dumps([t.as_json() for t in tools]),
            finish_reason=str(choice.get("finish_reason") or "stop"),
            response_id=str(answer.get("id") or f"chatcmpl-{uuid.uuid4().hex}"),
            created=int(answer.get("created") or time.time()),
            queue_ms=float(timing.get("queue_ms", 0.0)),
            prefill_ms=float(timing.get("prefill_ms", 0.0)),
            decode_ms=float(timing.get("decode_ms", 0.0)),
            engine_ms=float(answer.get("_engine_ms", 0.0)),
            stream=stream,
            priority=None if ranked is None else ranked.priority,
            priority_attained_ms=None if ranked is None else ranked.attained_ms,
            priority_age_ms=None if ranked is None else ranked.age_ms,
            priority_warm=None if ranked is None else ranked.warm,
        )
        routes, session.routes = session.routes, []
        await self._append_call(session.session_id, [*routes, served])
        return served

    async def _append_call(
        self, session_id: str, bodies: list[ev.GatewayEngineRouted | ev.GatewayLLMCallServed]
    ) -> None:
        """A call's routes and its record, in one append (one durable wait, as for the record alone)."""
        at = self.log.clock()
        drafts = []
        for body in bodies:
            if isinstance(body, ev.GatewayEngineRouted):
                event_id = self.event_ids(session_id, "routed", f"{body.call_id}/{body.attempt}")
            else:
                event_id = self.event_ids(session_id, "served", body.call_id)
            drafts.append(Draft(session_id, body, event_id, None, at))
        await self.log.append_many(drafts)
        for body in bodies:
            self._fold(session_id, body, at)

    # ------------------------------------------------------------ answers

    async def _final_message(
        self, session_id: str, served: ev.GatewayLLMCallServed
    ) -> tuple[str, list[GatewayToolCall], str]:
        """The text, the tool calls the client may see, and the finish reason, once every call has a verdict."""
        text, allowed = served.output_text, []
        refusals = []
        for call in tool_calls_of(served):
            verdict = await self._verdict(session_id, call.call_id)
            if isinstance(verdict, ev.ToolCallCommitted):
                allowed.append(call)
            else:
                refusals.append(refusal_text(call, verdict.reason))
        if refusals:
            text = "\n".join([text, *refusals]) if text else "\n".join(refusals)
        finish = served.finish_reason
        if finish == "tool_calls" and not allowed:
            finish = "stop"
        return text, allowed, finish

    def _released(self, session_id: str, calls: list[GatewayToolCall]) -> None:
        released_at = self.session(session_id).released_at
        now = self.log.clock()
        for call in calls:
            released_at.setdefault(call.call_id, now)

    @staticmethod
    def _usage(served: ev.GatewayLLMCallServed) -> dict[str, Any]:
        return {
            "prompt_tokens": served.prompt_tokens,
            "completion_tokens": served.output_tokens,
            "total_tokens": served.prompt_tokens + served.output_tokens,
            "prompt_tokens_details": {"cached_tokens": served.cached_tokens},
        }

    async def _respond(
        self,
        request: web.Request,
        session_id: str,
        served: ev.GatewayLLMCallServed,
        stream: bool,
        body: dict[str, Any],
        *,
        replay: bool,
    ) -> web.StreamResponse:
        text, allowed, finish = await self._final_message(session_id, served)
        self._released(session_id, allowed)
        headers = {"X-Agentlog-Call": served.call_id, "X-Agentlog-Replayed": "true" if replay else "false"}
        if not stream:
            message: dict[str, Any] = {"role": "assistant", "content": text or None}
            if allowed:
                message["tool_calls"] = [c.as_openai() for c in allowed]
            completion = {
                "id": served.response_id,
                "object": "chat.completion",
                "created": served.created,
                "model": served.model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": self._usage(served),
            }
            return web.json_response(completion, headers=headers)
        response = await self._open_sse(request, headers)
        await self._send_tail(response, served, [{"role": "assistant", "content": text}], allowed, finish, body)
        return response

    async def _open_sse(self, request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        return response

    @staticmethod
    async def _sse(response: web.StreamResponse, data: dict[str, Any] | str) -> None:
        text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
        await response.write(f"data: {text}\n\n".encode())

    def _chunk(
        self, served: ev.GatewayLLMCallServed, delta: dict[str, Any], finish: str | None = None
    ) -> dict[str, Any]:
        return {
            "id": served.response_id,
            "object": "chat.completion.chunk",
            "created": served.created,
            "model": served.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }

    async def _send_tail(
        self,
        response: web.StreamResponse,
        served: ev.GatewayLLMCallServed,
        deltas: list[dict[str, Any]],
        allowed: list[GatewayToolCall],
        finish: str,
        body: dict[str, Any],
    ) -> None:
        """The rest of a stream once the verdicts are in: text deltas, tool calls, the finish, usage."""
        for delta in deltas:
            if delta.get("content") or delta.get("role"):
                await self._sse(response, self._chunk(served, delta))
        if allowed:
            delta = {"tool_calls": [c.as_openai(i) for i, c in enumerate(allowed)]}
            await self._sse(response, self._chunk(served, delta))
        await self._sse(response, self._chunk(served, {}, finish))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage_chunk = {**self._chunk(served, {}), "choices": [], "usage": self._usage(served)}
            await self._sse(response, usage_chunk)
        await self._sse(response, "[DONE]")
        await response.write_eof()

    async def _stream(
        self, request: web.Request, session: GatewaySession, body: dict[str, Any], idem: str | None, step: int
    ) -> web.StreamResponse:
        """Text passes through as the engine sends it; tool calls wait for the record and the votes."""
        assert self._http is not None
        payload = self._engine_body(
            session.session_id, {**body, "stream": True, "stream_options": {"include_usage": True}}, step
        )
        began = time.monotonic()
        self.num_engine_requests += 1
        response: web.StreamResponse | None = None
        engine_id = await self._route(session, body, step)
        while True:
            asked, tokens, reached = engine_id, self._engine_begin(session, engine_id), False
            text: list[str] = []
            tools: dict[int, dict[str, str]] = {}
            finish = "stop"
            usage: dict[str, Any] = {}
            timing: dict[str, Any] = {}
            first: dict[str, Any] | None = None
            try:
                async with self._http.post(f"{self._url(asked)}/v1/chat/completions", json=payload) as r:
                    if r.status != 200:
                        raise _engine_error(r.status, await r.json(content_type=None))
                    async for chunk in _sse_events(r.content):
                        first = first or chunk
                        usage = chunk.get("usage") or usage
                        timing = chunk.get("agentlog") or timing
                        for choice in chunk.get("choices") or []:
                            delta = choice.get("delta") or {}
                            finish = choice.get("finish_reason") or finish
                            for t in delta.get("tool_calls") or []:
                                slot = tools.setdefault(int(t.get("index", 0)), {"id": "", "name": "", "arguments": ""})
                                function = t.get("function") or {}
                                slot["id"] = t.get("id") or slot["id"]
                                slot["name"] += function.get("name") or ""
                                slot["arguments"] += function.get("arguments") or ""
                            if delta.get("content") or (delta.get("role") and response is None):
                                text.append(delta.get("content") or "")
                                if response is None:
                                    headers = {"X-Agentlog-Call": llm_step_id(step), "X-Agentlog-Replayed": "false"}
                                    response = await self._open_sse(request, headers)
                                passed = {
                                    **chunk,
                                    "choices": [
                                        {
                                            **choice,
                                            "finish_reason": None,
                                            "delta": {k: v for k, v in delta.items() if k != "tool_calls"},
                                        }
                                    ],
                                }
                                passed.pop("usage", None)
                                passed.pop("agentlog", None)
                                await self._sse(response, passed)
                reached = True
                break
            except _UNREACHABLE as e:
                if response is not None:
                    raise  # the client has part of the answer: it re-sends, and the request is routed again
                try:
                    engine_id = await self._failover(session, body, step, asked, e)
                except RequestError as refused:
                    return refused.response()
            except (aiohttp.ClientError, OSError, ValueError) as e:
                error = RequestError(
                    502, f"The engine failed: {type(e).__name__}", type_="server_error", code="engine_error"
                )
                if response is None:
                    return error.response()
                raise
            except RequestError as e:
                if response is None:
                    return e.response()
                raise
            finally:
                self._engine_end(asked, tokens, reached=reached)
        answer = {
            "id": (first or {}).get("id"),
            "created": (first or {}).get("created"),
            "choices": [
                {
                    "message": {
                        "content": "".join(text),
                        "tool_calls": [
                            {"id": t["id"], "function": {"name": t["name"], "arguments": t["arguments"]}}
                            for _, t in sorted(tools.items())
                        ],
                    },
                    "finish_reason": finish,
                }
            ],
            "usage": usage,
            "agentlog": timing,
            "_engine_ms": (time.monotonic() - began) * 1000,
            "_engine_id": asked,
        }
        served = await self._record(session, body, idem, step, answer, stream=True)
        text_out, allowed, final_finish = await self._final_message(session.session_id, served)
        self._released(session.session_id, allowed)
        refusal = text_out[len(served.output_text) :] if text_out.startswith(served.output_text) else text_out
        if response is None:
            response = await self._open_sse(
                request, {"X-Agentlog-Call": served.call_id, "X-Agentlog-Replayed": "false"}
            )
            deltas = [{"role": "assistant", "content": text_out}]
        else:
            deltas = [{"content": refusal}] if refusal else []
        await self._send_tail(response, served, deltas, allowed, final_finish, body)
        return response


def _session_finished(session_id: str, ended: ev.GatewaySessionEnded) -> RequestError:
    return RequestError(
        409,
        f"Session {session_id} is finished ({ended.reason}); send later requests under a new {SESSION_HEADER}.",
        type_="invalid_request_error",
        code="session_finished",
    )


def _finished(session_id: str, ended: ev.GatewaySessionEnded) -> web.Response:
    """The answer of ``/v1/sessions/{id}/finish`` for a session that has ended."""
    body = {"id": session_id, "object": "agentlog.session", "status": "finished", "cause": ended.cause}
    return web.json_response({**body, "reason": ended.reason, "num_llm_calls": ended.num_llm_calls})


def _not_external(session_id: str) -> RequestError:
    return RequestError(
        409,
        f"Session {session_id} runs a program on agentlog; a client cannot drive it. Use another session id.",
        type_="invalid_request_error",
        code="session_not_external",
    )


def _engine_error(status: int, answer: Any) -> RequestError:
    message = answer.get("error", {}).get("message") if isinstance(answer, dict) else None
    if 400 <= status < 500:
        return RequestError(
            status,
            f"The engine refused the request: {message or status}",
            type_="invalid_request_error",
            code="engine_refused",
        )
    return RequestError(502, f"The engine failed with status {status}", type_="server_error", code="engine_error")


async def _sse_events(content: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a server-sent event stream, until ``[DONE]``."""
    async for raw in content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def load_api_keys(path: Path | None) -> frozenset[str]:
    """The API keys clients may use: ``AGENTLOG_GATEWAY_API_KEYS`` (comma-separated) and the file's lines."""
    keys = {k.strip() for k in os.environ.get("AGENTLOG_GATEWAY_API_KEYS", "").split(",")}
    if path is not None:
        keys |= {line.strip() for line in Path(path).read_text().splitlines()}
    return frozenset(k for k in keys if k and not k.startswith("#"))


if __name__ == "__main__":
    from workers.main import run_worker

    run_worker(GatewayWorker)
