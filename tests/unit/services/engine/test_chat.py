"""The simulated model's chat replies: parsing, the tool-call rules, schema-valid arguments, the stream."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest

from services.engine.chat import (
    ChatRequestError,
    chat_reply,
    completion_json,
    parse_chat_request,
    sample_arguments,
    stream_chunks,
)

pytestmark = pytest.mark.unit

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 3, "maxLength": 5},
        "mode": {"enum": ["a", "b", 3]},
        "n": {"type": "integer", "minimum": -3, "maximum": 3},
        "x": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        "k": {"type": "integer", "exclusiveMinimum": 4, "exclusiveMaximum": 6},
        "flag": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2},
        "nested": {"type": "object", "properties": {"v": {"type": ["null", "integer"]}}, "required": ["v"]},
        "either": {"anyOf": [{"type": "string"}, {"type": "boolean"}]},
        "fixed": {"const": "yes"},
        "nothing": {"type": "null"},
    }, "required": ["name", "mode", "n", "x", "k", "nested"], "additionalProperties": False},
    {"type": "object"},
]  # fmt: skip


@pytest.mark.parametrize("schema", SCHEMAS)
def test_sampled_arguments_satisfy_their_schema(schema: dict[str, Any]) -> None:
    for seed in range(200):
        jsonschema.validate(sample_arguments(schema, random.Random(seed)), schema)


def _request(content: str = "hi", **body: Any) -> Any:
    return parse_chat_request({"model": "m", "messages": [{"role": "user", "content": content}], **body})


def _tool(name: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": schema or SCHEMAS[0]}}


def test_the_reply_is_text_without_tools_and_a_function_of_the_content() -> None:
    reply = chat_reply(_request(), request_id="a", num_prompt_tokens=3)
    assert reply.tool_calls == () and reply.finish_reason == "stop"
    assert reply == chat_reply(_request(), request_id="b", num_prompt_tokens=3)
    assert reply != chat_reply(_request("other"), request_id="a", num_prompt_tokens=3)


def test_the_tool_choice_rules() -> None:
    tools = [_tool("a"), _tool("b")]
    auto = chat_reply(_request(tools=tools), request_id="r", num_prompt_tokens=1)
    assert auto.finish_reason == "tool_calls" and auto.content is None
    assert chat_reply(_request(tools=tools), request_id="r", num_prompt_tokens=1) == auto  # ids too
    assert chat_reply(_request(tools=tools, tool_choice="none"), request_id="r", num_prompt_tokens=1).tool_calls == ()
    named = _request(tools=tools, tool_choice={"type": "function", "function": {"name": "b"}})
    assert [c.name for c in chat_reply(named, request_id="r", num_prompt_tokens=1).tool_calls] == ["b"]
    answered = parse_chat_request({"model": "m", "tools": tools, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [auto.tool_calls[0].to_json()]},
        {"role": "tool", "tool_call_id": auto.tool_calls[0].id, "content": "done"},
    ]})  # fmt: skip
    assert chat_reply(answered, request_id="r2", num_prompt_tokens=1).tool_calls == ()
    required = parse_chat_request({**_body(answered), "tool_choice": "required"})
    assert len(chat_reply(required, request_id="r2", num_prompt_tokens=1).tool_calls) == 1


def _body(request: Any) -> dict[str, Any]:
    return {"model": request.model, "messages": list(request.messages), "tools": list(request.tools)}


def test_malformed_markers() -> None:
    tools = [_tool("a")]

    def call(marker: str) -> Any:
        [tool_call] = chat_reply(_request(f"go {marker}", tools=tools), request_id="r", num_prompt_tokens=1).tool_calls
        return tool_call

    good = call("")
    jsonschema.validate(json.loads(good.arguments), SCHEMAS[0])
    with pytest.raises(json.JSONDecodeError):
        json.loads(call("#malformed-json").arguments)
    assert call("#malformed-tool").name != "a"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(call("#malformed-args").arguments), SCHEMAS[0])
    without_required = chat_reply(
        _request("go #malformed-args", tools=[_tool("o", {"type": "object"})]), request_id="r", num_prompt_tokens=1
    )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(without_required.tool_calls[0].arguments), {"type": "object"})


def test_the_stream_reassembles_into_the_completion() -> None:
    request = _request(tools=[_tool("a")])
    reply = chat_reply(request, request_id="r", num_prompt_tokens=1)
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    completion = completion_json(reply, request_id="r", model="m", created=0, usage=usage, agentlog={"replayed": False})
    chunks = stream_chunks(completion, include_usage=True)
    deltas = [call for c in chunks if c["choices"] for call in c["choices"][0]["delta"].get("tool_calls", [])]
    arguments = "".join(call["function"].get("arguments", "") for call in deltas)
    assert arguments == reply.tool_calls[0].arguments
    assert (
        chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage and chunks[-1]["agentlog"] == {"replayed": False}
    )
    assert all(c["usage"] is None for c in chunks[:-1])
    assert "usage" not in stream_chunks(completion, include_usage=False)[-1]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": [{"role": "assistant"}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": []}]}, "messages[0]"),  # found by tests/integration/test_fuzz_http.py
        ({"model": "m", "messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "request_id": 7}, "request_id"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"}, "tool_choice"),
    ],
)
def test_bad_requests_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ChatRequestError) as refused:
        parse_chat_request(body)
    assert refused.value.param == param and refused.value.status == 400


def test_max_completion_tokens_wins_and_an_assistant_with_tool_calls_may_omit_content() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "a", "arguments": "{}"}}
    messages = [{"role": "assistant", "tool_calls": [call]}]
    request = parse_chat_request({"model": "m", "max_tokens": 9, "max_completion_tokens": 4, "messages": messages})
    assert request.max_tokens == 4 and request.tool_choice == "none"
