"""Which engine client a worker uses, from its command line and environment.

``AGENTLOG_ENGINE_KIND``: ``sim`` (default; agentlog's simulated engine, completions API),
``vllm`` or ``openai`` (chat completions, function calling: the simulated engine, vLLM's
OpenAI server or any OpenAI-compatible endpoint). For ``openai``: ``AGENTLOG_ENGINE_MODEL``
(the model to ask for, default ``sim``), ``AGENTLOG_ENGINE_API_KEY`` (sent as a bearer token;
never logged), ``AGENTLOG_ENGINE_IDS`` (``body``, the default: request and session ids as body
fields and headers; ``headers``: headers only, for endpoints that refuse unknown fields),
``AGENTLOG_ENGINE_TEMPERATURE`` (default: the endpoint's). For vLLM:
``AGENTLOG_VLLM_MODEL`` (served model name, default ``tiny``), ``AGENTLOG_VLLM_VOCAB_SIZE``
(default 4096), ``AGENTLOG_VLLM_HOLD_S`` (grace pin after each call, default none),
``AGENTLOG_VLLM_REACT_TOOLS`` (comma-separated: constrain replies to ``react``'s JSON for
these tools).
"""

from __future__ import annotations

import os

from workers.engines.base import Engine
from workers.engines.chat import ChatEngine
from workers.engines.http import HttpEngine
from workers.engines.vllm_http import VllmEngine, react_schema

__all__ = ["ENGINE_KINDS", "create_engine"]

ENGINE_KINDS = ("sim", "vllm", "openai")


def create_engine(url: str, *, engine_id: str, kind: str | None = None) -> Engine:
    kind = kind or os.environ.get("AGENTLOG_ENGINE_KIND", "sim")
    if kind == "sim":
        return HttpEngine(url, engine_id=engine_id)
    if kind == "vllm":
        hold = os.environ.get("AGENTLOG_VLLM_HOLD_S")
        tools = [t for t in os.environ.get("AGENTLOG_VLLM_REACT_TOOLS", "").split(",") if t]
        return VllmEngine(
            url,
            engine_id=engine_id,
            model=os.environ.get("AGENTLOG_VLLM_MODEL", "tiny"),
            vocab_size=int(os.environ.get("AGENTLOG_VLLM_VOCAB_SIZE", "4096")),
            hold_s=float(hold) if hold else None,
            json_schema=react_schema(tools) if tools else None,
        )
    if kind == "openai":
        ids = os.environ.get("AGENTLOG_ENGINE_IDS", "body")
        if ids not in ("body", "headers"):
            raise ValueError(f"AGENTLOG_ENGINE_IDS must be body or headers, got {ids!r}")
        temperature = os.environ.get("AGENTLOG_ENGINE_TEMPERATURE")
        return ChatEngine(
            url,
            engine_id=engine_id,
            model=os.environ.get("AGENTLOG_ENGINE_MODEL", "sim"),
            api_key=os.environ.get("AGENTLOG_ENGINE_API_KEY") or None,
            ids_in_body=ids == "body",
            temperature=float(temperature) if temperature else None,
        )
    raise ValueError(f"unknown engine kind {kind!r}; kinds are {', '.join(ENGINE_KINDS)}")
