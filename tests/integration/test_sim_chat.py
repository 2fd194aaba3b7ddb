"""The simulated engine's chat completions endpoint, as a real process, driven by the ``openai`` client.

Plain and streaming answers, function calling (arguments valid under the tool's schema, the
tool choice honoured, malformed calls on request), the paged cache across a session's turns
(its next turn hits its prefix), the record of request ids (a repeated id is answered from it,
also after a restart, and is not computed again), and bad bodies (OpenAI's error shape).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from cli.stack import Process, free_port
from services.programs.base import Prompt, TokenRun
from services.programs.sdk import render_messages
from workers.engines.base import EngineError
from workers.engines.chat import ChatEngine
from workers.engines.factory import create_engine
from workers.engines.sim_server import text_token_ids

pytestmark = [pytest.mark.integration]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 2, "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "detailed": {"type": "boolean"},
                "lat": {"type": "number", "minimum": -90, "maximum": 90},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
BOOK = {
    "type": "function",
    "function": {
        "name": "book_flight",
        "parameters": {"type": "object", "properties": {"to": {"type": "string"}}, "required": ["to"]},
    },
}


class Engine:
    def __init__(self, work: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        self.process = Process(
            "engine",
            [sys.executable, "-m", "workers.engines.sim_server", "--port", str(self.port),
             "--state-dir", str(work / "engine"), "--engine-id", "sim-chat", "--block-size", "4",
             "--gpu-blocks", "256", "--time-scale", "0.001", "--model", "sim-model", *extra],
            env, work / "engine.log",
        )  # fmt: skip

    def start(self) -> Engine:
        self.process.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                self.get("/health")
                return self
            except OSError:
                assert self.process.alive(), self.process.log_tail()
                time.sleep(0.1)
        raise TimeoutError("the sim engine did not start")

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as response:
            return json.loads(response.read())

    def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        request = urllib.request.Request(
            f"{self.url}{path}", body, {"Content-Type": "application/json", **(headers or {})}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    rig = Engine(tmp_path).start()
    try:
        yield rig
    finally:
        rig.process.stop()


def test_a_plain_answer_and_the_model_list(engine: Engine) -> None:
    client = engine.client()
    assert [m.id for m in client.models.list()] == ["sim-model"]
    messages: Any = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    first = client.chat.completions.create(
        model="sim-model", messages=messages, max_tokens=5, extra_body={"request_id": "s1/0", "session_id": "s1"}
    )
    assert first.id == "s1/0"
    assert first.object == "chat.completion"
    assert first.choices[0].finish_reason == "stop"
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].message.content and first.choices[0].message.content.startswith("simulated answer")
    assert first.choices[0].message.tool_calls is None
    assert first.usage is not None
    assert first.usage.completion_tokens == 5
    # The prompt is the rendered messages: 2 role tags, 2 + 2 words, the assistant tag.
    assert first.usage.prompt_tokens == 7
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # The same conversation says the same thing (the seed is its content); the model may be named by engine id.
    again = client.chat.completions.create(
        model="sim-chat", messages=messages, max_tokens=5, extra_body={"request_id": "s2/0", "session_id": "s2"}
    )
    assert again.choices[0].message.content == first.choices[0].message.content


def test_a_sessions_next_turn_hits_its_cached_prefix(engine: Engine) -> None:
    client = engine.client()
    messages: Any = [{"role": "user", "content": " ".join(f"word{i}" for i in range(30))}]
    first = client.chat.completions.create(model="sim-model", messages=messages, extra_headers={
        "X-Request-Id": "s/0", "X-Agentlog-Session": "s"})  # fmt: skip
    assert first.id == "s/0"
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "more"},
    ]
    second = client.chat.completions.create(model="sim-model", messages=messages, extra_headers={
        "X-Request-Id": "s/1", "X-Agentlog-Session": "s"})  # fmt: skip
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens_details is not None
    # The first prompt's 32 tokens (8 full blocks of 4) are cached; the second prompt starts with them.
    assert first.usage.prompt_tokens == 32
    assert second.usage.prompt_tokens_details.cached_tokens == 32
    hits = [e for b in engine.get("/kv_events?after=0")["batches"] for e in b["events"] if e["kind"] == "hit"]
    assert [(h["session_id"], h["call_id"], h["cached_tokens"]) for h in hits] == [("s", "0", 0), ("s", "1", 32)]


def test_a_tool_call_satisfies_the_schema_and_the_tool_choice_is_honoured(engine: Engine) -> None:
    client = engine.client()
    schema = WEATHER["function"]["parameters"]  # type: ignore[index]
    seen_tools = set()
    for i in range(12):
        messages: Any = [{"role": "user", "content": f"what now {i}"}]
        reply = client.chat.completions.create(model="sim-model", messages=messages, tools=[WEATHER, BOOK])  # type: ignore[list-item]
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        [call] = choice.message.tool_calls or []
        assert call.type == "function" and call.id.startswith("call_")
        seen_tools.add(call.function.name)
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            jsonschema.validate(arguments, schema)
        else:
            assert isinstance(arguments["to"], str)
    assert seen_tools == {"get_weather", "book_flight"}  # the seed picks among the tools

    named = client.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "x"}], tools=[WEATHER, BOOK],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "book_flight"}},
    )  # fmt: skip
    assert [c.function.name for c in named.choices[0].message.tool_calls or []] == ["book_flight"]
    none = client.chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": "x"}],
        tools=[WEATHER],
        tool_choice="none",  # type: ignore[list-item]
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "stop"
    # With the tool's result in hand, "auto" answers in text; "required" calls a tool again.
    after: Any = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    auto = client.chat.completions.create(model="sim-model", messages=after, tools=[WEATHER])  # type: ignore[list-item]
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content
    required = client.chat.completions.create(
        model="sim-model",
        messages=after,
        tools=[WEATHER],
        tool_choice="required",  # type: ignore[list-item]
    )
    assert required.choices[0].finish_reason == "tool_calls"


def test_malformed_tool_calls_on_request(engine: Engine) -> None:
    client = engine.client()
    tools: Any = [WEATHER]

    def call(marker: str) -> Any:
        reply = client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": f"weather {marker}"}], tools=tools
        )
        [tool_call] = reply.choices[0].message.tool_calls or []
        return tool_call.function

    with pytest.raises(json.JSONDecodeError):
        json.loads(call("#malformed-json").arguments)
    assert call("#malformed-tool").name not in {"get_weather"}
    bad_args = json.loads(call("#malformed-args").arguments)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad_args, WEATHER["function"]["parameters"])  # type: ignore[index]


def _stream(client: openai.OpenAI, **kwargs: Any) -> list[Any]:
    return list(client.chat.completions.create(model="sim-model", stream=True, **kwargs))


def test_streaming_text_and_tool_calls(engine: Engine) -> None:
    client = engine.client()
    messages: Any = [{"role": "user", "content": "stream me a few words"}]
    plain = client.chat.completions.create(model="sim-model", messages=messages, extra_body={"request_id": "p/0"})
    chunks = _stream(client, messages=messages, stream_options={"include_usage": True},
                     extra_body={"request_id": "st/0", "session_id": "st"})  # fmt: skip
    assert all(c.object == "chat.completion.chunk" and c.id == "st/0" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # word by word
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.prompt_tokens == plain.usage.prompt_tokens  # type: ignore[union-attr]
    assert usage_chunk.model_extra and usage_chunk.model_extra["agentlog"]["replayed"] is False

    tool_chunks = _stream(client, messages=messages, tools=[WEATHER])
    assert all(c.usage is None for c in tool_chunks)  # no usage chunk unless asked for
    deltas = [d for c in tool_chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])  # type: ignore[index]
    assert len(deltas) > 2  # the arguments come in pieces
    assert tool_chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_repeated_request_id_is_answered_from_the_record_even_after_a_restart(engine: Engine) -> None:
    client = engine.client()
    messages: Any = [{"role": "user", "content": "once only"}]
    extra = {"request_id": "r/0", "session_id": "r"}
    first = client.chat.completions.create(model="sim-model", messages=messages, tools=[WEATHER], extra_body=extra)  # type: ignore[list-item]
    assert first.model_extra and first.model_extra["agentlog"]["replayed"] is False
    second = client.chat.completions.create(model="sim-model", messages=messages, tools=[WEATHER], extra_body=extra)  # type: ignore[list-item]
    assert second.model_extra and second.model_extra["agentlog"]["replayed"] is True
    assert second.choices[0].message.tool_calls == first.choices[0].message.tool_calls
    streamed = _stream(client, messages=messages, tools=[WEATHER], extra_body=extra)
    deltas = [d for c in streamed for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id == (first.choices[0].message.tool_calls or [])[0].id
    assert streamed[-1].model_extra and streamed[-1].model_extra["agentlog"]["replayed"] is True
    stats = engine.get("/stats")
    assert (stats["num_served"], stats["num_replayed"]) == (1, 2)

    engine.process.stop()
    engine.start()
    third = client.chat.completions.create(model="sim-model", messages=messages, tools=[WEATHER], extra_body=extra)  # type: ignore[list-item]
    assert third.choices[0].message.tool_calls == first.choices[0].message.tool_calls
    stats = engine.get("/stats")
    assert (stats["num_served"], stats["num_replayed"]) == (1, 1)  # counted since the restart, none computed


USER: Any = [{"role": "user", "content": "x"}]
BAD_BODIES: list[tuple[Any, str | None]] = [
    (b"{not json", None),
    (b"[1, 2]", None),
    ({"messages": USER}, "model"),
    ({"model": "sim-model"}, "messages"),
    ({"model": "sim-model", "messages": []}, "messages"),
    ({"model": "sim-model", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
    ({"model": "sim-model", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"model": "sim-model", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"model": "sim-model", "messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"model": "sim-model", "messages": USER, "max_tokens": "9"}, "max_tokens"),
    ({"model": "sim-model", "messages": USER, "stream": "yes"}, "stream"),
    ({"model": "sim-model", "messages": USER, "tools": [{"type": "x"}]}, "tools[0]"),
    (
        {"model": "sim-model", "messages": USER,
         "tools": [{"type": "function", "function": {"name": "t", "parameters": {"type": "nonsense"}}}]},
        "tools[0].function.parameters",
    ),
    (
        {"model": "sim-model", "messages": USER, "tools": [WEATHER],
         "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ({"model": "sim-model", "messages": USER, "tool_choice": "required"}, "tool_choice"),
]  # fmt: skip


def test_bad_bodies_get_openais_error_shape_and_change_nothing(engine: Engine) -> None:
    for bad, param in BAD_BODIES:
        body = bad if isinstance(bad, bytes) else json.dumps(bad).encode()
        status, answer = engine.post("/v1/chat/completions", body)
        assert status == 400, (body, answer)
        assert set(answer) == {"error"}
        assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"], body
        assert answer["error"]["param"] == param, (body, answer)
    status, answer = engine.post("/v1/chat/completions", json.dumps({"model": "gpt-9", "messages": USER}).encode())
    assert (status, answer["error"]["code"], answer["error"]["param"]) == (404, "model_not_found", "model")
    with pytest.raises(openai.BadRequestError) as refused:
        engine.client().chat.completions.create(model="sim-model", messages=[])
    assert refused.value.status_code == 400 and refused.value.param == "messages"  # the client reads the shape
    stats = engine.get("/stats")
    assert (stats["num_served"], stats["kv_seq"]) == (0, 0)  # nothing ran, nothing recorded
    # A request id already used for a completion is not answered with a completion object.
    status, _ = engine.post("/v1/completions", json.dumps({"request_id": "c/0", "prompt": "a b c"}).encode())
    assert status == 200
    reused = {"model": "sim-model", "messages": USER, "request_id": "c/0"}
    status, answer = engine.post("/v1/chat/completions", json.dumps(reused).encode())
    assert (status, answer["error"]["code"]) == (409, "request_id_reused")
    assert engine.get("/stats")["num_replayed"] == 0  # refused, not answered from the record


def test_the_planners_chat_engine_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ChatEngine`` (``--engine-kind openai``) against the sim engine with an API key."""
    rig = Engine(tmp_path, "--api-key", "k-secret-1").start()
    monkeypatch.setenv("AGENTLOG_ENGINE_MODEL", "sim-model")
    monkeypatch.setenv("AGENTLOG_ENGINE_API_KEY", "k-secret-1")
    messages = [{"role": "user", "content": "what is the weather"}]

    async def body() -> None:
        engine = create_engine(f"{rig.url}/v1", engine_id="chat-0", kind="openai")
        assert isinstance(engine, ChatEngine) and "k-secret-1" not in repr(engine)
        wrong = ChatEngine(rig.url, engine_id="chat-0", model="sim-model", api_key="k-wrong")
        try:
            call = {"session_id": "s", "request_id": "s/llm-0", "prompt": Prompt(text="rendered"),
                    "max_output_tokens": 6, "messages": messages, "tools": [WEATHER]}  # fmt: skip
            first = await engine.complete(**call)  # type: ignore[attr-defined]
            assert first.finish_reason == "tool_calls" and first.text == "" and first.output_tokens == 6
            [tool_call] = first.tool_calls
            assert tool_call.name == "get_weather" and tool_call.id.startswith("call_")
            jsonschema.validate(json.loads(tool_call.arguments), WEATHER["function"]["parameters"])  # type: ignore[index]
            # The messages and tools were sent (not the prompt text): the engine counted their rendering.
            assert first.prompt_tokens == len(text_token_ids(render_messages(messages, [WEATHER])))
            assert not first.replayed
            again = await engine.complete(**call)  # type: ignore[attr-defined]
            assert again.replayed and again.tool_calls == first.tool_calls
            # A text prompt without messages (react, the LLM judge) is one user message.
            text = await engine.complete(session_id="s", request_id="s/llm-1", prompt=Prompt(text="a b c"),
                                         max_output_tokens=2)  # fmt: skip
            assert text.text.startswith("simulated answer") and text.tool_calls == () and text.prompt_tokens == 5
            with pytest.raises(EngineError, match="token runs"):
                await engine.complete(session_id="s", request_id="s/llm-2", prompt=Prompt((TokenRun("x", 4),)),
                                      max_output_tokens=2)  # fmt: skip
            with pytest.raises(EngineError, match="401") as refused:
                await wrong.complete(**call)  # type: ignore[attr-defined]
            assert "k-wrong" not in str(refused.value)
        finally:
            await engine.close()
            await wrong.close()
        stats = rig.get("/stats")
        assert (stats["num_served"], stats["num_replayed"]) == (2, 1)
        session_hits = [e for b in rig.get("/kv_events?after=0")["batches"] for e in b["events"] if e["kind"] == "hit"]
        assert {h["session_id"] for h in session_hits} == {"s"}  # the session id reached the engine

    try:
        asyncio.run(body())
    finally:
        rig.process.stop()
