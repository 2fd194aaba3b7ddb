"""Inference engines behind one interface (``Engine``): the simulated engine, and vLLM later."""

from workers.engines.base import Completion, Engine, EngineError, EngineUnavailable
from workers.engines.http import HttpEngine

__all__ = ["Completion", "Engine", "EngineError", "EngineUnavailable", "HttpEngine"]
