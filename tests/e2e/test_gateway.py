"""The OpenAI-compatible gateway through real processes on a real Kafka broker, driven by the official
``openai`` client: sim engine, planner, decider, executor and ``workers.gateway``, as ``logctl up --gateway``
starts them.

- completions (plain and streamed) land in the log as the session's LLM calls, adopted by the planner;
- the model's tool calls are voted on first: an aborted one never reaches the client (it reads why), a held
  one waits for ``logctl approve``; the tool result the client reports is recorded with its gap and the
  executor never runs the call;
- a re-sent request (same messages, or the same Idempotency-Key) is answered from the log: the engine's
  request count does not move;
- every bad request gets its status (401, 400, 404, 429) and nothing is appended;
- 50 concurrent sessions, 300 requests: every one is exactly one LLM call in the log;
- a session ends when idle for ``--idle-timeout-s`` (also after a gateway crash) or when the client
  finishes it: the planner records its SessionFinished, and a later request gets 409 ``session_finished``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from typer.testing import CliRunner

from cli.common import ensure_topics
from cli.main import app
from cli.sessions import SessionBook, read_sessions
from cli.stack import Stack
from log import LoggedEvent, open_log
from log.topics import SESSION_TOPICS
from schemas import events as ev
from services.session import GATEWAY_PROGRAM, SessionState
from workers.gateway import SESSION_HEADER

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

API_KEY = "test-key-" + uuid.uuid4().hex[:8]
RATE_LIMIT = 8  # requests per session per minute: the load test stays under it
ECHO = {
    "type": "function",
    "function": {
        "name": "echo",
        "description": "Return the text it is given.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
            "additionalProperties": False,
        },
    },
}
WIPE = {  # a tool the stack does not know: the decider's arg_schema voter aborts it
    "type": "function",
    "function": {"name": "wipe_disk", "parameters": {"type": "object", "properties": {}}},
}
PAYMENT = {  # irreversible: human_approval holds it for an operator
    "type": "function",
    "function": {
        "name": "payment",
        "parameters": {
            "type": "object",
            "properties": {"account": {"type": "string"}, "amount_cents": {"type": "integer", "minimum": 1}},
            "required": ["account", "amount_cents"],
            "additionalProperties": False,
        },
    },
}


class Gateway:
    def __init__(self, kafka: str, namespace: str, work: Path, *extra_args: str) -> None:
        self.log_url = f"kafka://{kafka}"
        self.namespace = namespace
        env = {"AGENTLOG_NAMESPACE": namespace, "AGENTLOG_GATEWAY_API_KEYS": API_KEY}
        self.stack = Stack(
            self.log_url,
            work,
            extra_env=env,
            gateway=True,
            gateway_args=["--max-requests-per-minute", str(RATE_LIMIT), *extra_args],
        )

    def start(self) -> None:
        ensure_topics(self.log_url, namespace=self.namespace)
        self.stack.start()
        self.wait_until_serving()

    def wait_until_serving(self) -> None:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.stack.gateway_url.removesuffix("/v1") + "/health", timeout=1):
                    return
            except OSError:
                gateway = self.stack.processes["gateway"]
                assert gateway.alive(), gateway.log_tail()
                time.sleep(0.2)
        raise TimeoutError(self.stack.processes["gateway"].log_tail())

    def client(self, session: str, **headers: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.stack.gateway_url,
            api_key=API_KEY,
            default_headers={SESSION_HEADER: session, **headers},
            max_retries=0,
            timeout=60,
        )

    def request(self, session: str, program: str, args: dict[str, Any]) -> None:
        """Ask the planner to run ``program`` as ``session`` (as ``logctl run`` does)."""

        async def append() -> None:
            async with open_log(self.log_url, actor="operator", namespace=self.namespace) as log:
                body = ev.SessionRequested(program=program, args_json=json.dumps(args), author="test")
                await log.append(session, body)

        asyncio.run(append())

    def engine_requests(self) -> int:
        with urllib.request.urlopen(f"{self.stack.engine_url}/stats", timeout=5) as response:
            stats = json.loads(response.read())
        return int(stats["num_served"]) + int(stats["num_replayed"])

    def events(self, topic: str) -> list[LoggedEvent]:
        async def read() -> list[LoggedEvent]:
            async with (
                open_log(self.log_url, actor="auditor", namespace=self.namespace) as log,
                log.consumer(f"logctl-t-{uuid.uuid4().hex[:6]}", [topic], from_beginning=True) as consumer,
            ):
                total = sum((await log.end_offsets(topic)).values())
                out: list[LoggedEvent] = []
                for _ in range(100):
                    if len(out) >= total:
                        break
                    out += await consumer.poll(timeout_s=0.3, max_records=5000)
                return out

        return asyncio.run(read())

    def end_offsets(self) -> dict[str, int]:
        async def ends() -> dict[str, int]:
            async with open_log(self.log_url, actor="auditor", namespace=self.namespace) as log:
                topics = [*SESSION_TOPICS, "agent.gateway"]
                return {t: sum((await log.end_offsets(t)).values()) for t in topics}

        return asyncio.run(ends())

    def sessions(self) -> SessionBook:
        async def read() -> SessionBook:
            async with open_log(self.log_url, actor="auditor", namespace=self.namespace) as log:
                return await read_sessions(log, group=f"logctl-read-{uuid.uuid4().hex[:6]}")

        return asyncio.run(read())

    def wait_for(self, session: str, done: Any, timeout_s: float = 60) -> SessionState:
        """The session as the log folds it, once ``done(state)`` holds."""
        deadline = time.monotonic() + timeout_s
        state = None
        while time.monotonic() < deadline:
            record = self.sessions().records.get(session)
            state = record.state if record else None
            if state is not None and done(state):
                return state
            time.sleep(0.5)
        raise AssertionError(f"{session} never got there: {state}")


@pytest.fixture(scope="module")
def gateway(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = Gateway(kafka_bootstrap, f"t{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("gateway"))
    g.start()
    try:
        yield g
    finally:
        codes = g.stack.stop()
        assert codes.get("gateway") == 0, g.stack.processes["gateway"].log_tail(40)


def _sid(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:6]}"


def test_models_and_a_plain_completion_land_in_the_log_as_the_sessions_llm_call(gateway: Gateway) -> None:
    session = _sid("plain")
    client = gateway.client(session)
    assert [m.id for m in client.models.list()] == ["sim"]
    reply = client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "Say hello."}])
    assert reply.choices[0].message.content and reply.usage is not None

    state = gateway.wait_for(session, lambda s: "llm-0" in s.llm_calls and s.llm_calls["llm-0"].completed)
    assert state.program == GATEWAY_PROGRAM and state.actors == {"planner"}  # it adopted the gateway's record
    completed = state.llm_calls["llm-0"].completed
    assert completed is not None
    assert completed.output_text == reply.choices[0].message.content
    assert completed.prompt_tokens == reply.usage.prompt_tokens
    assert completed.output_tokens == reply.usage.completion_tokens
    assert completed.engine_id == "sim-0"
    served = [e.body for e in gateway.events("agent.gateway") if e.session_id == session]
    assert len(served) == 1 and isinstance(served[0], ev.GatewayLLMCallServed)
    assert served[0].prompt_digest == state.llm_calls["llm-0"].started.prompt_digest


def test_a_streamed_completion_passes_through_chunk_by_chunk_and_is_logged(gateway: Gateway) -> None:
    session = _sid("stream")
    client = gateway.client(session)
    messages = [{"role": "user", "content": "Tell me a long story about logs, please, in many words."}]
    chunks = list(
        client.chat.completions.create(
            model="sim", messages=messages, stream=True, stream_options={"include_usage": True}, max_tokens=24
        )
    )
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) > 1, "streamed as one chunk"
    usage = next(c.usage for c in chunks if c.usage is not None)
    assert chunks[-1].usage is not None and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"

    state = gateway.wait_for(session, lambda s: "llm-0" in s.llm_calls and s.llm_calls["llm-0"].completed)
    completed = state.llm_calls["llm-0"].completed
    assert completed is not None and completed.output_text == "".join(texts)
    assert completed.output_tokens == usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_committed_tool_call_reaches_the_client_and_its_result_is_recorded_never_run(
    gateway: Gateway, stream: bool
) -> None:
    session = _sid("tools")
    client = gateway.client(session)
    messages: list[Any] = [{"role": "user", "content": "Echo something for me."}]
    first = _complete(client, messages, [ECHO], stream=stream)
    assert first["finish_reason"] == "tool_calls" and len(first["tool_calls"]) == 1
    call = first["tool_calls"][0]
    assert call["function"]["name"] == "echo"
    time.sleep(0.3)  # the client "runs" the tool: that is the gap
    messages += [
        {"role": "assistant", "content": first["content"] or None, "tool_calls": first["tool_calls"]},
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"echoed": "hi"})},
    ]
    second = _complete(client, messages, [ECHO], stream=stream)
    assert second["finish_reason"] == "stop" and second["content"]

    state = gateway.wait_for(session, lambda s: "llm-2" in s.llm_calls and s.tool_calls.get("tool-1") is not None
                             and s.tool_calls["tool-1"].completed is not None)  # fmt: skip
    tool = state.tool_calls["tool-1"]
    assert tool.proposed.tool == "echo" and isinstance(tool.verdict, ev.ToolCallCommitted)
    assert tool.completed is not None and json.loads(tool.completed.result_json) == {"echoed": "hi"}
    assert tool.completed.duration_ms >= 300
    assert tool.attempts == 0, "the executor started a call the client runs"
    effects = [e for e in gateway.events("agent.effects") if e.session_id == session]
    assert [type(e.body).__name__ for e in effects] == ["ToolCallCompleted"] and effects[0].envelope.actor == "executor"
    if not stream:
        _logctl_sees_the_whole_trajectory(gateway, session)


def _logctl_sees_the_whole_trajectory(gateway: Gateway, session: str) -> None:
    """``logctl sessions``, ``replay --check``, ``audit`` and ``verify`` on a session an external agent drove."""
    env = {"AGENTLOG_NAMESPACE": gateway.namespace}

    def logctl(*argv: str) -> Any:
        result = CliRunner().invoke(app, [*argv, "--log-url", gateway.log_url, "--json"], env=env)
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    listed = {s["session_id"]: s for s in logctl("sessions", "--limit", "1000")}
    assert listed[session]["program"] == GATEWAY_PROGRAM
    replayed = logctl("replay", session, "--check")
    assert replayed["problems"] == []
    kinds = [e["type"] for e in replayed["events"]]
    for kind in ("GatewayLLMCallServed", "LLMCallCompleted", "ToolCallProposed", "ToolCallCommitted",
                 "GatewayToolResultReported", "ToolCallCompleted"):  # fmt: skip
        assert kind in kinds, kinds
    audited = logctl("audit", "--session", session)
    assert [(c["call_id"], c["tool"]) for c in audited] == [("tool-1", "echo")], audited
    verified = logctl("verify", "--session", session)
    assert verified["ok"] is True, verified


def test_a_tool_call_aborted_by_a_voter_never_reaches_the_client(gateway: Gateway) -> None:
    for stream in (False, True):
        session = _sid("aborted")
        client = gateway.client(session)
        messages = [{"role": "user", "content": "Clean up my machine."}]
        answer = _complete(client, messages, [WIPE], stream=stream, tool_choice="required")
        assert answer["tool_calls"] == [] and answer["finish_reason"] == "stop"
        assert "wipe_disk" in answer["content"] and "refused" in answer["content"]
        state = gateway.wait_for(session, lambda s: "tool-1" in s.tool_calls and s.tool_calls["tool-1"].done)
        assert isinstance(state.tool_calls["tool-1"].verdict, ev.ToolCallAborted)
        assert "unknown tool" in state.tool_calls["tool-1"].verdict.reason


def test_a_held_tool_call_waits_for_logctl_approve(gateway: Gateway) -> None:
    session = _sid("held")
    client = gateway.client(session)
    got: dict[str, Any] = {}
    request = threading.Thread(
        target=lambda: got.update(
            _complete(client, [{"role": "user", "content": "Pay the bill."}], [PAYMENT], tool_choice="required")
        )
    )
    request.start()
    gateway.wait_for(session, lambda s: "tool-1" in s.tool_calls and s.tool_calls["tool-1"].num_verdicts == 0)
    time.sleep(1)
    assert request.is_alive() and not got, "a held call reached the client"
    argv = ["approve", session, "tool-1", "--log-url", gateway.log_url, "--reason", "ok"]
    result = CliRunner().invoke(app, argv, env={"AGENTLOG_NAMESPACE": gateway.namespace})
    assert result.exit_code == 0, result.output
    request.join(60)
    assert got["finish_reason"] == "tool_calls" and got["tool_calls"][0]["function"]["name"] == "payment"


def test_a_resent_request_is_answered_from_the_log(gateway: Gateway) -> None:
    session = _sid("resend")
    client = gateway.client(session)
    messages = [{"role": "user", "content": "What is an event log?"}]
    first = client.chat.completions.create(model="sim", messages=messages)
    before = gateway.engine_requests()
    again = client.chat.completions.with_raw_response.create(model="sim", messages=messages)
    assert again.headers["X-Agentlog-Replayed"] == "true"
    assert again.parse().model_dump() == first.model_dump()
    streamed = list(client.chat.completions.create(model="sim", messages=messages, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == first.choices[0].message.content

    keyed = gateway.client(session, **{"Idempotency-Key": "k-1"})
    one = keyed.chat.completions.create(model="sim", messages=[{"role": "user", "content": "once"}])
    between = gateway.engine_requests()
    other = keyed.chat.completions.create(model="sim", messages=[{"role": "user", "content": "once, re-worded"}])
    assert other.model_dump() == one.model_dump()
    assert gateway.engine_requests() == between == before + 1
    served = [e.body for e in gateway.events("agent.gateway") if e.session_id == session]
    assert [s.call_id for s in served] == ["llm-0", "llm-1"]


def test_bad_requests_get_their_status_and_append_nothing(gateway: Gateway) -> None:
    session = _sid("bad")
    before = gateway.end_offsets()
    url = gateway.stack.gateway_url + "/chat/completions"
    good = {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}

    bad_key = openai.OpenAI(base_url=gateway.stack.gateway_url, api_key="nope", max_retries=0,
                            default_headers={SESSION_HEADER: session})  # fmt: skip
    with pytest.raises(openai.AuthenticationError) as e401:
        bad_key.chat.completions.create(**good)
    assert e401.value.code == "invalid_api_key" and "nope" not in str(e401.value)
    with pytest.raises(openai.NotFoundError) as e404:
        gateway.client(session).chat.completions.create(model="gpt-9", messages=good["messages"])
    assert e404.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e400:
        gateway.client(session).chat.completions.create(model="sim", messages=[])
    assert e400.value.param == "messages"
    no_session = openai.OpenAI(base_url=gateway.stack.gateway_url, api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as missing:
        no_session.chat.completions.create(**good)
    assert missing.value.code == "missing_session"
    status, body = _post(url, b'{"model": "sim", "messages": [', session)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert gateway.end_offsets() == before

    # A session the planner runs a program for is not the client's to drive.
    planned = _sid("planned")
    steps = {"steps": [{"tool": "sleep", "arguments": {"seconds": 3600}}]}
    gateway.request(planned, "script", steps)
    gateway.wait_for(planned, lambda s: s.status is not None and s.program == "script" and s.num_steps > 0)
    deadline = time.monotonic() + 30
    while _finish(gateway, planned)[0] == 404 and time.monotonic() < deadline:
        time.sleep(0.5)  # until the gateway read the planner's SessionStarted (then: 409, nothing appended)
    before = gateway.end_offsets()
    status, body = _post(url, json.dumps(good).encode(), planned)
    assert status == 409 and body["error"]["code"] == "session_not_external"
    assert gateway.end_offsets()["agent.gateway"] == before["agent.gateway"]

    limited = _sid("limited")
    client = gateway.client(limited)
    for i in range(RATE_LIMIT):
        client.chat.completions.create(model="sim", messages=[{"role": "user", "content": f"request {i}"}])
    after_allowed = gateway.end_offsets()
    with pytest.raises(openai.RateLimitError) as e429:
        client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "one too many"}])
    assert e429.value.code == "rate_limit_exceeded" and int(e429.value.response.headers["Retry-After"]) >= 1
    assert gateway.end_offsets()["agent.gateway"] == after_allowed["agent.gateway"]


def test_fifty_concurrent_sessions_lose_and_duplicate_no_llm_call(gateway: Gateway) -> None:
    num_sessions, per_session = 50, 6
    run = uuid.uuid4().hex[:6]
    sessions = [f"load{i}-{run}" for i in range(num_sessions)]

    async def agent(session: str) -> list[str]:
        client = openai.AsyncOpenAI(base_url=gateway.stack.gateway_url, api_key=API_KEY, max_retries=0,
                                    default_headers={SESSION_HEADER: session}, timeout=120)  # fmt: skip
        messages: list[Any] = []
        texts = []
        async with client:
            for turn in range(per_session):
                messages.append({"role": "user", "content": f"{session} turn {turn}"})
                if turn % 2:
                    stream = await client.chat.completions.create(model="sim", messages=messages, stream=True)
                    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
                else:
                    reply = await client.chat.completions.create(model="sim", messages=messages)
                    text = reply.choices[0].message.content or ""
                messages.append({"role": "assistant", "content": text})
                texts.append(text)
        return texts

    async def everyone() -> list[list[str]]:
        return await asyncio.gather(*(agent(s) for s in sessions))

    answers = asyncio.run(everyone())
    assert all(len(a) == per_session for a in answers)

    served = Counter(
        (e.session_id, e.body.call_id) for e in gateway.events("agent.gateway") if e.session_id in set(sessions)
    )
    assert len(served) == num_sessions * per_session and set(served.values()) == {1}
    deadline = time.monotonic() + 90
    while True:
        completed = Counter(
            (e.session_id, e.body.call_id)
            for e in gateway.events("agent.actions")
            if e.session_id in set(sessions) and isinstance(e.body, ev.LLMCallCompleted)
        )
        if len(completed) == len(served) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert completed.keys() == served.keys() and set(completed.values()) == {1}


def _post(url: str, data: bytes, session: str) -> tuple[int, Any]:
    request = urllib.request.Request(
        url,
        data=data,
        headers={"Authorization": f"Bearer {API_KEY}", SESSION_HEADER: session, "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _complete(
    client: openai.OpenAI, messages: list[Any], tools: list[Any], *, stream: bool = False, tool_choice: str = "auto"
) -> dict[str, Any]:
    """The assistant's answer as a dict (content, tool_calls, finish_reason), streamed or not."""
    if not stream:
        reply = client.chat.completions.create(model="sim", messages=messages, tools=tools, tool_choice=tool_choice)
        choice = reply.choices[0]
        calls = [c.model_dump(include={"id", "type", "function"}) for c in choice.message.tool_calls or []]
        return {"content": choice.message.content or "", "tool_calls": calls, "finish_reason": choice.finish_reason}
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(
        model="sim", messages=messages, tools=tools, tool_choice=tool_choice, stream=True
    ):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for t in choice.delta.tool_calls or []:
                slot = calls.setdefault(
                    t.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                slot["id"] = t.id or slot["id"]
                if t.function is not None:
                    slot["function"]["name"] += t.function.name or ""
                    slot["function"]["arguments"] += t.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"content": content, "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish}


IDLE_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def idle_gateway(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    work = tmp_path_factory.mktemp("idle-gateway")
    g = Gateway(kafka_bootstrap, f"t{uuid.uuid4().hex[:10]}", work, "--idle-timeout-s", str(IDLE_TIMEOUT_S))
    g.start()
    try:
        yield g
    finally:
        g.stack.stop()


def _ended(gateway: Gateway, session: str) -> list[ev.GatewaySessionEnded]:
    return [
        e.body
        for e in gateway.events("agent.gateway")
        if e.session_id == session and isinstance(e.body, ev.GatewaySessionEnded)
    ]


def _finish(gateway: Gateway, session: str, key: str = API_KEY) -> tuple[int, Any]:
    url = f"{gateway.stack.gateway_url}/sessions/{session}/finish"
    request = urllib.request.Request(url, data=b"", headers={"Authorization": f"Bearer {key}"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_an_idle_session_is_finished_and_a_late_request_is_refused_but_a_resent_one_answered(
    idle_gateway: Gateway,
) -> None:
    session, busy = _sid("idle"), _sid("busy")
    client, busy_client = idle_gateway.client(session), idle_gateway.client(busy)
    hello = [{"role": "user", "content": "Say hello."}]
    reply = client.chat.completions.create(model="sim", messages=hello)
    # A session with requests closer together than the timeout stays open the whole time.
    began = time.monotonic()
    for i in range(4):
        busy_client.chat.completions.create(model="sim", messages=[{"role": "user", "content": f"turn {i}"}])
        time.sleep(IDLE_TIMEOUT_S / 3)
    assert time.monotonic() - began > IDLE_TIMEOUT_S and _ended(idle_gateway, busy) == []

    state = idle_gateway.wait_for(session, lambda s: s.finished)  # the session book folds agent.actions
    assert state.status.value == "finished" and state.actors == {"planner"}
    (ended,) = _ended(idle_gateway, session)
    assert json.loads(state.output_json or "{}") == {"ended": "idle", "reason": ended.reason}
    assert ended.cause == "idle" and f"(idle timeout {IDLE_TIMEOUT_S} s)" in ended.reason and ended.num_llm_calls == 1

    idle_gateway.wait_for(busy, lambda s: s.finished)  # and the busy one ends once it goes quiet

    before, engine_before = idle_gateway.end_offsets(), idle_gateway.engine_requests()
    with pytest.raises(openai.ConflictError) as late:
        client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "Still there?"}])
    assert late.value.code == "session_finished" and "under a new X-Agentlog-Session" in late.value.message
    again = client.chat.completions.create(model="sim", messages=hello)  # the client re-sends after a crash
    assert again.choices[0].message.content == reply.choices[0].message.content
    assert idle_gateway.end_offsets() == before and idle_gateway.engine_requests() == engine_before


def test_the_idle_clock_survives_a_gateway_crash_and_so_does_an_end(idle_gateway: Gateway) -> None:
    ended_before, quiet = _sid("ended-before"), _sid("quiet")
    idle_gateway.client(ended_before).chat.completions.create(model="sim", messages=[{"role": "user", "content": "a"}])
    idle_gateway.wait_for(ended_before, lambda s: s.finished)
    idle_gateway.client(quiet).chat.completions.create(model="sim", messages=[{"role": "user", "content": "b"}])
    idle_gateway.stack.processes["gateway"].kill()  # SIGKILL right after the answer: no end was appended
    assert _ended(idle_gateway, quiet) == []
    idle_gateway.stack.start_process("gateway")
    idle_gateway.wait_until_serving()
    # The restarted gateway counts from the session's last record, not from its own start.
    state = idle_gateway.wait_for(quiet, lambda s: s.finished)
    assert json.loads(state.output_json or "{}")["ended"] == "idle"
    assert [e.cause for e in _ended(idle_gateway, quiet)] == ["idle"]
    with pytest.raises(openai.ConflictError) as late:
        idle_gateway.client(ended_before).chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "after the restart"}]
        )
    assert late.value.code == "session_finished"
    assert len(_ended(idle_gateway, ended_before)) == 1


def test_the_client_finishes_a_session_explicitly(gateway: Gateway) -> None:
    session = _sid("finish")
    client = gateway.client(session)
    client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "one turn"}])

    assert _finish(gateway, session, key="wrong")[0] == 401
    assert _finish(gateway, _sid("never-seen"))[0] == 404
    assert _finish(gateway, "bad%20id")[0] == 400  # a space never makes a session id
    before = gateway.end_offsets()
    status, body = _finish(gateway, session)
    assert status == 200 and body["status"] == "finished" and body["cause"] == "client"
    assert body["num_llm_calls"] == 1
    assert _finish(gateway, session) == (200, body), "finishing again answers the same and appends nothing"
    assert gateway.end_offsets()["agent.gateway"] == before["agent.gateway"] + 1
    state = gateway.wait_for(session, lambda s: s.finished)
    assert json.loads(state.output_json or "{}") == {"ended": "client", "reason": "finished by the client"}
    with pytest.raises(openai.ConflictError) as late:
        client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "another turn"}])
    assert late.value.code == "session_finished"

    planned = _sid("planned")
    gateway.request(planned, "script", {"steps": [{"tool": "sleep", "arguments": {"seconds": 3600}}]})
    deadline = time.monotonic() + 30
    while _finish(gateway, planned)[0] == 404 and time.monotonic() < deadline:
        time.sleep(0.5)  # until the gateway read the planner's SessionStarted
    status, error = _finish(gateway, planned)
    assert status == 409 and error["error"]["code"] == "session_not_external"


def test_with_scheduling_each_call_records_the_priority_the_gateway_gave_it(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """``--scheduling plas``: each engine request carries the session's priority, and the log
    records it (GatewayLLMCallServed, and the LLMCallStarted the planner adopts), plain and streamed."""
    g = Gateway(kafka_bootstrap, f"t{uuid.uuid4().hex[:10]}", tmp_path, "--scheduling", "plas")
    g.start()
    try:
        session = _sid("ranked")
        client = g.client(session)
        client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "One."}], max_tokens=4)
        stream = client.chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "Two."}], max_tokens=4, stream=True
        )
        assert list(stream)
        state = g.wait_for(session, lambda s: all(f"llm-{i}" in s.llm_calls for i in (0, 1)))
    finally:
        g.stack.stop()
    served = {e.body.call_id: e.body for e in g.events("agent.gateway") if isinstance(e.body, ev.GatewayLLMCallServed)}
    assert sorted(served) == ["llm-0", "llm-1"]
    first, second = served["llm-0"], served["llm-1"]
    assert first.priority is not None and second.priority is not None
    assert (first.priority_attained_ms, first.priority_age_ms, first.priority_warm) == (0.0, 0.0, False)
    assert second.priority_attained_ms == first.prefill_ms + first.decode_ms  # the first call's service
    for call_id, body in served.items():
        started = state.llm_calls[call_id].started
        assert (started.priority, started.priority_attained_ms, started.priority_age_ms) == (
            body.priority,
            body.priority_attained_ms,
            body.priority_age_ms,
        )
