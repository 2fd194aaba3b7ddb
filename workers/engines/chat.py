"""An engine reached over OpenAI's chat completions API: agentlog's simulated engine, vLLM's
OpenAI server, or any OpenAI-compatible endpoint.

``POST {base_url}/v1/chat/completions`` with ``model``, ``messages``, ``tools`` and ``tool_choice``
(when the program gives them) and ``max_completion_tokens``; the request id and the session id travel as the
headers ``X-Request-Id`` and ``X-Agentlog-Session`` and, unless ``ids_in_body`` is off (an
endpoint that refuses unknown fields, as OpenAI's own does), as the body fields
``request_id`` and ``session_id`` (the simulated engine and vLLM read them there), and the
call's program-level ``priority`` when it has one (vLLM's field: ``services.scheduling``). An API key
goes in ``Authorization: Bearer``; it is never logged nor put in an error.

An SDK program's ``ctx.llm(messages, tools)`` is sent as it is; any other text prompt (the
``react`` program, the LLM judge) is sent as one user message. A token-run prompt (the
``trace`` program) has no text to send: a chat engine refuses it.

The reply's ``content`` is the completion's text and its ``tool_calls`` its tool calls, with
the raw arguments string, malformed or not (the program decides what to do with them).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from services.programs.base import ModelToolCall, Prompt
from workers.engines.base import Completion, EngineError
from workers.engines.http import HttpEngine

__all__ = ["ChatEngine"]


class ChatEngine(HttpEngine):
    def __init__(
        self,
        base_url: str,
        *,
        engine_id: str = "",
        model: str = "sim",
        api_key: str | None = None,
        ids_in_body: bool = True,
        temperature: float | None = None,
        timeout_s: float = 600,
    ) -> None:
        # An OpenAI-style base URL ends in /v1; the paths here start there.
        base_url = base_url.rstrip("/").removesuffix("/v1")
        super().__init__(base_url, engine_id=engine_id, model=model, timeout_s=timeout_s)
        self._api_key = api_key
        self.ids_in_body = ids_in_body
        self.temperature = temperature

    def __repr__(self) -> str:  # no key in a repr either
        return f"ChatEngine({self.base_url!r}, engine_id={self.engine_id!r}, model={self.model!r})"

    def chat_payload(
        self,
        *,
        session_id: str,
        request_id: str,
        prompt: Prompt,
        max_output_tokens: int,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        tool_choice: str | Mapping[str, Any] | None = None,
        priority: int | None = None,
    ) -> dict[str, Any]:
        if not messages:
            if prompt.text is None:
                raise EngineError(
                    f"request {request_id}: a chat engine needs messages or a text prompt, and this prompt is "
                    "token runs (the trace program); use --engine-kind sim or vllm for it"
                )
            messages = [{"role": "user", "content": prompt.text}]
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": [dict(m) for m in messages],
            "max_completion_tokens": max_output_tokens,
        }
        if tools:
            payload["tools"] = [dict(t) for t in tools]
        if tool_choice is not None:
            payload["tool_choice"] = tool_choice if isinstance(tool_choice, str) else dict(tool_choice)
        if self.temperature is not None:
            payload["temperature"] = self.temperature
        if self.ids_in_body:
            payload["request_id"] = request_id
            payload["session_id"] = session_id
            if priority is not None:  # vLLM's field; an endpoint that refuses unknown fields gets none
                payload["priority"] = priority
        return payload

    def headers(self, *, session_id: str, request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id, "X-Agentlog-Session": session_id}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    def timings(self, body: dict[str, Any], total_ms: float) -> tuple[float, float, float, bool]:
        """The simulated engine's ``agentlog`` timings, else vLLM's per-request ``metrics``, else the whole
        call as prefill."""
        if "agentlog" in body:
            return super().timings(body, total_ms)
        metrics = body.get("metrics") or {}
        prefill = metrics.get("time_to_first_token_ms")
        if prefill is None:
            return 0.0, total_ms, 0.0, False
        queue_ms = float(metrics.get("queue_time_ms") or 0.0)
        return queue_ms, float(prefill), float(metrics.get("generation_time_ms") or 0.0), False

    async def complete(
        self,
        *,
        session_id: str,
        request_id: str,
        prompt: Prompt,
        max_output_tokens: int,
        messages: Sequence[Mapping[str, Any]] = (),
        tools: Sequence[Mapping[str, Any]] = (),
        tool_choice: str | Mapping[str, Any] | None = None,
        priority: int | None = None,
    ) -> Completion:
        payload = self.chat_payload(
            session_id=session_id,
            request_id=request_id,
            prompt=prompt,
            max_output_tokens=max_output_tokens,
            messages=messages,
            tools=tools,
            tool_choice=tool_choice,
            priority=priority,
        )
        began = time.monotonic()
        body = await self.post(
            "/v1/chat/completions",
            payload,
            request_id=request_id,
            headers=self.headers(session_id=session_id, request_id=request_id),
        )
        try:
            choice = body["choices"][0]
            message = choice["message"]
            calls = tuple(_tool_call(c) for c in message.get("tool_calls") or [])
        except (KeyError, IndexError, TypeError) as e:
            raise EngineError(f"engine {self.engine_id} answered {request_id} without a chat message: {body}") from e
        usage = body.get("usage") or {}
        queue_ms, prefill_ms, decode_ms, replayed = self.timings(body, (time.monotonic() - began) * 1000)
        return Completion(
            request_id=request_id,
            engine_id=self.engine_id,
            text=str(message.get("content") or ""),
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
            output_tokens=int(usage.get("completion_tokens", 0)),
            finish_reason=str(choice.get("finish_reason") or "stop"),
            queue_ms=queue_ms,
            prefill_ms=prefill_ms,
            decode_ms=decode_ms,
            replayed=self.replayed(body, replayed),
            tool_calls=calls,
        )


def _tool_call(call: Mapping[str, Any]) -> ModelToolCall:
    function = call["function"]
    arguments = function.get("arguments")
    if not isinstance(arguments, str):  # some servers send an object; the log keeps what a model would emit
        arguments = json.dumps(arguments)
    return ModelToolCall(str(call.get("id") or ""), str(function.get("name") or ""), arguments)
