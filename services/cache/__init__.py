"""The cache manager's pure core: session views, tool latency model, survival-score policy."""

from services.cache.latency import ToolLatencyModel
from services.cache.policy import CacheDecision, CachePolicy, Delays, MemoryState, PolicyConfig
from services.cache.view import CacheViewBuilder, Phase, SessionView

__all__ = [
    "CacheDecision",
    "CachePolicy",
    "CacheViewBuilder",
    "Delays",
    "MemoryState",
    "Phase",
    "PolicyConfig",
    "SessionView",
    "ToolLatencyModel",
]
