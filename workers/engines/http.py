"""An engine reached over HTTP with vLLM's OpenAI-compatible completions API.

The request is ``POST {base_url}/v1/completions`` with the usual fields
(``model``, ``prompt``, ``max_tokens``) plus ``request_id`` and ``session_id``
(and, for token-run prompts, ``prompt_runs``; with a program-level priority, vLLM's
``priority``: ``services.scheduling``), and the answer the usual
``choices[0].text`` and ``usage`` (``prompt_tokens_details.cached_tokens``).
agentlog's simulated engine serves the same API (``workers.engines.sim_server``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from schemas.events import EngineId
from services.engine.record import RECORD_FIELD
from services.programs.base import Prompt
from workers.engines.base import Completion, EngineError, EngineUnavailable


class HttpEngine:
    def __init__(self, base_url: str, *, engine_id: str = "", model: str = "sim", timeout_s: float = 600) -> None:
        self.base_url = base_url.rstrip("/")
        self.engine_id = EngineId(engine_id or base_url)
        self.model = model
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    def payload(self, *, session_id: str, request_id: str, prompt: Prompt, max_output_tokens: int,
                priority: int | None = None) -> dict[str, Any]:  # fmt: skip
        """The request body (subclasses add engine-specific fields)."""
        payload: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_output_tokens,
            "request_id": request_id,
            "session_id": session_id,
        }
        if priority is not None:
            payload["priority"] = priority
        if prompt.text is not None:
            payload["prompt"] = prompt.text
        else:
            payload["prompt_runs"] = prompt.to_json()["runs"]
        return payload

    def replayed(self, body: dict[str, Any], engine_says: bool) -> bool:
        """Was this answer a replay: by the engine's own record (the simulated engine), or by the
        engine recorder in front of it (``workers/engines/recorder.py``)?"""
        return engine_says or bool((body.get(RECORD_FIELD) or {}).get("replayed", False))

    def timings(self, body: dict[str, Any], total_ms: float) -> tuple[float, float, float, bool]:
        """``(queue_ms, prefill_ms, decode_ms, replayed)`` from the answer (agentlog's sim engine
        reports them under ``agentlog``; without them the whole call counts as prefill)."""
        timing = body.get("agentlog", {})
        return (
            float(timing.get("queue_ms", 0.0)),
            float(timing.get("prefill_ms", total_ms)),
            float(timing.get("decode_ms", 0.0)),
            bool(timing.get("replayed", False)),
        )

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
        """A completion of ``prompt`` (``messages``, ``tools`` and ``tool_choice`` are for chat engines:
        the prompt is their rendering)."""
        payload = self.payload(
            session_id=session_id,
            request_id=request_id,
            prompt=prompt,
            max_output_tokens=max_output_tokens,
            priority=priority,
        )
        began = time.monotonic()
        body = await self.post("/v1/completions", payload, request_id=request_id)
        usage = body.get("usage", {})
        queue_ms, prefill_ms, decode_ms, replayed = self.timings(body, (time.monotonic() - began) * 1000)
        return Completion(
            request_id=request_id,
            engine_id=self.engine_id,
            text=body["choices"][0]["text"],
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
            output_tokens=int(usage.get("completion_tokens", 0)),
            finish_reason=str(body["choices"][0].get("finish_reason") or "stop"),
            queue_ms=queue_ms,
            prefill_ms=prefill_ms,
            decode_ms=decode_ms,
            replayed=self.replayed(body, replayed),
        )

    async def post(
        self, path: str, payload: dict[str, Any], *, request_id: str, headers: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """POST ``payload``; the answer's JSON. Raises ``EngineUnavailable`` (retry: unreachable, 5xx,
        429) or ``EngineError`` (refused: any other 4xx). Errors quote the answer, never the headers."""
        try:
            client = await self._client()
            async with client.post(f"{self.base_url}{path}", json=payload, headers=headers) as response:
                body = await response.json(content_type=None)
                if response.status >= 500 or response.status == 429:
                    raise EngineUnavailable(f"engine {self.engine_id} answered {response.status}: {body}")
                if response.status >= 400:
                    raise EngineError(f"engine {self.engine_id} refused {request_id} ({response.status}): {body}")
        except (aiohttp.ClientError, TimeoutError, ConnectionError, ValueError) as e:
            raise EngineUnavailable(f"engine {self.engine_id} unreachable: {type(e).__name__}: {e}") from e
        if not isinstance(body, dict):
            raise EngineError(f"engine {self.engine_id} answered {request_id} with {body!r}, not a JSON object")
        return body

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
