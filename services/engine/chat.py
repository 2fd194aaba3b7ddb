"""What the simulated engine says to a chat request: OpenAI's chat completions API, simulated.

Pure: the request body is checked and parsed here (``parse_chat_request``), the reply is a
deterministic function of the request's content (``chat_reply``), and the answer and its
server-sent-event chunks are built here (``completion_json``, ``stream_chunks``); the server
(``workers.engines.sim_server``) only adds the engine call, the clock and the network.

**What the model says.** A seed is digested from the request's content (messages, tools,
tool choice), so the same conversation always gets the same answer:

- ``tool_choice`` ``"none"`` (or no tools): text;
- ``"auto"`` (the default with tools): a tool call, unless the last message is a ``tool``
  message (the model has its result and answers in text), so an agent loop ends;
- ``"required"``: a tool call; a named function (``{"type": "function", "function": {"name"}}``):
  a call of that one.

The tool is picked by the seed among ``tools``; its arguments are generated from its JSON
schema (``sample_arguments``: object, string, number, integer, boolean, null, array, enum,
const, anyOf/oneOf; bounds honoured, ``pattern`` and ``format`` not), so they satisfy it.

**Malformed tool calls on purpose**, for tests: a marker in the last ``user`` message's text
makes the call malformed in one way: ``#malformed-json`` (arguments that are not JSON),
``#malformed-tool`` (a tool name not in ``tools``), ``#malformed-args`` (JSON arguments that
fail the tool's schema: a required property left out, or not an object).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

import jsonschema

from services.programs.sdk import render_messages
from services.scheduling import request_priority

__all__ = [
    "CHAT_ROLES",
    "MALFORMED_MARKERS",
    "ChatReply",
    "ChatRequest",
    "ChatRequestError",
    "ToolCall",
    "chat_reply",
    "completion_json",
    "error_json",
    "parse_chat_request",
    "sample_arguments",
    "stream_chunks",
]

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MALFORMED_MARKERS = ("#malformed-json", "#malformed-tool", "#malformed-args")
DEFAULT_MAX_TOKENS = 16  # as the completions endpoint
_SEED_PERSON = b"agentlog-sim-cht"
_ARGUMENT_PIECE = 8  # characters of arguments per streamed chunk


class ChatRequestError(ValueError):
    """A request the engine refuses; ``error_json`` gives it OpenAI's error shape."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


def error_json(error: ChatRequestError) -> dict[str, Any]:
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...]
    tool_choice: str
    """``none``, ``auto``, ``required`` or ``function`` (then ``tool_name`` says which)."""
    tool_name: str | None
    max_tokens: int
    stream: bool
    include_usage: bool
    request_id: str | None
    session_id: str | None
    priority: int = 0
    """vLLM's ``priority``: lower is served first (``services.scheduling``); 0 when absent."""

    def prompt_text(self) -> str:
        """The text whose tokens the engine counts and caches (the SDK renders messages the same way)."""
        return render_messages(self.messages, self.tools)

    def tool_schema(self, name: str) -> dict[str, Any] | None:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                schema: dict[str, Any] = tool["function"].get("parameters") or {"type": "object"}
                return schema
        return None


def _positive_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ChatRequestError(f"{key} must be a positive integer, got {value!r}", param=key)
    return value


def _optional_str(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ChatRequestError(f"{key} must be a non-empty string, got {value!r}", param=key)
    return value


def _check_message(message: Any, index: int) -> dict[str, Any]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ChatRequestError(f"{param} must be an object, got {message!r}", param=param)
    role = message.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:  # a list or a dict is not hashable
        raise ChatRequestError(f"{param}.role must be one of {sorted(CHAT_ROLES)}, got {role!r}", param=param)
    content = message.get("content")
    if content is None:
        if not (role == "assistant" and message.get("tool_calls")):
            raise ChatRequestError(
                f"{param}.content is missing (only an assistant message with tool_calls may omit it)",
                param=f"{param}.content",
            )
    elif isinstance(content, list):
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ChatRequestError(f"{param}.content parts must be objects with a type", param=f"{param}.content")
    elif not isinstance(content, str):
        raise ChatRequestError(f"{param}.content must be a string or a list of parts", param=f"{param}.content")
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise ChatRequestError(f"{param}.tool_call_id is required for a tool message", param=f"{param}.tool_call_id")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and not (
        isinstance(tool_calls, list)
        and all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in tool_calls)
    ):
        raise ChatRequestError(f"{param}.tool_calls must be a list of function calls", param=f"{param}.tool_calls")
    return message


def _check_tool(tool: Any, index: int) -> dict[str, Any]:
    param = f"tools[{index}]"
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
        raise ChatRequestError(f"{param} must be {{'type': 'function', 'function': {{...}}}}", param=param)
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ChatRequestError(f"{param}.function.name must be a non-empty string", param=f"{param}.function.name")
    parameters = function.get("parameters")
    if parameters is not None:
        try:
            if not isinstance(parameters, dict):
                raise jsonschema.SchemaError("not an object")
            jsonschema.Draft202012Validator.check_schema(parameters)
        except jsonschema.SchemaError as e:
            raise ChatRequestError(f"{param}.function.parameters is not a JSON schema: {e.message}",
                                   param=f"{param}.function.parameters") from None  # fmt: skip
    return {"type": "function", "function": function}


def _tool_choice(value: Any, tools: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise ChatRequestError("tool_choice 'required' needs tools", param="tool_choice")
        return str(value), None
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ChatRequestError(
            f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': {{'name'}}}}, "
            f"got {value!r}",
            param="tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise ChatRequestError(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
    return "function", name


def parse_chat_request(body: Any) -> ChatRequest:
    """The request ``body`` (decoded JSON), checked; raises ``ChatRequestError`` saying what is wrong."""
    if not isinstance(body, dict):
        raise ChatRequestError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ChatRequestError("model must be a non-empty string", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("messages must be a non-empty list", param="messages")
    checked = tuple(_check_message(m, i) for i, m in enumerate(messages))
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise ChatRequestError("tools must be a list", param="tools")
    specs = tuple(_check_tool(t, i) for i, t in enumerate(tools))
    choice, name = _tool_choice(body.get("tool_choice"), specs)
    max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ChatRequestError(f"stream must be a boolean, got {stream!r}", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ChatRequestError("stream_options must be an object", param="stream_options")
    if body.get("n", 1) != 1:
        raise ChatRequestError("the simulated engine answers n=1 only", param="n")
    try:
        priority = request_priority(body.get("priority"))
    except ValueError as e:
        raise ChatRequestError(str(e), param="priority") from None
    return ChatRequest(
        model=model,
        messages=checked,
        tools=specs,
        tool_choice=choice,
        tool_name=name,
        max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        request_id=_optional_str(body, "request_id"),
        session_id=_optional_str(body, "session_id"),
        priority=priority,
    )


# ------------------------------------------------------------------------ the reply


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """The raw arguments string, as a model emits it (JSON, unless malformed)."""

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ChatReply:
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_calls else "stop"

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.to_json() for call in self.tool_calls]
        return message


def _seed(request: ChatRequest) -> bytes:
    content = {"messages": request.messages, "tools": request.tools,
               "tool_choice": [request.tool_choice, request.tool_name]}  # fmt: skip
    return blake2b(json.dumps(content, sort_keys=True).encode(), digest_size=16, person=_SEED_PERSON).digest()


def _text_of(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def _marker(request: ChatRequest) -> str | None:
    users = [m for m in request.messages if m["role"] == "user"]
    text = _text_of(users[-1]) if users else ""
    return next((marker for marker in MALFORMED_MARKERS if marker in text), None)


def _wants_tool(request: ChatRequest) -> bool:
    if request.tool_choice == "none" or not request.tools:
        return False
    if request.tool_choice == "auto":
        return bool(request.messages[-1]["role"] != "tool")
    return True


def chat_reply(request: ChatRequest, *, request_id: str, num_prompt_tokens: int) -> ChatReply:
    """What the simulated model answers (module docstring): deterministic in the request's content;
    ``request_id`` only names the tool calls."""
    seed = _seed(request)
    rng = random.Random(int.from_bytes(seed, "little"))
    if not _wants_tool(request):
        return ChatReply(f"simulated answer {seed.hex()[:8]} to {num_prompt_tokens} prompt tokens")
    names = [t["function"]["name"] for t in request.tools]
    name = request.tool_name or names[rng.randrange(len(names))]
    schema = request.tool_schema(name) or {"type": "object"}
    arguments: Any = sample_arguments(schema, rng)
    marker = _marker(request)
    if marker == "#malformed-tool":
        name = next(
            f"{name}_unknown{'_' * i}" for i in range(len(names) + 1) if f"{name}_unknown{'_' * i}" not in names
        )
    elif marker == "#malformed-args":
        arguments = _violating(schema, arguments)
    raw = json.dumps(arguments, sort_keys=True)
    if marker == "#malformed-json":
        raw = raw[:-1]  # cut off the closing brace: never JSON
    call_id = "call_" + blake2b(f"{request_id}:0".encode() + seed, digest_size=12).hexdigest()
    return ChatReply(None, (ToolCall(call_id, name, raw),))


def _violating(schema: Mapping[str, Any], arguments: Any) -> Any:
    """Arguments that fail ``schema``: a required property left out, else not an object at all."""
    required = schema.get("required") or []
    if isinstance(arguments, dict) and required:
        return {k: v for k, v in arguments.items() if k != required[0]}
    return [arguments]


# ------------------------------------------------------------ arguments from a schema

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def sample_arguments(schema: Mapping[str, Any], rng: random.Random) -> Any:
    """A value that satisfies ``schema`` (the subset the module docstring lists), drawn from ``rng``."""
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][rng.randrange(len(schema["enum"]))]
    for key in ("anyOf", "oneOf"):
        choices = schema.get(key)
        if isinstance(choices, list) and choices:
            return sample_arguments(choices[rng.randrange(len(choices))], rng)
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"] or ["null"]
        kind = kinds[0]
    if kind is None:
        kind = "object" if "properties" in schema else "string"
    if kind == "object":
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        # Every required property; each optional one half the time.
        return {
            key: sample_arguments(sub if isinstance(sub, dict) else {}, rng)
            for key, sub in properties.items()
            if key in required or rng.random() < 0.5
        }
    if kind == "array":
        low = int(schema.get("minItems", 1))
        high = max(low, int(schema.get("maxItems", low + 2)))
        items = schema.get("items")
        items = items if isinstance(items, dict) else {}
        return [sample_arguments(items, rng) for _ in range(rng.randint(low, high))]
    if kind == "string":
        low = int(schema.get("minLength", 1))
        high = max(low, int(schema.get("maxLength", max(low, 10))))
        length = rng.randint(low, min(high, max(low, 10)))
        return "".join(_LETTERS[rng.randrange(len(_LETTERS))] for _ in range(length))
    if kind in ("integer", "number"):
        return _number(schema, rng, integer=kind == "integer")
    if kind == "boolean":
        return rng.random() < 0.5
    return None


def _number(schema: Mapping[str, Any], rng: random.Random, *, integer: bool) -> int | float:
    low = float(schema.get("minimum", schema.get("exclusiveMinimum", 0)))
    high = float(schema.get("maximum", schema.get("exclusiveMaximum", max(low, 0) + 100)))
    if integer:
        lo = int(low) + 1 if "exclusiveMinimum" in schema and "minimum" not in schema else -int(-low // 1)
        hi = int(high) - 1 if "exclusiveMaximum" in schema and "maximum" not in schema else int(high // 1)
        return rng.randint(lo, max(lo, hi))
    value = round(low + (high - low) * (0.05 + 0.9 * rng.random()), 2)
    return min(max(value, low), high)


# ------------------------------------------------------------------------ the answer


def completion_json(
    reply: ChatReply, *, request_id: str, model: str, created: int, usage: dict[str, Any], agentlog: dict[str, Any]
) -> dict[str, Any]:
    """The ``chat.completion`` object (what the engine records and a repeated request id gets)."""
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": reply.message(), "finish_reason": reply.finish_reason, "logprobs": None}],
        "usage": usage,
        "agentlog": agentlog,
    }


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def _words(text: str) -> list[str]:
    words = text.split(" ")
    return [w + " " for w in words[:-1]] + [words[-1]]


def stream_chunks(completion: Mapping[str, Any], *, include_usage: bool) -> list[dict[str, Any]]:
    """A ``chat.completion`` as the ``chat.completion.chunk`` objects of a stream, as OpenAI sends them:
    the role, the content word by word or each tool call (id and name, then its arguments in
    pieces), the finish reason, then (``include_usage``) a chunk with no choices and the usage.
    The last chunk carries the ``agentlog`` timings."""
    head = {k: completion[k] for k in ("id", "created", "model")}
    usage_field = {"usage": None} if include_usage else {}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {**head, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
                **usage_field}  # fmt: skip

    choice = completion["choices"][0]
    message = choice["message"]
    chunks = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        chunks.extend(chunk({"content": word}) for word in _words(message["content"]))
    for index, call in enumerate(message.get("tool_calls") or []):
        function = call["function"]
        chunks.append(chunk({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                             "function": {"name": function["name"], "arguments": ""}}]}))  # fmt: skip
        chunks.extend(
            chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
            for piece in _pieces(function["arguments"], _ARGUMENT_PIECE)
        )
    chunks.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        chunks.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": completion["usage"]})
    chunks[-1] = {**chunks[-1], "agentlog": completion.get("agentlog", {})}
    return chunks
