"""The engine recorder: a durable record of an engine's answers by request id, in front of it.

vLLM (and any external OpenAI-compatible API) does not remember what it answered. When the
planner crashes after the engine computed a call but before ``LLMCallCompleted`` is in the
log, the restarted planner sends the call again under the same request id, and the engine
computes it again. agentlog's simulated engine answers a repeated id from its own record; this
process gives every other engine the same property, on agentlog's side of the engine:

    planner / gateway / decider  ->  recorder (:8300)  ->  vLLM (:8000)
                                        |
                                     Postgres (agentlog_engine_responses)

- ``POST /v1/completions`` and ``/v1/chat/completions`` carrying a request id
  (``services/engine/record.py``): an id already recorded is answered from the record, marked
  ``agentlog_record.replayed``, without reaching the engine. Otherwise the request goes to the
  engine, and a successful answer is committed to Postgres **before** any of it is returned:
  whatever a caller has seen, a retry will see again. A stream is passed through as it comes,
  except its last bytes, held back until the whole stream is recorded.
- Two requests with one id at once: the second waits for the first and gets the record.
- An error answer (4xx, 5xx) is passed on and not recorded: nothing was computed that a retry
  could reuse. An unreachable engine is a 502 in OpenAI's error shape.
- Everything else (``/v1/models``, ``/metrics``, ``/health``, ...) is passed through unchanged.
- ``GET /recorder/stats``: ``recorded``, ``replayed``, ``forwarded`` (computations asked of the
  engine), ``passed_through``.

If the recorder itself dies mid-call, that call's computation is lost with it and a retry
computes it again, exactly as if the engine had died: the guarantee is that no answer anyone
received is ever computed twice.

Headers go to the engine as they came (an ``Authorization`` key included); none is logged.

Run: ``python -m workers.engines.recorder --upstream http://127.0.0.1:8000 [--port 8300]
[--record-url postgresql://...] [--namespace NS]``; the record URL defaults to
``AGENTLOG_RECORD_URL``, ``AGENTLOG_LEDGER_URL``, ``AGENTLOG_PG_URL``, else the embedded Postgres.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass

import aiohttp
import asyncpg
from aiohttp import web

from log.redact import redact
from services.engine.record import RECORDED_PATHS, mark_replayed, request_id_of

__all__ = ["Recorded", "Recorder", "ResponseRecord"]

_log = logging.getLogger(__name__)

RECORD_DDL = """
CREATE TABLE IF NOT EXISTS agentlog_engine_responses (
    namespace    text NOT NULL,
    request_id   text NOT NULL,
    path         text NOT NULL,
    status       integer NOT NULL,
    content_type text NOT NULL,
    body         bytea NOT NULL,
    recorded_at  double precision NOT NULL,
    PRIMARY KEY (namespace, request_id)
)
"""

# Hop-by-hop and framing headers: aiohttp sets its own for each leg.
_DROP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})


@dataclass(frozen=True)
class Recorded:
    path: str
    status: int
    content_type: str
    body: bytes
    recorded_at: float


class ResponseRecord:
    """The answers, in Postgres, one row per (namespace, request id); a row is never rewritten."""

    def __init__(self, dsn: str, namespace: str = "") -> None:
        self.dsn = dsn
        self.namespace = namespace
        self._pool: asyncpg.Pool | None = None

    async def start(self) -> ResponseRecord:
        self._pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=4)
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('agentlog:engine_responses'))")
            await conn.execute(RECORD_DDL)
        return self

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError("response record not started")
        return self._pool

    async def get(self, request_id: str) -> Recorded | None:
        row = await self.pool.fetchrow(
            "SELECT path, status, content_type, body, recorded_at FROM agentlog_engine_responses "
            "WHERE namespace = $1 AND request_id = $2",
            self.namespace,
            request_id,
        )
        return None if row is None else Recorded(*row)

    async def put(self, request_id: str, answer: Recorded) -> None:
        """Commit ``answer`` (the first one recorded for an id wins; a later one is dropped)."""
        await self.pool.execute(
            "INSERT INTO agentlog_engine_responses VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT DO NOTHING",
            self.namespace,
            request_id,
            answer.path,
            answer.status,
            answer.content_type,
            answer.body,
            answer.recorded_at,
        )

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None


def _error(status: int, message: str, kind: str) -> web.Response:
    """An OpenAI-shaped error."""
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": None}}, status=status)


class Recorder:
    def __init__(self, upstream: str, record: ResponseRecord, *, timeout_s: float = 600) -> None:
        self.upstream = upstream.rstrip("/")
        self.record = record
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._http: aiohttp.ClientSession | None = None
        self._inflight: dict[str, asyncio.Event] = {}
        self.num_recorded = 0
        self.num_replayed = 0
        self.num_forwarded = 0
        self.num_passed_through = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/recorder/stats", self.stats)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _: web.Application) -> None:
        self._http = aiohttp.ClientSession(timeout=self._timeout, auto_decompress=False)

    async def _close(self, _: web.Application) -> None:
        if self._http is not None:
            await self._http.close()
        await self.record.close()

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None:
            raise RuntimeError("recorder not started")
        return self._http

    async def stats(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "recorded": self.num_recorded,
                "replayed": self.num_replayed,
                "forwarded": self.num_forwarded,
                "passed_through": self.num_passed_through,
            }
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if request.method != "POST" or request.path not in RECORDED_PATHS:
            self.num_passed_through += 1
            return await self._forward(request, raw, record_as=None)
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None  # not JSON: the engine answers it (with its own 400); nothing to record
        try:
            rid = request_id_of(request.headers, body)
        except ValueError as e:
            return _error(400, f"request id: {e}", "invalid_request_error")
        if rid is None:
            self.num_passed_through += 1
            return await self._forward(request, raw, record_as=None)
        while (waiting := self._inflight.get(rid)) is not None:
            await waiting.wait()  # the same call is being looked up or computed: then the record answers
        # Claimed before the first await below, so a duplicate arriving meanwhile waits above.
        done = self._inflight[rid] = asyncio.Event()
        try:
            if (answer := await self.record.get(rid)) is not None:
                return self._replay(answer)
            return await self._forward(request, raw, record_as=rid)
        finally:
            del self._inflight[rid]
            done.set()

    def _replay(self, answer: Recorded) -> web.Response:
        self.num_replayed += 1
        body = answer.body
        if answer.content_type.startswith("application/json"):
            with contextlib.suppress(ValueError, TypeError):  # else replayed as the engine sent it
                body = json.dumps(mark_replayed(json.loads(body), answer.recorded_at)).encode()
        return web.Response(status=answer.status, body=body, content_type=answer.content_type.split(";")[0])

    async def _forward(self, request: web.Request, raw: bytes, *, record_as: str | None) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_HEADERS}
        url = f"{self.upstream}{request.rel_url}"
        if record_as is not None:
            self.num_forwarded += 1
        try:
            async with self.http.request(request.method, url, data=raw, headers=headers) as upstream:
                content_type = upstream.headers.get("Content-Type", "application/octet-stream")
                streamed = content_type.startswith("text/event-stream")
                if not streamed:
                    body = await upstream.read()
                    if record_as is not None and upstream.status == 200:
                        await self._commit(record_as, request.path, upstream.status, content_type, body)
                    passed = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_HEADERS}
                    return web.Response(status=upstream.status, body=body, headers=passed)
                return await self._stream(request, upstream, content_type, record_as)
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
            return _error(502, f"engine unreachable: {type(e).__name__}", "engine_unavailable")

    async def _stream(
        self, request: web.Request, upstream: aiohttp.ClientResponse, content_type: str, record_as: str | None
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status, headers={"Content-Type": content_type})
        await response.prepare(request)
        chunks: list[bytes] = []
        held: bytes | None = None  # the newest bytes: sent only once the stream is recorded
        async for chunk in upstream.content.iter_any():
            if held is not None:
                await response.write(held)
            chunks.append(chunk)
            held = chunk
        if record_as is not None and upstream.status == 200:
            await self._commit(record_as, request.path, upstream.status, content_type, b"".join(chunks))
        if held is not None:
            await response.write(held)
        await response.write_eof()
        return response

    async def _commit(self, rid: str, path: str, status: int, content_type: str, body: bytes) -> None:
        await self.record.put(rid, Recorded(path, status, content_type, body, time.time()))
        self.num_recorded += 1


def default_record_url() -> str:
    for name in ("AGENTLOG_RECORD_URL", "AGENTLOG_LEDGER_URL", "AGENTLOG_PG_URL"):
        if url := os.environ.get(name):
            return url
    from log.embedded import start_embedded

    return start_embedded()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workers.engines.recorder", description=__doc__.split("\n")[0])
    parser.add_argument("--upstream", required=True, help="the engine's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--record-url", default=None, help="Postgres for the record (see the module docstring)")
    parser.add_argument(
        "--namespace", default=os.environ.get("AGENTLOG_NAMESPACE", ""), help="keeps stacks sharing a database apart"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s recorder[{os.getpid()}] %(levelname)s %(message)s")
    url = args.record_url or default_record_url()
    recorder = Recorder(args.upstream, ResponseRecord(url, args.namespace))

    async def open_record(_: web.Application) -> None:
        await recorder.record.start()

    app = recorder.app()
    app.on_startup.insert(0, open_record)
    _log.info("recording %s at %s:%d (record %s)", args.upstream, args.host, args.port, redact(url))
    try:
        web.run_app(app, host=args.host, port=args.port, print=None, handle_signals=True, access_log=None)
    except (OSError, asyncpg.PostgresError) as e:  # one line, and never the password
        raise SystemExit(f"recorder: cannot start: {type(e).__name__}: {redact(str(e))}") from None


if __name__ == "__main__":
    main()
