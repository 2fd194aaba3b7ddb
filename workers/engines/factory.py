"""Which engine client a worker uses, from its command line and environment.

``AGENTLOG_ENGINE_KIND``: ``sim`` (default; agentlog's simulated engine) or ``vllm``. For vLLM:
``AGENTLOG_VLLM_MODEL`` (served model name, default ``tiny``), ``AGENTLOG_VLLM_VOCAB_SIZE``
(default 4096), ``AGENTLOG_VLLM_HOLD_S`` (grace pin after each call, default none),
``AGENTLOG_VLLM_REACT_TOOLS`` (comma-separated: constrain replies to ``react``'s JSON for
these tools).
"""

from __future__ import annotations

import os

from workers.engines.base import Engine
from workers.engines.http import HttpEngine
from workers.engines.vllm_http import VllmEngine, react_schema

__all__ = ["ENGINE_KINDS", "create_engine"]

ENGINE_KINDS = ("sim", "vllm")


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
    raise ValueError(f"unknown engine kind {kind!r}; kinds are {', '.join(ENGINE_KINDS)}")
