"""Inference engines behind one interface (``Engine``): ``HttpEngine`` for the simulated engine's server
(``sim_server``), ``vllm_http`` and ``vllm`` for a real vLLM server; ``factory`` picks one.
"""

from workers.engines.base import Completion, Engine, EngineError, EngineUnavailable
from workers.engines.http import HttpEngine

__all__ = ["Completion", "Engine", "EngineError", "EngineUnavailable", "HttpEngine"]
