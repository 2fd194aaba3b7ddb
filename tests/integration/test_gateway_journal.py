"""The gateway's journal (agent.gateway) on a real log, Kafka and Postgres, with a real sim engine.

The gateway reads its journal once, at start, and then knows its own records from its appends
(it does not consume its topic). So a restarted gateway must rebuild from the log exactly what
the first one knew: every recorded call, idempotency key and request digest, every reported
tool result with its gap, every ended session, every verdict; it must answer a re-sent request
from the log without calling the engine, append nothing for it, and number the next call of a
session after the recorded ones. Tool results a request reports are appended while its engine
call runs: they land before the answer's record, and are durable before the answer.

The verdict on the model's tool call is appended by the test as the decider (no planner and
decider run here: the gateway only reads agent.verdicts).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cli.common import init_log
from cli.stack import Process, free_port
from log import LoggedEvent, SharedLog, open_log
from log.topics import AGENT_GATEWAY
from schemas import events as ev
from workers.gateway import SESSION_HEADER, GatewayWorker

pytestmark = pytest.mark.integration

ECHO = {
    "type": "function",
    "function": {
        "name": "echo",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}
USE_ECHO = {"type": "function", "function": {"name": "echo"}}


@pytest.fixture
def engine_url(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    process = Process(
        "engine",
        [sys.executable, "-m", "workers.engines.sim_server", "--port", str(port), "--state-dir",
         str(tmp_path / "engine"), "--time-scale", "0", "--model", "sim"],
        env, tmp_path / "engine.log",
    )  # fmt: skip
    process.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1).close()
                break
            except OSError:
                assert process.alive() and time.monotonic() < deadline, process.log_tail()
                time.sleep(0.1)
        yield url
    finally:
        process.stop()


@pytest.fixture(params=["kafka", "postgres"])
def log_url(request: pytest.FixtureRequest) -> str:
    if request.param == "kafka":
        return f"kafka://{request.getfixturevalue('kafka_bootstrap')}"
    return str(request.getfixturevalue("pg_url"))


def state_of(gateway: GatewayWorker) -> dict[str, Any]:
    """What the gateway knows from the log (not what only one process's memory holds: the lock,
    requests in flight, release times, when a request last arrived)."""
    sessions = {
        sid: {
            "calls": {c: s.model_dump() for c, s in sorted(session.calls.items())},
            "served_at": dict(sorted(session.served_at.items())),
            "by_key": dict(sorted(session.by_key.items())),
            "by_digest": dict(sorted(session.by_digest.items())),
            "reported": sorted(session.reported),
            "gaps_ms": dict(sorted(session.gaps_ms.items())),
            "ended": session.ended.model_dump() if session.ended else None,
            "next_step": session.next_step,
        }
        for sid, session in sorted(gateway.sessions.items())
        if session.calls or session.ended
    }
    verdicts = {f"{s}/{c}": v.model_dump() for (s, c), v in sorted(gateway.verdicts.items())}
    return {"sessions": sessions, "verdicts": verdicts, "foreign": sorted(gateway.foreign)}


class Running:
    """One gateway process's worth: a GatewayWorker on its own SharedLog, serving on a port."""

    def __init__(self, log_url: str, namespace: str, engine_url: str, **options: Any) -> None:
        self.log_url, self.namespace, self.engine_url = log_url, namespace, engine_url
        self.options = options  # more GatewayWorker arguments
        self.port = free_port()

    async def __aenter__(self) -> GatewayWorker:
        self.log = await open_log(self.log_url, actor="gateway", namespace=self.namespace).start()
        self.worker = GatewayWorker(
            self.log, engine_url=self.engine_url, models=("sim",), port=self.port, poll_timeout_s=0.1, **self.options
        )
        await self.worker.__aenter__()
        await asyncio.wait_for(self.worker.ready.wait(), 60)
        return self.worker

    async def __aexit__(self, *exc: object) -> None:
        await self.worker.__aexit__(None, None, None)
        await self.log.close()


async def post(
    http: aiohttp.ClientSession, url: str, session: str, body: dict[str, Any], **headers: str
) -> tuple[dict[str, Any] | str, dict[str, str]]:
    """One request: the completion (or the raw event stream's text) and the response headers."""
    async with http.post(
        url, json={"model": "sim", "max_tokens": 12, **body}, headers={SESSION_HEADER: session, **headers}
    ) as r:
        assert r.status == 200, await r.text()
        answer = await r.text() if body.get("stream") else await r.json()
        return answer, dict(r.headers)


async def append_verdict(log: SharedLog, session: str, call_id: str) -> None:
    await log.append(session, ev.ToolCallCommitted(call_id=call_id, votes=[], policy="test"))


async def until_served(gateway: GatewayWorker, session: str) -> None:
    """Until the gateway has recorded the session's served call, whose tool call it then proposes.

    A decider votes on a proposal it has read; a verdict of a session the gateway does not
    know yet is not its own (agent.verdicts carries the planner's sessions too) and is not kept.
    """
    for _ in range(1200):
        if session in gateway.sessions:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the gateway never recorded a served call of {session}")


def test_a_restarted_gateway_knows_what_the_first_knew_and_answers_resent_requests_from_the_log(
    log_url: str, namespace: str, engine_url: str
) -> None:
    async def scenario() -> None:
        await init_log(log_url, 2, namespace=namespace)
        plain = {"messages": [{"role": "user", "content": "What is an event log?"}]}
        keyed = {"messages": [{"role": "user", "content": "once"}], "stream": True}
        asked = {"messages": [{"role": "user", "content": "Echo hi."}], "tools": [ECHO], "tool_choice": USE_ECHO}
        async with (
            aiohttp.ClientSession() as http,
            open_log(log_url, actor="decider", namespace=namespace) as decider,
        ):
            async with Running(log_url, namespace, engine_url) as first:
                assert AGENT_GATEWAY.name not in first.topics  # read at start, not consumed
                url = f"http://127.0.0.1:{first.port}/v1/chat/completions"
                one, _ = await post(http, url, "s-plain", plain)
                _, key_headers = await post(http, url, "s-keyed", keyed, **{"Idempotency-Key": "k-1"})
                calling = asyncio.ensure_future(post(http, url, "s-tool", asked))
                await until_served(first, "s-tool")
                await append_verdict(decider, "s-tool", "tool-1")  # as the decider: the call may go out
                called, _ = await calling
                assert isinstance(called, dict)
                tool_call = called["choices"][0]["message"]["tool_calls"][0]
                result = {"role": "tool", "tool_call_id": tool_call["id"], "content": "hi"}
                followed = {"messages": [*asked["messages"], called["choices"][0]["message"], result]}
                await post(http, url, "s-tool", followed)  # its tool result is appended alongside the engine call
                async with http.post(f"http://127.0.0.1:{first.port}/v1/sessions/s-plain/finish") as r:
                    assert r.status == 200
                tool_session = first.sessions["s-tool"]
                assert tool_session.reported == {"tool-1"} and tool_session.next_step == 3
                before, engine_calls = state_of(first), first.num_engine_requests
            assert engine_calls == 4
            journal = await journal_of(decider)
            kinds = [type(e.body).__name__ for e in journal if e.session_id == "s-tool"]
            # The result landed before the answer that followed it.
            assert kinds == ["GatewayLLMCallServed", "GatewayToolResultReported", "GatewayLLMCallServed"]

            async with Running(log_url, namespace, engine_url) as second:
                assert state_of(second) == before
                url = f"http://127.0.0.1:{second.port}/v1/chat/completions"
                again, headers = await post(http, url, "s-plain", plain)
                assert headers["X-Agentlog-Replayed"] == "true" and again == one
                _, headers = await post(http, url, "s-keyed", {**keyed, "stream": False}, **{"Idempotency-Key": "k-1"})
                assert headers["X-Agentlog-Replayed"] == "true"
                assert headers["X-Agentlog-Call"] == key_headers["X-Agentlog-Call"]
                _, headers = await post(http, url, "s-tool", followed)  # the result is not reported twice
                assert headers["X-Agentlog-Replayed"] == "true"
                assert second.num_engine_requests == 0
                assert [e.position for e in await journal_of(decider)] == [e.position for e in journal]
                _, headers = await post(http, url, "s-keyed", {"messages": [{"role": "user", "content": "next"}]})
                assert headers["X-Agentlog-Replayed"] == "false" and headers["X-Agentlog-Call"] == "llm-1"
                assert second.num_engine_requests == 1

    asyncio.run(scenario())


def test_tool_results_whose_append_fails_are_appended_again_with_the_answer_not_recomputed(
    log_url: str, namespace: str, engine_url: str
) -> None:
    """The results' batch is appended while the engine call runs; if it fails (a broker error on
    that batch alone), the answer must not be lost with it: a 500 would have the client re-send,
    and the engine compute the call again."""

    async def scenario() -> None:
        await init_log(log_url, 2, namespace=namespace)
        asked = {"messages": [{"role": "user", "content": "Echo hi."}], "tools": [ECHO], "tool_choice": USE_ECHO}
        async with (
            aiohttp.ClientSession() as http,
            open_log(log_url, actor="decider", namespace=namespace) as decider,
            Running(log_url, namespace, engine_url) as gateway,
        ):
            url = f"http://127.0.0.1:{gateway.port}/v1/chat/completions"
            calling = asyncio.ensure_future(post(http, url, "s-tool", asked))
            await until_served(gateway, "s-tool")
            await append_verdict(decider, "s-tool", "tool-1")
            called, _ = await calling
            assert isinstance(called, dict)
            tool_call = called["choices"][0]["message"]["tool_calls"][0]
            result = {"role": "tool", "tool_call_id": tool_call["id"], "content": "hi"}
            followed = {"messages": [*asked["messages"], called["choices"][0]["message"], result]}
            real, failed = gateway.log.append_many, []

            async def fail_the_results_once(drafts: Any) -> Any:
                if not failed and any(isinstance(d.body, ev.GatewayToolResultReported) for d in drafts):
                    failed.append(drafts)
                    raise RuntimeError("broker away")
                return await real(drafts)

            gateway.log.append_many = fail_the_results_once  # type: ignore[method-assign]
            _, headers = await post(http, url, "s-tool", followed)
            assert failed and headers["X-Agentlog-Replayed"] == "false"
            assert gateway.num_engine_requests == 2 and gateway.sessions["s-tool"].reported == {"tool-1"}
            _, headers = await post(http, url, "s-tool", followed)  # a re-send: from the log
            assert headers["X-Agentlog-Replayed"] == "true" and gateway.num_engine_requests == 2
            kinds = [type(e.body).__name__ for e in await journal_of(decider) if e.session_id == "s-tool"]
            assert kinds == ["GatewayLLMCallServed", "GatewayToolResultReported", "GatewayLLMCallServed"]

    asyncio.run(scenario())


async def journal_of(log: SharedLog) -> list[LoggedEvent]:
    """agent.gateway's records, partition by partition (each session's in order)."""
    out = []
    for partition, end in sorted((await log.end_offsets(AGENT_GATEWAY.name)).items()):
        async for record in log.scan(AGENT_GATEWAY.name, partition, 0, end):
            out.append(LoggedEvent(record.position, log.decode(record)))
    return out


def test_an_ended_session_is_forgotten_after_the_retention_and_its_requests_still_get_409(
    log_url: str, namespace: str, engine_url: str
) -> None:
    """``retain_ended_s`` after a session's end the gateway drops its calls (and its verdicts) and
    keeps how it ended: a re-sent request gets 409 ``session_finished`` (nothing appended, the engine
    not called), a finish still answers; a session still going keeps everything. A restarted gateway
    forgets the same sessions while it reads the journal."""

    async def scenario() -> None:
        await init_log(log_url, 2, namespace=namespace)
        plain = {"messages": [{"role": "user", "content": "What is an event log?"}]}
        asked = {"messages": [{"role": "user", "content": "Echo hi."}], "tools": [ECHO], "tool_choice": USE_ECHO}
        async with (
            aiohttp.ClientSession() as http,
            open_log(log_url, actor="decider", namespace=namespace) as decider,
        ):
            async with Running(log_url, namespace, engine_url, retain_ended_s=0.3) as gateway:
                base = f"http://127.0.0.1:{gateway.port}/v1"
                calling = asyncio.ensure_future(post(http, f"{base}/chat/completions", "s-done", asked))
                await until_served(gateway, "s-done")
                await append_verdict(decider, "s-done", "tool-1")
                await append_verdict(decider, "planner-run", "tool-1")  # not the gateway's: not kept
                await calling
                await post(http, f"{base}/chat/completions", "s-going", plain)
                async with http.post(f"{base}/sessions/s-done/finish") as r:
                    assert r.status == 200
                    finished = await r.json()
                assert ("s-done", "tool-1") in gateway.verdicts
                assert ("planner-run", "tool-1") not in gateway.verdicts
                deadline = time.monotonic() + 30
                while "s-done" in gateway.sessions:  # the forgetting task runs every 0.075 s here
                    assert time.monotonic() < deadline, "the ended session was never forgotten"
                    await asyncio.sleep(0.05)
                assert gateway.forgotten["s-done"].cause == "client"
                assert ("s-done", "tool-1") not in gateway.verdicts
                assert gateway.sessions["s-going"].calls, "a session still going keeps its calls"
                records, engine_calls = len(await journal_of(decider)), gateway.num_engine_requests
                async with http.post(
                    f"{base}/chat/completions", json={"model": "sim", **asked}, headers={SESSION_HEADER: "s-done"}
                ) as r:
                    assert r.status == 409 and (await r.json())["error"]["code"] == "session_finished"
                async with http.post(f"{base}/sessions/s-done/finish") as r:
                    assert r.status == 200 and await r.json() == finished
                assert len(await journal_of(decider)) == records and gateway.num_engine_requests == engine_calls

            async with Running(log_url, namespace, engine_url, retain_ended_s=0.3) as again:
                assert "s-done" not in again.sessions and again.forgotten["s-done"].cause == "client"
                assert again.sessions["s-going"].calls

    asyncio.run(scenario())
