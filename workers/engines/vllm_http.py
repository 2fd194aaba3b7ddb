"""The planner's engine for a real vLLM server (OpenAI-compatible completions API).

What it adds to ``HttpEngine`` (whose request already carries ``session_id`` and
``request_id``, both vLLM fields: the session id labels vLLM's KV events):

- **token-run prompts** (the ``trace`` program's synthetic prompts) become token-id prompts:
  token ``t`` of a run is sent as ``3 + t % (vocab_size - 3)`` (ids 0-2 are the tokenizer's
  special tokens), so equal runs are equal token ids and share KV blocks as in the simulator;
- **control arguments** per request in ``vllm_xargs``: ``agentlog_hold_s`` asks
  ``AgentlogScheduler`` to hold the session's blocks that long after the call (a grace period
  until the cache manager's decision arrives through the engine bridge);
- **structured output** (``json_schema``, e.g. ``react_schema(tools)``): vLLM's grammar-guided
  decoding, so even a random-weight model answers the ``react`` program in valid JSON;
- **timings** from vLLM's per-request metrics (``--enable-per-request-metrics``):
  ``queue_time_ms``, ``time_to_first_token_ms`` (prefill: scheduled to first token) and
  ``generation_time_ms`` (decode).

Greedy decoding (temperature 0) by default: a recorded output is then what the model says.
vLLM does not remember answers: a retried request id is computed again (the simulated engine
answers it from its record) unless the planner reaches vLLM through the engine recorder
(``workers/engines/recorder.py``), which answers it from a durable record.
"""

from __future__ import annotations

import copy
from typing import Any

from services.programs.base import Prompt
from services.tools import TOOLS
from workers.engines.http import HttpEngine

__all__ = ["FIRST_TOKEN_ID", "HOLD_ARG", "VllmEngine", "react_schema", "token_ids"]

HOLD_ARG = "agentlog_hold_s"
FIRST_TOKEN_ID = 3
"""Token ids below this are special tokens (unk, bos, eos in the tiny model's tokenizer)."""


def token_ids(prompt: Prompt, vocab_size: int) -> list[int]:
    span = vocab_size - FIRST_TOKEN_ID
    return [FIRST_TOKEN_ID + t % span for t in prompt.token_ids()]


def _bounded(schema: dict[str, Any], max_string: int) -> dict[str, Any]:
    """The schema with a ``maxLength`` on every unbounded string (a random model never stops one)."""
    schema = copy.deepcopy(schema)
    if schema.get("type") == "string":
        schema.setdefault("maxLength", max_string)
    for sub in schema.get("properties", {}).values():
        sub.update(_bounded(sub, max_string))
    return schema


def react_schema(tools: list[str], *, answer: bool = True, max_string: int = 24) -> dict[str, Any]:
    """JSON schema of a ``react`` reply: one of the tools with its argument schema, or (unless
    ``answer`` is false: the model must keep calling tools) an answer."""
    choices: list[dict[str, Any]] = [
        {
            "type": "object",
            "properties": {"tool": {"const": name}, "arguments": _bounded(TOOLS[name].args_schema, max_string)},
            "required": ["tool", "arguments"],
            "additionalProperties": False,
        }
        for name in tools
    ]
    if answer:
        choices.append(
            {
                "type": "object",
                "properties": {"answer": {"type": "string", "maxLength": max_string}},
                "required": ["answer"],
                "additionalProperties": False,
            }
        )
    return {"anyOf": choices}


class VllmEngine(HttpEngine):
    def __init__(
        self,
        base_url: str,
        *,
        engine_id: str = "",
        model: str = "tiny",
        vocab_size: int = 4096,
        hold_s: float | None = None,
        json_schema: dict[str, Any] | None = None,
        temperature: float = 0.0,
        timeout_s: float = 600,
    ) -> None:
        super().__init__(base_url, engine_id=engine_id, model=model, timeout_s=timeout_s)
        self.vocab_size = vocab_size
        self.hold_s = hold_s
        self.json_schema = json_schema
        self.temperature = temperature

    def payload(self, *, session_id: str, request_id: str, prompt: Prompt, max_output_tokens: int,
                priority: int | None = None) -> dict[str, Any]:  # fmt: skip
        payload = super().payload(
            session_id=session_id,
            request_id=request_id,
            prompt=prompt,
            max_output_tokens=max_output_tokens,
            priority=priority,
        )
        if prompt.text is None:
            del payload["prompt_runs"]
            payload["prompt"] = token_ids(prompt, self.vocab_size)
            payload["ignore_eos"] = True  # a trace's call generates its recorded number of tokens
        payload["temperature"] = self.temperature
        if self.hold_s:
            payload["vllm_xargs"] = {HOLD_ARG: self.hold_s}
        if self.json_schema is not None:
            payload["structured_outputs"] = {"json": self.json_schema, "disable_any_whitespace": True}
        return payload

    def timings(self, body: dict[str, Any], total_ms: float) -> tuple[float, float, float, bool]:
        metrics = body.get("metrics") or {}
        prefill = metrics.get("time_to_first_token_ms")
        if prefill is None:  # a server without --enable-per-request-metrics
            return 0.0, total_ms, 0.0, False
        return (
            float(metrics.get("queue_time_ms") or 0.0),
            float(prefill),
            float(metrics.get("generation_time_ms") or 0.0),
            False,
        )
