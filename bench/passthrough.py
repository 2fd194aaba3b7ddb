"""The floor of an HTTP gateway hop: an aiohttp server that forwards each chat completion to the
engine and hands the answer back, and does nothing else (no log, no session, no check).

``bench.gateway`` runs it in a process of its own beside the gateway, against the same engine, as
raw kafka-python stands beside the log in ``bench.log_throughput``: the gateway's added latency
minus this one's is what agentlog's gateway adds beyond the hop that any gateway in front of the
engine pays (two more HTTP exchanges, JSON parsed and written again, one more process).

Run: ``python -m bench.passthrough --engine-url http://127.0.0.1:8100 --port 8299``.
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
from aiohttp import web


def app(engine_url: str) -> web.Application:
    http: aiohttp.ClientSession | None = None

    async def forward(request: web.Request) -> web.StreamResponse:
        assert http is not None
        body = await request.json()
        async with http.post(f"{engine_url}/v1/chat/completions", json=body) as answer:
            if not body.get("stream"):
                return web.json_response(await answer.json(content_type=None), status=answer.status)
            response = web.StreamResponse(status=answer.status, headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def session(_app: web.Application):  # type: ignore[no-untyped-def]
        nonlocal http
        http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        yield
        await http.close()

    application = web.Application()
    application.router.add_post("/v1/chat/completions", forward)
    application.router.add_get("/health", lambda _request: _ok())
    application.cleanup_ctx.append(session)
    return application


async def _ok() -> web.Response:
    return web.Response(text="ok")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.passthrough", description=__doc__.split("\n")[0])
    parser.add_argument("--engine-url", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    asyncio.run(_serve(app(args.engine_url.rstrip("/")), args.host, args.port))


async def _serve(application: web.Application, host: str, port: int) -> None:
    runner = web.AppRunner(application, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    main()
